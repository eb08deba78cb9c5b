"""Queue options, types, strengths and states, validated in one place.

The option names are the public API of docs/PROTOCOL.md, "REST" (`PUT /v1/queues/{q}` JSON). Queue
types follow seed 004 ("Management of message queues", US 2003/0182464):
- one_way: the producer is answered as soon as the node accepted the message, before it is
  durable, and no completion status is kept (seed 004 One_Way: no RQP_ENQUEUE_ACK);
- one_way_ack: answered once durable; the producer can wait for the consumer's ack
  (seed 004 One_Way_Acknowledged and its CheckMsgCompletion);
- queued_ack: answered once durable (the default; docs/ARCHITECTURE.md, Guarantee 1);
- two_way: as queued_ack, and the consumer sends a reply the producer can wait for
  (seed 004 Two_Way, SendReply).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields
from typing import Any

from replication.views import View, ViewError, parse_views, views_json

# What a message may carry is wire/message_input.py's: the queue options are bounded by the
# same limits, and the queue core (its ready set per priority) takes PRIORITY_MAX from here.
from wire.message_input import DELAY_MAX_S, TTL_MAX_S, VISIBILITY_MAX_S
from wire.message_input import PRIORITY_MAX as PRIORITY_MAX

DEAD_LETTER_SUFFIX = ".dlq"
# 196 characters, so that a queue's dead-letter queue name (+ ".dlq") stays within 200.
QUEUE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,195}")


class QueueType(enum.StrEnum):
    ONE_WAY = "one_way"
    ONE_WAY_ACK = "one_way_ack"
    QUEUED_ACK = "queued_ack"
    TWO_WAY = "two_way"


class Strength(enum.StrEnum):
    PRODUCER = "producer"
    FULL = "full"


class QueueState(enum.StrEnum):
    """Seed 004's queue state machine (UNKNOWN ... OPEN ... FAILED)."""
    UNKNOWN = "UNKNOWN"
    CONFIGURING = "CONFIGURING"
    CONFIGURED = "CONFIGURED"
    OPENING = "OPENING"
    OPEN = "OPEN"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"
    FAILED = "FAILED"


# Every allowed state change in one table; anything else is a programmer error.
QUEUE_STATE_TRANSITIONS: dict[QueueState, frozenset[QueueState]] = {
    QueueState.UNKNOWN: frozenset({QueueState.CONFIGURING}),
    QueueState.CONFIGURING: frozenset({QueueState.CONFIGURED, QueueState.FAILED}),
    QueueState.CONFIGURED: frozenset({QueueState.OPENING, QueueState.CLOSING, QueueState.FAILED}),
    QueueState.OPENING: frozenset({QueueState.OPEN, QueueState.FAILED}),
    QueueState.OPEN: frozenset({QueueState.CLOSING, QueueState.FAILED}),
    QueueState.CLOSING: frozenset({QueueState.CLOSED, QueueState.FAILED}),
    QueueState.CLOSED: frozenset(),
    QueueState.FAILED: frozenset({QueueState.OPENING, QueueState.CLOSING}),
}


class OptionError(ValueError):
    """An option value is out of range; the message names the option."""


