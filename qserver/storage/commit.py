"""One commit's work: a sealed batch written into one LMDB write transaction (`BatchWriter`).

`Storage.commit` (lmdb_store.py) opens the transaction, makes one `BatchWriter` for it and
keeps what the writer leaves behind only once the transaction committed (the journal's next
sequence). Everything that lives for one transaction lives here, on the writer: the payloads
its entries hold, the queues its operations consumed, its queues' names, epochs and roles, its
op-log entries per queue, its queues' ready counts, the journal sequence it has reached. The
writer thread runs one commit at a time, and a commit that aborts leaves nothing of it.

`BatchWriter.write` is the one place that says the order of a transaction's steps.

A payload is stored once (log_bound.py says why and how the op log keeps it): an enqueue's
message row names the op-log entry of this batch that holds it, unless the queue has no op
log or is a backlog (its ready messages or kept records past half of `payload_hold_bytes`).
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import lmdb
import msgpack

from qserver.storage.batch import SealedBatch
from qserver.storage.housekeeping import Housekeeper
from qserver.storage.log_bound import LogBound
from qserver.storage.rows import (
    EXPIRY,
    EXPIRY_STATUS,
    QI,
    QPI,
    TTL,
    U32,
    EntryPayloads,
    Q,
    delete_prefix,
    put_in_order,
    queue_prefix,
)
from replication.invariants import InvariantViolation
from replication.journal import RUN_MARK
from replication.operations import (
    Acked,
    DeadLettered,
    Enqueued,
    Expired,
    Extended,
    Leased,
    Matured,
    Operation,
    Purged,
    Released,
    SubscriberAcked,
    SubscriptionDropped,
    SubscriptionOpened,
)
from replication.options import producer_key
from replication.snapshot import ROW_DEDUPE, ROW_MESSAGE


class BatchWriter:
    """Writes one sealed batch in one write transaction (writer thread), then is dropped."""

    def __init__(self, txn: lmdb.Transaction, batch: SealedBatch, *, db: dict[str, Any],
                 pack: Callable[[Any], bytes], node_id: str, journal_enabled: bool, journal_sequence: int,
                 log_bound: LogBound, housekeeper: Housekeeper) -> None:
        self.txn, self.batch, self.db, self._pack, self.node_id = txn, batch, db, pack, node_id
        self.journal_enabled = journal_enabled
        self.journal_sequence = journal_sequence      # the last one taken; Storage keeps it once committed
        self._bound, self._housekeeper = log_bound, housekeeper
        self._payloads: EntryPayloads | None = None   # this transaction's reads of payloads (made when needed)
        # Suffixes erased and snapshots installed replace rows: their kept records are looked at.
        self._consumed = {queue_id for queue_id, _ in batch.truncations} | \
            {queue_id for queue_id, _, _ in batch.snapshot_rows}
        self._names = {record["queue_id"]: (name, record["epoch"]) for name, record in batch.queue_records.items()}
        self._replicas = batch.replica_queue_ids
        self._entry_ends: dict[int, list[tuple[int, int]]] = {}   # this batch's entries per queue
        self._ready_counts = {record.get("queue_id", 0): record.get("ready_count", 0)
                              for record in batch.queue_records.values()}

    def write(self) -> tuple[list[bytes | None], list[dict[str, str] | None]]:
        """Every step of the batch, in order; returns the payloads (and headers) it was asked to read."""
        txn, batch, db = self.txn, self.batch, self.db
        for queue_id, order in batch.truncations:    # first: this batch's operations come after
            self._truncate(queue_id, order)
        for queue_id, dead_letter_queue_id, rows in batch.snapshot_rows:
            self._put_snapshot_rows(queue_id, dead_letter_queue_id, rows)
        for queue_id, order, digest in batch.snapshot_installs:
            self._bound.install_mark(txn, queue_id, order, digest, self._resolve)
        # The entries go in before the operations: an enqueue's row names its entry, and a
        # dead letter or a lease in this same batch reads the payload from it.
        if batch.oplog_rows:
            txn.cursor(db=db["oplog"]).putmulti([(QI.pack(queue_id, last), digest + Q.pack(first) + encoded)
                                                 for queue_id, first, last, digest, encoded in batch.oplog_rows])
            for queue_id, first, last, _, _ in batch.oplog_rows:
                if last > first:     # an entry of one operation is not kept for its payload (see LogBound._live_rows)
                    self._entry_ends.setdefault(queue_id, []).append((first, last))
        self._apply_operations()
        for name, queue_id in batch.deleted_queues:     # before the puts: a reset replaces a name
            txn.delete(name.encode(), db=db["queues"])
            txn.delete(name.encode(), db=db["epochs"])
            txn.put(Q.pack(queue_id), b"", db=db["doomed"])
        for name, record in batch.queue_records.items():
            txn.put(name.encode(), self._pack(record), db=db["queues"])
        for queue_id in batch.stream_resets:
            delete_prefix(txn.cursor(db=db["streams"]), queue_prefix(queue_id))
        for queue_id, key, stream in batch.stream_puts:
            if stream is None:
                txn.delete(queue_prefix(queue_id) + key.encode(), db=db["streams"])
            else:
                txn.put(queue_prefix(queue_id) + key.encode(), self._pack(stream), db=db["streams"])
        for name, epoch in batch.epochs.items():
            txn.put(name.encode(), Q.pack(epoch), db=db["epochs"])
        for client_id, client in batch.client_puts.items():
            txn.put(client_id.encode(), json.dumps(client).encode(), db=db["clients"])
        for client_id in batch.client_deletes:
            txn.delete(client_id.encode(), db=db["clients"])
        if batch.next_queue_id is not None:
            txn.put(b"next_queue_id", Q.pack(batch.next_queue_id), db=db["meta"])
        self._bound.truncate(txn, batch.log_floors, self._consumed, self._resolve)
        if batch.housekeeping_ms is not None:
            self._housekeeper.run(txn, batch.housekeeping_ms, batch.dedupe_window_ms, batch.status_retention_ms)
        return self._read_payloads()

    def _entry_payloads(self) -> EntryPayloads:
        if self._payloads is None:
            self._payloads = EntryPayloads(self.txn, self.db["oplog"])
        return self._payloads

    def _resolve(self, queue_id: int, index: int, held: bytes | int) -> bytes:
        return self._entry_payloads().resolve(queue_id, index, held)

    def _read_payloads(self) -> tuple[list[bytes | None], list[dict[str, str] | None]]:
        txn, db, reads = self.txn, self.db, self.batch.payload_reads
        payloads: list[bytes | None] = []
        headers: list[dict[str, str] | None] = []
        if not reads:
            return payloads, headers
        messages, resolve = db["messages"], self._entry_payloads().resolve
        for queue_id, index in reads:
            raw = txn.get(QI.pack(queue_id, index), db=messages)
            payloads.append(None if raw is None else resolve(queue_id, index, msgpack.unpackb(raw)[4]))
        if txn.stat(db["headers"])["entries"]:
            found = dict(txn.cursor(db=db["headers"]).getmulti([QI.pack(q, i) for q, i in reads]))
            headers = [None if (raw := found.get(QI.pack(q, i))) is None else msgpack.unpackb(raw) for q, i in reads]
        return payloads, headers

    # --- the batch's operations ------------------------------------------------------------
    def _apply_operations(self) -> None:
        """Each operation's rows and journal record, with the journal marks where they happened."""
        operations = self.batch.operations
        position, count = 0, len(operations)
        journaled = self.journal_enabled
        marks = self.batch.journal_marks if journaled else []
        next_mark = 0
        apply = self._APPLY
        while position < count:
            while next_mark < len(marks) and marks[next_mark][0] <= position:
                self._journal_mark(marks[next_mark][1])
                next_mark += 1
            if type(operations[position]) is Enqueued:
                stop = marks[next_mark][0] if next_mark < len(marks) else count
                position = self._apply_enqueue_run(operations, position, stop)
                continue
            op = operations[position]
            apply[type(op)](self, op)  # type: ignore[operator]
            if journaled:
                self._journal(op)
            position += 1
        for _, mark in marks[next_mark:]:
            self._journal_mark(mark)

    def _apply_enqueue_run(self, operations: list[Operation], start: int, stop: int) -> int:
        """Store a run of consecutive enqueues with one putmulti per database: most of a
        producer's batch is such a run, and this keeps the per-message Python work small.
        The journal takes one run record (replication/journal.py) for each stretch of
        the run that shares queue, time, priority and client with consecutive indices."""
        messages: list[tuple[bytes, bytes]] = []
        ready: list[tuple[bytes, bytes]] = []
        dedupe: list[tuple[bytes, bytes]] = []
        ttls: list[tuple[bytes, bytes]] = []
        delays: list[tuple[bytes, bytes]] = []
        headers: list[tuple[bytes, bytes]] = []
        pack, qi, qpi, q, crc32 = self._pack, QI.pack, QPI.pack, Q.pack, zlib.crc32
        journaled = self.journal_enabled
        runs: list[list[Any]] = []      # as _put_journal_runs takes them
        current: list[Any] | None = None
        names, replicas = self._names, self._replicas
        end = start
        entry_ends, half_hold = self._entry_ends, self._bound.payload_hold_bytes // 2
        kept_by_queue = self._bound.kept_by_queue
        for queue_id in entry_ends:
            if kept_by_queue.get(queue_id, 0) > half_hold:
                entry_ends[queue_id] = []
        waiting = self._ready_counts
        for op in operations[start:stop]:
            if type(op) is not Enqueued:
                break
            payload = op.payload
            # The payload's one copy is the entry of this batch that holds the enqueue (the
            # entry ending at or after its index). A queue without an op log keeps it here, and
            # so does a backlog (ready messages or kept records past half the hold): its
            # entries would only have their payloads moved out later.
            ends = entry_ends.get(op.queue_id)
            while ends and ends[0][1] < op.index:
                del ends[0]
            if not ends or ends[0][0] > op.index or waiting.get(op.queue_id, 0) * len(payload) > half_hold:
                held: bytes | int = payload
            else:
                held = ends[0][1]
            messages.append((qi(op.queue_id, op.index), pack([op.priority, op.enqueued_ms, op.dedupe_id, op.client, held])))
            if op.delay_ms:
                delays.append((qi(op.queue_id, op.index), TTL.pack(op.priority, op.delay_ms)))
            else:
                ready.append((qpi(op.queue_id, op.priority, op.index), b""))
            if op.dedupe_id is not None:
                dedupe.append((q(op.queue_id) + producer_key(op.client, op.dedupe_id).encode(),
                               qi(op.index, op.enqueued_ms)))
            if op.ttl_ms:
                ttls.append((qi(op.queue_id, op.index), TTL.pack(op.priority, op.ttl_ms)))
            if op.headers:
                headers.append((qi(op.queue_id, op.index), pack(op.headers)))
            if journaled:
                size, crc = len(payload), crc32(payload)
                if current is not None:
                    head = current[0]
                    if op.queue_id != head[2] or op.index != head[6] + current[1] or op.enqueued_ms != head[0] \
                            or op.priority != head[8] or op.client != head[13]:
                        current = None
                if current is None:
                    name, epoch = names.get(op.queue_id, ("", 0))
                    current = [[op.enqueued_ms, name, op.queue_id, epoch, op.index, "enqueue", op.index, op.dedupe_id,
                                op.priority, size, crc, "replica" if op.queue_id in replicas else "master",
                                self.node_id, op.client], 0, [], [], []]
                    runs.append(current)
                current[1] += 1
                current[2].append(op.dedupe_id)
                current[3].append(size)
                current[4].append(crc)
                if op.delay_ms:
                    # The audit must know the message is not ready: a journal-only record (no
                    # ordering index) right after its enqueue; the next enqueue starts a new run.
                    head = current[0]
                    runs.append([[op.enqueued_ms, head[1], op.queue_id, head[3], 0, "delay", op.index, None,
                                  op.priority, 0, 0, head[11], self.node_id, op.client], 1, [None], [0], [0]])
                    current = None
            end += 1
        txn, db = self.txn, self.db
        txn.cursor(db=db["messages"]).putmulti(messages)
        txn.cursor(db=db["ready"]).putmulti(ready)
        if dedupe:
            txn.cursor(db=db["dedupe"]).putmulti(dedupe)
        if ttls:
            txn.cursor(db=db["ttl"]).putmulti(ttls)
        if delays:
            txn.cursor(db=db["delayed"]).putmulti(delays)
        if headers:
            txn.cursor(db=db["headers"]).putmulti(headers)
        if runs:
            self._put_journal_runs(runs)
        return end

    def _apply_leased(self, op: Leased) -> None:
        txn, db = self.txn, self.db
        if not txn.delete(QPI.pack(op.queue_id, op.priority, op.index), db=db["ready"]):
            raise InvariantViolation(f"leased message {op.queue_id}/{op.index} was not ready")
        txn.put(QI.pack(op.queue_id, op.index),
                self._pack([op.priority, op.receipt, op.visibility_ms, op.deliveries, op.leased_ms]), db=db["leases"])

    def _apply_extended(self, op: Extended) -> None:
        txn, leases = self.txn, self.db["leases"]
        key = QI.pack(op.queue_id, op.index)
        raw = txn.get(key, db=leases)
        if raw is None:
            raise InvariantViolation(f"extended message {op.queue_id}/{op.index} is not leased")
        priority, receipt, _, deliveries, leased_ms = msgpack.unpackb(raw)
        if receipt != op.receipt:
            raise InvariantViolation(f"extended message {op.queue_id}/{op.index} is leased under another receipt")
        txn.put(key, self._pack([priority, receipt, op.visibility_ms, deliveries, leased_ms]), db=leases)

    def _apply_purged(self, op: Purged) -> None:
        self._take_out(op, "purged", delayed=op.delayed)

    def _apply_expired(self, op: Expired) -> None:
        self._take_out(op, "expired")

    def _take_out(self, op: Purged | Expired, state: str, *, delayed: bool = False) -> None:
        """An operator's purge or an expiry: the message leaves for good from where it waits."""
        txn, db = self.txn, self.db
        self._consumed.add(op.queue_id)
        key = QI.pack(op.queue_id, op.index)
        if delayed:
            removed = txn.delete(key, db=db["delayed"])
        elif op.leased:
            removed = txn.delete(key, db=db["leases"])
        else:
            removed = txn.delete(QPI.pack(op.queue_id, op.priority, op.index), db=db["ready"])
        if not removed:
            raise InvariantViolation(f"{state} message {op.queue_id}/{op.index} was not "
                                     f"{'delayed' if delayed else 'leased' if op.leased else 'ready'}")
        producer = self._producer_of(key) if op.track_status else None
        self._forget_message(key)
        if op.track_status:
            self._put_status(op.queue_id, op.index, state, op.at_ms, None, producer)

    def _apply_matured(self, op: Matured) -> None:
        txn, db = self.txn, self.db
        if not txn.delete(QI.pack(op.queue_id, op.index), db=db["delayed"]):
            raise InvariantViolation(f"matured message {op.queue_id}/{op.index} was not delayed")
        txn.put(QPI.pack(op.queue_id, op.priority, op.index), b"", db=db["ready"])

    def _apply_acked(self, op: Acked) -> None:
        self._consumed.add(op.queue_id)
        key = QI.pack(op.queue_id, op.index)
        self.txn.delete(key, db=self.db["leases"])
        producer = self._producer_of(key) if op.track_status else None
        self._forget_message(key)
        if op.track_status:
            self._put_status(op.queue_id, op.index, "replied" if op.reply is not None else "acked",
                             op.acked_ms, op.reply, producer)

    def _forget_message(self, key: bytes) -> None:
        """A message leaves for good: its row and the rows that only describe it."""
        txn, db = self.txn, self.db
        txn.delete(key, db=db["messages"])
        txn.delete(key, db=db["ttl"])
        txn.delete(key, db=db["headers"])

    def _apply_released(self, op: Released) -> None:
        self.txn.delete(QI.pack(op.queue_id, op.index), db=self.db["leases"])
        self.txn.put(QPI.pack(op.queue_id, op.priority, op.index), U32.pack(op.deliveries), db=self.db["ready"])

    def _apply_dead_lettered(self, op: DeadLettered) -> None:
        txn, db = self.txn, self.db
        key = QI.pack(op.queue_id, op.index)
        self._consumed.add(op.queue_id)
        if op.leased:
            txn.delete(key, db=db["leases"])
        elif not txn.delete(QPI.pack(op.queue_id, op.priority, op.index), db=db["ready"]):
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} was not ready")
        txn.delete(key, db=db["ttl"])
        raw = txn.pop(key, db=db["messages"])
        if raw is None:
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} has no body")
        priority, _, _, client, held = msgpack.unpackb(raw)
        payload = self._resolve(op.queue_id, op.index, held)
        txn.put(QI.pack(op.dead_letter_queue_id, op.dead_letter_index),
                self._pack([priority, op.at_ms, None, client, payload]), db=db["messages"])
        txn.put(QPI.pack(op.dead_letter_queue_id, priority, op.dead_letter_index), b"", db=db["ready"])
        headers = txn.pop(key, db=db["headers"])
        if headers is not None:             # they go with the message
            txn.put(QI.pack(op.dead_letter_queue_id, op.dead_letter_index), headers, db=db["headers"])
        if op.track_status:
            self._put_status(op.queue_id, op.index, "dead_lettered", op.at_ms, None, str(client))

    def _apply_in_record(self, op: Operation) -> None:
        """Durable subscriptions are queue state in the queue's record, written with the batch."""

    _APPLY = {Leased: _apply_leased, Extended: _apply_extended, Acked: _apply_acked, Purged: _apply_purged,
              Expired: _apply_expired, Matured: _apply_matured,
              Released: _apply_released, DeadLettered: _apply_dead_lettered,
              SubscriptionOpened: _apply_in_record, SubscriberAcked: _apply_in_record,
              SubscriptionDropped: _apply_in_record}

    def _producer_of(self, key: bytes) -> str | None:
        """The client in a message row, read before the row goes: its completion status keeps it."""
        raw = self.txn.get(key, db=self.db["messages"])
        return None if raw is None else str(msgpack.unpackb(raw)[3])

    def _put_status(self, queue_id: int, index: int, state: str, at_ms: int, reply: bytes | None,
                    producer: str | None) -> None:
        # The producer goes with the status: only it (or an admin) may read the status and the
        # reply once the message row is gone (docs/PROTOCOL.md, "Grants"; issue 32, item 13).
        self.txn.put(QI.pack(queue_id, index), self._pack([state, at_ms, reply, producer]), db=self.db["status"])
        self.txn.put(EXPIRY.pack(EXPIRY_STATUS, at_ms, queue_id) + Q.pack(index), b"", db=self.db["expiry"])

    # --- a deposed master's suffix, a snapshot's rows ----------------------------------------
    def _truncate(self, queue_id: int, order: int) -> None:
        """Erase a queue's messages (with their ready and dedupe rows) and op-log rows past
        `order`: an uncommitted suffix (see CommitPipeline.discard_uncommitted). Unjournaled: the
        member's epoch record, whose base is `order`, says where its stream goes on."""
        txn, db = self.txn, self.db
        cursor = txn.cursor(db=db["messages"])
        cursor.set_range(QI.pack(queue_id, order + 1))
        while (key := cursor.key()) and QI.unpack(key)[0] == queue_id:     # b"": past the end
            index = QI.unpack(key)[1]
            priority, _, dedupe_id, producer, _ = msgpack.unpackb(cursor.value())
            txn.delete(QPI.pack(queue_id, priority, index), db=db["ready"])
            txn.delete(key, db=db["ttl"])
            txn.delete(key, db=db["delayed"])
            txn.delete(key, db=db["headers"])
            if dedupe_id is not None:
                dedupe_key = Q.pack(queue_id) + producer_key(producer, dedupe_id).encode()
                kept = txn.get(dedupe_key, db=db["dedupe"])
                if kept is not None and QI.unpack(kept)[0] == index:
                    txn.delete(dedupe_key, db=db["dedupe"])
            cursor.delete()          # moves to the next record
        cursor = txn.cursor(db=db["oplog"])
        cursor.set_range(QI.pack(queue_id, order + 1))
        while (key := cursor.key()) and QI.unpack(key)[0] == queue_id:
            cursor.delete()

    def _put_snapshot_rows(self, queue_id: int, dead_letter_queue_id: int | None, rows: list[Any]) -> None:
        """A replica stores a snapshot's rows as they arrive (replication/snapshot.py); they
        count as its state only once the snapshot is installed. Each message is journaled as
        `snapshot` (or `snapshot_lease`), so the audit knows what the member took over; a run
        of them is one run record, as a producer's batch is."""
        pack, qi, qpi, crc32 = self._pack, QI.pack, QPI.pack, zlib.crc32
        journaled = self.journal_enabled
        messages: list[tuple[bytes, bytes]] = []
        ready: list[tuple[bytes, bytes]] = []
        leases: list[tuple[bytes, bytes]] = []
        dedupe: list[tuple[bytes, bytes]] = []
        ttls: list[tuple[bytes, bytes]] = []
        delays: list[tuple[bytes, bytes]] = []
        headers: list[tuple[bytes, bytes]] = []
        runs: list[list[Any]] = []
        run: list[Any] | None = None
        for row in rows:
            if row[0] == ROW_DEDUPE:
                dedupe.append((Q.pack(queue_id) + row[1].encode(), qi(row[2], row[3])))
                continue
            owner = queue_id if row[0] == ROW_MESSAGE else dead_letter_queue_id
            if owner is None:
                raise InvariantViolation(f"snapshot of queue {queue_id} has dead letters but no dead-letter queue")
            _, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease, ttl_ms, delay_ms, named = row
            messages.append((qi(owner, index), pack([priority, enqueued_ms, dedupe_id, client, payload])))
            if named:
                headers.append((qi(owner, index), pack(named)))
            if ttl_ms:
                ttls.append((qi(owner, index), TTL.pack(priority, ttl_ms)))
            if lease is None and delay_ms:
                delays.append((qi(owner, index), TTL.pack(priority, delay_ms)))
            elif lease is None:
                ready.append((qpi(owner, priority, index), U32.pack(deliveries) if deliveries else b""))
            else:
                leases.append((qi(owner, index), pack([priority, lease[0], lease[1], deliveries, lease[2]])))
            if journaled:
                # One record per run of consecutive messages that share time, priority,
                # client and kind (a producer's batch, as the master journaled it); a
                # snapshot's rows have no ordering index (0).
                kind, size, crc = "snapshot" if lease is None else "snapshot_lease", len(payload), crc32(payload)
                if run is not None:
                    head = run[0]
                    if head[6] + run[1] != index or head[2] != owner or head[0] != enqueued_ms \
                            or head[8] != priority or head[13] != client or head[5] != kind:
                        run = None
                if run is None:
                    name, epoch = self._names.get(owner, ("", 0))
                    run = [[enqueued_ms, name, owner, epoch, 0, kind, index, dedupe_id, priority, size, crc,
                            "replica", self.node_id, client], 0, [], [], []]
                    runs.append(run)
                run[1] += 1
                run[2].append(dedupe_id)
                run[3].append(size)
                run[4].append(crc)
                if lease is None and delay_ms:      # not ready yet, as after its enqueue
                    runs.append([[enqueued_ms, run[0][1], owner, run[0][3], 0, "delay", index, None, priority, 0, 0,
                                  "replica", self.node_id, client], 1, [None], [0], [0]])
                    run = None
        ready.sort()
        for name, puts in (("messages", messages), ("ready", ready), ("leases", leases), ("dedupe", dedupe),
                           ("ttl", ttls), ("delayed", delays), ("headers", headers)):
            if puts:
                put_in_order(self.txn.cursor(db=self.db[name]), puts)
        if runs:
            self._put_journal_runs(runs)

    # --- the journal (docs/AUDIT.md; its fields: replication/journal.py JOURNAL_FIELDS) --------
    def _journal(self, op: Operation) -> None:
        """One checksummed journal record for a step other than an enqueue (those: _apply_enqueue_run)."""
        name, epoch = self._names.get(op.queue_id, ("", 0))
        role = "replica" if op.queue_id in self._replicas else "master"
        record = self._pack(_journal_fields(op, name, epoch, self.node_id, role))
        self.journal_sequence += 1
        self.txn.put(Q.pack(self.journal_sequence), record + U32.pack(zlib.crc32(record)), db=self.db["journal"],
                     append=True)   # sequence numbers only grow: skip the search

    def _journal_mark(self, fields: list[Any]) -> None:
        record = self._pack(fields)
        self.journal_sequence += 1
        self.txn.put(Q.pack(self.journal_sequence), record + U32.pack(zlib.crc32(record)), db=self.db["journal"],
                     append=True)   # sequence numbers only grow: skip the search

    def _put_journal_runs(self, runs: list[list[Any]]) -> None:
        """Each run: [its first row's fields, count, dedupe ids, payload sizes, crc32s], stored
        as one record (a run record when it has more than one row)."""
        pack, sequence, rows = self._pack, self.journal_sequence, []
        for fields, count, dedupe_ids, sizes, crcs in runs:
            record = pack(fields + [RUN_MARK, count, dedupe_ids, sizes, crcs] if count > 1 else fields)
            sequence += count          # the record takes its rows' sequences; stored under the last
            rows.append((Q.pack(sequence), record + U32.pack(zlib.crc32(record))))
        self.txn.cursor(db=self.db["journal"]).putmulti(rows, append=True)
        self.journal_sequence = sequence


