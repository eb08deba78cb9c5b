"""Bounded clean-up inside a normal batch: completion statuses past their retention, dedupe
ids past their window, and the rows of deleted queue incarnations.

Separate from one commit's work on its operations (commit.py): none of it follows from the
batch's operations, it runs only in batches the engine marks (`SealedBatch.housekeeping_ms`),
and the dedupe sweep's position is the writer thread's across batches (one `Housekeeper` per
store).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lmdb

from qserver.storage.rows import EXPIRY, EXPIRY_STATUS, QI, Q, queue_prefix

ERASE_KEYS_PER_BATCH_MAX = 5_000
PRUNE_KEYS_PER_BATCH_MAX = 5_000
# A pass that is behind (`Housekeeper.run`) has the engine run the next one this soon instead
# of a housekeeping interval later (qserver/core/engine.py). At one pass a second,
# 5,000 keys a second is less than a windowed producer writes dedupe ids (every client
# enqueue has one): the rows outlived their window for as long as the load lasted, without
# bound. Twenty passes a second look at 100,000 keys a second, each pass still one bounded step.
CATCH_UP_INTERVAL_MS = 50
# The dedupe sweep walks the ids in key order, and a client's ids grow (a prefix and a
# counter): new rows land ahead of the sweep, which one pass a second never overtook under
# load, so it never came back to the expired rows behind it. It catches up whenever its walk
# through the table has taken longer than half the window (at least this long): an id then
# stays at most about one and a half windows.
DEDUPE_CYCLE_MIN_MS = 1_000


@dataclass(slots=True)
class PassSchedule:
    """When the engine's loop asks for a pass (it marks the open batch; the writer runs it): one
    every `interval_ms` with the interval's other chores, and one every CATCH_UP_INTERVAL_MS
    between them while the last pass was behind."""
    interval_ms: int
    next_pass_ms: int = 0
    next_catch_up_ms: int = 0

    def due(self, mono_ms: int, behind: bool) -> str | None:
        """"interval", "catch_up" or None (no pass now)."""
        if mono_ms >= self.next_pass_ms:
            self.next_pass_ms = mono_ms + self.interval_ms
            self.next_catch_up_ms = mono_ms + CATCH_UP_INTERVAL_MS
            return "interval"
        if behind and mono_ms >= self.next_catch_up_ms:
            self.next_catch_up_ms = mono_ms + CATCH_UP_INTERVAL_MS
            return "catch_up"
        return None

    def deadline(self, behind: bool) -> int:
        return min(self.next_pass_ms, self.next_catch_up_ms) if behind else self.next_pass_ms


# The databases whose rows of a deleted incarnation are erased (keyed by queue id first).
_ERASED = ("messages", "ready", "leases", "status", "dedupe", "oplog", "ttl", "delayed", "headers", "streams")


class Housekeeper:
    def __init__(self, db: dict[str, Any]) -> None:
        self._db = db
        self._dedupe_sweep_from = b""     # where the next dedupe sweep resumes (writer thread)
        self._dedupe_cycle_from_ms = 0    # when the sweep last started from the first id
        # Written by the writer thread after each pass, read by the engine's loop when it
        # schedules the next one: the last pass left more to do than one pass does.
        self.behind = False

    def run(self, txn: lmdb.Transaction, now_ms: int, dedupe_window_ms: int, status_retention_ms: int) -> None:
        """Completion statuses past their retention (oldest first, from the expiry index),
        dedupe ids past the window (an incremental sweep, so enqueues need no second index),
        and the records of deleted queue incarnations, a few thousand keys at a time. Behind:
        the statuses or the erase ended on their budget, or the sweep is slow (_sweep_dedupe)."""
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
        statuses_behind = pruned == PRUNE_KEYS_PER_BATCH_MAX
        dedupe_behind = self._sweep_dedupe(txn, now_ms, dedupe_window_ms)
        erase_behind = self._erase_doomed(txn)
        self.behind = statuses_behind or dedupe_behind or erase_behind

    def _sweep_dedupe(self, txn: lmdb.Transaction, now_ms: int, window_ms: int) -> bool:
        """Returns whether the sweep's walk through the table has taken longer than half the
        window without reaching its end (DEDUPE_CYCLE_MIN_MS)."""
        cursor = txn.cursor(db=self._db["dedupe"])
        if not self._dedupe_sweep_from:
            self._dedupe_cycle_from_ms = now_ms
        if not (cursor.set_range(self._dedupe_sweep_from) if self._dedupe_sweep_from else cursor.first()):
            self._dedupe_sweep_from = b""
            return False
        horizon_ms = now_ms - window_ms
        for _ in range(PRUNE_KEYS_PER_BATCH_MAX):
            key = cursor.key()
            if not key:
                break
            if QI.unpack(cursor.value())[1] < horizon_ms:
                cursor.delete()      # moves to the next entry
            elif not cursor.next():
                break
        self._dedupe_sweep_from = bytes(cursor.key())
        if not self._dedupe_sweep_from:
            return False             # the walk reached the end: the next pass starts another
        return now_ms - self._dedupe_cycle_from_ms >= max(DEDUPE_CYCLE_MIN_MS, window_ms // 2)

    def _erase_doomed(self, txn: lmdb.Transaction) -> bool:
        """Returns whether rows of a deleted incarnation are left for the next pass."""
        doomed = txn.cursor(db=self._db["doomed"])
        if not doomed.first():
            return False
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
                return True
        doomed.delete()
        return doomed.first()        # another deleted incarnation waits
