"""Bugs the chaos suite found, each pinned where it lives (the chaos scenarios replay them on
real processes; these tests hold the layer itself).

* A deposed `producer` master that rejoined as replica took the new master's whole history
  (its histories differed only by an uncommitted suffix), losing its consumers' acks: acked
  messages came back at that member (docs/PROTOCOL.md, "The bounded op log and snapshots": a
  returning member keeps its consumption state; an uncommitted suffix is discarded).
* A replica instance re-created for a full transfer started at epoch 1: its journal records
  named the wrong epoch and its durable epoch went backwards.
* E_NOT_MASTER answering a forwarded enqueue said the outcome was known, and a retry's
  definite error hid an earlier attempt's unknown outcome: the client reported a failure for
  an enqueue that was stored.
* HTTP passing-on dialled the URL the map publishes (the client proxy), not the node's own
  table: a partition between two nodes did not cut it.
* The audit matched a client's acknowledged enqueue with a deposed master's discarded copy of
  it (same dedupe id, older epoch) and reported a history mismatch.
* A `full` master without a lease (just restarted on a map that had moved on) expired leases,
  taking ordering indices its pair's history uses for other operations.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from audit.checks.group import check_group
from audit.checks.history import HistoryEnqueue, history_as_record
from qserver.cluster.relay import answer_from_master, relayed_error
from qserver.cluster.view import ClusterView
from qserver.core import commands as c
from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.cluster_map import ClusterMap, PairState
from replication.journal import JournalRecord
from replication.messages import encode_entry
from replication.operations import Enqueued, Operation
from replication.options import QueueOptions, Strength, producer_key
from replication.queue_core import SEQUENCE_FLOOR_HEADER, SEQUENCE_HEADER, SEQUENCE_KEY_HEADER, QueueCore, QueueRecord
from replication.store import MemoryStore
from wire.errors import E_NOT_MASTER, E_QUEUE_UNAVAILABLE, E_UNAVAILABLE, QueueError

AT_MS = 1_700_000_000_000


def producer_core(store: MemoryStore, strength: Strength = Strength.PRODUCER,
                  lease_clock: Callable[[], int] = lambda: AT_MS) -> QueueCore:
    record = QueueRecord(1, "events", QueueOptions(strength=strength), AT_MS)
    return QueueCore(record, store, random.Random(3), lease_clock=lease_clock)


def enqueue(core: QueueCore, store: MemoryStore, count: int, tag: str) -> list[int]:
    ops: list[Operation] = []
    ids = [core.enqueue(f"{tag}{i}".encode(), 4, f"{tag}-{i}", "c", AT_MS, ops)[0] for i in range(count)]
    core.seal()
    store.apply(ops)
    core.advance()
    return ids


# --- the uncommitted suffix of a deposed `producer` master ---------------------------------------
def test_a_deposed_producer_master_drops_its_uncommitted_suffix_and_keeps_what_its_consumers_acked() -> None:
    store = MemoryStore()
    core = producer_core(store)
    enqueue(core, store, 10, "a")                   # 1..10, committed up to 6
    core.visible_upto = 6
    ops: list[Operation] = []
    leased = core.lease(3, None, "c", AT_MS, ops)
    assert [op.index for op in leased] == [1, 2, 3]
    for op in leased[:2]:
        core.ack(op.index, op.receipt, "c", AT_MS, ops)
    dropped = core.discard_after(6)
    assert dropped is not None and sorted(index for _, index in dropped) == [7, 8, 9, 10]
    assert core.record.next_index == 7 and core.depth == 4          # 3 leased, 4..6 ready
    core.visible_upto = None
    more: list[Operation] = []
    assert [op.index for op in core.lease(10, None, "c", AT_MS, more)] == [4, 5, 6]
    assert core.enqueue(b"new", 4, "fresh", "c", AT_MS, more) == (7, False)   # the stream goes on from 7


def test_a_dropped_suffix_forgets_the_numbers_it_stored_but_keeps_the_floor() -> None:
    store = MemoryStore()
    core = producer_core(store)
    out: list[Operation] = []
    for number, index in ((3, 1), (4, 2), (5, 3)):
        headers = {SEQUENCE_KEY_HEADER: "fw:b@1", SEQUENCE_HEADER: str(number),
                   SEQUENCE_FLOOR_HEADER: str(number if number < 5 else 4)}
        assert core.enqueue(b"x", 4, None, "f", AT_MS, out, headers=headers) == (index, False)
    store.apply(out)
    core.visible_upto = 2
    assert core.discard_after(2) is not None
    assert core.record.to_json()["sequences"][producer_key("f", "fw:b@1")] == [4, [[4, 2]]]           # 5 (index 3) dropped; the floor stays


def test_a_suffix_is_not_dropped_under_full_strength_nor_past_a_lease() -> None:
    store = MemoryStore()
    full = producer_core(store, Strength.FULL)
    enqueue(full, store, 3, "f")
    assert full.discard_after(1) is None            # consumption steps are in its suffix too
    producer = producer_core(MemoryStore())
    enqueue(producer, MemoryStore(), 3, "p")
    producer.lease(3, None, "c", AT_MS, [])
    assert producer.discard_after(1) is None        # a consumer holds a message past the point


def test_storage_erases_a_truncated_suffix_before_the_batch_that_follows(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    record = QueueRecord(1, "events", QueueOptions(strength=Strength.PRODUCER), AT_MS, next_index=6)
    enqueues = [Enqueued(1, i, 4, AT_MS, f"d{i}", "c", b"x") for i in range(1, 6)]
    first = SealedBatch(operations=enqueues, queue_records={"events": record.to_json()},
                        oplog_rows=[(1, op.index, op.index, bytes(16), encode_entry([op])) for op in enqueues])
    storage.commit(first)
    # the suffix 4..5 goes, and the new master's 4 lands in the same transaction after it
    new = Enqueued(1, 4, 4, AT_MS, "new", "c", b"y")
    second = SealedBatch(operations=[new], queue_records={"events": record.to_json()},
                         oplog_rows=[(1, 4, 4, bytes(16), encode_entry([new]))], truncations=[(1, 3)])
    storage.commit(second)
    storage.begin_read()
    assert storage.ready_page(1, 4, 0, 100, 100) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    kept = [storage.dedupe_lookup(1, producer_key("c", dedupe_id)) for dedupe_id in ("d5", "d4", "new", "d3")]
    assert kept[0] is None and kept[1] is None and kept[2] is not None and kept[3] is not None
    assert storage.read_client_payload(1, 4) == b"y" and storage.read_client_payload(1, 5) is None
    assert storage.last(1)[0] == 4
    storage.close()


# --- outcomes of forwarded and retried enqueues ---------------------------------------------------
class _Replier:
    def __init__(self) -> None:
        self.failed: list[QueueError] = []

    def fail(self, request_id: int, error: QueueError) -> None:
        self.failed.append(error)

    def reply(self, request_id: int, result: Any) -> None:
        raise AssertionError("no reply expected")


def test_a_forwarded_enqueue_answered_not_master_has_an_unknown_outcome() -> None:
    replier = _Replier()
    command = c.EnqueueMany("events", 4, (b"x",), ("d1",), "client", replier)
    answer_from_master(command)([E_NOT_MASTER.code, "this member became the master"])
    assert replier.failed[0].code == E_NOT_MASTER.code and replier.failed[0].outcome_unknown
    assert not relayed_error(E_QUEUE_UNAVAILABLE.code, "no member may serve").outcome_unknown


@pytest.mark.asyncio
async def test_a_retry_that_fails_definitely_keeps_the_first_attempts_unknown_outcome() -> None:
    from client.router import retried_once as _retried_once

    async def refused() -> int:
        raise QueueError(E_QUEUE_UNAVAILABLE, "cannot serve")
    first = QueueError(E_UNAVAILABLE, "connection lost", outcome_unknown=True)
    with pytest.raises(QueueError) as raised:
        await _retried_once(first, refused())
    assert raised.value.code == E_QUEUE_UNAVAILABLE.code and raised.value.outcome_unknown
    with pytest.raises(QueueError) as definite:
        await _retried_once(QueueError(E_NOT_MASTER, "moved"), refused())
    assert not definite.value.outcome_unknown
    assert await _retried_once(first, asyncio.sleep(0, result=7)) == 7


# --- where a node dials its peers -------------------------------------------------------------------
def test_http_passing_on_dials_the_nodes_own_table_before_the_published_url() -> None:
    from replication.cluster_map import AddNode
    from tests.cluster_fakes import FakeMembership
    cluster_map = ClusterMap()
    cluster_map.apply(AddNode("n2", "http://127.0.0.1:9002"))          # what clients are told
    cluster_map.apply(AddNode("n3", "http://127.0.0.1:9003"))
    view = ClusterView("n1", {"n1": "http://127.0.0.1:9001", "n2": "http://127.0.0.1:7012"},
                       FakeMembership(cluster_map))
    assert view.url("n2") == "http://127.0.0.1:7012"                   # n1's proxy to n2
    assert view.url("n3") == "http://127.0.0.1:9003"                   # not in the table: the map's


# --- the audit and a deposed master's discarded copy --------------------------------------------
def _record(node: str, sequence: int, epoch: int, index: int, op: str, dedupe: str | None, role: str,
            queue_id: int = 1) -> JournalRecord:
    return JournalRecord(f"j-{node}", sequence, AT_MS + sequence, "orders", queue_id, epoch, index, op,
                         index if op == "enqueue" else 0, dedupe, 4, 1, 7, role, node, "c")


def test_the_audit_matches_an_acknowledged_enqueue_with_the_copy_that_survived() -> None:
    records = [
        _record("n1", 1, 1, 0, "epoch", "create", "master"), _record("n2", 1, 1, 0, "epoch", "create", "replica"),
        _record("n1", 2, 1, 1, "enqueue", "a", "master"), _record("n2", 2, 1, 1, "enqueue", "a", "replica"),
        _record("n1", 3, 1, 2, "enqueue", "b", "master"),            # never reached n2: discarded
        _record("n2", 3, 2, 1, "epoch", "failover", "master"),
        _record("n2", 4, 2, 2, "enqueue", "c", "master"),
        _record("n2", 5, 2, 3, "enqueue", "b", "master"),            # the client's retry of "b"
    ]
    history = [HistoryEnqueue("orders", "ok", 1, "a", 7), HistoryEnqueue("orders", "ok", 3, "b", 7),
               HistoryEnqueue("orders", "ok", 2, "c", 7)]
    result = check_group("orders", records + [history_as_record(h) for h in history])
    kinds = {v["kind"] for v in result["violations"]}
    assert "history_mismatch" not in kinds, result["violations"]


# --- a full master without its lease takes no index --------------------------------------------
def test_a_full_master_without_a_lease_does_not_expire_leases_on_its_own() -> None:
    from qserver.config import NodeConfig
    from qserver.core.engine import Engine
    from tests.sim.fakes import FakeGate, FakePairs, FakeRelay
    from tests.sim.memory_storage import MemoryStorage

    engine: Engine[Any, Any] = Engine(NodeConfig(), MemoryStorage("n1"))     # type: ignore[arg-type]
    pairs, coordinator = FakePairs(clustered=True), FakeGate(lease=False)
    engine.connect(pairs, coordinator, FakeRelay())
    assert not engine.full_master_may_decide()
    coordinator.lease.held = True
    assert engine.full_master_may_decide()
    engine.connect(pairs, None, FakeRelay())
    assert engine.full_master_may_decide()


# --- a replica instance re-created for a full transfer ----------------------------------------------
def test_a_replica_instance_recreated_for_a_full_transfer_keeps_the_epoch_it_replaces(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from qserver.assembly import build_engine
    from qserver.config import NodeConfig
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    engine = build_engine(NodeConfig(data_dir=str(tmp_path)), storage)
    old = engine.registry.create_core("events", QueueOptions(), AT_MS, None, incarnation=5, epoch=3)
    role = SimpleNamespace(core=old, incarnation=5, visible_order=0)
    engine.registry.reset_replica_instance(role, old.record.to_json())    # type: ignore[arg-type]
    assert role.core is not old and role.core.record.epoch == 3
    assert engine.pipeline.open.sealed.epochs["events"] == 3
    storage.close()


# --- qaudit over a node that journaled nothing ------------------------------------------------------
def test_qaudit_reads_the_journal_of_a_node_that_holds_no_queue(tmp_path: Path) -> None:
    from audit.inputs import read_records, resolve_journals
    Storage(tmp_path / "n5" / "lmdb", node_id="n5").close()        # a fifth node with no queue
    paths = resolve_journals([str(tmp_path / "n5")], tmp_path / "exported")
    assert read_records(paths) == []


# --- a batch that spans a change of role --------------------------------------------------------------
def test_operations_applied_as_replica_in_the_batch_where_the_node_became_master_are_not_streamed_again(
        tmp_path: Path) -> None:
    from replication.digest import EMPTY_DIGEST, fold
    from replication.master import MasterRole
    from tests.cluster_fakes import FakeCore, FakeStorage, pair_driver
    store = MemoryStore()
    core = producer_core(store, Strength.FULL)
    applied = Enqueued(1, 1, 4, AT_MS, "a", "c", b"x")        # received from the old master
    digest = fold(EMPTY_DIGEST, applied)
    driver = pair_driver("n2", FakeCore())
    role = MasterRole(core, FakeStorage(), node_id="n2", replica_id="n1", epoch=2, incarnation=1,
                      recorded_in_sync=True, last_order=1, digest=digest)
    driver.masters["events"] = role
    decided = Enqueued(1, 2, 4, AT_MS, "b", "c", b"y")          # its first own operation
    rows: list[tuple[int, int, int, bytes, bytes]] = []
    driver.before_commit([applied, decided], rows, AT_MS, {"events": core})
    assert [(first, last) for _, first, last, _, _ in rows] == [(2, 2)]
    assert role.digest == fold(digest, decided) and role.last_order == 2


def test_the_audit_replaces_a_discarded_suffix_with_what_the_new_epoch_put_at_the_same_ids() -> None:
    records = [
        _record("n1", 1, 1, 0, "epoch", "create", "master"), _record("n2", 1, 1, 0, "epoch", "create", "replica"),
        _record("n1", 2, 1, 1, "enqueue", "a", "master"), _record("n2", 2, 1, 1, "enqueue", "a", "replica"),
        _record("n1", 3, 1, 2, "enqueue", "b", "master"),              # uncommitted when n1 was cut off
        _record("n2", 3, 2, 1, "epoch", "failover", "master"),
        _record("n2", 4, 2, 2, "enqueue", "c", "master"), _record("n2", 5, 2, 3, "enqueue", "b", "master"),
        _record("n1", 4, 2, 1, "epoch", "failover", "replica"),        # n1 drops its suffix, follows from 1
        _record("n1", 5, 2, 2, "enqueue", "c", "replica"), _record("n1", 6, 2, 3, "enqueue", "b", "replica"),
        _record("n1", 7, 3, 3, "epoch", "handoff", "master"), _record("n2", 6, 3, 3, "epoch", "handoff", "replica"),
    ]
    history = [HistoryEnqueue("orders", "ok", 1, "a", 7), HistoryEnqueue("orders", "ok", 3, "b", 7),
               HistoryEnqueue("orders", "ok", 2, "c", 7)]
    result = check_group("orders", records + [history_as_record(h) for h in history])
    assert not result["violations"], result["violations"]
    assert any(flag["kind"] == "discarded_suffix" for flag in result["flags"])


# --- a restarted member decides nothing before it has its role ----------------------------------------
def test_a_core_without_a_role_yet_expires_no_lease_until_the_map_gives_it_one() -> None:
    from qserver.config import NodeConfig
    from qserver.core.engine import Engine
    from tests.sim.fakes import FakePairs, FakeRelay
    from tests.sim.memory_storage import MemoryStorage
    store = MemoryStore()
    lease_clock = [AT_MS]
    core = producer_core(store, lease_clock=lambda: lease_clock[0])
    enqueue(core, store, 1, "e")
    core.lease(1, 1, "c", AT_MS, [])                          # a lease that ran out long ago
    lease_clock[0] += 60_000
    engine: Engine[Any, Any] = Engine(NodeConfig(), MemoryStorage("n1"))     # type: ignore[arg-type]
    pairs = FakePairs(clustered=True)
    engine.connect(pairs, None, FakeRelay())
    engine.registry.cores = {"events": core}
    engine.role_changed("events")                  # as the registry's load does for every core
    engine._run_timed_steps(AT_MS + 60_000, lease_clock[0])
    assert engine.pipeline.open.sealed.operations == []       # restarted, no role yet: wait
    pairs.replicas["events"] = object()            # type: ignore[assignment]
    engine.role_changed("events")                  # as PairDriver._assume tells it
    engine._run_timed_steps(AT_MS + 60_000, lease_clock[0])
    assert [type(op).__name__ for op in engine.pipeline.open.sealed.operations] == ["Released"]


# --- a peer link whose socket breaks under its reader -------------------------------------------------
@pytest.mark.asyncio
async def test_a_link_whose_socket_breaks_under_the_reader_ends_and_leaves_the_dialer_alive() -> None:
    import aiohttp

    from qserver.transport.peer_link import LinkKeys
    from qserver.transport.peers import PeerTransport, _Link, _Peer
    from wire.version_headers import Side
    from wire.versions import REPLICATION_PROTOCOL, SILENT_PEER

    class _Breaking:
        """aiohttp's receive() answers a ping with a pong; on a closing transport that raises."""

        def __aiter__(self) -> _Breaking:
            return self

        async def __anext__(self) -> Any:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    transport = PeerTransport("n1", b"s" * 32, {"n2": "http://127.0.0.1:1"}, on_message=lambda peer, data: None)
    await transport._read(_Link(_Peer("n2", "http://127.0.0.1:1"), _Breaking(),   # type: ignore[arg-type]
                                LinkKeys(b"k" * 32, dialer=False), REPLICATION_PROTOCOL.high,
                                Side(None, SILENT_PEER["replication"])))


