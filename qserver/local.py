"""A local three-node cluster with demo producers and consumers: the README's main job.

    python -m qserver.local [--data-dir data/local] [--base-port 7100] [--duration-s 0]
                            [--rate 1000] [--handoff-every-s 15] [--no-demo]

It initialises three nodes under one directory on first use (n1 makes the cluster secret
and the admin credential, written to ./.qserver/credentials.json where `qctl` and the client
find it without flags; n2 and n3 join it), starts three real `qserver` processes on
loopback (HTTP on base-port+1..3, the membership layer on base-port+101..103), and waits
until they have elected a membership leader. Then, through the client library, a producer
and a consumer run on `orders` (strength `full`: every operation on both members) and on
`events` (strength `producer`), `orders` is handed off between its members every
--handoff-every-s seconds, and a live view shows the nodes, the membership leader, each
queue's master, replica, epoch, in-sync flag, lag and depth, the rates and end-to-end
latency, and the last handoff's write pause. Ctrl-C (or --duration-s) stops the demo, then
each node in turn (SIGTERM: a node hands off its masters before it stops).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

from client import AsyncClient, QueueError
from qserver.devcluster import LocalCluster

LOCAL_CREDENTIALS = Path(".qserver") / "credentials.json"
STATUS_INTERVAL_S = 1.0
QUEUES = {"orders": "full", "events": "producer"}
_STAMP = struct.Struct(">d")


class Demo:
    def __init__(self, client: AsyncClient, rate_per_s: int) -> None:
        self.client = client
        self.rate_per_s = rate_per_s
        self.produced = dict.fromkeys(QUEUES, 0)
        self.consumed = dict.fromkeys(QUEUES, 0)
        self.latencies_ms: list[float] = []
        self.errors: dict[str, int] = {}
        self.events: list[str] = []

    def _error(self, error: BaseException) -> None:
        code = error.code if isinstance(error, QueueError) else type(error).__name__
        self.errors[code] = self.errors.get(code, 0) + 1

    async def produce(self, queue: str) -> None:
        batch = max(1, self.rate_per_s // 50)
        interval_s = batch / self.rate_per_s
        next_at = time.monotonic()
        while True:
            payloads = [_STAMP.pack(time.time()) + b"demo message" for _ in range(batch)]
            try:
                await self.client.enqueue_many(queue, payloads, priority=4)
                self.produced[queue] += batch
            except QueueError as error:
                self._error(error)
                await asyncio.sleep(0.1)
            next_at = max(next_at + interval_s, time.monotonic() - 1.0)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def consume(self, queue: str) -> None:
        # Acks are pipelined (the client coalesces them into frames).
        acks: set[asyncio.Task[None]] = set()
        while True:
            try:
                async with self.client.consume(queue, prefetch=500) as messages:
                    async for message in messages:
                        self.latencies_ms.append((time.time() - _STAMP.unpack_from(message.payload)[0]) * 1000)
                        task = asyncio.ensure_future(message.ack())
                        acks.add(task)
                        task.add_done_callback(functools.partial(self._acked, queue))
                        task.add_done_callback(acks.discard)
            except QueueError as error:      # the subscription ends at a change of master
                self._error(error)
                await asyncio.sleep(0.2)
                with contextlib.suppress(QueueError):
                    await self.client.refresh_placement()

    def _acked(self, queue: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error(task.exception())  # type: ignore[arg-type]
        else:
            self.consumed[queue] += 1

    async def hand_off(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            started = time.monotonic()
            try:
                answer = await self.client.handoff("orders")
                self.events.append(f"{time.strftime('%H:%M:%S')} handoff of orders: master now {answer['master']} "
                                   f"(epoch {answer['epoch']}), writes paused {answer.get('pause_ms', '?')} ms, "
                                   f"call took {(time.monotonic() - started) * 1000:.0f} ms")
            except QueueError as error:
                self.events.append(f"{time.strftime('%H:%M:%S')} handoff of orders refused: {error}")

    async def report(self, cluster: LocalCluster, stop_at: float | None) -> None:
        last = (time.monotonic(), sum(self.produced.values()), sum(self.consumed.values()))
        tty = sys.stdout.isatty()
        while stop_at is None or time.monotonic() < stop_at:
            await asyncio.sleep(STATUS_INTERVAL_S)
            self.events += [f"{time.strftime('%H:%M:%S')} {event}" for event in cluster.restart_exited()]
            now = time.monotonic()
            produced, consumed = sum(self.produced.values()), sum(self.consumed.values())
            try:
                view = await self.client.cluster()
                depths = {q: (await self.client.queue_stats(q))["depth"] for q in QUEUES}
            except QueueError as error:
                self._error(error)
                continue
            lat = sorted(self.latencies_ms) or [0.0]
            self.latencies_ms.clear()
            lines = [f"qcluster demo: 3 nodes on loopback, data in {cluster.root}  (Ctrl-C stops)", ""]
            nodes = "  ".join(f"{n['id']} {n['state']}{' (membership leader)' if n['id'] == view.get('leader') else ''}"
                              for n in view.get("nodes", []))
            lines.append(f"nodes   {nodes}")
            lines.append(f"{'queue':<8} {'master':<7} {'replica':<8} {'epoch':>5} {'in sync':<8} {'depth':>8}  produced  consumed")
            for queue, entry in sorted(view.get("queues", {}).items()):
                lines.append(f"{queue:<8} {entry['master']:<7} {entry['replica']:<8} {entry['epoch']:>5} "
                             f"{'yes' if entry['in_sync'] else 'NO':<8} {depths.get(queue, 0):>8,}  "
                             f"{self.produced.get(queue, 0):>8,}  {self.consumed.get(queue, 0):>8,}")
            elapsed = now - last[0]
            lines.append("")
            lines.append(f"rates   produced {(produced - last[1]) / elapsed:>7,.0f}/s  consumed "
                         f"{(consumed - last[2]) / elapsed:>7,.0f}/s   end-to-end p50 {lat[len(lat) // 2]:.1f} ms  "
                         f"p99 {lat[int(len(lat) * 0.99)]:.1f} ms")
            lines.append(f"errors  {self.errors or 'none'}   (retriable ones are retried)")
            lines += ["", "recent events:"] + [f"  {event}" for event in self.events[-5:]]
            if tty:
                print("\x1b[H\x1b[2J" + "\n".join(lines), flush=True)
            else:
                print(f"{time.strftime('%H:%M:%S')} produced {produced:,} consumed {consumed:,} "
                      f"masters {[(q, e['master'], e['epoch']) for q, e in sorted(view.get('queues', {}).items())]} "
                      f"events {len(self.events)}", flush=True)
            last = (now, produced, consumed)


async def run_demo(cluster: LocalCluster, rate_per_s: int, duration_s: float, handoff_every_s: float) -> None:
    async with AsyncClient(cluster.urls["n1"], LOCAL_CREDENTIALS) as client:
        for queue, strength in QUEUES.items():
            await client.create_queue(queue, strength=strength)
        await client.refresh_placement()
        demo = Demo(client, rate_per_s)
        stop_at = time.monotonic() + duration_s if duration_s > 0 else None
        tasks = [asyncio.create_task(coroutine) for queue in QUEUES
                 for coroutine in (demo.produce(queue), demo.consume(queue))]
        if handoff_every_s > 0:
            tasks.append(asyncio.create_task(demo.hand_off(handoff_every_s)))
        reporter = asyncio.create_task(demo.report(cluster, stop_at))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([reporter, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in (*tasks, reporter, stopper):
            task.cancel()
        await asyncio.gather(*tasks, reporter, stopper, return_exceptions=True)
        summary: dict[str, Any] = {"produced": demo.produced, "consumed": demo.consumed, "errors": demo.errors}
        print(f"\ndemo done: {summary}")
        for event in demo.events:
            print(f"  {event}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qserver.local", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data/local"))
    parser.add_argument("--base-port", type=int, default=7100)
    parser.add_argument("--rate", type=int, default=1000, help="demo messages per second per queue")
    parser.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--handoff-every-s", type=float, default=15.0, help="hand off `orders` this often (0: never)")
    parser.add_argument("--no-demo", action="store_true", help="only run the three nodes")
    args = parser.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    LOCAL_CREDENTIALS.parent.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(args.data_dir.resolve(), 3, base_port=args.base_port,
                           credentials_path=LOCAL_CREDENTIALS.resolve())
    cluster.log_level = "INFO"
    try:
        cluster.start_all()
    except RuntimeError as error:
        cluster.stop_all()
        raise SystemExit(str(error)) from None
    for node in cluster.ids:
        print(f"node {node} up at {cluster.urls[node]} (log: {cluster.root / (node + '.log')})")
    print(f"credentials for qctl and the client: {LOCAL_CREDENTIALS} (try: .venv/bin/qctl status)")
    try:
        if args.no_demo:
            print("cluster running; Ctrl-C stops it")
            with contextlib.suppress(KeyboardInterrupt):
                while len(cluster.left_down) < len(cluster.ids):
                    for event in cluster.restart_exited():    # a node that failed stop is started again
                        print(f"{time.strftime('%H:%M:%S')} {event}", flush=True)
                    time.sleep(0.5)
        else:
            asyncio.run(run_demo(cluster, args.rate, args.duration_s, args.handoff_every_s))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # a second Ctrl-C must not cut the stop short
        print("stopping the nodes (each hands off its masters first) ...")
        cluster.stop_all()
        print("cluster stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
