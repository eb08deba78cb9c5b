"""Failover time and handoff pause on a local 3-node cluster with default settings (run by
hand, not in CI; loopback only; bounded in count and time).

    .venv/bin/python bench/bench_failover.py [--failovers 20] [--pauses 20] [--blackholes 20]
                                             [--handoffs 30] [--out FILE]

failover   producers (through the client library, at the node that holds neither member)
           write to a `full` queue one message at a time; the queue's master is killed with
           SIGKILL; measured: seconds from the kill to the first acknowledged write *sent
           after* the kill (the new master took it). The killed node is restarted and must be
           back in sync before the next round; rounds alternate which member is master, and
           record whether the killed node was also the membership (Raft) leader, which adds
           an election to the failover.
pause      the same load; the queue's master is paused (SIGSTOP) instead: the calls already sent
           to it get no answer and no broken connection. Measured: from the promotion (the
           first time the map at n3, read every 10 ms, names the replica master) to the first
           acknowledged write (issue 13: within 1 s). The paused node is resumed (SIGCONT) and
           must be back in sync before the next round.
blackhole  the same, on a chaos cluster (every link through a Toxiproxy proxy, chaos/cluster.py):
           every link of the master (replication, membership, and its clients' proxy) is held by
           a `timeout` toxic of 0 (data stops, connections stay open, as a dropped route does)
           instead of pausing it. Measured the same way; the links are healed after each round.
handoff    the same steady load; `POST /v1/queues/{q}/handoff` every round. Measured: the
           write pause as the producers see it (the longest time any write in flight during
           the handoff waited for its acknowledgement) and the master's own pause_ms (from
           when it stopped assigning indices until the swap was in its map).
Prints one JSON line per round and a summary (p50/p99/max) per measure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chaos.cluster import ChaosCluster, client_proxy  # noqa: E402
from chaos.toxiproxy_server import start as start_toxiproxy  # noqa: E402
from client import AsyncClient, QueueError  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

QUEUE = "bench"
PRODUCERS = 4
ROUND_TIMEOUT_S = 30.0


class Load:
    """Producers writing one message at a time; every write's invoke and ack times kept."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.writes: list[tuple[float, float]] = []      # (invoked, acknowledged), monotonic
        self.errors = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sequence = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._produce(w)) for w in range(PRODUCERS)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _produce(self, worker: int) -> None:
        while not self._stop.is_set():
            self._sequence += 1
            dedupe = f"w{worker}-{self._sequence}"
            invoked = time.monotonic()
            while not self._stop.is_set():
                try:
                    await self.client.enqueue(QUEUE, b"x" * 256, dedupe_id=dedupe)
                    self.writes.append((invoked, time.monotonic()))
                    break
                except QueueError:
                    self.errors += 1
                    await asyncio.sleep(0.005)


