"""The maintenance drain where the node asked runs the previous release (0.1.0 has no
/maintenance route, docs/OPERATIONS.md "Rolling upgrade"): the client drives it by per-queue
handoffs, which every release answers, after the same check the node makes
(replication/drain_check.py). No node is told of the maintenance: nothing stops a later handoff
or rebalance from giving the node a master again, so the roll stops it soon after.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from replication.drain_check import PairView, drain_refusals
from wire.errors import E_DRAIN_REFUSED, E_INVALID_OPTION, E_RESERVED_NAME, E_TIMEOUT, QueueError

if TYPE_CHECKING:
    from client.http import HttpClient

RETRY_S = 0.5       # a handoff refused a moment (its replica lagging) is asked again after this


def _masters_of(cluster: dict[str, Any], node_id: str, skipped: frozenset[str] | set[str] = frozenset()) -> list[str]:
    return sorted(name for name, entry in cluster.get("queues", {}).items()
                  if entry.get("master") == node_id and name not in skipped)


async def drain_by_handoffs(http: HttpClient, node_id: str, timeout_s: float) -> dict[str, Any]:
    """Hand off every queue `node_id` masters, until the map shows none (or `timeout_s`); the
    answer has the shape of the node's route's (POST /v1/cluster/nodes/{id}/maintenance)."""
    started = time.monotonic()
    cluster = await http.cluster()
    nodes = {n.get("id"): n.get("state") for n in cluster.get("nodes", [])}
    if nodes.get(node_id) in (None, "removed"):
        raise QueueError(E_INVALID_OPTION, f"no node named {node_id!r} in the cluster (nodes: "
                                           f"{', '.join(sorted(n for n in nodes if n)) or 'none'})")
    pairs = [PairView(name, e.get("master"), e.get("replica"), bool(e.get("in_sync")))
             for name, e in cluster.get("queues", {}).items()]
    refusals = drain_refusals(node_id, pairs, {n for n, state in nodes.items() if state == "up" and n})
    if refusals:
        raise QueueError(E_DRAIN_REFUSED, f"draining {node_id} would leave {len(refusals)} queue(s) without an "
                                          "in-sync copy: " + "; ".join(refusals))
    handoffs: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    # Queues no client may hand off (a channel's queue: E_RESERVED_NAME on every release) are
    # left to the node's orderly stop, which hands off every master it holds first.
    left_to_the_stop: set[str] = set()
    while (left := _masters_of(cluster, node_id, left_to_the_stop)) and time.monotonic() - started < timeout_s:
        for name in left:
            try:
                answer = await http.handoff(name)
            except QueueError as error:
                if error.code == E_RESERVED_NAME.code:
                    left_to_the_stop.add(name)
                    continue
                refused[name] = error.message
                continue
            refused.pop(name, None)
            handoffs.append({"queue": name, "from": node_id, "to": answer.get("master"),
                             "epoch": answer.get("epoch"), "pause_ms": answer.get("pause_ms")})
        cluster = await http.cluster()
        if _masters_of(cluster, node_id, left_to_the_stop):
            await asyncio.sleep(RETRY_S)
    left = _masters_of(cluster, node_id, left_to_the_stop)
    if left:
        raise QueueError(E_TIMEOUT, f"{node_id} still masters {len(left)} queue(s) after {timeout_s:g} s: "
                         + "; ".join(f"{name} ({refused.get(name, 'not handed off yet')})" for name in left))
    pauses = [h["pause_ms"] for h in handoffs if isinstance(h.get("pause_ms"), int | float)]
    return {"node": node_id, "masters": len(_masters_of(cluster, node_id)), "handoffs": handoffs,
            "left_to_the_stop": sorted(left_to_the_stop), "longest_pause_ms": max(pauses, default=None),
            "marked": {n: None for n, state in nodes.items() if n and state != "removed"},
            "took_ms": round((time.monotonic() - started) * 1000), "by_client_handoffs": True}


async def undrain_without_marks(http: HttpClient, node_id: str) -> dict[str, Any]:
    """The undrain where the node asked runs 0.1.0: a node the map holds draining is set up."""
    state = next((n.get("state") for n in (await http.cluster()).get("nodes", []) if n.get("id") == node_id), None)
    if state is None:
        raise QueueError(E_INVALID_OPTION, f"no node named {node_id!r} in the cluster")
    if state == "draining":
        state = (await http.undrain_node(node_id)).get("state", "up")
    return {"node": node_id, "state": state, "marked": {}, "done": True}
