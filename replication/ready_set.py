"""The ready messages of one queue: per priority, a heap of message indices, paged in from
storage on demand.

After a restart the heaps start empty and pages of pre-restart messages are loaded when
needed (`fill_head`), so a node holding a million messages serves at once. Invariant per
priority: the heap holds every ready message with index <= its loaded-up-to point, plus any
newer ones (everything made ready since the restart); a page is loaded whenever the heap's
head lies beyond that point, which keeps delivery in (priority, index) order.

Apart from the queue core (replication/queue_core.py) because this is one data structure with
its own invariant (heaps, pages, the indices to skip when a page comes in), read the same by
the master's decisions and a member's apply; the core keeps the record's counters.
"""
from __future__ import annotations

import heapq

from replication.options import PRIORITY_MAX
from replication.store import StoreReader

READY_PAGE_SIZE = 1024


class ReadySet:
    """`heaps[priority]`: ready indices, the lowest first once `fill_head(priority)` said so;
    `deliveries`: index -> deliveries so far, for ready messages delivered before."""
    __slots__ = ("_reader", "_queue_id", "heaps", "deliveries", "boundary", "_loaded_upto", "_exhausted",
                 "_pushed_beyond", "_removed")

    def __init__(self, reader: StoreReader, queue_id: int, boundary: int, *, empty: bool) -> None:
        """`boundary`: every index below it was stored before this set was built (pages of
        storage hold those); `empty`: storage holds no ready message of the queue."""
        self._reader = reader
        self._queue_id = queue_id
        self.heaps: list[list[int]] = [[] for _ in range(PRIORITY_MAX + 1)]
        self.deliveries: dict[int, int] = {}
        self.boundary = boundary
        self._loaded_upto = [0] * (PRIORITY_MAX + 1)
        self._exhausted = [empty] * (PRIORITY_MAX + 1)
        self._pushed_beyond: list[set[int]] = [set() for _ in range(PRIORITY_MAX + 1)]
        self._removed: set[int] = set()   # ready indices taken out of order by a member's apply

    def reset(self, boundary: int) -> None:
        """Hold nothing in memory: every ready message below `boundary` is paged in from
        storage, as after a restart (a snapshot installed over an instance that held nothing)."""
        self.boundary = boundary
        self.heaps = [[] for _ in range(PRIORITY_MAX + 1)]
        self.deliveries = {}
        self._loaded_upto = [0] * (PRIORITY_MAX + 1)
        self._exhausted = [False] * (PRIORITY_MAX + 1)
        self._pushed_beyond = [set() for _ in range(PRIORITY_MAX + 1)]
        self._removed = set()

    def push(self, priority: int, index: int, deliveries: int = 0) -> None:
        """A message new to this member (enqueued, dead-lettered into the queue, a snapshot's row)."""
        heapq.heappush(self.heaps[priority], index)
        if deliveries:
            self.deliveries[index] = deliveries

    def make_ready(self, index: int, priority: int, deliveries: int) -> None:
        """A message ready again (a lease ended without an ack) or at last (its delay ran out)."""
        if index in self._removed:
            # Taken out of order (a lease through a virtual queue, a member's apply): no longer
            # to be skipped. Where its copy is still in the heap it is live again as it is: a
            # second copy would be skipped in its place, and were it taken out of order again
            # (one mark in the set) the other copy would be delivered while it is leased.
            self._removed.discard(index)
            if index >= self.boundary or index <= self._loaded_upto[priority] or index in self._pushed_beyond[priority]:
                if deliveries:
                    self.deliveries[index] = deliveries
                return
            # Its page is not loaded: the copy pushed below is the one, and the page skips its row.
        heapq.heappush(self.heaps[priority], index)
        if self._loaded_upto[priority] < index < self.boundary:
            # A pre-restart message whose page is not loaded yet: the page load must skip it,
            # since it may or may not see the committed copy of this operation.
            self._pushed_beyond[priority].add(index)
        if deliveries:
            self.deliveries[index] = deliveries

    def take(self, priority: int, index: int) -> None:
        """Remove one ready message that is not necessarily at its heap's head."""
        if self.fill_head(priority) and self.heaps[priority][0] == index:
            heapq.heappop(self.heaps[priority])
        else:
            self._removed.add(index)      # skipped when it reaches a head or a page load
        self.deliveries.pop(index, None)

    def fill_head(self, priority: int) -> bool:
        """True when the priority's heap head is the lowest ready index of that priority."""
        heap = self.heaps[priority]
        removed = self._removed
        while True:
            while not self._exhausted[priority] and (not heap or heap[0] > self._loaded_upto[priority]):
                self._load_page(priority)
            if not heap or not removed or heap[0] not in removed:
                return bool(heap)
            removed.discard(heapq.heappop(heap))

    def _load_page(self, priority: int) -> None:
        rows = self._reader.ready_page(self._queue_id, priority, self._loaded_upto[priority],
                                       self.boundary, READY_PAGE_SIZE)
        heap, skip = self.heaps[priority], self._pushed_beyond[priority]
        for index, deliveries in rows:
            if index in skip:
                skip.discard(index)
                continue
            if index in self._removed:
                self._removed.discard(index)
                continue
            heapq.heappush(heap, index)
            if deliveries:
                self.deliveries[index] = deliveries
        if len(rows) < READY_PAGE_SIZE:
            self._exhausted[priority] = True
            self._loaded_upto[priority] = self.boundary
            skip.clear()
        else:
            self._loaded_upto[priority] = rows[-1][0]

    def discard_after(self, order: int) -> tuple[int, list[tuple[int, int]]]:
        """Drop every ready message past `order` (QueueCore.discard_after): returns how many
        there were (those stored before this set was built counted on their pages, which are
        never loaded again) and the (priority, index) dropped from memory."""
        boundary, on_disk = self.boundary, 0
        if order + 1 < boundary:
            for priority in range(PRIORITY_MAX + 1):
                after = order
                while rows := self._reader.ready_page(self._queue_id, priority, after, boundary, READY_PAGE_SIZE):
                    on_disk += len(rows)
                    after = rows[-1][0]
                    if len(rows) < READY_PAGE_SIZE:
                        break
            self.boundary = order + 1           # pages past it are never loaded again
            self._loaded_upto = [min(upto, order) for upto in self._loaded_upto]
            self._pushed_beyond = [{index for index in pushed if index <= order} for pushed in self._pushed_beyond]
        dropped: list[tuple[int, int]] = []
        for priority, heap in enumerate(self.heaps):
            if any(index > order for index in heap):
                dropped += [(priority, index) for index in heap if index > order and index not in self._removed]
                kept = [index for index in heap if index <= order]
                heapq.heapify(kept)
                self.heaps[priority] = kept
        for _, index in dropped:
            self.deliveries.pop(index, None)
        self._removed = {index for index in self._removed if index <= order}
        count = on_disk + sum(1 for _, index in dropped if index >= boundary)   # below it: counted on disk
        return count, dropped
