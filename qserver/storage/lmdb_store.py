"""LMDB storage of one node: the only module that opens its environment.

One environment per node, named databases per kind of record (below). Writes happen only in
`commit`, which the node's single writer thread runs for one sealed batch at a time: every
operation of the batch, the queue records it touched and their journal records go into one
transaction, fsync'd once (group commit). Reads of committed state (`ready_page`,
`dedupe_lookup`) run on the event loop's thread in short read transactions.

Key layout (big-endian integers so LMDB's byte order is numeric order):
    queues    name                                -> msgpack QueueRecord
    messages  queue_id:8 index:8                  -> msgpack [priority, enqueued_ms, dedupe_id, client, payload]
                                                     where payload is the bytes, or the last order of the
                                                     op-log entry that holds them (an int: see below)
    ready     queue_id:8 priority:1 index:8       -> deliveries so far (4 bytes, empty when 0)
    leases    queue_id:8 index:8                  -> msgpack [priority, receipt, visibility_ms, deliveries, leased_ms]
    status    queue_id:8 index:8                  -> msgpack [state, at_ms, reply, producer]   (completed
                                                     messages; rows written before issue 32 lack the producer)
    dedupe    queue_id:8 dedupe_id                -> index:8 enqueued_ms:8
    ttl       queue_id:8 index:8                  -> priority:1 ttl_ms:8   (live messages with a time to live)
    delayed   queue_id:8 index:8                  -> priority:1 delay_ms:8 (messages not ready until they mature:
                                                     no ready row meanwhile)
    headers   queue_id:8 index:8                  -> msgpack {name: value}  (messages that have headers)
    streams   queue_id:8 key                      -> msgpack [floor, [[number, message id], ...]]  (a producer's
                                                     numbered stream, replication/queue_core.py; the key
                                                     names its producer: replication/options.py producer_key)
    expiry    kind:1 at_ms:8 queue_id:8 index:8   -> ""   (completion statuses to prune, oldest first)
    doomed    queue_id:8                          -> ""   (deleted incarnations still being erased)
    epochs    name                                -> epoch:8
    journal   sequence:8                          -> msgpack record + crc32:4 (a producer's batch: one run
                                                     record under its last row's sequence,
                                                     replication/audit_checks.py RUN_MARK)
    oplog     queue_id:8 last order:8             -> digest:16 + first order:8 + encoded log entry (a run
                                                     of replicated operations, replication/oplog.py);
                                                     a snapshot's mark is the digest alone
              queue_id:8 0:8                      -> 0:16 + log start:8 (once truncated: records
                                                     below the start are gone)
    clients   client_id                           -> JSON client record
    meta      b"schema_version" | b"next_queue_id" | b"journal_sequence" | b"node_id" | b"storage_id"
              (journal_sequence: written by the journal's prune, which may empty the journal)
    raft_state, raft_log      the membership layer's Raft state (qserver/storage/raft_store.py reads and
                              writes them)

The op log is bounded: each batch carries the floor below which every member's needs are
met (`SealedBatch.log_floors`, see MasterRole.log_floor) and the writer deletes records below
it a bounded number at a time.

A payload is stored once. An enqueue's log entry carries its payload, so its message row
names the entry instead of holding a second copy (an entry of several operations: see
`_live_rows`); reads decode the entry (`_EntryPayloads`).
A record that goes below the floor while it holds a live message's payload is kept (no
longer part of the log: nothing below the log start is served or compared) and goes once
none of its messages is live, so a queue consumed about as fast as it is filled writes each
payload once. A backlog is bounded by `payload_hold_bytes`: a queue whose ready messages or
kept records pass half of it stores new payloads in their rows (twice, as a backlog's would
be anyway), and past the whole of it the oldest kept records' live payloads move into their
rows before they go. A snapshot's state is cut from one read transaction
(`open_snapshot`) and installed on the replica as rows (`snapshot_rows`) and, once complete,
a mark at its order (`snapshot_installs`).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import shutil
import struct
import time
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import lmdb
import msgpack

from replication.audit_checks import RUN_MARK, is_run, run_rows
from replication.digest import DIGEST_BYTES, EMPTY_DIGEST
from replication.invariants import InvariantViolation
from replication.messages import MessageError, decode_entry
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
from replication.queue_core import QueueRecord, sequences_from_json
from replication.snapshot import ROW_DEAD_LETTER, ROW_DEDUPE, ROW_MESSAGE, SnapshotViewLost
from replication.store import StoredLease

# 2: bounded op log (its start record at order 0, snapshot marks); no reader of layout 1.
# 3: the op log holds entries (runs of operations) keyed by their last order; no reader of 2.
# 4: a message row may name the op-log entry holding its payload instead; no reader of 3.
# 5: the membership layer's Raft state in raft_state and raft_log (qserver/storage/raft_store.py), not
#    in pysyncobj's journal files; no reader of 4.
# 6: a lease row (and a Leased operation in the op log) holds the lease's duration, not a
#    wall-clock deadline; no reader of 5.
# 7: messages with a time to live have a row in ttl (operations.Enqueued.ttl_ms), delayed ones a row
#    in delayed and none in ready until they mature, messages with headers a row in headers; no
#    reader of 6.
#    Within 7: numbered streams have rows of their own in streams (written when they change, not
#    with every batch that touches the queue); a record that still holds them is read as before
#    and its streams move to rows at its next write.
SCHEMA_VERSION = 7
_QI = struct.Struct(">QQ")
_QPI = struct.Struct(">QBQ")
_Q = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_EXPIRY = struct.Struct(">BQQ")
_TTL = struct.Struct(">BQ")
EXPIRY_STATUS = 1
DB_NAMES = ("queues", "messages", "ready", "leases", "status", "dedupe", "expiry", "doomed",
            "epochs", "journal", "clients", "meta", "oplog", "raft_state", "raft_log", "ttl", "delayed", "headers",
            "streams")
ERASE_KEYS_PER_BATCH_MAX = 5_000
PRUNE_KEYS_PER_BATCH_MAX = 5_000
TRUNCATE_RECORDS_PER_BATCH_MAX = 20_000     # op-log records deleted per batch (the rest follow)
# Each snapshot being sent holds an LMDB read transaction, one of the environment's reader
# slots (READERS_MAX): a node that many replicas open at once (its peer back after a failover
# of hundreds of queues) sends this many at a time, the others open again shortly (issue 31:
# 660 at once took every slot, and the engine died on MDB_READERS_FULL).
READERS_MAX = 256
SNAPSHOT_VIEWS_MAX = 64
_LOG_START = 0                               # the order of a queue's log-start record
# A write LMDB could not make while its disk held less than this was refused for lack of space
# (a short write past the disk's end comes back as EIO, not ENOSPC).
DISK_FULL_FREE_BYTES = 1 << 20
MAP_GRANULE_BYTES = 64 << 10                 # the map grows by whole multiples of this (of the OS page)
_ENTRY_AT = DIGEST_BYTES + 8                 # where an op-log value's encoded entry begins


class StorageLayoutError(Exception):
    """The data directory was written with another storage layout: never read it as ours."""


class StorageFull(Exception):
    """No room: the map is at its configured maximum (`map_limit`), or the disk is full or
    would leave less than its reserve free. Nothing of the transaction was stored."""

    def __init__(self, message: str, *, map_limit: bool = False) -> None:
        super().__init__(message)
        self.map_limit = map_limit


class MapGrowthNeeded(Exception):
    """The write transaction hit the map's end; the loop thread grows the map and retries."""