@dataclass(frozen=True, slots=True)
class QueueOptions:
    strength: Strength = Strength.PRODUCER
    max_depth: int = 1_000_000
    type: QueueType = QueueType.QUEUED_ACK
    visibility_timeout_s: float = 30.0
    max_deliveries: int = 10
    dead_letter: bool = True
    min_in_sync: int = 1
    message_ttl_s: float = 0.0     # each message's time to live unless its enqueue names one; 0: none
    # Fault surveillance of the queue's recipients (named push consumers; seed 001), 0: off.
    fault_interval_s: float = 0.0      # no message taken this long while some wait: the recipient is in fault
    defunct_interval_s: float = 0.0    # in fault this long: its subscriptions end, it is defunct
    message_interval_s: float = 0.0    # a message waiting this long fails over on its own
    # Rate control of the forwards into this queue, its root (seed 003; qserver/features/forwards/root.py):
    # R messages/s shared among them (0: no control, each sends as fast as it can), every T s,
    # by the weights they report (their fill level in `forward_bands` bands), or R/n (static).
    forward_rate: float = 0.0
    forward_interval_s: float = 2.0
    forward_mode: str = "adaptive"
    forward_bands: int = 10
    # Added in 0.3.0 (cluster feature level 3; docs/PROTOCOL.md, "Queue options delay_s and
    # receive_wait_s"): the delivery delay of every message enqueued without one of its own (SQS
    # DelaySeconds), and how long a REST receive that names no `wait_s` waits (SQS
    # ReceiveMessageWaitTimeSeconds).
    delay_s: float = 0.0
    receive_wait_s: float = 0.0
    # Virtual queues (replication/views.py; docs/PROTOCOL.md, "Virtual queues"): named filtered
    # views of the queue, by name; as JSON {name: filter}. Also level 3, stored only when set.
    views: tuple[View, ...] = ()

    def to_json(self, *, every: bool = False) -> dict[str, Any]:
        """The options as stored (map entries, queue records, snapshots, the journal): the
        options of LEVEL3_OPTIONS only when set, so that what a queue without them stores stays
        readable by release 0.2.0, whose nodes refuse option names they do not know. `every`:
        all of them, for an answer to show."""
        out = {name: getattr(self, name) for name in self.__slots__}
        out["strength"] = self.strength.value
        out["type"] = self.type.value
        out["views"] = views_json(self.views)
        if not every:
            for name in LEVEL3_OPTIONS:
                if not out[name]:
                    del out[name]
        return out

    @property
    def tracks_status(self) -> bool:
        """Whether acks leave a completion record (seed 004: the acknowledged queue types
        report completion to the producer). For the others an acked message is simply gone,
        which the status call reports as acked; dead-lettering is always recorded."""
        return self.type in (QueueType.ONE_WAY_ACK, QueueType.TWO_WAY)

    @property
    def visibility_timeout_ms(self) -> int:
        return int(self.visibility_timeout_s * 1000)

    @property
    def message_ttl_ms(self) -> int:
        return int(self.message_ttl_s * 1000)

    @property
    def delay_ms(self) -> int:
        return int(self.delay_s * 1000)


OPTION_NAMES = frozenset(f.name for f in fields(QueueOptions))
# Options release 0.2.0 does not know: set to anything but 0 only at cluster feature level 3
# (wire/versions.py FEATURES "queue_delay_and_wait"), stored only when set (QueueOptions.to_json).
LEVEL3_OPTIONS = frozenset({"delay_s", "receive_wait_s", "views"})
RECEIVE_WAIT_MAX_S = 20.0       # as SQS's ReceiveMessageWaitTimeSeconds, and our receive's wait_s
SURVEILLANCE_OPTIONS = frozenset({"fault_interval_s", "defunct_interval_s", "message_interval_s"})
SURVEILLANCE_INTERVAL_MAX_S = 86_400.0
FORWARD_MODES = ("adaptive", "static")
# Placement options are requests about where the pair lives, not properties of the queue:
# they are validated but never stored or compared (docs/PROTOCOL.md, "REST"; seed 004 MASTER_REQUIRED).
PLACEMENT_OPTION_NAMES = frozenset({"master_required", "master", "replica"})


def _number(raw: dict[str, Any], name: str, low: float, high: float, integral: bool) -> Any:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and not isinstance(value, int)):
        raise OptionError(f"{name} must be {'an integer' if integral else 'a number'}")
    if not low <= value <= high:
        raise OptionError(range_text(name, low, high))
    return value


def range_text(name: str, low: float, high: float) -> str:
    """'ttl_s must be between 0.001 s (1 ms) and 1,209,600 s (14 days)': the bounds as a person
    reads them, durations (names ending in _s) also in their largest whole unit, since
    1.2096e+06 (how Python's :g writes 14 days in seconds) says nothing to anyone."""
    return f"{name} must be between {_bound_text(name, low)} and {_bound_text(name, high)}"


_DURATION_UNITS = ((86_400.0, "day"), (3_600.0, "hour"), (60.0, "minute"), (1.0, "second"), (0.001, "ms"))


