"""The replicated operation log of each queue, as the replication roles read it.

Both members append every replicated operation with the rolling digest after it, keyed by
(queue, ordering index). The master streams a returning replica's missing suffix from it
(catch-up costs what was missed, not the queue's size) and both compare digests at an index.
The log is bounded: records below what every member still needs are truncated (see
MasterRole.log_floor), and a snapshot installed at order S leaves a mark at S (its digest, no
operation) from which the log goes on. `MemoryOpLog` is the in-memory twin; the node's LMDB
storage implements the same reads.
"""
from __future__ import annotations

import bisect
from typing import Protocol

from replication.messages import encode_operation
from replication.operations import Operation


class OpLogReader(Protocol):
    def read(self, queue_id: int, after_order: int, limit: int) -> list[tuple[int, bytes]]:
        """(order, encoded operation) with order > after_order, ascending, at most `limit`."""
        ...

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        """The rolling digest right after `order`, or None if this log does not hold it."""
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
        self._orders: dict[int, list[int]] = {}
        self._entries: dict[int, dict[int, tuple[Operation | None, bytes, bytes]]] = {}
        self._starts: dict[int, int] = {}
        self._empty = empty_digest

    def append(self, queue_id: int, op: Operation, digest: bytes, encoded: bytes = b"") -> None:
        orders = self._orders.setdefault(queue_id, [])
        if orders and op.order <= orders[-1]:
            raise ValueError(f"oplog order {op.order} after {orders[-1]}")
        orders.append(op.order)
        self._entries.setdefault(queue_id, {})[op.order] = (op, digest, encoded or encode_operation(op))

    def clear(self, queue_id: int) -> None:
        self._orders.pop(queue_id, None)
        self._entries.pop(queue_id, None)
        self._starts.pop(queue_id, None)

    def truncate(self, queue_id: int, floor: int) -> int:
        """Delete the records below `floor` (the one at floor stays: its digest is where a
        member at floor resumes); returns how many went."""
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
        """Delete the records past `order` (an uncommitted suffix, or a cut-short transfer's)."""
        orders = self._orders.get(queue_id, [])
        cut = bisect.bisect_right(orders, order)
        entries = self._entries.get(queue_id, {})
        for old in orders[cut:]:
            del entries[old]
        del orders[cut:]

    def read(self, queue_id: int, after_order: int, limit: int) -> list[tuple[int, bytes]]:
        orders = self._orders.get(queue_id, [])
        start = bisect.bisect_right(orders, after_order)
        entries = self._entries.get(queue_id, {})
        return [(o, entries[o][2]) for o in orders[start:start + limit] if entries[o][0] is not None]

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
        return [op for o in self._orders.get(queue_id, []) if (op := entries[o][0]) is not None]
