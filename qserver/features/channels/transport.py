"""How a channel's message travels (seed 002's title claim: the transport is chosen from the
size of the data, its frequency and its loss tolerance), as pure functions: the channel's
master (qserver/features/channels/mechanisms.py) asks `choose` at every publish.

- `replicated` (a channel nobody characterized, and every `durable` one): the message is an
  enqueue into the channel's queue, fsync'd on both members before it is answered, then sent
  to every subscriber; the last value survives any failover.
- `best_effort` (the seed's small, frequent data that tolerates loss: class `latest`, size at
  most BEST_EFFORT_SIZE_MAX, at least BEST_EFFORT_RATE_MIN a second, loss tolerant): sent to
  every subscriber at once and answered, neither replicated nor written to disk; the last
  value lives in the master's memory and is lost with it (a failover sends the last stored one).
- `staged` (the seed's voluminous data: STAGE_FROM bytes and more): stored once, as
  `replicated`, but subscribers are sent a reference and fetch the payload by its id, so the
  master's buffers hold no copy per subscriber and a `latest` reader that fell behind fetches
  only the newest value.
- `point_to_point` (voluminous data for one subscriber: the seed's "reliable point to point
  data mover"): relayed straight to that subscriber, not stored; its publisher is answered once
  the subscriber acknowledged receipt. A relay not acknowledged within RELAY_ACK_S (the
  subscriber left or hung), or when the master stops serving the channel, falls back to the
  stored path, so what was answered was either received or stored.

Only connections that asked for offers (wire/channel_ops.py ChannelOffersOp) are sent
references, relays and volatile messages; a subscriber of release 0.2.0 is sent every message
inline, and while one is subscribed the channel takes the stored path (its library orders
messages by ordering index: an id not stored would hide every stored one after it).
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

BEST_EFFORT_SIZE_MAX = 16 * 1024     # bytes: "small" (the seed's messages are 1,000-1,400 bytes)
BEST_EFFORT_RATE_MIN = 1.0           # publishes a second: "frequent" (a newer value comes within a second)
STAGE_FROM = 64 * 1024               # bytes: "voluminous"
RELAY_ACK_S = 5.0                    # a point-to-point relay not acknowledged by then is stored instead
RELAYS_PER_CHANNEL_MAX = 256         # relays awaiting receipt; beyond, a publish takes the stored path
RELAY_BYTES_PER_CHANNEL_MAX = 32 * 1024 * 1024   # and their payloads, held in the master's memory


class Mechanism(enum.StrEnum):
    REPLICATED = "replicated"
    BEST_EFFORT = "best_effort"
    STAGED = "staged"
    POINT_TO_POINT = "point_to_point"


def choose(delivery_class: str, attributes: Mapping[str, Any], subscribers: int, offer_takers: int) -> Mechanism:
    """The mechanism of the next publish on a channel of this class and these attributes
    (replication/map_channels.py ATTRIBUTES), with `subscribers` live subscriptions at its
    master, `offer_takers` of them on connections that take offers."""
    if delivery_class == "durable" or not attributes:
        return Mechanism.REPLICATED
    size = attributes.get("size_bytes", 0)
    if (delivery_class == "latest" and attributes.get("loss_tolerant") and 0 < size <= BEST_EFFORT_SIZE_MAX
            and attributes.get("per_second", 0.0) >= BEST_EFFORT_RATE_MIN and offer_takers == subscribers):
        return Mechanism.BEST_EFFORT
    if size >= STAGE_FROM:
        if subscribers == 1 and offer_takers == 1:
            return Mechanism.POINT_TO_POINT
        return Mechanism.STAGED
    return Mechanism.REPLICATED


def volatile_id(previous: int, now_us: int) -> int:
    """The id of a message that is not stored (best effort, relayed): the master's wall clock in
    microseconds, above the previous one, so ids keep growing across a failover to a node whose
    clock agrees. They are not ordering indices: a client orders them apart from stored ids."""
    return max(previous + 1, now_us)


def relay_overdue(sent_at: float, now: float) -> bool:
    return now - sent_at >= RELAY_ACK_S
