"""`AsyncClient`: the asyncio client library, with the WebSocket (`GET /v1/ws`) as fast path.

Why it is shaped like this: the server's cost is per item, per frame and per LMDB
transaction, and the client's cost is per await, so the client coalesces on two levels.
Concurrent `enqueue()` calls on one queue and priority join one open enqueue batch, and
concurrent `ack()` calls on one queue one open ack batch; every other call becomes one
typed op. The first call of an event-loop turn schedules one flush (`loop.call_soon`),
which closes the open batches into batch ops (tags 9 and 10) and wakes the writer task;
the writer sends everything queued as one frame (more only past the size limits). While a
send waits for the socket to drain, new calls pile up for the next frame, so batches grow
with load. Per message there is one future and a few list appends: no task, no timer, no
log line.

Failures: the socket reconnects on its own with bounded exponential backoff. An enqueue
batch that was in flight when the connection dropped is sent again with the SAME dedupe
ids (every enqueue gets one), for a bounded time and number of attempts, so each message
is stored once, and so is an ack batch (a repeat that finds its message gone is answered
as acked); any other in-flight op fails with `E_UNAVAILABLE` and `outcome_unknown=True`.
Enqueues and receives refused for a passing state of the cluster (RETRIED_CODES) are asked
again with backoff until their deadline. A `Closing` item from the server fails pending ops
with its code, and E_UNAUTHENTICATED or E_FORBIDDEN stops reconnecting for good.
Subscriptions (`consume`) are re-made after any retriable failure (a reconnect, a refused
or unanswered subscribe, a handoff) with the credit still owed, where the map names the
queue's master: see `Consumer._resubscribe`.

Admin calls go over signed REST (`client/http.py`) and share the client's aiohttp session.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import os
import random
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp
from yarl import URL

from client.channels import ChannelDelivery, ChannelInbox, channel_queue
from client.credentials import Credentials, load_credentials
from client.http import Grant, HttpClient, error_from_status
from client.macro import MacroConsumer, MacroQueue
from wire.errors import (
    E_BAD_FRAME,
    E_INTERNAL,
    E_MACRO_QUEUE,
    E_NOT_ADVERTISED,
    E_NOT_ENOUGH_REPLICAS,
    E_NOT_MASTER,
    E_OVERLOADED,
    E_QUEUE_UNAVAILABLE,
    E_REPLAYED_REQUEST,
    E_SESSION_EXPIRED,
    E_SHUTTING_DOWN,
    E_TIMEOUT,
    E_UNAVAILABLE,
    E_UNKNOWN_FORWARD,
    E_UNKNOWN_MACRO,
    E_UNKNOWN_MESSAGE,
    QueueError,
)
from wire.protocol import (
    BATCH_ITEMS_MAX,
    DELAY_MS_MAX,
    FRAME_ITEMS_MAX,
    FRAME_OBJECTS_MAX,
    TTL_MS_MAX,
    AckBatchOp,
    AdvertiseOp,
    ChannelEnded,
    ChannelMessage,
    ClientOp,
    Closing,
    CreditOp,
    DeliveredMessage,
    Delivery,
    EnqueueBatchOp,
    ErrorReply,
    ExtendOp,
    ForwardDataOp,
    ForwardRate,
    ForwardSessionOp,
    FrameError,
    OkReply,
    PingOp,
    PublishOp,
    ReceiveOp,
    ReleaseOp,
    ReportOp,
    SubscribeOp,
    SubscriptionEnded,
    UnsubscribeOp,
    decode_server_frame,
    encode_frame,
    messages_from_result,
)

FATAL_CLOSING_CODES = frozenset({"E_UNAUTHENTICATED", "E_FORBIDDEN"})
FRAME_BYTES_IN_MAX = 64 * 1024 * 1024
CLEANUP_TIMEOUT_S = 2.0
_SUBSCRIPTION_OPS = (SubscribeOp, CreditOp, UnsubscribeOp)
# Sent again after a lost connection, for enqueue_retry_time_s: an enqueue batch is stored once by
# its dedupe ids; an ack batch's repeat finds the messages it acked gone (see _resolve).
_RESENT_OPS = (EnqueueBatchOp, AckBatchOp)

CredentialsArg = Credentials | str | Path | None
_T = TypeVar("_T")
# What a pending op resolves: one future, or one per item of a batch op, in item order.
Target = asyncio.Future[Any] | list[asyncio.Future[Any]]


def _batch_bounds(payloads: Sequence[bytes], frame_bytes_max: int) -> list[tuple[int, int]]:
    """Split a batch so no part passes BATCH_ITEMS_MAX items or frame_bytes_max bytes."""
    bounds, start, size_bytes = [], 0, 0
    for index, payload in enumerate(payloads):
        if index > start and (index - start >= BATCH_ITEMS_MAX or size_bytes + len(payload) > frame_bytes_max):
            bounds.append((start, index))
            start, size_bytes = index, 0
        size_bytes += len(payload)
    bounds.append((start, len(payloads)))
    return bounds


class Message:
    """A leased message; `ack()` deletes it and `release()` gives it back, through the client
    that received it."""

    __slots__ = ("_client", "deliveries", "headers", "id", "payload", "priority", "queue", "receipt")

    def __init__(self, client: AsyncClient, queue: str, delivered: DeliveredMessage) -> None:
        self.id = delivered.message_id
        self.receipt = delivered.receipt
        self.priority = delivered.priority
        self.deliveries = delivered.deliveries
        self.payload = delivered.payload
        self.headers: dict[str, str] = dict(delivered.headers or {})
        self.queue = queue
        self._client = client

    def ack(self) -> Awaitable[None]:
        return self._client.ack(self.queue, self.id, self.receipt)

    def release(self) -> Coroutine[Any, Any, None]:
        return self._client.release(self.queue, self.id, self.receipt)

    def extend(self, visibility_timeout_s: float) -> Coroutine[Any, Any, None]:
        """Give the lease `visibility_timeout_s` from now (E_LEASE_EXPIRED if it ended)."""
        return self._client.extend(self.queue, self.id, self.receipt, visibility_timeout_s)

    def keep_alive(self, visibility_timeout_s: float = 30.0, every_s: float | None = None) -> LeaseKeeper:
        """`async with message.keep_alive():` around a long job: the lease is extended to
        `visibility_timeout_s` from now every `every_s` (a third of it by default) until the
        block ends, so no other consumer gets the message meanwhile. A consumer that crashes
        stops extending, and the message is redelivered once the last extension runs out."""
        return LeaseKeeper(self, visibility_timeout_s, every_s)

    def __repr__(self) -> str:
        return (f"Message(queue={self.queue!r}, id={self.id}, priority={self.priority}, "
                f"deliveries={self.deliveries}, payload={self.payload[:32]!r})")


class LeaseKeeper:
    """Extends one message's lease on a timer (see Message.keep_alive). A retriable failure
    (a failover under way) is tried again at the next beat; E_LEASE_EXPIRED or another
    refusal ends the beats and is kept in `lost`: the job may go on, but its ack will be
    refused and the message is, or will be, delivered again."""

    def __init__(self, message: Message, visibility_timeout_s: float, every_s: float | None) -> None:
        if not 0 < visibility_timeout_s <= 43_200:
            raise ValueError("visibility_timeout_s must be in (0, 43200]")
        self.every_s = every_s if every_s is not None else visibility_timeout_s / 3
        if not 0 < self.every_s < visibility_timeout_s:
            raise ValueError("every_s must be positive and shorter than visibility_timeout_s")
        self.message = message
        self.visibility_timeout_s = visibility_timeout_s
        self.extensions = 0
        self.lost: QueueError | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.message.extend(self.visibility_timeout_s)
        self.extensions += 1
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.message.extend(self.visibility_timeout_s)
                self.extensions += 1
            except QueueError as error:
                if not error.retriable:
                    self.lost = error
                    return

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class _PlacementReading:
    """One reading of the map (refresh_placement): the queues its callers asked about, or the
    whole map."""

    __slots__ = ("names", "task", "whole")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.whole = False
        self.task: asyncio.Task[None]


class _EnqueueBatch:
    """The enqueue() calls of one turn for one (queue, priority)."""

    __slots__ = ("dedupe_ids", "futures", "payloads", "size_bytes")

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.dedupe_ids: list[str] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.size_bytes = 0


class _Watch:
    """One enqueue watched without a task of its own (AsyncClient._watched_enqueue): its
    attempts, the first a future in its node's open batch, any later one a task started by
    the client's sweep where the map names the master now; `outcome` takes the first answer."""

    __slots__ = ("asked", "asked_at", "attempt", "failure", "outcome", "pending", "queue", "tasks")

    def __init__(self, queue: str, attempt: Callable[[AsyncClient], Coroutine[Any, Any, Any]], target: AsyncClient,
                 outcome: asyncio.Future[Any], asked_at: float) -> None:
        self.queue = queue
        self.attempt = attempt
        self.asked = {target}
        self.asked_at = asked_at
        self.outcome = outcome
        self.pending = 1
        self.failure: BaseException | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    def settle(self, attempt: asyncio.Future[Any]) -> None:
        """An attempt ended: its answer wins; a failure counts only once every attempt failed."""
        self.pending -= 1
        error = QueueError(E_UNAVAILABLE, "the attempt was cancelled", outcome_unknown=True) \
            if attempt.cancelled() else attempt.exception()       # read even when it comes too late
        if self.outcome.done():
            return
        if error is None:
            self.outcome.set_result(attempt.result())
        else:
            self.failure = _first_failure(self.failure, error)
        if not self.outcome.done() and self.pending == 0:
            self.outcome.set_exception(self.failure)      # type: ignore[arg-type]
        if self.outcome.done():
            for task in self.tasks:
                task.cancel()


class _AckBatch:
    """The ack() calls of one turn for one queue."""

    __slots__ = ("futures", "items")

    def __init__(self) -> None:
        self.items: list[tuple[int, str]] = []
        self.futures: list[asyncio.Future[Any]] = []


def resolve_credentials(credentials: CredentialsArg) -> Credentials:
    if isinstance(credentials, Credentials):
        return credentials
    return load_credentials(credentials)


