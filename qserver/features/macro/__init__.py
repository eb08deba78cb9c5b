"""Macro queues (seed 004): one name over member queues."""
