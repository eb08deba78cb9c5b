"""Publish/subscribe channels (seed 002, "CCI"): the node side.

A channel is defined in the cluster map (its delivery class and resend interval) together with
its queue `channel:<name>`, an ordinary `full` pair: a publish is one enqueue into that queue,
ordered and replicated by its master like any other, so the last value survives any failover.
Subscribers and publishers of a channel talk to that master (the client library routes them
there, as it routes a queue's traffic); this hub, on the master's node, keeps the subscriptions
of its connections, sends each committed publish to every subscriber (one item per connection,
coalesced into that connection's next frame with whatever else it is sent), keeps what the
`acked` class reports, and resends last values at a channel's resend interval.

Only the newest messages matter to `latest` and `acked` subscribers, so the queue is trimmed
(an ordinary replicated purge of the older ones) once it holds TRIM_ABOVE of them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from client import errors as e
from client.errors import QueueError
from client.protocol import ChannelEnded, ChannelMessage
from qserver import commands as c
from qserver.metrics import render_family
from qserver.pairs import Redirect
from replication.cluster_map import ChannelEntry, DeliveryClass, channel_queue

log = logging.getLogger("qserver.channels")
TRIM_ABOVE = 64                  # a channel's queue is trimmed to its newest message past this depth
REPORTS_KEPT = 10_000            # per channel: the newest publishes whose state `report` can tell
WATCH_INTERVAL_S = 0.25          # how often resends are due and masters checked


@dataclass(slots=True)
class Report:
    """What became of one published message (seed 002 CCIClient_report)."""
    subscribers: set[Any]                 # the connections it was sent to
    acked: set[Any] = field(default_factory=set)
    failed: set[Any] = field(default_factory=set)   # left (unsubscribed, disconnected) before acking

    def state(self, delivery_class: str) -> str:
        if delivery_class != DeliveryClass.ACKED:
            return "delivered"             # sent to every subscriber there was (best effort)
        if self.failed:
            return "failed"
        return "delivered" if self.acked >= self.subscribers else "pending_ack"


class PublishReplier:
    """Answers a publish once its enqueue is committed, and fans it out then."""
    __slots__ = ("channel", "connection", "hub", "payload")

    def __init__(self, hub: ChannelHub, connection: Any, channel: str, payload: bytes) -> None:
        self.hub, self.connection, self.channel, self.payload = hub, connection, channel, payload

    def reply(self, request_id: int, result: Any) -> None:
        message_id, _ = result
        self.hub.published(self.channel, int(message_id), self.payload)
        self.connection.reply(request_id, result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self.connection.fail(request_id, error)


class _Quiet:
    """The replier of the hub's own purges (a failed trim is tried again at the next publish)."""

    def reply(self, request_id: int, result: Any) -> None:
        pass

    def fail(self, request_id: int, error: QueueError) -> None:
        log.debug("trimming a channel's queue: %s", error)


