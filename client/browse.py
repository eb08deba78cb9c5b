"""Browsing a queue's messages without taking them (`peek`, `read`): what the client library's
WebSocket calls (client/aio.py) and REST calls (client/http.py) share: the answer's shape, and the
error a node of a release before browsing gives (docs/PROTOCOL.md, "Browsing messages (peek)").

A message is a dict: "id", "priority", "state" (ready / leased / delayed), "deliveries",
"enqueued_at_ms", "headers", "size", "payload" (bytes: over REST the node sends `payload_b64`),
"truncated" (only the first KiB, asked with `preview`). A page is {"messages", "next_after"
(pass it as `after` for the next page; None at the end), "served_by": {"node", "role"}}.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

from wire.errors import (
    E_BAD_FRAME,
    E_FEATURE_DISABLED,
    E_INTERNAL,
    E_METHOD_NOT_ALLOWED,
    E_NOT_FOUND,
    QueueError,
)

BROWSING_RELEASE = "0.3.0"
MESSAGE_FIELDS = ("id", "priority", "state", "deliveries", "enqueued_at_ms", "headers", "size", "payload", "truncated")


def node_too_old(error: QueueError, node: str = "the node") -> QueueError | None:
    """The error for a node that predates browsing, None when `error` is another: release 0.2.0
    refuses the WebSocket ops (tags 19, 20) as unknown (E_BAD_FRAME "unknown operation tag"),
    and answers the REST routes with E_METHOD_NOT_ALLOWED (GET on a path that takes POST or
    DELETE there) or E_NOT_FOUND."""
    old = ((error.code == E_BAD_FRAME.code and "unknown operation tag" in error.message)
           or error.code in (E_METHOD_NOT_ALLOWED.code, E_NOT_FOUND.code))
    if not old:
        return None
    return QueueError(E_FEATURE_DISABLED, f"{node} is too old to browse messages (peek, read): it runs a release "
                                          f"before {BROWSING_RELEASE} ({error.code}: {error.message}); upgrade it")


def message_from(raw: Any) -> dict[str, Any]:
    """A browsed message from the node's answer (payload bytes over the WebSocket, base64 in
    REST's `payload_b64`)."""
    try:
        message = dict(raw)
        if "payload_b64" in message:
            message["payload"] = base64.b64decode(message.pop("payload_b64"), validate=True)
        message["payload"] = bytes(message["payload"])
        message["headers"] = dict(message.get("headers") or {})
        message["truncated"] = bool(message.get("truncated", False))
        for name in MESSAGE_FIELDS:
            message[name]      # noqa: B018 - present, or a malformed answer
    except (TypeError, ValueError, KeyError, binascii.Error) as exc:
        raise QueueError(E_INTERNAL, f"a malformed browse answer: {exc!r}") from None
    return message


def page_from(raw: Any) -> dict[str, Any]:
    try:
        return {"messages": [message_from(item) for item in raw["messages"]], "next_after": raw["next_after"],
                "served_by": dict(raw["served_by"])}
    except (TypeError, KeyError) as exc:
        raise QueueError(E_INTERNAL, f"a malformed browse answer: {exc!r}") from None


def read_from(raw: Any) -> dict[str, Any]:
    message = message_from(raw)
    message["served_by"] = dict(message.get("served_by") or {})
    return message
