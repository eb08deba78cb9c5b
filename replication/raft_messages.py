"""The values the Raft core (replication/raft.py) reads, keeps and sends: members and
configurations, log entries, snapshots, the hard state, and the wire messages.

Every value is a frozen, slotted dataclass. Every message carries the sender's term (replies
too: a reply from an older term is ignored, which closes pysyncobj's hole of a stale success
raising a follower's match index), the sender's node id and storage id (a node that lost its
disk has a new storage id and is not counted until it is re-added with it), and its
recipient. The codec that puts `PROTOCOL_VERSION` on every frame comes with the node's
transport (issue 12, item 3); these types are what it encodes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

PROTOCOL_VERSION = 1
ENTRY_OVERHEAD_BYTES = 24     # index, term and kind, as a codec would frame them
MEMBER_OVERHEAD_BYTES = 16


@dataclass(frozen=True, slots=True)
class Member:
    """One node of a configuration, as the disk it had when it was added."""
    node_id: str
    storage_id: bytes


@dataclass(frozen=True, slots=True)
class Configuration:
    """Who votes and who only follows. It exists only in configuration entries and in
    snapshots (never in a separate file), so it is replicated, truncated and compacted
    exactly like the log that carries it."""
    voters: frozenset[Member] = frozenset()
    learners: frozenset[Member] = frozenset()
    # Derived lookups, built once (configurations are read on every message).
    _storage_by_node: dict[str, bytes] = field(init=False, repr=False, compare=False, hash=False)
    _voter_storage_by_node: dict[str, bytes] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        voter_nodes = [member.node_id for member in self.voters]
        learner_nodes = [member.node_id for member in self.learners]
        every_node = voter_nodes + learner_nodes
        if len(set(every_node)) != len(every_node):
            raise ValueError(f"a node appears twice in a configuration: {sorted(every_node)}")
        object.__setattr__(self, "_storage_by_node",
                           {member.node_id: member.storage_id for member in self.voters | self.learners})
        object.__setattr__(self, "_voter_storage_by_node", {member.node_id: member.storage_id for member in self.voters})

    @property
    def quorum(self) -> int:
        """Voters that make a majority (of every voter listed, counted or not)."""
        return len(self.voters) // 2 + 1

    def storage_id_of(self, node_id: str) -> bytes | None:
        """The storage id the configuration knows `node_id` by, voter or learner."""
        return self._storage_by_node.get(node_id)

    def voter_storage_id(self, node_id: str) -> bytes | None:
        return self._voter_storage_by_node.get(node_id)

    def is_voter(self, node_id: str, storage_id: bytes) -> bool:
        """A voter that counts: listed as a voter with exactly this disk."""
        return self._voter_storage_by_node.get(node_id) == storage_id

    def is_member(self, node_id: str) -> bool:
        return node_id in self._storage_by_node

    def is_learner(self, node_id: str) -> bool:
        return node_id in self._storage_by_node and node_id not in self._voter_storage_by_node

    def node_ids(self) -> list[str]:
        return sorted(self._storage_by_node)

    def voter_ids(self) -> list[str]:
        return sorted(self._voter_storage_by_node)

    def size_bytes(self) -> int:
        return sum(MEMBER_OVERHEAD_BYTES + len(member.node_id) + len(member.storage_id)
                   for member in self.voters | self.learners)


class EntryKind(enum.Enum):
    COMMAND = "command"                # the application's bytes
    CONFIGURATION = "configuration"    # the whole new configuration, in force from this entry on
    LEADER_START = "leader start"      # the no-op a new leader appends to commit its term


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    term: int
    kind: EntryKind
    command: bytes = b""
    configuration: Configuration | None = None

    def size_bytes(self) -> int:
        size = ENTRY_OVERHEAD_BYTES + len(self.command)
        return size + self.configuration.size_bytes() if self.configuration is not None else size


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The application's state after applying every entry up to `index` (opaque bytes), the
    term of that entry, and the configuration in force at it."""
    index: int
    term: int
    configuration: Configuration
    data: bytes


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be durable before any message that depends on it leaves the node."""
    term: int
    vote: str | None
    commit: int


# --- messages -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RaftMessage:
    term: int
    sender: str
    recipient: str
    sender_storage_id: bytes


@dataclass(frozen=True, slots=True)
class PreVoteRequest(RaftMessage):
    """Would you vote for me at `term` (one more than the sender's own)? Changes no term."""
    last_log_index: int
    last_log_term: int


@dataclass(frozen=True, slots=True)
class PreVoteResponse(RaftMessage):
    """`term` is the request's term when granted, the responder's own term when refused."""
    granted: bool


@dataclass(frozen=True, slots=True)
class VoteRequest(RaftMessage):
    last_log_index: int
    last_log_term: int


@dataclass(frozen=True, slots=True)
class VoteResponse(RaftMessage):
    granted: bool


@dataclass(frozen=True, slots=True)
class AppendRequest(RaftMessage):
    """Entries after (previous_index, previous_term), or none (a heartbeat); the leader's
    commit index; and `lease_context`, the leader's tick when it sent this, which the answer
    echoes (what the leader's lease counts from: RaftNode.lease_remaining_ticks)."""
    previous_index: int
    previous_term: int
    entries: tuple[Entry, ...]
    leader_commit: int
    lease_context: int = 0


@dataclass(frozen=True, slots=True)
class AppendResponse(RaftMessage):
    """The answer to an `AppendRequest` or a `SnapshotRequest`. On success, the sender's log
    matches the leader's up to `match_index`. On refusal, `rejected_index` is the request's
    previous_index and (hint_index, hint_term) the last entry of the sender's log at or below
    it whose term is at most the request's previous_term (fast backtracking). Either way it
    echoes the request's `lease_context` (0 for a snapshot's answer)."""
    success: bool
    match_index: int
    rejected_index: int
    hint_index: int
    hint_term: int
    lease_context: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotRequest(RaftMessage):
    """Install this snapshot: the leader no longer holds the entries you need. Answered by
    an `AppendResponse`."""
    snapshot: Snapshot


Message = PreVoteRequest | PreVoteResponse | VoteRequest | VoteResponse | AppendRequest | AppendResponse | SnapshotRequest
MESSAGE_TYPES: tuple[type[RaftMessage], ...] = (PreVoteRequest, PreVoteResponse, VoteRequest, VoteResponse,
                                                AppendRequest, AppendResponse, SnapshotRequest)
