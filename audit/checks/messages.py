"""Each message's life in one stream: enqueue, leases, acks, releases, expiries, delays,
dead-lettering, purges; delivery order by priority then index, the cause of every redelivery,
and a channel's durable subscriptions. What one member did with its messages, apart from
whether its history is whole (audit/checks/indexes.py).
"""
from __future__ import annotations

import heapq

from audit.checks.replay import (
    ACKED,
    DEAD,
    DELAYED,
    EXPIRED,
    LEASED,
    PURGED,
    READY,
    TAKING_OPS,
    StreamReplay,
)
from audit.checks.violations import (
    CONSUMED_WITHOUT_LEASE,
    DELIVERY_ORDER,
    DUPLICATED,
    DURABLE_SKIPPED,
    DURABLE_UNKNOWN,
    UNEXPECTED,
    UNEXPLAINED_REDELIVERY,
    AuditSettings,
    violation,
)
from replication.journal import JournalRecord
from replication.options import PRIORITY_MAX

PRIORITIES = PRIORITY_MAX + 1


class Consumption:
    """Message states of one stream, with a ready set per priority to judge delivery order."""

    def __init__(self, replay: StreamReplay, settings: AuditSettings) -> None:
        self.replay, self.settings = replay, settings
        self.ready: list[list[int]] = [[] for _ in range(PRIORITIES)]
        self.ready_count = [0] * PRIORITIES
        self.priority: dict[int, int] = {}
        self.lease_epoch: dict[int, int] = {}
        self.ready_cause: dict[int, str] = {}
        self.lowest_enqueued: int | None = None

    def enqueue(self, record: JournalRecord) -> None:
        message_id = record.message_id
        if message_id is None:
            return
        if message_id in self.replay.enqueued:
            known = self.replay.enqueued[message_id]
            if known.op != "enqueue" or known.epoch >= record.epoch:
                return        # a repeated index is reported by the continuity check
            self._forget(message_id)   # a discarded suffix's message (its epoch record may follow)
        self.replay.enqueued[message_id] = record
        self.replay.states[message_id] = READY
        priority = min(max(record.priority, 0), PRIORITIES - 1)
        self.priority[message_id] = priority
        heapq.heappush(self.ready[priority], message_id)
        self.ready_count[priority] += 1
        if self.lowest_enqueued is None or message_id < self.lowest_enqueued:
            self.lowest_enqueued = message_id

    def take_over(self, record: JournalRecord) -> None:
        """A message this member took over by snapshot, ready or leased as the master held it."""
        message_id = record.message_id
        if message_id is None:
            return
        if message_id in self.replay.enqueued:
            self._forget(message_id)   # a transfer cut short, taken again
        self.enqueue(record._replace(op="enqueue"))
        self.replay.enqueued[message_id] = record
        if record.op == "snapshot_lease":
            self.ready_count[self.priority[message_id]] -= 1
            self.replay.states[message_id] = LEASED
            self.replay.leased_ids.add(message_id)
            self.lease_epoch[message_id] = record.epoch

    def discard_after(self, base: int, epoch: int) -> None:
        """A member took a role in `epoch` holding indices up to `base`: messages it had
        enqueued past `base` in an older epoch were a discarded, never committed suffix (a
        deposed `producer` master drops it and follows on from its commit point); the new
        epoch's messages at the same ids replace them. (A restart passes epoch + 1: its own
        epoch's suffix past the commit point was discarded too.)"""
        replay = self.replay
        discarded = []
        for message_id in reversed(replay.enqueued):    # enqueues come in increasing id order
            if message_id <= base:
                break
            record = replay.enqueued[message_id]
            if record.op == "enqueue" and record.epoch < epoch:
                discarded.append(message_id)
        for message_id in discarded:
            self._forget(message_id)

    def _forget(self, message_id: int) -> None:
        replay = self.replay
        del replay.enqueued[message_id]
        if replay.states.pop(message_id, None) == READY:
            self.ready_count[self.priority[message_id]] -= 1
        replay.leased_ids.discard(message_id)

    def consume(self, record: JournalRecord) -> None:
        message_id = record.message_id
        state = self.replay.states.get(message_id) if message_id is not None else None
        if state is None:
            self._unknown(record)
        elif record.op == "lease":
            self._lease(record, message_id, state)   # type: ignore[arg-type]
        elif record.op == "extend":
            if state != LEASED:          # a new duration for a lease in flight: nothing else moves
                self._refuse(record, state)
        elif record.op in ("ack", "reply"):
            if state == LEASED:
                self.replay.states[message_id] = ACKED   # type: ignore[index]
                self.replay.consumed_times.append(record.at_ms)
            else:
                self._refuse(record, state)
        elif record.op in ("release", "expire"):
            if state == LEASED:
                self._make_ready(message_id, record.op)   # type: ignore[arg-type]
            else:
                self._refuse(record, state)
        elif record.op == "delay":           # journaled right after its enqueue: not ready yet
            if state == READY:
                self.ready_count[self.priority[message_id]] -= 1    # type: ignore[index]
                self.replay.states[message_id] = DELAYED         # type: ignore[index]
            else:
                self._refuse(record, state)
        elif record.op == "mature":
            if state == DELAYED:
                self.replay.states[message_id] = READY           # type: ignore[index]
                priority = self.priority[message_id]              # type: ignore[index]
                heapq.heappush(self.ready[priority], message_id)  # type: ignore[arg-type,misc]
                self.ready_count[priority] += 1
            else:
                self._refuse(record, state)
        elif record.op in TAKING_OPS:
            if self.replay.subscriptions:
                self._check_backlogs(record, message_id)    # type: ignore[arg-type]
            if state in (LEASED, READY, DELAYED):
                if state == READY:
                    self.ready_count[self.priority[message_id]] -= 1    # type: ignore[index]
                self.replay.states[message_id] = TAKING_OPS[record.op]  # type: ignore[index]
                self.replay.consumed_times.append(record.at_ms)
            else:
                self._refuse(record, state)

    def subscription_step(self, record: JournalRecord) -> None:
        """A durable subscription opened, acknowledged a message of its backlog, or dropped."""
        subscriptions, name = self.replay.subscriptions, str(record.dedupe_id)
        if record.op == "subscribe":
            subscriptions[name] = [record.index, set()]
        elif record.op == "unsubscribe":
            subscriptions.pop(name, None)
        else:
            opened, acked = subscriptions.setdefault(name, [None, set()])
            message_id = record.message_id
            if message_id is None:
                return
            state = self.replay.states.get(message_id)
            if (opened is not None and message_id <= opened) or (state is not None and state >= ACKED) or \
                    (state is None and self.replay.complete):
                self.replay.found.append(violation(
                    DURABLE_UNKNOWN, self.replay.queue, f"durable subscription {name} acknowledged message "
                    f"{message_id}, which is not in its backlog", node=self.replay.node, index=record.index or None,
                    message_id=message_id, records=[record], settings=self.settings))
            acked.add(message_id)

    def _check_backlogs(self, record: JournalRecord, message_id: int) -> None:
        """A message leaves a channel's queue (a trim) only once every durable subscription
        whose backlog holds it (opened before it) has acknowledged it."""
        for name, (opened, acked) in self.replay.subscriptions.items():
            if opened is not None and message_id > opened and message_id not in acked:
                self.replay.found.append(violation(
                    DURABLE_SKIPPED, self.replay.queue, f"message {message_id} left the queue ({record.op}) before "
                    f"durable subscription {name} acknowledged it", node=self.replay.node,
                    index=record.index or None, message_id=message_id,
                    records=[self.replay.enqueued.get(message_id, record), record], settings=self.settings))

    def _lease(self, record: JournalRecord, message_id: int, state: int) -> None:
        replay = self.replay
        if state == READY:
            self._check_order(record, message_id)
            self.ready_count[self.priority[message_id]] -= 1
            if message_id in replay.leased_ids:
                replay.redeliveries.append((record.at_ms, self.ready_cause.pop(message_id, "release")))
        elif state == LEASED and record.epoch > self.lease_epoch.get(message_id, record.epoch):
            replay.redeliveries.append((record.at_ms, "change_of_master"))
        elif state == LEASED:
            replay.found.append(violation(
                UNEXPLAINED_REDELIVERY, replay.queue,
                f"message {message_id} leased again in epoch {record.epoch} without a release, expiry "
                "or change of master", node=replay.node, index=record.index or None, message_id=message_id,
                records=[record], settings=self.settings))
        else:
            self._refuse(record, state)
            return
        replay.states[message_id] = LEASED
        replay.leased_ids.add(message_id)
        self.lease_epoch[message_id] = record.epoch

    def _check_order(self, record: JournalRecord, message_id: int) -> None:
        """No ready message of the same or a higher priority with a lower index may wait while
        this one is delivered. (A higher priority with a higher index may not have been
        committed yet, which the journal cannot show, so that case is not judged.)"""
        states, priorities = self.replay.states, self.priority
        for priority in range(priorities[message_id], PRIORITIES):
            if not self.ready_count[priority]:
                continue
            heap = self.ready[priority]
            while heap and (states.get(heap[0]) != READY or priorities[heap[0]] != priority):
                heapq.heappop(heap)
            if heap and heap[0] < message_id:
                waiting = self.replay.enqueued[heap[0]]
                self.replay.found.append(violation(
                    DELIVERY_ORDER, self.replay.queue,
                    f"message {message_id} (priority {priorities[message_id]}) delivered while message {heap[0]} "
                    f"(priority {priority}) was ready", node=self.replay.node, index=record.index or None,
                    message_id=message_id, records=[waiting, record], settings=self.settings))
                return

    def _make_ready(self, message_id: int, cause: str) -> None:
        self.replay.states[message_id] = READY
        priority = self.priority[message_id]
        heapq.heappush(self.ready[priority], message_id)
        self.ready_count[priority] += 1
        self.ready_cause[message_id] = cause

    def _refuse(self, record: JournalRecord, state: int) -> None:
        replay = self.replay
        if state >= ACKED:
            kind, why = DUPLICATED, "after it was " + {ACKED: "acknowledged", DEAD: "dead-lettered",
                                                       PURGED: "purged", EXPIRED: "expired"}[state]
        else:
            kind, why = CONSUMED_WITHOUT_LEASE, "while it was not leased"
        replay.found.append(violation(kind, replay.queue, f"{record.op} of message {record.message_id} {why}",
                                      node=replay.node, index=record.index or None, message_id=record.message_id,
                                      records=[record], settings=self.settings))

    def _unknown(self, record: JournalRecord) -> None:
        """A consumption step of a message this stream never enqueued. When the journal's
        beginning was pruned, messages below the first enqueue seen cannot be judged."""
        message_id = record.message_id
        pruned_before = not self.replay.complete and (
            self.lowest_enqueued is None or message_id is None or message_id < self.lowest_enqueued)
        if pruned_before:
            return
        self.replay.found.append(violation(
            UNEXPECTED, self.replay.queue, f"{record.op} of message {message_id}, which was never enqueued here",
            node=self.replay.node, index=record.index or None, message_id=message_id, records=[record],
            settings=self.settings))
