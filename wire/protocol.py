"""Typed frames of the client WebSocket (`GET /v1/ws`) and their one msgpack codec.

A frame is a msgpack array `[PROTOCOL_VERSION, [item, item, ...]]`; one frame carries many
operations (the client coalesces concurrent calls) and the server answers many per frame.
Each item is an array whose first element is a fixed tag; tags are never reused and new
ones are only added at the end. docs/PROTOCOL.md describes the format for other languages.
Decoding validates every field, so a malformed frame raises `FrameError` and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from wire.channel_ops import (
    CHANNEL_OP_ARITY,
    ChannelFetchOp,
    ChannelOffer,
    ChannelOffersOp,
    decode_channel_op,
    decode_offer,
)

# The limits of what a message carries are wire/message_input.py's; a frame outside them is
# refused here (E_BAD_FRAME), before it becomes a command.
from wire.message_input import (
    DELAY_MS_MAX,
    PRIORITY_MAX,
    PRIORITY_MIN,
    RECEIVE_MESSAGES_MAX,
    TTL_MS_MAX,
    VISIBILITY_MS_MAX,
)
from wire.view_ops import VIEW_OP_ARITY, ViewPeekOp, ViewReceiveOp, decode_view_op

PROTOCOL_VERSION = 1
FRAME_ITEMS_MAX = 10_000
# msgpack objects in one client frame, every element of every array and every key and value of
# every map counted (docs/PROTOCOL.md, "WebSocket frames"). Each object takes at least one byte,
# so a frame of this many bytes or fewer is within it without counting; a larger one is counted
# while it is decoded (issue 32, item 10: 16 MiB of tiny objects cost ~1 GB and seconds of the
# event loop). The client library cuts its frames well below it (client/batching.py frames).
FRAME_OBJECTS_MAX = 250_000


class FrameError(ValueError):
    """The bytes are not a well-formed frame; `request_id` is set when it could be read."""

    def __init__(self, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id


# --- client -> server --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EnqueueOp:
    TAG: ClassVar[int] = 1
    request_id: int
    queue: str
    payload: bytes
    priority: int = 4
    dedupe_id: str | None = None
    ttl_ms: int = 0          # the message's time to live; 0: the queue's message_ttl_s
    delay_ms: int = 0        # the message's delivery delay; 0: ready at once
    headers: dict[str, str] | None = None    # a small map delivered with it (limits: replication/options.py)


@dataclass(frozen=True, slots=True)
class ReceiveOp:
    TAG: ClassVar[int] = 2
    request_id: int
    queue: str
    max_messages: int = 1
    wait_ms: int = 0
    visibility_ms: int | None = None


@dataclass(frozen=True, slots=True)
class AckOp:
    TAG: ClassVar[int] = 3
    request_id: int
    queue: str
    message_id: int
    receipt: str


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    TAG: ClassVar[int] = 4
    request_id: int
    queue: str
    message_id: int
    receipt: str


@dataclass(frozen=True, slots=True)
class SubscribeOp:
    """Start pushing messages of `queue`; the server sends at most `credit` before more is given."""
    TAG: ClassVar[int] = 5
    request_id: int
    queue: str
    credit: int
    visibility_ms: int | None = None
    # A recipient's name (fault surveillance, seed 001: the queue's fault, defunct and message
    # intervals apply to it, and its messages fail over to its alternatives); nil: anonymous.
    recipient: str | None = None


@dataclass(frozen=True, slots=True)
class CreditOp:
    TAG: ClassVar[int] = 6
    request_id: int
    subscription_id: int
    credit: int


@dataclass(frozen=True, slots=True)
class UnsubscribeOp:
    TAG: ClassVar[int] = 7
    request_id: int
    subscription_id: int


@dataclass(frozen=True, slots=True)
class PingOp:
    TAG: ClassVar[int] = 8
    request_id: int


@dataclass(frozen=True, slots=True)
class EnqueueBatchOp:
    """Many messages to one queue at one priority: the client coalesces concurrent enqueue()
    calls into these. The result is [epoch, [message_id or [code, message], ...]], one entry
    per payload in order, so one full queue or bad item fails only its own message."""
    TAG: ClassVar[int] = 9
    request_id: int
    queue: str
    priority: int
    payloads: tuple[bytes, ...]
    dedupe_ids: tuple[str | None, ...] | None = None
    ttl_ms: int = 0          # every message's time to live; 0: the queue's message_ttl_s
    delay_ms: int = 0        # every message's delivery delay; 0: ready at once
    headers: dict[str, str] | None = None    # every message's


@dataclass(frozen=True, slots=True)
class AckBatchOp:
    """Many acks on one queue; the result is [None or [code, message], ...] in order."""
    TAG: ClassVar[int] = 10
    request_id: int
    queue: str
    items: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class ExtendOp:
    """Give a leased message's lease `visibility_ms` from now (the receipt stays)."""
    TAG: ClassVar[int] = 11
    request_id: int
    queue: str
    message_id: int
    receipt: str
    visibility_ms: int


