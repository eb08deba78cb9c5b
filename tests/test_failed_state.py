"""A queue that cannot serve reports FAILED with a reason and since when, and OPEN again once
it serves (issue 37 item 2; replication/queue_health.py, qserver/cluster/queue_health.py):
the pure rule, a node whose storage is full, and a `min_in_sync: 2` pair whose replica is gone,
on real processes."""
from __future__ import annotations

import asyncio
import io
import time
import urllib.request

import pytest

from client import AsyncClient, Client, QueueError
from client.qctl import main as qctl
from replication.cluster_map import ClusterMap, decode_map, encode_map
from replication.map_commands import (
    AddNode,
    CommandError,
    CreateQueue,
    DeleteQueue,
    SetFeatureLevel,
    SetQueueHealth,
    decode_command,
    encode_command,
)
from replication.queue_health import REPLICA_UNAVAILABLE, STORAGE_FULL, QueueHealth, judge
from tests.test_full_disk_pair import until

pytestmark = pytest.mark.timeout(120)


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def test_the_rule_and_since_when() -> None:
    healthy = judge(storage_full=None, min_in_sync=2, replicated=True, replica="n2", replica_in_sync=True)
    assert healthy is None
    # min_in_sync 1 goes on alone: not failed; a queue without a replica never waits for one.
    assert judge(storage_full=None, min_in_sync=1, replicated=True, replica="n2", replica_in_sync=False) is None
    assert judge(storage_full=None, min_in_sync=2, replicated=False, replica=None, replica_in_sync=False) is None
    gone = judge(storage_full=None, min_in_sync=2, replicated=True, replica="n2", replica_in_sync=False,
                 replica_storage_full=True)
    assert gone is not None and gone[0] == REPLICA_UNAVAILABLE and "n2" in gone[1] and "storage is full" in gone[1]
    full = judge(storage_full="10 bytes free", min_in_sync=2, replicated=True, replica="n2", replica_in_sync=False)
    assert full is not None and full[0] == STORAGE_FULL        # the storage comes first

    health = QueueHealth()
    assert health.observe("q", None, 1_000) is None and health.fields("q")["failed_reason"] is None
    assert health.observe("q", (STORAGE_FULL, "a"), 2_000) == "failed"
    assert health.observe("q", (STORAGE_FULL, "b"), 3_000) is None          # still failed: since stays
    assert health.fields("q") == {"state": "FAILED", "failed_reason": STORAGE_FULL, "failed_detail": "b",
                                  "failed_since_ms": 2_000}
    assert health.observe("q", (REPLICA_UNAVAILABLE, "c"), 4_000) == "failed"   # another reason: new since
    assert health.fields("q")["failed_since_ms"] == 4_000
    assert health.observe("q", None, 5_000) == "recovered" and "state" not in health.fields("q")
    health.observe("gone", (STORAGE_FULL, "x"), 6_000)
    assert health.keep_only({"q"}) == ["gone"] and health.failures == {}


def test_the_map_records_a_failed_queue_only_at_feature_level_3_and_keeps_it_in_snapshots() -> None:
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}"))
    cluster.apply(CreateQueue("q", {}, "n1", "n2", 7))
    failed = SetQueueHealth("q", 7, REPLICA_UNAVAILABLE, "replica n2 is not in sync", 1_000)
    assert decode_command(encode_command(failed)) == failed
    with pytest.raises(CommandError):
        decode_command(encode_command(SetQueueHealth("q", 7, REPLICA_UNAVAILABLE, "d", "soon")))  # type: ignore[arg-type]
    [refused] = cluster.apply(failed)               # 0.2.0 cannot decode it: not below level 3
    assert not refused.applied and "feature level 3" in refused.reason and cluster.queue_health == {}
    assert encode_map(cluster) == encode_map(decode_map(encode_map(cluster)))
    cluster.apply(SetFeatureLevel(3))
    assert not cluster.apply(SetQueueHealth("q", 8, STORAGE_FULL, "", 1))[0].applied     # another incarnation
    assert not cluster.apply(SetQueueHealth("q", 7, "bored", "", 1))[0].applied         # not a reason
    assert not cluster.apply(SetQueueHealth("q", 7, "", "", 0))[0].applied       # not failed: nothing to clear
    assert cluster.apply(failed)[0].applied
    assert cluster.to_json()["queues"]["q"]["failed_reason"] == REPLICA_UNAVAILABLE
    copy = decode_map(encode_map(cluster))
    assert copy == cluster and copy.queue_health == {"q": (REPLICA_UNAVAILABLE, "replica n2 is not in sync", 1_000)}
    assert cluster.apply(SetQueueHealth("q", 7, "", "", 0))[0].applied
    assert "failed_reason" not in cluster.to_json()["queues"]["q"] and cluster.queue_health == {}
    cluster.apply(failed)
    cluster.apply(DeleteQueue("q", 7))               # a deleted queue's record goes with it
    assert cluster.queue_health == {}


