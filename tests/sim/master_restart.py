"""The engine simulation's cluster (tests/sim/engine_cluster.py) with one kind of fault: the
node mastering the queue is killed (-9) and started again after less than its lease, as a
supervisor such as systemd's Restart=always does (issue 40, item 2). docs/PROTOCOL.md, "A
master restarted inside its lease", says what such a master must have before it acknowledges
anything at the same epoch; these runs show it.

Clients enqueue, receive and acknowledge throughout, at a steady rate. Each restart kills the
master at one of three moments, each twice a run in a seeded order:

- `any moment`: wherever the workload happens to be;
- `after persist`: the instant its disk has written a batch of the queue's operations, before
  the engine learns of it, so before the replica's acknowledgement of that batch counts (the
  batch went to the replica when it was sealed);
- `before persist`: the instant such a batch reaches the disk, after it went to the replica:
  the master loses it, and the replica may hold it.

The node comes back after a seeded delay shorter than the lease (LEASE_MS). After each restart
the run waits until an enqueue is acknowledged again and records when (`Restart.recovered_ms`),
then a quiet spell, then the next restart. Half the runs hand the queue from n1, which
usually leads the membership layer, to n2 first, so that both a leader's and a follower's
restarts are seen.

`StaleMapRestartSimulation` aims at the one window the rule must also cover: the master is
killed just after the membership leader applied its record of the replica as in sync again
and before the master's own copy of the map did, with a batch written that the replica never
received; it comes back inside its lease but cut off from every node, so that the leader fails
it over in parallel, and a consumer at the restarted node receives all it offers meanwhile.

`MasterRestartSimulation(seed, strength).run()` (or `StaleMapRestartSimulation`) replays a run
exactly; the checkers and the replay line are tests/test_engine_simulation.py's.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from qserver.core import commands as c
from qserver.storage.lmdb_store import SealedBatch
from replication.cluster_map import ChangePair
from replication.options import Strength
from tests.sim.engine_cluster import (
    CLOCK_DRIFT,
    FIRST_MASTER,
    LEASE_MARGIN_MS,
    LEASE_MS,
    NODES,
    QUEUE,
    EngineSimulation,
    SimNode,
)
from wire.errors import QueueError

MOMENTS = ("any moment", "after persist", "before persist")
RESTARTS = 2 * len(MOMENTS)
RESTART_DELAY_S = (0.005, 0.9 * LEASE_MS / 1000)   # how long the master's node stays down: inside its lease
ARMED_WAIT_S = 0.5             # a crash armed for a moment of the commit happens anyway after this long
RECOVERY_WAIT_S = 5.0          # how long the run waits for an acknowledged enqueue after a restart
# Writes are acknowledged again within this long of a restart: the restarted master holds a
# lease again within about a lease (its map replayed and caught up, one renewal answered), or
# the leader fails it over lease + margin after its last grant; the record of its replica out
# of sync (or the failover) is one Raft commit more. Runs take 300 ms at most.
RECOVERY_MAX_MS = 2 * (LEASE_MS + LEASE_MARGIN_MS)
QUIET_S = (0.1, 0.6)           # load without faults between one recovery and the next kill
ENQUEUE_EVERY_S = (0.002, 0.012)
RECEIVE_EVERY_S = (0.005, 0.025)
HANDOFF_WAIT_S = 5.0
STALE_ATTEMPTS = 6             # kills aimed at the stale-map window per run (each needs an in-sync record)
STALE_HITS = 2                 # enough of them that hit it
IN_SYNC_WAIT_S = 4.0           # for the leader's next in-sync record of the replica
CUT_OFF_S = 3 * (LEASE_MS + LEASE_MARGIN_MS) / 1000    # long enough for the leader to fail it over


@dataclass
class Restart:
    """One kill and restart of the master's node, and what followed it."""
    node: str
    moment: str
    epoch: int                      # the queue's epoch in the map when it was killed
    killed_ms: int = 0
    restarted_ms: int = 0
    recovered_ms: int | None = None     # an enqueue acknowledged again (None: not within RECOVERY_WAIT_S)
    master_after: str = ""          # the queue's master and epoch once writes were acknowledged again
    epoch_after: int = 0

    @property
    def down_ms(self) -> int:
        return self.restarted_ms - self.killed_ms

    @property
    def recovery_ms(self) -> int | None:
        return None if self.recovered_ms is None else self.recovered_ms - self.restarted_ms

    @property
    def resumed_at_same_epoch(self) -> bool:
        return self.master_after == self.node and self.epoch_after == self.epoch

    def describe(self) -> str:
        recovered = "never" if self.recovery_ms is None else f"after {self.recovery_ms} ms"
        return (f"{self.node} killed {self.moment} at {self.killed_ms} ms (epoch {self.epoch}), down {self.down_ms} "
                f"ms, writes acknowledged again {recovered} with {self.master_after} master at epoch "
                f"{self.epoch_after}")