# --- channels (seed 002; docs/PROTOCOL.md "Channels") ---
@dataclass(frozen=True, slots=True)
class ChannelSubscribeOp:
    """Subscribe to (or with `subscribe` false, unsubscribe from) several channels at once, all
    or none, idempotently. The result maps each channel to the id of its last value (nil:
    none), and those last values follow as ChannelMessage items."""
    TAG: ClassVar[int] = 12
    request_id: int
    channels: tuple[str, ...]
    subscribe: bool = True
    # A durable subscription's name: the `durable` channels among `channels` are read from the
    # backlog kept under this name (replicated, resent until acknowledged); nil: live only.
    durable: str | None = None


@dataclass(frozen=True, slots=True)
class ChannelAckOp:
    """An `acked` channel's subscriber acknowledges a message it was given."""
    TAG: ClassVar[int] = 13
    request_id: int
    channel: str
    message_id: int


@dataclass(frozen=True, slots=True)
class PublishOp:
    """Publish to a channel this connection advertises; the result is [message_id, epoch]."""
    TAG: ClassVar[int] = 14
    request_id: int
    channel: str
    payload: bytes
    dedupe_id: str | None = None


@dataclass(frozen=True, slots=True)
class AdvertiseOp:
    """Declare (or with `advertise` false, withdraw) that this connection publishes to channels;
    `leader` (0.3.0, sent only when true): it takes the lead among their advertisers."""
    TAG: ClassVar[int] = 15
    request_id: int
    channels: tuple[str, ...]
    advertise: bool = True
    leader: bool = False


@dataclass(frozen=True, slots=True)
class ReportOp:
    """A published message's state: {"state", "subscribers", "delivered", "acked"}."""
    TAG: ClassVar[int] = 16
    request_id: int
    channel: str
    message_id: int


# --- forwards (seed 003 store-and-forward; docs/PROTOCOL.md "Forwards") ---
@dataclass(frozen=True, slots=True)
class ForwardSessionOp:
    """A forwarder's session with the root, the master of the destination `queue` (seed 003
    §3.2): `open` true begins (or begins again) the session of `forward` on this connection,
    false keeps it alive. Both report the forwarder's `weight` (its fill band). The result:
    {"rate": messages/s or nil (no control), "interval_s", "bands", "mode", "keepalive_s",
    "hold_s"} on open, the current rate on a keepalive."""
    TAG: ClassVar[int] = 17
    request_id: int
    queue: str
    forward: str
    weight: int
    open: bool = False


@dataclass(frozen=True, slots=True)
class ForwardDataOp:
    """A forwarder's data message: its weight, then messages numbered in its `stream` (the
    source's ids; `floor`: every number below it is settled at the source). Each item is
    [payload, priority, number, ttl_ms, headers or nil]; the result is one entry per item,
    message id (also for a number stored before) or [code, message]."""
    TAG: ClassVar[int] = 18
    request_id: int
    queue: str
    forward: str
    stream: str
    weight: int
    floor: int
    items: tuple[tuple[bytes, int, int, int, dict[str, str] | None], ...]