@dataclass(frozen=True, slots=True)
class StorageSpace:
    """What the environment may still take: on its disk (free there, plus the pages its file
    holds that no database uses any more, which LMDB reuses first), and in its map (up to
    map_size_max_bytes)."""
    disk_free_bytes: int
    map_free_bytes: int


@dataclass
class SealedBatch:
    """Everything one transaction writes. Built on the loop thread, then only read."""
    operations: list[Operation] = field(default_factory=list)
    queue_records: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> record JSON
    deleted_queues: list[tuple[str, int]] = field(default_factory=list)      # (name, queue_id)
    client_puts: dict[str, dict[str, Any]] = field(default_factory=dict)
    client_deletes: list[str] = field(default_factory=list)
    payload_reads: list[tuple[int, int]] = field(default_factory=list)       # (queue_id, index)
    epochs: dict[str, int] = field(default_factory=dict)                     # queue name -> epoch
    # Log entries: (queue_id, first order, last order, digest after it, encoded entry).
    oplog_rows: list[tuple[int, int, int, bytes, bytes]] = field(default_factory=list)
    # A deposed master's uncommitted suffix to erase first: (queue_id, last order kept).
    truncations: list[tuple[int, int]] = field(default_factory=list)
    # Snapshot transfer on a replica: rows to store ((queue_id, dead-letter queue id, rows)),
    # then the marks of complete snapshots ((queue_id, order, digest)).
    snapshot_rows: list[tuple[int, int | None, list[Any]]] = field(default_factory=list)
    snapshot_installs: list[tuple[int, int, bytes]] = field(default_factory=list)
    log_floors: dict[int, int] = field(default_factory=dict)   # queue_id -> delete op-log records below
    # Numbered streams (QueueRecord.sequences), each in a row of its own: queues whose rows go
    # first (a snapshot installed), then (queue_id, key, [floor, [[number, id], ...]] or None).
    stream_resets: set[int] = field(default_factory=set)
    stream_puts: list[tuple[int, str, list[Any] | None]] = field(default_factory=list)
    # Run on the loop once the batch is committed, before anything is answered (not stored).
    on_commit: list[Any] = field(default_factory=list)
    # Journal-only records: a member taking a role in an epoch (op "epoch"; see JOURNAL_FIELDS),
    # each as (position, record): it is journaled before operations[position], where it
    # happened, so the audit reads every stream in the order its member lived it.
    journal_marks: list[tuple[int, list[Any]]] = field(default_factory=list)
    next_queue_id: int | None = None
    replica_queue_ids: set[int] = field(default_factory=set)                 # journal role "replica"
    housekeeping_ms: int | None = None                                       # prune older than this
    dedupe_window_ms: int = 300_000
    status_retention_ms: int = 3_600_000


@dataclass(frozen=True)
class CommitResult:
    payloads: list[bytes | None]
    commit_seconds: float
    operations: int
    headers: list[dict[str, str] | None] = field(default_factory=list)    # beside payloads, where any


def _queue_prefix(queue_id: int) -> bytes:
    return _Q.pack(queue_id)


def _streams_of(cursor: lmdb.Cursor, queue_id: int) -> dict[str, Any]:
    """A queue's numbered streams as stored in their rows: key -> [floor, [[number, id], ...]]."""
    prefix = _queue_prefix(queue_id)
    found: dict[str, Any] = {}
    if cursor.set_range(prefix):
        for raw_key, value in cursor:
            key = bytes(raw_key)
            if not key.startswith(prefix):
                break
            found[key[len(prefix):].decode()] = msgpack.unpackb(value)
    return found


def _delete_prefix(cursor: lmdb.Cursor, prefix: bytes) -> None:
    if cursor.set_range(prefix):
        while bytes(cursor.key()).startswith(prefix):
            if not cursor.delete():
                break


