"""Journal segments out of a node's LMDB environment into Parquet files, and pruning of what was
exported (docs/AUDIT.md, "Export"). qaudit reads the files; nothing here changes what the journal says.

A *segment* is a run of consecutive journal sequence numbers of one journal. It is sealed when
it holds `segment_records_max` records (size), when its oldest record is older than
`segment_age_max_ms` (age), or on demand (`force=True`), and written as one Parquet file:

    <destination>/<node>/journal-<node>-<journal id>-<first:020d>-<last:020d>.parquet

`destination` is a local directory or any URI pyarrow.fs understands (file://, hdfs://,
s3://, gs://, abfs://). A file is written under a `_tmp-` name (which Spark ignores) and then
moved into place, so a crash leaves no half segment under a real name; on a local disk the
file is fsync'd before the move and its directory after, so a segment is durable before the
prune may delete its records from LMDB. What was exported is
read back from the destination's file names, so an exporter needs no state of its own: a
restarted node continues after the last segment it finds for its journal.

The *journal id* names one journal of a node: a node that lost its disk starts a new journal
(sequence 1 again) under the same node id. It is the environment's `storage_id` (LMDB `meta`,
written by storage.py once per disk), in hex. Nothing here writes to `meta`.

Columns (replication/journal.py RECORD_COLUMNS): journal_id, sequence, the 14 journal fields
(JOURNAL_FIELDS), record_crc32 (as stored; the audit recomputes it from the fields),
extra (msgpack of any fields past the 14, so new fields never break the checksum). A record
whose body does not decode is exported with op "undecodable" and the raw body in `extra`:
the audit names it instead of the exporter hiding it.

API for the node (the HTTP route `POST /v1/journal/export` and `qctl journal export` call it):

    from qserver.storage.journal_export import ExportSettings, JournalExporter, JournalSource
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(destination="/srv/journal", retention_ms=3_600_000))
    exporter.due(now_ms)                  -> bool: a segment is full or old enough
    exporter.export(now_ms, force=False)  -> list[Segment]: seal and write what is due
                                             (force: also the unsealed tail; on demand)
    exporter.prune(safe_sequence, now_ms) -> int: records deleted from LMDB (prune_step: one transaction)
    exporter.prunable(now_ms)             -> bool: exported records past the retention are held
    exporter.status()                     -> dict (JSON): journal id, exported_through, pending, ...
    safe_sequence_for(source, floors)     -> int: the highest journal sequence below which every
                                             record of the queues in `floors` (local queue id ->
                                             highest ordering index every member holds) is passed

Threads: `export` reads in its own LMDB read transaction and writes files: run it off the
event loop. A node runs it, with the prune's scan, in a process of its own
(`export_in_process`), where its msgpack work never competes for the engine's GIL. `prune`
deletes in short write transactions of at most `prune_keys_per_txn_max` keys: run it on the storage writer's thread, between commits, so it
neither waits behind a group commit nor delays one. It deletes only records that are exported
(found in the destination), at or below the caller's `safe_sequence` (the pair's members have
all passed them: catch-up may read them) and older than `retention_ms`.

Offline (a stopped node, or tests): `export_environment(lmdb_path, destination)` exports
everything not yet in the destination, read-only.
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from replication.journal import JOURNAL_FIELDS, RECORD_COLUMNS, UNDECODABLE_OP, is_run, run_count, run_rows

_Q = struct.Struct(">Q")
_U32 = struct.Struct(">I")
READER_MAP_BYTES = 1 << 40     # NodeConfig.map_size_max_bytes by default (JournalSource.open; a
                               # node configured larger gets its export retried at the next interval)
SEGMENT_NAME = re.compile(r"^journal-(?P<node>.+)-(?P<journal>[0-9a-z]+)-(?P<first>\d{20})-(?P<last>\d{20})\.parquet$")
INT_COLUMNS = frozenset({"sequence", "at_ms", "queue_id", "epoch", "index", "message_id", "priority",
                          "payload_size", "payload_crc32", "record_crc32"})
SCHEMA = pa.schema([(name, pa.int64() if name in INT_COLUMNS else pa.binary() if name == "extra" else pa.string())
                    for name in RECORD_COLUMNS])


@dataclass(frozen=True)
class ExportSettings:
    destination: str
    segment_records_max: int = 200_000      # a segment is sealed at this many records ...
    segment_age_max_ms: int = 300_000       # ... or when its oldest record is this old
    retention_ms: int = 3_600_000           # exported records stay in LMDB at least this long
    prune_keys_per_txn_max: int = 5_000
    compression: str = "zstd"

    def __post_init__(self) -> None:
        if self.segment_records_max < 1 or self.prune_keys_per_txn_max < 1:
            raise ValueError("segment_records_max and prune_keys_per_txn_max must be positive")
        if self.segment_age_max_ms < 0 or self.retention_ms < 0:
            raise ValueError("segment_age_max_ms and retention_ms must not be negative")


@dataclass(frozen=True)
class Segment:
    node: str
    journal_id: str
    first_sequence: int
    last_sequence: int
    path: str                 # inside the destination's filesystem

    @property
    def records(self) -> int:
        return self.last_sequence - self.first_sequence + 1


class JournalSource:
    """The journal and meta databases of one LMDB environment (a node's, or opened offline)."""

    def __init__(self, env: lmdb.Environment, journal_db: Any, meta_db: Any, node_id: str, *,
                 writable: bool) -> None:
        self.env, self.journal_db, self.meta_db = env, journal_db, meta_db
        self.node_id = node_id
        self.writable = writable
        self._journal_id: str | None = None
        self._owned = False

    @classmethod
    def from_storage(cls, storage: Any) -> JournalSource:
        """The node's open `qserver.storage.lmdb_store.Storage`."""
        return cls(storage.env, storage.db["journal"], storage.db["meta"], storage.node_id, writable=True)

    @classmethod
    def open(cls, path: str | Path) -> JournalSource:
        """An environment on disk, read-only (its node may be running). LMDB refuses a reader
        whose map is smaller than the pages the writer has in use by then (MapResizedError),
        and a running node adds pages all the time: the reader maps as much as a node's map
        may ever grow to (address space only; nothing past the file is touched)."""
        env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=32, readahead=False,
                        map_size=READER_MAP_BYTES)
        with env.begin() as txn:
            names = {bytes(key) for key, _ in txn.cursor()}
        if b"journal" not in names or b"meta" not in names:
            env.close()
            raise FileNotFoundError(f"{path} holds no qserver journal")
        source = cls(env, env.open_db(b"journal", create=False), env.open_db(b"meta", create=False), "",
                     writable=False)
        with env.begin(db=source.meta_db) as txn:
            node = txn.get(b"node_id")
        source.node_id = bytes(node).decode() if node else Path(path).resolve().parent.name
        source._owned = True
        return source

    def close(self) -> None:
        if self._owned:
            self.env.close()

    def journal_id(self) -> str:
        """The journal's id: the environment's storage id (storage.py writes one per disk), or
        for an environment from before storage ids, one derived from its first record."""
        if self._journal_id is not None:
            return self._journal_id
        with self.env.begin(db=self.meta_db) as txn:
            storage_id = txn.get(b"storage_id")
        if storage_id:
            self._journal_id = f"{_Q.unpack(storage_id)[0]:016x}"
            return self._journal_id
        with self.env.begin(db=self.journal_db) as txn:
            first = txn.get(_Q.pack(1))
        self._journal_id = hashlib.sha256(bytes(first)).hexdigest()[:16] if first else "0" * 16
        return self._journal_id

    def bounds(self) -> tuple[int, int]:
        """(first, last) sequence held; (0, 0) when the journal is empty. A run record holds
        the sequences up to its key: the first is its first row's."""
        with self.env.begin(db=self.journal_db) as txn:
            cursor = txn.cursor()
            if not cursor.first():
                return 0, 0
            first = _Q.unpack(cursor.key())[0] - _rows_in(cursor.value()) + 1
            cursor.last()
            return first, _Q.unpack(cursor.key())[0]

    def record_end(self, first: int, limit: int) -> int:
        """Where a segment from `first` ends, aiming at `limit`: the key of the last record at
        or below it, or of the first record when that alone goes further (a run record is
        never split between two segments)."""
        with self.env.begin(db=self.journal_db) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_Q.pack(first)):
                return limit
            end = int(_Q.unpack(cursor.key())[0])
            if end >= limit:
                return end
            if cursor.set_range(_Q.pack(limit + 1)):
                cursor.prev()
            else:
                cursor.last()
            return int(_Q.unpack(cursor.key())[0])

    def first_at_ms(self, after_sequence: int) -> int | None:
        """The time of the first record after `after_sequence` (None when there is none)."""
        with self.env.begin(db=self.journal_db) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_Q.pack(after_sequence + 1)):
                return None
            try:
                return int(msgpack.unpackb(cursor.value()[:-4])[0])
            except Exception:      # an undecodable record: export it now, the audit names it
                return 0

    def read_columns(self, first: int, last: int) -> dict[str, list[Any]]:
        """Records first..last (those present) as columns of the export schema, a run record
        as one row per message: its stored checksum is verified here, and each row carries
        the checksum of its own fields, which the audit recomputes as for any record."""
        columns: dict[str, list[Any]] = {name: [] for name in RECORD_COLUMNS}
        journal_id = self.journal_id()
        fields = [columns[name] for name in JOURNAL_FIELDS]
        sequences, checksums, extras = columns["sequence"], columns["record_crc32"], columns["extra"]
        unpack = _U32.unpack
        pack = msgpack.Packer(use_bin_type=True).pack
        with self.env.begin(db=self.journal_db) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_Q.pack(first)):
                return columns
            for key, value in cursor:
                sequence = _Q.unpack(key)[0]
                if sequence > last:
                    break
                body, checksum = value[:-4], unpack(value[-4:])[0]
                record = _decode(body)
                extra: bytes | None
                if record is not None and is_run(record):
                    rows = run_rows(record) if zlib.crc32(body) == checksum else None
                    if rows is not None and all(_valid_fields(row) for row in rows):
                        for offset, row in enumerate(rows, sequence - len(rows) + 1):
                            for column, item in zip(fields, row, strict=True):
                                column.append(item)
                            sequences.append(offset)
                            checksums.append(zlib.crc32(pack(row)))
                            extras.append(None)
                        continue
                    record = None       # exported as one undecodable record: the audit names it
                if record is None:
                    record, extra = self._undecodable(), bytes(body)
                else:
                    extra = msgpack.packb(record[14:], use_bin_type=True) if len(record) > 14 else None
                for column, item in zip(fields, record, strict=False):
                    column.append(item)
                sequences.append(sequence)
                checksums.append(checksum)
                extras.append(extra)
        columns["journal_id"] = [journal_id] * len(sequences)
        return columns

    def _undecodable(self) -> list[Any]:
        return [0, "", 0, 0, 0, UNDECODABLE_OP, 0, None, 0, 0, 0, "", self.node_id, None]


