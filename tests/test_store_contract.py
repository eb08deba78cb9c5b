"""One contract for both stores: the in-memory twin (`MemoryStore`) and LMDB (`Storage`).

The same operations, applied by `MemoryStore.apply` and by `Storage.commit`, must give the
same answers to every read a queue core makes (`ready_page`, `dedupe_lookup`), the same
leases at start-up and the same payloads; otherwise tests run against the twin prove nothing
about the node. Each store writes each operation's rows in code of its own (`BatchWriter` in
qserver/storage/commit.py, `MemoryStore._apply_*`): the random run below holds them equal on
every Operation type, every read the twin answers (statuses, times to live, delays, headers),
snapshots cut and installed, and a discarded suffix. LMDB-only promises follow: durability
across reopen, the checksummed journal, and a full map that grows once, then refuses, losing
nothing.
"""
from __future__ import annotations

import random
import typing
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack
import pytest

from qserver.storage.lmdb_store import MapGrowthNeeded, SealedBatch, Storage, StorageFull
from replication.journal import JOURNAL_FIELDS
from replication.operations import (
    Acked,
    DeadLettered,
    Enqueued,
    Expired,
    Extended,
    Leased,
    Matured,
    Operation,
    Purged,
    Released,
    SubscriberAcked,
    SubscriptionDropped,
    SubscriptionOpened,
)
from replication.options import QueueOptions, Strength, producer_key
from replication.queue_core import SUBSCRIPTION_PRIORITY, InvariantViolation, QueueCore, QueueRecord
from replication.snapshot import memory_rows
from replication.store import MemoryStore, StoredLease
from wire.errors import QueueError

QUEUE = 1
PRODUCER = "producer"    # every enqueue's client here: dedupe ids are kept per producer (producer_key)
OTHER = 2
EVERYTHING = 2**63
AT_MS = 1_700_000_000_000


class Backend(Protocol):
    def commit(self, operations: Sequence[Operation], records: dict[str, dict[str, Any]] | None = None) -> None: ...
    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]: ...
    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None: ...
    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]: ...
    def leases(self, queue_id: int) -> list[StoredLease]: ...
    def payload(self, queue_id: int, index: int) -> bytes | None: ...
    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]: ...
    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]: ...
    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None: ...
    def status_producer(self, queue_id: int, index: int) -> str | None: ...
    def payloads_and_headers(self, reads: list[tuple[int, int]]) -> list[tuple[bytes | None, dict[str, str] | None]]:
        """As a commit's payload reads give them (a batch of leases: CommitResult)."""
        ...
    def snapshot_rows(self, name: str, queue_id: int) -> list[list[Any]]: ...
    def install(self, queue_id: int, rows: list[list[Any]]) -> None: ...
    def discard_after(self, queue_id: int, order: int) -> None: ...


