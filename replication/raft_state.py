"""A Raft node's state, what it shows, and its roles (the core's base: replication/raft.py).

Apart from the node's inputs, elections and the follower's side (`RaftNode`, replication/raft.py)
and from the leader's log replication (`LeaderReplication`, replication/raft_replication.py)
so that each of those reads against one small base: the fields a node holds, the one place
a role changes (`_transition`, checked against `ROLE_TRANSITIONS`), and the outbox. Pure like
the rest of the core (docs/RAFT.md "The API").
"""
from __future__ import annotations

import enum
import random

from replication.invariants import InvariantViolation
from replication.raft_contract import PersistedState, RaftLimits, Ready
from replication.raft_log import RaftLog
from replication.raft_messages import Configuration, Message, Snapshot
from replication.raft_progress import Progress


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


# The only role changes there are; anything else is a broken invariant.
ROLE_TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.FOLLOWER: frozenset({Role.FOLLOWER, Role.PRE_CANDIDATE}),
    Role.PRE_CANDIDATE: frozenset({Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE}),
    Role.CANDIDATE: frozenset({Role.FOLLOWER, Role.PRE_CANDIDATE, Role.LEADER}),
    Role.LEADER: frozenset({Role.FOLLOWER}),
}



class RaftState:
    """One node's Raft state, what it shows, and the one place its role changes. Owned by one
    task; not thread-safe, never blocks."""

    def __init__(self, node_id: str, storage_id: bytes, persisted: PersistedState, limits: RaftLimits,
                 random_source: random.Random, applied_index: int = 0) -> None:
        """`applied_index`: what an application with a durable state machine has applied
        already (it is not handed those entries again); 0 for one rebuilt from the snapshot."""
        self._node_id = node_id
        self._storage_id = storage_id
        self._limits = limits
        self._random = random_source
        self._log = RaftLog(persisted.snapshot, persisted.entries)
        hard_state = persisted.hard_state
        self._term = hard_state.term
        self._vote = hard_state.vote
        self._commit = max(hard_state.commit, persisted.snapshot.index)
        if self._commit > self._log.last_index:
            raise InvariantViolation(f"durable commit {self._commit} beyond the durable log ({self._log.last_index})")
        self._applied = max(persisted.snapshot.index, min(applied_index, self._commit))
        self._persisted_hard_state = hard_state
        self._role = Role.FOLLOWER
        self._leader_id: str | None = None
        self._tick_count = 0
        self._election_elapsed = 0
        self._election_timeout = self._random_election_timeout()
        self._heartbeat_elapsed = 0
        # A restarted node may have heard from a leader just before it stopped: it refuses
        # votes for one minimum election timeout, as if it had (leases stay safe).
        self._refuse_votes_until_tick = limits.election_timeout_min_ticks
        self._votes: dict[str, tuple[bytes, bool]] = {}      # node -> (storage id, granted)
        self._progress: dict[str, Progress] = {}
        self._term_start_index = 0
        self._outbox: list[Message] = []
        self._replication_pending = False
        self._pending_install: Snapshot | None = None
        self._pending_compaction: Snapshot | None = None
        self._ready_outstanding: Ready | None = None
        self.stale_messages_ignored = 0
        self.bad_messages_ignored = 0
        self.entries_truncated = 0

    # --- reading ------------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def storage_id(self) -> bytes:
        return self._storage_id

    @property
    def term(self) -> int:
        return self._term

    @property
    def vote(self) -> str | None:
        return self._vote

    @property
    def role(self) -> Role:
        return self._role

    @property
    def is_leader(self) -> bool:
        return self._role is Role.LEADER

    @property
    def leader_id(self) -> str | None:
        return self._leader_id

    @property
    def commit_index(self) -> int:
        return self._commit

    @property
    def applied_index(self) -> int:
        return self._applied

    @property
    def last_index(self) -> int:
        return self._log.last_index

    @property
    def configuration(self) -> Configuration:
        return self._log.configuration

    @property
    def snapshot_index(self) -> int:
        return self._log.snapshot.index

    @property
    def log(self) -> RaftLog:
        """Read-only use: checkers and tests look at the log through this."""
        return self._log

    @property
    def lease_remaining_ticks(self) -> int:
        """How many more ticks no other leader can exist; 0 when there is no such certainty.

        The rule (docs/RAFT.md): a follower refuses votes and pre-votes for
        `election_timeout_min_ticks` after an append from its leader, and a new leader needs
        the vote of one of the majority that answered our latest acknowledged round. So no
        other leader is elected before that round's send tick + that refusal window, counted
        on the followers' clocks: (min - 1) ticks (a tick may start right after the append
        arrives), shrunk by the clock drift allowed, less one tick for our own rounding."""
        if self._role is not Role.LEADER:
            return 0
        configuration = self._log.configuration
        sent = []
        for member in configuration.voters:
            if member.node_id == self._node_id:
                sent.append(self._tick_count if member.storage_id == self._storage_id else 0)
                continue
            progress = self._progress.get(member.node_id)
            counted = progress is not None and progress.storage_id == member.storage_id
            sent.append(progress.lease_context if counted and progress is not None else 0)
        sent.sort(reverse=True)
        start = sent[configuration.quorum - 1]
        if start == 0:
            return 0        # no round of this term acknowledged by a majority yet
        limits = self._limits
        window = int((limits.election_timeout_min_ticks - 1) * (1 - limits.clock_drift_max)) - 1
        return max(0, start + window - self._tick_count)

    def progress_of(self, node_id: str) -> Progress | None:
        """The leader's view of a follower (None elsewhere); for reading only."""
        return self._progress.get(node_id)

    # --- roles and the outbox -------------------------------------------------------------------
    def _require_no_ready_outstanding(self) -> None:
        if self._ready_outstanding is not None:
            raise InvariantViolation("the core was driven between ready() and advance()")

    def _transition(self, role: Role) -> None:
        if role not in ROLE_TRANSITIONS[self._role]:
            raise InvariantViolation(f"{self._node_id}: no move from {self._role.value} to {role.value}")
        self._role = role

    def _become_follower(self, term: int, leader: str | None) -> None:
        self._transition(Role.FOLLOWER)
        if term != self._term:
            self._term = term
            self._vote = None
        self._leader_id = leader
        if leader is not None:
            self._refuse_votes_until_tick = self._tick_count + self._limits.election_timeout_min_ticks
        self._election_elapsed = 0
        self._election_timeout = self._random_election_timeout()
        self._votes = {}
        self._progress = {}

    def _step_down(self) -> None:
        self._become_follower(self._term, None)

    def _random_election_timeout(self) -> int:
        return self._random.randrange(self._limits.election_timeout_min_ticks, self._limits.election_timeout_max_ticks)

    def _send(self, message: Message) -> None:
        self._outbox.append(message)
