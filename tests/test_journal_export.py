"""Journal export (qserver/storage/journal_export.py): segments sealed by size, age and on demand,
written where pyarrow.fs can write, continued after a restart, pruned only when exported, safe
and past the retention; what the files say is what LMDB said, and the audit reads it."""
from __future__ import annotations

import multiprocessing
import struct
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pyarrow.parquet as pq
import pytest

from audit.checks.violations import RECORD_CHECKSUM
from audit.inputs import read_records
from audit.local import audit_records
from qserver.storage.journal_export import (
    ExportSettings,
    JournalExporter,
    JournalSource,
    export_environment,
    export_in_process,
    safe_sequence_for,
)
from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.journal import JOURNAL_FIELDS, RECORD_COLUMNS, UNDECODABLE_OP, record_checksum_ok
from replication.operations import Acked, Enqueued, Leased
from replication.snapshot import ROW_MESSAGE, message_row

NOW_MS = 1_790_000_000_000


def commit_enqueues(storage: Storage, queue_id: int, first: int, count: int, at_ms: int = NOW_MS, *,
                    one_producer: bool = False) -> None:
    """`count` enqueues in one commit: journaled as one run record when `one_producer`, else
    (a producer each) as `count` records."""
    operations = [Enqueued(queue_id, index, 4, at_ms, f"d{queue_id}-{index}",
                           "producer" if one_producer else f"producer-{index}", f"m{index}".encode())
                  for index in range(first, first + count)]
    storage.commit(SealedBatch(operations=list(operations), queue_records={f"q{queue_id}": {"queue_id": queue_id,
                                                                                              "epoch": 1}}))


def consume(storage: Storage, queue_id: int, index: int, at_ms: int = NOW_MS) -> None:
    storage.commit(SealedBatch(operations=[Leased(queue_id, index, 4, "r", 30_000, 1, "consumer", at_ms),
                                           Acked(queue_id, index, 4, "consumer", at_ms + 1, False)],
                               queue_records={f"q{queue_id}": {"queue_id": queue_id, "epoch": 1}}))


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    store = Storage(tmp_path / "lmdb", node_id="n1")
    yield store
    store.close()


def test_each_exported_column_holds_what_storage_wrote_under_its_name(storage: Storage, tmp_path: Path) -> None:
    """Storage writes a record as a list in JOURNAL_FIELDS order and the audit reads the files by
    column name (RECORD_COLUMNS): an enqueue, its lease and its ack read back field by field."""
    commit_enqueues(storage, 1, 1, 1)
    consume(storage, 1, 1)
    JournalExporter(JournalSource.from_storage(storage), ExportSettings(str(tmp_path / "out"))).export(NOW_MS, force=True)
    table = pq.read_table(next((tmp_path / "out" / "n1").glob("*.parquet")))
    assert tuple(table.column_names) == RECORD_COLUMNS
    enqueue, lease, ack = table.to_pylist()
    assert {name: enqueue[name] for name in JOURNAL_FIELDS} == {
        "at_ms": NOW_MS, "queue": "q1", "queue_id": 1, "epoch": 1, "index": 1, "op": "enqueue", "message_id": 1,
        "dedupe_id": "d1-1", "priority": 4, "payload_size": 2, "payload_crc32": zlib.crc32(b"m1"), "role": "master",
        "node": "n1", "client": "producer-1"}
    assert (lease["op"], lease["message_id"], lease["client"], lease["at_ms"]) == ("lease", 1, "consumer", NOW_MS)
    assert (ack["op"], ack["message_id"], ack["client"], ack["at_ms"]) == ("ack", 1, "consumer", NOW_MS + 1)
    assert [row["sequence"] for row in (enqueue, lease, ack)] == [1, 2, 3]
    assert all(row["journal_id"] == f"{storage.storage_id:016x}" for row in (enqueue, lease, ack))


