"""Publish/subscribe channels in the client library (seed 002, "CCI"): what a client subscribes
to, and the messages waiting to be read.

A channel is served by the master of its queue `channel:<name>` (qserver/features/channels/hub.py); this
client subscribes there, through its connection to that node, and follows the channel when the
node ends the subscription (a handoff or failover: `ChannelEnded`) or the connection drops.
Subscribing to several channels is all or none: the channels are asked node by node, and when
one node refuses, those already subscribed are unsubscribed again before the error is raised.

What waits to be read depends on the channel's delivery class: under `latest` only the newest
unread value (a slow reader skips to it, never a backlog), under `acked` every message in
order (up to ACKED_BUFFER_MAX; acknowledge each with `ChannelDelivery.ack()`). No message
older than one already seen on its channel is handed out (ids are the channel queue's ordering
indices, which only grow, across failovers too).

How a message travels is the node's choice (docs/PROTOCOL.md, "How a channel's messages
travel"), and at cluster feature level 3 this client takes every kind (it asks for offers on
each connection before subscribing there): a message not stored (best effort, or relayed point
to point) has an id of its own kind, not an ordering index, ordered apart from stored ones; a
relay's receipt is acknowledged at once (its publisher is waiting for it); a reference to a
staged message is fetched, in order, before it is handed out (under `latest` only the newest
reference is fetched).

Under `durable` the client reads a durable subscription by its name: the node sends its
backlog a window at a time and resends what stays unacknowledged, so a message may come again
(after a resend, a failover, a subscribe again) until `ack()` is answered — at least once, in
id order apart from such repeats; one already waiting unread is not queued twice.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from wire.channel_ops import ChannelFetchOp, ChannelOffer, ChannelOffersOp, OfferKind
from wire.errors import (
    E_NOT_MASTER,
    E_SUBSCRIPTION_TAKEN,
    E_UNAVAILABLE,
    E_UNKNOWN_MESSAGE,
    E_UNKNOWN_SUBSCRIPTION,
    QueueError,
)
from wire.protocol import ChannelAckOp, ChannelEnded, ChannelMessage, ChannelSubscribeOp, ClientOp

CHANNEL_PREFIX = "channel:"      # replication/cluster_map.py CHANNEL_PREFIX
ACKED_BUFFER_MAX = 10_000        # unread messages of an `acked` channel kept (the oldest go first)
FOLLOW_PAUSE_S = (0.05, 2.0)     # between attempts to subscribe again where a channel went
FOLLOW_ATTEMPT_S = 2.0           # one such attempt (a node that is down does not answer)
OFFERS_LEVEL = 3                 # the cluster feature level from which nodes send offers (wire/versions.py)


def channel_queue(channel: str) -> str:
    return CHANNEL_PREFIX + channel


class ChannelNode(Protocol):
    """One node's connection as the inbox uses it (client/connection.py NodeConnection)."""

    channels_here: set[str]         # the channels subscribed through its socket

    def next_id(self) -> int: ...
    async def call(self, op: ClientOp) -> Any: ...
    def listen_channels(self, listener: ChannelInbox) -> None: ...


class ChannelRouter(Protocol):
    """The cluster map as the inbox uses it (client/router.py Router): where a channel's queue
    is served, and the channel's delivery class."""

    feature_level: int

    @property
    def closed(self) -> bool: ...
    def knows_master(self, queue: str) -> bool: ...
    def consume_target(self, queue: str) -> ChannelNode: ...
    def channel_class(self, channel: str) -> str: ...
    async def refresh_placement(self, queue: str | None = None) -> None: ...


@dataclass
class ChannelDelivery:
    """A message of a subscribed channel. `resent`: the last value sent again (on subscribing,
    or at the channel's resend interval)."""
    channel: str
    id: int
    payload: bytes
    resent: bool
    _node: Any = field(repr=False, default=None)
    _inbox: Any = field(repr=False, default=None)

    async def ack(self) -> None:
        """Acknowledge it: an `acked` channel's report counts it (at the node that sent it); a
        durable subscription's backlog loses it once this returns (at the node reading the
        subscription now; after a failover the message may come again first). A message not
        stored (best effort, relayed) has nothing to acknowledge: a relay's receipt was already."""
        if self._inbox is not None:
            await self._inbox.ack(self)


