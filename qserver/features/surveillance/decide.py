"""The decisions of fault surveillance (seed 001), as pure functions of what the watch saw and `now`.

The watch (qserver/features/surveillance/watch.py) reads the clocks, the map and the queues,
calls these, and performs what they decide: proposes map commands, ends subscriptions, moves
messages. Nothing here reads a clock, awaits or touches a queue, so each rule is tested
deterministically (tests/test_surveillance_decide.py), like the queue core.

The rules (the queue's options set the intervals, 0: off):
- a recipient that takes no message for `fault_interval_s` while messages wait enters **fault**;
- in fault for `defunct_interval_s`, it is **defunct**;
- one that subscribes again or takes a message (its probe) is **ok** again;
- a message waiting for `message_interval_s` is **overdue**: it fails over on its own;
- a message waiting for a recipient not ok goes to the first ok alternative of its chain, else
  back to its sender (its `reply-to` queue, or under `two_way` as its reply), else it waits;
- a recipient's reason says whether messages wait for it now, restated once it has been untrue
  for NOTE_SETTLE_S.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from replication.cluster_map import RecipientEntry, RecipientState
from replication.options import QueueType, Strength

NOTE_SETTLE_S = 1.0               # what waits must stay so this long before a reason is restated
NOTHING_WAITS = "nothing waits for it now"
WAIT_AGAIN = "messages wait for it again"


@dataclass(frozen=True, slots=True)
class Clock:
    """The watch's two clocks: `monotonic` (seconds) for intervals it measures itself, `wall_ms`
    for times the map and the storage keep (a state's `since_ms`, a message's enqueue time)."""
    monotonic: Callable[[], float]
    wall_ms: Callable[[], int]


class Intervals(Protocol):
    """The options of a queue surveillance reads (replication/options.py QueueOptions)."""
    @property
    def fault_interval_s(self) -> float: ...
    @property
    def defunct_interval_s(self) -> float: ...
    @property
    def message_interval_s(self) -> float: ...
    @property
    def strength(self) -> Strength: ...


class Verdict(NamedTuple):
    """A state to propose for a recipient, and why (the map's `reason`)."""
    state: str
    reason: str


# --- ok again -----------------------------------------------------------------------------------
def on_subscribe(state: str | None) -> Verdict | None:
    """A subscription makes a recipient ok (and registers a name the map does not hold)."""
    return None if state == RecipientState.OK else Verdict(RecipientState.OK, "subscribed")


def on_take(state: str | None) -> Verdict | None:
    """A message taken (acknowledged or released: its probe, in fault) makes a known recipient ok."""
    return None if state is None or state == RecipientState.OK else Verdict(RecipientState.OK, "took a message")


# --- fault and defunct --------------------------------------------------------------------------
def idle_for(now: float, waiting_since: float, last_take: float) -> float:
    """How long a recipient has taken no message while its queue held some: from its last take
    or from when the queue was last seen empty, whichever came later (a recipient idle for an
    hour over an empty queue is not in fault the moment one message arrives)."""
    return now - max(waiting_since, last_take)


def watches_idleness(state: str | None, options: Intervals, *, subscribed_here: bool) -> bool:
    """Whether a recipient's idleness can put it in fault: one subscribed here while ok (or not
    registered yet); one subscribed nowhere here while ok, under `full` strength only (under
    `producer` a member serves its own consumers: it may be subscribed at the other)."""
    if not options.fault_interval_s:
        return False
    if subscribed_here:
        return state is None or state == RecipientState.OK
    return state == RecipientState.OK and options.strength is Strength.FULL


def fault_verdict(idle_s: float, depth: int, options: Intervals, *, subscribed_here: bool) -> Verdict | None:
    """Fault once idle for the fault interval while messages wait (of a recipient
    `watches_idleness` holds for)."""
    if idle_s < options.fault_interval_s:
        return None
    doing = "took no message" if subscribed_here else "not subscribed"
    return Verdict(RecipientState.FAULT, f"{doing} for {options.fault_interval_s:g} s while {depth} waited")


def defunct_verdict(state: str, since_ms: int, now_ms: int, options: Intervals) -> Verdict | None:
    """Defunct once in fault for the defunct interval (the map's `since_ms`: when the spell began)."""
    if state == RecipientState.FAULT and options.defunct_interval_s \
            and now_ms - since_ms >= options.defunct_interval_s * 1000:
        return Verdict(RecipientState.DEFUNCT, f"in fault for {options.defunct_interval_s:g} s")
    return None


# --- what waits -----------------------------------------------------------------------------------
def is_overdue(enqueued_ms: int | None, now_ms: int, options: Intervals) -> bool:
    """A stored message waiting for the message interval fails over on its own, whatever the
    state. Whether the interval is on is the watch's to check, when it starts an overdue mover:
    that mover finishes the message it leased even if the interval was turned off meanwhile."""
    return enqueued_ms is not None and now_ms - enqueued_ms >= options.message_interval_s * 1000


def restated_reason(reason: str, waiting: bool) -> str | None:
    """None while a recipient's reason says what holds (messages wait for it, or "nothing waits
    for it now"), else the reason to restate: its cause ("took no message for 5 s") and what
    holds now."""
    if waiting != reason.endswith(NOTHING_WAITS):
        return None
    cause = reason.split(";", 1)[0].split(" while ", 1)[0]
    return f"{cause}; {WAIT_AGAIN if waiting else NOTHING_WAITS}"


def settled(untrue_since: float, now: float) -> bool:
    """A reason untrue this long is worth restating: a queue whose messages fail over as they
    come empties and fills with each one, and a reason is not worth a Raft write per message."""
    return now - untrue_since >= NOTE_SETTLE_S


def announces(seen: str | None, state: str, *, master_here: bool) -> bool:
    """A state change is announced by the master of the recipient's queue, once (every node
    follows the states); a node that starts announces the recipients it finds not ok."""
    return seen != state and master_here and (seen is not None or state != RecipientState.OK)


# --- fail-over ----------------------------------------------------------------------------------
def mover_runs(state: str | None, *, overdue_only: bool) -> bool:
    """The overdue mover runs while its recipient is ok, the other while it is not (and neither
    once the map forgot it)."""
    return state is not None and overdue_only == (state == RecipientState.OK)


def ok_alternatives(entry: RecipientEntry, chain: Sequence[str], queues: Sequence[str],
                    lookup: Callable[[str], RecipientEntry | None]) -> Iterator[tuple[str, str]]:
    """The alternatives of a recipient not ok that may take its waiting messages, in the chain's
    order, with their queues: each ok, consuming the queue the chain names for it, a queue
    other than the recipient's own (there it is a second consumer of the same messages, which
    the mover cannot tell apart). Lazily: each is judged by the map as it is when the mover
    comes to it (`lookup`: a recipient's entry now), after the previous one refused."""
    for alternative, queue in zip(chain, queues, strict=False):
        target = lookup(alternative)
        if target is None or target.state != RecipientState.OK or target.queue != queue or queue == entry.queue:
            continue
        yield alternative, queue


class ReturnRoute(enum.Enum):
    """Where a message no alternative took goes back to its sender, if anywhere."""
    REPLY_TO = "reply-to"     # enqueued into the queue its `reply-to` header names
    REPLY = "reply"           # a `two_way` queue's message: answered as its reply
    WAIT = "wait"             # neither: it waits


def return_route(reply_to: str | None, queue_type: QueueType) -> ReturnRoute:
    if reply_to:
        return ReturnRoute.REPLY_TO
    if queue_type is QueueType.TWO_WAY:
        return ReturnRoute.REPLY
    return ReturnRoute.WAIT


def fault_text(entry: RecipientEntry) -> str:
    """The fault a returned message carries (`x-fault`, or the two_way reply's `fault`)."""
    return f"recipient {entry.name} is {entry.state} and no alternative is ok"
