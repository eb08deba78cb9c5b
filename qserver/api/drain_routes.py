"""REST routes of the maintenance drain (docs/PROTOCOL.md, "Maintenance drain"; docs/OPERATIONS.md,
"Rolling upgrade"): POST /v1/cluster/nodes/{id}/maintenance hands the node's masters off to their
in-sync replicas and waits until it masters none; DELETE undoes it. Its replicas stay where they
are (the node comes back within a minute and catches up by log), unlike the decommissioning drain
of cluster_routes.py (POST .../drain: map state `draining`, replicas move away).

Nothing here changes the map beyond per-queue handoffs, which a 0.1.0 node applies and answers
as always: the drain works while the membership leader or the drained node runs 0.1.0, at
feature level 1. The mark "in maintenance" is node-local (Coordinator.maintenance): the node
that takes the request records it and passes it on to every other node; a node of this release
records it too, a 0.1.0 node answers 404 and is left out (the answer says which nodes hold it).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
from aiohttp import web

from qserver.api.auth import PASSED_ON_BY, pass_on_headers
from qserver.api.http_common import NODE, coordinator_of, in_engine, json_body, pass_on_to, principal
from replication.cluster_map import NodeState
from wire import errors as e
from wire.errors import QueueError

DRAIN_TIMEOUT_S_DEFAULT = 60.0
DRAIN_TIMEOUT_S_MAX = 3600.0
DRAIN_HANDOFFS_AT_ONCE = 8          # handoffs asked for at once (each parks its queue's writes a moment)
DRAIN_RETRY_S = 0.5                 # a handoff refused (its replica lagging a moment) is asked again after this
NODE_CALL_TIMEOUT_S = 15.0          # one node-to-node call: a handoff is over in HANDOFF_TIMEOUT_MS twice at most


def _known_node(request: web.Request) -> str:
    coordinator = coordinator_of(request)
    node_id = request.match_info["id"]
    nodes = coordinator.membership.cluster_map.nodes
    if node_id not in nodes or nodes[node_id].state is NodeState.REMOVED:
        known = ", ".join(sorted(n for n, entry in nodes.items() if entry.state is not NodeState.REMOVED)) or "none"
        raise QueueError(e.E_INVALID_OPTION, f"no node named {node_id!r} in the cluster (nodes: {known})")
    return node_id


async def _mark(request: web.Request, node_id: str, marked: bool) -> dict[str, bool | None]:
    """Record (or forget) `node_id` in maintenance here and at every other node the map holds up
    or draining (a down node forgot it anyway: the mark is not kept across a restart); per node,
    whether it holds the mark now (None: a 0.1.0 node, or one not reached)."""
    node = request.app[NODE]
    coordinator = coordinator_of(request)

    def apply(finish: Any) -> None:
        (coordinator.maintenance.add if marked else coordinator.maintenance.discard)(node_id)
        finish(None)
    await in_engine(node.engine, apply)
    others = sorted(n for n, entry in coordinator.membership.cluster_map.nodes.items()
                    if entry.state in (NodeState.UP, NodeState.DRAINING) and n != node.config.node_id)
    answers = await asyncio.gather(*(pass_on_to(request, node, other) for other in others))
    held: dict[str, bool | None] = {node.config.node_id: marked}
    for other, answer in zip(others, answers, strict=True):
        held[other] = marked if answer.status == 200 else None
    return held


async def _hand_off(request: web.Request, name: str, master: str) -> dict[str, Any]:
    """One handoff of queue `name` by its master `master` (this node or another, of either
    release: the queue's REST handoff, node-authenticated as pass_on_to does); its answer."""
    node = request.app[NODE]
    if master == node.config.node_id:
        coordinator = coordinator_of(request)
        return dict(await in_engine(node.engine, lambda finish: coordinator.handoff(name, "master", finish)))
    body = json.dumps({"initiator": "master"}).encode()
    path = "/v1/queues/" + quote(name, safe="") + "/handoff"
    headers = {"Content-Type": "application/json"}
    headers.update(pass_on_headers(node.auth.cluster_secret, node.config.node_id, master,
                                   principal(request).client_id, "POST", path, [], headers, body))
    url = yarl.URL(node.engine.pairs.view.url(master) + path, encoded=True)
    try:
        async with node.http_session().post(url, data=body, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=NODE_CALL_TIMEOUT_S)) as answer:
            document = json.loads(await answer.read() or b"{}")
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        raise QueueError(e.E_QUEUE_UNAVAILABLE, f"the master {master} of {name} did not answer: {error}") from None
    if answer.status != 200:
        raise QueueError(e.E_HANDOFF_REFUSED, str(document.get("message") or document))
    return dict(document)


