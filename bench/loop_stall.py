"""The event loop's longest stall while a node exports a journal of a million rows (issue 13:
target <= 20 ms; run by hand, not in CI; loopback only).

    .venv/bin/python bench/loop_stall.py [--messages 1000000] [--runs 3]

A 3-node cluster on loopback; `bench` is mastered by n1 and replicated on n2. The messages go
in as batches (each message one journal row of a run record), then, with a light enqueue load
going on (one call every 10 ms, its latency recorded), n1 is asked to export its journal
(POST /v1/journal/export). Meanwhile /metrics of n1 is read every 0.25 s:
`qserver_loop_lag_max_seconds` (the longest lag of the last 10 s of the node's loop-lag
watcher, qserver/metrics.py LoopLag) and the lag histogram's count over 20 ms. Prints one JSON
line per run and appends it to bench/results-loop-stall-<date>.jsonl.
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
from qserver.devcluster import LocalCluster  # noqa: E402

SCRAPE_INTERVAL_S = 0.25


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("qserver_loop_lag_max_seconds ", 'qserver_loop_lag_seconds_bucket{le="0.02"}',
                            "qserver_loop_lag_seconds_count")):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


async def one_run(messages: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root), 3, placement={"bench": ["n1", "n2"]})
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
                lag_max = 0.0
                done = asyncio.Event()

                async def light_load() -> None:
                    while not done.is_set():
                        started = time.perf_counter()
                        await client.enqueue("bench", b"during")
                        latencies.append(time.perf_counter() - started)
                        await asyncio.sleep(0.01)

                async def watch() -> None:
                    nonlocal lag_max
                    while not done.is_set():
                        lag_max = max(lag_max, (await asyncio.to_thread(scrape, cluster.urls["n1"]))
                                      .get("qserver_loop_lag_max_seconds", 0.0))
                        await asyncio.sleep(SCRAPE_INTERVAL_S)
                tasks = [asyncio.create_task(light_load()), asyncio.create_task(watch())]
                started = time.perf_counter()
                exported = await client.http.export_journal()
                export_s = time.perf_counter() - started
                await asyncio.sleep(SCRAPE_INTERVAL_S * 2)
                done.set()
                await asyncio.gather(*tasks)
                after = await asyncio.to_thread(scrape, cluster.urls["n1"])
                over_20ms = (after["qserver_loop_lag_seconds_count"] - after['qserver_loop_lag_seconds_bucket{le="0.02"}']) \
                    - (before["qserver_loop_lag_seconds_count"] - before['qserver_loop_lag_seconds_bucket{le="0.02"}'])
                latencies.sort()
                return {"messages": messages, "export_s": round(export_s, 2), "exported": exported,
                        "loop_lag_max_ms": round(lag_max * 1000, 1), "lags_over_20ms": int(over_20ms),
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
    lags = [r["loop_lag_max_ms"] for r in results]
    print(f"loop lag max during export: median {statistics.median(lags)} ms [{min(lags)} - {max(lags)}]")


if __name__ == "__main__":
    main()
