"""A macro queue's consumer choices as pure functions of what the members' heads showed.

`client/macro.py` reads each member's head at its master (`GET /v1/queues/{q}/head`: the
message a receive there would lease next, leased by no one, with its priority and enqueue
time) and asks these functions which member to lease from; they do no I/O and read no clock,
so the tests drive them with heads of their own (tests/test_macro_highest_priority.py).
docs/PROTOCOL.md ("Macro queues") says what each policy promises.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Head:
    """What a member's head answer says about the message a receive there would lease next."""
    priority: int           # the message's own priority, 0-9 (9 first)
    enqueued_ms: int        # when its member's master stored it (that node's wall clock)
    message_id: int         # its ordering index in the member (comparable within one member only)

    @classmethod
    def of(cls, answer: Mapping[str, Any] | None) -> Head | None:
        """The head from `GET /v1/queues/{q}/head`'s answer (None: the member has nothing ready)."""
        if not answer:
            return None
        return cls(int(answer["priority"]), int(answer["enqueued_ms"]), int(answer["id"]))


def chronological_order(members: Sequence[str], heads: Mapping[str, Head | None]) -> list[str]:
    """`chronological`: the members that have a ready message, the oldest head first."""
    found = [(head.enqueued_ms, head.message_id, queue) for queue in members
             if (head := heads.get(queue)) is not None]
    return [queue for _, _, queue in sorted(found)]


def highest_priority_order(members: Sequence[str], heads: Mapping[str, Head | None]) -> list[str]:
    """`highest_priority`: the members that have a ready message, by their head's priority (9
    first), then its age (the oldest enqueue first), then member order. Each member's head is
    its own highest-priority, oldest ready message (Guarantee 5, docs/ARCHITECTURE.md), so the
    first member holds the highest-priority ready message of the whole macro queue. Ages from
    different masters compare their wall clocks: a tie within their skew may go either way."""
    found = [(-head.priority, head.enqueued_ms, position, queue) for position, queue in enumerate(members)
             if (head := heads.get(queue)) is not None]
    return [queue for *_, queue in sorted(found)]


@dataclass(frozen=True, slots=True)
class Pick:
    """Lease up to `count` messages from `queue`: 1 while another member also has a ready
    message (its head may outrank this member's next one), every one still wanted when no
    other member has any (then this member's own order is the macro queue's)."""
    queue: str
    count: int


def highest_priority_pick(members: Sequence[str], heads: Mapping[str, Head | None], wanted: int) -> Pick | None:
    """The next lease of a `highest_priority` receive that wants `wanted` (≥ 1) more messages,
    given the heads known now (None for a member known empty or unreachable): None when no
    member has a ready message."""
    order = highest_priority_order(members, heads)
    if not order or wanted < 1:
        return None
    return Pick(order[0], wanted if len(order) == 1 else 1)
