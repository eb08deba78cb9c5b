"""The channel hub's decisions (seed 002), as pure functions of what it holds and `now`.

The hub (qserver/features/channels/hub.py) keeps the subscriptions and the readers of durable
subscriptions, reads the clock and storage, and sends what these functions decide; nothing here
reads a clock or touches a connection, so the rules are tested deterministically
(tests/test_channels_decide.py):
- a channel with a resend interval sends its last value again once that long has passed since
  it was last sent;
- a durable subscription's reader is sent its backlog a window (DURABLE_WINDOW) at a time, the
  acknowledged skipped, nothing past what is committed; what it holds unacknowledged for the
  channel's resend interval (DURABLE_RESEND_S if it sets none) is sent again;
- a new publish goes straight to a reader that caught up with its backlog and has room in its
  window; any other reader reads it from storage later.
"""
from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

DURABLE_WINDOW = 256             # a durable subscription's messages sent and not yet acknowledged
DURABLE_RESEND_S = 5.0           # a durable channel's resend interval when it sets none


def last_value_due(resend_interval_s: float, last_sent_at: float, now: float) -> bool:
    """Whether a channel's last value is to be sent again now (`last_sent_at`: 0 if never sent
    here; the channel's resend interval 0: never)."""
    return bool(resend_interval_s) and now - last_sent_at >= resend_interval_s


def durable_resend_interval(resend_interval_s: float) -> float:
    return resend_interval_s or DURABLE_RESEND_S


def resends_due(sent: Mapping[int, float], now: float, interval_s: float) -> list[int]:
    """The messages a reader holds unacknowledged since `interval_s` or longer, in the order sent."""
    return [index for index, sent_at in sent.items() if now - sent_at >= interval_s]


def window_room(unacknowledged: int) -> int:
    """How many more messages a reader may be sent before it acknowledges some."""
    return DURABLE_WINDOW - unacknowledged


@dataclass(frozen=True, slots=True)
class Fill:
    """What one read of a reader's backlog sends, and where it leaves the reader."""
    send: list[tuple[int, bytes]]
    cursor: int                # every backlog message up to this id was sent (or skipped: acknowledged)
    caught_up: bool            # the read reached the backlog's end: new publishes go straight out


def plan_fill(rows: Iterable[tuple[int, bytes]], *, asked: int, room: int, acked: Collection[int],
              visible_upto: int | None, cursor: int) -> Fill:
    """From the backlog's rows read after the cursor (`asked` of them at most: fewer means its
    end), the messages to send: up to `room`, the acknowledged skipped, none past what is
    committed (`visible_upto`; None: all). The rest is sent as its publishes commit, or once
    the window has room."""
    rows = list(rows)
    caught_up = len(rows) < asked
    send: list[tuple[int, bytes]] = []
    for index, payload in rows:
        if visible_upto is not None and index > visible_upto:
            caught_up = True
            break
        if room <= 0:
            caught_up = False
            break
        cursor = index
        if index in acked:
            continue
        send.append((index, payload))
        room -= 1
    return Fill(send, cursor, caught_up)


class Offer(enum.Enum):
    """What becomes of a new publish for one durable reader."""
    SEND = "send"              # caught up, room in its window: at once
    LATER = "later"            # behind, or its window is full: read from storage once it has room
    SENT = "sent"              # at or below its cursor: it has it already


def passed_over(message_id: int, *, sent: Collection[int], floor: int, acked: Collection[int]) -> bool:
    """A publish at or below a durable reader's cursor that the reader never got: its answer
    came after a later publish's (a retried dedupe id answered late), whose SEND moved the
    cursor past it. Neither sent and unacknowledged, nor acknowledged (at or below the floor,
    or in the acked set)."""
    return message_id > floor and message_id not in sent and message_id not in acked


def offer(message_id: int, *, cursor: int, caught_up: bool, unacknowledged: int) -> Offer:
    if message_id <= cursor:
        return Offer.SENT
    if caught_up and unacknowledged < DURABLE_WINDOW:
        return Offer.SEND
    return Offer.LATER
