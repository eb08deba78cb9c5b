"""Macro queues (seed 004, "Management of message queues"): one name over member queues.

The definition (members, each with a priority and a weight; a producer and a consumer policy)
is in the cluster map; the policies run here, in the client library, which already keeps the
map to send each queue's traffic to its master. A message enqueued through a macro queue goes
straight to the chosen member's master and a receive straight to the chosen member: no hop
more than a call on the member itself, where a node serving the macro would add one
(docs/PROTOCOL.md, "Macro queues", says what that costs). Each member is an ordinary queue
with its own pair, so a failover or handoff of one member is the member's affair: calls on it
follow its master as any call does, and the other members are not disturbed.

Producer policies: `all` (a copy to every member, each under its own dedupe id derived from
the message's, so a retry stores at most one copy per member), `round_robin` (smooth weighted
turns), `first_available` (member order; a member that refuses for certain — full, no master
reachable, not enough replicas — is passed over for the next), `fastest` (by this client's
recent response times, the members' queue lengths, or their average service times). A
message that a member surely did not store may go to the next member; one whose outcome is
unknown stays with its member (retried there under the same dedupe id), so it is stored once.

Consumer policies look before they lease, and lease only the message they deliver (leasing
and releasing others would raise delivery counts towards the dead-letter queue):
`prioritized` (members by priority, highest first), `round_robin` (starting one member further
each call), `chronological` (the member whose head was enqueued first), `highest_priority`
(the highest-priority ready message of any member, by the message's own priority, the oldest
first among equals: one lease at a time from the member whose head ranks first; cluster
feature level 2). The choices are pure functions in client/macro_decide.py. A receive with a
wait waits on every member's head at once and wakes on the first message of any of them.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self

from client.macro_decide import Head, chronological_order, highest_priority_pick
from replication.map_entries import ConsumerPolicy, ProducerPolicy
from wire.errors import (
    E_FEATURE_DISABLED,
    E_INVALID_OPTION,
    E_MACRO_EMPTY,
    E_NOT_ENOUGH_REPLICAS,
    E_QUEUE_FULL,
    E_QUEUE_UNAVAILABLE,
    E_UNAVAILABLE,
    E_UNKNOWN_QUEUE,
    QueueError,
)

if TYPE_CHECKING:
    from client.consumer import Message
    from client.http import HttpClient

# The policies' names, as the cluster map checks them (replication/map_entries.py).
PRODUCER_POLICIES = tuple(policy.value for policy in ProducerPolicy)
CONSUMER_POLICIES = tuple(policy.value for policy in ConsumerPolicy)
# Consumer policies release 0.1.0 does not know, with the cluster feature level each needs
# (wire/versions.py FEATURES): a node of 0.1.0 answers E_INVALID_OPTION for them.
NEWER_CONSUMER_POLICIES = {ConsumerPolicy.HIGHEST_PRIORITY.value: "macro_highest_priority"}
FASTEST_BY = ("response_time", "queue_length", "service_time")
# Refusals after which the message surely is not stored in that member: it may go to the next.
PASS_OVER = frozenset({E_QUEUE_FULL.code, E_QUEUE_UNAVAILABLE.code, E_UNAVAILABLE.code, E_NOT_ENOUGH_REPLICAS.code,
                       E_UNKNOWN_QUEUE.code})
SUSPECT_S = 2.0                 # a member that could not be reached is tried last for this long
STATS_MAX_AGE_S = 1.0           # `fastest` by queue length or service time: how stale the members' numbers may be
RESPONSE_EWMA_WEIGHT = 0.2      # `fastest` by response time: the weight of the newest sample
DEDUPE_MEMORY_MAX = 100_000     # dedupe id -> member chosen, so that a retry goes where the first try went
HEAD_WAIT_SLICE_S = 20.0        # one round of waiting on every member's head (a receive waits in rounds)
CONSUME_BATCH_MAX = 1000       # a macro consumer's receive takes at most this many (and at most its prefetch)
DEFINITION_MAX_AGE_S = 5.0      # the definition is read again from the map (in the background) this often


class MacroClient(Protocol):
    """The calls a macro queue makes on its members: `AsyncClient`'s public surface."""

    async def refresh_placement(self, queue: str | None = None) -> None: ...
    async def enqueue(self, queue: str, payload: bytes, priority: int = 4, dedupe_id: str | None = None, *,
                      ttl_s: float | None = None, delay_s: float | None = None,
                      headers: Mapping[str, str] | None = None) -> int: ...
    async def receive(self, queue: str, max_messages: int = 1, wait_s: float = 0.0,
                      visibility_timeout_s: float | None = None) -> list[Message]: ...
    async def queue_stats(self, name: str) -> dict[str, Any]: ...


