"""The WebSocket operations of virtual queues (docs/PROTOCOL.md, "Virtual queues"; client ops
23 and 24), kept out of wire/protocol.py, which registers them (its ClientOp, arity table and
decoder hook) and encodes them as any op: [tag, request_id, field, ...] in field order.

A node of release 0.2.0 answers either with E_BAD_FRAME ("unknown operation tag"), which the
client library turns into E_FEATURE_DISABLED naming the node.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from wire.message_input import RECEIVE_MESSAGES_MAX, VISIBILITY_MS_MAX


@dataclass(frozen=True, slots=True)
class ViewReceiveOp:
    """Lease up to `max_messages` of view `view` of `queue` now (no wait), in the queue's order;
    answered as ReceiveOp is: the delivered messages, [] when none is ready in the view."""
    TAG: ClassVar[int] = 23
    request_id: int
    queue: str
    view: str
    max_messages: int = 1
    visibility_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ViewPeekOp:
    """A page of view `view` of `queue`, as PeekOp answers for the queue (and "view")."""
    TAG: ClassVar[int] = 24
    request_id: int
    queue: str
    view: str
    after: int = 0
    limit: int = 100
    preview: bool = False


INT64_MAX = 2**63 - 1
VIEW_OP_ARITY = {ViewReceiveOp.TAG: (4, 6), ViewPeekOp.TAG: (4, 7)}


def decode_view_op(tag: int, request_id: int, args: list[Any], _str: Callable[..., Any], _int: Callable[..., int],
                   frame_error: Callable[[str, int], Exception]) -> ViewReceiveOp | ViewPeekOp:
    """One of the two ops from its fields (arity checked by the caller), with wire/protocol.py's
    field checks (given, as that module imports this one), which raise its FrameError."""
    queue, view = _str(args[0], "queue", request_id), _str(args[1], "view", request_id)
    rest = args[2:] + [None] * (3 - len(args[2:]))
    if tag == ViewReceiveOp.TAG:
        visibility = rest[1]
        return ViewReceiveOp(request_id, queue, view,
                             _int(1 if rest[0] is None else rest[0], "max_messages", 1, RECEIVE_MESSAGES_MAX,
                                  request_id),
                             None if visibility is None else _int(visibility, "visibility_ms", 0, VISIBILITY_MS_MAX,
                                                                  request_id))
    if rest[2] is not None and type(rest[2]) is not bool:
        raise frame_error("preview must be true or false", request_id)
    return ViewPeekOp(request_id, queue, view, _int(0 if rest[0] is None else rest[0], "after", 0, INT64_MAX, request_id),
                      _int(100 if rest[1] is None else rest[1], "limit", 0, INT64_MAX, request_id), bool(rest[2]))
