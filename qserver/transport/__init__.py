"""Links between nodes: the peer transport and TLS."""
