"""Broken invariants: programmer errors, never bad input.

Raised instead of `assert` (which `python -O` strips); the node lets it crash the process and
restarts from what is durable (docs/ARCHITECTURE.md, "Conventions": three kinds of failure). The pure invariant checkers
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
    visible before they were committed (docs/ARCHITECTURE.md, Guarantee 2)."""
    return set(delivered) - set(surviving_enqueues)


def history_disagreements(master_rows: Iterable[tuple[int, int, bytes]],
                          replica_rows: Iterable[tuple[int, int, bytes]]) -> list[int]:
    """Ordering indices at which both members hold a log entry (first, last, encoded) and the
    entries differ, in their bytes or their bounds: the members' logs must agree entry for
    entry within an epoch (the replica logs what the master streamed)."""
    replica = {last: (first, encoded) for first, last, encoded in replica_rows}
    bounds = sorted((first, last) for last, (first, _) in replica.items())
    out = []
    for first, last, encoded in master_rows:
        if last in replica:
            if replica[last] != (first, encoded):
                out.append(last)
        elif any(other_first <= last and first <= other_last for other_first, other_last in bounds):
            out.append(last)     # overlaps an entry of the replica's with other bounds
    return sorted(out)


def epochs_with_two_masters(observations: Iterable[tuple[int, str]]) -> dict[int, set[str]]:
    """(epoch, node that acted as master) observations -> the epochs with more than one master."""
    masters: dict[int, set[str]] = {}
    for epoch, node in observations:
        masters.setdefault(epoch, set()).add(node)
    return {epoch: nodes for epoch, nodes in masters.items() if len(nodes) > 1}
