"""`python -m chaos.run SCENARIO [--seed N] [--time S]`: one chaos run, judged.

    start Toxiproxy and a chaos cluster (every link proxied) -> create the queues
    -> workload + observer + the nemesis schedule for `time_s`
    -> heal everything -> `recovery_s` more workload (the cluster must serve again)
    -> settle (pairs agree, in sync, caught up) -> drain every queue (and member, and DLQ)
    -> kill -9 every node -> judge the history (chaos.checker) -> qaudit over the journals

Prints progress on stderr, a summary table on stdout and, as the LAST line of stdout, the
verdict as one JSON object. Exits 0 when the run is valid, 1 on any violation (history,
liveness or audit), 2 when it could not run. Everything it leaves (history.jsonl, the node
logs and configs, verdict.json, the audit report) is in the run directory (`--out`); node data
directories are removed after a valid run unless `--keep-data`.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chaos import checker
from chaos.cluster import ChaosCluster
from chaos.history import History
from chaos.nemesis import Nemesis, plan
from chaos.scenario import Scenario, available, load_scenario
from chaos.toxiproxy_server import start as start_toxiproxy
from chaos.workload import Observer, Workload, history_path
from client import AsyncClient
from replication.cluster_map import CHANNEL_PREFIX

EXIT_VALID, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2
AUDIT_ENGINES = ("python", "spark")


class Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"chaos [{time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)


async def run_scenario(scenario: Scenario, run_dir: Path, *, engine: str = "python",
                       progress: Progress | None = None, log_level: str = "WARNING") -> dict[str, Any]:
    """One run of the scenario; the verdict (see `verdict`)."""
    progress = progress or Progress(quiet=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(scenario.seed)
    schedule = plan(scenario.nemesis, scenario.time_s, rng)
    progress(f"{scenario.name}: seed {scenario.seed}, {scenario.time_s:g} s, {len(schedule)} faults, "
             f"{scenario.nodes} nodes; in {run_dir}")
    backend = "auto" if shutil.which("toxiproxy-server") else "subprocess"
    toxiproxy = await asyncio.to_thread(start_toxiproxy, backend=backend, seed=scenario.seed,
                                        log_path=run_dir / "toxiproxy.log")
    remote_toxiproxy = None
    cluster: ChaosCluster | None = None
    remote: ChaosCluster | None = None
    try:
        cluster = await asyncio.to_thread(ChaosCluster, run_dir / "cluster", scenario.nodes, toxiproxy,
                                          scenario.placement(), dict(scenario.settings))
        cluster.log_level = log_level
        await asyncio.to_thread(cluster.start_all)
        progress(f"cluster up ({toxiproxy.kind} Toxiproxy, {len(cluster.proxies)} proxies)")
        if scenario.remote is not None:
            # A second cluster, with a Toxiproxy of its own (proxy names are per cluster).
            remote_toxiproxy = await asyncio.to_thread(start_toxiproxy, backend=backend, seed=scenario.seed + 1,
                                                       log_path=run_dir / "remote-toxiproxy.log")
            placement = {q.name: list(q.placement) for q in scenario.remote.queues if q.placement}
            remote = await asyncio.to_thread(ChaosCluster, run_dir / "remote", scenario.remote.nodes,
                                             remote_toxiproxy, placement, dict(scenario.settings))
            remote.log_level = log_level
            await asyncio.to_thread(remote.start_all)
            progress(f"remote cluster up ({len(remote.proxies)} proxies)")
        return await _run_on(scenario, cluster, schedule, rng, run_dir, engine, progress, remote)
    finally:
        for started in (remote, cluster):
            if started is not None:
                await asyncio.to_thread(started.close)
        for proxy_server in (remote_toxiproxy, toxiproxy):
            if proxy_server is not None:
                await asyncio.to_thread(proxy_server.stop)


@dataclass
class Side:
    """One cluster of the run with its workload, observer and nemesis (a forwarding scenario
    has two: the forwards' sources here, their destinations in the remote one)."""
    cluster: ChaosCluster
    workload: Workload
    observer: Observer
    nemesis: Nemesis
    schedule: list[Any]

    @classmethod
    def of(cls, cluster: ChaosCluster, history: History, queues: list[Any], seed: int, scenario: Scenario,
           fault_spec: Any, rng: random.Random, fault_prefix: str = "f", **extra: Any) -> Side:
        workload = Workload(cluster, history, queues, seed, scenario.op_timeout_s, forwarded=frozenset(
            f.source for f in scenario.forwards), **extra)
        observer = Observer(cluster, history)
        admin_clients: dict[str, Any] = {}

        def admin(node: str) -> Any:
            if node not in admin_clients:
                admin_clients[node] = workload.client(node)
            return admin_clients[node]
        targets = [q.name for q in queues] + [CHANNEL_PREFIX + c.name for c in extra.get("channels", [])]
        nemesis = Nemesis(cluster, history, rng, observer.newest_map, admin, targets, fault_prefix)
        return cls(cluster, workload, observer, nemesis, plan(fault_spec, scenario.time_s, rng))


async def _run_on(scenario: Scenario, cluster: ChaosCluster, schedule: list[Any], rng: random.Random, run_dir: Path,
                  engine: str, progress: Progress, remote_cluster: ChaosCluster | None = None) -> dict[str, Any]:
    history = History(history_path(run_dir))
    main = Side.of(cluster, history, list(scenario.queues), scenario.seed, scenario, scenario.nemesis, rng,
                   macros=list(scenario.macros), channels=list(scenario.channels))
    main.schedule = schedule
    sides = [main]
    if remote_cluster is not None and scenario.remote is not None:
        sides.append(Side.of(remote_cluster, history, list(scenario.remote.queues), scenario.seed + 1, scenario,
                             scenario.remote.nemesis, random.Random(scenario.seed + 1), fault_prefix="remote-f"))
    stop_observer, stop_workers = asyncio.Event(), asyncio.Event()
    workers: list[asyncio.Task[None]] = []
    settled: dict[str, Any] = {}
    drained: dict[str, Any] = {}
    try:
        for side in sides:
            await side.workload.create_queues()
        if len(sides) > 1:
            await _create_forwards(scenario, cluster, sides[1].cluster)
        watching = [asyncio.create_task(side.observer.run(stop_observer)) for side in sides]
        for side in sides:
            workers += side.workload.start(stop_workers)
        progress(f"workload started: {len(workers)} workers on {sum(len(s.workload.queues) for s in sides)} queues")
        faults = [asyncio.create_task(side.nemesis.run(side.schedule, 0.0)) for side in sides]
        await asyncio.sleep(max(0.0, scenario.time_s - history.now()))
        await asyncio.gather(*faults)
        for side in sides:
            await side.nemesis.heal_all()
        history.phase = "recovery"
        applied = _applied(sides)
        progress(f"healed after {sum(applied.values())} faults {applied}; recovering")
        await asyncio.sleep(scenario.recovery_s)
        stop_workers.set()
        await sides[0].workload.stop_workers(workers)
        for number, side in enumerate(sides):
            outcome = await side.workload.settle(side.observer, scenario.settle_timeout_s)
            settled = outcome if number == 0 else {**settled, "remote": outcome,
                                                   "settled": settled["settled"] and outcome["settled"]}
        progress(f"settle: {settled}")
        for number, side in enumerate(sides):    # sources first: their forwarders empty them into the remote
            outcome = await side.workload.drain(side.observer.newest_map(), scenario.drain_timeout_s)
            drained.update({(f"remote:{key}" if number else key): value for key, value in outcome.items()})
        progress(f"drained: {sum(d['taken'] for d in drained.values())} messages")
        stop_observer.set()
        await asyncio.gather(*watching)
        final_map = main.observer.newest_map()
    finally:
        stop_workers.set()
        stop_observer.set()
        for side in sides:
            await side.workload.close()
            await side.observer.close()
        history.close()
    crashes = [crash for side in sides for crash in side.nemesis.crashes]
    observations = [o for side in sides for o in side.observer.observations]
    pairs = [p for side in sides for p in side.observer.pair_history()]
    (run_dir / "observations.json").write_text(json.dumps({"masters": sorted(observations), "pairs": pairs}) + "\n")
    for side in sides:
        await asyncio.to_thread(_kill_all, side.cluster)
    forwarded = scenario.forwarded()
    strengths = {**scenario.strengths(), **({q.name: q.strength for q in scenario.remote.queues}
                                           if scenario.remote else {})}
    judged = checker.check([e for e in history.completed if checker.source_queue(e.get("queue") or "")[0]
                            not in forwarded],
                           {q: s for q, s in strengths.items() if q not in forwarded}, observations, pairs,
                           scenario.one_way_queues(), scenario.liveness_stall_max_s)
    judged["forwards"] = {}
    for forward in scenario.forwards:
        verdict_of = checker.check_forward(history.completed, forward.name, forward.source, forward.destination)
        judged["forwards"][forward.name] = verdict_of["counts"]
        for kind, count in verdict_of["violation_counts"].items():
            judged["violation_counts"][kind] = judged["violation_counts"].get(kind, 0) + count
            judged["violations"].setdefault(kind, []).extend(verdict_of["violations"][kind])
    judged["valid"] = not judged["violation_counts"]
    progress(f"history judged: {'valid' if judged['valid'] else judged['violation_counts']}; auditing the journals")
    audit = await _audit(cluster, run_dir, engine, history=True, progress=progress)
    if len(sides) > 1:
        # The remote cluster's journals alone: its enqueues are the forwarders', not in the history.
        remote_audit = await _audit(sides[1].cluster, run_dir / "remote", engine, history=False, progress=progress)
        audit = _joined_audits(audit, remote_audit)
    return verdict(scenario, run_dir, judged, audit, nemesis=applied, settled=settled, drained=drained,
                   crashes=crashes, restart_failures=[f for side in sides for f in side.nemesis.restart_failures],
                   final_map=final_map, recovery=_recovery(history.completed, scenario),
                   observer_samples=sum(side.observer.samples for side in sides),
                   client_errors=[error for side in sides for error in side.workload.errors])


def _applied(sides: list[Side]) -> dict[str, int]:
    applied: dict[str, int] = {}
    for number, side in enumerate(sides):
        for kind, count in side.nemesis.applied.items():
            key = f"remote:{kind}" if number else kind
            applied[key] = applied.get(key, 0) + count
    return applied


async def _create_forwards(scenario: Scenario, cluster: ChaosCluster, remote: ChaosCluster) -> None:
    """Each forward, signed at the remote with its admin's credentials, reaching it through its
    client proxies (so `isolate-cluster` cuts the forwarders off)."""
    document = json.loads(remote.credentials_path.read_text())
    credentials = {"client_id": document["client_id"], "private_key": document["private_key"]}
    async with AsyncClient(cluster.client_urls[cluster.ids[0]], cluster.credentials_path) as admin:
        for forward in scenario.forwards:
            await admin.create_forward(forward.name, forward.source, forward.destination,
                                       urls=[remote.client_urls[node] for node in remote.ids], credentials=credentials)


async def _audit(cluster: ChaosCluster, run_dir: Path, engine: str, *, history: bool,
                 progress: Progress) -> dict[str, Any]:
    try:
        return await asyncio.to_thread(run_audit, cluster, run_dir, engine, history)
    except Exception as error:     # the run's facts stand; an audit that cannot run is a finding
        progress(f"the audit could not run: {error!r}")
        return {"verdict": "error", "violation_counts": {"audit_failed": 1}, "totals": {"records": 0},
                "error": repr(error)[:2000]}


def _joined_audits(main: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    """The main cluster's audit, with the remote's verdict, records and violations joined in."""
    joined = dict(main)
    joined["verdict"] = main["verdict"] if remote["verdict"] == "clean" else remote["verdict"]
    joined["violation_counts"] = {**main["violation_counts"],
                                  **{f"remote:{k}": v for k, v in remote["violation_counts"].items()}}
    joined["totals"] = {**main.get("totals", {}), "records": main["totals"]["records"] + remote["totals"]["records"]}
    joined["remote_total_queue"] = remote.get("total_queue", {})
    return joined


def _kill_all(cluster: ChaosCluster) -> None:
    for node in list(cluster.paused):
        cluster.resume(node)
    for node in list(cluster.processes):
        cluster.kill(node)


def _recovery(history: list[dict[str, Any]], scenario: Scenario) -> dict[str, int]:
    """Enqueues acknowledged per queue after the heal: the cluster must serve again."""
    counts = {queue.name: 0 for queue in scenario.queues}
    for entry in history:
        if entry["op"] == "enqueue" and entry["phase"] == "recovery" and entry["status"] == "ok":
            counts[entry["queue"]] += 1
    return counts


def run_audit(cluster: ChaosCluster, run_dir: Path, engine: str, with_history: bool = True) -> dict[str, Any]:
    """qaudit over every node's journal (exported from its LMDB environment) with the history."""
    from audit.cli import parser, run, write_report
    out = run_dir / "audit"
    history = ["--history", str(history_path(run_dir))] if with_history else []
    arguments = parser().parse_args(["--journals", *(str(cluster.root / node) for node in cluster.ids), *history,
                                     "--out", str(out), "--engine", engine, "--quiet", "--master", "local[2]"])
    report = run(arguments)
    write_report(report, out)
    return report


def verdict(scenario: Scenario, run_dir: Path, judged: dict[str, Any], audit: dict[str, Any], **facts: Any) -> dict[str, Any]:
    """Valid when the history shows no violation (its liveness included: no client stalled
    longer than the scenario's limit outside faults), the audit is clean, no node crashed, the
    cluster served after the heal, settled and was drained."""
    violations = dict(judged["violation_counts"])
    for name, count in audit["violation_counts"].items():
        violations[f"audit:{name}"] = count
    if facts["crashes"]:
        violations["node_crashed"] = len(facts["crashes"])
    if not facts["settled"]["settled"]:
        violations["did_not_settle"] = 1
    undrained = [key for key, result in facts["drained"].items() if not result["drained"]]
    if undrained:
        violations["not_drained"] = len(undrained)
    stalled = [queue for queue, count in facts["recovery"].items() if count == 0]
    if stalled:
        violations["no_progress_after_heal"] = len(stalled)
    total_queue = audit.get("total_queue", {})
    return {
        "scenario": scenario.name, "seed": scenario.seed, "time_s": scenario.time_s, "nodes": scenario.nodes,
        "valid": not violations, "violations": violations, "counts": judged["counts"],
        "duplicates_explained": judged["duplicates_explained"], "faults": facts["nemesis"],
        "epochs_observed": judged["epochs_observed"], "observer_samples": facts["observer_samples"],
        "settle": facts["settled"], "undrained": undrained, "recovery_enqueues": facts["recovery"],
        "audit": {"verdict": audit["verdict"], "records": audit["totals"]["records"],
                  **{k: total_queue.get(k) for k in ("enqueued", "acked", "dead_lettered", "purged", "expired", "queued",
                                                     "lost",
                                                     "unexpected", "duplicated", "recovered")},
                  "flags": len(audit.get("flags", []))},
        "crashes": [{k: v for k, v in crash.items() if k != "log_tail"} for crash in facts["crashes"]],
        "restart_failures": len(facts["restart_failures"]), "client_errors": facts["client_errors"][:10],
        "history_violations": judged["violations"], "queues": judged["queues"], "macros": judged["macros"],
        "channels": judged["channels"], "forwards": judged.get("forwards", {}), "liveness": judged["liveness"],
        "remote_audit": audit.get("remote_total_queue"),
        "run_dir": str(run_dir), "date": datetime.date.today().isoformat(),
    }


def summary(result: dict[str, Any]) -> str:
    header = (f"{'queue':<14}{'strength':<10}{'enq ok':>8}{'fail':>6}{'unk':>6}{'deliv':>8}{'lost':>6}"
              f"{'purged':>8}{'expired':>8}{'unexp':>7}{'dup':>6}{'recov':>7}")
    lines = [f"chaos {result['scenario']}  seed {result['seed']}  {result['time_s']:g} s  {result['nodes']} nodes",
             "faults: " + (", ".join(f"{kind} x{count}" for kind, count in sorted(result["faults"].items())) or "none"),
             header, "-" * len(header)]
    for name, queue in result["queues"].items():
        lines.append(f"{name:<14}{queue['strength']:<10}{queue['enqueue_ok']:>8}{queue['enqueue_fail']:>6}"
                     f"{queue['enqueue_unknown']:>6}{queue['delivered']:>8}{queue['lost']:>6}{queue['purged']:>8}"
                     f"{queue.get('expired', 0):>8}{queue['unexpected']:>7}"
                     f"{queue['duplicated']:>6}{queue['recovered']:>7}")
    explained = ", ".join(f"{why} {count}" for why, count in result["duplicates_explained"].items()) or "none"
    audit = result["audit"]
    for name, seen in result.get("channels", {}).items():
        lines.append(f"channel {name}: published {seen['published_ok']} ok / {seen['published_unknown']} unknown / "
                     f"{seen['published_fail']} failed, {seen['values_seen']} values seen by subscribers, "
                     f"{seen['subscribers_at_end']} subscribers recorded at the end")
        for subscription, counts in seen.get("durable", {}).items():
            lines.append(f"  durable {subscription}: given {counts['given']} ({counts['distinct']} distinct, "
                         f"{counts['resent']} resent), acknowledged {counts['acknowledged']}")
    for name, counts in result.get("forwards", {}).items():
        lines.append(f"forward {name}: enqueued {counts['enqueue_ok']} ok / {counts['enqueue_unknown']} unknown / "
                     f"{counts['enqueue_fail']} failed, {counts['delivered_messages']} delivered at the destination "
                     f"({counts['delivered']} deliveries), {counts['recovered']} recovered")
    for name, calls in result.get("macros", {}).items():
        lines.append(f"macro {name}: {calls['calls']} calls, every copy acknowledged {calls['every_copy_ok']}, "
                     f"some {calls['some_copies_ok']}, none {calls['no_copy_ok']}")
    lines += liveness_summary(result["liveness"])
    lines += [f"duplicates explained: {explained}",
              f"epochs observed: {result['epochs_observed']} ({result['observer_samples']} map samples); "
              f"settled: {result['settle']['settled']} in {result['settle']['settle_s']} s; "
              f"undrained: {result['undrained'] or 'none'}",
              f"audit: {audit['verdict']} ({audit['records']} records; enqueued {audit['enqueued']}, acked "
              f"{audit['acked']}, purged {audit['purged']}, expired {audit.get('expired')}, lost {audit['lost']}, unexpected {audit['unexpected']}, duplicated "
              f"{audit['duplicated']}, recovered {audit['recovered']}, flags {audit['flags']})",
              "violations: " + (", ".join(f"{k} {v}" for k, v in result["violations"].items()) or "none"),
              f"VERDICT: {'VALID' if result['valid'] else 'INVALID'}   (run directory {result['run_dir']})"]
    return "\n".join(lines)


def liveness_summary(liveness: dict[str, Any]) -> list[str]:
    """Per client its longest stall (no progress while it had work) and the longest part of a
    stall outside every fault window; then the stalls that invalidate the run."""
    limit = liveness["stall_max_s"]
    lines = [f"liveness: {len(liveness['fault_windows'])} fault windows; a stall outside them may last "
             f"{limit:g} s at most",
             f"  {'client':<30}{'role':<10}{'progress':>9}{'longest stall':>15}{'outside faults':>16}"]
    for process, client in liveness["clients"].items():
        lines.append(f"  {process:<30}{client['role']:<10}{client['progress']:>9}{client['longest_stall_s']:>13.2f} s"
                     f"{client['longest_outside_faults_s']:>14.2f} s")
    for stall in liveness["invalidating"]:
        after = f"{stall['after_heal_at']:.2f} s (a heal)" if stall["after_heal_at"] is not None else \
            f"{stall['outside_from']:.2f} s (quiet time)"
        lines.append(f"  STALLED: {stall['process']} made no progress from {stall['stall_from']:.2f} to "
                     f"{stall['stall_to']:.2f} s with work waiting, {stall['outside_faults_s']:.2f} s of it "
                     f"outside faults, from {after}")
    return lines


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(prog="python -m chaos.run", description="Run a chaos scenario against a real "
                                    "cluster through Toxiproxy and judge it (chaos/README.md).")
    parse.add_argument("scenario", help=f"a scenario file or name ({', '.join(available())})")
    parse.add_argument("--seed", type=int, help="seed of the fault schedule and the workload (default: the scenario's)")
    parse.add_argument("--time", type=float, dest="time_s", help="seconds of workload with faults (default: the scenario's)")
    parse.add_argument("--out", type=Path, help="run directory (default: a new one under the temp directory)")
    parse.add_argument("--spark", action="store_true", help="audit with Spark (local[2]) instead of the pure path")
    parse.add_argument("--keep-data", action="store_true", help="keep the nodes' data directories after a valid run")
    parse.add_argument("--results", type=Path, help="append the verdict (the last line) to this JSON-lines file")
    parse.add_argument("--log-level", default="WARNING", help="the nodes' log level (their logs stay in the run "
                       "directory)")
    parse.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parse


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    try:
        scenario = load_scenario(arguments.scenario)
        overrides: dict[str, Any] = {k: v for k, v in (("seed", arguments.seed), ("time_s", arguments.time_s))
                                     if v is not None}
        scenario = replace(scenario, **overrides)
    except (FileNotFoundError, ValueError) as error:
        print(f"chaos.run: {error}", file=sys.stderr)
        return EXIT_ERROR
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = arguments.out or Path(tempfile.gettempdir()) / "qcluster-chaos" / f"{scenario.name}-seed{scenario.seed}-{stamp}"
    progress = Progress(arguments.quiet)
    try:
        result = asyncio.run(run_scenario(scenario, run_dir, engine="spark" if arguments.spark else "python",
                                          progress=progress, log_level=arguments.log_level))
    except Exception as error:     # reported as a run that could not complete, with its reason
        print(f"chaos.run: the run could not complete: {error!r}", file=sys.stderr)
        print(json.dumps({"scenario": scenario.name, "seed": scenario.seed, "valid": False, "error": str(error)[:2000],
                          "run_dir": str(run_dir)}))
        return EXIT_ERROR
    (run_dir / "verdict.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["valid"] and not arguments.keep_data:
        for side, nodes in (("cluster", scenario.nodes), ("remote", scenario.remote.nodes if scenario.remote else 0)):
            shutil.rmtree(run_dir / side / "data", ignore_errors=True)
            for node in [f"n{i}" for i in range(1, nodes + 1)]:
                shutil.rmtree(run_dir / side / node, ignore_errors=True)
        shutil.rmtree(run_dir / "audit" / "exported", ignore_errors=True)
    print(summary(result))
    compact = {k: v for k, v in result.items() if k not in ("history_violations", "queues")}
    line = json.dumps(compact, separators=(",", ":"))
    if arguments.results is not None:
        with arguments.results.open("a") as results:
            results.write(line + "\n")
    print(line, flush=True)
    return EXIT_VALID if result["valid"] else EXIT_VIOLATIONS


if __name__ == "__main__":
    sys.exit(main())
