"""An in-memory twin of `qserver.storage.Storage`: what the engine, the pair driver, the
cores and the replication roles call, and nothing else.

Messages, ready lists, leases, statuses and dedupe ids live in a `MemoryStore` (the same
operation semantics as LMDB, checked by tests/test_store_contract.py), the replicated op log
in a `MemoryOpLog`, queue records, clients and epochs in dicts. `commit` applies one sealed
batch all at once, and a commit is durable: a crashed engine leaves behind exactly the
batches it committed, and a restarted engine on the same `MemoryStorage` loads them.
Housekeeping (pruning statuses and dedupe ids past their windows) is left out: it never
changes what a client may observe within one simulated run.
"""
from __future__ import annotations

from typing import Any

from qserver.storage import CommitResult, SealedBatch
from replication.digest import EMPTY_DIGEST
from replication.messages import decode_operation
from replication.operations import Enqueued
from replication.oplog import MemoryOpLog
from replication.queue_core import QueueRecord
from replication.store import MemoryStore, StoredLease, drop_queue


class MemoryStorage:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.storage_id = 1      # one disk per simulated node (a wipe would take a new one)
        self.store = MemoryStore()
        self.oplog = MemoryOpLog(EMPTY_DIGEST)
        self.records: dict[str, dict[str, Any]] = {}
        self.epochs: dict[str, int] = {}
        self.clients: dict[str, dict[str, Any]] = {}
        self._next_queue_id = 1
        self._reading = False
        self.commits = 0

    # --- lifecycle and loading -------------------------------------------------------------
    def close(self) -> None:
        self.end_read()

    def map_size(self) -> int:
        return 1 << 30

    def grow_map(self) -> int:
        return self.map_size()

    def load_queue_records(self) -> list[QueueRecord]:
        return [QueueRecord.from_json(self.records[name]) for name in sorted(self.records)]

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

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        queue = self.store.queues.get(queue_id)
        if queue is None:
            return None
        if index in queue.status:
            state, reply = queue.status[index]
            return state, 0, reply
        if index in queue.leases:
            return "delivered", queue.leases[index].deliveries, None
        if index in queue.messages:
            return "queued", 0, None
        return None

    # --- the op log (OpLogReader) ----------------------------------------------------------
    def read(self, queue_id: int, after_order: int, limit: int) -> list[tuple[int, bytes]]:
        return self.oplog.read(queue_id, after_order, limit)

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        return self.oplog.digest_at(queue_id, order)

    def last(self, queue_id: int) -> tuple[int, bytes]:
        return self.oplog.last(queue_id)

    # --- the one writer --------------------------------------------------------------------
    def commit(self, batch: SealedBatch) -> CommitResult:
        """Apply the whole batch (same order as `Storage._write`); durable on return."""
        # A deposed master's uncommitted suffix goes first (older batches may lack the field).
        for queue_id, order in getattr(batch, "truncations", ()):
            self._truncate(queue_id, order)
        self.store.apply(batch.operations)
        # Read before a deleted queue goes: LMDB only marks it doomed in this transaction.
        payloads = [self.store.payload(queue_id, index) for queue_id, index in batch.payload_reads]
        for name, queue_id in batch.deleted_queues:
            self.records.pop(name, None)
            self.epochs.pop(name, None)
            drop_queue(self.store, queue_id)
            self.oplog.clear(queue_id)
        for name, record in batch.queue_records.items():
            self.records[name] = dict(record)
        for queue_id, _order, digest, encoded in batch.oplog_rows:
            self.oplog.append(queue_id, decode_operation(encoded), digest, encoded)
        self.epochs.update(batch.epochs)
        for client_id, client in batch.client_puts.items():
            self.clients[client_id] = dict(client)
        for client_id in batch.client_deletes:
            self.clients.pop(client_id, None)
        if batch.next_queue_id is not None:
            self._next_queue_id = batch.next_queue_id
        self.commits += 1
        return CommitResult(payloads, 0.0, len(batch.operations))

    def _truncate(self, queue_id: int, order: int) -> None:
        """Erase the queue's messages (ready and dedupe entries too) and op-log rows past
        `order`, as `Storage._truncate` does."""
        queue = self.store.queues.get(queue_id)
        if queue is not None:
            for index in [index for index in queue.messages if index > order]:
                message = queue.messages.pop(index)
                queue.ready[message.priority] = [row for row in queue.ready.get(message.priority, [])
                                                 if row[0] != index]
                if message.dedupe_id is not None and queue.dedupe.get(message.dedupe_id, (0, 0))[0] == index:
                    del queue.dedupe[message.dedupe_id]
        kept = [(op, self.oplog.digest_at(queue_id, op.order), encoded)
                for op, (_, encoded) in zip(self.oplog.operations(queue_id), self.oplog.read(queue_id, 0, 10**9),
                                            strict=True) if op.order <= order]
        self.oplog.clear(queue_id)
        for op, digest, encoded in kept:
            assert digest is not None
            self.oplog.append(queue_id, op, digest, encoded)

    # --- inspection (the checkers) ---------------------------------------------------------
    def queue_id(self, name: str) -> int | None:
        record = self.records.get(name)
        return None if record is None else int(record["queue_id"])

    def held(self, queue_id: int) -> set[int]:
        queue = self.store.queues.get(queue_id)
        return set() if queue is None else set(queue.messages)

    def oplog_rows(self, queue_id: int) -> list[tuple[int, bytes]]:
        return self.oplog.read(queue_id, 0, 10**9)

    def surviving_enqueues(self, queue_id: int) -> set[int]:
        return {op.index for op in self.oplog.operations(queue_id) if type(op) is Enqueued}
