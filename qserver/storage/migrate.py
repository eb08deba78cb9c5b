"""Storage layouts and the migrations between them (docs/OPERATIONS.md, "Storage layouts and
migration").

A data directory's LMDB environment records its layout in `meta` (b"schema_version", the number
rows.py's SCHEMA_VERSION names). Storage runs `migrate_at_start` before anything reads a row:
a directory of an older layout is brought to this release's, step by step (N -> N+1, `UPGRADES`);
one of a newer layout is refused, naming both layouts and both releases as far as they are known.
`qserver migrate` runs the same steps by hand, or with --dry-run says what they would do, or
with --to brings a directory back to an older layout this release can still write
(`DOWNGRADES`: for rolling back before the cluster is finalized).

Crash safety: each step is one LMDB write transaction that also moves the stored layout number
and appends to the history: a crash (or any error) anywhere in it leaves the directory exactly
as it was, and the next start runs the step again from the beginning. A row a step cannot
decode stops it (MigrationError names the database and key); the transaction is aborted, so
nothing is deleted or half-written.

`meta` also records (since layout 8; layout 7 code ignores these keys):
    b"release"         the qserver release that last opened the directory for writing
    b"layout_history"  JSON list of {"release", "from", "to", "at"}: the directory's creation
                       (from null) and each migration, oldest first
"""
from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb
import msgpack

from qserver.storage.rows import DB_NAMES
from replication.queue_record import QueueRecord, sequences_from_json
from wire.versions import RELEASE

log = logging.getLogger("qserver.storage")

LAYOUT_KEY = b"schema_version"
RELEASE_KEY = b"release"
HISTORY_KEY = b"layout_history"
_Q = struct.Struct(">Q")
# Tests only: "fail:N" raises inside a step after the N-th row it read or wrote (the transaction
# is aborted); "stall:N" prints MIGRATION-STALLED to stderr there and sleeps, for a kill -9.
TEST_HOOK_ENV = "QSERVER_TEST_MIGRATION_HOOK"
# The layout each release reads, as far as this code knows (a directory's `release` key names
# the release that wrote it; layout 7 directories predate that key).
LAYOUT_RELEASES = {7: "0.1.0", 8: "0.2.0"}
# What layout 7's code (release 0.1.0) builds a queue record and its options from: a record
# with any other field would not load there (QueueRecord(**fields) refuses unknown names).
LAYOUT7_RECORD_FIELDS = frozenset({
    "queue_id", "name", "options", "created_ms", "next_index", "epoch", "state", "ready_count", "delayed_count",
    "dead_letter_of", "total_enqueued", "total_acked", "total_dead_lettered", "total_purged", "total_expired",
    "total_redelivered", "highest_depth", "service_ms_total", "service_count", "incarnation", "commit_order",
    "subscriptions", "sequences"})
LAYOUT7_OPTION_FIELDS = frozenset({
    "strength", "max_depth", "type", "visibility_timeout_s", "max_deliveries", "dead_letter", "min_in_sync",
    "message_ttl_s", "fault_interval_s", "defunct_interval_s", "message_interval_s", "forward_rate",
    "forward_interval_s", "forward_mode", "forward_bands"})


class StorageLayoutError(Exception):
    """The data directory holds a storage layout this release cannot read or bring to its own."""


class MigrationError(StorageLayoutError):
    """A step met a row it cannot decode, or data the target layout cannot hold: nothing was changed."""


@dataclass
class StepReport:
    """What one step did (or, in a dry run, would do)."""
    from_layout: int
    to_layout: int
    summary: str
    examined: dict[str, int] = field(default_factory=dict)    # database -> rows read
    rewritten: dict[str, int] = field(default_factory=dict)   # database -> rows written or deleted
    extra_bytes: int = 0            # the rows it writes: LMDB copies their pages until the commit
    seconds: float = 0.0

    @property
    def extra_disk_bytes(self) -> int:
        """What the data file may grow by: LMDB writes each changed page anew (copy on write) and
        frees the old one only once the transaction commits; a page (4 KiB) per row written, and
        the rows themselves over again when they spill their pages."""
        return sum(self.rewritten.values()) * 4096 + 2 * self.extra_bytes

    def to_json(self) -> dict[str, Any]:
        return {"from": self.from_layout, "to": self.to_layout, "summary": self.summary, "examined": self.examined,
                "rewritten": self.rewritten, "extra_disk_bytes": self.extra_disk_bytes,
                "seconds": round(self.seconds, 6)}