def _owner_only(path: Path, mode: int) -> None:
    """Take group and other permissions off a file or directory of ours that has them (one
    created before this node asked for owner-only modes, or under a loose umask)."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_mode & 0o077:
            os.chmod(path, mode)


def _put_in_order(cursor: lmdb.Cursor, puts: list[tuple[bytes, bytes]]) -> None:
    """Rows in ascending key order that all sort after the database's last key are appended
    (MDB_APPEND fills pages instead of splitting them: fewer pages for the commit to write);
    any others are put as usual. A snapshot's rows usually qualify: they fill an instance
    created for the transfer, whose local queue id is the newest (+26% transfer speed in an
    A/B, bench/RESULTS.md)."""
    if (not cursor.last() or bytes(cursor.key()) < puts[0][0]) and all(
            earlier[0] < later[0] for earlier, later in itertools.pairwise(puts)):
        cursor.putmulti(puts, append=True)
    else:
        cursor.putmulti(puts)


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
        self.payload_hold_bytes = payload_hold_bytes
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
        self._journal_sequence = 0
        # msgpack.packb builds a Packer per call, which costs more than packing a small record;
        # this one is used by the writer thread only (commit), so it is never shared.
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._batch_names: dict[int, tuple[str, int]] = {}   # queue id -> (name, epoch) of the batch
        self._batch_replicas: set[int] = set()                # queue ids this node holds as replica
        self._dedupe_sweep_from = b""     # where the next dedupe sweep resumes (writer thread)
        self._floors: dict[int, int] = {}  # op-log truncations still under way (writer thread)
        # Records below a queue's floor kept for their live payloads (writer thread): their
        # (order, size), oldest first, and total; and the order below which every record was
        # looked at. Rebuilt by looking again after a restart or an aborted commit.
        self._kept: dict[int, collections.deque[tuple[int, int, int]]] = {}   # (last, first, size)
        self._consumed: set[int] = set()   # queues whose messages this batch acknowledged or moved
        self._kept_bytes: dict[int, int] = {}
        self._examined: dict[int, int] = {}
        self.truncated_records = 0
        self.moved_payloads = 0
        self.kept_bytes = 0                # op-log records below the floors kept for live payloads
        self._entry_ends: dict[int, list[tuple[int, int]]] = {}   # this batch's entries per queue
        self._ready_counts: dict[int, int] = {}                    # this batch's queues' ready messages
        self._payloads: _EntryPayloads | None = None
        self._read_txn: lmdb.Transaction | None = None
        self._check_schema()

    # --- lifecycle -------------------------------------------------------------------------
    def _check_schema(self) -> None:
        with self.env.begin(write=True, db=self.db["meta"]) as txn:
            stored = txn.get(b"schema_version")
            if stored is None:
                txn.put(b"schema_version", _Q.pack(SCHEMA_VERSION))
                txn.put(b"node_id", self.node_id.encode())
            if txn.get(b"storage_id") is None:
                # Who this disk is: a node that comes back with another one lost its data, and
                # the membership layer must not count it as an in-sync replica (cluster_map.AddNode).
                txn.put(b"storage_id", _Q.pack(int.from_bytes(os.urandom(8), "big") >> 1 or 1))
            if stored is not None and _Q.unpack(stored)[0] != SCHEMA_VERSION:
                raise StorageLayoutError(
                    f"the data directory {self.path} holds storage layout {_Q.unpack(stored)[0]}, and this "
                    f"qserver reads layout {SCHEMA_VERSION} only. Nothing was changed. Either run the qserver "
                    f"release that wrote it, or move the directory aside and start this node on an empty one: "
                    f"it rejoins the cluster and its pairs give it their queues by state transfer (export the "
                    f"journal first with the old release if the audit needs it).")
            self.storage_id = int(_Q.unpack(txn.get(b"storage_id") or b"")[0])
            # The journal's last key is its sequence; meta keeps it only for a journal that the
            # exporter's prune emptied (a commit does not write it: one page less per fsync).
            sequence = txn.get(b"journal_sequence")
            last = txn.cursor(db=self.db["journal"])
            self._journal_sequence = max(_Q.unpack(sequence)[0] if sequence else 0,
                                         _Q.unpack(last.key())[0] if last.last() else 0)

    def close(self) -> None:
        self.end_read()
        self.env.close()

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def space(self) -> StorageSpace | None:
        """What is left (loop thread; a few stat calls: the engine asks a few times a second).
        None when it cannot be read (the engine keeps what it last knew)."""
        try:
            with self.env.begin() as txn:
                stats = [self.env.stat(), *(txn.stat(db) for db in self.db.values())]
            file_bytes = os.path.getsize(self.path / "data.mdb")
            disk_free = shutil.disk_usage(self.path).free
        except (OSError, lmdb.Error):
            return None
        used = (2 + sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)) * stats[0]["psize"]
        return StorageSpace(disk_free + max(0, file_bytes - used), max(0, self.map_size_max_bytes - used))

    def disk_full(self) -> bool:
        try:
            return shutil.disk_usage(self.path).free < DISK_FULL_FREE_BYTES
        except OSError:
            return False

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
        current = self.map_size()
        if current >= self.map_size_max_bytes:
            raise StorageFull(f"the storage map is full at its limit of {self.map_size_max_bytes} bytes",
                              map_limit=True)
        free = shutil.disk_usage(self.path).free
        used = os.path.getsize(self.path / "data.mdb")
        # The map is sparse, but keeping it within the disk keeps a disk-full error out of LMDB's fsync.
        target = min(current * 2, self.map_size_max_bytes, used + free - self.disk_reserve_bytes)
        if target < self.map_size_max_bytes:
            target -= target % MAP_GRANULE_BYTES
        if target <= current:
            raise StorageFull(f"the storage map at {current} bytes cannot grow: {free} bytes free on its disk, "
                              f"{self.disk_reserve_bytes} kept in reserve")
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
                record.sequences.update(sequences_from_json(_streams_of(streams, record.queue_id)))
            return records

    def load_leases(self, queue_id: int) -> list[StoredLease]:
        prefix = _queue_prefix(queue_id)
        leases = []
        with self.env.begin(db=self.db["leases"]) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    priority, receipt, visibility_ms, deliveries, leased_ms = msgpack.unpackb(value)
                    leases.append(StoredLease(_QI.unpack(key)[1], priority, receipt, visibility_ms,
                                              deliveries, leased_ms))
        return leases

    def load_clients(self) -> dict[str, dict[str, Any]]:
        with self.env.begin(db=self.db["clients"]) as txn:
            return {key.decode(): json.loads(value) for key, value in txn.cursor()}

    def next_queue_id(self) -> int:
        with self.env.begin(db=self.db["meta"]) as txn:
            raw = txn.get(b"next_queue_id")
        return _Q.unpack(raw)[0] if raw else 1

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
        if not cursor.set_range(_QPI.pack(queue_id, priority, after_index + 1)):
            return rows
        for key, value in cursor:
            owner, key_priority, index = _QPI.unpack(key)
            if owner != queue_id or key_priority != priority or index >= before_index or len(rows) >= limit:
                break
            rows.append((index, _U32.unpack(value)[0] if value else 0))
        return rows

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        raw = self._reader().get(_Q.pack(queue_id) + dedupe_id.encode(), db=self.db["dedupe"])
        return None if raw is None else _QI.unpack(raw)  # type: ignore[return-value]

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        """One C call for a whole batch (a get per id costs a GIL round trip each while the
        writer thread runs)."""
        prefix = _Q.pack(queue_id)
        found = self._reader().cursor(db=self.db["dedupe"]).getmulti([prefix + i.encode() for i in dedupe_ids])
        skip = len(prefix)
        return {bytes(key[skip:]).decode(): _QI.unpack(value) for key, value in found}  # type: ignore[misc]

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, ttl_ms) of the queue's committed messages with a time to live."""
        return self._timed_rows("ttl", queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, delay_ms) of the queue's committed messages still delayed."""
        return self._timed_rows("delayed", queue_id)

    def _timed_rows(self, name: str, queue_id: int) -> list[tuple[int, int, int]]:
        prefix = _queue_prefix(queue_id)
        cursor = self._reader().cursor(db=self.db[name])
        rows: list[tuple[int, int, int]] = []
        if cursor.set_range(prefix):
            for key, value in cursor:
                if bytes(key[:8]) != prefix:
                    break
                rows.append((_QI.unpack(key)[1], *_TTL.unpack(value)))
        return rows

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        """Completed status, or 'delivered'/'delayed'/'queued' from the lease, delay and message rows."""
        txn = self._reader()
        key = _QI.pack(queue_id, index)
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
        key = _QI.pack(queue_id, index)
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
        found = cursor.prev() if cursor.set_range(_QI.pack(queue_id + 1, 0)) else cursor.last()
        if not found:
            return None
        owner, index = _QI.unpack(bytes(cursor.key()))
        if owner != queue_id:
            return None
        held = msgpack.unpackb(cursor.value())[4]
        payload = held if type(held) is bytes else _EntryPayloads(txn, self.db["oplog"]).resolve(queue_id, index, held)
        return index, bytes(payload)

    def messages_after(self, queue_id: int, after_index: int, limit: int) -> list[tuple[int, bytes]]:
        """(id, payload) of the queue's stored messages with id > after_index, lowest first, at
        most `limit` (a durable subscription's backlog, read a window at a time)."""
        txn = self._reader()
        cursor = txn.cursor(db=self.db["messages"])
        out: list[tuple[int, bytes]] = []
        if not cursor.set_range(_QI.pack(queue_id, after_index + 1)):
            return out
        payloads = None
        for key, value in cursor:
            owner, index = _QI.unpack(key)
            if owner != queue_id or len(out) >= limit:
                break
            held = msgpack.unpackb(value)[4]
            if type(held) is not bytes:
                payloads = payloads or _EntryPayloads(txn, self.db["oplog"])
                held = payloads.resolve(queue_id, index, held)
            out.append((index, bytes(held)))
        return out

    def enqueued_ms(self, queue_id: int, index: int) -> int | None:
        """When a stored message was enqueued (the master's wall clock), None if not stored."""
        raw = self._reader().get(_QI.pack(queue_id, index), db=self.db["messages"])
        return None if raw is None else int(msgpack.unpackb(raw)[1])

    def producer(self, queue_id: int, index: int) -> str | None:
        """The client that enqueued a stored message (its sender), None if not stored."""
        raw = self._reader().get(_QI.pack(queue_id, index), db=self.db["messages"])
        return None if raw is None else str(msgpack.unpackb(raw)[3])

    # --- the op log, as the replication roles read it (OpLogReader) -----------------------
    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        out: list[tuple[int, int, bytes]] = []
        cursor = self._reader().cursor(db=self.db["oplog"])
        # Records below the log start may still be stored (kept for live payloads): not served.
        if not cursor.set_range(_QI.pack(queue_id, max(after_order, self.first(queue_id) - 1, _LOG_START) + 1)):
            return out
        size = 0
        for key, value in cursor:
            owner, order = _QI.unpack(key)
            if owner != queue_id:
                break
            if len(value) > DIGEST_BYTES:        # a snapshot's mark carries no operation
                out.append((_Q.unpack_from(value, DIGEST_BYTES)[0], order, bytes(value[_ENTRY_AT:])))
                size += len(value) - _ENTRY_AT
                if order - after_order >= limit or size >= bytes_max:
                    break
        return out

    def first(self, queue_id: int) -> int:
        raw = self._reader().get(_QI.pack(queue_id, _LOG_START), db=self.db["oplog"])
        return 0 if raw is None else _Q.unpack(raw[DIGEST_BYTES:])[0]

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        if order == 0:
            return EMPTY_DIGEST
        if order < self.first(queue_id):
            return None          # a record kept below the log start for its payloads
        raw = self._reader().get(_QI.pack(queue_id, order), db=self.db["oplog"])
        return None if raw is None else bytes(raw[:DIGEST_BYTES])

    def last(self, queue_id: int) -> tuple[int, bytes]:
        return _last_logged(self._reader().cursor(db=self.db["oplog"]), queue_id)

    def read_client_payload(self, queue_id: int, index: int) -> bytes | None:
        txn = self._reader()
        raw = txn.get(_QI.pack(queue_id, index), db=self.db["messages"])
        if raw is None:
            return None
        return _EntryPayloads(txn, self.db["oplog"]).resolve(queue_id, index, msgpack.unpackb(raw)[4])

    # --- the one writer (writer thread) ----------------------------------------------------
    def commit(self, batch: SealedBatch) -> CommitResult:
        started = time.perf_counter()
        # What the writer remembers of truncations under way, as of the last commit: an
        # aborted transaction must not leave it counting records it did not delete.
        floors, moved = dict(self._floors), self.moved_payloads
        # Journal sequences are taken as records are written; an aborted transaction (the map's
        # end, which the engine grows and retries) stored none of them, and must not leave a gap
        # that the audit reports as a lost record (issue 32, item 9; docs/AUDIT.md).
        sequence = self._journal_sequence
        try:
            with self.space_errors(), self.env.begin(write=True) as txn:
                payloads, headers = self._write(txn, batch)
        except BaseException:
            self._journal_sequence = sequence
            self._floors, self.moved_payloads = floors, moved
            self._kept, self._kept_bytes, self._examined = {}, {}, {}     # looked at again
            raise
        return CommitResult(payloads, time.perf_counter() - started, len(batch.operations), headers)

    def _write(self, txn: lmdb.Transaction, batch: SealedBatch) -> tuple[list[bytes | None],
                                                                          list[dict[str, str] | None]]:
        db = self.db
        self._payloads = _EntryPayloads(txn, db["oplog"])     # this transaction's reads of payloads
        # Suffixes erased and snapshots installed replace rows: their kept records are looked at.
        self._consumed = {queue_id for queue_id, _ in batch.truncations} | \
            {queue_id for queue_id, _, _ in batch.snapshot_rows}
        names = {record["queue_id"]: (name, record["epoch"]) for name, record in batch.queue_records.items()}
        self._batch_names = names
        self._batch_replicas = batch.replica_queue_ids
        journal = self._journal_writer(txn, names) if self.journal_enabled else None
        for queue_id, order in batch.truncations:    # first: this batch's operations come after
            self._truncate(txn, queue_id, order)
        for queue_id, dead_letter_queue_id, rows in batch.snapshot_rows:
            self._put_snapshot_rows(txn, queue_id, dead_letter_queue_id, rows, journal is not None)
        for queue_id, order, digest in batch.snapshot_installs:
            self._install_mark(txn, queue_id, order, digest)
        # The entries go in before the operations: an enqueue's row names its entry, and a
        # dead letter or a lease in this same batch reads the payload from it.
        self._entry_ends = {}
        if batch.oplog_rows:
            txn.cursor(db=db["oplog"]).putmulti([(_QI.pack(queue_id, last), digest + _Q.pack(first) + encoded)
                                                 for queue_id, first, last, digest, encoded in batch.oplog_rows])
            for queue_id, first, last, _, _ in batch.oplog_rows:
                if last > first:     # an entry of one operation is not kept for its payload (see _live_rows)
                    self._entry_ends.setdefault(queue_id, []).append((first, last))
        self._ready_counts = {record.get("queue_id", 0): record.get("ready_count", 0) for record in batch.queue_records.values()}
        operations = batch.operations
        position, count = 0, len(operations)
        marks = batch.journal_marks if self.journal_enabled else []
        next_mark = 0
        while position < count:
            while next_mark < len(marks) and marks[next_mark][0] <= position:
                self._journal_mark(txn, marks[next_mark][1])
                next_mark += 1
            if type(operations[position]) is Enqueued:
                stop = marks[next_mark][0] if next_mark < len(marks) else count
                position = self._apply_enqueue_run(txn, operations, position, stop, journal)
                continue
            op = operations[position]
            self._APPLY[type(op)](self, txn, op)  # type: ignore[operator]
            if journal is not None:
                journal(op)
            position += 1
        for _, mark in marks[next_mark:]:
            self._journal_mark(txn, mark)
        for name, queue_id in batch.deleted_queues:     # before the puts: a reset replaces a name
            txn.delete(name.encode(), db=db["queues"])
            txn.delete(name.encode(), db=db["epochs"])
            txn.put(_Q.pack(queue_id), b"", db=db["doomed"])
        for name, record in batch.queue_records.items():
            txn.put(name.encode(), self._pack(record), db=db["queues"])
        for queue_id in batch.stream_resets:
            _delete_prefix(txn.cursor(db=db["streams"]), _queue_prefix(queue_id))
        for queue_id, key, stream in batch.stream_puts:
            if stream is None:
                txn.delete(_queue_prefix(queue_id) + key.encode(), db=db["streams"])
            else:
                txn.put(_queue_prefix(queue_id) + key.encode(), self._pack(stream), db=db["streams"])
        for name, epoch in batch.epochs.items():
            txn.put(name.encode(), _Q.pack(epoch), db=db["epochs"])
        for client_id, client in batch.client_puts.items():
            txn.put(client_id.encode(), json.dumps(client).encode(), db=db["clients"])
        for client_id in batch.client_deletes:
            txn.delete(client_id.encode(), db=db["clients"])
        if batch.next_queue_id is not None:
            txn.put(b"next_queue_id", _Q.pack(batch.next_queue_id), db=db["meta"])
        if batch.log_floors or self._floors:
            self._truncate_logs(txn, batch.log_floors)
            self.kept_bytes = sum(self._kept_bytes.values())
        if batch.housekeeping_ms is not None:
            self._housekeeping(txn, batch)
        messages, resolve = db["messages"], self._payloads.resolve
        payloads = []
        for queue_id, index in batch.payload_reads:
            raw = txn.get(_QI.pack(queue_id, index), db=messages)
            payloads.append(None if raw is None else resolve(queue_id, index, msgpack.unpackb(raw)[4]))
        headers: list[dict[str, str] | None] = []
        if batch.payload_reads and txn.stat(db["headers"])["entries"]:
            found = dict(txn.cursor(db=db["headers"]).getmulti([_QI.pack(q, i) for q, i in batch.payload_reads]))
            headers = [None if (raw := found.get(_QI.pack(q, i))) is None else msgpack.unpackb(raw)
                       for q, i in batch.payload_reads]
        return payloads, headers

    def _journal_mark(self, txn: lmdb.Transaction, mark: list[Any]) -> None:
        record = self._pack(mark)
        self._journal_sequence += 1
        txn.put(_Q.pack(self._journal_sequence), record + _U32.pack(zlib.crc32(record)), db=self.db["journal"],
                append=True)

    def _apply_enqueue_run(self, txn: lmdb.Transaction, operations: list[Operation], start: int, stop: int,
                           journal: Any) -> int:
        """Store a run of consecutive enqueues with one putmulti per database: most of a
        producer's batch is such a run, and this keeps the per-message Python work small.
        The journal takes one run record (replication/audit_checks.py) for each stretch of
        the run that shares queue, time, priority and client with consecutive indices."""
        messages: list[tuple[bytes, bytes]] = []
        ready: list[tuple[bytes, bytes]] = []
        dedupe: list[tuple[bytes, bytes]] = []
        ttls: list[tuple[bytes, bytes]] = []
        delays: list[tuple[bytes, bytes]] = []
        headers: list[tuple[bytes, bytes]] = []
        pack, qi, qpi, q, crc32 = self._pack, _QI.pack, _QPI.pack, _Q.pack, zlib.crc32
        journaled = journal is not None
        runs: list[list[Any]] = []      # as _put_journal_runs takes them
        current: list[Any] | None = None
        names, replicas = self._batch_names, self._batch_replicas
        end = start
        entry_ends, half_hold = self._entry_ends, self.payload_hold_bytes // 2
        for queue_id in entry_ends:
            if self._kept_bytes.get(queue_id, 0) > half_hold:
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
                delays.append((qi(op.queue_id, op.index), _TTL.pack(op.priority, op.delay_ms)))
            else:
                ready.append((qpi(op.queue_id, op.priority, op.index), b""))
            if op.dedupe_id is not None:
                dedupe.append((q(op.queue_id) + producer_key(op.client, op.dedupe_id).encode(),
                               qi(op.index, op.enqueued_ms)))
            if op.ttl_ms:
                ttls.append((qi(op.queue_id, op.index), _TTL.pack(op.priority, op.ttl_ms)))
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
        txn.cursor(db=self.db["messages"]).putmulti(messages)
        txn.cursor(db=self.db["ready"]).putmulti(ready)
        if dedupe:
            txn.cursor(db=self.db["dedupe"]).putmulti(dedupe)
        if ttls:
            txn.cursor(db=self.db["ttl"]).putmulti(ttls)
        if delays:
            txn.cursor(db=self.db["delayed"]).putmulti(delays)
        if headers:
            txn.cursor(db=self.db["headers"]).putmulti(headers)
        if runs:
            self._put_journal_runs(txn, runs)
        return end

    def _put_journal_runs(self, txn: lmdb.Transaction, runs: list[list[Any]]) -> None:
        """Each run: [its first row's fields, count, dedupe ids, payload sizes, crc32s], stored
        as one record (a run record when it has more than one row)."""
        pack, sequence, rows = self._pack, self._journal_sequence, []
        for fields, count, dedupe_ids, sizes, crcs in runs:
            record = pack(fields + [RUN_MARK, count, dedupe_ids, sizes, crcs] if count > 1 else fields)
            sequence += count          # the record takes its rows' sequences; stored under the last
            rows.append((_Q.pack(sequence), record + _U32.pack(zlib.crc32(record))))
        txn.cursor(db=self.db["journal"]).putmulti(rows, append=True)
        self._journal_sequence = sequence

    def _apply_leased(self, txn: lmdb.Transaction, op: Leased) -> None:
        if not txn.delete(_QPI.pack(op.queue_id, op.priority, op.index), db=self.db["ready"]):
            raise InvariantViolation(f"leased message {op.queue_id}/{op.index} was not ready")
        txn.put(_QI.pack(op.queue_id, op.index),
                self._pack([op.priority, op.receipt, op.visibility_ms, op.deliveries, op.leased_ms]),
                db=self.db["leases"])

    def _apply_extended(self, txn: lmdb.Transaction, op: Extended) -> None:
        key = _QI.pack(op.queue_id, op.index)
        raw = txn.get(key, db=self.db["leases"])
        if raw is None:
            raise InvariantViolation(f"extended message {op.queue_id}/{op.index} is not leased")
        priority, receipt, _, deliveries, leased_ms = msgpack.unpackb(raw)
        if receipt != op.receipt:
            raise InvariantViolation(f"extended message {op.queue_id}/{op.index} is leased under another receipt")
        txn.put(key, self._pack([priority, receipt, op.visibility_ms, deliveries, leased_ms]), db=self.db["leases"])

    def _apply_purged(self, txn: lmdb.Transaction, op: Purged) -> None:
        self._take_out(txn, op, "purged", delayed=op.delayed)

    def _apply_expired(self, txn: lmdb.Transaction, op: Expired) -> None:
        self._take_out(txn, op, "expired")

    def _take_out(self, txn: lmdb.Transaction, op: Purged | Expired, state: str, *, delayed: bool = False) -> None:
        """An operator's purge or an expiry: the message leaves for good from where it waits."""
        self._consumed.add(op.queue_id)
        key = _QI.pack(op.queue_id, op.index)
        if delayed:
            removed = txn.delete(key, db=self.db["delayed"])
        elif op.leased:
            removed = txn.delete(key, db=self.db["leases"])
        else:
            removed = txn.delete(_QPI.pack(op.queue_id, op.priority, op.index), db=self.db["ready"])
        if not removed:
            raise InvariantViolation(f"{state} message {op.queue_id}/{op.index} was not "
                                     f"{'delayed' if delayed else 'leased' if op.leased else 'ready'}")
        producer = self._producer_of(txn, key) if op.track_status else None
        self._forget_message(txn, key)
        if op.track_status:
            self._put_status(txn, op.queue_id, op.index, state, op.at_ms, None, producer)

    def _apply_matured(self, txn: lmdb.Transaction, op: Matured) -> None:
        if not txn.delete(_QI.pack(op.queue_id, op.index), db=self.db["delayed"]):
            raise InvariantViolation(f"matured message {op.queue_id}/{op.index} was not delayed")
        txn.put(_QPI.pack(op.queue_id, op.priority, op.index), b"", db=self.db["ready"])

    def _apply_acked(self, txn: lmdb.Transaction, op: Acked) -> None:
        self._consumed.add(op.queue_id)
        key = _QI.pack(op.queue_id, op.index)
        txn.delete(key, db=self.db["leases"])
        producer = self._producer_of(txn, key) if op.track_status else None
        self._forget_message(txn, key)
        if op.track_status:
            self._put_status(txn, op.queue_id, op.index, "replied" if op.reply is not None else "acked",
                             op.acked_ms, op.reply, producer)

    def _forget_message(self, txn: lmdb.Transaction, key: bytes) -> None:
        """A message leaves for good: its row and the rows that only describe it."""
        txn.delete(key, db=self.db["messages"])
        txn.delete(key, db=self.db["ttl"])
        txn.delete(key, db=self.db["headers"])

    def _apply_released(self, txn: lmdb.Transaction, op: Released) -> None:
        txn.delete(_QI.pack(op.queue_id, op.index), db=self.db["leases"])
        txn.put(_QPI.pack(op.queue_id, op.priority, op.index), _U32.pack(op.deliveries), db=self.db["ready"])

    def _apply_dead_lettered(self, txn: lmdb.Transaction, op: DeadLettered) -> None:
        key = _QI.pack(op.queue_id, op.index)
        self._consumed.add(op.queue_id)
        if op.leased:
            txn.delete(key, db=self.db["leases"])
        elif not txn.delete(_QPI.pack(op.queue_id, op.priority, op.index), db=self.db["ready"]):
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} was not ready")
        txn.delete(key, db=self.db["ttl"])
        raw = txn.pop(key, db=self.db["messages"])
        if raw is None:
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} has no body")
        priority, _, _, client, held = msgpack.unpackb(raw)
        payload = self._payloads.resolve(op.queue_id, op.index, held)  # type: ignore[union-attr]
        txn.put(_QI.pack(op.dead_letter_queue_id, op.dead_letter_index),
                self._pack([priority, op.at_ms, None, client, payload]), db=self.db["messages"])
        txn.put(_QPI.pack(op.dead_letter_queue_id, priority, op.dead_letter_index), b"", db=self.db["ready"])
        headers = txn.pop(key, db=self.db["headers"])
        if headers is not None:             # they go with the message
            txn.put(_QI.pack(op.dead_letter_queue_id, op.dead_letter_index), headers, db=self.db["headers"])
        if op.track_status:
            self._put_status(txn, op.queue_id, op.index, "dead_lettered", op.at_ms, None, str(client))

    def _truncate(self, txn: lmdb.Transaction, queue_id: int, order: int) -> None:
        """Erase a queue's messages (with their ready and dedupe rows) and op-log rows past
        `order`: an uncommitted suffix (see Engine.discard_uncommitted). Unjournaled: the
        member's epoch record, whose base is `order`, says where its stream goes on."""
        db = self.db
        cursor = txn.cursor(db=db["messages"])
        cursor.set_range(_QI.pack(queue_id, order + 1))
        while (key := cursor.key()) and _QI.unpack(key)[0] == queue_id:     # b"": past the end
            index = _QI.unpack(key)[1]
            priority, _, dedupe_id, producer, _ = msgpack.unpackb(cursor.value())
            txn.delete(_QPI.pack(queue_id, priority, index), db=db["ready"])
            txn.delete(key, db=db["ttl"])
            txn.delete(key, db=db["delayed"])
            txn.delete(key, db=db["headers"])
            if dedupe_id is not None:
                dedupe_key = _Q.pack(queue_id) + producer_key(producer, dedupe_id).encode()
                kept = txn.get(dedupe_key, db=db["dedupe"])
                if kept is not None and _QI.unpack(kept)[0] == index:
                    txn.delete(dedupe_key, db=db["dedupe"])
            cursor.delete()          # moves to the next record
        cursor = txn.cursor(db=db["oplog"])
        cursor.set_range(_QI.pack(queue_id, order + 1))
        while (key := cursor.key()) and _QI.unpack(key)[0] == queue_id:
            cursor.delete()

    # --- snapshots and the bounded log (writer thread) ---------------------------------------
    def _put_snapshot_rows(self, txn: lmdb.Transaction, queue_id: int, dead_letter_queue_id: int | None,
                           rows: list[Any], journaled: bool) -> None:
        """A replica stores a snapshot's rows as they arrive (replication/snapshot.py); they
        count as its state only once the snapshot is installed. Each message is journaled as
        `snapshot` (or `snapshot_lease`), so the audit knows what the member took over; a run
        of them is one run record, as a producer's batch is."""
        db, pack, qi, qpi, crc32 = self.db, self._pack, _QI.pack, _QPI.pack, zlib.crc32
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
                dedupe.append((_Q.pack(queue_id) + row[1].encode(), qi(row[2], row[3])))
                continue
            owner = queue_id if row[0] == ROW_MESSAGE else dead_letter_queue_id
            if owner is None:
                raise InvariantViolation(f"snapshot of queue {queue_id} has dead letters but no dead-letter queue")
            _, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease, ttl_ms, delay_ms, named = row
            messages.append((qi(owner, index), pack([priority, enqueued_ms, dedupe_id, client, payload])))
            if named:
                headers.append((qi(owner, index), pack(named)))
            if ttl_ms:
                ttls.append((qi(owner, index), _TTL.pack(priority, ttl_ms)))
            if lease is None and delay_ms:
                delays.append((qi(owner, index), _TTL.pack(priority, delay_ms)))
            elif lease is None:
                ready.append((qpi(owner, priority, index), _U32.pack(deliveries) if deliveries else b""))
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
                    name, epoch = self._batch_names.get(owner, ("", 0))
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
                _put_in_order(txn.cursor(db=db[name]), puts)
        if runs:
            self._put_journal_runs(txn, runs)

    def _install_mark(self, txn: lmdb.Transaction, queue_id: int, order: int, digest: bytes) -> None:
        """A complete snapshot at `order`: the log starts there, with its digest."""
        self._forget_floor(queue_id)
        # An entry of this member's own ending there gives way to the mark: the payloads it
        # alone holds move into their rows first.
        replaced = txn.get(_QI.pack(queue_id, order), db=self.db["oplog"])
        if replaced is not None and len(replaced) > DIGEST_BYTES:
            first = _Q.unpack_from(replaced, DIGEST_BYTES)[0]
            self._move_payloads(txn, queue_id, order, self._live_rows(txn, queue_id, first, order, every=True))
        txn.put(_QI.pack(queue_id, order), digest, db=self.db["oplog"])
        txn.put(_QI.pack(queue_id, _LOG_START), EMPTY_DIGEST + _Q.pack(order), db=self.db["oplog"])

    def _truncate_logs(self, txn: lmdb.Transaction, floors: dict[int, int]) -> None:
        """Delete op-log records below each queue's floor, at most
        TRUNCATE_RECORDS_PER_BATCH_MAX per batch; what is left continues in the next batches.
        The log-start record moves to the floor first: from then on nothing below it is served.
        Each record that goes below the floor is looked at once: deleted, or kept while it
        holds a live message's payload. Kept records go, oldest first, once none of their
        messages is live (a queue consumed in order frees its oldest first), or once the
        queue keeps more than `payload_hold_bytes`, after their live payloads move into their
        message rows."""
        oplog = self.db["oplog"]
        for queue_id, floor in floors.items():
            start_key = _QI.pack(queue_id, _LOG_START)
            raw = txn.get(start_key, db=oplog)
            if floor > (0 if raw is None else _Q.unpack(raw[DIGEST_BYTES:])[0]):
                txn.put(start_key, EMPTY_DIGEST + _Q.pack(floor), db=oplog)
                self._floors[queue_id] = max(floor, self._floors.get(queue_id, 0))
        budget = TRUNCATE_RECORDS_PER_BATCH_MAX
        cursor = txn.cursor(db=oplog)
        for queue_id in list(self._floors):
            if budget <= 0:
                return                   # the rest goes on in the next batches
            floor = self._floors[queue_id]
            kept = self._kept.setdefault(queue_id, collections.deque())
            # Only a batch that consumed messages of the queue can have freed a kept record.
            while kept and budget > 0 and queue_id in self._consumed \
                    and not self._live_rows(txn, queue_id, kept[0][1], kept[0][0], every=False):
                order, _, size = kept.popleft()
                txn.delete(_QI.pack(queue_id, order), db=oplog)
                self._forget_kept(queue_id, size)
                budget -= 1
            examined = self._examined.get(queue_id, _LOG_START + 1)     # records below it were
            if examined < floor and cursor.set_range(_QI.pack(queue_id, examined)):
                while budget > 0:
                    key = cursor.key()
                    owner, order = _QI.unpack(key) if key else (0, 0)
                    if owner != queue_id or order >= floor:
                        examined = floor
                        break
                    examined = order + 1
                    budget -= 1
                    value = cursor.value()
                    first = _Q.unpack_from(value, DIGEST_BYTES)[0] if len(value) > DIGEST_BYTES else order
                    if first < order and self._live_rows(txn, queue_id, first, order, every=False):
                        size = len(value)
                        kept.append((order, first, size))
                        self._kept_bytes[queue_id] = self._kept_bytes.get(queue_id, 0) + size
                        cursor.next()
                    else:
                        cursor.delete()  # moves to the next record
                        self.truncated_records += 1
            elif examined < floor:
                examined = floor
            self._examined[queue_id] = examined
            while kept and budget > 0 and self._kept_bytes.get(queue_id, 0) > self.payload_hold_bytes:
                order, first, size = kept.popleft()
                self._move_payloads(txn, queue_id, order, self._live_rows(txn, queue_id, first, order, every=True))
                txn.delete(_QI.pack(queue_id, order), db=oplog)
                self._forget_kept(queue_id, size)
                budget -= 1
            if not kept and examined >= floor:
                self._forget_floor(queue_id)         # nothing below the floor is left

    def _forget_kept(self, queue_id: int, size: int) -> None:
        self._kept_bytes[queue_id] -= size
        self.truncated_records += 1

    def _forget_floor(self, queue_id: int) -> None:
        for remembered in (self._floors, self._kept, self._examined, self._kept_bytes):
            remembered.pop(queue_id, None)

    def _live_rows(self, txn: lmdb.Transaction, queue_id: int, first: int, last: int, *,
                   every: bool) -> list[tuple[bytes, list[Any]]]:
        """The message rows whose payload is only in the op-log entry from `first` to `last`:
        the live messages it enqueued (message ids are their enqueues' orders); the first
        one only unless `every`. An entry of one operation never holds a row's payload: one
        message at a time, a kept record per message cost more than the copy it saves (a
        deeper op-log tree to write in every commit, bench/RESULTS.md)."""
        live = []
        rows = txn.cursor(db=self.db["messages"])
        if rows.set_range(_QI.pack(queue_id, first)):
            end = _QI.pack(queue_id, last)
            for key, raw in rows:
                if bytes(key) > end:
                    break
                row = msgpack.unpackb(raw)
                if type(row[4]) is int and row[4] == last:
                    live.append((bytes(key), row))
                    if not every:
                        break
        return live

    def _move_payloads(self, txn: lmdb.Transaction, queue_id: int, last: int, live: list[tuple[bytes, list[Any]]]) -> None:
        resolve = self._payloads.resolve  # type: ignore[union-attr]
        messages = self.db["messages"]
        for key, row in live:
            row[4] = resolve(queue_id, _QI.unpack(key)[1], last)
            txn.put(key, self._pack(row), db=messages)
        self.moved_payloads += len(live)

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
            view = LmdbSnapshotView(self, txn, name, queue_id, consumption, after_index, dead_letter)
        except KeyError:
            txn.abort()
            return None
        self.snapshot_views_open += 1
        self._views.add(view)
        return view

    def _apply_in_record(self, txn: lmdb.Transaction, op: Operation) -> None:
        """Durable subscriptions are queue state in the queue's record, written with the batch."""

    _APPLY = {Leased: _apply_leased, Extended: _apply_extended, Acked: _apply_acked, Purged: _apply_purged,
              Expired: _apply_expired, Matured: _apply_matured,
              Released: _apply_released, DeadLettered: _apply_dead_lettered,
              SubscriptionOpened: _apply_in_record, SubscriberAcked: _apply_in_record,
              SubscriptionDropped: _apply_in_record}

    def _producer_of(self, txn: lmdb.Transaction, key: bytes) -> str | None:
        """The client in a message row, read before the row goes: its completion status keeps it."""
        raw = txn.get(key, db=self.db["messages"])
        return None if raw is None else str(msgpack.unpackb(raw)[3])

    def _put_status(self, txn: lmdb.Transaction, queue_id: int, index: int, state: str, at_ms: int,
                    reply: bytes | None, producer: str | None) -> None:
        # The producer goes with the status: only it (or an admin) may read the status and the
        # reply once the message row is gone (docs/PROTOCOL.md, "Grants"; issue 32, item 13).
        txn.put(_QI.pack(queue_id, index), self._pack([state, at_ms, reply, producer]), db=self.db["status"])
        txn.put(_EXPIRY.pack(EXPIRY_STATUS, at_ms, queue_id) + _Q.pack(index), b"", db=self.db["expiry"])

    def _journal_writer(self, txn: lmdb.Transaction, names: dict[int, tuple[str, int]]) -> Any:
        """A function that appends one checksummed journal record per operation (DESIGN.md 4.6)."""
        journal_db = self.db["journal"]
        node = self.node_id
        pack = self._pack

        def append(op: Operation) -> None:
            name, epoch = names.get(op.queue_id, ("", 0))
            role = "replica" if op.queue_id in self._batch_replicas else "master"
            record = pack(_journal_fields(op, name, epoch, node, role))   # enqueues: _apply_enqueue_run
            self._journal_sequence += 1
            txn.put(_Q.pack(self._journal_sequence), record + _U32.pack(zlib.crc32(record)), db=journal_db,
                    append=True)   # sequence numbers only grow: skip the search
        return append

    def _housekeeping(self, txn: lmdb.Transaction, batch: SealedBatch) -> None:
        """Bounded clean-up inside a normal batch: completion statuses past their retention
        (oldest first, from the expiry index), dedupe ids past the window (an incremental
        sweep, so enqueues need no second index), and the records of deleted queue
        incarnations, a few thousand keys at a time."""
        now_ms = batch.housekeeping_ms or 0
        cursor = txn.cursor(db=self.db["expiry"])
        horizon = now_ms - batch.status_retention_ms
        pruned = 0
        if cursor.set_range(bytes([EXPIRY_STATUS])):
            while pruned < PRUNE_KEYS_PER_BATCH_MAX:
                key = cursor.key()
                if not key or key[0] != EXPIRY_STATUS or _EXPIRY.unpack_from(key)[1] > horizon:
                    break
                txn.delete(_Q.pack(_EXPIRY.unpack_from(key)[2]) + key[_EXPIRY.size:], db=self.db["status"])
                cursor.delete()
                pruned += 1
        self._sweep_dedupe(txn, now_ms - batch.dedupe_window_ms)
        self._erase_doomed(txn)

    def _sweep_dedupe(self, txn: lmdb.Transaction, horizon_ms: int) -> None:
        cursor = txn.cursor(db=self.db["dedupe"])
        if not (cursor.set_range(self._dedupe_sweep_from) if self._dedupe_sweep_from else cursor.first()):
            self._dedupe_sweep_from = b""
            return
        for _ in range(PRUNE_KEYS_PER_BATCH_MAX):
            key = cursor.key()
            if not key:
                break
            if _QI.unpack(cursor.value())[1] < horizon_ms:
                cursor.delete()      # moves to the next entry
            elif not cursor.next():
                break
        self._dedupe_sweep_from = bytes(cursor.key())

    def _erase_doomed(self, txn: lmdb.Transaction) -> None:
        doomed = txn.cursor(db=self.db["doomed"])
        if not doomed.first():
            return
        queue_id = _Q.unpack(doomed.key())[0]
        prefix = _queue_prefix(queue_id)
        budget = ERASE_KEYS_PER_BATCH_MAX
        for name in ("messages", "ready", "leases", "status", "dedupe", "oplog", "ttl", "delayed", "headers", "streams"):
            cursor = txn.cursor(db=self.db[name])
            if not cursor.set_range(prefix):
                continue
            while budget > 0 and bytes(cursor.key()).startswith(prefix):
                cursor.delete()
                budget -= 1
            if budget == 0:
                return
        doomed.delete()

    # --- inspection (tests, tools) ---------------------------------------------------------
    def journal_records(self) -> list[list[Any]]:
        """Every journal row, checksums verified, run records as their rows (as exported)."""
        records: list[list[Any]] = []
        with self.env.begin(db=self.db["journal"]) as txn:
            for _, value in txn.cursor():
                body, checksum = value[:-4], _U32.unpack(value[-4:])[0]
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


