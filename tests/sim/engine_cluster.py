"""Deterministic simulation of a three-node cluster built from real engines
(docs/ARCHITECTURE.md, "Conventions"; after TigerBeetle's VOPR): the engine of qserver/core/ with
its group commit, as qserver/assembly.py builds it with its pair driver,
held answers and coordinator (leases, failover, handoff), the real membership layer (the Raft
core of replication/raft.py run by qserver/cluster/membership.py, its state in a `MemoryRaftStore`
written through the node's disk), on a virtual-time event loop, in-memory peer and membership
networks and in-memory storage whose commits are durable when they run, after a seeded fsync
delay.

One `random.Random(seed)` decides everything: the client workload, fsync latencies, network
latency and the faults; a second one, from the same seed, sets each node's clock, which runs
up to CLOCK_DRIFT faster or slower than the virtual time (leases count on it, Raft ticks by
it). At every acknowledged write and every few milliseconds the run checks that at most one
node could acknowledge writes as master of the queue, each judging its lease by its own clock. Clients follow the map: each request goes to a node picked at random,
which looks the queue up in its own copy of the map and is sent to the master or the replica
named there (a stale copy sends it to the wrong node; errors are recorded, not retried).
Faults come on a seeded schedule, each bounded in duration: crash and restart of the master,
of the replica or of any node; process pauses of the master or of any node (its engine and
disk stop, what arrives waits, it resumes with a backlog on a clock that moved on); partitions of the master from its replica and between any
pair of nodes (peer links only); a node isolated from the membership majority (cut off from
the membership links and from every peer); a node standing for election at once; and handoffs
asked by the master, by the replica, or by both at the same moment. A crash drops the engine
and its membership driver with what they had not written and every answer still owed; a
restart builds new ones on the same storage, and the Raft core replays the map from its log.
n1 founds the cluster (its store holds the first configuration); n2 and n3 join it.

A run is a safety phase with faults, then a liveness phase that heals everything, restarts
what is down and lets the cluster converge. `EngineSimulation(seed, strength).run()` replays
a run exactly; `pair_changes()` counts the failovers, handoffs and moves it went through.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qserver.assembly import build_engine
from qserver.cluster.membership import ChangeAll, RaftMembership, raft_limits, tick_ms
from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.engine import Engine
from qserver.storage.raft_store import MemoryRaftStore
from qserver.transport.memory_peers import MemoryPeerNetwork
from replication.cluster_map import ChangePair, ChangePairs, ClusterMap, QueueEntry, decode_command, encode_command
from replication.master import ReplicaProgress
from replication.options import Strength
from tests.sim.memory_storage import MemoryStorage
from tests.sim.virtual_loop import DelayedExecutor, VirtualTimeLoop
from wire.errors import QueueError

QUEUE = "q"
NODES = ("n1", "n2", "n3")
FIRST_MASTER, FIRST_REPLICA = "n1", "n2"
FOUNDER = "n1"                 # whose store holds the membership layer's first configuration
SAFETY_S = 4.0
JOIN_WAIT_STEPS = 1_000          # x 10 ms: how long the cluster may take to make every node a voter
LIVENESS_S = 10.0
FAULTS = 7
HANDOFFS = 3
SAMPLE_INTERVAL_S = 0.005
# Short leases so that failovers happen within a run: a master's lease lapses 300 ms after
# its last renewal, and the membership leader promotes its replica 150 ms after that.
LEASE_MS = 300
LEASE_MARGIN_MS = 150
LEASE_RENEW_INTERVAL_MS = 100
REPLICA_REPLACE_AFTER_S = 1.0
FAULT_S = (0.05, 2.0)          # how long a crash, partition or isolation lasts
# Each node's clock (its monotonic clock, which leases count on, and its Raft ticks) runs at
# 1 +- this rate against the virtual time: the most the Raft lease allows (RaftLimits).
CLOCK_DRIFT = 0.1
# Each node's wall clock (what records say; nothing may time a deadline on it) starts off the
# others by up to this much, and a run steps some of them by this much either way, as NTP does.
WALL_SKEW_MS = 60_000
WALL_STEPS = 2
WALL_BASE_MS = 1_700_000_000_000


def sim_config(node_id: str) -> NodeConfig:
    return NodeConfig(
        node_id=node_id, data_dir=f"/nonexistent/{node_id}",
        cluster_nodes={node: f"http://{node}.sim" for node in NODES},
        membership_nodes={node: f"{node}.sim:7200" for node in NODES},   # the simulated network ignores them
        lease_ms=LEASE_MS, lease_margin_ms=LEASE_MARGIN_MS, lease_renew_interval_ms=LEASE_RENEW_INTERVAL_MS,
        raft_heartbeat_ms=30, election_timeout_ms=(100, 200),
        replica_replace_after_s=REPLICA_REPLACE_AFTER_S).check()


@dataclass
class History:
    """What clients saw (Jepsen-style); the checkers judge it against the final state."""
    acked_enqueues: dict[int, bytes] = field(default_factory=dict)     # message id -> payload
    acked_twice: list[tuple[int, bytes, bytes]] = field(default_factory=list)   # one id, two payloads
    delivered: list[tuple[int, bytes]] = field(default_factory=list)
    # Every delivery in virtual ms: (message id, receive sent, answered, lease duration asked).
    leases: list[tuple[int, int, int, int]] = field(default_factory=list)
    consumed: set[int] = field(default_factory=set)
    ack_invoked: set[int] = field(default_factory=set)     # acks sent, answered or not
    invoked: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    unanswered: int = 0                                    # answers dropped by a crash
    handoffs: dict[str, int] = field(default_factory=dict)  # "initiator outcome" -> count
    simultaneous_handoffs: list[dict[str, str]] = field(default_factory=list)   # initiator -> outcome
    masters_seen: set[tuple[int, str]] = field(default_factory=set)   # (epoch, node acting as master)
    # Moments at which two nodes could both acknowledge writes as master of the queue (each
    # master with a lease valid on its own clock): (ms, the nodes).
    two_acknowledging: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    acks_checked: int = 0                                  # acknowledgements the check above ran at
    with_ttl: set[bytes] = field(default_factory=set)      # payloads enqueued with a time to live (each is unique)
    delayed: dict[bytes, tuple[int, int]] = field(default_factory=dict)   # payload -> (enqueue sent, delay ms)
    answered_at: list[tuple[bytes, int]] = field(default_factory=list)     # each delivery: payload, ms answered

    def failed(self, error: BaseException | str) -> None:
        code = error if isinstance(error, str) else error.code if isinstance(error, QueueError) \
            else type(error).__name__
        self.failures[code] = self.failures.get(code, 0) + 1

    def acknowledged(self, index: int, payload: bytes) -> None:
        earlier = self.acked_enqueues.setdefault(index, payload)
        if earlier != payload:
            self.acked_twice.append((index, earlier, payload))


class SimNode:
    """One node: its storage survives crashes; its engine, disk queue and copy of the map do not."""

    def __init__(self, sim: EngineSimulation, node_id: str, clock_rate: float, clock_offset_ms: int,
                 wall_offset_ms: int) -> None:
        self.sim = sim
        self.node_id = node_id
        self.clock_rate = clock_rate                # this node's ticks per virtual tick
        self.clock_offset_ms = clock_offset_ms      # monotonic clocks of two machines are unrelated
        self.wall_offset_ms = wall_offset_ms        # its wall clock's skew; steps move it
        self.storage = MemoryStorage(node_id)
        self.raft_store = MemoryRaftStore()        # survives crashes, as the node's LMDB would
        if node_id == FOUNDER:
            self.raft_store.bootstrap(node_id, self.storage.storage_id)
        self.config = sim_config(node_id)
        self.membership: RaftMembership | None = None
        self.map_commands: list[bytes] = []        # what this boot's membership applied, in order
        self.transport = sim.network.transport(node_id, self._on_message, self._on_link_change)
        self.membership_transport = sim.membership_network.transport(node_id, self._on_membership_frame)
        self._membership_inbound_at = 0.0
        self.engine: Engine | None = None
        self.disk: DelayedExecutor | None = None
        self.outstanding: set[asyncio.Future[Any]] = set()
        self.boots = 0
        self._inbound_at = 0.0
        self._paused_wake: asyncio.Event | None = None     # the engine's own, while it is paused

    @property
    def up(self) -> bool:
        return self.engine is not None

    @property
    def paused(self) -> bool:
        return self._paused_wake is not None

    def monotonic_ms(self) -> int:
        return self.clock_offset_ms + int(self.sim.loop.time() * 1000 * self.clock_rate)

    def wall_ms(self) -> int:
        return WALL_BASE_MS + self.wall_offset_ms + self.sim.now_ms()

    def may_acknowledge_as_master(self) -> bool:
        """Whether this node would take a write as master of the queue now: it masters the
        queue, no newer epoch fenced it, no handoff of it is under way (from its start the
        master assigns no new index) and its node lease is valid on its own clock. A paused
        process counts: it acts on that lease the moment it resumes."""
        engine = self.engine
        if engine is None or engine.coordinator is None:
            return False
        role = engine.pairs.masters.get(QUEUE)
        return role is not None and role.progress is not ReplicaProgress.FENCED \
            and not engine.coordinator.parks(QUEUE) and engine.coordinator.lease_valid()

    def _on_message(self, peer: str, data: bytes) -> None:
        self._arrive(c.PeerMessage(peer, data))

    def _on_link_change(self, peer: str, up: bool) -> None:
        self._arrive(c.LinkChange(peer, up))

    def _arrive(self, command: c.PeerMessage | c.LinkChange) -> None:
        """Network latency: a seeded delay, in arrival order (a link is a stream), and a
        link's breaking arrives after what it carried. A crash drops what is on its way."""
        if self.engine is None:
            return
        loop = self.sim.loop
        self._inbound_at = max(self._inbound_at, loop.time() + self.sim.rng.uniform(0, 0.005))
        loop.call_at(self._inbound_at, self._deliver, self.boots, command)

    def _deliver(self, boots: int, command: c.PeerMessage | c.LinkChange) -> None:
        if self.engine is not None and self.boots == boots:
            self.engine.submit(command)

    def _on_membership_frame(self, peer: str, data: bytes) -> None:
        """The same seeded latency, in order, on the membership link."""
        if self.membership is None:
            return
        loop = self.sim.loop
        self._membership_inbound_at = max(self._membership_inbound_at, loop.time() + self.sim.rng.uniform(0, 0.005))
        loop.call_at(self._membership_inbound_at, self._deliver_membership_frame, self.boots, peer, data)

    def _deliver_membership_frame(self, boots: int, peer: str, data: bytes) -> None:
        if self.membership is not None and self.boots == boots:
            self.membership.on_frame(peer, data)

    def _record_map_command(self, command: Any, outcomes: Any) -> None:
        if not isinstance(command, type(ChangeAll)):
            self.map_commands.append(encode_command(command))

    async def boot(self) -> None:
        """Start a new engine on the same storage; the membership layer replays the map to it
        (as Raft replays its journal) once it has loaded its queues."""
        if self.engine is not None:
            return
        self.boots += 1
        rng = self.sim.rng
        self.disk = DelayedExecutor(self.sim.loop, lambda: rng.randint(0, 3))
        disk = self.disk
        membership = self.membership = RaftMembership(
            self.node_id, self.storage.storage_id, self.raft_store, voters=set(NODES),
            send=self.membership_transport.send, writer=lambda: disk, loop=self.sim.loop,
            limits=raft_limits(self.config.election_timeout_ms, self.config.raft_heartbeat_ms),
            tick_s=tick_ms(self.config.raft_heartbeat_ms) / 1000 / self.clock_rate, seed=rng.getrandbits(64))
        engine = build_engine(self.config, self.storage, rng=random.Random(rng.getrandbits(64)),  # type: ignore[arg-type]
                              clock_ms=self.wall_ms, writer=self.disk, membership=membership,
                              monotonic_ms=self.monotonic_ms,
                              on_fatal=lambda reason, error: self.sim.engine_failed(self.node_id, reason, error))
        engine.pairs.send = self.transport.send
        engine.pairs.link_up = self.transport.is_up
        engine.self_checks = self.sim.self_checks
        applied = membership.on_applied
        self.map_commands = []

        def record_and_apply(command: Any, outcomes: Any) -> None:
            self._record_map_command(command, outcomes)
            applied(command, outcomes)
        membership.on_applied = record_and_apply
        await engine.start()
        self.engine = engine
        self.sim.rejoin_group(self.node_id, "crashed")
        membership.start()
        await self.transport.start()
        await self.membership_transport.start()

    async def crash(self) -> None:
        """kill -9: uncommitted batches and owed answers are gone; the peers see the links
        drop and the membership group goes on without this node."""
        engine = self.kill()
        if engine is not None:
            await self.bury(engine)

    def kill(self) -> Engine | None:
        """The moment of kill -9, the synchronous first part of `crash`: from here the engine
        runs no further step, its disk forgets what it was not done writing, and it sends
        nothing more. A scenario that must kill at an exact point (between a batch's write and
        the engine learning of it) calls this there, then awaits `bury`. None: not running."""
        engine, self.engine = self.engine, None
        if engine is None:
            return None
        self.boots += 1         # what was on its way to the dead engine is dropped
        self._paused_wake = None
        engine.pairs.send = lambda peer, data: False
        assert self.disk is not None
        self.disk.crash()
        self.sim.leave_group(self.node_id, "crashed")
        self.sim.rejoin_group(self.node_id, "paused")      # a paused process can be killed too
        if self.membership is not None:
            self.membership.stop()
            self.membership = None
        if engine._timer is not None:
            engine._timer.cancel()
        if engine._task is not None:
            engine._task.cancel()
        return engine

    async def bury(self, engine: Engine) -> None:
        """What follows a kill: the dead task ends, the answers it owed are never given, and
        the peers see the links drop."""
        if engine._task is not None:
            await asyncio.gather(engine._task, return_exceptions=True)
        for future in self.outstanding:
            future.cancel()
        self.sim.history.unanswered += len(self.outstanding)
        self.outstanding.clear()
        await self.transport.stop()
        await self.membership_transport.stop()

    def pause(self) -> bool:
        """A process pause (a long GC, SIGSTOP, a stalled VM): the engine's task and its disk
        stop; commands, peer messages and map changes that arrive meanwhile wait in its inbox,
        and its Raft member drops out of the group like a cut-off one. False: not running."""
        engine = self.engine
        if engine is None or self._paused_wake is not None:
            return False
        if engine._timer is not None:
            engine._timer.cancel()
        # The task waits on this event; whatever arrives now sets the stand-in instead.
        self._paused_wake, engine._wake = engine._wake, asyncio.Event()
        assert self.disk is not None
        self.disk.pause()
        self.sim.leave_group(self.node_id, "paused")
        return True

    def resume(self) -> None:
        """The process runs on, with the clock moved on under it and a backlog to work off."""
        wake, self._paused_wake = self._paused_wake, None
        engine = self.engine
        if wake is None or engine is None:
            return
        engine._wake = wake
        self.sim.rejoin_group(self.node_id, "paused")
        assert self.disk is not None
        self.disk.resume()
        wake.set()

    async def shutdown(self) -> None:
        """End of the run: stop the engine's task without answering anything further."""
        await self.crash()

    def entry(self) -> QueueEntry | None:
        """The queue as this node's copy of the map has it."""
        return None if self.membership is None else self.membership.cluster_map.queues.get(QUEUE)

    def call(self, command: Callable[[c.FutureReplier], c.Command],
             on_ok: Callable[[Any], None]) -> None:
        """Submit a client command; record its outcome when (if ever) it is answered."""
        history = self.sim.history
        if self.engine is None:
            history.failed("node down")
            return
        replier = c.FutureReplier()
        future = replier.future
        self.outstanding.add(future)

        def done(answered: asyncio.Future[Any]) -> None:
            self.outstanding.discard(answered)
            if answered.cancelled():
                return
            error = answered.exception()
            if error is not None:
                history.failed(error)
            else:
                on_ok(answered.result())
        future.add_done_callback(done)
        history.invoked += 1
        self.engine.submit(command(replier))


