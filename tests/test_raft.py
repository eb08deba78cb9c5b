"""Scenario tests of the pure Raft core (replication/raft.py), and regression tests for the
holes issue 12 found in pysyncobj.

`Cluster` drives real cores through a hand-held network: messages wait in `in_flight` until
`settle()` (or `run()`) delivers them, links can be blocked, and every node writes its
Ready to the simulator's disk model (tests/sim/raft_sim.py), so crashes lose exactly what
was not written. Election timeouts come from an injected random source that always answers
the same value, so no election starts unless a test asks for one (`elect`).
"""
from __future__ import annotations

import random

import pytest

from replication.invariants import InvariantViolation
from replication.raft import (
    ChangeKind,
    ConfigurationChange,
    PersistedState,
    Progress,
    ProgressState,
    Proposed,
    RaftLimits,
    RaftNode,
    Ready,
    Refusal,
    Refused,
    Role,
    bootstrap_state,
    empty_state,
)
from replication.raft_log import RaftLog
from replication.raft_messages import (
    AppendRequest,
    AppendResponse,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    Message,
    PreVoteRequest,
    PreVoteResponse,
    Snapshot,
    VoteRequest,
    VoteResponse,
)
from tests.sim.raft_sim import Disk

LIMITS = RaftLimits(election_timeout_min_ticks=10, election_timeout_max_ticks=20, heartbeat_interval_ticks=2,
                    resend_after_ticks=4, append_entries_max=4, append_bytes_max=1024, in_flight_appends_max=2,
                    uncommitted_entries_max=16, apply_entries_max=64, learner_lag_max_entries=2)
QUIET_TIMEOUT = 19      # the election timeout every node draws: long enough that tests decide who campaigns


class FixedTimeouts(random.Random):
    """The injected random source: every election timeout is the one the test chose."""

    def __init__(self, timeout: int) -> None:
        super().__init__(0)
        self.timeout = timeout

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        return self.timeout


def storage(node_id: str, generation: int = 0) -> bytes:
    return f"{node_id}-{generation}".encode()


def voters(*node_ids: str) -> Configuration:
    return Configuration(frozenset(Member(node_id, storage(node_id)) for node_id in node_ids))


class Cluster:
    def __init__(self, *node_ids: str, limits: RaftLimits = LIMITS, timeouts: dict[str, int] | None = None) -> None:
        self.limits = limits
        self.timeouts = timeouts or {}
        configuration = voters(*node_ids)
        self.disks = {node_id: Disk.holding(storage(node_id), bootstrap_state(configuration)) for node_id in node_ids}
        self.nodes: dict[str, RaftNode] = {}
        self.down: set[str] = set()
        self.in_flight: list[Message] = []
        self.blocked: set[tuple[str, str]] = set()
        self.applied: dict[str, list[Entry]] = {node_id: [] for node_id in node_ids}
        self.readies: dict[str, list[Ready]] = {node_id: [] for node_id in node_ids}
        for node_id in node_ids:
            self.start(node_id)
        # A node refuses votes for one minimum election timeout after it starts (it may have
        # heard from a leader just before): let that pass.
        self.tick_all(limits.election_timeout_min_ticks)

    # --- the world ---------------------------------------------------------------------------
    def start(self, node_id: str) -> None:
        disk = self.disks[node_id]
        self.nodes[node_id] = RaftNode(node_id, disk.storage_id, disk.persisted_state(), self.limits,
                                       FixedTimeouts(self.timeouts.get(node_id, QUIET_TIMEOUT)))
        self.down.discard(node_id)

    def crash(self, node_id: str) -> None:
        """Memory is lost; the disk keeps what Readies wrote."""
        self.down.add(node_id)

    def wipe(self, node_id: str, generation: int) -> None:
        self.crash(node_id)
        self.disks[node_id] = Disk.holding(storage(node_id, generation), empty_state())
        self.applied[node_id] = []

    def live(self) -> list[RaftNode]:
        return [node for node_id, node in self.nodes.items() if node_id not in self.down]

    def isolate(self, node_id: str) -> None:
        for other in self.nodes:
            if other != node_id:
                self.blocked |= {(node_id, other), (other, node_id)}

    def heal(self) -> None:
        self.blocked.clear()

    def flush(self) -> None:
        """Every live node handles its Ready: write, send (into in_flight), apply, advance."""
        for node in self.live():
            if node.has_ready():
                ready = node.ready()
                self.disks[node.node_id].write(ready)
                self.readies[node.node_id].append(ready)
                self.in_flight.extend(ready.messages)
                self.applied[node.node_id].extend(ready.committed_entries)
                node.advance(ready)

    def deliver(self, keep: bool = False) -> list[Message]:
        """Deliver what is in flight (blocked links and crashed nodes lose it)."""
        messages, self.in_flight = self.in_flight, []
        for message in messages:
            recipient = self.nodes.get(message.recipient)
            if recipient is not None and (message.sender, message.recipient) not in self.blocked \
                    and message.recipient not in self.down:
                recipient.step(message)
        return messages

    def settle(self, rounds_max: int = 100) -> None:
        self.flush()
        for _ in range(rounds_max):
            if not self.in_flight:
                return
            self.deliver()
            self.flush()
        raise AssertionError("messages still flowing after 100 rounds")

    def tick_all(self, ticks: int = 1) -> None:
        for _ in range(ticks):
            for node in self.live():
                node.tick()
            self.settle()

    def lapse_leases(self) -> None:
        """Nodes refuse votes for an election timeout after hearing from a leader: let it pass."""
        self.tick_all(self.limits.election_timeout_min_ticks)

    def elect(self, node_id: str) -> RaftNode:
        assert self.nodes[node_id].campaign()
        self.settle()
        leader = self.nodes[node_id]
        assert leader.is_leader, f"{node_id} did not win: {leader.role}"
        return leader

    def propose(self, node_id: str, *commands: bytes) -> list[Proposed]:
        outcomes = [self.nodes[node_id].propose(command) for command in commands]
        assert all(isinstance(outcome, Proposed) for outcome in outcomes), outcomes
        return [outcome for outcome in outcomes if isinstance(outcome, Proposed)]

    def change(self, node_id: str, kind: ChangeKind, member: str, storage_id: bytes = b"") -> Proposed | Refused:
        return self.nodes[node_id].propose_change(ConfigurationChange(kind, member, storage_id))

    def commands(self, node_id: str) -> list[bytes]:
        return [entry.command for entry in self.applied[node_id] if entry.kind is EntryKind.COMMAND]


