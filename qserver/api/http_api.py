"""The REST API (aiohttp) at the paths of docs/PROTOCOL.md, "REST".

Every handler authenticates (middleware), validates its input into a command, hands it to
the engine and shapes the answer. Foreign exceptions become catalog errors here and only
here; nothing a client sends can reach a core unvalidated.
"""
from __future__ import annotations

import asyncio
import base64
import bisect
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import yarl
from aiohttp import web

from qserver.api.auth import (
    FORWARDED_BY,
    SERVER_CONTROL_HEADERS,
    Principal,
    refused_ack_text,
    relay_headers,
    validate_grants,
)
from qserver.api.http_errors import error_response
from qserver.core import commands as c
from qserver.core.engine import TERMINAL_STATES, Engine
from qserver.features.redrive import redrive as redrive_dead_letters
from replication.cluster_map import CHANNEL_PREFIX, AddNode, ChangePair, NodeState, Reason, SetNodeState, astuple
from replication.options import (
    DEAD_LETTER_SUFFIX,
    DELAY_MAX_S,
    PRIORITY_DEFAULT,
    TTL_MAX_S,
    OptionError,
    checked_headers,
    is_valid_queue_name,
    parse_options,
    range_text,
    valid_dedupe_id,
)
from wire import errors as e
from wire.errors import QueueError
from wire.protocol import DeliveredMessage
from wire.signing import (
    SIGNED_HEADERS,
    audience_of,
    new_private_key,
    private_key_to_text,
    public_key_from_text,
    public_key_text,
)

