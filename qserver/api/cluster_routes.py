"""REST routes of the cluster: its map (GET /v1/cluster), handoffs, promotions, moves,
rebalancing, nodes joining, draining and leaving (docs/PROTOCOL.md, "Moves, drains and
rebalancing"), and the journal's export. A route that must run at a queue's master passes the
request on to it (http_common.pass_on_to).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from qserver.api.auth import PASSED_ON_BY
from qserver.api.http_common import (
    MAP_CATCH_UP_S,
    NODE,
    cluster_entry,
    coordinator_of,
    in_engine,
    json_body,
    pass_on_to,
    principal,
    propose,
    queue_name,
)
from replication.cluster_map import AddNode, ChangePair, NodeState, Reason, SetNodeState, astuple
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError


async def cluster(request: web.Request) -> web.Response:
    """The cluster map as this node knows it (the replicated map in a cluster), with the lag of
    the queues mastered here. With `summary=1`: counts instead of entries (ClusterMap.summary),
    at the cost of the nodes, not of the map (`qctl status` on a large map)."""
    node = request.app[NODE]
    who = principal(request)
    engine = node.engine
    summary = request.rel_url.query.get("summary", "0")
    if summary not in ("0", "1"):
        raise QueueError(e.E_INVALID_OPTION, "summary is 0 or 1")
    wanted = request.rel_url.query.getall("queue", [])
    if wanted:
        return web.json_response(_placement_of(node, who, wanted))
    if engine.coordinator is not None and summary == "1":
        coordinator = engine.coordinator
        membership = coordinator.membership
        # Coordinator.status's fields, without its whole map (ClusterMap.to_json).
        answer = {**membership.cluster_map.summary(), "node": node.config.node_id, "leader": membership.leader_id(),
                  "term": membership.term(),
                  "lease_remaining_ms": coordinator.lease.remaining_ms(coordinator.monotonic_ms()),
                  "failovers_proposed": coordinator.failovers, "membership": membership.status()}
        answer["out_of_sync"] = [name for name in answer["out_of_sync"] if who.may_see(name)]
        return web.json_response(answer)
    if summary == "1":
        return web.json_response({"node": node.config.node_id, "leader": None,
                                  "nodes": [{"id": node.config.node_id, "url": node.url, "state": "up"}],
                                  "counts": {"queues": len(engine.cores)}})
    if engine.coordinator is not None:
        status = engine.coordinator.status()
        status["queues"] = {name: entry for name, entry in status["queues"].items() if who.may_see(name)}
        status["macros"] = {name: macro for name, macro in status["macros"].items() if who.may_see(name)}
        for name, entry in status["queues"].items():
            role = engine.pairs.masters.get(name)
            if role is not None:
                entry["lag"] = role.last_order - role.replica_durable
        return web.json_response(status)
    else:
        nodes = [{"id": node.config.node_id, "url": node.url, "state": "up"}]
        queues = {name: {"master": node.config.node_id, "replica": None, "epoch": core.record.epoch}
                  for name, core in node.engine.cores.items() if who.may_see(name)}
    return web.json_response({"node": node.config.node_id, "nodes": nodes, "leader": None, "queues": queues})


PLACEMENT_QUEUES_MAX = 100     # names one GET /v1/cluster?queue=... may ask about


def _placement_of(node: Any, who: Any, wanted: list[str]) -> dict[str, Any]:
    """GET /v1/cluster?queue=A&queue=B: the map's nodes and version with only the entries of
    the queues (and macro queues) named, at the cost of the names, not of the map: what a
    client following a failover of its queues reads (issue 31; a map of 10,000 queues is
    megabytes). A dead-letter queue's name gives its queue's entry."""
    if len(wanted) > PLACEMENT_QUEUES_MAX:
        raise QueueError(e.E_INVALID_OPTION, f"at most {PLACEMENT_QUEUES_MAX} queue names at once")
    for name in wanted:
        if not is_valid_queue_name(name):
            raise QueueError(e.E_INVALID_OPTION, f"{name!r} is not a queue name")
    names = sorted({name.removesuffix(DEAD_LETTER_SUFFIX) for name in wanted if who.may_see(name)})
    engine = node.engine
    if engine.coordinator is None:
        entries = {name: {"master": node.config.node_id, "replica": None, "epoch": engine.cores[name].record.epoch}
                   for name in names if name in engine.cores}
        return {"node": node.config.node_id, "leader": None, "version": 0, "macros": {}, "queues": entries,
                "nodes": [{"id": node.config.node_id, "url": node.url, "state": "up"}]}
    membership = engine.coordinator.membership
    cluster = membership.cluster_map
    return {"node": node.config.node_id, "leader": membership.leader_id(), "version": cluster.version,
            "nodes": [{"id": n.node_id, "url": n.url, "state": n.state.value, "voter": n.voter}
                      for n in sorted(cluster.nodes.values(), key=lambda n: n.node_id)],
            "queues": {name: cluster.queues[name].to_json() for name in names if name in cluster.queues},
            "macros": {name: cluster.macros[name].to_json() for name in names if name in cluster.macros}}


async def export_journal(request: web.Request) -> web.Response:
    """Export this node's journal to Parquet now (docs/AUDIT.md), unsealed tail included."""
    principal(request).require("admin", "*")
    return web.json_response(await request.app[NODE].export_journal(force=True))


