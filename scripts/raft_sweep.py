"""Sweep the Raft simulation over many seeds (docs/RAFT.md has the figures it produced).

    .venv/bin/python scripts/raft_sweep.py --seeds 10000 --ticks 2000
    .venv/bin/python scripts/raft_sweep.py --replay 1234          # one seed, with its traceback

Prints, per kind of fault or path (tests/sim/raft_sim.py KINDS), the total count and the
number of seeds in which it occurred, then every failing seed with the line that replays it.
Exits 1 if a seed failed, or if one of issue 12's kinds occurred in fewer than 10% of seeds.
One process, one core: the seeds run one after the other.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replication.invariants import InvariantViolation  # noqa: E402
from tests.sim.raft_sim import ISSUE_KINDS, KINDS, RaftSimulation  # noqa: E402

COVERAGE_MIN = 0.10


def replay(seed: int, ticks: int) -> int:
    simulation = RaftSimulation(seed, ticks)
    try:
        counts = simulation.run()
    except (AssertionError, InvariantViolation):
        traceback.print_exc()
        print(f"seed {seed} failed at tick {simulation.now} ({len(simulation.nodes)} nodes)")
        return 1
    print(f"seed {seed}: clean ({len(simulation.nodes)} nodes, {simulation.now} ticks)")
    for kind in KINDS:
        print(f"  {kind:26} {counts[kind]:8}")
    return 0


def sweep(first: int, seeds: int, ticks: int, progress_every: int) -> int:
    totals: Counter[str] = Counter()
    seeds_with: Counter[str] = Counter()
    failures: list[tuple[int, str]] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    for done, seed in enumerate(range(first, first + seeds), start=1):
        simulation = RaftSimulation(seed, ticks)
        try:
            counts = simulation.run()
        except (AssertionError, InvariantViolation) as failure:
            failures.append((seed, f"{type(failure).__name__} at tick {simulation.now}: {failure}"))
            continue
        totals.update(counts)
        seeds_with.update(kind for kind in KINDS if counts[kind])
        if progress_every and done % progress_every == 0:
            print(f"... {done} seeds, {len(failures)} failing, {time.perf_counter() - started:.0f} s", flush=True)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(f"{seeds} seeds {first}..{first + seeds - 1}, {ticks} ticks each: {elapsed:.0f} s "
          f"({1000 * cpu / seeds:.1f} ms of CPU per seed)")
    print(f"{'kind':26} {'total':>9} {'seeds':>7} {'share':>7}")
    clean = seeds - len(failures)
    for kind in KINDS:
        share = seeds_with[kind] / clean if clean else 0.0
        print(f"{kind:26} {totals[kind]:9} {seeds_with[kind]:7} {share:7.1%}")
    for seed, what in failures:
        print(f"FAILED seed {seed}: {what}\n  replay: .venv/bin/python scripts/raft_sweep.py --replay {seed}")
    rare = [kind for kind in ISSUE_KINDS if clean and seeds_with[kind] / clean < COVERAGE_MIN]
    if rare:
        print(f"occurred in fewer than {COVERAGE_MIN:.0%} of seeds: {', '.join(rare)}")
    print(f"{len(failures)} failing seeds")
    return 1 if failures or rare else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    parser.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    parser.add_argument("--ticks", type=int, default=2000, help="ticks of the safety phase per seed (default 2000)")
    parser.add_argument("--progress", type=int, default=0, help="print a line every N seeds")
    parser.add_argument("--replay", type=int, help="run this one seed and show its traceback")
    arguments = parser.parse_args()
    if arguments.replay is not None:
        return replay(arguments.replay, arguments.ticks)
    return sweep(arguments.first, arguments.seeds, arguments.ticks, arguments.progress)


if __name__ == "__main__":
    sys.exit(main())
