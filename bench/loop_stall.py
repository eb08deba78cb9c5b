"""The event loop's longest stall while a node exports a journal of a million rows (issue 13:
target <= 20 ms; run by hand, not in CI; loopback only).

    .venv/bin/python bench/loop_stall.py [--messages 1000000] [--runs 3]

A 3-node cluster on loopback; `bench` is mastered by n1 and replicated on n2. The messages go
in as batches (each message one journal row of a run record), then, with a light enqueue load
going on (one call every 10 ms, its latency recorded), n1 is asked to export its journal
(POST /v1/journal/export). n1's loop-lag histogram (qserver/metrics.py LoopLag: a timer every
50 ms, how late it ran) is read before and after: the longest lag is at most the smallest
bucket bound holding every lag of the export, and the lags over 20 ms are counted. Prints one
JSON line per run and appends it to bench/results-loop-stall-<date>.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    """The loop-lag histogram's cumulative buckets ("+Inf" included) and the recent maximum."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("qserver_loop_lag_max_seconds ", "qserver_loop_lag_seconds_bucket")):
            key, value = line.rsplit(" ", 1)
            values[key.split('le="')[1].rstrip('"}') if "le=" in key else key] = float(value)
    return values


def longest_lag_bound_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """The smallest bucket bound that holds every lag observed between two scrapes."""
    total = after["+Inf"] - before["+Inf"]
    for bound in sorted((b for b in after if b[0].isdigit()), key=float):
        if after[bound] - before[bound] >= total:
            return float(bound) * 1000
    return float("inf")


async def one_run(messages: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        # No export of its own while it fills: the one asked for covers every row.
        cluster = LocalCluster(Path(root), 3, placement={"bench": ["n1", "n2"]},
                               settings={"journal_export_check_interval_s": 3600})
        cluster.start_all()
        try:
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
                await client.create_queue("bench", strength="full", max_depth=messages * 2)
                batch, pending = [b"m" * 64] * 1000, set()
                for _ in range(messages // len(batch)):
                    pending.add(asyncio.ensure_future(client.enqueue_many("bench", batch)))
                    if len(pending) >= 10:
                        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.gather(*pending)
                term_before = cluster.health("n1")["membership"]["term"]     # type: ignore[index]
                before = await asyncio.to_thread(scrape, cluster.urls["n1"])
                latencies: list[float] = []
                done = asyncio.Event()

                async def light_load() -> None:
                    while not done.is_set():
                        started = time.perf_counter()
                        await client.enqueue("bench", b"during")
                        latencies.append(time.perf_counter() - started)
                        await asyncio.sleep(0.01)

                load = asyncio.create_task(light_load())
                started = time.perf_counter()
                exported = await client.http.export_journal()
                export_s = time.perf_counter() - started
                after = await asyncio.to_thread(scrape, cluster.urls["n1"])
                done.set()
                await load
                over_20ms = (after["+Inf"] - after["0.02"]) - (before["+Inf"] - before["0.02"])
                latencies.sort()
                rows = exported["exported_through"] - exported["first_sequence"] + 1
                return {"messages": messages, "rows_exported": rows, "export_s": round(export_s, 2),
                        "loop_lag_max_ms_at_most": longest_lag_bound_ms(before, after),
                        "lags_over_20ms": int(over_20ms),
                        "enqueue_p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
                        "enqueue_max_ms": round(latencies[-1] * 1000, 2),
                        "term_changed": cluster.health("n1")["membership"]["term"] != term_before}  # type: ignore[index]
        finally:
            cluster.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    out = REPOSITORY / "bench" / f"results-loop-stall-{datetime.date.today().isoformat()}.jsonl"
    results = []
    for _ in range(args.runs):
        result = asyncio.run(one_run(args.messages))
        results.append(result)
        print(json.dumps(result), flush=True)
        with out.open("a") as file:
            file.write(json.dumps({"at": time.time(), **result}) + "\n")
    lags = [r["loop_lag_max_ms_at_most"] for r in results]
    print(f"longest loop lag during the export at most: median {statistics.median(lags)} ms "
          f"[{min(lags)} - {max(lags)}] (bucket bounds of qserver_loop_lag_seconds)")


if __name__ == "__main__":
    main()
