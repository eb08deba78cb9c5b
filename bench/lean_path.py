"""The minimum replicated data path, the reference the product is measured against (issue 11).

    .venv/bin/python bench/lean_path.py --runs 3 --seconds 5 [--payload-bytes 1024] [--out FILE]

Client -> master -> replica over aiohttp WebSockets on loopback, msgpack frames, uvloop, each
role its own process with its own LMDB environment (sync=True: every commit is fsync'd) and a
qserver node's GIL switch interval. Each run starts a fresh master and replica in a temporary
directory and stops them afterwards (closing their stdin, which they watch: they also go if
this process dies).

- The master numbers the payloads of each client frame `[request_id, [payload, ...]]`, adds
  them to its open group AND to the replica's outgoing buffer at once, and answers
  `[request_id, first_seq]` only when its own commit covering them is done and the replica's
  cumulative durable_seq has reached the request's last seq: every acknowledged message is
  fsync'd on both before the client hears of it.
- Group commit on both: the event loop fills the open group while a single writer thread
  commits the previous one (one write txn, `putmulti` of the group keyed by 8-byte big-endian
  seq); no fsync runs on the event loop.
- Master -> replica: one frame `[first_seq, [payload, ...]]` per event-loop turn with every
  record accepted since the last frame (not one per client frame, nor per master group: the
  replica starts its fsync as early as the master and frames stay few; per master group did
  52-67k msg/s batched against 81-84k in an A/B). The replica answers `[durable_seq]` after
  each of its commits (or after several, if it was busy: the acks are cumulative).

Workloads (1 KiB payloads, each bounded by --seconds), one JSON line per run, then a summary
line per workload with the median and [min, max] of the runs:
  produce_one_at_a_time   one single-message request at a time: latency p50/p99
  produce_100_in_flight   100 tasks each awaiting a single-message request in a loop
  produce_1000_in_flight  the same with 1000 tasks
  produce_batched         100 messages per request, 10 requests in flight
After each run both LMDB environments are opened again and must hold every message sent.

Deliberately left out compared to the product: message ids and the dedupe window, queues,
ready/lease indexes, consumers and acks, the journal, per-message record encoding and
checksums, authentication, membership, epochs, failover, catch-up and state transfer, limits
and backpressure. Only the data path and its durability are measured.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import lmdb
import msgpack
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import percentile  # noqa: E402

SEQ = struct.Struct(">Q")
MAP_SIZE = 4 << 30
GC_THRESHOLDS = (50_000, 20, 10)   # as a qserver node
GIL_SWITCH_INTERVAL_S = 0.0002   # as a qserver node: the writer thread gets the GIL back promptly after its fsync
T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class GroupCommitter:
    """Records appended on the event loop; one writer thread commits (and fsyncs) a group at a
    time while the next one fills; `committed` is set after each commit (`durable_seq` moved)."""

    def __init__(self, path: Path, committed: asyncio.Event) -> None:
        self.env = lmdb.open(str(path), map_size=MAP_SIZE, sync=True, metasync=True, writemap=False)
        self.committed = committed
        self.writer = ThreadPoolExecutor(max_workers=1)
        self.records: list[bytes] = []
        self.next_seq = 1
        self.durable_seq = 0
        self.ready = asyncio.Event()

    def append(self, payloads: list[bytes]) -> int:
        first = self.next_seq
        self.records.extend(payloads)
        self.next_seq += len(payloads)
        self.ready.set()
        return first

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.ready.wait()
            self.ready.clear()
            records, self.records = self.records, []
            first = self.next_seq - len(records)
            await loop.run_in_executor(self.writer, self.commit, first, records)
            self.durable_seq = first + len(records) - 1
            self.committed.set()

    def commit(self, first: int, records: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti([(SEQ.pack(first + i), record) for i, record in enumerate(records)], append=True)


class Master:
    """Every step is its own loop woken by an event, so none waits on another: the committer
    starts the next group while `answer` is still sending the answers of the last one."""

    def __init__(self, path: Path, replica_ws: aiohttp.ClientWebSocketResponse) -> None:
        self.progress = asyncio.Event()   # a commit here, or an ack from the replica
        self.committer = GroupCommitter(path, self.progress)
        self.replica_ws = replica_ws
        self.replica_durable = 0
        self.outgoing: list[bytes] = []
        self.outgoing_ready = asyncio.Event()
        self.waiting: deque[tuple[int, web.WebSocketResponse, int, int]] = deque()  # last_seq, ws, id, first

    async def handle_client(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=0)
        await ws.prepare(request)
        async for message in ws:
            if message.type is not aiohttp.WSMsgType.BINARY:
                break
            request_id, payloads = msgpack.unpackb(message.data)
            first = self.committer.append(payloads)
            self.outgoing.extend(payloads)
            self.outgoing_ready.set()
            self.waiting.append((first + len(payloads) - 1, ws, request_id, first))
        return ws

    async def forward(self) -> None:
        """One frame to the replica per loop turn, with every record accepted since the last one."""
        while True:
            await self.outgoing_ready.wait()
            self.outgoing_ready.clear()
            payloads, self.outgoing = self.outgoing, []
            await self.replica_ws.send_bytes(msgpack.packb([self.committer.next_seq - len(payloads), payloads]))

    async def read_replica_acks(self) -> None:
        async for message in self.replica_ws:
            self.replica_durable = msgpack.unpackb(message.data)[0]
            self.progress.set()
        raise RuntimeError("the replica link closed")

    async def answer(self) -> None:
        """Answer every request durable on both the master and the replica (seqs are assigned in
        arrival order, so `waiting` is sorted by last seq)."""
        while True:
            await self.progress.wait()
            self.progress.clear()
            durable = min(self.committer.durable_seq, self.replica_durable)
            while self.waiting and self.waiting[0][0] <= durable:
                _, ws, request_id, first = self.waiting.popleft()
                if not ws.closed:
                    await ws.send_bytes(msgpack.packb([request_id, first]))


class Replica:
    def __init__(self, path: Path) -> None:
        self.committed = asyncio.Event()
        self.committer = GroupCommitter(path, self.committed)
        self.master_ws: web.WebSocketResponse | None = None

    async def handle_master(self, request: web.Request) -> web.WebSocketResponse:
        ws = self.master_ws = web.WebSocketResponse(compress=False, max_msg_size=0)
        await ws.prepare(request)
        async for message in ws:
            if message.type is not aiohttp.WSMsgType.BINARY:
                break
            first, payloads = msgpack.unpackb(message.data)
            if first != self.committer.next_seq:
                raise RuntimeError(f"replica expected seq {self.committer.next_seq}, got {first}")
            self.committer.append(payloads)
        return ws

    async def acknowledge(self) -> None:
        """`[durable_seq]` to the master after each commit (or after several, if it was busy)."""
        while True:
            await self.committed.wait()
            self.committed.clear()
            assert self.master_ws is not None
            await self.master_ws.send_bytes(msgpack.packb([self.committer.durable_seq]))


async def serve(route: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                *tasks: Coroutine[Any, Any, None]) -> None:
    """Serve `route` on a free loopback port, print the port (the parent waits for it), and run
    `tasks` until one fails or stdin closes (the parent stopped, or died)."""
    app = web.Application()
    app.router.add_get(route, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    print(sock.getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    running = [asyncio.ensure_future(task) for task in (*tasks, stdin.read())]
    done, pending = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()


async def run_replica(data: Path) -> None:
    replica = Replica(data)
    await serve("/replicate", replica.handle_master, replica.committer.run(), replica.acknowledge())


async def run_master(data: Path, replica_port: int) -> None:
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"http://127.0.0.1:{replica_port}/replicate", max_msg_size=0) as replica_ws:
        master = Master(data, replica_ws)
        await serve("/produce", master.handle_client, master.committer.run(), master.forward(),
                    master.read_replica_acks(), master.answer())


class Client:
    """One WebSocket to the master; a reader task resolves each request's future by its id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0
        self.pending: dict[int, asyncio.Future[int]] = {}

    async def produce(self, payloads: list[bytes]) -> int:
        self.next_id += 1
        future = self.pending[self.next_id] = asyncio.get_running_loop().create_future()
        await self.ws.send_bytes(msgpack.packb([self.next_id, payloads]))
        return await future

    async def read_answers(self) -> None:
        async for message in self.ws:
            request_id, first_seq = msgpack.unpackb(message.data)
            self.pending.pop(request_id).set_result(first_seq)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the master closed the connection"))


