"""A local development node with a demo producer and consumer: the README's main job.

    python -m qserver.local [--data-dir data/local] [--port 7100] [--duration-s 0] [--rate 2000]

It initialises the node on first use (cluster secret, admin credential written to
./.qserver/credentials.json so `qctl` and the client find it without flags), starts a real
`qserver` process, then runs a producer and a consumer through the client library on the
queue `demo` and prints a live status line: produced and consumed per second, queue depth,
end-to-end latency. Ctrl-C (or --duration-s) stops the demo and the node in order. With
--no-demo it just runs the node. The replication and membership releases turn this into
a three-node cluster.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from client import AsyncClient, QueueError
from qserver.devcluster import start_qserver

LOCAL_CREDENTIALS = Path(".qserver") / "credentials.json"
STATUS_INTERVAL_S = 0.5
_STAMP = struct.Struct(">d")


def start_node(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    url = f"http://127.0.0.1:{port}"
    if not (data_dir / "cluster.secret").exists():
        subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(data_dir),
                        "--credentials", str(LOCAL_CREDENTIALS), "--url", url], check=True)
    try:
        process = start_qserver(["--data-dir", str(data_dir), "--port", str(port)], url, data_dir / "qserver.log")
    except RuntimeError as error:
        raise SystemExit(str(error)) from None
    print(f"node n1 up at {url} (data in {data_dir}, log in {data_dir / 'qserver.log'})")
    return process


class Demo:
    def __init__(self, client: AsyncClient, rate_per_s: int) -> None:
        self.client = client
        self.rate_per_s = rate_per_s
        self.produced = 0
        self.consumed = 0
        self.latencies_ms: list[float] = []
        self.errors = 0

    async def produce(self) -> None:
        batch = max(1, self.rate_per_s // 50)
        interval_s = batch / self.rate_per_s
        next_at = time.monotonic()
        while True:
            payloads = [_STAMP.pack(time.time()) + b"demo message" for _ in range(batch)]
            try:
                await self.client.enqueue_many("demo", payloads, priority=4)
                self.produced += batch
            except QueueError:
                self.errors += 1
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def consume(self) -> None:
        # Acks are pipelined (the client coalesces them into frames); awaiting each one in
        # turn would cap the consumer at one round trip per message.
        acks: set[asyncio.Task[None]] = set()
        async with self.client.consume("demo", prefetch=500) as messages:
            async for message in messages:
                self.latencies_ms.append((time.time() - _STAMP.unpack_from(message.payload)[0]) * 1000)
                task = asyncio.ensure_future(message.ack())
                acks.add(task)
                task.add_done_callback(self._acked)
                task.add_done_callback(acks.discard)

    def _acked(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            self.errors += 1
        else:
            self.consumed += 1

    async def report(self, stop_at: float | None) -> None:
        last = (time.monotonic(), 0, 0)
        tty = sys.stdout.isatty()
        while stop_at is None or time.monotonic() < stop_at:
            await asyncio.sleep(STATUS_INTERVAL_S if tty else 2.0)
            now = time.monotonic()
            elapsed = now - last[0]
            stats = await self.client.queue_stats("demo")
            lat = sorted(self.latencies_ms) or [0.0]
            self.latencies_ms.clear()
            line = (f"produced {self.produced:>9,} ({(self.produced - last[1]) / elapsed:>7,.0f}/s)  "
                    f"consumed {self.consumed:>9,} ({(self.consumed - last[2]) / elapsed:>7,.0f}/s)  "
                    f"depth {stats['depth']:>6,}  in flight {stats['in_flight']:>4}  "
                    f"e2e p50 {lat[len(lat) // 2]:5.1f} ms p99 {lat[int(len(lat) * 0.99)]:6.1f} ms")
            print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
            last = (now, self.produced, self.consumed)


async def run_demo(url: str, rate_per_s: int, duration_s: float) -> None:
    async with AsyncClient(url, LOCAL_CREDENTIALS) as client:
        await client.create_queue("demo")
        demo = Demo(client, rate_per_s)
        stop_at = time.monotonic() + duration_s if duration_s > 0 else None
        tasks = [asyncio.create_task(demo.produce()), asyncio.create_task(demo.consume())]
        reporter = asyncio.create_task(demo.report(stop_at))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([reporter, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in (*tasks, reporter, stopper):
            task.cancel()
        await asyncio.gather(*tasks, reporter, stopper, return_exceptions=True)
        print(f"\ndemo done: produced {demo.produced:,}, consumed {demo.consumed:,}, errors {demo.errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qserver.local", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data/local/n1"))
    parser.add_argument("--port", type=int, default=7100)
    parser.add_argument("--rate", type=int, default=2000, help="demo messages per second")
    parser.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--no-demo", action="store_true", help="only run the node")
    args = parser.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    node = start_node(args.data_dir, args.port)
    print(f"credentials for qctl and the client: {LOCAL_CREDENTIALS} (try: .venv/bin/qctl status)")
    try:
        if args.no_demo:
            print("node running; Ctrl-C stops it")
            with contextlib.suppress(KeyboardInterrupt):
                node.wait()
        else:
            asyncio.run(run_demo(f"http://127.0.0.1:{args.port}", args.rate, args.duration_s))
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=30)
        print("node stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
