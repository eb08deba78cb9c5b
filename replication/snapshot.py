"""State transfer by snapshot (seed 004 FIG. 22; docs/ARCHITECTURE.md, "Queue pairs": state transfer).

A member that is new, wiped, diverged or behind the start of the master's op log cannot
catch up from the log: it gets the queue's *state* at one ordering index instead, the
queued messages in order and not the history. The master cuts it from one read view of its
storage (`SnapshotView`), at an order no higher than the pair's commit point, and streams it
as rows in bounded chunks; the last chunk carries the digest at that order and a content
hash of every row sent, which the replica checks before anything of it counts.

Rows (msgpack lists, in this order within a view):
    [ROW_MESSAGE, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease, ttl_ms, delay_ms,
     headers]
    [ROW_DEDUPE, dedupe_id, index, enqueued_ms]            the dedupe window's entries
    [ROW_DEAD_LETTER, index, priority, enqueued_ms, None, client, payload, deliveries, lease, 0, 0, headers]
`lease` is [receipt, visibility_ms, leased_ms] or None (a duration: the taker times it from
when it takes the queue over, see operations.Leased); `ttl_ms` the message's time to live
(0: none), timed likewise from the install, and `delay_ms` a delay it still waits for (0: it
is ready or leased), timed again in full from the install; `headers` the message's
({name: value}) or None. Under `full` the snapshot is the whole
state: deliveries, leases in flight and the dead-letter queue's messages (its stream follows
on from the dead-letter order the last chunk names). Under `producer` it carries the live
messages and the dedupe window only (never the master's consumption state), and only those
above `after_index` for a returning member that keeps its own.

Pure: `MemorySnapshotView` is the in-memory twin of the LMDB view in qserver/storage/lmdb_store.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import xxhash

from replication.messages import MessageError

ROW_MESSAGE = 0
ROW_DEDUPE = 1
ROW_DEAD_LETTER = 2
STATE_HASH_BYTES = 16
EMPTY_STATE_HASH = bytes(STATE_HASH_BYTES)
_MESSAGE_ROW_FIELDS = 12
_DEDUPE_ROW_FIELDS = 4


class SnapshotViewLost(Exception):
    """`next_rows` can read no more of the view's state: the node's storage ended its read
    transaction (an LMDB map growth does, qserver/storage/lmdb_store.py grow_map). The rest of that state
    is gone; the transfer starts over from a new view (MasterRole._pump_snapshot)."""


class SnapshotView(Protocol):
    order: int                      # the snapshot's ordering index (its state includes every op up to it)
    digest: bytes                   # the rolling digest at `order`
    record: dict[str, Any]          # the master's queue record at `order`
    dead_letter: list[Any] | None   # `full`: [order, digest, record] of the dead-letter queue, same view

    def next_rows(self, bytes_max: int) -> list[list[Any]]:
        """The next rows, about `bytes_max` of payload at most (at least one row); [] at the end.
        Raises SnapshotViewLost when the view's state can no longer be read."""
        ...

    def close(self) -> None:
        ...


class SnapshotSource(Protocol):
    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> SnapshotView | None:
        """A view of the queue's committed state (None if the queue has no record here).
        `consumption`: deliveries, leases and the dead-letter queue `dead_letter` (name, id)
        are part of it (`full`)."""
        ...


def encode_rows(rows: list[list[Any]]) -> bytes:
    """A chunk's rows as they travel (SnapshotChunk.rows) and as the content hash folds them:
    packed once by the master, hashed as they are on both sides, unpacked once by the replica."""
    return msgpack.packb(rows, use_bin_type=True)


def fold_rows(state_hash: bytes, encoded_rows: bytes) -> bytes:
    """The content hash after one chunk: both sides hash the rows' msgpack encoding."""
    hasher = xxhash.xxh3_128(state_hash)      # as the rolling digest (replication/digest.py)
    hasher.update(encoded_rows)
    return hasher.digest()


def decode_rows(encoded_rows: Any) -> list[list[Any]]:
    """A chunk's rows from a peer, checked for shape (a malformed chunk is dropped, never applied)."""
    if not isinstance(encoded_rows, bytes):
        raise MessageError("snapshot rows are msgpack bytes")
    try:
        rows = msgpack.unpackb(encoded_rows, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"snapshot rows are not msgpack: {type(exc).__name__}") from None
    return check_rows(rows)


def message_row(kind: int, index: int, priority: int, enqueued_ms: int, dedupe_id: str | None, client: str,
                payload: bytes, deliveries: int, lease: list[Any] | None, ttl_ms: int = 0,
                delay_ms: int = 0, headers: dict[str, str] | None = None) -> list[Any]:
    return [kind, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease, ttl_ms, delay_ms,
            headers]


