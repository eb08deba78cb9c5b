"""A pure Raft core: the membership layer's consensus as a state machine (issue 12, item 1).

In the style of etcd-io/raft: the node feeds it `tick()`, `step(message)`, `propose(command)`
and `propose_change(change)`, then takes a `Ready` and does what it says in its order
(persist in one transaction, send, apply) before calling `advance(ready)`. Nothing here
waits, reads a clock, draws its own random numbers or does I/O: time is the count of
`tick()` calls and randomness is the injected `random.Random` (tests/test_purity.py).

What it implements and why (docs/RAFT.md has the long form):
- elections with pre-vote (a node cut off does not raise its term, so it cannot depose a
  healthy leader when it returns) and check-quorum (a leader that has not heard from a
  majority of voters within `election_timeout_min_ticks` steps down); nodes refuse votes for
  that long after hearing from a leader, and after a restart, which is what makes leases safe;
- replication with the §5.3 check, truncation only from the first entry whose term differs,
  fast backtracking, commitment by counting only of entries of the leader's own term, replies
  from older terms ignored; flow control by a bounded pipeline per follower;
- snapshots: the application hands one in with `compact`, followers too far behind get it;
- single-server membership changes, in force as soon as appended (Raft thesis §4.1), one at a
  time and only after the leader committed an entry of its own term;
- storage identity: members are (node id, storage id); a vote, an acknowledgement or a sign
  of life counts only from the disk the configuration names.
"""
from __future__ import annotations

import enum
import random
from collections.abc import Callable
from typing import Any, ClassVar

from replication.invariants import InvariantViolation
from replication.raft_contract import (
    ChangeKind,
    ConfigurationChange,
    PersistedState,
    ProposalOutcome,
    Proposed,
    RaftLimits,
    Ready,
    Refusal,
    Refused,
    bootstrap_state,
    changed_configuration,
    empty_state,
)
from replication.raft_log import RaftLog
from replication.raft_messages import (
    ENTRY_OVERHEAD_BYTES,
    AppendRequest,
    AppendResponse,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Message,
    PreVoteRequest,
    PreVoteResponse,
    RaftMessage,
    Snapshot,
    SnapshotRequest,
    VoteRequest,
    VoteResponse,
)
from replication.raft_progress import Progress, ProgressState

# The driver imports everything from here; the values live in raft_contract and raft_progress.
__all__ = ["ChangeKind", "ConfigurationChange", "PersistedState", "Progress", "ProgressState", "ProposalOutcome",
           "Proposed", "RaftLimits", "RaftNode", "Ready", "Refusal", "Refused", "Role", "bootstrap_state",
           "changed_configuration", "empty_state"]


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


MessageHandler = Callable[["RaftNode", Any], None]


