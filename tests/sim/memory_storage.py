"""An in-memory twin of `qserver.storage.lmdb_store.Storage`: what the engine, the pair driver, the
cores and the replication roles call, and nothing else.

Messages, ready lists, leases, statuses and dedupe ids live in a `MemoryStore` (the same
operation semantics as LMDB, checked by tests/test_store_contract.py), the replicated op log
in a `MemoryOpLog`, queue records, clients and epochs in dicts. `commit` applies one sealed
batch all at once, and a commit is durable: a crashed engine leaves behind exactly the
batches it committed, and a restarted engine on the same `MemoryStorage` loads them.
Housekeeping (pruning statuses and dedupe ids past their windows) is left out: it never
changes what a client may observe within one simulated run. The op log is truncated below
each batch's floors at once (Storage does it in bounded steps), and snapshots are cut from a
copy of the committed state (`open_snapshot`) and installed from their rows.
"""
from __future__ import annotations

from typing import Any

from qserver.storage.lmdb_store import CommitResult, SealedBatch
from replication.digest import EMPTY_DIGEST
from replication.messages import decode_entry
from replication.operations import Enqueued
from replication.oplog import MemoryOpLog
from replication.queue_core import QueueRecord
from replication.snapshot import ROW_DEAD_LETTER, MemorySnapshotView, memory_rows
from replication.store import MemoryStore, StoredLease, drop_queue


