"""The bounded op log on disk: records below each queue's floor deleted a bounded number per
batch, and the records kept below it while they hold a live message's payload.

The op log is bounded: each batch carries the floor below which every member's needs are
met (`SealedBatch.log_floors`, see MasterRole.log_floor) and the writer deletes records below
it a bounded number at a time. A payload is stored once: an enqueue's log entry carries its
payload, so its message row names the entry instead of holding a second copy (commit.py).
A record that goes below the floor while it holds a live message's payload is kept (no
longer part of the log: nothing below the log start is served or compared) and goes once
none of its messages is live, so a queue consumed about as fast as it is filled writes each
payload once. A backlog is bounded by `payload_hold_bytes`: a queue whose ready messages or
kept records pass half of it stores new payloads in their rows (commit.py), and past the
whole of it the oldest kept records' live payloads move into their rows before they go.

Separate from one commit's work (commit.py) because its state outlives the commit: the
truncations under way and the kept records are the writer thread's across batches (one
`LogBound` per store), and an aborted commit puts them back (`saved`, `restore`).
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import lmdb
import msgpack

from qserver.storage.rows import LOG_START, QI, Q
from replication.digest import DIGEST_BYTES, EMPTY_DIGEST

TRUNCATE_RECORDS_PER_BATCH_MAX = 20_000     # op-log records deleted per batch (the rest follow)

Resolve = Callable[[int, int, "bytes | int"], bytes]     # EntryPayloads.resolve of the commit's transaction


class LogBound:
    """The writer thread's record of op-log truncations under way and records kept for their
    payloads. Rebuilt by looking again after a restart or an aborted commit."""

    def __init__(self, db: dict[str, Any], pack: Callable[[Any], bytes], payload_hold_bytes: int) -> None:
        self._oplog, self._messages, self._pack = db["oplog"], db["messages"], pack
        self.payload_hold_bytes = payload_hold_bytes
        self.floors: dict[int, int] = {}    # op-log truncations still under way
        # Records below a queue's floor kept for their live payloads: their (last order, first
        # order, size), oldest first, and total per queue; and the order below which every
        # record was looked at.
        self.kept: dict[int, collections.deque[tuple[int, int, int]]] = {}
        self.kept_by_queue: dict[int, int] = {}
        self.examined: dict[int, int] = {}
        self.truncated_records = 0
        self.moved_payloads = 0
        self.kept_bytes = 0                # op-log records below the floors kept for live payloads

    def saved(self) -> tuple[dict[int, int], int]:
        """What a commit about to start may have to give back (`restore`)."""
        return dict(self.floors), self.moved_payloads

    def restore(self, saved: tuple[dict[int, int], int]) -> None:
        """The commit aborted: it must not leave this counting records it did not delete."""
        self.floors, self.moved_payloads = saved
        self.kept, self.kept_by_queue, self.examined = {}, {}, {}     # looked at again

    def truncate(self, txn: lmdb.Transaction, floors: dict[int, int], consumed: set[int], resolve: Resolve) -> None:
        """Delete op-log records below each queue's floor, at most
        TRUNCATE_RECORDS_PER_BATCH_MAX per batch; what is left continues in the next batches.
        The log-start record moves to the floor first: from then on nothing below it is served.
        Each record that goes below the floor is looked at once: deleted, or kept while it
        holds a live message's payload. Kept records go, oldest first, once none of their
        messages is live (a queue consumed in order frees its oldest first: only a batch that
        `consumed` messages of the queue can have freed one), or once the queue keeps more
        than `payload_hold_bytes`, after their live payloads move into their message rows."""
        if floors or self.floors:
            self._truncate(txn, floors, consumed, resolve)
            self.kept_bytes = sum(self.kept_by_queue.values())

    def _truncate(self, txn: lmdb.Transaction, floors: dict[int, int], consumed: set[int], resolve: Resolve) -> None:
        oplog = self._oplog
        for queue_id, floor in floors.items():
            start_key = QI.pack(queue_id, LOG_START)
            raw = txn.get(start_key, db=oplog)
            if floor > (0 if raw is None else Q.unpack(raw[DIGEST_BYTES:])[0]):
                txn.put(start_key, EMPTY_DIGEST + Q.pack(floor), db=oplog)
                self.floors[queue_id] = max(floor, self.floors.get(queue_id, 0))
        budget = TRUNCATE_RECORDS_PER_BATCH_MAX
        cursor = txn.cursor(db=oplog)
        for queue_id in list(self.floors):
            if budget <= 0:
                return                   # the rest goes on in the next batches
            floor = self.floors[queue_id]
            kept = self.kept.setdefault(queue_id, collections.deque())
            while kept and budget > 0 and queue_id in consumed \
                    and not self._live_rows(txn, queue_id, kept[0][1], kept[0][0], every=False):
                order, _, size = kept.popleft()
                txn.delete(QI.pack(queue_id, order), db=oplog)
                self._forget_kept(queue_id, size)
                budget -= 1
            examined = self.examined.get(queue_id, LOG_START + 1)     # records below it were
            if examined < floor and cursor.set_range(QI.pack(queue_id, examined)):
                while budget > 0:
                    key = cursor.key()
                    owner, order = QI.unpack(key) if key else (0, 0)
                    if owner != queue_id or order >= floor:
                        examined = floor
                        break
                    examined = order + 1
                    budget -= 1
                    value = cursor.value()
                    first = Q.unpack_from(value, DIGEST_BYTES)[0] if len(value) > DIGEST_BYTES else order
                    if first < order and self._live_rows(txn, queue_id, first, order, every=False):
                        size = len(value)
                        kept.append((order, first, size))
                        self.kept_by_queue[queue_id] = self.kept_by_queue.get(queue_id, 0) + size
                        cursor.next()
                    else:
                        cursor.delete()  # moves to the next record
                        self.truncated_records += 1
            elif examined < floor:
                examined = floor
            self.examined[queue_id] = examined
            while kept and budget > 0 and self.kept_by_queue.get(queue_id, 0) > self.payload_hold_bytes:
                order, first, size = kept.popleft()
                self._move_payloads(txn, queue_id, order, self._live_rows(txn, queue_id, first, order, every=True),
                                    resolve)
                txn.delete(QI.pack(queue_id, order), db=oplog)
                self._forget_kept(queue_id, size)
                budget -= 1
            if not kept and examined >= floor:
                self._forget_floor(queue_id)         # nothing below the floor is left

    def install_mark(self, txn: lmdb.Transaction, queue_id: int, order: int, digest: bytes, resolve: Resolve) -> None:
        """A complete snapshot at `order`: the log starts there, with its digest."""
        self._forget_floor(queue_id)
        # An entry of this member's own ending there gives way to the mark: the payloads it
        # alone holds move into their rows first.
        replaced = txn.get(QI.pack(queue_id, order), db=self._oplog)
        if replaced is not None and len(replaced) > DIGEST_BYTES:
            first = Q.unpack_from(replaced, DIGEST_BYTES)[0]
            self._move_payloads(txn, queue_id, order, self._live_rows(txn, queue_id, first, order, every=True),
                                resolve)
        txn.put(QI.pack(queue_id, order), digest, db=self._oplog)
        txn.put(QI.pack(queue_id, LOG_START), EMPTY_DIGEST + Q.pack(order), db=self._oplog)

    def _forget_kept(self, queue_id: int, size: int) -> None:
        self.kept_by_queue[queue_id] -= size
        self.truncated_records += 1

    def _forget_floor(self, queue_id: int) -> None:
        for remembered in (self.floors, self.kept, self.examined, self.kept_by_queue):
            remembered.pop(queue_id, None)

    def _live_rows(self, txn: lmdb.Transaction, queue_id: int, first: int, last: int, *,
                   every: bool) -> list[tuple[bytes, list[Any]]]:
        """The message rows whose payload is only in the op-log entry from `first` to `last`:
        the live messages it enqueued (message ids are their enqueues' orders); the first
        one only unless `every`. An entry of one operation never holds a row's payload: one
        message at a time, a kept record per message cost more than the copy it saves (a
        deeper op-log tree to write in every commit, bench/RESULTS.md)."""
        live = []
        rows = txn.cursor(db=self._messages)
        if rows.set_range(QI.pack(queue_id, first)):
            end = QI.pack(queue_id, last)
            for key, raw in rows:
                if bytes(key) > end:
                    break
                row = msgpack.unpackb(raw)
                if type(row[4]) is int and row[4] == last:
                    live.append((bytes(key), row))
                    if not every:
                        break
        return live

    def _move_payloads(self, txn: lmdb.Transaction, queue_id: int, last: int, live: list[tuple[bytes, list[Any]]],
                       resolve: Resolve) -> None:
        messages = self._messages
        for key, row in live:
            row[4] = resolve(queue_id, QI.unpack(key)[1], last)
            txn.put(key, self._pack(row), db=messages)
        self.moved_payloads += len(live)