def _last_logged(cursor: lmdb.Cursor, queue_id: int) -> tuple[int, bytes]:
    """(order, digest) of the queue's last op-log record, by a cursor on `oplog`; (0, empty)
    when it has none (the log-start record at order 0 is not one)."""
    found = cursor.prev() if cursor.set_range(_QI.pack(queue_id + 1, 0)) else cursor.last()
    if found:
        owner, order = _QI.unpack(cursor.key())
        if owner == queue_id and order != _LOG_START:
            return order, bytes(cursor.value()[:DIGEST_BYTES])
    return 0, EMPTY_DIGEST


def database_usage(path: str | Path) -> dict[str, dict[str, int]]:
    """Entries and used pages of every database of a node's LMDB, opened read-only beside a
    running node (`_main`: the catalog of named databases). Pages on LMDB's free list are
    reused by later writes and are not counted; the file's size is a high-water mark."""
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=len(DB_NAMES) + 2)
    try:
        with env.begin() as txn:
            stats = {"_main": txn.stat(env.open_db(None, txn=txn))}  # type: ignore[arg-type]
            for name in DB_NAMES:
                stats[name] = txn.stat(env.open_db(name.encode(), txn=txn, create=False))
        return {name: {"entries": stat["entries"], "pages": stat["branch_pages"] + stat["leaf_pages"]
                       + stat["overflow_pages"], "page_bytes": stat["psize"]} for name, stat in stats.items()}
    finally:
        env.close()