def follower_with_log(entries: list[Entry], term: int, commit: int, node_id: str = "b") -> RaftNode:
    """A follower restarted from a disk holding exactly these entries (after entry 1, the
    configuration of a, b and c)."""
    first = Entry(1, 1, EntryKind.CONFIGURATION, configuration=voters("a", "b", "c"))
    state = PersistedState(HardState(term, None, commit), Snapshot(0, 0, Configuration(), b""), (first, *entries))
    return RaftNode(node_id, storage(node_id), state, LIMITS, FixedTimeouts(QUIET_TIMEOUT))


def command(index: int, term: int, text: str = "") -> Entry:
    return Entry(index, term, EntryKind.COMMAND, command=(text or f"{term}.{index}").encode())


def append_from(leader: str, term: int, previous: tuple[int, int], entries: list[Entry], commit: int,
                recipient: str = "b") -> AppendRequest:
    return AppendRequest(term, leader, recipient, storage(leader), previous[0], previous[1], tuple(entries), commit)


def answers(ready: Ready) -> list[AppendResponse]:
    return [message for message in ready.messages if isinstance(message, AppendResponse)]


# --- elections -------------------------------------------------------------------------------
def test_a_node_that_campaigns_wins_a_pre_vote_then_a_vote_and_leads_the_next_term() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    assert leader.term == 2 and leader.leader_id == "a"
    assert all(node.leader_id == "a" and node.term == 2 for node in cluster.live())
    assert leader.commit_index == 2, "the leader's no-op of its term commits"


def test_an_election_timer_that_fires_starts_an_election_on_its_own() -> None:
    cluster = Cluster("a", "b", "c", timeouts={"b": 15})
    cluster.tick_all(15 - LIMITS.election_timeout_min_ticks)
    assert [node.node_id for node in cluster.live() if node.is_leader] == ["b"]


def test_nodes_whose_timers_fire_together_split_the_vote_and_no_one_leads() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.tick_all(QUIET_TIMEOUT * 3)
    assert not any(node.is_leader for node in cluster.live()), "randomized timeouts are what breaks the tie"


def test_followers_refuse_pre_votes_and_votes_while_they_hear_from_a_leader() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.nodes["b"].campaign()
    cluster.settle()
    assert cluster.nodes["b"].role is Role.PRE_CANDIDATE, "nobody answered"
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)
    assert cluster.nodes["a"].is_leader and cluster.nodes["b"].role is Role.FOLLOWER
    assert all(node.term == 2 for node in cluster.live()), "a refused pre-vote raises no term"