def _milliseconds(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    """Done-callback of fire-and-forget ops: read the outcome so asyncio does not report it."""
    if not future.cancelled():
        future.exception()


def _ttl_ms(ttl_s: float | None) -> int:
    """A message's time to live as the protocol carries it (0: the queue's default)."""
    if ttl_s is None:
        return 0
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s * 1000 <= TTL_MS_MAX:
        raise ValueError(f"ttl_s must be above 0 and at most {TTL_MS_MAX // 1000} seconds")
    return max(1, int(ttl_s * 1000))


_Headers = tuple[tuple[str, str], ...]      # a message's headers as a batch key (hashable)


def _headers_key(headers: Mapping[str, str] | None) -> _Headers:
    return tuple(sorted(headers.items())) if headers else ()


def _delay_ms(delay_s: float | None) -> int:
    """A message's delivery delay as the protocol carries it (0: ready at once)."""
    if delay_s is None:
        return 0
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not 0 <= delay_s * 1000 <= DELAY_MS_MAX:
        raise ValueError(f"delay_s must be from 0 to {DELAY_MS_MAX // 1000} seconds")
    return int(delay_s * 1000)


def _as_bytes(payload: Any) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    raise TypeError(f"a payload is bytes, not {type(payload).__name__}")


def _op_bytes(op: ClientOp) -> int:
    if isinstance(op, EnqueueBatchOp):
        return sum(map(len, op.payloads))
    if isinstance(op, PublishOp):
        return len(op.payload)
    if isinstance(op, ForwardDataOp):
        return sum(len(item[0]) for item in op.items)
    return 0


# A frame's msgpack objects, counted generously per op: the node refuses a frame of more than
# FRAME_OBJECTS_MAX (docs/PROTOCOL.md, "WebSocket frames"), so frames are cut at half of it.
FRAME_OBJECTS_CUT = FRAME_OBJECTS_MAX // 2


def _op_objects(op: ClientOp) -> int:
    if isinstance(op, EnqueueBatchOp):
        return 16 + 2 * len(op.payloads) + 2 * len(op.headers or ())
    if isinstance(op, AckBatchOp):
        return 8 + 3 * len(op.items)
    if isinstance(op, ForwardDataOp):
        return 16 + 40 * len(op.items)
    channels = getattr(op, "channels", None)       # channel subscribe and advertise: up to 1,000 names
    if channels is not None:
        return 8 + len(channels)
    return 48      # any other op: at most 9 fields, and a headers map of at most 16 names


ROUTED_ENQUEUE_RETRY_S = 0.5   # see AsyncClient._node_client
FAILOVER_WAIT_S = 4.0          # how long a call waits for the map to name a reachable master
DEAD_LETTER_SUFFIX = ".dlq"      # a queue's dead-letter queue: same pair (replication/options.py)
FAILOVER_POLL_S = 0.1
# A consumer without a subscription tries again after these delays, doubling (Consumer._resubscribe).
RESUBSCRIBE_DELAY_INITIAL_S, RESUBSCRIBE_DELAY_MAX_S = 0.05, 0.5
# A call refused for a passing state of the cluster (a node restarting or unreachable, a handoff
# or failover under way, a restarted master waiting for its lease, a full inbox, a replica out of
# sync under min_in_sync 2) is asked again after these delays, doubling, until its deadline
# (AsyncClient._until_deadline). E_QUEUE_FULL and E_STORAGE_FULL come back at once: they are
# back-pressure for the application to decide on; E_TIMEOUT has used the deadline up.
CALL_RETRY_DELAY_INITIAL_S, CALL_RETRY_DELAY_MAX_S = 0.05, 0.5
ACK_RESEND_DELAY_S = 0.1       # an ack batch refused for one of RETRIED_CODES goes out again after this
RETRIED_CODES = frozenset(kind.code for kind in (E_UNAVAILABLE, E_NOT_MASTER, E_QUEUE_UNAVAILABLE, E_OVERLOADED,
                                                 E_SHUTTING_DOWN, E_NOT_ENOUGH_REPLICAS, E_SESSION_EXPIRED))
STALL_CHECK_S = 0.25           # an enqueue unanswered this long reads the map again (AsyncClient._hedged)
WATCH_SWEEP_S = STALL_CHECK_S / 4   # how often the watched enqueues are looked over (_sweep_watches)
MAP_READ_TIMEOUT_S = 0.3       # a node's copy of the map not read in this long is passed over
PLACEMENT_QUEUES_MAX = 100     # queue entries one reading asks for; more: the whole map (PROTOCOL.md)
# Set while a call is retried after a failure (_retried_once): a retry at this very node
# (it has just become the queue's master) is taken once per call, not again from the retry.
_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("qcluster_retrying", default=False)


class AsyncClient:
    """The asyncio client. Use as `async with AsyncClient() as client:`; every method must be
    called from the event loop that first used the client."""

    def __init__(self, url: str | None = None, credentials: CredentialsArg = None, *,
                 request_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 reconnect_delay_initial_s: float = 0.05, reconnect_delay_max_s: float = 0.5,
                 enqueue_retry_time_s: float = 30.0, enqueue_attempts_max: int = 10,
                 in_flight_max: int = 50_000, frame_bytes_max: int = 1024 * 1024,
                 heartbeat_s: float = 10.0, ca_file: str | None = None) -> None:
        """`ca_file`: the CA that signs the nodes' TLS certificates (default: the credentials'
        `ca_file`, else the system's)."""
        creds = resolve_credentials(credentials)
        self._credentials = creds
        ca_file = creds.ca_file if ca_file is None else ca_file
        self._limits = dict(request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s, ca_file=ca_file,
                            reconnect_delay_initial_s=reconnect_delay_initial_s,
                            reconnect_delay_max_s=reconnect_delay_max_s, enqueue_retry_time_s=enqueue_retry_time_s,
                            enqueue_attempts_max=enqueue_attempts_max, in_flight_max=in_flight_max,
                            frame_bytes_max=frame_bytes_max, heartbeat_s=heartbeat_s)
        # The cluster map (docs/PROTOCOL.md): each queue's master, learned when a node answers
        # E_NOT_MASTER; traffic for a queue goes to a client of its master's node.
        self._masters: dict[str, str] = {}        # queue -> the node to send its traffic to
        self._cluster_size = 0                     # nodes in the map when last read
        self._node_urls: list[str] = []            # the other nodes' URLs in it
        self._master_urls: dict[str, str] = {}    # queue -> its master's node
        self._others: dict[str, AsyncClient] = {}
        # (queue, forward) -> what to call with the rate a root sends (forward sessions; shared
        # with this client's clients of other nodes, where the sessions are).
        self._forward_rates: dict[tuple[str, str], Callable[[float | None], None]] = {}
        self._forward_nodes: dict[tuple[str, str], AsyncClient] = {}     # the node each session is open at
        self._macros: dict[str, MacroQueue] = {}  # macro queues in the map (client/macro.py)
        # Channels (client/channels.py): the inbox of a client the application uses; on each
        # node's client, the channels subscribed and advertised through its socket.
        self._channel_inbox: ChannelInbox | None = None
        self._channels_here: set[str] = set()
        self._advertised_here: set[str] = set()
        self._advertised: set[str] = set()
        self._channel_classes: dict[str, str] = {}
        self._sessions = 0
        self.url = (url or creds.url).rstrip("/")
        self.client_id = creds.client_id
        self._signer = creds.signer()
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
        self._frame_bytes_max = frame_bytes_max
        self._heartbeat_s = heartbeat_s
        self._request_timeout_s = request_timeout_s
        # Every call over the WebSocket has a deadline (see _track): (when, request id), a heap
        # with answered calls left in it until they reach its top.
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        # See refresh_placement: the reading that still takes names, and the last one begun.
        self._gathering: _PlacementReading | None = None
        self._last_reading: asyncio.Task[None] | None = None
        self._watches: deque[_Watch] = deque()                         # see _watched_enqueue
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch_sweep: asyncio.Task[None] | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        # A dedupe id is a random 80-bit prefix per client plus a counter: unique like a
        # uuid4 hex (same 32 hex characters) for a fraction of the cost per message.
        self._dedupe_prefix = os.urandom(10).hex()
        self._dedupe_counter = itertools.count(1)
        # (queue, priority, ttl_ms, delay_ms, headers) -> the calls of this turn to put in one batch op
        self._open_enqueues: dict[tuple[str, int, int, int, _Headers], _EnqueueBatch] = {}
        self._open_acks: dict[str, _AckBatch] = {}
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
        self._consumers: set[Consumer] = set()
        self._consumers_by_subscription: dict[int, Consumer] = {}
        self._subscribing: dict[int, Consumer] = {}

    # --- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        try:
            await self.connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def usable(self) -> bool:
        """Not closed, and not stopped by a fatal error (its credentials were refused)."""
        return not self._closed and self._fatal is None

    async def connect(self) -> None:
        """Open the WebSocket now rather than on the first call; raises the first attempt's
        error (reconnecting goes on in the background unless the error is fatal)."""
        self._start()
        if self._ws is not None:
            return
        outcome: asyncio.Future[QueueError | None] = self._bound_loop().create_future()
        self._attempt_waiters.append(outcome)
        error = await outcome
        if error is not None:
            raise error

    async def close(self) -> None:
        """Unsubscribe consumers (releasing what they buffered), fail what is still pending,
        close the socket and the HTTP session."""
        if self._closed:
            return
        for consumer in list(self._consumers):
            await consumer.close()
        if self._channel_inbox is not None:
            self._channel_inbox.close()
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        self._fail_everything(QueueError(E_UNAVAILABLE, "the client is closed"))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        await self.http.close()
        for other in self._others.values():
            await other.close()

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _start(self) -> None:
        if self._closed:
            raise QueueError(E_UNAVAILABLE, "the client is closed")
        if self._fatal is not None:  # a fresh error: this call was never sent
            raise QueueError(self._fatal.kind, self._fatal.message)
        if self._supervisor is None:
            self._supervisor = self._bound_loop().create_task(self._supervise())

    # --- the per-call path --------------------------------------------------------------------
    def _new_future(self) -> asyncio.Future[Any]:
        if self._supervisor is None or self._fatal is not None or self._closed:
            self._start()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)  # type: ignore[union-attr]
        self._calls_in_flight += 1
        return self._loop.create_future()  # type: ignore[union-attr]

    def _submit(self, op: ClientOp) -> asyncio.Future[Any]:
        """Queue one op for this turn's frame and return the future its answer resolves."""
        future = self._new_future()
        self._pending[op.request_id] = (future, op)
        self._track(op)
        self._outgoing.append(op)
        return future

    def _submit_quietly(self, op: ClientOp) -> None:
        self._submit(op).add_done_callback(_ignore_outcome)

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
                             headers: dict[str, str] | None, batch: _EnqueueBatch) -> None:
        """One op for the batch, or several when it passes the item or byte limit."""
        payloads, count = batch.payloads, len(batch.payloads)
        if count <= BATCH_ITEMS_MAX and batch.size_bytes <= self._frame_bytes_max:
            op = EnqueueBatchOp(next(self._ids), queue, priority, tuple(payloads), tuple(batch.dedupe_ids), ttl_ms,
                                delay_ms, headers)
            self._pending[op.request_id] = (batch.futures, op)
            self._track(op)
            self._outgoing.append(op)
            return
        for start, end in _batch_bounds(payloads, self._frame_bytes_max):
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
        loop = self._bound_loop()
        wait_s = op.wait_ms / 1000 if type(op) is ReceiveOp else 0.0
        deadline = loop.time() + self._request_timeout_s + wait_s
        heapq.heappush(self._deadlines, (deadline, op.request_id))
        timer = self._deadline_timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._deadline_timer = loop.call_at(deadline, self._expire_calls)

    def _expire_calls(self) -> None:
        self._deadline_timer = None
        loop = self._bound_loop()
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
                self._fail_op(request_id, QueueError(E_TIMEOUT, f"no answer within {self._request_timeout_s} s",
                                                     outcome_unknown=sent))
            self._outgoing = [op for op in self._outgoing if op.request_id in pending]
            self._forget_retries()
            self._wake_room()
        if heap:
            self._deadline_timer = loop.call_at(heap[0][0], self._expire_calls)

    async def _wait_for_room(self) -> None:
        """Back-pressure: at most `in_flight_max` calls wait for answers at once."""
        while self._calls_in_flight >= self._in_flight_max:
            self._start()
            self._room_needed = True
            self._room.clear()
            await self._room.wait()

    def _new_dedupe_id(self) -> str:
        return f"{self._dedupe_prefix}{next(self._dedupe_counter):012x}"

    def _join_enqueue(self, queue: str, priority: int, payload: bytes, dedupe_id: str,
                      ttl_ms: int = 0, delay_ms: int = 0, headers: _Headers = ()) -> asyncio.Future[Any]:
        key = (queue, priority, ttl_ms, delay_ms, headers)
        batch = self._open_enqueues.get(key)
        if batch is None:
            batch = self._open_enqueues[key] = _EnqueueBatch()
        future = self._new_future()
        batch.payloads.append(payload)
        batch.dedupe_ids.append(dedupe_id)
        batch.futures.append(future)
        batch.size_bytes += len(payload)
        return future

    # --- the cluster map ----------------------------------------------------------------------
    def _route(self, queue: str) -> AsyncClient:
        """The client for the queue's master (this one unless the map says otherwise)."""
        url = self._masters.get(queue)
        if url is None or url == self.url:
            return self
        other = self._others.get(url)
        if other is None:
            other = self._others[url] = self._node_client(url)
        return other

    async def refresh_placement(self, queue: str | None = None) -> None:
        """Read the cluster map from every node (each lists the queues it holds); with `queue`,
        only that queue's entry (a map of thousands of queues is megabytes). Callers at once
        share one reading: after a failover thousands of calls in flight fail together, on
        one queue or on thousands, and read the map once, not once each against every node.
        A reading takes the names of every caller until it begins, and begins once the one
        before it has ended (so what made a caller ask is in what it reads); it asks for the
        names it took, PLACEMENT_QUEUES_MAX to a request (2,000 queues' entries are 20 small
        requests to each node, where the whole map of 10,000 is 5.6 MB from each), or for the
        whole map if a caller wanted it."""
        reading = self._gathering
        if reading is None:
            reading = self._gathering = _PlacementReading()
            reading.task = self._bound_loop().create_task(self._read_when_due(reading, self._last_reading))
            reading.task.add_done_callback(_ignore_outcome)
            self._last_reading = reading.task
        if queue is None:
            reading.whole = True
        else:
            reading.names.add(queue.removesuffix(DEAD_LETTER_SUFFIX))     # it lives in its queue's entry
        await asyncio.shield(reading.task)

    async def _read_when_due(self, reading: _PlacementReading, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(before)
        else:
            await asyncio.sleep(0)      # callers of this same turn join
        if self._gathering is reading:
            self._gathering = None
        if reading.whole:
            await self._read_placement(None)
            return
        names = sorted(reading.names)
        await asyncio.gather(*(self._read_placement(tuple(names[start:start + PLACEMENT_QUEUES_MAX]))
                               for start in range(0, len(names), PLACEMENT_QUEUES_MAX)))

    async def _read_placement(self, scope: tuple[str, ...] | None) -> None:
        first = await self._map_at(self, scope)
        if first is None:
            # This client's own node is down or paused: any other node of the last map knows it.
            first = await self._cluster_from_another_node(scope)
        urls = {node["id"]: node["url"].rstrip("/") for node in first.get("nodes", [])}
        self._cluster_size = len(urls)
        self._node_urls = [url for url in urls.values() if url != self.url]
        # Every node at once, each within MAP_READ_TIMEOUT_S: a paused node answers nothing and
        # must not hold up learning that its queues failed over (a peer link's state says
        # nothing of ours, so each node is asked).
        others = await asyncio.gather(*(self._map_at(self._route_to(url), scope) for url in self._node_urls))
        maps = [first] + [cluster_map for cluster_map in others if cluster_map is not None]
        newest_map = max(maps, key=lambda cluster_map: cluster_map.get("version", 0))
        if scope is None:
            self._learn_macros(newest_map.get("macros", {}))
            self._channel_classes = {name: channel.get("class", "latest")
                                     for name, channel in newest_map.get("channels", {}).items()}
        else:       # only what was asked about is known to be there (or gone)
            self._learn_macros(newest_map.get("macros", {}), only=scope)
        newest: dict[str, dict[str, Any]] = {}
        for cluster_map in maps:        # nodes may lag behind the membership layer: newest epoch wins
            for queue, pair in cluster_map.get("queues", {}).items():
                if pair.get("epoch", 0) >= newest.get(queue, {}).get("epoch", 0):
                    newest[queue] = pair
        for queue, pair in newest.items():
            if pair.get("master") not in urls:
                continue
            # A client of either member stays with it (under `producer` each member serves
            # its own consumers; a replica forwards what its master must order).
            members = {urls[pair["master"]], urls.get(pair.get("replica") or "", "")}
            # A queue's dead-letter queue lives in its pair (the map has no entry of its own).
            for name in (queue, queue + DEAD_LETTER_SUFFIX):
                self._masters[name] = self.url if self.url in members else urls[pair["master"]]
                self._master_urls[name] = urls[pair["master"]]

    def _learn_macros(self, definitions: Mapping[str, Any], only: tuple[str, ...] | None = None) -> None:
        for name in [name for name in (only or self._macros) if name in self._macros and name not in definitions]:
            del self._macros[name]
        for name, definition in definitions.items():
            if name in self._macros:
                self._macros[name].update(definition)
            else:
                self._macros[name] = MacroQueue(self, definition)

    async def macro(self, name: str) -> MacroQueue:
        """The macro queue `name` as the cluster map defines it now (read again here)."""
        await self.refresh_placement()
        found = self._macros.get(name)
        if found is None:
            raise QueueError(E_UNKNOWN_MACRO, f"no macro queue named {name!r}")
        return found

    async def _as_macro(self, name: str, error: QueueError) -> MacroQueue:
        """After E_MACRO_QUEUE: the name is a macro queue this client did not know yet."""
        if error.code != E_MACRO_QUEUE.code:
            raise error
        with contextlib.suppress(QueueError):
            await self.refresh_placement()
        found = self._macros.get(name)
        if found is None:
            raise error
        return found

    def _node_client(self, url: str) -> AsyncClient:
        """A client of another node of the cluster. It gives up on an unreachable node soon
        (this client then asks the map where the queue went) instead of retrying for long."""
        limits: dict[str, Any] = {**self._limits, "enqueue_retry_time_s": min(
            float(self._limits["enqueue_retry_time_s"]), ROUTED_ENQUEUE_RETRY_S)}  # type: ignore[arg-type]
        node = AsyncClient(url, self._credentials, **limits)
        node._forward_rates = self._forward_rates
        return node

    async def _hedged(self, queue: str, attempt: Callable[[AsyncClient], Coroutine[Any, Any, Any]]) -> Any:
        """An enqueue at the queue's master, watched: while it is unanswered, every
        STALL_CHECK_S the map is read again (one reading shared by every waiting call), and
        when it names another master (the one asked paused or was cut off, and its replica
        took over), the same enqueue, with the same dedupe ids, is asked there too. The first
        answer wins; the dedupe ids store the message once whichever attempts got through.
        Without it, calls sent to a paused master waited for their deadline although the
        replica was promoted seconds before."""
        loop = self._bound_loop()
        target = self._route(queue)
        asked = {target}
        attempts = {loop.create_task(attempt(target))}
        failure: BaseException | None = None
        try:
            while attempts:
                done, attempts = await asyncio.wait(attempts, timeout=STALL_CHECK_S,
                                                    return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    error = finished.exception()
                    if error is None:
                        return finished.result()
                    failure = _first_failure(failure, error)
                if done or not attempts:
                    continue
                with contextlib.suppress(QueueError):
                    await self.refresh_placement(queue)
                target = self._route(queue)
                if target not in asked:
                    asked.add(target)
                    attempts.add(loop.create_task(attempt(target)))
            if isinstance(failure, QueueError) and target is not self:
                # Every attempt failed, the last at another node's client (which knows no map):
                # as any routed call, refresh the map (waiting for a failover while the node is
                # unreachable) and try where it says now, once. (This client's own attempts
                # reroute themselves.)
                other = await self._rerouted(queue, failure, failed=target)
                if other is not None:
                    return await _retried_once(failure, attempt(other))
            raise failure or QueueError(E_INTERNAL, "no attempt was made")
        finally:
            for pending in attempts:
                pending.cancel()
                pending.add_done_callback(_ignore_outcome)

    async def _via(self, queue: str, target: AsyncClient, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on the client of the queue's node; when that node fails (unreachable,
        or no longer the master), refresh the map and try the node it names now, once."""
        try:
            return await getattr(target, method)(*args, **kwargs)
        except QueueError as error:
            other = await self._rerouted(queue, error, failed=target)
            if other is None:
                raise
            # Once more, where the map says now (the same node too: it has just become the
            # master, so what it forwarded before failed).
            return await _retried_once(error, getattr(other, method)(*args, **kwargs))

    async def _cluster_from_another_node(self, scope: tuple[str, ...] | None = None) -> dict[str, Any]:
        for url in self._node_urls:
            cluster_map = await self._map_at(self._route_to(url), scope)
            if cluster_map is not None:
                return cluster_map
        raise QueueError(E_UNAVAILABLE, f"{self.url} did not answer and no other node of the map did")

    @staticmethod
    async def _map_at(node: AsyncClient, scope: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        """A node's copy of the cluster map (only the entries of the queues in `scope`, if
        given), or None if it does not answer in MAP_READ_TIMEOUT_S."""
        try:
            async with asyncio.timeout(MAP_READ_TIMEOUT_S):
                return await node.http.cluster(scope)
        except (QueueError, TimeoutError):
            return None

    def _route_to(self, url: str) -> AsyncClient:
        if url == self.url:
            return self
        other = self._others.get(url)
        if other is None:
            other = self._others[url] = self._node_client(url)
        return other

    async def _rerouted(self, queue: str, error: QueueError, failed: AsyncClient | None = None) -> AsyncClient | None:
        """After E_NOT_MASTER (or the queue's node being unreachable): the master's client,
        if the refreshed map names another node than the one that failed."""
        if error.code not in (E_NOT_MASTER.code, E_UNAVAILABLE.code, E_QUEUE_UNAVAILABLE.code):
            return None
        failed = failed or self._route(queue)
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                await self.refresh_placement(queue)
            except QueueError:
                return None
            # Only a cluster fails over: a lone node that is down stays down until it returns.
            waits = error.code != E_NOT_MASTER.code and self._cluster_size > 1
            deadline = started + (FAILOVER_WAIT_S if waits else 0.0)
            target = self._route(queue)
            if error.code == E_NOT_MASTER.code:
                break
            # The node asked is there (its socket is up) but could not serve for a moment: it
            # waits for its lease, or lost its link to the master it forwards to.
            if target is not failed or error.code == E_QUEUE_UNAVAILABLE.code or failed.connected:
                if target is failed:
                    await asyncio.sleep(FAILOVER_POLL_S)
                return target
            if loop.time() >= deadline:
                return None
            # The queue's node is unreachable and the map still names it: the membership
            # layer fails over within its lease (docs/PROTOCOL.md); ask again shortly.
            await asyncio.sleep(FAILOVER_POLL_S)
        if target is self:
            master = self._master_urls.get(queue)
            if master == self.url:
                # This node has just become the master: what it took as replica and forwarded
                # failed ("this member became the master"); once more, here.
                return None if _RETRYING.get() else self
            # This node is a member but did not hold the queue yet (it has just been created):
            # this once, the master answers.
            return None if master is None else self._route_to(master)
        return target

    # --- messages -----------------------------------------------------------------------------
    async def enqueue(self, queue: str, payload: bytes, priority: int = 4,
                      dedupe_id: str | None = None, *, ttl_s: float | None = None,
                      delay_s: float | None = None, headers: Mapping[str, str] | None = None) -> int:
        """Enqueue one message and return its id once it is durable on every copy the queue's
        strength asks for. Except on a `one_way` queue (seed 004 One_Way): there the answer comes
        as soon as the master accepted the message, before it is durable, and a failure of the
        master right after may lose it (and give its id to another message); use `queued_ack`
        (the default) where an answer must mean stored. `ttl_s`: the message's time to live
        (default: the queue's `message_ttl_s`); once it has passed the message is never
        delivered (dead-lettered if the queue has a dead-letter queue, else dropped).
        `delay_s` (at most 900): the message is delivered no sooner than that. `headers`: a
        small map of names to strings (at most 16, 4,096 characters in all) that the consumer
        gets with the message (`Message.headers`)."""
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        dedupe_id = dedupe_id or self._new_dedupe_id()
        macro = self._macros.get(queue)
        if macro is not None:
            return await macro.enqueue(payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=headers)
        ttl_ms, delay_ms, named = _ttl_ms(ttl_s), _delay_ms(delay_s), _headers_key(headers)

        def attempt() -> Awaitable[int]:
            if self._masters:
                return self._watched_enqueue(queue, payload, priority, dedupe_id, ttl_ms, delay_ms, named)
            return self._enqueue_here(queue, payload, priority, dedupe_id, ttl_ms, delay_ms, named)
        try:
            return await self._until_deadline(attempt)
        except QueueError as error:
            macro = await self._as_macro(queue, error)
        return await macro.enqueue(payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=headers)

    async def _watched_enqueue(self, queue: str, payload: bytes, priority: int, dedupe_id: str,
                               ttl_ms: int, delay_ms: int, headers: _Headers) -> int:
        """An enqueue at the queue's master, watched as `_hedged` watches a call, but without a
        task and a timed wait per call (they cost a map-aware client about a quarter of its
        throughput: bench/RESULTS.md): the call joins its node's batch at once, and a sweep
        of this client's watched calls every WATCH_SWEEP_S asks again, where the map names
        the master now, those unanswered for that long."""
        target = self._route(queue)

        def attempt(node: AsyncClient) -> Coroutine[Any, Any, int]:
            return node._enqueue_here(queue, payload, priority, dedupe_id, ttl_ms, delay_ms, headers)
        if target._calls_in_flight >= target._in_flight_max:      # it must wait for room: a task
            return await self._hedged(queue, attempt)
        loop = self._bound_loop()
        first = target._join_enqueue(queue, priority, payload, dedupe_id, ttl_ms, delay_ms, headers)
        watch = _Watch(queue, attempt, target, loop.create_future(), loop.time())
        first.add_done_callback(watch.settle)
        self._watches.append(watch)
        if self._watch_timer is None:
            self._watch_timer = loop.call_later(WATCH_SWEEP_S, self._sweep_watches)
        try:
            return await watch.outcome  # type: ignore[no-any-return]
        except QueueError as failure:
            # Every attempt failed, the last one at its node (which knows no map): as a routed
            # call, read the map (waiting through a failover) and try once where it says now.
            other = await self._rerouted(queue, failure, failed=target)
            if other is None:
                raise
            return await _retried_once(failure, attempt(other))

    def _sweep_watches(self) -> None:
        """Every WATCH_SWEEP_S while enqueues are watched: drop the answered ones; if some
        waited STALL_CHECK_S, read the map (one reading for all) and ask each of them again at
        the master it names now, if that is a node not asked yet."""
        self._watch_timer = None
        loop = self._bound_loop()
        now = loop.time()
        watches = self._watches = deque(w for w in self._watches if not w.outcome.done())
        if any(now - w.asked_at >= STALL_CHECK_S for w in watches) and \
                (self._watch_sweep is None or self._watch_sweep.done()):
            self._watch_sweep = loop.create_task(self._ask_stalled_again())
            self._watch_sweep.add_done_callback(_ignore_outcome)
        if watches and not self._closed:
            self._watch_timer = loop.call_later(WATCH_SWEEP_S, self._sweep_watches)

    async def _ask_stalled_again(self) -> None:
        # Only the stalled queues' entries (one shared reading): the whole map of 10,000 queues
        # is 5.6 MB that each node encodes on its loop, the membership leader's too, while it
        # should be failing those queues over (issue 31).
        loop = self._bound_loop()
        now = loop.time()
        stalled = {watch.queue for watch in self._watches
                   if not watch.outcome.done() and now - watch.asked_at >= STALL_CHECK_S}
        with contextlib.suppress(QueueError):
            await asyncio.gather(*(self.refresh_placement(queue) for queue in stalled))
        now = loop.time()
        for watch in self._watches:
            if watch.outcome.done() or now - watch.asked_at < STALL_CHECK_S:
                continue
            target = self._route(watch.queue)
            if target in watch.asked:
                continue
            watch.asked.add(target)
            watch.asked_at, watch.pending = now, watch.pending + 1
            task = loop.create_task(watch.attempt(target))
            watch.tasks.append(task)
            task.add_done_callback(watch.settle)

    async def _enqueue_here(self, queue: str, payload: bytes, priority: int, dedupe_id: str, ttl_ms: int = 0,
                            delay_ms: int = 0, headers: _Headers = ()) -> int:
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        future = self._join_enqueue(queue, priority, payload, dedupe_id, ttl_ms, delay_ms, headers)
        try:
            return await future  # type: ignore[no-any-return]
        except QueueError as error:
            master = await self._rerouted(queue, error)
            if master is None:
                raise
            return await _retried_once(error, master._enqueue_here(queue, payload, priority, dedupe_id, ttl_ms,
                                                                   delay_ms, headers))

    async def enqueue_many(self, queue: str, payloads: Iterable[bytes], priority: int = 4, *,
                           dedupe_ids: Sequence[str] | None = None, ttl_s: float | None = None,
                           delay_s: float | None = None, headers: Mapping[str, str] | None = None) -> list[int]:
        """Enqueue many messages in one batch; returns their ids in order. On an error the
        first one is raised after every answer is in (the others may be stored: pass
        `dedupe_ids` to make a retry of the whole call safe). `ttl_s`, `delay_s`, `headers`: as
        for `enqueue`, for every message."""
        items = [_as_bytes(p) for p in payloads]
        if dedupe_ids is not None and len(dedupe_ids) != len(items):
            raise ValueError("dedupe_ids must have one id per payload")
        ids = list(dedupe_ids) if dedupe_ids is not None else [self._new_dedupe_id() for _ in items]
        if queue in self._macros:     # each message by the producer policy
            return list(await asyncio.gather(*(self.enqueue(queue, item, priority, dedupe_id, ttl_s=ttl_s,
                                                            delay_s=delay_s, headers=headers)
                                               for item, dedupe_id in zip(items, ids, strict=True))))
        ttl_ms, delay_ms, named = _ttl_ms(ttl_s), _delay_ms(delay_s), dict(headers) if headers else None

        def attempt() -> Awaitable[list[int]]:
            if self._masters:
                return self._hedged(queue, lambda node: node._enqueue_many_here(queue, items, priority, ids, ttl_ms,
                                                                                delay_ms, named))
            return self._enqueue_many_here(queue, items, priority, ids, ttl_ms, delay_ms, named)
        return await self._until_deadline(attempt)

    async def _until_deadline(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """`attempt()`, asked again with backoff while it fails with one of RETRIED_CODES,
        until the call's deadline (request_timeout_s from now); then its latest error, with
        its outcome unknown when any attempt's was. Safe for the calls it wraps: an enqueue's
        dedupe ids store it once, and a receive's leases of a lost answer run out."""
        loop = self._bound_loop()
        deadline = loop.time() + self._request_timeout_s
        delay_s = CALL_RETRY_DELAY_INITIAL_S
        outcome_unknown = False
        while True:
            try:
                return await attempt()
            except QueueError as error:
                outcome_unknown = outcome_unknown or error.outcome_unknown
                pause_s = delay_s * random.uniform(0.5, 1.0)
                if error.code not in RETRIED_CODES or not self.usable or loop.time() + pause_s >= deadline:
                    if outcome_unknown and not error.outcome_unknown:
                        raise QueueError(error.kind, error.message, outcome_unknown=True) from error
                    raise
            await asyncio.sleep(pause_s)
            delay_s = min(delay_s * 2, CALL_RETRY_DELAY_MAX_S)

    async def _enqueue_many_here(self, queue: str, items: list[bytes], priority: int, ids: list[str],
                                 ttl_ms: int = 0, delay_ms: int = 0, headers: dict[str, str] | None = None) -> list[int]:
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        # The call is its own batch with one future for all its answers: no future per message.
        futures = []
        for start, end in _batch_bounds(items, self._frame_bytes_max):
            op = EnqueueBatchOp(next(self._ids), queue, priority, tuple(items[start:end]), tuple(ids[start:end]), ttl_ms,
                                delay_ms, headers)
            futures.append(self._submit(op))
        try:
            outcomes = [outcome for part in await asyncio.gather(*futures) for outcome in part[1]]
        except QueueError as error:
            master = await self._rerouted(queue, error)
            if master is None:
                raise
            return await _retried_once(error, master._enqueue_many_here(queue, items, priority, ids, ttl_ms, delay_ms,
                                                                        headers))
        for outcome in outcomes:
            if type(outcome) is not int:
                raise _item_error(outcome)
        return outcomes

    async def receive(self, queue: str, max_messages: int = 1, wait_s: float = 0.0,
                      visibility_timeout_s: float | None = None) -> list[Message]:
        """Lease up to `max_messages`, waiting up to `wait_s` for the first; [] if none came.
        On a macro queue, from the member its consumer policy chooses (`Message.queue` names
        it; `Message.ack()` acks there)."""
        macro = self._macros.get(queue)
        if macro is not None:
            return await macro.receive(max_messages, wait_s, visibility_timeout_s)
        try:
            return await self._until_deadline(lambda: self._receive(queue, max_messages, wait_s, visibility_timeout_s))
        except QueueError as error:
            macro = await self._as_macro(queue, error)
        return await macro.receive(max_messages, wait_s, visibility_timeout_s)

    async def _receive(self, queue: str, max_messages: int, wait_s: float,
                       visibility_timeout_s: float | None) -> list[Message]:
        if self._masters and (target := self._route(queue)) is not self:
            return await self._via(queue, target, "_receive", queue, max_messages, wait_s, visibility_timeout_s)
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        op = ReceiveOp(next(self._ids), queue, max_messages, int(wait_s * 1000),
                       _milliseconds(visibility_timeout_s))
        try:
            result = await self._submit(op)
        except QueueError as error:
            master = await self._rerouted(queue, error)
            if master is None:
                raise
            return await _retried_once(error, master._receive(queue, max_messages, wait_s, visibility_timeout_s))
        try:
            return [Message(self, queue, m) for m in messages_from_result(result)]
        except FrameError as exc:
            raise QueueError(E_INTERNAL, f"a malformed receive answer: {exc}", outcome_unknown=True) from None

    def ack(self, queue: str, message_id: int, receipt: str) -> Awaitable[None]:
        """Acknowledge (delete) a leased message; concurrent acks on a queue share one batch.

        Returns an awaitable future rather than a coroutine, so a consumer that acks without
        waiting (`asyncio.ensure_future(message.ack())`) creates no task per message."""
        if self._masters and (target := self._route(queue)) is not self:
            return target.ack(queue, message_id, receipt)
        if self._calls_in_flight >= self._in_flight_max:
            return self._ack_when_room(queue, message_id, receipt)
        return self._join_ack(queue, message_id, receipt)

    async def _ack_when_room(self, queue: str, message_id: int, receipt: str) -> None:
        await self._wait_for_room()
        await self._join_ack(queue, message_id, receipt)

    def _join_ack(self, queue: str, message_id: int, receipt: str) -> asyncio.Future[Any]:
        batch = self._open_acks.get(queue)
        if batch is None:
            batch = self._open_acks[queue] = _AckBatch()
        future = self._new_future()
        batch.items.append((message_id, receipt))
        batch.futures.append(future)
        return future

    async def release(self, queue: str, message_id: int, receipt: str) -> None:
        if self._masters and (target := self._route(queue)) is not self:
            return await self._via(queue, target, "release", queue, message_id, receipt)
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        await self._submit(ReleaseOp(next(self._ids), queue, message_id, receipt))

    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        """Give a leased message's lease `visibility_timeout_s` from now, under the same
        receipt (0 gives it back at the next expiry sweep). Refused with E_LEASE_EXPIRED once
        the lease has ended; the duration is counted on the serving member's clock."""
        if not 0 <= visibility_timeout_s <= 43_200:
            raise ValueError("visibility_timeout_s must be in [0, 43200]")
        if self._masters and (target := self._route(queue)) is not self:
            return await self._via(queue, target, "extend", queue, message_id, receipt, visibility_timeout_s)
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        await self._submit(ExtendOp(next(self._ids), queue, message_id, receipt, round(visibility_timeout_s * 1000)))

    async def _call(self, op: ClientOp) -> Any:
        """One op on this node's socket, answered."""
        if self._calls_in_flight >= self._in_flight_max:
            await self._wait_for_room()
        return await self._submit(op)

    # --- channels (seed 002; client/channels.py) ----------------------------------------------
    @property
    def _inbox(self) -> ChannelInbox:
        if self._channel_inbox is None:
            self._channel_inbox = ChannelInbox(self)
        return self._channel_inbox

    async def subscribe(self, *channels: str, durable: str | None = None) -> dict[str, int | None]:
        """Subscribe to channels, all or none, idempotently; returns each new one's last id (None:
        nothing published yet). Their last values, then every new message, wait to be read with
        `poll`/`read` or `channel_messages()`. `durable`: read (and open, the first time) the
        durable subscription of that name on each channel (all of class `durable`): its backlog
        of every message published since it was opened and not acknowledged, kept while no one
        reads it; the answer is then each subscription's floor (acknowledged up to there)."""
        if not channels:
            raise ValueError("name at least one channel")
        return await self._inbox.subscribe(channels, durable)

    async def unsubscribe(self, *channels: str) -> None:
        await self._inbox.unsubscribe(channels)

    def poll(self) -> list[str]:
        """Subscribed channels with unread messages."""
        return self._inbox.poll()

    def read(self, channel: str) -> ChannelDelivery | None:
        """The next unread message of a channel (under `latest`, its newest value), or None."""
        return self._inbox.read(channel)

    async def next_channel_message(self) -> ChannelDelivery:
        """The first unread message across the subscribed channels, waiting for one."""
        return await self._inbox.next()

    async def advertise(self, *channels: str) -> None:
        """Declare that this client publishes to these channels (seed 002: a publish to a
        channel not advertised is refused, E_NOT_ADVERTISED). Several producers may."""
        self._advertised.update(channels)
        for channel in channels:
            target = self._route(channel_queue(channel))
            await self._advertise_at(target, channel)

    async def unadvertise(self, *channels: str) -> None:
        self._advertised.difference_update(channels)
        for channel in channels:
            target = self._route(channel_queue(channel))
            target._advertised_here.discard(channel)
            with contextlib.suppress(QueueError):
                await target._call(AdvertiseOp(next(target._ids), (channel,), False))

    async def _advertise_at(self, node: AsyncClient, channel: str) -> None:
        await node._call(AdvertiseOp(next(node._ids), (channel,), True))
        node._advertised_here.add(channel)

    async def publish(self, channel: str, payload: bytes, dedupe_id: str | None = None) -> int:
        """Publish one message to an advertised channel; returns its id once it is committed
        (and sent to the channel's subscribers). A dedupe id makes a retry publish it once."""
        dedupe_id = dedupe_id or self._new_dedupe_id()
        queue = channel_queue(channel)
        target = self._route(queue)
        try:
            return await self._publish_at(target, channel, payload, dedupe_id)
        except QueueError as error:
            other = await self._rerouted(queue, error, failed=target) if error.code != E_NOT_ADVERTISED.code \
                else None
            if other is None:
                raise
            return await _retried_once(error, self._publish_at(other, channel, payload, dedupe_id))

    async def _publish_at(self, node: AsyncClient, channel: str, payload: bytes, dedupe_id: str) -> int:
        if channel in self._advertised and channel not in node._advertised_here:
            await self._advertise_at(node, channel)      # the channel's master is this node now
        result = await node._call(PublishOp(next(node._ids), channel, _as_bytes(payload), dedupe_id))
        return int(result[0])

    async def report(self, channel: str, message_id: int) -> dict[str, Any]:
        """What became of a published message: `state` queued, delivered (to every subscriber;
        under `acked`, acknowledged by all), pending_ack or failed (a subscriber left without
        acknowledging), with the counts."""
        queue = channel_queue(channel)
        return dict(await self._via(queue, self._route(queue), "_call", ReportOp(next(self._ids), channel,
                                                                                 message_id)))

    async def create_channel(self, name: str, delivery_class: str = "latest",
                             resend_interval_s: float = 0.0) -> dict[str, Any]:
        """Define a channel (admin): `latest` or `acked`; `resend_interval_s` > 0 sends the last
        value again after that long without a publish."""
        return await self._changed_map(self.http.put_channel(name, delivery_class, resend_interval_s))

    async def characterize(self, name: str, delivery_class: str) -> dict[str, Any]:
        """Change a channel's delivery class (from its next publish)."""
        return await self._changed_map(self.http.put_channel(name, delivery_class))

    async def set_resend_interval(self, name: str, seconds: float) -> dict[str, Any]:
        return await self._changed_map(self.http.put_channel(name, resend_interval_s=seconds))

    async def typeof(self, name: str) -> dict[str, Any]:
        """A channel's delivery class, resend interval and where it is served."""
        return await self.http.channel(name)

    async def delete_channel(self, name: str) -> dict[str, Any]:
        return await self._changed_map(self.http.delete_channel(name))

    async def list_channels(self) -> list[dict[str, Any]]:
        return await self.http.list_channels()

    async def subscriptions(self, channel: str) -> list[dict[str, Any]]:
        """A durable channel's subscriptions: each one's `floor`, the messages `waiting` for it,
        whether a reader is `attached` and how many it holds `unacknowledged`."""
        return await self.http.subscriptions(channel)

    async def drop_subscription(self, channel: str, name: str) -> dict[str, Any]:
        """End a durable subscription for good (admin): its backlog is no longer kept."""
        return await self.http.drop_subscription(channel, name)

    async def set_alternatives(self, recipient: str, alternatives: Sequence[str]) -> dict[str, Any]:
        """A push recipient's ordered chain of alternative recipients (seed 001; admin)."""
        return await self.http.set_alternatives(recipient, alternatives)

    async def create_forward(self, name: str, source: str, destination: str, *, urls: Sequence[str] = (),
                             credentials: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Store-and-forward (seed 003; admin): the master of `source` (a `full` queue here)
        moves its messages into `destination` of the cluster at `urls`, signed there with
        `credentials` ({"client_id", "private_key"}); no urls: a queue of this cluster."""
        return await self.http.create_forward(name, source, destination, urls=urls, credentials=credentials)

    async def forwards(self) -> list[dict[str, Any]]:
        return await self.http.forwards()

    async def forward_stats(self, name: str) -> dict[str, Any]:
        return await self.http.forward_stats(name)

    async def delete_forward(self, name: str) -> dict[str, Any]:
        return await self.http.delete_forward(name)

    async def recipients(self) -> list[dict[str, Any]]:
        """Every recipient with its queue, state (ok, fault, defunct) and alternatives."""
        return await self.http.recipients()

    async def alternatives(self, recipient: str) -> list[str]:
        return await self.http.alternatives(recipient)

    async def remove_recipient(self, recipient: str) -> dict[str, Any]:
        """Forget a recipient (admin): its state and alternatives; what fault surveillance holds
        for it goes back to its queue. E_UNKNOWN_RECIPIENT when the cluster does not know it."""
        return await self.http.remove_recipient(recipient)

    # --- forward sessions (seed 003; the node's forwarder, qserver/features/forwards/forwarder.py, uses these) ----
    async def forward_session(self, queue: str, forward: str, weight: int, *, open: bool,
                              on_rate: Callable[[float | None], None] | None = None) -> Any:
        """Open (or keep alive) forward `forward`'s session with the root, the master of
        `queue` (opening finds it, as any routed call); `on_rate` is called with each rate the
        root sends. Open answers the session's terms ({"rate", "interval_s", "bands", "mode",
        "keepalive_s", "hold_s"}), a keepalive the current rate (messages/s; None: no control).
        The session lives on the connection to the node that opened it: keepalives and data go
        there (E_UNKNOWN_FORWARD once it is gone: open it again)."""
        if on_rate is not None:
            self._forward_rates[(queue, forward)] = on_rate
        if not open:
            return await self._forward_node(queue, forward)._forward_session_here(queue, forward, weight, False)
        node = self._route(queue)
        try:
            terms = await node._forward_session_here(queue, forward, weight, True)
        except QueueError as error:
            other = await self._rerouted(queue, error, failed=node)
            if other is None:
                raise
            node = other
            terms = await _retried_once(error, node._forward_session_here(queue, forward, weight, True))
        self._forward_nodes[(queue, forward)] = node
        return terms

    def _forward_node(self, queue: str, forward: str) -> AsyncClient:
        node = self._forward_nodes.get((queue, forward))
        if node is None:
            raise QueueError(E_UNKNOWN_FORWARD, f"no session of forward {forward} open from this client")
        return node

    async def _forward_session_here(self, queue: str, forward: str, weight: int, open: bool) -> Any:
        return await self._call(ForwardSessionOp(next(self._ids), queue, forward, weight, open))

    async def forward_data(self, queue: str, forward: str, stream: str, weight: int, floor: int,
                           items: Sequence[tuple[bytes, int, int, int, dict[str, str] | None]]) -> list[int | QueueError]:
        """A data message of an open session: items (payload, priority, number, ttl_ms, headers)
        numbered in `stream`, every number below `floor` settled. One outcome per item: the
        message id (a number stored before counts as stored) or the error that refused it."""
        node = self._forward_node(queue, forward)
        outcomes = await node._call(ForwardDataOp(next(node._ids), queue, forward, stream, weight, floor, tuple(items)))
        return [outcome if type(outcome) is int else _item_error(outcome) for outcome in outcomes]

    def forget_forward(self, queue: str, forward: str) -> None:
        self._forward_rates.pop((queue, forward), None)
        self._forward_nodes.pop((queue, forward), None)

    async def ping(self) -> None:
        """One round trip over the WebSocket (connecting first if needed)."""
        await self._submit(PingOp(next(self._ids)))

    def consume(self, queue: str, prefetch: int = 100, visibility_timeout_s: float | None = None, *,
                recipient: str | None = None) -> Consumer | MacroConsumer:
        """Messages pushed by the server as an async iterator; at most `prefetch` are leased
        and not yet taken at any time. Use `async with client.consume(q) as messages:`. On a
        macro queue this client knows (after any call on it, or `await client.macro(name)`),
        messages of all its members by its consumer policy (client/macro.py). `recipient`:
        consume as a named recipient under the queue's fault surveillance (seed 001): one that
        stops taking messages enters fault, and they fail over to its alternatives."""
        if not 1 <= prefetch <= 100_000:
            raise ValueError("prefetch must be in [1, 100000]")
        if queue in self._macros:
            return MacroConsumer(self._macros[queue], prefetch, visibility_timeout_s)
        consumer = Consumer(self._consume_target(queue), queue, prefetch, _milliseconds(visibility_timeout_s),
                            router=self, recipient=recipient)
        consumer._attach(consumer._client)
        return consumer

    def _consume_target(self, queue: str) -> AsyncClient:
        """Subscriptions go to the master (under `full` only it pushes)."""
        master = self._master_urls.get(queue)
        return self._route_to(master) if master is not None else self

    # --- admin and the REST-only message calls (client/http.py) ---------------------------------
    async def create_queue(self, name: str, **options: Any) -> dict[str, Any]:
        return await self.http.create_queue(name, **options)

    async def delete_queue(self, name: str) -> dict[str, Any]:
        return await self.http.delete_queue(name)

    async def purge(self, name: str) -> dict[str, Any]:
        """Take every message the queue holds now, ready or leased, out of it for good (admin
        grant): `{"queue", "purged"}`, and under `producer` `"members"`, each member's count."""
        return await self.http.purge(name)

    async def redrive(self, name: str, limit: int | None = None) -> dict[str, Any]:
        """Move up to `limit` (all there are now when None) of the queue's dead letters back
        into it, each at its priority as a new message (admin grant): `{"queue", "redriven"}`,
        `"stopped"` with the error code that ended it early, and under `producer` `"members"`."""
        return await self.http.redrive(name, limit)

    async def list_queues(self) -> list[dict[str, Any]]:
        """Every queue this client may see, by name (the client walks the server's pages)."""
        return await self.http.list_queues()

    async def queue_page(self, limit: int = 1000, after: str | None = None) -> dict[str, Any]:
        """One page of the queues: `{"queues": [...], "next": name or None}` (1 <= limit <= 1000;
        `after`: the previous page's `next`)."""
        return await self.http.queue_page(limit, after)

    async def create_macro(self, name: str, producer: str = "round_robin", consumer: str = "prioritized",
                           fastest_by: str = "response_time") -> dict[str, Any]:
        """Define a macro queue (admin; client/macro.py says what the policies do); add its
        members with `add_macro_member`. Enqueue, receive and consume on it as on a queue."""
        return await self._changed_map(self.http.create_macro(name, producer, consumer, fastest_by))

    async def delete_macro(self, name: str) -> dict[str, Any]:
        """Forget a macro queue; its members and their messages stay."""
        return await self._changed_map(self.http.delete_macro(name))

    async def add_macro_member(self, name: str, queue: str, priority: int = 0, weight: int = 1) -> dict[str, Any]:
        """Add a queue to a macro queue (or set its `priority`, 0-9, for the `prioritized`
        consumer policy, and its `weight`, 1-100, for the `round_robin` producer policy)."""
        return await self._changed_map(self.http.add_macro_member(name, queue, priority, weight))

    async def remove_macro_member(self, name: str, queue: str) -> dict[str, Any]:
        return await self._changed_map(self.http.remove_macro_member(name, queue))

    async def list_macros(self) -> list[dict[str, Any]]:
        return await self.http.list_macros()

    async def describe_macro(self, name: str) -> dict[str, Any]:
        """A macro queue's definition, each member with its pair (master, replica, epoch)."""
        return await self.http.macro(name)

    async def _changed_map(self, change: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        result = await change
        with contextlib.suppress(QueueError):     # this client's own calls see the change at once
            await self.refresh_placement()
        return result

    async def queue_stats(self, name: str) -> dict[str, Any]:
        return await self.http.queue_stats(name)

    async def reply(self, queue: str, message_id: int, receipt: str, body: bytes) -> None:
        await self.http.reply(queue, message_id, receipt, body)

    async def message_status(self, queue: str, message_id: int, wait_s: float = 0.0,
                             until: str | None = None) -> dict[str, Any]:
        return await self.http.message_status(queue, message_id, wait_s, until)

    async def register_client(self, name: str, grants: Iterable[Grant],
                              public_key: str | None = None) -> dict[str, Any]:
        return await self.http.register_client(name, grants, public_key)

    async def list_clients(self) -> list[dict[str, Any]]:
        return await self.http.list_clients()

    async def remove_client(self, client_id: str) -> dict[str, Any]:
        return await self.http.remove_client(client_id)

    async def set_grants(self, client_id: str, grants: Iterable[Grant]) -> dict[str, Any]:
        return await self.http.set_grants(client_id, grants)

    async def cluster(self) -> dict[str, Any]:
        return await self.http.cluster()

    async def handoff(self, queue: str, initiator: str = "master") -> dict[str, Any]:
        return await self.http.handoff(queue, initiator)

    async def promote(self, queue: str, *, unclean: bool = False) -> dict[str, Any]:
        return await self.http.promote(queue, unclean=unclean)

    async def move_queue(self, queue: str, member: str, to: str) -> dict[str, Any]:
        return await self.http.move_queue(queue, member, to)

    async def rebalance(self) -> dict[str, Any]:
        return await self.http.rebalance()

    async def add_node(self, node_id: str, url: str) -> dict[str, Any]:
        return await self.http.add_node(node_id, url)

    async def drain_node(self, node_id: str) -> dict[str, Any]:
        return await self.http.drain_node(node_id)

    async def remove_node(self, node_id: str) -> dict[str, Any]:
        return await self.http.remove_node(node_id)

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        """A draining node serves again (draining -> up); `rebalance` then brings it members."""
        return await self.http.undrain_node(node_id)

    # --- connection supervision ---------------------------------------------------------------
    async def _supervise(self) -> None:
        """Connect, serve until the socket ends, reconnect with backoff; forever, until closed
        or told something no reconnect can fix."""
        delay_s = self._reconnect_delay_initial_s
        while not self._closed:
            try:
                ws = await self._open_socket()
            except QueueError as error:
                # A replay refusal of an upgrade is of a copy of our own (this client signs
                # each attempt anew): connecting again is a new request, not a replay.
                if not error.retriable and error.code != E_REPLAYED_REQUEST.code:
                    self._set_fatal(error)
                    return
                self._on_connect_failed(error)
                await asyncio.sleep(delay_s * random.uniform(0.5, 1.0))
                delay_s = min(delay_s * 2, self._reconnect_delay_max_s)
                continue
            delay_s = self._reconnect_delay_initial_s
            self._resolve_attempt_waiters(None)
            cause = await self._serve(ws)
            if cause.code in FATAL_CLOSING_CODES:
                self._set_fatal(cause)
                return
            self._on_connection_lost(cause)

    async def _open_socket(self) -> aiohttp.ClientWebSocketResponse:
        headers = self._signer.headers("GET", self._ws_path, [], b"", audience=str(self._ws_url))
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                return await self.http.session().ws_connect(
                    self._ws_url, headers=headers, heartbeat=self._heartbeat_s,
                    max_msg_size=FRAME_BYTES_IN_MAX, timeout=aiohttp.ClientWSTimeout(ws_close=CLEANUP_TIMEOUT_S))
        except aiohttp.WSServerHandshakeError as exc:
            code = exc.headers.get("X-Error-Code") if exc.headers else None
            raise (QueueError(code, f"the WebSocket was refused (HTTP {exc.status})") if code
                   else error_from_status(exc.status)) from None
        except TimeoutError:
            raise QueueError(E_UNAVAILABLE, f"no WebSocket from {self.url} in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise QueueError(E_UNAVAILABLE, f"cannot reach {self.url}: {exc}") from None

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse) -> QueueError:
        """Run the reader and the writer until either ends; return why the socket is done."""
        loop = self._bound_loop()
        self._ws = ws
        self._sessions += 1
        for consumer in list(self._consumers):
            consumer._subscribe()
        if self._advertised_here:          # a new socket: the node knows nothing of the old one's
            self._submit_quietly(AdvertiseOp(next(self._ids), tuple(sorted(self._advertised_here)), True))
        if self._sessions > 1 and self._channel_inbox is not None and self._channels_here:
            self._channel_inbox.reconnected(self)
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
        loop = self._bound_loop()
        try:
            while True:
                if not self._outgoing:
                    self._writer_waiter = loop.create_future()
                    await self._writer_waiter
                    continue
                ops, self._outgoing = self._outgoing, []
                for frame in self._frames(ops):
                    await ws.send_bytes(frame)
        finally:
            self._writer_waiter = None

    def _frames(self, ops: list[ClientOp]) -> list[bytes]:
        """Encode ops into frames within the item and byte limits; an op that cannot be
        encoded fails alone instead of taking the writer down."""
        if len(ops) == 1 or (len(ops) <= FRAME_ITEMS_MAX
                             and sum(map(_op_bytes, ops)) <= self._frame_bytes_max
                             and sum(map(_op_objects, ops)) <= FRAME_OBJECTS_CUT):
            try:
                return [encode_frame(ops)]
            except (TypeError, ValueError, OverflowError):
                pass  # find and fail the culprit below
        frames: list[bytes] = []
        chunk: list[ClientOp] = []
        chunk_bytes = chunk_objects = 0
        for op in ops:
            try:
                encode_frame([op])
            except (TypeError, ValueError, OverflowError) as exc:
                self._fail_op(op.request_id, TypeError(f"cannot encode {type(op).__name__}: {exc}"))
                continue
            op_bytes, op_objects = _op_bytes(op), _op_objects(op)
            if chunk and (chunk_bytes + op_bytes > self._frame_bytes_max or len(chunk) >= FRAME_ITEMS_MAX
                          or chunk_objects + op_objects > FRAME_OBJECTS_CUT):
                frames.append(encode_frame(chunk))
                chunk, chunk_bytes, chunk_objects = [], 0, 0
            chunk.append(op)
            chunk_bytes += op_bytes
            chunk_objects += op_objects
        if chunk:
            frames.append(encode_frame(chunk))
        return frames

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
            elif kind is ChannelMessage:
                if self._channel_inbox is not None:
                    self._channel_inbox.deliver(item, self)
            elif kind is ChannelEnded:
                if self._channel_inbox is not None:
                    self._channel_inbox.ended(item, self)
            elif kind is ForwardRate:
                listener = self._forward_rates.get((item.queue, item.forward))
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
                elif acked_before and _item_error(outcome).code == E_UNKNOWN_MESSAGE.code:
                    future.set_result(None)
                else:
                    future.set_exception(_item_error(outcome))
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
            consumer = self._subscribing.pop(request_id, None)
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
        consumer = self._subscribing.pop(request_id, None)
        if consumer is not None and type(result) is int:
            self._consumers_by_subscription[result] = consumer
            consumer._on_subscribed(result)

    def _on_delivery(self, delivery: Delivery) -> None:
        consumer = self._consumers_by_subscription.get(delivery.subscription_id)
        if consumer is None or consumer.closed:
            # Pushed after we let go of the subscription: hand the leases straight back.
            if consumer is not None and self._ws is not None:
                for delivered in delivery.messages:
                    self._submit_quietly(ReleaseOp(next(self._ids), consumer.queue, delivered.message_id,
                                                   delivered.receipt))
            return
        consumer._on_messages(delivery.messages)

    def _end_subscription(self, subscription_id: int, error: QueueError) -> None:
        consumer = self._consumers_by_subscription.pop(subscription_id, None)
        if consumer is not None:
            consumer._on_subscription_ended(error)

    def _forget_subscription(self, subscription_id: int) -> None:
        self._consumers_by_subscription.pop(subscription_id, None)

    # --- losing the connection --------------------------------------------------------------------
    def _on_connection_lost(self, cause: QueueError) -> None:
        """Sent enqueue and ack batches go out again (_RESENT_OPS); other sent ops fail with
        `cause`; ops never sent wait for the next connection."""
        loop_time = self._bound_loop().time()
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
        self._subscribing.clear()
        self._consumers_by_subscription.clear()
        for consumer in self._consumers:
            consumer._on_connection_lost()
        if self._channel_inbox is not None and self._channels_here:
            self._channel_inbox.reconnected(self)
        self._wake_room()

    def _resend_later(self, request_id: int, error: QueueError) -> bool:
        """An ack batch refused for a passing reason (RETRIED_CODES: a master restarting or
        handing off) goes out again after ACK_RESEND_DELAY_S, within enqueue_retry_time_s, as
        after a lost connection; True when it will."""
        entry = self._pending.get(request_id)
        if entry is None or type(entry[1]) is not AckBatchOp or error.code not in RETRIED_CODES:
            return False
        loop = self._bound_loop()
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
        loop_time = self._bound_loop().time()
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
        for consumer in list(self._consumers):
            consumer._on_fatal(error)
        self._resolve_attempt_waiters(error)
        self._room_needed = False
        self._room.set()

    def _resolve_attempt_waiters(self, error: QueueError | None) -> None:
        waiters, self._attempt_waiters = self._attempt_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(error)


def _first_failure(first: BaseException | None, then: BaseException) -> BaseException:
    """The failure to report for a call tried more than once: the first one, but with its
    outcome unknown when any attempt's was (that attempt may have been applied)."""
    if first is None:
        return then
    if isinstance(first, QueueError) and not first.outcome_unknown \
            and isinstance(then, QueueError) and then.outcome_unknown:
        return QueueError(first.kind, first.message, outcome_unknown=True)
    return first


async def _retried_once(first: QueueError, retry: Awaitable[Any]) -> Any:
    """The one retry of a call whose first attempt failed with `first`: when that attempt's
    outcome was unknown, a definite error of the retry does not make the call's outcome
    definite (the first attempt may have been applied)."""
    retrying = _RETRYING.set(True)
    try:
        return await retry
    except QueueError as error:
        if first.outcome_unknown and not error.outcome_unknown:
            raise QueueError(error.kind, error.message, outcome_unknown=True) from error
        raise
    finally:
        _RETRYING.reset(retrying)


def _item_error(outcome: Any) -> QueueError:
    """The error of one item of a batch answer, `[code, message]`; it was not applied."""
    try:
        return QueueError(str(outcome[0]), str(outcome[1]))
    except (TypeError, IndexError):
        return QueueError(E_INTERNAL, f"a malformed batch outcome {outcome!r}", outcome_unknown=True)


class Consumer:
    """An async iterator of messages pushed to a subscription, with credit-based flow control.

    The server may push as many messages as it has credit for; the consumer starts with
    `prefetch` credit and grants more, in batches of half the prefetch, as the application
    takes messages, so at most `prefetch` messages are leased but not yet taken. Several
    tasks may iterate one consumer at once: workers that each await their own ack keep
    many acks in one batch, where one task awaiting each ack in turn pays a round trip each.
    """

    def __init__(self, client: AsyncClient, queue: str, prefetch: int, visibility_ms: int | None, *,
                 router: AsyncClient | None = None, recipient: str | None = None) -> None:
        """`router`: the client whose consume() made it; it knows the cluster map, so that the
        consumer follows the queue's master to its new node after a handoff or failover.
        `recipient`: the name fault surveillance knows this consumer by (qserver/features/surveillance/watch.py)."""
        self.queue = queue
        self.recipient = recipient
        self._router = router
        # Without a subscription (a lost connection, a refused or unanswered subscribe, a
        # subscription the server ended) one task subscribes again until it has one: see _recover.
        self._recovering: asyncio.Task[None] | None = None
        self._unsubscribed_since: float | None = None   # when this outage began (loop time)
        self._last_failure: QueueError | None = None     # the latest retriable failure of this outage
        self._outage_error: QueueError | None = None     # raised once by __anext__, see _resubscribe
        self.prefetch = prefetch
        self.closed = False
        self._client = client
        self._visibility_ms = visibility_ms
        self._credit_batch = max(1, prefetch // 2)
        self._buffer: deque[Message] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._subscription_id: int | None = None
        self._subscribing = False
        self._taken = 0  # messages taken since credit was last granted
        self._error: QueueError | None = None

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._outage_error is not None:
                error, self._outage_error = self._outage_error, None
                raise error
            if self.closed:
                raise StopAsyncIteration
            waiter: asyncio.Future[None] = self._client._bound_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        message = self._buffer.popleft()
        self._taken += 1
        if self._taken >= self._credit_batch:
            self._grant()
        return message

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Unsubscribe and release every buffered message so others get it now, not after
        its visibility timeout."""
        if self.closed:
            return
        self.closed = True
        self._wake()
        if self._recovering is not None:
            self._recovering.cancel()
        client = self._client
        client._consumers.discard(self)
        if client._ws is None or client._closed:
            return
        calls = [client._submit(ReleaseOp(next(client._ids), self.queue, m.id, m.receipt))
                 for m in self._buffer]
        self._buffer.clear()
        if self._subscription_id is not None:
            calls.append(client._submit(UnsubscribeOp(next(client._ids), self._subscription_id)))
        if calls:
            await asyncio.wait(calls, timeout=CLEANUP_TIMEOUT_S)
            for call in calls:
                call.add_done_callback(_ignore_outcome)
        if self._subscription_id is not None:
            client._forget_subscription(self._subscription_id)

    # --- driven by the client -----------------------------------------------------------------
    def _subscribe(self) -> None:
        """(Re)subscribe with the credit not yet in use: prefetch minus what is buffered."""
        credit = self.prefetch - len(self._buffer)
        if self.closed or self._subscribing or credit < 1:
            return
        op = SubscribeOp(next(self._client._ids), self.queue, credit, self._visibility_ms, self.recipient)
        self._subscribing = True
        self._taken = 0
        self._client._subscribing[op.request_id] = self
        self._client._submit_quietly(op)

    def _grant(self) -> None:
        if self._subscription_id is not None:
            op = CreditOp(next(self._client._ids), self._subscription_id, self._taken)
            self._taken = 0
            self._client._submit_quietly(op)
        elif not self._subscribing and self._client._ws is not None:
            self._subscribe()
        elif not self._subscribing and self._recovering is None:
            # The window was full when the connection went, so no recovery ran; room now, and
            # the node may never come back: follow the map as after any failure.
            self._recover(self._last_failure or QueueError(E_UNAVAILABLE, f"not connected to {self._client.url}"))

    def _on_subscribed(self, subscription_id: int) -> None:
        self._subscription_id = subscription_id
        self._subscribing = False
        self._unsubscribed_since = self._last_failure = self._outage_error = None
        if self.closed:
            self._client._submit_quietly(UnsubscribeOp(next(self._client._ids), subscription_id))
        elif self._taken >= self._credit_batch:
            self._grant()

    def _on_subscribe_failed(self, error: QueueError) -> None:
        self._subscribing = False
        self._on_unsubscribed(error)

    def _on_messages(self, messages: tuple[DeliveredMessage, ...]) -> None:
        client, queue, buffer = self._client, self.queue, self._buffer
        for delivered in messages:
            buffer.append(Message(client, queue, delivered))
        self._wake()

    def _on_connection_lost(self) -> None:
        """The socket is gone with the subscription. Its client subscribes again as soon as it
        has reconnected; meanwhile the recovery task reads the map, so that a consumer whose
        node died for good follows the queue to the promoted replica."""
        self._subscription_id = None
        self._subscribing = False
        self._on_unsubscribed(QueueError(E_UNAVAILABLE, f"the connection to {self._client.url} was lost"))

    def _on_subscription_ended(self, error: QueueError) -> None:
        self._subscription_id = None
        self._on_unsubscribed(error)

    def _on_unsubscribed(self, error: QueueError) -> None:
        """No subscription any more, for `error`: a lasting reason ends the iteration, any
        retriable one (E_NOT_MASTER after a handoff or failover, E_QUEUE_UNAVAILABLE while a
        restarted master waits for its lease, E_OVERLOADED, E_TIMEOUT, a lost connection) is
        recovered from. A consumer made by a node's own client (no router, so no map) cannot
        follow a master elsewhere: E_NOT_MASTER ends it."""
        if self.closed:
            return
        if not error.retriable or (error.code == E_NOT_MASTER.code and self._router is None):
            self._error = error
            self._wake()
            return
        self._recover(error)

    def _recover(self, error: QueueError) -> None:
        loop = self._client._bound_loop()
        self._last_failure = error
        if self._unsubscribed_since is None:
            self._unsubscribed_since = loop.time()
        if self._recovering is None:
            self._recovering = loop.create_task(self._resubscribe())

    def _needs_subscription(self) -> bool:
        # A full buffer needs none: taking a message subscribes again (_grant).
        return not self.closed and self._subscription_id is None and len(self._buffer) < self.prefetch

    async def _resubscribe(self) -> None:
        """Until subscribed: wait (backing off, RESUBSCRIBE_DELAY_*_S), read the map, and
        subscribe where it names the master now: this node again once it is back or may serve
        (a master restarted inside its lease), or the node that took the queue over. While no
        subscription is made for the client's request timeout, the iteration raises the
        latest retriable error once, then the consumer goes on trying: a caller is never left
        waiting in silence, and one that goes on iterating gets the messages once they come.
        Messages already buffered stay; their acks go to where they were leased."""
        delay_s = RESUBSCRIBE_DELAY_INITIAL_S
        try:
            while self._needs_subscription():
                await asyncio.sleep(delay_s * random.uniform(0.5, 1.0))
                delay_s = min(delay_s * 2, RESUBSCRIBE_DELAY_MAX_S)
                if not self._needs_subscription():
                    break
                self._report_long_outage()
                if self._subscribing:          # an attempt is under way: its answer decides
                    continue
                await self._follow_map()
                if self._needs_subscription() and not self._subscribing and self._client._ws is not None:
                    self._subscribe()           # not connected: the client subscribes on reconnect
        finally:
            self._recovering = None

    def _report_long_outage(self) -> None:
        client = self._client
        since = self._unsubscribed_since
        now = client._bound_loop().time()
        if since is not None and now - since >= client._request_timeout_s and self._last_failure is not None:
            failure = self._last_failure
            self._outage_error = QueueError(failure.kind, f"no subscription for {now - since:.1f} s: {failure.message}")
            self._unsubscribed_since = now
            self._wake()

    async def _follow_map(self) -> None:
        router = self._router
        if router is None:
            return
        with contextlib.suppress(QueueError):
            await router.refresh_placement(self.queue)
        target = router._consume_target(self.queue)
        if target is not self._client and not self.closed:
            self._client._consumers.discard(self)
            self._attach(target)

    def _attach(self, client: AsyncClient) -> None:
        client._start()
        self._client = client
        client._consumers.add(self)
        if client._ws is not None:
            self._subscribe()

    def _on_fatal(self, error: QueueError) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        """Wake every waiting task; each checks the buffer again (a cancelled one is skipped)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
