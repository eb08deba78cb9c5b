"""Scenarios: small declarative TOML files (chaos/scenarios/*.toml) that say what a run does.

    description = "one line"
    nodes = 3                    # 3 to 5
    time_s = 300                 # the workload's time with faults (the run adds start, recovery, settle, drain, audit)
    seed = 1
    recovery_s = 10              # workload after the last heal: the cluster must serve again
    settle_timeout_s = 60        # then every pair must agree, be in sync and caught up within this
    drain_timeout_s = 60         # per queue and member
    op_timeout_s = 8             # a client call that takes longer is recorded unknown
    liveness_stall_max_s = 5.0   # a client may go this long without progress, while it has work, outside faults

    [settings]                   # [node] keys for every node (deploy/node.toml lists them)
    replica_lag_max_ms = 1000

    [[queues]]                   # chaos.workload.QueueSpec
    name = "orders"
    strength = "full"
    type = "queued_ack"          # or one_way: answered before durable, judged as outcome unknown
    placement = ["n1", "n2"]
    producers = 2
    consumers = 2
    push_consumers = 1
    push_hold_s = 0.25           # push consumers hold each message this long: slower than the producers, their
                                 # prefetch window stays full (prefetch x hold under visibility_timeout_s)
    rate = 20
    priorities = [4, 7]
    purge_every_s = 60           # an operator's purge now and then (full only)
    redrive_every_s = 30         # ... and a redrive of the dead letters (full, with dead_letter)

    [[macros]]                   # chaos.workload.MacroSpec: enqueues through a macro queue
    name = "ledger"
    members = ["orders", "audit"]  # queues above (their own consumers take the copies)
    producer = "all"             # the only policy judged: a copy in every member
    producers = 1
    rate = 10

    [[channels]]                 # chaos.workload.ChannelSpec: a `latest` channel
    name = "prices"
    publishers = 1
    subscribers = 2
    rate = 10
    delivery_class = "latest"    # or "durable": each subscriber reads a durable subscription of its own

    [remote]                     # a second cluster (its own Toxiproxy, nemesis and workload) ...
    nodes = 3
    [[remote.queues]]            # its queues (a forward's destination: consumers only, a forward_rate)
    name = "inbox"
    producers = 0
    forward_rate = 60
    [remote.nemesis]             # its faults; kind isolate-cluster cuts it off from everything outside
    kinds = ["kill", "isolate-cluster"]
    [[forwards]]                 # ... and forwards from a queue here (producers only) into one there
    name = "out-in"
    source = "outbox"
    destination = "inbox"
    [nemesis]                    # chaos.nemesis.FaultSpec: faults drawn from the seed ...
    kinds = ["partition-master-replica", "kill", "kill-restart-now"]
    duration_s = [3, 10]
    quiet_s = [2, 6]
    tracks = 1                   # 2+: overlapping faults (combinations)

    [[nemesis.steps]]            # ... or an explicit schedule
    at_s = 5
    kind = "pause"
    duration_s = 4
    target = "master"
    queue = "orders"

A scenario is named by its file or by its name under chaos/scenarios/.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from chaos.liveness import LIVENESS_STALL_MAX_S
from chaos.nemesis import FAULT_KINDS, MODES, RING_NODES_MIN, TARGETS, Fault, FaultSpec, ScheduledFault
from chaos.workload import PUSH_PREFETCH, ChannelSpec, MacroSpec, QueueSpec
from replication.options import QueueType

Spec = TypeVar("Spec", QueueSpec, MacroSpec, ChannelSpec)
SCENARIO_DIRECTORY = Path(__file__).resolve().parent / "scenarios"
TIME_MAX_S = 3_600.0          # a run is bounded
QUEUES_MAX = 16
WORKERS_PER_QUEUE_MAX = 16


@dataclass(frozen=True)
class ForwardSpec:
    """A forward (seed 003) from a queue of the scenario's cluster into a queue of its remote one."""
    name: str
    source: str
    destination: str


@dataclass(frozen=True)
class RemoteSpec:
    """The second cluster of a forwarding scenario: its size, queues and faults."""
    nodes: int = 3
    queues: tuple[QueueSpec, ...] = ()
    nemesis: FaultSpec = FaultSpec()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str = ""
    nodes: int = 3
    time_s: float = 60.0
    seed: int = 1
    recovery_s: float = 8.0
    settle_timeout_s: float = 60.0
    drain_timeout_s: float = 60.0
    op_timeout_s: float = 8.0
    liveness_stall_max_s: float = LIVENESS_STALL_MAX_S
    settings: dict[str, str] = field(default_factory=dict)
    queues: tuple[QueueSpec, ...] = ()
    macros: tuple[MacroSpec, ...] = ()
    channels: tuple[ChannelSpec, ...] = ()
    nemesis: FaultSpec = FaultSpec()
    remote: RemoteSpec | None = None
    forwards: tuple[ForwardSpec, ...] = ()

    def strengths(self) -> dict[str, str]:
        return {queue.name: queue.strength for queue in self.queues}

    def forwarded(self) -> set[str]:
        """The queues a forward judges instead of the per-queue rules: its source (only the
        forwarder takes from it) and its destination (only forwarded messages enter it)."""
        return {q for forward in self.forwards for q in (forward.source, forward.destination)}

    def one_way_queues(self) -> list[str]:
        return [queue.name for queue in self.queues if queue.type == QueueType.ONE_WAY]

    def placement(self) -> dict[str, list[str]]:
        return {queue.name: list(queue.placement) for queue in self.queues if queue.placement}


def scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (SCENARIO_DIRECTORY / f"{name_or_path}.toml", SCENARIO_DIRECTORY / name_or_path):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in SCENARIO_DIRECTORY.glob("*.toml")))
    raise FileNotFoundError(f"no scenario {name_or_path!r} (a file, or one of: {known})")


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIRECTORY.glob("*.toml"))


def load_scenario(name_or_path: str) -> Scenario:
    path = scenario_path(name_or_path)
    return parse_scenario(path.stem, tomllib.loads(path.read_text()))


def parse_scenario(name: str, raw: dict[str, Any]) -> Scenario:
    known = {f.name for f in fields(Scenario)} - {"name"}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"scenario {name}: unknown keys {sorted(unknown)}")
    queues = tuple(_spec(QueueSpec, "queue", entry) for entry in raw.get("queues", []))
    macros = tuple(_spec(MacroSpec, "macro", entry) for entry in raw.get("macros", []))
    channels = tuple(_spec(ChannelSpec, "channel", entry) for entry in raw.get("channels", []))
    scenario = Scenario(
        name=name, description=str(raw.get("description", "")), nodes=int(raw.get("nodes", 3)),
        time_s=float(raw.get("time_s", 60.0)), seed=int(raw.get("seed", 1)),
        recovery_s=float(raw.get("recovery_s", 8.0)), settle_timeout_s=float(raw.get("settle_timeout_s", 60.0)),
        drain_timeout_s=float(raw.get("drain_timeout_s", 60.0)), op_timeout_s=float(raw.get("op_timeout_s", 8.0)),
        liveness_stall_max_s=float(raw.get("liveness_stall_max_s", LIVENESS_STALL_MAX_S)),
        settings={key: _toml_literal(value) for key, value in raw.get("settings", {}).items()},
        queues=queues, macros=macros, channels=channels, nemesis=_nemesis(raw.get("nemesis", {})),
        remote=_remote(raw["remote"]) if "remote" in raw else None,
        forwards=tuple(ForwardSpec(str(f["name"]), str(f["source"]), str(f["destination"]))
                       for f in raw.get("forwards", [])))
    check_scenario(scenario)
    return scenario


def check_scenario(scenario: Scenario) -> None:
    problems = []
    if not 3 <= scenario.nodes <= 5:
        problems.append("nodes must be 3 to 5")
    if not 0 < scenario.time_s <= TIME_MAX_S:
        problems.append(f"time_s must be in (0, {TIME_MAX_S}]")
    if not scenario.queues or len(scenario.queues) > QUEUES_MAX:
        problems.append(f"1 to {QUEUES_MAX} queues")
    if scenario.liveness_stall_max_s <= 0:
        problems.append("liveness_stall_max_s must be positive")
    ids = {f"n{i}" for i in range(1, scenario.nodes + 1)}
    for queue in scenario.queues:
        if queue.strength not in ("full", "producer"):
            problems.append(f"{queue.name}: strength is full or producer")
        if queue.type not in set(QueueType):
            problems.append(f"{queue.name}: type is one of {', '.join(QueueType)}")
        if queue.purge_every_s and queue.strength != "full":
            problems.append(f"{queue.name}: purges in the workload need strength full (ids are the pair's)")
        if queue.redrive_every_s and (queue.strength != "full" or not queue.dead_letter):
            problems.append(f"{queue.name}: redrives in the workload need strength full and a dead-letter queue")
        if queue.placement and (len(set(queue.placement)) != 2 or not set(queue.placement) <= ids):
            problems.append(f"{queue.name}: placement names two different nodes of {sorted(ids)}")
        if max(queue.producers, queue.consumers, queue.push_consumers) > WORKERS_PER_QUEUE_MAX or queue.rate <= 0:
            problems.append(f"{queue.name}: at most {WORKERS_PER_QUEUE_MAX} workers of a kind, a positive rate")
        if queue.push_hold_s and not (queue.push_consumers and 0 < queue.push_hold_s * PUSH_PREFETCH
                                      < queue.visibility_timeout_s):
            # A message waits up to prefetch x hold in the consumer's buffer: past the visibility
            # timeout its lease would expire there and every ack would fail.
            problems.append(f"{queue.name}: push_hold_s needs push consumers, and {PUSH_PREFETCH} x push_hold_s "
                            "under visibility_timeout_s")
    names = {queue.name for queue in scenario.queues}
    for macro in scenario.macros:
        if macro.producer != "all" or not macro.members or not set(macro.members) <= names or macro.name in names:
            problems.append(f"macro {macro.name}: producer all, over queues of the scenario, a name of its own")
        if not 0 < macro.producers <= WORKERS_PER_QUEUE_MAX or macro.rate <= 0:
            problems.append(f"macro {macro.name}: 1 to {WORKERS_PER_QUEUE_MAX} producers, a positive rate")
    for channel in scenario.channels:
        if not 0 < channel.publishers <= WORKERS_PER_QUEUE_MAX or not 0 < channel.subscribers <= WORKERS_PER_QUEUE_MAX \
                or channel.rate <= 0 or channel.delivery_class not in ("latest", "durable"):
            problems.append(f"channel {channel.name}: 1 to {WORKERS_PER_QUEUE_MAX} publishers and subscribers, "
                            "a positive rate, delivery_class latest or durable")
    remote_names = {queue.name for queue in scenario.remote.queues} if scenario.remote else set()
    if scenario.remote is not None and not 3 <= scenario.remote.nodes <= 5:
        problems.append("the remote cluster has 3 to 5 nodes")
    by_name = {queue.name: queue for queue in scenario.queues}
    for forward in scenario.forwards:
        source = by_name.get(forward.source)
        if source is None or source.strength != "full" or source.consumers or source.push_consumers \
                or forward.destination not in remote_names or remote_names & names:
            problems.append(f"forward {forward.name}: from a full queue here without consumers (the forwarder "
                            "is its consumer) into a queue of [remote], the two clusters' queue names apart")
    kinds = set(scenario.nemesis.kinds) | {step.fault.kind for step in scenario.nemesis.steps}
    if "majority-ring" in kinds and scenario.nodes < RING_NODES_MIN:
        problems.append(f"majority-ring needs {RING_NODES_MIN} nodes")
    if problems:
        raise ValueError(f"scenario {scenario.name}: " + "; ".join(problems))


