"""One queue of an incarnation, judged by its final master and every member: nothing committed
is lost, nothing delivered was uncommitted, no retry stored twice; and the queue's summary
(counts, redeliveries, time series, durable subscriptions) that the report shows.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from audit.checks.replay import ACKED, CONSUMED_COUNTS, TAKEN_STATES, StreamReplay
from audit.checks.units import StreamKey
from audit.checks.violations import (
    DUPLICATED,
    DURABLE_SKIPPED,
    LOST,
    SEEN_UNCOMMITTED,
    AuditSettings,
    violation,
)
from replication.invariants import lost_acknowledged, seen_but_uncommitted
from replication.journal import JournalRecord
from replication.options import DEAD_LETTER_SUFFIX

REDELIVERY_CAUSES = ("release", "expire", "change_of_master")

BUCKET_WIDTHS_MS = (10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000, 600_000,
                    1_800_000, 3_600_000, 21_600_000, 86_400_000)


def _final_master(keys: list[StreamKey], replays: Mapping[StreamKey, StreamReplay]) -> StreamKey:
    """The stream of the latest master (highest epoch as master, then latest record)."""
    return max(keys, key=lambda key: (max(replays[key].master_epochs, default=-1), replays[key].last_index,
                                      replays[key].last_sequence, key))


def check_queue(queue: str, keys: list[StreamKey], replays: Mapping[StreamKey, StreamReplay],
                acknowledged: set[int], settings: AuditSettings) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Jepsen's total-queue terms for one queue of an incarnation: every committed message is
    held (queued, acked or dead-lettered) by the final master and every current member."""
    members = [replays[key] for key in sorted(keys)]
    replicated = sum(member.consumption_replicated for member in members)
    consumption = sum(member.consumption for member in members)
    strength = "full" if replicated else "producer" if consumption else "unknown"
    final = replays[_final_master(keys, replays)]
    found: list[dict[str, Any]] = []
    if not (queue.endswith(DEAD_LETTER_SUFFIX) and strength != "full"):
        # A dead-letter queue of a `producer` pair is each member's own: nothing to compare.
        found += _check_survival(queue, members, final, acknowledged, settings)
    found += _duplicated_enqueues(queue, final, settings)
    summary = {"queue": queue, "strength": strength, "final_master": final.node,
               "members": [_member_summary(member) for member in members],
               "counts": {**_history_counts(final, members), **_redelivery_counts(final)},
               "series": _series(final, settings)}
    if final.subscriptions:
        durable, skipped = durable_summary(queue, final, members, settings)
        summary["durable"] = durable
        found += skipped
    return summary, found


def durable_summary(queue: str, final: StreamReplay, members: list[StreamReplay], settings: AuditSettings
                    ) -> tuple[dict[str, dict[str, int | None]], list[dict[str, Any]]]:
    """Each durable subscription the final master holds, from every member's journal (a member
    that took the queue by snapshot did not journal the opening, or the acks before it): its
    backlog (messages enqueued after it opened), how many it acknowledged and how many still
    wait for it at the final master. backlog == acknowledged + waiting proves every publish
    reached it. A member whose own journal cannot date the opening is judged here: a message
    of the backlog it took out of the queue unacknowledged is durable_skipped."""
    out: dict[str, dict[str, int | None]] = {}
    found: list[dict[str, Any]] = []
    held, _ = final.held()
    enqueued = set().union(*(member.enqueued for member in members))
    for name in sorted(final.subscriptions):
        states = [member.subscriptions[name] for member in members if name in member.subscriptions]
        opened = max((state[0] for state in states if state[0] is not None), default=None)
        acked: set[int] = set().union(*(state[1] for state in states))
        if opened is None:
            out[name] = {"opened_at": None, "backlog": None, "acknowledged": len(acked), "waiting": None}
            continue
        backlog = [message_id for message_id in enqueued if message_id > opened]
        out[name] = {"opened_at": opened, "backlog": len(backlog),
                     "acknowledged": sum(1 for message_id in backlog if message_id in acked),
                     "waiting": sum(1 for message_id in backlog if message_id in held and message_id not in acked)}
        for member in members:
            if name not in member.subscriptions or member.subscriptions[name][0] is not None:
                continue          # its own replay judged its trims (Consumption._check_backlogs)
            for message_id in sorted(backlog):
                if member.states.get(message_id) in TAKEN_STATES and message_id not in acked:
                    found.append(violation(
                        DURABLE_SKIPPED, queue, f"message {message_id} left the queue before durable subscription "
                        f"{name} acknowledged it", node=member.node, message_id=message_id,
                        records=[member.enqueued[message_id]] if message_id in member.enqueued else [],
                        settings=settings))
    return out, found


def _history_counts(final: StreamReplay, members: list[StreamReplay]) -> dict[str, int]:
    """The final master's counts, plus the messages consumed before it took the queue over by
    snapshot (a member that joined late, or was rebuilt): its journal starts with the
    messages still held then, and only the other members' journals show the earlier ones
    (each counted once; a message is consumed only once committed)."""
    counts = final.final_counts()
    earlier: dict[int, int] = {}
    for member in members:
        if member is final:
            continue
        for message_id, state in member.states.items():
            if state >= ACKED and message_id not in final.enqueued:
                earlier[message_id] = max(state, earlier.get(message_id, state))
    counts["enqueued"] += len(earlier)
    for state in earlier.values():
        counts[CONSUMED_COUNTS[state]] += 1
    return counts


