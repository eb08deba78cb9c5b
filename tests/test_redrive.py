"""Redrive (issue 14, item 10): dead letters go back to the queue they came from, on a real
cluster, through the client library and qctl."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client import AsyncClient
from tests.test_client_integration import run_qctl


async def dead_letter_all(client: AsyncClient, queue: str, count: int) -> None:
    """With max_deliveries 1, a released delivery is the message's last: it is dead-lettered."""
    for _ in range(count):
        [message] = await client.receive(queue, wait_s=2.0)
        await message.release()


@pytest.mark.asyncio
async def test_dead_letters_go_back_at_their_priorities_once_each_and_a_limit_bounds_a_redrive(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"jobs": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("jobs", strength="full", max_deliveries=1, dead_letter=True)
        for number, priority in enumerate([2, 7, 2, 7, 5]):
            await client.enqueue("jobs", b"job %d" % number, priority=priority)
        await dead_letter_all(client, "jobs", 5)
        assert (await client.queue_stats("jobs.dlq"))["depth"] == 5
        first, second = await client.redrive("jobs", limit=2), await client.redrive("jobs")
        assert (first["redriven"], len(first["ids"]), second["redriven"], len(second["ids"])) == (2, 2, 3, 3)
        assert await client.redrive("jobs") == {"queue": "jobs", "redriven": 0, "ids": []}
        back = await client.receive("jobs", max_messages=10, wait_s=2.0)
        assert sorted(m.payload for m in back) == [b"job %d" % n for n in range(5)]
        assert [m.priority for m in back] == [7, 7, 5, 2, 2] and all(m.deliveries == 1 for m in back)
        assert sorted(m.id for m in back) == first["ids"] + second["ids"]     # new messages, under the ids answered
        for message in back:
            await message.ack()
        await client.handoff("jobs")                       # the replica holds the same
        assert (await client.queue_stats("jobs.dlq"))["depth"] == 0
        assert (await client.queue_stats("jobs"))["depth"] == 0


def test_qctl_redrives_with_json_and_a_queue_without_dead_letters_is_refused(qnode: Any) -> None:
    assert run_qctl(qnode, "queue", "create", "mail", "--max-deliveries", "1", "--dead-letter")[0] == 0
    for payload in ("a", "b"):
        run_qctl(qnode, "put", "mail", payload)

    async def dead_letter() -> None:
        async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
            await dead_letter_all(client, "mail", 2)
    asyncio.run(dead_letter())
    code, answer, _ = run_qctl(qnode, "queue", "redrive", "mail", "--limit", "5")
    assert code == 0 and answer["redriven"] == 2 and len(answer["ids"]) == 2
    assert run_qctl(qnode, "queue", "stats", "mail")[1]["depth"] == 2
    assert run_qctl(qnode, "queue", "create", "plain", "--no-dead-letter")[0] == 0
    code, document, _ = run_qctl(qnode, "queue", "redrive", "plain")
    assert code == 1 and document["error"]["code"] == "E_INVALID_OPTION"
