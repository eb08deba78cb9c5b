"""The client WebSocket (`GET /v1/ws`): the fast path of the client library.

One connection carries many pipelined requests: a frame of N operations becomes N commands
in the engine's inbox without an await per operation, and the answers the engine releases
after each group commit are coalesced into one outgoing frame per event-loop turn. The
upgrade request is signed like any request; grants are checked per operation. Frames are
documented in docs/PROTOCOL.md.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import WSMsgType, web

from qserver.api import view_routes
from qserver.api.auth import CLUSTER_CLIENT, Principal, refused_ack_text
from qserver.api.http_common import NODE
from qserver.core import commands as c
from replication.cluster_map import CHANNEL_PREFIX
from replication.options import is_valid_queue_name
from wire import errors as e
from wire.channel_ops import ChannelFetchOp, ChannelOffersOp
from wire.errors import QueueError
from wire.message_input import check_dedupe_id, check_payload
from wire.protocol import (
    AckBatchOp,
    AckOp,
    AdvertiseOp,
    ChannelAckOp,
    ChannelSubscribeOp,
    Closing,
    CompletionWaitOp,
    CreditOp,
    DeliveredMessage,
    Delivery,
    EnqueueBatchOp,
    EnqueueOp,
    ErrorReply,
    ExtendOp,
    ForwardDataOp,
    ForwardSessionOp,
    FrameError,
    OkReply,
    PeekOp,
    PingOp,
    PublishOp,
    ReadOp,
    ReceiveOp,
    ReleaseOp,
    ReportOp,
    SubscribeOp,
    SubscriptionEnded,
    UnsubscribeOp,
    decode_client_frame,
    encode_frame,
)
from wire.view_ops import ViewPeekOp, ViewReceiveOp

log = logging.getLogger("qserver.ws")
CHANNEL_OPS = frozenset({PublishOp, ChannelSubscribeOp, ChannelAckOp, AdvertiseOp, ReportOp, ChannelFetchOp,
                         ChannelOffersOp})
# The largest client frame, in maximal messages plus room for the ops around them (issue 32,
# item 10): the client library cuts its frames at 1 MiB of payloads or one message alone.
# Larger, aiohttp closes the socket with 1009 (message too big) before reading the frame.
FRAME_BODIES, FRAME_SLACK_BYTES = 4, 1 << 20


class ClientConnection:
    """One client's socket; also the Replier its commands answer through."""

    def __init__(self, ws: web.WebSocketResponse, principal: Principal, node: Any) -> None:
        self.ws = ws
        self.principal = principal
        self.node = node
        self.engine = node.engine
        self._body_bytes_max = node.config.body_bytes_max
        self._pending_items_max = node.config.websocket_pending_items_max
        self._tracing = node.tracing        # enqueue spans (qserver/tracing.py); None: not configured
        self._out: list[Any] = []
        self._sending = False
        self._closed = False
        self._cut = False
        self.subscriptions: set[int] = set()
        self.queues_produced: set[str] = set()
        self.queues_consumed: set[str] = set()
        self.channels: set[str] = set()          # channels subscribed on this connection (qserver/features/channels/hub.py)
        self.advertised: set[str] = set()        # channels it may publish to
        self.durable: dict[str, str] = {}        # channel -> the durable subscription read on this connection
        self.takes_offers = False                # it asked for ChannelOffer pushes (op 26; qserver/features/channels/mechanisms.py)
        self.recipients: dict[str, str] = {}     # queue -> the recipient this connection consumes it as
        self.waits_asked = False                  # it asked a producer wait (op 21): dropped at close
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()   # held until done (the loop keeps weak references)

    def _spawn(self, coroutine: Any) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close_soon(self, error: QueueError) -> None:
        """close_with from outside a coroutine (the session's lifetime, a client change)."""
        self._spawn(self.close_with(error))

    @property
    def closed(self) -> bool:
        return self._closed

    # --- Replier ---------------------------------------------------------------------------
    def reply(self, request_id: int, result: Any) -> None:
        self._emit(OkReply(request_id, result))

    def fail(self, request_id: int, error: QueueError) -> None:
        self._emit(ErrorReply(request_id, error.code, error.message, error.outcome_unknown))

    def push(self, subscription_id: int, messages: list[DeliveredMessage]) -> None:
        self._emit(Delivery(subscription_id, tuple(messages)))

    def subscription_started(self, subscription: Any) -> None:
        if self._closed:
            # Subscribed after the socket closed (the subscribe was in the inbox): nothing
            # would ever end it, and it would hold its place under the listener bounds.
            self.engine.submit(c.Unsubscribe(subscription.subscription_id, None))
            return
        self.subscriptions.add(subscription.subscription_id)
        if subscription.recipient is not None:
            # Only now, where the engine took it (under `full`, at the queue's master): a node
            # that refused it with E_NOT_MASTER has not seen the recipient subscribe.
            self.node.surveillance.subscribed(subscription.queue, subscription.recipient, subscription.client)

    def subscription_ended(self, subscription_id: int, error: QueueError) -> None:
        self.subscriptions.discard(subscription_id)
        self._emit(SubscriptionEnded(subscription_id, error.code, error.message))

    def emit(self, item: Any) -> None:
        """Send a server item in this connection's next frame (channel messages)."""
        self._emit(item)

    def _emit(self, item: Any) -> None:
        if self._closed:
            return
        if len(self._out) >= self._pending_items_max:
            # The client does not read its answers: cut it rather than hold them without bound.
            self._out.clear()
            if not self._cut:
                self._cut = True
                self.close_soon(QueueError(e.E_OVERLOADED, "answers are not being read"))
            return
        self._out.append(item)
        if not self._sending:
            # The sender task first runs on the loop's next turn: every answer released in
            # this turn (a whole group commit's) goes out in its one frame.
            self._sending = True
            self._spawn(self._send_all())

    async def _send_all(self) -> None:
        try:
            while self._out and not self._closed:
                items, self._out = self._out, []
                await self.ws.send_bytes(encode_frame(items))
        except (ConnectionError, RuntimeError):
            self._closed = True
        finally:
            self._sending = False

    async def close_with(self, error: QueueError) -> None:
        """Tell the client why, then close (client removed, grant revoked, shutdown)."""
        if self._closed:
            return
        try:
            await self.ws.send_bytes(encode_frame([Closing(error.code, error.message)]))
        except (ConnectionError, RuntimeError):
            pass
        self._closed = True
        await self.ws.close()

    # --- reading ---------------------------------------------------------------------------
    async def serve(self) -> None:
        try:
            async for message in self.ws:
                if message.type == WSMsgType.BINARY:
                    self._handle_frame(message.data)
                elif message.type == WSMsgType.TEXT:
                    self.fail(0, QueueError(e.E_BAD_FRAME, "frames are binary msgpack"))
                elif message.type == WSMsgType.ERROR:
                    break
        finally:
            # Also when the handler is cancelled (the node stopping, the peer gone mid-frame):
            # what the connection holds in the engine, the channel hub and the forward root.
            self._closed = True
            for subscription_id in list(self.subscriptions):
                self.engine.submit(c.Unsubscribe(subscription_id, None))
            self.subscriptions.clear()
            if self.waits_asked:        # producer waits it held (qserver/api/completion_waits.py)
                listeners = self.engine.listeners
                self.engine.submit(c.Invoke(lambda now_ms: listeners.drop_connection_status_waiters(self)))
            self.node.channels.connection_closed(self)
            self.node.forward_root.connection_closed(self)

    def _handle_frame(self, data: bytes) -> None:
        try:
            items = decode_client_frame(data)
        except FrameError as error:
            self.node.bad_frames += 1
            self.fail(0, QueueError(e.E_BAD_FRAME, str(error)))
            return
        submit = self.engine.submit
        for item in items:
            if type(item) is PingOp:
                self.reply(item.request_id, None)
                continue
            try:
                command = self._command(item)
                if command is not None:
                    submit(command)
            except QueueError as error:
                self.fail(item.request_id, error)
            except FrameError as error:
                self.node.bad_frames += 1
                self.fail(error.request_id, QueueError(e.E_BAD_FRAME, str(error)))

    def _queue(self, name: str, privilege: str, request_id: int) -> str:
        if not is_valid_queue_name(name):
            raise QueueError(e.E_INVALID_NAME, f"invalid queue name {name[:40]!r}")
        if name.startswith(CHANNEL_PREFIX):
            raise QueueError(e.E_RESERVED_NAME, f"{name} holds a channel's messages: publish and subscribe instead")
        if not self.principal.allows(privilege, name):
            raise QueueError(e.E_FORBIDDEN, f"client {self.principal.client_id} may not {privilege} on {name}")
        return name

    def _command(self, op: Any) -> c.Command | None:
        """The engine command for an operation; None when it was answered here (channels)."""
        if isinstance(op, FrameError):
            raise op
        kind = type(op)
        client = self.principal.client_id
        if kind is EnqueueOp:
            check_payload(op.payload, self._body_bytes_max)
            check_dedupe_id(op.dedupe_id)
            if op.queue not in self.queues_produced:
                self.queues_produced.add(self._queue(op.queue, "post", op.request_id))
            replier = self if self._tracing is None else self._tracing.replier(self, op.queue, op.headers)
            return c.Enqueue(op.queue, op.payload, op.priority, op.dedupe_id, client, replier, op.request_id,
                             op.ttl_ms, op.delay_ms, op.headers)
        if kind is EnqueueBatchOp:
            # Oversized payloads and bad dedupe ids fail only their own item (engine step):
            # the batch coalesces many callers' messages.
            if op.queue not in self.queues_produced:
                self.queues_produced.add(self._queue(op.queue, "post", op.request_id))
            replier = self if self._tracing is None else \
                self._tracing.replier(self, op.queue, op.headers, len(op.payloads))
            return c.EnqueueMany(op.queue, op.priority, op.payloads, op.dedupe_ids, client, replier, op.request_id,
                                 op.ttl_ms, op.delay_ms, op.headers)
        if kind is AckBatchOp:
            if self._refused_acks(op.queue, op.request_id, op.items, batch=True):
                return None
            self._queue(op.queue, "delete", op.request_id)
            if self.recipients:
                self._took(op.queue, [message_id for message_id, _ in op.items])
            return c.AckMany(op.queue, op.items, client, self, op.request_id)
        if kind is AckOp and self._refused_acks(op.queue, op.request_id, ((op.message_id, op.receipt),), batch=False):
            return None
        if kind is AckOp or kind is ReleaseOp:
            self._queue(op.queue, "delete" if kind is AckOp else "get", op.request_id)
            if self.recipients:
                self._took(op.queue, [op.message_id])
            return c.Ack(op.queue, op.message_id, op.receipt, client, self, op.request_id, release=kind is ReleaseOp)
        if kind is ExtendOp:
            self._queue(op.queue, "get", op.request_id)        # like a release: it removes nothing
            return c.Ack(op.queue, op.message_id, op.receipt, client, self, op.request_id,
                         extend_ms=op.visibility_ms)
        if kind is ReceiveOp:
            self.queues_consumed.add(self._queue(op.queue, "get", op.request_id))
            wait_ms = min(op.wait_ms, int(self.node.config.receive_wait_max_s * 1000))
            return c.Receive(op.queue, op.max_messages, wait_ms, op.visibility_ms, client, self, op.request_id)
        if kind is SubscribeOp:
            self.queues_consumed.add(self._queue(op.queue, "get", op.request_id))
            if op.recipient is not None:
                if not is_valid_queue_name(op.recipient):
                    raise QueueError(e.E_INVALID_NAME, "a recipient's name is a queue name")
                self.node.surveillance.check_subscribe(op.queue, op.recipient, client)
                self.recipients[op.queue] = op.recipient
            return c.Subscribe(op.queue, op.credit, op.visibility_ms, client, self, op.request_id, op.recipient)
        if kind is CreditOp:
            self._own_subscription(op.subscription_id)
            return c.Credit(op.subscription_id, op.credit, self, op.request_id)
        if kind is UnsubscribeOp:
            self._own_subscription(op.subscription_id)
            self.subscriptions.discard(op.subscription_id)
            return c.Unsubscribe(op.subscription_id, self, op.request_id)
        if kind in CHANNEL_OPS:
            return self._channel_op(op)
        if kind is ViewReceiveOp or kind is ViewPeekOp:     # through a virtual queue (qserver/api/view_routes.py)
            return view_routes.ws_command(self.principal, op, self)
        if kind is PeekOp or kind is ReadOp:       # browse without taking: grant `get`
            self._queue(op.queue, "get", op.request_id)
            if kind is ReadOp:
                return c.Peek(op.queue, 0, 1, False, op.message_id, self, op.request_id)
            return c.Peek(op.queue, op.after, op.limit, op.preview, 0, self, op.request_id)
        if kind is CompletionWaitOp:       # a producer waiting for its message (qserver/api/completion_waits.py)
            self._queue(op.queue, "post", op.request_id)
            self.waits_asked = True
            return self.node.completion_waits.command(self.engine, op.queue, op.message_id, op.wait_ms, op.kind, client,
                                                      self.principal.allows("admin", op.queue), self, op.request_id)
        if kind is ForwardSessionOp:
            self._queue(op.queue, "post", op.request_id)
            self.reply(op.request_id, self.node.forward_root.session(self, op))
            return None
        if kind is ForwardDataOp:
            self._queue(op.queue, "post", op.request_id)
            self.node.forward_root.data(self, op)
            return None
        raise QueueError(e.E_BAD_FRAME, f"unsupported operation {kind.__name__}")

    def _channel_op(self, op: Any) -> c.Command | None:
        hub = self.node.channels
        kind = type(op)
        if kind is PublishOp:
            check_payload(op.payload, self._body_bytes_max)
            check_dedupe_id(op.dedupe_id)
            return hub.publish_command(self, op.channel, op.payload, op.dedupe_id, op.request_id)
        if kind is ChannelSubscribeOp:
            if op.subscribe and op.durable is not None:
                hub.subscribe_durable(self, op.channels, op.durable, op.request_id)
                return None
            if op.subscribe:
                answer, lasts = hub.subscribe(self, op.channels)
                self.reply(op.request_id, answer)
                for item in lasts:
                    self._emit(item)
                return None
            hub.unsubscribe(self, op.channels)
        elif kind is AdvertiseOp:
            hub.advertise(self, op.channels, op.advertise, op.leader)
        elif kind is ChannelAckOp:
            return hub.ack(self, op.channel, op.message_id, op.request_id)
        elif kind is ChannelFetchOp:
            self.reply(op.request_id, hub.mechanisms.fetch(self.principal, op.channel, op.message_id))
            return None
        elif kind is ChannelOffersOp:
            self.takes_offers = True
        else:
            # A delivery report tells who took a message: for those who may publish to the
            # channel, as a message's status is for its queue's producers (issue 32, Low).
            if not self.principal.allows("post", op.channel):
                raise QueueError(e.E_FORBIDDEN, f"client {self.principal.client_id} may not post on {op.channel}")
            self.reply(op.request_id, hub.report(op.channel, op.message_id))
            return None
        self.reply(op.request_id, None)
        return None

    def _refused_acks(self, queue: str, request_id: int, items: tuple[tuple[int, str], ...], *, batch: bool) -> bool:
        """Acks refused for want of `delete` from a client that may `get`: their leases are
        released, then the refusal says so (docs/PROTOCOL.md, "Grants"). False when the rule
        does not apply (the acks go on, or are refused, as usual)."""
        if not is_valid_queue_name(queue) or queue.startswith(CHANNEL_PREFIX) \
                or not self.principal.releases_refused_ack(queue):
            return False
        answer = RefusedAcks(self, request_id, self.principal, queue, [message_id for message_id, _ in items], batch)
        for position, (message_id, receipt) in enumerate(items):
            self.engine.submit(c.Ack(queue, message_id, receipt, self.principal.client_id, answer, position,
                                     release=True))
        return True

    def _took(self, queue: str, message_ids: list[int]) -> None:
        """A recipient answered for messages it was given (fault surveillance sees it alive)."""
        recipient = self.recipients.get(queue)
        if recipient is not None:
            self.node.surveillance.took(queue, recipient, message_ids)

    def _own_subscription(self, subscription_id: int) -> None:
        if subscription_id not in self.subscriptions:
            raise QueueError(e.E_BAD_REQUEST, f"subscription {subscription_id} is not on this connection")


