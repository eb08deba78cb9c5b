"""A queue's FAILED state (seed 004, issue 37 item 2): a queue whose pair cannot serve reports
FAILED, with a stable reason and since when, instead of OPEN; back to OPEN once it serves again.

FAILED is derived and reported, never stored in the queue's record: what makes a queue fail
(its master's storage full, its replica out of sync under `min_in_sync: 2`) is a condition the
master already acts on (it refuses writes with E_STORAGE_FULL / E_NOT_ENOUGH_REPLICAS), and the
queue serves again by itself when the condition ends. So the master judges it from the same
facts at each look (`judge`), and `QueueHealth` keeps, per queue, since when the judgement has
held (the wall time of the first look that found it), so `failed_since_ms` does not move while
the queue stays failed.

Pure: the caller passes the facts and the wall time (no clock, no I/O).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replication.map_commands import Outcome, SetQueueHealth
from wire.versions import FEATURES

# Stable reasons (docs/PROTOCOL.md, "Queue state FAILED"): clients and alerts match on them.
STORAGE_FULL = "storage_full"                  # the master's storage refuses new messages
REPLICA_UNAVAILABLE = "replica_unavailable"    # min_in_sync 2 and the replica is not in sync
REASONS = (STORAGE_FULL, REPLICA_UNAVAILABLE)
DETAIL_CHARS_MAX = 300                         # a reason's detail is a sentence, never a dump


@dataclass(frozen=True)
class QueueFailure:
    reason: str          # one of REASONS
    detail: str          # for a person: what the master saw
    since_ms: int        # wall time of the first look that found the queue failed for `reason`

    def to_json(self) -> dict[str, Any]:
        return {"state": "FAILED", "failed_reason": self.reason, "failed_detail": self.detail,
                "failed_since_ms": self.since_ms}


HEALTHY_FIELDS: dict[str, Any] = {"failed_reason": None, "failed_detail": None, "failed_since_ms": None}


def judge(*, storage_full: str | None, min_in_sync: int, replicated: bool, replica: str | None,
          replica_in_sync: bool, replica_storage_full: bool = False) -> tuple[str, str] | None:
    """Why a queue mastered here cannot serve, as (reason, detail); None while it can.

    `storage_full`: why this node refuses new messages (None: it has room). `replicated`: the
    queue has a replica assigned (a queue alone, or outside a cluster, never waits for one).
    `replica_in_sync`: the map records the replica in sync (or its removal is on its way).
    The storage comes first: a master out of room refuses every enqueue whatever its replica."""
    if storage_full is not None:
        return STORAGE_FULL, f"the master's storage is full ({storage_full})"[:DETAIL_CHARS_MAX]
    if min_in_sync >= 2 and replicated and not replica_in_sync:
        why = " (its storage is full)" if replica_storage_full else ""
        return REPLICA_UNAVAILABLE, (f"min_in_sync is {min_in_sync} and replica {replica} is not in sync{why}: "
                                     "writes are refused")[:DETAIL_CHARS_MAX]
    return None


class QueueHealth:
    """The queues found failed, each with since when. Bounded by the queues mastered here:
    `keep_only` drops those no longer mastered (deleted, handed off, failed over)."""

    def __init__(self) -> None:
        self.failures: dict[str, QueueFailure] = {}

    def observe(self, name: str, judged: tuple[str, str] | None, wall_ms: int) -> str | None:
        """Record a look at one queue. Returns "failed" when it just failed (or failed for
        another reason), "recovered" when it just serves again, None when nothing changed."""
        known = self.failures.get(name)
        if judged is None:
            if known is None:
                return None
            del self.failures[name]
            return "recovered"
        reason, detail = judged
        if known is not None and known.reason == reason:
            if known.detail != detail:     # the same failure, said better (free bytes change): keep its start
                self.failures[name] = QueueFailure(reason, detail, known.since_ms)
            return None
        self.failures[name] = QueueFailure(reason, detail, wall_ms)
        return "failed"

    def keep_only(self, names: set[str]) -> list[str]:
        """Forget the queues not in `names` (no longer mastered here); returns those forgotten."""
        gone = [name for name in self.failures if name not in names]
        for name in gone:
            del self.failures[name]
        return gone

    def fields(self, name: str) -> dict[str, Any]:
        """What the queue's statistics say of it: FAILED with its reason, or no failure."""
        known = self.failures.get(name)
        return known.to_json() if known is not None else dict(HEALTHY_FIELDS)


# --- in the cluster map (SetQueueHealth, tag 24, at cluster feature level 3) ------------------
# ClusterMap.queue_health: name -> (reason, detail, since_ms) of the queues recorded FAILED.
def apply_queue_health(cluster: Any, command: SetQueueHealth) -> Outcome:
    """Record (or clear, reason "") a queue's failure in the map. Refused below feature level 3
    on every node (a proposal that bypassed the gate leaves every copy the same), for another
    incarnation, and for a reason that is not one of REASONS."""
    entry = cluster.queues.get(command.name)
    if entry is None or entry.incarnation != command.incarnation:
        return Outcome(command.name, False, "no such incarnation")
    if cluster.feature_level < FEATURES["queue_health"]:
        return Outcome(command.name, False, f"a queue's health in the map needs cluster feature level "
                                            f"{FEATURES['queue_health']}")
    if command.reason == "":
        if cluster.queue_health.pop(command.name, None) is None:
            return Outcome(command.name, False, "not recorded failed")     # no second "serves again"
        return Outcome(command.name, True, "open")
    if command.reason not in REASONS:
        return Outcome(command.name, False, f"unknown reason {command.reason[:40]!r}")
    cluster.queue_health[command.name] = (command.reason, command.detail[:DETAIL_CHARS_MAX], command.since_ms)
    return Outcome(command.name, True, "failed")


def health_json(cluster: Any, name: str) -> dict[str, Any]:
    """What GET /v1/cluster adds to a queue's entry: FAILED with its reason, nothing while it serves."""
    known = cluster.queue_health.get(name)
    if known is None:
        return {}
    reason, detail, since_ms = known
    return QueueFailure(reason, detail, since_ms).to_json()


def encode_health(cluster: Any) -> list[list[Any]]:
    return [[name, reason, detail, since_ms] for name, (reason, detail, since_ms) in sorted(cluster.queue_health.items())]


def decode_health(rows: Any) -> dict[str, tuple[str, str, int]]:
    return {str(name): (str(reason), str(detail), int(since_ms)) for name, reason, detail, since_ms in rows}


def map_differs(recorded: tuple[str, str, int] | None, failure: QueueFailure | None) -> bool:
    """Whether the master should propose: the map's record and its own judgement disagree on
    failed or not, or on the reason (a changed detail alone is not worth a proposal)."""
    if failure is None:
        return recorded is not None
    return recorded is None or recorded[0] != failure.reason
