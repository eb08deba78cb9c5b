"""`Client`: the AsyncClient's API for synchronous code.

One private event loop runs in a daemon thread and owns an `AsyncClient`; each method hands
its coroutine to that loop (`asyncio.run_coroutine_threadsafe`) and waits for the answer.
Calls from several threads at once therefore still share one WebSocket and are coalesced
into frames like concurrent coroutines are. `consume` is a plain iterator.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar, overload

from client.aio import AsyncClient, CredentialsArg
from client.channels import ChannelDelivery
from client.consumer import Consumer, LeaseKeeper, Message
from client.http import Grant
from client.macro import MacroConsumer
from client.waits import Completion, OnComplete

T = TypeVar("T")


class SyncMessage:
    """A leased message received through a `Client`; `ack()`, `release()` and `extend()` block."""

    __slots__ = ("_client", "_message", "deliveries", "headers", "id", "payload", "priority", "queue", "receipt")

    def __init__(self, client: Client, message: Message) -> None:
        self._message = message
        self.headers = message.headers
        self.id = message.id
        self.receipt = message.receipt
        self.priority = message.priority
        self.deliveries = message.deliveries
        self.payload = message.payload
        self.queue = message.queue
        self._client = client

    def ack(self) -> None:
        self._client.ack(self.queue, self.id, self.receipt)

    def release(self) -> None:
        self._client.release(self.queue, self.id, self.receipt)

    def extend(self, visibility_timeout_s: float) -> None:
        self._client.extend(self.queue, self.id, self.receipt, visibility_timeout_s)

    @property
    def trace_context(self) -> Any:
        """The producer's OpenTelemetry context (Message.trace_context; client/tracing.py)."""
        return self._message.trace_context

    def keep_alive(self, visibility_timeout_s: float = 30.0, every_s: float | None = None) -> SyncLeaseKeeper:
        """`with message.keep_alive():` around a long job (see Message.keep_alive): the
        client's loop thread extends the lease while the block runs."""
        return SyncLeaseKeeper(self._client, self._message.keep_alive(visibility_timeout_s, every_s))

    def __repr__(self) -> str:
        return (f"SyncMessage(queue={self.queue!r}, id={self.id}, priority={self.priority}, "
                f"deliveries={self.deliveries}, payload={self.payload[:32]!r})")


class _SyncViewMessage(SyncMessage):
    """A message received through a view: settled through the view's routes (client/views.py)."""
    __slots__ = ()

    def ack(self) -> None:
        async def ack() -> None:
            await self._message.ack()
        self._client._run(ack())

    def release(self) -> None:
        self._client._run(self._message.release())

    def extend(self, visibility_timeout_s: float) -> None:
        self._client._run(self._message.extend(visibility_timeout_s))


