"""`NodeConnection`: the client library's WebSocket (`GET /v1/ws`) to ONE node.

It owns everything that lives and dies with one socket: request ids, the calls of this
event-loop turn coalesced into batch ops, the frames the writer sends, the futures the reader
resolves, each call's deadline, reconnecting with backoff, what is sent again after a lost
connection, and the subscriptions and channels made through this socket. It knows nothing of
the cluster map: which node a queue's traffic goes to is `client/router.py`'s business, and
the application's calls are `client/aio.py`'s (`AsyncClient`). Kept apart because it is the
hot path: per message one future and a few list appends, no task, no timer, no log line.

Why it is shaped like this: the server's cost is per item, per frame and per LMDB
transaction, and the client's cost is per await, so the connection coalesces on two levels.
Concurrent enqueues on one queue and priority join one open enqueue batch, and concurrent
acks on one queue one open ack batch; every other call becomes one typed op. The first call
of a turn schedules one flush (`loop.call_soon`), which closes the open batches into batch
ops (tags 9 and 10) and wakes the writer task; the writer sends everything queued as one
frame (more only past the size limits, docs/PROTOCOL.md "WebSocket frames"). While a send
waits for the socket to drain, new calls pile up for the next frame, so batches grow with load.

Failures: the socket reconnects on its own with bounded exponential backoff. An enqueue batch
that was in flight when the connection dropped is sent again with the SAME dedupe ids, for a
bounded time and number of attempts, so each message is stored once, and so is an ack batch
(a repeat that finds its message gone is answered as acked); any other in-flight op fails
with `E_UNAVAILABLE` and `outcome_unknown=True`. A `Closing` item from the server fails
pending ops with its code, and E_UNAUTHENTICATED or E_FORBIDDEN stops reconnecting for good.
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from yarl import URL

from client.batching import batch_bounds, frames
from client.credentials import Credentials
from client.http import HttpClient, error_from_status
from wire.errors import (
    E_BAD_FRAME,
    E_INTERNAL,
    E_NOT_ENOUGH_REPLICAS,
    E_NOT_MASTER,
    E_OVERLOADED,
    E_QUEUE_UNAVAILABLE,
    E_REPLAYED_REQUEST,
    E_SESSION_EXPIRED,
    E_SHUTTING_DOWN,
    E_TIMEOUT,
    E_UNAVAILABLE,
    E_UNKNOWN_MESSAGE,
    E_VERSION_MISMATCH,
    QueueError,
)
from wire.protocol import (
    BATCH_ITEMS_MAX,
    AckBatchOp,
    AdvertiseOp,
    ChannelEnded,
    ChannelMessage,
    ChannelOffer,
    ClientOp,
    Closing,
    CreditOp,
    Delivery,
    EnqueueBatchOp,
    ErrorReply,
    ExtendOp,
    ForwardRate,
    FrameError,
    OkReply,
    ReceiveOp,
    ReleaseOp,
    SubscribeOp,
    SubscriptionEnded,
    UnsubscribeOp,
    decode_server_frame,
)
from wire.version_headers import CLIENT_HEADER, NODE_HEADER, client_header

if TYPE_CHECKING:
    from client.consumer import Consumer

FATAL_CLOSING_CODES = frozenset({"E_UNAUTHENTICATED", "E_FORBIDDEN"})
FRAME_BYTES_IN_MAX = 64 * 1024 * 1024
CLEANUP_TIMEOUT_S = 2.0
_SUBSCRIPTION_OPS = (SubscribeOp, CreditOp, UnsubscribeOp)
# Sent again after a lost connection, for enqueue_retry_time_s: an enqueue batch is stored once by
# its dedupe ids; an ack batch's repeat finds the messages it acked gone (see _resolve).
_RESENT_OPS = (EnqueueBatchOp, AckBatchOp)
ACK_RESEND_DELAY_S = 0.1       # an ack batch refused for one of RETRIED_CODES goes out again after this
# A call refused for a passing state of the cluster (a node restarting or unreachable, a handoff
# or failover under way, a restarted master waiting for its lease, a full inbox, a replica out of
# sync under min_in_sync 2) is asked again (AsyncClient._until_deadline; an ack batch here, see
# _resend_later). E_QUEUE_FULL and E_STORAGE_FULL come back at once: they are back-pressure for
# the application to decide on; E_TIMEOUT has used the deadline up.
RETRIED_CODES = frozenset(kind.code for kind in (E_UNAVAILABLE, E_NOT_MASTER, E_QUEUE_UNAVAILABLE, E_OVERLOADED,
                                                 E_SHUTTING_DOWN, E_NOT_ENOUGH_REPLICAS, E_SESSION_EXPIRED))
# What a pending op resolves: one future, or one per item of a batch op, in item order.
Target = asyncio.Future[Any] | list[asyncio.Future[Any]]
Headers = tuple[tuple[str, str], ...]      # a message's headers as a batch key (hashable)


class ChannelListener(Protocol):
    """What a connection tells about the channels subscribed through it (client/channels.py)."""
    def deliver(self, item: ChannelMessage | ChannelOffer, node: NodeConnection) -> None: ...
    def ended(self, item: ChannelEnded, node: NodeConnection) -> None: ...
    def reconnected(self, node: NodeConnection) -> None: ...


# The library's own source of backoff jitter: an application that seeds the global random
# module (a simulation, a property test) is not disturbed by reconnects in the background.
_JITTER = random.Random()
_LET_GO_KEPT = 256      # subscriptions let go of whose queue is remembered (_on_delivery)


def jittered(delay_s: float) -> float:
    """A backoff pause: `delay_s` times a random factor in [0.5, 1]."""
    return delay_s * _JITTER.uniform(0.5, 1.0)


class Leases(Protocol):
    """Who a leased message's calls go to (client/consumer.py Message): its node's connection,
    or the router, which sends them where the cluster map says now."""
    def ack(self, queue: str, message_id: int, receipt: str) -> Awaitable[None]: ...
    async def release(self, queue: str, message_id: int, receipt: str) -> None: ...
    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None: ...


def ignore_outcome(future: asyncio.Future[Any]) -> None:
    """Done-callback of fire-and-forget ops: read the outcome so asyncio does not report it."""
    if not future.cancelled():
        future.exception()


def item_error(outcome: Any) -> QueueError:
    """The error of one item of a batch answer, `[code, message]`; it was not applied."""
    try:
        return QueueError(str(outcome[0]), str(outcome[1]))
    except (TypeError, IndexError):
        return QueueError(E_INTERNAL, f"a malformed batch outcome {outcome!r}", outcome_unknown=True)


class EnqueueBatch:
    """The enqueue calls of one turn for one (queue, priority, ttl, delay, headers)."""

    __slots__ = ("dedupe_ids", "futures", "payloads", "size_bytes")

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.dedupe_ids: list[str] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.size_bytes = 0


class AckBatch:
    """The ack calls of one turn for one queue."""

    __slots__ = ("futures", "items")

    def __init__(self) -> None:
        self.items: list[tuple[int, str]] = []
        self.futures: list[asyncio.Future[Any]] = []


class NodeConnection:
    """One node's WebSocket, its calls in flight and what was made through it. Every method
    must be called from the event loop that first used it."""

    def __init__(self, url: str, credentials: Credentials, *, request_timeout_s: float, connect_timeout_s: float,
                 reconnect_delay_initial_s: float, reconnect_delay_max_s: float, enqueue_retry_time_s: float,
                 enqueue_attempts_max: int, in_flight_max: int, frame_bytes_max: int, heartbeat_s: float,
                 ca_file: str,
                 forward_rates: dict[tuple[str, str], Callable[[float | None], None]] | None = None) -> None:
        self.url = url.rstrip("/")
        self._signer = credentials.signer()
        self.http = HttpClient(self.url, self._signer, request_timeout_s=request_timeout_s, ca_file=ca_file)
        base = URL(self.url)
        self._ws_path = base.raw_path.rstrip("/") + "/v1/ws"
        ws_scheme = {"http": "ws", "https": "wss"}.get(base.scheme, base.scheme)
        self._ws_url = URL(f"{ws_scheme}://{base.raw_authority}{self._ws_path}", encoded=True)
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_delay_initial_s = reconnect_delay_initial_s
        self._reconnect_delay_max_s = reconnect_delay_max_s
        self._enqueue_retry_time_s = enqueue_retry_time_s
        self._enqueue_attempts_max = enqueue_attempts_max
        self._in_flight_max = in_flight_max
        self.frame_bytes_max = frame_bytes_max
        self._heartbeat_s = heartbeat_s
        self.request_timeout_s = request_timeout_s
        # (queue, forward) -> what to call with the rate a root sends (forward sessions; one
        # dict shared by every connection of a client, wherever the sessions are).
        self.forward_rates: dict[tuple[str, str], Callable[[float | None], None]] = \
            forward_rates if forward_rates is not None else {}
        # Channels (client/channels.py): the inbox told about this socket's channel items, and
        # the channels subscribed and advertised through this socket.
        self.channel_listener: ChannelListener | None = None
        self.channels_here: set[str] = set()
        self.advertised_here: dict[str, bool] = {}     # channel -> advertised as its leader
        self.sessions = 0                          # sockets opened so far
        # Every call over the WebSocket has a deadline (see _track): (when, request id), a heap
        # with answered calls left in it until they reach its top.
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        # (queue, priority, ttl_ms, delay_ms, headers) -> the calls of this turn to put in one batch op
        self._open_enqueues: dict[tuple[str, int, int, int, Headers], EnqueueBatch] = {}
        self._open_acks: dict[str, AckBatch] = {}
        self._flush_scheduled = False
        self._calls_in_flight = 0  # futures handed out and not yet answered
        self._pending: dict[int, tuple[Target, ClientOp]] = {}
        self._outgoing: list[ClientOp] = []
        self._writer_waiter: asyncio.Future[None] | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._attempt_waiters: list[asyncio.Future[QueueError | None]] = []
        self._fatal: QueueError | None = None
        self._closed = False
        self._room = asyncio.Event()
        self._room_needed = False
        self._retry_deadline: dict[int, float] = {}
        self._retry_attempts: dict[int, int] = {}
        # Subscriptions (client/consumer.py): the consumers attached here, by subscription id,
        # and by the request id of their subscribe while it is unanswered.
        self.consumers: set[Consumer] = set()
        self._consumers_by_subscription: dict[int, Consumer] = {}
        # Queues of subscriptions let go of lately: a push on its way for one is released at once.
        self._let_go: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.subscribing: dict[int, Consumer] = {}

    # --- lifecycle ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usable(self) -> bool:
        """Not closed, and not stopped by a fatal error (its credentials were refused)."""
        return not self._closed and self._fatal is None

    async def connect(self) -> None:
        """Open the WebSocket now rather than on the first call; raises the first attempt's
        error (reconnecting goes on in the background unless the error is fatal)."""
        self.start()
        if self._ws is not None:
            return
        outcome: asyncio.Future[QueueError | None] = self.bound_loop().create_future()
        self._attempt_waiters.append(outcome)
        error = await outcome
        if error is not None:
            raise error

    async def close(self) -> None:
        """Unsubscribe consumers (releasing what they buffered), fail what is still pending,
        close the socket and the HTTP session."""
        if self._closed:
            return
        for consumer in list(self.consumers):
            await consumer.close()
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        self._fail_everything(QueueError(E_UNAVAILABLE, "the client is closed"))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        await self.http.close()

    def bound_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def start(self) -> None:
        if self._closed:
            raise QueueError(E_UNAVAILABLE, "the client is closed")
        if self._fatal is not None:  # a fresh error: this call was never sent
            raise QueueError(self._fatal.kind, self._fatal.message)
        if self._supervisor is None:
            self._supervisor = self.bound_loop().create_task(self._supervise())

    def listen_channels(self, listener: ChannelListener) -> None:
        """Tell `listener` the channel items this socket gets (client/channels.py)."""
        self.channel_listener = listener

    # --- the per-call path --------------------------------------------------------------------
    def next_id(self) -> int:
        """A request id of this connection."""
        return next(self._ids)

    def has_room(self) -> bool:
        return self._calls_in_flight < self._in_flight_max

    def _new_future(self) -> asyncio.Future[Any]:
        if self._supervisor is None or self._fatal is not None or self._closed:
            self.start()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)  # type: ignore[union-attr]
        self._calls_in_flight += 1
        return self._loop.create_future()  # type: ignore[union-attr]

    def submit(self, op: ClientOp) -> asyncio.Future[Any]:
        """Queue one op for this turn's frame and return the future its answer resolves."""
        future = self._new_future()
        self._pending[op.request_id] = (future, op)
        self._track(op)
        self._outgoing.append(op)
        return future

    def submit_quietly(self, op: ClientOp) -> None:
        self.submit(op).add_done_callback(ignore_outcome)

    async def call(self, op: ClientOp) -> Any:
        """One op on this node's socket, answered."""
        if self._calls_in_flight >= self._in_flight_max:
            await self.wait_for_room()
        return await self.submit(op)

    def _flush(self) -> None:
        """Once per turn: close the open batches into ops and wake the writer."""
        self._flush_scheduled = False
        if self._open_enqueues:
            batches, self._open_enqueues = self._open_enqueues, {}
            for (queue, priority, ttl_ms, delay_ms, headers), batch in batches.items():
                self._queue_enqueue_batch(queue, priority, ttl_ms, delay_ms, dict(headers) if headers else None, batch)
        if self._open_acks:
            acks, self._open_acks = self._open_acks, {}
            for queue, ack_batch in acks.items():
                for start in range(0, len(ack_batch.items), BATCH_ITEMS_MAX):
                    end = start + BATCH_ITEMS_MAX
                    op = AckBatchOp(next(self._ids), queue, tuple(ack_batch.items[start:end]))
                    self._pending[op.request_id] = (ack_batch.futures[start:end], op)
                    self._track(op)
                    self._outgoing.append(op)
        waiter = self._writer_waiter
        if waiter is not None and self._outgoing:
            self._writer_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _queue_enqueue_batch(self, queue: str, priority: int, ttl_ms: int, delay_ms: int,
                             headers: dict[str, str] | None, batch: EnqueueBatch) -> None:
        """One op for the batch, or several when it passes the item or byte limit."""
        payloads, count = batch.payloads, len(batch.payloads)
        if count <= BATCH_ITEMS_MAX and batch.size_bytes <= self.frame_bytes_max:
            op = EnqueueBatchOp(next(self._ids), queue, priority, tuple(payloads), tuple(batch.dedupe_ids), ttl_ms,
                                delay_ms, headers)
            self._pending[op.request_id] = (batch.futures, op)
            self._track(op)
            self._outgoing.append(op)
            return
        for start, end in batch_bounds(payloads, self.frame_bytes_max):
            op = EnqueueBatchOp(next(self._ids), queue, priority, tuple(payloads[start:end]),
                                tuple(batch.dedupe_ids[start:end]), ttl_ms, delay_ms, headers)
            self._pending[op.request_id] = (batch.futures[start:end], op)
            self._track(op)
            self._outgoing.append(op)

    def _track(self, op: ClientOp) -> None:
        """Give a call its deadline: request_timeout_s after it was asked (a receive's wait
        added). A call still unanswered then fails with E_TIMEOUT, retriable and with its
        outcome unknown once it was sent (a node that paused or a link that black-holes
        answers nothing and breaks nothing; without a deadline the call waited for ever)."""
        loop = self.bound_loop()
        wait_s = op.wait_ms / 1000 if type(op) is ReceiveOp else 0.0
        deadline = loop.time() + self.request_timeout_s + wait_s
        heapq.heappush(self._deadlines, (deadline, op.request_id))
        timer = self._deadline_timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._deadline_timer = loop.call_at(deadline, self._expire_calls)

    def _expire_calls(self) -> None:
        self._deadline_timer = None
        loop = self.bound_loop()
        now, heap, pending = loop.time(), self._deadlines, self._pending
        if len(heap) > 2 * len(pending) + 1024:          # answered calls pile up: keep it bounded
            self._deadlines = heap = [entry for entry in heap if entry[1] in pending]
            heapq.heapify(heap)
        expired = []
        while heap and (heap[0][1] not in pending or heap[0][0] <= now):
            _, request_id = heapq.heappop(heap)
            if request_id in pending:
                expired.append(request_id)
        if expired:
            unsent = {op.request_id for op in self._outgoing}
            for request_id in expired:
                sent = request_id not in unsent or request_id in self._retry_attempts
                self._fail_op(request_id, QueueError(E_TIMEOUT, f"no answer within {self.request_timeout_s} s",
                                                     outcome_unknown=sent))
            self._outgoing = [op for op in self._outgoing if op.request_id in pending]
            self._forget_retries()
            self._wake_room()
        if heap:
            self._deadline_timer = loop.call_at(heap[0][0], self._expire_calls)

    async def wait_for_room(self) -> None:
        """Back-pressure: at most `in_flight_max` calls wait for answers at once."""
        while self._calls_in_flight >= self._in_flight_max:
            self.start()
            self._room_needed = True
            self._room.clear()
            await self._room.wait()

    def join_enqueue(self, queue: str, priority: int, payload: bytes, dedupe_id: str,
                     ttl_ms: int = 0, delay_ms: int = 0, headers: Headers = ()) -> asyncio.Future[Any]:
        """Add one enqueue to this turn's batch of its queue, priority and options."""
        key = (queue, priority, ttl_ms, delay_ms, headers)
        batch = self._open_enqueues.get(key)
        if batch is None:
            batch = self._open_enqueues[key] = EnqueueBatch()
        future = self._new_future()
        batch.payloads.append(payload)
        batch.dedupe_ids.append(dedupe_id)
        batch.futures.append(future)
        batch.size_bytes += len(payload)
        return future

    # --- a leased message's calls, at this node (the node that leased it) -----------------------
    def ack(self, queue: str, message_id: int, receipt: str) -> Awaitable[None]:
        """Acknowledge a leased message here; concurrent acks on a queue share one batch."""
        if self._calls_in_flight >= self._in_flight_max:
            return self._ack_when_room(queue, message_id, receipt)
        return self._join_ack(queue, message_id, receipt)

    async def _ack_when_room(self, queue: str, message_id: int, receipt: str) -> None:
        await self.wait_for_room()
        await self._join_ack(queue, message_id, receipt)

    def _join_ack(self, queue: str, message_id: int, receipt: str) -> asyncio.Future[Any]:
        batch = self._open_acks.get(queue)
        if batch is None:
            batch = self._open_acks[queue] = AckBatch()
        future = self._new_future()
        batch.items.append((message_id, receipt))
        batch.futures.append(future)
        return future

    async def release(self, queue: str, message_id: int, receipt: str) -> None:
        await self.call(ReleaseOp(next(self._ids), queue, message_id, receipt))

    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        await self.call(ExtendOp(next(self._ids), queue, message_id, receipt, round(visibility_timeout_s * 1000)))

    # --- connection supervision ---------------------------------------------------------------
    async def _supervise(self) -> None:
        """Connect, serve until the socket ends, reconnect with backoff; forever, until closed
        or told something no reconnect can fix."""
        delay_s = self._reconnect_delay_initial_s
        while not self._closed:
            try:
                ws = await self.open_socket()
            except QueueError as error:
                # A replay refusal of an upgrade is of a copy of our own (this client signs
                # each attempt anew): connecting again is a new request, not a replay.
                if not error.retriable and error.code != E_REPLAYED_REQUEST.code:
                    self._set_fatal(error)
                    return
                self._on_connect_failed(error)
                await asyncio.sleep(jittered(delay_s))
                delay_s = min(delay_s * 2, self._reconnect_delay_max_s)
                continue
            delay_s = self._reconnect_delay_initial_s
            self._resolve_attempt_waiters(None)
            cause = await self._serve(ws)
            if cause.code in FATAL_CLOSING_CODES:
                self._set_fatal(cause)
                return
            self._on_connection_lost(cause)

    async def open_socket(self) -> aiohttp.ClientWebSocketResponse:
        """A signed WebSocket upgrade to this node (the supervisor's; tests drive one by hand)."""
        headers = self._signer.headers("GET", self._ws_path, [], b"", audience=str(self._ws_url))
        headers[CLIENT_HEADER] = client_header()     # this client's versions (a 0.1.0 node ignores them)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                ws = await self.http.session().ws_connect(
                    self._ws_url, headers=headers, heartbeat=self._heartbeat_s,
                    max_msg_size=FRAME_BYTES_IN_MAX, timeout=aiohttp.ClientWSTimeout(ws_close=CLEANUP_TIMEOUT_S))
        except aiohttp.WSServerHandshakeError as exc:
            code = exc.headers.get("X-Error-Code") if exc.headers else None
            if exc.headers:
                self.http.note_node(exc.headers)
            if code == E_VERSION_MISMATCH.code:
                # A refused upgrade's body does not reach the client: name both sides here.
                raise QueueError(code, f"the node ({exc.headers.get(NODE_HEADER) if exc.headers else '?'}) shares no "
                                       f"client protocol version with this client ({client_header()}): upgrade "
                                       "the older side") from None
            raise (QueueError(code, f"the WebSocket was refused (HTTP {exc.status})") if code
                   else error_from_status(exc.status)) from None
        except TimeoutError:
            raise QueueError(E_UNAVAILABLE, f"no WebSocket from {self.url} in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise QueueError(E_UNAVAILABLE, f"cannot reach {self.url}: {exc}") from None
        answer = getattr(ws, "_response", None)     # the 101 answer (aiohttp keeps no public handle)
        self.http.note_node(answer.headers if answer is not None else {})
        return ws

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse) -> QueueError:
        """Run the reader and the writer until either ends; return why the socket is done."""
        loop = self.bound_loop()
        self._ws = ws
        self.sessions += 1
        for consumer in list(self.consumers):
            consumer._subscribe()
        for leads in sorted(set(self.advertised_here.values())):   # a new socket: the node forgot the old one's
            names = tuple(sorted(name for name, lead in self.advertised_here.items() if lead == leads))
            self.submit_quietly(AdvertiseOp(next(self._ids), names, True, leads))
        if self.sessions > 1 and self.channel_listener is not None and self.channels_here:
            self.channel_listener.reconnected(self)
        reader = loop.create_task(self._read_loop(ws))
        writer = loop.create_task(self._write_loop(ws))
        try:
            await asyncio.wait((reader, writer), return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                # The writer failed; the reader may still hold the reason (a Closing item),
                # and a broken socket ends it promptly anyway.
                await asyncio.wait((reader,), timeout=CLEANUP_TIMEOUT_S)
        finally:
            self._ws = None
            writer.cancel()
            reader.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            await asyncio.shield(self._close_socket(ws))
        if reader.done() and not reader.cancelled() and reader.exception() is None:
            return reader.result()
        failed = [t for t in (reader, writer) if t.done() and not t.cancelled() and t.exception()]
        reason = repr(failed[0].exception()) if failed else "closed"
        return QueueError(E_UNAVAILABLE, f"the connection failed: {reason}", outcome_unknown=True)

    @staticmethod
    async def _close_socket(ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            await asyncio.wait_for(ws.close(), CLEANUP_TIMEOUT_S)
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass  # the socket is going away either way; nothing left to tell the server

    async def _read_loop(self, ws: aiohttp.ClientWebSocketResponse) -> QueueError:
        while True:
            message = await ws.receive()
            if message.type is aiohttp.WSMsgType.BINARY:
                try:
                    items = decode_server_frame(message.data)
                except FrameError as exc:
                    return QueueError(E_BAD_FRAME, f"the server sent a bad frame: {exc}",
                                      outcome_unknown=True)
                closing = self._dispatch(items)
                if closing is not None:
                    return closing
            elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                  aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                detail = message.extra or message.data or "closed"
                return QueueError(E_UNAVAILABLE, f"the connection was lost ({detail})",
                                  outcome_unknown=True)

    async def _write_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        loop = self.bound_loop()
        try:
            while True:
                if not self._outgoing:
                    self._writer_waiter = loop.create_future()
                    await self._writer_waiter
                    continue
                ops, self._outgoing = self._outgoing, []
                for frame in frames(ops, self.frame_bytes_max, self._fail_op):
                    await ws.send_bytes(frame)
        finally:
            self._writer_waiter = None

    # --- answers from the server ----------------------------------------------------------------
    def _dispatch(self, items: list[Any]) -> QueueError | None:
        """Resolve the futures a frame answers; returns the error of a Closing item."""
        pending = self._pending
        for item in items:
            kind = type(item)
            if kind is OkReply:
                entry = pending.pop(item.request_id, None)
                if entry is not None:
                    self._resolve(entry[0], entry[1], item.result)
            elif kind is ErrorReply:
                if item.request_id == 0:  # the whole frame was refused: we cannot tell whose ops
                    return QueueError(item.code, item.message, outcome_unknown=True)
                error = QueueError(item.code, item.message, outcome_unknown=item.outcome_unknown)
                if not self._resend_later(item.request_id, error):
                    self._fail_op(item.request_id, error)
            elif kind is SubscriptionEnded:
                self._end_subscription(item.subscription_id, QueueError(item.code, item.message))
            elif kind is Delivery:
                self._on_delivery(item)
            elif kind is ChannelMessage or kind is ChannelOffer:
                if self.channel_listener is not None:
                    self.channel_listener.deliver(item, self)
            elif kind is ChannelEnded:
                if self.channel_listener is not None:
                    self.channel_listener.ended(item, self)
            elif kind is ForwardRate:
                listener = self.forward_rates.get((item.queue, item.forward))
                if listener is not None:
                    listener(item.rate)
            elif kind is Closing:
                return QueueError(item.code, item.message, outcome_unknown=True)
        if self._retry_deadline:
            self._forget_retries()
        if self._room_needed:
            self._wake_room()
        return None

    def _resolve(self, target: Target, op: ClientOp, result: Any) -> None:
        kind = type(op)
        if (kind is EnqueueBatchOp or kind is AckBatchOp) and type(target) is list:
            futures: list[asyncio.Future[Any]] = target  # type: ignore[assignment]
            try:
                outcomes = result[1] if kind is EnqueueBatchOp else result
                if len(outcomes) != len(futures):
                    raise ValueError("one outcome per item")
            except (TypeError, IndexError, ValueError):
                self._fail_target(target, QueueError(E_INTERNAL, "a malformed batch answer", outcome_unknown=True))
                return
            self._calls_in_flight -= len(futures)
            # An ack sent again after a lost connection may have been applied the first time:
            # then its message is gone, which is what the ack asked for.
            acked_before = kind is AckBatchOp and op.request_id in self._retry_attempts
            for future, outcome in zip(futures, outcomes, strict=True):
                if future.done():
                    continue
                if outcome is None or type(outcome) is int:
                    future.set_result(outcome)
                elif acked_before and item_error(outcome).code == E_UNKNOWN_MESSAGE.code:
                    future.set_result(None)
                else:
                    future.set_exception(item_error(outcome))
            return
        if kind is SubscribeOp:
            self._on_subscribed(op.request_id, result)
        self._calls_in_flight -= 1
        single: asyncio.Future[Any] = target  # type: ignore[assignment]
        if not single.done():
            single.set_result(result)

    def _fail_op(self, request_id: int, error: BaseException) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        target, op = entry
        if type(op) is SubscribeOp:
            consumer = self.subscribing.pop(request_id, None)
            if consumer is not None and isinstance(error, QueueError):
                consumer._on_subscribe_failed(error)
        self._fail_target(target, error)

    def _fail_target(self, target: Target, error: BaseException) -> None:
        futures = target if isinstance(target, list) else [target]
        self._calls_in_flight -= len(futures)
        for future in futures:
            if not future.done():
                future.set_exception(error)

    def _forget_retries(self) -> None:
        for request_id in [r for r in self._retry_deadline if r not in self._pending]:
            del self._retry_deadline[request_id]
            self._retry_attempts.pop(request_id, None)

    def _wake_room(self) -> None:
        if self._calls_in_flight < self._in_flight_max:
            self._room_needed = False
            self._room.set()

    def _on_subscribed(self, request_id: int, result: Any) -> None:
        consumer = self.subscribing.pop(request_id, None)
        if consumer is not None and type(result) is int:
            self._consumers_by_subscription[result] = consumer
            consumer._on_subscribed(result)

    def _on_delivery(self, delivery: Delivery) -> None:
        consumer = self._consumers_by_subscription.get(delivery.subscription_id)
        if consumer is None or consumer.closed:
            # Pushed after we let go of the subscription: hand the leases straight back.
            queue = consumer.queue if consumer is not None else self._let_go.get(delivery.subscription_id)
            if queue is not None and self._ws is not None:
                for delivered in delivery.messages:
                    self.submit_quietly(ReleaseOp(next(self._ids), queue, delivered.message_id, delivered.receipt))
            return
        consumer._on_messages(delivery.messages)

    def _end_subscription(self, subscription_id: int, error: QueueError | None) -> None:  # None: let go of
        consumer = self._consumers_by_subscription.pop(subscription_id, None)
        if consumer is not None:
            self._remember_let_go(subscription_id, consumer.queue)
            if error is not None:
                consumer._on_subscription_ended(error)

    def forget_subscription(self, subscription_id: int) -> None:
        self._end_subscription(subscription_id, None)

    def _remember_let_go(self, subscription_id: int, queue: str) -> None:
        self._let_go[subscription_id] = queue
        if len(self._let_go) > _LET_GO_KEPT:
            self._let_go.popitem(last=False)

    # --- losing the connection --------------------------------------------------------------------
    def _on_connection_lost(self, cause: QueueError) -> None:
        """Sent enqueue and ack batches go out again (_RESENT_OPS); other sent ops fail with
        `cause`; ops never sent wait for the next connection."""
        loop_time = self.bound_loop().time()
        unsent = {op.request_id for op in self._outgoing}
        resend: list[ClientOp] = []
        for request_id, (_, op) in list(self._pending.items()):
            if request_id in unsent:
                continue
            if type(op) in _RESENT_OPS and self._may_retry(request_id, loop_time):
                resend.append(op)
                continue
            self._fail_op(request_id, QueueError(cause.kind, cause.message, outcome_unknown=True))
        # Subscription ops name subscriptions of the dead socket; consumers re-subscribe.
        for op in [op for op in self._outgoing if isinstance(op, _SUBSCRIPTION_OPS)]:
            self._fail_op(op.request_id, QueueError(E_UNAVAILABLE, "resubscribing"))
        self._outgoing = resend + [op for op in self._outgoing if op.request_id in self._pending]
        self.subscribing.clear()
        self._consumers_by_subscription.clear()
        self._let_go.clear()          # subscription ids are the socket's
        for consumer in self.consumers:
            consumer._on_connection_lost()
        if self.channel_listener is not None and self.channels_here:
            self.channel_listener.reconnected(self)
        self._wake_room()

    def _resend_later(self, request_id: int, error: QueueError) -> bool:
        """An ack batch refused for a passing reason (RETRIED_CODES: a master restarting or
        handing off) goes out again after ACK_RESEND_DELAY_S, within enqueue_retry_time_s, as
        after a lost connection; True when it will."""
        entry = self._pending.get(request_id)
        if entry is None or type(entry[1]) is not AckBatchOp or error.code not in RETRIED_CODES:
            return False
        loop = self.bound_loop()
        if not self._may_retry(request_id, loop.time()):
            return False
        loop.call_later(ACK_RESEND_DELAY_S, self._resend, request_id)
        return True

    def _resend(self, request_id: int) -> None:
        entry = self._pending.get(request_id)
        if entry is not None and not self._closed and all(op.request_id != request_id for op in self._outgoing):
            self._outgoing.append(entry[1])       # (a lost connection may have queued it again already)
            self._flush()

    def _may_retry(self, request_id: int, loop_time: float) -> bool:
        deadline = self._retry_deadline.setdefault(request_id, loop_time + self._enqueue_retry_time_s)
        attempts = self._retry_attempts.get(request_id, 0) + 1
        self._retry_attempts[request_id] = attempts
        return attempts <= self._enqueue_attempts_max and loop_time < deadline

    def _on_connect_failed(self, error: QueueError) -> None:
        """Ops waiting for a connection fail now, except enqueues inside their retry time."""
        loop_time = self.bound_loop().time()
        for op in list(self._outgoing):
            request_id = op.request_id
            if type(op) in _RESENT_OPS:
                deadline = self._retry_deadline.setdefault(request_id, loop_time + self._enqueue_retry_time_s)
                if loop_time < deadline:
                    continue
            was_sent = request_id in self._retry_attempts
            self._fail_op(request_id, QueueError(error.kind, error.message, outcome_unknown=was_sent))
        self._outgoing = [op for op in self._outgoing if op.request_id in self._pending]
        self._resolve_attempt_waiters(error)
        self._wake_room()

    def _set_fatal(self, error: QueueError) -> None:
        self._fatal = error
        self._fail_everything(error)

    def _fail_everything(self, error: QueueError) -> None:
        self._flush()  # calls of this turn become ops, so they fail below like the rest
        unsent = {op.request_id for op in self._outgoing}
        for request_id in list(self._pending):
            was_sent = request_id not in unsent or request_id in self._retry_attempts
            self._fail_op(request_id, QueueError(error.kind, error.message, outcome_unknown=was_sent))
        self._outgoing = []
        for consumer in list(self.consumers):
            consumer._on_fatal(error)
        self._resolve_attempt_waiters(error)
        self._room_needed = False
        self._room.set()

    def _resolve_attempt_waiters(self, error: QueueError | None) -> None:
        waiters, self._attempt_waiters = self._attempt_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(error)
