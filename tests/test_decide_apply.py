"""The master's decisions and a member's application of them leave the same state (issue 33, item 5).

A queue operation's effect is written in the core once where the master can place it through
the function a member applies it with (an enqueue, an ack, a release, an extension, a delay
running out, a durable subscription's steps: replication/queue_core.py). The other decisions
(a lease, a purge, an expiry, a dead-lettering) pick what to do as they change the state, so
their effect is written beside `apply`'s; this test holds the two equal: a master core
decides random commands of a `full` queue, a replica core applies the operations it decided,
each member commits them to its own store, and after every step both cores' observable state
is equal: the record (counters, streams and their floors, subscriptions), the ready messages
in delivery order with their delivery counts, the leases, the timed messages (times to live,
delays), the dedupe answers, and the same of the dead-letter queue.

A failure names its seed and step: `pytest tests/test_decide_apply.py -k "seed_<n>"`.
"""
from __future__ import annotations

import copy
import heapq
import random
from collections.abc import Callable
from typing import Any

import pytest

from replication.operations import Leased, Operation
from replication.options import PRIORITY_MAX, QueueOptions, Strength, producer_key
from replication.queue_core import (
    SEQUENCE_FLOOR_HEADER,
    SEQUENCE_HEADER,
    SEQUENCE_KEY_HEADER,
    SUBSCRIPTION_PRIORITY,
    QueueCore,
    QueueRecord,
)
from replication.queue_subscriptions import subscription_floor
from replication.store import MemoryStore
from replication.view_lease import lease_matching
from wire.errors import QueueError

QUEUE_ID, DEAD_LETTER_QUEUE_ID = 1, 2
START_MS = 1_000_000
STEPS = 300
SEEDS = list(range(1, 26))
CLIENTS = ("producer-a", "producer-b")
DEDUPE_IDS = tuple(f"d{n}" for n in range(6))
STREAM_KEYS = ("fwd@1/p4", "fwd@2/p0")
SUBSCRIPTIONS = ("s1", "s2", "s3")


class Member:
    """One member of the pair: its queue core and the queue's dead-letter core, its own store,
    and the node's commit cycle (seal, persist, advance)."""

    def __init__(self, options: QueueOptions, clock: Callable[[], int], seed: int) -> None:
        self.store = MemoryStore()
        record = QueueRecord(QUEUE_ID, "orders", options, START_MS)
        dead = QueueRecord(DEAD_LETTER_QUEUE_ID, "orders.dlq", QueueOptions(strength=Strength.FULL, max_depth=2**40,
                                                                            dead_letter=False),
                           START_MS, dead_letter_of="orders")
        rng = random.Random(seed)     # only the master draws (receipts); the replica's is never used
        self.core = QueueCore(record, self.store, rng, lease_clock=clock, dedupe_window_ms=2_000)
        self.dead = QueueCore(dead, self.store, rng, lease_clock=clock)
        self.core.dead_letter_core = self.dead

    def commit(self, batch: list[Operation]) -> None:
        for core in (self.core, self.dead):
            core.seal()
        self.store.apply(batch)
        for core in (self.core, self.dead):
            core.advance()


def ready_in_order(core: QueueCore) -> list[tuple[int, int, int]]:
    """(priority, index, deliveries so far) of every ready message, in delivery order, read
    from a copy of the core's ready set (the master pops its heads while a member may take a
    message from the middle of a heap lazily: only what they hold must agree)."""
    ready = copy.copy(core._ready)
    ready.heaps = [list(heap) for heap in ready.heaps]
    ready.deliveries = dict(ready.deliveries)
    ready._removed = set(ready._removed)
    ready._loaded_upto = list(ready._loaded_upto)
    ready._exhausted = list(ready._exhausted)
    ready._pushed_beyond = [set(pushed) for pushed in ready._pushed_beyond]
    out = []
    for priority in range(PRIORITY_MAX, -1, -1):
        while ready.fill_head(priority):
            index = heapq.heappop(ready.heaps[priority])
            out.append((priority, index, ready.deliveries.get(index, 0)))
    return out


