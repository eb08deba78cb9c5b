"""Rolling upgrade of 3 nodes under load (issue 34's measure): the previous release of
`releases.toml` rolled to this checkout while producers and consumers keep a `full` and a
`producer` queue busy, per roll mode:

    drain     each node's masters handed off first (the operator's roll), then SIGTERM
    sigterm   SIGTERM alone (the node hands its masters off as it stops)
    kill      kill -9 (no handoff: the pairs fail over after the lease)

Per run and queue: the longest write pause during the roll (the longest gap between
successive acknowledged enqueues), acknowledged messages lost and duplicates (chaos.checker
over the history), and the audit's verdict over the journals when `--audit`. Prints one JSON
line per run and, at the end, per mode and queue the median of the runs and their spread.
The roll itself is tests/upgrade_roll.py's, which the upgrade test (tests/test_upgrade.py)
runs with a small workload.

    .venv/bin/python -m bench.bench_upgrade --rate 1000 --runs 2 --modes drain,kill
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos.workload import QueueSpec
from qserver.dev.devcluster import REPOSITORY
from tests.upgrade_roll import RollPlan, roll_upgrade
from tests.upgrade_support import previous_release, release_tree, skip_reason

MODES = ("drain", "sigterm", "kill")
PRODUCER_RATE_MAX = 25.0         # messages/s one producer task sends (one call at a time: more tasks, more in flight)


def plan_for(mode: str, rate: float, audit: bool) -> RollPlan:
    """`rate` messages/s on each of a `full` and a `producer` queue, shared by producers of at
    most PRODUCER_RATE_MAX each, with consumers enough to keep up."""
    producers = max(1, int(-(-rate // PRODUCER_RATE_MAX)))
    each = rate / producers
    queues = [QueueSpec("hot-full", "full", placement=("n1", "n2"), producers=producers, consumers=2,
                        push_consumers=2, rate=each, receive_max=50, release_fraction=0.0, abandon_fraction=0.0,
                        extend_fraction=0.0),
              QueueSpec("hot-producer", "producer", placement=("n2", "n3"), producers=producers, consumers=2,
                        push_consumers=2, rate=each, receive_max=50, release_fraction=0.0, abandon_fraction=0.0,
                        extend_fraction=0.0)]
    return RollPlan(mode=mode, warmup_s=5.0, between_s=3.0, after_s=3.0, audit=audit, old_client=False,
                    post_checks=False, queues=queues, macros=[], channels=[], forwards=[],
                    in_sync_timeout_s=90.0, settle_timeout_s=90.0, drain_timeout_s=120.0)


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    queues = result.get("queues", {})
    return {"mode": result["mode"], "valid": result.get("valid"), "violations": result.get("violations"),
            "audit": (result.get("audit") or {}).get("verdict"),
            "steps": [{k: step.get(k) for k in ("node", "handoff_s", "stop_s", "start_s", "in_sync_s", "total_s")}
                      for step in result.get("steps", [])],
            "per_queue": {name: {"longest_write_pause_s": pause["longest_s"],
                                 "longest_pause_outside_roll_s": pause["longest_outside_roll_s"],
                                 "longest_during_handoffs_s": pause.get("longest_during_handoffs_s"),
                                 "acknowledged": pause["acknowledged"], "rate_per_s": pause.get("rate_per_s"),
                                 "lost": queues.get(name, {}).get("lost"),
                                 # under `producer` each member serves its own consumers: a message
                                 # delivered once by each is the design, not a duplicate
                                 "duplicated": sum(count for why, count in queues.get(name, {}).get(
                                     "duplicates_explained", {}).items() if why != "another_member"),
                                 "delivered_by_both_members": queues.get(name, {}).get(
                                     "duplicates_explained", {}).get("another_member", 0),
                                 "enqueue_unknown": queues.get(name, {}).get("enqueue_unknown")}
                          for name, pause in result.get("write_pauses", {}).items()},
            "roll_s": round(result.get("roll_ended_s", 0.0) - result.get("roll_began_s", 0.0), 2)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and queue: median and range of the longest write pause, lost and duplicates summed."""
    table: dict[str, Any] = {}
    for mode in dict.fromkeys(run["mode"] for run in runs):
        of_mode = [run for run in runs if run["mode"] == mode]
        queues: dict[str, Any] = {}
        for name in of_mode[0]["per_queue"]:
            pauses = [run["per_queue"][name]["longest_write_pause_s"] for run in of_mode]
            handoffs = [p for run in of_mode if (p := run["per_queue"][name].get("longest_during_handoffs_s")) is not None]
            queues[name] = {"longest_write_pause_median_s": round(statistics.median(pauses), 3),
                            "longest_write_pause_min_s": min(pauses), "longest_write_pause_max_s": max(pauses),
                            "handoff_pause_median_s": round(statistics.median(handoffs), 3) if handoffs else None,
                            "handoff_pause_max_s": max(handoffs, default=None),
                            "lost": sum(run["per_queue"][name]["lost"] or 0 for run in of_mode),
                            "duplicated": sum(run["per_queue"][name]["duplicated"] or 0 for run in of_mode),
                            "acknowledged": sum(run["per_queue"][name]["acknowledged"] for run in of_mode),
                            "rate_per_s_median": statistics.median(run["per_queue"][name].get("rate_per_s") or 0
                                                                   for run in of_mode)}
        table[mode] = {"runs": len(of_mode), "valid": sum(1 for run in of_mode if run["valid"]), "queues": queues}
    return table