class MemoryBackend:
    def __init__(self, tmp_path: Path) -> None:
        self.store = MemoryStore()

    def commit(self, operations: Sequence[Operation], records: dict[str, dict[str, Any]] | None = None) -> None:
        self.store.apply(list(operations))

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        return self.store.ready_page(queue_id, priority, after_index, before_index, limit)

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        return self.store.dedupe_lookup(queue_id, producer_key(PRODUCER, dedupe_id))

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        found = self.store.dedupe_lookup_many(queue_id, [producer_key(PRODUCER, d) for d in dedupe_ids])
        return {key.split("\x1f", 1)[1]: at for key, at in found.items()}

    def leases(self, queue_id: int) -> list[StoredLease]:
        return sorted(self.store.leases(queue_id), key=lambda lease: lease.index)

    def payload(self, queue_id: int, index: int) -> bytes | None:
        return self.store.payload(queue_id, index)

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.store.ttl_rows(queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.store.delayed_rows(queue_id)

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        return self.store.message_status(queue_id, index)

    def status_producer(self, queue_id: int, index: int) -> str | None:
        return self.store.status_producer(queue_id, index)

    def payloads_and_headers(self, reads: list[tuple[int, int]]) -> list[tuple[bytes | None, dict[str, str] | None]]:
        return [(self.store.payload(queue_id, index), self.store.headers(queue_id, index)) for queue_id, index in reads]

    def snapshot_rows(self, name: str, queue_id: int) -> list[list[Any]]:
        return memory_rows(self.store, queue_id, consumption=True, after_index=0)

    def install(self, queue_id: int, rows: list[list[Any]]) -> None:
        self.store.put_snapshot_rows(queue_id, None, rows)

    def discard_after(self, queue_id: int, order: int) -> None:
        self.store.discard_after(queue_id, order)

    def close(self) -> None:
        pass


class LmdbBackend:
    def __init__(self, tmp_path: Path) -> None:
        self.storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=64 << 20)

    def commit(self, operations: Sequence[Operation], records: dict[str, dict[str, Any]] | None = None) -> None:
        self.storage.commit(SealedBatch(operations=list(operations), queue_records=dict(records or {})))
        self.storage.end_read()   # the node's next step cycle reads in a new transaction

    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        return self.storage.ready_page(queue_id, priority, after_index, before_index, limit)

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        found = self.storage.dedupe_lookup(queue_id, producer_key(PRODUCER, dedupe_id))
        return None if found is None else tuple(found)  # type: ignore[return-value]

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        found = self.storage.dedupe_lookup_many(queue_id, [producer_key(PRODUCER, d) for d in dedupe_ids])
        return {key.split("\x1f", 1)[1]: tuple(at) for key, at in found.items()}  # type: ignore[misc]

    def leases(self, queue_id: int) -> list[StoredLease]:
        return sorted(self.storage.load_leases(queue_id), key=lambda lease: lease.index)

    def payload(self, queue_id: int, index: int) -> bytes | None:
        return self.storage.read_client_payload(queue_id, index)

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.storage.ttl_rows(queue_id)

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        return self.storage.delayed_rows(queue_id)

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        return self.storage.message_status(queue_id, index)

    def status_producer(self, queue_id: int, index: int) -> str | None:
        return self.storage.status_producer(queue_id, index)

    def payloads_and_headers(self, reads: list[tuple[int, int]]) -> list[tuple[bytes | None, dict[str, str] | None]]:
        result = self.storage.commit(SealedBatch(payload_reads=reads))
        self.storage.end_read()
        return list(zip(result.payloads, result.headers or [None] * len(reads), strict=True))

    def snapshot_rows(self, name: str, queue_id: int) -> list[list[Any]]:
        view = self.storage.open_snapshot(name, queue_id, consumption=True, after_index=0, dead_letter=None)
        assert view is not None
        try:
            return view.next_rows(1 << 40)
        finally:
            view.close()

    def install(self, queue_id: int, rows: list[list[Any]]) -> None:
        self.commit_batch(SealedBatch(snapshot_rows=[(queue_id, None, rows)]))

    def discard_after(self, queue_id: int, order: int) -> None:
        self.commit_batch(SealedBatch(truncations=[(queue_id, order)]))

    def commit_batch(self, batch: SealedBatch) -> None:
        self.storage.commit(batch)
        self.storage.end_read()

    def close(self) -> None:
        self.storage.close()


