"""The queue core: one queue's decisions as a pure state machine.

The node feeds it commands (`enqueue`, `lease`, `extend`, `ack`, `release`, `reply`, `expire_leases`)
with the wall clock's time as an argument (what the records say: enqueue and lease times,
the dedupe window); each appends the operations it decided to `out`, in
order, for the node to persist in one transaction before answering anyone (group commit:
DESIGN.md 4.3, STYLE.md "effects in order"). Nothing here waits, sleeps or does I/O apart
from committed-state reads through `StoreReader`.

Memory holds the leases in flight and, per priority, a heap of ready message indices. After
a restart the heap starts empty and pages of pre-restart messages are loaded on demand
(`_fill_head`), so a node holding a million messages serves at once. Invariant per priority:
the heap holds every ready message with index <= `_loaded_upto`, plus any newer ones
(everything made ready since the restart); a page is loaded whenever the heap's head lies
beyond `_loaded_upto`, which keeps delivery in (priority, index) order.

Leases are timed apart from the records, on `lease_clock` (the node's monotonic clock, a
virtual one in simulations): a lease is a duration, and its deadline is where that duration
ends on this member's own clock, counted from the grant here, or from the moment this member
inherited it (a restart, a takeover: `inherit_leases`, a snapshot). A wall clock that steps,
or two members' clocks that disagree, move no deadline (DESIGN.md 4.1).
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
    options_from_json,
    producer_key,
)
from replication.store import StoredLease, StoreReader
from wire.errors import (
    E_INVALID_OPTION,
    E_LEASE_EXPIRED,
    E_OVERLOADED,
    E_QUEUE_FULL,
    E_SUBSCRIPTIONS_FULL,
    E_UNKNOWN_MESSAGE,
    E_UNKNOWN_SUBSCRIPTION,
    E_WRONG_QUEUE_TYPE,
    QueueError,
)

READY_PAGE_SIZE = 1024
SUBSCRIPTIONS_MAX = 64        # durable subscriptions of one queue (a channel's)
# A producer that sends an ordered stream (a forwarder: issue 16) names it and numbers its
# messages in these headers; the queue stores each number once, however long between retries.
SEQUENCE_KEY_HEADER, SEQUENCE_HEADER = "x-sequence-key", "x-sequence"
# A producer whose numbers do not arrive in order (a forwarder: its source's priorities, delays
# and redeliveries reorder them) declares its floor: every number below it is settled (stored,
# or never to be sent again). Without it a number is its own floor: an in-order stream.
SEQUENCE_FLOOR_HEADER = "x-sequence-floor"
SEQUENCE_KEYS_MAX = 1_000     # streams one queue keeps numbers of
SEQUENCE_KEYS_PER_PRODUCER_MAX = 100  # of them, one producing client's (a forward numbers one per priority and source incarnation)
SEQUENCE_WINDOW_MAX = 4_096   # numbers a stream keeps at or above its floor (beyond: E_OVERLOADED)
SEQUENCE_NUMBERS_PER_PRODUCER_MAX = 8_192   # ... all streams of one producer, once one holds SEQUENCE_STREAM_FEW
SEQUENCE_STREAM_FEW = 256
SUBSCRIPTION_PRIORITY = 4     # every channel publish's priority, so durable subscriptions follow this one
# A deadline heap (leases, times to live, delays) is rebuilt from what is live once its stale
# entries pass this many and the live ones: a member that applies the master's decisions
# never pops them (only the deciding member's timed steps do), so they would grow for ever.
STALE_DEADLINES_MAX = 1024
PRIORITIES_HIGH_FIRST = tuple(range(PRIORITY_MAX, -1, -1))


@dataclass(slots=True)
class QueueRecord:
    """A queue's persisted identity and counters; written in every batch that touched it."""
    queue_id: int          # the incarnation: a new id each time a name is (re)created
    name: str
    options: QueueOptions
    created_ms: int
    next_index: int = 1
    epoch: int = 1
    state: QueueState = QueueState.UNKNOWN
    ready_count: int = 0
    delayed_count: int = 0     # messages waiting for their delivery delay (not ready yet)
    dead_letter_of: str | None = None
    total_enqueued: int = 0
    total_acked: int = 0
    total_dead_lettered: int = 0
    total_purged: int = 0
    total_expired: int = 0     # messages whose time to live ran out (dropped or dead-lettered)
    total_redelivered: int = 0
    highest_depth: int = 0
    service_ms_total: int = 0
    service_count: int = 0
    incarnation: int = 0     # the queue's identity across the cluster (0: a single node's queue)
    in_sync: bool = True     # the master's record of its replica (the membership layer's, later)
    # The pair's commit point as this member knew it when the batch was sealed (written with
    # every batch that touches the queue, so it covers every message consumed here): a member
    # restarted after a crash drops what it holds past it (discard_after). 0: not known.
    commit_order: int = 0
    # Durable subscriptions of a channel's queue: name -> [floor, acked]. Every message of the
    # subscription's backlog with index <= floor is acknowledged (it began at floor, its
    # SubscriptionOpened's ordering index); `acked` lists those above the floor acknowledged out
    # of order. Queue state, so it travels with the record: every batch, restart and snapshot.
    subscriptions: dict[str, list[Any]] = field(default_factory=dict)
    # Numbered streams of producers (SEQUENCE_KEY_HEADER): key -> [floor, {number: message id}]:
    # every number below the floor is settled, and those kept (at or above it) are stored. A
    # message whose number is either is a repeat, not stored again.
    sequences: dict[str, list[Any]] = field(default_factory=dict)
    # Streams changed since the record was last sealed for storage: the store keeps each stream
    # in a row of its own (LMDB `streams`), written when it changes, not with every batch that
    # touches the queue (a queue's producers may number many). Not part of the record's JSON.
    changed_streams: set[str] = field(default_factory=set, compare=False, repr=False)

    def to_json(self, *, streams: bool = True) -> dict[str, Any]:
        """The record as JSON; `streams=False`: without its streams (stored apart, see
        `changed_streams`), as every batch that touches the queue writes it."""
        # Written with every batch that touches the queue: a plain copy of the fields, not
        # dataclasses.asdict (which deep-copies recursively and cost ~100 µs of each commit).
        out = {name: getattr(self, name) for name in self.__slots__ if name != "changed_streams"}
        out["options"] = self.options.to_json()
        out["state"] = self.state.value
        if self.subscriptions:      # packed later, off the engine's task: a copy, not the live lists
            out["subscriptions"] = {name: [floor, list(acked)] for name, (floor, acked) in self.subscriptions.items()}
        del out["sequences"]
        if streams and self.sequences:
            out["sequences"] = {key: self.stream_json(key) for key in self.sequences}
        return out

    def stream_json(self, key: str) -> list[Any] | None:
        """One stream as stored ([floor, [[number, id], ...]]), None when the record has none."""
        stream = self.sequences.get(key)
        return None if stream is None else [stream[0], [[number, index] for number, index in stream[1].items()]]

    def take_changed_streams(self) -> list[tuple[str, list[Any] | None]]:
        """The streams changed since the last call, as stored (None: gone), for the batch being sealed."""
        changed = [(key, self.stream_json(key)) for key in sorted(self.changed_streams)]
        self.changed_streams.clear()
        return changed

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> QueueRecord:
        fields = {**raw, "options": options_from_json(raw["options"]), "state": QueueState(raw["state"])}
        fields.pop("sequences", None)
        record = cls(**fields)
        record.sequences = sequences_from_json(raw.get("sequences", {}))
        # A record stored before streams had rows of their own carries them: each is written to
        # its row with the record's next write (which no longer holds them).
        record.changed_streams = set(record.sequences)
        return record


