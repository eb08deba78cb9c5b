"""Leases are durations on the serving member's monotonic clock (issue 13, item 4).

A real engine on a real LMDB, with its wall clock injected: stepping that clock by a minute
either way (what NTP does to a node) must neither expire a lease early nor stretch it, and a
lease inherited at a restart runs its whole duration from the restart. The takeover after a
failover (leases inherited from another node's clock) is covered by the unit test below and by
the engine simulation's lease-timing check with skewed, stepping wall clocks
(tests/test_engine_simulation.py).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from qserver.assembly import build_engine
from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.engine import Engine
from qserver.storage.lmdb_store import Storage
from replication.operations import Extended, Operation
from replication.options import QueueOptions, Strength
from replication.queue_core import QueueCore, QueueRecord
from replication.store import MemoryStore
from wire.errors import QueueError
from wire.protocol import DeliveredMessage

STEP_MS = 60_000


class SteppedWallClock:
    """The wall clock a node reads, which an operator (or NTP) may step at any moment."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return int(time.time() * 1000) + self.offset_ms

    def step(self, ms: int) -> None:
        self.offset_ms += ms


async def call(engine: Engine, make: Callable[[c.FutureReplier], c.Command]) -> Any:
    return await engine.call(make)       # type: ignore[arg-type]


async def start(tmp_path: Path, wall: SteppedWallClock) -> Engine:
    engine = build_engine(NodeConfig(data_dir=str(tmp_path)), Storage(tmp_path / "lmdb", node_id="n1"),
                          rng=random.Random(1), clock_ms=wall)
    await engine.start()
    return engine


async def stop(engine: Engine) -> None:
    await engine.stop()
    engine.storage.close()


async def lease_one(engine: Engine, visibility_ms: int) -> DeliveredMessage:
    [leased] = await call(engine, lambda r: c.Receive("jobs", 1, 0, visibility_ms, "consumer", r))
    return leased


async def receive_now(engine: Engine) -> list[DeliveredMessage]:
    return await call(engine, lambda r: c.Receive("jobs", 1, 0, None, "consumer", r))


