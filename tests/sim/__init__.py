"""Simulations of the cluster on one thread and virtual time (see each module)."""
from __future__ import annotations

import os


def hash_seed() -> str:
    """How to get this process's string hashing back, which orders some set iterations and so a
    simulation's interleavings: scripts/test fixes PYTHONHASHSEED and prints it."""
    value = os.environ.get("PYTHONHASHSEED")
    return f"PYTHONHASHSEED={value}" if value else "(PYTHONHASHSEED unset: run through scripts/test to replay)"