class ChannelInbox:
    """One client's channel subscriptions and unread messages."""

    def __init__(self, router: ChannelRouter) -> None:
        self._router = router
        self._wanted: set[str] = set()                    # what the application subscribed to
        self._serving: dict[str, ChannelNode] = {}       # channel -> the node connection it is subscribed through
        self._unread: dict[str, deque[tuple[int, ChannelDelivery]]] = {}
        self._seen: dict[str, int] = {}                   # channel -> the highest id handed in
        self._arrivals = itertools.count()
        self._waiters: list[asyncio.Future[None]] = []
        self._following: dict[str, asyncio.Task[None]] = {}
        self._durable: dict[str, str] = {}               # channel -> the durable subscription read
        self._volatile_seen: dict[str, int] = {}          # channel -> the highest id not stored handed in
        self._offers_asked: set[ChannelNode] = set()      # connections told that this client takes offers
        self._references: dict[str, deque[tuple[ChannelOffer, ChannelNode]]] = {}   # waiting to be fetched
        self._fetching: dict[str, asyncio.Task[None]] = {}     # channel -> its references' fetcher
        self._receipts: set[asyncio.Task[None]] = set()          # relays' receipts being sent (held until done)

    @property
    def channels(self) -> list[str]:
        return sorted(self._wanted)

    # --- subscribing ----------------------------------------------------------------------------
    async def subscribe(self, channels: Iterable[str], durable: str | None = None) -> dict[str, int | None]:
        wanted = [name for name in dict.fromkeys(channels) if name not in self._wanted]
        if not wanted:
            return {}
        for name in wanted:
            if durable is not None:
                self._durable[name] = durable
            else:
                self._durable.pop(name, None)
        groups = await self._by_node(wanted)
        done: list[tuple[ChannelNode, list[str]]] = []
        answer: dict[str, int | None] = {}
        try:
            for node, names in groups.items():
                answer.update(await self._subscribe_at(node, names))
                done.append((node, names))
        except QueueError:
            for node, names in done:                      # all or none
                self._unregister(names)
                with contextlib.suppress(QueueError):
                    await node.call(ChannelSubscribeOp(node.next_id(), tuple(names), False))
            for name in wanted:
                self._durable.pop(name, None)
            raise
        self._wanted.update(wanted)
        return answer

    async def _by_node(self, channels: list[str]) -> dict[ChannelNode, list[str]]:
        router = self._router
        if not all(router.knows_master(channel_queue(name)) for name in channels):
            with contextlib.suppress(QueueError):
                await router.refresh_placement()
        groups: dict[ChannelNode, list[str]] = {}
        for name in channels:
            groups.setdefault(router.consume_target(channel_queue(name)), []).append(name)
        return groups

    async def _subscribe_at(self, node: ChannelNode, names: list[str], *, again: bool = True
                            ) -> dict[str, int | None]:
        """At one node; once more where the map says after E_NOT_MASTER (the map was stale)."""
        node.listen_channels(self)
        for name in names:            # registered first: the last values follow the answer at once
            self._serving[name] = node
            node.channels_here.add(name)
        durable = {self._durable.get(name) for name in names}
        if len(durable) > 1:
            raise ValueError("subscribe to durable and live channels in separate calls")
        try:
            if node not in self._offers_asked and self._router.feature_level >= OFFERS_LEVEL:
                await node.call(ChannelOffersOp(node.next_id()))
                self._offers_asked.add(node)
            answer = await node.call(ChannelSubscribeOp(node.next_id(), tuple(names), True, durable.pop()))
        except BaseException as error:
            self._unregister(names)
            if not isinstance(error, QueueError):
                raise
            if again and error.code in (E_NOT_MASTER.code, E_UNAVAILABLE.code) and await self._map_moved(names[0], node):
                return await self._subscribe_at(self._router.consume_target(channel_queue(names[0])), names,
                                                again=False)
            raise
        return {str(name): last for name, last in dict(answer).items()}

    def _unregister(self, names: Iterable[str]) -> None:
        for name in names:
            node = self._serving.pop(name, None)
            if node is not None:
                node.channels_here.discard(name)

    async def _map_moved(self, name: str, node: ChannelNode) -> bool:
        with contextlib.suppress(QueueError):
            await self._router.refresh_placement()
        return self._router.consume_target(channel_queue(name)) is not node

    async def unsubscribe(self, channels: Iterable[str]) -> None:
        by_node: dict[ChannelNode, list[str]] = {}
        for name in dict.fromkeys(channels):
            self._wanted.discard(name)
            self._durable.pop(name, None)
            node = self._serving.get(name)
            self._unregister([name])
            self._unread.pop(name, None)
            task = self._following.pop(name, None)
            if task is not None:
                task.cancel()
            if node is not None:
                by_node.setdefault(node, []).append(name)
        for node, names in by_node.items():
            with contextlib.suppress(QueueError):
                await node.call(ChannelSubscribeOp(node.next_id(), tuple(names), False))

    # --- what the nodes send ------------------------------------------------------------------
    def deliver(self, item: ChannelMessage | ChannelOffer, node: ChannelNode) -> None:
        if self._serving.get(item.channel) is not node:
            return                          # not ours (any more)
        if isinstance(item, ChannelOffer):
            self._offered(item, node)
            return
        if item.channel in self._durable:
            self._deliver_durable(item, node)
            return
        if item.message_id < self._seen.get(item.channel, 0):
            return                          # older than what was seen
        # The same id again is the last value resent (at the resend interval, or on subscribing
        # again after a failover): handed out again, as the channel asks.
        self._seen[item.channel] = item.message_id
        self._hand_out(item.channel, ChannelDelivery(item.channel, item.message_id, item.payload, item.resent,
                                                     node, self))

    def _offered(self, item: ChannelOffer, node: ChannelNode) -> None:
        if item.kind == OfferKind.REFERENCE:
            references = self._references.setdefault(item.channel, deque())
            if self._router.channel_class(item.channel) == "latest":
                references.clear()          # only the newest value is fetched
            elif len(references) >= ACKED_BUFFER_MAX:
                references.popleft()
            references.append((item, node))
            if item.channel not in self._fetching:
                self._fetching[item.channel] = asyncio.get_running_loop().create_task(self._fetch(item.channel))
            return
        if item.kind == OfferKind.RELAY:     # its publisher waits for this receipt
            task = asyncio.get_running_loop().create_task(self._receipt(node, item))
            self._receipts.add(task)
            task.add_done_callback(self._receipts.discard)
        if item.message_id < self._volatile_seen.get(item.channel, 0):
            return
        self._volatile_seen[item.channel] = item.message_id
        self._hand_out(item.channel, ChannelDelivery(item.channel, item.message_id, item.payload, item.resent,
                                                     None, None))

    async def _receipt(self, node: ChannelNode, item: ChannelOffer) -> None:
        with contextlib.suppress(QueueError):  # unanswered, the node stores it instead: it comes again
            await node.call(ChannelAckOp(node.next_id(), item.channel, item.message_id))

    async def _fetch(self, channel: str) -> None:
        """Fetch the channel's waiting references one at a time, in order, from the node that
        sent each; each is then handed in as a stored message."""
        try:
            references = self._references.get(channel)
            while references:
                item, node = references.popleft()
                if self._serving.get(channel) is not node:
                    continue
                try:
                    payload = await node.call(ChannelFetchOp(node.next_id(), channel, item.message_id))
                except QueueError as error:
                    if error.code != E_UNKNOWN_MESSAGE.code:
                        raise
                    continue                # replaced by newer values meanwhile: one of them comes
                self.deliver(ChannelMessage(channel, item.message_id, bytes(payload), item.resent), node)
        except QueueError:
            self._references.pop(channel, None)   # the node went: subscribing again sends the last value
        finally:
            self._fetching.pop(channel, None)

    def _hand_out(self, channel: str, delivery: ChannelDelivery) -> None:
        unread = self._unread.setdefault(channel, deque())
        if self._router.channel_class(channel) == "latest":
            unread.clear()                  # only the newest value waits
        elif len(unread) >= ACKED_BUFFER_MAX:
            unread.popleft()
        unread.append((next(self._arrivals), delivery))
        self._wake()

    def _deliver_durable(self, item: ChannelMessage, node: ChannelNode) -> None:
        """Every message of the backlog, once while it waits unread (the node resends what is
        not acknowledged; the window it sends is bounded, so is this)."""
        unread = self._unread.setdefault(item.channel, deque())
        if any(waiting.id == item.message_id for _, waiting in unread):
            return
        self._seen[item.channel] = max(item.message_id, self._seen.get(item.channel, 0))
        unread.append((next(self._arrivals), ChannelDelivery(item.channel, item.message_id, item.payload,
                                                             item.resent, node, self)))
        self._wake()

    async def ack(self, delivery: ChannelDelivery) -> None:
        node = self._serving.get(delivery.channel) if delivery.channel in self._durable else delivery._node
        if node is None:
            raise QueueError(E_UNAVAILABLE, f"channel {delivery.channel} is being subscribed again: the message "
                                            "comes again, acknowledge it then")
        await node.call(ChannelAckOp(node.next_id(), delivery.channel, delivery.id))
        unread = self._unread.get(delivery.channel)
        if unread and delivery.channel in self._durable:
            # A resend sent before the ack was committed arrived before its answer: acknowledged
            # now, it is not handed out again.
            kept = [(arrival, waiting) for arrival, waiting in unread if waiting.id != delivery.id]
            if len(kept) != len(unread):
                self._unread[delivery.channel] = deque(kept)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def ended(self, item: ChannelEnded, node: ChannelNode) -> None:
        """The node no longer serves the channel: subscribe again where the map says."""
        node.channels_here.discard(item.channel)
        if self._serving.get(item.channel) is not node:
            return
        if item.code in (E_SUBSCRIPTION_TAKEN.code, E_UNKNOWN_SUBSCRIPTION.code):
            # Another connection reads the durable subscription now, or it was dropped: not
            # followed (two readers of one name would take it from each other for ever).
            self._wanted.discard(item.channel)
            self._durable.pop(item.channel, None)
            self._unregister([item.channel])
            return
        self._follow(item.channel)

    def reconnected(self, node: ChannelNode) -> None:
        """The node's socket dropped or came back (a node forgets a socket's subscriptions):
        subscribe again there, or where the map says once it no longer serves them."""
        self._offers_asked.discard(node)     # a new socket: asked again before subscribing there
        for name in [n for n, serving in self._serving.items() if serving is node]:
            self._follow(name)

    def _follow(self, name: str) -> None:
        if name in self._wanted and name not in self._following:
            self._following[name] = asyncio.get_running_loop().create_task(self._move(name))

    async def _move(self, name: str) -> None:
        pause = FOLLOW_PAUSE_S[0]
        try:
            while name in self._wanted and not self._router.closed:
                node = self._router.consume_target(channel_queue(name))
                try:
                    await asyncio.wait_for(self._subscribe_at(node, [name]), FOLLOW_ATTEMPT_S)
                    return
                except (QueueError, TimeoutError):
                    pass               # that node cannot serve it (now): ask the map again
                await asyncio.sleep(pause)
                pause = min(pause * 2, FOLLOW_PAUSE_S[1])
                with contextlib.suppress(QueueError):
                    await self._router.refresh_placement()
        finally:
            self._following.pop(name, None)

    def close(self) -> None:
        """The client closes: nothing is followed any more."""
        self._wanted.clear()
        self._durable.clear()
        for task in [*self._following.values(), *self._fetching.values(), *self._receipts]:
            task.cancel()
        self._following.clear()
        self._fetching.clear()

    # --- reading --------------------------------------------------------------------------------
    def poll(self) -> list[str]:
        """The subscribed channels with unread messages (seed 002 poll)."""
        return sorted(name for name, unread in self._unread.items() if unread)

    def read(self, channel: str) -> ChannelDelivery | None:
        """The next unread message of `channel` (under `latest`: its newest value), or None."""
        unread = self._unread.get(channel)
        return unread.popleft()[1] if unread else None

    async def next(self) -> ChannelDelivery:
        """The unread message that arrived first, across channels, waiting for one."""
        while True:
            heads = [(unread[0][0], name) for name, unread in self._unread.items() if unread]
            if heads:
                return self._unread[min(heads)[1]].popleft()[1]
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
