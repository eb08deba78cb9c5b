"""How much of a node's work reaches queues a request never names (issue 31): a fault-free
run of the engine simulation's three real engines (tests/sim/engine_cluster.py) with `idle`
queues besides the busy one, whose every attribute access on every node is counted while
clients enqueue, receive and acknowledge on the busy queue.

A node whose work per request grows with the number of idle queues (a walk over every
queue's deadlines each turn, every pair on every commit or tick) shows here as visits per
request that grow with `idle`; the test in tests/test_scale.py compares 10 with thousands.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

from qserver.core import commands as c
from replication.queue_core import QueueCore
from tests.sim.engine_cluster import FIRST_MASTER, FIRST_REPLICA, NODES, QUEUE, EngineSimulation

CREATE_IN_FLIGHT = 64        # creations submitted at once (each is one map command)
FAILOVER_SETTLE_S = 3.0      # a killed node's lease lapses (0.3 s + margin) and its masters fail over


class _CountedCore(QueueCore):
    """A queue core whose attribute reads are counted (swapped in as its class once created)."""
    visits: collections.Counter[str] = collections.Counter()

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("__"):
            _CountedCore.visits[name] += 1
        return object.__getattribute__(self, name)


class IdleQueuesSimulation(EngineSimulation):
    """`down`: a node (not a member of the busy queue) killed once the idle queues exist; the
    counting starts after its lease lapsed and its masters failed over, so the survivors'
    masters of idle queues all wait for a replica that is gone."""
    self_checks = False
    def __init__(self, idle: int, requests: int = 200, seed: int = 1, down: str | None = None) -> None:
        super().__init__(seed, clock_drift=0.0)
        assert down not in (FIRST_MASTER, FIRST_REPLICA), "the busy queue's members stay up"
        self.down = down
        self.waiting_for_down = 0            # survivors' masters whose replica is the killed node
        for node in self.members.values():   # the dead node's replicas stay where they are
            node.config = dataclasses.replace(node.config, replica_replace_after_s=3600.0)
        self.idle = idle
        self.requests = requests
        self.visits: collections.Counter[str] = collections.Counter()    # attribute -> reads on idle cores
        self.answered = 0

    async def safety_phase(self, duration_s: float) -> None:
        """In place of faults: the idle queues, then the counted traffic on the busy one."""
        await self._create_idle_queues()
        await asyncio.sleep(1.0)             # the creations' batches and opens settle
        if self.down is not None:
            await self.members[self.down].crash()
            await asyncio.sleep(FAILOVER_SETTLE_S)
            self.waiting_for_down = sum(1 for node in self.members.values() if node.engine is not None
                                        for role in node.engine.pairs.masters.values() if role.replica_id == self.down)
        self._count_idle_cores()
        await self._busy_traffic()

    async def liveness_phase(self, duration_s: float) -> None:
        """Nothing was cut or stopped."""

    async def _sample_masters(self) -> None:
        """Not sampled: no fault can make two masters here, and a walk over thousands of
        masters every 5 ms of virtual time would be most of the run."""

    async def _create_idle_queues(self) -> None:
        """Spread over the nodes as masters and replicas, `CREATE_IN_FLIGHT` at a time."""
        options = {"strength": self.strength, "dead_letter": False, "visibility_timeout_s": 60.0}

        async def create(number: int) -> None:
            master, replica = NODES[number % 3], NODES[(number + 1) % 3]
            placement = {"master": master, "replica": replica}
            engine = self.members[master].engine      # a queue is created by its master
            assert engine is not None
            await engine.call(lambda replier: c.CreateQueue(f"idle-{number:05d}", options, placement, replier))
        for start in range(0, self.idle, CREATE_IN_FLIGHT):
            await asyncio.gather(*(create(n) for n in range(start, min(start + CREATE_IN_FLIGHT, self.idle))))

    def _count_idle_cores(self) -> None:
        _CountedCore.visits = self.visits
        for node in self.members.values():
            if node.engine is None:          # the killed one
                continue
            for name, core in node.engine.cores.items():
                if name != QUEUE:
                    core.__class__ = _CountedCore

    async def _busy_traffic(self) -> None:
        """Sequential enqueue, receive and ack at the busy queue's master, as one client would."""
        engine = self.members[FIRST_MASTER].engine
        assert engine is not None and self.members[FIRST_REPLICA].engine is not None
        for number in range(self.requests):
            payload = f"m{number}".encode()
            await engine.call(lambda replier, payload=payload: c.Enqueue(QUEUE, payload, 4, None, "producer",
                                                                         replier))
            leased = await engine.call(lambda replier: c.Receive(QUEUE, 1, 0, None, "consumer", replier))
            for message in leased:
                await engine.call(lambda replier, m=message: c.Ack(QUEUE, m.message_id, m.receipt, "consumer", replier))
            self.answered += 2 + len(leased)

    def visits_per_request(self) -> float:
        return sum(self.visits.values()) / max(1, self.answered)