@pytest.mark.asyncio
async def test_a_full_storage_fails_its_queues_and_they_open_again_once_there_is_room(qnode_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "small.toml"
    config.write_text("[node]\nmap_size_bytes = 1048576\nmap_size_max_bytes = 4194304\nbody_bytes_max = 65536\n")
    node = qnode_factory("small", ["--config", str(config)])
    await asyncio.to_thread(node.start)
    async with AsyncClient(node.url, node.credentials_path) as client:
        await client.create_queue("big")
        await client.create_queue("other")
        assert (await client.queue_stats("big"))["state"] == "OPEN"
        before_ms = int(time.time() * 1000)
        refused = None
        for n in range(200):                       # 200 x 60 KiB would need ~12 MiB
            try:
                await client.enqueue("big", bytes([n % 256]) * 60_000)
            except QueueError as error:
                refused = error
                break
        assert refused is not None and refused.code == "E_STORAGE_FULL"
        stats = await client.queue_stats("big")
        assert stats["state"] == "FAILED" and stats["failed_reason"] == "storage_full", stats
        assert before_ms <= stats["failed_since_ms"] <= int(time.time() * 1000)
        assert "storage is full" in stats["failed_detail"]
        since = stats["failed_since_ms"]
        # Every queue mastered here fails with it (none can take a message); since when stays put.
        other = await client.queue_stats("other")
        assert other["state"] == "FAILED" and other["failed_reason"] == "storage_full"
        assert (await client.queue_stats("big"))["failed_since_ms"] == since
        listed = {q["name"]: q for q in await client.list_queues()}
        assert listed["big"]["state"] == "FAILED"
        text = await asyncio.to_thread(_metrics, node.url)
        assert 'qserver_queue_failed{queue="big",reason="storage_full"} 1' in text
        code, out, err = await asyncio.to_thread(_qctl, node.credentials_path, node.url, "status")
        assert code == 0 and "FAILED QUEUE" in out and "storage_full" in out, (out, err)
        node_stats = await client.node_stats()
        assert {"big", "other"} <= set(node_stats["queues"]["failed"]["names"])     # and their dead-letter queues

        await client.purge("big")                   # room again: the queues serve and say so
        await until(lambda: _is_open(client, "big"), 30, "big OPEN again after the purge")
        stats = await client.queue_stats("big")
        assert stats["failed_reason"] is None and stats["failed_since_ms"] is None
        await client.enqueue("big", b"after")
        await until(lambda: _no_failed_metric(node.url), 5, "the failed series gone from /metrics")
        assert 'qserver_queue_failed_transitions_total{to="OPEN"}' in await asyncio.to_thread(_metrics, node.url)


async def _is_open(client: AsyncClient, queue: str) -> bool:
    return (await client.queue_stats(queue))["state"] == "OPEN"


async def _no_failed_metric(url: str) -> bool:
    return "qserver_queue_failed{" not in await asyncio.to_thread(_metrics, url)


@pytest.mark.asyncio
async def test_min_in_sync_2_without_its_replica_is_failed_replica_unavailable_until_it_returns(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    placement = {"strict": ["n1", "n2"], "loose": ["n1", "n2"]}
    cluster = await asyncio.to_thread(qcluster_factory, 3, placement)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.finalize_cluster()              # the map records FAILED from feature level 3 on
        await client.create_queue("strict", min_in_sync=2)
        await client.create_queue("loose")
        await client.enqueue("strict", b"one")
        assert (await client.queue_stats("strict"))["state"] == "OPEN"
        after = (await client.events(limit=1000))["next_after"]

        await asyncio.to_thread(cluster.kill, "n2")
        stats = await until(lambda: _failed(client, "strict"), 30, "strict FAILED")
        assert stats["failed_reason"] == "replica_unavailable" and "n2" in stats["failed_detail"], stats
        # min_in_sync 1 goes on alone: degraded, not failed.
        loose = await client.queue_stats("loose")
        assert loose["state"] == "OPEN" and loose["failed_reason"] is None
        with pytest.raises(QueueError) as refused:
            await client.enqueue("strict", b"refused")
        assert refused.value.code == "E_NOT_ENOUGH_REPLICAS"
        # Asked at another node, the answer is the master's (the request is passed on to it).
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as elsewhere:
            assert (await elsewhere.queue_stats("strict"))["failed_reason"] == "replica_unavailable"
            # Every node's map says so too (SetQueueHealth, proposed by the master), with the event.
            entry = await until(lambda: _map_failed(elsewhere, "strict"), 15, "strict FAILED in n3's map")
            assert entry["failed_reason"] == "replica_unavailable" and entry["failed_since_ms"] == stats["failed_since_ms"]
            assert "failed_reason" not in (await elsewhere.cluster())["queues"]["loose"]
            listed = {q["name"]: q for q in await elsewhere.list_queues()}     # n3 holds no member: the map's
            assert listed["strict"]["state"] == "FAILED" and listed["loose"].get("failed_reason") is None
            events = (await elsewhere.events(after=after, limit=1000))["events"]
            assert [e["reason"] for e in events if e["kind"] == "queue_failed" and e.get("queue") == "strict"] == \
                ["replica_unavailable"], events
        code, out, err = await asyncio.to_thread(_qctl, cluster.credentials_path, cluster.urls["n1"], "status")
        assert code == 0, err
        assert "FAILED QUEUE" in out and "strict" in out.split("FAILED QUEUE")[1] and "replica_unavailable" in out

        await asyncio.to_thread(cluster.start, "n2")
        await until(lambda: _is_open(client, "strict"), 60, "strict OPEN again once its replica is back in sync")
        await client.enqueue("strict", b"two")
        await until(lambda: _map_open(client, "strict"), 15, "strict no longer FAILED in the map")
    with Client(cluster.urls["n1"], cluster.credentials_path) as sync_client:   # the sync client says the same
        assert sync_client.queue_stats("strict")["state"] == "OPEN"


async def _failed(client: AsyncClient, queue: str) -> dict[str, object] | None:
    stats = await client.queue_stats(queue)
    return stats if stats["state"] == "FAILED" else None


async def _map_failed(client: AsyncClient, queue: str) -> dict[str, object] | None:
    entry = (await client.cluster())["queues"][queue]
    return entry if entry.get("failed_reason") else None


async def _map_open(client: AsyncClient, queue: str) -> bool:
    return "failed_reason" not in (await client.cluster())["queues"][queue]


def _qctl(credentials: object, url: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(credentials), "--url", url, *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()
