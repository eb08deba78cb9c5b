"""Broken invariants: programmer errors, never bad input.

Raised instead of `assert` (which `python -O` strips); the node lets it crash the process and
restarts from what is durable (STYLE.md "three kinds of failure"). The pure invariant checkers
of the replication release (acknowledged never lost, one master per epoch, ...) live here too,
so the simulator, the chaos runner and the audit share them.
"""
from __future__ import annotations


class InvariantViolation(Exception):
    """A state that correct code can never reach."""