log = logging.getLogger("qserver.http")
UNSIGNED_PATHS = frozenset({"/healthz", "/metrics", "/v1/peer"})   # peers authenticate with the cluster secret
ENGINE_ANSWER_GRACE_S = 30.0
STATUS_STATES = frozenset({"queued", "delayed", "delivered", "acked", "replied", "dead_lettered", "purged",
                           "expired"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NODE: web.AppKey[Any] = web.AppKey("node")       # the qserver.node.Node an application serves


PRIORITY_TEXTS = frozenset(str(p) for p in range(10))
QUEUES_PAGE_DEFAULT, QUEUES_PAGE_MAX = 100, 1000       # GET /v1/queues
# GET /v1/channels, /v1/macros, /v1/recipients: a client that does not page still gets them
# all up to this many.
NAMES_PAGE_DEFAULT = NAMES_PAGE_MAX = 1000


@web.middleware
async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Translate every failure into the error envelope, and authenticate signed routes."""
    node = request.app[NODE]
    try:
        if request.path not in UNSIGNED_PATHS:
            length = request.content_length
            if length is not None and length > node.config.body_bytes_max:
                raise QueueError(e.E_PAYLOAD_TOO_LARGE, f"body over {node.config.body_bytes_max} bytes")
            body = await request.read()
            raw_path = request.raw_path.split("?", 1)[0]
            if node.auth.node_id != node.config.node_id:
                node.auth.bind(node.config.node_id, own_addresses(node.config))
            who = node.auth.authenticate(request.method, raw_path, request.rel_url.query.items(), request.headers,
                                         body, secure=request.secure)
            request["principal"] = who
            if who.relayed_by is None:
                refuse_server_control_headers(request)
            else:
                await until_map_version(node, request.headers.get(MAP_VERSION))
        return await handler(request)
    except QueueError as error:
        if error.code == e.E_NOT_MASTER.code and node.engine.pairs.clustered:
            proxied = await proxy_to_master(request, node, getattr(error, "node", None),
                                            getattr(error, "placement", None))
            if proxied is not None:
                return proxied
        return error_response(error)
    except web.HTTPRequestEntityTooLarge:
        return error_response(QueueError(e.E_PAYLOAD_TOO_LARGE, f"body over {node.config.body_bytes_max} bytes"))
    except web.HTTPMethodNotAllowed:
        return error_response(QueueError(e.E_METHOD_NOT_ALLOWED))
    except web.HTTPNotFound:
        return error_response(QueueError(e.E_NOT_FOUND, f"no route {request.method} {request.path}"))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        raise       # the client hung up before its answer: aiohttp's handler logs one line (http_errors.py)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(QueueError(e.E_INTERNAL))


PLACEMENT = "X-Placement"
PROXY_TIMEOUT_S = 60.0
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# What a relay does not pass on: the client's signature (the envelope replaces it) and the
# server-control headers (the passing node sets its own).
RELAY_DROPPED = frozenset(name.lower() for name in (*SIGNED_HEADERS, *SERVER_CONTROL_HEADERS))
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", "::", ""})


def own_addresses(config: Any) -> set[str]:
    """The addresses this node answers at, as audiences (wire/signing.py, audience_of): its
    URL (the advertised one, and its entry in [cluster.nodes]), its `client_addresses` and the
    host:port it listens on; listening on loopback or every address, also the loopback names
    with its port. A request signed for any other address is refused here (docs/PROTOCOL.md,
    "Signing")."""
    host, port = config.host, config.port
    addresses = {audience_of(url) for url in (config.own_url, config.url, config.cluster_nodes.get(config.node_id),
                                              *config.client_addresses) if url}
    addresses.add(f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}")
    if host in LOOPBACK_HOSTS:
        addresses.update({f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"})
        if host in ("0.0.0.0", "::", ""):
            addresses.add(f"{socket.gethostname()}:{port}")
    return {audience_of(address) for address in addresses}


def refuse_server_control_headers(request: web.Request) -> None:
    """The headers a node sets when it passes a request on change what the next node does (a
    new queue's placement, a purge of one member's copy only); only a relayed request, whose
    envelope signs them, may carry them (docs/PROTOCOL.md, "Signing")."""
    for name in SERVER_CONTROL_HEADERS:
        if name in request.headers:
            raise QueueError(e.E_BAD_REQUEST, f"{name} is set only by a node passing a request on (node-"
                                              "authenticated); a client may not send it (docs/PROTOCOL.md, "
                                              "\"Signing\")")


async def proxy_to_master(request: web.Request, node: Any, target: str | None = None,
                          placement: tuple[str, str] | None = None) -> web.Response | None:
    """Any node answers any request (docs/PROTOCOL.md, "Signing"): one that is not the queue's
    master passes the request on to the master in a node-authenticated envelope (proxy_to)."""
    name = request.match_info.get("q")
    if name is None or FORWARDED_BY in request.headers or not is_valid_queue_name(name):
        return None
    entry = node.engine.pairs.view.entry(name)
    master = target or (entry.master if entry is not None else None)
    if master is None or master == node.config.node_id:
        return None
    return await proxy_to(request, node, master, placement)


async def proxy_to(request: web.Request, node: Any, target: str, placement: tuple[str, str] | None = None,
                   extra: Mapping[str, str] | None = None) -> web.Response:
    """Pass the request on to node `target`, once (the X-Forwarded-By header), in an envelope
    signed with the cluster secret that names this node, `target` and the principal this node
    authenticated (qserver/api/auth.py, relay_headers; docs/PROTOCOL.md, "Signing"): the client's
    own signature is not passed on, so it never holds at a node it did not address, and the
    target looks the principal up in its own registry."""
    master = target
    name = request.match_info.get("q", "")
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | RELAY_DROPPED}
    membership = node.engine.pairs.view.membership
    if membership is not None:
        headers[MAP_VERSION] = str(membership.cluster_map.version)
    headers.update(extra or {})
    if placement is not None:     # the passing node placed a new queue: its choice stands
        headers[PLACEMENT] = ",".join(placement)
    body = await request.read()
    # Exactly the path this node saw: a URL built from a string is normalized (yarl decodes
    # %3A in `channel%3Aname` to `:`), and the target would check another path.
    headers.update(relay_headers(node.auth.cluster_secret, node.config.node_id, master, principal(request).client_id,
                                 request.method, request.raw_path.split("?", 1)[0], request.rel_url.query.items(),
                                 headers, body))
    url = yarl.URL(node.engine.pairs.view.url(master) + request.raw_path, encoded=True)
    try:
        async with node.http_session().request(request.method, url, data=body, headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S)) as answer:
            body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        if request.method in ("PUT", "DELETE") and request.path == f"/v1/queues/{name}" and 200 <= answer.status < 300:
            await until_local_map_has(node, name, present=request.method == "PUT")
        return web.Response(status=answer.status, body=body, headers=kept)
    except (aiohttp.ClientError, TimeoutError):
        return error_response(QueueError(e.E_QUEUE_UNAVAILABLE, f"the master {master} of {name} cannot be reached"))


MAP_CATCH_UP_S = 3.0
MAP_VERSION = "X-Map-Version"      # the passing node's map version: see until_map_version


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


async def call(engine: Engine, factory: Callable[[c.FutureReplier], c.Command], wait_s: float = 0.0,
               *, may_have_applied: bool = False) -> Any:
    try:
        return await asyncio.wait_for(engine.call(factory), wait_s + ENGINE_ANSWER_GRACE_S)
    except TimeoutError:
        raise QueueError(e.E_TIMEOUT, "the node did not answer in time", outcome_unknown=may_have_applied) from None


# --- queues ------------------------------------------------------------------------------
async def put_queue(request: web.Request) -> web.Response:
    name = queue_name(request, "admin")
    try:
        options, placement = parse_options(await json_body(request))
    except OptionError as error:
        raise QueueError(e.E_INVALID_OPTION, str(error)) from None
    engine = request.app[NODE].engine
    chosen = request.headers.get(PLACEMENT, "").split(",")
    if FORWARDED_BY in request.headers and len(chosen) == 2:
        placement.setdefault("master", chosen[0])
        placement.setdefault("replica", chosen[1])
    result = await call(engine, lambda r: c.CreateQueue(name, options, placement, r))
    return web.json_response(result, status=201 if result["created"] else 200)


async def empty_queue_name(request: web.Request) -> web.Response:
    raise QueueError(e.E_INVALID_NAME, "the queue name is empty")


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


async def list_queues(request: web.Request) -> web.Response:
    """Every queue the caller may see, by name, a page at a time (`limit`, `after`: the last
    name of the previous page; `next` names this page's last when more follow). In a cluster
    the list is the map's, the same at every node: each queue with its master, replica, epoch
    and in-sync state, and the statistics of the members this node holds (`held_here`: the
    master's numbers are authoritative; a replica's follow them). Only the page's queues are
    described: the map keeps its names sorted (ClusterMap.queue_names)."""
    engine = request.app[NODE].engine
    who = principal(request)
    limit, after = page_params(request, QUEUES_PAGE_DEFAULT, QUEUES_PAGE_MAX)
    coordinator = engine.coordinator
    cluster_map = coordinator.membership.cluster_map if coordinator is not None else None
    entries = cluster_map.queues if cluster_map is not None else {}
    names = cluster_map.queue_names() if cluster_map is not None else sorted(engine.cores)
    chosen, cursor = page_of(names, after, limit, who.may_see)
    page: list[dict[str, Any]] = []
    for name in chosen:
        core = engine.cores.get(name)
        listed = engine.describe(core) if core is not None else {"name": name}
        entry = entries.get(name)
        if entry is not None:            # the map's placement wins over what this node describes
            listed.update({"options": listed.get("options", entry.options), "master": entry.master,
                           "replica": entry.replica, "epoch": entry.epoch, "in_sync": entry.in_sync,
                           "incarnation": entry.incarnation, "last_reason": entry.last_reason,
                           "held_here": core is not None})
        page.append(listed)
    return web.json_response({"queues": page, "next": cursor})


async def get_queue(request: web.Request) -> web.Response:
    name = request.match_info["q"]
    if not is_valid_queue_name(name):
        raise QueueError(e.E_INVALID_NAME, "invalid queue name")
    if not principal(request).may_see(name):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {name}")
    engine = request.app[NODE].engine
    core = engine.cores.get(name)
    if core is None:
        engine.pairs.refuse_if_not_master(name)    # in a cluster, another node may hold it
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    stats = engine.describe(core)
    stats.update(request.app[NODE].client_counts(name))
    sessions = request.app[NODE].forward_root.sessions_of(name)
    if sessions:                  # the root of forwards (seed 003): their sessions here
        stats["forward_sessions"] = sessions
    return web.json_response(stats)


async def delete_queue(request: web.Request) -> web.Response:
    name = queue_name(request, "admin")
    return web.json_response(await call(request.app[NODE].engine, lambda r: c.DeleteQueue(name, r)))


# --- messages ----------------------------------------------------------------------------
async def enqueue(request: web.Request) -> web.Response:
    name = queue_name(request, "post")
    raw_priority = request.headers.get("X-Priority", str(PRIORITY_DEFAULT))
    if raw_priority not in PRIORITY_TEXTS:
        raise QueueError(e.E_INVALID_OPTION, "X-Priority must be 0-9")
    dedupe_id = request.headers.get("X-Dedupe-Id")
    if dedupe_id is not None and not valid_dedupe_id(dedupe_id):
        raise QueueError(e.E_INVALID_OPTION, "X-Dedupe-Id must be 1-128 printable UTF-8 characters")
    ttl_ms = int(number_param(request, "ttl_s", 0.0, 0.001, TTL_MAX_S) * 1000)   # 0: the queue's default
    delay_ms = int(number_param(request, "delay_s", 0.0, 0.0, DELAY_MAX_S) * 1000)
    headers = _message_headers(request)
    payload = await request.read()
    node = request.app[NODE]
    engine = node.engine
    client = principal(request).client_id
    if node.macros.is_macro(name):
        # Its producer policy picks the member(s); each copy keeps its member's guarantees.
        answer = await node.macros.enqueue(client, name, payload, int(raw_priority), dedupe_id or uuid.uuid4().hex,
                                           ttl_s=ttl_ms / 1000 or None, delay_s=delay_ms / 1000 or None,
                                           headers=headers)
        return web.json_response({"id": int(answer), "queue": answer.queue, "copies": answer.copies, "macro": name},
                                 status=201)
    message_index, epoch = await call(
        engine, lambda r: c.Enqueue(name, payload, int(raw_priority), dedupe_id, client, r, ttl_ms=ttl_ms,
                                    delay_ms=delay_ms, headers=headers), may_have_applied=True)
    one_way = engine.cores[name].options.type.value == "one_way" if name in engine.cores else False
    return web.json_response({"id": message_index, "epoch": epoch}, status=202 if one_way else 201)


def _message_headers(request: web.Request) -> dict[str, str] | None:
    """A message's headers from `X-Headers`, a JSON object of names to strings."""
    raw = request.headers.get("X-Headers")
    if raw is None:
        return None
    try:
        return checked_headers(json.loads(raw))
    except (ValueError, OptionError) as error:
        raise QueueError(e.E_INVALID_OPTION, f"X-Headers must be a JSON object of names to strings: {error}") from None


async def receive(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    node = request.app[NODE]
    wait_s = number_param(request, "wait_s", 0.0, 0.0, node.config.receive_wait_max_s)
    visibility_s = number_param(request, "visibility_timeout_s", -1.0, 0.0, 43_200.0) if \
        "visibility_timeout_s" in request.rel_url.query else None
    visibility_ms = None if visibility_s is None else int(visibility_s * 1000)
    client = principal(request).client_id
    member = name
    if node.macros.is_macro(name):
        # Its consumer policy picks the member; X-Queue names it (ack, release, extend go there).
        leased = await node.macros.receive(client, name, wait_s, visibility_s)
        if leased:
            member = leased[0].queue
        messages = [DeliveredMessage(m.id, m.receipt, m.priority, m.deliveries, m.payload, m.headers or None)
                    for m in leased]
    else:
        messages = await call(node.engine, lambda r: c.Receive(name, 1, int(wait_s * 1000), visibility_ms, client,
                                                               r), wait_s)
    if not messages:
        return web.Response(status=204)
    message = messages[0]
    headers = {"X-Message-Id": str(message.message_id), "X-Receipt": message.receipt, "X-Queue": member,
               "X-Priority": str(message.priority), "X-Deliveries": str(message.deliveries)}
    if message.headers:
        headers["X-Headers"] = json.dumps(message.headers, ensure_ascii=True)
    return web.Response(status=200, body=message.payload, content_type="application/octet-stream", headers=headers)


async def ack(request: web.Request) -> web.Response:
    name = await deleting_queue_name(request)
    index, token = message_id(request), receipt(request)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r))
    return web.json_response({"acked": index})


async def deleting_queue_name(request: web.Request) -> str:
    """The queue of an ack or a reply, which need `delete`. A client refused for want of it that
    may `get` (it leased the message) has the lease released first, so the message does not
    stay invisible for its whole lease; the refusal says so (docs/PROTOCOL.md, "Grants")."""
    name = path_name(request, "q", "queue")
    who = principal(request)
    if not who.releases_refused_ack(name) or name.startswith(CHANNEL_PREFIX):
        return queue_name(request, "delete")
    index, token = message_id(request), receipt(request)
    try:
        await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, who.client_id, r, release=True))
    except QueueError as error:
        if error.code == e.E_NOT_MASTER.code:
            raise          # passed on to the master (errors_and_auth), where this rule runs again
        raise QueueError(e.E_FORBIDDEN, refused_ack_text(who, name, index, error)) from None
    raise QueueError(e.E_FORBIDDEN, refused_ack_text(who, name, index, None))