# --- browsing without taking (issue 35; docs/PROTOCOL.md "Browsing messages (peek)") ---
@dataclass(frozen=True, slots=True)
class PeekOp:
    """A page of a queue's messages in delivery order after cursor `after` (0: the start), at
    most `limit` (1..1000, checked by the node: E_INVALID_OPTION); `preview`: each payload's
    first KiB only. The result: {"messages": [{"id", "priority", "state", "deliveries",
    "enqueued_at_ms", "headers", "size", "payload", "truncated"}], "next_after", "served_by"}.
    Leases nothing, changes nothing. A node of release 0.2.0 answers E_BAD_FRAME (unknown tag)."""
    TAG: ClassVar[int] = 19
    request_id: int
    queue: str
    after: int = 0
    limit: int = 100
    preview: bool = False


@dataclass(frozen=True, slots=True)
class ReadOp:
    """One message of a queue by id, as PeekOp lists it (in full) with "served_by";
    E_UNKNOWN_MESSAGE when the queue does not hold it."""
    TAG: ClassVar[int] = 20
    request_id: int
    queue: str
    message_id: int


@dataclass(frozen=True, slots=True)
class CompletionWaitOp:
    """Wait (at most `wait_ms`, capped by the node at 60 s) for a message the caller enqueued to
    complete (docs/PROTOCOL.md, "Producers that wait"): the node answers once the message is
    acked, replied, dead-lettered, purged or expired, with {"id", "state", "deliveries",
    "reply"?}, or at the end of the wait with its state then. `kind` "ack" or "reply" (which the
    queue's type must keep: E_WAIT_UNSUPPORTED). A 0.2.0 node answers E_BAD_FRAME (unknown tag)."""
    TAG: ClassVar[int] = 21
    request_id: int
    queue: str
    message_id: int
    wait_ms: int
    kind: str


ClientOp = (EnqueueOp | ReceiveOp | AckOp | ReleaseOp | SubscribeOp | CreditOp | UnsubscribeOp | PingOp | EnqueueBatchOp
            | AckBatchOp | ExtendOp | ChannelSubscribeOp | ChannelAckOp | PublishOp | AdvertiseOp | ReportOp
            | ForwardSessionOp | ForwardDataOp | PeekOp | ReadOp | ViewReceiveOp | ViewPeekOp | CompletionWaitOp
            | ChannelFetchOp | ChannelOffersOp)
CHANNELS_PER_CALL_MAX = 1_000
BATCH_ITEMS_MAX = 10_000


# --- server -> client --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeliveredMessage:
    message_id: int
    receipt: str
    priority: int
    deliveries: int
    payload: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class OkReply:
    """Success of request `request_id`. `result` by op: enqueue -> [message_id, epoch];
    receive -> list of DeliveredMessage; subscribe -> subscription id; others -> None."""
    TAG: ClassVar[int] = 101
    request_id: int
    result: Any


@dataclass(frozen=True, slots=True)
class ErrorReply:
    TAG: ClassVar[int] = 102
    request_id: int
    code: str
    message: str
    outcome_unknown: bool = False


@dataclass(frozen=True, slots=True)
class Delivery:
    """Messages pushed to a subscription; each one uses one unit of the subscription's credit."""
    TAG: ClassVar[int] = 103
    subscription_id: int
    messages: tuple[DeliveredMessage, ...]


@dataclass(frozen=True, slots=True)
class Closing:
    """The server is about to close the socket (client removed, grant revoked, shutdown)."""
    TAG: ClassVar[int] = 104
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class SubscriptionEnded:
    """The server ended a subscription (its queue was deleted); no more deliveries follow."""
    TAG: ClassVar[int] = 105
    subscription_id: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    """A message published to a channel this connection subscribes to (`resent`: the last value
    sent again at the channel's resend interval, or on subscribing)."""
    TAG: ClassVar[int] = 106
    channel: str
    message_id: int
    payload: bytes
    resent: bool = False


