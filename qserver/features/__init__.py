"""Features built on the queues: each reaches the node through qserver.services only."""
