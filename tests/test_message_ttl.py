"""Message time to live (issue 14, item 6) in the pure core, against the in-memory store twin.

An expired message is never delivered: the master takes it out (dead-lettered with
`expired` when the queue has a dead-letter queue, else dropped as `Expired`), and the
replica applies the same operation. Time is a duration on each member's own clock, as a
lease's is: a member that places the message later (the replica's apply, a restart) counts
from then, so none expires early."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from client import AsyncClient
from replication.operations import DeadLettered, Enqueued, Expired, Leased, Operation, Released
from replication.options import QueueOptions, Strength
from replication.queue_core import QueueCore, QueueRecord
from replication.store import MemoryStore
from tests.test_client_integration import run_qctl


def core_on(store: MemoryStore, clock: list[int], *, queue_id: int = 1, dead_letter: bool = False,
            ttl_s: float = 0.0, strength: Strength = Strength.FULL) -> QueueCore:
    options = QueueOptions(strength=strength, dead_letter=dead_letter, message_ttl_s=ttl_s)
    return QueueCore(QueueRecord(queue_id, "jobs", options, 0), store, random.Random(queue_id),
                     lease_clock=lambda: clock[0])


def with_dead_letters(store: MemoryStore, clock: list[int], **options: object) -> QueueCore:
    core = core_on(store, clock, dead_letter=True, **options)  # type: ignore[arg-type]
    dead = QueueCore(QueueRecord(2, "jobs.dlq", QueueOptions(strength=Strength.FULL, dead_letter=False), 0,
                                 dead_letter_of="jobs"), store, random.Random(2), lease_clock=lambda: clock[0])
    core.dead_letter_core = dead
    return core


def commit(core: QueueCore, store: MemoryStore, ops: list[Operation]) -> list[Operation]:
    """Persist what the core staged, as the node's batch does."""
    store.apply(ops)
    core.seal()
    core.advance()
    done = list(ops)
    ops.clear()
    return done


def test_a_message_past_its_ttl_is_never_delivered_and_is_dropped_without_a_dead_letter_queue() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"short", 4, None, "p", 0, ops, ttl_ms=1_000)
    core.enqueue(b"long", 4, None, "p", 0, ops)
    commit(core, store, ops)
    clock[0] = 1_000
    [leased] = core.lease(5, 30_000, "c", 0, ops)
    assert leased.index == 2, "the expired message was delivered"
    expired = [op for op in ops if type(op) is Expired]
    assert [(op.index, op.leased) for op in expired] == [(1, False)]
    commit(core, store, ops)
    assert core.record.total_expired == 1 and core.depth == 1
    assert store.payload(1, 1) is None, "the expired message's row stays in storage"


def test_the_sweep_expires_a_ready_message_without_a_consumer_and_dead_letters_it() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = with_dead_letters(store, clock, ttl_s=2.0)      # the queue's default
    core.enqueue(b"a", 4, None, "p", 0, ops)
    commit(core, store, ops)
    assert core.next_deadline() == 2_000
    clock[0] = 1_999
    assert core.expire_messages(0, ops) == 0
    clock[0] = 2_000
    assert core.expire_messages(0, ops) == 1
    [moved] = ops
    assert type(moved) is DeadLettered and moved.expired and not moved.leased
    commit(core, store, ops)
    assert core.depth == 0 and core.dead_letter_core is not None and core.dead_letter_core.depth == 1
    assert store.payload(2, moved.dead_letter_index) == b"a"
    assert core.next_deadline() is None


def test_a_leased_message_is_left_to_its_consumer_and_expires_when_its_lease_ends() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=1_000)
    core.enqueue(b"b", 4, None, "p", 0, ops, ttl_ms=1_000)
    commit(core, store, ops)
    first, second = core.lease(2, 5_000, "c", 0, ops)
    commit(core, store, ops)
    clock[0] = 2_000           # both past their time to live, both still leased
    assert core.expire_messages(0, ops) == 0 and not ops
    core.ack(first.index, first.receipt, "c", 0, ops)     # a consumer may finish what it holds
    commit(core, store, ops)
    clock[0] = 5_000           # the other lease runs out: not ready again, expired
    assert core.expire_leases(0, ops) == 1
    [gone] = ops
    assert type(gone) is Expired and gone.index == second.index and gone.leased
    commit(core, store, ops)
    assert core.depth == 0 and core.record.total_expired == 1 and not store.leases(1)


