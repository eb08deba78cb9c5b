"""The requests a replica's clients made that this node relayed to the queue's master, waiting
for its answer (a RelayResult on the wire).

Separate from the pair driver because it is bookkeeping with deadlines only: which relayed
request belongs to which queue and client, when it times out, and what its client hears when the
master's answer cannot come (a change of role, a broken link, a full disk).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from qserver.cluster.holds import HeldAnswers
from replication.messages import RelayResult
from wire.errors import E_NOT_MASTER, E_TIMEOUT, ErrorKind

Answer = Callable[[Any], None]       # answer(outcome); a QueueError when refused


class RelayAnswers:
    def __init__(self, holds: HeldAnswers, monotonic_ms: Callable[[], int], *, first_id: int,
                 wait_max_ms: int) -> None:
        self.holds = holds
        self.monotonic_ms = monotonic_ms
        # Unique per node run: an answer the master sends to a crashed predecessor of this node
        # must never match one of our requests.
        self._next_id = first_id
        self.wait_max_ms = wait_max_ms       # the node's commit_wait_max_s
        self.waiting: dict[int, tuple[str, Answer]] = {}       # request id -> (queue, answer)
        self._deadlines: list[tuple[int, int]] = []           # heap of (deadline ms, request id)

    def add(self, name: str, request: list[Any], answer: Answer) -> int:
        """A request of queue `name` about to be relayed: its id."""
        request_id = self._next_id
        self._next_id += 1
        self.waiting[request_id] = (name, answer)
        wait_ms = request[2] if request[0] == "receive" else 0
        heapq.heappush(self._deadlines, (self.monotonic_ms() + self.wait_max_ms + wait_ms, request_id))
        return request_id

    def answered(self, name: str, result: RelayResult) -> None:
        """The master's answer: given to the client once this member's commit point passes it."""
        entry = self.waiting.pop(result.request_id, None)
        if entry is None:
            return
        answer = entry[1]
        commit, outcome = result.outcomes
        if not self.holds.hold(name, commit, lambda: answer(outcome), answer):   # refused: answer(the QueueError)
            answer(outcome)

    def fail(self, name: str, why: str, kind: ErrorKind = E_NOT_MASTER) -> None:
        """The master's answers to the requests of `name` will not come: their clients ask again."""
        failed = [request_id for request_id, (queue, _) in self.waiting.items() if queue == name]
        for request_id in failed:
            _, answer = self.waiting.pop(request_id)
            answer([kind.code, f"{why}; the outcome is unknown, retry (dedupe ids make it safe)"])

    def expire(self, mono_ms: int) -> None:
        """Requests past their deadline end with an outcome-unknown E_TIMEOUT (a RelayRequest lost with
        a broken link: nothing waits for ever or leaks). A late answer then finds no entry."""
        deadlines = self._deadlines
        while deadlines and (deadlines[0][0] <= mono_ms or deadlines[0][1] not in self.waiting):
            _, request_id = heapq.heappop(deadlines)
            entry = self.waiting.pop(request_id, None)
            if entry is not None:
                entry[1]([E_TIMEOUT.code, f"the master of {entry[0]} did not answer a forwarded request in "
                                          f"{self.wait_max_ms} ms; the outcome is unknown"])