@dataclass(frozen=True, slots=True)
class ChannelEnded:
    """The server stopped serving this connection's subscription to a channel (the channel's
    master moved, or the channel was deleted): subscribe again where the map says."""
    TAG: ClassVar[int] = 107
    channel: str
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ForwardRate:
    """The root's rate for a forwarder's session, sent every interval T (seed 003 §3.3):
    messages/s, or nil for no control."""
    TAG: ClassVar[int] = 108
    queue: str
    forward: str
    rate: float | None


ServerItem = (OkReply | ErrorReply | Delivery | Closing | SubscriptionEnded | ChannelMessage | ChannelEnded
              | ForwardRate | ChannelOffer)


# --- encoding --------------------------------------------------------------------------------
def _message_row(m: DeliveredMessage) -> list[Any]:
    row = [m.message_id, m.receipt, m.priority, m.deliveries, m.payload]
    return row if m.headers is None else [*row, m.headers]


def _encode_item(item: ClientOp | ServerItem) -> list[Any]:
    if isinstance(item, OkReply):
        result = item.result
        if isinstance(result, list) and result and isinstance(result[0], DeliveredMessage):
            result = [_message_row(m) for m in result]
        return [item.TAG, item.request_id, result]
    if isinstance(item, Delivery):
        return [item.TAG, item.subscription_id, [_message_row(m) for m in item.messages]]
    if isinstance(item, EnqueueBatchOp):
        return [item.TAG, item.request_id, item.queue, item.priority, list(item.payloads),
                None if item.dedupe_ids is None else list(item.dedupe_ids), item.ttl_ms, item.delay_ms, item.headers]
    if isinstance(item, AckBatchOp):
        return [item.TAG, item.request_id, item.queue, [list(pair) for pair in item.items]]
    if isinstance(item, ForwardDataOp):
        return [item.TAG, item.request_id, item.queue, item.forward, item.stream, item.weight, item.floor,
                [list(row) for row in item.items]]
    if isinstance(item, ChannelSubscribeOp) and item.durable is not None:
        return [item.TAG, item.request_id, list(item.channels), item.subscribe, item.durable]
    if isinstance(item, AdvertiseOp):
        return [item.TAG, item.request_id, list(item.channels), item.advertise, *([True] if item.leader else [])]
    if isinstance(item, ChannelSubscribeOp):
        return [item.TAG, item.request_id, list(item.channels), item.subscribe]
    return [item.TAG, *(getattr(item, name) for name in item.__slots__)]  # type: ignore[union-attr]


def encode_frame(items: list[Any]) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, [_encode_item(i) for i in items]], use_bin_type=True)


class _TooManyObjects(Exception):
    pass


class _ObjectBudget:
    """Counts a frame's objects as msgpack builds its containers, and stops the decoding once
    they pass the budget. msgpack has per-container limits only; these hooks run once per
    array or map, after its elements are built, so what a refused frame costs is bounded by
    the budget (and the containers still open), not by the frame's size."""
    __slots__ = ("left",)

    def __init__(self, budget: int) -> None:
        self.left = budget

    def array(self, items: list[Any]) -> list[Any]:
        self.left -= len(items)
        if self.left < 0:
            raise _TooManyObjects
        return items

    def map(self, pairs: dict[Any, Any]) -> dict[Any, Any]:
        self.left -= 2 * len(pairs)
        if self.left < 0:
            raise _TooManyObjects
        return pairs


def _unpack(data: bytes, objects_max: int | None = None) -> list[Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError("frames are binary")
    hooks: dict[str, Any] = {}
    if objects_max is not None and len(data) > objects_max:
        budget = _ObjectBudget(objects_max)
        hooks = {"list_hook": budget.array, "object_hook": budget.map}
    try:
        frame = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                                max_bin_len=len(data), max_str_len=len(data),
                                max_array_len=FRAME_ITEMS_MAX, max_map_len=64, **hooks)
    except _TooManyObjects:
        raise FrameError(f"a frame holds at most {objects_max} msgpack objects") from None
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise FrameError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(frame, list) or len(frame) != 2 or not isinstance(frame[1], list):
        raise FrameError("a frame is [version, [items...]]")
    if type(frame[0]) is not int or frame[0] != PROTOCOL_VERSION:
        raise FrameError(f"unsupported protocol version {frame[0]!r}")
    return frame[1]


