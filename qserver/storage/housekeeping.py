"""Bounded clean-up inside a normal batch: completion statuses past their retention, dedupe
ids past their window, and the rows of deleted queue incarnations.

Separate from one commit's work on its operations (commit.py): none of it follows from the
batch's operations, it runs only in batches the engine marks (`SealedBatch.housekeeping_ms`),
and the dedupe sweep's position is the writer thread's across batches (one `Housekeeper` per
store).
"""
from __future__ import annotations

from typing import Any

import lmdb

from qserver.storage.rows import EXPIRY, EXPIRY_STATUS, QI, Q, queue_prefix

ERASE_KEYS_PER_BATCH_MAX = 5_000
PRUNE_KEYS_PER_BATCH_MAX = 5_000
# The databases whose rows of a deleted incarnation are erased (keyed by queue id first).
_ERASED = ("messages", "ready", "leases", "status", "dedupe", "oplog", "ttl", "delayed", "headers", "streams")


class Housekeeper:
    def __init__(self, db: dict[str, Any]) -> None:
        self._db = db
        self._dedupe_sweep_from = b""     # where the next dedupe sweep resumes (writer thread)

    def run(self, txn: lmdb.Transaction, now_ms: int, dedupe_window_ms: int, status_retention_ms: int) -> None:
        """Completion statuses past their retention (oldest first, from the expiry index),
        dedupe ids past the window (an incremental sweep, so enqueues need no second index),
        and the records of deleted queue incarnations, a few thousand keys at a time."""
        cursor = txn.cursor(db=self._db["expiry"])
        horizon = now_ms - status_retention_ms
        pruned = 0
        if cursor.set_range(bytes([EXPIRY_STATUS])):
            while pruned < PRUNE_KEYS_PER_BATCH_MAX:
                key = cursor.key()
                if not key or key[0] != EXPIRY_STATUS or EXPIRY.unpack_from(key)[1] > horizon:
                    break
                txn.delete(Q.pack(EXPIRY.unpack_from(key)[2]) + key[EXPIRY.size:], db=self._db["status"])
                cursor.delete()
                pruned += 1
        self._sweep_dedupe(txn, now_ms - dedupe_window_ms)
        self._erase_doomed(txn)

    def _sweep_dedupe(self, txn: lmdb.Transaction, horizon_ms: int) -> None:
        cursor = txn.cursor(db=self._db["dedupe"])
        if not (cursor.set_range(self._dedupe_sweep_from) if self._dedupe_sweep_from else cursor.first()):
            self._dedupe_sweep_from = b""
            return
        for _ in range(PRUNE_KEYS_PER_BATCH_MAX):
            key = cursor.key()
            if not key:
                break
            if QI.unpack(cursor.value())[1] < horizon_ms:
                cursor.delete()      # moves to the next entry
            elif not cursor.next():
                break
        self._dedupe_sweep_from = bytes(cursor.key())

    def _erase_doomed(self, txn: lmdb.Transaction) -> None:
        doomed = txn.cursor(db=self._db["doomed"])
        if not doomed.first():
            return
        queue_id = Q.unpack(doomed.key())[0]
        prefix = queue_prefix(queue_id)
        budget = ERASE_KEYS_PER_BATCH_MAX
        for name in _ERASED:
            cursor = txn.cursor(db=self._db[name])
            if not cursor.set_range(prefix):
                continue
            while budget > 0 and bytes(cursor.key()).startswith(prefix):
                cursor.delete()
                budget -= 1
            if budget == 0:
                return
        doomed.delete()
