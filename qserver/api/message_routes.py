"""REST routes of a queue's messages: enqueue, receive, ack, release, extend, reply and a
message's status (docs/PROTOCOL.md, "REST"). What a message may carry is checked by
wire/message_input.py, as on every other surface.
"""
from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from aiohttp import web

from qserver.api import completion_waits
from qserver.api.auth import refused_ack_text
from qserver.api.http_common import NODE, call, message_id, number_param, path_name, principal, queue_name, receipt
from qserver.api.queue_routes import receive_wait_s
from qserver.core import commands as c
from qserver.core import peek
from qserver.core.engine import TERMINAL_STATES
from replication.cluster_map import CHANNEL_PREFIX
from wire import errors as e
from wire import message_input as m
from wire.errors import QueueError
from wire.protocol import DeliveredMessage

STATUS_STATES = frozenset({"queued", "delayed", "delivered", "acked", "replied", "dead_lettered", "purged",
                           "expired"})


async def enqueue(request: web.Request) -> web.Response:
    name = queue_name(request, "post")
    priority = m.priority_from_text(request.headers.get("X-Priority"))
    dedupe_id = request.headers.get("X-Dedupe-Id")
    m.check_dedupe_id(dedupe_id)
    ttl_ms = int(number_param(request, "ttl_s", 0.0, m.TTL_MIN_S, m.TTL_MAX_S) * 1000)   # 0: the queue's default
    delay_ms = int(number_param(request, "delay_s", 0.0, 0.0, m.DELAY_MAX_S) * 1000)
    headers = m.headers_from_json(request.headers.get("X-Headers"))
    payload = await request.read()
    node = request.app[NODE]
    engine = node.engine
    client = principal(request).client_id
    waiting = completion_waits.rest_wait_params(request, engine)     # wait=ack|reply&wait_s=
    if node.macros.is_macro(name):
        if waiting is not None:
            raise QueueError(e.E_WAIT_UNSUPPORTED, f"{name} is a macro queue: wait on the member it chose")
        # Its producer policy picks the member(s); each copy keeps its member's guarantees.
        answer = await node.macros.enqueue(client, name, payload, priority, dedupe_id or uuid.uuid4().hex,
                                           ttl_s=ttl_ms / 1000 or None, delay_s=delay_ms / 1000 or None,
                                           headers=headers)
        return web.json_response({"id": int(answer), "queue": answer.queue, "copies": answer.copies, "macro": name},
                                 status=201)
    tracing = node.tracing      # an enqueue span when configured and traced (qserver/tracing.py)
    message_index, epoch = await call(
        engine, lambda r: c.Enqueue(name, payload, priority, dedupe_id, client,
                                    r if tracing is None else tracing.replier(r, name, headers), ttl_ms=ttl_ms,
                                    delay_ms=delay_ms, headers=headers), may_have_applied=True)
    one_way = engine.cores[name].options.type.value == "one_way" if name in engine.cores else False
    if waiting is not None:
        return web.json_response(await completion_waits.rest_wait(request, node, name, message_index, *waiting,
                                                                  {"id": message_index, "epoch": epoch}), status=201)
    return web.json_response({"id": message_index, "epoch": epoch}, status=202 if one_way else 201)


async def receive(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    node = request.app[NODE]
    wait_s = number_param(request, "wait_s", 0.0, 0.0, node.config.receive_wait_max_s)
    if "wait_s" not in request.rel_url.query:     # the queue's receive_wait_s (docs/PROTOCOL.md, "Queue options")
        wait_s = min(receive_wait_s(node.engine, name), node.config.receive_wait_max_s)
    visibility_s = number_param(request, "visibility_timeout_s", -1.0, 0.0, m.VISIBILITY_MAX_S) if \
        "visibility_timeout_s" in request.rel_url.query else None
    visibility_ms = None if visibility_s is None else int(visibility_s * 1000)
    client = principal(request).client_id
    member = name
    if node.macros.is_macro(name):
        # Its consumer policy picks the member; X-Queue names it (ack, release, extend go there).
        leased = await node.macros.receive(client, name, wait_s, visibility_s)
        if leased:
            member = leased[0].queue
        messages = [DeliveredMessage(one.id, one.receipt, one.priority, one.deliveries, one.payload,
                                     one.headers or None) for one in leased]
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
    visibility_ms = int(number_param(request, "visibility_timeout_s", 0.0, 0.0, m.VISIBILITY_MAX_S) * 1000)
    client = principal(request).client_id
    await call(request.app[NODE].engine, lambda r: c.Ack(name, index, token, client, r, extend_ms=visibility_ms))
    return web.json_response({"extended": index, "visibility_timeout_s": visibility_ms / 1000})


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
    # client's own signed request (pass_on_to), so this is the original client, never the relay.
    who = principal(request)
    result = await call(node.engine, lambda r: c.MessageStatus(name, index, int(wait_s * 1000), until, who.client_id,
                                                               who.allows("admin", name), r), wait_s)
    reply_payload = result.pop("reply", None)
    if reply_payload is not None:
        result["reply_b64"] = base64.b64encode(reply_payload).decode()
    return web.json_response(result)


# --- browsing without taking (docs/PROTOCOL.md, "Browsing messages (peek)") ----------------------
def _integer_param(request: web.Request, name: str, default: int, low: int, high: int, text: str) -> int:
    raw = request.rel_url.query.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit() and low <= int(raw) <= high):
        raise QueueError(e.E_INVALID_OPTION, text)
    return int(raw)


def peeked_json(message: dict[str, Any]) -> dict[str, Any]:
    """A browsed message in JSON: its payload in base64 as `payload_b64`, as a reply's is
    `reply_b64` in a message's status."""
    shown = dict(message)
    shown["payload_b64"] = base64.b64encode(shown.pop("payload")).decode()
    return shown


def peek_params(request: web.Request) -> tuple[int, int, bool]:
    """`after`, `limit` and `preview` of a page of messages (GET .../messages, of a queue or a view)."""
    limit = _integer_param(request, "limit", peek.LIMIT_DEFAULT, 1, peek.LIMIT_MAX,
                           f"limit must be an integer between 1 and {peek.LIMIT_MAX}")
    after = _integer_param(request, "after", 0, 0, peek.CURSOR_MAX,
                           "after is the previous page's next_after (0: from the start)")
    raw_preview = request.rel_url.query.get("preview", "0")
    if raw_preview not in ("0", "1", "true", "false"):
        raise QueueError(e.E_INVALID_OPTION, "preview is 1 (the first KiB of each payload) or 0")
    return after, limit, raw_preview in ("1", "true")


async def peek_messages(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    after, limit, preview = peek_params(request)
    result = await call(request.app[NODE].engine, lambda r: c.Peek(name, after, limit, preview, 0, r))
    result["messages"] = [peeked_json(message) for message in result["messages"]]
    return web.json_response(result)


async def read_message(request: web.Request) -> web.Response:
    name = queue_name(request, "get")
    index = message_id(request)
    result = await call(request.app[NODE].engine, lambda r: c.Peek(name, 0, 1, False, index, r))
    served_by = result.pop("served_by")
    return web.json_response({**peeked_json(result), "served_by": served_by})