def _remote(raw: dict[str, Any]) -> RemoteSpec:
    unknown = set(raw) - {"nodes", "queues", "nemesis"}
    if unknown:
        raise ValueError(f"[remote]: unknown keys {sorted(unknown)}")
    return RemoteSpec(int(raw.get("nodes", 3)), tuple(_spec(QueueSpec, "queue", entry) for entry in raw.get("queues", [])),
                      _nemesis(raw.get("nemesis", {})))


def _spec(kind: type[Spec], label: str, entry: dict[str, Any]) -> Spec:
    """A `[[queues]]`, `[[macros]]` or `[[channels]]` table as its spec; lists become tuples."""
    known = {f.name for f in fields(kind)}  # type: ignore[arg-type]
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"{label} {entry.get('name')}: unknown keys {sorted(unknown)}")
    values: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value for key, value in entry.items()}
    if "priorities" in values:
        values["priorities"] = tuple(int(p) for p in values["priorities"])
    return kind(**values)


def _pair(value: Any, cast: type) -> Any:
    low, high = value if isinstance(value, list | tuple) else (value, value)
    if cast(low) > cast(high):
        raise ValueError(f"range {value} runs backwards")
    return (cast(low), cast(high))


def _nemesis(raw: dict[str, Any]) -> FaultSpec:
    known = {f.name for f in fields(FaultSpec)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"[nemesis]: unknown keys {sorted(unknown)}")
    values: dict[str, Any] = {}
    for key in ("duration_s", "quiet_s", "handoff_interval_s"):
        if key in raw:
            values[key] = _pair(raw[key], float)
    for key in ("latency_ms", "jitter_ms", "rate_kbs"):
        if key in raw:
            values[key] = _pair(raw[key], int)
    for key in ("kinds", "targets", "scopes"):
        if key in raw:
            values[key] = tuple(raw[key])
    for key in ("tracks",):
        if key in raw:
            values[key] = int(raw[key])
    for key in ("start_s", "end_margin_s"):
        if key in raw:
            values[key] = float(raw[key])
    if "mode" in raw:
        values["mode"] = str(raw["mode"])
    values["steps"] = tuple(_step(step) for step in raw.get("steps", []))
    spec = FaultSpec(**values)
    bad = [k for k in spec.kinds if k not in FAULT_KINDS] + [t for t in spec.targets if t not in TARGETS]
    if bad or spec.mode not in MODES or not 1 <= spec.tracks <= 4:
        raise ValueError(f"[nemesis]: unknown kinds/targets {bad}, mode {spec.mode!r} or tracks {spec.tracks} (1-4)")
    return spec


def _step(raw: dict[str, Any]) -> ScheduledFault:
    values = dict(raw)
    at_s = float(values.pop("at_s"))
    if "handoff_interval_s" in values:
        values["handoff_interval_s"] = _pair(values["handoff_interval_s"], float)
    values["duration_s"] = float(values["duration_s"])
    return ScheduledFault(at_s, Fault(**values))


def _toml_literal(value: Any) -> str:
    """A [settings] value as the TOML literal the node's config file gets."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    raise ValueError(f"setting value {value!r} is not a TOML scalar or list")