def _int(value: Any, name: str, low: int, high: int, request_id: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise FrameError(f"{name} must be an integer in [{low}, {high}]", request_id)
    return value


def _str(value: Any, name: str, request_id: int, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise FrameError(f"{name} must be a string", request_id)
    return value


INT64_MAX = 2**63 - 1
_OP_ARITY = {1: (5, 9), 2: (3, 6), 3: (5, 5), 4: (5, 5), 5: (4, 6), 6: (4, 4), 7: (3, 3), 8: (2, 2),
             9: (5, 9), 10: (4, 4), 11: (6, 6), 12: (4, 5), 13: (4, 4), 14: (4, 5), 15: (4, 5), 16: (4, 4),
             17: (6, 6), 18: (8, 8), 19: (3, 6), 20: (4, 4), 21: (6, 6)}
_OP_ARITY.update(VIEW_OP_ARITY)       # 23, 24: virtual queues (wire/view_ops.py)
_OP_ARITY.update(CHANNEL_OP_ARITY)    # 25, 26: channel mechanisms (wire/channel_ops.py)
FORWARD_ITEMS_MAX = 1_000
WEIGHT_MAX = 100


def _headers(value: Any, request_id: int) -> dict[str, str] | None:
    """The shape only (a map or nil): the node checks names, values and limits (E_INVALID_OPTION)."""
    if value is not None and not isinstance(value, dict):
        raise FrameError("headers must be a map of names to strings, or nil", request_id)
    return value


def _decode_op(row: Any) -> ClientOp:
    if not isinstance(row, list) or len(row) < 2:
        raise FrameError("an item is [tag, request_id, ...]")
    tag, request_id = row[0], row[1]
    request_id = _int(request_id, "request_id", 1, INT64_MAX, 0)
    arity = _OP_ARITY.get(tag) if type(tag) is int else None
    if arity is None:
        raise FrameError(f"unknown operation tag {tag!r}", request_id)
    if not arity[0] <= len(row) <= arity[1]:
        raise FrameError(f"operation {tag} takes {arity[0]}..{arity[1]} fields", request_id)
    args = row[2:]
    if tag == EnqueueOp.TAG:
        payload = args[1]
        if not isinstance(payload, (bytes, bytearray)):
            raise FrameError("payload must be binary", request_id)
        dedupe = _str(args[3], "dedupe_id", request_id, optional=True) if len(args) > 3 else None
        ttl_ms = _int(args[4], "ttl_ms", 0, TTL_MS_MAX, request_id) if len(args) > 4 else 0
        delay_ms = _int(args[5], "delay_ms", 0, DELAY_MS_MAX, request_id) if len(args) > 5 else 0
        return EnqueueOp(request_id, _str(args[0], "queue", request_id), bytes(payload),
                         _int(args[2], "priority", PRIORITY_MIN, PRIORITY_MAX, request_id), dedupe, ttl_ms, delay_ms,
                         _headers(args[6] if len(args) > 6 else None, request_id))
    if tag == ReceiveOp.TAG:
        padded = args + [None] * (4 - len(args))
        visibility = padded[3]
        return ReceiveOp(request_id, _str(padded[0], "queue", request_id),
                         _int(1 if padded[1] is None else padded[1], "max_messages", 1, RECEIVE_MESSAGES_MAX,
                              request_id),
                         _int(0 if padded[2] is None else padded[2], "wait_ms", 0, 3_600_000, request_id),
                         None if visibility is None else _int(visibility, "visibility_ms", 0, VISIBILITY_MS_MAX,
                                                              request_id))
    if tag in (AckOp.TAG, ReleaseOp.TAG):
        cls = AckOp if tag == AckOp.TAG else ReleaseOp
        return cls(request_id, _str(args[0], "queue", request_id),
                   _int(args[1], "message_id", 1, INT64_MAX, request_id), _str(args[2], "receipt", request_id))
    if tag == ExtendOp.TAG:
        return ExtendOp(request_id, _str(args[0], "queue", request_id),
                        _int(args[1], "message_id", 1, INT64_MAX, request_id), _str(args[2], "receipt", request_id),
                        _int(args[3], "visibility_ms", 0, VISIBILITY_MS_MAX, request_id))
    if tag == SubscribeOp.TAG:
        visibility = args[2] if len(args) > 2 else None
        recipient = _str(args[3], "recipient", request_id, optional=True) if len(args) > 3 else None
        return SubscribeOp(request_id, _str(args[0], "queue", request_id),
                           _int(args[1], "credit", 1, 100_000, request_id),
                           None if visibility is None else _int(visibility, "visibility_ms", 0, VISIBILITY_MS_MAX,
                                                                request_id),
                           recipient)
    if tag == CreditOp.TAG:
        return CreditOp(request_id, _int(args[0], "subscription_id", 1, INT64_MAX, request_id),
                        _int(args[1], "credit", 1, 100_000, request_id))
    if tag == EnqueueBatchOp.TAG:
        return _decode_enqueue_batch(request_id, args)
    if tag == AckBatchOp.TAG:
        return _decode_ack_batch(request_id, args)
    if tag == UnsubscribeOp.TAG:
        return UnsubscribeOp(request_id, _int(args[0], "subscription_id", 1, INT64_MAX, request_id))
    if tag in (ChannelSubscribeOp.TAG, AdvertiseOp.TAG):
        channels, on = args[0], args[1]
        if not isinstance(channels, list) or not 0 < len(channels) <= CHANNELS_PER_CALL_MAX or \
                not all(isinstance(name, str) for name in channels) or type(on) is not bool:
            raise FrameError(f"channels must be a list of 1..{CHANNELS_PER_CALL_MAX} names, then true or false",
                             request_id)
        if tag == ChannelSubscribeOp.TAG:
            durable = _str(args[2], "durable", request_id, optional=True) if len(args) > 2 else None
            return ChannelSubscribeOp(request_id, tuple(channels), on, durable)
        leader = args[2] if len(args) > 2 else False
        if type(leader) is not bool:
            raise FrameError("leader must be true or false", request_id)
        return AdvertiseOp(request_id, tuple(channels), on, leader)
    if tag in (ChannelAckOp.TAG, ReportOp.TAG):
        kind = ChannelAckOp if tag == ChannelAckOp.TAG else ReportOp
        return kind(request_id, _str(args[0], "channel", request_id),
                    _int(args[1], "message_id", 1, INT64_MAX, request_id))
    if tag == ForwardSessionOp.TAG:
        if type(args[3]) is not bool:
            raise FrameError("open must be true or false", request_id)
        return ForwardSessionOp(request_id, _str(args[0], "queue", request_id), _str(args[1], "forward", request_id),
                                _int(args[2], "weight", 0, WEIGHT_MAX, request_id), args[3])
    if tag == ForwardDataOp.TAG:
        return _decode_forward_data(request_id, args)
    if tag in VIEW_OP_ARITY:
        return decode_view_op(tag, request_id, args, _str, _int, FrameError)
    if tag in CHANNEL_OP_ARITY:
        return decode_channel_op(tag, request_id, args, _str, _int)
    if tag == PeekOp.TAG:
        padded = args + [None] * (4 - len(args))
        if padded[3] is not None and type(padded[3]) is not bool:
            raise FrameError("preview must be true or false", request_id)
        return PeekOp(request_id, _str(padded[0], "queue", request_id),
                      _int(0 if padded[1] is None else padded[1], "after", 0, INT64_MAX, request_id),
                      _int(100 if padded[2] is None else padded[2], "limit", 0, INT64_MAX, request_id),
                      bool(padded[3]))
    if tag == ReadOp.TAG:
        return ReadOp(request_id, _str(args[0], "queue", request_id),
                      _int(args[1], "message_id", 1, INT64_MAX, request_id))
    if tag == CompletionWaitOp.TAG:
        return CompletionWaitOp(request_id, _str(args[0], "queue", request_id),
                                _int(args[1], "message_id", 1, INT64_MAX, request_id),
                                _int(args[2], "wait_ms", 0, INT64_MAX, request_id), _str(args[3], "kind", request_id))
    if tag == PublishOp.TAG:
        if not isinstance(args[1], (bytes, bytearray)):
            raise FrameError("payload must be binary", request_id)
        return PublishOp(request_id, _str(args[0], "channel", request_id), bytes(args[1]),
                         _str(args[2], "dedupe_id", request_id, optional=True) if len(args) > 2 else None)
    return PingOp(request_id)


def _decode_enqueue_batch(request_id: int, args: list[Any]) -> EnqueueBatchOp:
    queue = _str(args[0], "queue", request_id)
    priority = _int(args[1], "priority", PRIORITY_MIN, PRIORITY_MAX, request_id)
    payloads, dedupe_ids = args[2], args[3] if len(args) > 3 else None
    ttl_ms = _int(args[4], "ttl_ms", 0, TTL_MS_MAX, request_id) if len(args) > 4 else 0
    delay_ms = _int(args[5], "delay_ms", 0, DELAY_MS_MAX, request_id) if len(args) > 5 else 0
    headers = _headers(args[6] if len(args) > 6 else None, request_id)
    if not isinstance(payloads, list) or not 0 < len(payloads) <= BATCH_ITEMS_MAX:
        raise FrameError(f"payloads must be a list of 1..{BATCH_ITEMS_MAX}", request_id)
    if not all(isinstance(p, (bytes, bytearray)) for p in payloads):
        raise FrameError("payloads must be binary", request_id)
    if dedupe_ids is not None:
        if not isinstance(dedupe_ids, list) or len(dedupe_ids) != len(payloads):
            raise FrameError("dedupe_ids must match payloads one for one", request_id)
        if not all(d is None or isinstance(d, str) for d in dedupe_ids):
            raise FrameError("dedupe ids must be strings or nil", request_id)
        dedupe_ids = tuple(dedupe_ids)
    return EnqueueBatchOp(request_id, queue, priority, tuple(bytes(p) for p in payloads), dedupe_ids, ttl_ms,
                          delay_ms, headers)


def _decode_forward_data(request_id: int, args: list[Any]) -> ForwardDataOp:
    rows = args[5]
    if not isinstance(rows, list) or not 0 < len(rows) <= FORWARD_ITEMS_MAX:
        raise FrameError(f"items must be a list of 1..{FORWARD_ITEMS_MAX}", request_id)
    items = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 5 or not isinstance(row[0], (bytes, bytearray)):
            raise FrameError("a forwarded item is [payload, priority, number, ttl_ms, headers]", request_id)
        items.append((bytes(row[0]), _int(row[1], "priority", PRIORITY_MIN, PRIORITY_MAX, request_id),
                      _int(row[2], "number", 1, INT64_MAX, request_id), _int(row[3], "ttl_ms", 0, TTL_MS_MAX, request_id),
                      _headers(row[4], request_id)))
    return ForwardDataOp(request_id, _str(args[0], "queue", request_id), _str(args[1], "forward", request_id),
                         _str(args[2], "stream", request_id), _int(args[3], "weight", 0, WEIGHT_MAX, request_id),
                         _int(args[4], "floor", 1, INT64_MAX, request_id), tuple(items))


def _decode_ack_batch(request_id: int, args: list[Any]) -> AckBatchOp:
    queue = _str(args[0], "queue", request_id)
    rows = args[1]
    if not isinstance(rows, list) or not 0 < len(rows) <= BATCH_ITEMS_MAX:
        raise FrameError(f"items must be a list of 1..{BATCH_ITEMS_MAX}", request_id)
    items = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 2 or not isinstance(row[1], str):
            raise FrameError("an ack item is [message_id, receipt]", request_id)
        items.append((_int(row[0], "message_id", 1, INT64_MAX, request_id), row[1]))
    return AckBatchOp(request_id, queue, tuple(items))


def decode_client_frame(data: bytes) -> list[ClientOp | FrameError]:
    """Decode a client frame. A broken frame raises FrameError; a broken item inside a good
    frame comes back as a FrameError in its place, so the other items still run."""
    items: list[ClientOp | FrameError] = []
    for row in _unpack(data, FRAME_OBJECTS_MAX):
        try:
            items.append(_decode_op(row))
        except FrameError as exc:
            items.append(exc)
    return items


def _decode_message(row: Any) -> DeliveredMessage:
    if not isinstance(row, list) or len(row) not in (5, 6) or (len(row) == 6 and not isinstance(row[5], dict)):
        raise FrameError("a message is [id, receipt, priority, deliveries, payload, headers?]")
    return DeliveredMessage(int(row[0]), str(row[1]), int(row[2]), int(row[3]), _payload(row[4]),
                            {str(k): str(v) for k, v in row[5].items()} if len(row) == 6 else None)


def _payload(value: Any) -> bytes:
    """A payload is msgpack bin. `bytes()` of anything else is no check: of an int it allocates
    that many zero bytes (a frame naming 10**9 cost a gigabyte) or overflows (the fuzzer found it)."""
    if not isinstance(value, bytes):
        raise FrameError(f"a payload is bytes, not {type(value).__name__}")
    return value


def decode_server_frame(data: bytes) -> list[ServerItem]:
    """Decode a server frame (the client's side). Anything malformed raises FrameError."""
    try:
        return _decode_server_items(_unpack(data))
    except FrameError:
        raise
    except (IndexError, TypeError, ValueError, KeyError) as exc:
        raise FrameError(f"malformed server frame: {type(exc).__name__}") from None


def _decode_server_items(rows: list[Any]) -> list[ServerItem]:
    out: list[ServerItem] = []
    for row in rows:
        if not isinstance(row, list) or not row:
            raise FrameError("an item is [tag, ...]")
        tag = row[0]
        if tag == OkReply.TAG:
            out.append(OkReply(row[1], row[2]))
        elif tag == ErrorReply.TAG:
            out.append(ErrorReply(row[1], str(row[2]), str(row[3]), bool(row[4])))
        elif tag == Delivery.TAG:
            out.append(Delivery(row[1], tuple(_decode_message(m) for m in row[2])))
        elif tag == Closing.TAG:
            out.append(Closing(str(row[1]), str(row[2])))
        elif tag == SubscriptionEnded.TAG:
            out.append(SubscriptionEnded(int(row[1]), str(row[2]), str(row[3])))
        elif tag == ChannelMessage.TAG:
            out.append(ChannelMessage(str(row[1]), int(row[2]), _payload(row[3]), bool(row[4])))
        elif tag == ChannelEnded.TAG:
            out.append(ChannelEnded(str(row[1]), str(row[2]), str(row[3])))
        elif tag == ChannelOffer.TAG:
            out.append(decode_offer(row, _payload))
        elif tag == ForwardRate.TAG:
            out.append(ForwardRate(str(row[1]), str(row[2]), None if row[3] is None else float(row[3])))
        else:
            raise FrameError(f"unknown server item tag {tag!r}")
    return out


def messages_from_result(result: Any) -> list[DeliveredMessage]:
    """The DeliveredMessage list of a receive's OkReply result; FrameError if malformed."""
    try:
        return [_decode_message(row) for row in result or []]
    except FrameError:
        raise
    except (IndexError, TypeError, ValueError) as exc:
        raise FrameError(f"malformed messages: {type(exc).__name__}") from None