@dataclass
class MigrationReport:
    path: str
    stored_layout: int | None        # None: a new directory
    target_layout: int
    written_by: str | None           # meta's release, when a release that records it wrote it
    history: list[dict[str, Any]]
    dry_run: bool
    steps: list[StepReport] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "stored_layout": self.stored_layout, "target_layout": self.target_layout,
                "written_by": self.written_by, "release": RELEASE, "dry_run": self.dry_run,
                "history": self.history, "steps": [step.to_json() for step in self.steps],
                "extra_disk_bytes": max((step.extra_disk_bytes for step in self.steps), default=0)}


class _Step:
    """Shared bookkeeping of a step's run: counts, the extra bytes, the test hook."""

    def __init__(self, report: StepReport, dry_run: bool) -> None:
        self.report, self.dry_run = report, dry_run
        hook = os.environ.get(TEST_HOOK_ENV, "")
        kind, _, at = hook.partition(":")
        self._hook = (kind, int(at)) if kind in ("fail", "stall") and at.isdigit() else None
        self._count = 0             # rows read or written (the test hook's clock)

    def examined(self, name: str) -> None:
        self.report.examined[name] = self.report.examined.get(name, 0) + 1
        self._handled()

    def write(self, txn: lmdb.Transaction, db: Any, name: str, key: bytes, value: bytes | None) -> None:
        self.report.rewritten[name] = self.report.rewritten.get(name, 0) + 1
        self.report.extra_bytes += len(key) + (len(value) if value is not None else 0)
        if self.dry_run:
            return
        if value is None:
            txn.delete(key, db=db)
        else:
            txn.put(key, value, db=db)
        self._handled()

    def _handled(self) -> None:
        self._count += 1
        if self._hook is not None and not self.dry_run and self._count == self._hook[1]:
            if self._hook[0] == "fail":
                raise RuntimeError(f"{TEST_HOOK_ENV}: failing the migration after {self._count} rows")
            os.write(2, b"MIGRATION-STALLED\n")
            time.sleep(120)


def _decoded(name: str, key: bytes, value: bytes) -> Any:
    try:
        return msgpack.unpackb(value)
    except (ValueError, msgpack.UnpackException, TypeError) as error:
        raise MigrationError(f"database {name!r}, key {key!r}: the row does not decode ({error}); the migration "
                             f"stopped and nothing was changed") from None


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)    # as commit.py's writer packs rows


def _streams_out_of_records(txn: lmdb.Transaction, dbs: dict[str, Any], step: _Step) -> None:
    """7 -> 8: every queue record's numbered streams move to their rows in `streams`, and the
    retired `in_sync` field (issue 33) goes. Layout 7 left both to the record's next write, so
    every reader had to merge streams out of records; layout 8 has them in rows only.

    A stream row already stored is newer than the record's copy (layout 7 wrote a stream's row
    whenever it changed, and the record kept its old copy until its next write): the row stays.
    Stream rows still in the form before floors ([number, id]) are rewritten in today's."""
    streams_db = dbs["streams"]
    for raw_key, value in txn.cursor(db=dbs["queues"]):
        key = bytes(raw_key)
        step.examined("queues")
        record = _decoded("queues", key, bytes(value))
        try:
            loaded = QueueRecord.from_json(record)
        except (KeyError, TypeError, ValueError) as error:
            raise MigrationError(f"database 'queues', key {key!r}: the queue record does not load ({error!r}); the "
                                 f"migration stopped and nothing was changed") from None
        if "sequences" not in record and "in_sync" not in record:
            continue
        prefix = _Q.pack(loaded.queue_id)
        for stream_key in sorted(loaded.sequences):
            row_key = prefix + stream_key.encode()
            step.examined("streams")
            if txn.get(row_key, db=streams_db) is None:
                step.write(txn, streams_db, "streams", row_key, _pack(loaded.stream_json(stream_key)))
        record.pop("sequences", None)
        record.pop("in_sync", None)
        step.write(txn, dbs["queues"], "queues", key, _pack(record))
    for raw_key, value in txn.cursor(db=streams_db):
        key = bytes(raw_key)
        step.examined("streams")
        stream = _decoded("streams", key, bytes(value))
        if not (isinstance(stream, list) and len(stream) == 2):
            raise MigrationError(f"database 'streams', key {key!r}: not a stream row ({stream!r}); the migration "
                                 f"stopped and nothing was changed")
        if isinstance(stream[1], int):          # before floors: [number, id]
            floor, kept = next(iter(sequences_from_json({"k": stream}).values()))
            step.write(txn, streams_db, "streams", key, _pack([floor, [[n, i] for n, i in kept.items()]]))