def test_a_node_refuses_votes_for_an_election_timeout_after_it_restarts() -> None:
    cluster = Cluster("a", "b", "c", timeouts={"b": 12})
    cluster.elect("a")
    cluster.crash("a")
    cluster.crash("c")
    cluster.start("c")
    cluster.nodes["b"].campaign()
    cluster.settle()
    assert not cluster.nodes["b"].is_leader, "c granted a vote right after its restart"
    cluster.tick_all(12)                                    # b campaigns again on its own
    assert any(node.is_leader for node in cluster.live())


# --- replication and commitment -------------------------------------------------------------
def test_a_proposal_commits_once_a_majority_holds_it_and_every_node_applies_it() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.blocked |= {("a", "c"), ("c", "a")}
    [outcome] = cluster.propose("a", b"x")
    cluster.settle()
    assert cluster.nodes["a"].commit_index == outcome.index, "a and b are a majority"
    assert cluster.commands("a") == [b"x"] and cluster.commands("c") == []
    cluster.heal()
    cluster.tick_all(LIMITS.resend_after_ticks + LIMITS.heartbeat_interval_ticks)   # what c lost is sent again
    assert all(cluster.commands(node_id) == [b"x"] for node_id in "abc")


def test_followers_learn_a_new_commit_index_within_a_round_trip_not_at_the_next_heartbeat() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    [entry] = cluster.propose("a", b"x")
    cluster.settle()                                        # no tick: no heartbeat
    assert leader.commit_index == entry.index
    # b's acknowledgement made the commit; c's came after it, and c is told too.
    assert all(cluster.nodes[node_id].commit_index == entry.index for node_id in "bc")
    assert all(cluster.commands(node_id) == [b"x"] for node_id in "abc")


def test_a_proposal_on_a_follower_is_refused_as_not_leader() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    assert cluster.nodes["b"].propose(b"x") == Refused(Refusal.NOT_LEADER)
    assert cluster.nodes["b"].propose_change(ConfigurationChange(ChangeKind.REMOVE_MEMBER, "c")) == \
        Refused(Refusal.NOT_LEADER)


def test_the_leader_refuses_proposals_past_the_uncommitted_limit_and_commands_too_large() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.isolate("a")
    outcomes = [leader.propose(b"x") for _ in range(LIMITS.uncommitted_entries_max + 1)]
    assert outcomes[-1] == Refused(Refusal.TOO_MANY_UNCOMMITTED)
    assert all(isinstance(outcome, Proposed) for outcome in outcomes[:-1])
    cluster.heal()
    cluster.settle()
    assert leader.propose(b"y" * LIMITS.append_bytes_max) == Refused(Refusal.TOO_LARGE)


def test_appends_respect_the_entry_limit_and_the_in_flight_window_per_follower() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.propose("a", *[b"x%d" % number for number in range(12)])
    cluster.flush()
    appends = [message for message in cluster.in_flight if isinstance(message, AppendRequest)]
    for follower in ("b", "c"):
        to_follower = [message for message in appends if message.recipient == follower]
        assert len(to_follower) == LIMITS.in_flight_appends_max
        assert all(len(message.entries) == LIMITS.append_entries_max for message in to_follower)
    cluster.settle()
    assert leader.commit_index == leader.last_index == 14


def test_a_follower_with_a_divergent_log_is_repaired_by_probing_back_to_the_last_agreement() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.isolate("a")
    cluster.propose("a", b"lost1", b"lost2", b"lost3")      # only a holds these (term 2)
    cluster.settle()
    cluster.crash("a")
    cluster.heal()
    cluster.lapse_leases()
    cluster.elect("b")
    cluster.propose("b", b"kept")
    cluster.settle()
    cluster.start("a")
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)
    assert cluster.commands("a") == cluster.commands("b") == [b"kept"]
    truncations = [ready.truncate_from for ready in cluster.readies["a"] if ready.truncate_from is not None]
    assert truncations == [3], "a dropped exactly its own unreplicated suffix, once"


def leader_from_log(entries: list[Entry], term: int, node_ids: tuple[str, ...] = ("a", "b", "c", "d", "e")) -> RaftNode:
    """Node a restarted at `term` - 1 with this log, then elected for `term` by b and c."""
    first = Entry(1, 1, EntryKind.CONFIGURATION, configuration=voters(*node_ids))
    state = PersistedState(HardState(term - 1, None, 1), Snapshot(0, 0, Configuration(), b""), (first, *entries))
    node = RaftNode("a", storage("a"), state, LIMITS, FixedTimeouts(QUIET_TIMEOUT))
    node.campaign()
    for answer_type in (PreVoteResponse, VoteResponse):
        node.advance(node.ready())
        for voter in ("b", "c"):
            node.step(answer_type(term, voter, "a", storage(voter), granted=True))
    assert node.is_leader and node.term == term
    return node


