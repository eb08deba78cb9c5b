"""`queue move` ends with the named node holding the named member (issue 39, item 6), on real
processes: a master moves by a handoff, the move of the old master's member, a wait for the new
member's state transfer and a handoff to it; a member already on the node is "already there";
the other member of the pair on the node swaps by a handoff. Nothing acknowledged is lost."""
from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from client import AsyncClient, QueueError, qctl
from qserver.dev.devcluster import LocalCluster
from tests.test_failover import drain, map_of, wait_for

pytestmark = pytest.mark.asyncio


def run_qctl(cluster: LocalCluster, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = qctl.main(["--credentials", str(cluster.credentials_path), *argv], stdout=out, stderr=out)
    return code, out.getvalue()


async def settled(cluster: LocalCluster, name: str, master: str, replica: str) -> bool:
    """Every node's copy of the map shows the pair, in sync."""
    for node in cluster.ids:
        entry = (await map_of(cluster, node))["queues"][name]
        if (entry["master"], entry["replica"], entry["in_sync"]) != (master, replica, True):
            return False
    return True


@pytest.mark.timeout(180)
async def test_moving_the_master_to_a_third_node_ends_with_that_node_master_and_loses_nothing(
        qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"billing": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("billing", strength="full")
        acknowledged = set(await client.enqueue_many("billing", [b"invoice"] * 3000))
        stop = asyncio.Event()

        async def produce() -> None:       # writes go on through the handoffs and the transfer
            while not stop.is_set():
                acknowledged.update(await client.enqueue_many("billing", [b"more"] * 20))
                await asyncio.sleep(0.01)
        producer = asyncio.create_task(produce())
        try:
            answer = await client.move_queue("billing", "master", "n3")
        finally:
            stop.set()
            await producer
        assert (answer["master"], answer["replica"], answer["how"]) == ("n3", "n2", "moved_and_handed_off"), answer
        assert answer["in_sync"], answer
        await wait_for(lambda: settled(cluster, "billing", "n3", "n2"), 5.0, "every node to show (n3, n2)")
        assert set(await drain(client, "billing")) == acknowledged


@pytest.mark.timeout(180)
async def test_a_member_already_on_the_node_is_there_and_the_other_member_swaps_by_a_handoff(
        qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"billing": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("billing", strength="full")
        acknowledged = set(await client.enqueue_many("billing", [b"x"] * 200))

    code, text = await asyncio.to_thread(run_qctl, cluster, "queue", "move", "billing", "--member", "replica",
                                         "--to", "n2")
    assert code == 0 and "n2 holds the replica already: nothing moved" in text, text
    code, text = await asyncio.to_thread(run_qctl, cluster, "queue", "move", "billing", "--member", "master",
                                         "--to", "n2")
    assert code == 0 and "billing: master n2, replica n1" in text and "a handoff swapped them" in text, text
    code, text = await asyncio.to_thread(run_qctl, cluster, "queue", "move", "billing", "--member", "replica",
                                         "--to", "n2")     # n2 masters it now: they swap back
    assert code == 0 and "billing: master n1, replica n2" in text, text
    code, text = await asyncio.to_thread(run_qctl, cluster, "queue", "move", "billing", "--member", "master",
                                         "--to", "n7")
    assert code == 1 and "E_INVALID_OPTION" in text and "no node named 'n7'" in text, text
    code, text = await asyncio.to_thread(run_qctl, cluster, "queue", "move", "billing", "--member", "replica",
                                         "--to", "n3")
    assert code == 0 and "billing: master n1, replica n3" in text and "state transfer" in text, text
    await wait_for(lambda: settled(cluster, "billing", "n1", "n3"), 20.0, "n3 in sync")
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        with pytest.raises(QueueError) as draining:
            await client.drain_node("n2")
            await client.move_queue("billing", "master", "n2")
        assert draining.value.code == "E_INVALID_OPTION" and "n2 is draining" in draining.value.message
        assert set(await drain(client, "billing")) == acknowledged
