"""Crash and restart of a real node: kill -9 with messages in flight loses nothing that was
acknowledged, stores nothing twice, and a node holding a million messages serves at once."""
from __future__ import annotations

import asyncio
import time

import pytest

from client import AsyncClient, QueueError

pytestmark = pytest.mark.asyncio


async def drain_all(client: AsyncClient, queue: str, expected_at_least: int, timeout_s: float = 30.0) -> list[bytes]:
    """Receive and ack until the queue is empty (waiting out leases the crash left behind)."""
    payloads: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        messages = await client.receive(queue, max_messages=500, wait_s=0.5)
        if not messages:
            stats = await client.queue_stats(queue)
            if stats["depth"] == 0 and len(payloads) >= expected_at_least:
                return payloads
            continue
        payloads.extend(m.payload for m in messages)
        await asyncio.gather(*(m.ack() for m in messages))
    raise AssertionError(f"queue {queue} not drained in {timeout_s}s: {len(payloads)} received")


async def receive_one_retrying(client: AsyncClient, queue: str, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """The first call after a crash may meet the dead socket: retriable errors are retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            [message] = await client.receive(queue, max_messages=1, wait_s=2)
            return message
        except QueueError as error:
            if not error.retriable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_every_acknowledged_enqueue_survives_a_kill_9_and_none_is_stored_twice(qnode) -> None:  # type: ignore[no-untyped-def]
    acknowledged: dict[bytes, int] = {}
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("crash", visibility_timeout_s=1.0)
        stop = asyncio.Event()

        async def producer(worker: int) -> None:
            sequence = 0
            while not stop.is_set():
                payload = f"w{worker}-{sequence}".encode()
                sequence += 1
                try:
                    acknowledged[payload] = await client.enqueue("crash", payload)
                except QueueError:
                    pass   # not acknowledged: it may or may not be stored; either is allowed

        async def leaser() -> None:
            while not stop.is_set():
                try:
                    await client.receive("crash", max_messages=20, wait_s=0.1)   # leased, never acked
                except QueueError:
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(producer(w)) for w in range(40)] + [asyncio.create_task(leaser())]
        await asyncio.sleep(1.5)
        before_kill = len(acknowledged)
        await asyncio.to_thread(qnode.kill)
        await asyncio.to_thread(qnode.start)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert before_kill > 1000, "the workload was too small to mean anything"

        drained = await drain_all(client, "crash", len(acknowledged))
    assert len(drained) == len(set(drained)), "a message was stored or delivered twice"
    missing = set(acknowledged) - set(drained)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    assert len(set(acknowledged.values())) == len(acknowledged), "two payloads got one id"


async def test_leases_and_dedupe_ids_survive_a_restart(qnode) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("durable", visibility_timeout_s=2.0)
        first = await client.enqueue("durable", b"once", dedupe_id="order-1")
        await client.enqueue("durable", b"two")
        [leased] = await client.receive("durable", max_messages=1)
        assert leased.payload == b"once"
        await asyncio.to_thread(qnode.kill)
        await asyncio.to_thread(qnode.start)
        assert await client.enqueue("durable", b"once", dedupe_id="order-1") == first
        [other] = await client.receive("durable", max_messages=5, wait_s=0.5)
        assert other.payload == b"two"
        await other.ack()
        # The lease taken before the crash runs out and the message comes back, counted.
        [again] = await client.receive("durable", max_messages=1, wait_s=5)
        assert again.payload == b"once" and again.deliveries == 2
        with pytest.raises(QueueError) as stale:
            await leased.ack()
        assert stale.value.code == "E_LEASE_EXPIRED"
        await again.ack()
        assert (await client.queue_stats("durable"))["depth"] == 0


async def test_a_node_holding_a_million_messages_serves_right_after_restart(qnode) -> None:  # type: ignore[no-untyped-def]
    count = 1_000_000
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("million", max_depth=2 * count)
        batch = [b"m" * 16] * 1000
        pending: set[asyncio.Future[list[int]]] = set()
        for _ in range(count // len(batch)):
            pending.add(asyncio.ensure_future(client.enqueue_many("million", batch, priority=3)))
            if len(pending) >= 8:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)
        await client.enqueue("million", b"urgent", priority=9)
        await asyncio.to_thread(qnode.kill)
        started = time.monotonic()
        await asyncio.to_thread(qnode.start)
        first = await receive_one_retrying(client, "million")
        serving_after_s = time.monotonic() - started
        assert first.payload == b"urgent"
        [second] = await client.receive("million", max_messages=1)
        assert second.payload == b"m" * 16 and second.id == 1
        stats = await client.queue_stats("million")
        assert stats["depth"] == count + 1
    # Loading a million keys would take seconds; the node must not do it before serving.
    assert serving_after_s < 3.0, f"first message {serving_after_s:.1f}s after the restart began"


async def test_a_message_dead_lettered_by_a_release_survives_a_restart(qnode) -> None:  # type: ignore[no-untyped-def]
    """The release that dead-letters a message writes the dead-letter queue's record in the
    same commit (its counter included): after a restart the message is there to receive, and
    the next dead letter takes the next index instead of overwriting it."""
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("jobs", max_deliveries=1)
        await client.enqueue_many("jobs", [b"poison", b"second"])
        [poison] = await client.receive("jobs", max_messages=1)
        await poison.release()                         # its only delivery: dead-lettered
        await asyncio.to_thread(qnode.kill)
        await asyncio.to_thread(qnode.start)
        [dead] = (await receive_one_retrying(client, "jobs.dlq"),)
        assert dead.payload == b"poison"
        [second] = await client.receive("jobs", max_messages=1, wait_s=1)
        await second.release()
        [after] = await client.receive("jobs.dlq", max_messages=5, wait_s=1)
        assert after.payload == b"second" and after.id != dead.id
        stats = await client.queue_stats("jobs.dlq")
        assert stats["depth"] == 2 and stats["total_enqueued"] == 2, stats



async def test_a_second_qserver_on_a_data_directory_in_use_refuses_to_start_and_the_first_serves_on(qnode) -> None:  # type: ignore[no-untyped-def]
    """Two processes on one node's data would both act as that node in the membership layer
    (a bench run that leaked a cluster's processes and started it again broke Raft's log
    matching): the second refuses, naming the first, and leaves it alone."""
    import subprocess
    import sys
    import urllib.request

    from qserver.dev.devcluster import free_port
    from tests.conftest import REPOSITORY
    second = subprocess.run([sys.executable, "-m", "qserver", "run", "--data-dir", str(qnode.data_dir),
                             "--port", str(free_port()), "--log-level", "WARNING"],
                            capture_output=True, timeout=60, cwd=REPOSITORY)
    assert second.returncode == 2, second.stderr
    assert f"in use by another qserver process (pid {qnode.process.pid})" in second.stderr.decode()
    with urllib.request.urlopen(f"{qnode.url}/healthz", timeout=5) as answer:
        assert answer.status == 200
    qnode.restart()                 # kill -9 drops the lock with the process: the next one starts
    with urllib.request.urlopen(f"{qnode.url}/healthz", timeout=5) as answer:
        assert answer.status == 200
