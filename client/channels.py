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

from wire.errors import E_NOT_MASTER, E_SUBSCRIPTION_TAKEN, E_UNAVAILABLE, E_UNKNOWN_SUBSCRIPTION, QueueError
from wire.protocol import ChannelAckOp, ChannelEnded, ChannelMessage, ChannelSubscribeOp, ClientOp

CHANNEL_PREFIX = "channel:"      # replication/cluster_map.py CHANNEL_PREFIX
ACKED_BUFFER_MAX = 10_000        # unread messages of an `acked` channel kept (the oldest go first)
FOLLOW_PAUSE_S = (0.05, 2.0)     # between attempts to subscribe again where a channel went
FOLLOW_ATTEMPT_S = 2.0           # one such attempt (a node that is down does not answer)


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
        subscription now; after a failover the message may come again first)."""
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
    def deliver(self, item: ChannelMessage, node: ChannelNode) -> None:
        if self._serving.get(item.channel) is not node:
            return                          # not ours (any more)
        if item.channel in self._durable:
            self._deliver_durable(item, node)
            return
        if item.message_id < self._seen.get(item.channel, 0):
            return                          # older than what was seen
        # The same id again is the last value resent (at the resend interval, or on subscribing
        # again after a failover): handed out again, as the channel asks.
        self._seen[item.channel] = item.message_id
        unread = self._unread.setdefault(item.channel, deque())
        if self._router.channel_class(item.channel) == "latest":
            unread.clear()                  # only the newest value waits
        elif len(unread) >= ACKED_BUFFER_MAX:
            unread.popleft()
        unread.append((next(self._arrivals), ChannelDelivery(item.channel, item.message_id, item.payload,
                                                             item.resent, node, self)))
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
        for task in self._following.values():
            task.cancel()
        self._following.clear()

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
