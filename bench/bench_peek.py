"""The event loop's stall while a node answers peeks of 1,000 messages of 1 KiB on a deep queue
(issue 35, item 1: target <= 5 ms; run by hand, not in CI; loopback only).

    .venv/bin/python bench/bench_peek.py [--messages 100000] [--fill-s 60] [--peeks 20] [--runs 3]

A 3-node cluster on loopback; `bench` (`full`) is mastered by n1 and replicated on n2. It is
filled with 1 KiB messages (up to --messages, or what --fill-s allows), then peeked --peeks
times, a page of 1,000 at a time from cursors spread over the queue (the start, the middle and
deep), over the WebSocket of the client library. Meanwhile another process pings n1 over its
own WebSocket every millisecond: a ping is answered by the node's loop without the engine
(qserver/api/ws_api.py), so its round trip grows by however long the loop was held. The stall
is the longest ping during the peeks minus the longest ping over as long a time without them.
n1's loop-lag histogram (qserver_loop_lag_seconds, a timer every 50 ms) is read too. Prints one
JSON line per run and appends it to bench/results-peek-<date>.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
from bench.loop_stall import longest_lag_bound_ms, scrape  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.core.peek import SCAN_BUDGET_S as BUDGET_S  # noqa: E402  (restored after each in-process measure)
from qserver.dev.devcluster import LocalCluster  # noqa: E402

PAGE = 1000
PAYLOAD = b"x" * 1024


def pinger(url: str, credentials: str, seconds: float, out: Any) -> None:
    """In a process of its own (the peeking client's decoding does not delay it): ping every
    millisecond for `seconds`, sending back each round trip in ms."""
    async def run() -> list[float]:
        async with AsyncClient(url, credentials) as client:
            await client.ping()
            trips: list[float] = []
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                started = time.perf_counter()
                await client.ping()
                trips.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.001)
            return trips
    out.send(asyncio.run(run()))


def pings_during(url: str, credentials: str, seconds: float) -> tuple[multiprocessing.Process, Any]:
    receiver, sender = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.Process(target=pinger, args=(url, credentials, seconds, sender))
    process.start()
    return process, receiver


async def fill(client: AsyncClient, messages: int, fill_s: float) -> int:
    await client.create_queue("bench", strength="full", max_depth=messages * 2)
    batch, pending, sent = [PAYLOAD] * 500, set(), 0
    end = time.perf_counter() + fill_s
    while sent < messages and time.perf_counter() < end:
        pending.add(asyncio.ensure_future(client.enqueue_many("bench", batch)))
        sent += len(batch)
        if len(pending) >= 8:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*pending)
    return sent


async def one_run(messages: int, fill_s: float, peeks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root), 3, placement={"bench": ["n1", "n2"]})
        cluster.start_all()
        url, credentials = cluster.urls["n1"], str(cluster.credentials_path)
        try:
            async with AsyncClient(url, credentials) as client:
                held = await fill(client, messages, fill_s)
                ids = [m["id"] for m in (await client.peek("bench", limit=1))["messages"]]
                first = ids[0]
                # Cursors spread over the queue: id * 10 + (9 - priority), all at priority 4.
                cursors = [((first + held * k // peeks) * 10 + 5) if k else 0 for k in range(peeks)]
                await asyncio.sleep(1.0)
                # The same time without peeks, then with them: the longest pings compared.
                window_s = max(2.0, peeks * 0.15)
                quiet_before = await asyncio.to_thread(scrape, url)
                process, receiver = pings_during(url, credentials, window_s)
                quiet = await asyncio.to_thread(receiver.recv)
                process.join()
                before = await asyncio.to_thread(scrape, url)
                process, receiver = pings_during(url, credentials, window_s)
                await asyncio.sleep(0.5)
                latencies, sizes = [], []
                for cursor in cursors:
                    started = time.perf_counter()
                    page = await client.peek("bench", after=cursor, limit=PAGE)
                    latencies.append((time.perf_counter() - started) * 1000)
                    sizes.append(len(page["messages"]))
                    await asyncio.sleep(0.05)
                busy = await asyncio.to_thread(receiver.recv)
                process.join()
                after = await asyncio.to_thread(scrape, url)
                stats = await client.http.queue_stats("bench")
            cluster.stop_all()
            scan = scan_times(Path(root) / "n1" / "lmdb", cursors)
            latencies.sort()
            return {**scan, "scan_budget_ms": BUDGET_S * 1000, "messages": held, "depth": stats["depth"], "peeks": peeks, "page": PAGE,
                    "messages_per_page_median": statistics.median(sizes), "messages_per_page_min": min(sizes),
                    "peek_p50_ms": round(latencies[len(latencies) // 2], 2), "peek_max_ms": round(latencies[-1], 2),
                    "ping_max_quiet_ms": round(max(quiet), 2), "ping_max_peeking_ms": round(max(busy), 2),
                    "ping_p50_quiet_ms": round(statistics.median(quiet), 2),
                    "ping_p99_peeking_ms": round(sorted(busy)[int(len(busy) * 0.99)], 2),
                    "ping_p99_quiet_ms": round(sorted(quiet)[int(len(quiet) * 0.99)], 2),
                    "loop_lag_max_quiet_ms_at_most": longest_lag_bound_ms(quiet_before, before),
                    "stall_ms": round(max(busy) - max(quiet), 2),
                    "loop_lag_max_ms_at_most": longest_lag_bound_ms(before, after)}
        finally:
            cluster.stop_all()


def scan_times(path: Path, cursors: list[int]) -> dict[str, Any]:
    """The loop time of one peek call itself, on n1's stored queue in this process: what the
    engine's task spends on the scan and on packing its answer into a frame (the stall the
    pings see, without their noise), with the scan's time budget and without it."""
    from qserver.core import peek
    from qserver.storage.lmdb_store import Storage
    from replication.queue_core import QueueCore
    from wire.protocol import OkReply, encode_frame

    storage = Storage(path, node_id="n1")
    try:
        record = next(r for r in storage.load_queue_records() if r.name == "bench")
        core = QueueCore(record, storage, random.Random(1), lease_clock=lambda: 0,
                         leases=storage.load_leases(record.queue_id))
        figures: dict[str, Any] = {}
        for label, budget in (("warming", BUDGET_S), ("budgeted", BUDGET_S), ("unbounded", 60.0)):
            peek.SCAN_BUDGET_S = budget
            times, cpu, counts = [], [], []
            for cursor in cursors:
                started, started_cpu = time.perf_counter(), time.process_time()
                page = peek.peek(storage, core, cursor, PAGE, False)
                encode_frame([OkReply(1, page)])
                times.append((time.perf_counter() - started) * 1000)
                cpu.append((time.process_time() - started_cpu) * 1000)
                counts.append(len(page["messages"]))
            if label == "warming":
                continue       # the first reads of a freshly opened environment come from the disk
            figures[f"call_ms_{label}_median"] = round(statistics.median(times), 2)
            figures[f"call_ms_{label}_max"] = round(max(times), 2)
            figures[f"call_cpu_ms_{label}_median"] = round(statistics.median(cpu), 2)
            figures[f"messages_{label}_median"] = statistics.median(counts)
        return figures
    finally:
        peek.SCAN_BUDGET_S = BUDGET_S
        storage.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--fill-s", type=float, default=60.0)
    parser.add_argument("--peeks", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    out = REPOSITORY / "bench" / f"results-peek-{datetime.date.today().isoformat()}.jsonl"
    results = []
    for _ in range(args.runs):
        result = asyncio.run(one_run(args.messages, args.fill_s, args.peeks))
        results.append(result)
        print(json.dumps(result), flush=True)
        with out.open("a") as file:
            file.write(json.dumps({"at": time.time(), **result}) + "\n")
    for key in ("call_cpu_ms_budgeted_median", "call_ms_budgeted_median", "stall_ms", "peek_p50_ms",
                "ping_max_peeking_ms", "ping_max_quiet_ms", "ping_p99_peeking_ms", "ping_p99_quiet_ms",
                "loop_lag_max_ms_at_most", "loop_lag_max_quiet_ms_at_most"):
        values = [r[key] for r in results]
        print(f"{key}: median {statistics.median(values)} [{min(values)} - {max(values)}]")


if __name__ == "__main__":
    main()
