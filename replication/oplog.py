"""The replicated operation log of each queue, as the replication roles read it.

The log is a sequence of entries. An entry is a run of consecutive replicated operations
(what the master decided for the queue in one step of its engine, split at
ENTRY_OPERATIONS_MAX operations or ENTRY_BYTES_MAX payload bytes), encoded once, digested
once and stored as one record keyed by (queue, ordering index of its last operation), with
the rolling digest after it. A batch of 100 enqueues is one record, not 100. Both members
hold the same entries (the replica logs what the master streamed), so every position a
member can hold, acknowledge or be compared at is the end of an entry. The master streams a
returning replica's missing suffix from it (catch-up costs what was missed, not the queue's
size) and both compare digests at such a position.
The log is bounded: records below what every member still needs are truncated (see
MasterRole.log_floor), and a snapshot installed at order S leaves a mark at S (its digest, no
operation) from which the log goes on. `MemoryOpLog` is the in-memory twin; the node's LMDB
storage implements the same reads.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from replication.messages import encode_entry
from replication.operations import Enqueued, Operation

ENTRY_OPERATIONS_MAX = 1_000          # operations per log entry
ENTRY_BYTES_MAX = 512 << 10           # payload bytes per log entry: far below a peer link's send
                                      # queue, which must always take one Append of one entry


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One record of the op log: a run of replicated operations with the digest after it."""
    ops: list[Operation]
    digest: bytes
    encoded: bytes          # encode_entry(ops): what is streamed, digested and logged

    @property
    def first(self) -> int:
        return self.ops[0].order

    @property
    def last(self) -> int:
        return self.ops[-1].order

    def row(self, queue_id: int) -> tuple[int, int, int, bytes, bytes]:
        """The entry as the storage's op-log row (SealedBatch.oplog_rows)."""
        return queue_id, self.first, self.last, self.digest, self.encoded


def runs(ops: list[Operation]) -> list[list[Operation]]:
    """Split operations decided together into the runs that become log entries."""
    out: list[list[Operation]] = []
    run: list[Operation] = []
    size = 0
    for op in ops:
        if run and (len(run) >= ENTRY_OPERATIONS_MAX or size >= ENTRY_BYTES_MAX):
            out.append(run)
            run, size = [], 0
        run.append(op)
        if type(op) is Enqueued:
            size += len(op.payload)
    if run:
        out.append(run)
    return out


class OpLogReader(Protocol):
    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        """(first order, last order, encoded entry) of the entries ending after `after_order`,
        ascending: at least one if there is one, then until they cover `limit` operations or
        `bytes_max` encoded bytes."""
        ...

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        """The rolling digest right after `order`, or None if this log does not hold it (an
        order inside an entry has none)."""
        ...

    def last(self, queue_id: int) -> tuple[int, bytes]:
        """(highest order held, digest after it); (0, empty digest) for an empty log."""
        ...

    def first(self, queue_id: int) -> int:
        """The log's start: it serves a member at any order from here on (0: from the queue's
        beginning). Records below it were truncated; its own record may be a snapshot's mark."""
        ...


class MemoryOpLog:
    """In-memory twin: `append` is called only for durable operations by the simulator."""

    def __init__(self, empty_digest: bytes) -> None:
        self._orders: dict[int, list[int]] = {}     # each entry's last order
        self._entries: dict[int, dict[int, tuple[list[Operation] | None, bytes, bytes]]] = {}
        self._starts: dict[int, int] = {}
        self._empty = empty_digest

    def append(self, queue_id: int, ops: list[Operation], digest: bytes, encoded: bytes = b"") -> None:
        orders = self._orders.setdefault(queue_id, [])
        if orders and ops[0].order <= orders[-1]:
            raise ValueError(f"oplog order {ops[0].order} after {orders[-1]}")
        orders.append(ops[-1].order)
        self._entries.setdefault(queue_id, {})[ops[-1].order] = (list(ops), digest, encoded or encode_entry(ops))

    def clear(self, queue_id: int) -> None:
        self._orders.pop(queue_id, None)
        self._entries.pop(queue_id, None)
        self._starts.pop(queue_id, None)

    def truncate(self, queue_id: int, floor: int) -> int:
        """Delete the entries ending below `floor` (the one ending at floor stays: its digest
        is where a member at floor resumes); returns how many went."""
        orders = self._orders.get(queue_id, [])
        cut = bisect.bisect_left(orders, floor)
        if cut == 0 or floor <= self._starts.get(queue_id, 0):
            return 0
        entries = self._entries[queue_id]
        for order in orders[:cut]:
            del entries[order]
        del orders[:cut]
        self._starts[queue_id] = floor
        return cut

    def install(self, queue_id: int, order: int, digest: bytes) -> None:
        """A snapshot installed at `order`: its mark (digest, no operation) starts the log there;
        records past it go (a member keeping its own state holds none: it discarded them)."""
        orders = self._orders.setdefault(queue_id, [])
        entries = self._entries.setdefault(queue_id, {})
        for old in [o for o in orders if o >= order]:
            del entries[old]
        orders[:] = [o for o in orders if o < order]
        orders.append(order)
        entries[order] = (None, digest, b"")
        self._starts[queue_id] = order

    def first(self, queue_id: int) -> int:
        return self._starts.get(queue_id, 0)

    def discard_after(self, queue_id: int, order: int) -> None:
        """Delete the entries ending past `order` (an uncommitted suffix, or a cut-short
        transfer's)."""
        orders = self._orders.get(queue_id, [])
        cut = bisect.bisect_right(orders, order)
        entries = self._entries.get(queue_id, {})
        for old in orders[cut:]:
            del entries[old]
        del orders[cut:]

    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        orders = self._orders.get(queue_id, [])
        start = bisect.bisect_right(orders, after_order)
        entries = self._entries.get(queue_id, {})
        out: list[tuple[int, int, bytes]] = []
        size = 0
        for o in orders[start:]:
            ops, _, encoded = entries[o]
            if ops is None:
                continue
            out.append((ops[0].order, o, encoded))
            size += len(encoded)
            if o - after_order >= limit or size >= bytes_max:
                break
        return out

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        if order == 0:
            return self._empty
        entry = self._entries.get(queue_id, {}).get(order)
        return None if entry is None else entry[1]

    def last(self, queue_id: int) -> tuple[int, bytes]:
        orders = self._orders.get(queue_id, [])
        if not orders:
            return 0, self._empty
        return orders[-1], self._entries[queue_id][orders[-1]][1]

    def operations(self, queue_id: int) -> list[Operation]:
        """The operations held (a snapshot's mark is none)."""
        entries = self._entries.get(queue_id, {})
        return [op for o in self._orders.get(queue_id, []) for op in (entries[o][0] or ())]