def test_the_audit_takes_a_replacement_journaled_before_its_epoch_record_as_the_suffixs_end() -> None:
    records = [
        _record("n1", 1, 1, 0, "epoch", "create", "master"), _record("n2", 1, 1, 0, "epoch", "create", "replica"),
        _record("n1", 2, 1, 1, "enqueue", "a", "master"), _record("n2", 2, 1, 1, "enqueue", "a", "replica"),
        _record("n1", 3, 1, 2, "enqueue", "b", "master"),
        _record("n2", 3, 2, 1, "epoch", "failover", "master"),
        _record("n2", 4, 2, 2, "enqueue", "c", "master"), _record("n2", 5, 2, 3, "enqueue", "b", "master"),
        # the new master's operations reached n1 in the transaction that also holds its epoch record
        _record("n1", 4, 2, 2, "enqueue", "c", "replica"), _record("n1", 5, 2, 3, "enqueue", "b", "replica"),
        _record("n1", 6, 2, 1, "epoch", "failover", "replica"),
    ]
    history = [HistoryEnqueue("orders", "ok", 1, "a", 7), HistoryEnqueue("orders", "ok", 3, "b", 7),
               HistoryEnqueue("orders", "ok", 2, "c", 7)]
    result = check_group("orders", records + [history_as_record(h) for h in history])
    assert not result["violations"], result["violations"]