def check_rows(rows: Any) -> list[list[Any]]:
    """Rows from a peer, checked for shape (a malformed chunk is dropped, never applied)."""
    if not isinstance(rows, list):
        raise MessageError("snapshot rows are a list")
    for row in rows:
        if not isinstance(row, list) or not row or type(row[0]) is not int:
            raise MessageError("a snapshot row is [kind, fields...]")
        if row[0] in (ROW_MESSAGE, ROW_DEAD_LETTER):
            if len(row) != _MESSAGE_ROW_FIELDS or type(row[1]) is not int or type(row[2]) is not int \
                    or not isinstance(row[6], bytes) or type(row[7]) is not int or type(row[9]) is not int \
                    or type(row[10]) is not int or not (row[11] is None or isinstance(row[11], dict)):
                raise MessageError("a snapshot message row is malformed")
            lease = row[8]
            if lease is not None and (not isinstance(lease, list) or len(lease) != 3
                                      or not isinstance(lease[0], str)):
                raise MessageError("a snapshot lease is [receipt, visibility_ms, leased_ms]")
        elif row[0] == ROW_DEDUPE:
            if len(row) != _DEDUPE_ROW_FIELDS or not isinstance(row[1], str) or type(row[2]) is not int:
                raise MessageError("a snapshot dedupe row is malformed")
        else:
            raise MessageError(f"unknown snapshot row kind {row[0]!r}")
    return rows


@dataclass
class InstalledState:
    """What a replica took from the rows of one transfer, for its queue core at install.
    The ready messages themselves are kept only for a member that keeps its own state
    (`keep_ready`: a returning `producer` member adds them to its core); any other core pages
    them in from storage, and only their count is needed (a tuple per message of a 1M-message
    transfer was ~100 MB of memory the collector kept scanning)."""
    keep_ready: bool = True
    ready: list[tuple[int, int, int]] = field(default_factory=list)       # (priority, index, deliveries)
    ready_count: int = 0
    delayed_count: int = 0          # waiting for their delivery delay: not ready (QueueCore._load_timed)
    leases: list[tuple[int, int, str, int, int, int]] = field(default_factory=list)
    # ^ (index, priority, receipt, visibility_ms, deliveries, leased_ms)
    dead_letter_ready_count: int = 0
    dead_letter_leases: list[tuple[int, int, str, int, int, int]] = field(default_factory=list)

    def take(self, rows: list[list[Any]]) -> None:
        keep = self.keep_ready
        for row in rows:
            kind = row[0]
            if kind == ROW_DEDUPE:
                continue
            lease = row[8]
            if lease is not None:
                leases = self.leases if kind == ROW_MESSAGE else self.dead_letter_leases
                leases.append((row[1], row[2], lease[0], lease[1], row[7], lease[2]))
            elif kind == ROW_MESSAGE and row[10]:
                self.delayed_count += 1
            elif kind == ROW_MESSAGE:
                self.ready_count += 1
                if keep:
                    self.ready.append((row[2], row[1], row[7]))
            else:
                self.dead_letter_ready_count += 1


class MemorySnapshotView:
    """A snapshot of in-memory state, copied when it is opened (so it is one consistent view)."""

    def __init__(self, rows: list[list[Any]], order: int, digest: bytes, record: dict[str, Any],
                 dead_letter: list[Any] | None = None) -> None:
        self._rows = rows
        self._position = 0
        self.order, self.digest, self.record, self.dead_letter = order, digest, record, dead_letter

    def next_rows(self, bytes_max: int) -> list[list[Any]]:
        out: list[list[Any]] = []
        size = 0
        while self._position < len(self._rows) and (not out or size < bytes_max):
            row = self._rows[self._position]
            size += len(row[6]) + 64 if row[0] != ROW_DEDUPE else 64
            out.append(row)
            self._position += 1
        return out

    def close(self) -> None:
        self._rows = []


def memory_rows(store: Any, queue_id: int, *, consumption: bool, after_index: int, kind: int = ROW_MESSAGE,
                with_dedupe: bool = True) -> list[list[Any]]:
    """The rows of one queue of a `replication.store.MemoryStore` (the twins' snapshots)."""
    queue = store.queues.get(queue_id)
    if queue is None:
        return []
    ready = {index: deliveries for rows in queue.ready.values() for index, deliveries in rows}
    rows: list[list[Any]] = []
    for index in sorted(queue.messages):
        if index <= after_index:
            continue
        message = queue.messages[index]
        lease = queue.leases.get(index)
        if consumption:
            deliveries = lease.deliveries if lease is not None else ready.get(index, 0)
            lease_row = None if lease is None else [lease.receipt, lease.visibility_ms, lease.leased_ms]
        else:
            deliveries, lease_row = 0, None
        rows.append(message_row(kind, index, message.priority, message.enqueued_ms, message.dedupe_id,
                                message.client, message.payload, deliveries, lease_row, message.ttl_ms,
                                message.delay_ms if index in queue.delayed else 0, message.headers))
    if with_dedupe:
        for dedupe_id, (index, enqueued_ms) in sorted(queue.dedupe.items()):
            if index > after_index:
                rows.append([ROW_DEDUPE, dedupe_id, index, enqueued_ms])
    return rows
