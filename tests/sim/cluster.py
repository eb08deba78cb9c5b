"""Deterministic simulation of one queue pair: real cores and replication roles on a seeded
fake clock, fake network and fake disk (docs/ARCHITECTURE.md, "Conventions": deterministic
simulation from one seed, after TigerBeetle's VOPR).

Everything runs from one `random.Random(seed)`: message delays, drops, duplicates and
reordering on the network, fsync latency, crashes that lose whatever was not yet fsync'd,
partitions, and the client workload. `SimNode` is a small driver with the node's effect
order: step the core, stage the operations, stream them, fsync, then answer clients once
their operation is committed. Each batch also truncates the op log below the role's floor
(the master's `log_floor`, the replica's visible order), and a replica recorded out of sync
that falls behind the log's start takes a snapshot: the checks below judge against each
node's `history`, a shadow of every operation it made durable that is never truncated. A failing run prints its seed; `Simulation(seed).run()`
replays it exactly.
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replication.digest import EMPTY_DIGEST
from replication.master import InSyncProposal, MasterRole, ReplicationLimits
from replication.messages import Message, RelayRequest, decode_message, encode_message
from replication.operations import Enqueued, Leased, Operation
from replication.oplog import LogEntry, MemoryOpLog
from replication.options import QueueOptions, QueueState, Strength
from replication.queue_core import QueueCore, QueueRecord
from replication.replica import ReplicaRole, SnapshotInstall
from replication.snapshot import InstalledState, MemorySnapshotView, SnapshotView, memory_rows
from replication.store import MemoryStore
from wire.errors import QueueError

QUEUE = "q"
QUEUE_IDS = {"n1": 1, "n2": 7}    # node-local storage ids differ, as they do between real nodes
INCARNATION = 1
# A small retention and small chunks: replicas out of sync fall behind the log's start, and
# snapshots take many chunks, some of them lost, repeated and reordered on the way.
LIMITS = ReplicationLimits(replica_lag_max=400, replica_lag_max_ms=300, resend_after_ms=150, window_max=64,
                           append_batch_max=16, open_retry_ms=200, snapshot_chunk_bytes_max=200,
                           snapshot_chunks_in_flight_max=3, log_retain_max_bytes=1_500)


class InvariantBroken(AssertionError):
    """A protocol invariant the simulation checks as it runs."""


class Clock:
    """Time and the event queue: callbacks run in (time, sequence) order."""

    def __init__(self) -> None:
        self.now_ms = 0
        self._events: list[tuple[int, int, Callable[[], None]]] = []
        self._sequence = 0

    def read(self) -> int:
        return self.now_ms

    def after(self, delay_ms: int, callback: Callable[[], None]) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (self.now_ms + max(0, delay_ms), self._sequence, callback))

    def run_until(self, end_ms: int) -> None:
        while self._events and self._events[0][0] <= end_ms:
            at_ms, _, callback = heapq.heappop(self._events)
            self.now_ms = at_ms
            callback()
        self.now_ms = end_ms


@dataclass
class Faults:
    drop: float = 0.0           # probability a message is lost
    duplicate: float = 0.0      # probability a message is delivered twice
    reorder: float = 0.0        # probability a message is held back (arrives after later ones)
    delay_ms: tuple[int, int] = (1, 4)
    fsync_ms: tuple[int, int] = (1, 3)


class Network:
    def __init__(self, clock: Clock, rng: random.Random) -> None:
        self.clock = clock
        self.rng = rng
        self.faults = Faults()
        self.nodes: dict[str, SimNode] = {}
        self.cut = False

    def send(self, source: str, target: str, message: Message) -> None:
        data = encode_message(message)      # every message crosses the real codec
        if self.cut or self.rng.random() < self.faults.drop:
            return
        copies = 2 if self.rng.random() < self.faults.duplicate else 1
        for _ in range(copies):
            delay = self.rng.randint(*self.faults.delay_ms)
            if self.rng.random() < self.faults.reorder:
                delay += self.rng.randint(5, 40)
            self.clock.after(delay, lambda d=data: self._deliver(source, target, d))

    def _deliver(self, source: str, target: str, data: bytes) -> None:
        node = self.nodes[target]
        if not self.cut and node.up:
            node.deliver(decode_message(data))

    def partition(self) -> None:
        self.cut = True
        for node in self.nodes.values():
            node.link_down()

    def heal(self) -> None:
        if self.cut:
            self.cut = False
            for node in self.nodes.values():
                node.link_up()


class Membership:
    """The static-placement stand-in: records the replica in or out of sync (compare-and-set)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.in_sync = True
        self.history: list[tuple[int, bool]] = []

    def propose(self, proposal: InSyncProposal, answer: Callable[[bool], None]) -> None:
        def decide() -> None:
            if proposal.expected_in_sync == self.in_sync:
                self.in_sync = proposal.in_sync
                self.history.append((self.clock.now_ms, self.in_sync))
            answer(self.in_sync)
        self.clock.after(2, decide)