async def redelivered_after(engine: Engine, message_id: int, timeout_s: float) -> None:
    """Wait until `message_id` can be received again (its lease expired)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for leased in await call(engine, lambda r: c.Receive("jobs", 1, 100, 60_000, "consumer", r)):
            if leased.message_id == message_id:
                return
    raise AssertionError(f"message {message_id} was not redelivered within {timeout_s} s")


@pytest.mark.asyncio
@pytest.mark.parametrize("step_ms", [STEP_MS, -STEP_MS], ids=["forward", "back"])
async def test_a_wall_clock_step_neither_expires_a_lease_early_nor_stretches_it(
        tmp_path: Path, step_ms: int) -> None:
    wall = SteppedWallClock()
    engine = await start(tmp_path, wall)
    try:
        await call(engine, lambda r: c.CreateQueue("jobs", {}, {}, r))
        for payload in (b"a", b"b"):
            await call(engine, lambda r, payload=payload: c.Enqueue("jobs", payload, 4, None, "producer", r))
        first = await lease_one(engine, 1_500)
        granted = time.monotonic()
        wall.step(step_ms)
        await asyncio.sleep(0.2)
        # RelayRequest, a wall-clock deadline would have passed a minute ago: the next receive
        # would get message 1 again. It gets message 2.
        assert [m.message_id for m in await receive_now(engine)] == [2]
        # Back, a wall-clock deadline would lie a minute away. The lease ends after its 1.5 s.
        await redelivered_after(engine, first.message_id, timeout_s=6.0)
        held_s = time.monotonic() - granted
        assert 1.4 <= held_s < 6.0, f"a 1.5 s lease held {held_s:.2f} s across a step of {step_ms} ms"
    finally:
        await stop(engine)


@pytest.mark.asyncio
async def test_a_lease_inherited_at_a_restart_runs_its_whole_duration_from_the_restart(tmp_path: Path) -> None:
    wall = SteppedWallClock()
    engine = await start(tmp_path, wall)
    await call(engine, lambda r: c.CreateQueue("jobs", {}, {}, r))
    await call(engine, lambda r: c.Enqueue("jobs", b"a", 4, None, "producer", r))
    leased = await lease_one(engine, 1_500)
    await stop(engine)
    wall.step(STEP_MS)                 # the machine's clock moved while the node was down
    engine = await start(tmp_path, wall)
    restarted = time.monotonic()
    try:
        assert await receive_now(engine) == []           # still leased: not expired by the step
        await redelivered_after(engine, leased.message_id, timeout_s=6.0)
        assert time.monotonic() - restarted >= 1.4, "the inherited lease ran less than its duration"
    finally:
        await stop(engine)


@pytest.mark.asyncio
async def test_an_ack_within_a_lease_is_taken_after_a_backward_step_and_refused_after_its_duration(
        tmp_path: Path) -> None:
    wall = SteppedWallClock()
    engine = await start(tmp_path, wall)
    try:
        await call(engine, lambda r: c.CreateQueue("jobs", {}, {}, r))
        await call(engine, lambda r: c.Enqueue("jobs", b"a", 4, None, "producer", r))
        leased = await lease_one(engine, 300)
        wall.step(-STEP_MS)
        await asyncio.sleep(0.6)
        with pytest.raises(QueueError) as refused:
            await call(engine, lambda r: c.Ack("jobs", leased.message_id, leased.receipt, "consumer", r))
        assert refused.value.code == "E_LEASE_EXPIRED"
    finally:
        await stop(engine)


def full_pair(master_clock: list[int], replica_clock: list[int]) -> tuple[QueueCore, QueueCore]:
    """The two cores of a `full` pair, each timing leases on its own clock (a one-item list)."""
    options = QueueOptions(strength=Strength.FULL, dead_letter=False)
    return (QueueCore(QueueRecord(1, "jobs", options, 0), MemoryStore(), random.Random(1),
                      lease_clock=lambda: master_clock[0]),
            QueueCore(QueueRecord(1, "jobs", options, 0), MemoryStore(), random.Random(2),
                      lease_clock=lambda: replica_clock[0]))


def test_a_new_master_times_inherited_leases_from_its_takeover_on_its_own_clock() -> None:
    """The replica applied the master's lease when its own clock read 5,000 (the master's read
    something else entirely: clocks of two machines are unrelated); it takes the queue over at
    its 9,000: the lease runs its whole 2 s from there, neither from the grant nor the apply."""
    master_clock, replica_clock = [1_000_000], [5_000]
    master, replica = full_pair(master_clock, replica_clock)
    ops: list[Operation] = []
    master.enqueue(b"a", 4, None, "producer", 0, ops)
    [granted] = master.lease(1, 2_000, "consumer", 0, ops)
    assert granted.visibility_ms == 2_000 and master.next_deadline() == 1_002_000
    for op in ops:
        replica.apply(op)
    replica_clock[0] = 9_000
    replica.inherit_leases()
    assert replica.next_deadline() == 11_000
    out: list[Operation] = []
    replica_clock[0] = 10_999
    assert replica.expire_leases(0, out) == 0
    replica_clock[0] = 11_000
    assert replica.expire_leases(0, out) == 1


# --- lease extension (issue 14, item 8) ------------------------------------------------------
def test_an_extension_moves_the_deadline_and_the_old_one_no_longer_expires_it() -> None:
    clock = [0]
    master, replica = full_pair(clock, clock)
    ops: list[Operation] = []
    master.enqueue(b"a", 4, None, "producer", 0, ops)
    [granted] = master.lease(1, 1_000, "consumer", 0, ops)
    clock[0] = 900
    master.extend(granted.index, granted.receipt, 5_000, "consumer", 0, ops)
    extended = ops[-1]
    assert isinstance(extended, Extended) and (extended.visibility_ms, extended.order) == (5_000, 3)
    for op in ops:
        replica.apply(op)
    clock[0] = 1_000                   # the first deadline: its heap entry is stale now
    assert master.expire_leases(0, []) == 0 and replica.expire_leases(0, []) == 0
    clock[0] = 5_900
    assert master.expire_leases(0, []) == 1
    with pytest.raises(QueueError) as refused:
        master.extend(granted.index, granted.receipt, 5_000, "consumer", 0, [])
    assert refused.value.code == "E_LEASE_EXPIRED"


@pytest.mark.asyncio
async def test_an_extended_lease_holds_through_a_handoff_and_keep_alive_outlives_the_visibility_timeout(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"jobs": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("jobs", strength="full", visibility_timeout_s=1.0)
        await client.refresh_placement()
        first_id = await client.enqueue("jobs", b"long job")
        second_id = await client.enqueue("jobs", b"longer job")
        [first] = await client.receive("jobs", wait_s=2.0)
        assert first.id == first_id
        await first.extend(6.0)
        await client.handoff("jobs")               # the new master inherits the extended lease
        await asyncio.sleep(1.5)                   # past the 1 s it was granted
        [second] = await client.receive("jobs", wait_s=2.0)
        assert second.id == second_id              # not the first again: its lease holds
        async with second.keep_alive(visibility_timeout_s=1.0, every_s=0.3) as keeper:
            await asyncio.sleep(2.5)               # a job longer than the visibility timeout
            assert await client.receive("jobs") == []
        assert keeper.lost is None and keeper.extensions >= 5
        await second.ack()
        await first.ack()
        with pytest.raises(QueueError) as refused:
            await first.extend(1.0)                # acked: the lease is gone
        assert refused.value.code == "E_LEASE_EXPIRED"
        stats = await client.queue_stats("jobs")
    assert stats["total_acked"] == 2 and stats["total_redelivered"] == 0
