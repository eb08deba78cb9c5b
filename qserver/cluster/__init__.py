"""The node in its cluster: queue pairs, the coordinator, the membership layer, relays."""
