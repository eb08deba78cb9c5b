"""Delayed delivery (issue 14, item 7): a message enqueued with a delay is not ready until the
delay has run out on the deciding member's clock; then one replicated operation (`Matured`)
makes it ready, in priority-then-index order among the ready messages. Pure core and store
tests first, then the audit, then real processes."""
from __future__ import annotations

import random
import time
from typing import Any

import pytest

from audit.checks import violations as checks
from client import AsyncClient
from replication.operations import Enqueued, Expired, Leased, Matured, Purged
from replication.options import Strength
from replication.queue_core import QueueCore
from replication.snapshot import InstalledState, memory_rows
from replication.store import MemoryStore
from tests.support import replica_in_sync
from tests.test_audit_checks import Journal, audit
from tests.test_client_integration import run_qctl
from tests.test_message_ttl import commit, core_on


def test_a_delayed_message_is_not_ready_until_it_matures_then_goes_by_its_index() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"later", 4, None, "p", 0, ops, delay_ms=1_000)
    core.enqueue(b"now", 4, None, "p", 0, ops)
    [enqueued, _] = commit(core, store, ops)
    assert type(enqueued) is Enqueued and enqueued.delay_ms == 1_000
    assert (core.depth, core.record.ready_count, core.record.delayed_count) == (2, 1, 1)
    assert core.next_deadline() == 1_000
    clock[0] = 999
    assert core.mature_messages(0, ops) == 0
    core.enqueue(b"after", 4, None, "p", 0, ops)
    commit(core, store, ops)
    clock[0] = 1_000
    assert core.mature_messages(0, ops) == 1
    [matured] = commit(core, store, ops)
    assert type(matured) is Matured and matured.index == 1 and matured.order == 4     # under full: replicated
    leased = core.lease(3, 5_000, "c", 0, ops)
    assert [op.index for op in leased] == [1, 2, 3], "once ready it goes by its index"


def test_the_replica_applies_the_maturity_and_a_restart_times_the_delay_again() -> None:
    master_store, replica_store, clock, ops = MemoryStore(), MemoryStore(), [0], []
    master, replica = core_on(master_store, clock), core_on(replica_store, clock)
    master.enqueue(b"a", 4, None, "p", 0, ops, delay_ms=2_000)
    for op in commit(master, master_store, ops):
        replica.apply(op)
        replica_store.apply([op])
    assert replica.record.delayed_count == 1 and not replica.has_ready()
    clock[0] = 5_000
    restarted = QueueCore(master.record, master_store, random.Random(3), lease_clock=lambda: clock[0])
    assert restarted.record.delayed_count == 1 and restarted.next_deadline() == 7_000   # from the restart
    master.mature_messages(0, ops)
    for op in commit(master, master_store, ops):
        replica.apply(op)
        replica_store.apply([op])
    assert replica.has_ready() and replica.record.delayed_count == 0 and replica_store.delayed_rows(1) == []


def test_a_purge_takes_delayed_messages_too() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, delay_ms=60_000)
    core.enqueue(b"b", 4, None, "p", 0, ops)
    commit(core, store, ops)
    assert core.purge(2, 10, 0, ops) == (2, True)
    purged = commit(core, store, ops)
    assert [(op.index, op.delayed) for op in purged if type(op) is Purged] == [(2, False), (1, True)]
    assert core.depth == 0 and store.delayed_rows(1) == [] and store.payload(1, 1) is None
    clock[0] = 60_000
    assert core.mature_messages(0, ops) == 0


def test_a_time_to_live_shorter_than_the_delay_expires_the_message_as_it_matures() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=500, delay_ms=1_000)
    commit(core, store, ops)
    clock[0] = 600
    assert core.expire_messages(0, ops) == 0, "a delayed message waits for its maturity"
    clock[0] = 1_000
    core.mature_messages(0, ops)
    assert [type(op) for op in ops] == [Matured, Expired]
    commit(core, store, ops)
    assert core.depth == 0 and core.record.total_expired == 1
    assert core.lease(1, 1_000, "c", 0, ops) == []


