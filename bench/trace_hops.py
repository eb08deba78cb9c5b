"""Where one request's time goes: hop timestamps of one-at-a-time enqueues through a local
3-node cluster (run by hand; loopback only; bounded by --requests).

    .venv/bin/python bench/trace_hops.py [--requests 2000] [--strength full|producer]

The nodes run with bench/hop_trace/sitecustomize.py on their path, which stamps the wall
clock (shared by every process on this machine) at each hop: the client's frame arriving at
the master, the engine stepping it, the batch sealed, the LMDB commit and its fsync, the
Append leaving and arriving at the replica, the replica's commit, its Ack, the answer leaving.
For every request, each event gets its offset from the moment the client sent it; the output
lists the median offset of each hop over the requests whose hops came in the most common
order (heartbeats and lease renewals interleave with some), then where the time goes between
consecutive hops. Figures include the tracer's own ~1 µs per hop.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

HERE = Path(__file__).resolve().parent


async def one_at_a_time(url: str, credentials: Path, strength: str, requests: int) -> list[tuple[int, int]]:
    payload = b"x" * 1024
    windows = []
    async with AsyncClient(url, credentials) as client:
        await client.create_queue("bench", strength=strength, max_depth=10_000_000)
        for _ in range(200):                     # warm up: connections, caches, the replica in sync
            await client.enqueue("bench", payload)
        await asyncio.sleep(1.0)
        for _ in range(requests):
            sent = time.time_ns()
            await client.enqueue("bench", payload)
            windows.append((sent, time.time_ns()))
    return windows


def read_traces(prefix: Path, pids: dict[int, str]) -> list[tuple[int, str]]:
    events = []
    for path in prefix.parent.glob(prefix.name + ".*"):
        node = pids.get(int(path.suffix[1:]), "?")
        for line in path.read_text().splitlines():
            stamp, event = line.split("\t", 1)
            events.append((int(stamp), f"{node}: {event}"))
    return sorted(events)


def report(windows: list[tuple[int, int]], events: list[tuple[int, str]]) -> None:
    by_signature: dict[tuple[str, ...], list[list[int]]] = collections.defaultdict(list)
    position = 0
    for sent, answered in windows:
        while position < len(events) and events[position][0] < sent:
            position += 1
        inside = []
        scan = position
        while scan < len(events) and events[scan][0] <= answered:
            inside.append(events[scan])
            scan += 1
        signature = tuple(name for _, name in inside) + ("client: answer received",)
        by_signature[signature].append([stamp - sent for stamp, _ in inside] + [answered - sent])
    signature, offsets = max(by_signature.items(), key=lambda item: len(item[1]))
    print(f"{len(windows)} requests; {len(offsets)} with the most common order of hops "
          f"({len(by_signature)} orders seen)\n")
    medians = [statistics.median(column) / 1000 for column in zip(*offsets, strict=True)]
    print(f"{'median µs from send':>20}  {'step µs':>8}  hop")
    previous = 0.0
    for name, at in zip(signature, medians, strict=True):
        print(f"{at:20.0f}  {at - previous:8.0f}  {name}")
        previous = at
    total = [answered - sent for sent, answered in windows]
    print(f"\nend to end over all requests: p50 {statistics.median(total) / 1e6:.2f} ms, "
          f"p99 {sorted(total)[int(len(total) * 0.99)] / 1e6:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--strength", choices=["full", "producer"], default="full")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qtrace-") as tmp:
        root = Path(tmp)
        prefix = root / "hops"
        os.environ["QSERVER_HOP_TRACE"] = str(prefix)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE / "hop_trace"), os.environ.get("PYTHONPATH", "")])
        cluster = LocalCluster(root, 3, placement={"bench": ["n1", "n2"]})
        try:
            cluster.start_all()
            pids = {process.pid: node for node, process in cluster.processes.items()}
            windows = asyncio.run(one_at_a_time(cluster.urls["n1"], cluster.credentials_path, args.strength,
                                                args.requests))
        finally:
            cluster.stop_all()
        report(windows, read_traces(prefix, pids))


if __name__ == "__main__":
    main()
