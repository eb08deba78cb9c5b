"""Durable subscriptions of a channel's queue, as the queue's record holds them: name ->
[floor, acked above the floor] (`QueueRecord.subscriptions`).

One definition of each step's effect on the record (opened, acknowledged, dropped), which the
master applies to its own record when it decides the step (replication/queue_core.py) and
every other member applies when the step reaches it: what a subscription holds is written
once. Apart from the core because it is the record's bookkeeping alone: no heaps, leases or
clocks. qserver/features/channels/hub.py serves the subscriptions.
"""
from __future__ import annotations

from replication.invariants import InvariantViolation
from replication.operations import SubscriberAcked, SubscriptionDropped, SubscriptionOpened
from replication.queue_record import QueueRecord

SUBSCRIPTIONS_MAX = 64        # durable subscriptions of one queue (a channel's)
SUBSCRIPTION_PRIORITY = 4     # every channel publish's priority, so durable subscriptions follow this one


def subscription_floor(record: QueueRecord) -> int | None:
    """The lowest floor of the durable subscriptions (None: there are none): no message
    above it may leave the queue, some subscription still waits for it."""
    subscriptions = record.subscriptions
    return min(floor for floor, _ in subscriptions.values()) if subscriptions else None


def apply_subscription_step(record: QueueRecord, op: SubscriptionOpened | SubscriberAcked | SubscriptionDropped) -> None:
    """The step's effect on the record; a step that does not fit it is a broken invariant."""
    subscriptions = record.subscriptions
    if type(op) is SubscriberAcked:
        state = subscriptions.get(op.subscription)
        if state is None:
            raise InvariantViolation(f"queue {record.name}: ack of unknown subscription {op.subscription}")
        floor = max(state[0], op.floor)
        state[0] = floor
        state[1] = sorted(i for i in {op.index, *state[1]} if i > floor)
    elif type(op) is SubscriptionOpened:
        if op.subscription in subscriptions:
            raise InvariantViolation(f"queue {record.name}: subscription {op.subscription} opened twice")
        subscriptions[op.subscription] = [op.order, []]
    elif subscriptions.pop(op.subscription, None) is None:
        raise InvariantViolation(f"queue {record.name}: drop of unknown subscription {op.subscription}")
