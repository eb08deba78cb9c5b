"""Virtual queues on the node (replication/views.py; docs/PROTOCOL.md, "Virtual queues"): receive,
peek and count through a view, reading what a filter looks at (the message's producer and
headers) from the node's storage.

A filter looks at the committed rows of the node's last LMDB transaction, as peek does
(qserver/core/peek.py): the message row's producer (`[priority, enqueued_ms, dedupe_id, client,
payload]`) and the headers row. A message decided in the batch not yet stored has no row: a view
sees it once the batch is stored (a few ms later), the same moment a peek would list it.

Every scan is bounded. A receive looks at up to VIEW_SCAN_MAX ready messages and at most
SCAN_BUDGET_S of the loop; when either runs out it leases what it found by then (maybe nothing:
the answer is then empty, as when no message matches, and the next receive looks again from the
head). A peek stops the same way and answers its page so far with its cursor. A view's depth in
the queue's stats counts matching ready messages up to DEPTH_COUNT_MAX (and the same time), and
says `depth_exact: false` when it stopped before the end: "at least depth".
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack

from qserver.core import peek
from qserver.storage.rows import QI
from replication.operations import Leased, Operation
from replication.queue_core import QueueCore
from replication.view_lease import lease_matching, ready_in_order
from replication.views import View, find_view
from wire.errors import E_UNKNOWN_VIEW, QueueError

VIEW_SCAN_MAX = 10_000     # ready messages one receive through a view looks at, at most
DEPTH_COUNT_MAX = 10_000   # a view's depth is counted up to this (then "at least")
SCAN_BUDGET_S = peek.SCAN_BUDGET_S


def view_of(core: QueueCore, name: str) -> View:
    view = find_view(core.options.views, name)
    if view is None:
        raise QueueError(E_UNKNOWN_VIEW, f"queue {core.name} has no view {name!r}")
    return view


class _Facts:
    """What a filter looks at of each message, read from one read transaction."""
    __slots__ = ("scan",)

    def __init__(self, storage: Any, core: QueueCore) -> None:
        self.scan = peek.Scan(storage, core, preview=True)

    def matches(self, view: View, index: int) -> bool:
        scan = self.scan
        raw = scan.txn.get(QI.pack(scan.queue_id, index), db=scan.db["messages"])
        if raw is None:
            return False           # not stored yet (decided in the open batch), or gone
        client = msgpack.unpackb(raw)[3]
        raw_headers = scan.txn.get(QI.pack(scan.queue_id, index), db=scan.db["headers"])
        return view.matches(client or "", msgpack.unpackb(raw_headers) if raw_headers else None)

    def close(self) -> None:
        self.scan.close()


def lease_through_view(storage: Any, core: QueueCore, view_name: str, max_messages: int, visibility_ms: int | None,
                       client: str, now_ms: int, out: list[Operation],
                       clock: Callable[[], float] = time.perf_counter) -> list[Leased]:
    """Lease up to `max_messages` of the view's ready messages, in the queue's order."""
    view = view_of(core, view_name)
    facts = _Facts(storage, core)
    started, looked = clock(), 0

    def accept(index: int) -> bool | None:
        nonlocal looked
        looked += 1
        if looked > VIEW_SCAN_MAX or (looked % 64 == 0 and clock() - started > SCAN_BUDGET_S):
            return None
        return facts.matches(view, index)

    try:
        return lease_matching(core, accept, max_messages, visibility_ms, client, now_ms, out)
    finally:
        facts.close()


def peek_view(storage: Any, core: QueueCore, view_name: str, after: int, limit: int, preview: bool,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """A page of the view's messages (ready, leased, delayed) in delivery order, as peek.peek
    answers the queue's: {"messages", "next_after"}; the cursor is the queue's place."""
    view = view_of(core, view_name)
    peek.check_limit(limit)
    peek.check_cursor(after)
    started = clock()
    facts = _Facts(storage, core)
    scan = facts.scan
    try:
        messages: list[dict[str, Any]] = []
        next_after: int | None = None
        last: tuple[int, int] | None = None
        for priority, index, state, deliveries in scan.places(*peek.place_of(after)):
            if len(messages) == limit or (last is not None and clock() - started > SCAN_BUDGET_S):
                next_after = peek.cursor_of(*last) if last is not None else after   # more may follow
                break
            last = (index, priority)
            if not facts.matches(view, index):
                continue
            message = scan.describe(index, priority, state, deliveries)
            if message is not None:
                messages.append(message)
        return {"messages": messages, "next_after": next_after, "view": view.name}
    finally:
        facts.close()


def view_depths(storage: Any, core: QueueCore, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Each view's ready messages that match: {name: {"filter", "depth", "depth_exact"}}. Counted
    from the core's ready set in its order, up to DEPTH_COUNT_MAX looked at per view and
    SCAN_BUDGET_S for all of them; past either, `depth_exact` is false (at least `depth`)."""
    views = core.options.views
    if not views:
        return {}
    answer: dict[str, Any] = {}
    started = clock()
    facts = _Facts(storage, core)
    try:
        visible_upto = core.visible_upto
        for view in views:
            depth, looked, exact = 0, 0, True
            for priority in range(9, -1, -1):
                for index in ready_in_order(core, priority):
                    if visible_upto is not None and index > visible_upto:
                        break
                    looked += 1
                    if looked > DEPTH_COUNT_MAX or clock() - started > SCAN_BUDGET_S:
                        exact = False
                        break
                    depth += facts.matches(view, index)
                if not exact:
                    break
            answer[view.name] = {"filter": view.to_json(), "depth": depth, "depth_exact": exact}
        return answer
    finally:
        facts.close()
