"""The pure queue core, driven against the in-memory store twin.

Every command goes through the steps the node takes (docs/ARCHITECTURE.md, "Conventions": one task owns
the effect order): the core stages operations, the batch is sealed, persisted (`MemoryStore.apply`)
and the core advanced. One set of invariant checkers (`check_*` below) judges every commit
of the scenario tests and every step of the randomized model test, which replays from its
seed: `pytest tests/test_queue_core.py -k "seed_<n>"`.
"""
from __future__ import annotations

import copy
import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from replication import queue_core, queue_streams, ready_set
from replication.operations import Acked, DeadLettered, Enqueued, Leased, Operation, Purged, Released
from replication.options import QUEUE_STATE_TRANSITIONS, QueueOptions, QueueState, QueueType, Strength, producer_key
from replication.queue_core import InvariantViolation, QueueCore, QueueRecord
from replication.ready_set import ReadySet
from replication.store import MemoryStore, StoreReader
from wire.errors import (
    E_INVALID_OPTION,
    E_LEASE_EXPIRED,
    E_OVERLOADED,
    E_QUEUE_FULL,
    E_UNKNOWN_MESSAGE,
    E_WRONG_QUEUE_TYPE,
    QueueError,
)

QUEUE_ID = 1
DEAD_LETTER_QUEUE_ID = 2
START_MS = 1_000_000
EVERYTHING = 2**63
T = TypeVar("T")


# --- the one set of invariant checkers ------------------------------------------------------
def stored_ready(store: MemoryStore, queue_id: int) -> dict[int, tuple[int, int]]:
    """Committed ready messages: index -> (priority, deliveries so far)."""
    rows: dict[int, tuple[int, int]] = {}
    for priority in range(10):
        for index, deliveries in store.ready_page(queue_id, priority, 0, EVERYTHING, EVERYTHING):
            if index in rows:
                raise AssertionError(f"message {index} is ready at two priorities")
            rows[index] = (priority, deliveries)
    return rows


def check_committed_state(core: QueueCore, store: MemoryStore) -> None:
    """With nothing staged, the core's counters and leases are exactly what storage holds."""
    ready = stored_ready(store, core.queue_id)
    leases = {lease.index for lease in store.leases(core.queue_id)}
    assert core.record.ready_count == len(ready), "ready_count differs from the stored ready messages"
    assert core.in_flight == len(leases), "in-flight count differs from the stored leases"
    assert not ready.keys() & leases, f"messages both ready and leased: {sorted(ready.keys() & leases)}"
    assert core.depth == len(ready) + len(leases)
    assert core.record.highest_depth >= core.depth
    assert all(index < core.record.next_index for index in ready.keys() | leases)


def check_delivery_order(leased: list[Leased]) -> None:
    """One lease hands out messages by priority (9 first), then by ordering index."""
    keys = [(-op.priority, op.index) for op in leased]
    assert keys == sorted(keys), f"out of order: {[(op.priority, op.index) for op in leased]}"
    assert len(set(keys)) == len(keys), "a message was handed out twice in one lease"


def check_not_redelivered(leased: list[Leased], acked: set[int]) -> None:
    again = [op.index for op in leased if op.index in acked]
    assert not again, f"acked messages delivered again: {again}"


def expected_next(ready: dict[int, tuple[int, int]], count: int) -> list[tuple[int, int, int]]:
    """The reference order: (index, priority, deliveries after this lease) of the next `count`."""
    order = sorted(ready.items(), key=lambda item: (-item[1][0], item[0]))[:count]
    return [(index, priority, deliveries + 1) for index, (priority, deliveries) in order]


def delivered(leased: list[Leased]) -> list[tuple[int, int, int]]:
    return [(op.index, op.priority, op.deliveries) for op in leased]


