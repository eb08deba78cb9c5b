"""A forward keeps several data messages in flight (issue 38): real nodes, the real forwarder.

Pipelined, a forward sends numbers past one the root is refusing at that moment; the root's
stream fences (replication/queue_streams.py) refuse those too until the refused one is stored, so
the destination stores each stream in its source's order even when it keeps filling up, and
nothing is lost or stored twice. Large messages travel in data messages of at most
DATA_BYTES_MAX (one batch of 64 KiB messages was larger than a node takes in one frame).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import LocalCluster

pytestmark = pytest.mark.asyncio


async def _consume(client: AsyncClient, queue: str, want: int, *, pause_s: float, timeout_s: float = 120.0
                   ) -> list[tuple[int, bytes]]:
    """(source id, payload) of each message taken from `queue`, in the order taken."""
    taken: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(taken) < want and time.monotonic() < deadline:
        for message in await client.receive(queue, 50, wait_s=0.5):
            taken.append((int(message.headers["x-sequence"]), message.payload))
            await message.ack()
        await asyncio.sleep(pause_s)
    assert len(taken) == want, f"{len(taken)} of {want} arrived"
    return taken


async def test_a_pipelined_forward_into_a_queue_that_keeps_filling_stores_in_order_and_loses_nothing(
        qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"src": ["n1", "n2"], "dst": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("dst", strength="full", max_depth=200)
        await client.create_queue("src", strength="full")
        sent = [b"m%05d" % i for i in range(2_000)]
        for start in range(0, len(sent), 500):
            await client.enqueue_many("src", sent[start:start + 500])
        await client.create_forward("pipe", "src", "dst")
        taken = await _consume(client, "dst", len(sent), pause_s=0.02)
        numbers = [number for number, _ in taken]
        assert numbers == sorted(numbers), "the destination stored the stream out of its source's order"
        assert sorted(payload for _, payload in taken) == sent
        stats = await client.forward_stats("pipe")
        assert stats["sent"] > len(sent), "the destination never refused: the test did not fill it"
        assert stats["stored"] == len(sent) and (await client.queue_stats("src"))["depth"] == 0


async def test_a_forward_of_large_messages_sends_them_in_data_messages_a_node_takes(qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"big-src": ["n1", "n2"], "big-dst": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("big-dst", strength="full")
        await client.create_queue("big-src", strength="full")
        sent = [n.to_bytes(2, "big") * 32_768 for n in range(300)]      # 300 x 64 KiB: 19 MiB
        for start in range(0, len(sent), 50):
            await client.enqueue_many("big-src", sent[start:start + 50])
        await client.create_forward("big", "big-src", "big-dst")
        taken = await _consume(client, "big-dst", len(sent), pause_s=0.0)
        assert sorted(payload for _, payload in taken) == sorted(sent)
