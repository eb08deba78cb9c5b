"""A drained node comes back (issue 39, item 2): `qctl nodes undrain` (alias `resume`) sets a
draining node up again, `nodes add` of a node already in the map says what it is, and
`rebalance` moves replicas onto a node that holds none before it spreads the masters, so the
README's drain, undrain, rebalance ends with the node serving again.

The spreading decision is pure (replication/cluster_map.py) and checked on maps; the sequence
runs on real processes through the client library and qctl.
"""
from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError, qctl
from qserver.dev.devcluster import LocalCluster
from replication.cluster_map import AddNode, ClusterMap, CreateQueue, plan_member_moves, plan_rebalance
from tests.test_failover import drain, map_of, wait_for


def cluster_map(pairs: dict[str, tuple[str, str]], nodes: tuple[str, ...] = ("n1", "n2", "n3")) -> ClusterMap:
    cluster = ClusterMap()
    for node in nodes:
        cluster.apply(AddNode(node, f"http://{node}"))
    for incarnation, (name, (master, replica)) in enumerate(sorted(pairs.items()), start=1):
        cluster.apply(CreateQueue(name, {}, master, replica, incarnation))
    return cluster


def test_a_node_that_holds_no_member_gets_replicas_and_then_a_master_from_the_node_that_masters_most() -> None:
    cluster = cluster_map({"a": ("n1", "n3"), "b": ("n1", "n3"), "c": ("n1", "n3"), "d": ("n3", "n1")})
    moves = plan_member_moves(cluster)
    assert [(m.name, m.new[1:]) for m in moves] == [("a", ("n1", "n2", False)), ("b", ("n1", "n2", False)),
                                                   ("d", ("n3", "n2", False))]
    for move in moves:
        assert cluster.apply(move)[0].applied
    assert cluster.members_per_node() == {"n1": 3, "n2": 3, "n3": 2}
    for entry in cluster.queues.values():       # the state transfers end
        entry.in_sync = True
    assert plan_rebalance(cluster) == ["a"]


def test_members_spread_to_within_one_move_nothing_and_out_of_sync_pairs_stay() -> None:
    assert plan_member_moves(cluster_map({"a": ("n1", "n2"), "b": ("n2", "n3"), "c": ("n3", "n1")})) == []
    cluster = cluster_map({"a": ("n1", "n3"), "b": ("n3", "n1")})
    assert [m.name for m in plan_member_moves(cluster)] == ["a"]          # 2, 0, 2 -> 2, 1, 1
    cluster.queues["a"].in_sync = cluster.queues["b"].in_sync = False
    assert plan_member_moves(cluster) == []


def run_qctl(cluster: LocalCluster, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = qctl.main(["--credentials", str(cluster.credentials_path), *argv], stdout=out, stderr=out)
    return code, out.getvalue()


def undrain_with_the_sync_client(cluster: LocalCluster, node: str) -> dict[str, Any]:
    with Client(cluster.urls["n3"], cluster.credentials_path) as client:
        return client.undrain_node(node)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_drained_node_undrained_and_rebalanced_holds_members_and_masters_again(qcluster_factory: Any) -> None:
    placement = {"a": ["n1", "n2"], "b": ["n2", "n3"], "c": ["n3", "n1"], "d": ["n2", "n1"]}
    cluster: LocalCluster = qcluster_factory(3, placement)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        acknowledged: dict[str, set[int]] = {}
        for name in placement:
            await client.create_queue(name, strength="full")
            acknowledged[name] = set(await client.enqueue_many(name, [name.encode()] * 100))
        await client.drain_node("n2")

        async def off_n2() -> bool:
            queues = (await map_of(cluster, "n1"))["queues"]
            return all("n2" not in (e["master"], e["replica"]) and e["in_sync"] for e in queues.values())
        await wait_for(off_n2, 30.0, "every member off n2 and in sync again")
        assert (await client.rebalance())["moves"] == []       # nothing moves onto a draining node

        code, text = await asyncio.to_thread(run_qctl, cluster, "nodes", "add", "n2", cluster.urls["n2"])
        assert code == 0 and "node n2 is already in the cluster (state draining" in text, text
        assert "qctl nodes undrain n2" in text, text
        code, text = await asyncio.to_thread(run_qctl, cluster, "nodes", "undrain", "n9")
        assert code == 1 and "E_INVALID_OPTION" in text and "no node named 'n9'" in text, text
        code, text = await asyncio.to_thread(run_qctl, cluster, "nodes", "resume", "n2")
        assert code == 0 and "node n2 is up again" in text, text

        async def up_everywhere() -> bool:
            maps = [await map_of(cluster, node) for node in cluster.ids]
            return all({n["id"]: n["state"] for n in m["nodes"]}["n2"] == "up" for m in maps)
        await wait_for(up_everywhere, 5.0, "every node's map to show n2 up")
        with pytest.raises(QueueError) as not_draining:
            await asyncio.to_thread(undrain_with_the_sync_client, cluster, "n2")
        assert not_draining.value.code == "E_INVALID_OPTION" and "n2 is up, not draining" in str(not_draining.value)

        code, text = await asyncio.to_thread(run_qctl, cluster, "--json", "rebalance")
        assert code == 0, text
        answer = json.loads(text)
        assert answer["moves"] and all(move["to"] == "n2" for move in answer["moves"]), answer
        assert answer["catching_up"] == [] and answer["handoffs"], answer

        async def n2_masters_again() -> bool:
            queues = (await map_of(cluster, "n1"))["queues"]
            return any(e["master"] == "n2" for e in queues.values()) and all(e["in_sync"] for e in queues.values())
        await wait_for(n2_masters_again, 15.0, "n2 to master a queue, every pair in sync")
        for name in placement:
            assert set(await drain(client, name)) == acknowledged[name], name