@pytest.fixture(params=[MemoryBackend, LmdbBackend], ids=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = request.param(tmp_path)
    yield backend
    backend.close()


# --- operation builders -----------------------------------------------------------------------
def enqueued(index: int, priority: int = 4, *, queue_id: int = QUEUE, dedupe_id: str | None = None,
             payload: bytes | None = None, at_ms: int = AT_MS) -> Enqueued:
    return Enqueued(queue_id, index, priority, at_ms, dedupe_id, PRODUCER,
                    payload if payload is not None else b"payload-%d-%d" % (queue_id, index))


def leased(index: int, priority: int = 4, *, queue_id: int = QUEUE, deliveries: int = 1,
           receipt: str | None = None, visibility_ms: int = 30_000) -> Leased:
    return Leased(queue_id, index, priority, receipt or f"{index:016x}", visibility_ms, deliveries, "consumer", AT_MS)


def released(index: int, priority: int = 4, *, queue_id: int = QUEUE, deliveries: int = 1,
             expired: bool = False) -> Released:
    return Released(queue_id, index, priority, deliveries, expired, AT_MS + 1)


def acked(index: int, priority: int = 4, *, queue_id: int = QUEUE, reply: bytes | None = None) -> Acked:
    return Acked(queue_id, index, priority, "consumer", AT_MS + 2, True, reply)


def whole(store: Backend, queue_id: int, priority: int) -> list[tuple[int, int]]:
    return store.ready_page(queue_id, priority, 0, EVERYTHING, 1 << 20)


# --- the contract, run against both stores ------------------------------------------------------
def test_an_enqueued_message_is_ready_at_its_priority_with_no_deliveries(store: Backend) -> None:
    store.commit([enqueued(1, 7, payload=b"hello")])
    assert whole(store, QUEUE, 7) == [(1, 0)]
    assert all(whole(store, QUEUE, priority) == [] for priority in range(10) if priority != 7)
    assert store.payload(QUEUE, 1) == b"hello"
    assert store.leases(QUEUE) == []


PAGE_WINDOWS = [(0, EVERYTHING, 100), (0, EVERYTHING, 3), (3, EVERYTHING, 100), (3, 9, 100), (3, 9, 2),
                (0, 1, 10), (0, 2, 10), (10, 20, 5), (11, 20, 5), (0, EVERYTHING, 0), (5, 5, 10), (9, 3, 10),
                (30, EVERYTHING, 10)]


@pytest.mark.parametrize(("after_index", "before_index", "limit"), PAGE_WINDOWS)
def test_a_ready_page_holds_indices_strictly_between_its_bounds_lowest_first_and_at_most_limit(
        store: Backend, after_index: int, before_index: int, limit: int) -> None:
    # Neighbouring keys (the priority on either side, the next queue) must never leak in.
    at_four = [1, 2, 3, 5, 8, 9, 13, 21]
    store.commit([enqueued(i, 4) for i in at_four] + [enqueued(i, 3) for i in (4, 6)]
                 + [enqueued(i, 5) for i in (7, 10, 11)] + [enqueued(i, 4, queue_id=OTHER) for i in (1, 12, 14)])
    expected = [(i, 0) for i in at_four if after_index < i < before_index][:limit]
    assert store.ready_page(QUEUE, 4, after_index, before_index, limit) == expected


def test_a_ready_page_reaches_the_largest_indices(store: Backend) -> None:
    big = [2**40, 2**62, 2**63 - 2]
    store.commit([enqueued(i, 9) for i in big] + [enqueued(1, 0, queue_id=OTHER)])
    assert whole(store, QUEUE, 9) == [(i, 0) for i in big]
    assert store.ready_page(QUEUE, 9, 2**40, EVERYTHING, 10) == [(2**62, 0), (2**63 - 2, 0)]


def test_a_lease_takes_the_message_out_of_ready_and_a_release_brings_it_back_with_its_deliveries(
        store: Backend) -> None:
    store.commit([enqueued(1), enqueued(2), enqueued(3)])
    store.commit([leased(2, deliveries=1, receipt="aa" * 8, visibility_ms=5)])
    assert whole(store, QUEUE, 4) == [(1, 0), (3, 0)]
    assert store.leases(QUEUE) == [StoredLease(2, 4, "aa" * 8, 5, 1, AT_MS)]
    store.commit([released(2, deliveries=1, expired=True)])
    assert whole(store, QUEUE, 4) == [(1, 0), (2, 1), (3, 0)]
    assert store.leases(QUEUE) == []
    store.commit([leased(2, deliveries=2), released(2, deliveries=2)])
    assert whole(store, QUEUE, 4) == [(1, 0), (2, 2), (3, 0)]
    assert store.payload(QUEUE, 2) == b"payload-1-2"


def test_an_ack_removes_the_lease_and_the_message(store: Backend) -> None:
    store.commit([enqueued(1), enqueued(2), leased(1), leased(2)])
    store.commit([acked(1), acked(2, reply=b"answer")])
    assert whole(store, QUEUE, 4) == []
    assert store.leases(QUEUE) == []
    assert store.payload(QUEUE, 1) is None and store.payload(QUEUE, 2) is None


def test_a_dead_letter_moves_the_message_to_its_queue_ready_with_no_deliveries(store: Backend) -> None:
    store.commit([enqueued(5, 6, payload=b"poison"), leased(5, 6, deliveries=3)])
    store.commit([DeadLettered(QUEUE, 5, 6, 3, OTHER, 1, AT_MS + 9, True)])
    assert store.leases(QUEUE) == [] and whole(store, QUEUE, 6) == []
    assert store.payload(QUEUE, 5) is None
    assert whole(store, OTHER, 6) == [(1, 0)]
    assert store.payload(OTHER, 1) == b"poison"


def test_messages_with_a_time_to_live_are_listed_until_they_leave_however_they_leave(store: Backend) -> None:
    ops: list[Operation] = [Enqueued(QUEUE, i, 4, AT_MS, None, "producer", b"m%d" % i, 1_000 * i) for i in range(1, 7)]
    store.commit(ops + [enqueued(7), enqueued(1, queue_id=OTHER)])
    assert store.ttl_rows(QUEUE) == [(i, 4, 1_000 * i) for i in range(1, 7)] and store.ttl_rows(OTHER) == []
    store.commit([leased(1), acked(1), Expired(QUEUE, 2, 4, False, AT_MS, True), leased(3),
                  Expired(QUEUE, 3, 4, True, AT_MS, True), DeadLettered(QUEUE, 4, 4, 0, OTHER, 2, AT_MS, True, 0, True, False)])
    assert store.ttl_rows(QUEUE) == [(5, 4, 5_000), (6, 4, 6_000)]
    assert whole(store, QUEUE, 4) == [(5, 0), (6, 0), (7, 0)] and store.leases(QUEUE) == []
    assert store.payload(QUEUE, 2) is None and store.payload(QUEUE, 3) is None
    assert store.payload(OTHER, 2) == b"m4" and whole(store, OTHER, 4) == [(1, 0), (2, 0)]
    with pytest.raises(InvariantViolation):
        store.commit([Expired(QUEUE, 7, 4, True, AT_MS, True)])       # not leased


def test_a_delayed_message_is_not_ready_until_it_matures_and_a_purge_takes_it(store: Backend) -> None:
    store.commit([Enqueued(QUEUE, 1, 4, AT_MS, None, "producer", b"d1", 0, 5_000),
                  Enqueued(QUEUE, 2, 6, AT_MS, None, "producer", b"d2", 0, 7_000), enqueued(3)])
    assert store.delayed_rows(QUEUE) == [(1, 4, 5_000), (2, 6, 7_000)] and whole(store, QUEUE, 4) == [(3, 0)]
    store.commit([Matured(QUEUE, 1, 4, AT_MS), Purged(QUEUE, 2, 6, False, AT_MS, True, 0, True)])
    assert store.delayed_rows(QUEUE) == [] and whole(store, QUEUE, 4) == [(1, 0), (3, 0)] and whole(store, QUEUE, 6) == []
    assert store.payload(QUEUE, 1) == b"d1" and store.payload(QUEUE, 2) is None
    with pytest.raises(InvariantViolation):
        store.commit([Matured(QUEUE, 3, 4, AT_MS)])       # not delayed


def test_a_dedupe_id_names_the_latest_enqueue_that_used_it_within_its_queue(store: Backend) -> None:
    store.commit([enqueued(1, dedupe_id="order-1", at_ms=AT_MS), enqueued(2, dedupe_id="order-2", at_ms=AT_MS + 1),
                   enqueued(1, queue_id=OTHER, dedupe_id="order-1", at_ms=AT_MS + 2)])
    assert store.dedupe_lookup(QUEUE, "order-1") == (1, AT_MS)
    assert store.dedupe_lookup(QUEUE, "order-2") == (2, AT_MS + 1)
    assert store.dedupe_lookup(OTHER, "order-1") == (1, AT_MS + 2)
    assert store.dedupe_lookup(OTHER, "order-2") is None
    assert store.dedupe_lookup(QUEUE, "order-") is None and store.dedupe_lookup(QUEUE, "order-10") is None
    store.commit([enqueued(3, dedupe_id="order-1", at_ms=AT_MS + 500_000)])
    assert store.dedupe_lookup(QUEUE, "order-1") == (3, AT_MS + 500_000)
    # An ack ends the message, not its dedupe id.
    store.commit([leased(3), acked(3)])
    assert store.dedupe_lookup(QUEUE, "order-1") == (3, AT_MS + 500_000)
    # A batch's ids in one read: only those kept answer.
    assert store.dedupe_lookup_many(QUEUE, ["order-1", "order-", "order-2", "missing"]) == {
        "order-1": (3, AT_MS + 500_000), "order-2": (2, AT_MS + 1)}


def test_dedupe_ids_are_matched_exactly_whatever_their_characters(store: Backend) -> None:
    ids = ["", "ö", "a/b", "x" * 300, "\x00", "日本"]
    store.commit([enqueued(n + 1, dedupe_id=dedupe_id) for n, dedupe_id in enumerate(ids)])
    assert [store.dedupe_lookup(QUEUE, dedupe_id) for dedupe_id in ids] == [(n + 1, AT_MS) for n in range(len(ids))]
    assert store.dedupe_lookup_many(QUEUE, ids) == {dedupe_id: (n + 1, AT_MS) for n, dedupe_id in enumerate(ids)}


def test_leases_are_listed_per_queue(store: Backend) -> None:
    store.commit([enqueued(i, i % 10) for i in range(1, 8)] + [enqueued(1, 0, queue_id=OTHER)])
    store.commit([leased(i, i % 10, deliveries=i, visibility_ms=i) for i in (6, 2, 4)]
                 + [leased(1, 0, queue_id=OTHER)])
    assert store.leases(QUEUE) == [StoredLease(i, i % 10, f"{i:016x}", i, i, AT_MS) for i in (2, 4, 6)]
    assert [lease.index for lease in store.leases(OTHER)] == [1]
    assert store.leases(3) == []


def test_leasing_a_message_that_is_not_ready_is_an_invariant_violation(store: Backend) -> None:
    store.commit([enqueued(1), leased(1)])
    with pytest.raises(InvariantViolation):
        store.commit([leased(1, deliveries=2)])
    with pytest.raises(InvariantViolation):
        store.commit([leased(9)])


def test_dead_lettering_a_message_without_a_body_is_an_invariant_violation(store: Backend) -> None:
    with pytest.raises(InvariantViolation):
        store.commit([DeadLettered(QUEUE, 9, 4, 3, OTHER, 1, AT_MS, True)])


# --- the two stores side by side on random operation sequences --------------------------------
# Every Operation type reaches both stores (COVERED is checked against replication/operations.py),
# with times to live, delays, headers, replies and dedupe ids, under both strengths (durable
# subscriptions need `full`); after every batch both answer every read the node makes of them
# alike, a snapshot cut from each is the same rows and installs alike, and so does a discarded
# suffix (`Storage._truncate` beside `MemoryStore.discard_after`).
COVERED = {Enqueued, Leased, Extended, Released, Acked, DeadLettered, Purged, Expired, Matured,
           SubscriptionOpened, SubscriberAcked, SubscriptionDropped}
SNAPSHOT_EVERY = 15          # batches between snapshots of QUEUE into a queue of its own
COPIES = 100                 # the first such queue's id


def random_batches(seed: int, batches: int, seen: set[type] | None = None
                   ) -> Iterator[tuple[list[Operation], dict[str, dict[str, Any]]]]:
    """Batches a real QueueCore decides on random commands: odd seeds run the queue under
    `full` (every step ordered; durable subscriptions), and seeds 2 and 5 without its dead-letter
    queue (a message past its time to live or its deliveries then leaves as Expired)."""
    rng = random.Random(seed)
    reference = MemoryStore()
    now_ms = AT_MS
    strength = Strength.FULL if seed % 2 else Strength.PRODUCER
    options = QueueOptions(strength=strength, max_deliveries=3, dead_letter=seed % 3 != 2)
    core = QueueCore(QueueRecord(QUEUE, "orders", options, AT_MS), reference, rng, lease_clock=lambda: now_ms,
                     dedupe_window_ms=1_000)
    dead = QueueCore(QueueRecord(OTHER, "orders.dlq", QueueOptions(strength=strength, dead_letter=False), AT_MS,
                                 dead_letter_of="orders"), reference, rng, lease_clock=lambda: now_ms)
    core.dead_letter_core = dead
    held: list[Leased] = []
    for _ in range(batches):
        out: list[Operation] = []
        for _ in range(rng.randint(1, 12)):
            now_ms += rng.randint(0, 300)
            roll = rng.random()
            if roll < 0.4:
                dedupe_id = f"d{rng.randrange(5)}" if rng.random() < 0.3 else None
                ttl_ms = rng.randint(200, 3_000) if rng.random() < 0.2 else 0
                delay_ms = rng.randint(100, 2_000) if rng.random() < 0.15 else 0
                headers = {"h": str(rng.randrange(100))} if rng.random() < 0.2 else None
                core.enqueue(rng.randbytes(rng.randrange(64)), rng.randrange(10), dedupe_id, PRODUCER, now_ms, out,
                             ttl_ms, delay_ms, headers)
            elif roll < 0.6:
                held += core.lease(rng.randint(1, 4), rng.randint(100, 6_000), "c", now_ms, out)
            elif roll < 0.78 and held:
                lease = held.pop(rng.randrange(len(held)))
                try:
                    if rng.random() < 0.6:
                        reply = rng.randbytes(8) if rng.random() < 0.3 else None
                        core.ack(lease.index, lease.receipt, "c", now_ms, out, reply=reply)
                    else:
                        core.release(lease.index, lease.receipt, now_ms, out)
                except Exception as error:  # an overdue or superseded lease: refused, maybe ended
                    assert getattr(error, "code", None) == "E_LEASE_EXPIRED", error
            elif roll < 0.83 and held:
                lease = held[rng.randrange(len(held))]
                try:
                    core.extend(lease.index, lease.receipt, rng.randint(0, 1_500), "c", now_ms, out)
                except Exception as error:  # as above
                    assert getattr(error, "code", None) == "E_LEASE_EXPIRED", error
            elif roll < 0.85:
                core.purge(core.record.next_index - 1 - rng.randint(0, 8), rng.randint(1, 6), now_ms, out)
            elif roll < 0.88:
                core.expire_leases(now_ms, out)
            elif roll < 0.91:
                core.expire_messages(now_ms, out)
            elif roll < 0.94:
                core.mature_messages(now_ms, out)
            elif strength is Strength.FULL:
                subscription = f"s{rng.randrange(2)}"
                try:
                    if subscription not in core.record.subscriptions and rng.random() < 0.5:
                        core.open_subscription(subscription, "c", now_ms, out)
                    elif rng.random() < 0.85:
                        rows = reference.ready_page(QUEUE, SUBSCRIPTION_PRIORITY, 0, EVERYTHING, 20)
                        if rows:
                            core.subscriber_ack(subscription, rng.choice(rows)[0], "c", now_ms, out)
                    else:
                        core.drop_subscription(subscription, "c", now_ms, out)
                except QueueError:          # no such subscription (yet), or no such message
                    pass
        core.seal()
        reference.apply(out)
        core.advance()
        if seen is not None:
            seen.update(type(op) for op in out)
        yield out, {"orders": core.record.to_json(), "orders.dlq": dead.record.to_json()}


def everything_read(store: Backend, rng: random.Random, queue_ids: Sequence[int], top_index: int) -> dict[str, Any]:
    reads: dict[str, Any] = {}
    indices = range(top_index + 2)
    dedupe_ids = [f"d{n}" for n in range(6)]
    for queue_id in queue_ids:
        for priority in range(10):
            reads[f"ready {queue_id}/{priority}"] = whole(store, queue_id, priority)
            after, before, limit = rng.randrange(top_index + 2), rng.randrange(top_index + 2), rng.randint(0, 5)
            reads[f"page {queue_id}/{priority} ({after}, {before}, {limit})"] = store.ready_page(
                queue_id, priority, after, before, limit)
        reads[f"leases {queue_id}"] = store.leases(queue_id)
        reads[f"dedupe {queue_id}"] = [store.dedupe_lookup(queue_id, dedupe_id) for dedupe_id in dedupe_ids]
        reads[f"dedupe many {queue_id}"] = store.dedupe_lookup_many(queue_id, dedupe_ids)
        reads[f"ttl rows {queue_id}"] = store.ttl_rows(queue_id)
        reads[f"delayed rows {queue_id}"] = store.delayed_rows(queue_id)
        reads[f"payloads {queue_id}"] = [store.payload(queue_id, index) for index in indices]
        reads[f"statuses {queue_id}"] = [store.message_status(queue_id, index) for index in indices]
        reads[f"status producers {queue_id}"] = [store.status_producer(queue_id, index) for index in indices]
        reads[f"payloads and headers {queue_id}"] = store.payloads_and_headers([(queue_id, i) for i in indices])
    return reads


def assert_alike(memory: Backend, lmdb_store: Backend, queue_ids: Sequence[int], top_index: int, seed: int,
                 what_happened: str) -> None:
    memory_reads = everything_read(memory, random.Random(seed), queue_ids, top_index)
    lmdb_reads = everything_read(lmdb_store, random.Random(seed), queue_ids, top_index)
    for what, answer in memory_reads.items():
        assert lmdb_reads[what] == answer, f"{what_happened}: {what}"


@pytest.mark.parametrize("seed", range(6), ids=lambda seed: f"seed_{seed}")
def test_the_two_stores_answer_alike_after_every_batch_of_a_random_run(seed: int, tmp_path: Path) -> None:
    memory, lmdb_store = MemoryBackend(tmp_path), LmdbBackend(tmp_path)
    seen: set[type] = set()
    queue_ids = [QUEUE, OTHER]
    try:
        top_index = 0
        for number, (operations, records) in enumerate(random_batches(seed, 60, seen)):
            memory.commit(operations, records)
            lmdb_store.commit(operations, records)
            top_index = max(record["next_index"] for record in records.values())
            assert_alike(memory, lmdb_store, queue_ids, top_index, seed * 1_000 + number, f"seed {seed}, batch {number}")
            if number % SNAPSHOT_EVERY == SNAPSHOT_EVERY - 1:
                rows = memory.snapshot_rows("orders", QUEUE)
                assert lmdb_store.snapshot_rows("orders", QUEUE) == rows, f"seed {seed}, batch {number}: snapshot"
                copy = COPIES + number
                memory.install(copy, rows)
                lmdb_store.install(copy, rows)
                queue_ids.append(copy)
                assert_alike(memory, lmdb_store, [copy], top_index, seed, f"seed {seed}, batch {number}: installed")
        order = random.Random(seed).randrange(top_index + 1)
        for queue_id in queue_ids:
            memory.discard_after(queue_id, order)
            lmdb_store.discard_after(queue_id, order)
        assert_alike(memory, lmdb_store, queue_ids, top_index, seed, f"seed {seed}: discarded after {order}")
    finally:
        lmdb_store.close()
    expected = COVERED - ({Expired} if seed % 3 != 2 else {DeadLettered})   # with a dead-letter queue or not
    if not seed % 2:
        expected -= {SubscriptionOpened, SubscriberAcked, SubscriptionDropped}   # under full only
    assert seen == expected, f"seed {seed}: {sorted(kind.__name__ for kind in seen ^ expected)}"


def test_the_random_run_covers_every_operation_type() -> None:
    """A new Operation type must join COVERED (and the random run) to be held equal in both stores."""
    assert set(typing.get_args(Operation)) == COVERED


# --- LMDB only --------------------------------------------------------------------------------
def queue_record_json(queue_id: int = QUEUE, name: str = "orders", **changes: Any) -> dict[str, Any]:
    record = QueueRecord(queue_id, name, QueueOptions(), AT_MS, **changes)
    return record.to_json()


def open_storage(path: Path, map_size_bytes: int = 64 << 20, map_size_max_bytes: int = 1 << 40) -> Storage:
    return Storage(path, node_id="n1", map_size_bytes=map_size_bytes, map_size_max_bytes=map_size_max_bytes)


def test_a_commit_is_durable_across_close_and_reopen(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "db")
    record = queue_record_json(next_index=4, ready_count=1, epoch=3)
    storage.commit(SealedBatch(
        operations=[enqueued(1, dedupe_id="order-1"), enqueued(2, 9), enqueued(3, 0), leased(2, 9), leased(1),
                    acked(1)],
        queue_records={"orders": record}, next_queue_id=3, epochs={"orders": 3}))
    storage.close()

    storage = open_storage(tmp_path / "db")
    try:
        [loaded] = storage.load_queue_records()
        assert loaded.to_json() == record
        assert storage.next_queue_id() == 3
        assert storage.ready_page(QUEUE, 0, 0, EVERYTHING, 10) == [(3, 0)]
        assert storage.ready_page(QUEUE, 9, 0, EVERYTHING, 10) == []
        assert tuple(storage.dedupe_lookup(QUEUE, producer_key(PRODUCER, "order-1")) or ()) == (1, AT_MS)
        assert storage.load_leases(QUEUE) == [StoredLease(2, 9, f"{2:016x}", 30_000, 1, AT_MS)]
        assert storage.read_client_payload(QUEUE, 3) == b"payload-1-3"
        assert storage.message_status(QUEUE, 1) == ("acked", 0, None)
        assert storage.message_status(QUEUE, 2) == ("delivered", 1, None)
        assert storage.message_status(QUEUE, 3) == ("queued", 0, None)
        assert storage.message_status(QUEUE, 4) is None
    finally:
        storage.close()


def test_the_journal_holds_one_checksummed_record_per_operation_across_reopen(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "db")
    first: list[Operation] = [enqueued(1, 7, dedupe_id="order-1", payload=b"body"), leased(1, 7), released(1, 7, expired=True),
             leased(1, 7, deliveries=2), acked(1, 7, reply=b"answer")]
    records = {"orders": queue_record_json(epoch=5)}
    storage.commit(SealedBatch(operations=first, queue_records=records))
    storage.close()
    storage = open_storage(tmp_path / "db")
    try:
        second: list[Operation] = [enqueued(2, 1), leased(2, 1, deliveries=3), DeadLettered(QUEUE, 2, 1, 3, OTHER, 1, AT_MS + 7, True)]
        storage.commit(SealedBatch(operations=second, queue_records=records))
        journal = [dict(zip(JOURNAL_FIELDS, fields, strict=True)) for fields in storage.journal_records()]
    finally:
        storage.close()
    assert [(entry["op"], entry["message_id"]) for entry in journal] == [
        ("enqueue", 1), ("lease", 1), ("expire", 1), ("lease", 1), ("reply", 1),
        ("enqueue", 2), ("lease", 2), ("dead_letter", 2)]
    assert all((entry["queue"], entry["queue_id"], entry["epoch"], entry["node"]) == ("orders", QUEUE, 5, "n1")
               for entry in journal)
    assert (journal[0]["dedupe_id"], journal[0]["priority"], journal[0]["payload_size"],
            journal[0]["payload_crc32"]) == ("order-1", 7, 4, zlib.crc32(b"body"))


def test_a_corrupted_journal_record_is_detected(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "db")
    try:
        storage.commit(SealedBatch(operations=[enqueued(1), enqueued(2)]))
        with storage.env.begin(write=True, db=storage.db["journal"]) as txn:
            key, value = next(iter(txn.cursor()))
            body = msgpack.unpackb(value[:-4])
            body[6] = 99
            txn.put(key, msgpack.packb(body) + value[-4:])
        with pytest.raises(InvariantViolation):
            storage.journal_records()
    finally:
        storage.close()


def test_a_full_map_grows_once_then_refuses_and_loses_nothing(tmp_path: Path) -> None:
    initial, limit = 256 * 1024, 512 * 1024
    storage = open_storage(tmp_path / "db", map_size_bytes=initial, map_size_max_bytes=limit)
    committed: dict[int, bytes] = {}
    growths = 0
    try:
        for index in range(1, 200):
            payload = bytes([index % 251]) * 20_000
            batch = SealedBatch(operations=[enqueued(index, payload=payload)],
                                queue_records={"orders": queue_record_json(next_index=index + 1)})
            try:
                storage.commit(batch)
            except MapGrowthNeeded:
                storage.end_read()
                assert storage.read_client_payload(QUEUE, index) is None, "a refused batch left a trace"
                storage.end_read()
                if growths == 1:
                    with pytest.raises(StorageFull):
                        storage.grow_map()
                    break
                assert storage.grow_map() == 2 * initial
                growths += 1
                storage.commit(batch)
            committed[index] = payload
        else:
            pytest.fail("the map never filled")
        assert growths == 1 and storage.map_size() == limit
        assert len(committed) > 10
        assert_everything_readable(storage, committed)
        storage.close()
        storage = open_storage(tmp_path / "db", map_size_bytes=initial, map_size_max_bytes=limit)
        assert_everything_readable(storage, committed)
    finally:
        storage.close()


def assert_everything_readable(storage: Storage, committed: dict[int, bytes]) -> None:
    storage.end_read()
    assert storage.ready_page(QUEUE, 4, 0, EVERYTHING, 10_000) == [(index, 0) for index in sorted(committed)]
    for index, payload in committed.items():
        assert storage.read_client_payload(QUEUE, index) == payload
    [record] = storage.load_queue_records()
    assert record.next_index == max(committed) + 1
    assert len(storage.journal_records()) == len(committed)
    storage.end_read()
