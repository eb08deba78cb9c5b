"""The one error catalog shared by server and client.

Codes are stable and append-only: never rename or reuse one. Each code carries the HTTP
status the server answers with, whether retrying can help, and the server and the client
library both build their errors from this table, so a code means the same thing on both
sides of the wire. `outcome_unknown` is per occurrence (an enqueue whose answer was lost
may have been applied), so it travels with the error rather than living in the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ErrorKind:
    code: str
    http_status: int
    retriable: bool
    summary: str


_CATALOG: dict[str, ErrorKind] = {}


def _kind(code: str, http_status: int, retriable: bool, summary: str) -> ErrorKind:
    kind = ErrorKind(code, http_status, retriable, summary)
    if code in _CATALOG:
        raise RuntimeError(f"error code {code} defined twice")
    _CATALOG[code] = kind
    return kind


# --- request shape -------------------------------------------------------------------------
E_BAD_REQUEST = _kind("E_BAD_REQUEST", 400, False, "the request is malformed")
E_BAD_JSON = _kind("E_BAD_JSON", 400, False, "the body is not valid JSON of the expected shape")
E_BAD_FRAME = _kind("E_BAD_FRAME", 400, False, "a WebSocket frame is not valid msgpack of the expected shape")
E_INVALID_NAME = _kind("E_INVALID_NAME", 400, False, "a queue or client name is empty, too long or has forbidden characters")
E_INVALID_OPTION = _kind("E_INVALID_OPTION", 400, False, "a queue option or parameter is out of range")
E_PAYLOAD_TOO_LARGE = _kind("E_PAYLOAD_TOO_LARGE", 413, False, "the body exceeds the configured maximum")
# E_NOT_IMPLEMENTED (501) is retired: nothing raised it. Codes are append-only: never reuse it.
E_METHOD_NOT_ALLOWED = _kind("E_METHOD_NOT_ALLOWED", 405, False, "the method is not allowed on this path")
E_NOT_FOUND = _kind("E_NOT_FOUND", 404, False, "no such route")
# --- security -------------------------------------------------------------------------------
E_UNAUTHENTICATED = _kind("E_UNAUTHENTICATED", 401, False, "the request is not signed, or the signature does not verify")
E_STALE_REQUEST = _kind("E_STALE_REQUEST", 401, False, "the request timestamp is outside the accepted window")
E_REPLAYED_REQUEST = _kind("E_REPLAYED_REQUEST", 401, False, "this request nonce was already used")
E_FORBIDDEN = _kind("E_FORBIDDEN", 403, False, "the client lacks the privilege for this queue")
E_UNKNOWN_CLIENT = _kind("E_UNKNOWN_CLIENT", 404, False, "no such registered client")
E_CLIENT_EXISTS = _kind("E_CLIENT_EXISTS", 409, False, "a client with this name is already registered")
E_UNKNOWN_ACCESS_KEY = _kind("E_UNKNOWN_ACCESS_KEY", 404, False, "the client has no access key of that id")
# --- queues and messages -----------------------------------------------------------------------
E_UNKNOWN_QUEUE = _kind("E_UNKNOWN_QUEUE", 404, False, "no such queue")
E_OPTIONS_MISMATCH = _kind("E_OPTIONS_MISMATCH", 409, False, "the queue exists with different options")
E_MASTER_EXISTS = _kind("E_MASTER_EXISTS", 409, False, "master_required was set and the queue already has a master")
E_QUEUE_FULL = _kind("E_QUEUE_FULL", 507, True, "the queue holds max_depth messages")
E_UNKNOWN_MESSAGE = _kind("E_UNKNOWN_MESSAGE", 404, False, "no such message in this queue")
E_LEASE_EXPIRED = _kind("E_LEASE_EXPIRED", 409, False,
                        "the receipt does not match the message's current lease (it expired, was released, or the "
                        "message was redelivered)")
E_WRONG_QUEUE_TYPE = _kind("E_WRONG_QUEUE_TYPE", 409, False, "the operation needs another queue type (replies need two_way)")
E_RESERVED_NAME = _kind("E_RESERVED_NAME", 409, False, "dead-letter queues and channels' queues come and go with their queue or channel")
E_RESERVED_HEADER = _kind("E_RESERVED_HEADER", 400, False,
                          "the message names a header the cluster itself sets (x-failed-over-from, x-returned-from, "
                          "x-fault, x-origin-producer)")
E_UNKNOWN_MACRO = _kind("E_UNKNOWN_MACRO", 404, False, "no such macro queue")
E_MACRO_REFUSED = _kind("E_MACRO_REFUSED", 409, False,
                        "the macro queue change was refused: the name is taken, the member is incompatible, "
                        "or the macro exists with other policies")
E_MACRO_QUEUE = _kind("E_MACRO_QUEUE", 409, False,
                      "the name is a macro queue: the client library and REST serve it, not this call")
E_UNKNOWN_CHANNEL = _kind("E_UNKNOWN_CHANNEL", 404, False, "no such channel")
E_UNKNOWN_SUBSCRIPTION = _kind("E_UNKNOWN_SUBSCRIPTION", 404, False, "no durable subscription of that name on the channel")
E_SUBSCRIPTIONS_FULL = _kind("E_SUBSCRIPTIONS_FULL", 409, False, "the channel has the most durable subscriptions it may have")
E_SUBSCRIPTION_TAKEN = _kind("E_SUBSCRIPTION_TAKEN", 409, False,
                             "another connection subscribed under this durable subscription's name")
E_RECIPIENT_DEFUNCT = _kind("E_RECIPIENT_DEFUNCT", 409, True,
                            "the recipient took no message for its queue's defunct interval: subscribe again")
E_UNKNOWN_RECIPIENT = _kind("E_UNKNOWN_RECIPIENT", 404, False,
                            "no such recipient: it never subscribed and has no alternatives, or was removed")
E_UNKNOWN_FORWARD = _kind("E_UNKNOWN_FORWARD", 404, False,
                          "no such forward, or no session of it here: open the session (again)")
E_FORWARD_REFUSED = _kind("E_FORWARD_REFUSED", 409, False,
                          "the forward was refused: the name is taken, the source is not a `full` queue, or is "
                          "forwarded already")
E_NOT_ADVERTISED = _kind("E_NOT_ADVERTISED", 409, False, "publish to a channel this connection has advertised")
E_STANDBY = _kind("E_STANDBY", 409, False, "another advertiser leads this channel: a standby's publish is "
                  "neither stored nor sent")
E_ADVERTISERS_FULL = _kind("E_ADVERTISERS_FULL", 409, False, "the channel has the most advertisers it may have")
E_MACRO_EMPTY = _kind("E_MACRO_EMPTY", 409, False, "the macro queue has no member that could take the message")
# --- node and cluster ---------------------------------------------------------------------------
E_STORAGE_FULL = _kind("E_STORAGE_FULL", 507, True, "the node's storage is full; nothing was stored")
E_OVERLOADED = _kind("E_OVERLOADED", 503, True, "the node's inbox is full; retry after a pause")
E_SHUTTING_DOWN = _kind("E_SHUTTING_DOWN", 503, True, "the node is stopping")
E_UNAVAILABLE = _kind("E_UNAVAILABLE", 503, True, "the node cannot be reached")
E_SESSION_EXPIRED = _kind("E_SESSION_EXPIRED", 503, True,
                          "the WebSocket session reached its lifetime (websocket_session_max_s); connect again")
E_TIMEOUT = _kind("E_TIMEOUT", 504, True, "no answer in time; the operation may or may not have happened")
E_NOT_MASTER = _kind("E_NOT_MASTER", 421, True, "this node is not the queue's master; refresh the placement")
E_QUEUE_UNAVAILABLE = _kind("E_QUEUE_UNAVAILABLE", 503, True, "no member of the queue's pair may serve it now")
E_NOT_ENOUGH_REPLICAS = _kind("E_NOT_ENOUGH_REPLICAS", 503, True, "min_in_sync cannot be met; nothing was stored")
E_HANDOFF_REFUSED = _kind("E_HANDOFF_REFUSED", 409, False, "the handoff was refused")
E_INTERNAL = _kind("E_INTERNAL", 500, True, "an unexpected server error")
# --- versions and upgrades (docs/OPERATIONS.md, "Upgrades") -------------------------------------
E_FEATURE_DISABLED = _kind("E_FEATURE_DISABLED", 409, False,
                           "the feature needs a higher cluster feature level: `qctl cluster finalize` raises it once "
                           "every node runs a release that supports it")
E_VERSION_MISMATCH = _kind("E_VERSION_MISMATCH", 426, False,
                           "the two sides share no protocol version: one of them needs another release")
E_NODES_BEHIND = _kind("E_NODES_BEHIND", 409, False,
                       "not every node runs a release that supports the asked feature level (the message names them)")
E_DRAIN_REFUSED = _kind("E_DRAIN_REFUSED", 409, False,
                        "draining the node now would leave a queue without an in-sync copy (the message names them)")
E_INVALID_DEFINITIONS = _kind("E_INVALID_DEFINITIONS", 400, False,
                              "the definitions document is malformed or inconsistent; nothing was changed")
# --- virtual queues (docs/PROTOCOL.md, "Virtual queues") -------------------------------------------
E_UNKNOWN_VIEW = _kind("E_UNKNOWN_VIEW", 404, False, "the queue has no virtual queue (view) of that name")
E_VIEWS_FULL = _kind("E_VIEWS_FULL", 409, False, "the queue has the most virtual queues (views) it may have")
# --- producers that wait (docs/PROTOCOL.md, "Producers that wait") ----------------------------------
E_WAIT_UNSUPPORTED = _kind("E_WAIT_UNSUPPORTED", 409, False,
                           "the queue's type keeps no completion to wait for: `ack` needs one_way_ack or two_way, "
                           "`reply` needs two_way")
E_WAIT_TIMEOUT = _kind("E_WAIT_TIMEOUT", 504, False,
                       "the message was stored but not completed within the wait; it stays in the queue")


def kind_of(code: str) -> ErrorKind:
    """The catalog entry for a code; codes unknown to this version map to E_INTERNAL's traits."""
    return _CATALOG.get(code) or ErrorKind(code, 500, False, "unknown error code")