def observable(core: QueueCore, now_ms: int, dedupe_keys: set[str]) -> dict[str, Any]:
    record = core.record
    return {
        "record": record.to_json(),
        "changed_streams": sorted(record.changed_streams),
        "ready": ready_in_order(core),
        "leases": {index: (lease.priority, lease.receipt, lease.visibility_ms, lease.deadline, lease.deliveries,
                           lease.leased_ms) for index, lease in sorted(core._leases.items())},
        "ttl": dict(sorted(core._ttl.items())),
        "delayed": dict(sorted(core._delayed.items())),
        "dedupe": {key: core._dedupe.find(key, now_ms) for key in sorted(dedupe_keys)},
        "depth": core.depth,
        "in_flight": core.in_flight,
        "subscription_floor": subscription_floor(record),
        "lowest": [core.lowest_index(priority) for priority in range(PRIORITY_MAX + 1)],
    }


class Pair:
    """A master that decides and a replica that applies, on one virtual clock."""

    def __init__(self, seed: int, options: QueueOptions) -> None:
        self.rng = random.Random(seed)
        self.now_ms = START_MS
        self.master = Member(options, lambda: self.now_ms, seed)
        self.replica = Member(options, lambda: self.now_ms, seed + 10_000)
        self.leased: dict[int, Leased] = {}
        self.numbers = {key: 0 for key in STREAM_KEYS}
        self.dedupe_keys: set[str] = set()

    def step(self, decide: Callable[[QueueCore, list[Operation]], object]) -> None:
        out: list[Operation] = []
        try:
            decide(self.master.core, out)
        except QueueError:
            pass        # refused: what it decided before refusing (an expired lease ended) still counts
        for op in out:
            if type(op) is Leased:
                self.leased[op.index] = op
        self.master.commit(out)
        for op in copy.deepcopy(out):        # what arrives is a copy: the replica localizes queue ids
            self.replica.core.apply(op)
        self.replica.commit(out)

    def check(self) -> None:
        for name in ("core", "dead"):
            decided = observable(getattr(self.master, name), self.now_ms, self.dedupe_keys)
            applied = observable(getattr(self.replica, name), self.now_ms, self.dedupe_keys)
            for key in decided:
                assert decided[key] == applied[key], (
                    f"{name} {key} differs:\n  master  {decided[key]}\n  replica {applied[key]}")

    # --- random commands ------------------------------------------------------------------
    def enqueue(self, *, priority: int | None = None, numbered: bool = True) -> Callable[..., object]:
        rng = self.rng
        client = rng.choice(CLIENTS)
        dedupe_id = rng.choice(DEDUPE_IDS) if rng.random() < 0.3 else None
        if dedupe_id is not None:
            self.dedupe_keys.add(producer_key(client, dedupe_id))
        ttl_ms = rng.choice((0, 0, 150, 600))
        delay_ms = rng.choice((0, 0, 0, 100, 400))
        headers = None
        if numbered and rng.random() < 0.25:
            key = rng.choice(STREAM_KEYS)
            self.numbers[key] += rng.choice((1, 1, 2))
            number = self.numbers[key] - rng.choice((0, 0, 0, 1, 3))      # some repeat a settled number
            headers = {SEQUENCE_KEY_HEADER: key, SEQUENCE_HEADER: str(max(1, number))}
            if rng.random() < 0.3:
                headers[SEQUENCE_FLOOR_HEADER] = str(max(1, number - rng.randrange(4)))
        chosen = rng.randrange(PRIORITY_MAX + 1) if priority is None else priority
        if rng.random() < 0.2 and headers is None:
            count = rng.randrange(1, 5)
            ids = [rng.choice(DEDUPE_IDS) if rng.random() < 0.3 else None for _ in range(count)]
            self.dedupe_keys.update(producer_key(client, d) for d in ids if d is not None)
            return lambda core, out: core.enqueue_many([b"m"] * count, chosen, ids, client, self.now_ms, out,
                                                       ttl_ms, delay_ms)
        return lambda core, out: core.enqueue(b"m", chosen, dedupe_id, client, self.now_ms, out, ttl_ms, delay_ms,
                                              headers)

    def a_lease(self) -> Leased | None:
        live = [op for op in self.leased.values()
                if op.index in self.master.core._leases and self.master.core._leases[op.index].receipt == op.receipt]
        stale = [op for op in self.leased.values() if op not in live]
        if stale and self.rng.random() < 0.1:
            return self.rng.choice(stale)       # an earlier lease's receipt: refused
        return self.rng.choice(live) if live else None

    def queue_command(self) -> tuple[str, Callable[..., object]]:
        """A command of an ordinary queue: enqueues (numbered, deduplicated, timed), leases and
        their ends, purges, and every timed step."""
        rng, now = self.rng, self.now_ms
        roll = rng.random()
        if roll < 0.35:
            return "enqueue", self.enqueue()
        if roll < 0.5:
            count, visibility = rng.randrange(1, 6), rng.choice((None, 80, 300, 1_000))
            if rng.random() < 0.4:       # through a virtual queue (issue 37 item 5): from the middle of the heaps
                residue = rng.randrange(3)
                return "view lease", lambda core, out: lease_matching(
                    core, lambda index: index % 3 == residue, count, visibility, "consumer", now, out)
            return "lease", lambda core, out: core.lease(count, visibility, "consumer", now, out)
        lease = self.a_lease()
        if roll < 0.85 and lease is not None:
            what = rng.choice(("ack", "ack", "release", "extend"))
            if what == "ack":
                return "ack", lambda core, out: core.ack(lease.index, lease.receipt, "consumer", now, out)
            if what == "release":
                return "release", lambda core, out: core.release(lease.index, lease.receipt, now, out)
            visibility = rng.choice((0, 50, 500))
            return "extend", lambda core, out: core.extend(lease.index, lease.receipt, visibility, "consumer", now, out)
        if roll < 0.9:
            upto, limit = rng.randrange(1, self.master.core.record.next_index + 1), rng.randrange(1, 8)
            return "purge", lambda core, out: core.purge(upto, limit, now, out)
        return "timers", lambda core, out: (core.expire_leases(now, out), core.expire_messages(now, out),
                                            core.mature_messages(now, out))

    def channel_command(self) -> tuple[str, Callable[..., object]]:
        """A command of a channel's queue: publishes, durable subscriptions and their acks, purges."""
        rng, now = self.rng, self.now_ms
        roll = rng.random()
        name = rng.choice(SUBSCRIPTIONS)
        if roll < 0.4:
            client = rng.choice(CLIENTS)
            return "publish", lambda core, out: core.enqueue(b"m", SUBSCRIPTION_PRIORITY, None, client, now, out)
        if roll < 0.5:
            return "subscribe", lambda core, out: core.open_subscription(name, "consumer", now, out)
        if roll < 0.55:
            return "unsubscribe", lambda core, out: core.drop_subscription(name, "consumer", now, out)
        if roll < 0.9:
            index = rng.randrange(1, self.master.core.record.next_index + 1)
            return "subscriber ack", lambda core, out: core.subscriber_ack(name, index, "consumer", now, out)
        upto, limit = rng.randrange(1, self.master.core.record.next_index + 1), rng.randrange(1, 8)
        return "purge", lambda core, out: core.purge(upto, limit, now, out)


