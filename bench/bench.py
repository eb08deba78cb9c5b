"""Throughput and latency of one node through the client library (run by hand, not in CI).

    .venv/bin/python bench/bench.py [--runs 3] [--seconds 5] [--payload-bytes 1024] [--url URL --credentials F]

Without --url it starts a fresh `qserver` on loopback in a temporary directory (fsync'd
group commit as in production) and stops it afterwards. Workloads, each printed as one JSON
line per run, then a summary line per workload with the median and spread of the runs:
  produce_100_in_flight   100 tasks each awaiting enqueue() in a loop
  produce_one_at_a_time   one enqueue() at a time: latency p50/p99
  produce_batched         enqueue_many() of 100 messages, 10 calls in flight
  drain_with_acks         consume() with prefetch, every message acked (acks pipelined)
  produce_and_consume     both at once (10 batches of 100 in flight, one consumer with prefetch
                          1000): msgs/s consumed and end-to-end latency
Every workload is bounded by --seconds (and the queue is drained between workloads).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import start_qserver  # noqa: E402

STAMP = struct.Struct(">d")
PREFETCH = 1000


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else 0.0


async def produce_in_flight(client: AsyncClient, queue: str, payload: bytes, seconds: float, tasks: int) -> dict[str, Any]:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await client.enqueue(queue, payload)
            done += 1
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": done / elapsed, "messages": done}


async def produce_one_at_a_time(client: AsyncClient, queue: str, payload: bytes, seconds: float) -> dict[str, Any]:
    latencies = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        await client.enqueue(queue, payload)
        latencies.append((time.perf_counter() - started) * 1000)
    return {"msgs_per_s": len(latencies) / seconds, "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99), "messages": len(latencies)}


async def produce_batched(client: AsyncClient, queue: str, payload: bytes, seconds: float,
                          batch: int = 100, calls: int = 10) -> dict[str, Any]:
    done = 0
    stop_at = time.perf_counter() + seconds
    payloads = [payload] * batch

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await client.enqueue_many(queue, payloads)
            done += batch
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(calls)))
    return {"msgs_per_s": done / (time.perf_counter() - started), "messages": done}


async def fill(client: AsyncClient, queue: str, payload: bytes, count: int) -> None:
    payloads = [STAMP.pack(time.time()) + payload[STAMP.size:]] * 100
    pending: set[asyncio.Task[Any]] = set()
    for _ in range(count // 100):
        pending.add(asyncio.ensure_future(client.enqueue_many(queue, payloads)))
        if len(pending) >= 10:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*pending)


async def drain(client: AsyncClient, queue: str, seconds: float, prefetch: int = 1000,
                latencies: list[float] | None = None, expected: int | None = None) -> dict[str, Any]:
    """Consume with prefetch and ack every message without waiting for each ack (acks are
    coalesced into batches by the client); stops after `expected` messages or `seconds`."""
    acked = 0
    acks: set[asyncio.Future[None]] = set()
    started = time.perf_counter()

    def on_ack(future: asyncio.Future[None]) -> None:
        nonlocal acked
        acks.discard(future)
        if not future.cancelled() and future.exception() is None:
            acked += 1

    async def take() -> None:
        taken = 0
        async with client.consume(queue, prefetch=prefetch) as messages:
            async for message in messages:
                if latencies is not None:
                    latencies.append((time.time() - STAMP.unpack_from(message.payload)[0]) * 1000)
                future = asyncio.ensure_future(message.ack())
                acks.add(future)
                future.add_done_callback(on_ack)
                taken += 1
                if expected is not None and taken >= expected:
                    break
    try:
        await asyncio.wait_for(take(), seconds)
    except TimeoutError:
        pass
    await asyncio.gather(*acks, return_exceptions=True)
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": acked / elapsed, "messages": acked}


async def produce_and_consume(client: AsyncClient, consumer_client: AsyncClient, queue: str, payload: bytes,
                              seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def producer() -> None:
        while time.perf_counter() < stop_at:
            await client.enqueue_many(queue, [STAMP.pack(time.time()) + payload[STAMP.size:]] * 100)
    consumer = asyncio.ensure_future(drain(consumer_client, queue, seconds + 2, latencies=latencies, prefetch=PREFETCH))
    await asyncio.gather(*(producer() for _ in range(10)))
    result = await consumer
    return {"msgs_per_s": result["msgs_per_s"], "messages": result["messages"],
            "e2e_p50_ms": percentile(latencies, 0.5), "e2e_p99_ms": percentile(latencies, 0.99)}


async def empty(client: AsyncClient, queue: str) -> None:
    stats = await client.queue_stats(queue)
    if stats["depth"]:
        await drain(client, queue, 60, expected=stats["depth"])


async def one_run(url: str, credentials: str, payload_bytes: int, seconds: float) -> list[dict[str, Any]]:
    payload = b"x" * payload_bytes
    results = []
    async with AsyncClient(url, credentials) as client, AsyncClient(url, credentials) as consumer_client:
        queue = f"bench-{time.monotonic_ns()}"
        await client.create_queue(queue, max_depth=50_000_000)
        await client.ping()
        runs = [
            ("produce_100_in_flight", lambda: produce_in_flight(client, queue, payload, seconds, 100)),
            ("produce_one_at_a_time", lambda: produce_one_at_a_time(client, queue, payload, seconds)),
            ("produce_batched", lambda: produce_batched(client, queue, payload, seconds)),
        ]
        for name, run in runs:
            results.append({"workload": name, **await run()})
        await empty(client, queue)
        await fill(client, queue, payload, 200_000)
        results.append({"workload": "drain_with_acks", **await drain(client, queue, seconds * 4, expected=200_000)})
        await empty(client, queue)
        results.append({"workload": "produce_and_consume",
                        **await produce_and_consume(client, consumer_client, queue, payload, seconds)})
        await client.delete_queue(queue)
    return results


def print_summaries(all_runs: dict[str, list[dict[str, Any]]]) -> None:
    """One JSON line per workload: the median of the runs and their [min, max] spread."""
    for workload, results in all_runs.items():
        summary: dict[str, Any] = {"workload": workload, "summary": True, "runs": len(results)}
        for key in ("msgs_per_s", "p50_ms", "p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
            values = [r[key] for r in results if key in r]
            if values:
                summary[key] = round(statistics.median(values), 3)
                summary[key + "_spread"] = [round(min(values), 3), round(max(values), 3)]
        print(json.dumps(summary), flush=True)


def start_node(port: int, journal: bool) -> tuple[subprocess.Popen[bytes], str, tempfile.TemporaryDirectory[str]]:
    workdir = tempfile.TemporaryDirectory(prefix="qbench-")
    data = Path(workdir.name) / "n1"
    credentials = str(Path(workdir.name) / "credentials.json")
    url = f"http://127.0.0.1:{port}"
    subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(data), "--credentials", credentials,
                    "--url", url], check=True, capture_output=True)
    args = ["--data-dir", str(data), "--port", str(port), "--log-level", "WARNING"]
    if not journal:
        args.append("--no-journal")
    return start_qserver(args, url, Path(workdir.name) / "qserver.log"), credentials, workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--url")
    parser.add_argument("--credentials")
    parser.add_argument("--port", type=int, default=7391)
    parser.add_argument("--no-journal", action="store_true", help="node without the journal (to measure its cost)")
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    process = workdir = None
    url, credentials = args.url, args.credentials
    if url is None:
        process, credentials, workdir = start_node(args.port, not args.no_journal)
        url = f"http://127.0.0.1:{args.port}"
    all_runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for run in range(args.runs):
            for result in asyncio.run(one_run(url, credentials, args.payload_bytes, args.seconds)):
                result["run"] = run + 1
                print(json.dumps(result), flush=True)
                all_runs.setdefault(result["workload"], []).append(result)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    print_summaries(all_runs)


if __name__ == "__main__":
    main()