async def handoff(request: web.Request) -> web.Response:
    """Swap master and replica (seed 004 FIG. 23-25), asked by either member."""
    name = queue_name(request, "admin")
    coordinator = coordinator_of(request)
    body = await json_body(request)
    initiator = body.get("initiator", "master") if isinstance(body, dict) else None
    if initiator not in ("master", "replica"):
        raise QueueError(e.E_INVALID_OPTION, "initiator is master or replica")
    entry = cluster_entry(request, name)
    node = request.app[NODE]
    target = entry.master if initiator == "master" else entry.replica
    if target != node.config.node_id and PASSED_ON_BY not in request.headers:
        return await pass_on_to(request, node, target)
    result = await in_engine(node.engine, lambda finish: coordinator.handoff(name, initiator, finish))
    return web.json_response(result)


async def promote(request: web.Request) -> web.Response:
    """Promote the replica of a queue whose master is lost; `unclean` when it is not known to be
    in sync (recorded in the map and the journals: the audit flags it)."""
    name = queue_name(request, "admin")
    coordinator = coordinator_of(request)
    body = await json_body(request)
    unclean = bool(body.get("unclean")) if isinstance(body, dict) else False
    entry = cluster_entry(request, name)
    if entry.in_sync:
        raise QueueError(e.E_INVALID_OPTION, "the replica is in sync: the membership layer fails over by itself, "
                                             "or use handoff")
    if not unclean:
        raise QueueError(e.E_INVALID_OPTION, "the replica is out of sync: promoting it may lose acknowledged "
                                             "messages; say unclean to do it anyway")
    pair = entry.pair          # the entry itself changes once the local map applies the change
    change = ChangePair(name, astuple(pair), (pair.epoch + 1, pair.replica, pair.master, False), Reason.UNCLEAN.value)
    outcomes = await in_engine(request.app[NODE].engine, lambda finish: coordinator.propose_checked(
        change, finish, lambda o: o))
    if not outcomes[0].applied:
        raise QueueError(e.E_HANDOFF_REFUSED, f"the map changed first: {outcomes[0].reason}")
    return web.json_response({"queue": name, "master": pair.replica, "epoch": pair.epoch + 1, "unclean": True})


MOVE_SYNC_WAIT_S = 30.0           # a new member's state transfer, before a handoff makes it master
HAND_OVER_WAIT_S = 12.0           # the master's node hands off (its HANDOFF_TIMEOUT_MS, twice, and a margin)
HAND_OVER_ORDER_EVERY_S = 1.0     # a handoff refused meanwhile (the replica's lag) is asked for again
REBALANCE_SYNC_WAIT_S = 20.0      # replicas moved by a rebalance, before the masters hand over
MAP_POLL_S = 0.05


async def move(request: web.Request) -> web.Response:
    """Put one member of a queue's pair on node `to`: afterwards `to` holds the member asked
    for. A replica moves by state transfer to the new node (the old one is dropped). A master
    moves by a handoff to its replica, that move of the old master's member, a wait until the
    new member is in sync, and a handoff to it: the pair ends as (to, the old replica). When
    `to` holds the other member the two swap by a handoff; when it holds this one, nothing
    changes ("already_there")."""
    name = queue_name(request, "admin")
    coordinator = coordinator_of(request)
    member, target = move_request(await json_body(request))
    node = request.app[NODE]
    entry = cluster_entry(request, name)
    if target not in coordinator.membership.cluster_map.nodes:
        known = ", ".join(sorted(coordinator.membership.cluster_map.nodes))
        raise QueueError(e.E_INVALID_OPTION, f"no node named {target!r} in the cluster (nodes: {known})")
    if target == (entry.master if member == "master" else entry.replica):
        return web.json_response(move_answer(entry, "already_there"))
    state = coordinator.membership.cluster_map.nodes[target].state
    if state is not NodeState.UP:
        raise QueueError(e.E_INVALID_OPTION, f"node {target} is {state.value}: members move only to up nodes")
    swap = target in (entry.master, entry.replica)
    if (member == "master" or swap) and entry.master != node.config.node_id and PASSED_ON_BY not in request.headers:
        answer = await pass_on_to(request, node, entry.master)        # its handoffs start at the master
        await until_local_epoch(node, name, answer)
        return answer
    deadline = asyncio.get_running_loop().time() + MOVE_SYNC_WAIT_S
    if swap:
        await hand_off_here(request, name, deadline)
        how = "handed_off"
    elif member == "replica":
        await replace_replica(request, name, target)
        how = "moved"
    else:
        await hand_off_here(request, name, deadline)
        await replace_replica(request, name, target)
        await until_in_sync(request, name, target, deadline)
        await hand_over(request, name, target)
        how = "moved_and_handed_off"
    return web.json_response(move_answer(cluster_entry(request, name), how))


