"""A rolling upgrade under traffic, judged as a chaos run is: tests/test_upgrade.py and
bench/bench_upgrade.py.

The cluster is made by the previous release (its `git worktree`, from `releases.toml`, run with
this interpreter: `qserver.dev.devcluster.LocalCluster`'s `code`), serves the chaos workload
(chaos/workload.py: producers, polling and push consumers, a macro queue, a durable channel
subscription, a forward into a queue of the same cluster) and, optionally, one client of the
previous release (tests/upgrade_old_client.py, run from the old tree). Then each node, the
membership leader last, has its masters handed off (mode `drain`; `sigterm` leaves that to
SIGTERM, which hands off by itself; `kill` is kill -9), is stopped, and is started from this
checkout on the same data directory and ports; the next node waits until every pair is in sync
again. Then the cluster is finalized (when this checkout has `AsyncClient.finalize_cluster`),
traffic goes on a little, stops, the cluster settles and is drained, and the history is judged
by chaos.checker and the journals (written first by the old release, then by this one) by the
audit (audit/, docs/AUDIT.md), as `python -m chaos.run` does (chaos/README.md).

Each node's upgrade is recorded in the history as a fault (op `nemesis`, kind `upgrade`) from
the moment its masters are handed off to the moment it is back in sync, so the liveness check
(chaos/liveness.py) allows a client a stall there, and no longer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import checker
from chaos.history import History, read_history, tag_of
from chaos.workload import ChannelSpec, MacroSpec, Observer, QueueSpec, Workload, history_path
from client import AsyncClient, QueueError
from qserver.dev.devcluster import LocalCluster
from replication.cluster_map import CHANNEL_PREFIX
from wire import versions

OLD_CLIENT_SCRIPT = Path(__file__).resolve().parent / "upgrade_old_client.py"
HANDOFF_TIMEOUT_S = 10.0
MASTERS_GONE_TIMEOUT_S = 20.0
POLL_S = 0.1
FINALIZE_TIMEOUT_S = 20.0
POST_CHECK_TIMEOUT_S = 20.0
OLD_CLIENT_STOP_TIMEOUT_S = 60.0


# --- the cluster ------------------------------------------------------------------------------
class RollCluster(LocalCluster):
    """A LocalCluster the chaos workload can drive (its clients dial the nodes directly)."""

    def __init__(self, root: Path, size: int, placement: dict[str, list[str]], settings: dict[str, object],
                 code: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, size, placement, settings, code=code, tls=False)
        self.client_urls = dict(self.urls)
        self.paused: set[str] = set()

    def running(self) -> list[str]:
        return [node for node, process in self.processes.items() if process.poll() is None]


@dataclass
class RollPlan:
    """What runs and how the roll goes."""
    mode: str = "drain"                  # drain (hand off, then SIGTERM) | sigterm | kill (kill -9)
    warmup_s: float = 5.0                # traffic before the first node goes
    between_s: float = 2.0               # traffic between one node back in sync and the next going
    after_s: float = 4.0                 # traffic after the roll and the finalize
    stop_after_drain_s: float = 1.0      # mode drain: traffic between the handoffs and the stop (their
                                         # pauses apart from the stop's: the stopped node is a replica too)
    in_sync_timeout_s: float = 60.0
    settle_timeout_s: float = 60.0
    drain_timeout_s: float = 60.0
    op_timeout_s: float = 8.0
    audit: bool = True
    old_client: bool = True
    finalize: bool = True
    post_checks: bool = True
    seed: int = 34
    settings: dict[str, object] = field(default_factory=lambda: {"replica_replace_after_s": "120.0"})
    queues: list[QueueSpec] = field(default_factory=lambda: [
        QueueSpec("orders", "full", placement=("n1", "n2"), producers=2, consumers=1, push_consumers=1, rate=20,
                  priorities=(4, 7)),
        QueueSpec("events", "producer", placement=("n2", "n3"), producers=2, consumers=2, rate=20),
        # A slow push consumer: a backlog and leases in flight whenever a node goes.
        QueueSpec("backlog", "full", placement=("n3", "n1"), producers=1, consumers=0, push_consumers=1,
                  push_hold_s=0.25, rate=6),
        QueueSpec("ledger-a", "full", placement=("n1", "n3"), producers=0, consumers=1),
        QueueSpec("ledger-b", "producer", placement=("n2", "n1"), producers=0, consumers=1),
        QueueSpec("outbox", "full", placement=("n3", "n2"), producers=1, consumers=0, rate=10),
        QueueSpec("inbox", "full", placement=("n1", "n2"), producers=0, consumers=1, rate=1, forward_rate=200,
                  forward_interval_s=1.0),
    ])
    macros: list[MacroSpec] = field(default_factory=lambda: [
        MacroSpec("ledger", ("ledger-a", "ledger-b"), producers=1, rate=8)])
    channels: list[ChannelSpec] = field(default_factory=lambda: [
        ChannelSpec("feed", publishers=1, subscribers=1, rate=8, delivery_class="durable")])
    forwards: list[tuple[str, str, str]] = field(default_factory=lambda: [("out-in", "outbox", "inbox")])


def _log(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


async def roll_upgrade(root: Path, old_tree: Path, new_tree: Path, plan: RollPlan,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Make a 3-node cluster with `old_tree`, run the workload, roll every node to `new_tree`,
    finalize, then judge: the result holds the checker's verdict, the forwards', the audit's,
    each step of the roll, the longest write pause per queue, the finalize and the post checks."""
    placement = {q.name: list(q.placement) for q in plan.queues if q.placement}
    cluster = await asyncio.to_thread(RollCluster, root / "cluster", 3, placement, plan.settings, old_tree)
    result: dict[str, Any] = {"mode": plan.mode, "old_tree": str(old_tree)}
    old_client: subprocess.Popen[bytes] | None = None
    try:
        await asyncio.to_thread(cluster.start_all)
        result["old_release"] = cluster.health("n1").get("release", "0.1.0 (no release in /healthz)")
        _log(progress, f"cluster of {result['old_release']} up")
        history = History(history_path(root))
        workload = Workload(cluster, history, plan.queues, plan.seed, plan.op_timeout_s,  # type: ignore[arg-type]
                            macros=plan.macros, channels=plan.channels,
                            forwarded=frozenset(source for _, source, _ in plan.forwards))
        observer = Observer(cluster, history)  # type: ignore[arg-type]
        try:
            await workload.create_queues()
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
                for name, source, destination in plan.forwards:
                    await admin.create_forward(name, source, destination)
            if plan.old_client:
                old_client = _start_old_client(cluster, old_tree, root)
            result.update(await _run(cluster, history, workload, observer, new_tree, plan, progress))
            if plan.post_checks:
                result["post_checks"] = await _post_checks(cluster, plan, history)
        finally:
            await workload.close()
            await observer.close()
            history.close()
        result["old_client"] = await asyncio.to_thread(_stop_old_client, old_client, root) if old_client else None
        result["problems"] = cluster.problems()
        await asyncio.to_thread(cluster.kill_all)
        result.update(_judge(root, history, observer, plan, result))
        if plan.audit:
            result["audit"] = await asyncio.to_thread(_audit, cluster, root, result.get("old_client"))
        return result
    finally:
        if old_client is not None and old_client.poll() is None:
            old_client.kill()
        await asyncio.to_thread(cluster.kill_all)