# --- a driver that runs a core the way the node does ----------------------------------------
class CountingReader:
    """Counts the ready pages a core reads, per priority."""

    def __init__(self, inner: StoreReader) -> None:
        self.inner = inner
        self.pages: Counter[int] = Counter()

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        self.pages[priority] += 1
        return self.inner.ready_page(queue_id, priority, after_index, before_index, limit)

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        return self.inner.dedupe_lookup(queue_id, dedupe_id)

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.inner.ttl_rows(queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.inner.delayed_rows(queue_id)


class Driver:
    """One queue and its dead-letter queue. Commands stage operations; `commit` seals,
    persists and advances; `restart` rebuilds both cores from what was committed."""

    def __init__(self, options: QueueOptions | None = None, *, seed: int = 7,
                 dedupe_window_ms: int = 300_000, with_dead_letter_queue: bool = True) -> None:
        self.store = MemoryStore()
        self.rng = random.Random(seed)
        self.now_ms = START_MS
        self.dedupe_window_ms = dedupe_window_ms
        self.with_dead_letter_queue = with_dead_letter_queue
        record = QueueRecord(QUEUE_ID, "orders", options or QueueOptions(), START_MS)
        dead_record = QueueRecord(DEAD_LETTER_QUEUE_ID, "orders.dlq", QueueOptions(max_depth=2**40, dead_letter=False),
                                  START_MS, dead_letter_of="orders")
        self.committed_records = [record.to_json(), dead_record.to_json()]
        self.sealed_records = self.committed_records
        self.staged: list[Operation] = []
        self.committed: list[Operation] = []
        self.core, self.dead = self._build(self.store)

    def _build(self, reader: StoreReader) -> tuple[QueueCore, QueueCore]:
        cores = [QueueCore(QueueRecord.from_json(copy.deepcopy(raw)), reader, self.rng,
                           lease_clock=lambda: self.now_ms, leases=self.store.leases(raw["queue_id"]), dedupe_window_ms=self.dedupe_window_ms)
                 for raw in self.committed_records]
        if self.with_dead_letter_queue:
            cores[0].dead_letter_core = cores[1]
        return cores[0], cores[1]

    # --- the node's commit cycle ---------------------------------------------------------
    def seal(self) -> list[Operation]:
        self.core.seal()
        self.dead.seal()
        # The node writes each touched queue's record in the batch it seals.
        self.sealed_records = [self.core.record.to_json(), self.dead.record.to_json()]
        batch, self.staged = self.staged, []
        return batch

    def persist(self, batch: list[Operation]) -> None:
        self.store.apply(batch)
        self.committed.extend(batch)
        self.committed_records = self.sealed_records
        self.core.advance()
        self.dead.advance()

    def commit(self) -> list[Operation]:
        batch = self.seal()
        self.persist(batch)
        check_committed_state(self.core, self.store)
        check_committed_state(self.dead, self.store)
        return batch

    def restart(self, reader: StoreReader | None = None) -> None:
        """A crash: whatever was not committed is gone; the cores come back from storage."""
        self.staged = []
        self.core, self.dead = self._build(reader or self.store)

    def tick(self, ms: int) -> None:
        self.now_ms += ms

    def _run(self, command: Callable[[list[Operation]], T], commit: bool) -> T:
        try:
            return command(self.staged)
        finally:
            if commit:
                self.commit()

    # --- commands ---------------------------------------------------------------------------
    def enqueue_deduped(self, payload: bytes = b"m", priority: int = 4, dedupe_id: str | None = None, *,
                        commit: bool = True) -> tuple[int, bool]:
        return self._run(lambda out: self.core.enqueue(payload, priority, dedupe_id, "producer", self.now_ms, out),
                         commit)

    def enqueue(self, payload: bytes = b"m", priority: int = 4, dedupe_id: str | None = None, *,
                commit: bool = True) -> int:
        return self.enqueue_deduped(payload, priority, dedupe_id, commit=commit)[0]

    def lease(self, count: int = 1, visibility_ms: int | None = None, *, commit: bool = True) -> list[Leased]:
        leased = self._run(lambda out: self.core.lease(count, visibility_ms, "consumer", self.now_ms, out), commit)
        check_delivery_order(leased)
        return leased

    def ack(self, leased: Leased, *, commit: bool = True) -> None:
        self.ack_index(leased.index, leased.receipt, commit=commit)

    def ack_index(self, index: int, receipt: str, *, commit: bool = True) -> None:
        self._run(lambda out: self.core.ack(index, receipt, "consumer", self.now_ms, out), commit)

    def reply(self, leased: Leased, payload: bytes, *, commit: bool = True) -> None:
        self._run(lambda out: self.core.reply(leased.index, leased.receipt, payload, "consumer", self.now_ms, out),
                  commit)

    def release(self, leased: Leased, *, commit: bool = True) -> None:
        self.release_index(leased.index, leased.receipt, commit=commit)

    def release_index(self, index: int, receipt: str, *, commit: bool = True) -> None:
        self._run(lambda out: self.core.release(index, receipt, self.now_ms, out), commit)

    def expire(self, *, commit: bool = True) -> int:
        return self._run(lambda out: self.core.expire_leases(self.now_ms, out), commit)


def error_code(call: Callable[[], Any]) -> str:
    with pytest.raises(QueueError) as caught:
        call()
    return caught.value.code


# --- order, lease, ack, release -------------------------------------------------------------
def test_messages_are_delivered_by_priority_nine_first_then_by_ordering_index() -> None:
    driver = Driver()
    for priority in (0, 4, 9, 4, 9, 0, 5):
        driver.enqueue(f"p{priority}".encode(), priority)
    leased = driver.lease(10)
    assert [(op.priority, op.index) for op in leased] == [(9, 3), (9, 5), (5, 7), (4, 2), (4, 4), (0, 1), (0, 6)]
    assert all(op.deliveries == 1 for op in leased)
    assert driver.lease(1) == []


def test_a_lease_hands_out_at_most_the_number_asked_for() -> None:
    driver = Driver()
    for _ in range(5):
        driver.enqueue()
    assert [op.index for op in driver.lease(2)] == [1, 2]
    assert [op.index for op in driver.lease(2)] == [3, 4]
    assert driver.core.in_flight == 4 and driver.core.record.ready_count == 1


def test_an_acked_message_is_gone_and_never_delivered_again() -> None:
    driver = Driver()
    driver.enqueue(b"once")
    [first] = driver.lease(1)
    driver.ack(first)
    assert driver.store.payload(QUEUE_ID, first.index) is None
    driver.tick(10 * 60_000)
    assert driver.expire() == 0
    assert driver.lease(1) == []
    assert driver.core.depth == 0 and driver.core.record.total_acked == 1
    assert error_code(lambda: driver.ack(first)) == E_LEASE_EXPIRED.code


def test_a_released_message_is_delivered_again_first_with_its_delivery_count_raised() -> None:
    driver = Driver()
    driver.enqueue(b"a")
    driver.enqueue(b"b")
    [first] = driver.lease(1)
    driver.release(first)
    assert driver.committed[-1] == Released(QUEUE_ID, first.index, 4, 1, False, driver.now_ms)
    again = driver.lease(2)
    assert delivered(again) == [(1, 4, 2), (2, 4, 1)]
    assert driver.core.record.total_redelivered == 1


def test_an_expired_lease_returns_the_message_to_ready_with_its_deliveries_kept() -> None:
    driver = Driver()
    driver.enqueue()
    [first] = driver.lease(1, visibility_ms=1_000)
    assert driver.core.next_deadline() == driver.now_ms + 1_000
    driver.tick(999)
    assert driver.expire() == 0
    driver.tick(1)
    assert driver.expire() == 1
    assert driver.committed[-1] == Released(QUEUE_ID, first.index, 4, 1, True, driver.now_ms)
    assert stored_ready(driver.store, QUEUE_ID) == {first.index: (4, 1)}
    [second] = driver.lease(1, visibility_ms=1_000)
    assert (second.index, second.deliveries) == (first.index, 2)
    assert second.receipt != first.receipt


def test_a_stale_receipt_is_refused_and_the_message_stays_leased() -> None:
    driver = Driver()
    driver.enqueue()
    [leased] = driver.lease(1)
    assert error_code(lambda: driver.ack_index(leased.index, "0" * 16)) == E_LEASE_EXPIRED.code
    assert error_code(lambda: driver.core.release(leased.index, "f" * 16, driver.now_ms, [])) == E_LEASE_EXPIRED.code
    assert driver.core.in_flight == 1
    assert [lease.receipt for lease in driver.store.leases(QUEUE_ID)] == [leased.receipt]
    driver.ack(leased)
    assert driver.core.depth == 0


def test_the_receipt_of_an_earlier_delivery_is_refused_after_redelivery() -> None:
    driver = Driver()
    driver.enqueue()
    [first] = driver.lease(1, visibility_ms=100)
    driver.tick(100)
    driver.expire()
    [second] = driver.lease(1)
    assert error_code(lambda: driver.ack(first)) == E_LEASE_EXPIRED.code
    driver.ack(second)
    assert driver.core.depth == 0


@pytest.mark.parametrize("index", [0, -1, 2, 3, 2**62])
def test_an_ack_of_an_index_never_issued_is_an_unknown_message(index: int) -> None:
    driver = Driver()
    driver.enqueue()
    assert error_code(lambda: driver.ack_index(index, "0" * 16)) == E_UNKNOWN_MESSAGE.code
    assert error_code(lambda: driver.core.release(index, "0" * 16, driver.now_ms, [])) == E_UNKNOWN_MESSAGE.code


def test_an_ack_of_a_ready_message_is_refused_as_not_leased() -> None:
    driver = Driver()
    index = driver.enqueue()
    assert error_code(lambda: driver.ack_index(index, "0" * 16)) == E_LEASE_EXPIRED.code
    assert driver.staged == [] and driver.core.record.ready_count == 1


@pytest.mark.parametrize("ending", ["ack", "release"])
def test_an_overdue_lease_ended_before_the_sweep_is_refused_and_the_message_is_redelivered(ending: str) -> None:
    driver = Driver()
    driver.enqueue(b"late")
    [leased] = driver.lease(1, visibility_ms=500)
    driver.tick(500)
    end = driver.ack if ending == "ack" else driver.release
    assert error_code(lambda: end(leased)) == E_LEASE_EXPIRED.code
    # The refusal still ended the lease, exactly as the sweep would have.
    assert driver.committed[-1] == Released(QUEUE_ID, leased.index, 4, 1, True, driver.now_ms)
    assert driver.expire() == 0
    [again] = driver.lease(1)
    assert (again.index, again.deliveries) == (leased.index, 2)
    assert driver.core.record.total_acked == 0


def test_a_full_queue_refuses_an_enqueue_and_stores_nothing() -> None:
    driver = Driver(QueueOptions(max_depth=3))
    for _ in range(3):
        driver.enqueue()
    [leased] = driver.lease(1)
    record_before = driver.core.record.to_json()
    assert error_code(lambda: driver.enqueue(b"too many")) == E_QUEUE_FULL.code
    assert driver.core.record.to_json() == record_before
    assert len(stored_ready(driver.store, QUEUE_ID)) == 2
    assert not any(isinstance(op, Enqueued) and op.payload == b"too many" for op in driver.committed)
    driver.ack(leased)
    assert driver.enqueue(b"room again") == 4
    assert driver.core.record.highest_depth == 3


# --- dedupe ---------------------------------------------------------------------------------
def enqueues_of(batch: list[Operation]) -> list[int]:
    return [op.index for op in batch if isinstance(op, Enqueued)]


def test_a_repeated_dedupe_id_in_the_same_batch_returns_the_first_id_and_stores_nothing() -> None:
    driver = Driver()
    first = driver.enqueue(b"x", dedupe_id="order-1", commit=False)
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1", commit=False) == (first, True)
    assert enqueues_of(driver.commit()) == [first]
    assert driver.core.record.ready_count == 1 and driver.core.record.total_enqueued == 1


def test_a_repeated_dedupe_id_while_the_first_is_being_committed_returns_the_first_id() -> None:
    driver = Driver()
    first = driver.enqueue(b"x", dedupe_id="order-1", commit=False)
    in_flight = driver.seal()
    assert driver.store.dedupe_lookup(QUEUE_ID, producer_key("producer", "order-1")) is None
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1", commit=False) == (first, True)
    driver.persist(in_flight)
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1", commit=False) == (first, True)
    assert enqueues_of(driver.commit()) == []
    assert driver.core.record.ready_count == 1


def test_a_repeated_dedupe_id_after_commit_is_answered_from_storage_even_after_a_restart() -> None:
    driver = Driver()
    first = driver.enqueue(b"x", dedupe_id="order-1")
    driver.tick(1_000)
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1") == (first, True)
    driver.restart()
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1") == (first, True)
    assert enqueues_of(driver.committed) == [first]
    # Acked or not, the id still names the first message while the window lasts.
    [leased] = driver.lease(1)
    driver.ack(leased)
    assert driver.enqueue_deduped(b"x again", dedupe_id="order-1") == (first, True)


def test_a_dedupe_id_outside_the_window_is_stored_anew() -> None:
    driver = Driver(dedupe_window_ms=10_000)
    first = driver.enqueue(b"x", dedupe_id="order-1")
    driver.tick(10_000)
    assert driver.enqueue_deduped(b"x", dedupe_id="order-1") == (first, True)
    driver.tick(1)
    second, repeated = driver.enqueue_deduped(b"x", dedupe_id="order-1")
    assert (second, repeated) == (first + 1, False)
    assert driver.store.dedupe_lookup(QUEUE_ID, producer_key("producer", "order-1")) == (second, driver.now_ms)
    assert driver.enqueue_deduped(b"x", dedupe_id="order-1") == (second, True)
    assert driver.core.record.ready_count == 2


def test_a_repeated_dedupe_id_is_answered_even_when_the_queue_is_full() -> None:
    driver = Driver(QueueOptions(max_depth=1))
    first = driver.enqueue(dedupe_id="order-1")
    assert driver.enqueue_deduped(dedupe_id="order-1") == (first, True)
    assert error_code(lambda: driver.enqueue(dedupe_id="order-2")) == E_QUEUE_FULL.code


def test_a_batch_in_one_step_answers_each_message_as_single_enqueues_would() -> None:
    driver = Driver(QueueOptions(max_depth=4))
    first = driver.enqueue(b"x", dedupe_id="kept")                 # committed: found in storage
    staged = driver.enqueue(b"y", dedupe_id="staged", commit=False)
    outcomes = driver.core.enqueue_many([b"a", b"b", b"c", b"d", b"e", b"f"], 4,
                                        ["kept", None, "staged", "new", "new", "over"], "producer", driver.now_ms,
                                        driver.staged)
    assert outcomes[:5] == [first, staged + 1, staged, staged + 2, staged + 2]
    assert isinstance(outcomes[5], QueueError) and outcomes[5].code == E_QUEUE_FULL.code
    assert enqueues_of(driver.commit()) == [staged, staged + 1, staged + 2]
    assert driver.core.record.ready_count == 4 and driver.core.record.total_enqueued == 4


# --- dead letters and replies ---------------------------------------------------------------
def test_after_max_deliveries_a_message_moves_to_the_dead_letter_queue_with_its_payload() -> None:
    driver = Driver(QueueOptions(max_deliveries=3))
    index = driver.enqueue(b"poison", priority=7)
    for delivery in (1, 2):
        [leased] = driver.lease(1, visibility_ms=100)
        assert leased.deliveries == delivery
        driver.tick(100)
        assert driver.expire() == 1
    [leased] = driver.lease(1)
    assert leased.deliveries == 3
    driver.release(leased)
    assert driver.committed[-1] == DeadLettered(QUEUE_ID, index, 7, 3, DEAD_LETTER_QUEUE_ID, 1, driver.now_ms, True)
    assert driver.core.depth == 0 and driver.core.record.total_dead_lettered == 1
    assert driver.lease(1) == []
    assert driver.store.payload(QUEUE_ID, index) is None
    assert driver.store.payload(DEAD_LETTER_QUEUE_ID, 1) == b"poison"
    assert driver.store.queues[QUEUE_ID].status[index] == ("dead_lettered", None)
    [dead] = driver.dead.lease(1, None, "operator", driver.now_ms, driver.staged)
    assert (dead.index, dead.priority, dead.deliveries) == (1, 7, 1)
    driver.commit()


def test_dead_lettering_numbers_messages_anew_in_the_dead_letter_queue() -> None:
    driver = Driver(QueueOptions(max_deliveries=1))
    indices = [driver.enqueue(bytes([n]), priority=n % 3) for n in range(5)]
    for leased in driver.lease(5, visibility_ms=10):
        driver.release(leased)
    moved = {op.index: op.dead_letter_index for op in driver.committed if isinstance(op, DeadLettered)}
    assert sorted(moved) == indices and sorted(moved.values()) == [1, 2, 3, 4, 5]
    for index, dead_index in moved.items():
        assert driver.store.payload(DEAD_LETTER_QUEUE_ID, dead_index) == bytes([index - 1])
    assert driver.dead.record.ready_count == 5 and driver.dead.record.next_index == 6


def test_an_overdue_ack_at_max_deliveries_dead_letters_the_message() -> None:
    driver = Driver(QueueOptions(max_deliveries=1))
    driver.enqueue(b"slow")
    [leased] = driver.lease(1, visibility_ms=10)
    driver.tick(10)
    assert error_code(lambda: driver.ack(leased)) == E_LEASE_EXPIRED.code
    assert isinstance(driver.committed[-1], DeadLettered)
    assert driver.store.payload(DEAD_LETTER_QUEUE_ID, 1) == b"slow"


def test_without_dead_letter_a_message_is_redelivered_forever() -> None:
    driver = Driver(QueueOptions(max_deliveries=2, dead_letter=False))
    index = driver.enqueue(b"stubborn")
    for delivery in range(1, 21):
        [leased] = driver.lease(1, visibility_ms=10)
        assert (leased.index, leased.deliveries) == (index, delivery)
        driver.tick(10)
        assert driver.expire() == 1
    assert not any(isinstance(op, DeadLettered) for op in driver.committed)
    assert driver.dead.record.next_index == 1 and driver.core.record.total_redelivered == 20


def test_a_queue_without_a_dead_letter_queue_keeps_redelivering() -> None:
    driver = Driver(QueueOptions(max_deliveries=1), with_dead_letter_queue=False)
    driver.enqueue()
    for delivery in (1, 2, 3):
        [leased] = driver.lease(1)
        assert leased.deliveries == delivery
        driver.release(leased)


def test_a_reply_on_a_queue_that_is_not_two_way_is_refused() -> None:
    driver = Driver(QueueOptions(type=QueueType.QUEUED_ACK))
    driver.enqueue()
    [leased] = driver.lease(1)
    assert error_code(lambda: driver.reply(leased, b"answer")) == E_WRONG_QUEUE_TYPE.code
    assert driver.core.in_flight == 1


def test_a_reply_on_a_two_way_queue_completes_the_message_with_the_answer() -> None:
    driver = Driver(QueueOptions(type=QueueType.TWO_WAY))
    index = driver.enqueue(b"question")
    [leased] = driver.lease(1)
    driver.tick(25)
    driver.reply(leased, b"answer")
    last = driver.committed[-1]
    assert isinstance(last, Acked) and (last.index, last.reply, last.track_status) == (index, b"answer", True)
    assert driver.store.queues[QUEUE_ID].status[index] == ("replied", b"answer")
    assert (driver.core.record.service_ms_total, driver.core.record.service_count) == (25, 1)


@pytest.mark.parametrize(("queue_type", "keeps_status"), [
    (QueueType.ONE_WAY, False), (QueueType.QUEUED_ACK, False), (QueueType.ONE_WAY_ACK, True),
    (QueueType.TWO_WAY, True)], ids=lambda value: getattr(value, "value", str(value)))
def test_only_the_acknowledged_queue_types_keep_a_completion_status(queue_type: QueueType,
                                                                    keeps_status: bool) -> None:
    driver = Driver(QueueOptions(type=queue_type))
    index = driver.enqueue()
    [leased] = driver.lease(1)
    driver.ack(leased)
    last = driver.committed[-1]
    assert isinstance(last, Acked) and last.track_status is keeps_status
    assert driver.store.queues[QUEUE_ID].status.get(index) == (("acked", None) if keeps_status else None)


@pytest.mark.parametrize("queue_type", list(QueueType), ids=lambda value: value.value)
def test_dead_lettering_is_recorded_whatever_the_queue_type(queue_type: QueueType) -> None:
    driver = Driver(QueueOptions(type=queue_type, max_deliveries=1))
    index = driver.enqueue()
    [leased] = driver.lease(1)
    driver.release(leased)
    last = driver.committed[-1]
    assert isinstance(last, DeadLettered) and last.track_status is True
    assert driver.store.queues[QUEUE_ID].status[index] == ("dead_lettered", None)


# --- queue states ---------------------------------------------------------------------------
def test_a_queue_walks_from_unknown_through_open_to_closed() -> None:
    driver = Driver()
    for state in (QueueState.CONFIGURING, QueueState.CONFIGURED, QueueState.OPENING, QueueState.OPEN,
                  QueueState.CLOSING, QueueState.CLOSED):
        driver.core.transition(state)
        assert driver.core.record.state is state
    assert QueueRecord.from_json(driver.core.record.to_json()).state is QueueState.CLOSED


def test_a_failed_queue_can_be_opened_again() -> None:
    driver = Driver()
    for state in (QueueState.CONFIGURING, QueueState.FAILED, QueueState.OPENING, QueueState.OPEN):
        driver.core.transition(state)
    assert driver.core.record.state is QueueState.OPEN


INVALID_TRANSITIONS = [(before, after) for before in QueueState for after in QueueState
                       if after not in QUEUE_STATE_TRANSITIONS[before]]


@pytest.mark.parametrize(("before", "after"), INVALID_TRANSITIONS, ids=lambda state: state.value)
def test_a_state_change_outside_the_table_is_an_invariant_violation(before: QueueState, after: QueueState) -> None:
    driver = Driver()
    driver.core.record.state = before
    with pytest.raises(InvariantViolation):
        driver.core.transition(after)
    assert driver.core.record.state is before


def test_every_queue_state_has_a_row_in_the_transition_table() -> None:
    assert set(QUEUE_STATE_TRANSITIONS) == set(QueueState)
    assert QUEUE_STATE_TRANSITIONS[QueueState.CLOSED] == frozenset()


# --- restart ---------------------------------------------------------------------------------
class ReadyModel:
    """The reference: ready messages and what a lease must hand out next."""

    def __init__(self, ready: dict[int, tuple[int, int]]) -> None:
        self.ready = dict(ready)

    def lease(self, driver: Driver, count: int) -> list[Leased]:
        leased = driver.lease(count, visibility_ms=3_600_000)
        assert delivered(leased) == expected_next(self.ready, count)
        for op in leased:
            del self.ready[op.index]
        return leased

    def release(self, driver: Driver, leased: list[Leased], *, commit: bool = True) -> None:
        for op in leased:
            driver.release(op, commit=False)
            self.ready[op.index] = (op.priority, op.deliveries)
        if commit:
            driver.commit()


@pytest.mark.parametrize("commit_release_before_first_lease", [True, False], ids=["committed", "uncommitted"])
def test_a_restarted_core_delivers_exactly_the_remaining_messages_in_order_loading_pages_lazily(
        commit_release_before_first_lease: bool) -> None:
    driver = Driver()
    # 3,000 messages at priority 4; 2,000 leased: 1..1,200 released again (ready with one
    # delivery), 1,201..1,800 acked, 1,801..2,000 left leased across the restart.
    for n in range(3_000):
        driver.enqueue(b"a%d" % n, 4, commit=False)
    leased_before = driver.lease(2_000, visibility_ms=3_600_000, commit=False)
    for op in leased_before[:1_200]:
        driver.release(op, commit=False)
    for op in leased_before[1_200:1_800]:
        driver.ack(op, commit=False)
    held_p4 = leased_before[1_800:]
    rng = random.Random(5)
    for n in range(2_000):
        driver.enqueue(b"b%d" % n, rng.choice([9, 7, 4, 0]), commit=False)
    held_p9 = driver.lease(30, visibility_ms=3_600_000, commit=False)
    assert {op.priority for op in held_p9} == {9}
    driver.commit()
    acked = {op.index for op in leased_before[1_200:1_800]}
    model = ReadyModel(stored_ready(driver.store, QUEUE_ID))
    assert len(model.ready) == 5_000 - 600 - 200 - 30

    reader = CountingReader(driver.store)
    driver.restart(reader)
    assert reader.pages == Counter(), "building a core must not read any page"
    assert driver.core.depth == 5_000 - 600 and driver.core.in_flight == 230
    # A pre-restart lease given back before its priority's first page is loaded.
    model.release(driver, held_p4[:50], commit=commit_release_before_first_lease)
    first = model.lease(driver, 1)
    assert first[0].priority == 9
    assert max(reader.pages.values()) == 1 and set(reader.pages) == {9}, reader.pages

    seen: list[Leased] = list(first)
    while model.ready and all(op.priority != 4 for op in seen):
        seen += model.lease(driver, 97)
    assert reader.pages[4] == 1, "the first page of priority 4 is loaded"
    # Given back after the first page of priority 4 was loaded; 1,801.. lie beyond it.
    model.release(driver, held_p4[50:120])
    model.release(driver, held_p9, commit=False)
    for n in range(300):
        priority = rng.randrange(10)
        index = driver.enqueue(b"c%d" % n, priority, commit=False)
        model.ready[index] = (priority, 0)
    driver.commit()
    while model.ready:
        seen += model.lease(driver, rng.randint(1, 400))
    model.release(driver, held_p4[120:])
    while model.ready:
        seen += model.lease(driver, 64)

    counts = Counter(op.index for op in seen)
    everything = set(range(1, driver.core.record.next_index))
    assert set(counts) == everything - acked, "lost or unexpected messages"
    assert all(count == 1 for count in counts.values()), "duplicated deliveries"
    assert driver.core.record.ready_count == 0 and driver.core.in_flight == len(everything - acked)
    assert all(pages <= 5_000 // ready_set.READY_PAGE_SIZE + 2 for pages in reader.pages.values()), reader.pages


def test_a_restart_keeps_the_leases_in_flight_and_runs_each_its_whole_duration_again() -> None:
    # Leases are durations timed on the member's own clock: one inherited at a restart (or a
    # takeover) counts as granted then, so it never expires early (docs/ARCHITECTURE.md, "Queue pairs").
    driver = Driver()
    driver.enqueue(b"a")
    driver.enqueue(b"b")
    [leased] = driver.lease(1, visibility_ms=5_000)
    assert leased.visibility_ms == 5_000
    driver.tick(1_000)
    driver.restart()
    assert driver.core.next_deadline() == driver.now_ms + 5_000
    driver.ack(leased)
    [second] = driver.lease(1, visibility_ms=1_000)
    driver.restart()
    driver.tick(1_000)
    assert driver.expire() == 1
    [again] = driver.lease(1)
    assert (again.index, again.deliveries) == (second.index, 2)


def test_uncommitted_operations_are_gone_after_a_restart() -> None:
    driver = Driver()
    kept = driver.enqueue(b"kept")
    driver.enqueue(b"lost", priority=9, commit=False)
    driver.lease(1, commit=False)
    driver.restart()
    assert driver.core.record.next_index == kept + 1
    assert delivered(driver.lease(5)) == [(kept, 4, 1)]


def test_an_empty_queue_restarts_without_reading_a_page_and_serves_new_and_released_messages() -> None:
    driver = Driver()
    assert driver.lease(1) == []
    driver.enqueue(b"a")
    driver.enqueue(b"b")
    first, second = driver.lease(2)
    driver.ack(first)
    reader = CountingReader(driver.store)
    driver.restart(reader)
    assert driver.core.record.ready_count == 0 and driver.core.in_flight == 1
    assert driver.lease(1) == []
    newer = driver.enqueue(priority=2)
    driver.release(second)
    assert delivered(driver.lease(5)) == [(second.index, 4, 2), (newer, 2, 1)]
    assert reader.pages == Counter()


# --- the randomized model test --------------------------------------------------------------
@dataclass
class ModelLease:
    priority: int
    receipt: str
    deadline_ms: int
    deliveries: int
    visibility_ms: int


@dataclass
class Model:
    """What a correct queue holds, in the plainest terms."""
    next_index: int = 1
    ready: dict[int, tuple[int, int]] = field(default_factory=dict)      # index -> (priority, deliveries)
    leased: dict[int, ModelLease] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    dead: dict[int, int] = field(default_factory=dict)                   # index -> dead-letter index
    dead_next_index: int = 1
    dedupe: dict[str, tuple[int, int]] = field(default_factory=dict)
    payloads: dict[int, bytes] = field(default_factory=dict)
    old_receipts: list[tuple[int, str]] = field(default_factory=list)

    def end_lease(self, index: int, options: QueueOptions, dead_letter_queue: bool) -> None:
        lease = self.leased.pop(index)
        self.old_receipts.append((index, lease.receipt))
        if dead_letter_queue and options.dead_letter and lease.deliveries >= options.max_deliveries:
            self.dead[index] = self.dead_next_index
            self.dead_next_index += 1
        else:
            self.ready[index] = (lease.priority, lease.deliveries)


class ModelRun:
    """One seeded run: random commands against the core and the model, a pipelined commit
    (one batch in flight while the next is staged, as the node does), and crashes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.options = QueueOptions(max_depth=rng.choice([12, 40, 1_000_000]), max_deliveries=rng.randint(1, 4),
                                    dead_letter=rng.random() < 0.7)
        self.dead_letter_queue = rng.random() < 0.9
        self.driver = Driver(self.options, seed=seed, dedupe_window_ms=1_500,
                             with_dead_letter_queue=self.dead_letter_queue)
        self.model = Model()
        self.committed_model = copy.deepcopy(self.model)
        self.sealed_model: Model | None = None
        self.in_flight: list[Operation] | None = None
        self.priorities = rng.choice([[4], [0, 9], [0, 3, 4, 9], list(range(10))])
        self.trace: list[str] = []

    # --- commands -----------------------------------------------------------------------
    def enqueue(self) -> None:
        driver, model, rng = self.driver, self.model, self.rng
        priority = rng.choice(self.priorities)
        dedupe_id = f"d{rng.randrange(6)}" if rng.random() < 0.3 else None
        payload = rng.randbytes(rng.randrange(8))
        earlier = model.dedupe.get(dedupe_id) if dedupe_id is not None else None
        if earlier is not None and driver.now_ms - earlier[1] <= driver.dedupe_window_ms:
            assert driver.enqueue_deduped(payload, priority, dedupe_id, commit=False) == (earlier[0], True)
            return
        if len(model.ready) + len(model.leased) >= self.options.max_depth:
            assert error_code(lambda: driver.enqueue(payload, priority, dedupe_id, commit=False)) == E_QUEUE_FULL.code
            return
        index = model.next_index
        assert driver.enqueue_deduped(payload, priority, dedupe_id, commit=False) == (index, False)
        model.next_index += 1
        model.ready[index] = (priority, 0)
        model.payloads[index] = payload
        if dedupe_id is not None:
            model.dedupe[dedupe_id] = (index, driver.now_ms)

    def lease(self) -> None:
        driver, model = self.driver, self.model
        count = self.rng.randint(1, 5)
        visibility_ms = self.rng.randint(50, 2_000)
        leased = driver.lease(count, visibility_ms, commit=False)
        check_not_redelivered(leased, model.acked)
        assert delivered(leased) == expected_next(model.ready, count)
        for op in leased:
            priority, deliveries = model.ready.pop(op.index)
            model.leased[op.index] = ModelLease(priority, op.receipt, driver.now_ms + visibility_ms, deliveries + 1,
                                                visibility_ms)

    def end(self, ack: bool) -> None:
        driver, model = self.driver, self.model
        if not model.leased:
            return
        index = self.rng.choice(sorted(model.leased))
        lease = model.leased[index]
        end = driver.ack_index if ack else driver.release_index
        if lease.deadline_ms <= driver.now_ms:
            assert error_code(lambda: end(index, lease.receipt, commit=False)) == E_LEASE_EXPIRED.code
            model.end_lease(index, self.options, self.dead_letter_queue)
            return
        end(index, lease.receipt, commit=False)
        if ack:
            del model.leased[index]
            model.acked.add(index)
        else:
            model.end_lease(index, self.options, self.dead_letter_queue)

    def stale_ack(self) -> None:
        driver, model = self.driver, self.model
        if model.old_receipts:
            index, receipt = self.rng.choice(model.old_receipts)
            if index in model.leased and model.leased[index].receipt == receipt:
                return
            before = len(driver.staged)
            assert error_code(lambda: driver.ack_index(index, receipt, commit=False)) == E_LEASE_EXPIRED.code
            assert len(driver.staged) == before
        never = self.rng.choice([0, model.next_index, model.next_index + 1_000])
        assert error_code(lambda: driver.ack_index(never, "0" * 16, commit=False)) == E_UNKNOWN_MESSAGE.code

    def expire(self) -> None:
        driver, model = self.driver, self.model
        due = sorted((lease.deadline_ms, index) for index, lease in model.leased.items()
                     if lease.deadline_ms <= driver.now_ms)
        assert driver.expire(commit=False) == len(due)
        for _, index in due:
            model.end_lease(index, self.options, self.dead_letter_queue)

    def start_commit(self) -> None:
        if self.in_flight is None:
            self.in_flight = self.driver.seal()
            self.sealed_model = copy.deepcopy(self.model)

    def finish_commit(self) -> None:
        if self.in_flight is None:
            return
        self.driver.persist(self.in_flight)
        self.in_flight = None
        assert self.sealed_model is not None
        self.committed_model = self.sealed_model
        self.check_store(self.committed_model)

    def crash(self) -> None:
        self.in_flight = None
        self.driver.restart()
        self.model = copy.deepcopy(self.committed_model)
        for lease in self.model.leased.values():       # inherited at the restart: granted now
            lease.deadline_ms = self.driver.now_ms + lease.visibility_ms

    # --- checks -------------------------------------------------------------------------
    def check_memory(self) -> None:
        core, model = self.driver.core, self.model
        assert core.record.ready_count == len(model.ready)
        assert core.in_flight == len(model.leased)
        assert core.depth == len(model.ready) + len(model.leased)
        assert core.record.next_index == model.next_index
        assert self.driver.dead.record.ready_count == len(model.dead)
        assert self.driver.dead.record.next_index == model.dead_next_index
        assert core.record.total_acked == len(model.acked)
        assert core.record.total_dead_lettered == len(model.dead)
        assert not model.acked & (model.ready.keys() | model.leased.keys() | model.dead.keys())

    def check_store(self, model: Model) -> None:
        store = self.driver.store
        assert stored_ready(store, QUEUE_ID) == model.ready
        stored_leases = {lease.index: (lease.priority, lease.receipt, lease.visibility_ms, lease.deliveries)
                         for lease in store.leases(QUEUE_ID)}
        assert stored_leases == {index: (lease.priority, lease.receipt, lease.visibility_ms, lease.deliveries)
                                 for index, lease in model.leased.items()}
        assert set(stored_ready(store, DEAD_LETTER_QUEUE_ID)) == set(model.dead.values())
        for index, dead_index in model.dead.items():
            assert store.payload(DEAD_LETTER_QUEUE_ID, dead_index) == model.payloads[index]
        for index in model.ready.keys() | model.leased.keys():
            assert store.payload(QUEUE_ID, index) == model.payloads[index]

    # --- the run ------------------------------------------------------------------------
    STEPS = (("enqueue", 30), ("lease", 20), ("ack", 12), ("release", 5), ("stale_ack", 3), ("tick", 12),
             ("expire", 6), ("start_commit", 12), ("finish_commit", 12), ("crash", 1))

    def step(self) -> None:
        names, weights = zip(*self.STEPS, strict=True)
        name = self.rng.choices(names, weights)[0]
        self.trace.append(f"{name}@{self.driver.now_ms}")
        if name == "tick":
            self.driver.tick(self.rng.randint(0, 700))
        elif name in ("ack", "release"):
            self.end(ack=name == "ack")
        else:
            getattr(self, name)()
        self.check_memory()

    def drain(self) -> None:
        """Liveness: with the faults over (one last clean restart), every message not acked
        is delivered again and can be acked; nothing is left behind."""
        self.start_commit()
        self.finish_commit()
        self.crash()
        model, driver = self.model, self.driver
        for _ in range(3):
            driver.tick(3_000)   # past every visibility timeout
            self.expire()
            while model.ready:
                self.lease()
            for index in sorted(model.leased):
                driver.ack_index(index, model.leased.pop(index).receipt, commit=False)
                model.acked.add(index)
            self.start_commit()
            self.finish_commit()
            self.check_memory()
        assert not model.ready and not model.leased, "messages left undelivered"
        assert model.acked | model.dead.keys() == set(range(1, model.next_index))
        assert driver.core.depth == 0


@pytest.mark.parametrize("page_size", [1, 3, 1024], ids=lambda size: f"page_{size}")
@pytest.mark.parametrize("seed", [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584],
                         ids=lambda seed: f"seed_{seed}")
def test_random_commands_keep_order_and_lose_or_duplicate_nothing(seed: int, page_size: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ready_set, "READY_PAGE_SIZE", page_size)
    run = ModelRun(seed)
    try:
        for _ in range(400):
            run.step()
        run.drain()
    except BaseException as failure:
        failure.add_note(f"replay: seed={seed} page_size={page_size}; last steps: {' '.join(run.trace[-25:])}")
        raise


# --- durable subscriptions (a channel's queue) ------------------------------------------------
def test_durable_subscriptions_keep_their_backlogs_and_a_replica_applies_the_same_floors() -> None:
    """A subscription's backlog is what was enqueued after it opened and it has not acked;
    the floor moves over acknowledged messages only, out-of-order acks wait above it; a purge
    stops below the lowest floor; a replica applying the master's operations holds the same
    state, and a restart (the record) keeps it."""
    master = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    before = master.enqueue(b"before")
    assert master._run(lambda out: master.core.open_subscription("s", "c", master.now_ms, out), True)
    assert not master._run(lambda out: master.core.open_subscription("s", "c", master.now_ms, out), True)
    opened = master.core.record.subscriptions["s"][0]
    ids = [master.enqueue(b"m%d" % n) for n in range(4)]

    def ack(index: int) -> bool:
        return master._run(lambda out: master.core.subscriber_ack("s", index, "c", master.now_ms, out), True)
    assert ack(ids[1]) and master.core.record.subscriptions["s"] == [opened, [ids[1]]]     # out of order
    assert ack(ids[0]) and master.core.record.subscriptions["s"] == [ids[1], []]           # the floor moves over both
    assert not ack(ids[0])                                                                 # again: nothing to do
    assert not ack(before)                                # below the floor (not in the backlog): nothing to do
    assert error_code(lambda: master._run(lambda out: master.core.subscriber_ack(
        "s", ids[-1] + 100, "c", master.now_ms, out), True)) == E_UNKNOWN_MESSAGE.code
    assert error_code(lambda: master._run(lambda out: master.core.subscriber_ack(
        "nobody", ids[2], "c", master.now_ms, out), True)) == "E_UNKNOWN_SUBSCRIPTION"
    purged, _ = master._run(lambda out: master.core.purge(ids[-1], 100, master.now_ms, out), True)
    assert purged == 3                                    # `before`, ids[0], ids[1]: nothing past the floor
    replica = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    for op in master.committed:
        replica.core.apply(op)
        replica.staged.append(op)
    replica.commit()
    assert replica.core.record.subscriptions == master.core.record.subscriptions
    master.restart()
    assert master.core.record.subscriptions == {"s": [ids[1], []]}
    with pytest.raises(InvariantViolation):               # a replica never takes a message some backlog holds
        replica.core.apply(Purged(QUEUE_ID, ids[2], 4, False, master.now_ms, False, replica.core.record.next_index))
    master._run(lambda out: master.core.drop_subscription("s", "c", master.now_ms, out), True)
    assert master._run(lambda out: master.core.purge(ids[-1], 100, master.now_ms, out), True)[0] == 2


@pytest.mark.parametrize("seed", range(20))
def test_a_run_of_acks_ends_where_the_same_acks_one_by_one_end(seed: int) -> None:
    """A reader's acks committed as one run (hub.py batches them) leave the subscription, the
    operations' messages and a replica as acking each alone would, each refused or repeated ack
    answered on its own. Replay: this seed."""
    assert _acks_pass(seed, batched=True) == _acks_pass(seed, batched=False), f"seed {seed}"


def _acks_pass(seed: int, *, batched: bool) -> tuple[Any, list[Any], list[int]]:
    rng = random.Random(seed)
    master = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    master._run(lambda out: master.core.open_subscription("s", "c", master.now_ms, out), True)
    ids = [master.enqueue(b"m%d" % n) for n in range(12)]
    runs = [[rng.choice(ids + [ids[-1] + 50]) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    outcomes: list[Any] = []
    for run in runs:
        if batched:
            result = master._run(lambda out, run=run: master.core.subscriber_acks("s", run, "c", master.now_ms, out), True)
            outcomes += [o.code if isinstance(o, QueueError) else o for o in result]
            continue
        for index in run:
            try:
                outcomes.append(master._run(lambda out, index=index: master.core.subscriber_ack(
                    "s", index, "c", master.now_ms, out), True))
            except QueueError as error:
                outcomes.append(error.code)
    replica = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    for op in master.committed:
        replica.core.apply(op)
        replica.staged.append(op)
    replica.commit()
    assert replica.core.record.subscriptions == master.core.record.subscriptions, f"seed {seed}"
    acked = sorted(op.index for op in master.committed if type(op).__name__ == "SubscriberAcked")
    return master.core.record.subscriptions, outcomes, acked


def test_a_numbered_stream_stores_each_number_once_however_long_after() -> None:
    """x-sequence-key / x-sequence: a repeat (the same number or a lower one) answers with the
    stream's last stored id and stores nothing, long past the dedupe window; a replica keeps
    the same marks; a batch cannot share one number."""
    master = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False, dedupe_window_ms=1_000)

    def send(number: int, dedupe_id: str | None = None) -> tuple[int, bool]:
        headers = {queue_core.SEQUENCE_KEY_HEADER: "fwd@7", queue_core.SEQUENCE_HEADER: str(number)}
        return master._run(lambda out: master.core.enqueue(b"m%d" % number, 4, dedupe_id, "forwarder",
                                                           master.now_ms, out, headers=headers), True)
    first, repeated = send(1, "a")
    assert not repeated
    second, _ = send(2, "b")
    master.tick(3_600_000)                                   # an hour: far past the dedupe window
    assert send(2, "b") == (second, True) and send(1, "c") == (second, True)
    third, repeated = send(3)
    assert not repeated and master.core.depth == 3
    assert master.core.record.to_json()["sequences"] == {producer_key("forwarder", "fwd@7"): [3, [[3, third]]]}
    replica = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    for op in master.committed:
        replica.core.apply(op)
    assert replica.core.record.sequences == master.core.record.sequences
    master.restart()
    assert send(3) == (third, True)
    assert error_code(lambda: send(0)) == "E_INVALID_OPTION"
    outcomes = master._run(lambda out: master.core.enqueue_many(
        [b"x", b"y"], 4, [None, None], "forwarder", master.now_ms, out,
        headers={queue_core.SEQUENCE_KEY_HEADER: "fwd@7", queue_core.SEQUENCE_HEADER: "9"}), True)
    assert all(isinstance(outcome, QueueError) for outcome in outcomes) and master.core.depth == 3


def test_the_lowest_index_of_a_priority_counts_ready_leased_and_delayed_messages() -> None:
    """A forwarder's floor per priority: nothing of that priority below it is left."""
    q = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    delayed = q._run(lambda out: q.core.enqueue(b"later", 4, None, "p", q.now_ms, out, delay_ms=60_000), False)[0]
    first, second = q.enqueue(b"a", 4, commit=False), q.enqueue(b"b", 4, commit=False)
    high = q.enqueue(b"h", 9, commit=False)
    assert q.core.lowest_index(4) == delayed < first < second and q.core.lowest_index(9) == high
    assert q.core.lowest_index(0) == q.core.record.next_index             # none of it: every id below settled
    leased = q.lease(3, commit=False)
    assert [lease.index for lease in leased] == [high, first, second]
    q.ack(leased[0], commit=False)
    assert q.core.lowest_index(9) == q.core.record.next_index
    q.ack(leased[1], commit=False)
    assert q.core.lowest_index(4) == delayed                              # still waiting for its delay
    assert q.core.lowest_index(4) < leased[2].index


def test_a_stream_with_a_declared_floor_takes_numbers_out_of_order_and_each_once() -> None:
    """x-sequence-floor (a forwarder's: its source's priorities and delays reorder the numbers):
    any number at or above the floor not stored yet is stored, each once; below the floor is
    settled; the stored numbers below a raised floor are forgotten (the window stays small)."""
    master = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False, dedupe_window_ms=1_000)

    def send(number: int, floor: int) -> tuple[int, bool]:
        headers = {queue_core.SEQUENCE_KEY_HEADER: "fw:a@3", queue_core.SEQUENCE_HEADER: str(number),
                   queue_core.SEQUENCE_FLOOR_HEADER: str(floor)}
        return master._run(lambda out: master.core.enqueue(b"m%d" % number, 4, None, "forwarder", master.now_ms,
                                                           out, headers=headers), True)
    ids = {number: send(number, 5)[0] for number in (9, 7, 12)}        # 5, 6, 8 wait (delayed, say)
    assert send(5, 5)[1] is False and send(8, 5)[1] is False
    assert send(7, 5) == (ids[7], True) and send(12, 5) == (ids[12], True)
    assert master.core.depth == 5
    master.tick(3_600_000)
    assert send(6, 6)[1] is False and send(6, 6)[1] is True
    assert send(13, 10)[1] is False                                    # the floor rises to 10
    assert sorted(master.core.record.sequences[producer_key("forwarder", "fw:a@3")][1]) == [12, 13]
    assert send(9, 9)[1] is True and send(11, 10)[1] is False          # below: settled; 11 was never stored
    assert master.core.depth == 8
    replica = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)
    for op in master.committed:
        replica.core.apply(op)
    assert replica.core.record.sequences == master.core.record.sequences
    assert error_code(lambda: send(20, 21)) == "E_INVALID_OPTION"      # a floor above its own number
    # An old record's [number, id] reads as that number's floor with it stored.
    assert queue_core.sequences_from_json({"k": [4, 17]}) == {"k": [4, {4: 17}]}