async def until_local_epoch(node: Any, name: str, answer: web.Response) -> None:
    """Read your writes: the pair a move passed on to the master answers with is known here
    before the answer goes back (MAP_CATCH_UP_S at most), so the client's next request here
    starts from it."""
    try:
        epoch = int(json.loads(answer.body)["epoch"]) if answer.status == 200 else 0  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError):
        return
    deadline = asyncio.get_running_loop().time() + MAP_CATCH_UP_S
    while asyncio.get_running_loop().time() < deadline:
        entry = node.engine.pairs.view.entry(name)
        if entry is None or entry.epoch >= epoch:
            return
        await asyncio.sleep(0.01)


def move_request(body: Any) -> tuple[str, str]:
    if not isinstance(body, dict) or body.get("member") not in ("master", "replica") or not isinstance(
            body.get("to"), str) or not body["to"]:
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"member": "master"|"replica", "to": NODE}')
    return body["member"], body["to"]


def move_answer(entry: Any, how: str) -> dict[str, Any]:
    return {"queue": entry.name, "master": entry.master, "replica": entry.replica, "epoch": entry.epoch,
            "in_sync": entry.in_sync, "how": how}


async def replace_replica(request: web.Request, name: str, target: str) -> None:
    """The pair's replica becomes a new, out-of-sync member on `target` (state transfer)."""
    coordinator = coordinator_of(request)
    pair = cluster_entry(request, name).pair      # the entry itself changes once the local map applies it
    change = ChangePair(name, astuple(pair), (pair.epoch + 1, pair.master, target, False), Reason.MOVE.value)
    outcomes = await in_engine(request.app[NODE].engine,
                               lambda finish: coordinator.propose_checked(change, finish, lambda o: o))
    if not outcomes[0].applied:
        raise QueueError(e.E_INVALID_OPTION, f"move refused: {outcomes[0].reason}")


async def hand_off_here(request: web.Request, name: str, deadline: float) -> None:
    """Hand off the queue this node masters, once its replica is in sync (until `deadline`)."""
    entry = cluster_entry(request, name)
    await until_in_sync(request, name, entry.replica, deadline)
    coordinator = coordinator_of(request)
    await in_engine(request.app[NODE].engine, lambda finish: coordinator.handoff(name, "master", finish))


async def until_in_sync(request: web.Request, name: str, replica: str, deadline: float) -> None:
    """Wait until this node's map shows `replica` in sync for the queue, or say why not."""
    loop = asyncio.get_running_loop()
    while True:
        entry = cluster_entry(request, name)
        if entry.replica != replica:
            raise QueueError(e.E_HANDOFF_REFUSED, f"the pair of {name} changed meanwhile: master {entry.master}, "
                                                  f"replica {entry.replica} (epoch {entry.epoch}, {entry.last_reason})")
        if entry.in_sync:
            return
        if loop.time() >= deadline:
            raise QueueError(e.E_TIMEOUT, f"{replica} holds the replica of {name} (master {entry.master}) but was "
                                          f"not in sync within {MOVE_SYNC_WAIT_S:g} s: a large queue's state "
                                          "transfer takes longer. Ask for the same move again once `qctl status` "
                                          "shows it in sync: it goes on from there")
        await asyncio.sleep(MAP_POLL_S)