def test_a_leader_does_not_commit_an_entry_of_an_earlier_term_by_counting_replicas() -> None:
    """Raft's Figure 8: a term-2 entry that the leader of term 4 finds on a majority is not
    committed by counting them (a leader of term 3 with another entry there could still be
    elected and erase it); it commits with the first entry of term 4."""
    leader = leader_from_log([command(2, 2), command(3, 2, "term 2")], term=4)
    no_op = leader.last_index
    assert leader.log.term_at(no_op) == 4
    leader.advance(leader.ready())
    for follower in ("b", "c"):
        leader.step(AppendResponse(4, follower, "a", storage(follower), success=True, match_index=3,
                                   rejected_index=0, hint_index=0, hint_term=0))
    assert leader.commit_index == 1, "three of five hold the term-2 entry, and it is still not committed"
    leader.step(AppendResponse(4, "b", "a", storage("b"), success=True, match_index=no_op,
                               rejected_index=0, hint_index=0, hint_term=0))
    assert leader.commit_index == 1
    leader.step(AppendResponse(4, "c", "a", storage("c"), success=True, match_index=no_op,
                               rejected_index=0, hint_index=0, hint_term=0))
    assert leader.commit_index == no_op, "the term-4 entry commits, and the term-2 one with it"


# --- the pysyncobj holes (issue 12) ------------------------------------------------------------
def test_a_stale_append_success_from_an_earlier_term_raises_no_match_index_and_commits_nothing() -> None:
    cluster = Cluster("a", "b", "c", "d", "e")
    cluster.elect("a")                                      # term 2
    cluster.isolate("a")
    cluster.blocked -= {("a", "c")}                         # a reaches c; c's answers are held back
    cluster.propose("a", *[b"x%d" % number for number in range(8)])   # X3..X10 on a and c
    cluster.flush()
    cluster.deliver()
    cluster.flush()
    stale = [message for message in cluster.in_flight if isinstance(message, AppendResponse)
             and message.sender == "c" and message.success]
    assert max(message.match_index for message in stale) == 10
    cluster.in_flight.clear()
    # b leads term 3 with d and e; a rejoins as its follower and drops X3..X10 for Y3.
    cluster.heal()
    cluster.isolate("a")
    cluster.isolate("c")
    cluster.lapse_leases()
    cluster.elect("b")
    cluster.heal()
    cluster.isolate("c")
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)
    assert cluster.nodes["a"].last_index == 3 and cluster.nodes["a"].log.term_at(3) == 3
    # a leads term 4 (b gone): its Z entries take indices 4..10 that c holds as X.
    cluster.crash("b")
    cluster.lapse_leases()
    cluster.elect("a")
    cluster.blocked |= {("a", "e"), ("e", "a")}
    cluster.propose("a", *[b"z%d" % number for number in range(6)])
    cluster.settle()
    leader = cluster.nodes["a"]
    assert leader.term == 4 and leader.last_index == 10
    commit, match = leader.commit_index, leader.progress_of("c")
    assert match is not None and match.match_index == 0
    for message in stale:                                   # c's term-2 answers arrive now
        leader.step(message)
    assert leader.progress_of("c") is not None and leader.progress_of("c").match_index == 0   # type: ignore[union-attr]
    assert leader.commit_index == commit, "a stale success from term 2 committed term-4 entries c never held"


def test_a_follower_keeps_matching_entries_of_the_same_term_and_truncates_only_from_the_first_conflict() -> None:
    follower = follower_with_log([command(index, 2) for index in range(2, 7)], term=2, commit=1)
    # A delayed append of term 2 repeats entries 3 and 4: entries 5 and 6 stay.
    follower.step(append_from("a", 2, (2, 2), [command(3, 2), command(4, 2)], commit=1))
    ready = follower.ready()
    assert ready.truncate_from is None and ready.entries == ()
    assert [answer.match_index for answer in answers(ready)] == [4]
    follower.advance(ready)
    assert follower.last_index == 6
    # The leader of term 3 agrees up to 4 and holds something else at 5: only 5 and 6 go.
    follower.step(append_from("c", 3, (3, 2), [command(4, 2), command(5, 3, "new")], commit=1))
    ready = follower.ready()
    assert ready.truncate_from == 5
    assert [(entry.index, entry.term) for entry in ready.entries] == [(5, 3)]
    follower.advance(ready)
    assert [follower.log.term_at(index) for index in range(1, 6)] == [1, 2, 2, 2, 3]


