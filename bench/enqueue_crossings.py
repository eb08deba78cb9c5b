"""How many times one enqueue's running code crosses from one project source file to another.

    .venv/bin/python bench/enqueue_crossings.py [--strength full|producer] [--enqueues 20]
                                                [--show] [--out FILE]

A 3-node cluster (data dirs and TOML from LocalCluster, whose processes are never started) runs
in THIS process on one asyncio loop, as `qserver.node.serve` runs a node (no signal handlers, a
clean stop at the end), on loopback, with its data in a temporary directory. The project's
AsyncClient, on the same loop, creates a queue placed on n1 (master) and n2 (replica), warms up
with 200 enqueues of 1 KiB, then makes N single `await client.enqueue(...)` calls one at a time.

For each of them a profile hook (every thread: the LMDB writer runs in one) records the file of
every Python 'call' and 'return' event, from just before the call to just after its future
answered, when that file lies in a project package (client/, qserver/, replication/, wire/ at
the repository root, whichever exist; never stdlib, site-packages, tests or bench) as a path
relative to the root. Consecutive equal paths collapse to one visit; crossings = visits - 1.
The nodes' background work (heartbeats, ticks) may interleave, so the figure is the median
(median_low: a real enqueue's) and the minimum over the N enqueues.

The same visits are also counted by room (docs/ARCHITECTURE.md, "Rooms": client, wire, api, core,
cluster, transport, storage, replication, features, node), with the flat layout before issue 33
mapped to the same rooms, so that the count does not grow when a file is split in two: `rooms`
is the crossings between rooms, `knot` those between the engine's room (core) and the pairs'
(cluster), the ping-pong issue 33 set out to remove.

Output: one JSON line on stdout (also appended to --out FILE), readable lines on stderr; --show
adds the median enqueue's file visits and its transitions per pair of files (top 15).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import faulthandler
import importlib
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))     # this checkout's packages, not the ones the venv installed:
# an editable install's finder would still serve a submodule this checkout lacks from its own tree
sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, "__module__", "").startswith("__editable__")]
PACKAGES = [name for name in ("client", "qserver", "replication", "wire") if (ROOT / name).is_dir()]
PAYLOAD = b"x" * 1024
WARMUP = 200
TOP_PAIRS = 15


def _import_first(names: list[str]) -> ModuleType:
    """The first of these modules that imports. The refactor this measures moves modules
    (qserver/devcluster.py to qserver/dev/, http_errors.py to qserver/api/, ...): the same
    script must run unchanged before and after it, or the two figures are not comparable."""
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
                raise               # the module exists but one of its own imports failed
            continue
        if not Path(module.__file__ or "").resolve().is_relative_to(ROOT):
            raise ImportError(f"{name} comes from {module.__file__}, not from {ROOT}")
        return module
    raise ModuleNotFoundError(f"none of {names} imports")


LocalCluster = _import_first(["qserver.dev.devcluster", "qserver.devcluster"]).LocalCluster
Node = _import_first(["qserver.node"]).Node
EnvelopeAppRunner = _import_first(["qserver.http_errors", "qserver.api.http_errors"]).EnvelopeAppRunner
load_config = _import_first(["qserver.config"]).load_config
AsyncClient = _import_first(["client"]).AsyncClient
from aiohttp import ClientError, ClientSession, web  # noqa: E402  (after the path above)


class Recorder:
    """The profile hook: project files of 'call'/'return' events while `on`, from any thread."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[str] = []
        self._paths: dict[str, str | None] = {}      # code filename -> path under ROOT, or None
        self._all_threads = getattr(threading, "setprofile_all_threads", None)    # Python >= 3.12

    def _path(self, filename: str) -> str | None:
        path = Path(filename).resolve()
        relative = path.relative_to(ROOT) if path.is_relative_to(ROOT) else None
        return relative.as_posix() if relative is not None and relative.parts[0] in PACKAGES else None

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on or (event != "call" and event != "return"):
            return
        filename = frame.f_code.co_filename
        path = self._paths.get(filename, "")
        if path == "":
            path = self._paths[filename] = self._path(filename)
        if path is not None:
            self.events.append(path)

    def arm(self) -> None:
        """Before the nodes start (Python < 3.12): every thread started from now on (the LMDB
        writers) runs the hook, which costs one flag test while not `on`."""
        if self._all_threads is None:
            threading.setprofile(self.hook)

    def start(self) -> None:
        self.events, self.on = [], True
        (self._all_threads or sys.setprofile)(self.hook)

    def stop(self) -> list[str]:
        sys.setprofile(None)
        if self._all_threads is not None:
            self._all_threads(None)
        self.on = False
        return self.events