def test_a_restarted_core_drops_its_suffix_past_the_recorded_commit_point_even_on_pages_not_loaded() -> None:
    store = MemoryStore()
    first = producer_core(store)
    enqueue(first, store, 10, "r")                            # 1..10 stored; the crash comes
    record = QueueRecord.from_json(first.record.to_json())
    core = QueueCore(record, store, random.Random(3), lease_clock=lambda: AT_MS)   # rebuilt: nothing loaded
    assert core.discard_after(6) == []                        # 7..10 are on pages it never read
    assert core.record.next_index == 7 and core.depth == 6
    leased = core.lease(20, None, "c", AT_MS, [])
    assert [op.index for op in leased] == [1, 2, 3, 4, 5, 6]   # storage still has 7..10: never read


# --- a restarted `producer` member's journal ------------------------------------------------------------
def test_the_audit_takes_a_restart_record_below_what_the_member_held_as_the_end_of_its_discarded_suffix() -> None:
    records = [
        _record("n1", 1, 1, 0, "epoch", "create", "master"), _record("n2", 1, 1, 0, "epoch", "create", "replica"),
        _record("n1", 2, 1, 1, "enqueue", "a", "master"), _record("n2", 2, 1, 1, "enqueue", "a", "replica"),
        _record("n1", 3, 1, 2, "enqueue", "b", "master"), _record("n2", 3, 1, 2, "enqueue", "b", "replica"),
        # n2 is killed knowing only index 1 committed; restarted, it drops 2 and takes it again
        _record("n2", 4, 1, 1, "epoch", "restart", "replica"), _record("n2", 5, 1, 2, "enqueue", "b", "replica"),
        _record("n1", 4, 1, 3, "enqueue", "c", "master"), _record("n2", 6, 1, 3, "enqueue", "c", "replica"),
    ]
    history = [HistoryEnqueue("orders", "ok", 1, "a", 7), HistoryEnqueue("orders", "ok", 2, "b", 7),
               HistoryEnqueue("orders", "ok", 3, "c", 7)]
    result = check_group("orders", records + [history_as_record(h) for h in history])
    assert not result["violations"], result["violations"]
    assert [(flag["kind"], flag["node"], flag["first"], flag["last"]) for flag in result["flags"]] == [
        ("discarded_suffix", "n2", 2, 2)]