class MemoryStorage:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.storage_id = 1      # one disk per simulated node (a wipe would take a new one)
        self.store = MemoryStore()
        self.oplog = MemoryOpLog(EMPTY_DIGEST)
        self.history = MemoryOpLog(EMPTY_DIGEST)     # every operation committed here, never truncated
        # Messages taken over by snapshot (queue id -> index -> payload), and the orders installed at.
        self.installed: dict[int, dict[int, bytes]] = {}
        self.installed_at: dict[int, list[int]] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.streams: dict[int, dict[str, Any]] = {}     # queue_id -> key -> stream (Storage's `streams` rows)
        self.epochs: dict[str, int] = {}
        self.clients: dict[str, dict[str, Any]] = {}
        self._next_queue_id = 1
        self._reading = False
        self.commits = 0
        self.housekeeping_behind = False     # nothing here is pruned in steps (Storage's, housekeeping.py)

    # --- lifecycle and loading -------------------------------------------------------------
    def close(self) -> None:
        self.end_read()

    def map_size(self) -> int:
        return 1 << 30

    def grow_map(self) -> int:
        return self.map_size()

    def load_queue_records(self) -> list[QueueRecord]:
        return [QueueRecord.from_json(self._with_streams(self.records[name])) for name in sorted(self.records)]

    def _with_streams(self, record: dict[str, Any]) -> dict[str, Any]:
        streams = self.streams.get(int(record["queue_id"]))
        return {**record, "sequences": {**record.get("sequences", {}), **streams}} if streams else dict(record)

    def load_leases(self, queue_id: int) -> list[StoredLease]:
        return sorted(self.store.leases(queue_id), key=lambda lease: lease.index)

    def load_clients(self) -> dict[str, dict[str, Any]]:
        return {key: dict(value) for key, value in self.clients.items()}

    def next_queue_id(self) -> int:
        return self._next_queue_id

    # --- committed reads -------------------------------------------------------------------
    def begin_read(self) -> None:
        self._reading = True

    def end_read(self) -> None:
        self._reading = False

    @property
    def reading(self) -> bool:
        return self._reading

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        return self.store.ready_page(queue_id, priority, after_index, before_index, limit)

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        return self.store.dedupe_lookup(queue_id, dedupe_id)

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        return self.store.dedupe_lookup_many(queue_id, dedupe_ids)

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.store.ttl_rows(queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.store.delayed_rows(queue_id)

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        return self.store.message_status(queue_id, index)

    def status_producer(self, queue_id: int, index: int) -> str | None:
        return self.store.status_producer(queue_id, index)

    def enqueued_ms(self, queue_id: int, index: int) -> int | None:
        queue = self.store.queues.get(queue_id)
        message = None if queue is None else queue.messages.get(index)
        return None if message is None else message.enqueued_ms

    def oldest_enqueued_ms(self, queue_ids: list[int]) -> dict[int, int]:
        """As Storage's: the enqueue time of each queue's lowest id still held."""
        out: dict[int, int] = {}
        for queue_id in queue_ids:
            queue = self.store.queues.get(queue_id)
            if queue is not None and queue.messages:
                out[queue_id] = queue.messages[min(queue.messages)].enqueued_ms
        return out

    # --- the op log (OpLogReader) ----------------------------------------------------------
    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        return self.oplog.read(queue_id, after_order, limit, bytes_max)

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        return self.oplog.digest_at(queue_id, order)

    def last(self, queue_id: int) -> tuple[int, bytes]:
        return self.oplog.last(queue_id)

    def first(self, queue_id: int) -> int:
        return self.oplog.first(queue_id)

    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> MemorySnapshotView | None:
        record = self.records.get(name)
        if record is None:
            return None
        rows = memory_rows(self.store, queue_id, consumption=consumption, after_index=after_index)
        dead = None
        if dead_letter is not None and dead_letter[0] in self.records:
            dead_name, dead_id = dead_letter
            dead_order, dead_digest = self.oplog.last(dead_id)
            dead = [dead_order, dead_digest, self._with_streams(self.records[dead_name])]
            rows += memory_rows(self.store, dead_id, consumption=True, after_index=0, kind=ROW_DEAD_LETTER,
                                with_dedupe=False)
        order, digest = self.oplog.last(queue_id)
        return MemorySnapshotView(rows, order, digest, self._with_streams(record), dead)

    # --- the one writer --------------------------------------------------------------------
    def commit(self, batch: SealedBatch) -> CommitResult:
        """Apply the whole batch (same order as `BatchWriter.write`, qserver/storage/commit.py); durable on return."""
        # A deposed master's uncommitted suffix goes first (older batches may lack the field).
        for queue_id, order in getattr(batch, "truncations", ()):
            self._truncate(queue_id, order)
        for queue_id, dead_letter_queue_id, rows in batch.snapshot_rows:
            self.store.put_snapshot_rows(queue_id, dead_letter_queue_id, rows)
            taken = self.installed.setdefault(queue_id, {})
            taken.update((row[1], row[6]) for row in rows if row[0] == 0)
        for queue_id, order, digest in batch.snapshot_installs:
            self.oplog.install(queue_id, order, digest)
            self.installed_at.setdefault(queue_id, []).append(order)
        self.store.apply(batch.operations)
        # Read before a deleted queue goes: LMDB only marks it doomed in this transaction.
        payloads = [self.store.payload(queue_id, index) for queue_id, index in batch.payload_reads]
        headers = [self.store.headers(queue_id, index) for queue_id, index in batch.payload_reads]
        for name, queue_id in batch.deleted_queues:
            self.records.pop(name, None)
            self.epochs.pop(name, None)
            drop_queue(self.store, queue_id)
            self.oplog.clear(queue_id)
            self.streams.pop(queue_id, None)
        for name, record in batch.queue_records.items():
            self.records[name] = dict(record)
        for queue_id in batch.stream_resets:
            self.streams.pop(queue_id, None)
        for queue_id, key, stream in batch.stream_puts:
            if stream is None:
                self.streams.get(queue_id, {}).pop(key, None)
            else:
                self.streams.setdefault(queue_id, {})[key] = stream
        for queue_id, _first, _last, digest, encoded in batch.oplog_rows:
            self.oplog.append(queue_id, decode_entry(encoded), digest, encoded)
            self.history.append(queue_id, decode_entry(encoded), digest, encoded)
        for queue_id, floor in batch.log_floors.items():
            self.oplog.truncate(queue_id, floor)
        self.epochs.update(batch.epochs)
        for client_id, client in batch.client_puts.items():
            self.clients[client_id] = dict(client)
        for client_id in batch.client_deletes:
            self.clients.pop(client_id, None)
        if batch.next_queue_id is not None:
            self._next_queue_id = batch.next_queue_id
        self.commits += 1
        return CommitResult(payloads, 0.0, len(batch.operations), headers)

    def _truncate(self, queue_id: int, order: int) -> None:
        """Erase the queue's messages (ready and dedupe entries too) and op-log rows past
        `order`, as `Storage._truncate` does."""
        self.store.discard_after(queue_id, order)
        self.oplog.discard_after(queue_id, order)
        self.history.discard_after(queue_id, order)
        taken = self.installed.get(queue_id, {})
        for index in [index for index in taken if index > order]:
            del taken[index]

    # --- inspection (the checkers) ---------------------------------------------------------
    def queue_id(self, name: str) -> int | None:
        record = self.records.get(name)
        return None if record is None else int(record["queue_id"])

    def held(self, queue_id: int) -> set[int]:
        queue = self.store.queues.get(queue_id)
        return set() if queue is None else set(queue.messages)

    def oplog_rows(self, queue_id: int) -> list[tuple[int, int, bytes]]:
        """What the (truncated) op log still holds."""
        return self.oplog.read(queue_id, 0, 10**9)

    def surviving_enqueues(self, queue_id: int) -> set[int]:
        """Enqueues of this instance's whole committed history (never truncated)."""
        return {op.index for op in self.history.operations(queue_id) if type(op) is Enqueued}

    def surviving_payloads(self, queue_id: int) -> dict[int, bytes]:
        """Message id -> payload of what this instance holds or held: its history's enqueues and
        the messages it took over by snapshot."""
        payloads = dict(self.installed.get(queue_id, {}))
        payloads.update((op.index, op.payload) for op in self.history.operations(queue_id) if type(op) is Enqueued)
        return payloads
