"""Nemeses: the faults a chaos run injects, and the seeded schedule that orders them.

Each fault starts, lasts a bounded time and is healed by the fault itself; `heal_all` at the
end of a run undoes whatever is left (every proxy clean, every paused node resumed, every
killed or crashed node started again). Faults act through the chaos cluster (chaos.cluster):

    partition-master-replica   cut every link between a queue's master and its replica
    isolate-node               cut one node (a queue's master, the membership leader, ...) from all others
    partition-halves           cut the cluster in two random halves
    majority-ring              5+ nodes in a random ring, each linked only to its two neighbours:
                               every node sees a majority, no two see the same one
    latency                    delay (with jitter) on every link of a node, or of the whole cluster
    bandwidth                  a rate limit on every link of a node
    kill                       kill -9 a node, start it again after the fault's duration
    kill-restart-now           kill -9 a node and start it again at once (after 0 to 0.5 s drawn
                               from the seed), as systemd's Restart=always does: the fault's
                               duration is that delay
    pause                      SIGSTOP a node for longer than its lease, then SIGCONT
    handoff-storm              handoffs asked every fraction of a second, by either member
    isolate-cluster            cut every client link of the cluster: nothing outside reaches it (a
                               partition between clusters, for a forward into it)

A cut is a toxic on both streams of each of the link's proxies: `timeout` (mode "drop": data
vanishes, the connection stays: a black hole) or `reset_peer` (mode "reject": connections are
reset at once). Every fault names its toxics after itself, so overlapping faults compose and
heal independently.

Targets (a node) are resolved when the fault starts, from the newest cluster map the observer
has seen, with the run's seeded random generator. `plan` draws the schedule from the seed:
faults of the scenario's kinds with durations and quiet gaps from its ranges, on one track
or several overlapping ones (combinations), all ending before the run's end.

Every fault is recorded in the history (status info, op `nemesis`): `start` (with `began_s`,
when the nemesis began applying it), `error` (it could not start; it may have acted half-way)
and `stop` (with `healed_s`, when undoing it had finished: a killed node answers again), each
naming the fault; the liveness check (chaos/liveness.py) reads its fault windows from them.

Everything blocking (toxiproxy-python, signals, starting a node) runs in a thread
(`asyncio.to_thread`), never on the event loop.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.cluster import ChaosCluster, client_proxy
from chaos.history import History
from client import AsyncClient, QueueError

log = logging.getLogger("chaos.nemesis")

NETWORK_KINDS = ("partition-master-replica", "isolate-node", "partition-halves", "majority-ring", "latency",
                 "bandwidth")
KILL_KINDS = ("kill", "kill-restart-now")
PROCESS_KINDS = (*KILL_KINDS, "pause")
FAULT_KINDS = (*NETWORK_KINDS, *PROCESS_KINDS, "handoff-storm", "isolate-cluster")
TARGETS = ("master", "replica", "leader", "random", "non-member")
MODES = ("drop", "reject", "mixed")
HANDOFF_TIMEOUT_S = 10.0
RESTART_ATTEMPTS_MAX = 3
RESTART_PAUSE_S = 1.0
WATCH_INTERVAL_S = 0.5
FAULTS_MAX = 1_000            # a schedule never holds more (bounded runs)
RING_NODES_MIN = 5
RESTART_NOW_DELAY_MAX_S = 0.5  # kill-restart-now: systemd's Restart=always waits RestartSec (100 ms by default)

MapSource = Callable[[], dict[str, Any]]
ClientFactory = Callable[[str], AsyncClient]


@dataclass(frozen=True)
class Fault:
    kind: str
    duration_s: float
    target: str = "random"          # for node faults: see TARGETS, or a node id
    queue: str | None = None        # whose master/replica; None: a random queue
    mode: str = "drop"              # for cuts: see MODES
    latency_ms: int = 200
    jitter_ms: int = 50
    rate_kbs: int = 100
    scope: str = "node"             # latency/bandwidth: "node" (its links) or "all"
    handoff_interval_s: tuple[float, float] = (0.2, 1.0)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (known: {', '.join(FAULT_KINDS)})")
        if self.mode not in MODES:
            raise ValueError(f"unknown cut mode {self.mode!r}")
        if self.kind == "kill-restart-now":
            if not 0 <= self.duration_s <= RESTART_NOW_DELAY_MAX_S:
                raise ValueError(f"kill-restart-now starts the node again within {RESTART_NOW_DELAY_MAX_S} s")
        elif self.duration_s <= 0:
            raise ValueError("a fault lasts a positive time")


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float
    fault: Fault
    track: int = 0


@dataclass(frozen=True)
class FaultSpec:
    """How a scenario draws its faults (the `[nemesis]` table)."""
    kinds: tuple[str, ...] = ()
    duration_s: tuple[float, float] = (3.0, 10.0)
    quiet_s: tuple[float, float] = (2.0, 6.0)
    tracks: int = 1
    start_s: float = 3.0
    end_margin_s: float = 2.0
    targets: tuple[str, ...] = ("master", "replica", "leader", "random")
    mode: str = "drop"
    latency_ms: tuple[int, int] = (50, 400)
    jitter_ms: tuple[int, int] = (0, 100)
    rate_kbs: tuple[int, int] = (20, 500)
    scopes: tuple[str, ...] = ("node",)
    handoff_interval_s: tuple[float, float] = (0.2, 1.0)
    steps: tuple[ScheduledFault, ...] = ()


def plan(spec: FaultSpec, time_s: float, rng: random.Random) -> list[ScheduledFault]:
    """The run's faults, in start order: `spec.steps` as given (those ending by `time_s`), or
    drawn from the seed on `spec.tracks` tracks, each fault followed by a quiet gap."""
    if spec.steps:
        return sorted((s for s in spec.steps if s.at_s + s.fault.duration_s <= time_s), key=lambda s: s.at_s)
    if not spec.kinds:
        return []
    schedule: list[ScheduledFault] = []
    end = time_s - spec.end_margin_s
    for track in range(spec.tracks):
        at = spec.start_s + (rng.uniform(*spec.quiet_s) if track else 0.0)
        while len(schedule) < FAULTS_MAX:
            duration = round(rng.uniform(*spec.duration_s), 2)
            if at + duration > end:
                break
            fault = _draw_fault(spec, rng, duration)
            schedule.append(ScheduledFault(round(at, 2), fault, track))
            at += fault.duration_s + rng.uniform(*spec.quiet_s)
    return sorted(schedule, key=lambda s: (s.at_s, s.track))


def _draw_fault(spec: FaultSpec, rng: random.Random, duration_s: float) -> Fault:
    kind = rng.choice(spec.kinds)
    mode = rng.choice(("drop", "reject")) if spec.mode == "mixed" else spec.mode
    target, latency_ms, jitter_ms = rng.choice(spec.targets), rng.randint(*spec.latency_ms), rng.randint(*spec.jitter_ms)
    rate_kbs, scope = rng.randint(*spec.rate_kbs), rng.choice(spec.scopes)
    if kind == "kill-restart-now":     # drawn last, so schedules without this kind stay as they were
        duration_s = round(rng.uniform(0.0, RESTART_NOW_DELAY_MAX_S), 3)
    return Fault(kind, duration_s, target=target, mode=mode, latency_ms=latency_ms, jitter_ms=jitter_ms,
                 rate_kbs=rate_kbs, scope=scope, handoff_interval_s=spec.handoff_interval_s)


@dataclass
class _Active:
    """What a started fault did, so that it can undo exactly that."""
    fault: Fault
    name: str
    toxics: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)   # (proxy, name, streams)
    killed: str | None = None
    paused: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Nemesis:
    def __init__(self, cluster: ChaosCluster, history: History, rng: random.Random, current_map: MapSource,
                 admin_client: ClientFactory, queues: list[str], fault_prefix: str = "f") -> None:
        """`fault_prefix` starts the name of each fault it records: two nemeses writing one
        history (a remote cluster's) keep their faults apart."""
        self.cluster = cluster
        self.history = history
        self.rng = rng
        self.current_map = current_map
        self.admin_client = admin_client
        self.queues = queues
        self.applied: dict[str, int] = {}
        self.crashes: list[dict[str, Any]] = []     # nodes that exited by themselves
        self.restart_failures: list[dict[str, Any]] = []
        self._names = (f"{fault_prefix}{number}" for number in itertools.count(1))
        self._busy: set[str] = set()                 # nodes under a process fault
        self._active: list[_Active] = []

    # --- running a schedule ------------------------------------------------------------------
    async def run(self, schedule: list[ScheduledFault], started_at: float) -> None:
        """Every fault at its time (seconds after `started_at`, the history's clock), each
        healed after its duration; returns when the last one is healed."""
        watch = asyncio.create_task(self._watch_crashes())
        try:
            await asyncio.gather(*(self._one(item, started_at) for item in schedule))
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _one(self, item: ScheduledFault, started_at: float) -> None:
        await asyncio.sleep(max(0.0, started_at + item.at_s - self.history.now()))
        active = await self.start(item.fault)
        if active is None:
            return
        try:
            if item.fault.kind == "handoff-storm":
                await self._handoff_storm(item.fault, active)
            else:
                await asyncio.sleep(item.fault.duration_s)
        finally:
            await self.stop(active)

    async def start(self, fault: Fault) -> _Active | None:
        active = _Active(fault, next(self._names))
        began_s = round(self.history.now(), 6)     # the record follows the fault's first effect
        try:
            started = await self._start(active)
        except Exception as error:        # a fault that cannot start is recorded, the run goes on
            log.exception("fault %s could not start", fault.kind)
            self.history.info("nemesis", "nemesis", event="error", kind=fault.kind, fault=active.name,
                              began_s=began_s, error=repr(error))
            await self.stop(active)
            return None
        if not started:
            self.history.info("nemesis", "nemesis", event="skipped", kind=fault.kind, **active.detail)
            return None
        self.applied[fault.kind] = self.applied.get(fault.kind, 0) + 1
        self._active.append(active)
        self.history.info("nemesis", "nemesis", event="start", kind=fault.kind, fault=active.name,
                          began_s=began_s, duration_s=fault.duration_s, **active.detail)
        return active

    async def stop(self, active: _Active) -> None:
        try:
            await asyncio.to_thread(self._undo, active)
        finally:
            if active in self._active:
                self._active.remove(active)
        self.history.info("nemesis", "nemesis", event="stop", kind=active.fault.kind, fault=active.name,
                          healed_s=round(self.history.now(), 6))

    async def heal_all(self) -> None:
        """Undo every fault still on, then make sure every proxy is clean and every node runs."""
        for active in list(self._active):
            await self.stop(active)
        await asyncio.to_thread(self._heal_everything)
        self.history.info("nemesis", "nemesis", event="healed")

    # --- starting faults ---------------------------------------------------------------------
    async def _start(self, active: _Active) -> bool:
        fault = active.fault
        kind = fault.kind
        if kind == "handoff-storm":
            return True
        if kind == "isolate-cluster":
            await asyncio.to_thread(self._cut_clients, active)
            return True
        if kind in PROCESS_KINDS:
            node = self._target(fault, exclude=self._busy)
            active.detail["node"] = node
            if node is None:
                return False
            self._busy.add(node)
            return await asyncio.to_thread(self._process_fault, active, node)
        pairs, detail = self._network_plan(fault)
        active.detail.update(detail)
        if kind in ("latency", "bandwidth"):
            await asyncio.to_thread(self._slow_links, active, pairs)
        elif pairs:
            await asyncio.to_thread(self._cut, active, pairs)
        return bool(pairs)

    def _network_plan(self, fault: Fault) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        """The node pairs a network fault acts on, and how it chose them."""
        ids = list(self.cluster.ids)
        kind = fault.kind
        if kind == "partition-master-replica":
            queue = fault.queue or self.rng.choice(self.queues)
            entry = self.current_map().get("queues", {}).get(queue, {})
            master, replica = entry.get("master"), entry.get("replica")
            if not master or not replica:
                return [], {"queue": queue, "why": "the map names no pair yet"}
            return [(master, replica)], {"queue": queue, "master": master, "replica": replica}
        if kind in ("isolate-node", "latency", "bandwidth") and not (kind != "isolate-node" and fault.scope == "all"):
            node = self._target(fault)
            if node is None:
                return [], {"why": "no target"}
            return [(node, other) for other in ids if other != node], {"node": node}
        if kind in ("latency", "bandwidth"):
            return list(itertools.combinations(ids, 2)), {"node": "all"}
        if kind == "partition-halves":
            shuffled = self.rng.sample(ids, len(ids))
            half = len(ids) // 2
            first, second = sorted(shuffled[:half]), sorted(shuffled[half:])
            return [(a, b) for a in first for b in second], {"halves": [first, second]}
        if kind == "majority-ring":
            if len(ids) < RING_NODES_MIN:
                raise ValueError(f"a majority ring needs {RING_NODES_MIN}+ nodes (in a smaller ring all are linked)")
            ring = self.rng.sample(ids, len(ids))
            neighbours = {frozenset((ring[i], ring[(i + 1) % len(ring)])) for i in range(len(ring))}
            cut = [(a, b) for a, b in itertools.combinations(ids, 2) if frozenset((a, b)) not in neighbours]
            return cut, {"ring": ring}
        raise ValueError(f"not a network fault: {kind}")

    def _target(self, fault: Fault, exclude: set[str] | None = None) -> str | None:
        """A node for a node fault, from the newest map: the queue's master or replica, the
        membership leader, a node that is no member of the queue, or any; `exclude`d nodes
        (already under a process fault) are avoided."""
        exclude = exclude or set()
        if fault.target in self.cluster.ids:
            return None if fault.target in exclude else fault.target
        current = self.current_map()
        queue = fault.queue or self.rng.choice(self.queues)
        entry = current.get("queues", {}).get(queue, {})
        running = [n for n in self.cluster.ids if n in self.cluster.processes and n not in exclude]
        wanted: str | None = None
        if fault.target in ("master", "replica"):
            wanted = entry.get(fault.target)
        elif fault.target == "leader":
            wanted = current.get("leader")
        elif fault.target == "non-member":
            others = [n for n in running if n not in (entry.get("master"), entry.get("replica"))]
            wanted = self.rng.choice(others) if others else None
        if wanted in running:
            return wanted
        return self.rng.choice(running) if running else None

    # --- blocking halves (threads) ------------------------------------------------------------
    def _cut(self, active: _Active, pairs: list[tuple[str, str]]) -> None:
        toxic, attributes = ("timeout", {"timeout": 0}) if active.fault.mode == "drop" else ("reset_peer", {"timeout": 0})
        active.detail["mode"] = active.fault.mode
        for first, second in pairs:
            for proxy in self.cluster.links_between(first, second):
                self._add(active, proxy, toxic, attributes)

    def _cut_clients(self, active: _Active) -> None:
        toxic, attributes = ("timeout", {"timeout": 0}) if active.fault.mode == "drop" else ("reset_peer", {"timeout": 0})
        active.detail["mode"] = active.fault.mode
        for node in self.cluster.ids:
            self._add(active, client_proxy(node), toxic, attributes)

    def _slow_links(self, active: _Active, pairs: list[tuple[str, str]]) -> None:
        fault = active.fault
        if fault.kind == "latency":
            toxic, attributes = "latency", {"latency": fault.latency_ms, "jitter": min(fault.jitter_ms, fault.latency_ms)}
        else:
            toxic, attributes = "bandwidth", {"rate": fault.rate_kbs}
        active.detail.update(attributes)
        for first, second in pairs:
            for proxy in self.cluster.links_between(first, second):
                self._add(active, proxy, toxic, attributes)

    def _add(self, active: _Active, proxy: str, toxic: str, attributes: dict[str, int]) -> None:
        streams = ("upstream", "downstream")
        active.toxics.append((proxy, active.name, streams))    # first: a half-added toxic is removed too
        self.cluster.add_toxic(proxy, toxic, attributes, name=active.name, streams=streams)

    def _process_fault(self, active: _Active, node: str) -> bool:
        if active.fault.kind in KILL_KINDS:
            self.cluster.kill(node)
            active.killed = node
            return True
        if self.cluster.pause(node):
            active.paused = node
            return True
        self._busy.discard(node)
        return False

    def _undo(self, active: _Active) -> None:
        for proxy, name, streams in active.toxics:
            for stream in streams:
                try:
                    self.cluster.remove_toxic(proxy, name=name, streams=(stream,))
                except Exception:   # never added (the add failed half-way): nothing to remove
                    log.debug("no toxic %s-%s on %s", name, stream, proxy)
        active.toxics.clear()
        if active.paused is not None:
            self.cluster.resume(active.paused)
            self._busy.discard(active.paused)
            active.paused = None
        if active.killed is not None:
            self._restart(active.killed)
            self._busy.discard(active.killed)
            active.killed = None

    def _restart(self, node: str) -> None:
        for attempt in range(1, RESTART_ATTEMPTS_MAX + 1):
            try:
                self.cluster.start(node, wait=False)
                return
            except RuntimeError as error:
                log.warning("restart of %s failed (attempt %d): %s", node, attempt, error)
                self.restart_failures.append({"node": node, "attempt": attempt, "error": str(error)[-2000:]})
                self.cluster.processes.pop(node, None)
                if attempt < RESTART_ATTEMPTS_MAX:
                    time.sleep(RESTART_PAUSE_S)

    def _heal_everything(self) -> None:
        self.cluster.heal_links()
        for node in list(self.cluster.paused):
            self.cluster.resume(node)
        self._collect_crashes()
        for node in self.cluster.ids:
            if node not in self.cluster.processes:
                self._restart(node)
        self._busy.clear()

    def _collect_crashes(self) -> None:
        for node, code in self.cluster.exited().items():
            log_path = self.cluster.root / f"{node}.log"
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            self.crashes.append({"node": node, "exit_code": code, "at": round(self.history.now(), 3), "log_tail": tail})
            self.history.info("nemesis", "crash", node=node, exit_code=code)
            self.cluster.processes.pop(node, None)

    async def _watch_crashes(self) -> None:
        """A node that exits by itself is a finding; it is started again so the run goes on."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self.cluster.exited():
                continue
            crashed = list(self.cluster.exited())
            await asyncio.to_thread(self._collect_crashes)
            for node in crashed:
                if node not in self._busy:
                    await asyncio.to_thread(self._restart, node)

    # --- the handoff storm (on the loop: it is client traffic) --------------------------------
    async def _handoff_storm(self, fault: Fault, active: _Active) -> None:
        deadline = self.history.now() + fault.duration_s
        asked = 0
        while self.history.now() < deadline and asked < FAULTS_MAX:
            queue = fault.queue or self.rng.choice(self.queues)
            initiator = self.rng.choice(("master", "replica"))
            running = [n for n in self.cluster.ids if n in self.cluster.processes and n not in self.cluster.paused]
            if running:
                await self.handoff(queue, initiator, self.rng.choice(running))
                asked += 1
            await asyncio.sleep(min(self.rng.uniform(*fault.handoff_interval_s), max(0.0, deadline - self.history.now())))
        active.detail["handoffs"] = asked

    async def handoff(self, queue: str, initiator: str, via: str) -> None:
        operation = self.history.invoke("nemesis", "handoff", queue, initiator=initiator, via=via)
        client = self.admin_client(via)
        try:
            answer = await asyncio.wait_for(client.handoff(queue, initiator=initiator), HANDOFF_TIMEOUT_S)
            self.history.complete(operation, "ok", epoch=answer.get("epoch"), master=answer.get("master"),
                                  replica=answer.get("replica"))
        except QueueError as error:
            self.history.complete(operation, "unknown" if error.outcome_unknown else "fail",
                                  error=f"{error.code}: {error.message}"[:300])
        except TimeoutError:
            self.history.complete(operation, "unknown", error="timed out")

