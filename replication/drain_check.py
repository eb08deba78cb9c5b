"""Whether a node may be drained for maintenance and stopped (docs/OPERATIONS.md, "Rolling
upgrade"): a pure decision on the map's pairs, shared by the node that runs the drain
(qserver/api/drain_routes.py) and the client that drains a cluster of the previous release
by per-queue handoffs (client/maintenance.py).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple


class PairView(NamedTuple):
    name: str
    master: str
    replica: str | None
    in_sync: bool


def drain_refusals(node_id: str, pairs: Iterable[PairView], up: Collection[str],
                   maintenance: Collection[str] = ()) -> list[str]:
    """Why draining `node_id` and then stopping it would leave a queue without an in-sync copy,
    one line per queue (empty: it may go). `up`: the nodes the map holds up. A queue it masters
    needs its replica in sync on an up node not itself in maintenance (the handoff's target); a
    queue whose in-sync replica it holds needs its master up (else it holds the only in-sync copy)."""
    reasons = []
    for pair in sorted(pairs):
        if pair.master == node_id:
            if not pair.in_sync or pair.replica is None:
                reasons.append(f"{pair.name}: its replica on {pair.replica} is not in sync")
            elif pair.replica not in up:
                reasons.append(f"{pair.name}: its replica's node {pair.replica} is not up")
            elif pair.replica in maintenance:
                reasons.append(f"{pair.name}: its replica's node {pair.replica} is drained for maintenance")
        elif pair.replica == node_id and pair.in_sync and pair.master not in up:
            reasons.append(f"{pair.name}: {node_id} holds its only in-sync copy (its master's node "
                           f"{pair.master} is not up)")
    return reasons
