"""State transfer by snapshot and the bounded log, on the pure roles and the LMDB storage.

The simulations (tests/test_simulation.py, tests/test_engine_simulation.py) run these under
faults; here each rule is pinned on its own: a snapshot is never cut above the commit point,
a partly received one is never reported as the member's position, a content hash that does
not match starts over, the log keeps what an in-sync replica needs, a storage of another
layout is refused with a message that says what to do."""
from __future__ import annotations

import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest

from qserver.storage.lmdb_store import SCHEMA_VERSION, SealedBatch, Storage, StorageLayoutError
from qserver.storage.migrate import OLDEST_LAYOUT
from replication.digest import EMPTY_DIGEST
from replication.master import MasterRole, ReplicaProgress, ReplicationLimits
from replication.messages import AppendAck, Open, SnapshotChunk, SyncBegin, decode_message, encode_message
from replication.operations import Operation
from replication.oplog import MemoryOpLog
from replication.options import QueueOptions, QueueState, Strength, producer_key
from replication.queue_core import QueueCore, QueueRecord
from replication.replica import ReplicaPhase, ReplicaRole
from replication.snapshot import MemorySnapshotView, SnapshotView, decode_rows, encode_rows, memory_rows
from replication.store import MemoryStore
from tests.conftest import REPOSITORY

QUEUE = "q"
LIMITS = ReplicationLimits(snapshot_chunk_bytes_max=64, snapshot_chunks_in_flight_max=2)


class Member:
    """One member's durable state (a store, a log, a record) and its queue core."""

    def __init__(self, queue_id: int, strength: Strength) -> None:
        self.queue_id = queue_id
        self.store, self.oplog = MemoryStore(), MemoryOpLog(EMPTY_DIGEST)
        options = QueueOptions(strength=strength, dead_letter=False)
        self.core = QueueCore(QueueRecord(queue_id, QUEUE, options, 0, state=QueueState.OPEN), self.store,
                              random.Random(1), lease_clock=lambda: 0)

    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> SnapshotView | None:
        order, digest = self.oplog.last(queue_id)
        return MemorySnapshotView(memory_rows(self.store, queue_id, consumption=consumption, after_index=after_index),
                                  order, digest, self.core.record.to_json())


def master_with(count: int, strength: Strength = Strength.FULL, in_sync: bool = False) -> tuple[Member, MasterRole]:
    member = Member(1, strength)
    role = MasterRole(member.core, member.oplog, node_id="n1", replica_id="n2", epoch=1, incarnation=1,
                      recorded_in_sync=in_sync, last_order=0, digest=EMPTY_DIGEST, limits=LIMITS, snapshots=member)
    enqueue(member, role, count)
    return member, role


def enqueue(member: Member, role: MasterRole, count: int, now_ms: int = 0) -> None:
    ops: list[Operation] = []
    for i in range(count):
        member.core.enqueue(f"message {i}".encode(), 4, None, "c", now_ms, ops)
    member.store.apply(ops)
    role.replicate(ops, now_ms)
    for row in role.to_log:
        member.oplog.append(member.queue_id, row.ops, row.digest, row.encoded)
    role.to_log.clear()
    role.local_durable_to(role.last_order, now_ms)


def sent(role: MasterRole) -> list[object]:
    """What the role sent, through the real codec."""
    out = [decode_message(encode_message(message)) for _, message in role.outbox]
    role.outbox.clear()
    return out


def stored(replica: ReplicaRole) -> list[list[Any]]:
    """As the driver does: take the rows received so far; once they are durable, say so."""
    rows, through = replica.snapshot_rows, replica.snapshot_rows_through
    replica.snapshot_rows, replica.snapshot_rows_through = [], None
    if through is not None:
        replica.snapshot_rows_durable(*through)
    return rows


def test_a_member_behind_the_logs_start_gets_the_state_in_chunks_and_installs_it_once_all_arrived() -> None:
    source, master = master_with(20)
    master.truncated_to(15)                                  # the log starts at 15: order 3 is gone
    replica_member = Member(7, Strength.FULL)
    replica = ReplicaRole(replica_member.core, replica_member.oplog, node_id="n2", master_id="n1", epoch=1,
                          incarnation=1, applied_order=3, digest=b"x" * 16, last_epoch=1, limits=LIMITS)
    replica.start(0)
    [opening] = [m for _, m in replica.outbox]
    replica.outbox.clear()
    master.receive(opening, 1)
    begin, *chunks = sent(master)
    assert isinstance(begin, SyncBegin) and begin.snapshot and begin.reset and begin.snapshot_order == 20
    assert len(chunks) == 2, "no more chunks than the window allows before acknowledgements"
    replica.receive(begin, 2)
    assert replica.resets, "a member with another history starts from an empty instance"
    rows = 0
    while chunks:
        for chunk in chunks:
            assert isinstance(chunk, SnapshotChunk)
            replica.receive(chunk, 3)
            assert replica.durable_order == 0, "a partly received snapshot is never reported as the position"
        if not replica.installs:
            assert not replica.outbox, "a chunk is acknowledged once its rows are stored, not before"
        rows += len(stored(replica))
        for _, ack in replica.outbox:
            master.receive(ack, 4)
        replica.outbox.clear()
        chunks = [m for m in sent(master) if isinstance(m, SnapshotChunk)]
    [install] = replica.installs
    assert (install.order, install.digest, rows) == (20, master.digest, 20)
    assert master.progress is ReplicaProgress.CATCHING_UP and master.snapshot_order == 20
    replica.local_durable_to(20)                             # the installation is durable
    for _, ack in replica.outbox:
        master.receive(ack, 5)
    assert master.snapshot_order is None and master.replica_durable == 20


