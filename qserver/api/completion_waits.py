"""Producers that wait for their message's completion (seed 004 One_Way_Acknowledged, Two_Way
and CheckMsgCompletion; docs/PROTOCOL.md, "Producers that wait").

A wait is the engine's status wait (qserver/core/listeners.py, `wait_for_status`) asked for the
terminal states: it holds no timer per message and looks again only when a commit changed the
message, so the node answers the moment the consumer's ack (or reply) is committed, never by
polling. Each wait holds a place under the connection's and the client's listener bounds
(`listeners_per_connection_max`, `listeners_per_client_max`: E_OVERLOADED past them) until it is
answered, and lasts at most WAIT_S_MAX: a client waiting longer asks again (client/waits.py),
so a wait whose connection closed is gone within WAIT_S_MAX. When the queue's master moves, its
waits are refused with E_NOT_MASTER (Listeners.drop_status_waiters) and the client asks the new
master, where the completion is in the replicated state (under `full`: the ack and its reply
are replicated operations, stored with the status on both members).

Served over the WebSocket (op 21, CompletionWaitOp) and REST (`POST /v1/queues/{q}/messages`
with `wait=ack|reply&wait_s=`). This module holds what both share, and the node's counters.
"""
from __future__ import annotations

import base64
from typing import Any

from qserver.api.http_common import call, number_param, principal
from qserver.core import commands as c
from qserver.core.engine import TERMINAL_STATES
from qserver.core.listeners import check_completion_kind
from wire import errors as e
from wire import versions
from wire.errors import QueueError

WAIT_KINDS = ("ack", "reply")
# The longest one wait is held at the node: bounded, so a wait outlives its connection by at most
# this; the client library asks again for longer waits (client/waits.py).
WAIT_S_MAX = 60.0


def check_kind(kind: Any) -> str:
    if kind not in WAIT_KINDS:
        raise QueueError(e.E_INVALID_OPTION, "wait is `ack` (the consumer acked) or `reply` (it replied, two_way)")
    return str(kind)


def feature_level(engine: Any) -> int:
    coordinator = engine.coordinator
    return versions.FEATURE_LEVEL if coordinator is None else coordinator.membership.cluster_map.feature_level


class CompletionWaits:
    """The node's producer waits: how many are held (a gauge) and how many completions were
    sent to a waiting producer (a counter; docs/OPERATIONS.md, "Monitoring")."""

    def __init__(self) -> None:
        self.pushed = 0
        self.timed_out = 0
        self.held = 0

    def command(self, engine: Any, queue: str, message_id: int, wait_ms: int, kind: str, client: str, admin: bool,
                replier: Any, request_id: int = 0) -> c.MessageStatus:
        """The engine command of one producer wait (both surfaces): refused with
        E_FEATURE_DISABLED below cluster feature level 3 (a 0.2.0 node of the cluster knows no
        such wait), E_INVALID_OPTION for a kind other than ack/reply."""
        versions.require_feature(feature_level(engine), "producer_waits")
        check_kind(kind)
        wait_ms = max(0, min(wait_ms, int(WAIT_S_MAX * 1000)))
        self.held += 1
        return c.MessageStatus(queue, message_id, wait_ms, TERMINAL_STATES, client, admin,
                               _Counted(self, replier), request_id, completion=kind)

    def render(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) of each series."""
        return [("qserver_producer_waits", "gauge", "producers waiting at this node for their message's completion "
                 "(WebSocket op 21, REST enqueue with wait)", float(self.held)),
                ("qserver_producer_completions_total", "counter",
                 "completions (ack, reply, dead letter) sent to a waiting producer", float(self.pushed)),
                ("qserver_producer_waits_timed_out_total", "counter",
                 "producer waits that ended before their message completed", float(self.timed_out))]


class _Counted:
    """A wait's replier: counts the wait out as it is answered. `connection`: the replier it
    wraps, whose waits the listener bounds count together (Listeners.hold_listener)."""
    __slots__ = ("waits", "inner")

    def __init__(self, waits: CompletionWaits, inner: Any) -> None:
        self.waits, self.inner = waits, inner

    @property
    def connection(self) -> Any:
        return self.inner

    def reply(self, request_id: int, result: Any) -> None:
        self.waits.held -= 1
        if isinstance(result, dict) and result.get("state") in TERMINAL_STATES:
            self.waits.pushed += 1
        else:
            self.waits.timed_out += 1
        self.inner.reply(request_id, result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self.waits.held -= 1
        self.inner.fail(request_id, error)


def completion_json(result: dict[str, Any]) -> dict[str, Any]:
    """A wait's answer in REST JSON: the reply in base64 (`reply_b64`), `completed` true once the
    message reached a terminal state."""
    shown = dict(result)
    reply = shown.pop("reply", None)
    if reply is not None:
        shown["reply_b64"] = base64.b64encode(reply).decode()
    shown["completed"] = shown.get("state") in TERMINAL_STATES
    return shown


def rest_wait_params(request: Any, engine: Any) -> tuple[str, float] | None:
    """`wait` and `wait_s` of a REST enqueue, checked before anything is stored: None when it
    does not wait. On the queue's master the queue's type is checked here too (elsewhere the
    request is passed on to the master, which checks it)."""
    query = request.rel_url.query
    if "wait" not in query:
        if "wait_s" in query:
            raise QueueError(e.E_INVALID_OPTION, "wait_s goes with wait=ack or wait=reply")
        return None
    kind = check_kind(query["wait"])
    wait_s = number_param(request, "wait_s", 0.0, 0.0, WAIT_S_MAX)
    versions.require_feature(feature_level(engine), "producer_waits")
    core = engine.cores.get(request.match_info.get("q", ""))
    if core is not None:
        check_completion_kind(core, kind)
    return kind, wait_s


async def rest_wait(request: Any, node: Any, name: str, message_index: int, kind: str, wait_s: float,
                    stored: dict[str, Any]) -> dict[str, Any]:
    """The enqueue's answer once the message completed or `wait_s` ran out: `stored` ({"id",
    "epoch"}) with "state", "deliveries", "completed" and "reply_b64". The message is stored
    whatever happens to the wait: an error of the wait (the master moved meanwhile) is reported
    as "wait_error" with the stored id, never as the enqueue's error (which a client would retry,
    storing the message twice)."""
    who = principal(request)
    try:
        result = await call(node.engine, lambda r: node.completion_waits.command(
            node.engine, name, message_index, int(wait_s * 1000), kind, who.client_id, who.allows("admin", name), r),
            wait_s)
    except QueueError as error:
        return {**stored, "completed": False, "wait_error": {"code": error.code, "message": error.message}}
    return {**stored, **completion_json(result), "id": message_index}