def test_storage_journals_a_role_record_where_it_happened_among_its_batchs_operations(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    record = QueueRecord(1, "events", QueueOptions(strength=Strength.PRODUCER), AT_MS, next_index=4)
    mark = [AT_MS, "events", 1, 1, 1, "epoch", 0, "restart", 0, 0, 0, "replica", "n1", ""]
    batch = SealedBatch(operations=[Enqueued(1, i, 4, AT_MS, f"d{i}", "c", b"x") for i in range(1, 4)],
                        queue_records={"events": record.to_json()},
                        oplog_rows=[(1, i, i, bytes(16), b"op") for i in range(1, 4)],
                        journal_marks=[(1, mark)])
    storage.commit(batch)
    assert [(row[5], row[4]) for row in storage.journal_records()] == [
        ("enqueue", 1), ("epoch", 1), ("enqueue", 2), ("enqueue", 3)]
    storage.close()


# --- a lease counts only on a map as new as the leader's ------------------------------------------------
def test_a_lease_grant_counts_only_once_the_nodes_map_has_applied_what_the_leaders_had() -> None:
    from replication.messages import LeaseGrant
    from tests.cluster_fakes import FakeCore, FakeMembership, pair_driver
    from tests.cluster_fakes import coordinator as make_coordinator
    clock = [10_000]
    core = FakeCore(lambda: clock[0])
    cluster_map = ClusterMap()
    cluster_map.version = 5                         # restarted on its own copy: 2 commands behind
    membership = FakeMembership(cluster_map)
    coordinator = make_coordinator(pair_driver("n1", core, membership), core, membership, lease_ms=800,
                                   lease_margin_ms=400, lease_renew_interval_ms=200)
    sequence = coordinator.lease.renewal(clock[0])
    coordinator.on_message("n2", LeaseGrant("", 0, 3, sequence, 7))
    assert not coordinator.lease_valid()            # its map may still name it master of a queue that failed over
    cluster_map.version = 7
    coordinator._accept_grants()
    assert coordinator.lease_valid()                # counted from when the renewal was sent
    clock[0] += 800
    assert not coordinator.lease_valid()


# --- a master taken up at a restart, on the node's own (possibly stale) copy of the map ----------------
def test_a_master_restarted_on_its_own_map_claims_no_commit_past_its_record_until_it_holds_a_lease() -> None:
    from replication.digest import EMPTY_DIGEST
    from replication.master import MasterRole
    from tests.cluster_fakes import FakeCore, FakeMembership, FakeStorage, coordinator, pair_driver
    clock = [10_000]
    core = FakeCore(lambda: clock[0])
    membership = FakeMembership()
    pairs = pair_driver("n1", core, membership)
    lease = coordinator(pairs, core, membership).lease
    # Its copy of the map says the replica is out of sync: everything it holds looks committed.
    pairs.masters["events"] = MasterRole(producer_core(MemoryStore()), FakeStorage(), node_id="n1", replica_id="n2",
                                         epoch=1, incarnation=1, recorded_in_sync=False, last_order=3678,
                                         digest=EMPTY_DIGEST)
    pairs.unconfirmed = {"events": 3677}                  # the commit point its queue record kept
    assert pairs.commit_order("events") == 3677          # what it persists and drops a suffix past
    pairs.confirm_restarted_masters()
    assert pairs.commit_order("events") == 3677          # no lease yet: the map may still move on
    lease.granted(lease.renewal(clock[0]))               # granted against a map as new as the leader's
    pairs.confirm_restarted_masters()
    assert pairs.commit_order("events") == 3678 and pairs.unconfirmed == {}
    assert "events" in core.served and "events" in pairs._ticking     # its listeners may see more now


# --- a message of the new epoch between the map's change and the roles' -----------------------------
def test_a_forward_of_the_new_epoch_waits_while_the_map_has_changed_but_the_roles_have_not() -> None:
    """The membership layer applies a handoff to the node's copy of the map at once; the pair
    driver takes the new roles when the engine's task gets to it. A RelayRequest from the new
    replica arriving in between went to the old, fenced replica role and was never answered
    (a client's enqueue hung for good in tests/test_failover.py, 1 run in 10 under load)."""
    from replication.cluster_map import AddNode, ChangePair, CreateQueue, Reason
    from replication.digest import EMPTY_DIGEST
    from replication.master import MasterRole
    from replication.messages import RelayRequest
    from replication.replica import ReplicaRole
    from tests.cluster_fakes import FakeCore, FakeMembership, FakeStorage, pair_driver
    cluster_map = ClusterMap()
    for node in ("n1", "n2"):
        cluster_map.apply(AddNode(node, f"http://{node}", True, 1))
    cluster_map.apply(CreateQueue("orders", {}, "n1", "n2", 7))
    handoff = ChangePair("orders", (1, "n1", "n2", True), (2, "n2", "n1", True), Reason.HANDOFF.value)
    assert cluster_map.apply(handoff)[0].applied                          # the map: already epoch 2
    pairs = pair_driver("n1", FakeCore(), FakeMembership(cluster_map))
    core = producer_core(MemoryStore())
    pairs.replicas["orders"] = ReplicaRole(core, FakeStorage(), node_id="n1", master_id="n2", epoch=1,
                                           incarnation=7, applied_order=0, digest=EMPTY_DIGEST, last_epoch=1)
    forward = RelayRequest("orders", 7, 2, 1, ["enqueue", 4, [b"x"], None, "c"])    # still epoch 1's replica
    assert pairs.inbox.ahead_of_map("n1", forward)         # kept until the roles follow the map
    assert len(pairs.inbox.early["orders"]) == 1
    del pairs.replicas["orders"]
    pairs.masters["orders"] = MasterRole(core, FakeStorage(), node_id="n1", replica_id="n2", epoch=2, incarnation=7,
                                         recorded_in_sync=False, last_order=0, digest=EMPTY_DIGEST)
    assert not pairs.inbox.ahead_of_map("n1", forward)     # the master of epoch 2 takes it


# --- a master that lost its disk right after its promotion -----------------------------------------
def test_a_master_that_lost_its_data_never_serves_an_empty_queue_even_with_its_replica_out_of_sync() -> None:
    """The lost-disk test of test_pairs.py ended once with the wiped node as master. The map
    sequence read while it ran (recorded in bench/RESULTS.md) shows the legitimate path: the
    wiped n2 re-registered (in sync cleared), was transferred the whole queue by snapshot and
    recorded in sync, and only then did the leader fail n1's queue over to it. This pins the
    ordering the map enforces, and the one hole it had: a node promoted just before its disk
    was lost kept the queue, and with its replica out of sync nothing moved it away."""
    from replication.cluster_map import AddNode, ChangePair, CreateQueue, plan_failover
    cluster_map = ClusterMap()
    for node, storage in (("n1", 11), ("n2", 22), ("n3", 33)):
        cluster_map.apply(AddNode(node, f"http://{node}", True, storage))
    cluster_map.apply(CreateQueue("ledger", {}, "n1", "n2", 7))
    # A failover planned before n2's new disk is known fails its compare-and-set after it.
    stale_plan, _ = plan_failover(cluster_map.copy(), {"n1"})
    assert cluster_map.apply(AddNode("n2", "http://n2", True, 23))[0].reason == "lost its data"
    assert not cluster_map.apply(stale_plan[0])[0].applied
    assert cluster_map.queues["ledger"].pair == PairState(1, "n1", "n2", False)
    # Promoted first, then the disk is gone: the replica (the old master) takes the queue back.
    cluster_map.apply(ChangePair("ledger", (1, "n1", "n2", False), (1, "n1", "n2", True), "in_sync"))
    failover, _ = plan_failover(cluster_map, {"n1"})
    assert cluster_map.apply(failover[0])[0].applied
    assert cluster_map.queues["ledger"].pair == PairState(2, "n2", "n1", False)
    outcomes = cluster_map.apply(AddNode("n2", "http://n2", True, 24))
    assert cluster_map.queues["ledger"].pair == PairState(3, "n1", "n2", False), outcomes


# --- master wins, always ------------------------------------------------------------------------------
def test_the_masters_handoff_request_wins_even_when_the_replicas_reached_the_master_first() -> None:
    """Both members asked at once and the replica's HandoffRequest arrived first: the master
    started the handoff for it, and its own request then joined it (both callers got 200 in 2
    of 10 real rounds). The replica is refused as soon as the master's own request arrives."""
    from replication.cluster_map import AddNode, CreateQueue
    from replication.digest import EMPTY_DIGEST
    from replication.master import MasterRole
    from replication.messages import HandoffAnswer, HandoffRequest, Message
    from tests.cluster_fakes import FakeCore, FakeMembership, FakeStorage, pair_driver
    from tests.cluster_fakes import coordinator as make_coordinator
    cluster_map = ClusterMap()
    for node in ("n1", "n2", "n3"):
        cluster_map.apply(AddNode(node, f"http://{node}", True, 1))
    cluster_map.apply(CreateQueue("q", {}, "n1", "n2", 5))
    assert cluster_map.queues["q"].pair == PairState(1, "n1", "n2", True)      # a handoff needs it in sync
    sent: list[tuple[str, Message]] = []
    core, membership = FakeCore(lambda: AT_MS), FakeMembership(cluster_map)
    pairs = pair_driver("n1", core, membership, sent)
    pairs.link_up = lambda node: True
    queue = QueueCore(QueueRecord(1, "q", QueueOptions(), AT_MS), MemoryStore(), random.Random(1), lease_clock=lambda: AT_MS)
    pairs.masters["q"] = MasterRole(queue, FakeStorage(), node_id="n1", replica_id="n2", epoch=1, incarnation=5,
                                    recorded_in_sync=True, last_order=3, digest=EMPTY_DIGEST)   # not caught up
    coordinator = make_coordinator(pairs, core, membership)
    coordinator._replica_asks("n2", HandoffRequest("q", 5, 1, 77))
    assert coordinator.handoffs["q"].initiator == "replica" and not sent
    answers: list[Any] = []
    coordinator.handoff("q", "master", answers.append)
    assert [(peer, type(message)) for peer, message in sent] == [("n2", HandoffAnswer)]
    answer = sent[0][1]
    assert isinstance(answer, HandoffAnswer) and answer.request_id == 77 and not answer.accepted
    assert "master's request wins" in answer.reason
    handoff = coordinator.handoffs["q"]
    assert handoff.initiator == "master" and handoff.replica_request is None and not answers
    coordinator._end_handoff("q", None)          # the swap committed: the master's caller is answered
    assert len(answers) == 1 and not isinstance(answers[0], Exception) and len(sent) == 1