def read_clients(path: str | Path) -> dict[str, dict[str, Any]]:
    """The client registry of another node's environment, read-only (it may be running)."""
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=len(DB_NAMES) + 2)
    try:
        with env.begin(db=env.open_db(b"clients", create=False)) as txn:
            return {key.decode(): json.loads(value) for key, value in txn.cursor()}
    finally:
        env.close()


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

JOURNAL_FIELDS = ("at_ms", "queue", "queue_id", "epoch", "index", "op", "message_id", "dedupe_id",
                  "priority", "payload_size", "payload_crc32", "role", "node", "client")


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


class _EntryPayloads:
    """Payloads whose one copy is their enqueue's op-log entry: a message row holds the
    entry's last order (an int) instead of the bytes. Each entry is decoded once per use
    (a commit, a snapshot view): a batch of leases or a snapshot chunk reads its messages in
    order, so most of them come out of one or two entries."""
    __slots__ = ("_txn", "_oplog", "_entries")
    KEPT_MAX = 8

    def __init__(self, txn: lmdb.Transaction, oplog: Any) -> None:
        self._txn, self._oplog = txn, oplog
        self._entries: dict[tuple[int, int], dict[int, bytes]] = {}

    def resolve(self, queue_id: int, index: int, held: bytes | int) -> bytes:
        if type(held) is not int:
            return held  # type: ignore[return-value]
        entry = self._entries.get((queue_id, held))
        if entry is None:
            raw = self._txn.get(_QI.pack(queue_id, held), db=self._oplog)
            if raw is None or len(raw) <= _ENTRY_AT:
                raise InvariantViolation(f"message {queue_id}/{index} names op-log entry {held}, which is gone")
            try:
                ops = decode_entry(bytes(raw[_ENTRY_AT:]))
            except MessageError as error:
                raise InvariantViolation(f"op-log entry {queue_id}/{held} does not decode: {error}") from None
            entry = {op.index: op.payload for op in ops if type(op) is Enqueued}
            if len(self._entries) >= self.KEPT_MAX:
                self._entries.clear()
            self._entries[(queue_id, held)] = entry
        payload = entry.get(index)
        if payload is None:
            raise InvariantViolation(f"op-log entry {queue_id}/{held} holds no enqueue of message {index}")
        return payload


