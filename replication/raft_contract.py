"""What the Raft core (replication/raft.py) and its driver hand each other: the limits it
runs under, the state it restarts from, the `Ready` it hands out, and the outcomes of
proposals and configuration changes.

The `Ready` is the contract's heart: one value listing, in the order the driver must do
them, what to make durable (in one transaction), what to send, and what to apply.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from replication.invariants import InvariantViolation
from replication.raft_messages import (
    ENTRY_OVERHEAD_BYTES,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    Message,
    Snapshot,
)


@dataclass(frozen=True, slots=True)
class RaftLimits:
    """Every timer and bound of the core, in ticks, entries and bytes."""
    election_timeout_min_ticks: int = 10
    election_timeout_max_ticks: int = 20       # exclusive: timeouts are drawn from [min, max)
    heartbeat_interval_ticks: int = 2
    resend_after_ticks: int = 5                # a probe, a snapshot or a stalled pipeline is sent again
    append_entries_max: int = 64               # per AppendRequest
    append_bytes_max: int = 256 * 1024         # per AppendRequest (a larger command is refused)
    in_flight_appends_max: int = 4             # per follower (flow control)
    uncommitted_entries_max: int = 512         # at the leader: proposals past it are refused
    apply_entries_max: int = 512               # committed entries handed out per Ready
    learner_lag_max_entries: int = 16          # a learner this close to the commit index may be promoted
    clock_drift_max: float = 0.1               # how much faster or slower any node's ticks may run (the lease)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_ticks < self.election_timeout_min_ticks:
            raise ValueError("heartbeat_interval_ticks must be positive and below election_timeout_min_ticks")
        if self.election_timeout_max_ticks <= self.election_timeout_min_ticks:
            raise ValueError("election_timeout_max_ticks must exceed election_timeout_min_ticks")
        if not 0 < self.resend_after_ticks < self.election_timeout_min_ticks:
            raise ValueError("resend_after_ticks must be positive and below election_timeout_min_ticks")
        if min(self.append_entries_max, self.in_flight_appends_max, self.uncommitted_entries_max,
               self.apply_entries_max) < 1 or self.append_bytes_max <= ENTRY_OVERHEAD_BYTES:
            raise ValueError("every count and byte limit must allow at least one entry")


@dataclass(frozen=True, slots=True)
class PersistedState:
    """What a node's disk holds: the core restarts from exactly this."""
    hard_state: HardState
    snapshot: Snapshot
    entries: tuple[Entry, ...]


def empty_state() -> PersistedState:
    """A node with a new (or wiped) disk: it knows no configuration and never campaigns
    until a leader gives it one that lists it."""
    return PersistedState(HardState(0, None, 0), Snapshot(0, 0, Configuration(), b""), ())


def bootstrap_state(configuration: Configuration) -> PersistedState:
    """The first members of a new cluster: the configuration is the first entry, committed
    by construction (every first member holds it)."""
    entry = Entry(1, 1, EntryKind.CONFIGURATION, configuration=configuration)
    return PersistedState(HardState(1, None, 1), Snapshot(0, 0, Configuration(), b""), (entry,))


@dataclass(frozen=True, slots=True)
class Ready:
    """What the driver must do, in this order: (1) in one durable transaction: install
    `install_snapshot` (the state machine becomes its data and the durable log is emptied) or
    record `compaction` (entries up to its index may go), delete durable entries from
    `truncate_from` on, append `entries`, write `hard_state`; (2) send `messages`; (3) apply
    `committed_entries` in order; then call `advance(ready)`."""
    hard_state: HardState | None
    install_snapshot: Snapshot | None
    compaction: Snapshot | None
    truncate_from: int | None
    entries: tuple[Entry, ...]
    messages: tuple[Message, ...]
    committed_entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        # A truncation always travels with the entries that replace it, as one unit.
        if self.truncate_from is not None and (not self.entries or self.entries[0].index != self.truncate_from):
            raise InvariantViolation(f"a truncation from {self.truncate_from} without the entries that replace it")
        if self.install_snapshot is not None and self.compaction is not None:
            raise InvariantViolation("one Ready both installs and takes a snapshot")

    @property
    def must_persist(self) -> bool:
        return bool(self.hard_state or self.install_snapshot or self.compaction or self.entries)


class Refusal(enum.Enum):
    NOT_LEADER = "not the leader"
    TOO_LARGE = "larger than one append message may carry"
    TOO_MANY_UNCOMMITTED = "too many uncommitted entries: try again later"
    TERM_NOT_COMMITTED = "no entry of this leader's term has committed yet"
    CHANGE_PENDING = "another configuration change is not committed yet"
    ALREADY_MEMBER = "the node is already a member"
    NOT_A_MEMBER = "the node is not a member"
    NOT_A_LEARNER = "the node is not a learner"
    LAST_VOTER = "the last voter cannot be removed"
    LEARNER_BEHIND = "the learner has not caught up with the log"


@dataclass(frozen=True, slots=True)
class Proposed:
    index: int
    term: int


@dataclass(frozen=True, slots=True)
class Refused:
    reason: Refusal


ProposalOutcome = Proposed | Refused


class ChangeKind(enum.Enum):
    ADD_LEARNER = "add learner"
    PROMOTE_LEARNER = "promote learner"
    ADD_VOTER = "add voter"
    REMOVE_MEMBER = "remove member"


@dataclass(frozen=True, slots=True)
class ConfigurationChange:
    kind: ChangeKind
    node_id: str
    storage_id: bytes = b""      # for additions: the disk the node has now


def changed_configuration(configuration: Configuration, change: ConfigurationChange) -> Configuration | Refusal:
    """The configuration after one single-server change, or why it cannot be made."""
    node_id = change.node_id
    if change.kind in (ChangeKind.ADD_LEARNER, ChangeKind.ADD_VOTER):
        if configuration.is_member(node_id):
            return Refusal.ALREADY_MEMBER
        member = Member(node_id, change.storage_id)
        if change.kind is ChangeKind.ADD_VOTER:
            return Configuration(configuration.voters | {member}, configuration.learners)
        return Configuration(configuration.voters, configuration.learners | {member})
    if change.kind is ChangeKind.PROMOTE_LEARNER:
        learner = [member for member in configuration.learners if member.node_id == node_id]
        if not learner:
            return Refusal.NOT_A_LEARNER
        return Configuration(configuration.voters | {learner[0]}, configuration.learners - {learner[0]})
    if not configuration.is_member(node_id):
        return Refusal.NOT_A_MEMBER
    voters = frozenset(member for member in configuration.voters if member.node_id != node_id)
    if not voters:
        return Refusal.LAST_VOTER
    return Configuration(voters, frozenset(member for member in configuration.learners if member.node_id != node_id))