async def produce_one_at_a_time(client: Client, payload: bytes, seconds: float) -> dict[str, Any]:
    latencies = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        await client.produce([payload])
        latencies.append((time.perf_counter() - started) * 1000)
    return {"msgs_per_s": len(latencies) / seconds, "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99), "messages": len(latencies)}


async def produce_in_flight(client: Client, payloads: list[bytes], seconds: float, tasks: int) -> dict[str, Any]:
    """`tasks` tasks each sending one request of `payloads` at a time until `seconds` have passed."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await client.produce(payloads)
            done += len(payloads)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return {"msgs_per_s": done / (time.perf_counter() - started), "messages": done}


async def workloads(master_port: int, payload: bytes, seconds: float) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"http://127.0.0.1:{master_port}/produce", max_msg_size=0) as ws:
        client = Client(ws)
        reader = asyncio.ensure_future(client.read_answers())
        runs = [
            ("produce_one_at_a_time", lambda: produce_one_at_a_time(client, payload, seconds)),
            ("produce_100_in_flight", lambda: produce_in_flight(client, [payload], seconds, 100)),
            ("produce_1000_in_flight", lambda: produce_in_flight(client, [payload], seconds, 1000)),
            ("produce_batched", lambda: produce_in_flight(client, [payload] * 100, seconds, 10)),
        ]
        results = [{"workload": name, **await run()} for name, run in runs]
        reader.cancel()
    return results


def start_role(processes: list[subprocess.Popen[str]], role: str, data: Path, *args: str) -> int:
    """Start this script as `role` (its stdin a pipe it watches, its own session so that a Ctrl-C
    is for us) and return the port it serves on."""
    process = subprocess.Popen([sys.executable, __file__, "--role", role, "--data", str(data), *args],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    processes.append(process)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"the {role} exited before serving (code {process.wait()})")
    return int(line)


def stop(process: subprocess.Popen[str]) -> None:
    """Close its stdin (it exits), and kill it if it has not within 5 s."""
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def one_run(payload_bytes: int, seconds: float) -> list[dict[str, Any]]:
    """A fresh replica and master in a temporary directory, the workloads, then a check that both
    environments hold every message acknowledged."""
    processes: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="lean-path-") as workdir:
        data = {role: Path(workdir) / role for role in ("master", "replica")}
        try:
            replica_port = start_role(processes, "replica", data["replica"])
            master_port = start_role(processes, "master", data["master"], "--replica-port", str(replica_port))
            results = run_loop(workloads(master_port, b"x" * payload_bytes, seconds))
        finally:
            for process in reversed(processes):   # the master first
                stop(process)
        acknowledged = sum(result["messages"] for result in results)
        for role, path in data.items():
            with lmdb.open(str(path), readonly=True, lock=False) as env:
                stored = env.stat()["entries"]
            if stored != acknowledged:
                raise RuntimeError(f"the {role} holds {stored} records, {acknowledged} were acknowledged")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    parser.add_argument("--role", choices=["master", "replica"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--replica-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        gc.freeze()                                   # as a qserver node (qserver/node.py, run)
        gc.set_threshold(*GC_THRESHOLDS)
    if args.role == "replica":
        return run_loop(run_replica(args.data))
    if args.role == "master":
        return run_loop(run_master(args.data, args.replica_port))

    def emit(line: dict[str, Any]) -> None:
        text = json.dumps({"system": "lean_path", **line})
        print(text, flush=True)
        if args.out is not None:
            with open(args.out, "a") as out:
                out.write(text + "\n")
    all_runs: dict[str, list[dict[str, Any]]] = {}
    for run in range(args.runs):
        for result in one_run(args.payload_bytes, args.seconds):
            emit({"workload": result["workload"], "run": run + 1, **result})
            all_runs.setdefault(result["workload"], []).append(result)
    for workload, results in all_runs.items():
        summary: dict[str, Any] = {"workload": workload, "summary": True, "runs": len(results)}
        for key in ("msgs_per_s", "p50_ms", "p99_ms"):
            values = [result[key] for result in results if key in result]
            if values:
                summary[key] = round(statistics.median(values), 3)
                summary[key + "_spread"] = [round(min(values), 3), round(max(values), 3)]
        emit(summary)


if __name__ == "__main__":
    main()
