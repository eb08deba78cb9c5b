"""The engine: the one task that owns every queue core of a node, its inbox and its commits."""
