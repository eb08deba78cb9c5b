"""Purge (issue 14, item 9): an operator takes every message a queue holds now out of it, for
good, in bounded steps; replicated under `full`, run on each member's own copy under
`producer`; journaled and shown by the audit as purged, never as lost."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from audit.checks import violations as checks
from client import AsyncClient, QueueError
from replication.operations import Operation, Purged
from tests.test_audit_checks import Journal, audit
from tests.test_client_integration import run_qctl
from tests.test_lease_time import full_pair
from tests.test_queue_core import Driver


def test_a_purge_takes_leased_then_ready_messages_in_bounded_steps_and_spares_later_enqueues() -> None:
    driver = Driver()
    for payload in range(8):
        driver.enqueue(bytes([payload]), priority=payload % 3)
    leased = driver.lease(2)
    driver.restart()                                  # ready pages not loaded yet: the purge loads them
    upto = driver.core.record.next_index - 1
    first, done = driver.core.purge(upto, 3, driver.now_ms, driver.staged)
    assert (first, done) == (3, False)
    assert [(op.index, op.leased) for op in driver.staged if isinstance(op, Purged)][:2] == \
        [(leased[0].index, True), (leased[1].index, True)]
    driver.commit()
    later = driver.enqueue(b"after")                  # enqueued while the purge goes on: it stays
    second, done = driver.core.purge(upto, 100, driver.now_ms, driver.staged)
    driver.commit()
    assert (second, done) == (5, True)
    assert driver.core.depth == 1 and driver.core.record.total_purged == 8
    [kept] = driver.lease(5)
    assert kept.index == later
    with pytest.raises(QueueError) as refused:
        driver.ack(leased[0])
    assert refused.value.code == "E_LEASE_EXPIRED"


def test_a_replica_applies_a_full_purge_as_the_master_decided_it() -> None:
    master, replica = full_pair([0], [0])
    ops: list[Operation] = []
    for _ in range(4):
        master.enqueue(b"m", 4, None, "p", 0, ops)
    master.lease(1, 1_000, "c", 0, ops)
    assert master.purge(4, 10, 0, ops) == (4, True)
    assert [op.order for op in ops if isinstance(op, Purged)] == [6, 7, 8, 9]     # replicated in order
    for op in ops:
        replica.apply(op)
    assert (master.depth, replica.depth, replica.record.total_purged) == (0, 0, 4)


def test_the_audit_counts_purged_messages_as_consumed_and_names_a_purge_of_one_not_held() -> None:
    clean = Journal("n1").enqueue(1, 2, 3).add("lease", 0, 1).add("purge", 0, 1).add("purge", 0, 2)
    report = audit(clean)
    assert report["verdict"] == "clean"
    counts = report["incarnations"][0]["queues"][0]["counts"]
    assert (counts["purged"], counts["queued"]) == (2, 1) and report["total_queue"]["purged"] == 2
    twice = Journal("n1").enqueue(1).add("purge", 0, 1).add("ack", 0, 1)
    assert audit(twice)["violation_counts"] == {checks.DUPLICATED: 1}


@pytest.mark.asyncio
async def test_a_purge_empties_both_members_under_either_strength_on_a_real_cluster(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"ledger": ["n1", "n2"], "events": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("ledger", strength="full")
        await client.create_queue("events", strength="producer")
        for queue in ("ledger", "events"):
            await client.enqueue_many(queue, [b"%d" % i for i in range(50)])
        [leased] = await client.receive("ledger", wait_s=2.0)
        full = await client.purge("ledger")                    # asked at n3: passed on to the master
        producer = await client.purge("events")
        assert full == {"queue": "ledger", "purged": 50, "upto": 51}     # the lease took ordering index 51
        assert producer["purged"] == 50 and producer["members"] == {"n1": 50, "n2": 50}
        with pytest.raises(QueueError) as refused:
            await leased.ack()
        assert refused.value.code == "E_LEASE_EXPIRED"
        await client.enqueue("ledger", b"after")
        await client.handoff("ledger")                          # the replica purged the same
        await client.handoff("events")                          # and under producer its own copy
        [after] = await client.receive("ledger", wait_s=2.0)
        assert after.payload == b"after"
        assert await client.receive("events", wait_s=0.5) == []
        stats = await client.queue_stats("ledger")
    assert stats["total_purged"] == 50 and stats["depth"] == 1


def test_qctl_purges_with_json_and_a_client_without_the_admin_grant_is_forbidden(qnode: Any, tmp_path: Path) -> None:
    assert run_qctl(qnode, "queue", "create", "jobs")[0] == 0
    for payload in ("a", "b", "c"):
        run_qctl(qnode, "put", "jobs", payload)
    assert run_qctl(qnode, "queue", "purge", "jobs") == (0, {"queue": "jobs", "purged": 3, "upto": 3}, "")
    assert run_qctl(qnode, "queue", "stats", "jobs")[1]["depth"] == 0
    code, _, _ = run_qctl(qnode, "clients", "add", "worker", "--grant", "jobs:post,get,delete",
                          "--out", str(tmp_path / "worker.json"))
    assert code == 0

    async def as_worker() -> str:
        async with AsyncClient(credentials=str(tmp_path / "worker.json")) as worker:
            await worker.enqueue("jobs", b"kept")
            with pytest.raises(QueueError) as refused:
                await worker.purge("jobs")
            return refused.value.code
    assert asyncio.run(as_worker()) == "E_FORBIDDEN"
    assert run_qctl(qnode, "queue", "stats", "jobs")[1]["depth"] == 1