def _back_to_7(txn: lmdb.Transaction, dbs: dict[str, Any], step: _Step) -> None:
    """8 -> 7: layout 8 is layout 7 with every stream in its row, which layout 7's code reads
    (it reads stream rows, and records without streams). Refused when a queue record holds a
    field layout 7's code does not know (QueueRecord(**fields) would refuse it there)."""
    for raw_key, value in txn.cursor(db=dbs["queues"]):
        key = bytes(raw_key)
        step.examined("queues")
        record = _decoded("queues", key, bytes(value))
        unknown = sorted(set(record) - LAYOUT7_RECORD_FIELDS)
        unknown += sorted(f"options.{name}" for name in set(record.get("options", {})) - LAYOUT7_OPTION_FIELDS)
        if unknown:
            raise MigrationError(f"database 'queues', key {key!r}: the record holds {', '.join(unknown)}, which "
                                 f"layout 7 (qserver {LAYOUT_RELEASES[7]}) cannot read; nothing was changed")


@dataclass(frozen=True)
class Migration:
    from_layout: int
    to_layout: int
    summary: str
    run: Callable[[lmdb.Transaction, dict[str, Any], _Step], None]


# Ordered: UPGRADES[i] goes from OLDEST_LAYOUT + i to OLDEST_LAYOUT + i + 1.
OLDEST_LAYOUT = 7
UPGRADES = (
    Migration(7, 8, "move numbered streams out of queue records into their stream rows; drop in_sync",
              _streams_out_of_records),
)
DOWNGRADES = {
    8: Migration(8, 7, "renumber to layout 7 (every layout 8 row is one layout 7 reads)", _back_to_7),
}
NEWEST_LAYOUT = UPGRADES[-1].to_layout


def stored_layout(txn: lmdb.Transaction, meta: Any) -> int | None:
    raw = txn.get(LAYOUT_KEY, db=meta)
    return None if raw is None else int(_Q.unpack(raw)[0])


def read_history(txn: lmdb.Transaction, meta: Any) -> list[dict[str, Any]]:
    raw = txn.get(HISTORY_KEY, db=meta)
    return [] if raw is None else list(json.loads(bytes(raw)))


def _release_of(layout: int, written_by: str | None) -> str:
    known = written_by or LAYOUT_RELEASES.get(layout)
    return f"qserver {known}" if known else "a qserver release"


def plan(layout: int, target: int) -> list[Migration]:
    """The steps from `layout` to `target`, or StorageLayoutError naming why there are none."""
    if layout == target:
        return []
    if target > layout:
        if layout < OLDEST_LAYOUT or target > NEWEST_LAYOUT:
            raise StorageLayoutError(
                f"no migration from layout {layout} to {target}: this release (qserver {RELEASE}) migrates "
                f"layouts {OLDEST_LAYOUT} to {NEWEST_LAYOUT}. Nothing was changed. Either run the qserver release "
                f"that wrote it, or move the directory aside and start this node on an empty one: it rejoins the "
                f"cluster and its pairs give it their queues by state transfer (export the journal first with "
                f"the old release if the audit needs it).")
        return list(UPGRADES[layout - OLDEST_LAYOUT:target - OLDEST_LAYOUT])
    steps = []
    for at in range(layout, target, -1):
        if at not in DOWNGRADES:
            raise StorageLayoutError(f"no way back from layout {at} to {at - 1} in qserver {RELEASE}")
        steps.append(DOWNGRADES[at])
    return steps