def test_the_replica_applies_the_masters_expiries_and_times_its_own_copy_from_its_apply() -> None:
    master_store, replica_store = MemoryStore(), MemoryStore()
    master_clock, replica_clock = [0], [10_000]
    master = core_on(master_store, master_clock)
    replica = core_on(replica_store, replica_clock)
    ops: list[Operation] = []
    master.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=1_000)
    master.enqueue(b"b", 4, None, "p", 0, ops, ttl_ms=60_000)
    for op in commit(master, master_store, ops):
        replica.apply(op)
        replica_store.apply([op])
    assert replica.next_deadline() == 11_000, "the replica counts from its own apply"
    master_clock[0] = 1_000
    master.expire_messages(0, ops)
    for op in commit(master, master_store, ops):
        replica.apply(op)
        replica_store.apply([op])
    assert replica.depth == master.depth == 1 and replica.record.total_expired == 1
    # After a takeover the other message runs its whole time from the apply, not less.
    replica_clock[0] = 69_999
    assert replica.expire_messages(0, ops) == 0
    replica_clock[0] = 70_000
    assert replica.expire_messages(0, ops) == 1


def test_a_restart_times_stored_messages_from_the_restart() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=1_000)
    commit(core, store, ops)
    clock[0] = 500_000                         # the node was down a long time
    restarted = QueueCore(core.record, store, random.Random(3), lease_clock=lambda: clock[0])
    assert restarted.next_deadline() == 501_000
    [leased] = restarted.lease(1, 1_000, "c", 0, ops)
    assert leased.index == 1


def test_a_purge_an_ack_and_a_redelivery_keep_the_time_to_live_bookkeeping_exact() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock, ttl_s=10.0)
    for payload in (b"a", b"b", b"c"):
        core.enqueue(payload, 4, None, "p", 0, ops)
    commit(core, store, ops)
    a, b = core.lease(2, 1_000, "c", 0, ops)
    core.ack(a.index, a.receipt, "c", 0, ops)
    core.release(b.index, b.receipt, 0, ops)
    commit(core, store, ops)
    assert [type(op) for op in core.lease(1, 1_000, "c", 0, ops)] == [Leased]
    core.purge(core.record.next_index - 1, 100, 0, ops)
    commit(core, store, ops)
    clock[0] = 20_000
    assert core.expire_messages(0, ops) == 0 and core.expire_leases(0, ops) == 0
    assert core.depth == 0 and core.record.total_expired == 0


def test_a_snapshot_row_carries_the_time_to_live() -> None:
    from replication.snapshot import memory_rows
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=7_000)
    core.enqueue(b"b", 4, None, "p", 0, ops)
    commit(core, store, ops)
    rows = memory_rows(store, 1, consumption=True, after_index=0, with_dedupe=False)
    assert [row[9] for row in rows] == [7_000, 0]
    taker = MemoryStore()
    taker.put_snapshot_rows(1, None, rows)
    assert taker.ttl_rows(1) == [(1, 4, 7_000)]


def test_the_enqueue_carries_its_ttl_and_a_redelivered_message_keeps_its_deadline() -> None:
    store, clock, ops = MemoryStore(), [0], []
    core = core_on(store, clock)
    core.enqueue(b"a", 4, None, "p", 0, ops, ttl_ms=3_000)
    [enqueued] = commit(core, store, ops)
    assert type(enqueued) is Enqueued and enqueued.ttl_ms == 3_000
    [leased] = core.lease(1, 1_000, "c", 0, ops)
    clock[0] = 1_000
    core.expire_leases(0, ops)
    assert [type(op) for op in ops] == [Leased, Released]
    commit(core, store, ops)
    clock[0] = 3_000            # not re-based by the redelivery: the enqueue's deadline holds
    assert core.lease(1, 1_000, "c", 0, ops) == []
    assert [type(op) for op in ops] == [Expired]


