"""Deterministic simulation of a Raft cluster: N real cores (replication/raft.py) on a virtual
tick clock, a faulty network and disks that keep only what a Ready had them write, all from
one seed (docs/ARCHITECTURE.md, "Conventions"; after TigerBeetle's VOPR). `RaftSimulation(seed).run()` replays a seed.

The safety phase runs the faults: message loss, duplication, reordering and delay;
symmetric and one-way partitions; crashes between any two steps of a Ready's handling (the
driver persists exactly what the Ready says, in one transaction, before it sends);
restarts from the disk; disk wipes (the node comes back empty with a new storage id and the
simulated operator removes and re-adds it); clocks that drift; snapshots taken by the
application, which compact the log; and an operator that removes voters, adds learners and
promotes them. The liveness phase then heals everything: the membership must become whole
again, a proposal must commit within a bound, and every node must apply the same commands.

`RaftChecker` judges every step as it happens: one leader per term, log matching, leader
completeness, state machine safety (applied entries and installed snapshots agree with one
history), no committed entry truncated or discarded, votes and acknowledgements counted only
from the disk the configuration names (every commit is durable on a majority of the
configuration's disks; every leader won a majority of such votes), and one vote per disk
per term.
"""
from __future__ import annotations

import hashlib
import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from replication.raft import (
    ChangeKind,
    ConfigurationChange,
    PersistedState,
    Proposed,
    RaftLimits,
    RaftNode,
    Ready,
    bootstrap_state,
    empty_state,
)
from replication.raft_messages import (
    AppendResponse,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    Message,
    Snapshot,
    VoteResponse,
)

# Small batches and windows so that pipelining, flow control and snapshots all happen.
SIM_LIMITS = RaftLimits(election_timeout_min_ticks=10, election_timeout_max_ticks=20, heartbeat_interval_ticks=3,
                        resend_after_ticks=5, append_entries_max=8, append_bytes_max=2048, in_flight_appends_max=3,
                        uncommitted_entries_max=48, apply_entries_max=64, learner_lag_max_entries=8)

# The kinds a sweep counts per seed; the first six are issue 12's, each wanted in >= 10% of seeds.
KINDS = ("leader_changes", "truncations", "snapshot_installs", "configuration_changes", "voter_wipes", "crashes",
         "partitions", "one_way_partitions", "messages_dropped", "messages_duplicated", "crashes_mid_ready",
         "learner_promotions", "leader_removals", "check_quorum_step_downs", "mismatched_answers",
         "messages_delayed_long", "stale_append_replies", "lease_held_ticks")
ISSUE_KINDS = KINDS[:6]

# Where in the handling of a Ready a crash may strike.
CRASH_POINTS = ("before persisting", "after persisting", "while sending", "before applying")


class InvariantBroken(AssertionError):
    """A Raft safety property the checker saw broken."""


@dataclass(slots=True)
class FaultRates:
    message_drop: float = 0.02
    message_duplicate: float = 0.01
    delay_ticks_max: int = 3
    long_delay: float = 0.01                 # of messages: held back long enough to outlive a term
    long_delay_ticks: tuple[int, int] = (10, 150)
    partition_start: float = 0.004           # per tick, when none is active
    partition_ticks: tuple[int, int] = (15, 120)
    crash: float = 0.0003                    # per node and tick
    leader_crash: float = 0.001              # per tick: the leader (with the highest term) crashes
    crash_mid_ready: float = 0.5             # of crashes: armed for the next Ready instead of at once
    downtime_ticks: tuple[int, int] = (5, 120)
    wipe: float = 0.0005                     # per tick, when the membership is whole
    churn: float = 0.01                      # per operator pass, when the membership is whole
    propose: float = 0.15                    # per tick
    snapshot_every_entries: int = 20
    clock_drift: float = 0.05                # each node ticks at 1 +- this
    operator_interval_ticks: int = 5
    wipe_noticed_after_ticks: tuple[int, int] = (0, 150)    # after the node is back with its new disk