def test_nothing_later_in_a_stream_is_stored_after_one_of_its_numbers_was_refused() -> None:
    """A forwarder keeps several data messages in flight (issue 38): once the master refused a
    number of a stream (the queue at max_depth here), every later number is refused too until
    that one is stored or passed by the declared floor; lower numbers go on."""
    master = Driver(QueueOptions(strength=Strength.FULL, max_depth=4), with_dead_letter_queue=False)

    def send(number: int, floor: int = 1) -> tuple[int, bool]:
        headers = {queue_core.SEQUENCE_KEY_HEADER: "fw:p@4", queue_core.SEQUENCE_HEADER: str(number),
                   queue_core.SEQUENCE_FLOOR_HEADER: str(floor)}
        return master._run(lambda out: master.core.enqueue(b"m%d" % number, 4, None, "forwarder", master.now_ms,
                                                           out, headers=headers), True)

    def consume(count: int) -> None:
        for lease in master.lease(count):
            master.ack(lease)
    for number in (2, 3, 4, 5):
        send(number)
    assert error_code(lambda: send(6)) == "E_QUEUE_FULL"           # the queue is full: 6 refused
    consume(3)                                                      # room again ...
    assert error_code(lambda: send(7)) == "E_OVERLOADED"           # ... but 7 waits for 6
    assert send(1)[1] is False                                      # a lower number goes on
    assert send(6)[1] is False and send(7)[1] is False              # 6 stored: the stream goes on
    assert master.core.depth == 4
    # The floor passing a refused number (gone from the source) lets the stream go on without it.
    assert error_code(lambda: send(8)) == "E_QUEUE_FULL"
    consume(1)
    assert error_code(lambda: send(9)) == "E_OVERLOADED"
    assert send(9, floor=9)[1] is False and master.core.depth == 4
    assert master.core.stream_fences._refused == {}


