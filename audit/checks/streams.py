"""Replaying one stream: the loop over a member's records that drives the index check
(audit/checks/indexes.py) and the message states (audit/checks/messages.py) together, with
their common steps inlined because it runs once per record of the audit.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from audit.checks.indexes import Continuity
from audit.checks.messages import Consumption
from audit.checks.replay import ACKED, LEASED, StreamReplay
from audit.checks.units import ARRIVAL_OP, StreamKey
from audit.checks.violations import DEFAULT_SETTINGS, AuditSettings
from replication.journal import CONSUMPTION_OPS, EPOCH_OP, RESTART_REASON, SNAPSHOT_OPS, SUBSCRIPTION_OPS, JournalRecord


def replay_stream(key: StreamKey, records: Sequence[JournalRecord], *, complete: bool,
                  settings: AuditSettings = DEFAULT_SETTINGS) -> StreamReplay:
    """Replay one stream (sorted by sequence): index continuity, each message's life
    (enqueue, leases, acks, releases, expiries, dead-lettering), delivery order by priority
    then index, and the cause of every redelivery."""
    replay = StreamReplay(key, key[2], complete)
    continuity = Continuity(replay, settings)
    consumer = Consumption(replay, settings)
    epochs, states = replay.epochs, replay.states
    high_by_epoch, consumed_times = continuity.high_by_epoch, replay.consumed_times
    current_epoch: int | None = None
    entry: list[Any] = [0, 0, None, None]
    high = None
    consumption = replicated = 0
    # The common steps (the next index, a new message, a lease of a ready message, an ack of a
    # leased one) are inlined: this loop runs once per record of the audit.
    for record in records:
        op = record.op
        index = record.index
        if op == EPOCH_OP:
            continuity.high = high
            continuity.base(record)
            high = continuity.high
            replay.epoch_records.append(record)
            consumer.discard_after(record.index, record.epoch + (record.dedupe_id == RESTART_REASON))
        elif index > 0:
            if high is not None and index == high + 1 and op != ARRIVAL_OP:
                high = index
                high_by_epoch[record.epoch] = index
            else:
                continuity.high = high
                continuity.step(record)
                high = continuity.high
        if op == "enqueue" or op == ARRIVAL_OP:
            consumer.enqueue(record)
        elif op in SNAPSHOT_OPS:
            consumer.take_over(record)
        elif op in CONSUMPTION_OPS:
            consumption += 1
            if index > 0:
                replicated += 1
            message_id = record.message_id
            if op == "ack" and states.get(message_id) == LEASED:      # type: ignore[arg-type]
                states[message_id] = ACKED                            # type: ignore[index]
                consumed_times.append(record.at_ms)
            else:
                consumer.consume(record)
        elif op in SUBSCRIPTION_OPS:
            consumer.subscription_step(record)
        if op == ARRIVAL_OP:
            continue
        if record.epoch != current_epoch:
            current_epoch = record.epoch
            entry = epochs.setdefault(current_epoch, [record.at_ms, 0, None, None])
        entry[1] += 1
        if record.at_ms < entry[0]:
            entry[0] = record.at_ms
        if entry[2] is None and record.role == "master":
            entry[2] = record
            replay.master_epochs.add(current_epoch)
        if op == EPOCH_OP and record.role == "master" and record.dedupe_id not in (None, RESTART_REASON):
            entry[3] = record.dedupe_id      # a restart in the same role starts no epoch
    continuity.high = high
    continuity.finish()
    replay.records = sum(entry[1] for entry in epochs.values())
    replay.last_sequence = max((r.sequence for r in records if r.op != ARRIVAL_OP), default=0)
    replay.consumption, replay.consumption_replicated = consumption, replicated
    return replay
