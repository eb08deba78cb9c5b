"""Disk left behind by a queue's traffic once its retentions pass (issue 11): run by hand,
loopback only, every wait bounded.

    .venv/bin/python bench/bench_disk.py [--messages 1000000] [--payload-bytes 1024] [--retention-s 60]

A 3-node cluster whose nodes keep dedupe ids, completion statuses and exported journal records
for --retention-s; one `full` queue (master n1, replica n2) takes --messages enqueues, 100 per
call with 10 calls in flight, and a consumer drains them with acks. Then every node exports its
journal, and once the retentions have passed the bench reads each node's LMDB (read-only,
beside the running node) until its used pages stop shrinking: one JSON line per node with the
used bytes (entries and pages per database; pages on LMDB's free list are reused and not
counted) against the target of 64 MB, and the data file's size (a high-water mark).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import drain, fill  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402
from qserver.storage.space import database_usage  # noqa: E402

TARGET_BYTES = 64 << 20
SETTLE_TIMEOUT_S = 600     # after the retentions: pruning goes in bounded steps per housekeeping


def used_bytes(usage: dict[str, dict[str, int]]) -> int:
    return sum(db["pages"] * db["page_bytes"] for db in usage.values())


async def traffic(cluster: LocalCluster, messages: int, payload_bytes: int) -> dict[str, float]:
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("disk", strength="full", max_depth=messages + 1)
        started = time.perf_counter()
        await fill(client, "disk", b"d" * payload_bytes, messages)
        filled = time.perf_counter()
        result = await drain(client, "disk", 3600, expected=messages)
        drained = time.perf_counter()
        if result["messages"] != messages:
            raise RuntimeError(f"drained {result['messages']} of {messages}")
        for node in cluster.ids:
            async with AsyncClient(cluster.urls[node], cluster.credentials_path) as at_node:
                await at_node.http.export_journal()
    return {"fill_s": filled - started, "drain_s": drained - filled}


def settle(cluster: LocalCluster, node: str, earliest_s: float) -> tuple[dict[str, dict[str, int]], float]:
    """Read the node's usage until it stops shrinking (three equal readings 5 s apart) after
    `earliest_s` (monotonic); returns it and the seconds waited past the retention."""
    path = cluster.root / node / "lmdb"
    while time.monotonic() < earliest_s:
        time.sleep(1)
    readings: list[int] = []
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        usage = database_usage(path)
        readings.append(used_bytes(usage))
        if len(readings) >= 3 and readings[-1] == readings[-2] == readings[-3]:
            return usage, time.monotonic() - earliest_s
        if time.monotonic() > deadline:
            return usage, time.monotonic() - earliest_s
        time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--retention-s", type=float, default=60.0)
    args = parser.parse_args()
    retention = args.retention_s
    settings: dict[str, object] = {"dedupe_window_s": retention, "status_retention_s": retention,
                                   "journal_retention_s": retention, "journal_segment_age_s": retention / 2,
                                   "journal_export_check_interval_s": 2.0}
    with tempfile.TemporaryDirectory(prefix="qbench-disk-") as root:
        cluster = LocalCluster(Path(root), 3, {"disk": ["n1", "n2"]}, settings)
        cluster.start_all()
        try:
            timings = asyncio.run(traffic(cluster, args.messages, args.payload_bytes))
            earliest = time.monotonic() + retention + 5
            for node in cluster.ids:
                usage, waited = settle(cluster, node, earliest)
                used = used_bytes(usage)
                print(json.dumps({"workload": "disk_after_retention", "node": node, "messages": args.messages,
                                  "payload_bytes": args.payload_bytes, "retention_s": retention,
                                  "used_mb": round(used / 1e6, 2), "target_mb": round(TARGET_BYTES / 1e6, 2),
                                  "met": used <= TARGET_BYTES, "settled_s_after_retention": round(waited, 1),
                                  "file_mb": round((cluster.root / node / "lmdb" / "data.mdb").stat().st_size / 1e6, 1),
                                  **timings,
                                  "databases": {name: db for name, db in usage.items() if db["entries"] or db["pages"]}}),
                      flush=True)
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