def test_a_crash_between_truncation_and_append_never_leaves_the_log_truncated_without_its_new_entries() -> None:
    old = [command(index, 2) for index in range(2, 7)]
    first = Entry(1, 1, EntryKind.CONFIGURATION, configuration=voters("a", "b", "c"))
    state = PersistedState(HardState(2, None, 1), Snapshot(0, 0, Configuration(), b""), (first, *old))
    for crash_after_write in (False, True):
        disk = Disk.holding(storage("b"), state)
        follower = RaftNode("b", disk.storage_id, disk.persisted_state(), LIMITS, FixedTimeouts(QUIET_TIMEOUT))
        follower.step(append_from("c", 3, (2, 2), [command(3, 3, "new3"), command(4, 3, "new4")], commit=1))
        ready = follower.ready()
        assert (ready.truncate_from, [entry.index for entry in ready.entries]) == (3, [3, 4]), \
            "the truncation and the entries replacing it are one unit of the Ready"
        if crash_after_write:
            disk.write(ready)                  # one transaction
        restarted = RaftNode("b", disk.storage_id, disk.persisted_state(), LIMITS, FixedTimeouts(QUIET_TIMEOUT))
        terms = [restarted.log.term_at(index) for index in range(1, restarted.last_index + 1)]
        assert terms == ([1, 2, 3, 3] if crash_after_write else [1, 2, 2, 2, 2, 2])


def test_a_ready_cannot_carry_a_truncation_without_the_entries_that_replace_it() -> None:
    with pytest.raises(InvariantViolation):
        Ready(hard_state=None, install_snapshot=None, compaction=None, truncate_from=3, entries=(),
              messages=(), committed_entries=())


def test_truncating_a_committed_entry_is_an_invariant_violation() -> None:
    follower = follower_with_log([command(index, 2) for index in range(2, 7)], term=2, commit=5)
    with pytest.raises(InvariantViolation):
        follower.step(append_from("c", 3, (3, 2), [command(4, 3)], commit=5))
    log = RaftLog(Snapshot(0, 0, Configuration(), b""), [command(index, 2) for index in range(1, 6)])
    with pytest.raises(InvariantViolation):
        log.truncate_from(4, commit_index=4)


def test_a_node_with_a_new_storage_id_is_not_counted_in_a_vote_or_a_quorum_until_re_added() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.propose("a", b"before")
    cluster.settle()
    # c loses its disk while a is down. It grants b its pre-vote (it knows no configuration
    # yet), and b, which knows c by its old disk, does not count it.
    cluster.crash("a")
    cluster.wipe("c", generation=1)
    cluster.start("c")
    cluster.lapse_leases()
    candidate = cluster.nodes["b"]
    candidate.campaign()
    cluster.flush()
    cluster.deliver()
    cluster.flush()
    [pre_vote] = cluster.deliver()
    assert isinstance(pre_vote, PreVoteResponse) and pre_vote.granted and pre_vote.sender_storage_id == storage("c", 1)
    assert candidate.role is Role.PRE_CANDIDATE, "b counted the pre-vote of c's new disk"
    # With a back, b wins the pre-vote; then only c's vote reaches it, and that one is not counted.
    cluster.start("a")
    cluster.lapse_leases()
    candidate.campaign()
    while candidate.role is not Role.CANDIDATE:
        cluster.flush()
        cluster.deliver()
    cluster.blocked |= {("a", "b")}
    cluster.flush()
    cluster.deliver()
    cluster.flush()
    votes = [message for message in cluster.deliver() if isinstance(message, VoteResponse)]
    assert sorted((vote.sender, vote.granted) for vote in votes) == [("a", True), ("c", True)]
    assert candidate.role is Role.CANDIDATE, "b won with the vote of c's new disk"
    cluster.heal()
    # c catches up from a; its acknowledgements are not counted either, and once it knows the
    # configuration names another disk for it, it refuses votes itself.
    cluster.lapse_leases()
    leader = cluster.elect("a")
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)
    cluster.blocked |= {("a", "b"), ("b", "a")}
    [blocked] = cluster.propose("a", b"needs b")
    cluster.tick_all(LIMITS.heartbeat_interval_ticks * 3)
    assert cluster.nodes["c"].last_index >= blocked.index
    assert leader.commit_index < blocked.index, "an acknowledgement from c's new disk was counted"
    cluster.heal()
    cluster.tick_all(LIMITS.resend_after_ticks + LIMITS.heartbeat_interval_ticks)
    assert leader.commit_index >= blocked.index
    cluster.isolate("c")
    cluster.lapse_leases()
    node_c = cluster.nodes["c"]
    node_c.step(PreVoteRequest(node_c.term + 1, "b", "c", storage("b"), 99, 9))
    cluster.flush()
    refusals = [message for message in cluster.deliver() if isinstance(message, PreVoteResponse)]
    assert [(refusal.sender, refusal.granted) for refusal in refusals] == [("c", False)]
    cluster.heal()
    # Re-added (removed, then a learner on its new disk, then promoted), c counts again.
    assert isinstance(cluster.change(leader.node_id, ChangeKind.REMOVE_MEMBER, "c"), Proposed)
    cluster.settle()
    assert isinstance(cluster.change(leader.node_id, ChangeKind.ADD_LEARNER, "c", storage("c", 1)), Proposed)
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)
    assert isinstance(cluster.change(leader.node_id, ChangeKind.PROMOTE_LEARNER, "c"), Proposed)
    cluster.settle()
    other = "b" if leader.node_id == "a" else "a"
    cluster.isolate(other)
    [counted] = cluster.propose(leader.node_id, b"with c")
    cluster.settle()
    assert leader.commit_index >= counted.index


