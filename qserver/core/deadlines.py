"""Each queue's next timed step (a lease running out, a delayed message maturing, a message's
time to live ending) in one heap, so that a turn of the engine costs what changed in it, not
the number of queues the node holds (issue 31: with 1,000 queues, asking every queue for its
deadline on every turn was a third of the node's time).

A queue whose deadline may have moved is marked `changed` (the engine does it whenever it
touches a core, and the pair driver whenever a queue's role changes); `refresh` asks only
those. Entries superseded by a later refresh stay in the heap until they reach its top and
are dropped there; the heap is rebuilt when such entries outnumber the live ones.
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
        self._changed: set[str] = set()

    def changed(self, name: str) -> None:
        self._changed.add(name)

    def changed_all(self, names: Iterable[str]) -> None:
        self._changed.update(names)

    def refresh(self, deadline_of: Callable[[str], int | None]) -> None:
        """Ask each changed queue for its deadline (None: nothing timed, or not decided here)."""
        if not self._changed:
            return
        heap, deadlines = self._heap, self._deadline
        for name in sorted(self._changed):          # sorted: a simulation replays the same heap
            deadline = deadline_of(name)
            if deadline is None:
                deadlines.pop(name, None)
            elif deadlines.get(name) != deadline:
                deadlines[name] = deadline
                heapq.heappush(heap, (deadline, name))
        self._changed.clear()
        if len(heap) > 2 * len(deadlines) + REBUILD_SLACK:
            self._heap = [(deadline, name) for name, deadline in deadlines.items()]
            heapq.heapify(self._heap)
        self._drop_superseded()

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
        self._changed.update(due)
        return due

    def check(self, names: Iterable[str], deadline_of: Callable[[str], int | None]) -> None:
        """A simulation's check after a refresh: every queue's live entry is its deadline now."""
        for name in names:
            if name not in self._changed and self._deadline.get(name) != deadline_of(name):
                raise InvariantViolation(f"queue {name}: its timed steps are due at {deadline_of(name)}, "
                                         f"the engine's timer has {self._deadline.get(name)}")

    def _drop_superseded(self) -> None:
        heap, deadlines = self._heap, self._deadline
        while heap and deadlines.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)

    def __len__(self) -> int:
        return len(self._deadline)
