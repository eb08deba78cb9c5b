"""Attack and regression tests for the storage findings of issue 32 (items 8 and 9, the journal
export's durability, owner-only files): against real nodes on loopback where the finding
shows there, and against the real `Storage` (and the real roles) where it lives in one process."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import stat
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from audit.checks.journals import check_journal_sequences
from client import AsyncClient
from qserver.cli import init
from qserver.dev.devcluster import LocalCluster
from qserver.storage.journal_export import ExportSettings, JournalExporter, JournalSource
from qserver.storage.lmdb_store import MapGrowthNeeded, SealedBatch, Storage
from replication.digest import EMPTY_DIGEST
from replication.master import MasterRole, ReplicaProgress, ReplicationLimits
from replication.messages import Refused, SnapshotChunk, SyncBegin, decode_message, encode_message
from replication.operations import Enqueued, Leased, Operation
from replication.oplog import MemoryOpLog
from replication.options import QueueOptions, QueueState, Strength
from replication.queue_core import QueueCore, QueueRecord
from replication.replica import ReplicaRole
from replication.snapshot import ROW_MESSAGE, MemorySnapshotView, SnapshotView, SnapshotViewLost, memory_rows
from replication.store import MemoryStore

AT_MS = 1_700_000_000_000


def record_json(queue_id: int, name: str, next_index: int = 1) -> dict[str, Any]:
    return QueueRecord(queue_id, name, QueueOptions(), AT_MS, next_index=next_index).to_json()


# --- item 8: a map growth during a snapshot transfer -------------------------------------------
async def metrics(cluster: LocalCluster, node: str) -> dict[str, float]:
    """The node's /metrics as {"name{labels}": value}."""
    def read() -> str:
        with urllib.request.urlopen(cluster.urls[node] + "/metrics", timeout=5,
                                    context=cluster.ssl_context) as answer:
            return str(answer.read().decode())
    values = {}
    for line in (await asyncio.to_thread(read)).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def bounded(call: Any, what: str, timeout_s: float = 30) -> Any:
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        pytest.fail(f"{what} took more than {timeout_s} s")


