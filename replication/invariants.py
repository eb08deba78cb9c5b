"""Broken invariants: programmer errors, never bad input.

Raised instead of `assert` (which `python -O` strips); the node lets it crash the process and
restarts from what is durable (STYLE.md "three kinds of failure"). The pure invariant checkers
of the replication release (acknowledged never lost, one master per epoch, ...) live here too,
so the simulator, the chaos runner and the audit share them.
"""
from __future__ import annotations

from collections.abc import Iterable


class InvariantViolation(Exception):
    """A state that correct code can never reach."""


# --- checkers shared by the simulator, the chaos runner and the audit ----------------------
def lost_acknowledged(acknowledged: Iterable[int], still_held: Iterable[int], consumed: Iterable[int]) -> set[int]:
    """Messages whose enqueue a producer saw acknowledged but which are neither held by the
    queue nor were consumed (acked by a consumer): lost (Jepsen's total-queue "lost")."""
    return set(acknowledged) - set(still_held) - set(consumed)


def seen_but_uncommitted(delivered: Iterable[int], surviving_enqueues: Iterable[int]) -> set[int]:
    """Messages a consumer received whose enqueue is not in the surviving history: they were
    visible before they were committed (DESIGN.md 3.2)."""
    return set(delivered) - set(surviving_enqueues)


def history_disagreements(master_rows: Iterable[tuple[int, bytes]],
                          replica_rows: Iterable[tuple[int, bytes]]) -> list[int]:
    """Ordering indices at which both members hold an operation and the encoded operations
    differ: the members' journals must agree op for op within an epoch."""
    replica = dict(replica_rows)
    return sorted(order for order, encoded in master_rows if order in replica and replica[order] != encoded)


def epochs_with_two_masters(observations: Iterable[tuple[int, str]]) -> dict[int, set[str]]:
    """(epoch, node that acted as master) observations -> the epochs with more than one master."""
    masters: dict[int, set[str]] = {}
    for epoch, node in observations:
        masters.setdefault(epoch, set()).add(node)
    return {epoch: nodes for epoch, nodes in masters.items() if len(nodes) > 1}
