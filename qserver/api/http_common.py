"""What every REST handler shares: the node an application serves (NODE), the caller (principal),
the request's names, numbers and JSON body, paging, calls into the engine, and passing a request
on to the node that serves it.

Separate from the routes so that the features' handlers (qserver/features/*/api.py) use the same
parsing, envelopes and pass-on as the core routes without importing them (tests/test_layers.py:
features may import this module of the API room and auth, nothing else of it).
"""
from __future__ import annotations

import asyncio
import bisect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import yarl
from aiohttp import web

from qserver.api.auth import PASSED_ON_BY, SERVER_CONTROL_HEADERS, Principal, pass_on_headers
from qserver.core import commands as c
from qserver.core.engine import Engine
from qserver.http_errors import error_response
from qserver.services import NodeServices
from replication.cluster_map import CHANNEL_PREFIX
from replication.options import is_valid_queue_name, range_text
from wire import errors as e
from wire.errors import QueueError
from wire.signing import SIGNED_HEADERS

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NODE: web.AppKey[Any] = web.AppKey("node")       # the qserver.node.Node an application serves
ENGINE_ANSWER_GRACE_S = 30.0
# GET /v1/channels, /v1/macros, /v1/recipients: a client that does not page still gets them
# all up to this many.
NAMES_PAGE_DEFAULT = NAMES_PAGE_MAX = 1000


def principal(request: web.Request) -> Principal:
    return request["principal"]  # type: ignore[no-any-return]


def path_name(request: web.Request, key: str, what: str) -> str:
    """A name in the path (a queue's, a recipient's, a forward's): queue-name rules."""
    name = request.match_info[key]
    if not is_valid_queue_name(name):
        raise QueueError(e.E_INVALID_NAME, f"{what} names are 1-200 of A-Z a-z 0-9 . _ : - starting alphanumeric")
    return name


def queue_name(request: web.Request, privilege: str) -> str:
    name = path_name(request, "q", "queue")
    if name.startswith(CHANNEL_PREFIX):
        raise QueueError(e.E_RESERVED_NAME, f"{name} holds a channel's messages: use /v1/channels")
    principal(request).require(privilege, name)
    return name


async def json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise QueueError(e.E_BAD_JSON, "the body is not valid JSON") from None


def number_param(request: web.Request, name: str, default: float, low: float, high: float) -> float:
    raw = request.rel_url.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise QueueError(e.E_INVALID_OPTION, f"{name} must be a number") from None
    if not low <= value <= high or value != value:
        raise QueueError(e.E_INVALID_OPTION, range_text(name, low, high))
    return value


def message_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not raw.isdigit() or not 0 < int(raw) < 2**63:
        raise QueueError(e.E_INVALID_OPTION, "message ids are positive integers")
    return int(raw)


def receipt(request: web.Request) -> str:
    value = request.rel_url.query.get("receipt", "")
    if not value or len(value) > 64:
        raise QueueError(e.E_BAD_REQUEST, "the receipt query parameter is required")
    return value


async def call(engine: Engine | NodeServices, factory: Callable[[c.FutureReplier], c.Command],
               wait_s: float = 0.0, *, may_have_applied: bool = False) -> Any:
    try:
        return await asyncio.wait_for(engine.call(factory), wait_s + ENGINE_ANSWER_GRACE_S)
    except TimeoutError:
        raise QueueError(e.E_TIMEOUT, "the node did not answer in time", outcome_unknown=may_have_applied) from None


def page_params(request: web.Request, default: int, maximum: int) -> tuple[int, str]:
    """A listing's `limit` (an integer, 1..maximum) and `after` cursor (a name: the previous
    page's `next`); anything else is refused with E_INVALID_OPTION, never read as the start."""
    raw = request.rel_url.query.get("limit")
    limit = default
    if raw:
        if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= maximum):
            raise QueueError(e.E_INVALID_OPTION, f"limit must be an integer between 1 and {maximum}")
        limit = int(raw)
    after = request.rel_url.query.get("after", "")
    if after and not is_valid_queue_name(after):
        raise QueueError(e.E_INVALID_OPTION, "after is the `next` of the previous page: a name")
    return limit, after


def page_of(names: Sequence[str], after: str, limit: int, visible: Callable[[str], bool]) -> tuple[list[str], str | None]:
    """The first `limit` visible names after `after` in `names` (sorted), and the cursor of the
    next page (this page's last name, None when no visible name follows): the cost is the
    page's (and the invisible names passed over), not the list's."""
    page: list[str] = []
    for position in range(bisect.bisect_right(names, after) if after else 0, len(names)):
        name = names[position]
        if not visible(name):
            continue
        if len(page) == limit:
            return page, page[-1]
        page.append(name)
    return page, None


# --- the coordinator's actions, on the engine's task (docs/PROTOCOL.md, "Moves, drains and rebalancing")
CLUSTER_ACTION_TIMEOUT_S = 30.0


