"""LMDB storage of one node: the only module that opens its environment.

One environment per node, named databases per kind of record (rows.py lays them out). Writes
happen only in `commit`, which the node's single writer thread runs for one sealed batch at a
time: every operation of the batch, the queue records it touched and their journal records go
into one transaction, fsync'd once (group commit); commit.py's `BatchWriter` does one
transaction's work. Reads of committed state (`ready_page`, `dedupe_lookup`, the op log as the
replication roles read it) run on the event loop's thread in short read transactions.

The op log is bounded and a payload is stored once (log_bound.py). A snapshot's state is cut
from one read transaction (`open_snapshot`, snapshot_view.py) and installed on the replica as
rows (`SealedBatch.snapshot_rows`) and, once complete, a mark at its order
(`SealedBatch.snapshot_installs`). Room on the disk and in the map: space.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import time
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from qserver.storage.batch import CommitResult, SealedBatch
from qserver.storage.commit import BatchWriter
from qserver.storage.housekeeping import Housekeeper
from qserver.storage.log_bound import LogBound
from qserver.storage.migrate import StorageLayoutError, migrate, stamp
from qserver.storage.rows import (
    DB_NAMES,
    ENTRY_AT,
    LOG_START,
    QI,
    QPI,
    SCHEMA_VERSION,
    TTL,
    U32,
    EntryPayloads,
    Q,
    last_logged,
    queue_prefix,
    streams_of,
)
from qserver.storage.snapshot_view import LmdbSnapshotView
from qserver.storage.space import MapGrowthNeeded, StorageFull, StorageSpace, disk_full, grown_map_size, measure_space
from replication.digest import DIGEST_BYTES, EMPTY_DIGEST
from replication.invariants import InvariantViolation
from replication.journal import is_run, run_rows
from replication.queue_core import QueueRecord, sequences_from_json
from replication.store import StoredLease

# Each snapshot being sent holds an LMDB read transaction, one of the environment's reader
# slots (READERS_MAX): a node that many replicas open at once (its peer back after a failover
# of hundreds of queues) sends this many at a time, the others open again shortly (issue 31:
# 660 at once took every slot, and the engine died on MDB_READERS_FULL).
READERS_MAX = 256
SNAPSHOT_VIEWS_MAX = 64


def _owner_only(path: Path, mode: int) -> None:
    """Take group and other permissions off a file or directory of ours that has them (one
    created before this node asked for owner-only modes, or under a loose umask)."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_mode & 0o077:
            os.chmod(path, mode)


