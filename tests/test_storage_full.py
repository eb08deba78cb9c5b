"""A node whose storage cannot grow refuses writes with E_STORAGE_FULL and loses nothing."""
from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, QueueError

pytestmark = pytest.mark.asyncio


async def test_a_full_disk_refuses_enqueues_keeps_what_was_stored_and_goes_on_serving(qnode_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "small.toml"
    config.write_text("[node]\nmap_size_bytes = 1048576\nmap_size_max_bytes = 2097152\nbody_bytes_max = 65536\n")
    node = qnode_factory("small", ["--config", str(config)])
    await asyncio.to_thread(node.start)
    async with AsyncClient(node.url, node.credentials_path) as client:
        await client.create_queue("big")
        stored: list[int] = []
        refused = None
        for n in range(200):                       # 200 x 60 KiB would need ~12 MiB
            try:
                stored.append(await client.enqueue("big", bytes([n % 256]) * 60_000))
            except QueueError as error:
                refused = error
                break
        assert refused is not None and refused.code == "E_STORAGE_FULL" and refused.retriable
        assert len(stored) > 5
        # Everything acknowledged before is still there, in order, and the node still serves.
        for expected in stored[:5]:
            [message] = await client.receive("big", wait_s=1)
            assert message.id == expected and message.payload == bytes([(expected - 1) % 256]) * 60_000
            await message.ack()
        assert (await client.queue_stats("big"))["depth"] == len(stored) - 5
    await asyncio.to_thread(node.kill)
    await asyncio.to_thread(node.start)
    async with AsyncClient(node.url, node.credentials_path) as client:
        assert (await client.queue_stats("big"))["depth"] == len(stored) - 5


async def test_the_map_grows_between_two_writer_jobs_never_during_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LMDB refuses to resize the map while a write transaction is active. The membership
    layer's writes and journal prunes share the writer with the commits, so the engine grows
    the map under the writer's lock (CommitPipeline._grow_and_retry): before, a Raft write running at
    that moment made the growth raise inside the commit's callback, and the engine kept its
    batch committing for ever (seen in a benchmark: no answers, no stop)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import lmdb

    from qserver.core.pipeline import LockedWriter
    from qserver.storage.lmdb_store import Storage
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=8 << 20, disk_reserve_bytes=0)
    writer = LockedWriter(ThreadPoolExecutor(max_workers=1))
    in_transaction, finish = threading.Event(), threading.Event()

    def a_raft_write() -> None:
        with storage.env.begin(write=True):
            in_transaction.set()
            assert finish.wait(10)
    try:
        job = writer.submit(a_raft_write)
        assert in_transaction.wait(10)
        with pytest.raises(lmdb.Error, match="write transaction is active"):
            storage.grow_map()                       # what the engine did, unguarded
        threading.Timer(0.2, finish.set).start()
        with writer.lock:                            # what it does now: waits for the job
            assert storage.grow_map() == 16 << 20
        job.result(timeout=10)
    finally:
        finish.set()
        writer.shutdown()
        storage.close()