def run(seed: int, options: QueueOptions, command: Callable[[Pair], tuple[str, Callable[..., object]]]) -> None:
    pair = Pair(seed, options)
    where = "before the first step"
    try:
        for step in range(STEPS):
            pair.now_ms += pair.rng.choice((0, 0, 10, 50, 200))
            name, decide = command(pair)
            where = f"step {step} ({name})"
            pair.step(decide)
            pair.check()
    except AssertionError as failure:
        pytest.fail(f"seed {seed}, {where}: {failure}")
    except Exception as failure:    # an InvariantViolation in the replica's apply, say
        pytest.fail(f"seed {seed}, {where}: {type(failure).__name__}: {failure}")


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed_{seed}")
def test_a_replica_applying_the_masters_operations_holds_the_masters_state(seed: int) -> None:
    options = QueueOptions(strength=Strength.FULL, max_depth=40, max_deliveries=3, visibility_timeout_s=0.3)
    run(seed, options, Pair.queue_command)


@pytest.mark.parametrize("seed", SEEDS[:10], ids=lambda seed: f"seed_{seed}")
def test_the_same_without_a_dead_letter_queue(seed: int) -> None:
    options = QueueOptions(strength=Strength.FULL, max_depth=40, max_deliveries=2, dead_letter=False)
    run(seed, options, Pair.queue_command)


@pytest.mark.parametrize("seed", SEEDS[:10], ids=lambda seed: f"seed_{seed}")
def test_a_channels_durable_subscriptions_are_the_same_on_both_members(seed: int) -> None:
    options = QueueOptions(strength=Strength.FULL, dead_letter=False)
    run(seed, options, Pair.channel_command)