class Storage:
    def __init__(self, path: str | Path, *, node_id: str, map_size_bytes: int = 1 << 30,
                 map_size_max_bytes: int = 1 << 40, journal_enabled: bool = True,
                 disk_reserve_bytes: int = 64 << 20, payload_hold_bytes: int = 64 << 20) -> None:
        self.path = Path(path)
        # Owner only (issue 32): the environment holds every payload, the client registry and
        # the Raft log (a forward's remote credential among its commands).
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _owner_only(self.path, 0o700)
        self.node_id = node_id
        self.map_size_max_bytes = map_size_max_bytes
        self.journal_enabled = journal_enabled
        self.disk_reserve_bytes = disk_reserve_bytes
        self.env = lmdb.open(str(self.path), map_size=min(map_size_bytes, map_size_max_bytes),
                             max_dbs=len(DB_NAMES) + 2, sync=True, metasync=True, writemap=False,
                             max_readers=READERS_MAX, readahead=False, mode=0o600)
        for name in ("data.mdb", "lock.mdb"):       # created before 0600 was asked for
            _owner_only(self.path / name, 0o600)
        self.db = {name: self.env.open_db(name.encode()) for name in DB_NAMES}
        self.snapshot_views_open = 0        # loop thread (open_snapshot, LmdbSnapshotView.close)
        self.snapshot_views_deferred = 0
        self.snapshot_views_lost = 0        # views a map growth ended (their transfers start over)
        # The open views (loop thread): a map growth ends their read transactions (grow_map).
        self._views: weakref.WeakSet[LmdbSnapshotView] = weakref.WeakSet()
        # The writer thread's state across commits (each commit's own lives on its BatchWriter):
        # the journal's last sequence, the op log's truncations and kept records, the dedupe sweep.
        self._journal_sequence = 0
        # msgpack.packb builds a Packer per call, which costs more than packing a small record;
        # this one is used by the writer thread only (commit), so it is never shared.
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._log_bound = LogBound(self.db, self._pack, payload_hold_bytes)
        self._housekeeper = Housekeeper(self.db)
        self._read_txn: lmdb.Transaction | None = None
        try:
            self._check_schema()
        except BaseException:       # refused or failed: the environment is not left open in this process
            self.env.close()
            raise

    # --- lifecycle -------------------------------------------------------------------------
    def _check_schema(self) -> None:
        # An older layout is migrated to ours before anything reads a row, a newer one refused
        # (migrate.py; docs/OPERATIONS.md, "Storage layouts and migration").
        for _ in range(16):
            try:
                report = migrate(self.env, self.db, str(self.path), target=SCHEMA_VERSION, readable=SCHEMA_VERSION)
                break
            except lmdb.MapFullError:       # the step stored nothing: grow the map, run it again
                self.env.set_mapsize(grown_map_size(self.map_size(), self.map_size_max_bytes, self.path,
                                                    self.disk_reserve_bytes))
        else:
            raise StorageFull(f"the storage migration of {self.path} does not fit in the map")
        self.migrated = report.steps
        with self.env.begin(write=True, db=self.db["meta"]) as txn:
            stored = txn.get(b"schema_version")
            if stored is None:
                txn.put(b"schema_version", Q.pack(SCHEMA_VERSION))
                txn.put(b"node_id", self.node_id.encode())
            if txn.get(b"storage_id") is None:
                # Who this disk is: a node that comes back with another one lost its data, and
                # the membership layer must not count it as an in-sync replica (cluster_map.AddNode).
                txn.put(b"storage_id", Q.pack(int.from_bytes(os.urandom(8), "big") >> 1 or 1))
            if stored is not None and Q.unpack(stored)[0] != SCHEMA_VERSION:     # migrate() refuses first
                raise StorageLayoutError(f"the data directory {self.path} holds storage layout "
                                         f"{Q.unpack(stored)[0]}, not {SCHEMA_VERSION}")
            self.storage_id = int(Q.unpack(txn.get(b"storage_id") or b"")[0])
            # The journal's last key is its sequence; meta keeps it only for a journal that the
            # exporter's prune emptied (a commit does not write it: one page less per fsync).
            sequence = txn.get(b"journal_sequence")
            last = txn.cursor(db=self.db["journal"])
            self._journal_sequence = max(Q.unpack(sequence)[0] if sequence else 0,
                                         Q.unpack(last.key())[0] if last.last() else 0)
        stamp(self.env, self.db["meta"], SCHEMA_VERSION)

    def close(self) -> None:
        self.end_read()
        self.env.close()

    # --- room (space.py) -------------------------------------------------------------------
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def space(self) -> StorageSpace | None:
        """What is left (loop thread; a few stat calls: the engine asks a few times a second).
        None when it cannot be read (the engine keeps what it last knew)."""
        return measure_space(self.env, list(self.db.values()), self.path, self.map_size_max_bytes)

    def disk_full(self) -> bool:
        return disk_full(self.path)

    @contextlib.contextmanager
    def space_errors(self) -> Iterator[None]:
        """LMDB's refusals for lack of space, as ours: the map's end (MapGrowthNeeded: grow it
        and write again) and a full disk (StorageFull). Nothing of the transaction was stored."""
        try:
            yield
        except lmdb.MapFullError:
            raise MapGrowthNeeded() from None
        except lmdb.Error as error:
            if "No space left" in str(error) or self.disk_full():
                raise StorageFull(f"the disk holding {self.path} is full ({error})") from error
            raise

    def grow_map(self) -> int:
        """Double the map (loop thread, no transaction open), or grow it as far as the disk
        allows beside its reserve. Raises StorageFull when it cannot grow at all."""
        target = grown_map_size(self.map_size(), self.map_size_max_bytes, self.path, self.disk_reserve_bytes)
        # py-lmdb ends every transaction of the environment when the map is resized: the cached
        # read goes (the next read opens a new one), and each snapshot view being sent is lost
        # (issue 32, item 8: its next chunk raised lmdb.Error in the engine, and the node exited).
        # Its transfer starts over from a new view (MasterRole._pump_snapshot).
        self.end_read()
        for view in list(self._views):
            view.lose()
            self.snapshot_views_lost += 1
        self._views.clear()
        self.env.set_mapsize(target)
        return target

    # --- loading at start ------------------------------------------------------------------
    def load_queue_records(self) -> list[QueueRecord]:
        with self.env.begin(db=self.db["queues"]) as txn:
            records = [QueueRecord.from_json(msgpack.unpackb(value)) for _, value in txn.cursor()]
            streams = txn.cursor(db=self.db["streams"])
            for record in records:
                record.sequences.update(sequences_from_json(streams_of(streams, record.queue_id)))
            return records

    def load_leases(self, queue_id: int) -> list[StoredLease]:
        prefix = queue_prefix(queue_id)
        leases = []
        with self.env.begin(db=self.db["leases"]) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    priority, receipt, visibility_ms, deliveries, leased_ms = msgpack.unpackb(value)
                    leases.append(StoredLease(QI.unpack(key)[1], priority, receipt, visibility_ms,
                                              deliveries, leased_ms))
        return leases

    def load_clients(self) -> dict[str, dict[str, Any]]:
        with self.env.begin(db=self.db["clients"]) as txn:
            return {key.decode(): json.loads(value) for key, value in txn.cursor()}

    def next_queue_id(self) -> int:
        with self.env.begin(db=self.db["meta"]) as txn:
            raw = txn.get(b"next_queue_id")
        return Q.unpack(raw)[0] if raw else 1

    @property
    def housekeeping_behind(self) -> bool:
        """The last housekeeping pass left more to prune than a pass does (housekeeping.py)."""
        return self._housekeeper.behind

    # --- committed reads (loop thread) -----------------------------------------------------
    def begin_read(self) -> None:
        """Open the read transaction that reads use until `end_read` (one per step cycle)."""
        if self._read_txn is None:
            self._read_txn = self.env.begin()

    @contextlib.contextmanager
    def reads(self) -> Iterator[Storage]:
        """Reads outside the engine's step (a read transaction of their own), or within one
        that holds its read already."""
        if self._read_txn is not None:
            yield self
            return
        self.begin_read()
        try:
            yield self
        finally:
            self.end_read()

    @property
    def reading(self) -> bool:
        return self._read_txn is not None

    def end_read(self) -> None:
        if self._read_txn is not None:
            self._read_txn.abort()
            self._read_txn = None

    def _reader(self) -> lmdb.Transaction:
        if self._read_txn is None:
            self.begin_read()
        return self._read_txn  # type: ignore[return-value]

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        rows: list[tuple[int, int]] = []
        cursor = self._reader().cursor(db=self.db["ready"])
        if not cursor.set_range(QPI.pack(queue_id, priority, after_index + 1)):
            return rows
        for key, value in cursor:
            owner, key_priority, index = QPI.unpack(key)
            if owner != queue_id or key_priority != priority or index >= before_index or len(rows) >= limit:
                break
            rows.append((index, U32.unpack(value)[0] if value else 0))
        return rows

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        raw = self._reader().get(Q.pack(queue_id) + dedupe_id.encode(), db=self.db["dedupe"])
        return None if raw is None else QI.unpack(raw)  # type: ignore[return-value]

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        """One C call for a whole batch (a get per id costs a GIL round trip each while the
        writer thread runs)."""
        prefix = Q.pack(queue_id)
        found = self._reader().cursor(db=self.db["dedupe"]).getmulti([prefix + i.encode() for i in dedupe_ids])
        skip = len(prefix)
        return {bytes(key[skip:]).decode(): QI.unpack(value) for key, value in found}  # type: ignore[misc]

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, ttl_ms) of the queue's committed messages with a time to live."""
        return self._timed_rows("ttl", queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, delay_ms) of the queue's committed messages still delayed."""
        return self._timed_rows("delayed", queue_id)

    def _timed_rows(self, name: str, queue_id: int) -> list[tuple[int, int, int]]:
        prefix = queue_prefix(queue_id)
        cursor = self._reader().cursor(db=self.db[name])
        rows: list[tuple[int, int, int]] = []
        if cursor.set_range(prefix):
            for key, value in cursor:
                if bytes(key[:8]) != prefix:
                    break
                rows.append((QI.unpack(key)[1], *TTL.unpack(value)))
        return rows

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        """Completed status, or 'delivered'/'delayed'/'queued' from the lease, delay and message rows."""
        txn = self._reader()
        key = QI.pack(queue_id, index)
        raw = txn.get(key, db=self.db["status"])
        if raw is not None:
            row = msgpack.unpackb(raw)       # [state, at_ms, reply] or, since issue 32, [..., producer]
            return row[0], 0, row[2]
        lease = txn.get(key, db=self.db["leases"])
        if lease is not None:
            return "delivered", msgpack.unpackb(lease)[3], None
        if txn.get(key, db=self.db["delayed"]) is not None:
            return "delayed", 0, None
        if txn.get(key, db=self.db["messages"]) is not None:
            return "queued", 0, None
        return None

    def status_producer(self, queue_id: int, index: int) -> str | None:
        """The client that enqueued a message whose status `message_status` reports: only it
        (or an admin of the queue) reads that status and its reply (docs/PROTOCOL.md, "Grants").
        From the completion status when there is one, else from the message row; None when
        neither names one (a status row written before status rows named their producer)."""
        txn = self._reader()
        key = QI.pack(queue_id, index)
        raw = txn.get(key, db=self.db["status"])
        if raw is not None:
            row = msgpack.unpackb(raw)
            return str(row[3]) if len(row) > 3 and row[3] is not None else None
        raw = txn.get(key, db=self.db["messages"])
        return None if raw is None else str(msgpack.unpackb(raw)[3])

    def newest_message(self, queue_id: int) -> tuple[int, bytes] | None:
        """(id, payload) of the queue's stored message with the highest id (a channel's last
        value), None when it holds none."""
        txn = self._reader()
        cursor = txn.cursor(db=self.db["messages"])
        # The key just before the next queue's first: this queue's last, if it has any.
        found = cursor.prev() if cursor.set_range(QI.pack(queue_id + 1, 0)) else cursor.last()
        if not found:
            return None
        owner, index = QI.unpack(bytes(cursor.key()))
        if owner != queue_id:
            return None
        held = msgpack.unpackb(cursor.value())[4]
        payload = held if type(held) is bytes else EntryPayloads(txn, self.db["oplog"]).resolve(queue_id, index, held)
        return index, bytes(payload)

    def messages_after(self, queue_id: int, after_index: int, limit: int) -> list[tuple[int, bytes]]:
        """(id, payload) of the queue's stored messages with id > after_index, lowest first, at
        most `limit` (a durable subscription's backlog, read a window at a time)."""
        txn = self._reader()
        cursor = txn.cursor(db=self.db["messages"])
        out: list[tuple[int, bytes]] = []
        if not cursor.set_range(QI.pack(queue_id, after_index + 1)):
            return out
        payloads = None
        for key, value in cursor:
            owner, index = QI.unpack(key)
            if owner != queue_id or len(out) >= limit:
                break
            held = msgpack.unpackb(value)[4]
            if type(held) is not bytes:
                payloads = payloads or EntryPayloads(txn, self.db["oplog"])
                held = payloads.resolve(queue_id, index, held)
            out.append((index, bytes(held)))
        return out

    def enqueued_ms(self, queue_id: int, index: int) -> int | None:
        """When a stored message was enqueued (the master's wall clock), None if not stored."""
        raw = self._reader().get(QI.pack(queue_id, index), db=self.db["messages"])
        return None if raw is None else int(msgpack.unpackb(raw)[1])

    def oldest_enqueued_ms(self, queue_ids: list[int]) -> dict[int, int]:
        """When each queue's oldest message still held (ready, leased or delayed) was enqueued:
        message ids grow in enqueue order, so it is the queue's first row of `messages`, one
        cursor seek per queue, no scan (qserver_queue_oldest_message_age_seconds, docs/OPERATIONS.md,
        "Monitoring"). A dead-letter queue's rows carry when they were dead-lettered. Queues that
        hold no message are left out."""
        cursor = self._reader().cursor(db=self.db["messages"])
        out: dict[int, int] = {}
        for queue_id in sorted(queue_ids):
            if not cursor.set_range(QI.pack(queue_id, 0)):
                break
            owner, _ = QI.unpack(cursor.key())
            if owner == queue_id:
                out[queue_id] = _enqueued_ms_of(cursor.value())
        return out

    def producer(self, queue_id: int, index: int) -> str | None:
        """The client that enqueued a stored message (its sender), None if not stored."""
        raw = self._reader().get(QI.pack(queue_id, index), db=self.db["messages"])
        return None if raw is None else str(msgpack.unpackb(raw)[3])

    # --- the op log, as the replication roles read it (OpLogReader) -----------------------
    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        out: list[tuple[int, int, bytes]] = []
        cursor = self._reader().cursor(db=self.db["oplog"])
        # Records below the log start may still be stored (kept for live payloads): not served.
        if not cursor.set_range(QI.pack(queue_id, max(after_order, self.first(queue_id) - 1, LOG_START) + 1)):
            return out
        size = 0
        for key, value in cursor:
            owner, order = QI.unpack(key)
            if owner != queue_id:
                break
            if len(value) > DIGEST_BYTES:        # a snapshot's mark carries no operation
                out.append((Q.unpack_from(value, DIGEST_BYTES)[0], order, bytes(value[ENTRY_AT:])))
                size += len(value) - ENTRY_AT
                if order - after_order >= limit or size >= bytes_max:
                    break
        return out

    def first(self, queue_id: int) -> int:
        raw = self._reader().get(QI.pack(queue_id, LOG_START), db=self.db["oplog"])
        return 0 if raw is None else Q.unpack(raw[DIGEST_BYTES:])[0]

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        if order == 0:
            return EMPTY_DIGEST
        if order < self.first(queue_id):
            return None          # a record kept below the log start for its payloads
        raw = self._reader().get(QI.pack(queue_id, order), db=self.db["oplog"])
        return None if raw is None else bytes(raw[:DIGEST_BYTES])

    def last(self, queue_id: int) -> tuple[int, bytes]:
        return last_logged(self._reader().cursor(db=self.db["oplog"]), queue_id)

    def read_client_payload(self, queue_id: int, index: int) -> bytes | None:
        txn = self._reader()
        raw = txn.get(QI.pack(queue_id, index), db=self.db["messages"])
        if raw is None:
            return None
        return EntryPayloads(txn, self.db["oplog"]).resolve(queue_id, index, msgpack.unpackb(raw)[4])

    # --- the one writer (writer thread) ----------------------------------------------------
    def commit(self, batch: SealedBatch) -> CommitResult:
        """Write the batch in one transaction (commit.py's BatchWriter says its steps' order).
        What the writer thread keeps across commits is kept only once the transaction
        committed: an aborted one (the map's end, which the engine grows and retries) stored
        nothing, and must neither leave a gap in the journal's sequence that the audit reports
        as a lost record (issue 32, item 9; docs/AUDIT.md) nor leave the op log's bound counting
        records it did not delete."""
        started = time.perf_counter()
        saved = self._log_bound.saved()
        try:
            with self.space_errors(), self.env.begin(write=True) as txn:
                writer = BatchWriter(txn, batch, db=self.db, pack=self._pack, node_id=self.node_id,
                                     journal_enabled=self.journal_enabled, journal_sequence=self._journal_sequence,
                                     log_bound=self._log_bound, housekeeper=self._housekeeper)
                payloads, headers = writer.write()
        except BaseException:
            self._log_bound.restore(saved)
            raise
        self._journal_sequence = writer.journal_sequence
        return CommitResult(payloads, time.perf_counter() - started, len(batch.operations), headers)

    @property
    def truncated_records(self) -> int:
        """Op-log records deleted below the floors (the node's metrics)."""
        return self._log_bound.truncated_records

    @property
    def moved_payloads(self) -> int:
        """Payloads moved from kept op-log records into their message rows."""
        return self._log_bound.moved_payloads

    @property
    def kept_bytes(self) -> int:
        """Op-log records below the floors kept for live payloads."""
        return self._log_bound.kept_bytes

    # --- snapshots being sent (loop thread) ------------------------------------------------
    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> LmdbSnapshotView | None:
        """A view of the queue's committed state in its own read transaction (loop thread);
        None when the queue has no record here, or while SNAPSHOT_VIEWS_MAX views are open
        (the replica opens again; `snapshot_views_deferred` counts those)."""
        if self.snapshot_views_open >= SNAPSHOT_VIEWS_MAX:
            self.snapshot_views_deferred += 1
            return None
        try:
            txn = self.env.begin()
        except lmdb.ReadersFullError:      # readers of other kinds took the slots: later, too
            self.snapshot_views_deferred += 1
            return None
        try:
            view = LmdbSnapshotView(self.db, txn, name, queue_id, consumption, after_index, dead_letter,
                                    self._view_closed)
        except KeyError:
            txn.abort()
            return None
        self.snapshot_views_open += 1
        self._views.add(view)
        return view

    def _view_closed(self, view: LmdbSnapshotView) -> None:
        self.snapshot_views_open -= 1
        self._views.discard(view)

    # --- inspection (tests, tools) ---------------------------------------------------------
    def journal_records(self) -> list[list[Any]]:
        """Every journal row, checksums verified, run records as their rows (as exported)."""
        records: list[list[Any]] = []
        with self.env.begin(db=self.db["journal"]) as txn:
            for _, value in txn.cursor():
                body, checksum = value[:-4], U32.unpack(value[-4:])[0]
                if zlib.crc32(body) != checksum:
                    raise InvariantViolation("journal record checksum mismatch")
                record = msgpack.unpackb(body)
                rows = run_rows(record) if is_run(record) else [record]
                if rows is None:
                    raise InvariantViolation(f"a malformed journal run record: {record[:16]}")
                records.extend(rows)
        return records

    def count(self, name: str) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self.db[name])["entries"])


def read_clients(path: str | Path) -> dict[str, dict[str, Any]]:
    """The client registry of another node's environment, read-only (it may be running)."""
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=len(DB_NAMES) + 2)
    try:
        with env.begin(db=env.open_db(b"clients", create=False)) as txn:
            return {key.decode(): json.loads(value) for key, value in txn.cursor()}
    finally:
        env.close()


_U64 = struct.Struct(">Q")


def _enqueued_ms_of(row: bytes | memoryview) -> int:
    """The enqueue time of a `messages` row (msgpack [priority, enqueued_ms, ...]) without
    unpacking its payload: a 5-array, a priority of one byte and a uint64 as a node writes
    them (half the cost of an Unpacker, which reads anything else)."""
    if row[0] == 0x95 and row[1] < 0x80 and row[2] == 0xCF:
        return int(_U64.unpack_from(row, 3)[0])
    unpacker = msgpack.Unpacker()
    unpacker.feed(bytes(row[:32]))
    unpacker.read_array_header()
    unpacker.skip()
    return int(unpacker.unpack())