def test_a_node_cut_off_does_not_raise_its_term_nor_disrupt_the_leader_when_it_returns() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.isolate("c")
    cluster.tick_all(QUIET_TIMEOUT * 5)                     # c's timer fires again and again
    assert cluster.nodes["c"].term == 2 and cluster.nodes["c"].role is Role.PRE_CANDIDATE
    cluster.heal()
    cluster.tick_all(QUIET_TIMEOUT * 2)
    assert cluster.nodes["a"].is_leader and all(node.term == 2 for node in cluster.live())


def test_a_leader_cut_off_from_the_majority_steps_down_within_an_election_timeout() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.tick_all(3)
    cluster.isolate("a")
    ticks = 0
    while leader.is_leader:
        cluster.tick_all()
        ticks += 1
        assert ticks <= LIMITS.election_timeout_min_ticks, "still leading after an election timeout alone"
    assert leader.term == 2 and leader.leader_id is None


# --- snapshots ---------------------------------------------------------------------------------
def test_a_follower_behind_the_leaders_snapshot_installs_it_and_applies_from_there() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.crash("c")
    cluster.propose("a", *[b"x%d" % number for number in range(6)])
    cluster.settle()
    assert leader.compact(leader.applied_index, b"state at %d" % leader.applied_index)
    compacted = leader.snapshot_index
    cluster.propose("a", b"after")
    cluster.settle()
    cluster.start("c")
    cluster.tick_all(LIMITS.resend_after_ticks + 1)
    installs = [ready.install_snapshot for ready in cluster.readies["c"] if ready.install_snapshot is not None]
    assert [snapshot.index for snapshot in installs] == [compacted]
    assert installs[0].configuration == voters("a", "b", "c"), "the configuration travels in the snapshot"
    assert cluster.disks["c"].snapshot.data == b"state at %d" % compacted
    assert cluster.commands("c") == [b"after"] and cluster.nodes["c"].commit_index == leader.commit_index


def test_compaction_is_written_by_the_next_ready_and_only_covers_applied_entries() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.propose("a", b"x", b"y")
    cluster.settle()
    assert not leader.compact(leader.applied_index + 1, b"ahead")
    assert leader.compact(leader.applied_index, b"state")
    ready = leader.ready()
    assert ready.compaction is not None and ready.compaction.index == leader.snapshot_index
    leader.advance(ready)
    assert not leader.compact(leader.snapshot_index, b"again"), "nothing new to cover"


# --- membership --------------------------------------------------------------------------------
def test_a_configuration_change_waits_for_an_entry_of_the_leaders_term_and_for_the_previous_change() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.nodes["a"]
    leader.campaign()
    while not leader.is_leader:
        cluster.flush()
        cluster.deliver()                                   # a leads; its no-op is not committed yet
    assert leader.commit_index < leader.last_index
    assert cluster.change("a", ChangeKind.ADD_LEARNER, "d", storage("d")) == Refused(Refusal.TERM_NOT_COMMITTED)
    cluster.settle()
    assert isinstance(cluster.change("a", ChangeKind.ADD_LEARNER, "d", storage("d")), Proposed)
    assert cluster.change("a", ChangeKind.REMOVE_MEMBER, "c") == Refused(Refusal.CHANGE_PENDING)
    cluster.settle()
    assert cluster.change("a", ChangeKind.ADD_LEARNER, "d", storage("d")) == Refused(Refusal.ALREADY_MEMBER)
    assert cluster.change("a", ChangeKind.PROMOTE_LEARNER, "b") == Refused(Refusal.NOT_A_LEARNER)
    assert cluster.change("a", ChangeKind.REMOVE_MEMBER, "x") == Refused(Refusal.NOT_A_MEMBER)