async def bench(modes: list[str], runs: int, rate: float, audit: bool, out: Path) -> list[dict[str, Any]]:
    release = previous_release()
    if release is None:
        raise SystemExit("releases.toml names no release older than this checkout")
    why = skip_reason(release["commit"])
    if why:
        raise SystemExit(f"cannot check out release {release['version']}: {why}")
    results = []
    with release_tree(release["commit"], out / f"release-{release['version']}") as old_tree:
        for number in range(runs):
            for mode in modes:
                started = time.monotonic()
                result = await roll_upgrade(out / f"{mode}-{number}", old_tree, REPOSITORY, plan_for(mode, rate, audit),
                                            progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
                (out / f"{mode}-{number}" / "result.json").write_text(json.dumps(result, indent=1, default=str))
                line = {"bench": "upgrade", "rate_per_queue": rate, "run": number, **summary_of(result),
                        "wall_s": round(time.monotonic() - started, 1)}
                print(json.dumps(line), flush=True)
                results.append(line)
    return results


def main(argv: list[str] | None = None) -> int:
    parse = argparse.ArgumentParser(prog="python -m bench.bench_upgrade", description=__doc__.split("\n\n")[0])
    parse.add_argument("--modes", default="drain,kill", help=f"comma-separated, of {', '.join(MODES)}")
    parse.add_argument("--runs", type=int, default=2, help="runs per mode")
    parse.add_argument("--rate", type=float, default=1000.0, help="enqueues per second on each queue")
    parse.add_argument("--audit", action="store_true", help="audit the journals after each run (slower)")
    parse.add_argument("--out", type=Path, help="where runs leave their data (default: a new temp directory)")
    parse.add_argument("--results", type=Path, help="append each run's JSON line and the summary to this file")
    arguments = parse.parse_args(argv)
    modes = [mode for mode in arguments.modes.split(",") if mode]
    if not set(modes) <= set(MODES):
        parse.error(f"modes are {', '.join(MODES)}")
    out = arguments.out or Path(tempfile.mkdtemp(prefix="bench-upgrade-"))
    out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(bench(modes, arguments.runs, arguments.rate, arguments.audit, out))
    table = {"bench": "upgrade-summary", "rate_per_queue": arguments.rate, "modes": aggregate(results)}
    print(json.dumps(table), flush=True)
    if arguments.results:
        with arguments.results.open("a") as lines:
            for line in [*results, table]:
                lines.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
