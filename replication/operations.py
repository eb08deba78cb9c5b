"""The operations a queue core applies, as typed records.

Each record is what the node persists (and journals) in one LMDB transaction and, from the
replication release on, what the master sends to its replica in ordering-index order. Tags
are fixed and never reused. They are plain values: no behaviour, no I/O, never changed after
they are made. They are not declared frozen only because a frozen dataclass's __init__ costs
about three times as much, and one of these is made for every message on the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class Enqueued:
    TAG: ClassVar[int] = 1
    queue_id: int
    index: int            # the ordering index; it is the message id
    priority: int
    enqueued_ms: int
    dedupe_id: str | None
    client: str
    payload: bytes = field(repr=False)
    # Time to live (0: none), a duration as a lease's is: each member times it on its own
    # monotonic clock from when it placed the message (the master's enqueue, the replica's
    # apply, a restart), so a message never expires early, at worst one restart late.
    ttl_ms: int = 0
    # Delivery delay (0: ready at once), a duration timed the same way: the message waits,
    # not ready, until a `Matured` operation makes it so (each member, under `producer`).
    delay_ms: int = 0
    headers: dict[str, str] | None = None     # a small map the producer gave it, delivered with it

    @property
    def order(self) -> int:
        """An enqueue's ordering index is its message id."""
        return self.index


@dataclass(slots=True)
class Leased:
    """A ready message handed to a consumer for `visibility_ms`. The duration is what is
    replicated and stored, never a deadline: each member times it on its own monotonic clock
    (from the grant at the master; from its takeover or restart at a member that inherits it),
    so a wall clock's step or two nodes' skew neither expires a lease early nor stretches it."""
    TAG: ClassVar[int] = 2
    queue_id: int
    index: int
    priority: int
    receipt: str
    visibility_ms: int
    deliveries: int
    client: str
    leased_ms: int      # wall clock, for the record (journal, service time); never for timing
    order: int = 0        # ordering index under `full`; 0 for a member's local lease (`producer`)


@dataclass(slots=True)
class Acked:
    TAG: ClassVar[int] = 3
    queue_id: int
    index: int
    priority: int
    client: str
    acked_ms: int
    track_status: bool
    reply: bytes | None = field(default=None, repr=False)   # set for two_way replies
    order: int = 0


@dataclass(slots=True)
class Released:
    """A lease ended without an ack (given back, or expired): the message is ready again."""
    TAG: ClassVar[int] = 4
    queue_id: int
    index: int
    priority: int
    deliveries: int
    expired: bool
    at_ms: int
    order: int = 0


@dataclass(slots=True)
class DeadLettered:
    """After max_deliveries the message moves to the queue's dead-letter queue, in one step."""
    TAG: ClassVar[int] = 5
    queue_id: int
    index: int
    priority: int
    deliveries: int
    dead_letter_queue_id: int
    dead_letter_index: int
    at_ms: int
    track_status: bool
    order: int = 0
    expired: bool = False     # its time to live ran out (else: max_deliveries was reached)
    leased: bool = True       # it was leased (the lease ends with the move), else ready


@dataclass(slots=True)
class Extended:
    """A lease in flight given a new duration, counted from now (SQS ChangeMessageVisibility);
    the receipt and the delivery count stay. Like `Leased`, the duration is what travels."""
    TAG: ClassVar[int] = 6
    queue_id: int
    index: int
    priority: int
    receipt: str
    visibility_ms: int
    client: str
    at_ms: int
    order: int = 0


@dataclass(slots=True)
class Purged:
    """An operator's purge took the message out of the queue, ready (`leased` False) or leased,
    for good: consumed, not lost (the audit counts it as purged)."""
    TAG: ClassVar[int] = 7
    queue_id: int
    index: int
    priority: int
    leased: bool
    at_ms: int
    track_status: bool
    order: int = 0
    delayed: bool = False     # it was still waiting for its delivery delay (`Enqueued.delay_ms`)


@dataclass(slots=True)
class Expired:
    """The message's time to live ran out (`Enqueued.ttl_ms`) in a queue without a dead-letter
    queue: it leaves the queue, ready or at the end of its lease (`leased`), never delivered
    again. (With a dead-letter queue it moves there: `DeadLettered` with `expired`.)"""
    TAG: ClassVar[int] = 8
    queue_id: int
    index: int
    priority: int
    leased: bool
    at_ms: int
    track_status: bool
    order: int = 0


@dataclass(slots=True)
class Matured:
    """A delayed message's delay ran out: it is ready from now on, in priority-then-index
    order among the ready messages (so ahead of later enqueues of its priority)."""
    TAG: ClassVar[int] = 9
    queue_id: int
    index: int
    priority: int
    at_ms: int
    order: int = 0


@dataclass(slots=True)
class SubscriptionOpened:
    """A durable subscription of a channel's queue begins (seed 002's UDP_ACK_RETRY class): its
    backlog is every message enqueued after this operation (index > `order`) that it has not
    acknowledged. The subscriptions are queue state kept in the queue's record, so they travel
    with it through storage, restarts and snapshots; these operations are how they change."""
    TAG: ClassVar[int] = 10
    queue_id: int
    subscription: str
    client: str
    at_ms: int
    order: int = 0


@dataclass(slots=True)
class SubscriberAcked:
    """A durable subscription acknowledged message `index`; `floor` is what the master computed
    from it: every message of the subscription's backlog up to `floor` is acknowledged (the
    replica applies it as decided, it never walks the messages itself)."""
    TAG: ClassVar[int] = 11
    queue_id: int
    subscription: str
    index: int
    floor: int
    client: str
    at_ms: int
    order: int = 0


@dataclass(slots=True)
class SubscriptionDropped:
    """A durable subscription ends for good: its backlog is no longer kept for it."""
    TAG: ClassVar[int] = 12
    queue_id: int
    subscription: str
    client: str
    at_ms: int
    order: int = 0


OPERATION_TYPES: dict[int, type] = {}   # filled below: tag -> class, for the codec

Operation = (Enqueued | Leased | Acked | Released | DeadLettered | Extended | Purged | Expired | Matured
             | SubscriptionOpened | SubscriberAcked | SubscriptionDropped)
SUBSCRIPTION_OPERATIONS = (SubscriptionOpened, SubscriberAcked, SubscriptionDropped)

for _kind in (Enqueued, Leased, Acked, Released, DeadLettered, Extended, Purged, Expired, Matured,
              *SUBSCRIPTION_OPERATIONS):
    OPERATION_TYPES[_kind.TAG] = _kind
