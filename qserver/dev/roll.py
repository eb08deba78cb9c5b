"""Roll the local demo's three nodes onto the code now on disk, one at a time (docs/OPERATIONS.md,
"Rolling upgrade"), while `python -m qserver.dev.local` runs them:

    python -m qserver.dev.roll [--data-dir data/local] [--release X.Y.Z] [--timeout-s 60]

For each node in turn, the membership leader last: the maintenance drain (its masters hand off to
their in-sync replicas, its replicas stay), SIGTERM to its process (the pid the demo's supervisor
wrote to DATA_DIR/nX.pid), a wait until the supervisor has started it again and it answers
/healthz with the expected release (default: this checkout's, wire/versions.py) and holds a
lease, the undrain, and a wait until every queue it is a member of is in sync again; then the
next. It prints what it does, each handoff's write pause and the longest. It refuses to start
while a queue lacks an in-sync copy (a pair out of sync or a member's node not up): stopping a
node then could lose acknowledged messages or stall a queue.

The drain and undrain go to a node other than the one rolled, through the client library: a
node of 0.1.0 has no maintenance route, and the client drains by per-queue handoffs instead
(client/maintenance.py), so the same roll upgrades a demo that runs the previous release.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import sys
import time
import tomllib
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import AsyncClient, QueueError
from wire.versions import RELEASE

POLL_S = 0.1
RESTART_WAIT_S = 60.0          # SIGTERM, the supervisor's restart (it polls every 0.5 s), start, lease
SYNC_WAIT_S = 60.0             # the restarted node's replicas catch up by log


class RollRefused(Exception):
    """The roll did not start, or stopped before the next node: the message says why."""


@dataclass
class NodeRoll:
    node: str
    handoffs: list[dict[str, Any]] = field(default_factory=list)
    drain_ms: int = 0
    restart_ms: int = 0
    sync_ms: int = 0


@dataclass
class RollReport:
    release: str
    nodes: list[NodeRoll] = field(default_factory=list)

    @property
    def longest_pause_ms(self) -> float | None:
        pauses = [h["pause_ms"] for roll in self.nodes for h in roll.handoffs
                  if isinstance(h.get("pause_ms"), int | float)]
        return max(pauses, default=None)


class Demo:
    """The running demo's nodes as its data directory describes them (LocalCluster's files)."""

    def __init__(self, data_dir: Path, credentials: Path | None = None) -> None:
        self.data_dir = data_dir.resolve()       # the demo names its config files so (LocalCluster's root)
        config = self.data_dir / "n1.toml"
        if not config.exists():
            raise RollRefused(f"no demo cluster in {data_dir} (no n1.toml): start it with python -m qserver.dev.local")
        self.urls: dict[str, str] = dict(tomllib.loads(config.read_text())["cluster"]["nodes"])
        self.credentials = credentials or data_dir / "admin-credentials.json"
        ca = data_dir / "n1" / "tls" / "ca.pem"
        self.ssl_context = ssl.create_default_context(cafile=str(ca)) if ca.exists() else None
        self.ca_file = str(ca) if ca.exists() else None

    def client(self, node: str) -> AsyncClient:
        return AsyncClient(self.urls[node], self.credentials, ca_file=self.ca_file)

    def health(self, node: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.urls[node] + "/healthz", timeout=2, context=self.ssl_context) as answer:
                return dict(json.loads(answer.read()))
        except (OSError, ValueError):
            return {}

    def pid(self, node: str) -> int | None:
        """The node's process now, as the supervisor recorded it, if it still runs that node
        (its command line names the node's config: a pid reused by another process is not it)."""
        config = str(self.data_dir / f"{node}.toml").encode()
        try:
            pid = int((self.data_dir / f"{node}.pid").read_text())
            if config in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
        except (OSError, ValueError):
            pass
        # A demo started by release 0.1.0's qserver.dev.local writes no pid file: the process
        # whose command line runs this very config file (as the README's kill line finds it).
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if config in argv and b"run" in argv:
                    return int(entry.name)
        return None


def _refusals(cluster: dict[str, Any]) -> list[str]:
    up = {n["id"] for n in cluster.get("nodes", []) if n.get("state") == "up"}
    problems = []
    for name, entry in sorted(cluster.get("queues", {}).items()):
        if not entry.get("in_sync"):
            problems.append(f"{name}: its replica on {entry.get('replica')} is not in sync")
        elif entry.get("master") not in up or entry.get("replica") not in up:
            problems.append(f"{name}: a member's node is not up ({entry.get('master')}, {entry.get('replica')})")
    return problems


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise RollRefused(f"gave up after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(POLL_S)


async def roll(demo: Demo, release: str = RELEASE, timeout_s: float = 60.0,
               say: Callable[[str], None] = print) -> RollReport:
    nodes = sorted(demo.urls)
    first = next((n for n in nodes if demo.health(n)), None)
    if first is None:
        raise RollRefused("no node of the demo answers /healthz: is python -m qserver.dev.local running?")
    async with demo.client(first) as client:
        cluster = await client.cluster()
    problems = _refusals(cluster)
    if problems:
        raise RollRefused("not rolling: a queue lacks an in-sync copy, so stopping a node could lose or stall it: "
                          + "; ".join(problems))
    missing = [n for n in nodes if demo.pid(n) is None]
    if missing:
        raise RollRefused(f"no running process of {', '.join(missing)} found (neither {demo.data_dir}/nX.pid "
                          f"nor a process running {demo.data_dir}/nX.toml)")
    leader = cluster.get("leader")
    order = sorted(nodes, key=lambda n: n == leader)
    say(f"rolling {', '.join(order)} (membership leader {leader} last) onto release {release}")
    report = RollReport(release)
    for node in order:
        report.nodes.append(await roll_one(demo, node, release, timeout_s, say))
    longest = report.longest_pause_ms
    say(f"rolled {len(order)} nodes onto {release}; longest write pause of a handoff: "
        + (f"{longest} ms" if longest is not None else "none measured (no queue to hand off)"))
    return report


async def roll_one(demo: Demo, node: str, release: str, timeout_s: float, say: Callable[[str], None]) -> NodeRoll:
    done = NodeRoll(node)
    # Through another node: the one rolled is stopped meanwhile, and one of this release (if any
    # runs yet) does the drain itself and tells the others of it.
    others = sorted((n for n in demo.urls if n != node), key=lambda n: demo.health(n).get("release") != release)
    via = others[0]
    started = time.monotonic()
    async with demo.client(via) as client:
        answer = await client.drain_node_for_maintenance(node, timeout_s)
    done.drain_ms = round((time.monotonic() - started) * 1000)
    done.handoffs = list(answer.get("handoffs", []))
    say(f"{node}: drained in {done.drain_ms} ms (asked through {via})")
    for handoff in done.handoffs:
        say(f"  {handoff['queue']}: master {handoff['from']} -> {handoff['to']}, writes paused "
            f"{handoff.get('pause_ms', '?')} ms")
    pid = demo.pid(node)
    if pid is None:
        raise RollRefused(f"{node}: its process is gone (see {demo.data_dir / (node + '.log')})")
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    say(f"{node}: SIGTERM to pid {pid}; the demo's supervisor starts it again on the code on disk")

    async def back() -> bool:
        health = await asyncio.to_thread(demo.health, node)
        membership = health.get("membership") or {}
        return demo.pid(node) not in (None, pid) and health.get("status") == "ok" \
            and health.get("release") == release and bool(membership.get("lease_valid")) \
            and (membership.get("nodes") or {}).get(node) == "up"
    await _until(back, RESTART_WAIT_S, f"{node} to run again with release {release}")
    done.restart_ms = round((time.monotonic() - started) * 1000)
    say(f"{node}: runs release {release} again (pid {demo.pid(node)}) after {done.restart_ms} ms")
    started = time.monotonic()
    async with demo.client(via) as client:
        await client.undrain_node_from_maintenance(node)

        async def in_sync() -> bool:
            cluster = await client.cluster()
            return all(entry.get("in_sync") for entry in cluster.get("queues", {}).values()
                       if node in (entry.get("master"), entry.get("replica")))
        await _until(in_sync, SYNC_WAIT_S, f"the replicas on {node} to be in sync again")
    done.sync_ms = round((time.monotonic() - started) * 1000)
    say(f"{node}: undrained; its replicas are in sync again after {done.sync_ms} ms")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qserver.dev.roll", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data/local"),
                        help="the running demo's data directory (default data/local)")
    parser.add_argument("--credentials", type=Path, default=None,
                        help="admin credential (default: DATA_DIR/admin-credentials.json)")
    parser.add_argument("--release", default=RELEASE,
                        help=f"the release each restarted node must report (default this checkout's, {RELEASE})")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each node's drain may take this long")
    args = parser.parse_args(argv)
    try:
        asyncio.run(roll(Demo(args.data_dir.resolve(), args.credentials), args.release, args.timeout_s,
                         lambda text: print(text, flush=True)))
    except (RollRefused, QueueError) as error:
        print(f"roll stopped: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