async def release(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    index, token = message_id(request), receipt(request)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, release=True))
    return web.json_response({"released": index})


async def extend(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    index, token = message_id(request), receipt(request)
    if "visibility_timeout_s" not in request.rel_url.query:
        raise QueueError(e.E_INVALID_OPTION, "visibility_timeout_s (the lease's new duration from now) is required")
    visibility_ms = int(number_param(request, "visibility_timeout_s", 0.0, 0.0, 43_200.0) * 1000)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, extend_ms=visibility_ms))
    return web.json_response({"extended": index, "visibility_timeout_s": visibility_ms / 1000})


OWN_COPY = "X-Own-Copy"     # set by a member passing a `producer` purge or redrive on to the other


async def purge(request: web.Request) -> web.Response:
    """Take every message the queue holds now (ready or leased) out of it, for good. Under
    `full` the master decides and the purge is replicated; under `producer`, see on_each_member."""
    name = queue_name(request, "admin")
    node = request.app[NODE]
    result = await call(node.engine, lambda r: c.Purge(name, r))
    return await on_each_member(request, name, result, "purged")


async def redrive(request: web.Request) -> web.Response:
    """Move the queue's dead letters (up to `limit`) back into it (qserver/features/redrive.py)."""
    name = queue_name(request, "admin")
    limit = int(number_param(request, "limit", 0, 1, 10_000_000)) or None
    node = request.app[NODE]
    result = await redrive_dead_letters(node.engine, name, limit, principal(request).client_id, call)
    return await on_each_member(request, name, result, "redriven")


