"""Virtual queues in the client library (docs/PROTOCOL.md, "Virtual queues"): named, filtered
views of one queue, defined and listed over REST, received from and browsed over the WebSocket
(ops 23 and 24, wire/view_ops.py, at the queue's master as the client's router finds it) or over
REST where there is no WebSocket (qctl).

Mixed into `AsyncClient` (through client/admin.py AdminCalls); the sync `Client` wraps each call.
A message received through a view is an ordinary `Message` (the queue's id and receipt); its
ack, release and extend go to the view's own REST routes, so a client whose grant names only the
view (`"<queue>/<view>"`) can settle what it received. A node of a release before 0.3.0 knows
neither: its E_BAD_FRAME (unknown tag) or E_NOT_FOUND / E_METHOD_NOT_ALLOWED becomes
E_FEATURE_DISABLED naming it.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from client import browse
from client.consumer import Message
from wire.errors import E_FEATURE_DISABLED, E_INTERNAL, E_METHOD_NOT_ALLOWED, E_NOT_FOUND, QueueError
from wire.protocol import DeliveredMessage, FrameError, messages_from_result
from wire.view_ops import ViewPeekOp, ViewReceiveOp

if TYPE_CHECKING:
    from client.http import HttpClient

VIEWS_RELEASE = "0.3.0"


def view_path(queue: str, view: str, *rest: str | int) -> str:
    from client.http import queue_path
    return queue_path(queue, "virtual", view, *rest)


def _too_old(error: QueueError, http: HttpClient) -> QueueError:
    if error.code in (E_NOT_FOUND.code, E_METHOD_NOT_ALLOWED.code):
        return QueueError(E_FEATURE_DISABLED, f"the node at {http.url} (release {http.server_release or 'unknown'}) "
                                              f"is too old for virtual queues (release {VIEWS_RELEASE} has them): "
                                              f"{error.message}")
    return error


class ViewLeases:
    """Where a message received through a view is settled: the view's routes (client/connection.py Leases)."""

    def __init__(self, http: HttpClient, view: str) -> None:
        self._http, self._view = http, view

    async def ack(self, queue: str, message_id: int, receipt: str) -> None:
        await self._http.request("DELETE", view_path(queue, self._view, "messages", message_id),
                                 query=[("receipt", receipt)], idempotent=False)

    async def release(self, queue: str, message_id: int, receipt: str) -> None:
        await self._http.request("POST", view_path(queue, self._view, "messages", message_id, "release"),
                                 query=[("receipt", receipt)], idempotent=False)

    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        await self._http.request("POST", view_path(queue, self._view, "messages", message_id, "extend"),
                                 query=[("receipt", receipt), ("visibility_timeout_s", f"{visibility_timeout_s:g}")],
                                 idempotent=True)


class ViewCalls:
    """The virtual-queue calls; `http` is the REST client of the class mixing this in."""

    http: HttpClient

    async def _view_json(self, method: str, path: str, document: Any = None,
                         query: list[tuple[str, str]] | None = None) -> Any:
        try:
            return await self.http._json(method, path, document=document, query=query or [])
        except QueueError as error:
            raise _too_old(error, self.http) from None

    async def create_view(self, queue: str, view: str, filter: dict[str, Any]) -> dict[str, Any]:
        """Define view `view` of `queue` (admin grant), or change its filter: `{"producer": id}`,
        `{"header": name, "equals": value}`, `{"header": name, "in": [values]}` or `{"origin":
        "direct" | "moved" | "failed_over" | "returned"}`. Answers `{"queue", "view", "filter", "views"}`."""
        return dict(await self._view_json("PUT", view_path(queue, view), filter))

    async def delete_view(self, queue: str, view: str) -> dict[str, Any]:
        return dict(await self._view_json("DELETE", view_path(queue, view)))

    async def list_views(self, queue: str) -> dict[str, Any]:
        """{view: {"filter", "depth", "depth_exact"}}: `depth` counts the ready messages in the
        view (at least that many when `depth_exact` is false: the count is bounded)."""
        from client.http import queue_path
        answer = await self._view_json("GET", queue_path(queue, "virtual"))
        return dict(answer["views"])

    async def receive_view(self, queue: str, view: str, max_messages: int = 1,
                           visibility_timeout_s: float | None = None) -> list[Message]:
        """Lease up to `max_messages` of the view's messages, in the queue's order, without
        waiting ([] when the view has none ready now). Each is the queue's message: its ack,
        release and extend go through the view's routes."""
        leases = ViewLeases(self.http, view)
        browse_ws = getattr(self, "_browse", None)
        if browse_ws is not None:         # an AsyncClient: op 23 over the WebSocket
            visibility_ms = None if visibility_timeout_s is None else int(visibility_timeout_s * 1000)
            result = await browse_ws(queue, lambda request_id: ViewReceiveOp(request_id, queue, view, max_messages,
                                                                             visibility_ms))
            try:
                return [Message(leases, queue, delivered) for delivered in messages_from_result(result)]
            except FrameError as exc:
                raise QueueError(E_INTERNAL, f"a malformed receive answer: {exc}", outcome_unknown=True) from None
        query = [] if visibility_timeout_s is None else [("visibility_timeout_s", f"{visibility_timeout_s:g}")]
        messages: list[Message] = []
        while len(messages) < max_messages:
            try:
                answer = await self.http.request("POST", view_path(queue, view, "receive"), query=query,
                                                 idempotent=False)
            except QueueError as error:
                raise _too_old(error, self.http) from None
            if answer.status == 204:
                break
            headers = answer.headers
            try:
                named = headers.get("X-Headers")
                delivered = DeliveredMessage(int(headers["X-Message-Id"]), headers["X-Receipt"],
                                             int(headers.get("X-Priority", "4")), int(headers.get("X-Deliveries", "1")),
                                             answer.body, None if named is None else dict(json.loads(named)))
            except (KeyError, ValueError, TypeError):
                raise QueueError(E_INTERNAL, "a receive answer lacks its message headers") from None
            messages.append(Message(leases, queue, delivered))
        return messages

    async def peek_view(self, queue: str, view: str, after: int = 0, limit: int = 100,
                        preview: bool = False) -> dict[str, Any]:
        """A page of the view's messages in delivery order, taking none (as `peek`)."""
        browse_ws = getattr(self, "_browse", None)
        if browse_ws is not None:         # an AsyncClient: op 24 over the WebSocket
            raw = await browse_ws(queue, lambda request_id: ViewPeekOp(request_id, queue, view, after, limit, preview))
        else:
            query = [("after", str(after)), ("limit", str(limit))] + ([("preview", "1")] if preview else [])
            raw = await self._view_json("GET", view_path(queue, view, "messages"), query=query)
        view_name = raw.get("view")
        page = browse.page_from(raw)
        page["view"] = view_name
        return page
