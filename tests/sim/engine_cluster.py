"""Deterministic simulation of a queue pair built from real engines (STYLE.md, after
TigerBeetle's VOPR): the node driver of qserver/engine.py with its group commit, pair driver
and held answers, on a virtual-time event loop, an in-memory peer network and in-memory
storage whose commits are durable when they run, after a seeded fsync delay.

One `random.Random(seed)` decides everything: the client workload (enqueues at both
members, receives and acks at the master), fsync latencies, partitions of the pair's link
and crashes of either node. A crash drops the engine with whatever it had not committed,
and every answer it still owed; a restart builds a new engine on the same storage. A run is
a safety phase with faults, then a liveness phase that heals, restarts and lets time run.
`EngineSimulation(seed, strength).run()` replays a run exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from client.errors import QueueError
from qserver import commands as c
from qserver.config import NodeConfig
from qserver.engine import Engine
from qserver.peers import MemoryPeerNetwork
from replication.options import Strength
from tests.sim.memory_storage import MemoryStorage
from tests.sim.virtual_loop import DelayedExecutor, VirtualTimeLoop

QUEUE = "q"
MASTER, REPLICA = "n1", "n2"
SAFETY_S = 3.0
LIVENESS_S = 15.0
FAULTS = 6


@dataclass
class History:
    """What clients saw (Jepsen-style); the checkers judge it against the final state."""
    acked_enqueues: set[int] = field(default_factory=set)
    delivered: list[int] = field(default_factory=list)
    consumed: set[int] = field(default_factory=set)
    ack_invoked: set[int] = field(default_factory=set)     # acks sent, answered or not
    invoked: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    unanswered: int = 0                                    # answers dropped by a crash

    def failed(self, error: BaseException) -> None:
        code = error.code if isinstance(error, QueueError) else type(error).__name__
        self.failures[code] = self.failures.get(code, 0) + 1


class SimNode:
    """One node: its storage survives crashes; its engine and disk queue do not."""

    def __init__(self, sim: EngineSimulation, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id
        self.storage = MemoryStorage(node_id)
        self.config = NodeConfig(node_id=node_id, data_dir=f"/nonexistent/{node_id}", cluster_nodes=sim.nodes,
                                 placement={QUEUE: [MASTER, REPLICA]}).check()
        self.transport = sim.network.transport(node_id, self._on_message, self._on_link_change)
        self.engine: Engine | None = None
        self.disk: DelayedExecutor | None = None
        self.outstanding: set[asyncio.Future[Any]] = set()
        self.boots = 0
        self._inbound_at = 0.0

    @property
    def up(self) -> bool:
        return self.engine is not None

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

    async def boot(self) -> None:
        if self.engine is not None:
            return
        self.boots += 1
        rng = self.sim.rng
        self.disk = DelayedExecutor(self.sim.loop, lambda: rng.randint(0, 3))
        engine = Engine(self.config, self.storage, rng=random.Random(rng.getrandbits(64)),  # type: ignore[arg-type]
                        clock_ms=self.sim.now_ms, writer=self.disk)
        engine.pairs.send = self.transport.send
        engine.pairs.link_up = self.transport.is_up
        await engine.start()
        self.engine = engine
        await self.transport.start()

    async def crash(self) -> None:
        """kill -9: uncommitted batches and owed answers are gone; the peer sees the link drop."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        self.boots += 1         # what was on its way to the dead engine is dropped
        engine.pairs.send = lambda peer, data: False
        assert self.disk is not None
        self.disk.crash()
        if engine._timer is not None:
            engine._timer.cancel()
        task = engine._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for future in self.outstanding:
            future.cancel()
        self.sim.history.unanswered += len(self.outstanding)
        self.outstanding.clear()
        await self.transport.stop()

    async def shutdown(self) -> None:
        """End of the run: stop the engine's task without answering anything further."""
        await self.crash()

    def call(self, command: Callable[[c.FutureReplier], c.Command],
             on_ok: Callable[[Any], None]) -> None:
        """Submit a client command; record its outcome when (if ever) it is answered."""
        if self.engine is None:
            return
        history = self.sim.history
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
    def __init__(self, seed: int, strength: Strength = Strength.FULL) -> None:
        self.seed = seed
        self.strength = strength
        self.rng = random.Random(seed)
        self.loop = VirtualTimeLoop()
        self.nodes = {MASTER: f"http://{MASTER}.sim", REPLICA: f"http://{REPLICA}.sim"}
        self.network = MemoryPeerNetwork()
        self.history = History()
        self.members = {node_id: SimNode(self, node_id) for node_id in self.nodes}
        self.log: list[str] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._next_payload = 0
        self.final: dict[str, dict[str, Any]] = {}     # pairs.describe(QUEUE) at the end

    def now_ms(self) -> int:
        return int(self.loop.time() * 1000)

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
            await self.safety_phase(safety_s)
            await self.liveness_phase(liveness_s)
        finally:
            for node in self.members.values():
                await node.shutdown()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coroutine: Any) -> None:
        self._tasks.append(self.loop.create_task(coroutine))

    async def _create_queue(self) -> None:
        options = {"strength": self.strength, "dead_letter": False, "visibility_timeout_s": 60.0}
        master = self.members[MASTER]
        assert master.engine is not None
        answer = await master.engine.call(lambda replier: c.CreateQueue(QUEUE, options, {}, replier))
        assert answer["created"], answer

    async def safety_phase(self, duration_s: float) -> None:
        """Client load with faults: partitions of the pair's link, crashes of either node."""
        loop, rng = self.loop, self.rng
        for _ in range(300):
            loop.call_later(rng.uniform(0, duration_s), self._enqueue, MASTER if rng.random() < 0.7 else REPLICA)
        for _ in range(200):
            loop.call_later(rng.uniform(0, duration_s), self._receive)
        for _ in range(FAULTS):
            loop.call_later(rng.uniform(0, duration_s), self._random_fault)
        await asyncio.sleep(duration_s)

    async def liveness_phase(self, duration_s: float) -> None:
        """No more faults or load: heal, restart what is down, and let the pair converge."""
        self.log.append(f"{self.now_ms()}: liveness")
        self.network.heal_all()
        for node in self.members.values():
            await node.boot()
        await asyncio.sleep(duration_s)
        for node_id, node in self.members.items():
            assert node.engine is not None
            self.final[node_id] = node.engine.pairs.describe(QUEUE)

    def _random_fault(self) -> None:
        choice = self.rng.choice(["partition", "crash_master", "crash_replica"])
        self.log.append(f"{self.now_ms()}: {choice}")
        if choice == "partition":
            self.network.partition(MASTER, REPLICA)
            self.loop.call_later(self.rng.uniform(0.05, 0.6), self.network.heal, MASTER, REPLICA)
            return
        node = self.members[MASTER if choice == "crash_master" else REPLICA]
        self._spawn(node.crash())
        self.loop.call_later(self.rng.uniform(0.02, 0.4), self._spawn, node.boot())

    # --- the client workload ---------------------------------------------------------------
    def _payloads(self, count: int) -> tuple[bytes, ...]:
        first, self._next_payload = self._next_payload, self._next_payload + count
        return tuple(f"m{i}".encode() for i in range(first, first + count))

    def _enqueue(self, node_id: str) -> None:
        node, history = self.members[node_id], self.history
        if self.rng.random() < 0.5:
            [payload] = self._payloads(1)
            node.call(lambda r: c.Enqueue(QUEUE, payload, 4, None, "producer", r),
                      lambda result: history.acked_enqueues.add(result[0]))
            return
        payloads = self._payloads(self.rng.randint(1, 4))

        def placed(result: Any) -> None:
            history.acked_enqueues.update(index for index in result[1] if isinstance(index, int))
        node.call(lambda r: c.EnqueueMany(QUEUE, self.rng.randint(0, 9), payloads, None, "producer", r), placed)

    def _receive(self) -> None:
        node, history = self.members[MASTER], self.history
        visibility_ms = self.rng.choice([300, 60_000])

        def got(messages: Any) -> None:
            for message in messages:
                history.delivered.append(message.message_id)
            if messages:
                self.loop.call_later(self.rng.uniform(0.001, 0.02), self._ack, messages)
        node.call(lambda r: c.Receive(QUEUE, self.rng.randint(1, 3), 0, visibility_ms, "consumer", r), got)

    def _ack(self, messages: list[Any]) -> None:
        node, history = self.members[MASTER], self.history
        if not node.up:
            return
        items = tuple((m.message_id, m.receipt) for m in messages)
        history.ack_invoked.update(m.message_id for m in messages)

        def acked(outcomes: Any) -> None:
            history.consumed.update(m for (m, _), outcome in zip(items, outcomes, strict=True) if outcome is None)
        node.call(lambda r: c.AckMany(QUEUE, items, "consumer", r), acked)

    # --- what the checkers read ------------------------------------------------------------
    def queue_id(self, node_id: str) -> int:
        queue_id = self.members[node_id].storage.queue_id(QUEUE)
        assert queue_id is not None, f"{node_id} holds no queue {QUEUE}"
        return queue_id

    def held(self, node_id: str) -> set[int]:
        return self.members[node_id].storage.held(self.queue_id(node_id))

    def oplog_rows(self, node_id: str) -> list[tuple[int, bytes]]:
        return self.members[node_id].storage.oplog_rows(self.queue_id(node_id))

    def surviving_enqueues(self) -> set[int]:
        return self.members[MASTER].storage.surviving_enqueues(self.queue_id(MASTER))