class MacroRouter(Protocol):
    """Where a member is served (client/router.py Router): its head is read at its master."""

    def http_for(self, queue: str) -> HttpClient: ...


@dataclass(slots=True)
class _MemberState:
    response_ms: float = 0.0    # smoothed enqueue response time seen by this client
    depth: float = 0.0          # last queue length read, plus what this client sent since
    service_ms: float = 0.0     # the member's average service time, last read
    stats_at: float = float("-inf")
    suspect_until: float = 0.0
    current: int = 0            # smooth weighted round robin's running weight


@dataclass(frozen=True, slots=True)
class Member:
    queue: str
    priority: int
    weight: int


class MacroEnqueued(int):
    """What an enqueue on a macro queue returns: the message id in the member it landed in
    (an int, as for a plain queue), with `queue` naming that member; under `all`, `copies`
    maps every member to its copy's id (and the id is the first member's)."""
    queue: str
    copies: dict[str, int]

    def __new__(cls, message_id: int, queue: str, copies: dict[str, int] | None = None) -> Self:
        made = super().__new__(cls, message_id)
        made.queue = queue
        made.copies = copies if copies is not None else {queue: message_id}
        return made

    def __repr__(self) -> str:
        return f"MacroEnqueued(id={int(self)}, queue={self.queue!r}, copies={self.copies!r})"


class MacroEnqueueError(QueueError):
    """An `all` enqueue that not every member acknowledged: `outcomes` maps each member to the
    id of its copy or the QueueError it failed with. Retry with the same dedupe id: the members
    that have their copy keep that one."""

    def __init__(self, first: QueueError, outcomes: dict[str, int | QueueError]) -> None:
        failed = {queue: o for queue, o in outcomes.items() if isinstance(o, QueueError)}
        super().__init__(first.kind, f"{len(failed)} of {len(outcomes)} members failed: "
                         + "; ".join(f"{queue}: {error.code} {error.message}" for queue, error in failed.items()),
                         outcome_unknown=any(error.outcome_unknown for error in failed.values()))
        self.outcomes = outcomes


def cluster_too_old(error: QueueError, consumer: str) -> QueueError | None:
    """What a create of a macro queue with a consumer policy of a later release says when the
    node that answered predates it: release 0.1.0 refuses a policy it does not know with
    E_INVALID_OPTION "'highest_priority' is not one of ..." (a node of this release answers
    E_FEATURE_DISABLED itself until the cluster's feature level allows it). None when `error`
    is something else."""
    feature = NEWER_CONSUMER_POLICIES.get(consumer)
    if feature is None or error.kind is not E_INVALID_OPTION or f"{consumer!r} is not one of" not in error.message:
        return None
    return QueueError(E_FEATURE_DISABLED, f"the cluster is too old for the macro consumer policy {consumer}: the node "
                                          f"runs a release that does not know it ({error.code}: {error.message}); "
                                          f"upgrade every node, then `qctl cluster finalize` ({feature})")


def member_dedupe_id(dedupe_id: str, member: str) -> str:
    """The dedupe id of a message's copy in one member under `all` (at most 128 characters)."""
    combined = f"{dedupe_id}@{member}"
    return combined if len(combined) <= 128 else hashlib.sha256(combined.encode()).hexdigest()


