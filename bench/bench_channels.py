"""Fan-out of a `latest` channel to 1, 100 and 1,000 subscribers on a local 3-node cluster
(issue 15, item 3; run by hand, not in CI; loopback only; each round bounded in time), and of
a `durable` channel to 1, 8 and 64 durable subscriptions, each acknowledging what it reads.

    .venv/bin/python bench/bench_channels.py [--seconds 5] [--subscribers 1,100,1000] [--durable 1,8,64]
                                             [--mechanisms]

`--mechanisms` (issue 37 item 10) runs, on a cluster at feature level 3, each mechanism a
channel's master can choose beside the single stored path the same data took before: 100-byte
values to 1 and 100 subscribers (best_effort against replicated), 256 KiB values to 16 subscribers
(staged against replicated) and to one (point_to_point against replicated).

Each subscriber is its own client with its own WebSocket to the channel's master (the
subscribers run in this one process, next to the publisher, on the same 2 cores as the
nodes). A publisher keeps 10 publishes of 100 bytes in flight for the round. Recorded per
round: publishes/s (acknowledged: committed on both members), deliveries/s (channel messages
the master's node sent, from its metrics), and how many subscribers ended on the last value.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import AsyncClient, QueueError  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

PUBLISHERS_IN_FLIGHT = 10


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def one_round(cluster: LocalCluster, subscribers: int, seconds: float) -> dict[str, Any]:
    channel = f"fanout{subscribers}"
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        created = await admin.create_channel(channel)
        master_url = cluster.urls[created["master"]]
        readers = [AsyncClient(master_url, cluster.credentials_path) for _ in range(subscribers)]
        try:
            for start in range(0, subscribers, 100):
                await asyncio.gather(*(r.subscribe(channel) for r in readers[start:start + 100]))
            async with AsyncClient(master_url, cluster.credentials_path) as publisher:
                await publisher.advertise(channel)
                delivered_before = metric(master_url, "qserver_channel_deliveries_total")
                published, last = 0, 0
                stop_at = time.perf_counter() + seconds

                async def publish() -> None:
                    nonlocal published, last
                    while time.perf_counter() < stop_at:
                        last = max(last, await publisher.publish(channel, b"p" * 100))
                        published += 1
                started = time.perf_counter()
                await asyncio.gather(*(publish() for _ in range(PUBLISHERS_IN_FLIGHT)))
                elapsed = time.perf_counter() - started
                delivered = metric(master_url, "qserver_channel_deliveries_total") - delivered_before
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and any(r._channel_inbox._seen.get(channel) != last  # type: ignore[union-attr]
                                                          for r in readers):
                    await asyncio.sleep(0.1)
                caught_up = sum(r._channel_inbox._seen.get(channel) == last for r in readers)  # type: ignore[union-attr]
        finally:
            await asyncio.gather(*(r.close() for r in readers), return_exceptions=True)
        await admin.delete_channel(channel)
    return {"workload": f"latest_fanout_{subscribers}", "subscribers": subscribers,
            "publishes_per_s": round(published / elapsed, 1), "deliveries_per_s": round(delivered / elapsed, 1),
            "deliveries_per_publish": round(delivered / max(1, published), 1),
            "subscribers_on_the_last_value": caught_up}


async def durable_round(cluster: LocalCluster, subscriptions: int, seconds: float) -> dict[str, Any]:
    """One publish is one replicated write whatever the number of durable subscriptions; each
    subscription's ack is one more (SubscriberAcked), so acks/s is what grows with them."""
    channel = f"durable{subscriptions}"
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        created = await admin.create_channel(channel, "durable")
        master_url = cluster.urls[created["master"]]
        readers = [AsyncClient(master_url, cluster.credentials_path) for _ in range(subscriptions)]
        acked = 0
        stop = asyncio.Event()

        async def read(reader: AsyncClient) -> None:
            """Take each message and acknowledge it without waiting for the answer before the
            next (up to the node's window of 256 unacknowledged), as a worker pool would."""
            nonlocal acked
            window = asyncio.Semaphore(256)

            async def ack(message: Any) -> None:
                nonlocal acked
                try:
                    await message.ack()
                    acked += 1
                except QueueError:
                    pass                    # sent again later (the round's drain counts it then)
                finally:
                    window.release()
            acking: set[asyncio.Task[None]] = set()
            while not stop.is_set():
                try:
                    message = await asyncio.wait_for(reader.next_channel_message(), 0.5)
                except TimeoutError:
                    continue
                await window.acquire()
                task = asyncio.create_task(ack(message))
                acking.add(task)
                task.add_done_callback(acking.discard)
            await asyncio.gather(*acking, return_exceptions=True)
        try:
            for number, reader in enumerate(readers):
                await reader.subscribe(channel, durable=f"s{number}")
            tasks = [asyncio.create_task(read(reader)) for reader in readers]
            async with AsyncClient(master_url, cluster.credentials_path) as publisher:
                await publisher.advertise(channel)
                published = 0
                stop_at = time.perf_counter() + seconds

                async def publish() -> None:
                    nonlocal published
                    while time.perf_counter() < stop_at:
                        await publisher.publish(channel, b"p" * 100)
                        published += 1
                started = time.perf_counter()
                await asyncio.gather(*(publish() for _ in range(PUBLISHERS_IN_FLIGHT)))
                elapsed = time.perf_counter() - started
                acked_in_round = acked
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and acked < published * subscriptions:
                    await asyncio.sleep(0.1)
                drained = acked >= published * subscriptions
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            await asyncio.gather(*(r.close() for r in readers), return_exceptions=True)
        await admin.delete_channel(channel)
    return {"workload": f"durable_fanout_{subscriptions}", "subscriptions": subscriptions,
            "publishes_per_s": round(published / elapsed, 1), "acks_per_s": round(acked_in_round / elapsed, 1),
            "every_backlog_drained": drained}


