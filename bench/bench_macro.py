"""A macro queue with the `round_robin` producer policy over 4 members against one plain queue,
on a local 3-node cluster (issue 14, item 5; run by hand, not in CI; loopback only; every
workload bounded in time).

    .venv/bin/python bench/bench_macro.py [--runs 3] [--seconds 5]

Members m1..m4 have their masters on n1, n2, n3, n1 (replicas on the next node); the plain
queue is mastered on n1. Both are `full`. The client talks to n1 and, being map-aware, sends
each member's traffic to its master. Runs alternate macro / plain so both see the same noise.
One JSON line per workload and run, then per workload the median and [min, max] of the runs
and the macro/plain ratio of the medians.

Then what a node-side fan-out would cost (why the policies run in the client library): REST
enqueues one at a time of 1 KiB into m2 (mastered on n2) sent to n2 itself, sent to n1 (which
passes the request on to n2), and sent to n1 on a macro queue whose one member is m2 (n1's
macro service runs the policy and enqueues at n2): p50 and p99 of each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import percentile, produce_in_flight, produce_one_at_a_time  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

MEMBERS = {"m1": ["n1", "n2"], "m2": ["n2", "n3"], "m3": ["n3", "n1"], "m4": ["n1", "n2"]}
PLACEMENT = {**MEMBERS, "plain": ["n1", "n2"]}


async def consume_all(client: AsyncClient, queue: str, count: int, timeout_s: float) -> dict[str, Any]:
    """Receive and ack `count` messages through `consume` (a push subscription on a plain
    queue; receives across the members, by the consumer policy, on a macro queue)."""
    done = 0
    started = time.perf_counter()
    acks: list[Any] = []
    async with client.consume(queue, prefetch=1000) as messages:
        async for message in messages:
            acks.append(asyncio.ensure_future(message.ack()))
            done += 1
            if done >= count or time.perf_counter() - started > timeout_s:
                break
    await asyncio.gather(*acks)
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": done / elapsed, "messages": done}


async def one_round(client: AsyncClient, queue: str, seconds: float) -> list[dict[str, Any]]:
    payload = b"x" * 1024
    results = [{"workload": "produce_100_in_flight", **await produce_in_flight(client, queue, payload, seconds, 100)},
               {"workload": "produce_1000_in_flight",
                **await produce_in_flight(client, queue, payload, seconds, 1000)},
               {"workload": "produce_one_at_a_time",
                **await produce_one_at_a_time(client, queue, payload, seconds)}]
    depth = await total_depth(client, queue)
    results.append({"workload": "consume_with_acks", **await consume_all(client, queue, depth, 120)})
    return results


async def rest_latency(client: AsyncClient, url: str, queue: str, seconds: float) -> dict[str, Any]:
    http = client._router.route_to(url).http
    latencies = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        await http.enqueue_http(queue, b"x" * 1024)
        latencies.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": round(percentile(latencies, 0.5), 3), "p99_ms": round(percentile(latencies, 0.99), 3),
            "messages": len(latencies)}


async def hop_cost(cluster: LocalCluster, client: AsyncClient, seconds: float) -> None:
    await client.create_macro("solo", "round_robin", "prioritized")
    await client.add_macro_member("solo", "m2")
    for _ in range(2):          # twice, interleaved
        for name, url, queue in (("rest_at_the_master", cluster.urls["n2"], "m2"),
                                 ("rest_passed_on_by_another_node", cluster.urls["n1"], "m2"),
                                 ("rest_macro_served_by_another_node", cluster.urls["n1"], "solo")):
            print(json.dumps({"workload": name, **await rest_latency(client, url, queue, seconds)}), flush=True)


async def total_depth(client: AsyncClient, queue: str) -> int:
    names = list(MEMBERS) if queue == "macro" else [queue]
    return sum([(await client.queue_stats(name))["depth"] for name in names])


async def main_async(runs: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="qbench-macro-") as root:
        cluster = LocalCluster(Path(root), 3, PLACEMENT)
        cluster.start_all()
        try:
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
                for name in PLACEMENT:
                    await client.create_queue(name, strength="full", max_depth=10_000_000)
                await client.create_macro("macro", "round_robin", "round_robin")
                for name in MEMBERS:
                    await client.add_macro_member("macro", name)
                await client.ping()
                collected: dict[tuple[str, str], list[dict[str, Any]]] = {}
                for run in range(runs):
                    for queue in ("macro", "plain"):
                        for result in await one_round(client, queue, seconds):
                            result.update({"queue": queue, "run": run})
                            print(json.dumps(result), flush=True)
                            collected.setdefault((result["workload"], queue), []).append(result)
                summarize(collected)
                await hop_cost(cluster, client, seconds)
        finally:
            for node in list(cluster.processes):
                cluster.kill(node)


def summarize(collected: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    for workload in dict.fromkeys(w for w, _ in collected):
        line: dict[str, Any] = {"workload": workload, "summary": True}
        for queue in ("macro", "plain"):
            values = [r["msgs_per_s"] for r in collected[(workload, queue)]]
            line[queue] = {"msgs_per_s": round(statistics.median(values), 1),
                           "spread": [round(min(values), 1), round(max(values), 1)]}
            p50s = [r["p50_ms"] for r in collected[(workload, queue)] if "p50_ms" in r]
            if p50s:
                line[queue]["p50_ms"] = round(statistics.median(p50s), 3)
        line["macro_over_plain"] = round(line["macro"]["msgs_per_s"] / line["plain"]["msgs_per_s"], 3)
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(main_async(args.runs, args.seconds))


if __name__ == "__main__":
    main()
