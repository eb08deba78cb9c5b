"""How much goes into one batch op and one frame: the client library's sizing of the wire.

`batch_bounds` cuts a batch of enqueues that passes BATCH_ITEMS_MAX items or the client's
frame_bytes_max into several batch ops, and `frames` packs one turn's ops into frames that
pass neither FRAME_ITEMS_MAX, frame_bytes_max nor half of FRAME_OBJECTS_MAX (docs/PROTOCOL.md,
"WebSocket frames"). Kept apart from the connection (client/connection.py, which collects a
turn's calls into batches and decides when to send) because it is pure sizing, no socket and
no futures: the connection decides when, this module how much.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from wire.protocol import (
    BATCH_ITEMS_MAX,
    FRAME_ITEMS_MAX,
    FRAME_OBJECTS_MAX,
    AckBatchOp,
    ClientOp,
    EnqueueBatchOp,
    ForwardDataOp,
    PublishOp,
    encode_frame,
)

# A frame's msgpack objects, counted generously per op: the node refuses a frame of more than
# FRAME_OBJECTS_MAX (docs/PROTOCOL.md, "WebSocket frames"), so frames are cut at half of it.
FRAME_OBJECTS_CUT = FRAME_OBJECTS_MAX // 2


def batch_bounds(payloads: Sequence[bytes], frame_bytes_max: int) -> list[tuple[int, int]]:
    """Split a batch so no part passes BATCH_ITEMS_MAX items or frame_bytes_max bytes."""
    bounds, start, size_bytes = [], 0, 0
    for index, payload in enumerate(payloads):
        if index > start and (index - start >= BATCH_ITEMS_MAX or size_bytes + len(payload) > frame_bytes_max):
            bounds.append((start, index))
            start, size_bytes = index, 0
        size_bytes += len(payload)
    bounds.append((start, len(payloads)))
    return bounds


def _op_bytes(op: ClientOp) -> int:
    if isinstance(op, EnqueueBatchOp):
        return sum(map(len, op.payloads))
    if isinstance(op, PublishOp):
        return len(op.payload)
    if isinstance(op, ForwardDataOp):
        return sum(len(item[0]) for item in op.items)
    return 0


def _op_objects(op: ClientOp) -> int:
    if isinstance(op, EnqueueBatchOp):
        return 16 + 2 * len(op.payloads) + 2 * len(op.headers or ())
    if isinstance(op, AckBatchOp):
        return 8 + 3 * len(op.items)
    if isinstance(op, ForwardDataOp):
        return 16 + 40 * len(op.items)
    channels = getattr(op, "channels", None)       # channel subscribe and advertise: up to 1,000 names
    if channels is not None:
        return 8 + len(channels)
    return 48      # any other op: at most 9 fields, and a headers map of at most 16 names


def frames(ops: list[ClientOp], frame_bytes_max: int, fail: Callable[[int, BaseException], None]) -> list[bytes]:
    """Encode ops into frames within the item and byte limits; an op that cannot be
    encoded fails alone (`fail(request_id, error)`) instead of taking the writer down."""
    if len(ops) == 1 or (len(ops) <= FRAME_ITEMS_MAX
                         and sum(map(_op_bytes, ops)) <= frame_bytes_max
                         and sum(map(_op_objects, ops)) <= FRAME_OBJECTS_CUT):
        try:
            return [encode_frame(ops)]
        except (TypeError, ValueError, OverflowError):
            pass  # find and fail the culprit below
    encoded: list[bytes] = []
    chunk: list[ClientOp] = []
    chunk_bytes = chunk_objects = 0
    for op in ops:
        try:
            encode_frame([op])
        except (TypeError, ValueError, OverflowError) as exc:
            fail(op.request_id, TypeError(f"cannot encode {type(op).__name__}: {exc}"))
            continue
        op_bytes, op_objects = _op_bytes(op), _op_objects(op)
        if chunk and (chunk_bytes + op_bytes > frame_bytes_max or len(chunk) >= FRAME_ITEMS_MAX
                      or chunk_objects + op_objects > FRAME_OBJECTS_CUT):
            encoded.append(encode_frame(chunk))
            chunk, chunk_bytes, chunk_objects = [], 0, 0
        chunk.append(op)
        chunk_bytes += op_bytes
        chunk_objects += op_objects
    if chunk:
        encoded.append(encode_frame(chunk))
    return encoded
