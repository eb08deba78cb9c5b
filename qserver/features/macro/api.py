"""Macro queues (seed 004) in the REST API: their definitions in the cluster map, and the look
at a queue's head that their consumer policies need.

A macro queue is one name over member queues, with a producer policy (which member an
enqueue goes to) and a consumer policy (which member a receive leases from). The definition
lives in the cluster map, so every node and every client routes the same way and it survives
any failover; the messages live in the members, each an ordinary queue with its own pair.
The policies run in the client library (`client/macro.py`), next to the map copy it already
keeps to send each queue's traffic to its master: a macro call costs no hop more than a call
on the member it lands in (docs/PROTOCOL.md, "Macro queues").
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.api.http_common import (
    NAMES_PAGE_DEFAULT,
    NAMES_PAGE_MAX,
    call,
    json_body,
    number_param,
    page_of,
    page_params,
    principal,
    propose,
    queue_name,
)
from qserver.core import commands as c
from qserver.services import SERVICES
from replication.cluster_map import (
    ClusterMap,
    ConsumerPolicy,
    CreateMacro,
    DeleteMacro,
    FastestBy,
    PutMacroMember,
    RemoveMacroMember,
    macro_policy_problem,
)
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError
from wire.versions import OLDEST_FEATURE_LEVEL, require_feature


def macro_name(request: web.Request) -> str:
    name = request.match_info["m"]
    if not is_valid_queue_name(name) or name.endswith(DEAD_LETTER_SUFFIX):
        raise QueueError(e.E_INVALID_NAME, "macro queue names are queue names (1-196 of A-Z a-z 0-9 . _ : -, "
                                           "starting alphanumeric)")
    principal(request).require("admin", name)
    return name


def _cluster_map(request: web.Request) -> ClusterMap:
    return request.app[SERVICES].require_cluster_map()


def describe(request: web.Request, name: str) -> dict[str, Any]:
    """The definition, with each member's pair as the map has it now."""
    cluster = _cluster_map(request)
    macro = cluster.macros.get(name)
    if macro is None:
        raise QueueError(e.E_UNKNOWN_MACRO, f"no macro queue named {name!r}")
    described = macro.to_json()
    for member in described["members"]:
        entry = cluster.queues.get(member["queue"])
        if entry is not None:
            member.update({"master": entry.master, "replica": entry.replica, "epoch": entry.epoch,
                           "in_sync": entry.in_sync})
    return described


async def _propose(request: web.Request, command: Any) -> Any:
    outcome = await propose(request, command)
    if not outcome.applied:
        kind = e.E_UNKNOWN_MACRO if outcome.reason == "no such macro queue" else e.E_MACRO_REFUSED
        raise QueueError(kind, f"{_attempt(command)}: {outcome.reason}")
    return outcome


def _attempt(command: Any) -> str:
    """What the caller asked for, in its words rather than the map command's name."""
    if isinstance(command, PutMacroMember):
        return f"cannot add queue {command.queue} to macro queue {command.name}"
    if isinstance(command, RemoveMacroMember):
        return f"cannot remove queue {command.queue} from macro queue {command.name}"
    verb = "delete" if isinstance(command, DeleteMacro) else "create"
    return f"cannot {verb} macro queue {command.name}"


def require_macro_features(cluster: ClusterMap, consumer: str) -> None:
    """A policy of a later release reaches the map only once every node knows it: release
    0.1.0 refuses `highest_priority` when it applies the map command, so proposing it earlier
    would split the nodes' maps. E_FEATURE_DISABLED below the feature's cluster level
    (wire/versions.py; docs/OPERATIONS.md, "The cluster feature level"). Whatever creates a
    macro queue calls this before it proposes."""
    if consumer == ConsumerPolicy.HIGHEST_PRIORITY:
        require_feature(getattr(cluster, "feature_level", OLDEST_FEATURE_LEVEL), "macro_highest_priority")


async def put_macro(request: web.Request) -> web.Response:
    name = macro_name(request)
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) - {"producer", "consumer", "fastest_by"}:
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"producer": ..., "consumer": ..., "fastest_by": ...}')
    command = CreateMacro(name, str(body.get("producer", "round_robin")), str(body.get("consumer", "prioritized")),
                          str(body.get("fastest_by", FastestBy.RESPONSE_TIME.value)))
    problem = macro_policy_problem(command.producer, command.consumer, command.fastest_by)
    if problem:
        raise QueueError(e.E_INVALID_OPTION, problem)
    require_macro_features(_cluster_map(request), command.consumer)
    if name in _cluster_map(request).queues:
        raise QueueError(e.E_MACRO_REFUSED, f"{name} is a queue")
    outcome = await _propose(request, command)
    return web.json_response(describe(request, name), status=201 if outcome.reason == "created" else 200)


async def list_macros(request: web.Request) -> web.Response:
    """The macro queues the caller may see, by name, a page at a time (`limit`, `after`,
    `next` as GET /v1/queues); only the page's macro queues are described."""
    who = principal(request)
    limit, after = page_params(request, NAMES_PAGE_DEFAULT, NAMES_PAGE_MAX)
    names, cursor = page_of(sorted(_cluster_map(request).macros), after, limit, who.may_see)
    return web.json_response({"macros": [describe(request, name) for name in names], "next": cursor})


async def get_macro(request: web.Request) -> web.Response:
    name = request.match_info["m"]
    if not principal(request).may_see(name):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {name}")
    return web.json_response(describe(request, name))


async def delete_macro(request: web.Request) -> web.Response:
    name = macro_name(request)
    await _propose(request, DeleteMacro(name))
    return web.json_response({"macro": name, "deleted": True})


async def put_member(request: web.Request) -> web.Response:
    name = macro_name(request)
    member = queue_name(request, "admin")
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) - {"priority", "weight"} \
            or not all(type(body.get(key, 1)) is int for key in ("priority", "weight")):
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"priority": 0-9, "weight": 1-100} (integers)')
    await _propose(request, PutMacroMember(name, member, body.get("priority", 0), body.get("weight", 1)))
    return web.json_response(describe(request, name))


async def remove_member(request: web.Request) -> web.Response:
    name = macro_name(request)
    member = queue_name(request, "admin")
    await _propose(request, RemoveMacroMember(name, member))
    return web.json_response(describe(request, name))


async def head(request: web.Request) -> web.Response:
    """The message a receive would lease next, leased by no one (200 `{"id", "priority",
    "enqueued_ms"}`), waiting up to `wait_s` for one (204 when none came)."""
    name = queue_name(request, "get")
    services = request.app[SERVICES]
    wait_s = number_param(request, "wait_s", 0.0, 0.0, services.config.receive_wait_max_s)
    found = await call(services, lambda r: c.Head(name, int(wait_s * 1000), r), wait_s)
    if not found:
        return web.Response(status=204)
    return web.json_response(found[0])


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/macros", list_macros)
    r.add_put("/v1/macros/{m}", put_macro)
    r.add_get("/v1/macros/{m}", get_macro)
    r.add_delete("/v1/macros/{m}", delete_macro)
    r.add_put("/v1/macros/{m}/members/{q}", put_member)
    r.add_delete("/v1/macros/{m}/members/{q}", remove_member)
    r.add_get("/v1/queues/{q}/head", head)