async def on_each_member(request: web.Request, name: str, result: dict[str, Any], count: str) -> web.Response:
    """Under `producer` each member holds its own copy of the messages and of their
    consumption (dead letters included): the member that ran an operator's purge or redrive
    passes it on to the other, which runs it on its own copy; `members` says what each did,
    or why not (a member that is down keeps its copy, as it keeps messages acked at the other)."""
    node = request.app[NODE]
    core = node.engine.cores.get(name)
    entry = node.engine.pairs.view.entry(name)
    if core is None or entry is None or core.options.strength.value != "producer" or OWN_COPY in request.headers:
        return web.json_response(result)
    me = node.config.node_id
    other = entry.replica if entry.master == me else entry.master
    members: dict[str, Any] = {me: result[count]}
    if other:
        answer = await proxy_to(request, node, other, extra={OWN_COPY: "1"})
        try:
            document = json.loads(answer.body)       # type: ignore[arg-type]
            members[other] = document[count] if answer.status == 200 else document["error"]["code"]
        except (ValueError, KeyError, TypeError):
            members[other] = e.E_INTERNAL.code
    return web.json_response({**result, "members": members})


async def reply(request: web.Request) -> web.Response:
    name = await deleting_queue_name(request)
    index, token = message_id(request), receipt(request)
    payload = await request.read()
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, reply_payload=payload))
    return web.json_response({"replied": index})


