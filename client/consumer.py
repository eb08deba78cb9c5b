"""What the application holds of leased messages: `Message`, `LeaseKeeper` and `Consumer`.

A `Message` is one leased message, acked, released or extended through whoever it was leased
from (`Leases`: the node's connection, or the router for the home node, which follows the
map). A `Consumer` is one subscription's pushed messages as an async iterator, with the
credit-based flow control of docs/PROTOCOL.md; it lives on one node's connection
(client/connection.py) and follows the queue's master to another node through the router
(client/router.py) after a handoff or failover. Kept apart from the connection and the router
because it is what the application sees: neither of them needs more of it than the hooks the
connection calls (`_subscribe`, `_on_messages`, ...).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any, Self

from client import tracing
from client.connection import CLEANUP_TIMEOUT_S, Leases, NodeConnection, ignore_outcome, jittered
from wire.errors import E_NOT_MASTER, E_UNAVAILABLE, QueueError
from wire.message_input import VISIBILITY_MAX_S
from wire.protocol import CreditOp, DeliveredMessage, ReleaseOp, SubscribeOp, UnsubscribeOp

if TYPE_CHECKING:
    from client.router import Router

# A consumer without a subscription tries again after these delays, doubling (Consumer._resubscribe).
RESUBSCRIBE_DELAY_INITIAL_S, RESUBSCRIBE_DELAY_MAX_S = 0.05, 0.5


class Message:
    """A leased message; `ack()` deletes it and `release()` gives it back, through the client
    that received it (`Leases`: its node's connection, or the router for the home node)."""

    __slots__ = ("_client", "deliveries", "headers", "id", "payload", "priority", "queue", "receipt")

    def __init__(self, client: Leases, queue: str, delivered: DeliveredMessage) -> None:
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

    @property
    def trace_context(self) -> Any:
        """The producer's OpenTelemetry context from the message's `traceparent` header, to start
        a handler's span in (client/tracing.py `context_of`); None without one."""
        return tracing.context_of(self.headers)

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
        if not 0 < visibility_timeout_s <= VISIBILITY_MAX_S:
            raise ValueError(f"visibility_timeout_s must be in (0, {VISIBILITY_MAX_S:g}]")
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


class Consumer:
    """An async iterator of messages pushed to a subscription, with credit-based flow control.

    The server may push as many messages as it has credit for; the consumer starts with
    `prefetch` credit and grants more, in batches of half the prefetch, as the application
    takes messages, so at most `prefetch` messages are leased but not yet taken. Several
    tasks may iterate one consumer at once: workers that each await their own ack keep
    many acks in one batch, where one task awaiting each ack in turn pays a round trip each.
    """

    def __init__(self, client: NodeConnection, queue: str, prefetch: int, visibility_ms: int | None, *,
                 router: Router | None = None, recipient: str | None = None) -> None:
        """`client`: the connection it subscribes through. `router`: the router of the client
        whose consume() made it; it knows the cluster map, so that the
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
            waiter: asyncio.Future[None] = self._client.bound_loop().create_future()
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
        client.consumers.discard(self)
        if not client.connected or client.closed:
            return
        calls = [client.submit(ReleaseOp(client.next_id(), self.queue, m.id, m.receipt))
                 for m in self._buffer]
        self._buffer.clear()
        if self._subscription_id is not None:
            calls.append(client.submit(UnsubscribeOp(client.next_id(), self._subscription_id)))
        if calls:
            await asyncio.wait(calls, timeout=CLEANUP_TIMEOUT_S)
            for call in calls:
                call.add_done_callback(ignore_outcome)
        if self._subscription_id is not None:
            client.forget_subscription(self._subscription_id)

    # --- driven by the client -----------------------------------------------------------------
    def _subscribe(self) -> None:
        """(Re)subscribe with the credit not yet in use: prefetch minus what is buffered."""
        credit = self.prefetch - len(self._buffer)
        if self.closed or self._subscribing or credit < 1:
            return
        op = SubscribeOp(self._client.next_id(), self.queue, credit, self._visibility_ms, self.recipient)
        self._subscribing = True
        self._taken = 0
        self._client.subscribing[op.request_id] = self
        self._client.submit_quietly(op)

    def _grant(self) -> None:
        if self._subscription_id is not None:
            op = CreditOp(self._client.next_id(), self._subscription_id, self._taken)
            self._taken = 0
            self._client.submit_quietly(op)
        elif not self._subscribing and self._client.connected:
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
            self._client.submit_quietly(UnsubscribeOp(self._client.next_id(), subscription_id))
        elif self._taken >= self._credit_batch:
            self._grant()

    def _on_subscribe_failed(self, error: QueueError) -> None:
        self._subscribing = False
        self._on_unsubscribed(error)

    def _on_messages(self, messages: tuple[DeliveredMessage, ...]) -> None:
        client = self._client if self._router is None else self._router.leases_for(self._client)
        queue = self.queue
        made = [Message(client, queue, delivered) for delivered in messages]
        self._buffer.extend(made)
        if tracing.api() is not None:       # a consumer span per pushed message that carries a trace context
            tracing.received(queue, made)
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
        recovered from. A consumer without a router (so without a map) cannot follow a
        master elsewhere: E_NOT_MASTER ends it."""
        if self.closed:
            return
        if not error.retriable or (error.code == E_NOT_MASTER.code and self._router is None):
            self._error = error
            self._wake()
            return
        self._recover(error)

    def _recover(self, error: QueueError) -> None:
        loop = self._client.bound_loop()
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
                await asyncio.sleep(jittered(delay_s))
                delay_s = min(delay_s * 2, RESUBSCRIBE_DELAY_MAX_S)
                if not self._needs_subscription():
                    break
                self._report_long_outage()
                if self._subscribing:          # an attempt is under way: its answer decides
                    continue
                await self._follow_map()
                if self._needs_subscription() and not self._subscribing and self._client.connected:
                    self._subscribe()           # not connected: the client subscribes on reconnect
        finally:
            self._recovering = None

    def _report_long_outage(self) -> None:
        client = self._client
        since = self._unsubscribed_since
        now = client.bound_loop().time()
        if since is not None and now - since >= client.request_timeout_s and self._last_failure is not None:
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
        target = router.consume_target(self.queue)
        if target is not self._client and not self.closed:
            self._client.consumers.discard(self)
            self._attach(target)

    def _attach(self, client: NodeConnection) -> None:
        client.start()
        self._client = client
        client.consumers.add(self)
        if client.connected:
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