def _bound_text(name: str, value: float) -> str:
    number = f"{int(value):,}" if value == int(value) else f"{value:g}"
    if not name.endswith("_s") or value == 0:
        return number
    for unit_s, unit in _DURATION_UNITS:
        count = value / unit_s
        if count >= 1 and abs(count - round(count)) < 1e-9 and (unit != "ms" or value < 1):
            if unit == "second":
                return f"{number} s"
            plural = "" if round(count) == 1 or unit == "ms" else "s"
            return f"{number} s ({round(count):,} {unit}{plural})"
    return f"{number} s"


def parse_options(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a create/open request into (queue options given, placement requests), validated.

    Only the options the caller named are returned, so `open` can compare just those with
    an existing queue's (different options -> E_OPTIONS_MISMATCH)."""
    if not isinstance(raw, dict):
        raise OptionError("options must be a JSON object")
    unknown = set(raw) - OPTION_NAMES - PLACEMENT_OPTION_NAMES
    if unknown:
        raise OptionError(f"unknown options: {', '.join(sorted(unknown))}")
    given = _values(raw)
    fault, defunct = given.get("fault_interval_s", 0.0), given.get("defunct_interval_s", 0.0)
    if defunct and not 0 < fault <= defunct:
        raise OptionError("defunct_interval_s needs a fault_interval_s, and is at least as long")
    message = given.get("message_interval_s", 0.0)
    if fault and message and fault < message:
        # Seed 001: the fault interval is "equal to or greater than a message interval" (a
        # recipient is judged over at least one message's whole deadline).
        raise OptionError("fault_interval_s is at least as long as message_interval_s")
    placement = {k: raw[k] for k in raw.keys() & PLACEMENT_OPTION_NAMES}
    if "master_required" in placement and not isinstance(placement["master_required"], bool):
        raise OptionError("master_required must be true or false")
    for member in ("master", "replica"):
        if member in placement and not isinstance(placement[member], str):
            raise OptionError(f"{member} must be a node id")
    return given, placement


def _values(raw: dict[str, Any]) -> dict[str, Any]:
    """Each queue option `raw` names, validated on its own (OptionError for the first out of range)."""
    given: dict[str, Any] = {}
    for name in raw.keys() & OPTION_NAMES:
        if name == "strength":
            given[name] = _enum(Strength, raw[name], name)
        elif name == "type":
            given[name] = _enum(QueueType, raw[name], name)
        elif name == "dead_letter":
            if not isinstance(raw[name], bool):
                raise OptionError("dead_letter must be true or false")
            given[name] = raw[name]
        elif name == "visibility_timeout_s":
            given[name] = float(_number(raw, name, 0.0, VISIBILITY_MAX_S, False))
        elif name == "message_ttl_s":
            given[name] = float(_number(raw, name, 0.0, TTL_MAX_S, False))
        elif name == "delay_s":
            given[name] = float(_number(raw, name, 0.0, DELAY_MAX_S, False))
        elif name == "receive_wait_s":
            given[name] = float(_number(raw, name, 0.0, RECEIVE_WAIT_MAX_S, False))
        elif name == "views":
            try:
                given[name] = parse_views(raw[name])
            except ViewError as error:
                raise OptionError(str(error)) from None
        elif name in SURVEILLANCE_OPTIONS:
            given[name] = float(_number(raw, name, 0.0, SURVEILLANCE_INTERVAL_MAX_S, False))
        elif name == "forward_rate":
            given[name] = float(_number(raw, name, 0.0, 1_000_000.0, False))
        elif name == "forward_interval_s":
            given[name] = float(_number(raw, name, 0.05, 3_600.0, False))
        elif name == "forward_mode":
            if raw[name] not in FORWARD_MODES:
                raise OptionError(f"forward_mode must be one of {', '.join(FORWARD_MODES)}")
            given[name] = raw[name]
        elif name == "forward_bands":
            given[name] = _number(raw, name, 2, 100, True)
        elif name == "max_depth":
            given[name] = _number(raw, name, 1, 2**40, True)
        elif name == "max_deliveries":
            given[name] = _number(raw, name, 1, 1_000_000, True)
        else:  # min_in_sync
            given[name] = _number(raw, name, 1, 2, True)
    return given


# What `PATCH /v1/queues/{q}` may change (docs/PROTOCOL.md, "Changing a queue's options"): what
# the queue core reads afresh at each enqueue, lease or release, and the features at each look.
# The others are fixed at creation: strength, type and min_in_sync shape the pair's protocol,
# and dead_letter decides whether the queue has a dead-letter queue at all (made with it).
CHANGEABLE_OPTIONS = frozenset({"visibility_timeout_s", "max_deliveries", "message_ttl_s", "max_depth", "delay_s",
                                "receive_wait_s", "views", *SURVEILLANCE_OPTIONS, "forward_rate", "forward_interval_s",
                                "forward_mode", "forward_bands"})


def parse_changes(raw: Any) -> dict[str, Any]:
    """The options a change names, validated one by one (OptionError naming the first that is
    unknown, a placement request or out of range), as JSON values. At least one. An option fixed
    at creation may be named with the value the queue has (a caller that restates every option,
    as the SQS endpoint's SetQueueAttributes of a RedrivePolicy does): changed_options refuses it
    only when it would change."""
    if not isinstance(raw, dict) or not raw:
        raise OptionError("the body is a JSON object of the options to change, at least one")
    placement = sorted(set(raw) & PLACEMENT_OPTION_NAMES)
    if placement:
        raise OptionError(f"{', '.join(placement)} cannot be changed: placement is asked of a create, or of a move")
    unknown = sorted(set(raw) - OPTION_NAMES)
    if unknown:
        raise OptionError(f"unknown options: {', '.join(unknown)}")
    # each value on its own: rules across options are checked with the queue's (changed_options)
    return {name: views_json(value) if name == "views" else getattr(value, "value", value)
            for name, value in _values(raw).items()}


def changed_options(current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A map entry's stored options (`current`) with `changes` applied: the stored form again
    (QueueOptions.to_json, LEVEL3_OPTIONS only when set). OptionError when an option fixed at
    creation would change, or the result breaks a rule that spans options (a defunct interval
    needs a fault interval no longer than it)."""
    merged = options_from_json(current).to_json(every=True)
    fixed = sorted(name for name in set(changes) - CHANGEABLE_OPTIONS
                   if name not in merged or getattr(changes[name], "value", changes[name]) != merged[name])
    if fixed:
        raise OptionError(f"{', '.join(fixed)} cannot be changed: fixed when the queue is created (changeable: "
                          f"{', '.join(sorted(CHANGEABLE_OPTIONS))})")
    merged.update(changes)
    given, _ = parse_options(merged)
    return QueueOptions(**given).to_json()


def _enum(kind: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(member.value for member in kind)  # type: ignore[attr-defined]
        raise OptionError(f"{name} must be one of {allowed}") from None


def options_from_json(raw: dict[str, Any]) -> QueueOptions:
    """Rebuild stored options (already validated when the queue was created)."""
    return QueueOptions(**{**raw, "strength": Strength(raw["strength"]), "type": QueueType(raw["type"]),
                           "views": _stored_views(raw.get("views"))})


def _stored_views(raw: Any) -> tuple[View, ...]:
    """Views as stored (JSON), or already built (a member following its entry's options)."""
    return raw if isinstance(raw, tuple) else parse_views(raw or {})


def mismatched_options(existing: QueueOptions, given: dict[str, Any]) -> list[str]:
    return sorted(name for name, value in given.items() if getattr(existing, name) != value)


def is_valid_queue_name(name: str) -> bool:
    if name.endswith(DEAD_LETTER_SUFFIX):
        return bool(QUEUE_NAME_PATTERN.fullmatch(name[:-len(DEAD_LETTER_SUFFIX)]))
    return bool(QUEUE_NAME_PATTERN.fullmatch(name))


def producer_key(client: str, name: str) -> str:
    """A dedupe id or a stream's key as the queue keeps it: its producer's own. Without the
    client id, one producer could claim another's ids or numbers ahead of it (and have every
    later message of that producer answered as a repeat: stored nowhere). Neither a client id
    nor a dedupe id or stream key (printable characters) holds the separator."""
    return f"{client}\x1f{name}"


def dead_letter_name(queue: str) -> str:
    return queue + DEAD_LETTER_SUFFIX


def base_name(queue: str) -> str:
    """The queue whose map entry `queue` shares: itself, or the queue of a dead-letter queue."""
    return queue[:-len(DEAD_LETTER_SUFFIX)] if queue.endswith(DEAD_LETTER_SUFFIX) else queue