async def _run(cluster: RollCluster, history: History, workload: Workload, observer: Observer, new_tree: Path,
               plan: RollPlan, progress: Callable[[str], None] | None) -> dict[str, Any]:
    stop_workers, stop_observer = asyncio.Event(), asyncio.Event()
    watching = asyncio.create_task(observer.run(stop_observer))
    workers = workload.start(stop_workers)
    outcome: dict[str, Any] = {}
    try:
        await asyncio.sleep(plan.warmup_s)
        leader = await asyncio.to_thread(cluster.membership_leader)
        order = [node for node in cluster.ids if node != leader] + ([leader] if leader else [])
        outcome["order"] = order
        outcome["roll_began_s"] = history.now()
        steps = []
        async with AsyncClient(cluster.urls[order[0]], cluster.credentials_path) as admin:
            for node in order:
                steps.append(await _upgrade_node(cluster, history, observer, admin, node, new_tree, plan))
                _log(progress, f"{node} runs {steps[-1]['release']}: {steps[-1]}")
                await asyncio.sleep(plan.between_s)
        outcome["roll_ended_s"] = history.now()
        outcome["steps"] = steps
        outcome["finalize"] = await _finalize(cluster) if plan.finalize else {"skipped": "not asked"}
        _log(progress, f"finalize: {outcome['finalize']}")
        await asyncio.sleep(plan.after_s)
    finally:
        history.phase = "recovery"
        stop_workers.set()
        await workload.stop_workers(workers)
    outcome["settle"] = await workload.settle(observer, plan.settle_timeout_s)
    _log(progress, f"settle: {outcome['settle']}")
    outcome["drained"] = await workload.drain(observer.newest_map(), plan.drain_timeout_s)
    stop_observer.set()
    await watching
    outcome["final_map_version"] = observer.newest_map().get("version")
    outcome["client_errors"] = workload.errors[:10]
    return outcome