class MasterRestartSimulation(EngineSimulation):
    def __init__(self, seed: int, strength: Strength = Strength.FULL, clock_drift: float = CLOCK_DRIFT,
                 restarts: int = RESTARTS) -> None:
        super().__init__(seed, strength, clock_drift)
        self.plan = random.Random(seed ^ 0x4E57)     # the restarts' moments and delays: a stream of their own
        self.restart_count = restarts
        self.restarts: list[Restart] = []
        self._armed: dict[str, str] = {}             # node -> the moment its next kill waits for
        self._crashed = asyncio.Event()
        self._loading = False
        self._burying: asyncio.Task[None] | None = None

    # --- killing at a moment of the commit -------------------------------------------------
    def _holds_queue_operations(self, node: SimNode, job: tuple[Any, ...]) -> bool:
        """Whether a job handed to the disk commits a batch with the queue's op-log rows (the
        engine's writer passes its call on as (storage.commit, (batch,), {}))."""
        queue_id = node.storage.queue_id(QUEUE)
        parts = [*job, *(item for part in job if isinstance(part, tuple) for item in part)]
        return queue_id is not None and any(row[0] == queue_id for part in parts if isinstance(part, SealedBatch)
                                            for row in part.oplog_rows)

    def _hook_disk(self, node: SimNode) -> None:
        """Kill the node at the armed moment of the next batch that carries the queue's op-log
        rows: `before persist` as it reaches the disk, which never writes it; `after persist`
        the instant the disk has written it, before the engine hears so (the future it waits
        on never completes: the process is gone)."""
        disk = node.disk
        assert disk is not None
        submit = disk.submit

        def submit_or_kill(fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            moment = self._armed.get(node.node_id)
            if moment is None or not self._holds_queue_operations(node, args):
                return submit(fn, *args, **kwargs)
            self._armed.pop(node.node_id)
            never: Future[Any] = Future()
            if moment == "before persist":
                self._kill(node, moment)
                return never
            written = submit(fn, *args, **kwargs)
            written.add_done_callback(lambda _: self._kill(node, moment) if node.disk is disk else None)
            return never
        disk.submit = submit_or_kill    # type: ignore[method-assign]

    def _kill(self, node: SimNode, moment: str) -> None:
        self._armed.pop(node.node_id, None)
        engine = node.kill()
        if engine is None:
            return
        self.note(f"kill {node.node_id} ({moment})")
        self._burying = self.loop.create_task(node.bury(engine))
        self._crashed.set()

    # --- the run ---------------------------------------------------------------------------
    async def safety_phase(self, duration_s: float) -> None:
        """Steady load and a series of restarts of whichever node masters the queue (they take
        the time they take: `duration_s` is not used)."""
        self._loading = True
        self._spawn(self._load(self._enqueue, ENQUEUE_EVERY_S))
        self._spawn(self._load(self._receive, RECEIVE_EVERY_S))
        if self.plan.random() < 0.5:
            await self._hand_off_first()
        moments = [MOMENTS[number % len(MOMENTS)] for number in range(self.restart_count)]
        self.plan.shuffle(moments)
        for moment in moments:
            await asyncio.sleep(self.plan.uniform(*QUIET_S))
            await self._restart_master(moment)
        await asyncio.sleep(self.plan.uniform(*QUIET_S))
        self._loading = False

    async def _load(self, step: Callable[[], None], every_s: tuple[float, float]) -> None:
        while self._loading:
            step()
            await asyncio.sleep(self.rng.uniform(*every_s))

    async def _hand_off_first(self) -> None:
        """Move the queue from n1, which founded the membership layer and usually leads it, to
        n2: its restarts are then a follower's, whose lease the leader keeps counting (a
        leader's restart elects another, which must wait out the lease before it may fail
        anything over)."""
        deadline = self.loop.time() + HANDOFF_WAIT_S
        while self.loop.time() < deadline:
            engine = self.members[FIRST_MASTER].engine
            assert engine is not None and engine.coordinator is not None
            outcome: list[Any] = []

            def ask(now_ms: int, coordinator: Any = engine.coordinator, answer: Any = outcome.append) -> None:
                coordinator.handoff(QUEUE, "master", answer)
            engine.invoke(ask)
            while not outcome and self.loop.time() < deadline:
                await asyncio.sleep(0.005)
            entry = self.latest_entry()
            if outcome and not isinstance(outcome[0], QueueError) and entry is not None \
                    and entry.master != FIRST_MASTER:
                self.note(f"handed off to {entry.master} (epoch {entry.epoch})")
                return
            await asyncio.sleep(0.05)          # refused (the replica not in sync yet): ask again
        raise AssertionError("the queue was never handed off from n1")

    async def _restart_master(self, moment: str) -> Restart:
        entry = self.latest_entry()
        assert entry is not None, "the queue is in no map"
        node = self.members[entry.master]
        assert node.up, f"the master {entry.master} is down between restarts"
        restart = Restart(entry.master, moment, entry.epoch)
        self.restarts.append(restart)
        self._crashed.clear()
        if moment == "any moment":
            self._kill(node, moment)
        else:
            self._hook_disk(node)
            self._armed[node.node_id] = moment
            try:
                await asyncio.wait_for(self._crashed.wait(), ARMED_WAIT_S)
            except TimeoutError:
                restart.moment += " (no batch came: killed at any moment)"
                self._kill(node, restart.moment)
        restart.killed_ms = self.now_ms()
        await self._come_back(node, restart, self.plan.uniform(*RESTART_DELAY_S))
        await self._until_acknowledged_again(restart)
        return restart

    async def _come_back(self, node: SimNode, restart: Restart, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self._burying is not None:
            await self._burying          # the dead engine's task has ended and its links are down
        restart.restarted_ms = self.now_ms()
        self.note(f"restart {node.node_id}")
        await node.boot()

    async def _until_acknowledged_again(self, restart: Restart) -> None:
        """Until an enqueue is acknowledged with an id not acknowledged before."""
        acknowledged = len(self.history.acked_enqueues)
        deadline = self.loop.time() + RECOVERY_WAIT_S
        while self.loop.time() < deadline:
            if len(self.history.acked_enqueues) > acknowledged:
                restart.recovered_ms = self.now_ms()
                entry = self.latest_entry()
                if entry is not None:
                    restart.master_after, restart.epoch_after = entry.master, entry.epoch
                self.note(f"writes acknowledged again, {restart.recovery_ms} ms after the restart")
                return
            await asyncio.sleep(0.001)


class StaleMapRestartSimulation(MasterRestartSimulation):
    """Kills aimed at the window between the leader's record of the replica as in sync and the
    master's own copy of that record (see the module's docstring). `hits` counts the restarts
    that came back in it: the restarted master's map says out of sync, the leader's in sync,
    and the master holds operations its replica lacks."""

    def __init__(self, seed: int, strength: Strength = Strength.FULL, clock_drift: float = CLOCK_DRIFT) -> None:
        super().__init__(seed, strength, clock_drift, restarts=0)
        self.hits = 0
        self._watching = False
        self._pair_cut: tuple[str, str] | None = None
        for node in self.members.values():
            self._watch_map(node)

    def _watch_map(self, node: SimNode) -> None:
        """When a node other than the master applies the record of the replica in sync while the
        master's copy still says out of sync: cut the pair's link (the replica receives nothing
        more) and kill the master after its next write."""
        record = node._record_map_command

        def record_and_watch(command: Any, outcomes: Any) -> None:
            record(command, outcomes)
            if not (self._watching and isinstance(command, ChangePair) and command.name == QUEUE
                    and command.new[3] and not command.expected[3] and outcomes and outcomes[0].applied):
                return
            master = self.members[command.new[1]]
            mine = master.entry()
            if master is node or not master.up or mine is None or mine.in_sync:
                return
            self._watching = False
            self._pair_cut = (master.node_id, command.new[2])
            self._cut(*self._pair_cut)
            self.restarts.append(Restart(master.node_id, "after persist, its map behind the leader's in-sync record",
                                         mine.epoch))
            self._hook_disk(master)
            self._armed[master.node_id] = "after persist"
        node._record_map_command = record_and_watch    # type: ignore[method-assign]

    async def safety_phase(self, duration_s: float) -> None:
        self._loading = True
        self._spawn(self._load(self._enqueue, ENQUEUE_EVERY_S))
        self._spawn(self._load(self._receive, RECEIVE_EVERY_S))
        await self._hand_off_first()        # the master must not lead: it applies records after the leader
        for _ in range(STALE_ATTEMPTS):
            if self.hits >= STALE_HITS:
                break
            await asyncio.sleep(self.plan.uniform(*QUIET_S))
            if await self._kill_in_window():
                await self._restart_cut_off()
        await asyncio.sleep(self.plan.uniform(*QUIET_S))
        self._loading = False

    async def _kill_in_window(self) -> bool:
        """Restart the master inside its lease (it records its replica out of sync at once),
        then watch for the leader's record of the replica in sync again: the master is killed
        in the window, if it is still open, after its next write. False: no kill came."""
        entry = self.latest_entry()
        assert entry is not None
        node = self.members[entry.master]
        armed = len(self.restarts)
        self._kill(node, "to record its replica out of sync")
        await self._come_back(node, Restart(node.node_id, "", entry.epoch), self.plan.uniform(*RESTART_DELAY_S))
        self._watching = True
        deadline = self.loop.time() + IN_SYNC_WAIT_S
        while self.loop.time() < deadline:
            if len(self.restarts) > armed and not self.members[self.restarts[-1].node].up:
                self.restarts[-1].killed_ms = self.now_ms()
                return True
            await asyncio.sleep(0.001)
        self._watching = False
        self._armed.clear()
        if len(self.restarts) > armed:      # armed, but no write came
            self.restarts.pop()
        if self._pair_cut is not None:
            self._uncut(*self._pair_cut)
            self._pair_cut = None
        self.note("no kill in the stale-map window")
        return False

    async def _restart_cut_off(self) -> None:
        """Back inside the lease, but cut off: the leader fails the queue over meanwhile."""
        restart = self.restarts[-1]
        node = self.members[restart.node]
        self._cut_off(node.node_id)
        await self._come_back(node, restart, self.plan.uniform(*RESTART_DELAY_S))
        await self._consume_all_offered(node)
        await asyncio.sleep(CUT_OFF_S)
        self._end_isolation(node.node_id)
        if self._pair_cut is not None:
            self._uncut(*self._pair_cut)
            self._pair_cut = None
        await self._until_acknowledged_again(restart)

    def _cut_off(self, node_id: str) -> None:
        """From every node, peer and membership links alike (its clients still reach it)."""
        self.note(f"cut off {node_id}")
        self._isolations[node_id] += 1
        self.leave_group(node_id, "isolated")
        for other in NODES:
            if other != node_id:
                self._cut(node_id, other)

    async def _consume_all_offered(self, node: SimNode) -> None:
        """Once the restarted node has taken its role from its copy of the map, a consumer there
        receives every message it offers."""
        for _ in range(200):
            engine = node.engine
            role = engine.pairs.masters.get(QUEUE) if engine is not None else None
            mine, latest = node.entry(), self.latest_entry()
            if role is not None and mine is not None and latest is not None:
                replica = self.members[mine.replica].storage
                replica_id = replica.queue_id(QUEUE)
                replica_last = replica.last(replica_id)[0] if replica_id is not None else 0
                stale = not mine.in_sync and latest.in_sync and role.last_order > replica_last
                self.hits += stale
                self.note(f"{node.node_id} master again: its map says {'in' if mine.in_sync else 'out of'} sync, "
                          f"the leader's {'in' if latest.in_sync else 'out of'} sync; it holds up to "
                          f"{role.last_order}, its replica up to {replica_last}, consumers see up to "
                          f"{role.core.visible_upto}")
                break
            await asyncio.sleep(0.001)
        history = self.history

        def got(messages: Any) -> None:
            history.delivered.extend((message.message_id, message.payload) for message in messages)
            self.note(f"a consumer at {node.node_id} received {sorted(message.message_id for message in messages)[-8:]} "
                      f"(the newest of {len(messages)})")
        node.call(lambda replier: c.Receive(QUEUE, 1_000, 0, 60_000, "consumer", replier), got)
