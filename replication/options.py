"""Queue options, types, strengths and states, validated in one place.

The option names are the public API of DESIGN.md 4.4 (`PUT /v1/queues/{q}` JSON). Queue
types follow seed 004 ("Management of message queues", US 2003/0182464):
- one_way: the producer is answered as soon as the node accepted the message, before it is
  durable, and no completion status is kept (seed 004 One_Way: no RQP_ENQUEUE_ACK);
- one_way_ack: answered once durable; the producer can wait for the consumer's ack
  (seed 004 One_Way_Acknowledged and its CheckMsgCompletion);
- queued_ack: answered once durable (the default; DESIGN.md 3.1);
- two_way: as queued_ack, and the consumer sends a reply the producer can wait for
  (seed 004 Two_Way, SendReply).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields
from typing import Any

DEAD_LETTER_SUFFIX = ".dlq"
# 196 characters, so that a queue's dead-letter queue name (+ ".dlq") stays within 200.
QUEUE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,195}")
PRIORITY_MAX = 9
PRIORITY_DEFAULT = 4
TTL_MAX_S = 1_209_600.0     # a message's time to live: at most 14 days (SQS's longest retention)
DELAY_MAX_S = 900.0         # a message's delivery delay: at most 15 minutes (as SQS)
HEADERS_MAX = 16             # a message's headers: at most this many names,
HEADER_NAME_CHARS_MAX = 64   # each name 1-64 printable characters,
HEADERS_CHARS_MAX = 4_096    # and all names and values together at most this many characters,
# besides a numbered stream's (replication/queue_core.py SEQUENCE_*_HEADER), each value at most 256.
STREAM_HEADERS = frozenset({"x-sequence-key", "x-sequence", "x-sequence-floor"})
STREAM_HEADER_CHARS_MAX = 256


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

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["strength"] = self.strength.value
        out["type"] = self.type.value
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


OPTION_NAMES = frozenset(f.name for f in fields(QueueOptions))
SURVEILLANCE_OPTIONS = frozenset({"fault_interval_s", "defunct_interval_s", "message_interval_s"})
SURVEILLANCE_INTERVAL_MAX_S = 86_400.0
FORWARD_MODES = ("adaptive", "static")
# Placement options are requests about where the pair lives, not properties of the queue:
# they are validated but never stored or compared (DESIGN.md 4.4, seed 004 MASTER_REQUIRED).
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
    an existing queue's (DESIGN.md: different options -> E_OPTIONS_MISMATCH)."""
    if not isinstance(raw, dict):
        raise OptionError("options must be a JSON object")
    unknown = set(raw) - OPTION_NAMES - PLACEMENT_OPTION_NAMES
    if unknown:
        raise OptionError(f"unknown options: {', '.join(sorted(unknown))}")
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
            given[name] = float(_number(raw, name, 0.0, 43_200.0, False))
        elif name == "message_ttl_s":
            given[name] = float(_number(raw, name, 0.0, TTL_MAX_S, False))
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
    fault, defunct = given.get("fault_interval_s", 0.0), given.get("defunct_interval_s", 0.0)
    if defunct and not 0 < fault <= defunct:
        raise OptionError("defunct_interval_s needs a fault_interval_s, and is at least as long")
    placement = {k: raw[k] for k in raw.keys() & PLACEMENT_OPTION_NAMES}
    if "master_required" in placement and not isinstance(placement["master_required"], bool):
        raise OptionError("master_required must be true or false")
    for member in ("master", "replica"):
        if member in placement and not isinstance(placement[member], str):
            raise OptionError(f"{member} must be a node id")
    return given, placement


def _enum(kind: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(member.value for member in kind)  # type: ignore[attr-defined]
        raise OptionError(f"{name} must be one of {allowed}") from None


def options_from_json(raw: dict[str, Any]) -> QueueOptions:
    """Rebuild stored options (already validated when the queue was created)."""
    return QueueOptions(**{**raw, "strength": Strength(raw["strength"]), "type": QueueType(raw["type"])})


def mismatched_options(existing: QueueOptions, given: dict[str, Any]) -> list[str]:
    return sorted(name for name, value in given.items() if getattr(existing, name) != value)


def checked_headers(headers: Any) -> dict[str, str] | None:
    """A message's headers as given (a small map of printable names to strings, within the
    limits above; empty: None), or OptionError naming what is wrong."""
    if headers is None or headers == {}:
        return None
    # The stream headers a forward sets (docs/PROTOCOL.md "Forwards") count apart, so that a
    # message accepted at its source, at the limits, can be forwarded (issue 32, Low).
    if not isinstance(headers, dict) or len(headers) > HEADERS_MAX + len(STREAM_HEADERS) \
            or sum(1 for name in headers if name not in STREAM_HEADERS) > HEADERS_MAX:
        raise OptionError(f"headers are a map of at most {HEADERS_MAX} names to strings")
    total = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not 0 < len(name) <= HEADER_NAME_CHARS_MAX or not name.isprintable():
            raise OptionError(f"a header name is 1-{HEADER_NAME_CHARS_MAX} printable characters")
        if not isinstance(value, str) or not value.isprintable():
            raise OptionError(f"header {name!r} must be a string of printable characters")
        if name not in STREAM_HEADERS:
            total += len(name) + len(value)
        elif len(value) > STREAM_HEADER_CHARS_MAX:
            raise OptionError(f"header {name!r} holds at most {STREAM_HEADER_CHARS_MAX} characters")
    if total > HEADERS_CHARS_MAX:
        raise OptionError(f"headers hold at most {HEADERS_CHARS_MAX} characters")
    return dict(headers)


def is_valid_queue_name(name: str) -> bool:
    if name.endswith(DEAD_LETTER_SUFFIX):
        return bool(QUEUE_NAME_PATTERN.fullmatch(name[:-len(DEAD_LETTER_SUFFIX)]))
    return bool(QUEUE_NAME_PATTERN.fullmatch(name))


def valid_dedupe_id(dedupe_id: str) -> bool:
    """1-128 printable characters. Lone surrogates, which is how aiohttp hands over header
    bytes that are not UTF-8 and which storage could not encode, are not printable."""
    return 0 < len(dedupe_id) <= 128 and dedupe_id.isprintable()


# Headers the cluster itself sets on a message it moves (fault surveillance: docs/PROTOCOL.md
# "Fault surveillance"); an ordinary enqueue naming one is refused (E_RESERVED_HEADER): a client
# could otherwise pass a message off as failed over, or as another producer's.
FAILED_OVER_FROM = "x-failed-over-from"
RETURNED_FROM = "x-returned-from"
FAULT = "x-fault"
ORIGIN_PRODUCER = "x-origin-producer"      # the client that enqueued a message the cluster moved
RESERVED_HEADERS = frozenset({FAILED_OVER_FROM, RETURNED_FROM, FAULT, ORIGIN_PRODUCER})
REPLY_TO = "reply-to"                      # the queue a message returns to (its producer must be allowed to post there)


def producer_key(client: str, name: str) -> str:
    """A dedupe id or a stream's key as the queue keeps it: its producer's own. Without the
    client id, one producer could claim another's ids or numbers ahead of it (and have every
    later message of that producer answered as a repeat: stored nowhere). Neither a client id
    nor a dedupe id or stream key (printable characters) holds the separator."""
    return f"{client}\x1f{name}"


def dead_letter_name(queue: str) -> str:
    return queue + DEAD_LETTER_SUFFIX