async def _cluster_map(cluster: RollCluster, admin: AsyncClient) -> dict[str, Any]:
    for _ in range(50):
        with contextlib.suppress(QueueError, OSError, TimeoutError):
            return dict(await asyncio.wait_for(admin.cluster(), 3.0))
        await asyncio.sleep(POLL_S)
    raise RuntimeError("no node answered /v1/cluster for 5 s")


async def _upgrade_node(cluster: RollCluster, history: History, observer: Observer, admin: AsyncClient, node: str,
                        new_tree: Path, plan: RollPlan) -> dict[str, Any]:
    """One node: hand off its masters (mode drain), stop it, start it from `new_tree`, wait
    until every pair is in sync again; recorded in the history as a fault (see the module)."""
    began = history.now()
    fault = f"upgrade-{node}"
    history.info("nemesis", "nemesis", event="start", kind="upgrade", fault=fault, began_s=round(began, 6), node=node,
                 mode=plan.mode)
    step: dict[str, Any] = {"node": node}
    if plan.mode == "drain":
        step["handoffs"], step["masters_left"] = await _hand_off_masters(cluster, history, admin, node)
        step["handoff_s"] = round(history.now() - began, 3)
        await asyncio.sleep(plan.stop_after_drain_s)
    stopping = history.now()
    step["drain_window_s"] = [round(began, 3), round(stopping, 3)]
    if plan.mode == "kill":
        await asyncio.to_thread(cluster.kill, node)
        step["exit_code"] = -9
    else:
        step["exit_code"] = await asyncio.to_thread(cluster.stop, node)
    step["stop_s"] = round(history.now() - stopping, 3)
    starting = history.now()
    await asyncio.to_thread(cluster.start, node, code=new_tree)
    step["start_s"] = round(history.now() - starting, 3)
    step["release"] = cluster.health(node).get("release")
    waiting = history.now()
    step["in_sync"] = await _wait_in_sync(cluster, admin, plan.in_sync_timeout_s)
    step["in_sync_s"] = round(history.now() - waiting, 3)
    healed = history.now()
    history.info("nemesis", "nemesis", event="stop", kind="upgrade", fault=fault, healed_s=round(healed, 6))
    step["total_s"] = round(healed - began, 3)
    return step