async def wait_in_sync(client: AsyncClient, timeout_s: float = ROUND_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            entry: dict[str, Any] = (await client.cluster())["queues"][QUEUE]
            if entry["in_sync"]:
                return entry
        except QueueError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("the pair did not come back in sync")


async def first_ack(load: Load, round_number: int, *, invoked_after: float = 0.0, acked_after: float = 0.0) -> float:
    """When the first recent write invoked after `invoked_after` and acknowledged after
    `acked_after` was acknowledged."""
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while time.monotonic() < deadline:
        acked = [a for invoked, a in load.writes[-400:] if invoked > invoked_after and a > acked_after]
        if acked:
            return min(acked)
        await asyncio.sleep(0.005)
    raise RuntimeError(f"round {round_number}: writes did not resume")


async def failovers(cluster: LocalCluster, rounds: int) -> list[dict[str, Any]]:
    results = []
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue(QUEUE, strength="full", max_depth=50_000_000)
        load = Load(client)
        load.start()
        try:
            for round_number in range(1, rounds + 1):
                entry = await wait_in_sync(client)
                await asyncio.sleep(0.5)
                victim = entry["master"]
                leader = (await client.cluster()).get("leader")
                killed_at = time.monotonic()
                await asyncio.to_thread(cluster.kill, victim)
                resumed = await first_ack(load, round_number, invoked_after=killed_at)
                failover_s = resumed - killed_at
                result = {"measure": "failover", "round": round_number, "killed": victim,
                          "killed_was_membership_leader": victim == leader, "seconds": round(failover_s, 3)}
                print(json.dumps(result), flush=True)
                results.append(result)
                await asyncio.to_thread(cluster.start, victim)
        finally:
            await load.stop()
        await client.delete_queue(QUEUE)
    return results


def pause(cluster: LocalCluster, victim: str) -> Callable[[], None]:
    """SIGSTOP the master; the returned call resumes it."""
    cluster.processes[victim].send_signal(signal.SIGSTOP)
    return lambda: cluster.processes[victim].send_signal(signal.SIGCONT)


def black_hole(cluster: LocalCluster, victim: str) -> Callable[[], None]:
    """Hold every byte on every link of the master (blocking: run in a thread); the returned
    call (blocking too) heals them."""
    assert isinstance(cluster, ChaosCluster)
    proxies = [*cluster.links_of(victim), client_proxy(victim)]
    for proxy in proxies:
        cluster.add_toxic(proxy, "timeout", {"timeout": 0}, name="blackhole")

    def heal() -> None:
        for proxy in proxies:
            cluster.remove_toxic(proxy, name="blackhole")
    return heal


async def isolations(cluster: LocalCluster, rounds: int, fault: str) -> list[dict[str, Any]]:
    """`fault`: "pause" or "blackhole" (see the module docstring)."""
    isolate = pause if fault == "pause" else black_hole
    results = []
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as observer:
        await client.create_queue(QUEUE, strength="full", max_depth=50_000_000, master="n1", replica="n2")
        await client.refresh_placement()
        load = Load(client)
        load.start()
        try:
            for round_number in range(1, rounds + 1):
                entry = await wait_in_sync(observer)
                await asyncio.sleep(0.5)
                victim, epoch = entry["master"], entry["epoch"]
                faulted_at = time.monotonic()
                heal = await asyncio.to_thread(isolate, cluster, victim)
                isolated_at = time.monotonic()       # from here the master can acknowledge nothing
                try:
                    promoted_at = None
                    deadline = faulted_at + ROUND_TIMEOUT_S
                    while promoted_at is None and time.monotonic() < deadline:
                        try:
                            now = (await observer.cluster())["queues"][QUEUE]
                            if now["epoch"] > epoch and now["master"] != victim:
                                promoted_at = time.monotonic()
                        except QueueError:
                            pass
                        await asyncio.sleep(0.01)
                    if promoted_at is None:
                        raise RuntimeError(f"round {round_number}: no promotion")
                    acked_at = await first_ack(load, round_number, acked_after=isolated_at + 0.01)
                finally:
                    await asyncio.to_thread(heal)
                result = {"measure": fault, "round": round_number, "master": victim,
                          "promotion_s": round(promoted_at - faulted_at, 3),
                          "first_ack_after_promotion_s": round(acked_at - promoted_at, 3)}
                print(json.dumps(result), flush=True)
                results.append(result)
        finally:
            await load.stop()
        await client.delete_queue(QUEUE)
    return results


async def handoffs(cluster: LocalCluster, rounds: int) -> list[dict[str, Any]]:
    results = []
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue(QUEUE, strength="full", max_depth=50_000_000)
        load = Load(client)
        load.start()
        try:
            for round_number in range(1, rounds + 1):
                await wait_in_sync(client)
                await asyncio.sleep(0.3)
                started = time.monotonic()
                answer = await client.handoff(QUEUE)
                ended = time.monotonic()
                await asyncio.sleep(0.3)       # writes in flight at the end are answered by now
                # The pause a producer saw: writes that were in flight at any time during the handoff.
                during = [acked - invoked for invoked, acked in load.writes if acked >= started and invoked <= ended]
                result = {"measure": "handoff", "round": round_number, "master": answer["master"],
                          "client_pause_ms": round(max(during, default=0.0) * 1000, 1),
                          "master_pause_ms": answer.get("pause_ms"), "call_ms": round((ended - started) * 1000, 1)}
                print(json.dumps(result), flush=True)
                results.append(result)
        finally:
            await load.stop()
        await client.delete_queue(QUEUE)
    return results


def summarise(name: str, values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"measure": name, "summary": True, "count": len(ordered), "p50": round(statistics.median(ordered), 3),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3), "max": round(ordered[-1], 3),
            "min": round(ordered[0], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--failovers", type=int, default=20)
    parser.add_argument("--pauses", type=int, default=20)
    parser.add_argument("--blackholes", type=int, default=20)
    parser.add_argument("--handoffs", type=int, default=30)
    parser.add_argument("--out", type=Path, help="append every JSON line to this file too")
    args = parser.parse_args()
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="qbench-failover-") as root:
        cluster = LocalCluster(Path(root), 3)
        cluster.start_all()
        try:
            if args.handoffs:
                lines += asyncio.run(handoffs(cluster, args.handoffs))
            if args.failovers:
                lines += asyncio.run(failovers(cluster, args.failovers))
            if args.pauses:
                lines += asyncio.run(isolations(cluster, args.pauses, "pause"))
        finally:
            cluster.stop_all()
    if args.blackholes:
        with tempfile.TemporaryDirectory(prefix="qbench-blackhole-") as root, \
                start_toxiproxy(backend="subprocess") as toxiproxy:
            chaos = ChaosCluster(Path(root), 3, toxiproxy)
            try:
                chaos.start_all()
                lines += asyncio.run(isolations(chaos, args.blackholes, "blackhole"))
            finally:
                chaos.close()
    summaries = []
    failover = [r["seconds"] for r in lines if r["measure"] == "failover"]
    if failover:
        summaries.append(summarise("failover_s", failover))
        for was_leader in (False, True):
            subset = [r["seconds"] for r in lines if r["measure"] == "failover"
                      and r["killed_was_membership_leader"] == was_leader]
            if subset:
                summaries.append(summarise(f"failover_s_killed_{'also' if was_leader else 'not'}_membership_leader",
                                           subset))
    for fault in ("pause", "blackhole"):
        for key in ("promotion_s", "first_ack_after_promotion_s"):
            values = [float(r[key]) for r in lines if r["measure"] == fault]
            if values:
                summaries.append(summarise(f"{fault}_{key}", values))
    for key in ("client_pause_ms", "master_pause_ms"):
        values = [float(r[key]) for r in lines if r["measure"] == "handoff" and r.get(key) is not None]
        if values:
            summaries.append(summarise(f"handoff_{key}", values))
    for summary in summaries:
        print(json.dumps(summary), flush=True)
    if args.out:
        with args.out.open("a") as out:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            for line in lines + summaries:
                out.write(json.dumps({"at": stamp, **line}) + "\n")


if __name__ == "__main__":
    main()