class RefusedAcks:
    """The Replier of the releases that answer acks refused for want of `delete`: once every
    release is answered, the acks are refused with E_FORBIDDEN saying what became of each
    message (one error for an AckOp; one outcome per item for an AckBatchOp, as AckMany
    answers). A release refused for E_NOT_MASTER refuses the acks so: the client asks the
    master, where this rule runs again."""

    def __init__(self, connection: ClientConnection, request_id: int, principal: Principal, queue: str,
                 message_ids: list[int], batch: bool) -> None:
        self._connection, self._request_id, self._principal = connection, request_id, principal
        self._queue, self._message_ids, self._batch = queue, message_ids, batch
        self._outcomes: dict[int, QueueError | None] = {}

    def reply(self, position: int, result: Any) -> None:
        self._answered(position, None)

    def fail(self, position: int, error: QueueError) -> None:
        self._answered(position, error)

    def _answered(self, position: int, error: QueueError | None) -> None:
        self._outcomes[position] = error
        if len(self._outcomes) < len(self._message_ids):
            return
        moved = next((o for o in self._outcomes.values() if o is not None and o.code == e.E_NOT_MASTER.code), None)
        if moved is not None:
            self._connection.fail(self._request_id, moved)
            return
        refusals = [QueueError(e.E_FORBIDDEN, refused_ack_text(self._principal, self._queue, message_id,
                                                               self._outcomes[item]))
                    for item, message_id in enumerate(self._message_ids)]
        if self._batch:
            self._connection.reply(self._request_id, [[r.code, r.message] for r in refusals])
        else:
            self._connection.fail(self._request_id, refusals[0])