class ChannelHub:
    def __init__(self, node: Any) -> None:
        self._node = node
        self.subscribers: dict[str, dict[Any, None]] = {}          # channel -> connections, in order
        self._last: dict[str, tuple[int, bytes]] = {}              # channel -> its newest (id, payload) known here
        self._last_sent_at: dict[str, float] = {}
        self._reports: dict[str, collections.OrderedDict[int, Report]] = {}
        self._trimming: set[str] = set()
        self.published_total = 0
        self.delivered_total = 0
        self._task: asyncio.Task[None] | None = None

    # --- the map ----------------------------------------------------------------------------
    def entry(self, channel: str) -> ChannelEntry:
        coordinator = self._node.engine.coordinator
        found = coordinator.membership.cluster_map.channels.get(channel) if coordinator is not None else None
        if found is None:
            raise QueueError(e.E_UNKNOWN_CHANNEL, f"no channel named {channel!r}")
        return found  # type: ignore[no-any-return]

    def _served_here(self, channel: str) -> None:
        """Raise unless this node masters the channel's queue (E_NOT_MASTER names the node)."""
        queue = channel_queue(channel)
        pairs = self._node.engine.pairs
        if queue in pairs.masters and queue in self._node.engine.cores:
            return
        entry = pairs.view.entry(queue)
        if entry is None:
            raise QueueError(e.E_QUEUE_UNAVAILABLE, f"channel {channel}: its queue is not in this node's map yet")
        raise Redirect(entry.master, f"channel {channel} is served by its master {entry.master}")

    # --- subscriptions ------------------------------------------------------------------------
    def subscribe(self, connection: Any, channels: tuple[str, ...]) -> tuple[dict[str, int | None],
                                                                              list[ChannelMessage]]:
        """All or none: every channel exists, the caller may read it and this node serves it.
        Returns the answer (each channel's last id) and the last values to send after it."""
        for channel in channels:
            self.entry(channel)
            if not connection.principal.allows("get", channel):
                raise QueueError(e.E_FORBIDDEN, f"client {connection.principal.client_id} may not get on {channel}")
            self._served_here(channel)
        answer: dict[str, int | None] = {}
        lasts = []
        for channel in dict.fromkeys(channels):
            self.subscribers.setdefault(channel, {})[connection] = None
            connection.channels.add(channel)
            last = self._last_value(channel)
            answer[channel] = None if last is None else last[0]
            if last is not None:         # the last value on subscribe (seed 002)
                lasts.append(ChannelMessage(channel, last[0], last[1], True))
        self._start()
        return answer, lasts

    def advertise(self, connection: Any, channels: tuple[str, ...], on: bool) -> None:
        """A producer declares (or withdraws) that it publishes to these channels (seed 002
        advertise); several producers may advertise one channel. All or none."""
        for channel in channels:
            self.entry(channel)
            if not connection.principal.allows("post", channel):
                raise QueueError(e.E_FORBIDDEN, f"client {connection.principal.client_id} may not post on {channel}")
        for channel in channels:
            if on:
                connection.advertised.add(channel)
            else:
                connection.advertised.discard(channel)

    def unsubscribe(self, connection: Any, channels: tuple[str, ...]) -> None:
        for channel in channels:
            self._drop(connection, channel)

    def connection_closed(self, connection: Any) -> None:
        for channel in list(connection.channels):
            self._drop(connection, channel)

    def _drop(self, connection: Any, channel: str) -> None:
        connection.channels.discard(channel)
        subscribers = self.subscribers.get(channel)
        if subscribers is not None:
            subscribers.pop(connection, None)
            if not subscribers:
                del self.subscribers[channel]
        for report in self._reports.get(channel, {}).values():
            if connection in report.subscribers and connection not in report.acked:
                report.failed.add(connection)

    # --- publishing ---------------------------------------------------------------------------
    def publish_command(self, connection: Any, channel: str, payload: bytes, dedupe_id: str | None,
                        request_id: int) -> c.Enqueue:
        self.entry(channel)
        if channel not in connection.advertised:
            raise QueueError(e.E_NOT_ADVERTISED, f"advertise channel {channel} on this connection before publishing")
        self._served_here(channel)
        return c.Enqueue(channel_queue(channel), payload, 4, dedupe_id, connection.principal.client_id,
                         PublishReplier(self, connection, channel, payload), request_id)

    def published(self, channel: str, message_id: int, payload: bytes) -> None:
        """A publish is committed: every subscriber here gets it (and nothing older after it)."""
        last = self._last.get(channel)
        if last is not None and last[0] >= message_id:
            return                   # an older publish answered late (a retried dedupe id)
        self._last[channel] = (message_id, payload)
        self._last_sent_at[channel] = time.monotonic()
        self.published_total += 1
        subscribers = list(self.subscribers.get(channel, ()))
        item = ChannelMessage(channel, message_id, payload, False)
        for connection in subscribers:
            connection.emit(item)
        self.delivered_total += len(subscribers)
        try:
            delivery_class = self.entry(channel).delivery_class
        except QueueError:
            return
        reports = self._reports.setdefault(channel, collections.OrderedDict())
        reports[message_id] = Report(set(subscribers) if delivery_class == DeliveryClass.ACKED else set())
        while len(reports) > REPORTS_KEPT:
            reports.popitem(last=False)
        self._trim(channel, message_id)

    def ack(self, connection: Any, channel: str, message_id: int) -> None:
        reports = self._reports.get(channel)
        report = None if reports is None else reports.get(message_id)
        if report is None or connection not in report.subscribers:
            raise QueueError(e.E_UNKNOWN_MESSAGE, f"channel {channel}: message {message_id} was not sent to you "
                                                  "(or is too old to track)")
        report.acked.add(connection)

    def report(self, channel: str, message_id: int) -> dict[str, Any]:
        delivery_class = self.entry(channel).delivery_class
        self._served_here(channel)
        reports = self._reports.get(channel)
        report = None if reports is None else reports.get(message_id)
        if report is None:
            last = self._last_value(channel)
            if last is not None and message_id > last[0]:
                return {"id": message_id, "state": "queued"}   # not committed yet (or never published)
            raise QueueError(e.E_UNKNOWN_MESSAGE, f"channel {channel}: no report for message {message_id} "
                                                  "(too old, or published before this node served the channel)")
        return {"id": message_id, "state": report.state(delivery_class), "subscribers": len(report.subscribers),
                "acked": len(report.acked), "failed": len(report.failed)}

    def _trim(self, channel: str, newest: int) -> None:
        core = self._node.engine.cores.get(channel_queue(channel))
        if core is None or core.depth <= TRIM_ABOVE or channel in self._trimming:
            return
        self._trimming.add(channel)
        engine = self._node.engine
        engine.submit(c.Purge(channel_queue(channel), _Quiet(), upto=newest - 1))
        asyncio.get_running_loop().call_later(1.0, self._trimming.discard, channel)

    def _last_value(self, channel: str) -> tuple[int, bytes] | None:
        """The newest message of the channel's queue (read from storage after a failover)."""
        last = self._last.get(channel)
        if last is None:
            core = self._node.engine.cores.get(channel_queue(channel))
            storage = self._node.storage
            if core is not None:
                with_read = not storage.reading
                if with_read:
                    storage.begin_read()
                try:
                    last = storage.newest_message(core.queue_id)
                finally:
                    if with_read:
                        storage.end_read()
                if last is not None:
                    self._last[channel] = last
        return last

    # --- the watch: resends, masters that moved, channels deleted ------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.subscribers:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for channel in list(self.subscribers):
                try:
                    entry = self.entry(channel)
                    self._served_here(channel)
                except QueueError as error:
                    self._end(channel, error)
                    continue
                self._resend_if_due(entry)

    def _resend_if_due(self, entry: ChannelEntry) -> None:
        if not entry.resend_interval_s:
            return
        channel = entry.name
        now = time.monotonic()
        if now - self._last_sent_at.get(channel, 0.0) < entry.resend_interval_s:
            return
        last = self._last_value(channel)
        if last is None:
            return
        self._last_sent_at[channel] = now
        item = ChannelMessage(channel, last[0], last[1], True)
        for connection in list(self.subscribers.get(channel, ())):
            connection.emit(item)

    def _end(self, channel: str, error: QueueError) -> None:
        """This node no longer serves the channel: its subscribers subscribe again elsewhere."""
        for connection in list(self.subscribers.get(channel, ())):
            self._drop(connection, channel)
            connection.emit(ChannelEnded(channel, error.code, error.message))
        for kept in (self._last, self._last_sent_at, self._reports):
            kept.pop(channel, None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def render_metrics(self) -> list[str]:
        return (render_family("qserver_channel_subscribers", "gauge", "channel subscriptions served here",
                              [({"channel": name}, len(subs)) for name, subs in sorted(self.subscribers.items())])
                + render_family("qserver_channel_published_total", "counter", "publishes fanned out here",
                                [({}, self.published_total)])
                + render_family("qserver_channel_deliveries_total", "counter",
                                "channel messages sent to subscribers here", [({}, self.delivered_total)]))