def sequences_from_json(raw: dict[str, Any]) -> dict[str, list[Any]]:
    """Streams as stored ([floor, [[number, id], ...]]); a record written before floors
    ([highest number, its id]) reads as that number's floor with it stored."""
    out: dict[str, list[Any]] = {}
    for key, (floor, stored) in raw.items():
        pairs = [(floor, stored)] if isinstance(stored, int) else stored
        out[str(key)] = [int(floor), {int(number): int(index) for number, index in pairs}]
    return out


@dataclass(slots=True)
class _Lease:
    priority: int
    receipt: str
    visibility_ms: int     # what was granted (replicated and stored)
    deadline: int          # where it ends on this member's lease clock
    deliveries: int
    leased_ms: int         # wall clock, for the record


@dataclass(slots=True)
class _DedupeOverlay:
    """Dedupe ids of enqueues not yet committed (reads see committed state only)."""
    staged: dict[str, tuple[int, int]] = field(default_factory=dict)
    sealed: dict[str, tuple[int, int]] = field(default_factory=dict)


class QueueCore:
    def __init__(self, record: QueueRecord, reader: StoreReader, rng: random.Random, *,
                 lease_clock: Callable[[], int], leases: list[StoredLease] = (),  # type: ignore[assignment]
                 dedupe_window_ms: int = 300_000) -> None:
        self.record = record
        self._lease_clock = lease_clock
        self._reader = reader
        self._rng = rng
        self._dedupe_window_ms = dedupe_window_ms
        self._dedupe = _DedupeOverlay()
        self.dead_letter_core: QueueCore | None = None
        # Every index below the boundary was stored before this core was built.
        self._boundary = record.next_index
        self._ready: list[list[int]] = [[] for _ in range(PRIORITY_MAX + 1)]
        self._ready_deliveries: dict[int, int] = {}
        self._loaded_upto = [0] * (PRIORITY_MAX + 1)
        self._exhausted = [record.ready_count == 0] * (PRIORITY_MAX + 1)
        self._pushed_beyond: list[set[int]] = [set() for _ in range(PRIORITY_MAX + 1)]
        self._removed: set[int] = set()   # ready indices taken out of order by apply()
        # Consumers may see messages up to this ordering index: the commit point of a
        # replicated queue (DESIGN.md 3.2: only committed operations are visible). None: all.
        self.visible_upto: int | None = None
        self._leases: dict[int, _Lease] = {}
        # Enqueues refused because the queue was at max_depth, on this member since it started
        # (seed 003's overflows: the master decides, so only the master's count grows).
        self.overflows = 0
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
        small map delivered with it (checked by the caller: replication.options.checked_headers)."""
        if dedupe_id is not None:
            earlier = self._find_dedupe(producer_key(client, dedupe_id), now_ms)
            if earlier is not None:
                return earlier, True
        if headers is not None and SEQUENCE_HEADER in headers:
            earlier = self._sequence_repeat(headers, client)
            if earlier is not None:
                return earlier, True
        return self._place(payload, priority, dedupe_id, client, now_ms, out, ttl_ms, delay_ms, headers), False

    def enqueue_many(self, payloads: list[bytes], priority: int, dedupe_ids: list[str | None], client: str,
                     now_ms: int, out: list[Operation], ttl_ms: int = 0, delay_ms: int = 0,
                     headers: dict[str, str] | None = None) -> list[int | QueueError]:
        """A batch in one step: each message's id (a kept dedupe id's earlier one), or the
        error that refused it. The committed dedupe ids are looked up in one read."""
        staged, sealed = self._dedupe.staged, self._dedupe.sealed
        keys = [None if d is None else producer_key(client, d) for d in dedupe_ids]
        unknown = [k for k in keys if k is not None and k not in staged and k not in sealed]
        stored = self._reader.dedupe_lookup_many(self.queue_id, unknown) if unknown else {}
        find, place = self._find_dedupe, self._place
        outcomes: list[int | QueueError] = []
        if headers is not None and SEQUENCE_HEADER in headers:
            if len(payloads) != 1:       # one number names one message
                return [QueueError(E_INVALID_OPTION, f"{SEQUENCE_HEADER} numbers one message: enqueue them one "
                                                     "at a time")] * len(payloads)
            try:
                earlier = self._sequence_repeat(headers, client)
            except QueueError as error:
                return [error]
            if earlier is not None:
                return [earlier]
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
        index = record.next_index
        record.next_index = index + 1
        ttl_ms = ttl_ms or record.options.message_ttl_ms
        out.append(Enqueued(record.queue_id, index, priority, now_ms, dedupe_id, client, payload, ttl_ms, delay_ms,
                            headers))
        if headers is not None and SEQUENCE_HEADER in headers:
            self._note_sequence(headers, client, index)
        if ttl_ms:
            self._live_for(index, priority, ttl_ms)
        if delay_ms:
            self._delay(index, priority, delay_ms)
        else:
            heapq.heappush(self._ready[priority], index)
            record.ready_count += 1
        record.total_enqueued += 1
        if self.depth > record.highest_depth:
            record.highest_depth = self.depth
        if dedupe_id is not None:
            self._dedupe.staged[producer_key(client, dedupe_id)] = (index, now_ms)
        return index

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
            while len(leased) < max_messages and self._fill_head(priority):
                if visible_upto is not None and self._ready[priority][0] > visible_upto:
                    break       # the rest of this priority is newer still: not committed yet
                index = heapq.heappop(self._ready[priority])
                if index in self._ttl and self._ttl[index][0] <= lease_now:
                    # Its time ran out before the sweep got to it: never delivered.
                    self._expire_ready(index, priority, now_ms, out, popped=True)
                    continue
                deliveries = self._ready_deliveries.pop(index, 0) + 1
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
            if self._fill_head(priority):
                index = self._ready[priority][0]
                if visible_upto is None or index <= visible_upto:
                    return index, priority
        return None

    def ready_head(self, priority: int) -> int | None:
        """The lowest ready index of that priority (what a lease of it would take), if any."""
        return self._ready[priority][0] if self._fill_head(priority) else None

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
        self._ttl.pop(index, None)
        record = self.record
        record.total_acked += 1
        record.service_ms_total += max(0, now_ms - lease.leased_ms)
        record.service_count += 1
        out.append(Acked(record.queue_id, index, lease.priority, client, now_ms,
                         record.options.tracks_status, reply, self._consumption_order()))

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
        lease.visibility_ms = visibility_ms
        lease.deadline = self._lease_clock() + visibility_ms
        heapq.heappush(self._lease_deadlines, (lease.deadline, index, receipt))
        out.append(Extended(self.queue_id, index, lease.priority, receipt, visibility_ms, client, now_ms,
                            self._consumption_order()))

    # --- numbered streams (SEQUENCE_HEADER) -------------------------------------------------
    def _sequence_repeat(self, headers: dict[str, str], client: str) -> int | None:
        """The message id to answer with when the message's number is settled already (its own
        id when the stream still lists it, else the stream's latest), else None; refuses
        malformed numbers and a stream with no room. A stream is its producer's own (the key
        is scoped by the client id): another client naming the same key numbers another stream."""
        key, number, _ = _sequence_of(headers, client)
        stream = self.record.sequences.get(key)
        if stream is None:
            sequences = self.record.sequences
            if len(sequences) >= SEQUENCE_KEYS_MAX:
                raise QueueError(E_INVALID_OPTION, f"queue {self.name} keeps {SEQUENCE_KEYS_MAX} streams' numbers")
            prefix = producer_key(client, "")
            if sum(1 for other in sequences if other.startswith(prefix)) >= SEQUENCE_KEYS_PER_PRODUCER_MAX:
                raise QueueError(E_INVALID_OPTION, f"client {client} numbers {SEQUENCE_KEYS_PER_PRODUCER_MAX} streams "
                                               f"in queue {self.name} already")
            return None
        floor, stored = stream
        if number in stored:
            return stored[number]    # type: ignore[no-any-return]
        if number < floor:
            return max(stored.values(), default=0)
        if len(stored) >= SEQUENCE_WINDOW_MAX:
            raise QueueError(E_OVERLOADED, f"stream {key} of queue {self.name} holds {SEQUENCE_WINDOW_MAX} numbers "
                                           f"above its floor {floor}: retry once its producer's floor moves")
        # The numbers live in the queue's record, written with every batch: what one producer
        # keeps there is bounded over all its streams too (counted only once a stream holds
        # many: an in-order producer's stream holds one).
        if len(stored) >= SEQUENCE_STREAM_FEW and self._numbers_held(client) >= SEQUENCE_NUMBERS_PER_PRODUCER_MAX:
            raise QueueError(E_OVERLOADED, f"client {client} holds {SEQUENCE_NUMBERS_PER_PRODUCER_MAX} numbers above "
                                           f"its streams' floors in queue {self.name}: retry once its floors move")
        return None

    def _numbers_held(self, client: str) -> int:
        prefix = producer_key(client, "")
        return sum(len(stream[1]) for key, stream in self.record.sequences.items() if key.startswith(prefix))

    def _note_sequence(self, headers: dict[str, str], client: str, index: int) -> None:
        """Record a stored number and raise the floor to what its producer declared (the
        master placing it and every member applying it do the same)."""
        key, number, declared = _sequence_of(headers, client)
        self.record.changed_streams.add(key)
        stream = self.record.sequences.setdefault(key, [0, {}])
        if declared > stream[0]:      # numbers below a raised floor are settled: forgotten
            stream[0] = declared
            stream[1] = {n: i for n, i in stream[1].items() if n >= declared}
        stream[1][number] = index

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
        self.record.subscriptions[name] = [op.order, []]
        out.append(op)
        return True

    def drop_subscription(self, name: str, client: str, now_ms: int, out: list[Operation]) -> None:
        if self.record.subscriptions.pop(name, None) is None:
            raise QueueError(E_UNKNOWN_SUBSCRIPTION, f"{self.name} has no durable subscription {name!r}")
        out.append(SubscriptionDropped(self.queue_id, name, client, now_ms, self._consumption_order()))

    def subscriber_ack(self, name: str, index: int, client: str, now_ms: int, out: list[Operation]) -> bool:
        """A durable subscription acknowledges message `index` of its backlog; False when it
        had already (an ack repeated after a lost answer). The floor moves over every
        acknowledged message it now has below it, walking the stored messages above it."""
        state = self.record.subscriptions.get(name)
        if state is None:
            raise QueueError(E_UNKNOWN_SUBSCRIPTION, f"{self.name} has no durable subscription {name!r}")
        floor, acked = state
        if index <= floor or index in acked:
            return False
        if not self._reader.ready_page(self.queue_id, SUBSCRIPTION_PRIORITY, index - 1, index + 1, 1):
            raise QueueError(E_UNKNOWN_MESSAGE, f"{self.name}: no message {index} in subscription {name}'s backlog")
        done = {index, *acked}
        rows = self._reader.ready_page(self.queue_id, SUBSCRIPTION_PRIORITY, floor, 2**63, len(done) + 1)
        for stored, _ in rows:
            if stored not in done:
                break
            floor = stored
        op = SubscriberAcked(self.queue_id, name, index, floor, client, now_ms, self._consumption_order())
        self._apply_subscriber_ack(op)
        out.append(op)
        return True

    def subscription_floor(self) -> int | None:
        """The lowest floor of the durable subscriptions (None: there are none): no message
        above it may leave the queue, some subscription still waits for it."""
        subscriptions = self.record.subscriptions
        return min(floor for floor, _ in subscriptions.values()) if subscriptions else None

    def _apply_subscriber_ack(self, op: SubscriberAcked) -> None:
        state = self.record.subscriptions.get(op.subscription)
        if state is None:
            raise InvariantViolation(f"queue {self.name}: ack of unknown subscription {op.subscription}")
        floor = max(state[0], op.floor)
        state[0] = floor
        state[1] = sorted(i for i in {op.index, *state[1]} if i > floor)

    def purge(self, upto: int, limit: int, now_ms: int, out: list[Operation]) -> tuple[int, bool]:
        """Take up to `limit` messages with index <= `upto` out of the queue, leased ones
        first, then ready ones in delivery order; returns (how many, whether none is left).
        An operator's purge runs this in bounded steps (Engine._step_purge) with `upto` fixed
        at its start, so what is enqueued meanwhile stays. A message a durable subscription
        has not acknowledged stays too: `upto` stops below the lowest floor."""
        floor = self.subscription_floor()
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
            heap = self._ready[priority]
            while purged < limit and self._fill_head(priority) and heap[0] <= upto:
                index = heapq.heappop(heap)
                self._ready_deliveries.pop(index, None)
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
            self._fill_head(priority) and self._ready[priority][0] <= upto for priority in PRIORITIES_HIGH_FIRST)
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
            del self._delayed[index]
            self.record.delayed_count -= 1
            out.append(Matured(self.queue_id, index, priority, now_ms, self._consumption_order()))
            self._make_ready(index, priority, 0)
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
        self._dedupe.sealed, self._dedupe.staged = self._dedupe.staged, {}

    def advance(self) -> None:
        """The sealed batch is committed: the reader sees it now."""
        self._dedupe.sealed = {}

    def accept_dead_letter(self, priority: int, now_ms: int, *, index: int = 0) -> int:
        """Make room for a message moving in from the queue this one is the dead-letter queue of
        (at `index` when applying the master's decision, else at the next index)."""
        record = self.record
        if index == 0:
            index = record.next_index
        elif index < record.next_index:
            raise InvariantViolation(f"queue {self.name}: dead letter at {index} below {record.next_index}")
        record.next_index = index + 1
        heapq.heappush(self._ready[priority], index)
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
        heapq.heappush(self._ready[priority], index)
        if self._loaded_upto[priority] < index < self._boundary:
            # A pre-restart message whose page is not loaded yet: the page load must skip it,
            # since it may or may not see the committed copy of this operation.
            self._pushed_beyond[priority].add(index)
        if deliveries:
            self._ready_deliveries[index] = deliveries

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
            deliveries = self._ready_deliveries.pop(index, 0)
            self.record.ready_count -= 1
        else:
            deliveries = self._ready_deliveries.get(index, 0)
            self._take_ready(priority, index)
        self._expire(index, priority, deliveries, False, now_ms, out)

    def discard_after(self, order: int) -> list[tuple[int, int]] | None:
        """Drop a deposed `producer` master's uncommitted suffix: the enqueues past `order`
        (no consumer saw them: only committed messages are visible), so that the member can
        follow the new master from `order` and keep its own consumption state of everything
        before (DESIGN.md 4.1). Messages past `order` stored before this core was built (a
        restart) are counted on their pages, which are never loaded again. Returns the
        (priority, index) dropped from memory, or None when it cannot be done here (under
        `full` the suffix holds consumption steps too; a message past `order` is leased): the
        member then takes the master's whole history instead."""
        if self.options.strength is not Strength.PRODUCER or any(index > order for index in self._leases):
            return None
        boundary, on_disk = self._boundary, 0
        if order + 1 < boundary:
            for priority in range(PRIORITY_MAX + 1):
                after = order
                while rows := self._reader.ready_page(self.queue_id, priority, after, boundary, READY_PAGE_SIZE):
                    on_disk += len(rows)
                    after = rows[-1][0]
                    if len(rows) < READY_PAGE_SIZE:
                        break
            self._boundary = order + 1           # pages past it are never loaded again
            self._loaded_upto = [min(upto, order) for upto in self._loaded_upto]
            self._pushed_beyond = [{index for index in pushed if index <= order} for pushed in self._pushed_beyond]
        dropped: list[tuple[int, int]] = []
        for priority, heap in enumerate(self._ready):
            if any(index > order for index in heap):
                dropped += [(priority, index) for index in heap if index > order and index not in self._removed]
                kept = [index for index in heap if index <= order]
                heapq.heapify(kept)
                self._ready[priority] = kept
        for _, index in dropped:
            self._ready_deliveries.pop(index, None)
        for index in [index for index in self._ttl if index > order]:
            del self._ttl[index]
        delayed = [index for index in self._delayed if index > order]
        for index in delayed:
            del self._delayed[index]
        self._removed = {index for index in self._removed if index <= order}
        for overlay in (self._dedupe.staged, self._dedupe.sealed):
            for dedupe_id in [d for d, (index, _) in overlay.items() if index > order]:
                del overlay[dedupe_id]
        # A number stored by a dropped message is not stored any more: its producer, never
        # answered, sends it again. The floor stays: it is the producer's word about numbers
        # below it (a forwarder declares only what its source committed), not this queue's data.
        for key, numbered in self.record.sequences.items():
            kept_numbers = {number: index for number, index in numbered[1].items() if index <= order}
            if len(kept_numbers) != len(numbered[1]):
                numbered[1] = kept_numbers
                self.record.changed_streams.add(key)
        count = on_disk + sum(1 for _, index in dropped if index >= boundary)   # below it: counted on disk
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
            self._boundary = self.record.next_index
            self._ready = [[] for _ in range(PRIORITY_MAX + 1)]
            self._ready_deliveries = {}
            self._loaded_upto = [0] * (PRIORITY_MAX + 1)
            self._exhausted = [False] * (PRIORITY_MAX + 1)
            self._pushed_beyond = [set() for _ in range(PRIORITY_MAX + 1)]
            self._removed = set()
        else:
            for priority, index, deliveries in ready:
                heapq.heappush(self._ready[priority], index)
                if deliveries:
                    self._ready_deliveries[index] = deliveries
        for index, priority, receipt, visibility_ms, deliveries, leased_ms in leases:
            self._inherit(index, priority, receipt, visibility_ms, deliveries, leased_ms)
        self._load_timed()

    # --- the replica's side: applying what the master decided ------------------------------
    def apply(self, op: Operation) -> None:
        """Apply an operation the master decided, in ordering-index order (DESIGN.md 4.1).

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
            self._apply_subscription_step(op)
            return
        if type(op) is Matured:
            if self._delayed.pop(op.index, None) is None:
                raise InvariantViolation(f"queue {self.name}: message {op.index} matured but was not delayed")
            self.record.delayed_count -= 1
            self._make_ready(op.index, op.priority, 0)
            return
        if type(op) is Purged and op.delayed:
            self._ttl.pop(op.index, None)
            self.record.total_purged += 1
            if self._delayed.pop(op.index, None) is None:
                raise InvariantViolation(f"queue {self.name}: purge of message {op.index}, which is not delayed")
            self.record.delayed_count -= 1
            return
        if type(op) is Purged or type(op) is Expired:
            floor = self.subscription_floor()
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
            extended = self._leases.get(op.index)
            if extended is None or extended.receipt != op.receipt:
                raise InvariantViolation(f"queue {self.name}: extension of message {op.index} that is not so leased")
            self._inherit(op.index, op.priority, op.receipt, op.visibility_ms, extended.deliveries, extended.leased_ms)
            return
        if type(op) is DeadLettered and not op.leased:     # a ready message whose time ran out
            self._take_ready(op.priority, op.index)
            lease = None
        else:
            lease = self._leases.pop(op.index, None)
            if lease is None:
                raise InvariantViolation(f"queue {self.name}: {type(op).__name__} of message {op.index} that is not leased")
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

    def _apply_subscription_step(self, op: SubscriptionOpened | SubscriberAcked | SubscriptionDropped) -> None:
        subscriptions = self.record.subscriptions
        if type(op) is SubscriberAcked:
            self._apply_subscriber_ack(op)
        elif type(op) is SubscriptionOpened:
            if op.subscription in subscriptions:
                raise InvariantViolation(f"queue {self.name}: subscription {op.subscription} opened twice")
            subscriptions[op.subscription] = [op.order, []]
        elif subscriptions.pop(op.subscription, None) is None:
            raise InvariantViolation(f"queue {self.name}: drop of unknown subscription {op.subscription}")

    def _apply_enqueued(self, op: Enqueued) -> None:
        record = self.record
        if op.index < record.next_index:
            raise InvariantViolation(f"queue {self.name}: enqueue at {op.index} below {record.next_index}")
        record.next_index = op.index + 1
        if op.headers is not None and SEQUENCE_HEADER in op.headers:
            self._note_sequence(op.headers, op.client, op.index)
        if op.delay_ms:
            self._delay(op.index, op.priority, op.delay_ms)
        else:
            heapq.heappush(self._ready[op.priority], op.index)
            record.ready_count += 1
        record.total_enqueued += 1
        record.highest_depth = max(record.highest_depth, self.depth)
        if op.dedupe_id is not None:
            self._dedupe.staged[producer_key(op.client, op.dedupe_id)] = (op.index, op.enqueued_ms)
        if op.ttl_ms:
            self._live_for(op.index, op.priority, op.ttl_ms)

    def _advance_order(self, order: int) -> None:
        if order < self.record.next_index:
            raise InvariantViolation(f"queue {self.name}: ordering index {order} below {self.record.next_index}")
        self.record.next_index = order + 1

    def _take_ready(self, priority: int, index: int) -> None:
        """Remove one ready message that is not necessarily at its heap's head."""
        if self._fill_head(priority) and self._ready[priority][0] == index:
            heapq.heappop(self._ready[priority])
        else:
            self._removed.add(index)      # skipped when it reaches a head or a page load
        self._ready_deliveries.pop(index, None)
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
    def _find_dedupe(self, dedupe_id: str, now_ms: int, stored: dict[str, tuple[int, int]] | None = None) -> int | None:
        """The kept message of this dedupe id; `stored`: the committed ids already read for
        a batch (StoreReader.dedupe_lookup_many), else storage is asked."""
        hit = self._dedupe.staged.get(dedupe_id) or self._dedupe.sealed.get(dedupe_id)
        if hit is None:
            hit = stored.get(dedupe_id) if stored is not None else self._reader.dedupe_lookup(self.queue_id, dedupe_id)
        if hit is not None and now_ms - hit[1] <= self._dedupe_window_ms:
            return hit[0]
        return None

    def _fill_head(self, priority: int) -> bool:
        """True when the priority's heap head is the lowest ready index of that priority."""
        heap = self._ready[priority]
        removed = self._removed
        while True:
            while not self._exhausted[priority] and (not heap or heap[0] > self._loaded_upto[priority]):
                self._load_page(priority)
            if not heap or not removed or heap[0] not in removed:
                return bool(heap)
            removed.discard(heapq.heappop(heap))

    def _load_page(self, priority: int) -> None:
        rows = self._reader.ready_page(self.queue_id, priority, self._loaded_upto[priority],
                                       self._boundary, READY_PAGE_SIZE)
        heap, skip = self._ready[priority], self._pushed_beyond[priority]
        for index, deliveries in rows:
            if index in skip:
                skip.discard(index)
                continue
            if index in self._removed:
                self._removed.discard(index)
                continue
            heapq.heappush(heap, index)
            if deliveries:
                self._ready_deliveries[index] = deliveries
        if len(rows) < READY_PAGE_SIZE:
            self._exhausted[priority] = True
            self._loaded_upto[priority] = self._boundary
            skip.clear()
        else:
            self._loaded_upto[priority] = rows[-1][0]

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
        record.total_redelivered += 1
        priority = lease.priority
        self._make_ready(index, priority, lease.deliveries)
        out.append(Released(record.queue_id, index, priority, lease.deliveries, expired, now_ms,
                            self._consumption_order()))


def _sequence_of(headers: dict[str, str], client: str) -> tuple[str, int, int]:
    """(stream key, scoped by its producer; number; declared floor) of a numbered message, or
    E_INVALID_OPTION."""
    key, raw = headers.get(SEQUENCE_KEY_HEADER), headers[SEQUENCE_HEADER]
    raw_floor = headers.get(SEQUENCE_FLOOR_HEADER, raw)
    if not key or not _is_number(raw) or not _is_number(raw_floor) or int(raw_floor) > int(raw):
        raise QueueError(E_INVALID_OPTION, f"{SEQUENCE_HEADER} is a number from 1, with {SEQUENCE_KEY_HEADER} "
                                           f"naming the stream (and {SEQUENCE_FLOOR_HEADER}, if any, at most it)")
    return producer_key(client, key), int(raw), int(raw_floor)


def _is_number(raw: str) -> bool:
    return raw.isdigit() and 0 < len(raw) <= 18 and int(raw) >= 1


def _bounded(heap: list[Any], live: dict[int, Any], entry: Callable[[int, Any], Any]) -> list[Any]:
    """The deadline heap as it is, or rebuilt from `live` (index -> what it times) once its stale
    entries pass STALE_DEADLINES_MAX and the live ones."""
    if len(heap) <= 2 * len(live) + STALE_DEADLINES_MAX:
        return heap
    rebuilt = [entry(index, value) for index, value in live.items()]
    heapq.heapify(rebuilt)
    return rebuilt