def _check_survival(queue: str, members: list[StreamReplay], final: StreamReplay, acknowledged: set[int],
                    settings: AuditSettings) -> list[dict[str, Any]]:
    """Committed = held by two nodes or acknowledged to a client: then the final master and
    every member holding the highest index hold it. A message only some consumer saw, which
    the final master does not hold, was seen before it was committed."""
    holders: dict[int, set[str]] = {}
    for member in members:
        for message_id in member.enqueued:
            holders.setdefault(message_id, set()).add(member.node)
    committed = {message_id for message_id, nodes in holders.items() if len(nodes) >= 2} | acknowledged
    high = max(member.last_index for member in members)
    targets = [member for member in members if member.last_index == high and high > 0]
    if final not in targets:
        targets.append(final)

    def witness(message_id: int) -> list[JournalRecord]:
        return [next(m.enqueued[message_id] for m in members if message_id in m.enqueued)] \
            if message_id in holders else []
    found = []
    for target in targets:
        start = target.first_index or 1
        held, consumed = target.held()
        for message_id in sorted(lost_acknowledged({m for m in committed if m >= start}, held, consumed)):
            found.append(violation(LOST, queue, f"committed message {message_id} is not held by {target.node}",
                                   node=target.node, message_id=message_id, records=witness(message_id),
                                   settings=settings))
    delivered = {m for member in members for m in member.leased_ids if m >= (final.first_index or 1)}
    for message_id in sorted(seen_but_uncommitted(delivered, final.enqueued) - committed):
        found.append(violation(SEEN_UNCOMMITTED, queue,
                               f"message {message_id} was delivered but is not in the final master's history",
                               node=final.node, message_id=message_id, records=witness(message_id),
                               settings=settings))
    return found


def _duplicated_enqueues(queue: str, final: StreamReplay, settings: AuditSettings) -> list[dict[str, Any]]:
    """One dedupe id stored as two messages within the dedupe window: a retry stored twice."""
    by_dedupe: dict[str, JournalRecord] = {}
    found = []
    for message_id in sorted(final.enqueued):
        record = final.enqueued[message_id]
        if record.dedupe_id is None or record.op != "enqueue":
            continue
        earlier = by_dedupe.get(record.dedupe_id)
        if earlier is not None and record.at_ms - earlier.at_ms <= settings.dedupe_window_ms:
            found.append(violation(DUPLICATED, queue,
                                   f"dedupe id {record.dedupe_id} stored as messages {earlier.message_id} and {message_id}",
                                   node=final.node, message_id=message_id, records=[earlier, record], settings=settings))
        by_dedupe[record.dedupe_id] = record
    return found


def _member_summary(member: StreamReplay) -> dict[str, Any]:
    node, journal_id, _, queue_id = member.key
    return {"node": node, "journal_id": journal_id, "queue_id": queue_id, "records": member.records,
            "first_index": member.first_index, "last_index": member.last_index,
            "master_epochs": sorted(member.master_epochs), **member.final_counts()}


def _redelivery_counts(member: StreamReplay) -> dict[str, int]:
    counts = {f"redelivered_{cause}": 0 for cause in REDELIVERY_CAUSES}
    for _, cause in member.redeliveries:
        counts[f"redelivered_{cause}"] += 1
    return counts


def _series(member: StreamReplay, settings: AuditSettings) -> dict[str, Any]:
    """Per time bucket: enqueued, consumed (acked or dead-lettered), redelivered by cause, and
    the depth at the bucket's end, as the final master's journal shows them."""
    times = [record.at_ms for record in member.enqueued.values()] + member.consumed_times
    if not times:
        return {"bucket_ms": 0, "start_ms": 0, "enqueued": [], "consumed": [], "depth": [],
                **{cause: [] for cause in REDELIVERY_CAUSES}}
    start, end = min(times), max(times)
    width = next((w for w in BUCKET_WIDTHS_MS if (end - start) // w + 1 <= settings.buckets_max), 0)
    if width == 0:
        width = BUCKET_WIDTHS_MS[-1]
        while (end - start) // width + 1 > settings.buckets_max:
            width *= 2
    count = (end - start) // width + 1

    def bucket(at_ms: int) -> int:
        return min(max((at_ms - start) // width, 0), count - 1)
    series: dict[str, list[int]] = {name: [0] * count for name in ("enqueued", "consumed", *REDELIVERY_CAUSES)}
    for record in member.enqueued.values():
        series["enqueued"][bucket(record.at_ms)] += 1
    for at_ms in member.consumed_times:
        series["consumed"][bucket(at_ms)] += 1
    for at_ms, cause in member.redeliveries:
        series[cause][bucket(at_ms)] += 1
    depth, running = [], 0
    for position in range(count):
        running += series["enqueued"][position] - series["consumed"][position]
        depth.append(running)
    return {"bucket_ms": width, "start_ms": start, **series, "depth": depth}
