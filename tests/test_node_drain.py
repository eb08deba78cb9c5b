"""The maintenance drain and the roll of the local demo (issue 34, item 4; docs/OPERATIONS.md,
"Rolling upgrade"): `qctl node drain` hands every master of a node off to its in-sync replica and
answers once it masters none, its replicas stay; while drained no handoff or rebalance makes it
master, and a master a failover gives it goes back once its pair is whole; undrain ends that;
a drain that would leave a queue without an in-sync copy is refused (E_DRAIN_REFUSED, naming
it) and changes nothing. `python -m qserver.dev.roll` rolls a running demo's three nodes.

The refusal decision is pure (replication/drain_check.py) and checked on pairs; the rest on real
processes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError
from client.maintenance import drain_by_handoffs
from client.qctl import build_parser
from client.qctl_cluster import cmd_node_drain
from qserver.dev.devcluster import LocalCluster, code_environment, port_free
from qserver.dev.roll import Demo, roll
from replication.drain_check import PairView, drain_refusals
from tests.test_failover import drain, map_of, wait_for
from tests.test_nodes_undrain import run_qctl
from wire.versions import RELEASE

REPOSITORY = Path(__file__).resolve().parent.parent


def test_a_drain_is_refused_when_a_queue_would_lose_its_only_in_sync_copy() -> None:
    up = {"n1", "n2", "n3"}
    whole = [PairView("a", "n1", "n2", True), PairView("b", "n2", "n1", True)]
    assert drain_refusals("n1", whole, up) == []
    assert drain_refusals("n1", [PairView("a", "n1", "n2", False)], up) == ["a: its replica on n2 is not in sync"]
    assert drain_refusals("n1", whole, {"n1", "n3"}) == ["a: its replica's node n2 is not up",
                                                       "b: n1 holds its only in-sync copy (its master's node n2 "
                                                       "is not up)"]
    assert drain_refusals("n1", whole, up, maintenance={"n2"}) == ["a: its replica's node n2 is drained for "
                                                                  "maintenance"]
    # Its out-of-sync replica is not a copy anyone counts on: stopping it loses nothing.
    assert drain_refusals("n2", [PairView("a", "n1", "n2", False)], up) == []


def pairs_of(cluster_map: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    return {name: (e["master"], e["replica"], e["in_sync"]) for name, e in cluster_map["queues"].items()}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_maintenance_drain_hands_masters_off_keeps_replicas_and_holds_until_undrained(
        qcluster_factory: Any) -> None:
    placement = {"a": ["n1", "n2"], "b": ["n1", "n3"], "c": ["n2", "n1"], "d": ["n3", "n2"]}
    cluster: LocalCluster = qcluster_factory(3, placement)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        acknowledged: dict[str, set[int]] = {}
        for name in placement:
            await client.create_queue(name, strength="full" if name in "ac" else "producer")
            acknowledged[name] = set(await client.enqueue_many(name, [name.encode()] * 50))

        code, text = await asyncio.to_thread(run_qctl, cluster, "--url", cluster.urls["n3"], "--json",
                                             "node", "drain", "n1", "--timeout-s", "20")
        assert code == 0, text
        answer = json.loads(text)
        assert answer["masters"] == 0 and {h["queue"] for h in answer["handoffs"]} == {"a", "b"}, answer
        assert all(isinstance(h["pause_ms"], int) for h in answer["handoffs"]), answer
        assert answer["marked"] == {"n1": True, "n2": True, "n3": True}, answer
        # Its replicas stay (no state transfer elsewhere): the pairs only swapped.
        assert pairs_of(await map_of(cluster, "n1")) == {"a": ("n2", "n1", True), "b": ("n3", "n1", True),
                                                         "c": ("n2", "n1", True), "d": ("n3", "n2", True)}

        with pytest.raises(QueueError) as refused:            # a handoff onto it
            await client.handoff("a")
        assert refused.value.code == "E_HANDOFF_REFUSED" and "n1" in str(refused.value), refused.value
        balance = await client.rebalance()
        assert balance["moves"] == [] and not set(balance["handoffs"]) & {"a", "b", "c"}, balance
        await asyncio.sleep(1.0)
        assert all(e["master"] != "n1" for e in (await map_of(cluster, "n2"))["queues"].values())

        # A failover onto it (its pair's master dies) is handed back once the pair is whole again.
        cluster.kill("n2")

        async def failed_over() -> bool:
            return (await map_of(cluster, "n3"))["queues"]["c"]["master"] == "n1"
        await wait_for(failed_over, 15.0, "c to fail over onto n1")
        cluster.start("n2")

        async def handed_back() -> bool:
            queues = (await map_of(cluster, "n3"))["queues"]
            return all(e["master"] != "n1" and e["in_sync"] for e in queues.values())
        await wait_for(handed_back, 30.0, "n1 to hand back the masters the failover gave it")

    with Client(cluster.urls["n3"], cluster.credentials_path) as sync_client:   # the sync client's undrain
        answer = await asyncio.to_thread(sync_client.undrain_node_from_maintenance, "n1")
    assert answer["state"] == "up" and answer["marked"]["n3"] is False, answer
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        entry = (await client.cluster())["queues"]["b"]
        assert entry["replica"] == "n1", entry
        assert (await client.handoff("b"))["master"] == "n1"     # it takes masters again
        for name in placement:
            assert set(await drain(client, name)) == acknowledged[name], name


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_drain_that_would_leave_a_queue_without_an_in_sync_copy_is_refused_and_changes_nothing(
        qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"a": ["n1", "n2"], "b": ["n3", "n1"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("a", strength="full")
        await client.create_queue("b", strength="full")
        await client.enqueue("a", b"x")
    cluster.kill("n2")                       # a's replica: its master n1 holds the only in-sync copy

    async def down() -> bool:
        cluster_map = await map_of(cluster, "n3")
        return {n["id"]: n["state"] for n in cluster_map["nodes"]}["n2"] == "down"
    await wait_for(down, 15.0, "n2 down in the map")
    code, text = await asyncio.to_thread(run_qctl, cluster, "--url", cluster.urls["n3"], "--json",
                                         "node", "drain", "n1", "--timeout-s", "5")
    # Its replica is recorded out of sync once a write needs it, down in the map at once.
    assert code == 1 and "E_DRAIN_REFUSED" in text, text
    assert "a: its replica's node n2 is not up" in text or "a: its replica on n2 is not in sync" in text, text
    assert "b:" not in text, text            # b's replica n1 is in sync and its master n3 up: not a reason
    cluster_map = await map_of(cluster, "n3")
    assert pairs_of(cluster_map)["a"][0] == "n1" and pairs_of(cluster_map)["b"][0] == "n3"
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        # The client's own drain, for a node of 0.1.0 that has no maintenance route: the same
        # check, then per-queue handoffs (here onto n1, which the refused drain left unmarked).
        with pytest.raises(QueueError) as refused:
            await drain_by_handoffs(client.http, "n1", 5.0)
        assert refused.value.code == "E_DRAIN_REFUSED" and "a: its replica" in str(refused.value)
        answer = await drain_by_handoffs(client.http, "n3", 10.0)
        assert [(h["queue"], h["to"]) for h in answer["handoffs"]] == [("b", "n1")], answer
        assert isinstance(answer["handoffs"][0]["pause_ms"], int) and answer["marked"]["n1"] is None, answer
        assert (await client.cluster())["queues"]["b"]["master"] == "n1"


def free_base_port() -> int:
    """A base port whose HTTP (base+1..3) and membership (base+101..103) ports are free."""
    for _ in range(200):
        base = random.randint(5_000, 9_800)
        if all(port_free(base + offset + i) for offset in (0, 100) for i in (1, 2, 3)):
            return base
    raise RuntimeError("no free base port")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_roll_script_drains_restarts_and_undrains_each_node_of_the_running_demo(tmp_path: Path) -> None:
    data_dir = tmp_path / "local"
    base = free_base_port()
    log = (tmp_path / "demo.log").open("wb")
    demo_process = subprocess.Popen(
        [sys.executable, "-m", "qserver.dev.local", "--no-demo", "--data-dir", str(data_dir), "--base-port",
         str(base), "--credentials", str(tmp_path / "credentials.json")],
        cwd=REPOSITORY, env=code_environment(REPOSITORY), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "cluster running" not in (tmp_path / "demo.log").read_text():
            assert demo_process.poll() is None and time.monotonic() < deadline, (tmp_path / "demo.log").read_text()
            await asyncio.sleep(0.2)
        demo = Demo(data_dir)
        async with demo.client("n1") as client:
            ids = {name: set(await client.enqueue_many(name, [b"m"] * 100)) for name in ("orders", "events")}
        pids = {node: demo.pid(node) for node in demo.urls}
        leader = (await map_of_demo(demo))["leader"]
        said: list[str] = []
        report = await roll(demo, RELEASE, 20.0, said.append)
        assert report.nodes[-1].node == leader, said          # the membership leader last
        assert sorted(r.node for r in report.nodes) == ["n1", "n2", "n3"], said
        assert all(demo.pid(node) not in (None, pids[node]) for node in demo.urls), said   # each a new process
        assert report.longest_pause_ms is not None and report.longest_pause_ms < 2_000, said
        assert said[-1].startswith("rolled 3 nodes onto " + RELEASE), said
        cluster_map = await map_of_demo(demo)
        assert all(e["in_sync"] for e in cluster_map["queues"].values()), cluster_map["queues"]
        async with demo.client("n2") as client:
            for name, wanted in ids.items():
                assert set(await drain(client, name)) == wanted, name
    finally:
        if demo_process.poll() is None:
            demo_process.send_signal(signal.SIGINT)      # Ctrl-C: the demo stops its nodes, leader last
            try:
                demo_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo_process.pid, signal.SIGKILL)
        demo_process.wait(timeout=10)
        log.close()
        if (data_dir / "n1.toml").exists():       # a node the demo did not stop (each runs in its own session)
            left = Demo(data_dir)
            for node in left.urls:
                if (pid := left.pid(node)) is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


async def map_of_demo(demo: Demo) -> dict[str, Any]:
    async with demo.client("n3") as client:
        return await client.cluster()


def test_qctl_node_drain_prints_each_handoff_its_pause_and_the_nodes_not_told() -> None:
    class FakeHttp:
        async def drain_node_for_maintenance(self, node_id: str, timeout_s: float) -> dict[str, Any]:
            assert (node_id, timeout_s) == ("n1", 7.0)
            return {"node": "n1", "masters": 0, "took_ms": 40, "longest_pause_ms": 12,
                    "handoffs": [{"queue": "a", "from": "n1", "to": "n2", "epoch": 3, "pause_ms": 12},
                                 {"queue": "b", "from": "n1", "to": "n3", "epoch": 5, "pause_ms": None}],
                    "marked": {"n1": True, "n2": True, "n3": None}}
    parser = build_parser()
    args = parser.parse_args(["node", "drain", "n1", "--timeout-s", "7"])
    outcome = asyncio.run(cmd_node_drain(FakeHttp(), args))  # type: ignore[arg-type]
    assert outcome.human.splitlines() == [
        "a: master n1 -> n2 (epoch 3), writes paused 12 ms",
        "b: master n1 -> n3 (epoch 5), writes paused ? ms",
        "node n1 masters no queue (took 40 ms, longest write pause 12 ms); its replicas stay. Stop it, upgrade it, "
        "start it, then qctl node undrain n1",
        "not told of the maintenance (an older release, or not reached): n3; a master they hand to it is handed "
        "back once it runs this release"]
    assert parser.parse_args(["node", "drain", "n1", "--move-replicas"]).move_replicas
    assert parser.parse_args(["nodes", "drain", "n1"]).handler.__name__ == "cmd_nodes_drain"   # kept for scripts