def _journal_fields(op: Operation, name: str, epoch: int, node: str, role: str) -> list[Any]:
    """The journal row of a consumption step; `index` is its ordering index (0 when local)."""
    if isinstance(op, Leased):
        return [op.leased_ms, name, op.queue_id, epoch, op.order, "lease", op.index, None, op.priority,
                0, 0, role, node, op.client]
    if isinstance(op, Extended):
        return [op.at_ms, name, op.queue_id, epoch, op.order, "extend", op.index, None, op.priority,
                0, 0, role, node, op.client]
    if isinstance(op, Acked):
        return [op.acked_ms, name, op.queue_id, epoch, op.order, "reply" if op.reply is not None else "ack",
                op.index, None, op.priority, 0, 0, role, node, op.client]
    if isinstance(op, Released):
        return [op.at_ms, name, op.queue_id, epoch, op.order, "expire" if op.expired else "release", op.index,
                None, op.priority, 0, 0, role, node, ""]
    if isinstance(op, SubscriberAcked | SubscriptionOpened | SubscriptionDropped):
        # The subscription's name rides in the dedupe id's column; an ack names its message.
        return [op.at_ms, name, op.queue_id, epoch, op.order, _SUBSCRIPTION_JOURNAL_OPS[type(op)],
                op.index if isinstance(op, SubscriberAcked) else 0, op.subscription, 0, 0, 0, role, node, op.client]
    journal_op = _UNCLIENTED_JOURNAL_OPS.get(type(op))
    if journal_op is None:
        raise InvariantViolation(f"no journal form for {type(op).__name__}")
    return [op.at_ms, name, op.queue_id, epoch, op.order, journal_op, op.index, None,  # type: ignore[union-attr]
            op.priority, 0, 0, role, node, ""]


# Steps the node decides on its own (an operator's purge, timed steps): no client in the record.
_UNCLIENTED_JOURNAL_OPS: dict[type, str] = {Purged: "purge", DeadLettered: "dead_letter", Expired: "ttl_expire",
                                            Matured: "mature"}


_SUBSCRIPTION_JOURNAL_OPS: dict[type, str] = {SubscriptionOpened: "subscribe", SubscriberAcked: "subscriber_ack",
                                              SubscriptionDropped: "unsubscribe"}
