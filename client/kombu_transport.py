"""A kombu transport over the cluster, so that Celery runs on it: `broker_url = "qcluster://n1:7100,n2:7100"`.

Built like kombu's own virtual transports (SQS, Redis): kombu keeps exchanges and bindings in
the process (`kombu.transport.virtual`), and this module maps what reaches a queue onto the
client library (client/aio.py, run on a loop thread of its own by client/kombu_link.py):

| kombu | the cluster |
|---|---|
| a queue (declared) | a queue, created with the `queue_options` transport option unless `create_queues` is off |
| publish (`_put`) | enqueue: kombu's message (body, headers, properties) as a JSON envelope in the payload; its priority 0-9 as ours (9 highest); its `expiration` as the message's time to live |
| consume, `drain_events` | long-polled receives (`wait_time_seconds`), at most one per queue at a time, leasing for `visibility_timeout` no more than `prefetch_count` asks for |
| ack | ack |
| reject with requeue, recover, a channel closed with unacked messages | release (the message is ready again at once) |
| reject without requeue | ack (discarded, as an AMQP broker without a dead-letter exchange does) |
| a long task | every lease the channel holds (delivered and unacked, or fetched ahead) is extended every third of `visibility_timeout`, so no other worker gets the message meanwhile; a worker that dies stops extending and its messages come back after `visibility_timeout` |
| `_size`, `_purge`, `_delete` | the queue's `ready` count, purge, delete |

Each delivery gets a fresh kombu delivery tag (a message delivered twice must not share one in
kombu's QoS), and `delivery_info["redelivered"]` is set from our delivery count. docs/CELERY.md
has the URL, the options, the grants a worker and a producer need, and what differs from AMQP.

The `qcluster` URL scheme: kombu resolves a scheme only through `kombu.transport.TRANSPORT_ALIASES`;
importing this module adds `qcluster` there, and an installed package adds it without any import of
ours (the `.pth` hook of `_qcluster_kombu_alias.py`, docs/CELERY.md "How qcluster:// is found").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport.virtual.base import queue_declare_ok_t
from kombu.utils.json import dumps, loads

from client.aio import AsyncClient
from client.consumer import Message as LeasedMessage
from client.kombu_link import (
    ClusterChannelError,
    ClusterConnectionError,
    ClusterLink,
    kombu_error,
    node_urls,
    options_of,
)
from replication.options import DEAD_LETTER_SUFFIX, QUEUE_NAME_PATTERN
from wire.errors import E_INVALID_NAME, E_LEASE_EXPIRED, E_OPTIONS_MISMATCH, E_UNKNOWN_QUEUE, QueueError
from wire.message_input import RECEIVE_MESSAGES_MAX, VISIBILITY_MAX_S
from wire.versions import RELEASE

TRANSPORT_ALIASES.setdefault("qcluster", "client.kombu_transport:Transport")

log = logging.getLogger(__name__)

# The transport options (kombu's `transport_options`, Celery's `broker_transport_options`)
# and their defaults; docs/CELERY.md, "Transport options", says what each does.
DEFAULT_OPTIONS: dict[str, Any] = {
    "credentials": None,              # path of a credentials file; None: the usual search (client/credentials.py)
    "visibility_timeout": 30.0,       # seconds a receive leases for; the keep-alive extends it
    "wait_time_seconds": 5.0,         # one long poll's wait at most
    "receive_batch": 10,              # messages one receive asks for when prefetch_count is 0 (no limit)
    "create_queues": True,            # declare creates the queue (grant admin); False: an operator made them
    "queue_options": {"strength": "full"},   # for the queues it creates: every operation on both members
    "queue_name_prefix": "",          # put before every kombu queue name
    "request_timeout": 30.0,          # the client library retries a failover away this long
}
KEEP_ALIVE_MIN_S = 0.2
WAKE_S = 1.0       # drain_events looks again this often while it waits, as a safety net


class Lease:
    """A message this transport holds a lease on: fetched ahead, or delivered and not yet acked."""

    __slots__ = ("message", "queue")

    def __init__(self, queue: str, message: LeasedMessage) -> None:
        self.queue = queue
        self.message = message


class Channel(virtual.Channel):
    """A kombu channel: its consumers' long polls, what they fetched ahead (`_buffer`) and
    what it delivered unacked (`_held`, by delivery tag). Every mutation happens under the
    transport's condition lock: kombu's thread, the pool's threads (acks) and the loop thread
    (poll results) all touch them."""

    do_restore = True

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._transport = connection
        self._buffer: deque[Lease] = deque()
        self._held: dict[str, Lease] = {}
        self._polling: dict[str, int] = {}      # queue -> messages its outstanding receive asks for
        self._noack_queues: set[str] = set()

    # --- queues ---------------------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self._transport.declare(queue, auto_delete=bool(kwargs.get("auto_delete")))

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        """Declare (create once per connection); the answer's message count is 0 except for a
        passive declare: asking costs a signed REST call, and Celery's rpc:// result backend
        declares its reply queue at every publish. `_size` and a passive declare read it."""
        if passive:
            return super().queue_declare(queue, passive=True, **kwargs)
        name = queue or f"amq.gen-{uuid.uuid4()}"
        self._new_queue(name, **kwargs)
        return queue_declare_ok_t(name, 0, 0)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        try:
            self._transport.stats(queue)
        except ClusterChannelError as error:
            if error.code == E_UNKNOWN_QUEUE.code:
                return False
            raise
        return True

    def _size(self, queue: str) -> int:
        try:
            return int(self._transport.stats(queue).get("ready", 0))
        except ClusterChannelError as error:
            if error.code == E_UNKNOWN_QUEUE.code:
                return 0
            raise

    def _purge(self, queue: str) -> int:
        name = self._transport.queue_name(queue)
        answer = self._transport.link.call(lambda c: c.purge(name), f"purge {name!r}")
        return int(answer.get("purged", 0))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._transport.delete(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> None:
        # kombu's virtual queue_delete deletes only queues bound in this process's state; the
        # cluster's queue exists whoever declared it.
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)

    # --- publish --------------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        name = self._transport.queue_name(queue)
        priority = self._get_message_priority(message)          # kombu's 0-9, 9 highest: ours too
        ttl_s = _ttl_s(message.get("properties", {}).get("expiration"))
        payload = dumps(message).encode()
        self._transport.link.call(lambda c: c.enqueue(name, payload, priority, ttl_s=ttl_s),
                                  f"publish to {name!r}")

    # --- consume --------------------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, callback: Callable[..., Any], consumer_tag: str,
                      **kwargs: Any) -> Any:
        with self._transport.cond:
            if no_ack:
                self._noack_queues.add(queue)
            self._transport.consumed.add(queue)
            result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
            self._transport.cond.notify_all()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        with self._transport.cond:
            queue = self._tag_to_queue.get(consumer_tag)
            result = super().basic_cancel(consumer_tag)
            if queue is not None and queue not in self._active_queues:
                self._noack_queues.discard(queue)
            self._transport.cond.notify_all()
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """One message of `queue` now, or None: one fetched ahead, else a receive that waits for none."""
        with self._transport.cond:
            lease = next((item for item in self._buffer if item.queue == queue), None)
            if lease is not None:
                self._buffer.remove(lease)
        if lease is None:
            name = self._transport.queue_name(queue)
            visibility_s = self._transport.options["visibility_timeout"]
            messages = self._transport.link.call(lambda c: c.receive(name, 1, 0.0, visibility_s),
                                                 f"receive from {name!r}")
            if not messages:
                return None
            lease = Lease(queue, messages[0])
        with self._transport.cond:
            raw = self._take(lease, no_ack)
        if raw is None:
            return None
        message = self.Message(raw, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _take(self, lease: Lease, no_ack: bool) -> dict[str, Any] | None:
        """The kombu message of a lease about to be delivered (under the lock): held until its
        ack, or acked now for a no-ack consumer. None for a payload that is no kombu envelope
        (enqueued by something else): given back, and dead-lettered after max_deliveries."""
        raw = envelope(lease.message)
        if raw is None:
            log.warning("qcluster: message %s of queue %r is not a kombu message; released",
                        lease.message.id, lease.queue)
            self._transport.settle(lease.message.release, "release")
            return None
        if no_ack:
            self._transport.settle(lease.message.ack, "ack")
        else:
            self._held[raw["properties"]["delivery_tag"]] = lease
        return raw

    def next_delivery(self) -> tuple[str, dict[str, Any]] | None:
        """(queue, kombu message) to deliver now, under the lock; None when nothing may be."""
        while self._buffer and self._consumers and self.qos.can_consume():
            lease = self._buffer.popleft()
            if lease.queue not in self._active_queues:
                self._transport.settle(lease.message.release, "release")
                continue
            raw = self._take(lease, lease.queue in self._noack_queues)
            if raw is not None:
                return lease.queue, raw
        return None

    def pump(self) -> None:
        """Start a long poll on each consumed queue without one, asking for no more than the
        prefetch count leaves room for (under the lock). A queue gets at least one message's
        worth while there is any room, so that one queue's long poll never starves another."""
        if self.closed or not self._consumers:
            return
        active = list(dict.fromkeys(self._active_queues))
        idle = [queue for queue in active if queue not in self._polling]
        if not idle:
            return
        prefetch = self.qos.prefetch_count
        if prefetch:
            room = prefetch - len(self._held) - len(self._buffer) - sum(self._polling.values())
            if room <= 0:
                return
            each = max(1, room // len(active))
        else:
            if self._buffer:
                return
            each = self._transport.options["receive_batch"]
        link = self._transport.link
        if link.client is None:
            return
        for queue in idle:
            self._polling[queue] = each
            link.spawn(self._long_poll(link.client, queue, each))

    async def _long_poll(self, client: AsyncClient, queue: str, count: int) -> None:
        """One long poll (on the loop thread); what it leased goes to the buffer, or back to
        the queue when nobody consumes it any more."""
        transport = self._transport
        name = transport.queue_name(queue)
        error: QueueError | None = None
        messages: list[LeasedMessage] = []
        try:
            messages = await client.receive(name, count, transport.options["wait_time_seconds"],
                                            transport.options["visibility_timeout"])
        except QueueError as failure:
            error = failure
        except (RuntimeError, OSError) as failure:     # a client closed under it (a reconnect)
            if not self.closed:
                error = QueueError("E_UNAVAILABLE", f"the connection ended: {failure!r}")
        finally:
            with transport.cond:
                self._polling.pop(queue, None)
                give_back = messages if self.closed or queue not in self._active_queues else []
                if not give_back:
                    self._buffer.extend(Lease(queue, m) for m in messages)
                if error is not None and not self.closed:
                    transport.failed(kombu_error(error, f"receive from {name!r}"))
                transport.cond.notify_all()
        for message in give_back:
            with contextlib.suppress(QueueError, RuntimeError, OSError):
                await message.release()

    # --- settle ---------------------------------------------------------------------------------
    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        with self._transport.cond:
            lease = self._held.pop(delivery_tag, None)
            self._transport.cond.notify_all()       # room for more: the drain loop polls again
        if lease is not None:
            self._transport.settle(lease.message.ack, "ack")
        super().basic_ack(delivery_tag, multiple)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            with self._transport.cond:
                lease = self._held.pop(delivery_tag, None)
            if lease is not None:
                self._transport.settle(lease.message.ack, "ack")
        super().basic_reject(delivery_tag, requeue=requeue)     # requeue: QoS.reject -> _restore

    def _restore(self, message: Any) -> None:
        """Give a delivered message back (reject with requeue, recover, a channel closed with
        it unacked): released, so that it is ready again at once, rather than published again
        as kombu's virtual transports do (which would leave our lease to run out as well)."""
        with self._transport.cond:
            lease = self._held.pop(message.delivery_tag, None)
            self._transport.cond.notify_all()
        if lease is not None:
            self._transport.settle(lease.message.release, "release")

    def leases(self) -> list[LeasedMessage]:
        """Every message this channel holds a lease on (under the lock): the keep-alive's list."""
        return [lease.message for lease in itertools.chain(self._buffer, self._held.values())]

    def close(self) -> None:
        transport = self._transport
        if self.closed:
            return
        super().close()          # cancels the consumers and restores (releases) the unacked
        with transport.cond:
            left = list(itertools.chain(self._buffer, self._held.values()))
            self._buffer.clear()
            self._held.clear()
            transport.cond.notify_all()
        for lease in left:
            transport.settle(lease.message.release, "release")


class Transport(virtual.Transport):
    """kombu's Transport for `qcluster://` URLs (see the module docstring)."""

    Channel = Channel
    driver_type = "qcluster"
    driver_name = "qcluster"
    default_port = 7100           # type: ignore[assignment]
    can_parse_url = True          # the URL holds several hosts: kombu passes it whole
    polling_interval = None       # type: ignore[assignment]   # long polls: drain_events never sleeps
    connection_errors = (*virtual.Transport.connection_errors, ClusterConnectionError)  # type: ignore[assignment]
    channel_errors = (*virtual.Transport.channel_errors, ClusterChannelError)  # type: ignore[assignment]
    # kombu's `ensure` (publish retries) reconnects on these and tries again; a refusal
    # (ClusterChannelError) is raised as it is: trying again would meet the same refusal.
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()
    implements = virtual.Transport.implements.extend(
        asynchronous=False, exchange_type=frozenset(["direct", "topic"]), heartbeats=False)

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.options = options_of(client.transport_options or {}, DEFAULT_OPTIONS)
        if not 0 < self.options["visibility_timeout"] <= VISIBILITY_MAX_S or self.options["wait_time_seconds"] < 0 \
                or not 1 <= self.options["receive_batch"] <= RECEIVE_MESSAGES_MAX:
            raise ValueError(f"visibility_timeout must be above 0 and at most {VISIBILITY_MAX_S:g}, "
                             f"wait_time_seconds at least 0, receive_batch 1-{RECEIVE_MESSAGES_MAX}")
        self.cond = threading.Condition()
        self.consumed: set[str] = set()          # queues some channel of this connection consumed
        self._auto_delete: set[str] = set()
        self._declared: set[str] = set()
        self._error: Exception | None = None
        self._settling: set[concurrent.futures.Future[None]] = set()
        self._link: ClusterLink | None = None
        self._keep_alive: concurrent.futures.Future[None] | None = None
        self._turn = 0
        self._learned_urls: list[str] = []       # the cluster's nodes, as the last connection read them
        self._node_down: str | None = None       # the node the last connection lost: tried last

    def driver_version(self) -> str:
        return RELEASE

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """The broker URL as given: kombu's own sanitizing parses one host and port only and
        fails on `host1:7100,host2:7100`. The URL holds no secret (the credentials file signs);
        a `user:password@` someone put there anyway is masked."""
        if include_password or not uri.startswith("qcluster://"):
            return uri
        hosts = uri.removeprefix("qcluster://").split(",")
        return "qcluster://" + ",".join(host.split("@", 1)[1] if "@" in host else host for host in hosts)

    @property
    def link(self) -> ClusterLink:
        if self._link is None:
            raise ClusterConnectionError("the transport is not connected")
        return self._link

    # --- connection -----------------------------------------------------------------------------
    def establish_connection(self) -> Any:
        conninfo = self.client
        assert conninfo is not None
        named = node_urls(conninfo.hostname, tls=bool(conninfo.ssl), port=conninfo.port or self.default_port)
        # The URL's nodes in its order, then the others the cluster map named; the node the
        # previous connection lost goes last.
        urls = list(dict.fromkeys(named + self._learned_urls))
        if self._node_down in urls and len(urls) > 1:
            urls.remove(self._node_down)
            urls.append(self._node_down)
        link = ClusterLink(urls, self.options["credentials"], request_timeout_s=self.options["request_timeout"],
                           connect_timeout_s=float(conninfo.connect_timeout or 5.0))
        try:
            link.connect()
        except BaseException:
            link.close()
            raise
        self._link = link
        self._error = None                       # a failure of the connection before is no news to this one
        self._learned_urls = link.learned_urls or self._learned_urls
        self._node_down = None
        self._keep_alive = link.spawn(self._keep_leases())
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        super().close_connection(connection)      # closes the channels: their leases are given back
        link, self._link = self._link, None
        if link is None:
            return
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        pending = list(self._settling)
        doomed = [self.queue_name(q) for q in self._auto_delete & self.consumed]

        async def cleanup(client: Any) -> None:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)
            # AMQP deletes an auto_delete queue when its last consumer goes: Celery's rpc://
            # reply queue is one, made per producer process.
            for name in doomed:
                with contextlib.suppress(QueueError):
                    await client.delete_queue(name)
        # Acks and releases for a node that is down would only wait for their deadline.
        link.close(cleanup, timeout_s=0.5 if link.node_down else 5.0)

    # --- names and queue calls ------------------------------------------------------------------
    def queue_name(self, queue: str) -> str:
        name = f"{self.options['queue_name_prefix']}{queue}"
        if not QUEUE_NAME_PATTERN.fullmatch(name) or name.endswith(DEAD_LETTER_SUFFIX):
            raise ClusterChannelError(
                f"{name!r} cannot name a queue of the cluster: 1-196 characters of A-Z a-z 0-9 . _ : - "
                f"(starting with a letter or digit), not ending in {DEAD_LETTER_SUFFIX!r}", E_INVALID_NAME.code)
        return name

    def declare(self, queue: str, *, auto_delete: bool) -> None:
        name = self.queue_name(queue)
        if auto_delete:
            self._auto_delete.add(queue)
        if not self.options["create_queues"] or name in self._declared:
            return
        options = dict(self.options["queue_options"])
        try:
            self.link.call(lambda c: c.create_queue(name, **options), f"create queue {name!r}")
        except ClusterChannelError as error:
            if error.code == E_OPTIONS_MISMATCH.code:
                log.info("qcluster: queue %r exists with other options than %s; used as it is", name, options)
            elif error.code == "E_FORBIDDEN":
                # A client without admin uses a queue an operator made: it exists if its
                # statistics answer (any grant on the name may read them).
                try:
                    self.stats(queue)
                except ClusterChannelError:
                    raise ClusterChannelError(
                        f"{error}; creating a queue needs the grant admin on it: give the client that grant, "
                        "or create the queue beforehand (qctl queue create)", error.code) from error
            else:
                raise
        self._declared.add(name)

    def stats(self, queue: str) -> dict[str, Any]:
        name = self.queue_name(queue)
        return dict(self.link.call(lambda c: c.queue_stats(name), f"statistics of {name!r}"))

    def delete(self, queue: str) -> None:
        name = self.queue_name(queue)
        self._declared.discard(name)
        try:
            self.link.call(lambda c: c.delete_queue(name), f"delete queue {name!r}")
        except ClusterChannelError as error:
            if error.code != E_UNKNOWN_QUEUE.code:
                raise

    # --- leases ---------------------------------------------------------------------------------
    def settle(self, action: Callable[[], Awaitable[None]], what: str) -> None:
        """Ack or release on the loop without waiting (kombu's thread goes on); a close waits
        for what is still under way. A refusal is logged: the message is delivered again."""
        link = self._link
        if link is None:
            return

        async def run() -> None:
            try:
                await action()
            except QueueError as error:
                if error.code == E_LEASE_EXPIRED.code:
                    log.warning("qcluster: %s refused, the lease had ended (the message is delivered again): %s",
                                what, error)
                else:
                    log.warning("qcluster: %s failed: %s", what, error)
        future = link.spawn(run())
        self._settling.add(future)
        future.add_done_callback(self._settling.discard)

    async def _keep_leases(self) -> None:
        """Extend every lease the channels hold, every third of the visibility timeout."""
        visibility_s = self.options["visibility_timeout"]
        every_s = max(KEEP_ALIVE_MIN_S, visibility_s / 3)
        while True:
            await asyncio.sleep(every_s)
            with self.cond:
                leases = [m for channel in list(self.channels) for m in channel.leases()]
            outcomes = await asyncio.gather(*(m.extend(visibility_s) for m in leases), return_exceptions=True)
            for message, outcome in zip(leases, outcomes, strict=True):
                if isinstance(outcome, QueueError) and not outcome.retriable:
                    log.warning("qcluster: the lease of message %s of %r could not be kept (%s): it will be "
                                "delivered again", message.id, message.queue, outcome)

    def failed(self, error: Exception) -> None:
        """A long poll's error, raised by the next drain_events (under the lock)."""
        self._error = error

    # --- drain ----------------------------------------------------------------------------------
    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Deliver one message, waiting up to `timeout` (socket.timeout after it, as kombu expects)."""
        deadline = None if timeout is None else monotonic() + timeout
        with self.cond:
            while True:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                channels = list(self.channels)
                found = None
                for offset in range(len(channels)):
                    channel = channels[(self._turn + offset) % len(channels)]
                    channel.pump()
                    if found is None:
                        delivery = channel.next_delivery()
                        if delivery is not None:
                            found = delivery
                            self._turn += 1
                if found is not None:
                    break
                if self._link is None or not self._link.usable:
                    raise ClusterConnectionError("the connection to the cluster is closed")
                try:
                    self._link.check_node()
                except ClusterConnectionError:
                    self._node_down = self._link.url
                    raise
                remaining = WAKE_S if deadline is None else min(WAKE_S, deadline - monotonic())
                if remaining <= 0:
                    raise TimeoutError()        # socket.timeout: kombu waits for it
                self.cond.wait(remaining)
        queue, raw = found
        self._deliver(raw, queue)


def envelope(message: LeasedMessage) -> dict[str, Any] | None:
    """The kombu message a payload holds, with a fresh delivery tag and `redelivered` set."""
    try:
        raw = loads(message.payload)
        properties = raw["properties"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(properties, dict):
        return None
    properties["delivery_tag"] = uuid.uuid4().hex
    info = properties.setdefault("delivery_info", {})
    if isinstance(info, dict):
        info["redelivered"] = message.deliveries > 1
    return raw if isinstance(raw, dict) else None


def _ttl_s(expiration: Any) -> float | None:
    """kombu's `expiration` property (milliseconds, as AMQP: text or a number) in seconds."""
    if expiration is None:
        return None
    try:
        milliseconds = float(expiration)
    except (TypeError, ValueError):
        return None
    return milliseconds / 1000 if milliseconds > 0 else None


__all__ = ["Channel", "ClusterChannelError", "ClusterConnectionError", "Transport"]
