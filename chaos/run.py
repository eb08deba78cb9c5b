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
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos import checker
from chaos.cluster import ChaosCluster
from chaos.history import History
from chaos.nemesis import Nemesis, plan
from chaos.scenario import Scenario, available, load_scenario
from chaos.toxiproxy_server import start as start_toxiproxy
from chaos.workload import Observer, Workload, history_path

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
    toxiproxy = await asyncio.to_thread(start_toxiproxy, backend="auto" if shutil.which("toxiproxy-server")
                                        else "subprocess", seed=scenario.seed, log_path=run_dir / "toxiproxy.log")
    cluster: ChaosCluster | None = None
    try:
        cluster = await asyncio.to_thread(ChaosCluster, run_dir / "cluster", scenario.nodes, toxiproxy,
                                          scenario.placement(), dict(scenario.settings))
        cluster.log_level = log_level
        await asyncio.to_thread(cluster.start_all)
        progress(f"cluster up ({toxiproxy.kind} Toxiproxy, {len(cluster.proxies)} proxies)")
        return await _run_on(scenario, cluster, schedule, rng, run_dir, engine, progress)
    finally:
        if cluster is not None:
            await asyncio.to_thread(cluster.close)
        await asyncio.to_thread(toxiproxy.stop)


async def _run_on(scenario: Scenario, cluster: ChaosCluster, schedule: list[Any], rng: random.Random, run_dir: Path,
                  engine: str, progress: Progress) -> dict[str, Any]:
    history = History(history_path(run_dir))
    workload = Workload(cluster, history, list(scenario.queues), scenario.seed, scenario.op_timeout_s,
                        list(scenario.macros), list(scenario.channels))
    observer = Observer(cluster, history)
    admin_clients: dict[str, Any] = {}

    def admin(node: str) -> Any:
        if node not in admin_clients:
            admin_clients[node] = workload.client(node)
        return admin_clients[node]
    nemesis = Nemesis(cluster, history, rng, observer.newest_map, admin, scenario.fault_targets())
    stop_observer, stop_workers = asyncio.Event(), asyncio.Event()
    try:
        await workload.create_queues()
        watching = asyncio.create_task(observer.run(stop_observer))
        workers = workload.start(stop_workers)
        progress(f"workload started: {len(workers)} workers on {len(scenario.queues)} queues")
        faults = asyncio.create_task(nemesis.run(schedule, 0.0))
        await asyncio.sleep(max(0.0, scenario.time_s - history.now()))
        await faults
        await nemesis.heal_all()
        history.phase = "recovery"
        progress(f"healed after {sum(nemesis.applied.values())} faults {nemesis.applied}; recovering")
        await asyncio.sleep(scenario.recovery_s)
        stop_workers.set()
        await workload.stop_workers(workers)
        settled = await workload.settle(observer, scenario.settle_timeout_s)
        progress(f"settle: {settled}")
        drained = await workload.drain(observer.newest_map(), scenario.drain_timeout_s)
        progress(f"drained: {sum(d['taken'] for d in drained.values())} messages")
        stop_observer.set()
        await watching
        final_map = observer.newest_map()
    finally:
        stop_workers.set()
        stop_observer.set()
        await workload.close()
        await observer.close()
        history.close()
    crashes = list(nemesis.crashes)
    (run_dir / "observations.json").write_text(json.dumps({"masters": sorted(observer.observations),
                                                            "pairs": observer.pair_history()}) + "\n")
    await asyncio.to_thread(_kill_all, cluster)
    judged = checker.check(history.completed, scenario.strengths(), observer.observations, observer.pair_history(),
                           scenario.one_way_queues())
    progress(f"history judged: {'valid' if judged['valid'] else judged['violation_counts']}; auditing the journals")
    try:
        audit = await asyncio.to_thread(run_audit, cluster, run_dir, engine)
    except Exception as error:     # the run's facts stand; an audit that cannot run is a finding
        progress(f"the audit could not run: {error!r}")
        audit = {"verdict": "error", "violation_counts": {"audit_failed": 1}, "totals": {"records": 0},
                 "error": repr(error)[:2000]}
    return verdict(scenario, run_dir, judged, audit, nemesis=dict(nemesis.applied), settled=settled, drained=drained,
                   crashes=crashes, restart_failures=nemesis.restart_failures, final_map=final_map,
                   recovery=_recovery(history.completed, scenario), observer_samples=observer.samples,
                   client_errors=workload.errors)


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


def run_audit(cluster: ChaosCluster, run_dir: Path, engine: str) -> dict[str, Any]:
    """qaudit over every node's journal (exported from its LMDB environment) with the history."""
    from audit.cli import parser, run, write_report
    out = run_dir / "audit"
    arguments = parser().parse_args(["--journals", *(str(cluster.root / node) for node in cluster.ids),
                                     "--history", str(history_path(run_dir)), "--out", str(out),
                                     "--engine", engine, "--quiet", "--master", "local[2]"])
    report = run(arguments)
    write_report(report, out)
    return report


def verdict(scenario: Scenario, run_dir: Path, judged: dict[str, Any], audit: dict[str, Any], **facts: Any) -> dict[str, Any]:
    """Valid when the history shows no violation, the audit is clean, no node crashed, the
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
        "channels": judged["channels"],
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
    for name, calls in result.get("macros", {}).items():
        lines.append(f"macro {name}: {calls['calls']} calls, every copy acknowledged {calls['every_copy_ok']}, "
                     f"some {calls['some_copies_ok']}, none {calls['no_copy_ok']}")
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


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(prog="python -m chaos.run", description="Run a chaos scenario against a real "
                                    "cluster through Toxiproxy and judge it (DESIGN.md 4.7).")
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
        shutil.rmtree(run_dir / "cluster" / "data", ignore_errors=True)
        for node in [f"n{i}" for i in range(1, scenario.nodes + 1)]:
            shutil.rmtree(run_dir / "cluster" / node, ignore_errors=True)
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
