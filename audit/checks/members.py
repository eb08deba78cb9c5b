"""The members of one incarnation against each other: they agree op for op within an epoch,
each epoch has one master, and the timeline of epochs (handoffs, failovers, forced
promotions). Records of an "epoch" op are used when present (replication/journal.py); every
check also works without them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from audit.checks.replay import StreamReplay
from audit.checks.units import StreamKey, group_of
from audit.checks.violations import (
    DISCARDED_SUFFIX,
    MEMBER_DISAGREEMENT,
    PAYLOAD_MISMATCH,
    TWO_MASTERS,
    UNCLEAN_PROMOTION,
    AuditSettings,
    violation,
)
from replication.invariants import epochs_with_two_masters
from replication.journal import EPOCH_OP, JournalRecord

_CONTENT = slice(7, 13)       # op, message_id, dedupe_id, priority, payload_size, payload_crc32


def _content(record: JournalRecord) -> Any:
    return record[_CONTENT]


def check_agreement(members: list[StreamKey], streams: Mapping[StreamKey, Sequence[JournalRecord]],
                    flags: list[dict[str, Any]], settings: AuditSettings) -> list[dict[str, Any]]:
    """Members agree op for op: two records at one ordering index of one queue written in the
    same epoch must be the same operation with the same payload checksum. Different contents
    in different epochs are a discarded, never committed suffix (flagged, not a violation:
    if such a message had been acknowledged or seen, the survival checks say so)."""
    if len(members) < 2:
        return []
    first_seen: dict[tuple[str, int], JournalRecord] = {}
    conflicts: dict[tuple[str, int], list[JournalRecord]] = {}
    content = _CONTENT
    for key in members:
        for record in streams[key]:
            if record.index <= 0 or record.op == EPOCH_OP:
                continue
            slot = (record.queue, record.index)
            seen = first_seen.get(slot)
            if seen is None:
                first_seen[slot] = record
            elif seen[content] != record[content]:
                conflicts.setdefault(slot, [seen]).append(record)
    found = []
    for (queue, index), records in sorted(conflicts.items()):
        found += _judge_conflict(queue, index, records, flags, settings)
    return found


def _judge_conflict(queue: str, index: int, records: list[JournalRecord], flags: list[dict[str, Any]],
                    settings: AuditSettings) -> list[dict[str, Any]]:
    by_content: dict[tuple[Any, ...], list[JournalRecord]] = {}
    for record in records:
        by_content.setdefault(_content(record), []).append(record)
    contents = sorted(by_content, key=repr)
    found = []
    for position, one in enumerate(contents):
        for other in contents[position + 1:]:
            shared = {r.epoch for r in by_content[one]} & {r.epoch for r in by_content[other]}
            if not shared:
                continue
            same_op = one[:4] == other[:4]
            epoch = min(shared)
            cited = [r for r in by_content[one] + by_content[other] if r.epoch == epoch]
            what = "payload checksums differ" if same_op else f"{one[0]} of {one[1]} against {other[0]} of {other[1]}"
            found.append(violation(PAYLOAD_MISMATCH if same_op else MEMBER_DISAGREEMENT, queue,
                                   f"members disagree at index {index} in epoch {epoch}: {what}",
                                   node=",".join(sorted({r.node for r in cited})), index=index,
                                   message_id=one[1], records=cited, settings=settings))
    if not found:
        newest = max(r.epoch for r in records)
        for content in contents:
            group = by_content[content]
            if max(r.epoch for r in group) < newest:
                flags.append({"kind": DISCARDED_SUFFIX, "queue": queue, "node": ",".join(sorted({r.node for r in group})),
                              "epoch": max(r.epoch for r in group), "first": index, "last": index,
                              "detail": f"{content[0]} at index {index} replaced in a later epoch"})
    return found


def check_masters(members: list[StreamKey], replays: Mapping[StreamKey, StreamReplay],
                  settings: AuditSettings) -> list[dict[str, Any]]:
    observations = []
    witnesses: dict[tuple[int, str], JournalRecord] = {}
    for key in members:
        for epoch, entry in replays[key].epochs.items():
            if entry[2] is not None:
                observations.append((epoch, key[0]))
                witnesses.setdefault((epoch, key[0]), entry[2])
    found = []
    queue = group_of(members[0][2])
    for epoch, nodes in sorted(epochs_with_two_masters(observations).items()):
        found.append(violation(TWO_MASTERS, queue, f"epoch {epoch} has masters {', '.join(sorted(nodes))}",
                               node=",".join(sorted(nodes)), records=[witnesses[(epoch, node)] for node in sorted(nodes)],
                               settings=settings))
    return found


def timeline(members: list[StreamKey], replays: Mapping[StreamKey, StreamReplay]) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]]]:
    """Each epoch of the incarnation: its master(s), when it was first seen and why it began
    (from "epoch" records when the journals have them, otherwise inferred)."""
    epochs: dict[int, dict[str, Any]] = {}
    for key in members:
        for epoch, (first_ms, records, master_record, reason) in replays[key].epochs.items():
            entry = epochs.setdefault(epoch, {"epoch": epoch, "masters": set(), "first_ms": first_ms,
                                              "reason": None, "records": 0})
            entry["first_ms"] = min(entry["first_ms"], first_ms)
            entry["records"] += records
            if master_record is not None:
                entry["masters"].add(key[0])
            if reason is not None and entry["reason"] is None:
                entry["reason"] = reason
    flags = []
    timeline: list[dict[str, Any]] = []
    previous: set[str] = set()
    for epoch in sorted(epochs):
        entry = epochs[epoch]
        masters = entry["masters"]
        entry["inferred"] = entry["reason"] is None
        if entry["inferred"]:
            entry["reason"] = "create" if not timeline else ("change_of_master" if masters and masters != previous
                                                             else "same_master")
        if entry["reason"] == "unclean":
            flags.append({"kind": UNCLEAN_PROMOTION, "queue": group_of(members[0][2]), "node": ",".join(sorted(masters)),
                          "epoch": epoch, "first": 0, "last": 0,
                          "detail": f"forced promotion (qctl promote --unclean) to epoch {epoch}"})
        entry["masters"] = sorted(masters)
        previous = masters or previous
        timeline.append(entry)
    return timeline, flags