@dataclass
class Trace:
    crossings: int        # transitions between consecutive visits
    files: int            # distinct files visited
    visits: list[str]     # the project files in order, consecutive repeats collapsed


def collapse(events: list[str]) -> Trace:
    visits = [path for i, path in enumerate(events) if i == 0 or events[i - 1] != path]
    return Trace(max(len(visits) - 1, 0), len(set(visits)), visits)


def pairs(visits: list[str]) -> list[tuple[str, str, int]]:
    counts = collections.Counter(tuple(sorted(step)) for step in zip(visits, visits[1:], strict=False))
    return [(a, b, n) for (a, b), n in counts.most_common(TOP_PAIRS)]


# The flat qserver/ of before issue 33, by room (the rooms themselves are qserver/<room>/...).
FLAT_ROOMS = {
    "engine": "core", "commands": "core", "deadlines": "core", "failstop": "core",
    "pairs": "cluster", "coordinator": "cluster", "membership": "cluster", "forwarding": "cluster",
    "storage": "storage", "raft_store": "storage", "journal_export": "storage",
    "peers": "transport", "tls": "transport",
    "http_api": "api", "ws_api": "api", "http_errors": "api", "auth": "api",
}


def room(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    if parts[0] != "qserver":
        return parts[0]                                  # client, wire, replication
    if len(parts) > 2:
        return parts[1]                                  # qserver/<room>/...
    return FLAT_ROOMS.get(parts[1], "features" if parts[1] not in ("node", "services", "assembly") else "node")


def room_crossings(visits: list[str]) -> tuple[int, int]:
    """Crossings between rooms, and between core and cluster."""
    rooms = [room(visit) for visit in visits]
    steps = [(a, b) for a, b in zip(rooms, rooms[1:], strict=False) if a != b]
    return len(steps), sum(1 for step in steps if set(step) == {"core", "cluster"})


def commit() -> str:
    """HEAD's short hash, read from .git (a worktree's .git is a file naming its git dir)."""
    try:
        git = ROOT / ".git"
        git = (ROOT / git.read_text().split(":", 1)[1].strip()).resolve() if git.is_file() else git
        head = (git / "HEAD").read_text().strip()
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").exists() else git
        if head.startswith("ref: "):       # a branch: its loose ref, else its line in packed-refs
            ref = head[5:]
            loose = [base / ref for base in (git, common) if (base / ref).exists()]
            head = loose[0].read_text().strip() if loose else next(
                line.split()[0] for line in (common / "packed-refs").read_text().splitlines() if line.endswith(" " + ref))
        return head[:7]
    except (OSError, IndexError, StopIteration):
        return "unknown"


async def wait_ready(urls: list[str], timeout_s: float) -> None:
    """Until every node sees a membership leader, holds a lease and sees every node up and voting."""
    deadline = time.monotonic() + timeout_s
    async with ClientSession() as session:
        for url in urls:
            while True:
                try:
                    async with session.get(url + "/healthz") as answer:
                        membership = (await answer.json()).get("membership", {})
                except (OSError, ValueError, TimeoutError, ClientError):
                    membership = {}
                states, voters = membership.get("nodes", {}), membership.get("raft", {}).get("voters", [])
                if membership.get("leader") and membership.get("lease_valid") and len(voters) == len(urls) \
                        and len(states) == len(urls) and all(state == "up" for state in states.values()):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} not ready in {timeout_s}s: {membership}")
                await asyncio.sleep(0.05)


