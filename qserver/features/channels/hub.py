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

`durable` subscriptions are queue state of the channel's queue (QueueCore: opened, acknowledged
and dropped by replicated operations, kept in its record): a subscription's backlog is every
message published after it was opened that it has not acknowledged, so one publish is one
replicated write however many subscriptions there are, and a trim never takes a message some
subscription still waits for. Here, a `DurableReader` sends a connection its subscription's
backlog a window at a time, from storage, and resends what stays unacknowledged.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qserver.core import commands as c
from qserver.features.channels import decide
from qserver.features.channels.decide import Offer
from qserver.features.channels.mechanisms import Mechanisms
from qserver.features.channels.publishers import ADVERTISERS_PER_CHANNEL_MAX, Publishers
from qserver.features.channels.transport import Mechanism
from qserver.metrics import render_family
from qserver.services import Redirect
from replication.cluster_map import ChannelEntry, DeliveryClass, channel_queue
from replication.options import is_valid_queue_name
from replication.queue_core import SUBSCRIPTION_PRIORITY, QueueCore
from wire import errors as e
from wire.errors import QueueError
from wire.protocol import ChannelEnded, ChannelMessage

if TYPE_CHECKING:
    from qserver.services import NodeServices

log = logging.getLogger("qserver.features.channels.hub")
TRIM_ABOVE = 64                  # a channel's queue is trimmed to its newest message past this depth
REPORTS_KEPT = 10_000            # per channel: the newest publishes whose state `report` can tell
WATCH_INTERVAL_S = 0.25          # how often resends are due and masters checked
ACK_RUN_MAX = 1_024              # a durable reader's acks committed as one run, at most
ACKS_WAITING_MAX = 4 * decide.DURABLE_WINDOW   # acks waiting for the run in flight (a reader holds 256 unacked)


@dataclass(slots=True)
class Report:
    """What became of one published message (seed 002 CCIClient_report), judged by the class
    the channel had when it was published (a later characterize does not change it)."""
    delivery_class: str
    subscribers: set[Any]                 # the connections it was sent to
    acked: set[Any] = field(default_factory=set)
    failed: set[Any] = field(default_factory=set)   # left (unsubscribed, disconnected) before acking
    late: set[Any] = field(default_factory=set)     # subscribed after, and were sent it as the last value
    late_acked: bool = False              # one of those acknowledged it

    def state(self) -> str:
        if self.delivery_class != DeliveryClass.ACKED:
            return "delivered"             # sent to every subscriber there was (best effort)
        if self.failed:
            # Seed 002: "if the message was not delivered successfully the first time and the
            # joining of a new subscriber triggers a successful delivery, the status changes
            # to successfully delivered".
            return "delivered" if self.late_acked else "failed"
        return "delivered" if self.acked >= self.subscribers else "pending_ack"

    def acknowledged(self, connection: Any) -> None:
        """`connection` (one it was sent to, or a late subscriber: in `late`) acknowledged it."""
        if connection in self.late and (connection in self.failed or connection not in self.subscribers):
            self.late_acked = True       # sent it as the last value on (re)subscribing: seed 002's late delivery
        else:
            self.acked.add(connection)

    def left(self, connection: Any) -> None:
        """`connection` unsubscribed or went: unacknowledged, it fails the message."""
        if connection in self.subscribers and connection not in self.acked:
            self.failed.add(connection)
        # A late subscriber that leaves unacknowledged changes nothing, and is not kept: a quiet
        # channel's last report would otherwise hold every connection that came and went.
        self.late.discard(connection)


@dataclass(slots=True, eq=False)
class DurableReader:
    """The connection reading a durable subscription's backlog (one at a time per name)."""
    connection: Any
    channel: str
    name: str
    sent: dict[int, float] = field(default_factory=dict)  # unacknowledged id -> when last sent (monotonic)
    cursor: int = 0            # every backlog message up to this id was sent
    caught_up: bool = False    # the last read reached the backlog's end: new publishes go straight out
    # Its acks: those that came while a run of them was being committed wait here and go as the
    # next run, one engine step (qserver/core/steps.py, `acks`) instead of one each.
    acks_waiting: list[tuple[int, int]] = field(default_factory=list)   # (message id, request id)
    acking: bool = False


