"""Queue pairs on real processes: producers and consumers at both members, both strengths,
kill -9 of the replica under load and its return through state transfer."""
from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

import pytest

from client import AsyncClient, QueueError

pytestmark = pytest.mark.asyncio
PLACEMENT = {"orders": ["n1", "n2"], "ledger": ["n1", "n2"]}


async def stats(client: AsyncClient, queue: str) -> dict[str, Any]:
    return await client.queue_stats(queue)


async def wait_converged(master: AsyncClient, replica: AsyncClient, queue: str, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        m, r = await stats(master, queue), await stats(replica, queue)
        if m["replication_state"] == "in_sync" and r["replication_state"] == "following" \
                and m["last_order"] == r["last_order"] == m["commit_order"] == r["commit_order"] \
                and m["digest"] == r["digest"]:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{queue} did not converge: master {m} replica {r}")
        await asyncio.sleep(0.1)


async def wait_converged_either(first: AsyncClient, second: AsyncClient, queue: str,
                                timeout_s: float = 20.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Like wait_converged, whichever of the two is the master (a failover may swap them):
    (the master's stats, the replica's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = await stats(first, queue), await stats(second, queue)
        master, replica = (a, b) if a.get("master_status") == "master" else (b, a)
        if master["replication_state"] == "in_sync" and replica["replication_state"] == "following" \
                and master["last_order"] == replica["last_order"] == master["commit_order"] == replica["commit_order"] \
                and master["digest"] == replica["digest"]:
            return master, replica
        if time.monotonic() > deadline:
            raise AssertionError(f"{queue} did not converge: {a} {b}")
        await asyncio.sleep(0.1)


async def test_both_members_take_producers_and_each_serves_its_own_consumers(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
        await master.create_queue("orders", strength="producer")
        at_master = await master.enqueue_many("orders", [f"m{i}".encode() for i in range(50)])
        at_replica = [await replica.enqueue("orders", f"r{i}".encode()) for i in range(20)]
        assert len(set(at_master) | set(at_replica)) == 70, "the master orders both members' enqueues"
        await wait_converged(master, replica, "orders")
        with urllib.request.urlopen(cluster.urls["n1"] + "/metrics", timeout=5) as answer:
            metrics = answer.read().decode()
        for line in ('qserver_replica_lag_operations{queue="orders",role="master"} 0',
                     'qserver_replica_in_sync{queue="orders",role="master"} 1',
                     'qserver_peer_link_up{peer="n2"} 1', "qserver_payloads_moved_total 0", "qserver_oplog_kept_bytes ",
                     "qserver_membership_term ", 'qserver_membership_index{kind="commit"} ',
                     'qserver_membership_persist_wait_seconds_bucket{le="0.01"} ', "qserver_membership_persist_seconds_count "):
            assert line in metrics
        # producer strength: each member's consumers see every message once, in the same order
        for client in (master, replica):
            seen = []
            while True:
                messages = await client.receive("orders", max_messages=100, wait_s=0.2)
                if not messages:
                    break
                seen.extend(m.id for m in messages)
                await asyncio.gather(*(m.ack() for m in messages))
            assert seen == sorted(at_master + at_replica), client.url


async def test_under_full_strength_a_message_acked_at_one_member_is_never_delivered_at_the_other(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
        await master.create_queue("ledger", strength="full")
        ids = await master.enqueue_many("ledger", [f"l{i}".encode() for i in range(30)])
        taken: list[int] = []
        for client in (replica, master, replica):
            messages = await client.receive("ledger", max_messages=10, wait_s=1)
            taken.extend(m.id for m in messages)
            await asyncio.gather(*(m.ack() for m in messages))
        assert sorted(taken) == ids and len(set(taken)) == 30
        final = await wait_converged(master, replica, "ledger")
        assert final["depth"] == 0 and (await stats(replica, "ledger"))["depth"] == 0
        assert await replica.receive("ledger", wait_s=0.2) == [] and await master.receive("ledger", wait_s=0.2) == []


async def test_a_replica_killed_under_load_returns_through_state_transfer_identical_to_the_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT, {"replica_lag_max_ms": 500})
    acknowledged: list[int] = []
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master:
        await master.create_queue("orders", strength="producer")
        stop = asyncio.Event()

        async def produce() -> None:
            while not stop.is_set():
                try:
                    acknowledged.extend(await master.enqueue_many("orders", [b"x" * 100] * 20))
                except QueueError:
                    await asyncio.sleep(0.01)
        producers = [asyncio.create_task(produce()) for _ in range(4)]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.kill, "n2")
        before_return = len(acknowledged)
        await asyncio.sleep(1.5)
        assert len(acknowledged) > before_return, "the master kept acknowledging alone (recorded out of sync)"
        assert (await stats(master, "orders"))["replication_state"] == "out_of_sync"
        await asyncio.to_thread(cluster.start, "n2")
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*producers)
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
            final = await wait_converged(master, replica, "orders")
            assert final["depth"] == len(set(acknowledged)) == (await stats(replica, "orders"))["depth"]


async def test_a_client_of_a_node_that_holds_neither_member_is_sent_to_the_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as outsider:
        created = await outsider.create_queue("orders")          # HTTP: passed on to the master
        assert created["master"] == "n1" and created["replica"] == "n2"
        first = await outsider.enqueue("orders", b"one")         # WebSocket: E_NOT_MASTER, then routed
        assert first == 1 and outsider._router.route("orders").url == cluster.urls["n1"]
        [message] = await outsider.receive("orders", wait_s=1)
        assert message.payload == b"one"
        await message.ack()
        assert (await outsider.queue_stats("orders"))["depth"] == 0


async def test_a_subscriber_at_the_master_gets_only_committed_messages_as_they_commit(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master:
        await master.create_queue("orders")
        received: list[bytes] = []

        async def consume() -> None:
            async with master.consume("orders", prefetch=50) as messages:
                async for message in messages:
                    received.append(message.payload)
                    await message.ack()
                    if len(received) == 100:
                        return
        consumer = asyncio.create_task(consume())
        await master.enqueue_many("orders", [f"{i}".encode() for i in range(100)])
        await asyncio.wait_for(consumer, 10)
        assert received == [f"{i}".encode() for i in range(100)]


async def test_a_dedupe_id_is_kept_by_the_pair_whichever_member_the_retry_reaches(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
        await master.create_queue("orders")
        first = await master.enqueue("orders", b"pay 10", dedupe_id="payment-7")
        again = await replica.enqueue("orders", b"pay 10", dedupe_id="payment-7")
        assert again == first
        final = await wait_converged(master, replica, "orders")
        assert final["depth"] == 1 and final["total_enqueued"] == 1


async def test_under_full_strength_dead_lettering_happens_once_for_the_pair(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
        await master.create_queue("ledger", strength="full", max_deliveries=2)
        await master.enqueue("ledger", b"poison")
        for client in (master, replica):          # leased once at each member, given back each time
            [message] = await client.receive("ledger", wait_s=2)
            await message.release()
        [dead] = await replica.receive("ledger.dlq", wait_s=2)
        assert dead.payload == b"poison"
        await dead.ack()
        for queue in ("ledger", "ledger.dlq"):
            final = await wait_converged(master, replica, queue)
            assert final["depth"] == 0 and (await stats(replica, queue))["depth"] == 0


async def test_a_replica_that_lost_its_disk_takes_the_whole_queue_again(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    # Five voters: with n1 down and n2's disk gone, n3, n4 and n5 still make a majority that
    # can replace n2 in the membership layer (three voters could not, and must not: a wiped
    # voter never votes again under its old membership).
    cluster = qcluster_factory(5, {**PLACEMENT, "other": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master:
        await master.create_queue("ledger", strength="full")
        await master.enqueue_many("ledger", [f"l{i}".encode() for i in range(300)])
        [taken] = await master.receive("ledger", wait_s=5, visibility_timeout_s=600)
        assert taken.payload == b"l0"
    # n2 loses its disk and, before it hears from n1 again, creates a queue of its own: its
    # local storage ids now differ from n1's, as they do between real nodes.
    await asyncio.to_thread(cluster.kill, "n1")
    await asyncio.to_thread(cluster.wipe, "n2")
    await asyncio.to_thread(cluster.start, "n2")
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as newcomer:
        await newcomer.create_queue("other")
        await asyncio.to_thread(cluster.start, "n1")
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master:
            await master.enqueue_many("ledger", [b"after"] * 10)
            # n1 restarted without a lease: the leader may fail its queues over to n2 as soon
            # as n2 is in sync again (it then holds everything): either way they converge. The
            # map read every 0.5 s while this ran (issue 13) showed that order each time n2 ended
            # as master: in sync cleared by n2's new storage id, then set again by n1 once its
            # snapshot was installed, and only then the failover (epoch 2). A failover planned
            # before the new storage id is known fails its compare-and-set, and a node that loses
            # its disk right after its promotion gives the queue back (test_chaos_regressions).
            final, replica_view = await wait_converged_either(master, newcomer, "ledger")
            assert final["depth"] == replica_view["depth"] == 310
            assert replica_view["in_flight"] == final["in_flight"] == 1    # the lease came across too


async def test_a_stale_ack_at_the_replica_of_a_full_queue_is_refused_like_at_the_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
        await master.create_queue("ledger", strength="full")
        message_id = await master.enqueue("ledger", b"once")
        await wait_converged(master, replica, "ledger")      # the replica holds the queue by now
        [message] = await replica.receive("ledger", wait_s=2)
        with pytest.raises(QueueError) as stale:
            await replica.ack("ledger", message_id, "0" * 16)
        assert stale.value.code == "E_LEASE_EXPIRED"
        await message.ack()
        assert (await wait_converged(master, replica, "ledger"))["depth"] == 0