class SyncLeaseKeeper:
    """A LeaseKeeper whose beats run on the client's loop thread; `lost` as there."""

    def __init__(self, client: Client, keeper: LeaseKeeper) -> None:
        self._client = client
        self.keeper = keeper

    @property
    def lost(self) -> Any:
        return self.keeper.lost

    def __enter__(self) -> Self:
        self._client._run(self.keeper.start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._client._run(self.keeper.stop())


class SyncConsumer:
    """Iterator over a subscription's messages; close it (or use `with`) to unsubscribe."""

    def __init__(self, client: Client, consumer: Consumer | MacroConsumer) -> None:
        self._client = client
        self._consumer = consumer

    def __iter__(self) -> Iterator[SyncMessage]:
        return self

    def __next__(self) -> SyncMessage:
        message = self._client._run(_next_or_none(self._consumer))
        if message is None:
            raise StopIteration
        return SyncMessage(self._client, message)

    def close(self) -> None:
        self._client._run(self._consumer.close())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _next_or_none(consumer: Consumer | MacroConsumer) -> Message | None:
    try:
        return await consumer.__anext__()
    except StopAsyncIteration:
        return None


def loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A new event loop running on a daemon thread of its own (started), for blocking callers
    that hand it coroutines (`asyncio.run_coroutine_threadsafe`): this module's `Client` and
    the kombu transport's link (client/kombu_link.py). `loop.call_soon_threadsafe(loop.stop)`
    ends it: the thread closes the loop after its async generators."""
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return loop, thread


class Client:
    """Synchronous client: `with Client() as client: client.enqueue("orders", b"hi")`.
    Keyword options are those of `AsyncClient`."""

    def __init__(self, url: str | None = None, credentials: CredentialsArg = None, **options: Any) -> None:
        self._async = AsyncClient(url, credentials, **options)
        self.url = self._async.url
        self.client_id = self._async.client_id
        self._loop, self._thread = loop_thread("qserver-client-loop")
        self._closed = False

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the client's loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: do not leave it running
            raise

    # --- lifecycle ----------------------------------------------------------------------------
    def connect(self) -> None:
        self._run(self._async.connect())

    def close(self) -> None:
        """Close the client and stop its thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def __enter__(self) -> Self:
        try:
            self.connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def server_release(self) -> str | None:
        """As AsyncClient.server_release: None before any answer or from qserver 0.1.0 (or older)."""
        return self._async.server_release

    @property
    def cluster_feature_level(self) -> int | None:
        """As AsyncClient.cluster_feature_level."""
        return self._async.cluster_feature_level

    # --- messages -----------------------------------------------------------------------------
    @overload
    def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                ttl_s: float | None = None, delay_s: float | None = None, headers: Mapping[str, str] | None = None,
                wait: None = None, timeout_s: float | None = None, on_complete: OnComplete | None = None) -> int: ...
    @overload
    def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                ttl_s: float | None = None, delay_s: float | None = None, headers: Mapping[str, str] | None = None,
                wait: str, timeout_s: float | None = None, on_complete: OnComplete | None = None) -> Completion: ...
    def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                ttl_s: float | None = None, delay_s: float | None = None,
                headers: Mapping[str, str] | None = None, wait: str | None = None, timeout_s: float | None = None,
                on_complete: OnComplete | None = None) -> Any:
        """As AsyncClient.enqueue: the id once durable, except on a `one_way` queue (answered
        before it is durable); `ttl_s` the message's time to live, `delay_s` its delivery delay,
        `headers` a small map delivered with it. `wait="ack"|"reply"` blocks this thread until
        the consumer acked or replied (a Completion), E_WAIT_TIMEOUT after `timeout_s`.
        `on_complete` runs on the client's own loop thread, not the caller's: keep it short and
        hand work to your threads (client/waits.py)."""
        if wait is None:
            return self._run(self._async.enqueue(queue, payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s,
                                                 headers=headers, timeout_s=timeout_s, on_complete=on_complete))
        return self._run(self._async.enqueue(queue, payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s,
                                             headers=headers, wait=wait, timeout_s=timeout_s,
                                             on_complete=on_complete))

    def enqueue_many(self, queue: str, payloads: Iterable[bytes], priority: int = 4, *,
                     dedupe_ids: Sequence[str] | None = None, ttl_s: float | None = None,
                     delay_s: float | None = None, headers: Mapping[str, str] | None = None,
                     wait: str | None = None, timeout_s: float | None = None,
                     on_complete: OnComplete | None = None) -> list[Any]:
        return self._run(self._async.enqueue_many(queue, list(payloads), priority, dedupe_ids=dedupe_ids,
                                                  ttl_s=ttl_s, delay_s=delay_s, headers=headers, wait=wait,
                                                  timeout_s=timeout_s, on_complete=on_complete))

    def receive(self, queue: str, max_messages: int = 1, wait_s: float = 0.0,
                visibility_timeout_s: float | None = None) -> list[SyncMessage]:
        messages = self._run(self._async.receive(queue, max_messages, wait_s, visibility_timeout_s))
        return [SyncMessage(self, m) for m in messages]

    def ack(self, queue: str, message_id: int, receipt: str) -> None:
        # AsyncClient.ack does its work when called, so call it on the loop's thread.
        self._run(_on_loop(self._async.ack, queue, message_id, receipt))

    def release(self, queue: str, message_id: int, receipt: str) -> None:
        self._run(self._async.release(queue, message_id, receipt))

    def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        self._run(self._async.extend(queue, message_id, receipt, visibility_timeout_s))

    def ping(self) -> None:
        self._run(self._async.ping())

    def consume(self, queue: str, prefetch: int = 100, visibility_timeout_s: float | None = None, *,
                recipient: str | None = None) -> SyncConsumer:
        async def subscribe() -> Consumer | MacroConsumer:
            return self._async.consume(queue, prefetch, visibility_timeout_s, recipient=recipient)
        return SyncConsumer(self, self._run(subscribe()))

    # --- admin --------------------------------------------------------------------------------
    def create_queue(self, name: str, **options: Any) -> dict[str, Any]:
        return self._run(self._async.create_queue(name, **options))

    def delete_queue(self, name: str) -> dict[str, Any]:
        return self._run(self._async.delete_queue(name))

    def set_queue_options(self, name: str, **options: Any) -> dict[str, Any]:
        """AsyncClient.set_queue_options (client/admin.py)."""
        return self._run(self._async.set_queue_options(name, **options))

    def purge(self, name: str) -> dict[str, Any]:
        return self._run(self._async.purge(name))

    def redrive(self, name: str, limit: int | None = None) -> dict[str, Any]:
        return self._run(self._async.redrive(name, limit))

    def list_queues(self) -> list[dict[str, Any]]:
        return self._run(self._async.list_queues())

    def queue_page(self, limit: int = 1000, after: str | None = None) -> dict[str, Any]:
        return self._run(self._async.queue_page(limit, after))

    def queue_page_around(self, limit: int = 1000, after: str | None = None, *, before: str | None = None,
                          match: str = "") -> dict[str, Any]:
        """See AsyncClient.queue_page_around."""
        return self._run(self._async.queue_page_around(limit, after, before=before, match=match))

    def create_macro(self, name: str, producer: str = "round_robin", consumer: str = "prioritized",
                     fastest_by: str = "response_time") -> dict[str, Any]:
        return self._run(self._async.create_macro(name, producer, consumer, fastest_by))

    def delete_macro(self, name: str) -> dict[str, Any]:
        return self._run(self._async.delete_macro(name))

    def add_macro_member(self, name: str, queue: str, priority: int = 0, weight: int = 1) -> dict[str, Any]:
        return self._run(self._async.add_macro_member(name, queue, priority, weight))

    def remove_macro_member(self, name: str, queue: str) -> dict[str, Any]:
        return self._run(self._async.remove_macro_member(name, queue))

    def list_macros(self) -> list[dict[str, Any]]:
        return self._run(self._async.list_macros())

    def describe_macro(self, name: str) -> dict[str, Any]:
        return self._run(self._async.describe_macro(name))

    # --- channels (seed 002) --------------------------------------------------------------------
    def create_channel(self, name: str, delivery_class: str = "latest", resend_interval_s: float = 0.0,
                       **attributes: Any) -> dict[str, Any]:
        return self._run(self._async.create_channel(name, delivery_class, resend_interval_s, **attributes))

    def characterize(self, name: str, delivery_class: str | None = None, **attributes: Any) -> dict[str, Any]:
        return self._run(self._async.characterize(name, delivery_class, **attributes))

    def set_resend_interval(self, name: str, seconds: float) -> dict[str, Any]:
        return self._run(self._async.set_resend_interval(name, seconds))

    def typeof(self, name: str) -> dict[str, Any]:
        return self._run(self._async.typeof(name))

    def delete_channel(self, name: str) -> dict[str, Any]:
        return self._run(self._async.delete_channel(name))

    def list_channels(self) -> list[dict[str, Any]]:
        return self._run(self._async.list_channels())

    def advertise(self, *channels: str, leader: bool = False) -> None:
        self._run(self._async.advertise(*channels, leader=leader))

    def unadvertise(self, *channels: str) -> None:
        self._run(self._async.unadvertise(*channels))

    def publish(self, channel: str, payload: bytes, dedupe_id: str | None = None) -> int:
        return self._run(self._async.publish(channel, payload, dedupe_id))

    def report(self, channel: str, message_id: int) -> dict[str, Any]:
        return self._run(self._async.report(channel, message_id))

    def subscribe(self, *channels: str, durable: str | None = None) -> dict[str, int | None]:
        return self._run(self._async.subscribe(*channels, durable=durable))

    def subscriptions(self, channel: str) -> list[dict[str, Any]]:
        return self._run(self._async.subscriptions(channel))

    def drop_subscription(self, channel: str, name: str) -> dict[str, Any]:
        return self._run(self._async.drop_subscription(channel, name))

    def unsubscribe(self, *channels: str) -> None:
        self._run(self._async.unsubscribe(*channels))

    def poll(self) -> list[str]:
        async def poll() -> list[str]:
            return self._async.poll()
        return self._run(poll())

    @overload
    def read(self, channel: str) -> ChannelDelivery | None: ...
    @overload
    def read(self, channel: str, message_id: int) -> dict[str, Any]: ...

    def read(self, channel: str, message_id: int | None = None) -> ChannelDelivery | None | dict[str, Any]:
        """`read(channel)`: the next unread message of a channel (its `ack()` is a coroutine: use
        `ack_channel`). `read(queue, message_id)`: one message of a queue by id, browsed without
        taking it (`read_message`)."""
        if message_id is not None:
            return self.read_message(channel, message_id)

        async def read() -> ChannelDelivery | None:
            return self._async.read(channel)
        return self._run(read())

    def peek(self, queue: str, after: int = 0, limit: int = 100, preview: bool = False) -> dict[str, Any]:
        """A page of `queue`'s messages in delivery order, taking none (AsyncClient.peek)."""
        return self._run(self._async.peek(queue, after, limit, preview))

    def read_message(self, queue: str, message_id: int) -> dict[str, Any]:
        """One message of `queue` by id, without taking it (AsyncClient.read_message)."""
        return self._run(self._async.read_message(queue, message_id))

    # --- virtual queues (client/views.py; docs/PROTOCOL.md, "Virtual queues") -------------------
    def create_view(self, queue: str, view: str, filter: dict[str, Any]) -> dict[str, Any]:
        return self._run(self._async.create_view(queue, view, filter))

    def delete_view(self, queue: str, view: str) -> dict[str, Any]:
        return self._run(self._async.delete_view(queue, view))

    def list_views(self, queue: str) -> dict[str, Any]:
        return self._run(self._async.list_views(queue))

    def receive_view(self, queue: str, view: str, max_messages: int = 1,
                     visibility_timeout_s: float | None = None) -> list[SyncMessage]:
        """AsyncClient.receive_view: each message's ack, release and extend go through the view."""
        received = self._run(self._async.receive_view(queue, view, max_messages, visibility_timeout_s))
        return [_SyncViewMessage(self, message) for message in received]

    def peek_view(self, queue: str, view: str, after: int = 0, limit: int = 100,
                  preview: bool = False) -> dict[str, Any]:
        return self._run(self._async.peek_view(queue, view, after, limit, preview))

    def next_channel_message(self, timeout_s: float | None = None) -> ChannelDelivery | None:
        """The first unread message across the subscribed channels; None after `timeout_s`."""
        async def wait() -> ChannelDelivery | None:
            try:
                return await asyncio.wait_for(self._async.next_channel_message(), timeout_s)
            except TimeoutError:
                return None
        return self._run(wait())

    def set_alternatives(self, recipient: str, alternatives: Sequence[str]) -> dict[str, Any]:
        return self._run(self._async.set_alternatives(recipient, alternatives))

    def alternatives(self, recipient: str) -> list[str]:
        return self._run(self._async.alternatives(recipient))

    def recipients(self) -> list[dict[str, Any]]:
        return self._run(self._async.recipients())

    def remove_recipient(self, recipient: str) -> dict[str, Any]:
        return self._run(self._async.remove_recipient(recipient))

    def create_forward(self, name: str, source: str, destination: str, *, urls: Sequence[str] = (),
                       credentials: Mapping[str, str] | None = None,
                       control: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._run(self._async.create_forward(name, source, destination, urls=urls, credentials=credentials,
                                                    control=control))

    def change_forward(self, name: str, control: Mapping[str, Any]) -> dict[str, Any]:
        return self._run(self._async.change_forward(name, control))

    def forwards(self) -> list[dict[str, Any]]:
        return self._run(self._async.forwards())

    def forward_stats(self, name: str) -> dict[str, Any]:
        return self._run(self._async.forward_stats(name))

    def delete_forward(self, name: str) -> dict[str, Any]:
        return self._run(self._async.delete_forward(name))

    def ack_channel(self, message: ChannelDelivery) -> None:
        self._run(message.ack())

    def queue_stats(self, name: str) -> dict[str, Any]:
        return self._run(self._async.queue_stats(name))

    def reply(self, queue: str, message_id: int, receipt: str, body: bytes) -> None:
        self._run(self._async.reply(queue, message_id, receipt, body))

    def message_status(self, queue: str, message_id: int, wait_s: float = 0.0,
                       until: str | None = None) -> dict[str, Any]:
        return self._run(self._async.message_status(queue, message_id, wait_s, until))

    def register_client(self, name: str, grants: Iterable[Grant],
                        public_key: str | None = None) -> dict[str, Any]:
        return self._run(self._async.register_client(name, list(grants), public_key))

    def list_clients(self) -> list[dict[str, Any]]:
        return self._run(self._async.list_clients())

    def remove_client(self, client_id: str) -> dict[str, Any]:
        return self._run(self._async.remove_client(client_id))

    def set_grants(self, client_id: str, grants: Iterable[Grant]) -> dict[str, Any]:
        return self._run(self._async.set_grants(client_id, list(grants)))

    def create_access_key(self, client_id: str) -> dict[str, Any]:
        """AsyncClient.create_access_key (client/admin.py)."""
        return self._run(self._async.create_access_key(client_id))

    def list_access_keys(self, client_id: str) -> list[dict[str, Any]]:
        return self._run(self._async.list_access_keys(client_id))

    def revoke_access_key(self, client_id: str, key_id: str) -> dict[str, Any]:
        return self._run(self._async.revoke_access_key(client_id, key_id))

    def cluster(self) -> dict[str, Any]:
        return self._run(self._async.cluster())

    def node_stats(self) -> dict[str, Any]:
        """See AsyncClient.node_stats (GET /v1/node)."""
        return self._run(self._async.node_stats())

    def events(self, after: int = 0, limit: int = 100, wait_s: float = 0.0) -> dict[str, Any]:
        """See AsyncClient.events."""
        return self._run(self._async.events(after, limit, wait_s))

    def handoff(self, queue: str, initiator: str = "master") -> dict[str, Any]:
        return self._run(self._async.handoff(queue, initiator))

    def promote(self, queue: str, *, unclean: bool = False) -> dict[str, Any]:
        return self._run(self._async.promote(queue, unclean=unclean))

    def move_queue(self, queue: str, member: str, to: str) -> dict[str, Any]:
        return self._run(self._async.move_queue(queue, member, to))

    def rebalance(self) -> dict[str, Any]:
        return self._run(self._async.rebalance())

    def add_node(self, node_id: str, url: str) -> dict[str, Any]:
        return self._run(self._async.add_node(node_id, url))

    def drain_node(self, node_id: str) -> dict[str, Any]:
        return self._run(self._async.drain_node(node_id))

    def remove_node(self, node_id: str) -> dict[str, Any]:
        return self._run(self._async.remove_node(node_id))

    def undrain_node(self, node_id: str) -> dict[str, Any]:
        """A draining node serves again (draining -> up); `rebalance` then brings it members."""
        return self._run(self._async.undrain_node(node_id))

    def cluster_versions(self) -> dict[str, Any]:
        """See AsyncClient.cluster_versions."""
        return self._run(self._async.cluster_versions())

    def finalize_cluster(self, level: int | None = None) -> dict[str, Any]:
        """See AsyncClient.finalize_cluster."""
        return self._run(self._async.finalize_cluster(level))

    def drain_node_for_maintenance(self, node_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """See AsyncClient.drain_node_for_maintenance."""
        return self._run(self._async.drain_node_for_maintenance(node_id, timeout_s))

    def undrain_node_from_maintenance(self, node_id: str) -> dict[str, Any]:
        return self._run(self._async.undrain_node_from_maintenance(node_id))

    def export_definitions(self) -> dict[str, Any]:
        """See AsyncClient.export_definitions."""
        return self._run(self._async.export_definitions())

    def import_definitions(self, document: Mapping[str, Any], dry_run: bool = False, *,
                           forward_credentials: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Any]:
        """See AsyncClient.import_definitions."""
        return self._run(self._async.import_definitions(document, dry_run, forward_credentials=forward_credentials))


async def _on_loop(function: Any, *args: Any) -> Any:
    """Run an AsyncClient method that acts when called (not when awaited) on the loop."""
    return await function(*args)
