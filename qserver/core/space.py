"""Room in storage: whether this node takes new messages, by the disk's free space against its
reserve, the LMDB map against its limit, and writes that found no room (E_STORAGE_FULL,
docs/PROTOCOL.md, "Errors").

Its own module because it is a small state machine with its own clock and hysteresis, read by
the command steps (refuse before deciding anything), fed by the commit pipeline (what each
batch writes, a write that found no room) and telling the pairs when it flips.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from qserver.config import NodeConfig
from qserver.core.batch import OpenBatch
from qserver.storage.lmdb_store import SealedBatch, Storage, StorageFull, StorageSpace
from replication.operations import Enqueued
from wire.errors import E_STORAGE_FULL, QueueError

log = logging.getLogger("qserver.core.engine")
SPACE_CHECK_INTERVAL_MS = 100   # how often the storage's room is looked at (a few stat calls)
# Within this of the reserve, what each batch writes is counted against the room last measured,
# so a fast producer does not run 100 ms of writes past the line (twice its payloads: rows,
# indices and copied pages come with them).
SPACE_COUNTED_BYTES = 256 << 20
SPACE_RESUME_BYTES = 1 << 20    # room beyond the reserve before a full node takes new messages again
# After a write found no room, the node takes new data again no sooner than this, doubling while
# writes keep failing soon after it resumes (a replica whose disk cannot hold its master's state
# would otherwise start over every few hundred milliseconds), and back to the first once none has
# failed for FULL_HOLD_RESET_MS.
FULL_HOLD_INITIAL_MS, FULL_HOLD_MAX_MS, FULL_HOLD_RESET_MS = 1_000, 30_000, 120_000


class StorageRoom:
    """`storage_full`: why new messages are refused with E_STORAGE_FULL (None: there is room).
    `on_changed(full, mono_ms)` is called when that flips (the engine tells the pairs)."""

    def __init__(self, config: NodeConfig, storage: Storage, monotonic_ms: Callable[[], int]) -> None:
        self.config = config
        self.storage = storage
        self.monotonic_ms = monotonic_ms
        self.on_changed: Callable[[bool, int], None] = lambda full, mono_ms: None
        self.storage_full: str | None = None
        self.space: StorageSpace | None = None          # as last looked at
        self._map_full = False                          # a write found the map at its limit
        self._resume_bytes = SPACE_RESUME_BYTES         # room beyond the reserve to take messages again
        self._next_space_check_ms = 0
        self._written_since_measured = 0                # estimated bytes committed since `space`
        self._full_until_ms = 0                         # no room before then (see FULL_HOLD_INITIAL_MS)
        self._full_hold_ms = FULL_HOLD_INITIAL_MS
        self._last_found_full_ms: int | None = None

    def full_error(self) -> QueueError:
        """The refusal of new messages while `storage_full` says why."""
        return QueueError(E_STORAGE_FULL, f"the storage of node {self.config.node_id} is full ({self.storage_full}); "
                                          "nothing was stored")

    def found_full(self, batch: OpenBatch, error: StorageFull) -> None:
        """A write found no room: refuse new messages now. Taken again once the disk has its
        reserve free with this batch's size twice over to spare (it may come again), or the
        map has room (it was at its limit), and the hold has passed (FULL_HOLD_INITIAL_MS)."""
        sealed = batch.sealed
        size = sum(len(row[4]) for row in sealed.oplog_rows) + sum(
            len(op.payload) for op in sealed.operations if type(op) is Enqueued)
        self._resume_bytes = SPACE_RESUME_BYTES + 2 * size
        self._map_full = self._map_full or error.map_limit
        mono_ms = self.monotonic_ms()
        if self._last_found_full_ms is not None and mono_ms - self._last_found_full_ms > FULL_HOLD_RESET_MS:
            self._full_hold_ms = FULL_HOLD_INITIAL_MS
        self._last_found_full_ms = mono_ms
        self._full_until_ms = mono_ms + self._full_hold_ms
        self._full_hold_ms = min(2 * self._full_hold_ms, FULL_HOLD_MAX_MS)
        self._set_storage_full(str(error), mono_ms)
        self._next_space_check_ms = 0

    def count_written(self, sealed: SealedBatch) -> None:
        """Near the reserve, what this batch will write counts against the room last measured
        (without a reserve, writes go on to the disk's end and a full disk refuses them)."""
        space, reserve = self.space, self.config.disk_reserve_bytes
        if space is None or not reserve or space.disk_free_bytes - self._written_since_measured > \
                reserve + SPACE_COUNTED_BYTES:
            return
        logged = sum(len(row[4]) for row in sealed.oplog_rows)    # in a pair the entries hold the payloads
        payloads = logged or sum(len(op.payload) for op in sealed.operations if type(op) is Enqueued)
        self._written_since_measured += 2 * payloads

    def check(self, mono_ms: int) -> None:
        """Refuse new messages while the disk has less than its reserve free (acknowledgements,
        deletes and the membership layer's writes may use the reserve), or once a write found
        no room; take them again when there is room with some to spare, so a node at the edge
        does not flip at every commit. Measured every SPACE_CHECK_INTERVAL_MS (a few stat
        calls), and between two measurements less what the batches since wrote."""
        if mono_ms >= self._next_space_check_ms:
            self._next_space_check_ms = mono_ms + SPACE_CHECK_INTERVAL_MS
            measure = getattr(self.storage, "space", None)   # an in-memory twin (tests/sim) has no disk to measure
            measured = measure() if measure is not None else None
            if measured is not None:
                self.space, self._written_since_measured = measured, 0
        space = self.space
        if space is None:
            return
        disk_free = space.disk_free_bytes - self._written_since_measured
        reserve = self.config.disk_reserve_bytes
        slack = self._resume_bytes if self.storage_full is not None else 0
        if self._map_full and space.map_free_bytes >= slack + min(SPACE_RESUME_BYTES, self.storage.map_size_max_bytes // 16):
            self._map_full = False
        why: str | None = None
        if disk_free < reserve + slack:
            why = f"{max(0, disk_free)} bytes free on its disk, {reserve} kept in reserve"
        elif self._map_full:
            why = f"its map is full at its limit of {self.storage.map_size_max_bytes} bytes"
        elif mono_ms < self._full_until_ms:
            why = self.storage_full       # a write found no room a moment ago
        self._set_storage_full(why, mono_ms)

    def _set_storage_full(self, why: str | None, mono_ms: int) -> None:
        was_full = self.storage_full is not None
        self.storage_full = why
        if was_full == (why is not None):
            return
        if why is not None:
            log.warning("storage full (%s): new messages are refused with E_STORAGE_FULL and this node's replicas "
                        "stop following until there is room", why)
        else:
            log.warning("storage has room again: new messages are taken and this node's replicas catch up")
            self._resume_bytes = SPACE_RESUME_BYTES
        self.on_changed(why is not None, mono_ms)
