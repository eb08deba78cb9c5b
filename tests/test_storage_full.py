"""A node whose storage cannot grow refuses writes with E_STORAGE_FULL and loses nothing."""
from __future__ import annotations

import pytest

from client import AsyncClient, QueueError

pytestmark = pytest.mark.asyncio


async def test_a_full_disk_refuses_enqueues_keeps_what_was_stored_and_goes_on_serving(qnode_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "small.toml"
    config.write_text("[node]\nmap_size_bytes = 1048576\nmap_size_max_bytes = 2097152\nbody_bytes_max = 65536\n")
    node = qnode_factory("small", ["--config", str(config)])
    node.start()
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
    node.kill()
    node.start()
    async with AsyncClient(node.url, node.credentials_path) as client:
        assert (await client.queue_stats("big"))["depth"] == len(stored) - 5
