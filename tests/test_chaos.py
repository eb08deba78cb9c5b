"""Chaos on real processes through Toxiproxy (chaos/README.md).

The smoke scenario (chaos/scenarios/smoke.toml: one partition, one kill, one pause, one
handoff) runs the whole runner as a user would, and must come out valid with a clean audit.
The longer scenarios are run by hand (`python -m chaos.run NAME`, results in bench/RESULTS.md).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.cluster import ChaosCluster
from chaos.scenario import load_scenario
from chaos.toxiproxy_server import ToxiproxyHandle
from chaos.toxiproxy_server import start as start_toxiproxy
from client import AsyncClient, QueueError
from qserver.dev.devcluster import REPOSITORY

SMOKE_TIME_MAX_S = 180


def test_the_smoke_scenario_loses_nothing_and_its_audit_is_clean(tmp_path: Path) -> None:
    # The faulty phase ends with the scenario's last fault (`--time`): the quiet traffic the
    # scenario runs after it (8 s of 42 when this was written) only repeats what the recovery
    # phase after the heal shows. Every fault still runs, as the assertion on `faults` checks.
    faults_end_s = max(step.at_s + step.fault.duration_s for step in load_scenario("smoke").nemesis.steps)
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "chaos.run", "smoke", "--time", f"{faults_end_s:g}",
                          "--out", str(tmp_path / "run"), "--quiet"],
                         capture_output=True, text=True, cwd=REPOSITORY, timeout=SMOKE_TIME_MAX_S + 60)
    elapsed_s = time.monotonic() - started
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-3000:]
    result = json.loads(lines[-1])
    assert run.returncode == 0 and result["valid"], "\n".join(lines[:-1]) + "\n" + run.stderr[-3000:]
    assert result["audit"]["verdict"] == "clean" and result["audit"]["lost"] == 0
    assert set(result["faults"]) == {"partition-master-replica", "kill", "pause", "handoff-storm"}
    assert result["counts"]["enqueue_ok"] > 500 and result["counts"]["lost"] == 0
    assert elapsed_s < SMOKE_TIME_MAX_S, f"the smoke run took {elapsed_s:.0f} s"


# --- a regression found by the chaos runs, on a chaos cluster --------------------------------
@pytest.fixture
def toxiproxy() -> Iterator[ToxiproxyHandle]:
    with start_toxiproxy(backend="subprocess") as handle:
        yield handle


@pytest.fixture
def chaos_cluster(tmp_path: Path, toxiproxy: ToxiproxyHandle) -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(tmp_path / "cluster", 3, toxiproxy, {"events": ["n1", "n2"]})
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.close()


async def entry_at(cluster: ChaosCluster, node: str, queue: str) -> dict[str, Any]:
    async with AsyncClient(cluster.urls[node], cluster.credentials_path) as client:
        return dict((await client.cluster())["queues"].get(queue, {}))


async def wait_for(what: str, timeout_s: float, check: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
@pytest.mark.parametrize("crash", [False, True], ids=["cut-off", "cut-off-then-killed"])
async def test_a_deposed_producer_master_rejoins_without_giving_its_consumers_what_they_acked(
        chaos_cluster: ChaosCluster, crash: bool) -> None:
    cluster = chaos_cluster
    async with AsyncClient(cluster.client_urls["n1"], cluster.credentials_path) as at_n1:
        await at_n1.create_queue("events", strength="producer")
        await at_n1.enqueue_many("events", [b"before"] * 40)
        acked: list[int] = []
        while len(acked) < 20:
            messages = await at_n1.receive("events", max_messages=20 - len(acked), wait_s=1.0)
            await asyncio.gather(*(m.ack() for m in messages))
            acked += [m.id for m in messages]
        stop = asyncio.Event()

        async def produce() -> None:        # in flight when n1 is cut off: its uncommitted suffix
            while not stop.is_set():
                try:
                    await asyncio.wait_for(at_n1.enqueue_many("events", [b"during"] * 5), 2.0)
                except (QueueError, TimeoutError):
                    await asyncio.sleep(0.05)
        producer = asyncio.create_task(produce())
        await asyncio.sleep(0.5)
        for proxy in cluster.links_of("n1"):
            await asyncio.to_thread(cluster.add_toxic, proxy, "timeout", {"timeout": 0}, name="cut")

        async def promoted() -> bool:
            return (await entry_at(cluster, "n2", "events")).get("master") == "n2"
        await wait_for("n2 to be promoted", 15.0, promoted)
        stop.set()
        await producer
        if crash:           # it comes back from its disk: the suffix and its commit point as recorded
            await asyncio.to_thread(cluster.kill, "n1")
        await asyncio.to_thread(cluster.heal_links)
        if crash:
            await asyncio.to_thread(cluster.start, "n1")

        async def rejoined() -> bool:
            entry = await entry_at(cluster, "n1", "events")
            stats = await at_n1.queue_stats("events")
            return entry.get("replica") == "n1" and entry.get("in_sync") is True \
                and stats.get("replication_state") == "following"
        await wait_for("n1 to follow n2 in sync", 20.0, rejoined)
        again: list[int] = []
        while messages := await at_n1.receive("events", max_messages=200, wait_s=0.5):
            again += [m.id for m in messages]
            await asyncio.gather(*(m.ack() for m in messages))
        assert not set(acked) & set(again), f"acked at n1, then delivered there again: {sorted(set(acked) & set(again))}"
        assert set(range(21, 41)) <= set(again)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_snapshot_cut_by_a_broken_link_resumes_from_the_same_view_under_traffic(
        tmp_path: Path, toxiproxy: ToxiproxyHandle) -> None:
    # Small chunks, one in flight: the transfer of ~3 MB takes seconds, so the cut lands in it.
    cluster = ChaosCluster(tmp_path / "cluster", 3, toxiproxy, {"ledger": ["n1", "n2"]},
                           {"snapshot_chunk_bytes_max": 8192, "snapshot_chunks_in_flight_max": 1})
    try:
        cluster.start_all()
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
                AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
            await master.create_queue("ledger", strength="full")
            for _ in range(30):
                await master.enqueue_many("ledger", [b"m" * 1024] * 100)
            sent_before = (await master.queue_stats("ledger"))["snapshots_sent"]
            await asyncio.to_thread(cluster.wipe, "n2")     # a fresh member takes a `full` queue by snapshot
            await asyncio.to_thread(cluster.start, "n2")
            stop = asyncio.Event()

            async def traffic() -> None:                       # enqueue, receive and ack meanwhile
                while not stop.is_set():
                    await master.enqueue_many("ledger", [b"t" * 100] * 10)
                    for message in await master.receive("ledger", max_messages=5):
                        await message.ack()
                    await asyncio.sleep(0.02)
            producer = asyncio.create_task(traffic())

            async def receiving() -> bool:
                try:
                    return bool((await replica.queue_stats("ledger")).get("receiving_snapshot"))
                except QueueError:
                    return False
            await wait_for("n2 to be taking the snapshot", 30.0, receiving)
            peer_links = cluster.links_between("n1", "n2")[:2]
            for proxy in peer_links:                           # the replication link only: Raft stays up
                await asyncio.to_thread(cluster.set_enabled, proxy, False)
            await asyncio.sleep(1.5)
            for proxy in peer_links:
                await asyncio.to_thread(cluster.set_enabled, proxy, True)

            async def converged() -> bool:
                m, r = await master.queue_stats("ledger"), await replica.queue_stats("ledger")
                return m["replication_state"] == "in_sync" and r.get("replication_state") == "following" \
                    and r["last_order"] == m["last_order"] and r["digest"] == m["digest"]
            await wait_for("the replica to be in sync again", 60.0, converged)
            stop.set()
            await producer
            await wait_for("the replica to be in sync at the end", 30.0, converged)
            stats = await master.queue_stats("ledger")
            assert stats["snapshots_sent"] == sent_before + 1, "the transfer went on from its view, no other"
            metrics = (await asyncio.to_thread(
                lambda: urllib.request.urlopen(cluster.urls["n2"] + "/metrics", timeout=5).read())).decode()
            assert 'qserver_snapshots_total{side="resumed"} 1' in metrics, metrics
            r = await replica.queue_stats("ledger")
            assert (r["depth"], r["in_flight"]) == (stats["depth"], stats["in_flight"])
    finally:
        cluster.close()