class RaftNode:
    """One node's Raft state. Owned by one task; not thread-safe, never blocks."""

    _HANDLERS: ClassVar[dict[tuple[Role, type[RaftMessage]], MessageHandler]]

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

    # --- inputs -------------------------------------------------------------------------------
    def tick(self) -> None:
        self._require_no_ready_outstanding()
        self._tick_count += 1
        if self._role is Role.LEADER:
            self._tick_leader()
        else:
            self._tick_election()

    def step(self, message: Message) -> None:
        self._require_no_ready_outstanding()
        if message.recipient != self._node_id or message.sender == self._node_id:
            self.bad_messages_ignored += 1
            return
        if message.term > self._term:
            if not self._accept_higher_term(message):
                return
        elif message.term < self._term:
            self._answer_older_term(message)
            return
        handler = self._HANDLERS.get((self._role, type(message)))
        if handler is None:
            self.stale_messages_ignored += 1      # e.g. a vote answer after the election ended
            return
        handler(self, message)

    def campaign(self) -> bool:
        """Start an election now, as if the election timer had fired (an operator moving the
        leadership, a test choosing its leader). False if this node may not campaign (not a
        voter on this disk) or already leads."""
        self._require_no_ready_outstanding()
        if self._role is Role.LEADER or not self._may_campaign():
            return False
        self._election_elapsed = 0
        self._start_pre_vote()
        return True

    def propose(self, command: bytes) -> ProposalOutcome:
        self._require_no_ready_outstanding()
        refusal = self._refusal_to_append(len(command))
        if refusal is not None:
            return Refused(refusal)
        entry = Entry(self._log.last_index + 1, self._term, EntryKind.COMMAND, command=command)
        self._append_as_leader(entry)
        return Proposed(entry.index, entry.term)

    def propose_change(self, change: ConfigurationChange) -> ProposalOutcome:
        """One single-server change, refused unless an entry of this leader's term has
        committed and no other change is pending (the fix to the thesis' §4.1 algorithm)."""
        self._require_no_ready_outstanding()
        refusal = self._refusal_to_append(0)
        if refusal is None and self._commit < self._term_start_index:
            refusal = Refusal.TERM_NOT_COMMITTED
        if refusal is None and self._log.configuration_index > self._commit:
            refusal = Refusal.CHANGE_PENDING
        if refusal is None and change.kind is ChangeKind.PROMOTE_LEARNER:
            refusal = self._refusal_to_promote(change.node_id)
        if refusal is not None:
            return Refused(refusal)
        configuration = changed_configuration(self._log.configuration, change)
        if isinstance(configuration, Refusal):
            return Refused(configuration)
        entry = Entry(self._log.last_index + 1, self._term, EntryKind.CONFIGURATION, configuration=configuration)
        self._append_as_leader(entry)
        return Proposed(entry.index, entry.term)

    def compact(self, index: int, data: bytes) -> bool:
        """The application's snapshot of its state after applying `index`: the log before it
        goes (in memory now, on disk with the next Ready). False if it covers nothing new or
        more than was applied."""
        self._require_no_ready_outstanding()
        if not self._log.snapshot.index < index <= self._applied:
            return False
        term = self._log.term_at(index)
        if term is None:
            raise InvariantViolation(f"no term for applied index {index}")
        snapshot = Snapshot(index, term, self._log.configuration_at(index), data)
        self._log.compact(snapshot)
        self._pending_compaction = snapshot
        return True

    # --- the Ready cycle ----------------------------------------------------------------------
    def has_ready(self) -> bool:
        hard = self._persisted_hard_state
        return bool(self._outbox or self._replication_pending or self._log.has_unpersisted()
                    or self._pending_install or self._pending_compaction or self._commit > self._applied
                    or hard.term != self._term or hard.vote != self._vote or hard.commit != self._commit)

    def ready(self) -> Ready:
        self._require_no_ready_outstanding()
        if self._replication_pending:
            self._replication_pending = False
            self._replicate_to_all()
        hard_state = HardState(self._term, self._vote, self._commit)
        truncate_from, entries = self._log.unpersisted()
        last_to_apply = min(self._commit, self._applied + self._limits.apply_entries_max)
        ready = Ready(
            hard_state=None if hard_state == self._persisted_hard_state else hard_state,
            install_snapshot=self._pending_install,
            compaction=self._pending_compaction,
            truncate_from=truncate_from,
            entries=entries,
            messages=tuple(self._outbox),
            committed_entries=self._log.entries_between(self._applied + 1, last_to_apply),
        )
        self._ready_outstanding = ready
        return ready

    def advance(self, ready: Ready) -> None:
        """The driver did everything `ready` asked, in order."""
        if ready is not self._ready_outstanding:
            raise InvariantViolation("advance() with a Ready that is not the outstanding one")
        self._ready_outstanding = None
        if ready.hard_state is not None:
            self._persisted_hard_state = ready.hard_state
        self._log.mark_persisted()
        self._outbox = []
        self._pending_install = None
        self._pending_compaction = None
        if ready.committed_entries:
            self._applied = ready.committed_entries[-1].index

    def _require_no_ready_outstanding(self) -> None:
        if self._ready_outstanding is not None:
            raise InvariantViolation("the core was driven between ready() and advance()")

    # --- roles --------------------------------------------------------------------------------
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

    def _start_pre_vote(self) -> None:
        """Ask the voters whether they would vote for us, without raising any term."""
        self._transition(Role.PRE_CANDIDATE)
        self._leader_id = None
        self._votes = {self._node_id: (self._storage_id, True)}
        if self._election_won():
            self._start_election()
            return
        for voter_id in self._log.configuration.voter_ids():
            if voter_id != self._node_id:
                self._send(PreVoteRequest(self._term + 1, self._node_id, voter_id, self._storage_id,
                                          self._log.last_index, self._log.last_term))

    def _start_election(self) -> None:
        self._transition(Role.CANDIDATE)
        self._term += 1
        self._vote = self._node_id
        self._leader_id = None
        self._votes = {self._node_id: (self._storage_id, True)}
        if self._election_won():
            self._become_leader()
            return
        for voter_id in self._log.configuration.voter_ids():
            if voter_id != self._node_id:
                self._send(VoteRequest(self._term, self._node_id, voter_id, self._storage_id,
                                       self._log.last_index, self._log.last_term))

    def _become_leader(self) -> None:
        self._transition(Role.LEADER)
        self._leader_id = self._node_id
        self._heartbeat_elapsed = 0
        self._progress = {}
        self._sync_progress_with_configuration()
        # The no-op of this term: once it commits, everything before it has too (§5.4.2), and
        # configuration changes may start.
        entry = Entry(self._log.last_index + 1, self._term, EntryKind.LEADER_START)
        self._term_start_index = entry.index
        self._append_as_leader(entry)

    def _step_down(self) -> None:
        self._become_follower(self._term, None)

    def _election_won(self) -> bool:
        granted, _ = self._tally()
        return granted >= self._log.configuration.quorum

    def _election_lost(self) -> bool:
        configuration = self._log.configuration
        _, refused = self._tally()
        return refused > len(configuration.voters) - configuration.quorum

    def _tally(self) -> tuple[int, int]:
        """(granted, refused) among the configuration's voters, counting only answers from the
        disk the configuration names."""
        granted = refused = 0
        for member in self._log.configuration.voters:
            answer = self._votes.get(member.node_id)
            if answer is not None and answer[0] == member.storage_id:
                if answer[1]:
                    granted += 1
                else:
                    refused += 1
        return granted, refused

    def _random_election_timeout(self) -> int:
        return self._random.randrange(self._limits.election_timeout_min_ticks, self._limits.election_timeout_max_ticks)

    def _may_campaign(self) -> bool:
        return self._log.configuration.is_voter(self._node_id, self._storage_id)

    def _may_vote(self) -> bool:
        """A node that knows the configuration names another disk for it has lost what it
        promised before: it grants nothing."""
        known_as = self._log.configuration.storage_id_of(self._node_id)
        return known_as is None or known_as == self._storage_id

    def _in_leader_lease(self) -> bool:
        """Leader stickiness: no vote while a leader (or we, as leader) was heard from recently."""
        return self._role is Role.LEADER or self._tick_count < self._refuse_votes_until_tick

    # --- ticks --------------------------------------------------------------------------------
    def _tick_election(self) -> None:
        self._election_elapsed += 1
        if self._election_elapsed < self._election_timeout:
            return
        self._election_elapsed = 0
        self._election_timeout = self._random_election_timeout()
        if self._may_campaign():
            self._start_pre_vote()

    def _tick_leader(self) -> None:
        if not self._quorum_heard_recently():
            self._step_down()         # check-quorum
            return
        self._heartbeat_elapsed += 1
        if self._heartbeat_elapsed >= self._limits.heartbeat_interval_ticks:
            self._heartbeat_elapsed = 0
            for node_id, progress in self._progress.items():
                self._heartbeat(node_id, progress)

    def _quorum_heard_recently(self) -> bool:
        configuration = self._log.configuration
        horizon = self._tick_count - self._limits.election_timeout_min_ticks
        heard = 0
        for member in configuration.voters:
            if member.node_id == self._node_id:
                heard += member.storage_id == self._storage_id
                continue
            progress = self._progress.get(member.node_id)
            if progress is not None and progress.storage_id == member.storage_id and progress.heard_tick > horizon:
                heard += 1
        return heard >= configuration.quorum

    # --- messages: terms ----------------------------------------------------------------------
    def _accept_higher_term(self, message: Message) -> bool:
        """Whether to go on with a message from a later term (after moving to it if need be)."""
        if isinstance(message, (PreVoteRequest, VoteRequest)):
            if self._in_leader_lease():
                self.stale_messages_ignored += 1      # neither the term nor the vote moves
                return False
            if isinstance(message, VoteRequest):
                self._become_follower(message.term, None)
            return True                               # a pre-vote never changes a term
        if isinstance(message, PreVoteResponse) and message.granted:
            return True                               # granted at the term we would campaign for
        leader = message.sender if isinstance(message, (AppendRequest, SnapshotRequest)) else None
        self._become_follower(message.term, leader)
        return True

    def _answer_older_term(self, message: Message) -> None:
        """A leader of an older term learns ours (it may be cut off and not know); a pre-vote
        from an older term is refused with ours; anything else is stale and ignored."""
        if isinstance(message, (AppendRequest, SnapshotRequest)):
            self._send(AppendResponse(self._term, self._node_id, message.sender, self._storage_id,
                                      success=False, match_index=0, rejected_index=0, hint_index=0, hint_term=0))
        elif isinstance(message, PreVoteRequest):
            self._send(PreVoteResponse(self._term, self._node_id, message.sender, self._storage_id, granted=False))
        else:
            self.stale_messages_ignored += 1

    # --- messages: elections ------------------------------------------------------------------
    def _on_pre_vote_request(self, message: PreVoteRequest) -> None:
        if self._in_leader_lease():
            self.stale_messages_ignored += 1
            return
        granted = (message.term > self._term and self._may_vote()
                   and self._log.is_up_to_date(message.last_log_index, message.last_log_term))
        self._send(PreVoteResponse(message.term if granted else self._term, self._node_id, message.sender,
                                   self._storage_id, granted=granted))

    def _on_vote_request(self, message: VoteRequest) -> None:
        if self._in_leader_lease():
            self.stale_messages_ignored += 1
            return
        granted = (self._vote in (None, message.sender) and self._may_vote()
                   and self._log.is_up_to_date(message.last_log_index, message.last_log_term))
        if granted:
            if self._role is not Role.FOLLOWER:
                self._become_follower(self._term, None)
            self._vote = message.sender
            self._election_elapsed = 0
        self._send(VoteResponse(self._term, self._node_id, message.sender, self._storage_id, granted=granted))

    def _on_pre_vote_response(self, message: PreVoteResponse) -> None:
        if message.granted and message.term != self._term + 1:
            self.stale_messages_ignored += 1
            return
        self._votes[message.sender] = (message.sender_storage_id, message.granted)
        if self._election_won():
            self._start_election()
        elif self._election_lost():
            self._become_follower(self._term, None)

    def _on_vote_response(self, message: VoteResponse) -> None:
        self._votes[message.sender] = (message.sender_storage_id, message.granted)
        if self._election_won():
            self._become_leader()
        elif self._election_lost():
            self._become_follower(self._term, None)

    # --- messages: a follower -----------------------------------------------------------------
    def _follow(self, leader: str) -> None:
        """A message from this term's leader: it is the leader, and it is alive."""
        if self._role is not Role.FOLLOWER:
            self._become_follower(self._term, leader)
        elif self._leader_id != leader:
            if self._leader_id is not None:
                raise InvariantViolation(f"two leaders in term {self._term}: {self._leader_id} and {leader}")
            self._leader_id = leader
        self._election_elapsed = 0
        self._refuse_votes_until_tick = self._tick_count + self._limits.election_timeout_min_ticks

    def _on_append_request(self, message: AppendRequest) -> None:
        self._follow(message.sender)
        entries = message.entries
        previous_index, previous_term = message.previous_index, message.previous_term
        if previous_index < self._commit:
            # Everything up to our commit index is the leader's too: skip what it covers.
            covered = min(len(entries), self._commit - previous_index)
            self._check_committed_entries_agree(entries[:covered])
            entries = entries[covered:]
            previous_index = self._commit
        elif self._log.term_at(previous_index) != previous_term:
            self._refuse_append(message)
            return
        configuration_index = self._log.configuration_index
        removed = self._log.merge(entries, self._commit)
        self.entries_truncated += removed
        last_verified = previous_index + len(entries)
        if message.leader_commit > self._commit:
            self._commit = max(self._commit, min(message.leader_commit, last_verified))
        if removed or self._log.configuration_index != configuration_index:
            self._on_configuration_changed()
        self._answer_append(message.sender, last_verified, message.lease_context)

    def _check_committed_entries_agree(self, entries: tuple[Entry, ...]) -> None:
        for entry in entries:
            own_term = self._log.term_at(entry.index)
            if own_term is not None and own_term != entry.term:
                raise InvariantViolation(f"committed entry {entry.index} has term {own_term}, the leader's {entry.term}")

    def _refuse_append(self, message: AppendRequest) -> None:
        hint_index, hint_term = self._log.last_at_or_below(message.previous_index, message.previous_term)
        self._send(AppendResponse(self._term, self._node_id, message.sender, self._storage_id, success=False,
                                  match_index=0, rejected_index=message.previous_index,
                                  hint_index=hint_index, hint_term=hint_term, lease_context=message.lease_context))

    def _answer_append(self, leader: str, match_index: int, lease_context: int = 0) -> None:
        self._send(AppendResponse(self._term, self._node_id, leader, self._storage_id, success=True,
                                  match_index=match_index, rejected_index=0, hint_index=0, hint_term=0,
                                  lease_context=lease_context))

    def _on_snapshot_request(self, message: SnapshotRequest) -> None:
        self._follow(message.sender)
        snapshot = message.snapshot
        if snapshot.index <= self._commit:
            self._answer_append(message.sender, self._commit)
            return
        if self._log.term_at(snapshot.index) == snapshot.term:
            # We hold its last entry, so our log is the leader's up to there: only commit.
            self._commit = snapshot.index
            self._answer_append(message.sender, snapshot.index)
            return
        self._log.install(snapshot)
        self._commit = snapshot.index
        self._applied = snapshot.index
        self._pending_install = snapshot
        self._pending_compaction = None
        self._on_configuration_changed()
        self._answer_append(message.sender, snapshot.index)

    # --- messages: the leader -----------------------------------------------------------------
    def _on_rival_leader(self, message: AppendRequest | SnapshotRequest) -> None:
        raise InvariantViolation(f"{self._node_id} leads term {self._term} and so does {message.sender}")

    def _on_append_response(self, message: AppendResponse) -> None:
        progress = self._progress.get(message.sender)
        if progress is None:
            self.stale_messages_ignored += 1          # no longer a member
            return
        if message.sender_storage_id != progress.storage_id:
            # Another disk answers for this node: nothing the old one acknowledged stands.
            self._reset_progress(progress, message.sender_storage_id)
        progress.heard_tick = self._tick_count
        progress.lease_context = max(progress.lease_context, message.lease_context)
        if message.success:
            self._on_append_accepted(message.sender, progress, message.match_index)
        else:
            self._on_append_rejected(message.sender, progress, message)

    def _reset_progress(self, progress: Progress, storage_id: bytes) -> None:
        progress.move_to(ProgressState.PROBE)
        progress.storage_id = storage_id
        progress.match_index = 0
        progress.commit_sent = 0
        progress.lease_context = 0
        progress.next_index = self._log.last_index + 1

    def _on_append_accepted(self, node_id: str, progress: Progress, match_index: int) -> None:
        if match_index > self._log.last_index:
            self.bad_messages_ignored += 1
            return
        advanced = match_index > progress.match_index
        if advanced:
            progress.match_index = match_index
            progress.progress_tick = self._tick_count
        if progress.state is ProgressState.REPLICATE:
            progress.in_flight = [last for last in progress.in_flight if last > match_index]
            progress.next_index = max(progress.next_index, match_index + 1)
        elif progress.state is ProgressState.PROBE or progress.match_index >= progress.snapshot_index:
            progress.move_to(ProgressState.REPLICATE)
            progress.next_index = progress.match_index + 1
            progress.progress_tick = self._tick_count
        if advanced:
            committed = self._commit
            self._advance_commit()
            if self._commit > committed and self._role is Role.LEADER:
                for other_id, other in self._progress.items():
                    if other_id != node_id:
                        self._tell_commit(other_id, other)
        if self._role is Role.LEADER:
            self._replicate(node_id, progress)
            self._tell_commit(node_id, progress)

    def _tell_commit(self, node_id: str, progress: Progress) -> None:
        """Send a follower in step the commit index it can take now (as etcd's bcastAppend
        does), not at the next heartbeat: a map change should reach every node's copy within
        a round trip, or a node asked right after a handoff still names the old master. The
        append goes after the follower's match index, which it holds, so it is never refused;
        a follower takes the commit index only up to what the append vouches for."""
        if progress.state is ProgressState.REPLICATE and progress.match_index >= self._log.snapshot.index \
                and min(self._commit, progress.match_index) > progress.commit_sent:
            self._send_append(node_id, progress.match_index, ())
            progress.last_sent_tick = self._tick_count

    def _on_append_rejected(self, node_id: str, progress: Progress, message: AppendResponse) -> None:
        if progress.state is ProgressState.REPLICATE:
            if message.rejected_index <= progress.match_index:
                self.stale_messages_ignored += 1
                return
            progress.move_to(ProgressState.PROBE)
        elif progress.state is ProgressState.PROBE:
            if message.rejected_index != progress.next_index - 1:
                self.stale_messages_ignored += 1
                return
        else:
            return                                  # the snapshot's answer decides
        agreed_index, _ = self._log.last_at_or_below(message.hint_index, message.hint_term)
        progress.next_index = max(progress.match_index + 1, min(message.rejected_index, agreed_index + 1))
        self._send_probe(node_id, progress)

    def _advance_commit(self) -> None:
        """Commit the highest index a majority of counted voters hold, if it is of our term."""
        configuration = self._log.configuration
        matches = []
        for member in configuration.voters:
            if member.node_id == self._node_id:
                matches.append(self._log.last_index if member.storage_id == self._storage_id else 0)
                continue
            progress = self._progress.get(member.node_id)
            counted = progress is not None and progress.storage_id == member.storage_id
            matches.append(progress.match_index if counted and progress is not None else 0)
        matches.sort(reverse=True)
        candidate = matches[configuration.quorum - 1]
        if candidate <= self._commit or self._log.term_at(candidate) != self._term:
            return
        self._commit = candidate
        if not configuration.is_voter(self._node_id, self._storage_id) and self._commit >= self._log.configuration_index:
            self._step_down()         # our removal is committed: let the others elect a leader

    # --- replication --------------------------------------------------------------------------
    def _refusal_to_append(self, size_bytes: int) -> Refusal | None:
        if self._role is not Role.LEADER:
            return Refusal.NOT_LEADER
        if size_bytes + ENTRY_OVERHEAD_BYTES > self._limits.append_bytes_max:
            return Refusal.TOO_LARGE
        if self._log.last_index - self._commit >= self._limits.uncommitted_entries_max:
            return Refusal.TOO_MANY_UNCOMMITTED
        return None

    def _refusal_to_promote(self, node_id: str) -> Refusal | None:
        progress = self._progress.get(node_id)
        configuration = self._log.configuration
        if progress is None or progress.storage_id != configuration.storage_id_of(node_id):
            return Refusal.LEARNER_BEHIND
        if progress.match_index + self._limits.learner_lag_max_entries < self._commit:
            return Refusal.LEARNER_BEHIND
        return None

    def _append_as_leader(self, entry: Entry) -> None:
        self._log.append(entry)
        if entry.kind is EntryKind.CONFIGURATION:
            self._on_configuration_changed()
        self._replication_pending = True
        self._advance_commit()     # a single voter commits alone

    def _on_configuration_changed(self) -> None:
        if self._role is Role.LEADER:
            self._sync_progress_with_configuration()

    def _sync_progress_with_configuration(self) -> None:
        configuration = self._log.configuration
        # Sorted, never a set's order: the order messages leave in must not depend on hashing.
        members = [node_id for node_id in configuration.node_ids() if node_id != self._node_id]
        for node_id in list(self._progress):
            if not configuration.is_member(node_id):
                del self._progress[node_id]
        for node_id in members:
            if node_id not in self._progress:
                storage_id = configuration.storage_id_of(node_id) or b""
                self._progress[node_id] = Progress(storage_id=storage_id, next_index=self._log.last_index + 1,
                                                   progress_tick=self._tick_count, heard_tick=self._tick_count)

    def _replicate_to_all(self) -> None:
        for node_id, progress in self._progress.items():
            self._replicate(node_id, progress)

    def _replicate(self, node_id: str, progress: Progress) -> None:
        if progress.state is ProgressState.REPLICATE:
            self._send_pipelined(node_id, progress)
        elif progress.state is ProgressState.PROBE and not progress.probe_outstanding:
            self._send_probe(node_id, progress)

    def _heartbeat(self, node_id: str, progress: Progress) -> None:
        """Every heartbeat interval each follower hears from us: a probe or a snapshot sent
        again when its answer is overdue, or an empty append that carries the commit index."""
        overdue = self._tick_count - progress.sent_tick >= self._limits.resend_after_ticks
        if progress.state is ProgressState.PROBE and (not progress.probe_outstanding or overdue):
            self._send_probe(node_id, progress)
        elif progress.state is ProgressState.SNAPSHOT and overdue:
            self._send_snapshot(node_id, progress)
        elif (progress.state is ProgressState.REPLICATE and progress.in_flight
              and self._tick_count - progress.progress_tick >= self._limits.resend_after_ticks):
            progress.move_to(ProgressState.PROBE)     # the pipeline stalled: something was lost
            progress.next_index = progress.match_index + 1
            self._send_probe(node_id, progress)
        elif self._tick_count - progress.last_sent_tick >= self._limits.heartbeat_interval_ticks:
            previous_index = max(progress.match_index, self._log.snapshot.index)
            self._send_append(node_id, previous_index, ())
            progress.last_sent_tick = self._tick_count

    def _send_probe(self, node_id: str, progress: Progress) -> None:
        if progress.next_index <= self._log.snapshot.index:
            self._send_snapshot(node_id, progress)
            return
        entries = self._log.entries_for_append(progress.next_index, self._limits.append_entries_max,
                                               self._limits.append_bytes_max)
        self._send_append(node_id, progress.next_index - 1, entries)
        progress.probe_outstanding = True
        progress.sent_tick = progress.last_sent_tick = self._tick_count

    def _send_pipelined(self, node_id: str, progress: Progress) -> None:
        limits = self._limits
        while len(progress.in_flight) < limits.in_flight_appends_max and progress.next_index <= self._log.last_index:
            if progress.next_index <= self._log.snapshot.index:
                self._send_snapshot(node_id, progress)
                return
            entries = self._log.entries_for_append(progress.next_index, limits.append_entries_max,
                                                   limits.append_bytes_max)
            if not progress.in_flight:
                progress.progress_tick = self._tick_count
            self._send_append(node_id, progress.next_index - 1, entries)
            progress.in_flight.append(entries[-1].index)
            progress.next_index = entries[-1].index + 1
            progress.last_sent_tick = self._tick_count

    def _send_append(self, node_id: str, previous_index: int, entries: tuple[Entry, ...]) -> None:
        previous_term = self._log.term_at(previous_index)
        if previous_term is None:
            raise InvariantViolation(f"no term for index {previous_index} to send after")
        progress = self._progress.get(node_id)
        if progress is not None:
            progress.commit_sent = max(progress.commit_sent, min(self._commit, previous_index + len(entries)))
        self._send(AppendRequest(self._term, self._node_id, node_id, self._storage_id,
                                 previous_index, previous_term, entries, self._commit, self._tick_count))

    def _send_snapshot(self, node_id: str, progress: Progress) -> None:
        snapshot = self._log.snapshot
        if progress.state is not ProgressState.SNAPSHOT:
            progress.move_to(ProgressState.SNAPSHOT)
        progress.snapshot_index = snapshot.index
        progress.sent_tick = progress.last_sent_tick = self._tick_count
        self._send(SnapshotRequest(self._term, self._node_id, node_id, self._storage_id, snapshot))

    def _send(self, message: Message) -> None:
        self._outbox.append(message)


def _handlers() -> dict[tuple[Role, type[RaftMessage]], MessageHandler]:
    """One handler per (role, message type); a pair not listed is ignored as stale."""
    table: dict[tuple[Role, type[RaftMessage]], MessageHandler] = {}
    for role in Role:
        table[(role, PreVoteRequest)] = RaftNode._on_pre_vote_request
        table[(role, VoteRequest)] = RaftNode._on_vote_request
    for role in (Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE):
        table[(role, AppendRequest)] = RaftNode._on_append_request
        table[(role, SnapshotRequest)] = RaftNode._on_snapshot_request
    table[(Role.PRE_CANDIDATE, PreVoteResponse)] = RaftNode._on_pre_vote_response
    table[(Role.CANDIDATE, VoteResponse)] = RaftNode._on_vote_response
    table[(Role.LEADER, AppendResponse)] = RaftNode._on_append_response
    table[(Role.LEADER, AppendRequest)] = RaftNode._on_rival_leader
    table[(Role.LEADER, SnapshotRequest)] = RaftNode._on_rival_leader
    return table


RaftNode._HANDLERS = _handlers()