def test_full_segments_are_sealed_by_size_and_the_tail_on_demand(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 25)
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(str(tmp_path / "out"), segment_records_max=10))
    assert exporter.due(NOW_MS)
    written = exporter.export(NOW_MS)
    assert [(s.first_sequence, s.last_sequence) for s in written] == [(1, 10), (11, 20)]
    assert not exporter.due(NOW_MS) and exporter.pending() == (21, 25)
    [tail] = exporter.export(NOW_MS, force=True)
    assert (tail.first_sequence, tail.last_sequence, tail.records) == (21, 25, 5)
    assert exporter.export(NOW_MS, force=True) == []
    names = sorted(path.name for path in (tmp_path / "out" / "n1").iterdir())
    journal_id = f"{storage.storage_id:016x}"
    assert names[0] == f"journal-n1-{journal_id}-{1:020d}-{10:020d}.parquet" and len(names) == 3


def test_a_producers_batch_is_one_run_record_exported_as_one_row_per_message(storage: Storage,
                                                                              tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 25, one_producer=True)
    consume(storage, 1, 1)
    assert storage.count("journal") == 3, "one run record, then the lease and the ack"
    rows = storage.journal_records()
    assert [(row[4], row[5], row[7]) for row in rows[:25]] == [(i, "enqueue", f"d1-{i}") for i in range(1, 26)]
    exporter = JournalExporter(JournalSource.from_storage(storage), ExportSettings(str(tmp_path / "out")))
    assert exporter.pending() == (1, 27)
    exporter.export(NOW_MS, force=True)
    records = read_records([str(tmp_path / "out")])
    assert [record[1] for record in records] == list(range(1, 28)), "a sequence per message"
    assert [list(record[2:16]) for record in records] == rows
    assert all(record_checksum_ok(record) for record in records)
    report = audit_records(records)
    assert report["verdict"] == "clean", report["violations"]
    assert report["total_queue"]["enqueued"] == 25 and report["total_queue"]["acked"] == 1


def test_segments_end_between_run_records(storage: Storage, tmp_path: Path) -> None:
    for first in (1, 8, 15):
        commit_enqueues(storage, 1, first, 7, one_producer=True)      # keys 7, 14, 21
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(str(tmp_path / "out"), segment_records_max=10))
    written = exporter.export(NOW_MS)
    assert [(s.first_sequence, s.last_sequence) for s in written] == [(1, 7), (8, 14)]
    assert exporter.pending() == (15, 21)
    [tail] = exporter.export(NOW_MS, force=True)
    assert (tail.first_sequence, tail.last_sequence) == (15, 21)
    big = JournalExporter(JournalSource.from_storage(storage), ExportSettings(str(tmp_path / "big"), segment_records_max=5))
    assert [(s.first_sequence, s.last_sequence) for s in big.export(NOW_MS, force=True)] == [(1, 7), (8, 14), (15, 21)]
    report = audit_records(read_records([str(tmp_path / "big")]))
    assert report["verdict"] == "clean" and report["totals"]["records"] == 21


def test_runs_are_pruned_whole_and_held_back_by_their_last_index(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 5, one_producer=True)                       # 1..5
    commit_enqueues(storage, 1, 6, 5, at_ms=NOW_MS + 100_000, one_producer=True)  # 6..10
    source = JournalSource.from_storage(storage)
    assert safe_sequence_for(source, {1: 4}) == 0, "the run holds index 5, which a member lacks"
    assert safe_sequence_for(source, {1: 5}) == 5
    exporter = JournalExporter(source, ExportSettings(str(tmp_path / "out"), retention_ms=60_000))
    exporter.export(NOW_MS, force=True)
    assert exporter.prune(safe_sequence=10, now_ms=NOW_MS + 61_000) == 1       # the first run, whole
    assert source.bounds() == (6, 10) and exporter.pending() == (11, 10)


def test_an_old_enough_tail_is_sealed_by_age(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 3, at_ms=NOW_MS)
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(str(tmp_path / "out"), segment_records_max=100, segment_age_max_ms=60_000))
    assert not exporter.due(NOW_MS + 59_999) and exporter.export(NOW_MS + 59_999) == []
    assert exporter.due(NOW_MS + 60_000)
    assert [s.records for s in exporter.export(NOW_MS + 60_000)] == [3]


