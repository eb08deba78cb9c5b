"""The decisions of fault surveillance (seed 001), as pure functions of what the watch saw and `now`.

The watch (qserver/features/surveillance/watch.py) reads the clocks, the map and the queues,
calls these, and performs what they decide: proposes map commands, ends subscriptions, moves
messages. Nothing here reads a clock, awaits or touches a queue, so each rule is tested
deterministically (tests/test_surveillance_decide.py), like the queue core.

The rules (the queue's options set the intervals, 0: off):
- a recipient that takes no message for `fault_interval_s` while messages offered to it (pushed
  to one of its subscriptions) wait for its answer enters **fault**: one offered nothing (the
  engine gave the queue's messages to another consumer) is not judged; one subscribed nowhere
  is judged on the messages that waited unleased;
- in fault for `defunct_interval_s`, it is **defunct**;
- one that subscribes again or takes a message (its probe) is **ok** again;
- a message enqueued `message_interval_s` ago and not taken is **overdue**: it fails over on its
  own, also one pushed to a recipient that has not answered for it (its lease is taken back);
- a message waiting for a recipient not ok goes to the first ok alternative of the chain it
  started on (the chain travels with it: a moved message names its first recipient and those
  tried), else back to its sender (its `reply-to` queue, or under `two_way` as its reply), else
  it waits;
- a move whose outcome is unknown is settled at that alternative (same dedupe id) before any
  other is tried: the next one could make a second copy;
- a recipient's reason says whether messages wait for it now, restated once it has been untrue
  for NOTE_SETTLE_S.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
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
def idle_for(now: float, waiting_since: float | None, last_take: float) -> float:
    """How long a recipient has taken no message while messages waited for it: from its last
    take or from when they began to wait, whichever came later (a recipient idle for an hour
    over an empty queue is not in fault the moment one message arrives). `waiting_since`: for
    one subscribed here, since it was first offered a message it has not answered for (None:
    it holds none, it is judged on nothing); for one subscribed nowhere, since messages
    waited unleased in its queue."""
    return 0.0 if waiting_since is None else now - max(waiting_since, last_take)


def watches_idleness(state: str | None, options: Intervals, *, subscribed_here: bool) -> bool:
    """Whether a recipient's idleness can put it in fault: one subscribed here while ok (or not
    registered yet); one subscribed nowhere here while ok, under `full` strength only (under
    `producer` a member serves its own consumers: it may be subscribed at the other)."""
    if not options.fault_interval_s:
        return False
    if subscribed_here:
        return state is None or state == RecipientState.OK
    return state == RecipientState.OK and options.strength is Strength.FULL


def fault_verdict(idle_s: float, waiting: int, options: Intervals, *, subscribed_here: bool) -> Verdict | None:
    """Fault once idle for the fault interval while messages wait for it (of a recipient
    `watches_idleness` holds for). `waiting`: subscribed here, the messages offered to it it has
    not answered for; subscribed nowhere, those that wait in its queue."""
    if idle_s < options.fault_interval_s:
        return None
    if subscribed_here:
        return Verdict(RecipientState.FAULT, f"took no message for {options.fault_interval_s:g} s while "
                                             f"{waiting} offered to it waited")
    return Verdict(RecipientState.FAULT, f"not subscribed for {options.fault_interval_s:g} s while {waiting} waited")


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


def overdue_pushed(enqueued: Mapping[int, int | None], now_ms: int, options: Intervals) -> list[int]:
    """The messages pushed to a recipient (id -> when enqueued) whose delivery deadline passed:
    the message interval is each message's deadline, whether it waits in the queue or was
    pushed to a recipient that has not answered for it. Their leases are taken back and they
    fail over (0: the interval is off)."""
    if not options.message_interval_s:
        return []
    return sorted(index for index, enqueued_ms in enqueued.items() if is_overdue(enqueued_ms, now_ms, options))


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


class Route(NamedTuple):
    """Whose chain a message follows, and who it was tried at already."""
    origin: str                # the recipient it was first for: its chain is the one followed
    tried: tuple[str, ...]     # the recipients it was at, in order, the one holding it now last


def route_of(holder: str, failed_over_from: str | None, tried: str | None) -> Route:
    """The chain travels with the message: one moved before (its `x-failed-over-from` names its
    first recipient, `x-failed-over-tried` those it was at) follows that recipient's chain, not
    the chain of the alternative that holds it now. Headers only the cluster sets
    (wire/message_input.py RESERVED_HEADERS)."""
    if not failed_over_from:
        return Route(holder, (holder,))
    before = tuple(name for name in (tried or failed_over_from).split(",") if name)
    return Route(failed_over_from, before if before and before[-1] == holder else (*before, holder))


def ok_alternatives(entry: RecipientEntry, chain: Sequence[str], queues: Sequence[str],
                    lookup: Callable[[str], RecipientEntry | None],
                    tried: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """The alternatives of a recipient not ok that may take its waiting messages, in the chain's
    order, with their queues: each ok, not tried already, consuming the queue the chain names
    for it, a queue other than the one holding the message (there it is a second consumer of
    the same messages, which the mover cannot tell apart). Lazily: each is judged by the map as
    it is when the mover comes to it (`lookup`: a recipient's entry now), after the previous
    one refused."""
    for alternative, queue in zip(chain, queues, strict=False):
        target = lookup(alternative)
        if target is None or target.state != RecipientState.OK or target.queue != queue or queue == entry.queue \
                or alternative in tried:
            continue
        yield alternative, queue


class MoveAnswer(enum.Enum):
    """What an alternative's refusal of a move means for the message."""
    NEXT = "next"              # it holds no copy: the next alternative may take it
    SETTLE_HERE = "settle"     # it may hold it, or cannot answer now: only this one again (same dedupe id)
    GONE = "gone"              # its queue is gone, and any copy with it: free to go on


def move_answer(code: str, *, outcome_unknown: bool, retriable: bool, unsettled: bool) -> MoveAnswer:
    """How a refused move goes on. Once an answer was unknown (`unsettled`), the move is settled
    at that alternative before any other is tried, whatever its state meanwhile: a refusal of
    the retry does not say the first try stored nothing (issue 37, item 9: the next
    alternative made a second copy). Only the alternative's queue gone frees it."""
    if code == "E_UNKNOWN_QUEUE" and not outcome_unknown:
        return MoveAnswer.GONE if unsettled else MoveAnswer.NEXT
    if unsettled or outcome_unknown or (retriable and code != "E_QUEUE_FULL"):
        return MoveAnswer.SETTLE_HERE
    return MoveAnswer.NEXT


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


def fault_text(tried: Sequence[tuple[str, str | None]]) -> str:
    """The fault a returned message carries (`x-fault`, or the two_way reply's `fault`): the
    recipients of its chain, those it was at first, each with its state ("not registered": one
    that never subscribed, or the map forgot)."""
    named = ", ".join(f"{name} ({state or 'not registered'})" for name, state in tried)
    return f"recipient{'s' if len(tried) > 1 else ''} {named} not ok and no alternative is ok"