def test_a_learner_catches_up_before_it_is_promoted_and_then_counts_as_a_voter() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    cluster.propose("a", *[b"x%d" % number for number in range(8)])
    cluster.settle()
    cluster.disks["d"] = Disk.holding(storage("d"), empty_state())
    cluster.applied["d"], cluster.readies["d"] = [], []
    cluster.start("d")
    cluster.blocked |= {("a", "d"), ("d", "a")}
    assert isinstance(cluster.change("a", ChangeKind.ADD_LEARNER, "d", storage("d")), Proposed)
    cluster.settle()
    assert leader.configuration.is_learner("d")
    assert cluster.change("a", ChangeKind.PROMOTE_LEARNER, "d") == Refused(Refusal.LEARNER_BEHIND)
    cluster.heal()
    cluster.tick_all(LIMITS.heartbeat_interval_ticks * 3)
    assert cluster.commands("d") == cluster.commands("a"), "the learner applies the log"
    assert cluster.nodes["d"].role is Role.FOLLOWER and not cluster.nodes["d"].campaign(), "a learner never campaigns"
    assert isinstance(cluster.change("a", ChangeKind.PROMOTE_LEARNER, "d"), Proposed)
    cluster.settle()
    assert leader.configuration == voters("a", "b", "c", "d")
    cluster.crash("b")
    cluster.crash("c")
    [entry] = cluster.propose("a", b"needs d")
    cluster.settle()
    assert leader.commit_index < entry.index, "four voters need three"
    cluster.start("c")
    cluster.tick_all(LIMITS.heartbeat_interval_ticks * 2)
    assert leader.commit_index >= entry.index, "a, c and the promoted d are three of four"


def test_a_removed_voter_no_longer_counts_toward_the_quorum() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    assert isinstance(cluster.change("a", ChangeKind.REMOVE_MEMBER, "c"), Proposed)
    cluster.settle()
    assert leader.configuration == voters("a", "b") and leader.progress_of("c") is None
    cluster.crash("c")
    cluster.blocked |= {("a", "b"), ("b", "a")}
    [entry] = cluster.propose("a", b"x")
    cluster.settle()
    assert leader.commit_index < entry.index, "two voters need both"
    cluster.heal()
    cluster.tick_all(LIMITS.resend_after_ticks + LIMITS.heartbeat_interval_ticks)
    assert leader.commit_index >= entry.index


def test_a_removed_leader_steps_down_once_its_removal_commits_and_the_others_elect_a_leader() -> None:
    cluster = Cluster("a", "b", "c", timeouts={"b": 12})
    leader = cluster.elect("a")
    assert isinstance(cluster.change("a", ChangeKind.REMOVE_MEMBER, "a"), Proposed)
    assert leader.is_leader, "it leads until its removal commits"
    cluster.settle()
    assert not leader.is_leader and not leader.campaign()
    cluster.tick_all(QUIET_TIMEOUT + 1)
    new_leaders = [node.node_id for node in cluster.live() if node.is_leader]
    assert new_leaders in (["b"], ["c"])
    assert cluster.nodes[new_leaders[0]].configuration == voters("b", "c")


def test_the_last_voter_cannot_be_removed_and_a_single_voter_commits_alone() -> None:
    cluster = Cluster("a")
    leader = cluster.elect("a")
    [entry] = cluster.propose("a", b"x")
    cluster.settle()
    assert leader.commit_index == entry.index
    assert cluster.change("a", ChangeKind.REMOVE_MEMBER, "a") == Refused(Refusal.LAST_VOTER)


# --- restarts and the Ready contract -------------------------------------------------------------
def test_a_restarted_node_keeps_its_term_vote_and_log_and_applies_its_committed_entries_again() -> None:
    cluster = Cluster("a", "b", "c")
    cluster.elect("a")
    cluster.propose("a", b"x", b"y")
    cluster.settle()
    cluster.tick_all(LIMITS.heartbeat_interval_ticks)       # b learns the commit index
    before = cluster.nodes["b"]
    cluster.crash("b")
    cluster.applied["b"] = []
    cluster.start("b")
    after = cluster.nodes["b"]
    assert (after.term, after.vote, after.last_index) == (before.term, before.vote, before.last_index)
    cluster.flush()
    assert cluster.commands("b") == [b"x", b"y"]


