"""The SQS endpoint's cost (issue 36, "Measures"): boto3 against a local 3-node cluster and the same
workloads through our own client library in the same run (1 KiB messages, the same concurrency,
queues of the same strength on the same pair), then SendMessageBatch of 10 with 100 calls in
flight. Run by hand, not in CI; loopback only; every workload bounded in time.

    .venv/bin/python bench/bench_sqs.py [--seconds 5] [--threads 16] [--batch-calls 100]

boto3 is synchronous: its concurrency is threads, each with its own client (botocore clients
are thread-safe, but one per thread keeps their connection pools apart). Our client runs the
same number of calls in flight on one event loop. Both queues are `full` (a queue created
through SQS is; docs/SQS.md) with master n1 and replica n2; the SDK and our client both talk
to n1. One JSON line per workload, then a summary with the boto3/own ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import boto3  # noqa: E402
import botocore.config  # noqa: E402

from bench.bench import percentile, produce_in_flight  # noqa: E402
from client import AsyncClient, Client  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

PLACEMENT = {"sqs-bench": ["n1", "n2"], "own-bench": ["n1", "n2"], "sqs-batch": ["n1", "n2"]}
PAYLOAD = "x" * 1024


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the nodes have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def with_node_cpu(pids: list[int], result: dict[str, Any], before: float) -> dict[str, Any]:
    """The nodes' CPU per message of a workload: what the path costs on the server side,
    whatever the client spends (boto3 in threads is mostly its own bottleneck)."""
    used = cpu_s(pids) - before
    return {**result, "node_cpu_us_per_msg": round(used * 1e6 / max(result["messages"], 1), 1)}


def boto(url: str, key_id: str, secret: str, pool: int = 10) -> Any:
    config = botocore.config.Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=pool)
    session = boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name="us-east-1")
    return session.client("sqs", endpoint_url=f"{url}/sqs", config=config)


def in_threads(threads: int, seconds: float, make: Any, step: Any) -> dict[str, Any]:
    """`step(client)` in `threads` threads for `seconds`; each returns how many messages it did."""
    done, latencies, lock = [0], [], threading.Lock()
    clients = [make() for _ in range(threads)]
    stop_at = time.perf_counter() + seconds

    def work(client: Any) -> None:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            count = step(client)
            with lock:
                done[0] += count
                latencies.append((time.perf_counter() - started) * 1000)
            if count == 0:
                return          # drained
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, clients))
    elapsed = time.perf_counter() - started
    return {"msgs_per_s": round(done[0] / elapsed, 1), "messages": done[0], "calls": len(latencies),
            "p50_ms": round(percentile(latencies, 0.5), 2), "p99_ms": round(percentile(latencies, 0.99), 2)}


def boto_workloads(url: str, key: dict[str, str], seconds: float, threads: int, batch_calls: int,
                   pids: list[int]) -> list[dict[str, Any]]:
    def make() -> Any:
        return boto(url, key["access_key_id"], key["secret_access_key"])
    queue_url = make().create_queue(QueueName="sqs-bench")["QueueUrl"]

    def send(client: Any) -> int:
        client.send_message(QueueUrl=queue_url, MessageBody=PAYLOAD)
        return 1

    def receive(client: Any) -> int:
        messages = client.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
        if messages:
            client.delete_message_batch(QueueUrl=queue_url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
        return len(messages)
    before = cpu_s(pids)
    results = [{"workload": f"boto3 SendMessage, {threads} threads",
                **with_node_cpu(pids, in_threads(threads, seconds, make, send), before)}]
    before = cpu_s(pids)
    results.append({"workload": f"boto3 ReceiveMessage(10)+DeleteMessageBatch, {threads} threads",
                    **with_node_cpu(pids, in_threads(threads, seconds * 3, make, receive), before)})
    batch_url = make().create_queue(QueueName="sqs-batch")["QueueUrl"]
    entries = [{"Id": str(i), "MessageBody": PAYLOAD} for i in range(10)]

    def send_batch(client: Any) -> int:
        answer = client.send_message_batch(QueueUrl=batch_url, Entries=entries)
        return len(answer.get("Successful", []))
    before = cpu_s(pids)
    results.append({"workload": f"boto3 SendMessageBatch(10), {batch_calls} calls in flight",
                    **with_node_cpu(pids, in_threads(batch_calls, seconds, make, send_batch), before)})
    return results


async def own_workloads(url: str, credentials: Path, seconds: float, in_flight: int, pids: list[int]
                        ) -> list[dict[str, Any]]:
    async with AsyncClient(url, credentials) as client:
        await client.create_queue("own-bench", strength="full")
        before = cpu_s(pids)
        produced = with_node_cpu(pids, await produce_in_flight(client, "own-bench", PAYLOAD.encode(), seconds,
                                                               in_flight), before)
        before = cpu_s(pids)
        done, stop_at, started = 0, time.perf_counter() + seconds * 3, time.perf_counter()

        async def consume() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                messages = await client.receive("own-bench", 10)
                if not messages:
                    return
                await asyncio.gather(*(message.ack() for message in messages))
                done += len(messages)
        await asyncio.gather(*(consume() for _ in range(in_flight)))
        elapsed = time.perf_counter() - started
    produced["msgs_per_s"] = round(produced["msgs_per_s"], 1)
    return [{"workload": f"own client enqueue, {in_flight} in flight", **produced},
            {"workload": f"own client receive(10)+ack, {in_flight} in flight",
             **with_node_cpu(pids, {"msgs_per_s": round(done / elapsed, 1), "messages": done}, before)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--batch-calls", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sqs-") as root:
        cluster = LocalCluster(Path(root) / "cluster", 3, PLACEMENT)
        try:
            cluster.start_all()
            url = cluster.urls["n1"]
            with Client(url, cluster.credentials_path) as admin:
                client_id = admin.register_client("bench", [{"pattern": "*", "privileges": [
                    "post", "get", "delete", "admin"]}])["id"]
                key = admin.create_access_key(client_id)
            pids = [process.pid for process in cluster.processes.values()]
            results = boto_workloads(url, key, args.seconds, args.threads, args.batch_calls, pids)
            results += asyncio.run(own_workloads(url, cluster.credentials_path, args.seconds, args.threads, pids))
        finally:
            cluster.kill_all()
    for result in results:
        print(json.dumps(result))
    by_name = {r["workload"].split(",")[0]: r["msgs_per_s"] for r in results}
    cpu = {r["workload"].split(",")[0]: r["node_cpu_us_per_msg"] for r in results}
    print(json.dumps({"summary": {
        "produce boto3/own": round(by_name["boto3 SendMessage"] / by_name["own client enqueue"], 3),
        "consume boto3/own": round(by_name["boto3 ReceiveMessage(10)+DeleteMessageBatch"]
                                   / max(by_name["own client receive(10)+ack"], 1e-9), 3),
        # The nodes' CPU a message costs more through SQS (SigV4, JSON, the delegated call) than ours.
        "node_cpu_us_per_msg_produce boto3-own": round(cpu["boto3 SendMessage"] - cpu["own client enqueue"], 1),
        "node_cpu_us_per_msg_consume boto3-own": round(cpu["boto3 ReceiveMessage(10)+DeleteMessageBatch"]
                                                       - cpu["own client receive(10)+ack"], 1)}}))


if __name__ == "__main__":
    main()