async def in_engine(engine: Engine, action: Callable[[Callable[[Any], None]], None]) -> Any:
    """Run action(finish) on the engine's task; finish(result) or finish(QueueError)."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def finish(result: Any) -> None:
        if future.done():
            return
        if isinstance(result, QueueError):
            future.set_exception(result)
        else:
            future.set_result(result)
    engine.invoke(lambda now_ms: action(finish))
    try:
        return await asyncio.wait_for(future, CLUSTER_ACTION_TIMEOUT_S)
    except TimeoutError:
        raise QueueError(e.E_TIMEOUT, "the cluster did not finish in time", outcome_unknown=True) from None


def coordinator_of(request: web.Request) -> Any:
    coordinator = request.app[NODE].engine.coordinator
    if coordinator is None:
        raise QueueError(e.E_INVALID_OPTION, "this node is not part of a cluster")
    return coordinator


def cluster_entry(request: web.Request, name: str) -> Any:
    entry = request.app[NODE].engine.pairs.view.entry(name)
    if entry is None:
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    return entry


async def propose(request: web.Request, command: Any) -> Any:
    """Propose a map command through the membership layer; its (first) Outcome once applied here."""
    coordinator = coordinator_of(request)
    outcomes = await in_engine(request.app[NODE].engine,
                               lambda finish: coordinator.propose_checked(command, finish, lambda o: o))
    return outcomes[0]


# --- passing a request on to the node that serves it (docs/PROTOCOL.md, "Signing") ----------
PLACEMENT = "X-Placement"
PASS_ON_TIMEOUT_S = 60.0
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# What a node does not pass on: the client's signature (the envelope replaces it) and the
# server-control headers (the passing node sets its own).
NOT_PASSED_ON = frozenset(name.lower() for name in (*SIGNED_HEADERS, *SERVER_CONTROL_HEADERS))
MAP_CATCH_UP_S = 3.0
MAP_VERSION = "X-Map-Version"      # the passing node's map version: see until_map_version


async def pass_on_to_master(request: web.Request, node: Any, target: str | None = None,
                            placement: tuple[str, str] | None = None) -> web.Response | None:
    """Any node answers any request (docs/PROTOCOL.md, "Signing"): one that is not the queue's
    master passes the request on to the master in a node-authenticated envelope (pass_on_to)."""
    name = request.match_info.get("q")
    if name is None or PASSED_ON_BY in request.headers or not is_valid_queue_name(name):
        return None
    entry = node.engine.pairs.view.entry(name)
    master = target or (entry.master if entry is not None else None)
    if master is None or master == node.config.node_id:
        return None
    return await pass_on_to(request, node, master, placement)


async def pass_on_to(request: web.Request, node: Any, target: str, placement: tuple[str, str] | None = None,
                     extra: Mapping[str, str] | None = None) -> web.Response:
    """Pass the request on to node `target`, once (the X-Forwarded-By header), in an envelope
    signed with the cluster secret that names this node, `target` and the principal this node
    authenticated (qserver/api/auth.py, pass_on_headers; docs/PROTOCOL.md, "Signing"): the client's
    own signature is not passed on, so it never holds at a node it did not address, and the
    target looks the principal up in its own registry."""
    master = target
    name = request.match_info.get("q", "")
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | NOT_PASSED_ON}
    membership = node.engine.pairs.view.membership
    if membership is not None:
        headers[MAP_VERSION] = str(membership.cluster_map.version)
    headers.update(extra or {})
    if placement is not None:     # the passing node placed a new queue: its choice stands
        headers[PLACEMENT] = ",".join(placement)
    body = await request.read()
    # Exactly the path this node saw: a URL built from a string is normalized (yarl decodes
    # %3A in `channel%3Aname` to `:`), and the target would check another path.
    headers.update(pass_on_headers(node.auth.cluster_secret, node.config.node_id, master, principal(request).client_id,
                                 request.method, request.raw_path.split("?", 1)[0], request.rel_url.query.items(),
                                 headers, body))
    url = yarl.URL(node.engine.pairs.view.url(master) + request.raw_path, encoded=True)
    try:
        async with node.http_session().request(request.method, url, data=body, headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=PASS_ON_TIMEOUT_S)) as answer:
            body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        if request.method in ("PUT", "DELETE") and request.path == f"/v1/queues/{name}" and 200 <= answer.status < 300:
            await until_local_map_has(node, name, present=request.method == "PUT")
        return web.Response(status=answer.status, body=body, headers=kept)
    except (aiohttp.ClientError, TimeoutError):
        return error_response(QueueError(e.E_QUEUE_UNAVAILABLE, f"the master {master} of {name} cannot be reached"))


async def until_map_version(node: Any, version_text: str | None) -> None:
    """A request passed on by a node whose map was at version V waits (at most MAP_CATCH_UP_S)
    until this node's map has applied V too: it finds what the passing node saw, a channel or
    queue just created through it (a durable subscription's drop answered E_UNKNOWN_CHANNEL
    at a master whose map was a command behind)."""
    membership = node.engine.pairs.view.membership
    if membership is None or version_text is None or not version_text.isdigit():
        return
    wanted = int(version_text)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + MAP_CATCH_UP_S
    while membership.cluster_map.version < wanted and loop.time() < deadline:
        await asyncio.sleep(0.01)


async def until_local_map_has(node: Any, name: str, *, present: bool) -> None:
    """Read your writes: a queue created (or deleted) through this node is known here before
    the answer goes back, so the client's next request here finds it."""
    deadline = asyncio.get_running_loop().time() + MAP_CATCH_UP_S
    while (node.engine.pairs.view.entry(name) is not None) != present \
            and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