# --- the application ------------------------------------------------------------------------
def _chain(digest: bytes, entry: Entry) -> bytes:
    payload = entry.command if entry.kind is EntryKind.COMMAND else entry.kind.value.encode()
    return hashlib.blake2b(digest + payload, digest_size=8).digest()


@dataclass(slots=True)
class StateMachine:
    """The simulated application: a hash chain over every applied entry."""
    index: int = 0
    digest: bytes = bytes(8)

    def apply(self, entry: Entry) -> None:
        if entry.index != self.index + 1:
            raise InvariantBroken(f"applied entry {entry.index} after {self.index}")
        self.digest = _chain(self.digest, entry)
        self.index = entry.index

    def to_bytes(self) -> bytes:
        return self.index.to_bytes(8, "big") + self.digest

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot) -> StateMachine:
        if not snapshot.data:
            return cls(snapshot.index)
        index = int.from_bytes(snapshot.data[:8], "big")
        if index != snapshot.index:
            raise InvariantBroken(f"snapshot at {snapshot.index} holds state at {index}")
        return cls(index, snapshot.data[8:])


# --- the disk -------------------------------------------------------------------------------
@dataclass(slots=True)
class Disk:
    """A node's durable state. `write` is one transaction: a crash leaves all of a Ready's
    writes or none of them (an LMDB commit)."""
    storage_id: bytes
    hard_state: HardState
    snapshot: Snapshot
    entries: list[Entry]

    @classmethod
    def holding(cls, storage_id: bytes, state: PersistedState) -> Disk:
        return cls(storage_id, state.hard_state, state.snapshot, list(state.entries))

    def persisted_state(self) -> PersistedState:
        return PersistedState(self.hard_state, self.snapshot, tuple(self.entries))

    @property
    def last_index(self) -> int:
        return self.snapshot.index + len(self.entries)

    def term_at(self, index: int) -> int | None:
        offset = index - self.snapshot.index
        if offset == 0:
            return self.snapshot.term
        return self.entries[offset - 1].term if 0 < offset <= len(self.entries) else None

    def write(self, ready: Ready) -> list[Entry]:
        """Apply the Ready's writes; returns the durable entries they removed."""
        removed: list[Entry] = []
        if ready.install_snapshot is not None:
            removed = self.entries
            self.entries = []
            self.snapshot = ready.install_snapshot
        elif ready.compaction is not None:
            del self.entries[:ready.compaction.index - self.snapshot.index]
            self.snapshot = ready.compaction
        if ready.truncate_from is not None:
            position = ready.truncate_from - self.snapshot.index - 1
            removed = self.entries[position:]
            del self.entries[position:]
        for entry in ready.entries:
            if entry.index != self.last_index + 1:
                raise InvariantBroken(f"the Ready writes entry {entry.index} after durable {self.last_index}")
            self.entries.append(entry)
        if ready.hard_state is not None:
            self.hard_state = ready.hard_state
        if self.hard_state.commit > self.last_index:
            raise InvariantBroken(f"durable commit {self.hard_state.commit} beyond durable log {self.last_index}")
        return removed


# --- the network ----------------------------------------------------------------------------
@dataclass(slots=True)
class Network:
    rng: random.Random
    rates: FaultRates
    counts: Counter[str]
    faulty: bool = True
    blocked: set[tuple[str, str]] = field(default_factory=set)
    in_flight: list[tuple[int, int, Message]] = field(default_factory=list)
    sequence: int = 0

    def send(self, message: Message, now: int) -> None:
        rng = self.rng
        if self.faulty and rng.random() < self.rates.message_drop:
            self.counts["messages_dropped"] += 1
            return
        copies = 2 if self.faulty and rng.random() < self.rates.message_duplicate else 1
        self.counts["messages_duplicated"] += copies - 1
        for _ in range(copies):
            delay = rng.randint(1, self.rates.delay_ticks_max) if self.faulty else 1
            if self.faulty and rng.random() < self.rates.long_delay:
                delay = rng.randint(*self.rates.long_delay_ticks)
                self.counts["messages_delayed_long"] += 1
            self.sequence += 1
            heapq.heappush(self.in_flight, (now + delay, self.sequence, message))

    def due(self, now: int) -> list[Message]:
        out = []
        in_flight = self.in_flight
        while in_flight and in_flight[0][0] <= now:
            message = heapq.heappop(in_flight)[2]
            if (message.sender, message.recipient) not in self.blocked:
                out.append(message)
        return out