# (label, channel attributes, subscribers, payload bytes); the attributes {} is today's single path.
MECHANISM_ROUNDS: list[tuple[str, dict[str, Any], int, int]] = [
    ("small_replicated_1", {}, 1, 100),
    ("small_best_effort_1", {"size_bytes": 100, "per_second": 1000.0, "loss_tolerant": True}, 1, 100),
    ("small_replicated_100", {}, 100, 100),
    ("small_best_effort_100", {"size_bytes": 100, "per_second": 1000.0, "loss_tolerant": True}, 100, 100),
    ("large_replicated_16", {}, 16, 256 * 1024),
    ("large_staged_16", {"size_bytes": 256 * 1024}, 16, 256 * 1024),
    ("large_replicated_1", {}, 1, 256 * 1024),
    ("large_point_to_point_1", {"size_bytes": 256 * 1024}, 1, 256 * 1024),
]


def last_seen(reader: AsyncClient, channel: str) -> int:
    inbox = reader._channel_inbox
    assert inbox is not None
    return max(inbox._seen.get(channel, 0), inbox._volatile_seen.get(channel, 0))


async def mechanism_round(cluster: LocalCluster, label: str, attributes: dict[str, Any], subscribers: int,
                          size: int, seconds: float) -> dict[str, Any]:
    """Publishes/s and each publish's latency (10 in flight), deliveries/s and how many
    subscribers ended on the last value, for one channel characterized with `attributes`."""
    channel = f"m-{label}"
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        created = await admin.create_channel(channel, **attributes)
        master_url = cluster.urls[created["master"]]
        readers = [AsyncClient(master_url, cluster.credentials_path) for _ in range(subscribers)]
        try:
            await asyncio.gather(*(r.subscribe(channel) for r in readers))
            mechanism = (await readers[0].typeof(channel))["mechanism"]
            async with AsyncClient(master_url, cluster.credentials_path) as publisher:
                await publisher.advertise(channel)
                delivered_before = metric(master_url, "qserver_channel_deliveries_total")
                latencies: list[float] = []
                last = 0
                stop_at = time.perf_counter() + seconds
                payload = b"p" * size

                async def publish() -> None:
                    nonlocal last
                    while time.perf_counter() < stop_at:
                        began = time.perf_counter()
                        last = max(last, await publisher.publish(channel, payload))
                        latencies.append(time.perf_counter() - began)
                started = time.perf_counter()
                await asyncio.gather(*(publish() for _ in range(PUBLISHERS_IN_FLIGHT)))
                elapsed = time.perf_counter() - started
                delivered = metric(master_url, "qserver_channel_deliveries_total") - delivered_before
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and any(last_seen(r, channel) != last for r in readers):
                    await asyncio.sleep(0.1)
                caught_up = sum(last_seen(r, channel) == last for r in readers)
        finally:
            await asyncio.gather(*(r.close() for r in readers), return_exceptions=True)
        await admin.delete_channel(channel)
    latencies.sort()
    return {"workload": f"mechanism_{label}", "mechanism": mechanism, "subscribers": subscribers, "payload_bytes": size,
            "publishes_per_s": round(len(latencies) / elapsed, 1),
            "publish_p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
            "publish_p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2),
            "deliveries_per_s": round(delivered / elapsed, 1), "subscribers_on_the_last_value": caught_up}


async def main_async(seconds: float, counts: list[int], durable: list[int], mechanisms: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="qbench-channels-") as root:
        cluster = LocalCluster(Path(root), 3)
        cluster.start_all()
        try:
            for count in counts:
                print(json.dumps(await one_round(cluster, count, seconds)), flush=True)
            for count in durable:
                print(json.dumps(await durable_round(cluster, count, seconds)), flush=True)
            if mechanisms:
                async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
                    await admin.finalize_cluster()
                for label, attributes, subscribers, size in MECHANISM_ROUNDS:
                    print(json.dumps(await mechanism_round(cluster, label, attributes, subscribers, size, seconds)),
                          flush=True)
        finally:
            for node in list(cluster.processes):
                cluster.kill(node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--subscribers", default="1,100,1000", help="latest rounds ('' for none)")
    parser.add_argument("--durable", default="1,8,64", help="durable rounds ('' for none)")
    parser.add_argument("--mechanisms", action="store_true", help="each mechanism against the stored path")
    args = parser.parse_args()
    asyncio.run(main_async(args.seconds, [int(n) for n in args.subscribers.split(",") if n],
                           [int(n) for n in args.durable.split(",") if n], args.mechanisms))


if __name__ == "__main__":
    main()
