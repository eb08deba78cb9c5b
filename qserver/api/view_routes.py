"""REST routes of virtual queues (docs/PROTOCOL.md, "Virtual queues"; replication/views.py).

Defining: `PUT /v1/queues/{q}/virtual/{v}` (the filter as the body), `DELETE` of it and
`GET /v1/queues/{q}/virtual` (the views with their depths), which need `admin` on the queue
(listing: any grant that lets the caller see the queue). The definitions are the queue option
`views`, changed through the map like any option (SetQueueOptions, feature level 3).

Using: `POST /v1/queues/{q}/virtual/{v}/receive`, `GET /v1/queues/{q}/virtual/{v}/messages`
(peek), and for a client whose grant names only the view, the lease's `DELETE .../messages/{id}`
(ack) and `POST .../messages/{id}/release` under the view's path too (a client with a grant on
the queue may use the queue's routes: the ids and receipts are the queue's). Each needs the
privilege the queue's route needs, on the queue or on the view: a grant whose pattern is
`<queue>/<view>` gives it through that view only (replication/views.py grant_name).
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from qserver.api.auth import Principal
from qserver.api.http_common import (
    NODE,
    call,
    in_engine,
    json_body,
    message_id,
    number_param,
    path_name,
    principal,
    propose,
    receipt,
)
from qserver.api.message_routes import peek_params, peeked_json
from qserver.api.queue_routes import _change_lone
from qserver.core import commands as c
from qserver.core import view_scan
from replication.cluster_map import CHANNEL_PREFIX, SetQueueOptions
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name, options_from_json
from replication.views import (
    VIEWS_MAX,
    ViewError,
    check_view_name,
    find_view,
    grant_name,
    parse_view,
    views_json,
    with_view,
    without_view,
)
from wire import errors as e
from wire import message_input as m
from wire import versions
from wire.errors import QueueError
from wire.view_ops import ViewPeekOp, ViewReceiveOp

CHANGE_ATTEMPTS = 3     # a view change that met another change of the queue's views is proposed again


def _names(request: web.Request, privilege: str) -> tuple[str, str]:
    """(queue, view) of the path, the caller allowed `privilege` on the queue or on the view."""
    return allowed_view(principal(request), privilege, path_name(request, "q", "queue"), request.match_info["v"])


def allowed_view(who: Principal, privilege: str, queue: str, view: Any) -> tuple[str, str]:
    """(queue, view) once `who` may use `privilege` on the queue or through the view (REST and
    the WebSocket's ops 23 and 24); E_INVALID_NAME, E_RESERVED_NAME or E_FORBIDDEN otherwise."""
    if not is_valid_queue_name(queue):
        raise QueueError(e.E_INVALID_NAME, f"invalid queue name {queue[:40]!r}")
    if queue.startswith(CHANNEL_PREFIX):
        raise QueueError(e.E_RESERVED_NAME, f"{queue} holds a channel's messages: it has no views")
    try:
        view = check_view_name(view)
    except ViewError as error:
        raise QueueError(e.E_INVALID_NAME, str(error)) from None
    if not (who.allows(privilege, queue) or who.allows(privilege, grant_name(queue, view))):
        raise QueueError(e.E_FORBIDDEN, f"client {who.client_id} may not {privilege} on {queue} "
                                        f"nor through its view {grant_name(queue, view)}")
    return queue, view


def ws_command(who: Principal, op: ViewReceiveOp | ViewPeekOp, replier: Any) -> c.Command:
    """The engine command of WebSocket op 23 (receive through a view, never waiting) or 24 (peek)."""
    queue, view = allowed_view(who, "get", op.queue, op.view)
    if isinstance(op, ViewReceiveOp):
        return c.Receive(queue, op.max_messages, 0, op.visibility_ms, who.client_id, replier, op.request_id, view=view)
    return c.Peek(queue, op.after, op.limit, op.preview, 0, replier, op.request_id, view=view)


def _views_now(request: web.Request, name: str) -> Any:
    """The queue's views as this node knows them: its map entry's in a cluster, else its core's."""
    engine = request.app[NODE].engine
    coordinator = engine.coordinator
    if coordinator is not None:
        versions.require_feature(coordinator.membership.cluster_map.feature_level, "virtual_queues")
        entry = coordinator.membership.cluster_map.queues.get(name)
        if entry is None:
            raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
        return options_from_json(entry.options).views
    core = engine.cores.get(name)
    if core is None:
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    return core.options.views


async def _change_views(request: web.Request, name: str, views: dict[str, Any]) -> Any:
    """Set the queue option `views` (as PATCH /v1/queues/{q} would); the views after it."""
    engine = request.app[NODE].engine
    changes = {"views": views}
    coordinator = engine.coordinator
    if coordinator is None:
        await in_engine(engine, lambda finish: _change_lone(engine, name, changes, finish))
        return engine.cores[name].options.views
    entry = coordinator.membership.cluster_map.queues[name]
    outcome = await propose(request, SetQueueOptions(name, entry.incarnation, changes))
    if not outcome.applied:
        kind = e.E_UNKNOWN_QUEUE if "incarnation" in outcome.reason else e.E_INVALID_OPTION
        raise QueueError(kind, f"queue {name}: {outcome.reason}")
    return _views_now(request, name)


def _check_owner(name: str) -> None:
    if name.endswith(DEAD_LETTER_SUFFIX) or name.startswith(CHANNEL_PREFIX):
        raise QueueError(e.E_RESERVED_NAME, f"{name}: a dead-letter queue or a channel's queue has no views")


async def put_view(request: web.Request) -> web.Response:
    """PUT /v1/queues/{q}/virtual/{v}: define the view (or change its filter)."""
    name, view_name = _names(request, "admin")
    principal(request).require("admin", name)      # defining needs the queue's admin, never a view's grant
    _check_owner(name)
    try:
        view = parse_view(view_name, await json_body(request))
    except ViewError as error:
        raise QueueError(e.E_INVALID_OPTION, str(error)) from None
    # SetQueueOptions names the whole set: a change of another view between our read and the
    # map applying ours would be lost, so we look again and propose again (the map orders them).
    for _ in range(CHANGE_ATTEMPTS):
        current = _views_now(request, name)
        if find_view(current, view_name) is None and len(current) >= VIEWS_MAX:
            raise QueueError(e.E_VIEWS_FULL, f"queue {name} has {VIEWS_MAX} views, the most it may have")
        after = await _change_views(request, name, with_view(current, view))
        if find_view(after, view_name) == view:
            break
    else:
        raise QueueError(e.E_TIMEOUT, f"queue {name}: its views kept changing; view {view_name} may not be set")
    return web.json_response({"queue": name, "view": view_name, "filter": view.to_json(),
                              "views": views_json(after)})


async def delete_view(request: web.Request) -> web.Response:
    name, view_name = _names(request, "admin")
    principal(request).require("admin", name)
    _check_owner(name)
    for _ in range(CHANGE_ATTEMPTS):
        current = _views_now(request, name)
        if find_view(current, view_name) is None:
            raise QueueError(e.E_UNKNOWN_VIEW, f"queue {name} has no view {view_name!r}")
        after = await _change_views(request, name, without_view(current, view_name))
        if find_view(after, view_name) is None:
            return web.json_response({"queue": name, "deleted": view_name, "views": views_json(after)})
    raise QueueError(e.E_TIMEOUT, f"queue {name}: its views kept changing; view {view_name} may still be there")


async def list_views(request: web.Request) -> web.Response:
    """GET /v1/queues/{q}/virtual: each view's filter and depth (ready messages in it), counted
    on the node that answers (bounded: `depth_exact` false says "at least")."""
    name = path_name(request, "q", "queue")
    if not principal(request).may_see(name):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {name}")
    engine = request.app[NODE].engine
    core = engine.cores.get(name)
    if core is None:
        engine.pairs.refuse_if_not_master(name)
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    return web.json_response({"queue": name, "views": view_scan.view_depths(engine.registry.storage, core)})


async def receive(request: web.Request) -> web.Response:
    """POST /v1/queues/{q}/virtual/{v}/receive: lease the view's next message (200 with it, as the
    queue's receive answers; 204: none now). A receive through a view does not wait."""
    name, view_name = _names(request, "get")
    if number_param(request, "wait_s", 0.0, 0.0, 0.0) != 0.0:
        raise QueueError(e.E_INVALID_OPTION, "a receive through a view does not wait: wait_s is 0")
    visibility_s = number_param(request, "visibility_timeout_s", -1.0, 0.0, m.VISIBILITY_MAX_S) if \
        "visibility_timeout_s" in request.rel_url.query else None
    visibility_ms = None if visibility_s is None else int(visibility_s * 1000)
    client = principal(request).client_id
    messages = await call(request.app[NODE].engine,
                          lambda r: c.Receive(name, 1, 0, visibility_ms, client, r, view=view_name))
    if not messages:
        return web.Response(status=204)
    message = messages[0]
    headers = {"X-Message-Id": str(message.message_id), "X-Receipt": message.receipt, "X-Queue": name,
               "X-View": view_name, "X-Priority": str(message.priority), "X-Deliveries": str(message.deliveries)}
    if message.headers:
        headers["X-Headers"] = json.dumps(message.headers, ensure_ascii=True)
    return web.Response(status=200, body=message.payload, content_type="application/octet-stream", headers=headers)


async def peek_messages(request: web.Request) -> web.Response:
    name, view_name = _names(request, "get")
    after, limit, preview = peek_params(request)
    result = await call(request.app[NODE].engine, lambda r: c.Peek(name, after, limit, preview, 0, r, view=view_name))
    result["messages"] = [peeked_json(message) for message in result["messages"]]
    return web.json_response(result)


async def ack(request: web.Request) -> web.Response:
    """DELETE /v1/queues/{q}/virtual/{v}/messages/{id}?receipt=: the lease's receipt is what a
    receive through the view answered (the receipt, 64 random bits, is the proof of the lease)."""
    name, _ = _names(request, "delete")
    index, token = message_id(request), receipt(request)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r))
    return web.json_response({"acked": index})


async def release(request: web.Request) -> web.Response:
    name, _ = _names(request, "get")
    index, token = message_id(request), receipt(request)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, release=True))
    return web.json_response({"released": index})


async def extend(request: web.Request) -> web.Response:
    name, _ = _names(request, "get")
    index, token = message_id(request), receipt(request)
    visibility_ms = int(number_param(request, "visibility_timeout_s", 30.0, 0.0, m.VISIBILITY_MAX_S) * 1000)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, extend_ms=visibility_ms))
    return web.json_response({"extended": index})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/queues/{q}/virtual", list_views)
    r.add_put("/v1/queues/{q}/virtual/{v}", put_view)
    r.add_delete("/v1/queues/{q}/virtual/{v}", delete_view)
    r.add_post("/v1/queues/{q}/virtual/{v}/receive", receive)
    r.add_get("/v1/queues/{q}/virtual/{v}/messages", peek_messages)
    r.add_delete("/v1/queues/{q}/virtual/{v}/messages/{id}", ack)
    r.add_post("/v1/queues/{q}/virtual/{v}/messages/{id}/release", release)
    r.add_post("/v1/queues/{q}/virtual/{v}/messages/{id}/extend", extend)
