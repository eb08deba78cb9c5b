"""What a queue core may read from storage, and an in-memory twin of the node's storage.

The core keeps in memory only what it must decide on: leases in flight and the ready
messages it has loaded. After a restart it loads ready messages lazily, a bounded page at a
time, so a node holding millions of messages serves at once (`StoreReader.ready_page`).
`MemoryStore` applies the same operations as `qserver.storage.lmdb_store.Storage` and answers the same
reads; tests/test_store_contract.py runs one suite against both.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Protocol

from replication.invariants import InvariantViolation
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
from replication.options import producer_key
from replication.snapshot import ROW_DEDUPE, ROW_MESSAGE


class StoreReader(Protocol):
    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        """Committed ready messages of one priority with after_index < index < before_index,
        lowest first, at most `limit`: (index, deliveries so far)."""
        ...

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        """(message index, enqueued_ms) of a committed enqueue with this dedupe id, if kept."""
        ...

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        """The same for many ids at once (a batch's): only those kept are in the answer."""
        ...

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, ttl_ms) of every stored message of the queue with a time to live."""
        ...

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        """(index, priority, delay_ms) of every stored message of the queue still delayed."""
        ...


@dataclass(slots=True)
class StoredLease:
    index: int
    priority: int
    receipt: str
    visibility_ms: int       # a duration: see operations.Leased
    deliveries: int
    leased_ms: int


@dataclass
class _MemoryQueue:
    messages: dict[int, Enqueued] = field(default_factory=dict)
    ready: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # priority -> sorted (index, deliveries)
    leases: dict[int, StoredLease] = field(default_factory=dict)
    status: dict[int, tuple[str, bytes | None]] = field(default_factory=dict)
    producers: dict[int, str] = field(default_factory=dict)   # of the status rows (Storage: in the row)
    dedupe: dict[str, tuple[int, int]] = field(default_factory=dict)
    delayed: set[int] = field(default_factory=set)      # messages not ready until they mature


class MemoryStore:
    """In-memory twin of the LMDB storage: same reads, same operation semantics."""

    def __init__(self) -> None:
        self.queues: dict[int, _MemoryQueue] = {}

    def _queue(self, queue_id: int) -> _MemoryQueue:
        return self.queues.setdefault(queue_id, _MemoryQueue())

    # --- reads -----------------------------------------------------------------------------
    def ready_page(self, queue_id: int, priority: int, after_index: int, before_index: int,
                   limit: int) -> list[tuple[int, int]]:
        rows = self._queue(queue_id).ready.get(priority, [])
        start = bisect.bisect_right(rows, (after_index, 2**63))
        return [row for row in rows[start:start + limit] if row[0] < before_index]

    def dedupe_lookup(self, queue_id: int, dedupe_id: str) -> tuple[int, int] | None:
        return self._queue(queue_id).dedupe.get(dedupe_id)

    def message_status(self, queue_id: int, index: int) -> tuple[str, int, bytes | None] | None:
        """As Storage.message_status: the completed status, or 'delivered' (with its deliveries),
        'delayed' or 'queued' from where the message waits; None when none of them holds it."""
        queue = self.queues.get(queue_id)
        if queue is None:
            return None
        if index in queue.status:
            state, reply = queue.status[index]
            return state, 0, reply
        if index in queue.leases:
            return "delivered", queue.leases[index].deliveries, None
        if index in queue.delayed:
            return "delayed", 0, None
        if index in queue.messages:
            return "queued", 0, None
        return None

    def status_producer(self, queue_id: int, index: int) -> str | None:
        """As Storage.status_producer: who enqueued a message whose status is reported."""
        queue = self._queue(queue_id)
        if index in queue.status:
            return queue.producers.get(index)
        message = queue.messages.get(index)
        return None if message is None else message.client

    def dedupe_lookup_many(self, queue_id: int, dedupe_ids: list[str]) -> dict[str, tuple[int, int]]:
        kept = self._queue(queue_id).dedupe
        return {dedupe_id: kept[dedupe_id] for dedupe_id in dedupe_ids if dedupe_id in kept}

    def ttl_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        messages = self._queue(queue_id).messages
        return [(index, m.priority, m.ttl_ms) for index, m in sorted(messages.items()) if m.ttl_ms]

    def delayed_rows(self, queue_id: int) -> list[tuple[int, int, int]]:
        queue = self._queue(queue_id)
        return [(index, queue.messages[index].priority, queue.messages[index].delay_ms) for index in sorted(queue.delayed)]

    def leases(self, queue_id: int) -> list[StoredLease]:
        return list(self._queue(queue_id).leases.values())

    def payload(self, queue_id: int, index: int) -> bytes | None:
        message = self._queue(queue_id).messages.get(index)
        return None if message is None else message.payload

    def headers(self, queue_id: int, index: int) -> dict[str, str] | None:
        message = self._queue(queue_id).messages.get(index)
        return None if message is None else message.headers

    # --- writes ----------------------------------------------------------------------------
    def apply(self, operations: list[Operation]) -> None:
        for op in operations:
            getattr(self, "_apply_" + type(op).__name__)(op)

    def put_snapshot_rows(self, queue_id: int, dead_letter_queue_id: int | None, rows: list[list[Any]]) -> None:
        """Store a snapshot's rows (replication/snapshot.py) as Storage does."""
        for row in rows:
            if row[0] == ROW_DEDUPE:
                self._queue(queue_id).dedupe[row[1]] = (row[2], row[3])
                continue
            target = queue_id if row[0] == ROW_MESSAGE else dead_letter_queue_id
            if target is None:
                raise InvariantViolation(f"snapshot of queue {queue_id} has dead letters but no dead-letter queue")
            queue = self._queue(target)
            _, index, priority, enqueued_ms, dedupe_id, client, payload, deliveries, lease, ttl_ms, delay_ms, headers = row
            queue.messages[index] = Enqueued(target, index, priority, enqueued_ms, dedupe_id, client, payload, ttl_ms,
                                             delay_ms if lease is None else 0, headers)
            if lease is None and delay_ms:
                queue.delayed.add(index)
            elif lease is None:
                self._set_ready(queue, priority, index, deliveries)
            else:
                queue.leases[index] = StoredLease(index, priority, lease[0], lease[1], deliveries, lease[2])

    def _set_ready(self, queue: _MemoryQueue, priority: int, index: int, deliveries: int) -> None:
        bisect.insort(queue.ready.setdefault(priority, []), (index, deliveries))

    def _drop_ready(self, queue: _MemoryQueue, priority: int, index: int) -> bool:
        rows = queue.ready.get(priority, [])
        position = bisect.bisect_left(rows, (index, -1))
        if position < len(rows) and rows[position][0] == index:
            rows.pop(position)
            return True
        return False

    def _apply_Enqueued(self, op: Enqueued) -> None:
        queue = self._queue(op.queue_id)
        queue.messages[op.index] = op
        if op.delay_ms:
            queue.delayed.add(op.index)
        else:
            self._set_ready(queue, op.priority, op.index, 0)
        if op.dedupe_id is not None:
            queue.dedupe[producer_key(op.client, op.dedupe_id)] = (op.index, op.enqueued_ms)

    def _apply_Leased(self, op: Leased) -> None:
        queue = self._queue(op.queue_id)
        if not self._drop_ready(queue, op.priority, op.index):
            raise InvariantViolation(f"leased message {op.queue_id}/{op.index} was not ready")
        queue.leases[op.index] = StoredLease(op.index, op.priority, op.receipt, op.visibility_ms,
                                             op.deliveries, op.leased_ms)

    def _apply_Extended(self, op: Extended) -> None:
        lease = self._queue(op.queue_id).leases.get(op.index)
        if lease is None or lease.receipt != op.receipt:
            raise InvariantViolation(f"extended message {op.queue_id}/{op.index} is not so leased")
        lease.visibility_ms = op.visibility_ms

    def _apply_Matured(self, op: Matured) -> None:
        queue = self._queue(op.queue_id)
        if op.index not in queue.delayed:
            raise InvariantViolation(f"matured message {op.queue_id}/{op.index} was not delayed")
        queue.delayed.discard(op.index)
        self._set_ready(queue, op.priority, op.index, 0)

    def _apply_Purged(self, op: Purged) -> None:
        self._take_out(op, "purged", delayed=op.delayed)

    def _apply_Expired(self, op: Expired) -> None:
        self._take_out(op, "expired")

    def _take_out(self, op: Purged | Expired, state: str, *, delayed: bool = False) -> None:
        queue = self._queue(op.queue_id)
        if delayed:
            if op.index not in queue.delayed:
                raise InvariantViolation(f"{state} message {op.queue_id}/{op.index} was not delayed")
            queue.delayed.discard(op.index)
        elif op.leased:
            if queue.leases.pop(op.index, None) is None:
                raise InvariantViolation(f"{state} message {op.queue_id}/{op.index} was not leased")
        elif not self._drop_ready(queue, op.priority, op.index):
            raise InvariantViolation(f"{state} message {op.queue_id}/{op.index} was not ready")
        message = queue.messages.pop(op.index, None)
        if op.track_status:
            queue.status[op.index] = (state, None)
            if message is not None:
                queue.producers[op.index] = message.client

    # Durable subscriptions are queue state in the queue's record (QueueCore): nothing to store.
    def _apply_SubscriptionOpened(self, op: SubscriptionOpened) -> None:
        pass

    def _apply_SubscriberAcked(self, op: SubscriberAcked) -> None:
        pass

    def _apply_SubscriptionDropped(self, op: SubscriptionDropped) -> None:
        pass

    def _apply_Acked(self, op: Acked) -> None:
        queue = self._queue(op.queue_id)
        queue.leases.pop(op.index, None)
        message = queue.messages.pop(op.index, None)
        if op.track_status:
            queue.status[op.index] = ("replied" if op.reply is not None else "acked", op.reply)
            if message is not None:
                queue.producers[op.index] = message.client

    def _apply_Released(self, op: Released) -> None:
        queue = self._queue(op.queue_id)
        queue.leases.pop(op.index, None)
        self._set_ready(queue, op.priority, op.index, op.deliveries)

    def _apply_DeadLettered(self, op: DeadLettered) -> None:
        queue = self._queue(op.queue_id)
        if op.leased:
            queue.leases.pop(op.index, None)
        elif not self._drop_ready(queue, op.priority, op.index):
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} was not ready")
        message = queue.messages.pop(op.index, None)
        if message is None:
            raise InvariantViolation(f"dead-lettered message {op.queue_id}/{op.index} has no body")
        dead = self._queue(op.dead_letter_queue_id)
        dead.messages[op.dead_letter_index] = Enqueued(op.dead_letter_queue_id, op.dead_letter_index,
                                                       op.priority, op.at_ms, None, message.client,
                                                       message.payload, headers=message.headers)
        self._set_ready(dead, op.priority, op.dead_letter_index, 0)
        if op.track_status:
            queue.status[op.index] = ("dead_lettered", None)
            queue.producers[op.index] = message.client


    def discard_after(self, queue_id: int, order: int) -> None:
        """Erase a queue's messages past `order` (ready, delayed and dedupe entries too), as
        `Storage._truncate` does for a deposed master's uncommitted suffix."""
        queue = self.queues.get(queue_id)
        if queue is None:
            return
        for index in [index for index in queue.messages if index > order]:
            message = queue.messages.pop(index)
            self._drop_ready(queue, message.priority, index)
            queue.delayed.discard(index)
            key = None if message.dedupe_id is None else producer_key(message.client, message.dedupe_id)
            if key is not None and queue.dedupe.get(key, (0, 0))[0] == index:
                del queue.dedupe[key]


def drop_queue(store: MemoryStore, queue_id: int) -> None:
    """Forget everything of one queue incarnation (a deleted queue's records)."""
    store.queues.pop(queue_id, None)