# --- the checker ----------------------------------------------------------------------------
class RaftChecker:
    """Safety properties judged as the simulation runs (see the module's docstring)."""

    def __init__(self) -> None:
        self.leaders: dict[int, str] = {}                         # term -> its leader
        self.committed: dict[int, int] = {}                       # index -> term of the committed entry
        self.committed_max = 0
        self.entries: dict[tuple[int, int], tuple[Entry, int]] = {}   # (index, term) -> entry, previous term
        self.digests: dict[int, bytes] = {}                       # index -> state machine digest after it
        self.held: dict[bytes, set[tuple[int, int]]] = {}         # storage id -> (index, term) ever durable there
        self.votes: dict[tuple[bytes, int], str] = {}             # (storage id, term) -> candidate
        self.grants: dict[tuple[int, str], set[bytes]] = {}       # (term, candidate) -> storage ids that voted
        self.commit_seen: dict[str, int] = {}

    def fail(self, what: str) -> NoReturn:
        raise InvariantBroken(what)

    # leaders and commitment, after every call into a core
    def saw_leader(self, core: RaftNode) -> bool:
        """Records the leader of its term; True the first time it is seen."""
        term = core.term
        known = self.leaders.get(term)
        if known == core.node_id:
            return False
        if known is not None:
            self.fail(f"two leaders in term {term}: {known} and {core.node_id}")
        self.leaders[term] = core.node_id
        self._check_won_by_counted_votes(core)
        self._check_leader_complete(core)
        return True

    def _check_won_by_counted_votes(self, core: RaftNode) -> None:
        configuration = core.configuration
        voters = self.grants.get((core.term, core.node_id), set()) | {core.storage_id}
        counted = sum(1 for member in configuration.voters if member.storage_id in voters)
        if counted < configuration.quorum:
            self.fail(f"{core.node_id} leads term {core.term} with {counted} counted votes of {configuration}")

    def _check_leader_complete(self, core: RaftNode) -> None:
        log = core.log
        if log.last_index < self.committed_max:
            self.fail(f"leader {core.node_id} of term {core.term} ends at {log.last_index}, "
                      f"before committed {self.committed_max}")
        for index in range(log.snapshot.index + 1, self.committed_max + 1):
            if log.term_at(index) != self.committed[index]:
                self.fail(f"leader {core.node_id} of term {core.term} lacks committed entry {index}")

    def saw_commit(self, core: RaftNode) -> None:
        seen = self.commit_seen.get(core.node_id, 0)
        commit = core.commit_index
        if commit <= seen:
            return
        self.commit_seen[core.node_id] = commit
        log = core.log
        for index in range(max(seen, log.snapshot.index) + 1, commit + 1):
            term = log.term_at(index)
            if term is None:
                self.fail(f"{core.node_id} committed {index} which it does not hold")
            known = self.committed.get(index)
            if known is None:
                self.committed[index] = term
            elif known != term:
                self.fail(f"index {index} committed with term {known} and with term {term} (at {core.node_id})")
        self.committed_max = max(self.committed_max, commit)
        if core.is_leader:
            self._check_commit_durable_on_majority(core, commit)

    def _check_commit_durable_on_majority(self, leader: RaftNode, commit: int) -> None:
        """Every commit is held by a majority of the configuration's disks (the leader's own
        log counts: it is durable before anything that reveals the commit leaves)."""
        configuration = leader.configuration
        position = (commit, self.committed[commit])
        holders = 0
        for member in configuration.voters:
            if member.node_id == leader.node_id:
                holders += member.storage_id == leader.storage_id
            else:
                holders += position in self.held.get(member.storage_id, ())
        if holders < configuration.quorum:
            self.fail(f"{leader.node_id} committed {commit} held by {holders} of {configuration}")

    def forget_commit_seen(self, node_id: str) -> None:
        self.commit_seen.pop(node_id, None)

    # what a Ready writes
    def before_write(self, node_id: str, disk: Disk, ready: Ready) -> None:
        if ready.truncate_from is not None:
            for entry in disk.entries[ready.truncate_from - disk.snapshot.index - 1:]:
                if self.committed.get(entry.index) == entry.term:
                    self.fail(f"{node_id} truncates committed entry {entry.index} (term {entry.term})")
        snapshot = ready.install_snapshot
        if snapshot is not None:
            for entry in disk.entries:
                if entry.index > snapshot.index and self.committed.get(entry.index) == entry.term:
                    self.fail(f"{node_id} discards committed entry {entry.index} installing snapshot {snapshot.index}")
            self._check_snapshot(node_id, snapshot)

    def _check_snapshot(self, node_id: str, snapshot: Snapshot) -> None:
        state = StateMachine.from_snapshot(snapshot)
        known = self.digests.get(snapshot.index)
        if known is not None and known != state.digest:
            self.fail(f"{node_id} installs a snapshot at {snapshot.index} that differs from the applied history")
        if self.committed.get(snapshot.index, snapshot.term) != snapshot.term:
            self.fail(f"{node_id} installs a snapshot at {snapshot.index} of a term that was not committed there")

    def after_write(self, node_id: str, disk: Disk, ready: Ready) -> None:
        held = self.held.setdefault(disk.storage_id, set())
        entries = self.entries
        for entry in ready.entries:
            previous_term = disk.term_at(entry.index - 1)
            key = (entry.index, entry.term)
            known = entries.get(key)
            if known is None:
                entries[key] = (entry, previous_term if previous_term is not None else -1)
            elif known[0] != entry or (previous_term is not None and known[1] not in (previous_term, -1)):
                self.fail(f"log matching: {node_id} holds a different entry or prefix at {key}")
            held.add(key)

    def sent(self, message: Message) -> None:
        if isinstance(message, VoteResponse) and message.granted:
            key = (message.sender_storage_id, message.term)
            earlier = self.votes.setdefault(key, message.recipient)
            if earlier != message.recipient:
                self.fail(f"disk {message.sender_storage_id!r} voted for {earlier} and {message.recipient} "
                          f"in term {message.term}")
            self.grants.setdefault((message.term, message.recipient), set()).add(message.sender_storage_id)

    def applied(self, node_id: str, state: StateMachine) -> None:
        known = self.digests.setdefault(state.index, state.digest)
        if known != state.digest:
            self.fail(f"{node_id} applied a different history: digests differ at {state.index}")