# --- on real processes -------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_expired_messages_are_never_delivered_and_both_members_agree_on_a_real_cluster(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"quotes": ["n1", "n2"], "ticks": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("quotes", strength="full")                   # with quotes.dlq
        await client.create_queue("ticks", strength="producer", dead_letter=False, type="one_way_ack",
                                  message_ttl_s=0.4)
        await client.enqueue("quotes", b"stale", ttl_s=0.3)
        fresh = await client.enqueue("quotes", b"fresh")
        dropped = await client.enqueue_many("ticks", [b"t1", b"t2"])             # the queue's 0.4 s
        kept = await client.enqueue("ticks", b"t3", ttl_s=600)
        await asyncio.sleep(0.8)
        [message] = await client.receive("quotes", max_messages=10, wait_s=1.0)
        assert message.id == fresh
        await message.ack()
        [dead] = await client.receive("quotes.dlq", wait_s=1.0)
        assert dead.payload == b"stale"
        [tick] = await client.receive("ticks", max_messages=10, wait_s=1.0)
        assert tick.id == kept
        statuses = [(await client.message_status("ticks", i))["state"] for i in dropped]
        assert statuses == ["expired", "expired"]
        await client.handoff("quotes")            # the replica applied the same expiry
        stats = await client.queue_stats("quotes")
        assert (stats["total_expired"], stats["total_dead_lettered"], stats["depth"]) == (1, 1, 0)


def test_qctl_puts_with_a_time_to_live_and_shows_what_expired(qnode: Any) -> None:
    assert run_qctl(qnode, "queue", "create", "prices", "--no-dead-letter", "--message-ttl-s", "30")[0] == 0
    code, put, _ = run_qctl(qnode, "put", "prices", "old", "--ttl-s", "0.2")
    assert code == 0
    run_qctl(qnode, "put", "prices", "new")
    time.sleep(0.5)
    code, got, _ = run_qctl(qnode, "get", "prices", "--wait-s", "1", "--ack")
    assert code == 0 and got["id"] == put["id"] + 1
    _, stats, _ = run_qctl(qnode, "queue", "stats", "prices")
    assert stats["total_expired"] == 1 and stats["options"]["message_ttl_s"] == 30 and stats["depth"] == 0
    assert run_qctl(qnode, "put", "prices", "x", "--ttl-s", "0")[0] == 1      # E_INVALID_OPTION, nothing stored


def test_a_replica_that_only_applies_keeps_its_deadline_heaps_bounded() -> None:
    """A member applying the master's decisions never pops its deadline heaps (the deciding
    member's timed steps do): before the heaps were rebuilt from what is live, a `full`
    replica kept an entry for every lease it ever applied, and its engine's timer saw their
    past deadlines and woke every millisecond."""
    from replication.queue_core import STALE_DEADLINES_MAX
    master_store, replica_store, clock, ops = MemoryStore(), MemoryStore(), [0], []
    master, replica = core_on(master_store, clock), core_on(replica_store, clock)
    for round_number in range(3 * STALE_DEADLINES_MAX):
        master.enqueue(b"m", 4, None, "p", 0, ops, ttl_ms=60_000, delay_ms=1 if round_number % 2 else 0)
        clock[0] += 1
        master.mature_messages(0, ops)
        for leased in master.lease(1, 30_000, "c", 0, ops):
            master.ack(leased.index, leased.receipt, "c", 0, ops)
        for op in commit(master, master_store, ops):
            replica.apply(op)
    assert replica.depth == master.depth <= 1
    for heap in (replica._lease_deadlines, replica._ttl_deadlines, replica._due):
        assert len(heap) <= 2 * STALE_DEADLINES_MAX + 2
