"""The WebSocket items of channels that choose their transport (docs/PROTOCOL.md, "How a channel's
messages travel"; client ops 25 and 26, push 110), kept out of wire/protocol.py, which registers
them (its ClientOp and ServerItem, arity table and decoder hooks) and encodes them as any item:
[tag, field, ...] in field order.

A connection is sent ChannelOffer pushes only after it asked for them (ChannelOffersOp): a
client library of release 0.2.0 never asks, and is sent every message inline as a
ChannelMessage, whatever the channel's mechanism.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar


class OfferKind(enum.StrEnum):
    """How a ChannelOffer carries its message."""
    VOLATILE = "volatile"      # best effort: kept in the master's memory only; its id is not an ordering index
    REFERENCE = "reference"    # staged: stored once; no payload here, fetch it (ChannelFetchOp) by its id
    RELAY = "relay"            # point to point: not stored; acknowledge receipt (ChannelAckOp) to answer its publisher


@dataclass(frozen=True, slots=True)
class ChannelFetchOp:
    """The payload of a staged channel message, by the id its reference named: the result is
    the payload (bytes); E_UNKNOWN_MESSAGE once newer values replaced it."""
    TAG: ClassVar[int] = 25
    request_id: int
    channel: str
    message_id: int


@dataclass(frozen=True, slots=True)
class ChannelOffersOp:
    """This connection takes ChannelOffer pushes from now on (the result is nil)."""
    TAG: ClassVar[int] = 26
    request_id: int


@dataclass(frozen=True, slots=True)
class ChannelOffer:
    """A channel message sent by a mechanism other than the stored, replicated one (`kind`:
    OfferKind). `size` is the payload's length (also of a reference, whose payload is empty)."""
    TAG: ClassVar[int] = 110
    channel: str
    message_id: int
    kind: str
    size: int
    payload: bytes
    resent: bool = False


CHANNEL_OP_ARITY = {ChannelFetchOp.TAG: (4, 4), ChannelOffersOp.TAG: (2, 2)}
INT64_MAX = 2**63 - 1


def decode_channel_op(tag: int, request_id: int, args: list[Any], _str: Callable[..., Any],
                      _int: Callable[..., int]) -> ChannelFetchOp | ChannelOffersOp:
    """One of the two ops from its fields (arity checked by the caller), with wire/protocol.py's
    field checks (given, as that module imports this one)."""
    if tag == ChannelOffersOp.TAG:
        return ChannelOffersOp(request_id)
    return ChannelFetchOp(request_id, _str(args[0], "channel", request_id),
                          _int(args[1], "message_id", 1, INT64_MAX, request_id))


def decode_offer(row: list[Any], payload: Callable[[Any], bytes]) -> ChannelOffer:
    kind = str(row[3])
    if kind not in set(OfferKind):
        raise ValueError(f"unknown offer kind {kind[:20]!r}")
    return ChannelOffer(str(row[1]), int(row[2]), kind, int(row[4]), payload(row[5]), bool(row[6]))
