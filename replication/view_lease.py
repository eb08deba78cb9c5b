"""Leasing through a virtual queue (replication/views.py; docs/PROTOCOL.md, "Virtual queues"):
the queue core's ready messages walked in its own order, and the ones a view's filter accepts
leased exactly as QueueCore.lease leases its heads.

Apart from replication/queue_core.py (at its size limit) and from replication/views.py (the
definitions, which the queue options import): this reads and changes the core's own structures
(its ready set, leases and timed messages) through the core's internal steps, as its own
methods do, on the engine's task only.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from replication.operations import Leased, Operation
from replication.queue_core import PRIORITIES_HIGH_FIRST, QueueCore, _Lease


def ready_in_order(core: QueueCore, priority: int) -> Iterator[int]:
    """The ready messages of one priority, lowest id first, lazily: the heap is walked from its
    root (a heap of heap positions), so the first k cost O(k log k) whatever the queue's depth.
    Pages of messages stored before a restart are loaded as the walk reaches them
    (replication/ready_set.py), after which it walks the grown heap again from the start,
    skipping what it already answered. The caller changes nothing while it iterates."""
    ready = core._ready          # the core's own set (replication/queue_core.py): read here, changed only there
    last = 0
    while ready.fill_head(priority):
        heap, removed = ready.heaps[priority], ready._removed
        loaded_upto, exhausted = ready._loaded_upto[priority], ready._exhausted[priority]
        frontier = [(heap[0], 0)]
        grown = False
        stale: set[int] = set()       # indices whose one copy to skip (ReadySet._removed) was met
        while frontier:
            index, position = heapq.heappop(frontier)
            if index > last:
                if not exhausted and index > loaded_upto:
                    ready._load_page(priority)          # stored messages may come before this one
                    grown = True
                    break
                if index in removed and index not in stale:
                    stale.add(index)
                else:
                    last = index
                    yield index
            for child in (2 * position + 1, 2 * position + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        if not grown:
            if exhausted:
                return
            ready._load_page(priority)      # every loaded one was walked: the next page of stored ones


def lease_matching(core: QueueCore, accept: Callable[[int], bool | None], max_messages: int,
                   visibility_ms: int | None, client: str, now_ms: int, out: list[Operation]) -> list[Leased]:
    """Lease up to `max_messages` ready messages that `accept(index)` takes, in the queue's own
    order (priority 9 first, then oldest), each exactly as QueueCore.lease leases its head: the
    same `Leased` operation, which every member applies as any lease (QueueCore.apply takes a
    ready message wherever it is in its heap). `accept` answers None once its budget is spent:
    what was found by then is leased, and the rest waits for the next receive."""
    if core.record.ready_count == 0:
        return []
    chosen: list[tuple[int, int]] = []
    visible_upto = core.visible_upto
    spent = False
    for priority in PRIORITIES_HIGH_FIRST:
        for index in ready_in_order(core, priority):
            if visible_upto is not None and index > visible_upto:
                break       # not committed in the pair yet, and neither is anything newer of this priority
            verdict = accept(index)
            if verdict is None:
                spent = True
                break
            if verdict:
                chosen.append((priority, index))
                if len(chosen) == max_messages:
                    break
        if spent or len(chosen) == max_messages:
            break
    if visibility_ms is None:
        visibility_ms = core.options.visibility_timeout_ms
    lease_now = core._lease_clock()
    leased: list[Leased] = []
    for priority, index in chosen:
        if index in core._ttl and core._ttl[index][0] <= lease_now:
            core._expire_ready(index, priority, now_ms, out, popped=False)    # never delivered
            continue
        deliveries = core._ready.deliveries.get(index, 0) + 1
        core._take_ready(priority, index)
        receipt = f"{core._rng.getrandbits(64):016x}"
        core._add_lease(index, _Lease(priority, receipt, visibility_ms, lease_now + visibility_ms, deliveries, now_ms))
        op = Leased(core.queue_id, index, priority, receipt, visibility_ms, deliveries, client, now_ms,
                    core._consumption_order())
        out.append(op)
        leased.append(op)
    return leased
