"""The client-side history (docs/AUDIT.md, "History file") against the journals: every
enqueue a client saw acknowledged is there under the id it was told, a definite failure is
not. The history is the audit's input, not the journal's format, so it is defined here; its
entries travel with the journal records (as records of op `HISTORY_OP`) to reach their group.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from audit.checks.replay import StreamReplay
from audit.checks.units import StreamKey
from audit.checks.violations import (
    ACKNOWLEDGED_MISSING,
    HISTORY_MALFORMED,
    HISTORY_MISMATCH,
    PAYLOAD_MISMATCH,
    UNEXPECTED,
    AuditSettings,
    violation,
)
from replication.journal import JournalRecord

HISTORY_OP = "history"            # a client-side history entry travelling with the records

HISTORY_STATUSES = ("ok", "unknown", "fail")


class HistoryEnqueue(NamedTuple):
    """One client-side enqueue outcome (docs/AUDIT.md, "History file")."""
    queue: str
    status: str                   # ok | unknown | fail
    message_id: int | None
    dedupe_id: str | None
    payload_crc32: int | None = None
    at_ms: int | None = None
    client: str | None = None


def history_as_record(entry: HistoryEnqueue) -> JournalRecord:
    """A history entry shaped as a record, so that it can travel with the journals (Spark)."""
    return JournalRecord("", 0, entry.at_ms or 0, entry.queue, 0, 0, 0, HISTORY_OP, entry.message_id,
                         entry.dedupe_id, 0, 0, -1 if entry.payload_crc32 is None else entry.payload_crc32,
                         entry.status, "", entry.client)


def record_as_history(record: JournalRecord) -> HistoryEnqueue:
    return HistoryEnqueue(record.queue, record.role, record.message_id, record.dedupe_id,
                          None if record.payload_crc32 in (-1, None) else record.payload_crc32,
                          record.at_ms or None, record.client)


def check_history(history: list[HistoryEnqueue], components: list[list[StreamKey]],
                  replays: Mapping[StreamKey, StreamReplay], settings: AuditSettings) -> tuple[
        dict[int, dict[str, set[int]]], list[dict[str, Any]], dict[str, int]]:
    """Every enqueue a client saw acknowledged is in the journals, under the id it was told; a
    definite failure is not; an unknown outcome may be either (found: Jepsen's "recovered").
    Returns the acknowledged message ids per incarnation (position) and queue."""
    counts = {"ok": 0, "unknown": 0, "fail": 0, "recovered": 0}
    acknowledged: dict[int, dict[str, set[int]]] = {}
    found: list[dict[str, Any]] = []
    if not history:
        return acknowledged, found, counts
    by_dedupe, by_id = _enqueue_index(components, replays)
    for entry in sorted(history, key=lambda h: (h.queue, h.dedupe_id or "", h.message_id or 0, h.status)):
        if entry.status not in HISTORY_STATUSES or (entry.dedupe_id is None and entry.message_id is None):
            found.append(_history_violation(HISTORY_MALFORMED, entry, "a history entry needs a status of ok, "
                                            "unknown or fail and a dedupe_id or id", None, settings))
            continue
        counts[entry.status] += 1
        match = by_dedupe.get((entry.queue, entry.dedupe_id)) if entry.dedupe_id is not None \
            else by_id.get((entry.queue, entry.message_id or 0))
        if entry.status == "ok":
            found += _judge_acknowledged(entry, match, settings)
            if match is not None:
                acknowledged.setdefault(match[0], {}).setdefault(entry.queue, set()).add(match[1].message_id or 0)
        elif entry.status == "fail" and match is not None:
            found.append(_history_violation(UNEXPECTED, entry, "an enqueue the client saw fail is in the journals",
                                            match[1], settings))
        elif entry.status == "unknown" and match is not None:
            counts["recovered"] += 1
    return acknowledged, found, counts


def _enqueue_index(components: list[list[StreamKey]], replays: Mapping[StreamKey, StreamReplay]) -> tuple[
        dict[tuple[str, str], tuple[int, JournalRecord]], dict[tuple[str, int], tuple[int, JournalRecord]]]:
    """Where each dedupe id and message id was enqueued. One found twice is matched with the
    record of the newest epoch: an older one was a deposed master's discarded suffix, and the
    client's retry (same dedupe id) was stored again under a new id by the next master."""
    by_dedupe: dict[tuple[str, str], tuple[int, JournalRecord]] = {}
    by_id: dict[tuple[str, int], tuple[int, JournalRecord]] = {}

    def keep(index: dict[Any, tuple[int, JournalRecord]], slot: Any, found: tuple[int, JournalRecord]) -> None:
        known = index.get(slot)
        if known is None or found[1].epoch > known[1].epoch:
            index[slot] = found
    for position, members in enumerate(components):
        for key in members:
            for message_id, record in replays[key].enqueued.items():
                if record.op != "enqueue":
                    continue
                if record.dedupe_id is not None:
                    keep(by_dedupe, (record.queue, record.dedupe_id), (position, record))
                keep(by_id, (record.queue, message_id), (position, record))
    return by_dedupe, by_id


def _judge_acknowledged(entry: HistoryEnqueue, match: tuple[int, JournalRecord] | None,
                        settings: AuditSettings) -> list[dict[str, Any]]:
    if match is None:
        return [_history_violation(ACKNOWLEDGED_MISSING, entry, "an acknowledged enqueue is in no journal",
                                   None, settings)]
    record = match[1]
    if entry.message_id is not None and entry.message_id != record.message_id:
        return [_history_violation(HISTORY_MISMATCH, entry, f"the client was told id {entry.message_id}, the "
                                   f"journals hold it as {record.message_id}", record, settings)]
    if entry.payload_crc32 is not None and entry.payload_crc32 != record.payload_crc32:
        return [_history_violation(PAYLOAD_MISMATCH, entry, "the journals hold another payload checksum than "
                                   "the client sent", record, settings)]
    return []


def _history_violation(kind: str, entry: HistoryEnqueue, detail: str, record: JournalRecord | None,
                       settings: AuditSettings) -> dict[str, Any]:
    where = f"dedupe id {entry.dedupe_id}" if entry.dedupe_id is not None else f"id {entry.message_id}"
    return violation(kind, entry.queue, f"{detail} ({where})", message_id=entry.message_id,
                     records=[record] if record else [], settings=settings)