def test_a_snapshot_cut_by_a_broken_link_goes_on_from_the_same_view_after_the_last_chunk_held() -> None:
    source, master = master_with(20)
    master.truncated_to(15)
    replica_member = Member(7, Strength.FULL)
    replica = ReplicaRole(replica_member.core, replica_member.oplog, node_id="n2", master_id="n1", epoch=1,
                          incarnation=1, applied_order=0, digest=EMPTY_DIGEST, last_epoch=1, limits=LIMITS)
    replica.start(0)
    master.receive(replica.outbox.pop()[1], 1)
    begin, first, _second = sent(master)                  # the second chunk is lost with the link
    replica.receive(begin, 2)
    assert replica.resets
    replica.resets.clear()                                # the driver erased the old instance
    replica.receive(first, 2)
    rows = stored(replica)
    replica.outbox.clear()                                # ...and the first one's acknowledgement
    enqueue(source, master, 5, now_ms=3)                  # live traffic goes on meanwhile
    master.link_down()
    replica.link_down()
    replica.start(4)                                      # the link is back
    opening = replica.outbox.pop()[1]
    assert isinstance(opening, Open) and (opening.snapshot_order, opening.snapshot_received) == (20, 1)
    master.receive(opening, 5)
    resumed, *chunks = sent(master)
    assert isinstance(resumed, SyncBegin) and resumed.snapshot and not resumed.reset
    assert (resumed.snapshot_order, resumed.resume_after) == (20, 1), "the same view, after the chunk it holds"
    assert [chunk.sequence for chunk in chunks] == [2, 3]
    replica.receive(resumed, 6)
    assert not replica.resets and not replica.discards, "what arrived before the break is kept"
    while chunks:
        for chunk in chunks:
            replica.receive(chunk, 7)
        rows += stored(replica)
        for _, ack in replica.outbox:
            master.receive(ack, 8)
        replica.outbox.clear()
        chunks = [m for m in sent(master) if isinstance(m, SnapshotChunk)]
    [install] = replica.installs
    assert (install.order, install.digest) == (20, master._digest_at(20)), "the content hash matched"
    assert sorted(row[1] for row in rows) == list(range(1, 21)), "every message of the view once, none later"
    assert replica.snapshots_resumed == 1 and source.core.record.next_index == 26


def test_a_snapshot_view_kept_for_a_resume_is_dropped_after_sync_view_max() -> None:
    _, master = master_with(20)
    master.truncated_to(15)
    master.receive(Open(QUEUE, 1, 1, 1, 0, EMPTY_DIGEST, session=1), 0)
    sent(master)
    master.link_down()
    master.tick(LIMITS.sync_view_max_ms - 1)
    assert master.snapshot_order == 20, "kept while a resume may come"
    master.tick(LIMITS.sync_view_max_ms + 1)
    assert master.snapshot_order is None
    master.receive(Open(QUEUE, 1, 1, 1, 0, EMPTY_DIGEST, session=2, snapshot_order=20, snapshot_received=1), 1)
    begin = sent(master)[0]
    assert isinstance(begin, SyncBegin) and begin.reset and not begin.resume_after, "a new view, from empty"


def test_a_snapshot_is_never_cut_above_the_commit_point() -> None:
    _, master = master_with(10, in_sync=True)               # the replica holds nothing: nothing committed
    master.truncated_to(5)
    master.receive(Open(QUEUE, 1, 1, 1, 0, EMPTY_DIGEST, session=9), 1)
    assert not [m for m in sent(master) if isinstance(m, (SyncBegin, SnapshotChunk))]
    assert master.commit_order == 0 and master.replica_durable == 0