class MacroQueue:
    """A macro queue as one client sees it: its definition from the cluster map, and what the
    policies remember (turns, response times, members' lengths)."""

    def __init__(self, client: MacroClient, definition: Mapping[str, Any], router: MacroRouter) -> None:
        self._client = client
        self._router = router
        self._state: dict[str, _MemberState] = {}
        self._consumer_turn = 0
        self._chosen: OrderedDict[str, str] = OrderedDict()    # dedupe id -> member (see DEDUPE_MEMORY_MAX)
        self._refreshing: asyncio.Task[None] | None = None
        self._rereading: asyncio.Task[None] | None = None
        self.update(definition)

    def update(self, definition: Mapping[str, Any]) -> None:
        self.name: str = definition["name"]
        self.producer: str = definition["producer"]
        self.consumer: str = definition["consumer"]
        self.fastest_by: str = definition.get("fastest_by", "response_time")
        self.members = [Member(m["queue"], int(m.get("priority", 0)), int(m.get("weight", 1)))
                        for m in definition.get("members", [])]
        for member in self.members:
            self._state.setdefault(member.queue, _MemberState())
        self._read_at = time.monotonic()

    def _reread_if_old(self) -> None:
        """Members added or removed by another client reach this one within DEFINITION_MAX_AGE_S."""
        if time.monotonic() - self._read_at < DEFINITION_MAX_AGE_S or \
                (self._rereading is not None and not self._rereading.done()):
            return
        self._read_at = time.monotonic()
        self._rereading = asyncio.get_running_loop().create_task(self._client.refresh_placement())
        self._rereading.add_done_callback(lambda task: task.cancelled() or task.exception())

    # --- producer side ------------------------------------------------------------------------
    async def enqueue(self, payload: bytes, priority: int, dedupe_id: str, **extra: Any) -> MacroEnqueued:
        self._reread_if_old()
        if not self.members:
            raise QueueError(E_MACRO_EMPTY, f"macro queue {self.name} has no members")
        if self.producer == "all":
            return await self._enqueue_all(payload, priority, dedupe_id, **extra)
        first = self._chosen.get(dedupe_id)
        order = self._producer_order()
        if first is not None and first in order:     # a retry: where the first attempt went, first
            order.remove(first)
            order.insert(0, first)
        last: QueueError | None = None
        for queue in order:
            self._remember(dedupe_id, queue)
            try:
                message_id = await self._timed_enqueue(queue, payload, priority, dedupe_id, **extra)
            except QueueError as error:
                if error.outcome_unknown or error.code not in PASS_OVER:
                    raise
                last = error          # surely not stored there: the next member may take it
                if error.code != E_QUEUE_FULL.code:
                    self._state[queue].suspect_until = time.monotonic() + SUSPECT_S
                continue
            return MacroEnqueued(message_id, queue)
        assert last is not None
        raise last

    async def _enqueue_all(self, payload: bytes, priority: int, dedupe_id: str, **extra: Any) -> MacroEnqueued:
        queues = [member.queue for member in self.members]
        results = await asyncio.gather(*(self._timed_enqueue(queue, payload, priority, member_dedupe_id(dedupe_id, queue),
                                                             **extra) for queue in queues), return_exceptions=True)
        outcomes: dict[str, int | QueueError] = {}
        for queue, result in zip(queues, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, QueueError):
                raise result
            outcomes[queue] = result
        failures = [o for o in outcomes.values() if isinstance(o, QueueError)]
        if failures:
            raise MacroEnqueueError(failures[0], outcomes)
        copies = {queue: int(o) for queue, o in outcomes.items()}  # type: ignore[arg-type]
        return MacroEnqueued(copies[queues[0]], queues[0], copies)

    async def _timed_enqueue(self, queue: str, payload: bytes, priority: int, dedupe_id: str, **extra: Any) -> int:
        state = self._state[queue]
        started = time.monotonic()
        message_id = await self._client.enqueue(queue, payload, priority, dedupe_id, **extra)
        elapsed_ms = (time.monotonic() - started) * 1000
        state.response_ms = elapsed_ms if state.response_ms == 0 else \
            (1 - RESPONSE_EWMA_WEIGHT) * state.response_ms + RESPONSE_EWMA_WEIGHT * elapsed_ms
        state.depth += 1
        return int(message_id)

    def _producer_order(self) -> list[str]:
        """The members to try, the policy's choice first; members that could not be reached
        lately go last (they are still tried: they may be back)."""
        now = time.monotonic()
        if self.producer == "round_robin":
            chosen = self._next_turn()
            order = [chosen] + [m.queue for m in self.members if m.queue != chosen]
        elif self.producer == "fastest":
            self._refresh_stats_soon()
            key = {"response_time": lambda q: self._state[q].response_ms,
                   "queue_length": lambda q: self._state[q].depth,
                   "service_time": lambda q: self._state[q].service_ms}[self.fastest_by]
            order = sorted((m.queue for m in self.members), key=key)
        else:                                             # first_available
            order = [m.queue for m in self.members]
        return sorted(order, key=lambda q: self._state[q].suspect_until > now)   # stable: keeps the policy's order

    def _next_turn(self) -> str:
        """Smooth weighted round robin: over a cycle of Σweight turns each member gets its
        weight's worth, spread out rather than in a row."""
        total = 0
        best: Member | None = None
        for member in self.members:
            state = self._state[member.queue]
            state.current += member.weight
            total += member.weight
            if best is None or state.current > self._state[best.queue].current:
                best = member
        assert best is not None
        self._state[best.queue].current -= total
        return best.queue

    def _remember(self, dedupe_id: str, queue: str) -> None:
        self._chosen[dedupe_id] = queue
        self._chosen.move_to_end(dedupe_id)
        if len(self._chosen) > DEDUPE_MEMORY_MAX:
            self._chosen.popitem(last=False)

    def _refresh_stats_soon(self) -> None:
        """`fastest` by queue length or service time reads the members' statistics in the
        background, at most every STATS_MAX_AGE_S; until an answer comes, what is known counts
        (and every message sent counts one more in its member's length)."""
        if self.fastest_by == "response_time" or (self._refreshing is not None and not self._refreshing.done()):
            return
        now = time.monotonic()
        if all(now - self._state[m.queue].stats_at < STATS_MAX_AGE_S for m in self.members):
            return
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh_stats())

    async def _refresh_stats(self) -> None:
        async def one(queue: str) -> None:
            with contextlib.suppress(QueueError, TimeoutError):
                async with asyncio.timeout(STATS_MAX_AGE_S * 2):
                    stats = await self._client.queue_stats(queue)
                state = self._state[queue]
                state.depth, state.service_ms = float(stats.get("depth", 0)), float(stats.get("average_service_ms", 0))
                state.stats_at = time.monotonic()
        await asyncio.gather(*(one(member.queue) for member in self.members))

    # --- consumer side ------------------------------------------------------------------------
    async def receive(self, max_messages: int, wait_s: float, visibility_timeout_s: float | None) -> list[Message]:
        self._reread_if_old()
        if not self.members:
            raise QueueError(E_MACRO_EMPTY, f"macro queue {self.name} has no members")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            if self.consumer == ConsumerPolicy.HIGHEST_PRIORITY:
                messages, failed = await self._receive_highest(max_messages, visibility_timeout_s)
                if messages:
                    return messages
                order = [member.queue for member in self.members]
            else:
                order = await self._consumer_order()
                messages, failed = await self._receive_in_order(order, max_messages, visibility_timeout_s)
                if messages:
                    return messages
            if failed is not None and len(order) == len(self.members) and \
                    all(self._state[q].suspect_until > time.monotonic() for q in order):
                raise failed
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            await self._any_head(min(remaining, HEAD_WAIT_SLICE_S))

    async def _receive_in_order(self, order: list[str], max_messages: int, visibility_timeout_s: float | None
                                ) -> tuple[list[Message], QueueError | None]:
        """The first member in `order` that has messages gives them (up to `max_messages`)."""
        failed: QueueError | None = None
        for queue in order:
            try:
                messages = await self._client.receive(queue, max_messages, 0.0, visibility_timeout_s)
            except QueueError as error:     # this member cannot serve now: the others may
                failed = error
                self._state[queue].suspect_until = time.monotonic() + SUSPECT_S
                continue
            if messages:
                return messages, failed
        return [], failed

    async def _receive_highest(self, max_messages: int, visibility_timeout_s: float | None
                               ) -> tuple[list[Message], QueueError | None]:
        """`highest_priority`: every member's head at once, then a lease of one message at a
        time from the member whose head ranks first (client/macro_decide.py), reading that
        member's head again after each; the rest of the batch at once when only one member has
        any. Each lease is of a message this receive delivers (nothing is leased and given
        back), and what was leased is delivered even when a later member call fails. A member
        that answers a lease with nothing (another consumer took its head) sits out the rest of
        this batch, so a batch makes at most `max_messages` + members lease calls."""
        if max_messages < 1:
            raise QueueError(E_INVALID_OPTION, "max_messages must be at least 1")
        queues = [member.queue for member in self.members]
        heads, failed = await self._heads(queues)
        taken: list[Message] = []
        while (pick := highest_priority_pick(queues, heads, max_messages - len(taken))) is not None:
            try:
                messages = await self._client.receive(pick.queue, pick.count, 0.0, visibility_timeout_s)
            except QueueError as error:     # this member cannot serve now: the others may
                failed = error
                self._state[pick.queue].suspect_until = time.monotonic() + SUSPECT_S
                heads[pick.queue] = None
                continue
            taken.extend(messages)
            if len(taken) >= max_messages:
                break
            if len(messages) < pick.count:  # drained, or its head went to another consumer
                heads[pick.queue] = None
                continue
            again, head_failed = await self._heads([pick.queue])
            heads[pick.queue] = again[pick.queue]
            failed = head_failed or failed
        return taken, failed

    async def _heads(self, queues: list[str]) -> tuple[dict[str, Head | None], QueueError | None]:
        """Each member's head, read at its master at once; a member that cannot answer counts
        as empty and is suspect for a while (the error is handed back)."""
        answers = await asyncio.gather(*(self._head(queue, 0.0) for queue in queues), return_exceptions=True)
        heads: dict[str, Head | None] = {}
        failed: QueueError | None = None
        for queue, answer in zip(queues, answers, strict=True):
            if isinstance(answer, QueueError):
                self._state[queue].suspect_until = time.monotonic() + SUSPECT_S
                failed, heads[queue] = answer, None
            elif isinstance(answer, BaseException):
                raise answer
            else:
                heads[queue] = Head.of(answer)
        return heads, failed

    async def _consumer_order(self) -> list[str]:
        """The members to lease from, in turn; members that failed lately go last."""
        queues = [member.queue for member in self.members]
        if self.consumer == "prioritized":
            order = [m.queue for m in sorted(self.members, key=lambda m: -m.priority)]
        elif self.consumer == "round_robin":
            start = self._consumer_turn % len(queues)
            self._consumer_turn += 1
            order = queues[start:] + queues[:start]
        else:                                   # chronological: the oldest head first
            heads, _ = await self._heads(queues)
            order = chronological_order(queues, heads)
        now = time.monotonic()
        return sorted(order, key=lambda q: self._state[q].suspect_until > now)

    async def _head(self, queue: str, wait_s: float) -> dict[str, Any] | None:
        return await self._router.http_for(queue).head(queue, wait_s)

    async def _any_head(self, wait_s: float) -> None:
        """Wait until some member has a message (or `wait_s` passes): nothing is leased."""
        waits = [asyncio.ensure_future(self._head(member.queue, wait_s)) for member in self.members]
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not task.exception() and task.result() for task in done):
                    return
                errors = [task.exception() for task in done if task.exception()]
                if errors and not pending:
                    raise errors[0]  # type: ignore[misc]
        finally:
            for task in waits:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)


@dataclass
class MacroConsumer:
    """`client.consume(macro)`: messages of every member, chosen by the consumer policy, as an
    async iterator. It receives at most `prefetch` (≤ CONSUME_BATCH_MAX) at a time with a long wait, so it blocks
    across all members as a receive does; what it took and was not handed out when it closes
    is released, so others get it now rather than after its visibility timeout."""
    macro: MacroQueue
    prefetch: int
    visibility_timeout_s: float | None
    wait_s: float = 5.0
    closed: bool = False
    _buffer: deque[Message] = field(default_factory=deque)

    def __aiter__(self) -> MacroConsumer:
        return self

    async def __anext__(self) -> Message:
        while not self._buffer:
            if self.closed:
                raise StopAsyncIteration
            self._buffer.extend(await self.macro.receive(min(self.prefetch, CONSUME_BATCH_MAX), self.wait_s,
                                                         self.visibility_timeout_s))
        return self._buffer.popleft()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.closed = True
        buffered, self._buffer = list(self._buffer), deque()
        for message in buffered:
            with contextlib.suppress(QueueError):
                await message.release()
