"""`min_in_sync` on real processes: with 2, a queue whose replica is gone refuses enqueues with
E_NOT_ENOUGH_REPLICAS before anything is stored, and an enqueue caught as the replica went is
never acknowledged on the master's disk alone; with 1 (the default) the master records the
replica out of sync and goes on alone. Both take writes again, on both members, once the
replica is back in sync (docs/ARCHITECTURE.md, Guarantee 8)."""
from __future__ import annotations

import asyncio
import time

import pytest

from client import AsyncClient, QueueError
from tests.test_full_disk_pair import converged, receive_all, sees_everything, until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(150)]
PLACEMENT = {"strict": ["n1", "n2"], "loose": ["n1", "n2"]}


async def in_sync(client: AsyncClient, queue: str) -> bool:
    return bool((await client.cluster())["queues"][queue]["in_sync"])


async def out_of_sync(client: AsyncClient, queue: str) -> bool:
    return not await in_sync(client, queue)


async def test_min_in_sync_2_refuses_enqueues_without_storing_while_the_replica_is_out_of_sync_and_1_goes_on_alone(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = await asyncio.to_thread(qcluster_factory, 3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client, \
            AsyncClient(cluster.urls["n1"], cluster.credentials_path, request_timeout_s=1.5) as impatient:
        await client.create_queue("strict", min_in_sync=2)
        await client.create_queue("loose")
        acked: dict[str, dict[int, bytes]] = {"strict": {}, "loose": {}}
        for queue, numbers in acked.items():
            for number in range(20):
                numbers[await client.enqueue(queue, f"{queue}-{number}".encode())] = f"{queue}-{number}".encode()
        for queue in acked:
            await until(lambda queue=queue: converged(client, queue), 10, f"{queue} in sync")   # type: ignore[misc]

        await asyncio.to_thread(cluster.kill, "n2")
        # The master records the replica of `strict` out of sync on its own, with no write
        # outstanding: its link is down longer than replica_lag_max_ms.
        await until(lambda: out_of_sync(client, "strict"), 15, "strict's replica recorded out of sync")
        before = await client.queue_stats("strict")
        with pytest.raises(QueueError) as refused:
            await impatient.enqueue("strict", b"refused")
        assert refused.value.code == "E_NOT_ENOUGH_REPLICAS" and not refused.value.outcome_unknown, refused.value
        after = await client.queue_stats("strict")
        assert (after["last_order"], after["next_index"], after["depth"]) == \
            (before["last_order"], before["next_index"], before["depth"]), "a refused enqueue stored something"

        # min_in_sync 1: the master records its replica out of sync and answers, alone.
        started = time.monotonic()
        acked["loose"][await client.enqueue("loose", b"alone")] = b"alone"
        assert time.monotonic() - started < 8, "the master waited for its replica instead of going on alone"
        assert await out_of_sync(client, "loose")

        await asyncio.to_thread(cluster.start, "n2")
        for queue in acked:
            await until(lambda queue=queue: in_sync(client, queue), 30, f"{queue} recorded in sync again")  # type: ignore[misc]
            await until(lambda queue=queue: converged(client, queue), 30, f"{queue} caught up")  # type: ignore[misc]
        acked["strict"][await client.enqueue("strict", b"both again")] = b"both again"
        acked["loose"][await client.enqueue("loose", b"both again")] = b"both again"

        # Every acknowledged message is on both members (under `producer` each serves its own
        # consumers), and the refused one is on neither.
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
            for queue in acked:
                await until(lambda queue=queue: sees_everything(replica, queue, max(acked[queue])), 10,  # type: ignore[misc]
                            f"the replica's consumers see every message of {queue}")
            for member in (client, replica):
                for queue, numbers in acked.items():
                    got = await receive_all(member, queue)
                    assert got == numbers, (member.url, queue, sorted(got), sorted(numbers))


async def test_min_in_sync_2_never_acknowledges_an_enqueue_its_gone_replica_does_not_hold(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """An enqueue that reaches the master after the replica died, before the map records it out of
    sync, is stored on the master but not acknowledged: it is answered E_NOT_ENOUGH_REPLICAS with
    its outcome unknown once the replica is recorded out of sync (it may be delivered later: a
    retry with the same dedupe id stores it once)."""
    cluster = await asyncio.to_thread(qcluster_factory, 3, {"strict": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client, \
            AsyncClient(cluster.urls["n1"], cluster.credentials_path, request_timeout_s=6) as producer:
        await client.create_queue("strict", min_in_sync=2)
        acked = {await client.enqueue("strict", b"first"): b"first"}
        await until(lambda: converged(client, "strict"), 10, "strict in sync")
        await asyncio.to_thread(cluster.kill, "n2")
        assert await in_sync(client, "strict")
        with pytest.raises(QueueError) as caught:
            await producer.enqueue("strict", b"caught", dedupe_id="caught-1")
        assert caught.value.code == "E_NOT_ENOUGH_REPLICAS" and caught.value.outcome_unknown, caught.value
        assert await out_of_sync(client, "strict")

        await asyncio.to_thread(cluster.start, "n2")
        await until(lambda: converged(client, "strict"), 30, "strict in sync again")
        again = await client.enqueue("strict", b"caught", dedupe_id="caught-1")   # stored once
        acked[again] = b"caught"
        got = await receive_all(client, "strict")
        assert got == acked, (got, acked)