async def websocket(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    config = node.config
    ws = web.WebSocketResponse(max_msg_size=config.body_bytes_max * FRAME_BODIES + FRAME_SLACK_BYTES, heartbeat=30.0)
    await ws.prepare(request)
    principal = request["principal"]
    connection = ClientConnection(ws, principal, node)
    node.connections.add(connection)
    record = node.engine.clients.get(principal.client_id)
    if principal.client_id != CLUSTER_CLIENT and (record is None or record["grants"] != principal.grants):
        # The client was removed, or its grants changed, while the upgrade was under way (after
        # it was authenticated, before this session was listed for node.py's _clients_changed).
        connection.close_soon(QueueError(e.E_UNAUTHENTICATED if record is None else e.E_FORBIDDEN,
                                         "the client was removed" if record is None
                                         else "the client's grants changed"))
    # A session is authorised once, at its upgrade: it ends after websocket_session_max_s, so
    # no session outlives its signature by more (issue 32, item 4); the client reconnects,
    # signing anew. (A removed client's or narrowed grant's sessions end at once: node.py.)
    expiry = asyncio.get_running_loop().call_later(
        config.websocket_session_max_s, connection.close_soon,
        QueueError(e.E_SESSION_EXPIRED, f"the session reached its lifetime of {config.websocket_session_max_s:g} s; "
                                        "connect again"))
    try:
        await connection.serve()
    finally:
        expiry.cancel()
        node.connections.discard(connection)
    return ws
