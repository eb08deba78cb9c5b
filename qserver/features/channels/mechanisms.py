"""The mechanisms by which a channel's messages travel (issue 37 item 10), driven at the
channel's master for the channel hub (hub.py): which one a publish takes (the pure rule is
transport.py `choose`), the messages that are not stored (best effort, relayed point to point)
with their last values, the relays awaiting receipt, and fetching a staged message's payload.

The stored path (`replicated`, `staged`) stays the hub's: a publish is an enqueue whose
PublishReplier calls hub.published once committed; `staged` only changes what published sends
(a reference instead of the payload) to connections that take offers.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qserver.core import commands as c
from qserver.features.channels import transport
from qserver.features.channels.transport import Mechanism
from replication.cluster_map import channel_queue
from replication.queue_core import SUBSCRIPTION_PRIORITY
from wire import errors as e
from wire.channel_ops import ChannelOffer, OfferKind
from wire.errors import QueueError
from wire.protocol import ChannelMessage

if TYPE_CHECKING:
    from qserver.features.channels.hub import ChannelHub
    from qserver.services import NodeServices


@dataclass(slots=True, eq=False)
class Relay:
    """A point-to-point message sent to its one subscriber, its publisher not answered yet."""
    target: Any                  # the subscriber's connection
    replier: Any                 # the publisher's (a connection, or the REST request's future)
    request_id: int
    payload: bytes
    dedupe_id: str | None
    client: str
    sent_at: float


class PublishReplier:
    """Answers a stored publish once its enqueue is committed, and fans it out then (as
    `mechanism`: replicated or staged)."""
    __slots__ = ("channel", "connection", "hub", "mechanism", "payload")

    def __init__(self, hub: ChannelHub, connection: Any, channel: str, payload: bytes,
                 mechanism: Mechanism = Mechanism.REPLICATED) -> None:
        self.hub, self.connection, self.channel, self.payload = hub, connection, channel, payload
        self.mechanism = mechanism

    def reply(self, request_id: int, result: Any) -> None:
        message_id, _ = result
        self.hub.published(self.channel, int(message_id), self.payload, self.mechanism)
        self.connection.reply(request_id, result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self.connection.fail(request_id, error)


def takes_offers(connection: Any) -> bool:
    return bool(getattr(connection, "takes_offers", False))


class Mechanisms:
    def __init__(self, hub: ChannelHub, services: NodeServices, clock: Callable[[], float],
                 wall_us: Callable[[], int] = lambda: time.time_ns() // 1000) -> None:
        self._hub, self._services, self._clock, self._wall_us = hub, services, clock, wall_us
        self._volatile_last: dict[str, tuple[int, bytes]] = {}    # channel -> newest message not stored
        self._last_volatile_id = 0
        self.relays: dict[str, dict[int, Relay]] = {}             # channel -> id -> relay awaiting receipt
        self.counts: dict[str, int] = {mechanism.value: 0 for mechanism in Mechanism}   # publishes by mechanism

    # --- choosing ------------------------------------------------------------------------------
    def current(self, channel: str) -> Mechanism:
        """The mechanism the channel's next publish takes here (typeof reports it)."""
        entry = self._hub.entry(channel)
        subscribers = self._hub.subscribers.get(channel, {})
        return transport.choose(entry.delivery_class, entry.attributes, len(subscribers),
                                sum(1 for connection in subscribers if takes_offers(connection)))

    def route(self, replier: Any, channel: str, payload: bytes, dedupe_id: str | None, client: str,
              request_id: int) -> c.Enqueue | None:
        """A publish, checked by the caller: the enqueue of the stored path (answered once
        committed), or None when it was sent (best effort: answered already) or relayed (answered
        once received, or stored after all)."""
        mechanism = self.current(channel)
        if mechanism is Mechanism.POINT_TO_POINT and self._relays_full(channel, len(payload)):
            mechanism = Mechanism.STAGED         # what waits for receipts is bounded: stored instead
        self.counts[mechanism.value] += 1
        if mechanism is Mechanism.BEST_EFFORT:
            message_id = self._volatile(channel, payload)
            subscribers = list(self._hub.subscribers.get(channel, {}))
            self._send(channel, message_id, payload, OfferKind.VOLATILE, subscribers)
            self._hub.record_report(channel, message_id, subscribers)
            replier.reply(request_id, (message_id, self._epoch(channel)))
            return None
        if mechanism is Mechanism.POINT_TO_POINT:
            (target,) = self._hub.subscribers[channel]
            message_id = self._volatile(channel, payload)
            self.relays.setdefault(channel, {})[message_id] = Relay(target, replier, request_id, payload, dedupe_id,
                                                                    client, self._clock())
            self._send(channel, message_id, payload, OfferKind.RELAY, (target,))
            return None
        self._volatile_last.pop(channel, None)       # a stored message is newer than any volatile one
        return c.Enqueue(channel_queue(channel), payload, SUBSCRIPTION_PRIORITY, dedupe_id, client,
                         PublishReplier(self._hub, replier, channel, payload, mechanism), request_id)

    def _relays_full(self, channel: str, size: int) -> bool:
        relays = self.relays.get(channel, {})
        return len(relays) >= transport.RELAYS_PER_CHANNEL_MAX or \
            size + sum(len(relay.payload) for relay in relays.values()) > transport.RELAY_BYTES_PER_CHANNEL_MAX

    def _volatile(self, channel: str, payload: bytes) -> int:
        self._last_volatile_id = transport.volatile_id(self._last_volatile_id, self._wall_us())
        self._volatile_last[channel] = (self._last_volatile_id, payload)
        self._hub.published_total += 1
        return self._last_volatile_id

    def _epoch(self, channel: str) -> int:
        entry = self._services.entry(channel_queue(channel))
        return 0 if entry is None else entry.epoch

    def _send(self, channel: str, message_id: int, payload: bytes, kind: OfferKind, connections: Any,
              resent: bool = False) -> None:
        offer = ChannelOffer(channel, message_id, kind.value, len(payload), payload, resent)
        inline = ChannelMessage(channel, message_id, payload, resent)
        for connection in list(connections):
            connection.emit(offer if takes_offers(connection) else inline)
            self._hub.delivered_total += 1

    # --- what the stored path sends -------------------------------------------------------------
    def stored_item(self, connection: Any, channel: str, message_id: int, payload: bytes, staged: bool,
                    resent: bool) -> ChannelOffer | ChannelMessage:
        """A stored message for one connection: a reference when staged and it takes offers."""
        if staged and takes_offers(connection):
            return ChannelOffer(channel, message_id, OfferKind.REFERENCE.value, len(payload), b"", resent)
        return ChannelMessage(channel, message_id, payload, resent)

    def last_items(self, connection: Any, channel: str, stored: tuple[int, bytes] | None) -> list[Any]:
        """The last value sent on subscribing (or at the resend interval): the newest message
        not stored when there is one (it came after every stored one), else the stored last (to
        a connection that takes no offers, always)."""
        volatile = self._volatile_last.get(channel)
        if volatile is not None and takes_offers(connection):
            return [ChannelOffer(channel, volatile[0], OfferKind.VOLATILE.value, len(volatile[1]), volatile[1], True)]
        if stored is None:
            return []
        staged = self.current(channel) in (Mechanism.STAGED, Mechanism.POINT_TO_POINT)
        return [self.stored_item(connection, channel, stored[0], stored[1], staged, True)]

    def fetch(self, principal: Any, channel: str, message_id: int) -> bytes:
        """A stored message's payload, for a subscriber given its reference."""
        self._hub.entry(channel)
        if not principal.allows("get", channel):
            raise QueueError(e.E_FORBIDDEN, f"client {principal.client_id} may not get on {channel}")
        self._services.require_feature("channel_attributes")
        core = self._services.held_core(channel_queue(channel))     # either member: stored on both
        if core is None:
            raise QueueError(e.E_QUEUE_UNAVAILABLE, f"channel {channel}: its queue is not held here")
        if core.visible_upto is None or message_id <= core.visible_upto:
            for _, payload in self._services.payloads(core.queue_id, [message_id]):
                if payload is not None:
                    return payload
        raise QueueError(e.E_UNKNOWN_MESSAGE, f"channel {channel}: no message {message_id} (newer values replaced it, "
                                              "or it was never published)")

    # --- relays ----------------------------------------------------------------------------------
    def received(self, connection: Any, channel: str, message_id: int) -> bool:
        """A subscriber acknowledged a relayed message: its publisher is answered. False when no
        relay of that id awaits this connection (an ordinary acknowledgement)."""
        relays = self.relays.get(channel)
        relay = None if relays is None else relays.get(message_id)
        if relay is None or relay.target is not connection:
            return False
        del relays[message_id]                                  # type: ignore[union-attr]
        if not relays:
            self.relays.pop(channel, None)
        self._hub.record_report(channel, message_id, [connection], (connection,))
        relay.replier.reply(relay.request_id, (message_id, self._epoch(channel)))
        return True

    def left(self, connection: Any, channel: str) -> None:
        """A subscriber left: what was relayed to it and not acknowledged is stored instead."""
        for message_id, relay in list(self.relays.get(channel, {}).items()):
            if relay.target is connection:
                self._store_instead(channel, message_id)

    def overdue(self, now: float) -> None:
        for channel, relays in list(self.relays.items()):
            for message_id, relay in list(relays.items()):
                if transport.relay_overdue(relay.sent_at, now):
                    self._store_instead(channel, message_id)

    def ended(self, channel: str) -> None:
        """This node stopped serving the channel: relays go the stored path (which refuses
        them, E_NOT_MASTER: their publishers publish again at the new master), and the last
        value not stored is gone."""
        for message_id in list(self.relays.get(channel, {})):
            self._store_instead(channel, message_id)
        self._volatile_last.pop(channel, None)

    def _store_instead(self, channel: str, message_id: int) -> None:
        relays = self.relays.get(channel, {})
        relay = relays.pop(message_id)
        if not relays:
            self.relays.pop(channel, None)
        self.counts[Mechanism.STAGED.value] += 1
        self._services.submit(c.Enqueue(channel_queue(channel), relay.payload, SUBSCRIPTION_PRIORITY, relay.dedupe_id,
                                        relay.client, PublishReplier(self._hub, relay.replier, channel, relay.payload,
                                                                     Mechanism.STAGED), relay.request_id))