@dataclass
class Pending:
    """A client answer waiting for durability here and the commit point."""
    required_order: int
    batch: int
    answer: Callable[[], None]


@dataclass
class History:
    """What clients saw (Jepsen-style): the checkers judge this against the final state."""
    acked_enqueues: dict[str, set[int]] = field(default_factory=lambda: {"n1": set(), "n2": set()})
    delivered: dict[str, list[int]] = field(default_factory=lambda: {"n1": [], "n2": []})
    consumed: dict[str, set[int]] = field(default_factory=lambda: {"n1": set(), "n2": set()})
    ack_invoked: set[int] = field(default_factory=set)     # acks sent, answered or not
    failures: int = 0


class SimNode:
    def __init__(self, name: str, sim: Simulation, is_master: bool) -> None:
        self.name = name
        self.sim = sim
        self.is_master = is_master
        self.peer = "n2" if name == "n1" else "n1"
        self.store = MemoryStore()                       # durable state
        self.oplog = MemoryOpLog(EMPTY_DIGEST)           # durable op log (truncated)
        self.history = MemoryOpLog(EMPTY_DIGEST)         # every op made durable here, never truncated
        self.snapshots_installed = 0
        self.truncated_rows = 0
        self.staged_rows: list[list[Any]] = []           # snapshot rows of the batch being staged
        self.staged_through: tuple[int, int] | None = None   # the role's chunk they end with
        self.staged_installs: list[tuple[SnapshotInstall, InstalledState]] = []
        self.staged_discards: list[int] = []
        self.received = InstalledState()                 # rows of the transfer under way
        self.applied_upto = 0                            # the last order applied here (no skips)
        self.queue_id = QUEUE_IDS[name]
        self.record_json = QueueRecord(self.queue_id, QUEUE, sim.options, 0, state=QueueState.OPEN).to_json()
        self.up = True
        self.boots = 0
        self.batch = 0                                   # the batch being staged
        self.durable_batch = 0
        self.fsync_in_flight = False
        self.staged_ops: list[Operation] = []
        self.staged_log: list[LogEntry] = []
        self.pending: list[Pending] = []
        self.waiting_forwards: dict[int, Callable[[list[Any]], None]] = {}
        self.next_request = 1
        self.role: MasterRole | ReplicaRole
        self.boot()

    # --- lifecycle -------------------------------------------------------------------------
    def boot(self) -> None:
        self.boots += 1
        self.up = True
        self.staged_ops, self.staged_log, self.pending, self.waiting_forwards = [], [], [], {}
        self.staged_rows, self.staged_installs, self.staged_discards = [], [], []
        self.staged_through = None
        self.received = InstalledState()
        self.fsync_in_flight = False
        record = QueueRecord.from_json(self.record_json)
        self.core = QueueCore(record, self.store, random.Random(self.sim.rng.random()),
                              lease_clock=self.sim.clock.read, leases=self.store.leases(self.queue_id))
        last_order, digest = self.oplog.last(self.queue_id)
        self.applied_upto = last_order
        if self.is_master:
            self.role = MasterRole(self.core, self.oplog, node_id=self.name, replica_id=self.peer, epoch=1,
                                   incarnation=INCARNATION, recorded_in_sync=self.sim.membership.in_sync,
                                   last_order=last_order, digest=digest, limits=LIMITS, snapshots=self,
                                   log_start=self.oplog.first(self.queue_id))
        else:
            self.role = ReplicaRole(self.core, self.oplog, node_id=self.name, master_id=self.peer, epoch=1,
                                    incarnation=INCARNATION, applied_order=last_order, digest=digest,
                                    last_epoch=1, limits=LIMITS, session_base=self.boots << 20,
                                    known_committed=int(self.record_json.get("commit_order", 0)))
            if not self.sim.network.cut:
                self.role.start(self.sim.clock.now_ms)
        self.drain()
        if self.boots > 1 and not self.sim.network.cut:
            self.peer_node().link_up()     # the peer link is dialled again

    def crash(self) -> None:
        """kill -9: whatever was not fsync'd is gone; clients of this node get no answer."""
        self.up = False
        self.boots += 1          # fsyncs in flight belong to a dead incarnation now
        self.staged_ops, self.staged_log, self.pending = [], [], []
        self.staged_rows, self.staged_installs, self.staged_discards = [], [], []
        self.staged_through = None
        self.peer_node().link_down()      # the peer sees its link break

    def peer_node(self) -> SimNode:
        return self.sim.network.nodes[self.peer]

    def link_down(self) -> None:
        if self.up:
            self.role.link_down()

    def link_up(self) -> None:
        if self.up and isinstance(self.role, ReplicaRole):
            self.role.start(self.sim.clock.now_ms)
            self.drain()

    # --- the effect order: stage, stream, fsync, answer ------------------------------------
    def drain(self) -> None:
        role = self.role
        if isinstance(role, ReplicaRole):
            for record in role.resets:
                self._reset(record)
            role.resets.clear()
            for order in role.discards:
                self._discard_after(order)
            role.discards.clear()
            self.received.take(role.snapshot_rows)
            self.staged_rows.extend(role.snapshot_rows)
            role.snapshot_rows.clear()
            if role.snapshot_rows_through is not None:
                self.staged_through, role.snapshot_rows_through = role.snapshot_rows_through, None
            for install in role.installs:
                self._stage_install(install)
            role.installs.clear()
            for entry in role.applied:
                for op in entry.ops:
                    if op.order != self.applied_upto + 1:
                        raise InvariantBroken(f"{self.name} applied order {op.order} after {self.applied_upto}: "
                                              "a catch-up skipped what the member lacked")
                    self.applied_upto = op.order
                self.staged_ops.extend(entry.ops)
            self.staged_log.extend(role.applied)
            role.applied.clear()
            for result in role.relay_results:
                callback = self.waiting_forwards.pop(result.request_id, None)
                if callback is not None:
                    callback(result.outcomes)
            role.relay_results.clear()
        else:
            forwarded, role.relayed = role.relayed, []
            for request in forwarded:
                self._run_forwarded(request)
            self.staged_log.extend(role.to_log)
            role.to_log.clear()
            for proposal in role.proposals:
                self.sim.membership.propose(proposal, self._decided(self.boots))
            role.proposals.clear()
        for target, message in role.outbox:
            self.sim.network.send(self.name, target, message)
        role.outbox.clear()
        self._start_fsync()
        self._answer_committed()

    def _decided(self, boots: int) -> Callable[[bool], None]:
        def answer(in_sync: bool) -> None:
            if self.up and self.boots == boots and isinstance(self.role, MasterRole):
                self.role.membership_decided(in_sync)
                self.drain()
        return answer

    def _reset(self, record_json: dict[str, Any]) -> None:
        # As the engine does: the wiped instance gets a new local id, so a batch of the old
        # one still on its way to disk lands on the old data (left behind, as the engine's
        # housekeeping erases it later), not on the new.
        self.queue_id += 100
        fresh = QueueRecord(self.queue_id, QUEUE, self.sim.options, record_json["created_ms"], state=QueueState.OPEN)
        self.record_json = fresh.to_json()
        self.core = QueueCore(fresh, self.store, random.Random(self.sim.rng.random()), lease_clock=self.sim.clock.read)
        self.role.core = self.core
        self.core.visible_upto = 0
        self.staged_ops, self.staged_log = [], []
        self.staged_rows, self.staged_installs, self.staged_discards = [], [], []
        self.staged_through = None
        self.received = InstalledState()
        self.applied_upto = 0

    def _discard_after(self, order: int) -> None:
        """A `producer` member keeping its state up to `order` (a snapshot follows)."""
        if self.core.discard_after(order) is None:
            raise InvariantBroken(f"{self.name} could not keep its state up to {order}")
        self.staged_discards.append(order)
        self.staged_rows, self.received, self.staged_through = [], InstalledState(), None
        self.applied_upto = min(self.applied_upto, order)

    def _stage_install(self, install: SnapshotInstall) -> None:
        record = self.core.record
        count = self.received.ready_count + len(self.received.leases)
        if install.keep_upto:
            record.ready_count += self.received.ready_count
            record.total_enqueued += count
        else:
            record.ready_count = self.received.ready_count
            record.total_enqueued = count
        record.next_index = install.order + 1
        self.staged_installs.append((install, self.received))
        self.received = InstalledState()
        self.applied_upto = install.order

    # --- snapshots (SnapshotSource) ----------------------------------------------------------
    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> SnapshotView | None:
        """One view of what is durable here (the store, the log and the record as fsync'd)."""
        order, digest = self.oplog.last(queue_id)
        rows = memory_rows(self.store, queue_id, consumption=consumption, after_index=after_index)
        return MemorySnapshotView(rows, order, digest, dict(self.record_json))

    def _start_fsync(self) -> None:
        if self.fsync_in_flight or not (self.staged_ops or self.staged_log or self.staged_rows or self.staged_installs
                                        or self.staged_discards):
            return
        ops, log = self.staged_ops, self.staged_log
        rows, installs, discards = self.staged_rows, self.staged_installs, self.staged_discards
        through = self.staged_through
        self.staged_ops, self.staged_log = [], []
        self.staged_rows, self.staged_installs, self.staged_discards = [], [], []
        self.staged_through = None
        floor = self._log_floor()
        record = self.core.record.to_json()
        # As the engine does: the record keeps the commit point this member knew.
        record["commit_order"] = self.role.commit_order if isinstance(self.role, MasterRole) \
            else self.role.visible_order
        self.core.seal()
        self.fsync_in_flight = True
        self.batch += 1
        batch, boots = self.batch, self.boots
        self.sim.clock.after(self.sim.rng.randint(*self.sim.network.faults.fsync_ms),
                             lambda: self._fsync_done(boots, batch, ops, log, record, (rows, installs, discards, floor, through)))

    def _log_floor(self) -> int:
        """What this batch truncates the log below (checked: no member still needs it)."""
        role = self.role
        if isinstance(role, MasterRole):
            floor = role.log_floor
            peer = self.peer_node()
            held, digest = peer.oplog.last(peer.queue_id)
            # (A replica whose history differs from the master's takes a snapshot anyway.)
            same_history = self.oplog.digest_at(self.queue_id, held) == digest
            if self.sim.membership.in_sync and floor > held and same_history and not peer.staged_installs \
                    and isinstance(peer.role, ReplicaRole) and not peer.role.receiving_snapshot:
                raise InvariantBroken(f"the master truncates below {floor}, past what its in-sync replica holds "
                                      f"({held})")
            role.truncated_to(floor)
            return floor
        return role.log_floor

    def _fsync_done(self, boots: int, batch: int, ops: list[Operation], log: list[LogEntry],
                    record: dict[str, Any], snapshot: tuple[Any, Any, Any, int]) -> None:
        if boots != self.boots or not self.up:
            return
        rows, installs, discards, floor, through = snapshot
        current = record["queue_id"] == self.queue_id      # not a batch of an instance since reset
        for order in discards:
            if self.queue_id in self.store.queues:
                self.store.discard_after(self.queue_id, order)
            self.oplog.discard_after(self.queue_id, order)
        if current:
            self.store.put_snapshot_rows(self.queue_id, None, rows)
        for install, _ in installs:
            if current:
                self.oplog.install(self.queue_id, install.order, install.digest)
        self.store.apply(ops)
        for row in log:
            self.oplog.append(row.ops[0].queue_id, row.ops, row.digest, row.encoded)
            self.history.append(row.ops[0].queue_id, row.ops, row.digest, row.encoded)
        if current:
            self.truncated_rows += self.oplog.truncate(self.queue_id, floor)
            for install, received in installs:
                self.core.install_snapshot(received.ready if install.keep_upto else None, received.leases)
                self.snapshots_installed += 1
        if current:
            self.record_json = record
        log = [row for row in log if row.ops[0].queue_id == self.queue_id]
        self.core.advance()
        if isinstance(self.role, MasterRole) and current:
            self.role.recorded_commit = int(record["commit_order"])
        self.durable_batch = batch
        self.fsync_in_flight = False
        durable = max([row.last for row in log] + [install.order for install, _ in installs if current],
                      default=0)
        if durable:
            self.role.local_durable_to(durable) if isinstance(self.role, ReplicaRole) \
                else self.role.local_durable_to(durable, self.sim.clock.now_ms)
        if through is not None and isinstance(self.role, ReplicaRole):
            self.role.snapshot_rows_durable(*through)
        self.drain()

    def _answer_committed(self) -> None:
        commit = self.role.commit_order if isinstance(self.role, MasterRole) else self.role.visible_order
        ready = [p for p in self.pending if p.batch <= self.durable_batch and p.required_order <= commit]
        if ready:
            self.pending = [p for p in self.pending if p not in ready]
            for pending in ready:
                pending.answer()

    def _stage(self, ops: list[Operation]) -> None:
        self.staged_ops.extend(ops)
        if isinstance(self.role, MasterRole):
            self.role.replicate(ops, self.sim.clock.now_ms)

    def _after_this_batch(self, required_order: int, answer: Callable[[], None]) -> None:
        batch = self.batch + 1 if (self.staged_ops or self.staged_log) else self.batch
        self.pending.append(Pending(required_order, batch, answer))

    # --- messages ----------------------------------------------------------------------------
    def deliver(self, message: Message) -> None:
        self.role.receive(message, self.sim.clock.now_ms)
        self.drain()

    def tick(self) -> None:
        if not self.up:
            return
        now = self.sim.clock.now_ms
        if isinstance(self.role, MasterRole):
            ops: list[Operation] = []
            self.core.expire_leases(now, ops)
            self._stage(ops)
        self.role.tick(now)
        self.drain()

    # --- client operations -------------------------------------------------------------------
    def client_enqueue(self, payload: bytes) -> None:
        history = self.sim.history
        if not self.up:
            return
        if isinstance(self.role, ReplicaRole):
            request_id = self.next_request
            self.next_request += 1
            def placed(outcomes: list[Any]) -> None:
                order = outcomes[0]
                if isinstance(order, int):
                    self.pending.append(Pending(order, self.batch, lambda: history.acked_enqueues[self.name].add(order)))
                    self._answer_committed()
            self.waiting_forwards[request_id] = placed
            self.role.relay(request_id, ["enqueue", payload, 4, None])
            self.drain()
            return
        try:
            self.role.check_writable()
            ops: list[Operation] = []
            index, _ = self.core.enqueue(payload, 4, None, "c", self.sim.clock.now_ms, ops)
        except QueueError:
            history.failures += 1
            return
        self._stage(ops)
        self._after_this_batch(index, lambda: history.acked_enqueues[self.name].add(index))
        self.drain()

    def _run_forwarded(self, request: RelayRequest) -> None:
        assert isinstance(self.role, MasterRole)
        kind, payload, priority, dedupe = request.request
        try:
            self.role.check_writable()
            ops: list[Operation] = []
            index, _ = self.core.enqueue(payload, priority, dedupe, "forwarded", self.sim.clock.now_ms, ops)
            outcome: Any = index
        except QueueError as error:
            self.role.answer_relay(request, [[error.code, error.message]])
            return
        self._stage(ops)
        role = self.role
        # As the engine does: the answer leaves once the operation is committed. Sent before,
        # it could name an order that dies with this master if it crashes before its fsync.
        self._after_this_batch(index, lambda: (role.answer_relay(request, [outcome]), self.drain()))

    def client_receive_and_ack(self) -> None:
        """Lease one message here; ack it once the lease is answered (committed)."""
        if not self.up or (isinstance(self.role, ReplicaRole) and self.sim.options.strength is Strength.FULL):
            return   # under `full` a replica forwards receives: this simulation keeps consumers on the master
        ops: list[Operation] = []
        leased = self.core.lease(1, 60_000, "c", self.sim.clock.now_ms, ops)
        if not leased:
            return
        lease = leased[0]
        self._stage(ops)
        history = self.sim.history
        def got() -> None:
            history.delivered[self.name].append(lease.index)
            self.sim.clock.after(self.sim.rng.randint(1, 20), lambda: self._ack(lease))
        self._after_this_batch(lease.order, got)
        self.drain()

    def _ack(self, lease: Leased) -> None:
        if not self.up:
            return
        ops: list[Operation] = []
        try:
            self.core.ack(lease.index, lease.receipt, "c", self.sim.clock.now_ms, ops)
        except QueueError:
            return       # the node restarted and forgot the lease, or it expired
        self._stage(ops)
        history = self.sim.history
        history.ack_invoked.add(lease.index)
        order = ops[0].order
        self._after_this_batch(order, lambda: history.consumed[self.name].add(lease.index))
        self.drain()