async def message_status(request: web.Request) -> web.Response:
    name = queue_name(request, "post")
    raw_id = request.match_info["id"]
    digits = raw_id.removeprefix("-")
    if digits.isascii() and digits.isdigit() and int(raw_id) <= 0:     # never issued (docs/PROTOCOL.md, "Grants")
        raise QueueError(e.E_UNKNOWN_MESSAGE, f"queue {name} has no message {raw_id}")
    index = message_id(request)
    node = request.app[NODE]
    wait_s = number_param(request, "wait_s", 0.0, 0.0, node.config.receive_wait_max_s)
    until_raw = request.rel_url.query.get("until")
    until = frozenset(until_raw.split(",")) if until_raw else TERMINAL_STATES
    if not until <= STATUS_STATES:
        raise QueueError(e.E_INVALID_OPTION, f"until takes states among {', '.join(sorted(STATUS_STATES))}")
    # The caller as the master authenticated it: a node passing the request on relays the
    # client's own signed request (proxy_to), so this is the original client, never the relay.
    who = principal(request)
    result = await call(node.engine, lambda r: c.MessageStatus(name, index, int(wait_s * 1000), until, who.client_id,
                                                               who.allows("admin", name), r), wait_s)
    reply_payload = result.pop("reply", None)
    if reply_payload is not None:
        result["reply_b64"] = base64.b64encode(reply_payload).decode()
    return web.json_response(result)