def test_a_record_stored_with_the_retired_in_sync_field_still_loads_and_is_written_without_it() -> None:
    """Issue 33: `QueueRecord.in_sync` was stored and never read; records on disk still carry it."""
    record = QueueRecord(QUEUE_ID, "orders", QueueOptions(), START_MS, next_index=7, total_enqueued=6)
    stored = {**record.to_json(), "in_sync": False}
    loaded = QueueRecord.from_json(stored)
    assert loaded == record and "in_sync" not in loaded.to_json()



def test_a_stream_and_a_dedupe_id_are_their_producers_own_and_bounded_per_producer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, item 3: another client naming a producer's stream key, or sending its dedupe id
    first, numbers a stream of its own and stores a message of its own; what one producer keeps
    in the queue's record is bounded (streams, and numbers over all of them; smaller bounds here)."""
    monkeypatch.setattr(queue_streams, "SEQUENCE_KEYS_PER_PRODUCER_MAX", 10)
    monkeypatch.setattr(queue_streams, "SEQUENCE_STREAM_FEW", 8)
    monkeypatch.setattr(queue_streams, "SEQUENCE_NUMBERS_PER_PRODUCER_MAX", 64)
    master = Driver(QueueOptions(strength=Strength.FULL), with_dead_letter_queue=False)

    def send(client: str, key: str, number: int, floor: int | None = None, dedupe_id: str | None = None
             ) -> tuple[int, bool]:
        headers = {queue_core.SEQUENCE_KEY_HEADER: key, queue_core.SEQUENCE_HEADER: str(number)}
        if floor is not None:
            headers[queue_core.SEQUENCE_FLOOR_HEADER] = str(floor)
        return master._run(lambda out: master.core.enqueue(b"m", 4, dedupe_id, client, master.now_ms, out,
                                                           headers=headers), True)
    claimed, _ = send("attacker", "fwd@1/p4", 999_999_999_999, dedupe_id="order-1")
    stored, repeated = send("forwarder", "fwd@1/p4", 1, dedupe_id="order-1")
    assert not repeated and stored == claimed + 1
    for number in range(queue_streams.SEQUENCE_KEYS_PER_PRODUCER_MAX):
        send("greedy", f"s{number}", 1)
    assert error_code(lambda: send("greedy", "one-more", 1)) == E_INVALID_OPTION.code
    assert send("modest", "one-more", 1)[1] is False
    few = queue_streams.SEQUENCE_STREAM_FEW
    streams = queue_streams.SEQUENCE_NUMBERS_PER_PRODUCER_MAX // few
    for stream in range(streams):     # out of order, each number above a floor of 1: all kept
        for number in range(2, few + 2):
            send("hoarder", f"h{stream}", number, floor=1)
    assert error_code(lambda: send("hoarder", "h0", few + 2, floor=1)) == E_OVERLOADED.code


