"""Scale (issue 31, item 4): many queues, failover, a restart with a big state, many connections.

On a local cluster of real `qserver` processes on loopback (run by hand, not in CI; every wait
bounded; every node process it starts is stopped at exit, also on an error or Ctrl-C; the
cluster lives in a temporary directory, removed at the end unless --keep).

    .venv/bin/python bench/bench_scale.py [--part queues|failover|restart|connections|all]
        [--nodes 5] [--queues 10000] [--failover-queues 2000] [--restart-messages 1000000]
        [--clients 5000] [--duration 60] [--quick] [--out FILE] [--keep] [--profile DIR]

`--quick`: small sizes for a smoke run (3 nodes, 200 queues, 60 failover queues, 50,000
messages, 200 clients for 10 s; output under the system's temp directory unless --out). An
option given explicitly wins over both size sets. One JSON line per measurement, printed and
appended to --out (default bench/results-scale-<date>.jsonl), each with the sizes, the git
commit, the date, the target it is judged against and `met` (null: no target, information).
`--profile DIR`: py-spy records (collapsed stacks, DIR/*.txt) the node the sequential enqueues
address while they run, every surviving node for --profile-s seconds from the failover's kill,
and the connections node for --profile-s seconds from the start of the load.

queues       every queue `full`, with its dead-letter queue (the default), created through
             signed REST (`PUT /v1/queues/{q}`, --create-concurrency in flight, at n1): total
             time and rate, one create's p50/p99 at the start and at the end; the nodes' RSS
             afterwards (/proc/PID/status: VmRSS of the node's process, its anonymous and
             file-backed parts (LMDB's map) and its children's); one enqueue's p50/p99 to a
             queue mastered on the node addressed, one at a time, over signed REST and over the
             client library's WebSocket, with 10 queues in the cluster and again with all N
             idle; `qctl --json status` wall time (the real CLI, a subprocess; its interpreter's
             start-up, `qctl --help`, is reported beside it); one page of `GET /v1/queues`
             (limit 100, the default, and 1000); a read of the map (`GET /v1/cluster`, which the
             client library reads within 0.3 s to follow failovers) and of `/metrics`.
failover     a node (not the membership leader unless --kill-leader) masters at least M queues
             (created with `master` set to it where the cluster has fewer); after one enqueue to
             each, it is killed with SIGKILL, and one prober per queue asks for an acknowledged
             enqueue again and again (retrying on any error): per queue the time from the kill
             to its first acknowledgement (by the new master: the old one is dead). --prober
             library (default): the client library, map-aware, connected to another node;
             direct: one AsyncClient per node without the library's map, each queue's enqueue
             sent to its replica's node (the one a failover promotes), then where the map read
             by the benchmark names the master (chosen by itself when the library cannot read
             the map: it gives up on a map not read within 0.3 s). The map is read meanwhile
             (every --map-poll-s at another node) for when each promotion became visible. The
             node is then started again and its queues must be back in sync (reported only).
restart      --restart-messages spread over the queues (enqueue_many batches of up to 100 at
             their masters, as fast as the cluster takes them); once every pair is in sync, the
             node (not the leader) that holds most of them is stopped (--restart-signal: term,
             an orderly stop that hands its masters off, or kill); while it is down each of its
             queues gets --down-writes messages (at the master, after the failover on a kill),
             so that it has something to catch up on, and once the map records them out of sync
             (15 s at most) it is started again: time until it serves (/healthz 200, and a
             signed enqueue addressed to it answered) and until every pair it is a member of is
             recorded in sync in the map and the node holds each in sync (a replica `following`,
             from its own `GET /v1/queues` pages).
connections  K WebSocket clients of the client library (one AsyncClient each) on ONE node,
             split over --client-processes generator processes (default one per 2,500), each
             client sending one enqueue a second (open loop, phases spread over the second) for
             --duration s to one of the queues that node masters: p50/p99 latency, the node's
             RSS before and after connecting (memory per connection), the node's and the
             generators' CPU (a generator near one core is the bottleneck, not the node), sends
             that started late, and each process's open-file limit (this process raises its soft
             limit to the hard one before starting anything; nodes and generators inherit it).
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import contextlib
import functools
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import percentile  # noqa: E402
from bench.bench_failover import summarise  # noqa: E402
from client import AsyncClient, QueueError  # noqa: E402
from client.credentials import Credentials, load_credentials  # noqa: E402
from client.http import HttpClient  # noqa: E402
from client.router import PLACEMENT_QUEUES_MAX  # noqa: E402
from qserver.dev.devcluster import REPOSITORY, LocalCluster, NodeRun, start_qserver  # noqa: E402

PARTS = ("queues", "failover", "restart", "connections")
FULL = {"nodes": 5, "queues": 10_000, "failover_queues": 2_000, "restart_messages": 1_000_000, "clients": 5_000,
        "duration": 60.0, "latency_samples": 1_000, "connection_queues": 100}
QUICK = {"nodes": 3, "queues": 200, "failover_queues": 60, "restart_messages": 50_000, "clients": 200,
         "duration": 10.0, "latency_samples": 200, "connection_queues": 20}
PREFIX = "scale-"
BASELINE_QUEUES = 10
WARMUP_CALLS = 20
PAYLOAD_BYTES_DEFAULT = 100
FILL_BATCH = 100
FILL_IN_FLIGHT = 32
CLIENTS_PER_PROCESS = 2_500
CONNECT_IN_FLIGHT = 50            # upgrades in flight per generator (the node's listen backlog is 128)
LATE_S = 0.05                     # a send that starts this late is counted late (the generator fell behind)
MAP_READ_TARGET_S = 0.3           # client/router.py MAP_READ_TIMEOUT_S: a slower map is passed over
NODE_START_TIMEOUT_S = 120.0      # a node restarted with a big state (devcluster's default is 20 s)
TARGET_RSS_MB = 512
TARGET_LATENCY_RATIO = 1.2
TARGET_LISTING_MS = 100.0
TARGET_FAILOVER_P99_S = 2.0
TARGET_SERVING_S = 10.0
TARGET_IN_SYNC_S = 30.0
TARGET_CONNECTION_P99_MS = 20.0
_T = TypeVar("_T")


def queue_name(index: int) -> str:
    return f"{PREFIX}{index:06d}"


# --- processes: every one this benchmark starts is stopped at exit ----------------------------
class Cleanup:
    """Stops what the benchmark started: the cluster's nodes (every process of each), the load
    generators, and anything else that is a direct child of this process (a node being started
    when Ctrl-C came), each by its process group (the nodes' journal export child is in it);
    then removes the cluster's directory unless it is kept. Idempotent; run from `finally`, at
    exit and from the signal handlers."""

    def __init__(self) -> None:
        self.cluster: LocalCluster | None = None
        self.root: Path | None = None
        self.keep = False
        self.done = False

    def kill_processes(self, reap: bool = True) -> None:
        """`reap`: also wait for what is not a Popen of ours (not from a signal handler: the event
        loop's child watcher must reap the generators it started itself)."""
        if self.cluster is not None:
            for runs in self.cluster.runs.values():
                for run in runs.runs:
                    _kill_group(run.process.pid, run.process.poll() is None)
                    run.ended_on_purpose = True
            self.cluster.processes.clear()
        for pid in _own_children():
            _kill_group(pid, True)
        if not reap:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:       # reap what is not a Popen of ours (Popen reaps its own)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if not _own_children():
                    break
                time.sleep(0.05)

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        self.kill_processes()
        if self.root is not None:
            if self.keep:
                print(f"kept the cluster's directory: {self.root}", file=sys.stderr)
            else:
                shutil.rmtree(self.root, ignore_errors=True)


def _own_children() -> list[int]:
    """This process's direct children (every thread's), alive or not yet reaped."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
    return pids


def _kill_group(pid: int, alive: bool) -> None:
    """SIGKILL the process group a child of ours leads (started with start_new_session), or the
    child alone if it leads none; nothing for a child already reaped (its pid may be reused)."""
    if not alive:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


CLEANUP = Cleanup()


def _on_signal(number: int, frame: Any) -> None:
    CLEANUP.kill_processes(reap=False)      # at once: unwinding may take a while
    if number == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + number)


def raise_open_files_limit() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# --- /proc ------------------------------------------------------------------------------------
def _status_kb(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[key] = int(value.split()[0])
    return fields


def process_memory(pid: int) -> dict[str, Any]:
    """A process's resident memory in MB: VmRSS, its anonymous and file-backed parts (a node's
    LMDB map is file-backed), its peak (VmHWM), and its children's VmRSS."""
    own = _status_kb(pid)
    children = [int(p) for task in _listdir(f"/proc/{pid}/task")
                for p in _read(f"/proc/{pid}/task/{task}/children").split()]
    return {"rss_mb": round(own.get("VmRSS", 0) / 1024, 1), "rss_anon_mb": round(own.get("RssAnon", 0) / 1024, 1),
            "rss_file_mb": round(own.get("RssFile", 0) / 1024, 1), "hwm_mb": round(own.get("VmHWM", 0) / 1024, 1),
            "children_rss_mb": round(sum(_status_kb(c).get("VmRSS", 0) for c in children) / 1024, 1)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(values[:8])
    return total - values[3] - values[4], total


def open_files(pid: int) -> dict[str, Any]:
    soft: int | str | None = None
    for line in _read(f"/proc/{pid}/limits").splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            soft = int(value) if value.isdigit() else value
    return {"fds_open": len(_listdir(f"/proc/{pid}/fd")), "nofile_soft": soft}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# --- results ----------------------------------------------------------------------------------
def git_commit() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPOSITORY, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPOSITORY,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return commit or "unknown", dirty


class Report:
    """One JSON line per measurement: printed, and appended to the output file at once (a run
    that fails later keeps what it measured)."""

    def __init__(self, out: Path, sizes: dict[str, Any]) -> None:
        self.out = out
        self.sizes = sizes
        self.commit, self.dirty = git_commit()
        self.lines: list[dict[str, Any]] = []
        out.parent.mkdir(parents=True, exist_ok=True)

    def line(self, part: str, measure: str, *, target: str | None, met: bool | None, **fields: Any) -> dict[str, Any]:
        record = {"bench": "scale", "part": part, "measure": measure, **fields, "target": target, "met": met,
                  "sizes": self.sizes, "commit": self.commit, "dirty_tree": self.dirty,
                  "date": time.strftime("%Y-%m-%d"), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        text = json.dumps(record)
        print(text, flush=True)
        with self.out.open("a") as out:
            out.write(text + "\n")
        self.lines.append(record)
        return record


def latency_summary(values_ms: list[float]) -> dict[str, Any]:
    if not values_ms:
        return {"count": 0}
    return {"count": len(values_ms), "p50_ms": round(percentile(values_ms, 0.5), 3),
            "p99_ms": round(percentile(values_ms, 0.99), 3), "max_ms": round(max(values_ms), 3),
            "mean_ms": round(statistics.fmean(values_ms), 3)}


# --- the cluster ------------------------------------------------------------------------------
@dataclass
class Bench:
    args: argparse.Namespace
    cluster: LocalCluster
    credentials: Credentials
    report: Report
    http: dict[str, HttpClient] = field(default_factory=dict)
    payload: bytes = b""

    def url(self, node: str) -> str:
        return self.cluster.urls[node]

    def rest(self, node: str) -> HttpClient:
        client = self.http.get(node)
        if client is None:
            client = self.http[node] = HttpClient(self.url(node), self.credentials.signer())
        return client

    def running(self) -> list[str]:
        return [node for node, process in sorted(self.cluster.processes.items()) if process.poll() is None]

    async def close(self) -> None:
        for client in self.http.values():
            await client.close()
        self.http.clear()

    async def cluster_map(self, at: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """The map as a running node holds it (`at`, else the first that answers)."""
        nodes = [at] if at else self.running()
        error: BaseException | None = None
        for node in nodes:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self.rest(node).cluster()
            except (QueueError, TimeoutError) as exc:
                error = exc
        raise RuntimeError(f"no node answered GET /v1/cluster: {error}")

    async def bench_queues(self, at: str | None = None) -> dict[str, dict[str, Any]]:
        queues = (await self.cluster_map(at))["queues"]
        return {name: entry for name, entry in queues.items() if name.startswith(PREFIX)}


def start_node(cluster: LocalCluster, node: str, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
    """LocalCluster.start(node, wait=False) with a longer start timeout: a node with a big
    state may take over devcluster's 20 s to answer /healthz (it would be killed then)."""
    runs = cluster.runs[node]
    log_offset = runs.log_path.stat().st_size if runs.log_path.exists() else 0
    process = start_qserver(["--config", str(cluster.root / f"{node}.toml"), "--log-level", cluster.log_level],
                            cluster.urls[node], runs.log_path, timeout_s=timeout_s, ssl_context=cluster.ssl_context)
    runs.runs.append(NodeRun(process, log_offset))
    cluster.processes[node] = process


class NodeClients:
    """One AsyncClient per node, none with the library's copy of the map: a call goes to the node
    it is sent to (the benchmark reads the map itself, with no time limit on the read; the
    library passes over a map not read within 0.3 s, which a map of thousands of queues may
    exceed)."""

    def __init__(self, bench: Bench, request_timeout_s: float = 30.0) -> None:
        self.bench, self.request_timeout_s = bench, request_timeout_s
        self.clients: dict[str, AsyncClient] = {}

    def __getitem__(self, node: str) -> AsyncClient:
        client = self.clients.get(node)
        if client is None:
            client = self.clients[node] = AsyncClient(self.bench.url(node), self.bench.credentials,
                                                      request_timeout_s=self.request_timeout_s)
        return client

    async def __aenter__(self) -> NodeClients:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await asyncio.gather(*(client.close() for client in self.clients.values()), return_exceptions=True)


async def gather_all(calls: Iterable[Awaitable[_T]]) -> list[_T]:
    """asyncio.gather, except that on the first failure the calls still running are cancelled
    (and waited for) before it is raised: none is left behind talking to the cluster."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def bounded_gather(calls: Iterable[Callable[[], Awaitable[_T]]], concurrency: int) -> list[_T]:
    gate = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[_T]]) -> _T:
        async with gate:
            return await call()
    return await gather_all(one(call) for call in calls)


async def create_queues(bench: Bench, names: list[str], placement: dict[str, str] | None = None,
                        via: str = "n1") -> list[tuple[float, float]]:
    """Create `names` (full, default options) through signed REST at `via`, at most
    --create-concurrency at once; (start, seconds) of each create, in the order started. The
    whole is bounded (at least 5 creates a second, and a minute)."""
    http = bench.rest(via if via in bench.cluster.processes else bench.running()[0])
    timings: list[tuple[float, float]] = [(0.0, 0.0)] * len(names)
    order = iter(range(len(names)))

    async def create(index: int) -> None:
        started = time.perf_counter()
        async with asyncio.timeout(60):
            await http.create_queue(names[index], strength="full", **(placement or {}))
        timings[index] = (started, time.perf_counter() - started)

    async def worker() -> None:
        for index in order:
            await create(index)
    async with asyncio.timeout(60 + 0.2 * len(names)):
        await gather_all(worker() for _ in range(min(bench.args.create_concurrency, len(names)) or 1))
    return timings


async def ensure_queues(bench: Bench, count: int) -> list[str]:
    """The first `count` bench queues, creating those the cluster does not have."""
    names = [queue_name(i) for i in range(count)]
    existing = await bench.bench_queues()
    missing = [name for name in names if name not in existing]
    if missing:
        await create_queues(bench, missing)
    return names


async def next_free_names(bench: Bench, count: int) -> list[str]:
    existing = await bench.bench_queues()
    start = 1 + max((int(name[len(PREFIX):]) for name in existing if name[len(PREFIX):].isdigit()), default=-1)
    return [queue_name(start + i) for i in range(count)]


async def wait_in_sync(bench: Bench, names: set[str] | None = None, member: str | None = None,
                       timeout_s: float = 300.0, at: str | None = None) -> float:
    """Seconds until the map records every chosen queue in sync (`names`; else every bench
    queue; only those `member` is master or replica of when given), read at `at` (else the
    first running node) every 0.25 s at least (longer when the map itself is slow to read)."""
    started = time.monotonic()
    deadline = started + timeout_s
    left: list[str] = []
    while True:
        read_started = time.monotonic()
        queues = await bench.bench_queues(at)
        read_s = time.monotonic() - read_started
        left = [name for name, entry in queues.items()
                if (names is None or name in names) and (member is None or member in (entry["master"], entry["replica"]))
                and not entry["in_sync"]]
        if names is not None:
            left += [name for name in names if name not in queues]
        if not left:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(left)} queue(s) not in sync within {timeout_s}s, e.g. {sorted(left)[:5]}")
        await asyncio.sleep(max(0.25, 2 * read_s))


def node_memories(bench: Bench) -> dict[str, dict[str, Any]]:
    return {node: process_memory(process.pid) for node, process in sorted(bench.cluster.processes.items())}


# --- part 1: many queues ----------------------------------------------------------------------
async def enqueue_latencies(bench: Bench, queue: str, node: str, profile_as: str) -> dict[str, Any]:
    """One enqueue at a time to `queue` at `node` (its master): signed REST, then the client
    library's WebSocket; WARMUP_CALLS of each not counted. With --profile, py-spy records the
    node meanwhile (DIR/PROFILE_AS-NODE.txt)."""
    profilers = start_profilers(bench, [node], profile_as)
    try:
        return await _enqueue_latencies(bench, queue, node)
    finally:
        await asyncio.to_thread(finish_profilers, profilers, True)


async def _enqueue_latencies(bench: Bench, queue: str, node: str) -> dict[str, Any]:
    samples = bench.args.latency_samples
    http = bench.rest(node)
    rest: list[float] = []
    async with asyncio.timeout(60 + samples * 0.2):
        for i in range(WARMUP_CALLS + samples):
            started = time.perf_counter()
            await http.enqueue_http(queue, bench.payload)
            if i >= WARMUP_CALLS:
                rest.append((time.perf_counter() - started) * 1000)
    ws: list[float] = []
    async with asyncio.timeout(60 + samples * 0.2), AsyncClient(bench.url(node), bench.credentials) as client:
        for i in range(WARMUP_CALLS + samples):
            started = time.perf_counter()
            await client.enqueue(queue, bench.payload)
            if i >= WARMUP_CALLS:
                ws.append((time.perf_counter() - started) * 1000)
    return {"rest": latency_summary(rest), "websocket": latency_summary(ws)}


async def timed(call: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        async with asyncio.timeout(60):
            await call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def qctl_command() -> list[str]:
    script = Path(sys.executable).parent / "qctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "client.qctl"]


def run_wall_ms(command: list[str], runs: int) -> tuple[list[float], int, int]:
    """Wall times of `runs` runs of a command (ms), the last one's exit code and output size."""
    times, code, size = [], 0, 0
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, timeout=120, cwd=REPOSITORY)
        times.append((time.perf_counter() - started) * 1000)
        code, size = done.returncode, len(done.stdout)
    return times, code, size


async def part_queues(bench: Bench) -> None:
    args, report = bench.args, bench.report
    total = args.queues
    names = [queue_name(i) for i in range(total)]
    baseline_count = min(BASELINE_QUEUES, total)
    first_started = time.perf_counter()
    first_timings = await create_queues(bench, names[:baseline_count])
    first_s = time.perf_counter() - first_started
    await wait_in_sync(bench, set(names[:baseline_count]), timeout_s=60)
    probe = names[0]
    master = (await bench.bench_queues())[probe]["master"]
    options = (await bench.rest(master).queue_stats(probe))["options"]
    before = await enqueue_latencies(bench, probe, master, f"latency-{baseline_count}-queues")

    rest_names = names[baseline_count:]
    started = time.perf_counter()
    timings = await create_queues(bench, rest_names) if rest_names else []
    bulk_s = time.perf_counter() - started
    window = max(10, min(1000, len(timings) // 10))
    by_start = [seconds * 1000 for _, seconds in sorted(timings)]
    report.line("queues", "create", target=None, met=None, created=total, strength=options.get("strength"),
                dead_letter=options.get("dead_letter"),
                via="n1 (REST)", concurrency=args.create_concurrency,
                seconds_total=round(first_s + bulk_s, 3), rate_per_s=round(total / (first_s + bulk_s), 1),
                bulk_created=len(rest_names), bulk_seconds=round(bulk_s, 3),
                bulk_rate_per_s=round(len(rest_names) / bulk_s, 1) if rest_names else None,
                window=window, first_creates=latency_summary(by_start[:window]),
                last_creates=latency_summary(by_start[-window:]),
                first_10_creates=latency_summary([s * 1000 for _, s in first_timings]))
    in_sync_s = await wait_in_sync(bench, timeout_s=120 + total * 0.05)
    report.line("queues", "all_in_sync_after_create", target=None, met=None, seconds=round(in_sync_s, 3))
    await asyncio.sleep(2)

    memories = node_memories(bench)
    largest = max(memory["rss_mb"] for memory in memories.values())
    report.line("queues", "node_memory", target=f"VmRSS <= {TARGET_RSS_MB} MB per node",
                met=largest <= TARGET_RSS_MB, queues=total, max_rss_mb=largest, nodes=memories,
                cores_held={node: bench.cluster.health(node).get("queues") for node in bench.running()},
                cores_are="queue instances a node holds: masters and replicas, each queue's dead-letter queue too")

    master = (await bench.bench_queues())[probe]["master"]
    after = await enqueue_latencies(bench, probe, master, f"latency-{total}-queues")
    for path in ("rest", "websocket"):
        p50_10, p50_n = before[path]["p50_ms"], after[path]["p50_ms"]
        ratio = p50_n / p50_10 if p50_10 else math.inf
        report.line("queues", f"enqueue_latency_{path}", target=f"p50 with {total} queues <= "
                    f"{TARGET_LATENCY_RATIO} x p50 with {baseline_count}", met=ratio <= TARGET_LATENCY_RATIO,
                    node=master, queue=probe, sequential=True, payload_bytes=len(bench.payload),
                    with_10=before[path], with_n=after[path], p50_ratio=round(ratio, 3))

    at = "n1" if "n1" in bench.running() else bench.running()[0]
    credentials_path = str(bench.cluster.credentials_path)
    base = [*qctl_command(), "--credentials", credentials_path, "--url", bench.url(at)]
    startup, _, _ = await asyncio.to_thread(run_wall_ms, [*base, "--help"], 3)
    status, code, size = await asyncio.to_thread(run_wall_ms, [*base, "--json", "status"], 3)
    status_ms = statistics.median(status)
    status_help = await asyncio.to_thread(subprocess.run, [*base, "status", "--help"], capture_output=True,
                                          text=True, timeout=60, cwd=REPOSITORY)
    whole: dict[str, Any] = {}
    if "--all" in status_help.stdout:     # a qctl that summarizes a large map: the whole map too
        every, every_code, every_size = await asyncio.to_thread(run_wall_ms, [*base, "--json", "status", "--all"], 3)
        whole = {"all_wall_ms_median": round(statistics.median(every), 1), "all_exit_code": every_code,
                 "all_output_bytes": every_size}
    report.line("queues", "qctl_status", target=f"wall time <= {TARGET_LISTING_MS:g} ms", met=status_ms <= TARGET_LISTING_MS
                and code == 0, queues=total, command="qctl --json status", exit_code=code, output_bytes=size,
                wall_ms_median=round(status_ms, 1), wall_ms_runs=[round(t, 1) for t in status],
                qctl_help_ms_median=round(statistics.median(startup), 1),
                status_minus_startup_ms=round(status_ms - statistics.median(startup), 1), **whole)

    def page_of(limit: int, after: str | None) -> Callable[[], Awaitable[Any]]:
        query = [("limit", str(limit))] + ([("after", after)] if after else [])
        return lambda: bench.rest(at).request("GET", "/v1/queues", query=query)
    for limit in (100, 1000):
        page = await timed(page_of(limit, None), 10)
        middle = await timed(page_of(limit, names[total // 2]), 10)
        p50 = statistics.median(page)
        report.line("queues", "list_queues_page", target=f"one page <= {TARGET_LISTING_MS:g} ms",
                    met=p50 <= TARGET_LISTING_MS, queues=total, node=at, limit=limit, paged="limit/after",
                    first_page=latency_summary(page), middle_page=latency_summary(middle))

    map_read = await timed(lambda: bench.rest(at).cluster(), 5)
    answer = await bench.rest(at).request("GET", "/v1/cluster")
    report.line("queues", "cluster_map_read", target=f"GET /v1/cluster <= {MAP_READ_TARGET_S * 1000:g} ms "
                "(client/router.py MAP_READ_TIMEOUT_S: a slower map is passed over)",
                met=statistics.median(map_read) <= MAP_READ_TARGET_S * 1000, queues=total,
                read=latency_summary(map_read), bytes=len(answer.body))
    scrape, scraped = [], 0
    for _ in range(3):
        started = time.perf_counter()
        with urllib.request.urlopen(bench.url(at) + "/metrics", timeout=60) as metrics:
            scraped = len(metrics.read())
        scrape.append((time.perf_counter() - started) * 1000)
    report.line("queues", "metrics_scrape", target=None, met=None, queues=total, read=latency_summary(scrape),
                bytes=scraped)


# --- part 2: failover at scale ----------------------------------------------------------------
def start_profilers(bench: Bench, nodes: list[str], part: str,
                    duration_s: float | None = None) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    """With --profile DIR: py-spy records each of `nodes` (DIR/PART-NODE.txt) for `duration_s`,
    or until finish_profilers stops it (None), as collapsed stacks: one line per stack and
    its sample count (sort by the count, or feed it to flamegraph.pl), every thread at 200 Hz."""
    if bench.args.profile is None:
        return []
    bench.args.profile.mkdir(parents=True, exist_ok=True)
    started = []
    for node in nodes:
        out = bench.args.profile / f"{part}-{node}.txt"
        command = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(bench.cluster.processes[node].pid),
                   "--rate", "200", "--format", "raw", "--nonblocking", "--output", str(out)]
        if duration_s is not None:
            command += ["--duration", str(math.ceil(duration_s))]      # whole seconds only
        with open(out.with_suffix(".log"), "wb") as errors:      # why py-spy wrote nothing, if it did not
            started.append((node, subprocess.Popen(command, stdout=errors, stderr=subprocess.STDOUT,
                                                   start_new_session=True), out))
    time.sleep(0.5)                     # py-spy attaches before the clock starts
    return started


def finish_profilers(profilers: list[tuple[str, subprocess.Popen[bytes], Path]], stop: bool = False) -> None:
    """Waits for each recording to end (`stop`: ends it now: py-spy writes what it has on SIGINT)."""
    for node, process, out in profilers:
        if stop:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid, True)
            process.wait()
        print(f"profile of {node}: {out}" if out.exists() else
              f"py-spy wrote no profile of {node}: see {out.with_suffix('.log')}", file=sys.stderr)


async def watch_promotions(bench: Bench, at: str, victim: str, names: set[str], killed_at: float,
                           promoted: dict[str, float], masters: dict[str, str], stop: asyncio.Event) -> int:
    """Read the map at `at` until every queue of `names` names another master than `victim`;
    the first time each did, from the kill (`promoted`), and the latest master of each
    (`masters`). Returns how many reads it took. Each read asks for those queues' entries
    only, PLACEMENT_QUEUES_MAX to a request: the whole map of 10,000 queues is 5.6 MB that
    the node encodes on its loop (~150 ms), and the watcher's node may lead the membership
    layer, whose failover it would slow down."""
    reads = 0
    wanted = sorted(names)
    while not stop.is_set() and len(promoted) < len(names):
        queues: dict[str, Any] = {}
        try:
            async with asyncio.timeout(10):
                for start in range(0, len(wanted), PLACEMENT_QUEUES_MAX):
                    queues.update((await bench.rest(at).cluster(wanted[start:start + PLACEMENT_QUEUES_MAX]))["queues"])
        except (QueueError, TimeoutError):
            pass
        reads += 1
        seen = time.monotonic() - killed_at
        for name in names:
            entry = queues.get(name)
            if entry is not None:
                masters[name] = entry["master"]
            if name not in promoted and entry is not None and entry["master"] != victim:
                promoted[name] = seen
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), bench.args.map_poll_s)
    return reads


async def part_failover(bench: Bench) -> None:
    args, report, cluster = bench.args, bench.report, bench.cluster
    wanted = args.failover_queues
    cluster_map = await bench.cluster_map()
    leader = cluster_map.get("leader")
    queues = {name: entry for name, entry in cluster_map["queues"].items() if name.startswith(PREFIX)}
    mastered = collections.Counter(entry["master"] for entry in queues.values())
    candidates = [node for node in bench.running() if args.kill_leader == (node == leader)] or bench.running()
    victim = max(candidates, key=lambda node: (mastered[node], node))
    created = 0
    if mastered[victim] < wanted:
        extra = await next_free_names(bench, wanted - mastered[victim])
        await create_queues(bench, extra, placement={"master": victim})
        created = len(extra)
    queues = await bench.bench_queues()
    probed = sorted(name for name, entry in queues.items() if entry["master"] == victim)[:wanted]
    await wait_in_sync(bench, set(probed), timeout_s=120 + wanted * 0.05)
    survivor = leader if leader in bench.running() and leader != victim else \
        next(node for node in bench.running() if node != victim)
    watcher_at = next((node for node in bench.running() if node not in (victim, survivor)), survivor)
    first_ack: dict[str, float] = {}
    errors: collections.Counter[str] = collections.Counter()
    attempts = collections.Counter[str]()
    promoted: dict[str, float] = {}
    deadline_s = 60.0
    masters_seen: dict[str, str] = {}           # the watcher's latest reading: queue -> master
    prober, library_failed = args.prober, None
    async with AsyncClient(bench.url(survivor), bench.credentials, request_timeout_s=10) as client, \
            NodeClients(bench, request_timeout_s=1.0) as nodes:
        if prober == "library":
            try:
                await client.refresh_placement()
            except QueueError as error:        # the library could not read the map (see NodeClients)
                prober, library_failed = "direct", str(error)
        target = {name: queues[name]["replica"] for name in probed}

        def send(name: str) -> Awaitable[int]:
            if prober == "library":
                return client.enqueue(name, bench.payload)
            return nodes[target[name]].enqueue(name, bench.payload)
        async with asyncio.timeout(60 + wanted * 0.05):        # every route and connection warm
            if prober == "library":
                await gather_all(client.enqueue(name, bench.payload) for name in probed)
            else:
                await gather_all(nodes[node].ping() for node in set(target.values()))
                await gather_all(nodes[victim].enqueue(name, bench.payload) for name in probed)
        await asyncio.sleep(1.0)
        stop = asyncio.Event()
        profilers = start_profilers(bench, [node for node in bench.running() if node != victim], "failover",
                                    bench.args.profile_s)
        killed_at, killed_wall = time.monotonic(), time.time()
        cluster.kill(victim)
        killed_s = time.monotonic() - killed_at
        watcher = asyncio.ensure_future(watch_promotions(bench, watcher_at, victim, set(probed), killed_at,
                                                         promoted, masters_seen, stop)) if args.map_poll_s > 0 else None

        async def probe(name: str) -> None:
            while time.monotonic() - killed_at < deadline_s:
                attempts[name] += 1
                try:
                    await send(name)
                except QueueError as error:
                    errors[error.code] += 1
                    seen = masters_seen.get(name)
                    if seen is not None and seen != victim:     # direct: where the map says now
                        target[name] = seen
                    await asyncio.sleep(0.02)
                    continue
                first_ack[name] = time.monotonic() - killed_at
                return
        try:
            await bounded_gather([functools.partial(probe, name) for name in probed],
                                 args.probe_concurrency or len(probed))
        finally:
            if watcher is not None:          # until it has seen every promotion (30 s at most)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(watcher), 30)
            stop.set()
            reads = await watcher if watcher is not None else 0
            await asyncio.to_thread(finish_profilers, profilers)
    values = list(first_ack.values())
    summary = summarise("failover_first_ack_s", values) if values else {"count": 0}
    missing = len(probed) - len(values)
    after = await bench.bench_queues(survivor)
    moved = sum(1 for name in probed if after[name]["master"] != victim)
    report.line("failover", "failover_first_ack", target=f"p99 <= {TARGET_FAILOVER_P99_S:g} s from the kill to "
                "each queue's first acknowledged enqueue", met=missing == 0 and summary["p99"] <= TARGET_FAILOVER_P99_S,
                killed=victim, signal="SIGKILL", killed_was_membership_leader=victim == leader,
                queues_in_cluster=len(queues), queues_mastered_by_killed=sum(1 for e in queues.values()
                                                                           if e["master"] == victim),
                queues_created_for_it=created, probed=len(probed), acknowledged=len(values), missing=missing,
                masters_moved=moved, prober=prober, library_map_read_failed=library_failed,
                prober_detail=f"AsyncClient at {survivor}, map-aware" if prober == "library" else
                "one AsyncClient per node, each queue's enqueue sent to its replica's node (then where the map "
                "read by the benchmark names the master), 1 s per attempt", prober_calls="one per queue at a time",
                kill_call_s=round(killed_s, 3), killed_at_wall=time.strftime("%H:%M:%S", time.localtime(killed_wall))
                + f".{int(killed_wall * 1000) % 1000:03d}", p50_s=summary.get("p50"), p99_s=summary.get("p99"),
                max_s=summary.get("max"), min_s=summary.get("min"),
                attempts_p99=percentile(list(attempts.values()), 0.99), errors=dict(errors),
                promotion_seen_in_map=({k: v for k, v in summarise("promoted_s", list(promoted.values())).items()
                                        if k not in ("measure", "summary")} | {
                    "poll_s": args.map_poll_s, "reads": reads, "at": watcher_at, "seen": len(promoted)})
                if promoted else None)
    started = time.monotonic()
    await asyncio.to_thread(start_node, cluster, victim)
    healthz_s = time.monotonic() - started
    in_sync_s = await wait_in_sync(bench, member=victim, timeout_s=120 + wanted * 0.1, at=survivor)
    report.line("failover", "killed_node_back_in_sync", target=None, met=None, node=victim,
                healthz_s=round(healthz_s, 3), in_sync_s_from_start=round(in_sync_s + healthz_s, 3))
    if args.rebalance:          # the killed node masters nothing now: spread the masters again
        before = await bench.bench_queues(survivor)
        started = time.monotonic()
        async with asyncio.timeout(180):
            answer = await bench.rest(survivor).rebalance()
        called_s = time.monotonic() - started
        handoffs = [name for name in answer.get("handoffs", []) if name in before]
        deadline = time.monotonic() + 120 + wanted * 0.05
        while True:     # until the handoffs it started are in the map, and every pair in sync
            queues = await bench.bench_queues(survivor)
            left = sum(1 for name in handoffs if queues[name]["master"] == before[name]["master"])
            if (not left and all(entry["in_sync"] for entry in queues.values())) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        masters = collections.Counter(entry["master"] for entry in queues.values())
        report.line("failover", "rebalance_after", target=None, met=None, call_s=round(called_s, 3),
                    seconds=round(time.monotonic() - started, 3), moves=len(answer.get("moves", [])),
                    handoffs=len(handoffs), handoffs_not_done=left, masters_per_node=dict(sorted(masters.items())))


# --- part 3: restart with a big state ---------------------------------------------------------
async def fill_queues(bench: Bench, names: list[str], total: int) -> float:
    """`total` messages spread evenly over `names`, in enqueue_many batches of up to FILL_BATCH
    at each queue's master, FILL_IN_FLIGHT batches at once. Returns the seconds it took."""
    per, extra = divmod(total, len(names))
    batches: list[tuple[str, int]] = []
    for index, name in enumerate(names):
        count = per + (1 if index < extra else 0)
        batches += [(name, min(FILL_BATCH, count - done)) for done in range(0, count, FILL_BATCH)]
    masters = {name: entry["master"] for name, entry in (await bench.bench_queues()).items()}
    started = time.perf_counter()
    async with NodeClients(bench) as nodes, asyncio.timeout(300 + total / 1000):
        await bounded_gather([functools.partial(nodes[masters[name]].enqueue_many, name, [bench.payload] * size)
                              for name, size in batches], FILL_IN_FLIGHT)
    return time.perf_counter() - started


async def until_out_of_sync(bench: Bench, members: set[str], at: str, timeout_s: float) -> int:
    """Until the map at `at` records every queue of `members` out of sync (the stopped node
    no longer follows), at most timeout_s; how many were still recorded in sync then."""
    deadline = time.monotonic() + timeout_s
    while True:
        queues = await bench.bench_queues(at)
        still = sum(1 for name in members if queues[name]["in_sync"])
        if not still or time.monotonic() > deadline:
            return still
        await asyncio.sleep(0.25)


async def write_while_down(bench: Bench, node: str, members: set[str], at: str, count: int) -> int:
    """`count` messages to each of `members` at its master (once the map at `at` names none on
    the stopped `node`: after a SIGKILL, once the failover is recorded): what the stopped node
    must catch up on. Returns how many were acknowledged."""
    if count <= 0:
        return 0
    deadline = time.monotonic() + 30
    while True:
        queues = await bench.bench_queues(at)
        if all(queues[name]["master"] != node for name in members) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    async with NodeClients(bench) as nodes, asyncio.timeout(120 + len(members) * 0.05):
        done = await bounded_gather([functools.partial(nodes[queues[name]["master"]].enqueue_many, name,
                                                       [bench.payload] * count) for name in sorted(members)],
                                    FILL_IN_FLIGHT)
    return sum(len(ids) for ids in done)


async def first_enqueue_answered(bench: Bench, node: str, queue: str, timeout_s: float) -> float:
    """Seconds until a signed REST enqueue addressed to `node` is answered with success."""
    started = time.monotonic()
    async with HttpClient(bench.url(node), bench.credentials.signer(), request_timeout_s=5) as http:
        while True:
            try:
                await http.enqueue_http(queue, bench.payload)
                return time.monotonic() - started
            except QueueError:
                if time.monotonic() - started > timeout_s:
                    raise
                await asyncio.sleep(0.05)


async def until_member_in_sync(bench: Bench, node: str, members: set[str], at: str, started: float,
                               timeout_s: float) -> dict[str, float]:
    """Until every queue of `members` is recorded in sync in the map (read at `at`) and `node`
    holds each in sync: as a replica "following" (its digest matched its master's), as a master
    "in_sync" (its own `replication_state`, read in `GET /v1/queues` pages at `node`). The
    times, from `started`, when each side was first all there."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    left: dict[str, int] = {}
    async with HttpClient(bench.url(node), bench.credentials.signer(), request_timeout_s=30) as http:
        while True:
            queues = await bench.bench_queues(at)
            left["map"] = sum(1 for name in members if not queues[name]["in_sync"])
            try:
                listed = await http.list_queues(page_size=1000)
                held = {q["name"] for q in listed if q.get("held_here")
                        and q.get("replication_state") in ("following", "in_sync")}
                left["node"] = len(members - held)
            except QueueError:
                left["node"] = len(members)
            for side, count in left.items():
                if not count and side not in seen:
                    seen[side] = round(time.monotonic() - started, 3)
            if len(seen) == 2:
                return seen
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node}'s queues not in sync within {timeout_s}s: still {left}")
            await asyncio.sleep(0.25)


async def part_restart(bench: Bench) -> None:
    args, report, cluster = bench.args, bench.report, bench.cluster
    names = await ensure_queues(bench, args.restart_queues or args.queues)
    fill_s = await fill_queues(bench, names, args.restart_messages)
    report.line("restart", "fill", target=None, met=None, messages=args.restart_messages, queues=len(names),
                payload_bytes=len(bench.payload), batch=FILL_BATCH, batches_in_flight=FILL_IN_FLIGHT,
                seconds=round(fill_s, 3), msgs_per_s=round(args.restart_messages / fill_s, 1),
                nodes=node_memories(bench))
    await wait_in_sync(bench, set(names), timeout_s=600)
    cluster_map = await bench.cluster_map()
    leader = cluster_map.get("leader")
    queues = {name: entry for name, entry in cluster_map["queues"].items() if name in set(names)}
    held = collections.Counter(node for entry in queues.values() for node in (entry["master"], entry["replica"]))
    target = max((node for node in bench.running() if node != leader), key=lambda node: (held[node], node))
    members = {name for name, entry in queues.items() if target in (entry["master"], entry["replica"])}
    as_master = sum(1 for name in members if queues[name]["master"] == target)
    watcher = leader if leader in bench.running() else next(n for n in bench.running() if n != target)
    memory_before = process_memory(cluster.processes[target].pid)
    signal_name = "SIGTERM" if args.restart_signal == "term" else "SIGKILL"
    stopped_at = time.monotonic()
    code = await asyncio.to_thread(cluster.runs[target].end, cluster.processes.pop(target),
                                   signal.SIGTERM if args.restart_signal == "term" else signal.SIGKILL, 120)
    stop_s = time.monotonic() - stopped_at
    written = await write_while_down(bench, target, members, watcher, args.down_writes)
    still_in_sync = await until_out_of_sync(bench, members, watcher, 15.0)
    down_s = time.monotonic() - stopped_at
    probe = sorted(members)[0]
    started = time.monotonic()
    await asyncio.to_thread(start_node, cluster, target)
    healthz_s = time.monotonic() - started
    answered_s = healthz_s + await first_enqueue_answered(bench, target, probe, 120)
    seen = await until_member_in_sync(bench, target, members, watcher, started, 600)
    in_sync_s = max(seen.values())
    common = {"node": target, "signal": signal_name, "exit_code": code, "messages": args.restart_messages,
              "queues": len(names), "members_on_node": len(members), "mastered_before_stop": as_master,
              "stop_s": round(stop_s, 3), "written_while_down": written, "down_s": round(down_s, 3),
              "recorded_in_sync_at_restart": still_in_sync, "rss_before_stop": memory_before}
    report.line("restart", "restart_serving", target=f"<= {TARGET_SERVING_S:g} s from the start to /healthz 200 and "
                "a signed enqueue through it answered", met=answered_s <= TARGET_SERVING_S, **common,
                healthz_s=round(healthz_s, 3), first_enqueue_answered_s=round(answered_s, 3))
    report.line("restart", "restart_in_sync", target=f"<= {TARGET_IN_SYNC_S:g} s from the start until every pair "
                "of the node is recorded in sync in the map and the node holds each in sync (replica: following)",
                met=in_sync_s <= TARGET_IN_SYNC_S, **common, in_sync_s=in_sync_s, map_in_sync_s=seen["map"],
                node_in_sync_s=seen["node"], rss_after=process_memory(cluster.processes[target].pid))


# --- part 4: many connections -----------------------------------------------------------------
async def _read_json_line(process: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any]:
    assert process.stdout is not None
    async with asyncio.timeout(timeout_s):
        while True:
            line = await process.stdout.readline()
            if not line:
                raise RuntimeError(f"a load generator (pid {process.pid}) ended early (code {await process.wait()})")
            with contextlib.suppress(ValueError):
                document = json.loads(line)
                if isinstance(document, dict):
                    return document


def _metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{name}(?:{{}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


async def part_connections(bench: Bench) -> None:
    args, report, cluster = bench.args, bench.report, bench.cluster
    node = args.connections_node
    if node not in cluster.processes:
        raise RuntimeError(f"{node} is not running")
    clients, duration = args.clients, args.duration
    queues = await bench.bench_queues()
    mastered = sorted(name for name, entry in queues.items() if entry["master"] == node)
    if len(mastered) < args.connection_queues:
        extra = await next_free_names(bench, args.connection_queues - len(mastered))
        await create_queues(bench, extra, placement={"master": node})
        mastered += extra
    targets = mastered[:args.connection_queues]
    await wait_in_sync(bench, set(targets), timeout_s=120)
    pid = cluster.processes[node].pid
    processes = args.client_processes or max(1, math.ceil(clients / CLIENTS_PER_PROCESS))
    files_before = open_files(pid)
    if isinstance(files_before["nofile_soft"], int) and files_before["nofile_soft"] < clients + 1000:
        print(f"warning: {node}'s open-file limit {files_before['nofile_soft']} is below {clients} connections "
              "and its own files", file=sys.stderr)
    await asyncio.sleep(1)
    memory_before = process_memory(pid)
    root = Path(cluster.root)
    workers: list[asyncio.subprocess.Process] = []
    specs = []
    connect_timeout_s = max(60.0, clients / 20)
    for index in range(processes):
        mine = list(range(index, clients, processes))
        spec = {"url": bench.url(node), "credentials": str(cluster.credentials_path), "duration": duration,
                "queues": [targets[i % len(targets)] for i in mine], "payload_bytes": len(bench.payload),
                "connect_in_flight": CONNECT_IN_FLIGHT, "result": str(root / f"generator-{index}.json"),
                "hard_timeout_s": connect_timeout_s + duration + 180}
        path = root / f"generator-{index}.spec.json"
        path.write_text(json.dumps(spec))
        specs.append(spec)
        with (root / f"generator-{index}.log").open("ab") as log:
            workers.append(await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).resolve()), "--generator", str(path), cwd=REPOSITORY,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True))
    try:
        connect_started = time.monotonic()
        ready = [await _read_json_line(worker, connect_timeout_s) for worker in workers]
        connect_s = time.monotonic() - connect_started
        await asyncio.sleep(1)
        memory_connected = process_memory(pid)
        files_connected = open_files(pid)
        with urllib.request.urlopen(bench.url(node) + "/metrics", timeout=30) as answer:
            gauge = _metric(answer.read().decode(), "qserver_websocket_connections")
        connected = sum(r["connected"] for r in ready)
        profilers = start_profilers(bench, [node], "connections", min(duration, bench.args.profile_s))
        node_cpu, machine = process_cpu_s(pid), machine_cpu()
        load_started = time.monotonic()
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write(b"go\n")
            await worker.stdin.drain()
        results = [await _read_json_line(worker, duration + 120) for worker in workers]
        load_s = time.monotonic() - load_started
        await asyncio.to_thread(finish_profilers, profilers)
        node_cpu_s = process_cpu_s(pid) - node_cpu
        busy, total = (now - then for now, then in zip(machine_cpu(), machine, strict=True))
        memory_loaded = process_memory(pid)
        latencies: list[float] = []
        errors: collections.Counter[str] = collections.Counter()
        for spec in specs:
            document = json.loads(Path(spec["result"]).read_text())
            latencies += document["latencies_ms"]
            errors.update(document["errors"])
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
        for worker in workers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.wait(), 60)
        await asyncio.sleep(2)
        memory_after = process_memory(pid)
    finally:
        for worker in workers:
            if worker.returncode is None:
                _kill_group(worker.pid, True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.wait(), 5)
    summary = latency_summary(latencies)
    def per_connection_kb(key: str) -> float | None:
        return round((memory_connected[key] - memory_before[key]) * 1024 / connected, 1) if connected else None
    generators = [{"clients": r["clients"], "connected": r["connected"], "connect_failed": r["failed"],
                   "connect_s": r["connect_s"], "cpu_cores_during_load": g["cpu_cores"], "rss_mb": g["rss_mb"],
                   "nofile_soft": r["nofile_soft"], "sends_late": g["late"], "sent": g["sent"]}
                  for r, g in zip(ready, results, strict=True)]
    common = {"node": node, "clients": clients, "connected": connected, "connections_gauge": gauge,
              "queues": len(targets), "rate_per_client_per_s": 1, "duration_s": duration,
              "generator_processes": processes, "generators": generators}
    sent = sum(g["sent"] for g in results)
    report.line("connections", "connections_latency", target=f"p99 <= {TARGET_CONNECTION_P99_MS:g} ms",
                met=connected == clients and not errors and summary.get("p99_ms", math.inf) <= TARGET_CONNECTION_P99_MS,
                **common, enqueue=summary, errors=dict(errors), sent=sent,
                sends_late_fraction=round(sum(g["late"] for g in results) / sent, 4) if sent else None,
                load_s=round(load_s, 3), node_cpu_cores=round(node_cpu_s / load_s, 3),
                generators_cpu_cores=round(sum(g["cpu_cores"] for g in results), 3),
                machine_busy_fraction=round(busy / total, 3) if total else None, cores=os.cpu_count())
    report.line("connections", "connections_memory", target=None, met=None, **common,
                connect_s=round(connect_s, 3), rss_before=memory_before, rss_connected=memory_connected,
                rss_after_load=memory_loaded, rss_after_disconnect=memory_after,
                rss_kb_per_connection=per_connection_kb("rss_mb"), anon_kb_per_connection=per_connection_kb("rss_anon_mb"),
                per_connection_note="the node's RSS delta: a heap with free room from earlier parts under-counts it "
                "(the figure of --part connections alone is the one to quote)",
                node_files_before=files_before, node_files_connected=files_connected)


# --- the load generator (a process of its own) ------------------------------------------------
async def generator(spec: dict[str, Any]) -> None:
    """Open one AsyncClient per queue in the spec (CONNECT_IN_FLIGHT at once), say so on stdout,
    wait for "go" on stdin, send one enqueue a second per client for the duration, write the
    latencies to the result file and say so. Ends itself if stdin closes (its parent is gone)."""
    loop = asyncio.get_running_loop()
    soft, _ = raise_open_files_limit()
    credentials = load_credentials(spec["credentials"])
    payload = b"c" * spec["payload_bytes"]
    gate = asyncio.Semaphore(spec["connect_in_flight"])
    failures: collections.Counter[str] = collections.Counter()

    async def open_one() -> AsyncClient | None:
        async with gate:
            client = AsyncClient(spec["url"], credentials, request_timeout_s=10)
            try:
                async with asyncio.timeout(30):
                    await client.connect()
                return client
            except (QueueError, TimeoutError) as error:
                failures[getattr(error, "code", "timeout")] += 1
                await client.close()
                return None
    started = time.monotonic()
    opened = await asyncio.gather(*(open_one() for _ in spec["queues"]))
    pairs = [(client, queue) for client, queue in zip(opened, spec["queues"], strict=True) if client is not None]
    print(json.dumps({"clients": len(spec["queues"]), "connected": len(pairs), "failed": dict(failures),
                      "connect_s": round(time.monotonic() - started, 3), "nofile_soft": soft}), flush=True)
    if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
        os._exit(3)
    watchdog = loop.run_in_executor(None, sys.stdin.readline)     # EOF: the parent is gone
    watchdog.add_done_callback(lambda line: None if line.result() else os._exit(4))
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    late = sent = 0
    sends = max(1, int(spec["duration"]))
    load_started = loop.time()
    cpu = resource.getrusage(resource.RUSAGE_SELF)

    async def run(client: AsyncClient, queue: str, offset: float) -> None:
        nonlocal late, sent
        for k in range(sends):
            delay = load_started + offset + k - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > LATE_S:
                late += 1
            sent += 1
            began = time.perf_counter()
            try:
                await client.enqueue(queue, payload)
            except QueueError as error:
                errors[error.code] += 1
                continue
            latencies.append(round((time.perf_counter() - began) * 1000, 3))
    count = len(pairs)
    await asyncio.gather(*(run(client, queue, i / count) for i, (client, queue) in enumerate(pairs)))
    wall = loop.time() - load_started
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    Path(spec["result"]).write_text(json.dumps({"latencies_ms": latencies, "errors": dict(errors)}))
    print(json.dumps({"sent": sent, "late": late, "wall_s": round(wall, 3), "cpu_s": round(cpu_s, 3),
                      "cpu_cores": round(cpu_s / wall, 3), "rss_mb": process_memory(os.getpid())["rss_mb"]}),
          flush=True)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            await asyncio.gather(*(client.close() for client, _ in pairs), return_exceptions=True)


def generator_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGALRM, lambda *_: os._exit(5))       # whatever happens, not for ever
    signal.alarm(int(spec["hard_timeout_s"]))
    _install_uvloop()
    asyncio.run(generator(spec))
    sys.stdout.flush()
    os._exit(0)     # the stdin watchdog's thread would hold the interpreter's exit


# --- main -------------------------------------------------------------------------------------
def _install_uvloop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    uvloop.install()
    return "uvloop"


async def run_parts(bench: Bench, parts: list[str]) -> None:
    try:
        for part in parts:
            started = time.monotonic()
            print(f"--- part {part}", file=sys.stderr, flush=True)
            try:
                # A node that exited by itself in an earlier part is started again, as a supervisor
                # would (node_problems at the end reports it), so the next part has its cluster.
                restarted = await asyncio.to_thread(bench.cluster.restart_exited)
                if restarted:
                    bench.report.line(part, "nodes_restarted_before_part", target=None, met=None, events=restarted)
                    await asyncio.to_thread(bench.cluster.wait_ready)
                await {"queues": part_queues, "failover": part_failover, "restart": part_restart,
                       "connections": part_connections}[part](bench)
            except (RuntimeError, QueueError, TimeoutError, OSError, subprocess.SubprocessError) as error:
                exited = {node: process.returncode for node, process in sorted(bench.cluster.processes.items())
                          if process.poll() is not None}
                bench.report.line(part, "part_failed", target=None, met=False, error=f"{type(error).__name__}: {error}",
                                  nodes_exited_by_themselves=exited)
            print(f"--- part {part}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    finally:
        await bench.close()


def sizes_from(args: argparse.Namespace) -> dict[str, Any]:
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return {key: getattr(args, key) for key in preset} | {
        "quick": args.quick, "restart_queues": args.restart_queues or args.queues, "client_processes":
        args.client_processes or max(1, math.ceil(args.clients / CLIENTS_PER_PROCESS)),
        "restart_signal": args.restart_signal, "down_writes": args.down_writes, "payload_bytes": args.payload_bytes}


def _parts(text: str) -> list[str]:
    chosen = list(PARTS) if text == "all" else text.split(",")
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part {unknown[0]!r} (one of {', '.join(PARTS)}, all)")
    return chosen


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--generator":
        generator_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--part", default="all", type=_parts,
                        help=f"{'|'.join(PARTS)}|all, or several joined by commas (run in that order)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--nodes", type=int, help=f"nodes in the cluster ({FULL['nodes']}; quick {QUICK['nodes']})")
    parser.add_argument("--queues", type=int, help=f"queues created ({FULL['queues']:,}; quick {QUICK['queues']})")
    parser.add_argument("--failover-queues", type=int,
                        help=f"queues the killed node masters ({FULL['failover_queues']:,}; quick {QUICK['failover_queues']})")
    parser.add_argument("--restart-messages", type=int, help=f"messages before the restart "
                        f"({FULL['restart_messages']:,}; quick {QUICK['restart_messages']:,})")
    parser.add_argument("--restart-queues", type=int, default=0,
                        help="queues the messages are spread over (default: --queues)")
    parser.add_argument("--restart-signal", choices=("term", "kill"), default="term")
    parser.add_argument("--down-writes", type=int, default=1,
                        help="messages enqueued to each of the stopped node's queues while it is down")
    parser.add_argument("--clients", type=int,
                        help=f"WebSocket clients on one node ({FULL['clients']:,}; quick {QUICK['clients']})")
    parser.add_argument("--duration", type=float, help=f"seconds of load in the connections part "
                        f"({FULL['duration']:g}; quick {QUICK['duration']:g})")
    parser.add_argument("--client-processes", type=int, default=0,
                        help=f"load generator processes (default: one per {CLIENTS_PER_PROCESS:,} clients)")
    parser.add_argument("--connections-node", default="n1")
    parser.add_argument("--connection-queues", type=int, help="queues the connections node masters, the clients' targets")
    parser.add_argument("--latency-samples", type=int, help="sequential enqueues per latency measurement")
    parser.add_argument("--create-concurrency", type=int, default=16)
    parser.add_argument("--probe-concurrency", type=int, default=0, help="failover probers at once (default: all)")
    parser.add_argument("--prober", choices=("library", "direct"), default="library",
                        help="failover probes through the map-aware client library, or sent straight to each "
                             "queue's replica node (chosen by itself when the library cannot read the map)")
    parser.add_argument("--no-rebalance", dest="rebalance", action="store_false",
                        help="after the failover, leave the masters where the failover put them (default: "
                             "`POST /v1/cluster/rebalance`, as an operator would, so the next parts find them spread)")
    parser.add_argument("--kill-leader", action="store_true", help="the failover kills the membership leader")
    parser.add_argument("--map-poll-s", type=float, default=0.5,
                        help="during the failover, read the map this often for promotions (0: not at all)")
    parser.add_argument("--payload-bytes", type=int, default=PAYLOAD_BYTES_DEFAULT)
    parser.add_argument("--out", type=Path, help="append the JSON lines here")
    parser.add_argument("--profile", type=Path, help="py-spy records into this directory: the node addressed by the "
                        "sequential enqueues while they run, every surviving node from the failover's kill, "
                        "the connections node from the start of its load")
    parser.add_argument("--profile-s", type=float, default=6.0, help="seconds the failover's and the connections' recordings last")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs, data)")
    args = parser.parse_args()
    sizes = sizes_from(args)
    date = time.strftime("%Y-%m-%d")
    out = args.out or (Path(tempfile.gettempdir()) / f"results-scale-quick-{date}.jsonl" if args.quick
                       else REPOSITORY / "bench" / f"results-scale-{date}.jsonl")
    parts: list[str] = args.part
    soft, hard = raise_open_files_limit()         # before any node starts: they inherit it
    if soft < args.clients + 1000:
        print(f"warning: the open-file limit ({soft}, hard {hard}) is below {args.clients} connections: a node "
              "and a generator each need one per connection", file=sys.stderr)
    loop_kind = _install_uvloop()
    atexit.register(CLEANUP.run)
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _on_signal)
    report = Report(out, sizes | {"parts": parts, "loop": loop_kind, "nofile_soft": soft})
    CLEANUP.keep = args.keep
    try:
        root = CLEANUP.root = Path(tempfile.mkdtemp(prefix="qbench-scale-"))
        cluster = CLEANUP.cluster = LocalCluster(root, args.nodes)
        cluster.start_all()
        bench = Bench(args, cluster, load_credentials(cluster.credentials_path), report,
                      payload=b"s" * args.payload_bytes)
        asyncio.run(run_parts(bench, parts))
        problems = cluster.problems()
        report.line("all", "node_problems", target="no node crashed or logged a traceback", met=not problems,
                    count=len(problems), first=[problem[:600] for problem in problems[:3]],
                    cluster_dir=str(root) if args.keep else None)
    finally:
        CLEANUP.run()
    print(f"results appended to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
