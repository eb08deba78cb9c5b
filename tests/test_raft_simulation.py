"""The Raft core under the deterministic simulation (tests/sim/raft_sim.py).

A fixed set of seeds runs on every CI run, plus a few fresh ones; a failure names the seed
and the line that replays it. Over the fixed seeds every fault and every path the sweep
counts must occur (a simulation that never takes a path proves nothing about it). The last
tests break the core on purpose and check that the checker notices: it is only as good as
what it catches. The long sweep is `scripts/raft_sweep.py` (docs/RAFT.md).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from replication import raft
from replication.invariants import InvariantViolation
from replication.raft import RaftNode, Role
from replication.raft_log import RaftLog
from replication.raft_messages import AppendRequest, Entry
from tests.conftest import REPOSITORY
from tests.sim.raft_sim import KINDS, InvariantBroken, RaftSimulation

FIXED_SEEDS = list(range(1, 61))
_FRESH = random.Random(os.getpid())
FRESH_SEEDS = [_FRESH.randrange(10**9) for _ in range(4)]      # different ones each run
COUNTS: dict[int, Counter[str]] = {}


def run_seed(seed: int) -> Counter[str]:
    simulation = RaftSimulation(seed)
    try:
        counts = simulation.run()
    except (AssertionError, InvariantViolation) as failure:
        raise AssertionError(
            f"seed {seed} fails at tick {simulation.now}: {failure}\n"
            f"replay: .venv/bin/python scripts/raft_sweep.py --replay {seed}   "
            f"(or RaftSimulation({seed}).run() in tests/sim/raft_sim.py)") from None
    COUNTS[seed] = counts
    return counts


@pytest.mark.parametrize("seed", FIXED_SEEDS + FRESH_SEEDS)
def test_a_cluster_under_faults_stays_safe_and_converges_once_healed(seed: int) -> None:
    run_seed(seed)


def test_over_the_fixed_seeds_every_fault_and_path_occurs() -> None:
    totals: Counter[str] = Counter()
    for seed in FIXED_SEEDS:
        totals.update(COUNTS[seed] if seed in COUNTS else run_seed(seed))
    never = [kind for kind in KINDS if totals[kind] == 0]
    assert never == [], f"never exercised over the fixed seeds: {never}"


def test_a_seed_replays_exactly_whatever_the_hash_seed_of_the_process() -> None:
    program = ("import json; from tests.sim.raft_sim import RaftSimulation; s = RaftSimulation(5); "
               "c = s.run(); print(json.dumps([sorted(c.items()), s.now, s.network.sequence]))")
    outputs = []
    for hash_seed in ("1", "2"):
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPOSITORY)}
        answer = subprocess.run([sys.executable, "-c", program], cwd=REPOSITORY, env=environment,
                                capture_output=True, text=True, check=True, timeout=120)
        outputs.append(json.loads(answer.stdout))
    assert outputs[0] == outputs[1]


# --- the checker catches broken cores ------------------------------------------------------------
def truncate_everything_after_the_previous_entry(self: RaftLog, entries: Sequence[Entry], commit_index: int) -> int:
    """pysyncobj's follower: whatever it holds after the leader's previous entry goes."""
    removed = 0
    if entries and self.last_index >= entries[0].index:
        removed = self.last_index - entries[0].index + 1
        RaftLog.truncate_from(self, entries[0].index, -1)
    for entry in entries:
        if entry.index > self.last_index:
            self.append(entry)
    return removed


def count_votes_from_any_disk(self: RaftNode) -> tuple[int, int]:
    granted = refused = 0
    for member in self.configuration.voters:
        answer = self._votes.get(member.node_id)
        if answer is not None:
            granted += answer[1]
            refused += not answer[1]
    return granted, refused


def commit_up_to_the_last_entry_held(self: RaftNode, message: AppendRequest) -> None:
    """A follower taking the leader's commit index up to its own last entry, verified or not."""
    RaftNode._on_append_request(self, message)
    if message.leader_commit > self._commit:
        self._commit = min(message.leader_commit, self.last_index)


def keep_acknowledgements_of_a_lost_disk(self: RaftNode, progress: raft.Progress, storage_id: bytes) -> None:
    """A leader that goes on counting a follower's old disk when another one answers."""


@pytest.mark.parametrize("target, name, replacement, expected", [
    (RaftLog, "merge", truncate_everything_after_the_previous_entry, "truncates committed entry"),
    (RaftNode, "_tally", count_votes_from_any_disk, "counted votes"),
    (RaftNode, "_reset_progress", keep_acknowledgements_of_a_lost_disk, "held by"),
    (None, "append handler", commit_up_to_the_last_entry_held, "committed with term"),
])
def test_the_checker_catches_a_broken_core(monkeypatch: pytest.MonkeyPatch, target: type | None, name: str,
                                           replacement: Callable[..., object], expected: str) -> None:
    if target is None:
        handlers: dict[tuple[Role, type], Callable[..., object]] = dict(RaftNode._HANDLERS)
        for role in (Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE):
            handlers[(role, AppendRequest)] = replacement
        monkeypatch.setattr(RaftNode, "_HANDLERS", handlers)
    else:
        monkeypatch.setattr(target, name, replacement)
    for seed in range(1, 41):           # each of these broke a run within the first few seeds when written
        try:
            RaftSimulation(seed).run()
        except InvariantBroken as failure:
            assert expected in str(failure), f"seed {seed}: {failure}"
            return
    pytest.fail(f"40 seeds ran clean on a core that breaks its {name}")
