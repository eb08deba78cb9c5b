"""The local cluster of real processes, the demo and their helpers."""
