"""Answers held until their queue's commit point passes them, and dead letters kept out of sight
until the stream that decided them commits.

In a pair a client is answered only once what it did is on both members (docs/PROTOCOL.md,
"Replication messages"): the core decides, the batch persists and streams, and the answer waits
here for the commit point. Separate from the pair driver because it knows nothing of roles or
messages: it asks `CommitPoints` where each queue's commit point is and whether it may answer.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from qserver.core.ports import OUTCOME_UNKNOWN
from replication.operations import DeadLettered, Operation
from wire.errors import E_NOT_ENOUGH_REPLICAS, E_NOT_MASTER, E_TIMEOUT, E_UNKNOWN_QUEUE, QueueError

if TYPE_CHECKING:
    from replication.master import MasterRole
    from replication.queue_core import QueueCore


class CommitPoints(Protocol):
    """Where a queue's commit point is here (None: this node holds no role of it), and whether
    its answers may go out now (a master without its lease, or restarted in its role, holds
    them): both in one call, asked for every answer held or released."""

    def answer_point(self, name: str) -> tuple[int | None, bool]:
        ...


@dataclass(slots=True)
class HeldAnswer:
    """An answer released once the queue's commit point passes `required_order`."""
    required_order: int
    release: Any              # a no-argument callable: answer
    refuse: Any = None        # callable(QueueError): the queue went away first, or the deadline passed
    deadline_ms: int = 0      # refused (outcome unknown) if still held then: see expire
    write: bool = False       # an enqueue's answer (see refuse_unreplicated_writes)


class HeldAnswers:
    """The answers of each queue waiting for its commit point, in (nearly) increasing order."""

    def __init__(self, points: CommitPoints, monotonic_ms: Callable[[], int], *, clustered: bool,
                 wait_max_ms: int) -> None:
        self.points = points
        self.monotonic_ms = monotonic_ms
        self.clustered = clustered
        self.wait_max_ms = wait_max_ms        # the node's commit_wait_max_s
        self.held: dict[str, collections.deque[HeldAnswer]] = {}

    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *, write: bool = False) -> bool:
        """Park an answer until the commit point passes required_order; False: answer now.
        `write`: an enqueue's answer (see refuse_unreplicated_writes)."""
        commit, may_answer = self.points.answer_point(name)
        if required_order == OUTCOME_UNKNOWN or (commit is None and self.clustered):
            # Decided here as the master, which this node stopped being (or it no longer holds
            # the queue) before it committed: it may or may not survive.
            if refuse is not None:
                refuse(QueueError(E_NOT_MASTER, f"queue {name}: this node stopped being its master before the "
                                                "operation committed", outcome_unknown=True))
            return True          # a push is dropped: its lease runs out and it is delivered again
        if commit is None or (required_order <= commit and may_answer):
            return False
        self.held.setdefault(name, collections.deque()).append(
            HeldAnswer(required_order, release, refuse, self.monotonic_ms() + self.wait_max_ms, write))
        return True

    def release(self, names: Iterable[str]) -> None:
        """Answer what the commit point of each of `names` has passed."""
        for queue in names:
            waiting = self.held.get(queue)
            if not waiting:
                continue
            commit, may_answer = self.points.answer_point(queue)
            if not may_answer:
                continue
            # Answers are held in (nearly) increasing order: release from the front. One that
            # needs less than the one before it only waits for that one.
            while waiting and commit is not None and waiting[0].required_order <= commit:
                waiting.popleft().release()
            if not waiting:
                del self.held[queue]

    def settle(self, name: str, error: QueueError, commit: int) -> None:
        """Answer every held answer of `name`: released when committed (up to `commit`), else refused."""
        for held in self.held.pop(name, ()):
            if held.required_order <= commit:
                held.release()
            elif held.refuse is not None:
                held.refuse(error)
            # a push without refusal is dropped: its lease runs out and it is delivered again

    def drop(self, name: str) -> None:
        """The queue left this node: what it held never committed here."""
        for held in self.held.pop(name, ()):
            if held.refuse is not None:
                held.refuse(QueueError(E_UNKNOWN_QUEUE, f"queue {name} was deleted", outcome_unknown=True))

    def refuse_unreplicated_writes(self, role: MasterRole) -> None:
        """Under min_in_sync 2 a replica just recorded out of sync: the enqueues waiting for it
        are not acknowledged on this member's disk alone. They are stored here and may yet be
        delivered (committed once the replica is back, or by this member's commit point), so
        their answer says the outcome is unknown; a retry with the same dedupe id is safe."""
        name = role.core.name
        waiting = self.held.get(name)
        if not waiting:
            return
        error = QueueError(E_NOT_ENOUGH_REPLICAS, f"queue {name}: its replica {role.replica_id} was recorded out of "
                                                  "sync before it held this message", outcome_unknown=True)
        kept: collections.deque[HeldAnswer] = collections.deque()
        for held in waiting:
            if held.write and held.refuse is not None and held.required_order > role.replica_durable:
                held.refuse(error)
            else:
                kept.append(held)
        self.held[name] = kept

    def expire(self, mono_ms: int) -> None:
        """Held answers past their deadline end with an outcome-unknown E_TIMEOUT (an answer held
        for a commit point that does not come: nothing waits for ever)."""
        for name, waiting in self.held.items():
            while waiting and waiting[0].deadline_ms <= mono_ms:
                held = waiting.popleft()
                if held.refuse is not None:      # a push without refusal: its lease runs out instead
                    held.refuse(QueueError(E_TIMEOUT, f"queue {name}: not committed within {self.wait_max_ms} ms "
                                                      "(no lease or no replica?)", outcome_unknown=True))
        # Only queues with answers still held are looked at again (issue 31).
        for name in [name for name, waiting in self.held.items() if not waiting]:
            del self.held[name]


class DeadLetterGate:
    """Dead letters enter a dead-letter queue through its source queue's stream, so under `full`
    one becomes visible when the source's DeadLettered is committed. `pending`: dead-letter queue
    name -> (source order, dead-letter index) not yet committed."""

    def __init__(self, masters: Mapping[str, MasterRole], cores: Callable[[], Mapping[str, QueueCore]]) -> None:
        self.masters = masters
        self.cores = cores
        self.pending: dict[str, collections.deque[tuple[int, int]]] = {}

    def note_decided(self, core: QueueCore, ops: list[Operation]) -> None:
        """Called as soon as a master's core decided `ops`: a replicated dead-lettering must
        not make its message visible in the dead-letter queue before it commits."""
        dead = core.dead_letter_core
        if dead is None or core.name not in self.masters:
            return
        added = False
        for op in ops:
            if type(op) is DeadLettered and op.order:
                self.pending.setdefault(dead.name, collections.deque()).append((op.order, op.dead_letter_index))
                added = True
        if added:
            self.gate()

    def gate(self) -> None:
        """A dead-letter queue shows messages up to its first dead letter not yet committed."""
        cores = self.cores()
        for name, pending in self.pending.items():
            dead = cores.get(name)
            source = self.masters.get(dead.record.dead_letter_of or "") if dead is not None else None
            if dead is None or source is None:
                pending.clear()
                continue
            while pending and pending[0][0] <= source.commit_order:
                pending.popleft()
            dead.visible_upto = pending[0][1] - 1 if pending else None
        # Only queues with something pending are looked at again (issue 31).
        for name in [name for name, pending in self.pending.items() if not pending]:
            del self.pending[name]