def too_new_message(path: str, layout: int, written_by: str | None, readable: int) -> str:
    return (f"the data directory {path} has storage layout {layout} written by {_release_of(layout, written_by)}; "
            f"this is qserver {RELEASE}, which reads layout {readable}. Nothing was changed. Run the newer "
            f"release on it, or bring it back first with that release's `qserver migrate --to {readable}` "
            f"(docs/OPERATIONS.md, \"Storage layouts and migration\"), or start this node on an empty directory "
            f"(its pairs give it their queues by state transfer)")


def migrate(env: lmdb.Environment, dbs: dict[str, Any], path: str, *, target: int, readable: int,
            dry_run: bool = False) -> MigrationReport:
    """Bring the environment's layout to `target` (one write transaction per step), or in a dry
    run say what that would do and change nothing. `readable`: the layout this code reads (a
    newer stored layout is refused, whatever the target)."""
    meta = dbs["meta"]
    with env.begin(db=meta) as txn:
        layout = stored_layout(txn, meta)
        raw_release = txn.get(RELEASE_KEY, db=meta)
        written_by = None if raw_release is None else bytes(raw_release).decode()
        history = read_history(txn, meta)
    report = MigrationReport(path, layout, target, written_by, history, dry_run)
    if layout is None:
        return report                      # a new directory: Storage writes its layout
    if layout > readable:
        raise StorageLayoutError(too_new_message(path, layout, written_by, readable))
    for migration in plan(layout, target):
        step_report = StepReport(migration.from_layout, migration.to_layout, migration.summary)
        started = time.perf_counter()
        log.info("storage %s: %s layout %d -> %d: %s", path, "would migrate" if dry_run else "migrating",
                 migration.from_layout, migration.to_layout, migration.summary)
        if dry_run:
            with env.begin(db=meta) as txn:
                migration.run(txn, dbs, _Step(step_report, dry_run=True))
        else:
            with env.begin(write=True, db=meta) as txn:
                if stored_layout(txn, meta) != migration.from_layout:       # another process moved it
                    raise StorageLayoutError(f"the data directory {path} changed layout during the migration")
                migration.run(txn, dbs, _Step(step_report, dry_run=False))
                history.append({"release": RELEASE, "from": migration.from_layout, "to": migration.to_layout,
                                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                txn.put(HISTORY_KEY, json.dumps(history).encode(), db=meta)
                txn.put(LAYOUT_KEY, _Q.pack(migration.to_layout), db=meta)
                if migration.to_layout > migration.from_layout:
                    txn.put(RELEASE_KEY, RELEASE.encode(), db=meta)
                else:       # for an older release, which will not keep the key current
                    txn.delete(RELEASE_KEY, db=meta)
        step_report.seconds = time.perf_counter() - started
        report.steps.append(step_report)
        log.info("storage %s: %s layout %d -> %d in %.3f s: read %s, %s %s", path,
                 "would migrate" if dry_run else "migrated", migration.from_layout, migration.to_layout,
                 step_report.seconds, step_report.examined, "would write" if dry_run else "wrote",
                 step_report.rewritten)
    return report


def stamp(env: lmdb.Environment, meta: Any, layout: int) -> None:
    """Record this release as the directory's last writer; a new directory's history starts
    with its creation. Called by Storage once its layout is its own."""
    with env.begin(write=True, db=meta) as txn:
        if txn.get(HISTORY_KEY) is None:
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            txn.put(HISTORY_KEY, json.dumps([{"release": RELEASE, "from": None, "to": layout, "at": at}]).encode())
        if txn.get(RELEASE_KEY) != RELEASE.encode():
            txn.put(RELEASE_KEY, RELEASE.encode())


def open_environment(path: str, *, dry_run: bool) -> tuple[lmdb.Environment, dict[str, Any]]:
    """An existing node environment and its databases, for `qserver migrate` (a dry run
    creates nothing in it). StorageLayoutError when `path` holds none."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise StorageLayoutError(f"{path} holds no node storage (no data.mdb): nothing to migrate")
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    env = lmdb.open(path, map_size=max(1 << 30, size + (256 << 20)), max_dbs=len(DB_NAMES) + 2, sync=True,
                    metasync=True, readahead=False, create=False, mode=0o600)
    try:
        dbs = {name: env.open_db(name.encode(), create=not dry_run) for name in DB_NAMES}
    except lmdb.NotFoundError:
        env.close()
        raise StorageLayoutError(f"{path} lacks some of a node's databases: not a node's storage") from None
    return env, dbs