class Simulation:
    def __init__(self, seed: int, strength: Strength = Strength.FULL) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.options = QueueOptions(strength=strength, dead_letter=False, visibility_timeout_s=60.0)
        self.clock = Clock()
        self.network = Network(self.clock, self.rng)
        self.membership = Membership(self.clock)
        self.history = History()
        self.master = SimNode("n1", self, is_master=True)
        self.replica = SimNode("n2", self, is_master=False)
        self.network.nodes = {"n1": self.master, "n2": self.replica}
        self.log: list[str] = []

    def _every(self, period_ms: int, action: Callable[[], None], until_ms: int) -> None:
        def fire() -> None:
            action()
            if self.clock.now_ms + period_ms <= until_ms:
                self.clock.after(period_ms, fire)
        self.clock.after(period_ms, fire)

    def safety_phase(self, duration_ms: int) -> None:
        """Client load with faults: lossy network, partitions, crashes of either member."""
        self.network.faults = Faults(drop=0.03, duplicate=0.03, reorder=0.05)
        end = self.clock.now_ms + duration_ms
        self._every(10, self.master.tick, end)
        self._every(10, self.replica.tick, end)
        for at in sorted(self.rng.randrange(0, duration_ms) for _ in range(400)):
            node = self.master if self.rng.random() < 0.7 else self.replica
            self.clock.after(at, lambda n=node, i=at: n.client_enqueue(f"m{i}".encode()))
        for at in sorted(self.rng.randrange(0, duration_ms) for _ in range(250)):
            node = self.master if self.rng.random() < 0.7 else self.replica
            self.clock.after(at, node.client_receive_and_ack)
        for _ in range(3):
            self.clock.after(self.rng.randrange(0, duration_ms), self._random_fault)
        self.clock.run_until(end)

    def _random_fault(self) -> None:
        choice = self.rng.choice(["partition", "crash_master", "crash_replica"])
        self.log.append(f"{self.clock.now_ms}: {choice}")
        if choice == "partition":
            self.network.partition()
            self.clock.after(self.rng.randint(50, 600), self.network.heal)
        else:
            node = self.master if choice == "crash_master" else self.replica
            if node.up:
                node.crash()
                self.clock.after(self.rng.randint(20, 400), node.boot)

    def liveness_phase(self, duration_ms: int = 5_000) -> None:
        """Heal everything, stop faults and load; the pair must converge."""
        self.network.faults = Faults()
        self.network.heal()
        for node in (self.master, self.replica):
            if not node.up:
                node.boot()
        end = self.clock.now_ms + duration_ms
        self._every(10, self.master.tick, end)
        self._every(10, self.replica.tick, end)
        self.clock.run_until(end)

    def run(self, safety_ms: int = 3_000) -> Simulation:
        self.safety_phase(safety_ms)
        self.liveness_phase()
        return self

    def oplog_rows(self, node: SimNode) -> list[tuple[int, int, bytes]]:
        """What the node's (truncated) op log still holds: (first, last, encoded entry)."""
        return node.oplog.read(node.queue_id, 0, 10**9)

    def surviving_enqueues(self, node: SimNode) -> set[int]:
        """Enqueues in the node's whole durable history (of its current instance)."""
        return {op.index for op in node.history.operations(node.queue_id) if type(op) is Enqueued}

    def held(self, node: SimNode) -> set[int]:
        queue = node.store.queues.get(node.queue_id)
        return set() if queue is None else set(queue.messages)