async def _hand_off_masters(cluster: RollCluster, history: History, admin: AsyncClient,
                            node: str) -> tuple[int, list[str]]:
    """Ask a handoff of every queue `node` masters, then wait (bounded) until it masters none.
    The handoff calls of release 0.1.0 (a maintenance drain needs every node on this release
    to answer it; the first nodes of a roll have peers of the old one)."""
    asked = 0
    deadline = time.monotonic() + MASTERS_GONE_TIMEOUT_S
    while True:
        current = await _cluster_map(cluster, admin)
        # A channel's queue answers a handoff by its queue path with E_RESERVED_NAME (0.1.0 and
        # this release alike): it moves with SIGTERM's own handoffs, or fails over.
        mastered = sorted(q for q, entry in current.get("queues", {}).items()
                          if entry.get("master") == node and entry.get("replica") and not q.startswith(CHANNEL_PREFIX))
        if not mastered or time.monotonic() > deadline:
            return asked, mastered
        for queue in mastered:
            operation = history.invoke("nemesis", "handoff", queue, initiator="master", via="roll")
            try:
                answer = await asyncio.wait_for(admin.handoff(queue), HANDOFF_TIMEOUT_S)
                history.complete(operation, "ok", epoch=answer.get("epoch"), master=answer.get("master"),
                                 replica=answer.get("replica"))
            except QueueError as error:
                history.complete(operation, "unknown" if error.outcome_unknown else "fail",
                                 error=f"{error.code}: {error.message}"[:300])
            except TimeoutError:
                history.complete(operation, "unknown", error="timed out")
            asked += 1
        await asyncio.sleep(POLL_S)


