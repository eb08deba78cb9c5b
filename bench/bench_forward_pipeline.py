"""How fast one forward moves a backlog, unpaced (issue 38, item 3).

    .venv/bin/python bench/bench_forward_pipeline.py [--messages 20000] [--bytes 1024] [--runs 3] [--out FILE]

A local 3-node cluster (loopback, temporary data): the source queue `src` on n1 (master) and n2,
the destination `dst` on n2 (master) and n3, both `full` (each message replicated and fsync'd on
two members). `--messages` are enqueued into `src` first (enqueue_many of 500), then the forward
`bench` (src -> dst, the destination without a forward rate: nothing paces it) is created, and
the run times from its creation until `dst` holds every message and `src` none. Reported per run:
msg_per_s from the first message seen at `dst` (polled every 50 ms) to the last (the forward's
start, up to RECONCILE_INTERVAL_S after its creation, left out), msg_per_s_from_create over the
whole span, the cores each node used meanwhile; and the median of msg_per_s.

One JSON line per run on stdout (appended to --out): messages, bytes, seconds, msg_per_s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

BATCH = 500
TIMEOUT_S = 600.0


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """Each node's CPU time so far (user + system, from /proc: what limits the figure)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for node, process in cluster.processes.items():
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds[node] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


async def one_run(cluster: LocalCluster, messages: int, size: int, run: int) -> dict[str, object]:
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        source, destination, name = f"src{run}", f"dst{run}", f"bench{run}"
        await client.create_queue(destination, strength="full")
        await client.create_queue(source, strength="full")
        payload = b"x" * size
        for start in range(0, messages, BATCH):
            await client.enqueue_many(source, [payload] * min(BATCH, messages - start))
        began, cpu_before = time.monotonic(), cpu_seconds(cluster)
        await client.create_forward(name, source, destination)
        first_at: float | None = None
        while True:
            stats = await client.queue_stats(destination)
            if first_at is None and stats["depth"] > 0:
                first_at, first_depth = time.monotonic(), stats["depth"]
            if stats["depth"] >= messages:
                break
            if time.monotonic() - began > TIMEOUT_S:
                raise TimeoutError(f"{stats['depth']} of {messages} forwarded in {TIMEOUT_S} s")
            await asyncio.sleep(0.05)
        ended = time.monotonic()
        seconds = ended - began
        steady = messages - first_depth if first_at is not None and ended > first_at else 0
        rate = round(steady / (ended - first_at)) if steady and first_at is not None else None
        cpu = {node: round((spent - cpu_before[node]) / seconds, 2) for node, spent in cpu_seconds(cluster).items()}
        left = (await client.queue_stats(source))["depth"]
        await client.delete_forward(name)
        for queue in (source, destination):         # each run starts from the same cluster
            await client.delete_queue(queue)
        return {"bench": "forward_pipeline", "run": run, "messages": messages, "bytes": size,
                "seconds": round(seconds, 3), "msg_per_s": rate,
                "msg_per_s_from_create": round(messages / seconds), "source_left": left,
                "node_cores": cpu,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    messages = min(args.messages, 1_000_000)
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as root:
        cluster = LocalCluster(Path(root) / "cluster", 3, {f"{kind}{run}": nodes for run in range(args.runs)
                                                          for kind, nodes in (("src", ["n1", "n2"]), ("dst", ["n2", "n3"]))})
        cluster.start_all()
        try:
            rates: list[int] = []
            for run in range(args.runs):
                line = asyncio.run(one_run(cluster, messages, args.bytes, run))
                if isinstance(line["msg_per_s"], int):
                    rates.append(line["msg_per_s"])
                print(json.dumps(line), flush=True)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(line) + "\n")
            print(f"median {statistics.median(rates):,.0f} msg/s [{min(rates):,} - {max(rates):,}]", file=sys.stderr)
        finally:
            cluster.kill_all()


if __name__ == "__main__":
    main()