# --- clients -----------------------------------------------------------------------------
async def register_client(request: web.Request) -> web.Response:
    principal(request).require("admin")
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not is_valid_queue_name(body["name"]):
        raise QueueError(e.E_INVALID_NAME, "a client needs a name of 1-200 of A-Z a-z 0-9 . _ : -")
    grants = validate_grants(body.get("grants", []))
    engine = request.app[NODE].engine
    if any(record["name"] == body["name"] for record in engine.clients.values()):
        raise QueueError(e.E_CLIENT_EXISTS, f"a client named {body['name']} exists")
    private_text = None
    if body.get("public_key") is not None:
        try:
            public_key_from_text(str(body["public_key"]))
        except ValueError:
            raise QueueError(e.E_INVALID_OPTION, "public_key must be a base64 raw Ed25519 key") from None
        public_text = str(body["public_key"])
    else:
        key = new_private_key()
        private_text, public_text = private_key_to_text(key), public_key_text(key)
    client_id = "c-" + os.urandom(6).hex()
    record = {"id": client_id, "name": body["name"], "public_key": public_text, "grants": grants,
              "created_ms": int(time.time() * 1000)}
    await call(engine, lambda r: c.PutClient(client_id, record, r))
    answer = dict(record)
    if private_text is not None:
        answer["private_key"] = private_text
    return web.json_response(answer, status=201)


async def list_clients(request: web.Request) -> web.Response:
    principal(request).require("admin")
    return web.json_response({"clients": sorted(request.app[NODE].engine.clients.values(), key=lambda r: r["name"])})


async def remove_client(request: web.Request) -> web.Response:
    principal(request).require("admin")
    client_id = request.match_info["id"]
    await call(request.app[NODE].engine, lambda r: c.PutClient(client_id, None, r))
    return web.json_response({"removed": client_id})