async def _wait_in_sync(cluster: RollCluster, admin: AsyncClient, timeout_s: float) -> bool:
    """Until every node runs, every node sees every queue's pair in sync and agrees on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = []
        for node in cluster.ids:
            health = cluster.health(node)
            if not health:
                break
            views.append(health)
        current = await _cluster_map(cluster, admin)
        queues = current.get("queues", {})
        if len(views) == len(cluster.ids) and queues and all(
                entry.get("in_sync") and entry.get("master") and entry.get("replica") for entry in queues.values()):
            return True
        await asyncio.sleep(POLL_S * 3)
    return False


async def _finalize(cluster: RollCluster) -> dict[str, Any]:
    """Raise the cluster feature level (`qctl cluster finalize`), once every node runs this
    release; the level the map records after. Skipped (and said so) while this checkout has no
    `AsyncClient.finalize_cluster`."""
    if not hasattr(AsyncClient, "finalize_cluster"):
        return {"skipped": "AsyncClient.finalize_cluster does not exist in this checkout"}
    async with AsyncClient(cluster.urls[cluster.ids[0]], cluster.credentials_path) as admin:
        answer = await asyncio.wait_for(admin.finalize_cluster(), FINALIZE_TIMEOUT_S)
        current = await _cluster_map(cluster, admin)
    return {"answer": answer, "map_feature_level": current.get("feature_level"),
            "expected": versions.FEATURE_LEVEL}


# --- the client of the previous release ----------------------------------------------------------
def _start_old_client(cluster: RollCluster, old_tree: Path, root: Path) -> subprocess.Popen[bytes]:
    """tests/upgrade_old_client.py with the old release's code (its client library and chaos
    workload) on the path: it runs until its stdin closes, then drains its queue."""
    document = {"ids": cluster.ids, "urls": cluster.urls, "credentials": str(cluster.credentials_path),
                "history": str(root / "old-client-history.jsonl"), "queue": "legacy"}
    environment = {**os.environ, "PYTHONPATH": str(old_tree)}
    with (root / "old-client.log").open("wb") as log:
        return subprocess.Popen([sys.executable, str(OLD_CLIENT_SCRIPT), json.dumps(document)], cwd=old_tree,
                                env=environment, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)


def _stop_old_client(process: subprocess.Popen[bytes], root: Path) -> dict[str, Any]:
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()
    try:
        code = process.wait(timeout=OLD_CLIENT_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    path = root / "old-client-history.jsonl"
    entries = list(read_history(path)) if path.exists() else []
    verdict = checker.check(entries, {"legacy": "full"}, liveness_stall_max_s=3600.0)
    return {"exit_code": code, "history": str(path), "valid": verdict["valid"] and code == 0,
            "violation_counts": verdict["violation_counts"], "counts": verdict["queues"].get("legacy", {}),
            "log_tail": (root / "old-client.log").read_text(errors="replace")[-1500:] if code else ""}


# --- after the roll ------------------------------------------------------------------------------
async def _post_checks(cluster: RollCluster, plan: RollPlan, history: History) -> dict[str, Any]:
    """On the upgraded cluster, with the workload stopped and the queues drained: an enqueue
    through the macro reaches each member, a value published while a durable subscription is
    closed waits in its backlog, and a message enqueued into a forward's source arrives at its
    destination. What the durable subscription still held of the workload's publishes (its
    reader stops after DURABLE_QUIET_S without a message: one resent after that is still
    there) is taken here and recorded in the history as its reader's, as the drain of a queue
    is: the checker holds the subscription to "every acknowledged publish given by the end"."""
    checks: dict[str, Any] = {}
    async with AsyncClient(cluster.urls[cluster.ids[0]], cluster.credentials_path,
                           request_timeout_s=plan.op_timeout_s) as client:
        for macro in plan.macros:
            answer = await client.enqueue(macro.name, b"after-the-roll|macro", 4, dedupe_id="after-roll-macro")
            got = {}
            for member in macro.members:
                got[member] = await _take_payload(client, member, b"after-the-roll|macro")
            checks[f"macro {macro.name}"] = {"copies": sorted(answer.copies), "taken": got,
                                             "ok": all(got.values()) and sorted(answer.copies) == sorted(macro.members)}
        for channel in plan.channels:
            subscription = channel.subscription(0)
            if subscription is None:
                continue
            await client.advertise(channel.name)
            await client.publish(channel.name, b"after-the-roll|channel", dedupe_id="after-roll-channel")
            await client.subscribe(channel.name, durable=subscription)
            found = False
            left: list[str | None] = []
            deadline = time.monotonic() + POST_CHECK_TIMEOUT_S
            while not found and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    message = await asyncio.wait_for(client.next_channel_message(), 1.0)
                    found = message.payload == b"after-the-roll|channel"
                    if not found:
                        left.append(tag_of(message.payload))
                        history.info(f"drain-{subscription}", "channel_value", channel=channel.name, id=message.id,
                                     tag=tag_of(message.payload), resent=message.resent, subscription=subscription)
                    await message.ack()
            await client.unsubscribe(channel.name)
            checks[f"durable {subscription}"] = {"ok": found, "left_before_it": left[:20]}
        for name, source, destination in plan.forwards:
            await client.enqueue(source, b"after-the-roll|forward", 4, dedupe_id="after-roll-forward")
            checks[f"forward {name}"] = {"ok": await _take_payload(client, destination, b"after-the-roll|forward")}
    return checks


async def _take_payload(client: AsyncClient, queue: str, payload: bytes) -> bool:
    deadline = time.monotonic() + POST_CHECK_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(QueueError, TimeoutError):
            for message in await asyncio.wait_for(client.receive(queue, 10, wait_s=1.0), 5.0):
                await message.ack()
                if message.payload == payload:
                    return True
    return False


# --- the verdicts --------------------------------------------------------------------------------
def _judge(root: Path, history: History, observer: Observer, plan: RollPlan, result: dict[str, Any]) -> dict[str, Any]:
    forwarded = {q for _, source, destination in plan.forwards for q in (source, destination)}
    strengths = {q.name: q.strength for q in plan.queues if q.name not in forwarded}
    judged = checker.check([e for e in history.completed if checker.source_queue(e.get("queue") or "")[0]
                            not in forwarded], strengths, observer.observations, observer.pair_history())
    violations = dict(judged["violation_counts"])
    forwards = {}
    for name, source, destination in plan.forwards:
        verdict = checker.check_forward(history.completed, name, source, destination)
        forwards[name] = verdict["counts"]
        for kind, count in verdict["violation_counts"].items():
            violations[kind] = violations.get(kind, 0) + count
    return {"valid": not violations, "violations": violations, "queues": judged["queues"], "forwards": forwards,
            "duplicates_explained": judged["duplicates_explained"], "macros": judged["macros"],
            "channels": judged["channels"], "liveness_invalidating": judged["liveness"]["invalidating"],
            "history_violations": {k: v[:3] for k, v in judged["violations"].items()},
            "write_pauses": write_pauses(history.completed, [q.name for q in plan.queues if q.producers],
                                         result.get("roll_began_s", 0.0), result.get("roll_ended_s", 0.0),
                                         [step["drain_window_s"] for step in result.get("steps", [])
                                          if plan.mode == "drain"])}


def write_pauses(history: list[dict[str, Any]], queues: list[str], began_s: float, ended_s: float,
                 drains: list[list[float]] | None = None) -> dict[str, Any]:
    """Per queue, the longest gap between successive acknowledged enqueues (by completion time)
    during the roll, where it fell, the same outside the roll for comparison, and the longest
    gap within the time a node's masters were handed off before its stop (`drains`: from the
    first handoff to the stop): the handoffs' own pause."""
    pauses: dict[str, Any] = {}
    for queue in queues:
        done = sorted(e["t_complete"] for e in history if e.get("op") == "enqueue" and e.get("queue") == queue
                      and e.get("status") == "ok" and e.get("t_complete") is not None)
        during, outside = (0.0, None), 0.0
        for earlier, later in zip(done, done[1:], strict=False):
            gap = later - earlier
            if later >= began_s and earlier <= ended_s:
                if gap > during[0]:
                    during = (gap, earlier)
            else:
                outside = max(outside, gap)
        in_drains = [later - earlier for earlier, later in zip(done, done[1:], strict=False)
                     if any(start <= earlier and later <= stop for start, stop in drains or [])]
        span_s = done[-1] - done[0] if len(done) > 1 else 0.0
        pauses[queue] = {"longest_s": round(during[0], 3), "at_s": None if during[1] is None else round(during[1], 3),
                         "longest_outside_roll_s": round(outside, 3), "acknowledged": len(done),
                         "rate_per_s": round(len(done) / span_s, 1) if span_s else None,
                         "longest_during_handoffs_s": round(max(in_drains), 3) if in_drains else None}
    return pauses


def _audit(cluster: RollCluster, root: Path, old_client: dict[str, Any] | None) -> dict[str, Any]:
    """qaudit (pure-Python engine) over every node's journal, with the history of every client
    (this release's workload and the old release's client) joined in one file."""
    from audit.cli import parser, run, write_report
    joined = root / "all-clients-history.jsonl"
    with joined.open("w") as out:
        for path in [history_path(root)] + ([Path(old_client["history"])] if old_client else []):
            if path.exists():
                out.write(path.read_text())
    out_dir = root / "audit"
    arguments = parser().parse_args(["--journals", *(str(cluster.root / node) for node in cluster.ids),
                                     "--history", str(joined), "--out", str(out_dir), "--engine", "python", "--quiet"])
    report = run(arguments)
    write_report(report, out_dir)
    total = report.get("total_queue", {})
    return {"verdict": report["verdict"], "violation_counts": report["violation_counts"],
            "records": report["totals"]["records"],
            **{k: total.get(k) for k in ("enqueued", "acked", "lost", "unexpected", "duplicated", "recovered")}}
