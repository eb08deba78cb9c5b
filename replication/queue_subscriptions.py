"""Durable subscriptions of a channel's queue, as the queue's record holds them: name ->
[floor, acked above the floor] (`QueueRecord.subscriptions`).

One definition of each step's effect on the record (opened, acknowledged, dropped), which the
master applies to its own record when it decides the step (replication/queue_core.py) and
every other member applies when the step reaches it: what a subscription holds is written
once. Apart from the core because it is the record's bookkeeping alone: no heaps, leases or
clocks. qserver/features/channels/hub.py serves the subscriptions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from replication.invariants import InvariantViolation
from replication.operations import Operation, SubscriberAcked, SubscriptionDropped, SubscriptionOpened
from replication.queue_record import QueueRecord
from wire.errors import E_UNKNOWN_MESSAGE, E_UNKNOWN_SUBSCRIPTION, QueueError

SUBSCRIPTIONS_MAX = 64        # durable subscriptions of one queue (a channel's)
SUBSCRIPTION_PRIORITY = 4     # every channel publish's priority, so durable subscriptions follow this one
RUN_READ_MAX = 4_096          # a run of acks spanning more stored messages checks each message on its own

# ready_page(after, before, limit): the stored ready messages after < index < before, lowest first
ReadyPage = Callable[[int, int, int], list[tuple[int, int]]]


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


def acknowledge_run(record: QueueRecord, queue_id: int, name: str, indices: Sequence[int], client: str, now_ms: int,
                    out: list[Operation], ready_page: ReadyPage, next_order: Callable[[], int]) -> list[bool | QueueError]:
    """A durable subscription acknowledges a run of messages of its backlog (one reader's acks
    that arrived together: qserver/features/channels/hub.py batches them), decided by the
    master: per message True, False when it had already (an ack repeated after a lost answer),
    or the error that refuses it alone (not in the backlog). One read checks the run's messages
    and one walk moves the floor over every acknowledged message it now has below it; each
    message newly acknowledged is one SubscriberAcked (every member journals it, so the audit
    sees each), the last carrying the floor the run moved to, the others the floor before it."""
    state = record.subscriptions.get(name)
    if state is None:
        raise QueueError(E_UNKNOWN_SUBSCRIPTION, f"{record.name} has no durable subscription {name!r}")
    floor, acked = state
    done = set(acked)
    highest = max(indices)
    stored = None if highest - floor > RUN_READ_MAX else \
        {index for index, _ in ready_page(floor, highest + 1, highest - floor)}
    outcomes: list[bool | QueueError] = []
    new: list[int] = []
    for index in indices:
        if index <= floor or index in done:
            outcomes.append(False)
        elif (index in stored) if stored is not None else bool(ready_page(index - 1, index + 1, 1)):
            done.add(index)
            new.append(index)
            outcomes.append(True)
        else:
            outcomes.append(QueueError(E_UNKNOWN_MESSAGE, f"{record.name}: no message {index} in subscription "
                                                          f"{name}'s backlog"))
    if new:
        moved = floor
        for index, _ in ready_page(floor, 2**63, len(done) + 1):
            if index not in done:
                break
            moved = index
        for position, index in enumerate(new):
            op = SubscriberAcked(queue_id, name, index, moved if position == len(new) - 1 else floor, client, now_ms,
                                 next_order())
            apply_subscription_step(record, op)      # as every member applies it
            out.append(op)
    return outcomes
