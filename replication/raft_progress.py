"""The leader's view of one follower: how far its log matches, what is in flight to it,
and which of three ways it is being fed (etcd-io/raft's tracker.Progress, in brief).

PROBE: one append at a time until the follower's position is found (after an election, a
refusal, a stall). REPLICATE: a pipeline of at most `in_flight_appends_max` appends, the
flow control. SNAPSHOT: the follower needs entries the leader compacted; its snapshot is on
the way. The moves between them are one table; any other is a broken invariant.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from replication.invariants import InvariantViolation


class ProgressState(enum.Enum):
    PROBE = "probe"             # one append at a time until the follower's position is found
    REPLICATE = "replicate"     # a pipeline of at most in_flight_appends_max appends
    SNAPSHOT = "snapshot"       # the snapshot is on its way; wait for its answer


PROGRESS_TRANSITIONS: dict[ProgressState, frozenset[ProgressState]] = {
    ProgressState.PROBE: frozenset({ProgressState.PROBE, ProgressState.REPLICATE, ProgressState.SNAPSHOT}),
    ProgressState.REPLICATE: frozenset({ProgressState.PROBE, ProgressState.SNAPSHOT}),
    ProgressState.SNAPSHOT: frozenset({ProgressState.PROBE, ProgressState.REPLICATE}),
}


@dataclass(slots=True)
class Progress:
    """The leader's view of one follower (voter or learner)."""
    storage_id: bytes          # the disk the follower last answered from
    next_index: int
    match_index: int = 0
    state: ProgressState = ProgressState.PROBE
    probe_outstanding: bool = False
    in_flight: list[int] = field(default_factory=list)   # last index of each append in flight
    sent_tick: int = 0         # when the probe or the snapshot in flight left
    progress_tick: int = 0     # when match_index last moved (a pipeline stalled longer is probed again)
    heard_tick: int = 0        # when the follower last answered in this term (check-quorum)
    last_sent_tick: int = -1   # when anything was last sent (an idle link gets a heartbeat)
    snapshot_index: int = 0
    commit_sent: int = 0       # the highest commit index an append to it could carry (see RaftNode._tell_commit)
    lease_context: int = 0     # the send tick of the latest append it answered (RaftNode.lease_remaining_ticks)

    def move_to(self, state: ProgressState) -> None:
        if state not in PROGRESS_TRANSITIONS[self.state]:
            raise InvariantViolation(f"progress cannot move from {self.state.value} to {state.value}")
        self.state = state
        self.in_flight.clear()
        self.probe_outstanding = False
