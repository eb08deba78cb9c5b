"""The queue core: one queue's decisions as a pure state machine.

The node feeds it commands (`enqueue`, `lease`, `extend`, `ack`, `release`, `reply`, `expire_leases`)
with the wall clock's time as an argument (what the records say: enqueue and lease times, the
dedupe window); each appends the operations it decided to `out`, in order, for the node to
persist in one transaction before answering anyone (group commit: docs/ARCHITECTURE.md
"Conventions": persist, then send, then answer). Nothing here waits, sleeps or does I/O apart
from committed-state reads through `StoreReader`.

Memory holds the leases in flight, the messages timed by a time to live or a delay, and the
ready messages (`ReadySet`, replication/ready_set.py: per priority a heap, paged in from
storage after a restart). The master decides; every other member applies what it decided
(`apply`). An enqueue, an ack, a release, an extension, a delay running out and a durable
subscription's steps take effect on the master through the functions `apply` uses;
tests/test_decide_apply.py holds the other decisions (leases, purges, expiry, dead-lettering)
equal to their application on random command sequences. The record
(replication/queue_record.py), dedupe ids and numbered streams (replication/queue_streams.py)
and durable subscriptions (replication/queue_subscriptions.py) live apart; what other modules
import of them is re-exported here.

Leases are timed apart from the records, on `lease_clock` (the node's monotonic clock, a
virtual one in simulations): a lease is a duration, and its deadline is where that duration
ends on this member's own clock, counted from the grant here, or from the moment this member
inherited it (a restart, a takeover: `inherit_leases`, a snapshot). A wall clock that steps,
or two members' clocks that disagree, move no deadline (docs/PROTOCOL.md "Time: leases are
durations on the serving member's monotonic clock").
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from replication.invariants import InvariantViolation
from replication.operations import (
    Acked,
    DeadLettered,
    Enqueued,
    Expired,
    Extended,
    Leased,
    Matured,
    Operation,
    Purged,
    Released,
    SubscriberAcked,
    SubscriptionDropped,
    SubscriptionOpened,
)
from replication.options import (
    PRIORITY_MAX,
    QUEUE_STATE_TRANSITIONS,
    QueueOptions,
    QueueState,
    QueueType,
    Strength,
    producer_key,
)
from replication.queue_record import QueueRecord, sequences_from_json
from replication.queue_streams import (
    SEQUENCE_FLOOR_HEADER,
    SEQUENCE_HEADER,
    SEQUENCE_KEY_HEADER,
    DedupeIds,
    StreamFences,
    forget_numbers_after,
    note_sequence,
)
from replication.queue_subscriptions import (
    SUBSCRIPTION_PRIORITY,
    SUBSCRIPTIONS_MAX,
    acknowledge_run,
    apply_subscription_step,
    subscription_floor,
)
from replication.ready_set import ReadySet
from replication.store import StoredLease, StoreReader
from wire.errors import (
    E_INVALID_OPTION,
    E_LEASE_EXPIRED,
    E_QUEUE_FULL,
    E_SUBSCRIPTIONS_FULL,
    E_UNKNOWN_MESSAGE,
    E_UNKNOWN_SUBSCRIPTION,
    E_WRONG_QUEUE_TYPE,
    QueueError,
)

# Re-exported: the node, storage and the features import these from here.
__all__ = ["PRIORITIES_HIGH_FIRST", "SEQUENCE_FLOOR_HEADER", "SEQUENCE_HEADER", "SEQUENCE_KEY_HEADER",
           "STALE_DEADLINES_MAX", "SUBSCRIPTIONS_MAX", "SUBSCRIPTION_PRIORITY", "InvariantViolation", "QueueCore",
           "QueueRecord", "sequences_from_json"]

# A deadline heap (leases, times to live, delays) is rebuilt from what is live once its stale
# entries pass this many and the live ones: a member that applies the master's decisions
# never pops them (only the deciding member's timed steps do), so they would grow for ever.
STALE_DEADLINES_MAX = 1024
PRIORITIES_HIGH_FIRST = tuple(range(PRIORITY_MAX, -1, -1))


@dataclass(slots=True)
class _Lease:
    priority: int
    receipt: str
    visibility_ms: int     # what was granted (replicated and stored)
    deadline: int          # where it ends on this member's lease clock
    deliveries: int
    leased_ms: int         # wall clock, for the record


class QueueCore:
    def __init__(self, record: QueueRecord, reader: StoreReader, rng: random.Random, *,
                 lease_clock: Callable[[], int], leases: list[StoredLease] = (),  # type: ignore[assignment]
                 dedupe_window_ms: int = 300_000) -> None:
        self.record = record
        self._lease_clock = lease_clock
        self._reader = reader
        self._rng = rng
        self._dedupe = DedupeIds(reader, record.queue_id, dedupe_window_ms)
        self.dead_letter_core: QueueCore | None = None
        # Every index below the boundary was stored before this core was built: paged in.
        self._ready = ReadySet(reader, record.queue_id, record.next_index, empty=record.ready_count == 0)
        # Consumers may see messages up to this ordering index: the commit point of a
        # replicated queue (docs/ARCHITECTURE.md Guarantee 2: consumers see only committed
        # messages). None: all.
        self.visible_upto: int | None = None
        self._leases: dict[int, _Lease] = {}
        # Enqueues refused because the queue was at max_depth, on this member since it started
        # (seed 003's overflows: the master decides, so only the master's count grows).
        self.overflows = 0
        self.stream_fences = StreamFences()     # the deciding member's only (queue_streams.py)
        self._lease_deadlines: list[tuple[int, int, str]] = []
        for stored in leases:      # from storage, after a restart: inherited now
            self._inherit(stored.index, stored.priority, stored.receipt, stored.visibility_ms,
                          stored.deliveries, stored.leased_ms)
        # Live messages with a time to live: index -> (deadline on the lease clock, priority),
        # and their deadlines as a heap (entries of messages gone since are skipped).
        self._ttl: dict[int, tuple[int, int]] = {}
        self._ttl_deadlines: list[tuple[int, int]] = []
        # Messages waiting for their delivery delay: index -> (due on the lease clock, priority),
        # and the due times as a heap. They are in no ready heap until they mature.
        self._delayed: dict[int, tuple[int, int]] = {}
        self._due: list[tuple[int, int]] = []
        self._load_timed()

    # --- identity and state ----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.record.name

    @property
    def queue_id(self) -> int:
        return self.record.queue_id

    @property
    def options(self) -> QueueOptions:
        return self.record.options

    @property
    def depth(self) -> int:
        return self.record.ready_count + len(self._leases) + self.record.delayed_count

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    def transition(self, state: QueueState) -> None:
        if state not in QUEUE_STATE_TRANSITIONS[self.record.state]:
            raise InvariantViolation(f"queue {self.name}: {self.record.state.value} -> {state.value}")
        self.record.state = state

    # --- commands --------------------------------------------------------------------------
    def enqueue(self, payload: bytes, priority: int, dedupe_id: str | None, client: str,
                now_ms: int, out: list[Operation], ttl_ms: int = 0, delay_ms: int = 0,
                headers: dict[str, str] | None = None) -> tuple[int, bool]:
        """Place a message; returns (message id, True if it repeats a kept dedupe id).
        `ttl_ms`: its time to live (0: the queue's `message_ttl_s`, which may be none);
        `delay_ms`: how long it waits before it is ready (0: ready at once); `headers`: a
        small map delivered with it (checked by the caller: wire.message_input.checked_headers)."""
        if dedupe_id is not None:
            earlier = self._dedupe.find(producer_key(client, dedupe_id), now_ms)
            if earlier is not None:
                return earlier, True
        if headers is not None and SEQUENCE_HEADER in headers:
            return self.stream_fences.enqueue(self.record, headers, client, lambda: self._place(
                payload, priority, dedupe_id, client, now_ms, out, ttl_ms, delay_ms, headers))
        return self._place(payload, priority, dedupe_id, client, now_ms, out, ttl_ms, delay_ms, headers), False

    def enqueue_many(self, payloads: list[bytes], priority: int, dedupe_ids: list[str | None], client: str,
                     now_ms: int, out: list[Operation], ttl_ms: int = 0, delay_ms: int = 0,
                     headers: dict[str, str] | None = None) -> list[int | QueueError]:
        """A batch in one step: each message's id (a kept dedupe id's earlier one), or the
        error that refused it. The committed dedupe ids are looked up in one read."""
        keys = [None if d is None else producer_key(client, d) for d in dedupe_ids]
        unknown = self._dedupe.uncommitted_unknown(keys)
        stored = self._reader.dedupe_lookup_many(self.queue_id, unknown) if unknown else {}
        find, place = self._dedupe.find, self._place
        outcomes: list[int | QueueError] = []
        if headers is not None and SEQUENCE_HEADER in headers:
            if len(payloads) != 1:       # one number names one message
                return [QueueError(E_INVALID_OPTION, f"{SEQUENCE_HEADER} numbers one message: enqueue them one "
                                                     "at a time")] * len(payloads)
            def dedupe_or_place() -> int:
                earlier = find(keys[0], now_ms, stored) if keys[0] is not None else None
                return earlier if earlier is not None else place(payloads[0], priority, dedupe_ids[0], client, now_ms,
                                                                 out, ttl_ms, delay_ms, headers)
            try:
                return [self.stream_fences.enqueue(self.record, headers, client, dedupe_or_place)[0]]
            except QueueError as error:
                return [error]
        for payload, dedupe_id, key in zip(payloads, dedupe_ids, keys, strict=True):
            if key is not None and (earlier := find(key, now_ms, stored)) is not None:
                outcomes.append(earlier)
                continue
            try:
                outcomes.append(place(payload, priority, dedupe_id, client, now_ms, out, ttl_ms, delay_ms, headers))
            except QueueError as error:
                outcomes.append(error)
        return outcomes

    def _place(self, payload: bytes, priority: int, dedupe_id: str | None, client: str, now_ms: int,
               out: list[Operation], ttl_ms: int = 0, delay_ms: int = 0, headers: dict[str, str] | None = None) -> int:
        record = self.record
        if self.depth >= record.options.max_depth:
            self.overflows += 1
            raise QueueError(E_QUEUE_FULL, f"queue {record.name} holds {record.options.max_depth} messages")
        op = Enqueued(record.queue_id, record.next_index, priority, now_ms, dedupe_id, client, payload,
                      ttl_ms or record.options.message_ttl_ms, delay_ms or record.options.delay_ms, headers)
        out.append(op)
        # The master places the message exactly as every member applies its Enqueued: one
        # definition of an enqueue's effect (issue 33, item 5).
        self._apply_enqueued(op)
        return op.index

    def lease(self, max_messages: int, visibility_ms: int | None, client: str, now_ms: int,
              out: list[Operation]) -> list[Leased]:
        """Lease up to max_messages ready messages, highest priority first, then oldest."""
        leased: list[Leased] = []
        if self.record.ready_count == 0:
            return leased
        if visibility_ms is None:
            visibility_ms = self.options.visibility_timeout_ms
        lease_now = self._lease_clock()
        deadline = lease_now + visibility_ms
        visible_upto = self.visible_upto
        for priority in PRIORITIES_HIGH_FIRST:
            while len(leased) < max_messages and self._ready.fill_head(priority):
                if visible_upto is not None and self._ready.heaps[priority][0] > visible_upto:
                    break       # the rest of this priority is newer still: not committed yet
                index = heapq.heappop(self._ready.heaps[priority])
                if index in self._ttl and self._ttl[index][0] <= lease_now:
                    # Its time ran out before the sweep got to it: never delivered.
                    self._expire_ready(index, priority, now_ms, out, popped=True)
                    continue
                deliveries = self._ready.deliveries.pop(index, 0) + 1
                receipt = f"{self._rng.getrandbits(64):016x}"
                self.record.ready_count -= 1
                self._add_lease(index, _Lease(priority, receipt, visibility_ms, deadline, deliveries, now_ms))
                op = Leased(self.queue_id, index, priority, receipt, visibility_ms, deliveries, client, now_ms,
                            self._consumption_order())
                out.append(op)
                leased.append(op)
            if len(leased) == max_messages:
                break
        return leased

    def head(self) -> tuple[int, int] | None:
        """(index, priority) of the message the next lease would take, without leasing it: a
        macro queue's consumer policies look at their members' heads before they lease from
        one (leasing and releasing the others would raise their delivery counts)."""
        if self.record.ready_count == 0:
            return None
        visible_upto = self.visible_upto
        for priority in PRIORITIES_HIGH_FIRST:
            if self._ready.fill_head(priority):
                index = self._ready.heaps[priority][0]
                if visible_upto is None or index <= visible_upto:
                    return index, priority
        return None

    def ready_head(self, priority: int) -> int | None:
        """The lowest ready index of that priority (what a lease of it would take), if any."""
        return self._ready.heaps[priority][0] if self._ready.fill_head(priority) else None

    def lowest_index(self, priority: int) -> int:
        """The lowest index of that priority the queue holds (ready, leased or delayed), or the
        next index when it holds none: every such message below it has left the queue (a
        forwarder's floor)."""
        head = self.ready_head(priority)
        lowest = self.record.next_index if head is None else head
        leased = [index for index, lease in self._leases.items() if lease.priority == priority]
        delayed = [index for index, (_, delayed_priority) in self._delayed.items() if delayed_priority == priority]
        return min([lowest, *leased, *delayed])

    def ack(self, index: int, receipt: str, client: str, now_ms: int, out: list[Operation],
            reply: bytes | None = None) -> None:
        lease = self._valid_lease(index, receipt, now_ms, out)
        del self._leases[index]
        record = self.record
        op = Acked(record.queue_id, index, lease.priority, client, now_ms, record.options.tracks_status, reply,
                   self._consumption_order())
        self._lease_ended(op, lease)
        out.append(op)

    def reply(self, index: int, receipt: str, payload: bytes, client: str, now_ms: int,
              out: list[Operation]) -> None:
        """Seed 004 SendReply: the consumer's answer completes (acks) a two_way message."""
        if self.options.type is not QueueType.TWO_WAY:
            raise QueueError(E_WRONG_QUEUE_TYPE, f"queue {self.name} is {self.options.type.value}, not two_way")
        self.ack(index, receipt, client, now_ms, out, reply=payload)

    def release(self, index: int, receipt: str, now_ms: int, out: list[Operation]) -> None:
        lease = self._valid_lease(index, receipt, now_ms, out)
        self._end_lease(index, lease, now_ms, expired=False, out=out)

    def extend(self, index: int, receipt: str, visibility_ms: int, client: str, now_ms: int,
               out: list[Operation]) -> None:
        """Give a lease in flight a new duration from now (shorter or longer; 0 makes the
        message ready again at the next expiry sweep, as SQS does). Refused like an ack once the
        lease has ended or under another receipt."""
        lease = self._valid_lease(index, receipt, now_ms, out)
        op = Extended(self.queue_id, index, lease.priority, receipt, visibility_ms, client, now_ms,
                      self._consumption_order())
        self._extended(op)
        out.append(op)

    # --- durable subscriptions (a channel's queue; qserver/features/channels/hub.py serves them) ---------
    def open_subscription(self, name: str, client: str, now_ms: int, out: list[Operation]) -> bool:
        """Begin a durable subscription (its backlog: every message enqueued from now on);
        False when it exists already (subscribing again is idempotent)."""
        if name in self.record.subscriptions:
            return False
        if self.options.strength is not Strength.FULL:
            raise QueueError(E_INVALID_OPTION, f"queue {self.name}: durable subscriptions need strength full")
        if len(self.record.subscriptions) >= SUBSCRIPTIONS_MAX:
            raise QueueError(E_SUBSCRIPTIONS_FULL, f"{self.name} has {SUBSCRIPTIONS_MAX} durable subscriptions")
        op = SubscriptionOpened(self.queue_id, name, client, now_ms, self._consumption_order())
        apply_subscription_step(self.record, op)     # as every member applies it
        out.append(op)
        return True

    def drop_subscription(self, name: str, client: str, now_ms: int, out: list[Operation]) -> None:
        if name not in self.record.subscriptions:
            raise QueueError(E_UNKNOWN_SUBSCRIPTION, f"{self.name} has no durable subscription {name!r}")
        op = SubscriptionDropped(self.queue_id, name, client, now_ms, self._consumption_order())
        apply_subscription_step(self.record, op)     # as every member applies it
        out.append(op)

    def subscriber_acks(self, name: str, indices: Sequence[int], client: str, now_ms: int,
                        out: list[Operation]) -> list[bool | QueueError]:
        """A durable subscription acknowledges a run of its backlog's messages: per message True,
        False (acknowledged before) or its refusal (replication/queue_subscriptions.py)."""
        return acknowledge_run(self.record, self.queue_id, name, indices, client, now_ms, out,
                               lambda after, before, limit: self._reader.ready_page(
                                   self.queue_id, SUBSCRIPTION_PRIORITY, after, before, limit),
                               self._consumption_order)

    def subscriber_ack(self, name: str, index: int, client: str, now_ms: int, out: list[Operation]) -> bool:
        """One message: False when it had already (an ack repeated after a lost answer)."""
        outcome = self.subscriber_acks(name, [index], client, now_ms, out)[0]
        if isinstance(outcome, QueueError):
            raise outcome
        return outcome

    def purge(self, upto: int, limit: int, now_ms: int, out: list[Operation]) -> tuple[int, bool]:
        """Take up to `limit` messages with index <= `upto` out of the queue, leased ones
        first, then ready ones in delivery order; returns (how many, whether none is left).
        An operator's purge runs this in bounded steps (qserver/core/admin_steps.py) with `upto` fixed
        at its start, so what is enqueued meanwhile stays. A message a durable subscription
        has not acknowledged stays too: `upto` stops below the lowest floor."""
        floor = subscription_floor(self.record)
        if floor is not None:
            upto = min(upto, floor)
        record, purged = self.record, 0
        track = record.options.tracks_status
        for index in sorted(i for i in self._leases if i <= upto)[:limit]:
            lease = self._leases.pop(index)
            self._ttl.pop(index, None)
            out.append(Purged(record.queue_id, index, lease.priority, True, now_ms, track, self._consumption_order()))
            purged += 1
        for priority in PRIORITIES_HIGH_FIRST:
            heap = self._ready.heaps[priority]
            while purged < limit and self._ready.fill_head(priority) and heap[0] <= upto:
                index = heapq.heappop(heap)
                self._ready.deliveries.pop(index, None)
                self._ttl.pop(index, None)
                record.ready_count -= 1
                out.append(Purged(record.queue_id, index, priority, False, now_ms, track, self._consumption_order()))
                purged += 1
        for index in sorted(i for i in self._delayed if i <= upto)[:max(0, limit - purged)]:
            _, priority = self._delayed.pop(index)
            self._ttl.pop(index, None)
            record.delayed_count -= 1
            out.append(Purged(record.queue_id, index, priority, False, now_ms, track, self._consumption_order(), True))
            purged += 1
        record.total_purged += purged
        done = not any(i <= upto for i in self._leases) and not any(i <= upto for i in self._delayed) and not any(
            self._ready.fill_head(priority) and self._ready.heaps[priority][0] <= upto for priority in PRIORITIES_HIGH_FIRST)
        return purged, done

    def expire_leases(self, now_ms: int, out: list[Operation]) -> int:
        """End every lease whose deadline has passed on the lease clock; returns how many
        ended (`now_ms`, the wall clock, is what the Released records say)."""
        ended = 0
        deadlines = self._lease_deadlines
        lease_now = self._lease_clock()
        while deadlines and deadlines[0][0] <= lease_now:
            deadline, index, receipt = heapq.heappop(deadlines)
            lease = self._leases.get(index)
            # Entries go stale: the lease ended, or an extension pushed a new deadline.
            if lease is not None and lease.receipt == receipt and lease.deadline == deadline:
                self._end_lease(index, lease, now_ms, expired=True, out=out)
                ended += 1
        return ended

    def expire_messages(self, now_ms: int, out: list[Operation]) -> int:
        """Take out every ready message whose time to live has run out on the lease clock
        (dead-lettered when the queue has a dead-letter queue, else dropped); returns how many.
        A leased one is left to its consumer: if its lease ends without an ack, it goes then
        (`_end_lease`). Under `full` only the master decides (its operations are replicated)."""
        expired = 0
        for index, (_, priority) in self._pop_due(self._ttl_deadlines, self._ttl):
            if index in self._leases or index in self._delayed:
                continue        # leased (see _end_lease) or delayed (see mature_messages)
            self._expire_ready(index, priority, now_ms, out, popped=False)
            expired += 1
        return expired

    def mature_messages(self, now_ms: int, out: list[Operation]) -> int:
        """Make every delayed message whose delay has run out on the lease clock ready
        (`Matured`); returns how many. One past its time to live too is expired at once."""
        matured = 0
        lease_now = self._lease_clock()
        for index, (_, priority) in self._pop_due(self._due, self._delayed):
            op = Matured(self.queue_id, index, priority, now_ms, self._consumption_order())
            self._matured(op)
            out.append(op)
            matured += 1
            live = self._ttl.get(index)
            if live is not None and live[0] <= lease_now:
                self._expire_ready(index, priority, now_ms, out, popped=False)
            elif live is not None:
                heapq.heappush(self._ttl_deadlines, (live[0], index))    # the sweep skipped it while delayed
        return matured

    def _pop_due(self, heap: list[tuple[int, int]],
                 live: dict[int, tuple[int, int]]) -> Iterator[tuple[int, tuple[int, int]]]:
        """(index, its live entry) for each entry of a deadline heap whose time has come on the
        lease clock; stale entries (the message gone, or given another deadline) are dropped."""
        lease_now = self._lease_clock()
        while heap and heap[0][0] <= lease_now:
            deadline, index = heapq.heappop(heap)
            entry = live.get(index)
            if entry is not None and entry[0] == deadline:
                yield index, entry

    def next_deadline(self) -> int | None:
        """The earliest deadline of a lease, a time to live or a delay, on the lease clock."""
        deadlines = [heap[0][0] for heap in (self._lease_deadlines, self._ttl_deadlines, self._due) if heap]
        return min(deadlines) if deadlines else None

    def inherit_leases(self) -> None:
        """This member takes the queue over (a failover, a handoff): every lease in flight
        counts as granted now, on this member's clock. The master that granted them timed
        them on another clock, which says nothing here; none may expire early, so each runs
        its whole duration again (at worst one takeover longer than granted)."""
        now = self._lease_clock()
        for lease in self._leases.values():
            lease.deadline = now + lease.visibility_ms
        self._lease_deadlines = [(lease.deadline, index, lease.receipt) for index, lease in self._leases.items()]
        heapq.heapify(self._lease_deadlines)

    def seal(self) -> None:
        """The staged batch is going to disk; its dedupe ids stay visible until committed."""
        self._dedupe.seal()

    def advance(self) -> None:
        """The sealed batch is committed: the reader sees it now."""
        self._dedupe.advance()

    def accept_dead_letter(self, priority: int, now_ms: int, *, index: int = 0) -> int:
        """Make room for a message moving in from the queue this one is the dead-letter queue of
        (at `index` when applying the master's decision, else at the next index)."""
        record = self.record
        if index == 0:
            index = record.next_index
        elif index < record.next_index:
            raise InvariantViolation(f"queue {self.name}: dead letter at {index} below {record.next_index}")
        record.next_index = index + 1
        self._ready.push(priority, index)
        record.ready_count += 1
        record.total_enqueued += 1
        record.highest_depth = max(record.highest_depth, self.depth)
        return index

    def has_ready(self) -> bool:
        return self.record.ready_count > 0

    # --- time to live ----------------------------------------------------------------------
    def _live_for(self, index: int, priority: int, ttl_ms: int) -> None:
        """The message expires `ttl_ms` from now on this member's clock (placed, applied,
        or loaded after a restart or a snapshot: never earlier than the master's own)."""
        deadline = self._lease_clock() + ttl_ms
        self._ttl[index] = (deadline, priority)
        heapq.heappush(self._ttl_deadlines, (deadline, index))
        self._ttl_deadlines = _bounded(self._ttl_deadlines, self._ttl, lambda i, entry: (entry[0], i))

    def _delay(self, index: int, priority: int, delay_ms: int) -> None:
        """The message waits `delay_ms` from now on this member's clock before it is ready."""
        due = self._lease_clock() + delay_ms
        self._delayed[index] = (due, priority)
        heapq.heappush(self._due, (due, index))
        self._due = _bounded(self._due, self._delayed, lambda i, entry: (entry[0], i))
        self.record.delayed_count += 1

    def _load_timed(self) -> None:
        """Every stored message with a time to live, and every delayed one, timed from now
        (a restart, a snapshot install): none expires or matures early, at worst one restart late."""
        self._ttl, self._ttl_deadlines, self._delayed, self._due = {}, [], {}, []
        self.record.delayed_count = 0
        for index, priority, ttl_ms in self._reader.ttl_rows(self.queue_id):
            self._live_for(index, priority, ttl_ms)
        for index, priority, delay_ms in self._reader.delayed_rows(self.queue_id):
            self._delay(index, priority, delay_ms)

    def _make_ready(self, index: int, priority: int, deliveries: int) -> None:
        """A message ready again (a lease ended without an ack) or at last (its delay ran out)."""
        self.record.ready_count += 1
        self._ready.make_ready(index, priority, deliveries)

    def _expire(self, index: int, priority: int, deliveries: int, leased: bool, now_ms: int,
                out: list[Operation]) -> None:
        """The message's time ran out: to the dead-letter queue with `expired`, or dropped."""
        record = self.record
        self._ttl.pop(index, None)
        record.total_expired += 1
        dead_letter = self.dead_letter_core
        if dead_letter is not None and record.options.dead_letter:
            dead_index = dead_letter.accept_dead_letter(priority, now_ms)
            record.total_dead_lettered += 1
            out.append(DeadLettered(record.queue_id, index, priority, deliveries, dead_letter.queue_id, dead_index,
                                    now_ms, True, self._consumption_order(), True, leased))
        else:
            out.append(Expired(record.queue_id, index, priority, leased, now_ms, record.options.tracks_status,
                               self._consumption_order()))

    def _expire_ready(self, index: int, priority: int, now_ms: int, out: list[Operation], *, popped: bool) -> None:
        if popped:      # already off its heap's head (lease)
            deliveries = self._ready.deliveries.pop(index, 0)
            self.record.ready_count -= 1
        else:
            deliveries = self._ready.deliveries.get(index, 0)
            self._take_ready(priority, index)
        self._expire(index, priority, deliveries, False, now_ms, out)

    def discard_after(self, order: int) -> list[tuple[int, int]] | None:
        """Drop a deposed `producer` master's uncommitted suffix: the enqueues past `order`
        (no consumer saw them: only committed messages are visible), so that the member can
        follow the new master from `order` and keep its own consumption state of everything
        before (SyncBegin's `keep_upto`, docs/PROTOCOL.md "Replication messages"). Messages past
        `order` stored before this core was built (a restart) are counted on their pages, which
        are never loaded again. Returns the (priority, index) dropped from memory, or None when
        it cannot be done here (under `full` the suffix holds consumption steps too; a message
        past `order` is leased): the member then takes the master's whole history instead."""
        if self.options.strength is not Strength.PRODUCER or any(index > order for index in self._leases):
            return None
        count, dropped = self._ready.discard_after(order)
        for index in [index for index in self._ttl if index > order]:
            del self._ttl[index]
        delayed = [index for index in self._delayed if index > order]
        for index in delayed:
            del self._delayed[index]
        self._dedupe.discard_after(order)
        forget_numbers_after(self.record, order)
        record = self.record
        record.ready_count -= count
        record.delayed_count -= len(delayed)
        record.total_enqueued -= count + len(delayed)
        record.next_index = min(record.next_index, order + 1)
        return dropped

    def install_snapshot(self, ready: list[tuple[int, int, int]] | None,
                         leases: list[tuple[int, int, str, int, int, int]]) -> None:
        """A snapshot's rows are committed to storage and its counters to the record: serve
        them. `ready` (priority, index, deliveries) are pushed as they are; None means this
        instance held nothing before, so every ready message below `next_index` is paged in
        from storage as after a restart. `leases`: (index, priority, receipt, visibility_ms,
        deliveries, leased_ms) under `full`, inherited now."""
        if ready is None:
            self._ready.reset(self.record.next_index)
        else:
            for priority, index, deliveries in ready:
                self._ready.push(priority, index, deliveries)
        for index, priority, receipt, visibility_ms, deliveries, leased_ms in leases:
            self._inherit(index, priority, receipt, visibility_ms, deliveries, leased_ms)
        self._load_timed()

    # --- the replica's side: applying what the master decided ------------------------------
    def apply(self, op: Operation) -> None:
        """Apply an operation the master decided, in ordering-index order (Append, docs/PROTOCOL.md
        "Replication messages").

        The replica never decides: it places each message, lease, ack, release and
        dead-lettering exactly as the master did, so under `full` both members hold identical
        state. The ordering index only moves forward."""
        if type(op) is Enqueued:
            self._apply_enqueued(op)
            return
        if op.order:
            self._advance_order(op.order)
        if type(op) is Leased:
            self._take_ready(op.priority, op.index)
            self._inherit(op.index, op.priority, op.receipt, op.visibility_ms, op.deliveries, op.leased_ms)
            return
        if isinstance(op, SubscriptionOpened | SubscriberAcked | SubscriptionDropped):
            apply_subscription_step(self.record, op)
            return
        if type(op) is Matured:
            self._matured(op)
            return
        if type(op) is Purged and op.delayed:
            self._ttl.pop(op.index, None)
            self.record.total_purged += 1
            if self._delayed.pop(op.index, None) is None:
                raise InvariantViolation(f"queue {self.name}: purge of message {op.index}, which is not delayed")
            self.record.delayed_count -= 1
            return
        if type(op) is Purged or type(op) is Expired:
            floor = subscription_floor(self.record)
            if floor is not None and op.index > floor:
                raise InvariantViolation(f"queue {self.name}: message {op.index} left before every durable "
                                         f"subscription acknowledged it (lowest floor {floor})")
            self._ttl.pop(op.index, None)
            if type(op) is Purged:
                self.record.total_purged += 1
            else:
                self.record.total_expired += 1
            if not op.leased:
                self._take_ready(op.priority, op.index)
            elif self._leases.pop(op.index, None) is None:
                raise InvariantViolation(f"queue {self.name}: purge of message {op.index}, which is not leased")
            return
        if type(op) is Extended:
            self._extended(op)
            return
        if type(op) is DeadLettered and not op.leased:     # a ready message whose time ran out
            self._take_ready(op.priority, op.index)
            lease = None
        else:
            lease = self._leases.pop(op.index, None)
            if lease is None:
                raise InvariantViolation(f"queue {self.name}: {type(op).__name__} of message {op.index} that is not leased")
        self._lease_ended(op, lease)  # type: ignore[arg-type]   # what is left: Acked, Released, DeadLettered

    def _extended(self, op: Extended) -> None:
        """The lease runs for its new duration from now, on this member's clock (master or not)."""
        extended = self._leases.get(op.index)
        if extended is None or extended.receipt != op.receipt:
            raise InvariantViolation(f"queue {self.name}: extension of message {op.index} that is not so leased")
        self._inherit(op.index, op.priority, op.receipt, op.visibility_ms, extended.deliveries, extended.leased_ms)

    def _matured(self, op: Matured) -> None:
        """A delayed message's delay ran out: the master deciding it and a member applying it."""
        if self._delayed.pop(op.index, None) is None:
            raise InvariantViolation(f"queue {self.name}: message {op.index} matured but was not delayed")
        self.record.delayed_count -= 1
        self._make_ready(op.index, op.priority, 0)

    def _lease_ended(self, op: Acked | Released | DeadLettered, lease: _Lease | None) -> None:
        """What an ack, a release or a dead-lettering does once the message is off its lease
        (`lease`) or, for a ready message whose time ran out, off the ready set (None): the
        master's ack and release go through here as a member's apply does."""
        record = self.record
        if type(op) is Acked:
            self._ttl.pop(op.index, None)
            record.total_acked += 1
            record.service_ms_total += max(0, op.acked_ms - lease.leased_ms)  # type: ignore[union-attr]
            record.service_count += 1
        elif type(op) is Released:
            record.total_redelivered += 1
            self._make_ready(op.index, op.priority, op.deliveries)
        elif type(op) is DeadLettered:
            self._ttl.pop(op.index, None)
            record.total_dead_lettered += 1
            record.total_expired += op.expired
            if self.dead_letter_core is None:
                raise InvariantViolation(f"queue {self.name} has no dead-letter queue")
            self.dead_letter_core.accept_dead_letter(op.priority, 0, index=op.dead_letter_index)

    def _apply_enqueued(self, op: Enqueued) -> None:
        record = self.record
        if op.index < record.next_index:
            raise InvariantViolation(f"queue {self.name}: enqueue at {op.index} below {record.next_index}")
        record.next_index = op.index + 1
        if op.headers is not None and SEQUENCE_HEADER in op.headers:
            note_sequence(self.record, op.headers, op.client, op.index)
        if op.delay_ms:
            self._delay(op.index, op.priority, op.delay_ms)
        else:
            self._ready.push(op.priority, op.index)
            record.ready_count += 1
        record.total_enqueued += 1
        record.highest_depth = max(record.highest_depth, self.depth)
        if op.dedupe_id is not None:
            self._dedupe.stage(producer_key(op.client, op.dedupe_id), op.index, op.enqueued_ms)
        if op.ttl_ms:
            self._live_for(op.index, op.priority, op.ttl_ms)

    def _advance_order(self, order: int) -> None:
        if order < self.record.next_index:
            raise InvariantViolation(f"queue {self.name}: ordering index {order} below {self.record.next_index}")
        self.record.next_index = order + 1

    def _take_ready(self, priority: int, index: int) -> None:
        """Remove one ready message that is not necessarily at its heap's head."""
        self._ready.take(priority, index)
        self.record.ready_count -= 1

    def _consumption_order(self) -> int:
        """Under `full` every consumption step takes the next ordering index (it is replicated);
        under `producer` it is local to this member and outside the ordering index."""
        if self.record.options.strength is not Strength.FULL:
            return 0
        order = self.record.next_index
        self.record.next_index = order + 1
        return order

    # --- internals -------------------------------------------------------------------------
    def _add_lease(self, index: int, lease: _Lease) -> None:
        self._leases[index] = lease
        heapq.heappush(self._lease_deadlines, (lease.deadline, index, lease.receipt))
        self._lease_deadlines = _bounded(self._lease_deadlines, self._leases,
                                         lambda i, live: (live.deadline, i, live.receipt))

    def _inherit(self, index: int, priority: int, receipt: str, visibility_ms: int, deliveries: int,
                 leased_ms: int) -> None:
        """A lease this member did not grant (stored before a restart, applied as the
        master's decision, in a snapshot): it runs from now on this member's clock."""
        self._add_lease(index, _Lease(priority, receipt, visibility_ms, self._lease_clock() + visibility_ms,
                                      deliveries, leased_ms))

    def _valid_lease(self, index: int, receipt: str, now_ms: int, out: list[Operation]) -> _Lease:
        lease = self._leases.get(index)
        if lease is None:
            if 1 <= index < self.record.next_index:
                raise QueueError(E_LEASE_EXPIRED, f"message {index} has no lease now for the receipt to match "
                                                  "(its lease expired or was released, the message was acked or "
                                                  "taken out of the queue, or no message has this id)")
            raise QueueError(E_UNKNOWN_MESSAGE, f"queue {self.name} has no message {index}")
        if lease.receipt != receipt:
            raise QueueError(E_LEASE_EXPIRED, f"the receipt does not match message {index}'s current lease (it "
                                              "names an earlier lease, which expired or was released before the "
                                              "message was delivered again, or it is no receipt of this message)")
        if lease.deadline <= self._lease_clock():
            # The lease ran out before the expiry sweep got to it: end it now, so the
            # message is redelivered exactly as if the sweep had run first.
            self._end_lease(index, lease, now_ms, expired=True, out=out)
            raise QueueError(E_LEASE_EXPIRED, f"the lease on message {index} had expired when this request came: "
                                              "the message goes back for another delivery (or is dead-lettered "
                                              "after max_deliveries, or expires past its time to live)")
        return lease

    def _end_lease(self, index: int, lease: _Lease, now_ms: int, *, expired: bool,
                   out: list[Operation]) -> None:
        del self._leases[index]
        record = self.record
        live = self._ttl.get(index)
        if live is not None and live[0] <= self._lease_clock():
            self._expire(index, lease.priority, lease.deliveries, True, now_ms, out)
            return
        dead_letter = self.dead_letter_core
        if dead_letter is not None and record.options.dead_letter and lease.deliveries >= record.options.max_deliveries:
            self._ttl.pop(index, None)
            dead_index = dead_letter.accept_dead_letter(lease.priority, now_ms)
            record.total_dead_lettered += 1
            out.append(DeadLettered(record.queue_id, index, lease.priority, lease.deliveries,
                                    dead_letter.queue_id, dead_index, now_ms, True, self._consumption_order()))
            return
        op = Released(record.queue_id, index, lease.priority, lease.deliveries, expired, now_ms,
                      self._consumption_order())
        self._lease_ended(op, lease)
        out.append(op)


def _bounded(heap: list[Any], live: dict[int, Any], entry: Callable[[int, Any], Any]) -> list[Any]:
    """The deadline heap as it is, or rebuilt from `live` (index -> what it times) once its stale
    entries pass STALE_DEADLINES_MAX and the live ones."""
    if len(heap) <= 2 * len(live) + STALE_DEADLINES_MAX:
        return heap
    rebuilt = [entry(index, value) for index, value in live.items()]
    heapq.heapify(rebuilt)
    return rebuilt
