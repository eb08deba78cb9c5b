"""How long the membership layer's writes wait behind queue commits on a node's one writer
thread (issue 12 bounds it at 10 ms), under the heaviest queue load this machine gives (run by
hand, not in CI; loopback only; bounded in time).

    .venv/bin/python bench/raft_write_wait.py [--seconds 10]

A 3-node cluster; the queue `load` (n1 master, n2 replica, `full`, fsync on both) takes 1,000
single enqueues in flight, then 10 batches of 100 in flight, each for --seconds, while another
client creates and deletes a queue every 50 ms: each is a map change every node writes to its
Raft log. Prints the load's throughput, then per node how many Raft writes there were and how many
waited longer than 2, 5 and 10 ms for the writer (qserver_membership_persist_wait_seconds), and
the same for the queue commits they wait behind (qserver_commit_seconds). --setting KEY=VALUE
sets a [node] key on every node (e.g. to try a commit bound).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench import produce_batched, produce_in_flight  # noqa: E402
from bench.bench_cluster import raft_write_waits  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402


async def churn_the_map(client: AsyncClient, stop_at: float) -> int:
    changes = 0
    while time.perf_counter() < stop_at:
        await client.create_queue("churn", strength="full")
        await client.delete_queue("churn")
        changes += 2
        await asyncio.sleep(0.05)
    return changes


async def run(cluster: LocalCluster, seconds: float) -> dict[str, float]:
    payload = b"x" * 1024
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as operator:
        await client.create_queue("load", strength="full", max_depth=50_000_000)
        results = {}
        for name, workload in (("produce_1000_in_flight", lambda: produce_in_flight(client, "load", payload, seconds, 1000)),
                               ("produce_batched", lambda: produce_batched(client, "load", payload, seconds))):
            outcome, changes = await asyncio.gather(workload(), churn_the_map(operator, time.perf_counter() + seconds))
            results[name] = round(outcome["msgs_per_s"])
            results[f"{name}_map_changes"] = changes
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--setting", action="append", default=[], help="KEY=VALUE for every node's [node]")
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="qbench-raft-") as root:
        settings = dict(item.split("=", 1) for item in args.setting)
        cluster = LocalCluster(Path(root), 3, {"load": ["n1", "n2"]}, settings or None)
        cluster.start_all()
        try:
            print(json.dumps({"workload": "load", **asyncio.run(run(cluster, args.seconds))}), flush=True)
            print(json.dumps(raft_write_waits(cluster)), flush=True)
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