async def hand_over(request: web.Request, name: str, target: str) -> None:
    """Have the queue's master (on any node) hand off to its in-sync replica `target`, until
    this node's map shows `target` master."""
    coordinator = coordinator_of(request)
    engine = request.app[NODE].engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HAND_OVER_WAIT_S
    next_order = loop.time()
    while True:
        entry = cluster_entry(request, name)
        if entry.master == target:
            return
        if entry.replica != target:
            raise QueueError(e.E_HANDOFF_REFUSED, f"the pair of {name} changed meanwhile: master {entry.master}, "
                                                  f"replica {entry.replica} (epoch {entry.epoch}, {entry.last_reason})")
        if loop.time() >= deadline:
            raise QueueError(e.E_TIMEOUT, f"{target} holds the in-sync replica of {name} but its master "
                                          f"{entry.master} did not hand off within {HAND_OVER_WAIT_S:g} s: "
                                          f"`qctl handoff {name}` asks it again")
        if loop.time() >= next_order:
            next_order = loop.time() + HAND_OVER_ORDER_EVERY_S
            await in_engine(engine, lambda finish: finish(coordinator.order_handoff(name)))
        await asyncio.sleep(MAP_POLL_S)


async def rebalance(request: web.Request) -> web.Response:
    """Spread members, then masters: replicas move onto up nodes that hold fewer members (a
    node back from a drain holds none), and once they are in sync (REBALANCE_SYNC_WAIT_S at
    most) the masters hand over so that they spread evenly."""
    principal(request).require("admin", "*")
    coordinator = coordinator_of(request)
    engine = request.app[NODE].engine
    moves = await in_engine(engine, coordinator.rebalance_members)
    catching_up = await until_moves_in_sync(request, moves)
    chosen = await in_engine(engine, lambda finish: finish(coordinator.rebalance()))
    return web.json_response({"moves": moves, "catching_up": catching_up, "handoffs": chosen})


async def until_moves_in_sync(request: web.Request, moves: list[dict[str, str]]) -> list[str]:
    """The moved queues whose new replica is not in sync after REBALANCE_SYNC_WAIT_S (a queue
    whose pair changed otherwise meanwhile is not waited for)."""
    view = request.app[NODE].engine.pairs.view
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REBALANCE_SYNC_WAIT_S

    def waiting() -> list[str]:
        return [move["queue"] for move in moves if (entry := view.entry(move["queue"])) is not None
                and entry.replica == move["to"] and not entry.in_sync]
    while (left := waiting()) and loop.time() < deadline:
        await asyncio.sleep(MAP_POLL_S)
    return left


async def add_node(request: web.Request) -> web.Response:
    principal(request).require("admin", "*")
    coordinator = coordinator_of(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not isinstance(body.get("url"), str):
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"id": NODE, "url": URL}')
    nodes = coordinator.membership.cluster_map.nodes
    known = body["id"] in nodes
    if known and nodes[body["id"]].state is NodeState.REMOVED:
        raise QueueError(e.E_INVALID_OPTION, f"node {body['id']} was removed for good: a removed node id is never "
                                             "reused (initialise the node again under another id)")
    url_changed = known and nodes[body["id"]].url != body["url"]
    if not known or url_changed:
        outcome = await propose(request, AddNode(body["id"], body["url"]))
        if not outcome.applied:
            raise QueueError(e.E_INVALID_OPTION, f"refused: {outcome.reason}")
        known = outcome.reason == "known"       # added elsewhere, and not yet applied here when asked
    # Adding a known node again leaves its state as it is: the answer says which (a draining
    # node stays draining; `undrain` is what makes it serve again).
    entry = coordinator.membership.cluster_map.nodes[body["id"]]     # applied here before the answer
    return web.json_response({"node": entry.node_id, "done": True, "known": known, "state": entry.state.value,
                              "url": entry.url, "url_changed": url_changed})


async def drain_node(request: web.Request) -> web.Response:
    principal(request).require("admin", "*")
    command = SetNodeState(request.match_info["id"], NodeState.DRAINING.value)
    return await node_command(request, coordinator_of(request), command)


async def undrain_node(request: web.Request) -> web.Response:
    """A draining node serves again (`qctl nodes undrain`): draining -> up."""
    principal(request).require("admin", "*")
    coordinator = coordinator_of(request)
    node_id = request.match_info["id"]
    return web.json_response(await in_engine(request.app[NODE].engine,
                                             lambda finish: coordinator.undrain(node_id, finish)))


async def remove_node(request: web.Request) -> web.Response:
    principal(request).require("admin", "*")
    command = SetNodeState(request.match_info["id"], NodeState.REMOVED.value)
    return await node_command(request, coordinator_of(request), command)


async def node_command(request: web.Request, coordinator: Any, command: Any) -> web.Response:
    outcome = await propose(request, command)
    if not outcome.applied:
        raise QueueError(e.E_INVALID_OPTION, f"refused: {outcome.reason}")
    return web.json_response({"node": outcome.name, "done": True})