class QueueError(Exception):
    """Base of every error the server answers with and the client raises."""

    def __init__(self, kind: ErrorKind | str, message: str = "", *, outcome_unknown: bool = False) -> None:
        self.kind = kind if isinstance(kind, ErrorKind) else kind_of(kind)
        self.message = message or self.kind.summary
        self.outcome_unknown = outcome_unknown
        super().__init__(f"{self.kind.code}: {self.message}")

    @property
    def code(self) -> str:
        return self.kind.code

    @property
    def retriable(self) -> bool:
        return self.kind.retriable

    @property
    def http_status(self) -> int:
        return self.kind.http_status

    def envelope(self) -> dict[str, Any]:
        """The JSON error envelope (docs/PROTOCOL.md)."""
        return {"error": {"code": self.code, "message": self.message,
                          "retriable": self.retriable, "outcome_unknown": self.outcome_unknown}}

    @classmethod
    def from_envelope(cls, body: Any, http_status: int = 500) -> QueueError:
        """Rebuild an error from a server's JSON envelope (or a WebSocket error tuple)."""
        try:
            error = body["error"]
            code = str(error["code"])
            return cls(code, str(error.get("message", "")),
                       outcome_unknown=bool(error.get("outcome_unknown", False)))
        except (KeyError, TypeError):
            return cls(E_INTERNAL, f"unexpected error body (HTTP {http_status})")