def test_an_application_with_a_durable_state_is_not_handed_what_it_applied_before_the_restart() -> None:
    follower = follower_with_log([command(2, 2), command(3, 2)], term=2, commit=3)
    assert [entry.index for entry in follower.ready().committed_entries] == [1, 2, 3]
    disk_state = PersistedState(HardState(2, None, 3), Snapshot(0, 0, Configuration(), b""),
                                tuple(follower.log.entries_between(1, 3)))
    restarted = RaftNode("b", storage("b"), disk_state, LIMITS, FixedTimeouts(QUIET_TIMEOUT), applied_index=2)
    assert [entry.index for entry in restarted.ready().committed_entries] == [3]


def test_driving_the_core_between_ready_and_advance_is_an_invariant_violation() -> None:
    cluster = Cluster("a", "b", "c")
    leader = cluster.elect("a")
    leader.propose(b"x")
    ready = leader.ready()
    with pytest.raises(InvariantViolation):
        leader.tick()
    with pytest.raises(InvariantViolation):
        leader.advance(Ready(None, None, None, None, (), (), ()))
    leader.advance(ready)


def test_messages_of_an_older_term_change_nothing_and_an_old_leader_learns_the_newer_term() -> None:
    follower = follower_with_log([command(2, 2)], term=5, commit=1)
    follower.step(VoteRequest(4, "c", "b", storage("c"), 9, 4))
    follower.step(append_from("a", 3, (2, 2), [command(3, 3)], commit=2))
    ready = follower.ready()
    assert ready.entries == () and follower.term == 5 and follower.vote is None
    assert [(answer.term, answer.success) for answer in answers(ready)] == [(5, False)]


def test_a_vote_is_written_before_the_answer_that_grants_it_and_survives_a_restart() -> None:
    follower = follower_with_log([command(2, 2)], term=2, commit=1)
    for _ in range(LIMITS.election_timeout_min_ticks):
        follower.tick()                                     # its refusal of votes after starting lapses
    disk = Disk.holding(storage("b"), PersistedState(HardState(2, None, 1), follower.log.snapshot,
                                                     follower.log.entries_between(1, 2)))
    follower.step(VoteRequest(3, "a", "b", storage("a"), 2, 2))
    ready = follower.ready()
    assert ready.hard_state == HardState(3, "a", 1), "the vote is in the transaction of the same Ready"
    assert [(type(message), message.granted) for message in ready.messages if isinstance(message, VoteResponse)] \
        == [(VoteResponse, True)]
    disk.write(ready)
    restarted = RaftNode("b", storage("b"), disk.persisted_state(), LIMITS, FixedTimeouts(QUIET_TIMEOUT))
    for _ in range(LIMITS.election_timeout_min_ticks):
        restarted.tick()
    restarted.step(VoteRequest(3, "c", "b", storage("c"), 2, 2))
    answer = restarted.ready()
    assert [message.granted for message in answer.messages if isinstance(message, VoteResponse)] == [False]
    assert restarted.vote == "a"


def test_a_pre_vote_changes_no_term_and_is_refused_to_a_log_behind_ours() -> None:
    follower = follower_with_log([command(2, 2)], term=2, commit=1)
    follower.tick()     # nothing heard from a leader since the restart; the restart refusal lasts
    for _ in range(LIMITS.election_timeout_min_ticks):
        follower.tick()
    follower.step(PreVoteRequest(3, "c", "b", storage("c"), 1, 1))
    follower.step(PreVoteRequest(3, "a", "b", storage("a"), 2, 2))
    ready = follower.ready()
    assert follower.term == 2
    granted = [(message.sender, message.recipient, message.granted, message.term) for message in ready.messages
               if isinstance(message, PreVoteResponse)]
    assert granted == [("b", "c", False, 2), ("b", "a", True, 3)]


def test_progress_refuses_an_illegal_state_move() -> None:
    progress = Progress(storage_id=b"s", next_index=1)
    progress.move_to(ProgressState.REPLICATE)
    with pytest.raises(InvariantViolation):
        progress.move_to(ProgressState.REPLICATE)


@pytest.mark.parametrize("changes", [
    {"heartbeat_interval_ticks": 10},
    {"election_timeout_max_ticks": 10},
    {"resend_after_ticks": 0},
    {"in_flight_appends_max": 0},
    {"append_bytes_max": 8},
])
def test_limits_that_contradict_each_other_are_refused(changes: dict[str, int]) -> None:
    values = {"election_timeout_min_ticks": 10, "election_timeout_max_ticks": 20, **changes}
    with pytest.raises(ValueError):
        RaftLimits(**values)