def test_the_files_hold_what_the_journal_holds_and_audit_clean(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 5)
    consume(storage, 1, 1)
    JournalExporter(JournalSource.from_storage(storage), ExportSettings(str(tmp_path / "out"))).export(NOW_MS, force=True)
    records = read_records([str(tmp_path / "out")])
    assert [list(record[2:16]) for record in records] == storage.journal_records()
    assert all(record_checksum_ok(record) for record in records)
    report = audit_records(records)
    assert report["verdict"] == "clean", report["violations"]
    assert report["total_queue"] == {"lost": 0, "unexpected": 0, "duplicated": 0, "recovered": 0, "enqueued": 5,
                                     "acked": 1, "dead_lettered": 0, "purged": 0, "expired": 0, "queued": 4}


def test_a_restarted_exporter_continues_after_the_last_segment_it_finds(storage: Storage, tmp_path: Path) -> None:
    settings = ExportSettings(f"file://{tmp_path / 'out'}", segment_records_max=4)
    commit_enqueues(storage, 1, 1, 6)
    JournalExporter(JournalSource.from_storage(storage), settings).export(NOW_MS, force=True)
    (tmp_path / "out" / "n1" / "_tmp-crashed-half.parquet").write_bytes(b"partial")   # an interrupted write
    commit_enqueues(storage, 1, 7, 3)
    again = JournalExporter(JournalSource.from_storage(storage), settings)
    assert again.exported_through == 6
    assert [(s.first_sequence, s.last_sequence) for s in again.export(NOW_MS, force=True)] == [(7, 9)]
    report = audit_records(read_records([str(tmp_path / "out")]))
    assert report["verdict"] == "clean" and report["totals"]["records"] == 9


def test_prune_deletes_only_exported_safe_and_old_records(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 10, at_ms=NOW_MS)
    commit_enqueues(storage, 1, 11, 10, at_ms=NOW_MS + 50_000)
    source = JournalSource.from_storage(storage)
    exporter = JournalExporter(source, ExportSettings(str(tmp_path / "out"), segment_records_max=15,
                                                      retention_ms=60_000, prune_keys_per_txn_max=3))
    exporter.export(NOW_MS)                               # 1..15 exported, 16..20 not yet
    assert exporter.prune(safe_sequence=100, now_ms=NOW_MS + 30_000) == 0            # nothing past retention
    assert exporter.prune(safe_sequence=4, now_ms=NOW_MS + 61_000) == 4              # the pair holds it back
    assert exporter.prune(safe_sequence=100, now_ms=NOW_MS + 61_000) == 6            # the young ones stay
    assert source.bounds() == (11, 20)
    assert exporter.prune(safe_sequence=100, now_ms=NOW_MS + 200_000) == 5           # never past what is exported
    assert source.bounds() == (16, 20)
    exporter.export(NOW_MS + 200_000, force=True)
    report = audit_records(read_records([str(tmp_path / "out")]))
    assert report["verdict"] == "clean" and report["journals"][0]["records"] == 20


def test_exported_records_past_the_retention_are_prunable_with_nothing_new_to_export(storage: Storage,
                                                                                        tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 5)
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(str(tmp_path / "out"), retention_ms=60_000))
    assert not exporter.prunable(NOW_MS + 61_000)                 # not exported yet
    exporter.export(NOW_MS, force=True)
    assert not exporter.due(NOW_MS + 61_000)
    assert not exporter.prunable(NOW_MS + 30_000)                 # within the retention
    assert exporter.prunable(NOW_MS + 61_000)
    assert exporter.prune(safe_sequence=safe_sequence_for(exporter.source, {}, upto=exporter.exported_through),
                          now_ms=NOW_MS + 61_000) == 5
    assert not exporter.prunable(NOW_MS + 61_000)