async def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_a_map_growth_in_the_middle_of_a_snapshot_transfer_no_longer_kills_the_master(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, item 8. A replica that lost its disk takes its `full` queue back by snapshot
    (small chunks, one in flight: the transfer takes a while); it is paused half-way (SIGSTOP),
    which holds the master's read view open, and writes to another queue of the same master
    grow its LMDB map (a small initial map). py-lmdb ends every transaction when the map
    grows: on the old code the master's next chunk, once the replica went on, raised
    lmdb.Error in the engine and the node exited with code 70. Now the transfer starts over
    from a new view, the master stays up, and the replica ends in sync with every message."""
    cluster: LocalCluster = qcluster_factory(
        3, {"ledger": ["n1", "n2"], "filler": ["n1", "n3"]},
        {"map_size_bytes": 4 << 20, "snapshot_chunk_bytes_max": 4096, "snapshot_chunks_in_flight_max": 1})
    payloads = [b"%06d-" % number + bytes(2000) for number in range(4000)]
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("ledger", strength="full")
        await client.create_queue("filler", strength="producer")
        for start in range(0, len(payloads), 500):
            await bounded(client.enqueue_many("ledger", payloads[start:start + 500]), "an enqueue of the queue's load")

        async def truncated() -> bool:      # n2 returns behind the log's start: a snapshot
            return bool((await client.queue_stats("ledger"))["log_start"] > 1)
        await wait_for(truncated, 30, "the op log to be truncated below what both members hold")
        await asyncio.to_thread(cluster.wipe, "n2")
        await asyncio.to_thread(cluster.start, "n2", wait=False)

        async def sending() -> bool:
            return (await metrics(cluster, "n1")).get("qserver_snapshot_views_open", 0) >= 1
        await wait_for(sending, 60, "n1 to send n2 a snapshot")
        n2 = cluster.processes["n2"].pid
        os.kill(n2, signal.SIGSTOP)
        try:
            assert (await metrics(cluster, "n1"))["qserver_snapshot_views_open"] >= 1, \
                "the transfer ended before the replica was paused: make it longer"
            map_before = (await metrics(cluster, "n1"))["qserver_storage_map_bytes"]
            for _ in range(100):                         # the map grows while the view is open
                await bounded(client.enqueue_many("filler", [os.urandom(60_000) for _ in range(8)]), "a filler enqueue")
                if (await metrics(cluster, "n1"))["qserver_storage_map_bytes"] > map_before:
                    break
            else:
                pytest.fail("n1's map never grew")
        finally:
            os.kill(n2, signal.SIGCONT)

        async def in_sync() -> dict[str, Any] | None:
            stats = await client.queue_stats("ledger")
            return stats if stats["replica"] == "n2" and stats["replication_state"] == "in_sync" else None
        stats = await wait_for(in_sync, 120, "n2 to take the snapshot again and be in sync")
        assert cluster.processes["n1"].poll() is None, "the master exited"
        assert stats["snapshots_sent"] >= 2, f"the lost view's transfer started over from a new one: {stats}"
        await bounded(client.handoff("ledger"), "the handoff to n2")
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as at_n2:
        async def n2_masters() -> bool:
            return bool((await at_n2.queue_stats("ledger"))["master"] == "n2")
        await wait_for(n2_masters, 10, "n2's copy of the map to show the handoff")
        received: list[bytes] = []
        while batch := await bounded(at_n2.receive("ledger", max_messages=1000, wait_s=1), "a receive at n2"):
            received += [message.payload for message in batch]
            await bounded(asyncio.gather(*(message.ack() for message in batch)), "the acks at n2")
    assert sorted(received) == payloads, "the replica holds every message, once"


def test_a_snapshot_view_ends_with_a_map_growth_and_says_so_and_reads_go_on(tmp_path: Path) -> None:
    """Issue 32, item 8, deterministic, on the real Storage: a view is read part-way, the map
    grows (Storage.grow_map, as the engine does when a commit finds the map's end), and the
    view's next chunk raised lmdb.Error (py-lmdb ends every transaction on a resize), which
    killed the engine. Now it raises SnapshotViewLost, which the master handles; the loop's
    cached read transaction is replaced, not reused dead; a new view reads the whole state."""
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=1 << 20, disk_reserve_bytes=0)
    try:
        enqueues: list[Operation] = [Enqueued(1, index, 4, AT_MS, None, "c", b"%04d" % index + bytes(1000))
                                     for index in range(1, 201)]
        storage.commit(SealedBatch(operations=enqueues, queue_records={"q": record_json(1, "q", 201)}))
        view = storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None)
        assert view is not None
        first = view.next_rows(5_000)
        assert 0 < len(first) < 200
        storage.begin_read()                               # the engine's step holds its read
        assert storage.ready_page(1, 4, 0, 1 << 62, 1) == [(1, 0)]
        storage.grow_map()
        with pytest.raises(SnapshotViewLost):
            view.next_rows(5_000)
        assert storage.ready_page(1, 4, 0, 1 << 62, 1) == [(1, 0)], "reads go on after a growth"
        storage.end_read()
        assert storage.snapshot_views_open == 1 and storage.snapshot_views_lost == 1
        view.close()
        assert storage.snapshot_views_open == 0
        again = storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None)
        assert again is not None
        rows: list[list[Any]] = []
        while chunk := again.next_rows(5_000):
            rows += chunk
        again.close()
        assert [row[1] for row in rows if row[0] == ROW_MESSAGE] == list(range(1, 201))
    finally:
        storage.close()


class _Member:
    """One member's durable state in memory; its views can be lost as an LMDB view is."""

    def __init__(self, queue_id: int) -> None:
        self.queue_id = queue_id
        self.store, self.oplog = MemoryStore(), MemoryOpLog(EMPTY_DIGEST)
        self.core = QueueCore(QueueRecord(queue_id, "q", QueueOptions(strength=Strength.FULL, dead_letter=False), 0,
                                          state=QueueState.OPEN), self.store, random.Random(1), lease_clock=lambda: 0)
        self.views: list[_LosableView] = []

    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> SnapshotView | None:
        order, digest = self.oplog.last(queue_id)
        view = _LosableView(memory_rows(self.store, queue_id, consumption=consumption, after_index=after_index),
                            order, digest, self.core.record.to_json())
        self.views.append(view)
        return view


class _LosableView(MemorySnapshotView):
    lost = False

    def next_rows(self, bytes_max: int) -> list[list[Any]]:
        if self.lost:
            raise SnapshotViewLost("lost")
        return super().next_rows(bytes_max)


def test_a_master_whose_snapshot_view_is_lost_starts_the_transfer_over_and_the_replica_gets_all_of_it() -> None:
    """Issue 32, item 8, on the real roles: the view is lost half-way (as a map growth ends an
    LMDB view). The master must neither die nor finish the transfer short (an empty last
    chunk would carry a content hash that matches what was sent, and the replica would
    install part of the queue): it tells the replica to open again, and the new view's
    snapshot, which first erases what the lost one stored, is installed whole."""
    limits = ReplicationLimits(snapshot_chunk_bytes_max=64, snapshot_chunks_in_flight_max=2)
    source = _Member(1)
    master = MasterRole(source.core, source.oplog, node_id="n1", replica_id="n2", epoch=1, incarnation=1,
                        recorded_in_sync=False, last_order=0, digest=EMPTY_DIGEST, limits=limits, snapshots=source)
    ops: list[Operation] = []
    for number in range(20):
        source.core.enqueue(b"message %d" % number, 4, None, "c", 0, ops)
    source.store.apply(ops)
    master.replicate(ops, 0)
    for entry in master.to_log:
        source.oplog.append(1, entry.ops, entry.digest, entry.encoded)
    master.to_log.clear()
    master.local_durable_to(master.last_order, 0)
    master.truncated_to(15)
    member = _Member(7)
    replica = ReplicaRole(member.core, member.oplog, node_id="n2", master_id="n1", epoch=1, incarnation=1,
                          applied_order=0, digest=EMPTY_DIGEST, last_epoch=1, limits=limits)

    def exchange(now_ms: int) -> list[list[Any]]:
        """Deliver what each side sent, through the real codec, until both are quiet; the
        rows the replica stored (as the driver does), dropped whenever it is reset."""
        rows: list[list[Any]] = []
        while master.outbox or replica.outbox:
            for _, message in master.outbox:
                replica.receive(decode_message(encode_message(message)), now_ms)
            master.outbox.clear()
            if replica.resets:
                rows.clear()                     # the driver erases the old instance
                replica.resets.clear()
            rows += replica.snapshot_rows
            through = replica.snapshot_rows_through
            replica.snapshot_rows, replica.snapshot_rows_through = [], None
            if through is not None:
                replica.snapshot_rows_durable(*through)
            for _, message in replica.outbox:
                master.receive(decode_message(encode_message(message)), now_ms)
            replica.outbox.clear()
        return rows

    replica.start(0)
    master.receive(replica.outbox.pop()[1], 1)
    begin, first, _ = (decode_message(encode_message(message)) for _, message in master.outbox)
    master.outbox.clear()
    assert isinstance(begin, SyncBegin) and isinstance(first, SnapshotChunk)
    replica.receive(begin, 2)
    replica.resets.clear()
    replica.receive(first, 2)
    replica.snapshot_rows, through = [], replica.snapshot_rows_through
    replica.snapshot_rows_through = None
    replica.snapshot_rows_durable(*through)           # type: ignore[misc]
    source.views[0].lost = True                       # the map grew
    [(_, ack)] = replica.outbox
    replica.outbox.clear()
    master.receive(ack, 3)                            # the next chunk is due: the view is gone
    assert master.progress is ReplicaProgress.PROBING and master.snapshot_order is None
    assert [message.code for _, message in master.outbox if isinstance(message, Refused)] == ["E_RESYNC"]
    rows = exchange(4)
    [install] = replica.installs
    assert (install.order, install.digest) == (20, master.digest)
    assert sorted(row[1] for row in rows) == list(range(1, 21)), "the whole state, from the new view"
    assert len(source.views) == 2 and master.snapshots_sent == 2


# --- item 9: journal sequence numbers after an aborted commit ----------------------------------
def test_a_commit_aborted_by_the_maps_end_leaves_no_gap_in_the_journal_sequence(tmp_path: Path) -> None:
    """Issue 32, item 9. Batches with journaled enqueues (run records), consumption steps
    (one record each) and an epoch mark are committed into a small map; some find its end,
    which aborts their transaction, and are written again after the map grows (as the engine
    does). The old code had already advanced the journal's sequence inside the aborted
    transaction and kept it, so the journal skipped numbers (21 -> 24) and the audit reported
    records lost that never were (journal_sequence_gap). Now every number is there, once."""
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=256 << 10, disk_reserve_bytes=0)
    aborted = 0
    try:
        records = {"q": record_json(1, "q")}
        for number in range(1, 41):
            index = 2 * number
            ops: list[Operation] = [Enqueued(1, index - 1, 4, AT_MS, None, "c", bytes(20_000)),
                                    Enqueued(1, index, 4, AT_MS, None, "c", bytes(20_000))]
            if number > 1:
                ops.append(Leased(1, index - 2, 4, f"r{number}", 30_000, 1, "c", AT_MS))
            mark = [AT_MS, "q", 1, number, 0, "epoch", 0, None, 0, 0, 0, "master", "n1", ""]
            batch = SealedBatch(operations=ops, queue_records=records, journal_marks=[(0, mark)])
            try:
                storage.commit(batch)
            except MapGrowthNeeded:
                aborted += 1
                storage.grow_map()
                storage.commit(batch)
        source = JournalSource.from_storage(storage)
        first, last = source.bounds()
        sequences = source.read_columns(first, last)["sequence"]
    finally:
        storage.close()
    assert aborted >= 2, "no commit found the map's end: make the map smaller"
    assert sequences == list(range(1, len(sequences) + 1))
    assert check_journal_sequences("n1", "j", sequences)["violations"] == []


# --- Low: the journal export is durable before its records are pruned ---------------------------
def test_a_journal_segment_is_fsynced_before_the_prune_can_delete_its_records(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, Low "journal export prunes before fsync". The exporter wrote a segment
    (Parquet, renamed into place) without fsync, and the prune deleted the records it holds
    from LMDB (which is fsync'd): a crash of the machine then lost them from both. Now the
    segment file is fsync'd before its rename and its directory after, before the exporter
    counts it as exported, so before any prune of its records."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)
    storage = Storage(tmp_path / "lmdb", node_id="n1", disk_reserve_bytes=0)
    try:
        storage.commit(SealedBatch(operations=[Enqueued(1, index, 4, AT_MS, None, "c", b"x")
                                               for index in range(1, 11)],
                                   queue_records={"q": record_json(1, "q", 11)}))
        exporter = JournalExporter(JournalSource.from_storage(storage),
                                   ExportSettings(str(tmp_path / "export"), retention_ms=0))
        monkeypatch.setattr(os, "fsync", fsync)
        [segment] = exporter.export(AT_MS, force=True)
        monkeypatch.setattr(os, "fsync", real_fsync)
        directory = str(Path(segment.path).parent)
        assert any(Path(path).name.startswith("_tmp-") for path in synced), f"the segment's file: {synced}"
        assert directory in synced, f"the rename into {directory}: {synced}"
        assert exporter.prune(segment.last_sequence, AT_MS + 1) == 1     # one run record
    finally:
        storage.close()


# --- Low: owner-only LMDB files -------------------------------------------------------------
def test_the_lmdb_directory_and_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """Issue 32, Low. The LMDB environment (every payload, the client registry, the Raft log
    with a forward's remote credential) was created 0755/0644 under the usual umask: readable
    by every local user, and so was the node's data directory. Now the LMDB directory and the
    data directory `qserver init` makes are 0700 and the LMDB files 0600, and an environment
    created before is tightened when it is opened."""
    storage = Storage(tmp_path / "new", node_id="n1")
    storage.close()
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    Storage(old, node_id="n1").close()
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(old / name, 0o644)
    Storage(old, node_id="n1").close()
    for path in (tmp_path / "new", old):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for name in ("data.mdb", "lock.mdb"):
            assert stat.S_IMODE((path / name).stat().st_mode) == 0o600, path / name
    assert init(tmp_path / "n1", "n1", tmp_path / "admin.json", "http://127.0.0.1:1", False) == 0
    assert stat.S_IMODE((tmp_path / "n1").stat().st_mode) == 0o700, "the data directory `qserver init` makes"


def test_numbered_streams_live_in_rows_of_their_own(tmp_path: Path) -> None:
    """Issue 32, item 3: a queue's numbered streams were part of its record, rewritten with every
    batch that touched the queue (1,000 streams of 4,096 numbers: a stall per batch). Each stream
    now has a row, written when it changes; the record a batch writes holds none, and reads put
    them back (a restart, a snapshot view). (A record stored with its streams inside, as layout 7
    could hold, has them moved to rows by the migration to layout 8: tests/test_migration.py.)"""
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    record = QueueRecord(1, "collect", QueueOptions(strength=Strength.FULL), 1_000)
    record.sequences = {"c-1\x1ffwd@1/p4": [3, {3: 1, 5: 2}], "c-2\x1fother": [1, {1: 3}]}
    record.changed_streams = set(record.sequences)
    batch = SealedBatch(queue_records={"collect": record.to_json(streams=False)},
                        stream_puts=[(1, key, stream) for key, stream in record.take_changed_streams()])
    assert "sequences" not in batch.queue_records["collect"] and not record.changed_streams
    storage.commit(batch)
    [loaded] = storage.load_queue_records()
    assert loaded.sequences == record.sequences and not loaded.changed_streams
    loaded.sequences["c-1\x1ffwd@1/p4"][1][6] = 4          # one stream changes: only its row is written
    loaded.changed_streams.add("c-1\x1ffwd@1/p4")
    changed = loaded.take_changed_streams()
    assert changed == [("c-1\x1ffwd@1/p4", [3, [[3, 1], [5, 2], [6, 4]]])]
    storage.commit(SealedBatch(queue_records={"collect": loaded.to_json(streams=False)},
                               stream_puts=[(1, key, stream) for key, stream in changed]))
    storage.close()
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    [again] = storage.load_queue_records()
    assert again.sequences == {"c-1\x1ffwd@1/p4": [3, {3: 1, 5: 2, 6: 4}], "c-2\x1fother": [1, {1: 3}]}
    assert not again.changed_streams
    view = storage.open_snapshot("collect", 1, consumption=True, after_index=0, dead_letter=None)
    assert view is not None and QueueRecord.from_json(view.record).sequences == again.sequences
    view.close()
    storage.close()