class _Step:
    """The replier of one durable subscription step: calls `done(result)` or `failed(error)`."""
    __slots__ = ("done", "failed")

    def __init__(self, done: Any, failed: Any) -> None:
        self.done, self.failed = done, failed

    def reply(self, request_id: int, result: Any) -> None:
        self.done(result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self.failed(error)


class _Quiet:
    """The replier of the hub's own purges (a failed trim is tried again at the next publish)."""

    def reply(self, request_id: int, result: Any) -> None:
        pass

    def fail(self, request_id: int, error: QueueError) -> None:
        log.debug("trimming a channel's queue: %s", error)


class ChannelHub:
    """The driver of channels on this node: it keeps the subscriptions, reads the clock
    (`clock`: monotonic seconds) and storage, and sends what the pure rules
    (qserver/features/channels/decide.py) decide."""

    def __init__(self, services: NodeServices, clock: Callable[[], float] = time.monotonic) -> None:
        self._services = services
        self._clock = clock
        self.subscribers: dict[str, dict[Any, None]] = {}          # channel -> connections, in order
        self._last: dict[str, tuple[int, bytes]] = {}              # channel -> its newest (id, payload) known here
        self._last_sent_at: dict[str, float] = {}
        self._reports: dict[str, collections.OrderedDict[int, Report]] = {}
        self._trimming: set[str] = set()
        self.durable: dict[str, dict[str, DurableReader]] = {}      # channel -> subscription name -> reader
        self.published_total = 0
        self.delivered_total = 0
        self._task: asyncio.Task[None] | None = None
        self.mechanisms = Mechanisms(self, services, clock)     # how each publish travels (transport.py)
        self.publishers = Publishers()                          # who advertised each channel, who leads

    # --- the map ----------------------------------------------------------------------------
    def entry(self, channel: str) -> ChannelEntry:
        cluster = self._services.cluster_map
        found = cluster.channels.get(channel) if cluster is not None else None
        if found is None:
            raise QueueError(e.E_UNKNOWN_CHANNEL, f"no channel named {channel!r}")
        return found

    def _served_here(self, channel: str) -> None:
        """Raise unless this node masters the channel's queue (E_NOT_MASTER names the node)."""
        queue = channel_queue(channel)
        if self._services.master_core(queue) is not None:
            return
        entry = self._services.entry(queue)
        if entry is None:
            raise QueueError(e.E_QUEUE_UNAVAILABLE, f"channel {channel}: its queue is not in this node's map yet")
        raise Redirect(entry.master, f"channel {channel} is served by its master {entry.master}")

    # --- subscriptions ------------------------------------------------------------------------
    def subscribe(self, connection: Any, channels: tuple[str, ...]) -> tuple[dict[str, int | None], list[Any]]:
        """All or none: every channel exists, the caller may read it and this node serves it.
        Returns the answer (each channel's last id) and the last values to send after it."""
        for channel in channels:
            self.entry(channel)
            if not connection.principal.allows("get", channel):
                raise QueueError(e.E_FORBIDDEN, f"client {connection.principal.client_id} may not get on {channel}")
            self._served_here(channel)
        answer: dict[str, int | None] = {}
        lasts: list[Any] = []
        for channel in dict.fromkeys(channels):
            self.subscribers.setdefault(channel, {})[connection] = None
            connection.channels.add(channel)
            last = self._last_value(channel)
            answer[channel] = None if last is None else last[0]
            if self.entry(channel).attributes.get("skip_last_value"):
                continue                 # seed 002: "perhaps make it a channel attribute"
            items = self.mechanisms.last_items(connection, channel, last)   # the last value on subscribe (seed 002)
            lasts.extend(items)
            report = self._reports.get(channel, {}).get(items[0].message_id) if items else None
            if report is not None:
                report.late.add(connection)      # its ack may turn a failed report into delivered
        self._start()
        return answer, lasts

    def advertise(self, connection: Any, channels: tuple[str, ...], on: bool, leader: bool = False) -> None:
        """A producer declares (or withdraws) that it publishes to these channels (seed 002
        advertise); several producers may advertise one channel, one leads (publishers.py;
        `leader`: this connection takes the lead). All or none."""
        if leader and on:
            self._services.require_feature("channel_advertisers")
        for channel in channels:
            self.entry(channel)
            if not connection.principal.allows("post", channel):
                raise QueueError(e.E_FORBIDDEN, f"client {connection.principal.client_id} may not post on {channel}")
            if on and channel not in connection.advertised \
                    and self.publishers.count(channel) >= ADVERTISERS_PER_CHANNEL_MAX:
                raise QueueError(e.E_ADVERTISERS_FULL, f"channel {channel} has {ADVERTISERS_PER_CHANNEL_MAX} "
                                                       "advertisers at its master")
        for channel in channels:
            if on:
                connection.advertised.add(channel)
                self.publishers.advertise(channel, connection, leader=leader)
            else:
                connection.advertised.discard(channel)
                self.publishers.withdraw(channel, connection)

    def unsubscribe(self, connection: Any, channels: tuple[str, ...]) -> None:
        for channel in channels:
            self._drop(connection, channel)

    def connection_closed(self, connection: Any) -> None:
        for channel in list(connection.channels):
            self._drop(connection, channel)
        for channel in list(connection.advertised):
            self.publishers.withdraw(channel, connection)
        for channel in list(connection.durable):
            self._detach(connection, channel)

    # --- durable subscriptions ----------------------------------------------------------------
    def subscribe_durable(self, connection: Any, channels: tuple[str, ...], name: str, request_id: int) -> None:
        """Read the durable subscription `name` of each channel on this connection, opening the
        ones that do not exist yet (replicated, answered once committed). Checked all or none
        before any opens; an open that fails after (the master moved) is answered with its
        error, and subscribing again is idempotent. A connection reading one of them elsewhere
        is told E_SUBSCRIPTION_TAKEN."""
        if not is_valid_queue_name(name):
            raise QueueError(e.E_INVALID_NAME, "a durable subscription's name is a queue name (1-196 of A-Z a-z "
                                               "0-9 . _ : -, starting alphanumeric)")
        channels = tuple(dict.fromkeys(channels))
        for channel in channels:
            entry = self.entry(channel)
            if entry.delivery_class != DeliveryClass.DURABLE:
                raise QueueError(e.E_INVALID_OPTION, f"channel {channel} is {entry.delivery_class}: durable "
                                                     "subscriptions are on durable channels")
            if not connection.principal.allows("get", channel):
                raise QueueError(e.E_FORBIDDEN, f"client {connection.principal.client_id} may not get on {channel}")
            self._served_here(channel)
        answer: dict[str, int | None] = {}
        errors: list[QueueError] = []

        def settle(channel: str, outcome: Any) -> None:
            if isinstance(outcome, QueueError):
                errors.append(outcome)
            else:
                answer[channel] = outcome
            if len(answer) + len(errors) < len(channels):
                return
            if errors:
                connection.fail(request_id, errors[0])
                return
            if connection.closed:
                return
            connection.reply(request_id, answer)
            for opened in channels:
                self._attach(connection, opened, name)
        for channel in channels:
            self._services.submit(c.DurableSubscription(
                channel_queue(channel), "open", name, 0, connection.principal.client_id,
                _Step(lambda _, ch=channel: settle(ch, self._floor(ch, name)),
                      lambda error, ch=channel: settle(ch, error))))

    def _floor(self, channel: str, name: str) -> int | None:
        core = self._core(channel)
        state = None if core is None else core.record.subscriptions.get(name)
        return None if state is None else int(state[0])

    def _core(self, channel: str) -> QueueCore | None:
        return self._services.held_core(channel_queue(channel))

    def _attach(self, connection: Any, channel: str, name: str) -> None:
        readers = self.durable.setdefault(channel, {})
        previous = readers.get(name)
        if previous is not None and previous.connection is not connection:
            self._detach(previous.connection, channel)
            previous.connection.emit(ChannelEnded(channel, e.E_SUBSCRIPTION_TAKEN.code,
                                                  f"durable subscription {name} is read on another connection"))
        old_name = connection.durable.get(channel)
        if old_name is not None and old_name != name:
            self._detach(connection, channel)
        readers = self.durable.setdefault(channel, {})       # a detach may have dropped the last one
        reader = readers.get(name)
        if reader is None or reader.connection is not connection:
            reader = readers[name] = DurableReader(connection, channel, name)
        connection.durable[channel] = name
        reader.sent.clear()                 # a subscribe again sends the whole backlog again
        reader.cursor, reader.caught_up = 0, False
        self._fill(reader)
        self._start()

    def _detach(self, connection: Any, channel: str) -> None:
        name = connection.durable.pop(channel, None)
        readers = self.durable.get(channel)
        if name is None or readers is None:
            return
        reader = readers.get(name)
        if reader is not None and reader.connection is connection:
            del readers[name]
            if not readers:
                del self.durable[channel]

    def _fill(self, reader: DurableReader) -> None:
        """Send the reader its backlog's next messages, up to its window, from storage (only
        committed ones: visible_upto)."""
        core = self._core(reader.channel)
        state = None if core is None else core.record.subscriptions.get(reader.name)
        if core is None or state is None:
            return
        room = decide.window_room(len(reader.sent))
        if room <= 0:
            return
        floor, acked = state
        asked = room + len(acked)
        rows = self._services.messages_after(core.queue_id, max(reader.cursor, floor), asked)
        fill = decide.plan_fill(rows, asked=asked, room=room, acked=set(acked), visible_upto=core.visible_upto,
                                cursor=reader.cursor)
        now = self._clock()
        reader.cursor, reader.caught_up = fill.cursor, fill.caught_up
        for index, payload in fill.send:
            reader.sent[index] = now
            reader.connection.emit(ChannelMessage(reader.channel, index, payload, False))
            self.delivered_total += 1

    def _publish_durable(self, channel: str, message_id: int, payload: bytes) -> None:
        now = self._clock()
        core = self._core(channel)
        for reader in self.durable.get(channel, {}).values():
            verdict = decide.offer(message_id, cursor=reader.cursor, caught_up=reader.caught_up,
                                   unacknowledged=len(reader.sent))
            if verdict is Offer.SENT:
                state = None if core is None else core.record.subscriptions.get(reader.name)
                if state is not None and decide.passed_over(message_id, sent=reader.sent, floor=state[0],
                                                            acked=state[1]):
                    reader.sent[message_id] = now       # the cursor went past it before its answer came
                    reader.connection.emit(ChannelMessage(channel, message_id, payload, False))
                    self.delivered_total += 1
                continue
            if verdict is Offer.SEND:
                reader.cursor = message_id
                reader.sent[message_id] = now
                reader.connection.emit(ChannelMessage(channel, message_id, payload, False))
                self.delivered_total += 1
            else:
                reader.caught_up = False        # read from storage once the window has room

    def _ack_durable(self, connection: Any, channel: str, message_id: int, request_id: int) -> c.Command | None:
        name = connection.durable[channel]
        reader = self.durable.get(channel, {}).get(name)
        if reader is not None and reader.connection is connection:
            if len(reader.acks_waiting) >= ACKS_WAITING_MAX:
                raise QueueError(e.E_OVERLOADED, f"durable subscription {name} has {ACKS_WAITING_MAX} acks waiting")
            reader.acks_waiting.append((message_id, request_id))
            if not reader.acking:
                self._ack_run(reader)
            return None

        def done(result: Any) -> None:
            reader = self.durable.get(channel, {}).get(name)
            if reader is not None and reader.connection is connection:
                reader.sent.pop(message_id, None)
                if not reader.caught_up:
                    self._fill(reader)
            connection.reply(request_id, None)
        return c.DurableSubscription(channel_queue(channel), "ack", name, message_id, connection.principal.client_id,
                                     _Step(done, lambda error: connection.fail(request_id, error)))

    def _ack_run(self, reader: DurableReader) -> None:
        """Commit the reader's waiting acks as one run (the first ack goes alone, those that come
        meanwhile go together next), answering each with its own outcome."""
        run, reader.acks_waiting = reader.acks_waiting[:ACK_RUN_MAX], reader.acks_waiting[ACK_RUN_MAX:]
        reader.acking = True
        connection = reader.connection

        def next_run() -> None:
            reader.acking = False
            if reader.acks_waiting and self.durable.get(reader.channel, {}).get(reader.name) is reader:
                self._ack_run(reader)

        def done(outcomes: list[Any]) -> None:
            for (message_id, request_id), outcome in zip(run, outcomes, strict=True):
                if isinstance(outcome, QueueError):
                    connection.fail(request_id, outcome)
                    continue
                reader.sent.pop(message_id, None)
                connection.reply(request_id, None)
            if not reader.caught_up and self.durable.get(reader.channel, {}).get(reader.name) is reader:
                self._fill(reader)
            next_run()

        def failed(error: QueueError) -> None:
            for _, request_id in run:
                connection.fail(request_id, error)
            next_run()
        self._services.submit(c.DurableSubscription(
            channel_queue(reader.channel), "acks", reader.name, 0, connection.principal.client_id, _Step(done, failed),
            message_ids=tuple(message_id for message_id, _ in run)))

    def drop_subscription_command(self, channel: str, name: str, client: str, replier: Any) -> c.DurableSubscription:
        """End a durable subscription for good (its reader, if any, is told)."""
        self.entry(channel)
        self._served_here(channel)

        def done(result: Any) -> None:
            reader = self.durable.get(channel, {}).get(name)
            if reader is not None:
                self._detach(reader.connection, channel)
                reader.connection.emit(ChannelEnded(channel, e.E_UNKNOWN_SUBSCRIPTION.code,
                                                    f"durable subscription {name} was dropped"))
            replier.reply(0, {"channel": channel, "subscription": name, "dropped": True})
        return c.DurableSubscription(channel_queue(channel), "drop", name, 0, client,
                                     _Step(done, lambda error: replier.fail(0, error)))

    def durable_subscriptions(self, channel: str) -> list[dict[str, Any]]:
        """The channel's durable subscriptions as this master holds them: each one's floor,
        the messages waiting for it (counted from storage, bounded by the queue's depth), its
        reader here and what that reader holds unacknowledged."""
        self.entry(channel)
        self._served_here(channel)
        core = self._core(channel)
        if core is None:
            return []
        subscriptions = sorted(core.record.subscriptions.items())
        # Counted from the ready index (no payload read): every channel message is ready.
        ready = self._services.ready_counts(core.queue_id, SUBSCRIPTION_PRIORITY,
                                            [floor for _, (floor, _) in subscriptions], core.depth + 1)
        out = []
        for (name, (floor, acked)), count in zip(subscriptions, ready, strict=True):
            reader = self.durable.get(channel, {}).get(name)
            out.append({"name": name, "floor": floor, "waiting": count - len(acked), "attached": reader is not None,
                        "unacknowledged": 0 if reader is None else len(reader.sent)})
        return out

    def _resend_durable(self, entry: ChannelEntry, now: float) -> None:
        interval = decide.durable_resend_interval(entry.resend_interval_s)
        core = self._core(entry.name)
        if core is None:
            return
        for reader in list(self.durable.get(entry.name, {}).values()):
            due = decide.resends_due(reader.sent, now, interval)
            if due:
                for index, payload in self._services.payloads(core.queue_id, due):
                    if payload is None:              # acknowledged meanwhile and trimmed
                        reader.sent.pop(index, None)
                        continue
                    reader.sent[index] = now
                    reader.connection.emit(ChannelMessage(entry.name, index, payload, True))
            if not reader.caught_up:
                self._fill(reader)

    def _drop(self, connection: Any, channel: str) -> None:
        connection.channels.discard(channel)
        self.mechanisms.left(connection, channel)
        subscribers = self.subscribers.get(channel)
        if subscribers is not None:
            subscribers.pop(connection, None)
            if not subscribers:
                del self.subscribers[channel]
        for report in self._reports.get(channel, {}).values():
            report.left(connection)

    # --- publishing ---------------------------------------------------------------------------
    def publish_command(self, connection: Any, channel: str, payload: bytes, dedupe_id: str | None,
                        request_id: int) -> c.Enqueue | None:
        self.entry(channel)
        if channel not in connection.advertised:
            raise QueueError(e.E_NOT_ADVERTISED, f"advertise channel {channel} on this connection before publishing")
        if not self.publishers.may_publish(channel, connection):
            raise self._standby(channel)
        self._served_here(channel)
        return self.mechanisms.route(connection, channel, payload, dedupe_id, connection.principal.client_id, request_id)

    def leader_client(self, channel: str) -> str | None:
        """The client id of the connection leading the channel's advertisers here (None: none)."""
        leader = self.publishers.leader(channel)
        return None if leader is None else str(leader.principal.client_id)

    def check_rest_publisher(self, channel: str, client_id: str) -> None:
        """A REST publish declares its publisher by itself: it goes out while nobody advertised
        the channel, or when the caller is the leading advertiser's client."""
        leader = self.leader_client(channel)
        if leader is not None and leader != client_id:
            raise self._standby(channel)

    def _standby(self, channel: str) -> QueueError:
        return QueueError(e.E_STANDBY, f"channel {channel} is published by its leading advertiser (client "
                                       f"{self.leader_client(channel)}): this publish was neither stored nor sent")

    def published(self, channel: str, message_id: int, payload: bytes,
                  mechanism: Mechanism = Mechanism.REPLICATED) -> None:
        """A publish is committed: every subscriber here gets it (and nothing older after it)."""
        last = self._last.get(channel)
        if last is not None and last[0] >= message_id:
            # An older publish answered late (a retried dedupe id): live subscribers keep only
            # the newest, but a durable reader that went past it without it must still get it.
            if channel in self.durable:
                self._publish_durable(channel, message_id, payload)
            return
        self._last[channel] = (message_id, payload)
        self._last_sent_at[channel] = self._clock()
        self.published_total += 1
        subscribers = list(self.subscribers.get(channel, ()))
        item = ChannelMessage(channel, message_id, payload, False)
        staged = mechanism is Mechanism.STAGED      # subscribers that take offers are sent a reference
        for connection in subscribers:
            connection.emit(self.mechanisms.stored_item(connection, channel, message_id, payload, True, False)
                            if staged else item)
        self.delivered_total += len(subscribers)
        if channel in self.durable:
            self._publish_durable(channel, message_id, payload)
        self.record_report(channel, message_id, subscribers)
        self._trim(channel, message_id)

    def record_report(self, channel: str, message_id: int, subscribers: list[Any], acked: tuple[Any, ...] = ()) -> None:
        """Keep what `report` will tell of a message just sent, under the channel's class now."""
        try:
            delivery_class = self.entry(channel).delivery_class
        except QueueError:
            return
        reports = self._reports.setdefault(channel, collections.OrderedDict())
        reports[message_id] = Report(delivery_class, set(subscribers) if delivery_class == DeliveryClass.ACKED else set(),
                                     set(acked))
        while len(reports) > REPORTS_KEPT:
            reports.popitem(last=False)

    def ack(self, connection: Any, channel: str, message_id: int, request_id: int) -> c.Command | None:
        """A subscriber's acknowledgement: of its durable subscription's message (a replicated
        step, answered once committed: the command), or of an `acked` channel's (answered here)."""
        if self.mechanisms.received(connection, channel, message_id):     # a relay's receipt
            connection.reply(request_id, None)
            return None
        if channel in connection.durable:
            return self._ack_durable(connection, channel, message_id, request_id)
        reports = self._reports.get(channel)
        report = None if reports is None else reports.get(message_id)
        if report is None or (connection not in report.subscribers and connection not in report.late):
            raise QueueError(e.E_UNKNOWN_MESSAGE, f"channel {channel}: message {message_id} was not sent to you "
                                                  "(or is too old to track)")
        report.acknowledged(connection)
        connection.reply(request_id, None)
        return None

    def report(self, channel: str, message_id: int) -> dict[str, Any]:
        self.entry(channel)
        self._served_here(channel)
        core = self._core(channel)
        if core is not None and core.record.subscriptions:
            return self._durable_report(core, channel, message_id)
        reports = self._reports.get(channel)
        report = None if reports is None else reports.get(message_id)
        if report is None:
            last = self._last_value(channel)
            if last is not None and message_id > last[0]:
                return {"id": message_id, "state": "queued"}   # not committed yet (or never published)
            raise QueueError(e.E_UNKNOWN_MESSAGE, f"channel {channel}: no report for message {message_id} "
                                                  "(too old, or published before this node served the channel)")
        return {"id": message_id, "state": report.state(), "subscribers": len(report.subscribers),
                "acked": len(report.acked), "failed": len(report.failed)}

    def _durable_report(self, core: QueueCore, channel: str, message_id: int) -> dict[str, Any]:
        """From the replicated subscription state: delivered once every durable subscription
        (every one opened before it) acknowledged it."""
        last = self._last_value(channel)
        if last is None or message_id > last[0]:
            return {"id": message_id, "state": "queued"}
        subscriptions = core.record.subscriptions
        acked = sum(1 for floor, above in subscriptions.values() if message_id <= floor or message_id in above)
        return {"id": message_id, "state": "delivered" if acked == len(subscriptions) else "pending_ack",
                "subscribers": len(subscriptions), "acked": acked, "failed": 0}

    def _trim(self, channel: str, newest: int) -> None:
        core = self._core(channel)
        if core is None or core.depth <= TRIM_ABOVE or channel in self._trimming:
            return
        self._trimming.add(channel)
        self._services.submit(c.Purge(channel_queue(channel), _Quiet(), upto=newest - 1))
        asyncio.get_running_loop().call_later(1.0, self._trimming.discard, channel)

    def _last_value(self, channel: str) -> tuple[int, bytes] | None:
        """The newest message of the channel's queue (read from storage after a failover)."""
        last = self._last.get(channel)
        if last is None:
            core = self._core(channel)
            if core is not None:
                last = self._services.newest_message(core.queue_id)
                if last is not None:
                    self._last[channel] = last
        return last

    # --- the watch: resends, masters that moved, channels deleted ------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.subscribers or self.durable:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = self._clock()
            self.mechanisms.overdue(now)
            for channel in list(dict.fromkeys([*self.subscribers, *self.durable])):
                try:
                    entry = self.entry(channel)
                    self._served_here(channel)
                except QueueError as error:
                    self._end(channel, error)
                    continue
                self._resend_if_due(entry)
                if channel in self.durable:
                    self._resend_durable(entry, now)

    def _resend_if_due(self, entry: ChannelEntry) -> None:
        channel = entry.name
        now = self._clock()
        if not decide.last_value_due(entry.resend_interval_s, self._last_sent_at.get(channel, 0.0), now):
            return
        self._last_sent_at[channel] = now
        last = self._last_value(channel)
        for connection in list(self.subscribers.get(channel, ())):
            for item in self.mechanisms.last_items(connection, channel, last):
                connection.emit(item)

    def _end(self, channel: str, error: QueueError) -> None:
        """This node no longer serves the channel: its subscribers subscribe again elsewhere."""
        for connection in list(self.subscribers.get(channel, ())):
            self._drop(connection, channel)
            connection.emit(ChannelEnded(channel, error.code, error.message))
        for reader in list(self.durable.get(channel, {}).values()):
            self._detach(reader.connection, channel)
            reader.connection.emit(ChannelEnded(channel, error.code, error.message))
        for kept in (self._last, self._last_sent_at, self._reports):
            kept.pop(channel, None)
        self.mechanisms.ended(channel)

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
                + render_family("qserver_channel_publishes_total", "counter",
                                "publishes at this node by how they traveled (docs/PROTOCOL.md, \"How a channel's "
                                "messages travel\")",
                                [({"mechanism": name}, count) for name, count in self.mechanisms.counts.items()])
                + render_family("qserver_channel_advertisers", "gauge", "connections advertising a channel here",
                                [({"channel": name}, len(publishers.advertisers))
                                 for name, publishers in sorted(self.publishers.channels.items())])
                + render_family("qserver_channel_deliveries_total", "counter",
                                "channel messages sent to subscribers here", [({}, self.delivered_total)])
                + render_family("qserver_channel_durable_unacknowledged", "gauge",
                                "messages sent to a durable subscription's reader here and not acknowledged yet",
                                [({"channel": channel, "subscription": name}, len(reader.sent))
                                 for channel, readers in sorted(self.durable.items())
                                 for name, reader in sorted(readers.items())]))