# --- the ready set alone: takes out of order, releases, pages not yet loaded ----------------------
class _SnapshotReader:
    """Storage as it stood when the set was built: the pre-restart ready rows, never updated
    (the worst case the set must survive: a page that sees none of the commits since)."""

    def __init__(self, rows: dict[int, list[int]]) -> None:
        self.rows = rows

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        return [(index, 0) for index in self.rows.get(priority, []) if after_index < index < before_index][:limit]


@pytest.mark.parametrize("page_size", [1, 2, 5], ids=lambda size: f"page_{size}")
@pytest.mark.parametrize("seed", range(1, 41), ids=lambda seed: f"seed_{seed}")
def test_the_ready_set_serves_each_ready_message_once_in_order_whatever_is_taken_out_of_order(
        seed: int, page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages taken from the middle of a heap (a lease through a virtual queue, a member's
    apply) or from pages not yet loaded, made ready again and taken again, against a model: the
    head is always the lowest ready (priority, index), and a drain yields each ready one once."""
    monkeypatch.setattr(ready_set, "READY_PAGE_SIZE", page_size)
    rng = random.Random(seed)
    boundary = 30
    stored = {index: rng.randrange(3) for index in range(1, boundary) if rng.random() < 0.7}
    rows: dict[int, list[int]] = {}
    for index, priority in sorted(stored.items()):
        rows.setdefault(priority, []).append(index)
    ready = ReadySet(_SnapshotReader(rows), 1, boundary, empty=not stored)
    model_ready, taken, next_index, trace = dict(stored), dict[int, int](), boundary, []
    try:
        for _ in range(200):
            choice = rng.random()
            if choice < 0.2:
                priority = rng.randrange(3)
                ready.push(priority, next_index)
                model_ready[next_index] = priority
                trace.append(f"push {next_index}@{priority}")
                next_index += 1
            elif choice < 0.5 and model_ready:
                index = rng.choice(sorted(model_ready))
                priority = model_ready.pop(index)
                ready.take(priority, index)
                taken[index] = priority
                trace.append(f"take {index}")
            elif choice < 0.75 and taken:
                index = rng.choice(sorted(taken))
                priority = taken.pop(index)
                ready.make_ready(index, priority, 1)
                model_ready[index] = priority
                trace.append(f"ready {index}")
            elif choice < 0.85 and taken:
                trace.append(f"ack {taken.popitem()[0]}")
            else:
                priority = rng.randrange(3)
                expected = min((i for i, p in model_ready.items() if p == priority), default=None)
                has = ready.fill_head(priority)
                assert (ready.heaps[priority][0] if has else None) == expected, trace[-20:]
                if expected is not None:
                    ready.take(priority, expected)
                    taken[expected] = model_ready.pop(expected)
                    trace.append(f"head {expected}")
        for priority in range(3):
            drained = []
            while ready.fill_head(priority):
                drained.append(heapq.heappop(ready.heaps[priority]))
            assert drained == sorted(i for i, p in model_ready.items() if p == priority), trace[-20:]
    except BaseException as failure:
        failure.add_note(f"replay: seed={seed} page_size={page_size}; last steps: {' '.join(trace[-25:])}")
        raise