def test_a_journal_pruned_empty_goes_on_after_its_last_sequence_when_reopened(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    commit_enqueues(storage, 1, 1, 10)
    exporter = JournalExporter(JournalSource.from_storage(storage),
                               ExportSettings(str(tmp_path / "out"), retention_ms=1_000))
    exporter.export(NOW_MS, force=True)
    assert exporter.prune(safe_sequence=100, now_ms=NOW_MS + 2_000) == 10
    assert JournalSource.from_storage(storage).bounds()[1] == 0           # nothing left in the journal
    storage.close()
    storage = Storage(tmp_path / "lmdb", node_id="n1")                    # commits do not write the sequence
    commit_enqueues(storage, 1, 11, 1)
    assert JournalSource.from_storage(storage).bounds() == (11, 11)
    storage.close()


def test_the_safe_bound_follows_the_index_every_member_holds(storage: Storage) -> None:
    commit_enqueues(storage, 1, 1, 5)       # sequences 1..5
    commit_enqueues(storage, 2, 1, 5)       # 6..10: another queue
    commit_enqueues(storage, 1, 6, 5)       # 11..15
    source = JournalSource.from_storage(storage)
    assert safe_sequence_for(source, {1: 3}) == 3
    assert safe_sequence_for(source, {1: 5}) == 10
    assert safe_sequence_for(source, {1: 10, 2: 2}) == 7
    assert safe_sequence_for(source, {}) == 15
    assert safe_sequence_for(source, {}, older_than_ms=NOW_MS - 1) == 0, "nothing old enough to prune"
    commit_enqueues(storage, 1, 11, 5, at_ms=NOW_MS + 10)   # 16..20: younger
    assert safe_sequence_for(source, {}, older_than_ms=NOW_MS) == 15


def test_the_node_exports_and_finds_the_safe_bound_in_a_process_of_its_own(storage: Storage, tmp_path: Path) -> None:
    """What the node's export process runs, as the node runs it: in a spawned process that opens
    the environment read-only while this process holds it open for writing and grows its map
    in between, as a node's map grows under traffic."""
    settings = ExportSettings(str(tmp_path / "out"), segment_records_max=4, retention_ms=0)
    commit_enqueues(storage, 1, 1, 6)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        segments, safe = pool.submit(export_in_process, str(storage.path), settings, NOW_MS, False, {1: 5}).result()
        assert [(s.first_sequence, s.last_sequence) for s in segments] == [(1, 4)] and safe == 4
        storage.end_read()
        storage.grow_map()
        commit_enqueues(storage, 1, 7, 3)
        segments, safe = pool.submit(export_in_process, str(storage.path), settings, NOW_MS, True, {1: 9}).result()
    assert [(s.first_sequence, s.last_sequence) for s in segments] == [(5, 8), (9, 9)] and safe == 9
    node_side = JournalExporter(JournalSource.from_storage(storage), settings)
    assert node_side.exported_through == 9


def test_an_undecodable_record_is_exported_and_named_by_the_audit(storage: Storage, tmp_path: Path) -> None:
    commit_enqueues(storage, 1, 1, 3)
    body = b"\xc1 not msgpack"        # a damaged record that still carries a matching checksum
    with storage.env.begin(write=True, db=storage.db["journal"]) as txn:
        txn.put(struct.pack(">Q", 4), body + struct.pack(">I", zlib.crc32(body)))
    JournalExporter(JournalSource.from_storage(storage), ExportSettings(str(tmp_path / "out"))).export(NOW_MS, force=True)
    table = pq.read_table(next((tmp_path / "out" / "n1").glob("*.parquet")))
    assert table.column("op").to_pylist()[-1] == UNDECODABLE_OP and table.column("extra")[-1].as_py() == body
    report = audit_records(read_records([str(tmp_path / "out")]))
    assert report["violation_counts"] == {RECORD_CHECKSUM: 1} and report["journals"][0]["records"] == 4


def test_a_node_that_lost_its_disk_exports_a_new_journal_beside_the_old(tmp_path: Path) -> None:
    ids = []
    for attempt in range(2):
        store = Storage(tmp_path / f"disk{attempt}", node_id="n1")
        commit_enqueues(store, 1, 1, 2)
        store.close()
        [segment] = export_environment(tmp_path / f"disk{attempt}", str(tmp_path / "out"))
        ids.append(segment.journal_id)
    assert ids[0] != ids[1] and len(list((tmp_path / "out" / "n1").glob("*.parquet"))) == 2
    report = audit_records(read_records([str(tmp_path / "out")]))
    assert report["totals"]["journals"] == 2 and report["verdict"] == "clean"


def _bounds_after_growth(path: str, opened: Any, grown: Any) -> tuple[int, int]:
    """In a process of its own: open the journal, let the node write on, then read it."""
    source = JournalSource.open(path)
    try:
        opened.set()
        assert grown.wait(60)
        return source.bounds()
    finally:
        source.close()


def test_a_reader_opened_before_the_journal_grew_reads_it_after(storage: Storage) -> None:
    """A node under traffic adds pages past what its export process saw when it opened the
    environment; LMDB refuses a reader whose map is smaller than the pages in use
    (MapResizedError), which failed every export during a benchmark's fill."""
    commit_enqueues(storage, 1, 1, 10)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        opened, grown = manager.Event(), manager.Event()
        reading = pool.submit(_bounds_after_growth, str(storage.path), opened, grown)
        assert opened.wait(60)
        next_index = 11
        for _ in range(40):          # ~40 MiB of new pages, past the reader's 10 MiB default map
            storage.commit(SealedBatch(
                operations=[Enqueued(1, index, 4, NOW_MS, None, "p", b"x" * 4000)
                            for index in range(next_index, next_index + 250)],
                queue_records={"q1": {"queue_id": 1, "epoch": 1}}))
            next_index += 250
        grown.set()
        first, last = reading.result(timeout=60)
    assert first == 1 and last > 10


def test_a_snapshots_rows_are_journaled_as_runs_and_exported_one_row_per_message(storage: Storage) -> None:
    """A replica taking a snapshot journals what it took over in run records (consecutive
    messages of one time, priority, client and kind), as the master journaled the producers'
    batches; the export gives the same rows as one record per message would: `snapshot` or
    `snapshot_lease`, no ordering index, the message id, each with the checksum of its fields."""
    lease = [b"r", NOW_MS + 60_000, NOW_MS]
    rows = [message_row(ROW_MESSAGE, index, 4, NOW_MS, f"d{index}", "p", f"m{index}".encode(), 0, None)
            for index in range(1, 6)]
    rows += [message_row(ROW_MESSAGE, 6, 4, NOW_MS, None, "other", b"m6", 0, None),         # another client
             message_row(ROW_MESSAGE, 7, 4, NOW_MS, None, "other", b"m7", 1, lease),        # leased
             message_row(ROW_MESSAGE, 9, 4, NOW_MS, None, "other", b"m9", 0, None)]         # not consecutive
    storage.commit(SealedBatch(snapshot_rows=[(1, None, rows)], queue_records={"q1": {"queue_id": 1, "epoch": 3}}))
    source = JournalSource.from_storage(storage)
    with source.env.begin(db=source.journal_db) as txn:
        assert txn.stat(source.journal_db)["entries"] == 4, "five in one run, then one record each"
    columns = source.read_columns(1, 100)
    assert columns["sequence"] == list(range(1, 9))
    assert columns["message_id"] == [1, 2, 3, 4, 5, 6, 7, 9] and set(columns["index"]) == {0}
    assert columns["op"] == ["snapshot"] * 6 + ["snapshot_lease", "snapshot"]
    assert columns["dedupe_id"] == ["d1", "d2", "d3", "d4", "d5", None, None, None]
    assert columns["payload_crc32"] == [zlib.crc32(row[6]) for row in rows]
    assert set(columns["queue"]) == {"q1"} and set(columns["epoch"]) == {3} and set(columns["role"]) == {"replica"}
    fields = [columns[name] for name in JOURNAL_FIELDS]
    for position, checksum in enumerate(columns["record_crc32"]):
        record = [column[position] for column in fields]
        assert checksum == zlib.crc32(msgpack.packb(record, use_bin_type=True)), "a row checks like a plain record"
