"""Each queue's next timed step (a lease running out, a delayed message maturing, a message's
time to live ending) in one heap, so that a turn of the engine costs what changed in it, not
the number of queues the node holds (issue 31: with 1,000 queues, asking every queue for its
deadline on every turn was a third of the node's time).

A queue whose deadline may have moved is added to `changed` (the engine does it whenever it
touches a core, and the pair driver whenever a queue's role changes); `refresh` asks only
those (`changed` is a plain set its writers add to: a method around `add` was a call into
this module and back for every core touched). Entries superseded by a later refresh stay in
the heap until they reach its top and are dropped there; the heap is rebuilt when such
entries outnumber the live ones.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from replication.invariants import InvariantViolation

REBUILD_SLACK = 64     # superseded entries tolerated beyond the live ones before a rebuild


class DueQueues:
    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []    # (deadline, queue); superseded entries included
        self._deadline: dict[str, int] = {}       # queue -> the deadline its live entry holds
        self.changed: set[str] = set()            # queues whose deadline may have moved

    def refresh(self, deadlines_of: Callable[[list[str]], list[int | None]]) -> int | None:
        """Ask the changed queues for their deadlines (None: nothing timed, or not decided
        here), all in one call: a call back per queue crossed into the engine and back each time.
        Returns the next deadline (next_deadline), which the engine's timer wants after it."""
        if not self.changed:
            return self.next_deadline()
        heap, deadlines = self._heap, self._deadline
        names = sorted(self.changed)               # sorted: a simulation replays the same heap
        for name, deadline in zip(names, deadlines_of(names), strict=True):
            if deadline is None:
                deadlines.pop(name, None)
            elif deadlines.get(name) != deadline:
                deadlines[name] = deadline
                heapq.heappush(heap, (deadline, name))
        self.changed.clear()
        if len(heap) > 2 * len(deadlines) + REBUILD_SLACK:
            self._heap = [(deadline, name) for name, deadline in deadlines.items()]
            heapq.heapify(self._heap)
        return self.next_deadline()

    def next_deadline(self) -> int | None:
        self._drop_superseded()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: int) -> list[str]:
        """The queues whose deadline has come, earliest first; each is marked changed (the
        engine runs its steps, and the next refresh asks it for its next deadline)."""
        heap, deadlines, due = self._heap, self._deadline, []
        while heap and heap[0][0] <= now:
            deadline, name = heapq.heappop(heap)
            if deadlines.get(name) == deadline:
                del deadlines[name]
                due.append(name)
        self.changed.update(due)
        return due

    def check(self, names: Iterable[str], deadlines_of: Callable[[list[str]], list[int | None]]) -> None:
        """A simulation's check after a refresh: every queue's live entry is its deadline now."""
        names = [name for name in names if name not in self.changed]
        for name, deadline in zip(names, deadlines_of(names), strict=True):
            if self._deadline.get(name) != deadline:
                raise InvariantViolation(f"queue {name}: its timed steps are due at {deadline}, "
                                         f"the engine's timer has {self._deadline.get(name)}")

    def _drop_superseded(self) -> None:
        heap, deadlines = self._heap, self._deadline
        while heap and deadlines.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)

    def __len__(self) -> int:
        return len(self._deadline)
