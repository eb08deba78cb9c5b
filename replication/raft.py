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
from replication.raft_messages import (
    AppendRequest,
    AppendResponse,
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
from replication.raft_replication import LeaderReplication
from replication.raft_state import Role

# The driver imports everything from here; the values live in raft_contract, raft_progress and
# raft_state.
__all__ = ["ChangeKind", "ConfigurationChange", "PersistedState", "Progress", "ProgressState", "ProposalOutcome",
           "Proposed", "RaftLimits", "RaftNode", "Ready", "Refusal", "Refused", "Role", "bootstrap_state",
           "changed_configuration", "empty_state"]


MessageHandler = Callable[["RaftNode", Any], None]


class RaftNode(LeaderReplication):
    """One node's Raft core: its inputs, the Ready cycle, elections and the follower's side;
    the leader's replication is `LeaderReplication`'s (replication/raft_replication.py), the
    state and roles `RaftState`'s (replication/raft_state.py)."""

    _HANDLERS: ClassVar[dict[tuple[Role, type[RaftMessage]], MessageHandler]]

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

    # --- elections ----------------------------------------------------------------------------
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
