"""Publish/subscribe channels (seed 002)."""
