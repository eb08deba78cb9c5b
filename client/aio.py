"""`AsyncClient`: the asyncio client library, with the WebSocket (`GET /v1/ws`) as fast path.

The client is three parts, each in its own module:
- `client/connection.py` `NodeConnection`: one node's WebSocket. It coalesces concurrent calls
  into batch ops and frames, resolves their futures, gives each call a deadline, reconnects
  with backoff and sends enqueue and ack batches again, with the same dedupe ids, after a lost
  connection;
- `client/router.py` `Router`: the cluster map and one connection per node; which node a
  queue's traffic goes to, and following the queue after E_NOT_MASTER or an unreachable node;
- this module: the application's calls, each turned into ops at the node the router names.
  Enqueues and receives refused for a passing state of the cluster (RETRIED_CODES) are asked
  again with backoff until their deadline (`_until_deadline`). Subscriptions (`consume`,
  client/consumer.py) are re-made after any retriable failure with the credit still owed,
  where the map names the queue's master. Channels (client/channels.py) and macro queues
  (client/macro.py) use this client's public calls and the router's small interface.

Admin calls go over signed REST (`client/admin.py`, `client/http.py`) and share the home
node's aiohttp session.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar, overload

from client import browse, tracing, waits
from client.admin import AdminCalls
from client.batching import batch_bounds
from client.channels import ChannelDelivery, ChannelInbox, channel_queue
from client.connection import RETRIED_CODES, Headers, NodeConnection, item_error, jittered
from client.consumer import Consumer, Message
from client.credentials import Credentials, load_credentials
from client.http import HttpClient
from client.macro import MacroConsumer, MacroQueue
from client.router import Router, retried_once
from wire.errors import (
    E_BAD_FRAME,
    E_FEATURE_DISABLED,
    E_INTERNAL,
    E_MACRO_QUEUE,
    E_NOT_ADVERTISED,
    E_UNAVAILABLE,
    E_UNKNOWN_FORWARD,
    E_UNKNOWN_MACRO,
    QueueError,
)
from wire.message_input import DELAY_MS_MAX, TTL_MS_MAX, VISIBILITY_MAX_S
from wire.protocol import (
    AdvertiseOp,
    ClientOp,
    DeliveredMessage,
    EnqueueBatchOp,
    ForwardDataOp,
    ForwardSessionOp,
    FrameError,
    PeekOp,
    PingOp,
    PublishOp,
    ReadOp,
    ReceiveOp,
    ReportOp,
    messages_from_result,
)
from wire.versions import FEATURES

CredentialsArg = Credentials | str | Path | None
_T = TypeVar("_T")
# A call refused for one of RETRIED_CODES (client/connection.py says which and why) is asked
# again after these delays, doubling, until its deadline (AsyncClient._until_deadline).
CALL_RETRY_DELAY_INITIAL_S, CALL_RETRY_DELAY_MAX_S = 0.05, 0.5


def resolve_credentials(credentials: CredentialsArg) -> Credentials:
    if isinstance(credentials, Credentials):
        return credentials
    return load_credentials(credentials)


def _milliseconds(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _ttl_ms(ttl_s: float | None) -> int:
    """A message's time to live as the protocol carries it (0: the queue's default)."""
    if ttl_s is None:
        return 0
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s * 1000 <= TTL_MS_MAX:
        raise ValueError(f"ttl_s must be above 0 and at most {TTL_MS_MAX // 1000} seconds")
    return max(1, int(ttl_s * 1000))


def _headers_key(headers: Mapping[str, str] | None) -> Headers:
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


class AsyncClient(AdminCalls):
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
        ca_file = creds.ca_file if ca_file is None else ca_file
        limits = dict(request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s, ca_file=ca_file,
                      reconnect_delay_initial_s=reconnect_delay_initial_s,
                      reconnect_delay_max_s=reconnect_delay_max_s, enqueue_retry_time_s=enqueue_retry_time_s,
                      enqueue_attempts_max=enqueue_attempts_max, in_flight_max=in_flight_max,
                      frame_bytes_max=frame_bytes_max, heartbeat_s=heartbeat_s)
        self._router = Router(url or creds.url, creds, limits, self._learn_macros)
        self._home = self._router.home        # the node this client was given
        self.url = self._router.url
        self.client_id = creds.client_id
        self.http = self._home.http
        self._request_timeout_s = request_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None     # the home connection's, once bound
        self._macros: dict[str, MacroQueue] = {}  # macro queues in the map (client/macro.py)
        # Channels (client/channels.py): the inbox, made on first use, and the channels this
        # client advertised (each node's connection keeps those advertised through it).
        self._channel_inbox: ChannelInbox | None = None
        self._advertised: set[str] = set()
        self._leading: set[str] = set()           # of them, those it advertised as their leader
        self._forward_nodes: dict[tuple[str, str], NodeConnection] = {}   # the node each forward session is open at
        # A dedupe id is a random 80-bit prefix per client plus a counter: unique like a
        # uuid4 hex (same 32 hex characters) for a fraction of the cost per message.
        self._dedupe_prefix = os.urandom(10).hex()
        self._dedupe_counter = itertools.count(1)

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
        return self._home.connected

    @property
    def usable(self) -> bool:
        """Not closed, and not stopped by a fatal error (its credentials were refused)."""
        return self._home.usable

    @property
    def server_release(self) -> str | None:
        """The release the client's node named in its last answer; None before any answer, or
        when the node named none: qserver 0.1.0 or older (docs/PROTOCOL.md, "Versions and negotiation")."""
        return self.http.server_release

    @property
    def cluster_feature_level(self) -> int | None:
        """The cluster feature level the node named in its last answer (None: as server_release)."""
        return self.http.cluster_feature_level

    async def connect(self) -> None:
        """Open the WebSocket now rather than on the first call; raises the first attempt's
        error (reconnecting goes on in the background unless the error is fatal)."""
        await self._home.connect()

    async def close(self) -> None:
        """Unsubscribe consumers (releasing what they buffered), fail what is still pending,
        close the socket and the HTTP session."""
        if self._home.closed:
            return
        if self._channel_inbox is not None:
            self._channel_inbox.close()
        await waits.cancel_callbacks(self)      # pending on_complete waits: their callbacks hear "failed"
        await self._router.close()

    def _new_dedupe_id(self) -> str:
        return f"{self._dedupe_prefix}{next(self._dedupe_counter):012x}"

    # --- the cluster map (client/router.py) -------------------------------------------------------
    async def refresh_placement(self, queue: str | None = None) -> None:
        """Read the cluster map again (all of it, or `queue`'s entry): where each queue's master
        is. Concurrent callers share one reading (client/router.py, `Router.refresh_placement`)."""
        await self._router.refresh_placement(queue)

    def node_http(self, url: str) -> HttpClient:
        """The REST client of the cluster's node at `url`, on this client's credentials and its
        connection to that node (opened on first use): a call addressed to one node in
        particular, such as a listing of what that node masters."""
        return self._router.route_to(url.rstrip("/")).http

    def _learn_macros(self, definitions: Mapping[str, Any], only: tuple[str, ...] | None = None) -> None:
        for name in [name for name in (only or self._macros) if name in self._macros and name not in definitions]:
            del self._macros[name]
        for name, definition in definitions.items():
            if name in self._macros:
                self._macros[name].update(definition)
            else:
                self._macros[name] = MacroQueue(self, definition, self._router)

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

    # --- messages -----------------------------------------------------------------------------
    @overload
    async def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                      ttl_s: float | None = None, delay_s: float | None = None,
                      headers: Mapping[str, str] | None = None, wait: None = None, timeout_s: float | None = None,
                      on_complete: waits.OnComplete | None = None) -> int: ...
    @overload
    async def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                      ttl_s: float | None = None, delay_s: float | None = None,
                      headers: Mapping[str, str] | None = None, wait: str, timeout_s: float | None = None,
                      on_complete: waits.OnComplete | None = None) -> waits.Completion: ...
    async def enqueue(self, queue: str, payload: bytes, priority: int = 4,
                      dedupe_id: str | None = None, *, ttl_s: float | None = None,
                      delay_s: float | None = None, headers: Mapping[str, str] | None = None,
                      wait: str | None = None, timeout_s: float | None = None,
                      on_complete: waits.OnComplete | None = None) -> Any:
        """Enqueue one message and return its id once it is durable on every copy the queue's
        strength asks for. Except on a `one_way` queue (seed 004 One_Way): there the answer comes
        as soon as the master accepted the message, before it is durable, and a failure of the
        master right after may lose it (and give its id to another message); use `queued_ack`
        (the default) where an answer must mean stored. `ttl_s`: the message's time to live
        (default: the queue's `message_ttl_s`); once it has passed the message is never
        delivered (dead-lettered if the queue has a dead-letter queue, else dropped).
        `delay_s` (at most 900): the message is delivered no sooner than that. `headers`: a
        small map of names to strings (at most 16, 4,096 characters in all) that the consumer
        gets with the message (`Message.headers`). With OpenTelemetry in use and a span current,
        a producer span is made and its W3C context added to the headers (client/tracing.py).
        `wait="ack"` (one_way_ack, two_way queues) or `"reply"` (two_way): once stored, wait up to
        `timeout_s` (default 30) for the consumer and return a `Completion` (id, outcome, reply);
        E_WAIT_TIMEOUT when it did not come (the message stays queued). `on_complete`: called
        once on the client's loop with the Completion; without `wait` the id is returned at once
        (client/waits.py; docs/PROTOCOL.md, "Producers that wait")."""
        if wait is not None or on_complete is not None:
            return await waits.enqueue_waiting(self, queue, 1, lambda: self.enqueue(
                queue, payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=headers),
                wait, timeout_s, on_complete)
        if tracing.api() is not None and tracing.wants_publish(headers):
            return await tracing.publish(queue, headers, None, lambda traced: self.enqueue(
                queue, payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=traced))
        if type(payload) is not bytes:
            payload = _as_bytes(payload)
        dedupe_id = dedupe_id or self._new_dedupe_id()
        macro = self._macros.get(queue)
        if macro is not None:
            return await macro.enqueue(payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=headers)
        ttl_ms, delay_ms, named = _ttl_ms(ttl_s), _delay_ms(delay_s), _headers_key(headers)

        def attempt() -> Awaitable[int]:
            if self._router.has_map:
                return self._watched_enqueue(queue, payload, priority, dedupe_id, ttl_ms, delay_ms, named)
            return self._enqueue_at(self._home, queue, payload, priority, dedupe_id, ttl_ms, delay_ms, named)
        try:
            return await self._until_deadline(attempt)
        except QueueError as error:
            macro = await self._as_macro(queue, error)
        return await macro.enqueue(payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s, headers=headers)

    async def _watched_enqueue(self, queue: str, payload: bytes, priority: int, dedupe_id: str,
                               ttl_ms: int, delay_ms: int, headers: Headers) -> int:
        """An enqueue at the queue's master, joining its node's batch at once and watched by
        the router (Router.watched), or, when that node has no room, hedged (Router.hedged)."""
        router = self._router
        target = router.route(queue)

        def attempt(node: NodeConnection) -> Coroutine[Any, Any, int]:
            return self._enqueue_at(node, queue, payload, priority, dedupe_id, ttl_ms, delay_ms, headers)
        if not target.has_room():      # it must wait for room: a task
            return await router.hedged(queue, attempt)  # type: ignore[no-any-return]
        first = target.join_enqueue(queue, priority, payload, dedupe_id, ttl_ms, delay_ms, headers)
        return await router.watched(queue, target, first, attempt)  # type: ignore[no-any-return]

    async def _enqueue_at(self, node: NodeConnection, queue: str, payload: bytes, priority: int, dedupe_id: str,
                          ttl_ms: int = 0, delay_ms: int = 0, headers: Headers = ()) -> int:
        if not node.has_room():
            await node.wait_for_room()
        future = node.join_enqueue(queue, priority, payload, dedupe_id, ttl_ms, delay_ms, headers)
        try:
            return await future  # type: ignore[no-any-return]
        except QueueError as error:
            master = await self._router.rerouted(queue, error, failed=node)
            if master is None:
                raise
            return await retried_once(error, self._enqueue_at(master, queue, payload, priority, dedupe_id, ttl_ms,
                                                              delay_ms, headers))

    async def enqueue_many(self, queue: str, payloads: Iterable[bytes], priority: int = 4, *,
                           dedupe_ids: Sequence[str] | None = None, ttl_s: float | None = None,
                           delay_s: float | None = None, headers: Mapping[str, str] | None = None,
                           wait: str | None = None, timeout_s: float | None = None,
                           on_complete: waits.OnComplete | None = None) -> list[Any]:
        """Enqueue many messages in one batch; returns their ids in order. On an error the
        first one is raised after every answer is in (the others may be stored: pass
        `dedupe_ids` to make a retry of the whole call safe). `ttl_s`, `delay_s`, `headers`: as
        for `enqueue`, for every message. `wait`, `timeout_s`, `on_complete`: as for `enqueue`,
        for each message (with `wait`: their Completions, or the first wait's error)."""
        items = [_as_bytes(p) for p in payloads]
        if wait is not None or on_complete is not None:
            return await waits.enqueue_waiting(self, queue, len(items), lambda: self.enqueue_many(
                queue, items, priority, dedupe_ids=dedupe_ids, ttl_s=ttl_s, delay_s=delay_s, headers=headers),
                wait, timeout_s, on_complete)  # type: ignore[no-any-return]
        if dedupe_ids is not None and len(dedupe_ids) != len(items):
            raise ValueError("dedupe_ids must have one id per payload")
        ids = list(dedupe_ids) if dedupe_ids is not None else [self._new_dedupe_id() for _ in items]
        if tracing.api() is not None and tracing.wants_publish(headers):      # one producer span for the batch
            return await tracing.publish(queue, headers, len(items), lambda traced: self.enqueue_many(
                queue, items, priority, dedupe_ids=ids, ttl_s=ttl_s, delay_s=delay_s, headers=traced))
        if queue in self._macros:     # each message by the producer policy
            return list(await asyncio.gather(*(self.enqueue(queue, item, priority, dedupe_id, ttl_s=ttl_s,
                                                            delay_s=delay_s, headers=headers)
                                               for item, dedupe_id in zip(items, ids, strict=True))))
        ttl_ms, delay_ms, named = _ttl_ms(ttl_s), _delay_ms(delay_s), dict(headers) if headers else None

        def at(node: NodeConnection) -> Coroutine[Any, Any, list[int]]:
            return self._enqueue_many_at(node, queue, items, priority, ids, ttl_ms, delay_ms, named)

        def attempt() -> Awaitable[list[int]]:
            if self._router.has_map:
                return self._router.hedged(queue, at)
            return at(self._home)
        return await self._until_deadline(attempt)

    async def _until_deadline(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """`attempt()`, asked again with backoff while it fails with one of RETRIED_CODES,
        until the call's deadline (request_timeout_s from now); then its latest error, with
        its outcome unknown when any attempt's was. Safe for the calls it wraps: an enqueue's
        dedupe ids store it once, and a receive's leases of a lost answer run out."""
        loop = self._loop
        if loop is None:
            loop = self._loop = self._home.bound_loop()
        deadline = loop.time() + self._request_timeout_s
        delay_s = CALL_RETRY_DELAY_INITIAL_S
        outcome_unknown = False
        while True:
            try:
                return await attempt()
            except QueueError as error:
                outcome_unknown = outcome_unknown or error.outcome_unknown
                pause_s = jittered(delay_s)
                if error.code not in RETRIED_CODES or not self.usable or loop.time() + pause_s >= deadline:
                    if outcome_unknown and not error.outcome_unknown:
                        raise QueueError(error.kind, error.message, outcome_unknown=True) from error
                    raise
            await asyncio.sleep(pause_s)
            delay_s = min(delay_s * 2, CALL_RETRY_DELAY_MAX_S)

    async def _enqueue_many_at(self, node: NodeConnection, queue: str, items: list[bytes], priority: int,
                               ids: list[str], ttl_ms: int = 0, delay_ms: int = 0,
                               headers: dict[str, str] | None = None) -> list[int]:
        if not node.has_room():
            await node.wait_for_room()
        # The call is its own batch with one future for all its answers: no future per message.
        futures = []
        for start, end in batch_bounds(items, node.frame_bytes_max):
            op = EnqueueBatchOp(node.next_id(), queue, priority, tuple(items[start:end]), tuple(ids[start:end]),
                                ttl_ms, delay_ms, headers)
            futures.append(node.submit(op))
        try:
            outcomes = [outcome for part in await asyncio.gather(*futures) for outcome in part[1]]
        except QueueError as error:
            master = await self._router.rerouted(queue, error, failed=node)
            if master is None:
                raise
            return await retried_once(error, self._enqueue_many_at(master, queue, items, priority, ids, ttl_ms,
                                                                   delay_ms, headers))
        for outcome in outcomes:
            if type(outcome) is not int:
                raise item_error(outcome)
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
        target = self._router.route(queue)
        if target is not self._home:
            return await self._router.via(
                queue, target, lambda node: self._receive_at(node, queue, max_messages, wait_s, visibility_timeout_s))
        return await self._receive_at(target, queue, max_messages, wait_s, visibility_timeout_s)

    async def _receive_at(self, node: NodeConnection, queue: str, max_messages: int, wait_s: float,
                          visibility_timeout_s: float | None) -> list[Message]:
        if not node.has_room():
            await node.wait_for_room()
        op = ReceiveOp(node.next_id(), queue, max_messages, int(wait_s * 1000), _milliseconds(visibility_timeout_s))
        started_ns = time.time_ns() if tracing.api() is not None else None      # a consumer span's start
        try:
            result = await node.submit(op)
        except QueueError as error:
            master = await self._router.rerouted(queue, error, failed=node)
            if master is None:
                raise
            return await retried_once(error, self._receive_at(master, queue, max_messages, wait_s,
                                                              visibility_timeout_s))
        leases = self._router.leases_for(node)      # acks go where the message was leased
        try:
            messages = [Message(leases, queue, m) for m in messages_from_result(result)]
        except FrameError as exc:
            raise QueueError(E_INTERNAL, f"a malformed receive answer: {exc}", outcome_unknown=True) from None
        if started_ns is not None and messages:
            tracing.received(queue, messages, started_ns)
        return messages

    def ack(self, queue: str, message_id: int, receipt: str) -> Awaitable[None]:
        """Acknowledge (delete) a leased message; concurrent acks on a queue share one batch.

        Returns an awaitable future rather than a coroutine, so a consumer that acks without
        waiting (`asyncio.ensure_future(message.ack())`) creates no task per message."""
        return self._router.ack(queue, message_id, receipt)

    async def release(self, queue: str, message_id: int, receipt: str) -> None:
        await self._router.release(queue, message_id, receipt)

    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        """Give a leased message's lease `visibility_timeout_s` from now, under the same
        receipt (0 gives it back at the next expiry sweep). Refused with E_LEASE_EXPIRED once
        the lease has ended; the duration is counted on the serving member's clock."""
        if not 0 <= visibility_timeout_s <= VISIBILITY_MAX_S:
            raise ValueError(f"visibility_timeout_s must be in [0, {VISIBILITY_MAX_S:g}]")
        await self._router.extend(queue, message_id, receipt, visibility_timeout_s)

    def lease(self, queue: str, message_id: int, receipt: str, node_url: str | None = None) -> Message:
        """A handle on a message leased earlier, known by its id and receipt alone (as an SQS
        receipt handle carries them): ack, release or extend it at `node_url`, the node that
        leased it (under `producer` each member keeps its own leases), or with None wherever
        the map says the queue's master is now. Its payload and headers are empty."""
        router = self._router
        leases = router if node_url is None else router.leases_for(router.route_to(node_url.rstrip("/")))
        return Message(leases, queue, DeliveredMessage(message_id, receipt, 0, 0, b""))

    def leased_at(self, message: Message) -> str:
        """The URL of the node a received message's lease belongs to (see `lease`)."""
        return str(getattr(message._client, "url", self._router.url))

    # --- channels (seed 002; client/channels.py) ----------------------------------------------
    @property
    def _inbox(self) -> ChannelInbox:
        if self._channel_inbox is None:
            self._channel_inbox = ChannelInbox(self._router)
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

    @overload
    def read(self, channel: str) -> ChannelDelivery | None: ...
    @overload
    def read(self, channel: str, message_id: int) -> Awaitable[dict[str, Any]]: ...

    def read(self, channel: str, message_id: int | None = None) -> ChannelDelivery | None | Awaitable[dict[str, Any]]:
        """`read(channel)`: the next unread message of a channel (under `latest`, its newest
        value), or None. `await read(queue, message_id)`: one message of a queue by id, browsed
        without taking it (`read_message`)."""
        if message_id is not None:
            return self.read_message(channel, message_id)
        return self._inbox.read(channel)

    async def next_channel_message(self) -> ChannelDelivery:
        """The first unread message across the subscribed channels, waiting for one."""
        return await self._inbox.next()

    async def advertise(self, *channels: str, leader: bool = False) -> None:
        """Declare that this client publishes to these channels (seed 002: a publish to a
        channel not advertised is refused, E_NOT_ADVERTISED). Several producers may; `leader`
        takes the lead (at cluster feature level 3, kept wherever the channel moves): while it
        leads, the others' publishes are refused E_STANDBY."""
        self._advertised.update(channels)
        if leader:
            self._leading.update(channels)
        for channel in channels:
            if not self._router.knows_master(channel_queue(channel)):   # its master keeps who leads
                with contextlib.suppress(QueueError):
                    await self._router.refresh_placement(channel_queue(channel))
            target = self._router.consume_target(channel_queue(channel))   # the master (route: maybe the replica)
            try:
                await self._advertise_at(target, channel)
            except QueueError as error:
                if leader and error.code == E_BAD_FRAME.code:      # a node of 0.2.0: op 15 has no `leader`
                    raise QueueError(E_FEATURE_DISABLED, "advertising as a channel's leader needs cluster feature "
                                                         f"level {FEATURES['channel_advertisers']} (0.3.0)") from None
                raise

    async def unadvertise(self, *channels: str) -> None:
        """Withdraw: the next advertiser leads, and this client's publishes are refused (an
        unknown channel: E_UNKNOWN_CHANNEL). Sent to the channel's master, which keeps who
        advertised (`route` may be this client's own node, the replica: it would withdraw
        nothing there), and to the routed node too if it was advertised through it."""
        self._advertised.difference_update(channels)
        self._leading.difference_update(channels)
        for channel in channels:
            master = self._router.consume_target(channel_queue(channel))
            routed = self._router.route(channel_queue(channel))
            for target in [master] + ([routed] if routed is not master and channel in routed.advertised_here else []):
                target.advertised_here.pop(channel, None)
                try:
                    await target.call(AdvertiseOp(target.next_id(), (channel,), False))
                except QueueError as error:
                    if error.code != E_UNAVAILABLE.code:    # a node not reached forgot it with the socket
                        raise

    async def _advertise_at(self, node: NodeConnection, channel: str) -> None:
        await node.call(AdvertiseOp(node.next_id(), (channel,), True, channel in self._leading))
        node.advertised_here[channel] = channel in self._leading

    async def publish(self, channel: str, payload: bytes, dedupe_id: str | None = None) -> int:
        """Publish one message to an advertised channel; returns its id once it is committed
        (and sent to the channel's subscribers). A dedupe id makes a retry publish it once."""
        dedupe_id = dedupe_id or self._new_dedupe_id()
        queue = channel_queue(channel)
        target = self._router.consume_target(queue)       # its master: a channel's replica does not pass it on
        try:
            return await self._publish_at(target, channel, payload, dedupe_id)
        except QueueError as error:
            other = await self._router.rerouted(queue, error, failed=target) \
                if error.code != E_NOT_ADVERTISED.code else None
            if other is None:
                raise
            return await retried_once(error, self._publish_at(other, channel, payload, dedupe_id))  # type: ignore[no-any-return]

    async def _publish_at(self, node: NodeConnection, channel: str, payload: bytes, dedupe_id: str) -> int:
        if channel in self._advertised and channel not in node.advertised_here:
            await self._advertise_at(node, channel)      # the channel's master is this node now
        result = await node.call(PublishOp(node.next_id(), channel, _as_bytes(payload), dedupe_id))
        return int(result[0])

    async def report(self, channel: str, message_id: int) -> dict[str, Any]:
        """What became of a published message: `state` queued, delivered (to every subscriber;
        under `acked`, acknowledged by all), pending_ack or failed (a subscriber left without
        acknowledging), with the counts."""
        queue = channel_queue(channel)
        return dict(await self._router.via(queue, self._router.route(queue),
                                           lambda node: node.call(ReportOp(node.next_id(), channel, message_id))))

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
            self._router.forward_rates[(queue, forward)] = on_rate
        if not open:
            return await self._forward_session_at(self._forward_node(queue, forward), queue, forward, weight, False)
        node = self._router.route(queue)
        try:
            terms = await self._forward_session_at(node, queue, forward, weight, True)
        except QueueError as error:
            other = await self._router.rerouted(queue, error, failed=node)
            if other is None:
                raise
            node = other
            terms = await retried_once(error, self._forward_session_at(node, queue, forward, weight, True))
        self._forward_nodes[(queue, forward)] = node
        return terms

    def _forward_node(self, queue: str, forward: str) -> NodeConnection:
        node = self._forward_nodes.get((queue, forward))
        if node is None:
            raise QueueError(E_UNKNOWN_FORWARD, f"no session of forward {forward} open from this client")
        return node

    @staticmethod
    async def _forward_session_at(node: NodeConnection, queue: str, forward: str, weight: int, open: bool) -> Any:
        return await node.call(ForwardSessionOp(node.next_id(), queue, forward, weight, open))

    async def forward_data(self, queue: str, forward: str, stream: str, weight: int, floor: int,
                           items: Sequence[tuple[bytes, int, int, int, dict[str, str] | None]]) -> list[int | QueueError]:
        """A data message of an open session: items (payload, priority, number, ttl_ms, headers)
        numbered in `stream`, every number below `floor` settled. One outcome per item: the
        message id (a number stored before counts as stored) or the error that refused it."""
        node = self._forward_node(queue, forward)
        outcomes = await node.call(ForwardDataOp(node.next_id(), queue, forward, stream, weight, floor, tuple(items)))
        return [outcome if type(outcome) is int else item_error(outcome) for outcome in outcomes]

    def forget_forward(self, queue: str, forward: str) -> None:
        self._router.forward_rates.pop((queue, forward), None)
        self._forward_nodes.pop((queue, forward), None)

    # --- browsing without taking (docs/PROTOCOL.md, "Browsing messages (peek)"; client/browse.py) ---
    async def peek(self, queue: str, after: int = 0, limit: int = 100, preview: bool = False) -> dict[str, Any]:
        """A page of `queue`'s messages in delivery order, leasing nothing and counting no
        delivery: {"messages": [{"id", "priority", "state", "deliveries", "enqueued_at_ms",
        "headers", "size", "payload" (bytes), "truncated"}], "next_after" (the next page's
        `after`; None at the end), "served_by": {"node", "role"}}. `limit` 1..1000; `preview`:
        only each payload's first KiB."""
        page = await self._until_deadline(
            lambda: self._browse(queue, lambda request_id: PeekOp(request_id, queue, after, limit, preview)))
        return browse.page_from(page)

    async def read_message(self, queue: str, message_id: int) -> dict[str, Any]:
        """One message of `queue` by id, as `peek` lists it (in full) with "served_by";
        E_UNKNOWN_MESSAGE when the queue does not hold it. Leases nothing."""
        found = await self._until_deadline(
            lambda: self._browse(queue, lambda request_id: ReadOp(request_id, queue, message_id)))
        return browse.read_from(found)

    async def _browse(self, queue: str, make: Callable[[int], ClientOp]) -> Any:
        target = self._router.route(queue)
        if target is not self._home:
            return await self._router.via(queue, target, lambda node: self._browse_at(node, queue, make))
        return await self._browse_at(target, queue, make)

    async def _browse_at(self, node: NodeConnection, queue: str, make: Callable[[int], ClientOp]) -> Any:
        try:
            return await node.call(make(node.next_id()))
        except QueueError as error:
            too_old = browse.node_too_old(error, f"the node at {node.url}")
            if too_old is not None:
                raise too_old from None
            master = await self._router.rerouted(queue, error, failed=node)
            if master is None:
                raise
            return await retried_once(error, self._browse_at(master, queue, make))

    async def ping(self) -> None:
        """One round trip over the WebSocket (connecting first if needed)."""
        await self._home.submit(PingOp(self._home.next_id()))

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
        target = self._router.consume_target(queue)
        consumer = Consumer(target, queue, prefetch, _milliseconds(visibility_timeout_s),
                            router=self._router, recipient=recipient)
        consumer._attach(target)
        return consumer