async def set_grants(request: web.Request) -> web.Response:
    principal(request).require("admin")
    client_id = request.match_info["id"]
    engine = request.app[NODE].engine
    body = await json_body(request)
    grants = validate_grants(body.get("grants") if isinstance(body, dict) else None)
    record = engine.clients.get(client_id)
    if record is None:
        raise QueueError(e.E_UNKNOWN_CLIENT, f"no client {client_id}")
    updated = {**record, "grants": grants}
    await call(engine, lambda r: c.PutClient(client_id, updated, r))
    return web.json_response(updated)


# --- cluster, node ----------------------------------------------------------------------
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


# --- cluster operations (docs/PROTOCOL.md, "Moves, drains and rebalancing") -----------------------
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
    if target != node.config.node_id and FORWARDED_BY not in request.headers:
        return await proxy_to(request, node, target)
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
    if (member == "master" or swap) and entry.master != node.config.node_id and FORWARDED_BY not in request.headers:
        answer = await proxy_to(request, node, entry.master)        # its handoffs start at the master
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


async def propose(request: web.Request, command: Any) -> Any:
    """Propose a map command through the membership layer; its (first) Outcome once applied here."""
    coordinator = coordinator_of(request)
    outcomes = await in_engine(request.app[NODE].engine,
                               lambda finish: coordinator.propose_checked(command, finish, lambda o: o))
    return outcomes[0]


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    engine = node.engine
    # A supervisor or load balancer reads the status code: 503 whenever the engine does not
    # take commands (starting, stopping, or failed and about to exit).
    status = "ok" if engine.serving else "failed" if engine.failed is not None else "not_serving"
    answer: dict[str, Any] = {"status": status, "node": node.config.node_id, "queues": len(engine.cores)}
    coordinator = node.engine.coordinator
    if coordinator is not None:      # enough for a supervisor to see the node take part
        answer["membership"] = {"leader": coordinator.membership.leader_id(), "term": coordinator.membership.term(),
                                "nodes": {n: entry.state.value for n, entry
                                          in sorted(coordinator.membership.cluster_map.nodes.items())},
                                "lease_valid": coordinator.lease_valid(), "raft": coordinator.membership.status()}
    return web.json_response(answer, status=200 if status == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[NODE].render_metrics(), content_type="text/plain")


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_put("/v1/queues/", empty_queue_name)
    r.add_get("/v1/queues", list_queues)
    r.add_put("/v1/queues/{q}", put_queue)
    r.add_get("/v1/queues/{q}", get_queue)
    r.add_delete("/v1/queues/{q}", delete_queue)
    r.add_post("/v1/queues/{q}/messages", enqueue)
    r.add_post("/v1/queues/{q}/receive", receive)
    r.add_delete("/v1/queues/{q}/messages/{id}", ack)
    r.add_post("/v1/queues/{q}/messages/{id}/release", release)
    r.add_post("/v1/queues/{q}/messages/{id}/extend", extend)
    r.add_post("/v1/queues/{q}/purge", purge)
    r.add_post("/v1/queues/{q}/redrive", redrive)
    r.add_post("/v1/queues/{q}/messages/{id}/reply", reply)
    r.add_get("/v1/queues/{q}/messages/{id}/status", message_status)
    r.add_post("/v1/queues/{q}/handoff", handoff)
    r.add_post("/v1/queues/{q}/move", move)
    r.add_post("/v1/queues/{q}/promote", promote)
    r.add_post("/v1/cluster/rebalance", rebalance)
    r.add_post("/v1/cluster/nodes", add_node)
    r.add_post("/v1/cluster/nodes/{id}/drain", drain_node)
    r.add_post("/v1/cluster/nodes/{id}/undrain", undrain_node)
    r.add_delete("/v1/cluster/nodes/{id}", remove_node)
    r.add_post("/v1/journal/export", export_journal)
    r.add_get("/v1/cluster", cluster)
    r.add_post("/v1/clients", register_client)
    r.add_get("/v1/clients", list_clients)
    r.add_delete("/v1/clients/{id}", remove_client)
    r.add_put("/v1/clients/{id}/grants", set_grants)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