class EngineSimulation:
    # The engines check their bookkeeping of what changed against walks over every queue
    # (Engine.self_checks); a run that counts the engines' work turns it off.
    self_checks = True

    def __init__(self, seed: int, strength: Strength = Strength.FULL, clock_drift: float = CLOCK_DRIFT,
                 ttl_share: float = 0.0) -> None:
        self.seed = seed
        self.strength = strength
        self.rng = random.Random(seed)
        # The share of enqueues given a time to live, drawn from a stream of their own (with
        # none, a seed's run is the run it was before messages could expire).
        self.ttl_share = ttl_share
        self.ttls = random.Random(seed ^ 0x7711)      # and their delivery delays
        # The clocks come from a stream of their own: a seed's run without drift is the run it
        # was before clocks drifted (the regression seeds replay what they found).
        clocks = random.Random(seed ^ 0xC10C)
        self.walls = random.Random(seed ^ 0x3A11)     # wall clocks: their own stream, for the same reason
        self.loop = VirtualTimeLoop()
        self.network = MemoryPeerNetwork()
        self.membership_network = MemoryPeerNetwork()
        self.history = History()
        self.members = {node_id: SimNode(self, node_id, 1 + clocks.uniform(-clock_drift, clock_drift),
                                         clocks.randrange(10**9), self.walls.randint(-WALL_SKEW_MS, WALL_SKEW_MS))
                        for node_id in NODES}
        self.clock_drift = clock_drift
        self.log: list[str] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._fault_timers: list[asyncio.TimerHandle] = []
        self._next_payload = 0
        self._cuts: collections.Counter[frozenset[str]] = collections.Counter()    # partitions in force
        self._out_of_group: dict[str, set[str]] = {node: set() for node in NODES}  # why (crashed, isolated, paused)
        self._isolations: collections.Counter[str] = collections.Counter()          # isolation faults in force
        self.final_entry: QueueEntry | None = None     # the map's entry after the liveness phase
        self.final: dict[str, dict[str, Any]] = {}     # pairs.describe(QUEUE) at each final member
        self.broken: list[str] = []                    # engines that stopped on an error

    def now_ms(self) -> int:
        return int(self.loop.time() * 1000)

    def note(self, event: str) -> None:
        self.log.append(f"{self.now_ms()}: {event}")

    # --- running ---------------------------------------------------------------------------
    def run(self, safety_s: float = SAFETY_S, liveness_s: float = LIVENESS_S) -> EngineSimulation:
        try:
            self.loop.run_until_complete(self._main(safety_s, liveness_s))
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        return self

    async def _main(self, safety_s: float, liveness_s: float) -> None:
        try:
            for node in self.members.values():
                await node.boot()
            await self._create_queue()
            await self._until_every_node_votes()
            self._spawn(self._sample_masters())
            await self.safety_phase(safety_s)
            await self.liveness_phase(liveness_s)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for node in self.members.values():
                await node.shutdown()

    def engine_failed(self, node_id: str, reason: str, error: BaseException | None) -> None:
        """An engine fails (a broken invariant, its task dying, a commit's completion raising)
        where a real node would stop its process: that fails the run."""
        self.broken.append(f"{self.now_ms()} ms, {node_id}: {reason}: {error!r}")

    def _spawn(self, coroutine: Any) -> None:
        self._tasks.append(self.loop.create_task(coroutine))

    def _later(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> None:
        """A fault's next step; the liveness phase cancels those not yet run."""
        self._fault_timers.append(self.loop.call_later(delay_s, callback, *args))

    async def _create_queue(self) -> None:
        """At n1 once every node has entered the map (the queue needs two live nodes)."""
        options = {"strength": self.strength, "dead_letter": False, "visibility_timeout_s": 60.0}
        placement = {"master": FIRST_MASTER, "replica": FIRST_REPLICA}
        master = self.members[FIRST_MASTER]
        assert master.engine is not None
        for _ in range(200):
            try:
                answer = await master.engine.call(lambda replier: c.CreateQueue(QUEUE, options, placement, replier))
            except QueueError:
                await asyncio.sleep(0.02)
                continue
            assert answer["created"], answer
            return
        raise AssertionError("the queue was never created")

    async def _until_every_node_votes(self) -> None:
        """Faults begin once every node is a voter of the configuration in force. A node joins
        as a learner and is promoted later; faults that began while two voters made the whole
        configuration (seed 418385154: n3 not yet joined, then n2 down or isolated to the end)
        left no quorum for the whole safety phase, which is Raft working as it should, not a
        schedule that says anything about the queue."""
        for _ in range(JOIN_WAIT_STEPS):
            statuses = [node.membership.status() for node in self.members.values() if node.membership is not None]
            if len(statuses) == len(NODES) and all(sorted(s.get("voters", [])) == sorted(NODES) for s in statuses):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the membership layer never made every node a voter")

    async def _sample_masters(self) -> None:
        """Who acts as master of which epoch, as every live node sees itself, and whether two
        could acknowledge writes at once."""
        seen = self.history.masters_seen
        while True:
            for node_id, node in self.members.items():
                if node.engine is not None:
                    seen.update((role.epoch, node_id) for role in node.engine.pairs.masters.values())
            self.check_one_acknowledging()
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def check_one_acknowledging(self) -> None:
        """At most one node may acknowledge writes as master of the queue at any moment, each
        judging its lease by its own drifting clock. Run at every sample and at the moment of
        every acknowledged write."""
        able = tuple(node_id for node_id, node in self.members.items() if node.may_acknowledge_as_master())
        if len(able) > 1:
            self.history.two_acknowledging.append((self.now_ms(), able))

    async def safety_phase(self, duration_s: float) -> None:
        """Client load with faults and handoffs, each at a seeded moment."""
        loop, rng = self.loop, self.rng
        for _ in range(300):
            loop.call_later(rng.uniform(0, duration_s), self._enqueue)
        for _ in range(200):
            loop.call_later(rng.uniform(0, duration_s), self._receive)
        for _ in range(FAULTS):
            self._later(rng.uniform(0, duration_s), self._random_fault)
        for _ in range(rng.randint(0, HANDOFFS)):
            self._later(rng.uniform(0, duration_s), self._handoff, rng.choice(["master", "replica", "both"]))
        walls = self.walls
        for _ in range(WALL_STEPS):
            self._later(walls.uniform(0, duration_s), self._step_wall, walls.choice(NODES),
                        walls.choice([-WALL_SKEW_MS, WALL_SKEW_MS]))
        await asyncio.sleep(duration_s)

    async def liveness_phase(self, duration_s: float) -> None:
        """No more faults or load: heal, restart what is down, and let the cluster converge."""
        self.note("liveness")
        for timer in self._fault_timers:
            timer.cancel()
        self._fault_timers.clear()
        self._cuts.clear()
        self.network.heal_all()
        for node in self.members.values():
            node.resume()
        self._isolations.clear()
        for node_id in NODES:
            self.rejoin_group(node_id, "isolated")
        for node in self.members.values():
            await node.boot()
        await asyncio.sleep(duration_s)
        entry = self.latest_entry()
        assert entry is not None, "the queue is not in the final map"
        self.final_entry = entry
        for node_id in (entry.master, entry.replica):
            engine = self.members[node_id].engine
            assert engine is not None
            self.final[node_id] = engine.pairs.describe(QUEUE)

    # --- faults ----------------------------------------------------------------------------
    def latest_entry(self) -> QueueEntry | None:
        """The queue in the most recent copy of the map (what an operator would read)."""
        maps = [node.membership.cluster_map for node in self.members.values() if node.membership is not None]
        if not maps:
            return None
        return max(maps, key=lambda cluster: cluster.version).queues.get(QUEUE)

    def _random_fault(self) -> None:
        rng = self.rng
        entry = self.latest_entry()
        if entry is None:
            return                    # every node is down: nothing to aim at
        choice = rng.choice(["crash_master", "crash_replica", "crash_any", "partition_pair", "partition_any",
                             "isolate", "isolate_master", "elect", "pause_master", "pause_any"])
        duration = rng.uniform(*FAULT_S)
        if choice.startswith("pause"):
            node_id = entry.master if choice == "pause_master" else rng.choice(NODES)
            if self.members[node_id].pause():
                self.note(f"{choice} {node_id} for {duration:.3f}s")
                self._later(duration, self._resume, node_id)
        elif choice.startswith("crash"):
            node_id = {"crash_master": entry.master, "crash_replica": entry.replica}.get(choice) or rng.choice(NODES)
            self.note(f"{choice} {node_id} for {duration:.3f}s")
            self._spawn(self.members[node_id].crash())
            self._later(duration, self._spawn_boot, node_id)
        elif choice.startswith("partition"):
            a, b = (entry.master, entry.replica) if choice == "partition_pair" else rng.sample(NODES, 2)
            self.note(f"{choice} {a}-{b} for {duration:.3f}s")
            self._cut(a, b)
            self._later(duration, self._uncut, a, b)
        elif choice.startswith("isolate"):
            node_id = entry.master if choice == "isolate_master" else rng.choice(NODES)
            self.note(f"{choice} {node_id} for {duration:.3f}s")
            self._isolations[node_id] += 1
            self.leave_group(node_id, "isolated")
            for other in NODES:
                if other != node_id:
                    self._cut(node_id, other)
            self._later(duration, self._end_isolation, node_id)
        else:
            membership = self.members[candidate := rng.choice(NODES)].membership
            if membership is not None:
                self.note(f"campaign {candidate}")
                membership.campaign()

    def _step_wall(self, node_id: str, step_ms: int) -> None:
        self.note(f"step {node_id}'s wall clock by {step_ms} ms")
        self.members[node_id].wall_offset_ms += step_ms

    def _resume(self, node_id: str) -> None:
        self.note(f"resume {node_id}")
        self.members[node_id].resume()

    def _spawn_boot(self, node_id: str) -> None:
        self.note(f"restart {node_id}")
        self._spawn(self.members[node_id].boot())

    def _end_isolation(self, node_id: str) -> None:
        self.note(f"heal {node_id}")
        for other in NODES:
            if other != node_id:
                self._uncut(node_id, other)
        self._isolations[node_id] -= 1
        if self._isolations[node_id] == 0:
            self.rejoin_group(node_id, "isolated")

    def _cut(self, a: str, b: str) -> None:
        pair = frozenset((a, b))
        self._cuts[pair] += 1
        if self._cuts[pair] == 1:
            self.network.partition(a, b)

    def _uncut(self, a: str, b: str) -> None:
        pair = frozenset((a, b))
        if self._cuts[pair] > 0:
            self._cuts[pair] -= 1
            if self._cuts[pair] == 0:
                self.network.heal(a, b)

    def leave_group(self, node_id: str, why: str) -> None:
        """A crashed, paused or cut-off node's membership links are cut (a crashed one's are
        closed as well); the others go on without it, a majority electing a leader."""
        reasons = self._out_of_group[node_id]
        if not reasons:
            for other in NODES:
                if other != node_id:
                    self.membership_network.partition(node_id, other)
        reasons.add(why)

    def rejoin_group(self, node_id: str, why: str) -> None:
        reasons = self._out_of_group[node_id]
        if why not in reasons:
            return
        reasons.discard(why)
        if not reasons:
            for other in NODES:
                if other != node_id and not self._out_of_group[other]:
                    self.membership_network.heal(node_id, other)

    # --- handoffs --------------------------------------------------------------------------
    def _handoff(self, who: str) -> None:
        """Ask for a handoff at the master, at the replica, or at both at the same moment
        (then the master's request must win: History.simultaneous_handoffs)."""
        entry = self.latest_entry()
        if entry is None:
            return                    # every node is down: no one to ask
        self.note(f"handoff asked by {who} ({entry.master} -> {entry.replica}, epoch {entry.epoch})")
        outcomes: dict[str, str] = {}
        if who == "both" and not any(self.members[node].paused for node in (entry.master, entry.replica)):
            self.history.simultaneous_handoffs.append(outcomes)
        for initiator, node_id in (("master", entry.master), ("replica", entry.replica)):
            if who not in (initiator, "both"):
                continue
            engine = self.members[node_id].engine
            if engine is None:
                self._record_handoff(outcomes, initiator, "node down")
                continue

            def ask(now_ms: int, engine: Engine = engine, initiator: str = initiator) -> None:
                assert engine.coordinator is not None
                engine.coordinator.handoff(QUEUE, initiator, functools.partial(self._handoff_done, outcomes, initiator))
            engine.invoke(ask)

    def _handoff_done(self, outcomes: dict[str, str], initiator: str, result: Any) -> None:
        outcome = "ok"
        if isinstance(result, QueueError):
            # Refused for a replica out of sync is no contest with the replica's request, which
            # waits at the master and may succeed once the replica is in sync.
            outcome = result.code + (" (not in sync)" if "not in sync" in result.message else "")
        self._record_handoff(outcomes, initiator, outcome)

    def _record_handoff(self, outcomes: dict[str, str], initiator: str, outcome: str) -> None:
        outcomes[initiator] = outcome
        key = f"{initiator} {outcome}"
        self.history.handoffs[key] = self.history.handoffs.get(key, 0) + 1

    # --- the client workload ---------------------------------------------------------------
    def _payloads(self, count: int) -> tuple[bytes, ...]:
        first, self._next_payload = self._next_payload, self._next_payload + count
        return tuple(f"m{i}".encode() for i in range(first, first + count))

    def _target(self, master_share: float) -> SimNode | None:
        """A client reaches the cluster through a random node and follows that node's map to
        the queue's master (or, with the other share, its replica)."""
        contact = self.members[self.rng.choice(NODES)]
        entry = contact.entry() if contact.up else None
        if entry is None:
            self.history.failed("no map")
            return None
        return self.members[entry.master if self.rng.random() < master_share else entry.replica]

    def _enqueue(self) -> None:
        node, history = self._target(0.7), self.history
        if node is None:
            return
        ttl_ms = self.ttls.choice([150, 1_500]) if self.ttls.random() < self.ttl_share else 0
        delay_ms = self.ttls.choice([100, 800]) if self.ttls.random() < self.ttl_share else 0
        if self.rng.random() < 0.5:
            [payload] = self._payloads(1)

            def answered(result: Any) -> None:
                history.acknowledged(result[0], payload)
                self._check_at_acknowledgement()
            if ttl_ms:
                history.with_ttl.add(payload)
            node.call(lambda r: c.Enqueue(QUEUE, payload, 4, None, "producer", r, ttl_ms=ttl_ms, delay_ms=delay_ms),
                      answered)
            if delay_ms:
                history.delayed[payload] = (self.now_ms(), delay_ms)
            return
        payloads = self._payloads(self.rng.randint(1, 4))

        def placed(result: Any) -> None:
            for index, payload in zip(result[1], payloads, strict=True):
                if isinstance(index, int):
                    history.acknowledged(index, payload)
            self._check_at_acknowledgement()
        if ttl_ms:
            history.with_ttl.update(payloads)
        node.call(lambda r: c.EnqueueMany(QUEUE, self.rng.randint(0, 9), payloads, None, "producer", r,
                                          ttl_ms=ttl_ms, delay_ms=delay_ms), placed)
        if delay_ms:
            history.delayed.update((payload, (self.now_ms(), delay_ms)) for payload in payloads)

    def _check_at_acknowledgement(self) -> None:
        self.history.acks_checked += 1
        self.check_one_acknowledging()

    def _receive(self) -> None:
        node, history = self._target(0.8), self.history
        if node is None:
            return
        visibility_ms = self.rng.choice([300, 60_000])
        sent_ms = self.now_ms()

        def got(messages: Any) -> None:
            for message in messages:
                history.delivered.append((message.message_id, message.payload))
                history.answered_at.append((message.payload, self.now_ms()))
                history.leases.append((message.message_id, sent_ms, self.now_ms(), visibility_ms))
            if messages:
                self.loop.call_later(self.rng.uniform(0.001, 0.02), self._ack, node, messages)
        wait_ms = self.rng.choice([0, 0, 100])
        node.call(lambda r: c.Receive(QUEUE, self.rng.randint(1, 3), wait_ms, visibility_ms, "consumer", r), got)

    def _ack(self, node: SimNode, messages: list[Any]) -> None:
        """Acks go where the messages were received (under `producer` leases are local)."""
        history = self.history
        if not node.up:
            return
        items = tuple((m.message_id, m.receipt) for m in messages)
        history.ack_invoked.update(m.message_id for m in messages)

        def acked(outcomes: Any) -> None:
            history.consumed.update(m for (m, _), outcome in zip(items, outcomes, strict=True) if outcome is None)
        node.call(lambda r: c.AckMany(QUEUE, items, "consumer", r), acked)

    # --- what the checkers read ------------------------------------------------------------
    @property
    def final_master(self) -> str:
        assert self.final_entry is not None
        return self.final_entry.master

    @property
    def final_replica(self) -> str:
        assert self.final_entry is not None
        return self.final_entry.replica

    def queue_id(self, node_id: str) -> int:
        queue_id = self.members[node_id].storage.queue_id(QUEUE)
        assert queue_id is not None, f"{node_id} holds no queue {QUEUE}"
        return queue_id

    def held(self, node_id: str) -> set[int]:
        return self.members[node_id].storage.held(self.queue_id(node_id))

    def oplog_rows(self, node_id: str) -> list[tuple[int, int, bytes]]:
        return self.members[node_id].storage.oplog_rows(self.queue_id(node_id))

    def surviving_payloads(self, node_id: str) -> dict[int, bytes]:
        """Message id -> payload of every enqueue in the node's committed history, once the run
        has converged. A node that took a snapshot holds the queue's state, not its history:
        below the snapshot's order, ids it never held were consumed before it (and are taken
        from the other nodes' histories, which agree on everything committed)."""
        storage = self.members[node_id].storage
        queue_id = self.queue_id(node_id)
        payloads = storage.surviving_payloads(queue_id)
        installed_at = storage.installed_at.get(queue_id)
        if installed_at:
            below = min(installed_at)
            for other in self.members.values():
                other_id = other.storage.queue_id(QUEUE)
                if other is self.members[node_id] or other_id is None:
                    continue
                for index, payload in other.storage.surviving_payloads(other_id).items():
                    if index <= below:
                        payloads.setdefault(index, payload)
        return payloads

    def installed_snapshots(self, node_id: str) -> int:
        storage = self.members[node_id].storage
        return len(storage.installed_at.get(self.queue_id(node_id), []))

    def pair_changes(self) -> collections.Counter[str]:
        """Applied changes of the queue's pair, by reason (failover, handoff, move, in_sync)."""
        cluster = ClusterMap()
        counts: collections.Counter[str] = collections.Counter()
        # Every boot replays the map from the start of its Raft log (no run compacts it), so
        # the longest record any node holds is the whole history.
        for data in max((node.map_commands for node in self.members.values()), key=len):
            command = decode_command(data)
            outcomes = cluster.apply(command)
            if isinstance(command, (ChangePair, ChangePairs)):
                counts.update(outcome.reason for outcome in outcomes if outcome.applied and outcome.name == QUEUE)
        return counts
