"""Whether pruning keeps pace under sustained load (run by hand; loopback only; bounded by
--seconds): a 3-node cluster whose nodes remember dedupe ids for --window-s, one `full` queue
(master n1, replica n2) taking windowed `enqueue_many` calls with a consumer acking beside them
for --seconds, and every --sample-s the dedupe ids stored on the master and the replica (read
from their LMDB, read-only, beside the running nodes). Every client enqueue carries a dedupe id,
so what the window alone holds is the enqueue rate times the window; one JSON line per sample,
then a summary line with the last sample's ids against that.

    .venv/bin/python bench/bench_housekeeping.py [--seconds 90] [--window-s 5] [--sample-s 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import produce_and_consume  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402
from qserver.storage.space import database_usage  # noqa: E402


async def run(cluster: LocalCluster, seconds: float, sample_s: float, window_s: float) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client, \
            AsyncClient(cluster.urls["n1"], cluster.credentials_path) as consumer:
        await client.create_queue("kept", strength="full", max_depth=10_000_000)
        started = time.monotonic()

        async def sample() -> None:
            while True:
                await asyncio.sleep(sample_s)
                ids = {node: (await asyncio.to_thread(database_usage, cluster.root / node / "lmdb"))["dedupe"]["entries"]
                       for node in ("n1", "n2")}
                line = {"workload": "dedupe_ids_under_load", "at_s": round(time.monotonic() - started, 1),
                        "depth": (await client.queue_stats("kept"))["depth"], "ids": ids}
                samples.append(line)
                print(json.dumps(line), flush=True)

        sampler = asyncio.ensure_future(sample())
        try:
            result = await produce_and_consume(client, consumer, "kept", b"k" * 1024, seconds)
        finally:
            sampler.cancel()
    last = samples[-1] if samples else {"ids": {}, "depth": 0}
    enqueued_per_s = (result["messages"] + last["depth"]) / seconds    # acked, and still queued at the end
    summary = {"workload": "dedupe_ids_under_load", "summary": True, "seconds": seconds, "window_s": window_s,
               "msgs_per_s": round(result["msgs_per_s"]), "enqueued_per_s": round(enqueued_per_s),
               "window_holds": round(enqueued_per_s * window_s),
               "last_ids": last["ids"], "max_ids": max((max(s["ids"].values()) for s in samples), default=0)}
    print(json.dumps(summary), flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qbench-housekeeping-") as root:
        cluster = LocalCluster(Path(root), 3, {"kept": ["n1", "n2"]}, {"dedupe_window_s": args.window_s})
        cluster.start_all()
        try:
            asyncio.run(run(cluster, args.seconds, args.sample_s, args.window_s))
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
