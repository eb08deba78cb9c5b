"""The cluster side reaches the node's core only through the ports of qserver/core/ports.py
(docs/ARCHITECTURE.md): the pair driver and the coordinator never name the engine, and their
parts work on small fakes (tests/cluster_fakes.py)."""
from __future__ import annotations

from pathlib import Path

from qserver.cluster.holds import HeldAnswers
from qserver.core.ports import OUTCOME_UNKNOWN
from tests.cluster_fakes import FakeCore, FakeMembership, coordinator, pair_driver
from wire.errors import E_NOT_MASTER, E_TIMEOUT, QueueError

CLUSTER = Path(__file__).resolve().parent.parent / "qserver" / "cluster"


# The pair driver, the coordinator and the parts they are made of.
PAIRS_AND_COORDINATOR = ("pairs.py", "coordinator.py", "view.py", "holds.py", "relay_answers.py", "proposals.py",
                         "batches.py", "replica_effects.py", "master_effects.py", "peer_inbox.py")


def test_the_pair_driver_and_the_coordinator_never_name_the_engine() -> None:
    for name in PAIRS_AND_COORDINATOR:
        assert "engine" not in (CLUSTER / name).read_text().lower(), f"{name} names the engine"


class _Points:
    def __init__(self) -> None:
        self.commit: int | None = 3
        self.answering = True

    def answer_point(self, name: str) -> tuple[int | None, bool]:
        return self.commit, self.answering


def test_a_held_answer_goes_out_once_the_commit_point_passes_it_and_only_while_answers_may_go() -> None:
    clock = [0]
    points = _Points()
    holds = HeldAnswers(points, lambda: clock[0], clustered=True, wait_max_ms=1_000)
    released: list[int] = []
    assert not holds.hold("q", 3, lambda: released.append(3))           # committed already: answer now
    assert holds.hold("q", 5, lambda: released.append(5))
    points.commit, points.answering = 5, False
    holds.release(["q"])
    assert released == [] and "q" in holds.held                         # a master without its lease holds it
    points.answering = True
    holds.release(["q"])
    assert released == [5] and holds.held == {}


def test_a_held_answer_past_its_deadline_or_of_a_deposed_master_says_its_outcome_is_unknown() -> None:
    clock = [0]
    points = _Points()
    holds = HeldAnswers(points, lambda: clock[0], clustered=True, wait_max_ms=1_000)
    refused: list[QueueError] = []
    holds.hold("q", 9, lambda: None, refused.append)
    clock[0] = 1_000
    holds.expire(clock[0])
    assert [(error.kind, error.outcome_unknown) for error in refused] == [(E_TIMEOUT, True)] and holds.held == {}
    assert holds.hold("q", OUTCOME_UNKNOWN, lambda: None, refused.append)
    assert (refused[-1].kind, refused[-1].outcome_unknown) == (E_NOT_MASTER, True)


def test_a_pair_driver_and_a_coordinator_are_made_on_fakes_of_the_ports() -> None:
    core, membership = FakeCore(), FakeMembership()
    pairs = pair_driver("n1", core, membership)
    made = coordinator(pairs, core, membership)
    assert pairs.coordinator is made and made.pairs is pairs and not made.lease_valid()
    pairs.tick(0)                                     # nothing held, nothing to do
    assert pairs.commit_order("q") is None and pairs.may_answer("q")
