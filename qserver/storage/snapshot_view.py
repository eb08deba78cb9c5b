"""One queue's committed state read for a snapshot transfer (`LmdbSnapshotView`), in bounded
chunks of rows as replication/snapshot.py lays them out.

Separate from the store: a view lives in a read transaction of its own for as long as its
transfer runs, walks several databases side by side (`_Beside`), and answers the master
role's SnapshotView interface, not the engine's reads. The store opens views, counts them,
and ends them when the map grows (Storage.open_snapshot, Storage.grow_map).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import lmdb
import msgpack

from qserver.storage.rows import QI, QPI, TTL, U32, EntryPayloads, Q, last_logged, streams_of
from replication.snapshot import ROW_DEAD_LETTER, ROW_DEDUPE, ROW_MESSAGE, SnapshotViewLost


class _Beside:
    """A database keyed like the messages (queue_id, index), read beside a walk over the
    messages in key order: a cursor step per row it holds instead of a lookup per message."""
    __slots__ = ("_cursor", "_next")

    def __init__(self, txn: lmdb.Transaction, db: Any, start: bytes) -> None:
        self._cursor = txn.cursor(db=db)
        self._next: bytes | None = bytes(self._cursor.key()) if self._cursor.set_range(start) else None

    def at(self, key: bytes) -> bytes | None:
        """The value at `key` (the walk's next message), or None; keys only grow."""
        cursor = self._cursor
        while self._next is not None and self._next < key:      # a row without its message
            self._next = bytes(cursor.key()) if cursor.next() else None
        if self._next != key:
            return None
        value = bytes(cursor.value())
        self._next = bytes(cursor.key()) if cursor.next() else None
        return value


class LmdbSnapshotView:
    """One queue's committed state at one order, read from one LMDB read transaction (a
    consistent view while writes go on). Its rows come in bounded chunks (SnapshotView in
    replication/snapshot.py). Holding the transaction keeps LMDB from reusing pages freed
    since, which is why MasterRole drops a view after sync_view_max_ms. `on_close` tells the
    store that opened it (it counts the views open)."""

    def __init__(self, db: dict[str, Any], txn: lmdb.Transaction, name: str, queue_id: int, consumption: bool,
                 after_index: int, dead_letter: tuple[str, int] | None,
                 on_close: Callable[[LmdbSnapshotView], None]) -> None:
        self._txn, self._db, self._on_close = txn, db, on_close
        self.lost = False                # a map growth ended its transaction (see lose)
        self._payloads = EntryPayloads(txn, db["oplog"])
        self._consumption = consumption
        self.record = self._record(name)
        self.order, self.digest = self._last(queue_id)
        self.dead_letter: list[Any] | None = None
        # (kind, queue id, next key to read): messages, dedupe entries, dead letters
        self._parts: list[tuple[int, int, bytes]] = [(ROW_MESSAGE, queue_id, QI.pack(queue_id, after_index + 1)),
                                                     (ROW_DEDUPE, queue_id, Q.pack(queue_id))]
        self._after_index = after_index
        if dead_letter is not None:
            dead_name, dead_id = dead_letter
            order, digest = self._last(dead_id)
            self.dead_letter = [order, digest, self._record(dead_name)]
            self._parts.append((ROW_DEAD_LETTER, dead_id, QI.pack(dead_id, 1)))

    def _record(self, name: str) -> dict[str, Any]:
        raw = self._txn.get(name.encode(), db=self._db["queues"])
        if raw is None:
            raise KeyError(name)
        record = dict(msgpack.unpackb(raw))
        streams = streams_of(self._txn.cursor(db=self._db["streams"]), record["queue_id"])
        if streams:                 # a stored record holds none (layout 8): the snapshot's record carries them
            record["sequences"] = streams
        return record

    def _last(self, queue_id: int) -> tuple[int, bytes]:
        return last_logged(self._txn.cursor(db=self._db["oplog"]), queue_id)

    def lose(self) -> None:
        """The map is about to grow (Storage.grow_map), which ends this view's transaction:
        from now on `next_rows` raises SnapshotViewLost. It still counts as open until `close`."""
        if not self.lost and self._txn is not None:
            self.lost = True
            self._txn.abort()            # its reader slot is free at once

    def next_rows(self, bytes_max: int) -> list[list[Any]]:
        if self.lost:
            raise SnapshotViewLost(f"the snapshot at order {self.order} lost its read transaction to a map growth")
        out: list[list[Any]] = []
        size = 0
        while self._parts and size < bytes_max:
            kind, queue_id, start = self._parts[0]
            if kind == ROW_DEDUPE:
                rows, resume, taken = self._dedupe_rows(queue_id, start, bytes_max - size)
            else:
                rows, resume, taken = self._message_rows(kind, queue_id, start, bytes_max - size)
            out += rows
            size += taken
            if resume is None:
                self._parts.pop(0)
            else:
                self._parts[0] = (kind, queue_id, resume)
        return out

    def _message_rows(self, kind: int, queue_id: int, start: bytes,
                      bytes_max: int) -> tuple[list[list[Any]], bytes | None, int]:
        """Message rows from `start` on, about `bytes_max` of payload: (rows, where the next
        call resumes or None at the queue's end, the bytes counted). Per message, on the
        master's loop during a transfer: the leases (and times to live, delays, headers) come
        from cursors walked beside the messages' (all in (queue, index) order; few messages
        have such rows), not a lookup each."""
        rows: list[list[Any]] = []
        size = 0
        txn, unpack_row, unpack_key = self._txn, msgpack.unpackb, QI.unpack
        resolve = self._payloads.resolve
        cursor = txn.cursor(db=self._db["messages"])
        if not cursor.set_range(start):
            return rows, None, 0
        consumption = self._consumption
        if consumption:
            ready_db, ready_key = self._db["ready"], QPI.pack
            leases = _Beside(txn, self._db["leases"], start)
        ttls, delays, named = (_Beside(txn, self._db[name], start) for name in ("ttl", "delayed", "headers"))
        # The view's transaction has buffers off: keys and values are bytes.
        for key, value in cast("Iterator[tuple[bytes, bytes]]", cursor):
            owner, index = unpack_key(key)
            if owner != queue_id:
                return rows, None, size
            if size >= bytes_max:
                return rows, key, size
            priority, enqueued_ms, dedupe_id, client, held = unpack_row(value)
            payload = held if type(held) is bytes else resolve(owner, index, held)
            deliveries, lease = 0, None
            if consumption:
                if (raw_lease := leases.at(key)) is not None:
                    _, receipt, visibility_ms, deliveries, leased_ms = unpack_row(raw_lease)
                    lease = [receipt, visibility_ms, leased_ms]
                else:
                    raw_ready = txn.get(ready_key(queue_id, priority, index), db=ready_db)
                    deliveries = U32.unpack(raw_ready)[0] if raw_ready else 0
            ttl, delay, headers = ttls.at(key), delays.at(key), named.at(key)
            # As replication.snapshot.message_row lays it out.
            rows.append([kind, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease,
                         0 if ttl is None else TTL.unpack(ttl)[1], 0 if delay is None else TTL.unpack(delay)[1],
                         None if headers is None else unpack_row(headers)])
            size += len(payload) + 64
        return rows, None, size

    def _dedupe_rows(self, queue_id: int, start: bytes,
                     bytes_max: int) -> tuple[list[list[Any]], bytes | None, int]:
        rows: list[list[Any]] = []
        prefix = Q.pack(queue_id)
        cursor = self._txn.cursor(db=self._db["dedupe"])
        if not cursor.set_range(start):
            return rows, None, 0
        after, unpack, size = self._after_index, QI.unpack, 0
        for key, value in cast("Iterator[tuple[bytes, bytes]]", cursor):
            if key[:8] != prefix:
                return rows, None, size
            if size >= bytes_max:
                return rows, key, size
            index, enqueued_ms = unpack(value)
            if index > after:           # (counted once taken: a call that returns rows takes one)
                rows.append([ROW_DEDUPE, key[8:].decode(), index, enqueued_ms])
                size += 64
        return rows, None, size

    def close(self) -> None:
        if self._txn is not None:
            self._txn.abort()            # (a lost view's was aborted already: nothing more)
            self._txn = None  # type: ignore[assignment]
            self._on_close(self)
