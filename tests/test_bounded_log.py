"""The bounded op log and state transfer by snapshot, on real processes (docs/ARCHITECTURE.md, "Queue pairs").

Records below what both members hold are truncated as the pair goes, so an emptied queue
leaves a small constant on disk; a member re-created elsewhere takes the queue's state, not
its history; a replica killed while it takes a snapshot under traffic comes back identical."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import LocalCluster
from qserver.storage.space import database_usage
from tests.test_failover import drain, wait_for
from tests.test_pairs import wait_converged

pytestmark = pytest.mark.asyncio


OPLOG_ENTRIES_MAX, OPLOG_PAGES_MAX = 4, 8      # an emptied queue's log: the log-start record and the last one


def _log_is_small(usage: dict[str, dict[str, int]]) -> bool:
    return usage["oplog"]["entries"] <= OPLOG_ENTRIES_MAX and usage["oplog"]["pages"] <= OPLOG_PAGES_MAX \
        and usage["messages"]["entries"] == 0 and usage["ready"]["entries"] == 0


@pytest.mark.timeout(240)
async def test_a_queue_that_carried_50000_messages_holds_a_small_constant_of_log_once_emptied(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster: LocalCluster = qcluster_factory(3, {"ledger": ["n1", "n2"]})
    payload = bytes(100)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("ledger", strength="full", dead_letter=False)
        for _ in range(5):
            await asyncio.gather(*(client.enqueue_many("ledger", [payload] * 1000) for _ in range(10)))
        # Full, it holds 5 MB of payloads and 50,000 rows: hundreds of times the pages it may keep.
        full = database_usage(cluster.root / "n1" / "lmdb")
        assert sum(full[name]["pages"] for name in ("oplog", "messages", "ready")) > 100 * OPLOG_PAGES_MAX, full
        assert len(await drain(client, "ledger")) == 50_000

        async def truncated() -> bool:
            stats = await client.queue_stats("ledger")
            return stats["log_start"] >= stats["last_order"] - 1 and stats["depth"] == 0
        await wait_for(truncated, 20, "the master's log to be truncated to its end")

        # Housekeeping batches go on deleting in bounded steps on both members (the replica
        # learns the floor a moment later): polled for up to 10 s, then asserted below.
        deadline = time.monotonic() + 10
        while not all(_log_is_small(database_usage(cluster.root / node / "lmdb")) for node in ("n1", "n2")) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    for node in ("n1", "n2"):
        stats = database_usage(cluster.root / node / "lmdb")
        print(node, stats)   # the used pages per database, for the record
        assert stats["oplog"]["entries"] <= OPLOG_ENTRIES_MAX, stats
        assert stats["messages"]["entries"] == 0 and stats["ready"]["entries"] == 0, stats
        assert stats["oplog"]["pages"] <= OPLOG_PAGES_MAX, stats


@pytest.mark.timeout(180)
async def test_a_member_recreated_by_a_move_takes_the_state_and_repeats_no_acknowledged_message(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster: LocalCluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        ids = await client.enqueue_many("orders", [f"o{i}".encode() for i in range(3000)])
        acked: list[int] = []
        while len(acked) < 2000:
            messages = await client.receive("orders", max_messages=min(500, 2000 - len(acked)), wait_s=1)
            acked.extend(m.id for m in messages)
            await asyncio.gather(*(m.ack() for m in messages))

        async def truncated() -> bool:
            return bool((await client.queue_stats("orders"))["log_start"] > 1)
        await wait_for(truncated, 20, "the log to be truncated below what both members hold")
        await client.move_queue("orders", "replica", "n3")

        async def moved() -> dict[str, Any] | None:
            stats = await client.queue_stats("orders")
            return stats if stats["replica"] == "n3" and stats["replication_state"] == "in_sync" else None
        stats = await wait_for(moved, 30, "the replica to move to n3 and be in sync")
        assert stats["snapshots_sent"] >= 1, stats
        await client.handoff("orders")      # answered once the old master's copy of the map has the swap
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as at_n3:
            async def n3_masters() -> bool:   # n3 applies the same committed swap a moment later
                return bool((await at_n3.queue_stats("orders"))["master"] == "n3")
            await wait_for(n3_masters, 5, "n3's copy of the map to show the swap")
            rest = await drain(at_n3, "orders")
    assert not set(rest) & set(acked), "a member re-created by a move delivered acknowledged messages again"
    assert sorted(rest) == sorted(set(ids) - set(acked))


async def test_a_dead_letter_taken_over_by_snapshot_is_served_by_the_new_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """A message dead-lettered while the replica is away reaches it inside its queue's
    snapshot, counter and all: after a handoff the new master serves it (it once held the
    row under a counter that did not cover it, and served nothing)."""
    cluster: LocalCluster = qcluster_factory(3, {"jobs": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("jobs", strength="full", max_deliveries=1)
        await client.enqueue_many("jobs", [b"poison", b"fine"])
        await asyncio.to_thread(cluster.wipe, "n2")
        [poison] = await client.receive("jobs", max_messages=1, wait_s=1)
        assert poison.payload == b"poison"
        await poison.release()                    # its only delivery: dead-lettered
        await asyncio.to_thread(cluster.start, "n2")

        async def in_sync() -> dict[str, Any] | None:
            stats = await client.queue_stats("jobs")
            return stats if stats["replication_state"] == "in_sync" else None
        stats = await wait_for(in_sync, 30, "the returning replica to take the snapshot")
        assert stats["snapshots_sent"] >= 1, stats
        await client.handoff("jobs")
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as at_n2:
        [dead] = await at_n2.receive("jobs.dlq", max_messages=5, wait_s=2)
        assert dead.payload == b"poison"
        await dead.ack()
        [fine] = await at_n2.receive("jobs", max_messages=5, wait_s=1)
        await fine.release()                      # the next dead letter takes the next index
        [second] = await at_n2.receive("jobs.dlq", max_messages=5, wait_s=2)
        assert second.payload == b"fine" and second.id != dead.id


@pytest.mark.timeout(240)
async def test_a_replica_killed_while_taking_a_snapshot_under_traffic_comes_back_identical(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster: LocalCluster = qcluster_factory(3, {"ledger": ["n1", "n2"]},
                                             {"snapshot_chunk_bytes_max": 16384, "snapshot_chunks_in_flight_max": 2})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("ledger", strength="full")
        payload = bytes(2048)
        for _ in range(10):
            await client.enqueue_many("ledger", [payload] * 1000)
        # Consumed and acknowledged while the replica is away: its return is past the log's start.
        first = await client.receive("ledger", max_messages=1000, wait_s=1)
        await asyncio.to_thread(cluster.wipe, "n2")
        await asyncio.gather(*(m.ack() for m in first))
        await client.enqueue_many("ledger", [payload] * 500)
        stop = asyncio.Event()

        async def traffic() -> None:
            while not stop.is_set():
                await client.enqueue_many("ledger", [b"live"] * 50)
                for message in await client.receive("ledger", max_messages=20, wait_s=0.05):
                    await message.ack()
                await asyncio.sleep(0.01)
        running = asyncio.create_task(traffic())
        await asyncio.to_thread(cluster.start, "n2")

        async def receiving() -> bool:
            async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
                try:
                    return bool((await replica.queue_stats("ledger")).get("receiving_snapshot"))
                except Exception:
                    return False
        await wait_for(receiving, 30, "the returning replica to take a snapshot")
        await asyncio.to_thread(cluster.kill, "n2")          # kill -9 in the middle of the transfer
        await asyncio.sleep(0.5)
        await asyncio.to_thread(cluster.start, "n2")
        await asyncio.sleep(2)
        stop.set()
        await running
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
            final = await wait_converged(client, replica, "ledger", timeout_s=60)
            replica_stats = await replica.queue_stats("ledger")
        assert final["snapshots_sent"] >= 1, final
        assert replica_stats["depth"] == final["depth"] and replica_stats["in_flight"] == final["in_flight"]
