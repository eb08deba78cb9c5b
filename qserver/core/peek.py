"""Browsing a queue's messages without taking them: `peek` (a page in delivery order) and `read`
(one message by id), docs/PROTOCOL.md "Browsing messages (peek)".

Both run on the engine's task as a command (qserver/core/steps.py `_peek`), so they see one
consistent state, and they change nothing: no lease, no delivery counted, no operation decided,
nothing staged, journaled or logged. What they list is what the node has committed: the rows of
the node's last committed LMDB transaction (message, ready and header rows), not yet-unstored
decisions of the open batch, and in a pair nothing past the queue's commit point (the core's
`visible_upto`: docs/ARCHITECTURE.md Guarantee 2, consumers see only committed messages). A
lease or a delay comes from the core's memory, which is where the serving member keeps them;
a message whose row is stored but that the core no longer holds (acked in the batch being
stored) is not listed.

The order is the order receive hands messages out: priority 9 first, then by id. A leased or a
delayed message is listed at its place in that order, since that is where it is delivered from:
a lease that ends without an ack puts the message back there, and a delay that runs out makes
it ready there (replication/ready_set.py keeps one heap per priority, by index).

A page's cursor is its last message's place, `id * 10 + (9 - priority)` (`next_after`): the
place and not the id, because a message may leave the queue between two pages, and its id alone
would not say where in the order the next page starts. The scan stops once it has spent
SCAN_BUDGET_S of the loop and answers the page so far with its cursor (issue 35: a peek never
holds the loop over ~5 ms).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from qserver.storage.rows import ENTRY_AT, QI, QPI, U32
from replication.operations import Enqueued
from replication.options import PRIORITY_MAX
from replication.queue_core import PRIORITIES_HIGH_FIRST, QueueCore
from wire.errors import E_INTERNAL, E_INVALID_OPTION, E_UNKNOWN_MESSAGE, QueueError

LIMIT_DEFAULT = 100
LIMIT_MAX = 1000
PREVIEW_BYTES = 1024
# The loop time one peek's scan may take: it checks after each message and stops past it,
# answering the page so far. Packing and sending the answer come on top, and issue 35 asks a
# call's whole stall to stay within ~5 ms: with 4 ms the node's loop lag during peeks reached
# 5-10 ms on a loaded 2-core machine (bench/bench_peek.py; docs/PROTOCOL.md "Browsing messages").
SCAN_BUDGET_S = 0.003
CURSOR_MAX = 2**63 - 1
PLACES = PRIORITY_MAX + 1


def check_limit(limit: int) -> None:
    if not 1 <= limit <= LIMIT_MAX:
        raise QueueError(E_INVALID_OPTION, f"limit must be an integer between 1 and {LIMIT_MAX}")


def check_cursor(after: int) -> None:
    if not 0 <= after <= CURSOR_MAX:
        raise QueueError(E_INVALID_OPTION, "after is the previous page's next_after (0: from the start)")


def cursor_of(index: int, priority: int) -> int:
    return index * PLACES + (PRIORITY_MAX - priority)


def place_of(cursor: int) -> tuple[int, int]:
    """(priority, index) of a cursor: the page after it starts past that index in that priority."""
    return PRIORITY_MAX - cursor % PLACES, cursor // PLACES


# Where an Enqueued operation's row in an op-log entry holds the message's index and payload
# (replication/messages.py encodes an operation as [tag, field, ...] in field order).
_ENQUEUED_FIELDS = [field.name for field in dataclasses.fields(Enqueued)]
_INDEX_AT, _PAYLOAD_AT = _ENQUEUED_FIELDS.index("index") + 1, _ENQUEUED_FIELDS.index("payload") + 1
_ENTRIES_KEPT = 8


class _Payloads:
    """Payloads whose one copy is in their enqueue's op-log entry (qserver/storage/rows.py,
    EntryPayloads), read for a browse: each entry unpacked once per call, its enqueues' payloads
    picked by position without building the operations (an entry of 500 messages of 1 KiB took
    ~0.7 ms to decode into operations, ~0.2 ms this way: it is the scan's largest step)."""
    __slots__ = ("_txn", "_oplog", "_entries")

    def __init__(self, txn: Any, oplog: Any) -> None:
        self._txn, self._oplog = txn, oplog
        self._entries: dict[int, dict[int, bytes]] = {}

    def resolve(self, queue_id: int, index: int, held: Any) -> bytes:
        if type(held) is bytes:
            return held
        entry = self._entries.get(held)
        if entry is None:
            raw = self._txn.get(QI.pack(queue_id, held), db=self._oplog)
            rows = msgpack.unpackb(raw[ENTRY_AT:], raw=False) if raw is not None and len(raw) > ENTRY_AT else []
            entry = {row[_INDEX_AT]: row[_PAYLOAD_AT] for row in rows if row[0] == Enqueued.TAG}
            if len(self._entries) >= _ENTRIES_KEPT:
                self._entries.clear()
            self._entries[held] = entry
        payload = entry.get(index)
        if payload is None:      # the core would stop on this when it delivers; a browse only says so
            raise QueueError(E_INTERNAL, f"message {queue_id}/{index} names op-log entry {held}, which lacks it")
        return payload


class _Held:
    """What the core holds in memory of a queue's messages that are not ready: leases and delays.
    Walked once per call, grouped by priority: a cost of its own, outside the scan's time checks
    (~1 ms per 10,000 leased or delayed messages), which a page of ready messages never pays
    when the queue holds none."""
    __slots__ = ("leased", "delayed", "_by_priority")

    def __init__(self, core: QueueCore) -> None:
        # The core's own maps (replication/queue_core.py): read, never changed.
        self.leased: dict[int, Any] = core._leases           # index -> _Lease (priority, deliveries)
        self.delayed: dict[int, tuple[int, int]] = core._delayed   # index -> (due, priority)
        self._by_priority: list[list[tuple[int, str, int]]] | None = None

    def of_priority(self, priority: int, after: int) -> list[tuple[int, str, int]]:
        """(index, state, deliveries) of the leased and delayed messages of `priority` past `after`."""
        if not self.leased and not self.delayed:
            return []
        if self._by_priority is None:
            grouped: list[list[tuple[int, str, int]]] = [[] for _ in range(PLACES)]
            for index, lease in self.leased.items():
                grouped[lease.priority].append((index, "leased", lease.deliveries))
            for index, (_, held_priority) in self.delayed.items():
                grouped[held_priority].append((index, "delayed", 0))
            for group in grouped:
                group.sort()
            self._by_priority = grouped
        group = self._by_priority[priority]
        return group[bisect.bisect_right(group, (after, "~", 0)):]


class Scan:
    """One peek or read over one read transaction of the node's storage."""

    def __init__(self, storage: Any, core: QueueCore, *, preview: bool) -> None:
        self.core = core
        self.queue_id = core.queue_id
        self.preview = preview
        self.txn = storage.env.begin()
        self.db = storage.db
        self.payloads = _Payloads(self.txn, self.db["oplog"])
        self.held = _Held(core)
        upto = core.visible_upto
        self.visible_upto = (1 << 64) if upto is None else upto

    def close(self) -> None:
        self.txn.abort()

    def _ready(self, priority: int, after: int) -> Iterator[tuple[int, str, int]]:
        """The committed ready rows of `priority` past `after`, by index."""
        cursor = self.txn.cursor(db=self.db["ready"])
        if not cursor.set_range(QPI.pack(self.queue_id, priority, after + 1)):
            return
        queue_id, held = self.queue_id, self.held
        for key, value in cursor:
            owner, key_priority, index = QPI.unpack(key)
            if owner != queue_id or key_priority != priority:
                return
            if index in held.leased or index in held.delayed:
                continue       # leased or delayed since the row was stored: listed as such
            yield index, "ready", U32.unpack(value)[0] if value else 0

    def places(self, priority: int, after: int) -> Iterator[tuple[int, int, str, int]]:
        """(priority, index, state, deliveries) in delivery order from just past (priority, after)."""
        for current in PRIORITIES_HIGH_FIRST:
            if current > priority:
                continue
            floor = after if current == priority else 0
            merged = heapq.merge(self._ready(current, floor), self.held.of_priority(current, floor))
            for index, state, deliveries in merged:
                if index > self.visible_upto:
                    break          # not committed in the pair yet, and neither is anything newer
                yield current, index, state, deliveries

    def describe(self, index: int, priority: int, state: str, deliveries: int) -> dict[str, Any] | None:
        """The message as the answer lists it; None when its row is gone (it left the queue)."""
        raw = self.txn.get(QI.pack(self.queue_id, index), db=self.db["messages"])
        if raw is None:
            return None
        row = msgpack.unpackb(raw)           # [priority, enqueued_ms, dedupe_id, client, payload]
        payload = self.payloads.resolve(self.queue_id, index, row[4])
        raw_headers = self.txn.get(QI.pack(self.queue_id, index), db=self.db["headers"])
        size = len(payload)
        truncated = self.preview and size > PREVIEW_BYTES
        return {"id": index, "priority": priority, "state": state, "deliveries": deliveries,
                "enqueued_at_ms": int(row[1]), "headers": msgpack.unpackb(raw_headers) if raw_headers else {},
                "size": size, "payload": payload[:PREVIEW_BYTES] if truncated else payload, "truncated": truncated}

    def state_of(self, index: int) -> tuple[int, str, int] | None:
        """(priority, state, deliveries) of a message the queue holds and may show, else None."""
        if index > self.visible_upto:
            return None
        lease = self.held.leased.get(index)
        if lease is not None:
            return lease.priority, "leased", lease.deliveries
        delayed = self.held.delayed.get(index)
        if delayed is not None:
            return delayed[1], "delayed", 0
        raw = self.txn.get(QI.pack(self.queue_id, index), db=self.db["messages"])
        if raw is None:
            return None
        priority = int(msgpack.unpackb(raw)[0])
        value = self.txn.get(QPI.pack(self.queue_id, priority, index), db=self.db["ready"])
        if value is None:
            return None        # stored, but neither ready, leased nor delayed: leaving the queue
        return priority, "ready", U32.unpack(value)[0] if value else 0


def peek(storage: Any, core: QueueCore, after: int, limit: int, preview: bool,
         clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """A page of at most `limit` messages after cursor `after`: {"messages", "next_after"}."""
    check_limit(limit)
    check_cursor(after)
    started = clock()
    scan = Scan(storage, core, preview=preview)
    try:
        messages: list[dict[str, Any]] = []
        next_after: int | None = None
        last: tuple[int, int] | None = None
        places = scan.places(*place_of(after))
        for priority, index, state, deliveries in places:
            if len(messages) == limit or (messages and clock() - started > SCAN_BUDGET_S):
                next_after = cursor_of(*last) if last is not None else after   # more follow
                break
            message = scan.describe(index, priority, state, deliveries)
            last = (index, priority)
            if message is not None:
                messages.append(message)
        return {"messages": messages, "next_after": next_after}
    finally:
        scan.close()


def read(storage: Any, core: QueueCore, index: int) -> dict[str, Any]:
    """One message by id, in full; E_UNKNOWN_MESSAGE when the queue does not hold it."""
    scan = Scan(storage, core, preview=False)
    try:
        found = scan.state_of(index) if 0 < index <= CURSOR_MAX else None
        message = None if found is None else scan.describe(index, *found)
        if message is None:
            raise QueueError(E_UNKNOWN_MESSAGE, f"queue {core.name} holds no message {index}")
        return message
    finally:
        scan.close()
