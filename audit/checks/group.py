"""Every per-queue check on one queue group: the unit Spark's workers and the pure-Python path
both hand records to (audit/spark_job.py, audit/local.py). Splits the records into streams,
replays them, links incarnations, and runs the member, queue and history checks on each.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import msgpack

from audit.checks.history import HISTORY_OP, HistoryEnqueue, check_history, record_as_history
from audit.checks.incarnations import dead_letter_arrivals, dead_letter_sources, link_incarnations
from audit.checks.members import check_agreement, check_masters, timeline
from audit.checks.queues import check_queue
from audit.checks.replay import StreamReplay
from audit.checks.streams import replay_stream
from audit.checks.units import ARRIVAL_OP, StreamKey, group_of
from audit.checks.violations import DEFAULT_SETTINGS, RECORD_CHECKSUM, AuditSettings, cap_violations, violation
from replication.journal import UNDECODABLE_OP, JournalRecord, record_checksum_ok

_SEQUENCE = itemgetter(1)


def check_group(group: str, records: Iterable[JournalRecord], settings: AuditSettings = DEFAULT_SETTINGS,
                journal_starts: Mapping[tuple[str, str], int | None] | None = None) -> dict[str, Any]:
    """Every per-queue check on one queue group (journal records and history entries, in any
    order). `journal_starts` gives each (node, journal id)'s first sequence present: a journal
    that starts at 1 is complete, so each of its streams must start at index 1 (or at the base
    an epoch record names)."""
    journal_starts = journal_starts or {}
    history, streams, found = _split(records, settings)
    sources = dead_letter_sources(streams)
    replays: dict[StreamKey, StreamReplay] = {}
    for key, stream_records in streams.items():
        if key in sources:
            arrivals = dead_letter_arrivals(streams[sources[key]], stream_records)
            stream_records = sorted([*stream_records, *arrivals], key=lambda r: (r.sequence, r.op != ARRIVAL_OP))
        replays[key] = replay_stream(key, stream_records, complete=journal_starts.get(key[:2]) == 1,
                                     settings=settings)
        found += replays[key].found
    components = link_incarnations(streams)
    acknowledged, history_found, history_counts = check_history(history, components, replays, settings)
    found += history_found
    incarnations = []
    flags: list[dict[str, Any]] = []
    for position, members in enumerate(components):
        incarnation, incarnation_found, incarnation_flags = _check_incarnation(
            members, streams, replays, acknowledged.get(position, {}), settings)
        incarnations.append(incarnation)
        found += incarnation_found
        flags += incarnation_flags
    flags.sort(key=lambda flag: (flag["kind"], flag["queue"], flag["node"] or "", flag["epoch"], flag["first"]))
    listed, counts = cap_violations(found, settings)
    return {"group": group, "incarnations": incarnations, "violations": listed, "violation_counts": counts,
            "flags": flags, "history": history_counts}


def _split(records: Iterable[JournalRecord], settings: AuditSettings) -> tuple[
        list[HistoryEnqueue], dict[StreamKey, list[JournalRecord]], list[dict[str, Any]]]:
    """History entries apart; journal records by stream in journal order, checksums verified."""
    history: list[HistoryEnqueue] = []
    found: list[dict[str, Any]] = []
    streams: dict[StreamKey, list[JournalRecord]] = {}
    pack = msgpack.Packer(use_bin_type=True).pack
    for record in records:
        if record.op == HISTORY_OP:
            history.append(record_as_history(record))
            continue
        if record.op == UNDECODABLE_OP or not record_checksum_ok(record, pack):
            found.append(violation(RECORD_CHECKSUM, record.queue, "the record does not match its checksum",
                                   node=record.node, index=record.index, message_id=record.message_id,
                                   records=[record], settings=settings))
            if record.op == UNDECODABLE_OP:
                continue
        key = (record.node, record.journal_id, record.queue, record.queue_id)
        stream = streams.get(key)
        if stream is None:
            stream = streams[key] = []
        stream.append(record)
    for stream in streams.values():
        stream.sort(key=_SEQUENCE)      # usually sorted already: linear
    return history, dict(sorted(streams.items())), found


def _check_incarnation(members: list[StreamKey], streams: Mapping[StreamKey, Sequence[JournalRecord]],
                       replays: Mapping[StreamKey, StreamReplay], acknowledged: Mapping[str, set[int]],
                       settings: AuditSettings) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    flags: list[dict[str, Any]] = [flag for key in members for flag in replays[key].flags]
    found = check_agreement(members, streams, flags, settings)
    found += check_masters(members, replays, settings)
    queues: dict[str, list[StreamKey]] = {}
    for key in members:
        queues.setdefault(key[2], []).append(key)
    summaries = []
    for queue in sorted(queues):
        summary, queue_found = check_queue(queue, queues[queue], replays, acknowledged.get(queue, set()), settings)
        summaries.append(summary)
        found += queue_found
    epochs, epoch_flags = timeline(members, replays)
    first = members[0]
    incarnation = {"id": f"{first[2]}@{first[0]}/{first[1]}/{first[3]}", "queue": group_of(first[2]),
                   "queues": summaries, "epochs": epochs}
    return incarnation, found, flags + epoch_flags