def _decode(body: bytes) -> list[Any] | None:
    """A record body as the field list, or None when it is not a well-formed record."""
    try:
        record = msgpack.unpackb(body)
    except Exception:
        return None
    if not isinstance(record, list) or len(record) < len(JOURNAL_FIELDS) or not _valid_fields(record):
        return None
    return record


def _valid_fields(record: list[Any]) -> bool:
    for position, name in enumerate(JOURNAL_FIELDS):
        item = record[position]
        if name in INT_COLUMNS:
            if item is not None and (type(item) is not int or not -(1 << 63) <= item < (1 << 63)):
                return False
        elif item is not None and type(item) is not str:
            return False
    return True


def columns_table(columns: Mapping[str, list[Any]]) -> pa.Table:
    return pa.table({name: pa.array(columns[name], type=SCHEMA.field(name).type) for name in RECORD_COLUMNS},
                    schema=SCHEMA)


def filesystem_for(destination: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, base path) of a directory or URI."""
    if "://" not in destination:
        destination = str(Path(destination).resolve())
    filesystem, path = pafs.FileSystem.from_uri(destination)
    return filesystem, path.rstrip("/")


def _sync(filesystem: pafs.FileSystem, path: str) -> None:
    """fsync a local file or directory. Object stores (s3://, gs://, abfs://) hold an object
    once its upload completes, and HDFS a file once it is closed: nothing more to do there."""
    if not isinstance(filesystem, pafs.LocalFileSystem):
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _safe_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", node) or "_"


class JournalExporter:
    """Seals, writes and prunes one journal's segments (see the module docstring)."""

    def __init__(self, source: JournalSource, settings: ExportSettings,
                 filesystem: pafs.FileSystem | None = None) -> None:
        self.source = source
        self.settings = settings
        if filesystem is None:
            self.filesystem, self.base = filesystem_for(settings.destination)
        else:
            self.filesystem, self.base = filesystem, settings.destination.rstrip("/")
        self.directory = f"{self.base}/{_safe_name(source.node_id)}"
        self._lock = threading.Lock()
        self._exported_through: int | None = None

    # --- what was exported ----------------------------------------------------------------
    def segments(self) -> list[Segment]:
        """This journal's segments found in the destination, in order."""
        journal_id = self.source.journal_id()
        selector = pafs.FileSelector(self.directory, allow_not_found=True)
        found = []
        for info in self.filesystem.get_file_info(selector):
            match = SEGMENT_NAME.match(info.base_name)
            if match and match["journal"] == journal_id:
                found.append(Segment(self.source.node_id, journal_id, int(match["first"]), int(match["last"]),
                                     info.path))
        return sorted(found, key=lambda segment: segment.first_sequence)

    def forget_exported(self) -> None:
        """Segments were written by another exporter of this journal (the node's export
        process): find them again in the destination."""
        self._exported_through = None

    @property
    def exported_through(self) -> int:
        if self._exported_through is None:
            segments = self.segments()
            self._exported_through = segments[-1].last_sequence if segments else 0
        return self._exported_through

    def pending(self) -> tuple[int, int]:
        """(first, last) sequence not yet exported; first > last when nothing is pending."""
        first, last = self.source.bounds()
        return max(self.exported_through + 1, first), last

    def due(self, now_ms: int) -> bool:
        first, last = self.pending()
        if first > last:
            return False
        if last - first + 1 >= self.settings.segment_records_max:
            return True
        oldest = self.source.first_at_ms(first - 1)
        return oldest is not None and now_ms - oldest >= self.settings.segment_age_max_ms

    def prunable(self, now_ms: int) -> bool:
        """The journal starts with an exported record past the retention: a prune would delete
        something (given the pairs' floors), even if nothing new is due for export."""
        first, _ = self.source.bounds()
        if first == 0 or first > self.exported_through:
            return False
        oldest = self.source.first_at_ms(first - 1)
        return oldest is not None and now_ms - oldest >= self.settings.retention_ms

    # --- export ---------------------------------------------------------------------------
    def export(self, now_ms: int, *, force: bool = False) -> list[Segment]:
        """Write every full segment; then the partial tail when forced or old enough."""
        with self._lock:
            written = []
            while True:
                first, last = self.pending()
                if first > last:
                    break
                limit = min(last, first + self.settings.segment_records_max - 1)
                if limit - first + 1 < self.settings.segment_records_max and not force:
                    oldest = self.source.first_at_ms(first - 1)
                    if oldest is None or now_ms - oldest < self.settings.segment_age_max_ms:
                        break
                written.append(self._write_segment(first, self.source.record_end(first, limit)))
            return written

    def _write_segment(self, first: int, last: int) -> Segment:
        columns = self.source.read_columns(first, last)
        journal_id = self.source.journal_id()
        node = _safe_name(self.source.node_id)
        name = f"journal-{node}-{journal_id}-{first:020d}-{last:020d}.parquet"
        final, temporary = f"{self.directory}/{name}", f"{self.directory}/_tmp-{uuid.uuid4().hex}-{name}"
        self.filesystem.create_dir(self.directory, recursive=True)
        pq.write_table(columns_table(columns), temporary, filesystem=self.filesystem,
                       compression=self.settings.compression)
        # Durable before it counts as exported: the prune deletes from LMDB (fsync'd) what the
        # destination's file names say is exported, and a crash must not leave the journal with
        # neither copy (issue 32: the prune ran before the segment reached the disk).
        _sync(self.filesystem, temporary)
        self.filesystem.move(temporary, final)
        _sync(self.filesystem, self.directory)          # the rename
        _sync(self.filesystem, self.directory.rpartition("/")[0] or "/")   # the directory, if it is new
        self._exported_through = last
        return Segment(self.source.node_id, journal_id, first, last, final)

    # --- prune ----------------------------------------------------------------------------
    def prune(self, safe_sequence: int, now_ms: int) -> int:
        """Delete exported records at or below `safe_sequence` older than the retention, from
        the journal's start, in short write transactions. Returns how many were deleted."""
        deleted = 0
        while True:
            count, done = self.prune_step(safe_sequence, now_ms)
            deleted += count
            if done:
                return deleted

    def prune_step(self, safe_sequence: int, now_ms: int) -> tuple[int, bool]:
        """One short write transaction of `prune` (at most prune_keys_per_txn_max records):
        a node runs each as its own job of the writer thread, so commits go between them.
        Returns (records deleted, whether the prune is done)."""
        if not self.source.writable:
            raise PermissionError("this journal source is read-only")
        with self._lock:
            return self._prune_batch(min(self.exported_through, safe_sequence), now_ms - self.settings.retention_ms)

    def _prune_batch(self, bound: int, cutoff_ms: int) -> tuple[int, bool]:
        count = 0
        with self.source.env.begin(write=True, db=self.source.journal_db) as txn:
            cursor = txn.cursor()
            if not cursor.last():
                return 0, True
            # The sequence goes on after the journal's last record, which this may delete.
            txn.put(b"journal_sequence", cursor.key(), db=self.source.meta_db)
            cursor.first()
            while count < self.settings.prune_keys_per_txn_max:
                key = cursor.key()
                if not key or _Q.unpack(key)[0] > bound or _record_at_ms(cursor.value()) > cutoff_ms:
                    return count, True
                cursor.delete()
                count += 1
        return count, False

    def status(self) -> dict[str, Any]:
        first, last = self.source.bounds()
        pending_first, pending_last = self.pending()
        return {"node": self.source.node_id, "journal_id": self.source.journal_id(),
                "destination": self.settings.destination, "first_sequence": first, "last_sequence": last,
                "exported_through": self.exported_through,
                "pending_records": max(0, pending_last - pending_first + 1)}


def _rows_in(value: bytes) -> int:
    """How many journal sequences a stored record takes."""
    record = _decode(value[:-4])
    return 1 if record is None else run_count(record)


def _record_at_ms(value: bytes) -> int:
    try:
        return int(msgpack.unpackb(value[:-4])[0])
    except Exception:
        return 0        # undecodable: old enough to go once it is exported


def iterate_records(source: JournalSource, after: int = 0) -> Iterator[tuple[int, list[Any] | None]]:
    """(sequence, fields or None when undecodable) from `after` on; for tools and tests."""
    with source.env.begin(db=source.journal_db) as txn:
        cursor = txn.cursor()
        if not cursor.set_range(_Q.pack(after + 1)):
            return
        for key, value in cursor:
            yield _Q.unpack(key)[0], _decode(value[:-4])


def safe_sequence_for(source: JournalSource, floors: Mapping[int, int], scan_max: int = 1_000_000,
                      upto: int | None = None, older_than_ms: int | None = None) -> int:
    """The highest sequence s such that every record up to s of a queue in `floors` (local
    queue id -> the highest ordering index every member of its pair holds) is at or below
    its floor. Records of other queues and local records (index 0) never hold it back. Scans
    at most `scan_max` records from the journal's start, none past `upto` and, given
    `older_than_ms`, none from the first record at or after it (the prune stops there anyway:
    the scan need not read an hour of journal to learn that nothing is old enough)."""
    bound = 0
    for scanned, (sequence, record) in enumerate(iterate_records(source)):
        if scanned >= scan_max or (upto is not None and sequence > upto):
            break
        if record is not None and older_than_ms is not None and record[0] > older_than_ms:
            break
        if record is not None:
            floor = floors.get(record[2])
            if floor is not None and record[4] + run_count(record) - 1 > floor:
                break
        bound = sequence
    return bound


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Initializer of the node's export process: it goes when the node goes, even by SIGKILL
    (its task queue's pipe never reports the end: the process holds both of its ends). A
    segment cut short is left under its `_tmp-` name, which nothing reads."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def export_in_process(path: str, settings: ExportSettings, now_ms: int, force: bool,
                      floors: Mapping[int, int]) -> tuple[list[Segment], int]:
    """What a node runs in its export process (qserver/node.py): export what is due from the
    environment at `path`, opened read-only here, and find the journal's safe sequence for the
    prune (`safe_sequence_for`, up to what is exported). Both are scans of up to a million
    records with msgpack: in a process of their own they never hold the engine's GIL. The
    environment is opened for each call and mapped as large as the node's may grow
    (JournalSource.open), so the node's writes meanwhile never make it unreadable."""
    source = JournalSource.open(path)
    try:
        exporter = JournalExporter(source, settings)
        segments = exporter.export(now_ms, force=force)
        return segments, safe_sequence_for(source, floors, upto=exporter.exported_through,
                                           older_than_ms=now_ms - settings.retention_ms)
    finally:
        source.close()


def export_environment(path: str | Path, destination: str, *, segment_records_max: int = 200_000,
                       filesystem: pafs.FileSystem | None = None) -> list[Segment]:
    """Export everything of the environment at `path` not yet in `destination` (read-only)."""
    source = JournalSource.open(path)
    try:
        exporter = JournalExporter(source, ExportSettings(destination, segment_records_max=segment_records_max),
                                   filesystem)
        return exporter.export(0, force=True)
    finally:
        source.close()