# --- one node and its driver -----------------------------------------------------------------
@dataclass(slots=True)
class SimNode:
    node_id: str
    disk: Disk
    tick_rate: float
    core: RaftNode | None = None
    state: StateMachine = field(default_factory=StateMachine)
    tick_credit: float = 0.0
    down_until: int = 0
    crash_armed: str | None = None       # a crash point for the next Ready
    wipes: int = 0
    wipe_noticed_at: int = 0             # when the operator learns that its disk is new


class RaftSimulation:
    """One seed's run. `run()` raises InvariantBroken (or the core's InvariantViolation) on a
    broken property and AssertionError when the healed cluster does not converge."""

    def __init__(self, seed: int, ticks: int = 2000, rates: FaultRates | None = None,
                 limits: RaftLimits = SIM_LIMITS, node_count: int | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.ticks = ticks
        self.rates = rates or FaultRates()
        self.limits = limits
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self.network = Network(random.Random(self.rng.getrandbits(64)), self.rates, self.counts)
        self.checker = RaftChecker()
        self.now = 0
        self.faults_on = True
        self.partition_until = 0
        self.commands_proposed = 0
        self.configuration_indexes: set[int] = set()
        self.proposal_after_healing: tuple[RaftNode, Proposed] | None = None
        count = node_count or self.rng.randint(3, 5)
        ids = [f"n{number}" for number in range(1, count + 1)]
        configuration = Configuration(frozenset(Member(node_id, f"{node_id}-0".encode()) for node_id in ids))
        self.nodes: dict[str, SimNode] = {}
        for node_id in ids:
            drift = self.rng.uniform(-self.rates.clock_drift, self.rates.clock_drift)
            disk = Disk.holding(f"{node_id}-0".encode(), bootstrap_state(configuration))
            self.nodes[node_id] = SimNode(node_id, disk, 1.0 + drift)
            self._start(self.nodes[node_id])

    # --- running ------------------------------------------------------------------------------
    def run(self) -> Counter[str]:
        for _ in range(self.ticks):
            self._step_world()
        self._heal()
        self._converge()
        return self.counts

    def _step_world(self) -> None:
        self.now += 1
        if self.faults_on:
            self._inject_faults()
        self._restart_due_nodes()
        for message in self.network.due(self.now):
            node = self.nodes[message.recipient]
            if node.core is not None:
                self._deliver(node, message)
        for node in self.nodes.values():
            if node.core is not None:
                node.tick_credit += node.tick_rate
                while node.tick_credit >= 1.0 and node.core is not None:
                    node.tick_credit -= 1.0
                    self._tick(node)
        if self.faults_on and self.rng.random() < self.rates.propose:
            self._propose(b"c%d" % self.commands_proposed)
        if self.now % self.rates.operator_interval_ticks == 0:
            self._operate()
        for node in self.nodes.values():
            if node.core is not None and node.core.has_ready():
                self._handle_ready(node)
        self._check_leases()

    def _check_leases(self) -> None:
        """The leader lease (RaftNode.lease_remaining_ticks): at any moment at most one node
        believes it holds it, whatever the clocks' drift (they run at 1 +- rates.clock_drift,
        within the core's clock_drift_max). The node leases and failover decisions rest on it."""
        holders = [node.node_id for node in self.nodes.values()
                   if node.core is not None and node.core.lease_remaining_ticks > 0]
        if len(holders) > 1:
            self.checker.fail(f"at {self.now} {holders} all hold the leader lease")
        if holders:
            self.counts["lease_held_ticks"] += 1

    def _deliver(self, node: SimNode, message: Message) -> None:
        core = node.core
        assert core is not None
        if isinstance(message, (AppendResponse, VoteResponse)):
            self._note_mismatched_answer(core, message)
            if message.term < core.term and core.is_leader and isinstance(message, AppendResponse) and message.success:
                self.counts["stale_append_replies"] += 1     # pysyncobj's hole: it must change nothing
        was_leader, term = core.is_leader, core.term
        core.step(message)
        self._observe(core, was_leader, term)

    def _tick(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        was_leader, term = core.is_leader, core.term
        core.tick()
        self._observe(core, was_leader, term)

    def _observe(self, core: RaftNode, was_leader: bool, term: int) -> None:
        """Called after every call into a core, so the checker sees every leader and every
        commit as it happens."""
        checker = self.checker
        if core.is_leader:
            if checker.leaders.get(core.term) != core.node_id and checker.saw_leader(core) and len(checker.leaders) > 1:
                self.counts["leader_changes"] += 1
        elif was_leader and core.term == term:
            removed = not core.configuration.is_voter(core.node_id, core.storage_id)
            self.counts["leader_removals" if removed else "check_quorum_step_downs"] += 1
        if core.commit_index > checker.commit_seen.get(core.node_id, 0):
            checker.saw_commit(core)

    def _note_mismatched_answer(self, core: RaftNode, message: AppendResponse | VoteResponse) -> None:
        """An answer from a disk the recipient's configuration does not name (it must not count)."""
        known = core.configuration.storage_id_of(message.sender)
        if known is not None and known != message.sender_storage_id:
            self.counts["mismatched_answers"] += 1

    # --- the driver ---------------------------------------------------------------------------
    def _handle_ready(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        ready = core.ready()
        crash_point, node.crash_armed = node.crash_armed, None
        if crash_point == "before persisting":
            self._crash(node)
            return
        self.checker.before_write(node.node_id, node.disk, ready)
        removed = node.disk.write(ready)
        if ready.truncate_from is not None and removed:
            self.counts["truncations"] += 1
        if ready.install_snapshot is not None:
            self.counts["snapshot_installs"] += 1
            node.state = StateMachine.from_snapshot(ready.install_snapshot)
        self.checker.after_write(node.node_id, node.disk, ready)
        if crash_point == "after persisting":
            self._crash(node)
            return
        self._send(node, ready, crash_point)
        if node.core is None:
            return
        if crash_point == "before applying":
            self._crash(node)
            return
        self._apply(node, ready.committed_entries)
        core.advance(ready)
        self._maybe_compact(node)

    def _send(self, node: SimNode, ready: Ready, crash_point: str | None) -> None:
        cut = self.rng.randrange(len(ready.messages) + 1) if crash_point == "while sending" else None
        for position, message in enumerate(ready.messages):
            if position == cut:
                self._crash(node)
                return
            self.checker.sent(message)
            self.network.send(message, self.now)

    def _apply(self, node: SimNode, entries: tuple[Entry, ...]) -> None:
        for entry in entries:
            node.state.apply(entry)
            self.checker.applied(node.node_id, node.state)
            if entry.kind is EntryKind.CONFIGURATION and entry.index > 1:
                self._count_configuration_change(entry)

    def _count_configuration_change(self, entry: Entry) -> None:
        if entry.index in self.configuration_indexes:     # once per index, when a first node applies it
            return
        self.configuration_indexes.add(entry.index)
        self.counts["configuration_changes"] += 1

    def _maybe_compact(self, node: SimNode) -> None:
        core = node.core
        if core is None or node.state.index - core.snapshot_index < self.rates.snapshot_every_entries:
            return
        if node.state.index != core.applied_index:
            raise InvariantBroken(f"{node.node_id} applied {node.state.index}, its core says {core.applied_index}")
        core.compact(node.state.index, node.state.to_bytes())

    # --- faults -------------------------------------------------------------------------------
    def _start(self, node: SimNode) -> None:
        node.core = RaftNode(node.node_id, node.disk.storage_id, node.disk.persisted_state(), self.limits,
                             random.Random(self.rng.getrandbits(64)))
        node.state = StateMachine.from_snapshot(node.disk.snapshot)
        node.tick_credit = 0.0
        node.crash_armed = None
        self.checker.forget_commit_seen(node.node_id)

    def _crash(self, node: SimNode) -> None:
        node.core = None
        node.crash_armed = None
        low, high = self.rates.downtime_ticks
        node.down_until = self.now + self.rng.randint(low, high)
        self.counts["crashes"] += 1

    def _restart_due_nodes(self) -> None:
        for node in self.nodes.values():
            if node.core is None and node.down_until <= self.now:
                self._start(node)

    def _inject_faults(self) -> None:
        rng, rates = self.rng, self.rates
        if self.network.blocked and self.now >= self.partition_until:
            self.network.blocked.clear()
        elif not self.network.blocked and rng.random() < rates.partition_start:
            self._partition()
        for node in self.nodes.values():
            if node.core is not None and rng.random() < rates.crash:
                self._crash_soon(node)
        if rng.random() < rates.leader_crash:
            leader = self._leader()
            if leader is not None:
                self._crash_soon(self.nodes[leader.node_id])
        if rng.random() < rates.wipe:
            self._maybe_wipe()

    def _crash_soon(self, node: SimNode) -> None:
        """Now, or at a random point of the handling of its next Ready."""
        if self.rng.random() < self.rates.crash_mid_ready:
            node.crash_armed = self.rng.choice(CRASH_POINTS)
            self.counts["crashes_mid_ready"] += 1
        else:
            self._crash(node)

    def _partition(self) -> None:
        rng = self.rng
        ids = sorted(self.nodes)
        low, high = self.rates.partition_ticks
        self.partition_until = self.now + rng.randint(low, high)
        shape = rng.random()
        if shape < 0.35:                                     # one node cut off, both ways: often the leader
            leader = self._leader()
            alone = leader.node_id if leader is not None and rng.random() < 0.5 else rng.choice(ids)
            groups = [[alone], [node_id for node_id in ids if node_id != alone]]
        elif shape < 0.65:                                   # two halves
            shuffled = ids[:]
            rng.shuffle(shuffled)
            split = rng.randint(1, len(ids) // 2)
            groups = [shuffled[:split], shuffled[split:]]
        else:                                                # one way: a node's messages out, or in, are lost
            node_id = rng.choice(ids)
            others = [other for other in ids if other != node_id]
            outgoing = rng.random() < 0.5
            self.network.blocked = {(node_id, other) if outgoing else (other, node_id) for other in others}
            self.counts["one_way_partitions"] += 1
            return
        self.network.blocked = {(a, b) for a in groups[0] for b in groups[1]} | {(b, a) for a in groups[0] for b in groups[1]}
        self.counts["partitions"] += 1

    def _maybe_wipe(self) -> None:
        """One lost disk at a time, and only while the membership is whole with three voters
        or more (Raft tolerates losing a minority of disks, not more)."""
        leader = self._leader()
        if leader is None or not self._membership_whole(leader, voters_min=3):
            return
        node = self.nodes[self.rng.choice(sorted(self.nodes))]
        if leader.configuration.voter_storage_id(node.node_id) == node.disk.storage_id:
            self.counts["voter_wipes"] += 1
        if node.core is not None:
            self._crash(node)
        node.wipes += 1
        node.disk = Disk.holding(f"{node.node_id}-{node.wipes}".encode(), empty_state())
        node.wipe_noticed_at = node.down_until + self.rng.randint(*self.rates.wipe_noticed_after_ticks)

    # --- clients and the operator --------------------------------------------------------------
    def _live(self) -> list[SimNode]:
        return [node for node in self.nodes.values() if node.core is not None]

    def _leader(self) -> RaftNode | None:
        leaders = [node.core for node in self._live() if node.core is not None and node.core.is_leader]
        return max(leaders, key=lambda core: core.term) if leaders else None

    def _propose(self, command: bytes) -> None:
        live = self._live()
        if not live:
            return
        leaders = [node for node in live if node.core is not None and node.core.is_leader]
        node = self.rng.choice(leaders or live)
        core = node.core
        assert core is not None
        was_leader, term = core.is_leader, core.term
        core.propose(command)
        self._observe(core, was_leader, term)
        self.commands_proposed += 1

    def _membership_whole(self, leader: RaftNode, voters_min: int) -> bool:
        """Every node a voter on the disk it has now, and no change pending."""
        configuration = leader.configuration
        if leader.log.configuration_index > leader.commit_index or len(configuration.voters) < voters_min:
            return False
        return all(configuration.voter_storage_id(node_id) == node.disk.storage_id
                   for node_id, node in self.nodes.items())

    def _operate(self) -> None:
        leader = self._leader()
        if leader is None:
            return
        change = self._next_change(leader)
        if change is None:
            return
        outcome = leader.propose_change(change)
        if isinstance(outcome, Proposed) and change.kind is ChangeKind.PROMOTE_LEARNER:
            self.counts["learner_promotions"] += 1
        self._observe(leader, True, leader.term)

    def _next_change(self, leader: RaftNode) -> ConfigurationChange | None:
        configuration = leader.configuration
        for node_id, node in sorted(self.nodes.items()):
            known = configuration.storage_id_of(node_id)
            if known is not None and known != node.disk.storage_id and self.now >= node.wipe_noticed_at:
                # It came back with a new disk, and the operator noticed (some time later).
                return ConfigurationChange(ChangeKind.REMOVE_MEMBER, node_id)
        for node_id, node in sorted(self.nodes.items()):
            if not configuration.is_member(node_id):
                return ConfigurationChange(ChangeKind.ADD_LEARNER, node_id, node.disk.storage_id)
        for node_id in configuration.node_ids():
            if configuration.is_learner(node_id):
                return ConfigurationChange(ChangeKind.PROMOTE_LEARNER, node_id)
        if self.faults_on and self.rng.random() < self.rates.churn and self._membership_whole(leader, 3):
            voters = configuration.voter_ids()
            removed = leader.node_id if self.rng.random() < 0.3 else self.rng.choice(voters)
            return ConfigurationChange(ChangeKind.REMOVE_MEMBER, removed)
        return None

    # --- the liveness phase --------------------------------------------------------------------
    def _heal(self) -> None:
        self.faults_on = False
        self.network.faulty = False
        self.network.blocked.clear()
        for node in self.nodes.values():
            node.crash_armed = None
            if node.core is None:
                node.down_until = self.now

    def _converge(self, membership_ticks_max: int = 1000, commit_ticks_max: int = 100,
                  apply_ticks_max: int = 200) -> None:
        self._run_until(self._whole_leader, membership_ticks_max,
                        "the healed cluster did not elect a leader with every node a voter")
        leader = self._run_until(self._proposal_committed, commit_ticks_max,
                                 f"a proposal after healing did not commit within {commit_ticks_max} ticks")
        self._run_until(lambda: leader if self._all_applied(leader.commit_index) else None, apply_ticks_max,
                        "the healed nodes did not all apply the same commands")

    def _proposal_committed(self) -> RaftNode | None:
        """A client's proposal after healing, made again (as a client would) if the leader it
        went to lost its leadership first: it was a leader cut off until the healing."""
        leader = self._whole_leader()
        if leader is None:
            return None
        if self.proposal_after_healing is None or self.proposal_after_healing[0] is not leader \
                or self.proposal_after_healing[1].term != leader.term:
            outcome = leader.propose(b"after healing")
            if not isinstance(outcome, Proposed):
                return None
            self.proposal_after_healing = (leader, outcome)
        outcome = self.proposal_after_healing[1]
        committed = leader.commit_index >= outcome.index and leader.log.term_at(outcome.index) == outcome.term
        return leader if committed else None

    def _whole_leader(self) -> RaftNode | None:
        leader = self._leader()
        return leader if leader is not None and self._membership_whole(leader, len(self.nodes)) else None

    def _all_applied(self, index: int) -> bool:
        """Every node applied the same history, up to the same index at or past `index`."""
        states = [node.state for node in self.nodes.values()]
        first = states[0]
        return first.index >= index and all(state.index == first.index and state.digest == first.digest
                                            for state in states)

    def _run_until(self, condition: Callable[[], RaftNode | None], ticks_max: int, failure: str) -> RaftNode:
        for _ in range(ticks_max):
            found = condition()
            if found is not None:
                return found
            self._step_world()
        raise AssertionError(f"seed {self.seed}: {failure}")