def test_a_chunk_whose_content_hash_does_not_match_makes_the_replica_start_over() -> None:
    _, master = master_with(3)
    master.truncated_to(3)
    member = Member(7, Strength.FULL)
    replica = ReplicaRole(member.core, member.oplog, node_id="n2", master_id="n1", epoch=1, incarnation=1,
                          applied_order=0, digest=EMPTY_DIGEST, last_epoch=1, limits=LIMITS)
    replica.start(0)
    master.receive(replica.outbox.pop()[1], 1)
    messages = sent(master)
    replica.receive(messages[0], 2)
    session = replica.session
    forged = SnapshotChunk(QUEUE, 1, 1, session, 1, encode_rows([]), True, 3, master.digest, b"\x01" * 16)
    replica.receive(forged, 3)
    assert not replica.installs and replica.session == session + 1, "a mismatch opens again"
    assert replica.phase is ReplicaPhase.OPENING


def test_an_in_sync_replica_holds_the_log_back_and_an_out_of_sync_one_only_within_the_retention() -> None:
    _, master = master_with(50, in_sync=True)
    master.receive(Open(QUEUE, 1, 1, 1, 0, EMPTY_DIGEST, session=1), 1)
    master.receive(AppendAck(QUEUE, 1, 1, 0, 30, session=1), 2)
    assert master.log_floor == 30
    limits = ReplicationLimits(log_retain_max_bytes=200)
    member = Member(1, Strength.FULL)
    lagging = MasterRole(member.core, member.oplog, node_id="n1", replica_id="n2", epoch=1, incarnation=1,
                         recorded_in_sync=False, last_order=0, digest=EMPTY_DIGEST, limits=limits, snapshots=member)
    lagging.receive(Open(QUEUE, 1, 1, 1, 0, EMPTY_DIGEST, session=1), 1)
    for _ in range(20):
        enqueue(member, lagging, 5)
    assert 0 < lagging.log_floor < lagging.last_order, "past the retention the log goes on without the replica"


def test_a_producer_member_behind_the_logs_start_keeps_its_own_state_and_takes_only_whats_above() -> None:
    _, master = master_with(30, Strength.PRODUCER)
    master.truncated_to(20)
    master.receive(Open(QUEUE, 1, 1, 1, 12, b"d" * 16, session=4, committed_order=12), 1)
    begin, *chunks = sent(master)
    assert isinstance(begin, SyncBegin) and begin.snapshot and not begin.reset and begin.keep_upto == 12
    indices = [row[1] for chunk in chunks if isinstance(chunk, SnapshotChunk)
               for row in decode_rows(chunk.rows) if row[0] == 0]
    assert indices and min(indices) == 13