def test_a_snapshot_carries_the_delay_and_the_taker_does_not_count_the_message_ready() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, delay_ms=9_000)
    core.enqueue(b"b", 4, None, "p", 0, ops)
    commit(core, store, ops)
    rows = memory_rows(store, 1, consumption=True, after_index=0, with_dedupe=False)
    assert [row[10] for row in rows] == [9_000, 0]
    received = InstalledState()
    received.take(rows)
    assert received.ready_count == 1
    taker = MemoryStore()
    taker.put_snapshot_rows(1, None, rows)
    assert taker.delayed_rows(1) == [(1, 4, 9_000)] and taker.ready_page(1, 4, 0, 10, 10) == [(2, 0)]
    installed = core_on(taker, [100])
    installed.install_snapshot(None, [])
    assert installed.record.delayed_count == 1 and installed.next_deadline() == 9_100


def test_a_producer_member_matures_its_own_copy_locally() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock, strength=Strength.PRODUCER)
    core.enqueue(b"a", 4, None, "p", 0, ops, delay_ms=10)
    commit(core, store, ops)
    clock[0] = 10
    core.mature_messages(0, ops)
    [matured] = commit(core, store, ops)
    assert matured.order == 0          # consumption under `producer` is each member's own
    assert [type(op) for op in core.lease(1, 1_000, "c", 0, ops)] == [Leased]


def test_the_audit_judges_delivery_order_among_ready_messages_only() -> None:
    delayed = Journal("n1").enqueue(1, 2).add("delay", 0, 1).add("lease", 0, 2).add("ack", 0, 2) \
        .add("mature", 0, 1).add("lease", 0, 1).add("ack", 0, 1)
    assert audit(delayed)["verdict"] == "clean"
    early = Journal("n1").enqueue(1, 2).add("delay", 0, 1).add("lease", 0, 1)
    assert audit(early)["violation_counts"] == {checks.CONSUMED_WITHOUT_LEASE: 1}
    matured = Journal("n1").enqueue(1, 2).add("delay", 0, 1).add("mature", 0, 1).add("lease", 0, 2)
    assert audit(matured)["violation_counts"] == {checks.DELIVERY_ORDER: 1}
    purged = Journal("n1").enqueue(1).add("delay", 0, 1).add("purge", 0, 1)
    assert audit(purged)["total_queue"]["purged"] == 1


@pytest.mark.asyncio
async def test_a_delayed_message_waits_on_a_real_cluster_and_both_members_agree(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"mail": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("mail", strength="full")
        sent = time.monotonic()
        later = await client.enqueue("mail", b"later", delay_s=0.6)
        now = await client.enqueue("mail", b"now")
        assert (await client.message_status("mail", later))["state"] == "delayed"
        [first] = await client.receive("mail", max_messages=10, wait_s=0.2)
        assert first.id == now
        await first.ack()
        [second] = await client.receive("mail", max_messages=10, wait_s=2.0)   # woken by the maturity
        assert second.id == later and time.monotonic() - sent >= 0.6
        await second.ack()
        await client.enqueue("mail", b"pending", delay_s=600)
        await replica_in_sync(client, "mail")
        await client.handoff("mail")                   # the replica holds it delayed too
        stats = await client.queue_stats("mail")
        assert (stats["delayed"], stats["ready"], stats["depth"]) == (1, 0, 1)
        assert await client.receive("mail", wait_s=0.3) == []
        with pytest.raises(ValueError):
            await client.enqueue("mail", b"x", delay_s=901)


def test_qctl_puts_with_a_delay_and_refuses_a_bad_one(qnode: Any) -> None:
    assert run_qctl(qnode, "queue", "create", "later")[0] == 0
    code, put, _ = run_qctl(qnode, "put", "later", "soon", "--delay-s", "0.3")
    assert code == 0
    assert run_qctl(qnode, "get", "later")[1] is None
    assert run_qctl(qnode, "queue", "stats", "later")[1]["delayed"] == 1
    time.sleep(0.4)
    code, got, _ = run_qctl(qnode, "get", "later", "--wait-s", "1", "--ack")
    assert code == 0 and got["id"] == put["id"]
    code, _, err = run_qctl(qnode, "put", "later", "x", "--delay-s", "901")
    assert code == 1 and "E_INVALID_OPTION" in err
    assert run_qctl(qnode, "queue", "stats", "later")[1]["depth"] == 0


@pytest.mark.asyncio
async def test_a_delayed_enqueue_at_the_replica_is_forwarded_with_its_delay(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"mail": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:    # the replica's node
        await client.create_queue("mail", strength="producer")
        await client.enqueue_many("mail", [b"a", b"b"], delay_s=30)
        stats = await client.queue_stats("mail")
        assert stats["delayed"] == 2 and stats["ready"] == 0
        with pytest.raises(ValueError):
            await client.enqueue("mail", b"x", delay_s=-1)
