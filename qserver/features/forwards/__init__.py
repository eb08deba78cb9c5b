"""Store-and-forward between clusters (seed 003): forwarders and the forward root."""