def test_a_data_directory_of_another_layout_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A layout older than any this release migrates (tests/test_migration.py: the ones it does,
    and a newer one)."""
    too_old = OLDEST_LAYOUT - 1
    Storage(tmp_path / "lmdb", node_id="n1").close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=32)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"schema_version", too_old.to_bytes(8, "big"))
    env.close()
    with pytest.raises(StorageLayoutError, match=f"no migration from layout {too_old} to {SCHEMA_VERSION}.*empty one"):
        Storage(tmp_path / "lmdb", node_id="n1")
    (tmp_path / "node.toml").write_text(f'[node]\nnode_id = "n1"\ndata_dir = "{tmp_path}"\nport = 1\n')
    result = subprocess.run([sys.executable, "-m", "qserver", "run", "--config", str(tmp_path / "node.toml")],
                            cwd=REPOSITORY, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"from layout {too_old}" in result.stderr
    assert "Traceback" not in result.stderr


def test_storage_truncates_the_log_in_bounded_steps_and_serves_nothing_below_its_start(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        batch = SealedBatch()
        batch.oplog_rows = [(5, order, order, bytes([order % 256]) * 16, b"op") for order in range(1, 101)]
        storage.commit(batch)
        storage.commit(SealedBatch(log_floors={5: 60}))
        storage.end_read()
        assert storage.first(5) == 60 and storage.last(5)[0] == 100
        assert [last for _, last, _ in storage.read(5, 0, 1000)][:2] == [60, 61]
        assert storage.digest_at(5, 60) == bytes([60]) * 16 and storage.digest_at(5, 59) is None
        assert storage.count("oplog") == 41 + 1          # from the floor on, and the log-start record
    finally:
        storage.close()


def test_snapshot_rows_are_appended_only_where_they_sort_after_every_stored_key(tmp_path: Path) -> None:
    from qserver.storage.rows import put_in_order
    env = lmdb.open(str(tmp_path / "db"), max_dbs=1)
    rows = env.open_db(b"rows")
    key = struct.Struct(">QQ").pack
    with env.begin(write=True) as txn:
        put_in_order(txn.cursor(db=rows), [(key(2, i), b"a") for i in range(1, 4)])     # appended
        put_in_order(txn.cursor(db=rows), [(key(1, i), b"b") for i in (5, 6)])          # before them: put
        put_in_order(txn.cursor(db=rows), [(key(3, 2), b"c"), (key(3, 1), b"c")])       # not ascending: put
        put_in_order(txn.cursor(db=rows), [(key(2, 9), b"d")])                          # after its queue: put
    with env.begin(db=rows) as txn:
        stored = [(struct.Struct(">QQ").unpack(k), bytes(v)) for k, v in txn.cursor()]
    assert stored == [((1, 5), b"b"), ((1, 6), b"b"), ((2, 1), b"a"), ((2, 2), b"a"), ((2, 3), b"a"),
                      ((2, 9), b"d"), ((3, 1), b"c"), ((3, 2), b"c")]


def test_an_lmdb_view_carries_each_messages_lease_or_deliveries_and_the_dedupe_window_once(tmp_path: Path) -> None:
    """The view on the master's storage, read in chunks far smaller than the queue: every
    message once, in order, with its lease (leased) or its delivery count (released, or
    never delivered), then the dedupe window's entries; a lease of another queue that sorts
    among them is not taken for one of this queue's."""
    from qserver.storage.lmdb_store import SealedBatch, Storage
    from replication.operations import Enqueued, Leased, Released
    from replication.snapshot import ROW_DEDUPE, ROW_MESSAGE
    at_ms = 1_700_000_000_000
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        records = {name: QueueRecord(queue_id, name, QueueOptions(), at_ms).to_json() for name, queue_id in (("q", 1), ("other", 2))}
        enqueues: list[Operation] = [Enqueued(1, index, 4, at_ms, f"d{index}", "c", b"p%d" % index) for index in range(1, 41)]
        enqueues += [Enqueued(2, 1, 4, at_ms, None, "c", b"other")]
        storage.commit(SealedBatch(operations=enqueues, queue_records=records))
        leased = [Leased(1, index, 4, f"r{index}", 30_000, 1, "c", at_ms) for index in (3, 17, 40)]
        released = [Leased(1, index, 4, f"r{index}", 30_000, 2, "c", at_ms) for index in (5, 6)]
        storage.commit(SealedBatch(operations=[*leased, *released, Leased(2, 1, 4, "x", 30_000, 1, "c", at_ms)]))
        storage.commit(SealedBatch(operations=[Released(1, index, 4, 2, False, at_ms) for index in (5, 6)]))
        view = storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None)
        assert view is not None
        rows = []
        try:
            while chunk := view.next_rows(40):             # a row or two per call
                rows += chunk
        finally:
            view.close()
    finally:
        storage.close()
    messages = [row for row in rows if row[0] == ROW_MESSAGE]
    assert [row[1] for row in messages] == list(range(1, 41)), "each message once, in order"
    by_index = {row[1]: row for row in messages}
    for index, row in by_index.items():
        assert row[6] == b"p%d" % index and row[4] == f"d{index}"
        if index in (3, 17, 40):
            assert row[8] == [f"r{index}", 30_000, at_ms] and row[7] == 1, row
        else:
            assert row[8] is None and row[7] == (2 if index in (5, 6) else 0), row
    assert sorted(row[1] for row in rows if row[0] == ROW_DEDUPE) == sorted(producer_key("c", f"d{index}") for index in range(1, 41))


def test_a_node_sends_at_most_snapshot_views_max_snapshots_at_once_and_the_rest_open_again(tmp_path: Path) -> None:
    """Each view holds an LMDB reader slot: 660 replicas opening at once after a failover took
    every slot and the node died on MDB_READERS_FULL (issue 31). Past SNAPSHOT_VIEWS_MAX the
    master gets no view (its replica's Open is answered by the next Open), and a view closed
    frees its place; other readers keep their slots."""
    from qserver.storage.lmdb_store import READERS_MAX, SNAPSHOT_VIEWS_MAX
    assert SNAPSHOT_VIEWS_MAX < READERS_MAX // 2
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        storage.commit(SealedBatch(queue_records={"q": QueueRecord(1, "q", QueueOptions(), 0).to_json()}))
        views = [storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None)
                 for _ in range(SNAPSHOT_VIEWS_MAX)]
        assert all(view is not None for view in views) and storage.snapshot_views_open == SNAPSHOT_VIEWS_MAX
        assert storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None) is None
        assert storage.snapshot_views_deferred == 1
        storage.begin_read()                              # the engine still reads
        storage.end_read()
        views.pop().close()                               # type: ignore[union-attr]
        again = storage.open_snapshot("q", 1, consumption=True, after_index=0, dead_letter=None)
        assert again is not None and storage.snapshot_views_open == SNAPSHOT_VIEWS_MAX
        for view in [*views, again]:
            view.close()                                  # type: ignore[union-attr]
        assert storage.snapshot_views_open == 0
    finally:
        storage.close()