class LmdbSnapshotView:
    """One queue's committed state at one order, read from one LMDB read transaction (a
    consistent view while writes go on). Its rows come in bounded chunks (SnapshotView in
    replication/snapshot.py). Holding the transaction keeps LMDB from reusing pages freed
    since, which is why MasterRole drops a view after sync_view_max_ms."""

    def __init__(self, storage: Storage, txn: lmdb.Transaction, name: str, queue_id: int, consumption: bool,
                 after_index: int, dead_letter: tuple[str, int] | None) -> None:
        self._storage, self._txn, self._db = storage, txn, storage.db
        self.lost = False                # a map growth ended its transaction (see lose)
        self._payloads = _EntryPayloads(txn, storage.db["oplog"])
        self._consumption = consumption
        self.record = self._record(name)
        self.order, self.digest = self._last(queue_id)
        self.dead_letter: list[Any] | None = None
        # (kind, queue id, next key to read): messages, dedupe entries, dead letters
        self._parts: list[tuple[int, int, bytes]] = [(ROW_MESSAGE, queue_id, _QI.pack(queue_id, after_index + 1)),
                                                     (ROW_DEDUPE, queue_id, _Q.pack(queue_id))]
        self._after_index = after_index
        if dead_letter is not None:
            dead_name, dead_id = dead_letter
            order, digest = self._last(dead_id)
            self.dead_letter = [order, digest, self._record(dead_name)]
            self._parts.append((ROW_DEAD_LETTER, dead_id, _QI.pack(dead_id, 1)))

    def _record(self, name: str) -> dict[str, Any]:
        raw = self._txn.get(name.encode(), db=self._db["queues"])
        if raw is None:
            raise KeyError(name)
        record = dict(msgpack.unpackb(raw))
        streams = _streams_of(self._txn.cursor(db=self._db["streams"]), record["queue_id"])
        if streams:
            record["sequences"] = {**record.get("sequences", {}), **streams}
        return record

    def _last(self, queue_id: int) -> tuple[int, bytes]:
        return _last_logged(self._txn.cursor(db=self._db["oplog"]), queue_id)

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
        txn, unpack_row, unpack_key = self._txn, msgpack.unpackb, _QI.unpack
        resolve = self._payloads.resolve
        cursor = txn.cursor(db=self._db["messages"])
        if not cursor.set_range(start):
            return rows, None, 0
        consumption = self._consumption
        if consumption:
            ready_db, ready_key = self._db["ready"], _QPI.pack
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
                    deliveries = _U32.unpack(raw_ready)[0] if raw_ready else 0
            ttl, delay, headers = ttls.at(key), delays.at(key), named.at(key)
            # As replication.snapshot.message_row lays it out.
            rows.append([kind, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease,
                         0 if ttl is None else _TTL.unpack(ttl)[1], 0 if delay is None else _TTL.unpack(delay)[1],
                         None if headers is None else unpack_row(headers)])
            size += len(payload) + 64
        return rows, None, size

    def _dedupe_rows(self, queue_id: int, start: bytes,
                     bytes_max: int) -> tuple[list[list[Any]], bytes | None, int]:
        rows: list[list[Any]] = []
        prefix = _Q.pack(queue_id)
        cursor = self._txn.cursor(db=self._db["dedupe"])
        if not cursor.set_range(start):
            return rows, None, 0
        after, unpack, size = self._after_index, _QI.unpack, 0
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
            self._storage.snapshot_views_open -= 1
            self._storage._views.discard(self)