async def drain_for_maintenance(request: web.Request) -> web.Response:
    """Hand off every master of the node to its in-sync replica, until the map shows it master
    of none (or `timeout_s`): refused first (E_DRAIN_REFUSED, naming the queues) when that, or
    stopping the node after, would leave a queue without an in-sync copy."""
    principal(request).require("admin", "*")
    node = request.app[NODE]
    coordinator = coordinator_of(request)
    node_id = _known_node(request)
    if PASSED_ON_BY in request.headers:        # another node took the request: only the mark is asked of this one
        await in_engine(node.engine, lambda finish: finish(coordinator.maintenance.add(node_id)))
        return web.json_response({"node": node_id, "marked": True})
    body = await json_body(request)
    timeout_s = body.get("timeout_s", DRAIN_TIMEOUT_S_DEFAULT) if isinstance(body, dict) else None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
            or not 0 < timeout_s <= DRAIN_TIMEOUT_S_MAX:
        raise QueueError(e.E_INVALID_OPTION, f"timeout_s is a number of seconds in (0, {DRAIN_TIMEOUT_S_MAX:g}]")
    refusals = coordinator.drain_refusals(node_id)
    if refusals:
        raise QueueError(e.E_DRAIN_REFUSED, f"draining {node_id} would leave {len(refusals)} queue(s) without an "
                                            "in-sync copy: " + "; ".join(refusals))
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    marks = await _mark(request, node_id, True)
    handoffs: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    gate = asyncio.Semaphore(DRAIN_HANDOFFS_AT_ONCE)

    async def one(name: str) -> None:
        async with gate:
            entry = coordinator.membership.cluster_map.queues.get(name)
            if entry is None or entry.master != node_id:
                return
            try:
                answer = await _hand_off(request, name, node_id)
            except QueueError as error:
                refused[name] = error.message
                return
            refused.pop(name, None)
            handoffs.append({"queue": name, "from": node_id, "to": answer.get("master"),
                             "epoch": answer.get("epoch"), "pause_ms": answer.get("pause_ms")})
    while (left := coordinator.masters_of(node_id)) and loop.time() < deadline:
        await asyncio.gather(*(one(name) for name in left))
        if coordinator.masters_of(node_id):
            await asyncio.sleep(DRAIN_RETRY_S)
    left = coordinator.masters_of(node_id)
    if left:
        raise QueueError(e.E_TIMEOUT, f"{node_id} still masters {len(left)} queue(s) after {timeout_s:g} s: "
                         + "; ".join(f"{name} ({refused.get(name, 'not handed off yet')})" for name in left)
                         + f". It stays in maintenance: ask again, or `qctl node undrain {node_id}`")
    pauses = [h["pause_ms"] for h in handoffs if isinstance(h.get("pause_ms"), int | float)]
    return web.json_response({"node": node_id, "masters": 0, "handoffs": handoffs,
                              "longest_pause_ms": max(pauses, default=None), "marked": marks,
                              "took_ms": round((loop.time() - started) * 1000)})


async def undrain_from_maintenance(request: web.Request) -> web.Response:
    """The node is no longer in maintenance: forgotten everywhere; a node the map holds
    `draining` (the decommissioning drain) is set up as well, so one undrain undoes either."""
    principal(request).require("admin", "*")
    node = request.app[NODE]
    coordinator = coordinator_of(request)
    node_id = _known_node(request)
    if PASSED_ON_BY in request.headers:
        await in_engine(node.engine, lambda finish: finish(coordinator.maintenance.discard(node_id)))
        return web.json_response({"node": node_id, "marked": False})
    marks = await _mark(request, node_id, False)
    state = coordinator.membership.cluster_map.nodes[node_id].state
    if state is NodeState.DRAINING:
        await in_engine(node.engine, lambda finish: coordinator.undrain(node_id, finish))
        state = NodeState.UP
    return web.json_response({"node": node_id, "state": state.value, "marked": marks, "done": True})