async def measure(cluster: Any, recorder: Recorder, strength: str, enqueues: int) -> list[Trace]:
    traces = []
    async with AsyncClient(cluster.urls[cluster.ids[0]], cluster.credentials_path) as client:
        await client.create_queue("crossings", strength=strength, max_depth=1_000_000)
        for _ in range(WARMUP):
            await client.enqueue("crossings", PAYLOAD)
        await asyncio.sleep(0.5)
        for _ in range(enqueues):
            recorder.start()
            await client.enqueue("crossings", PAYLOAD)
            traces.append(collapse(recorder.stop()))
            await asyncio.sleep(0.01)
    return traces


async def run_cluster(root: Path, recorder: Recorder, args: argparse.Namespace) -> list[Trace]:
    cluster = LocalCluster(root, 3, placement={"crossings": ["n1", "n2"]}, tls=False)
    recorder.arm()
    started: list[tuple[Any, web.BaseSite, list[web.AppRunner]]] = []
    try:
        for node_id in cluster.ids:
            config = load_config(root / f"{node_id}.toml")
            node = Node(config)
            await node.start()
            runner = EnvelopeAppRunner(node.application(), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, config.host, config.port, reuse_address=True, backlog=1024)
            await site.start()
            runners = [runner]
            started.append((node, site, runners))
            membership_app = node.membership_application()
            if membership_app is not None:
                host, port = (config.membership_bind or config.membership_nodes[config.node_id]).rsplit(":", 1)
                membership_runner = EnvelopeAppRunner(membership_app, access_log=None, handle_signals=False)
                await membership_runner.setup()
                runners.append(membership_runner)
                await web.TCPSite(membership_runner, host, int(port), reuse_address=True).start()
        await wait_ready([cluster.urls[n] for n in cluster.ids], timeout_s=20)
        return await asyncio.wait_for(measure(cluster, recorder, args.strength, args.enqueues),
                                      timeout=max(args.timeout - 25, 5))
    finally:
        recorder.stop()
        threading.setprofile(None)
        for _, started_site, _ in started:
            await started_site.stop()
        for node, _, runners in reversed(started):
            await node.stop()
            for runner in runners:
                await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strength", choices=["full", "producer"], default="full")
    parser.add_argument("--enqueues", type=int, default=20)
    parser.add_argument("--show", action="store_true", help="the median enqueue's file visits and pairs")
    parser.add_argument("--out", type=Path, help="append the JSON line to this file")
    parser.add_argument("--timeout", type=float, default=58.0, help="wall limit of the whole run (s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    faulthandler.dump_traceback_later(args.timeout, exit=True)    # the last resort if a stop hangs
    recorder = Recorder()
    with tempfile.TemporaryDirectory(prefix="qcrossings-") as tmp:
        traces = asyncio.run(run_cluster(Path(tmp), recorder, args))
    faulthandler.cancel_dump_traceback_later()
    ordered = sorted(traces, key=lambda trace: trace.crossings)
    median = ordered[(len(ordered) - 1) // 2]
    crossings = [trace.crossings for trace in traces]
    result = {"bench": "enqueue_crossings", "commit": commit(), "strength": args.strength, "enqueues": len(traces),
              "crossings_median": median.crossings, "crossings_min": ordered[0].crossings,
              "crossings_max": ordered[-1].crossings, "files_median": median.files,
              "rooms_median": statistics.median_low(room_crossings(trace.visits)[0] for trace in traces),
              "knot_median": statistics.median_low(room_crossings(trace.visits)[1] for trace in traces),
              "pairs_top": [list(pair) for pair in pairs(median.visits)]}
    lines = [f"{len(traces)} enqueues ({args.strength}): crossings median {median.crossings} (mean "
             f"{statistics.mean(crossings):.1f}), min {ordered[0].crossings}, max {ordered[-1].crossings}; "
             f"{median.files} distinct files in the median one; between rooms {result['rooms_median']}, core <-> "
             f"cluster {result['knot_median']} (medians)", "crossings per enqueue: " + " ".join(map(str, crossings))]
    if args.show:
        lines += ["", "file visits of the median enqueue:", *(f"  {visit}" for visit in median.visits)]
        lines += ["", f"transitions per pair of files (top {TOP_PAIRS}):"]
        lines += [f"  {n:5d}  {a} <-> {b}" for a, b, n in pairs(median.visits)]
    print("\n".join(lines), file=sys.stderr, flush=True)
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        with open(args.out, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
