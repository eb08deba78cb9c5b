"""Which streams of a queue group belong together: one incarnation of a queue is the streams
that share replicated operations, with each dead-letter queue's stream beside its source's.
Also the dead-letter queue's derived arrivals: the journal does not carry a dead-letter
queue's message id, so it is derived. The queue's ids and (under `full`) its ordering indices
come from one counter, so the k-th arrival takes the k-th positive integer that none of the
dead-letter queue's own records uses as an ordering index.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from audit.checks.units import ARRIVAL_OP, StreamKey, group_of
from replication.journal import ENQUEUE_OPS, EPOCH_OP, SNAPSHOT_REASON, JournalRecord
from replication.options import DEAD_LETTER_SUFFIX, dead_letter_name

LINK_HEAD_RECORDS = 16      # linking streams looks at each stream's first replicated records ...
LINK_STRIDE = 16            # ... and at every index divisible by this


def dead_letter_arrivals(source: Sequence[JournalRecord], dead: Sequence[JournalRecord]) -> list[JournalRecord]:
    """The derived arrivals of a dead-letter queue's stream, one per `dead_letter` of its source
    stream on the same node, in order (see the module docstring for the numbering)."""
    used = {record.index for record in dead if record.index > 0 and record.op != EPOCH_OP}
    payloads = {record.message_id: record for record in source if record.op in ENQUEUE_OPS}
    template = dead[0] if dead else None
    arrivals: list[JournalRecord] = []
    # A dead-letter queue taken over by snapshot numbers its later arrivals after its state.
    candidate = max((record.index for record in dead if record.op == EPOCH_OP and record.dedupe_id == SNAPSHOT_REASON),
                    default=0)
    for record in source:
        if record.op != "dead_letter":
            continue
        candidate += 1
        while candidate in used:
            candidate += 1
        enqueue = payloads.get(record.message_id)
        arrivals.append(JournalRecord(
            record.journal_id, record.sequence, record.at_ms,
            template.queue if template else dead_letter_name(record.queue),
            template.queue_id if template else -1, record.epoch, candidate if record.index > 0 else 0, ARRIVAL_OP,
            candidate, None, record.priority, enqueue.payload_size if enqueue else 0,
            enqueue.payload_crc32 if enqueue else 0, record.role, record.node, record.client))
    return arrivals


class _Links:
    """Union-find over stream keys."""

    def __init__(self) -> None:
        self.parent: dict[StreamKey, StreamKey] = {}

    def find(self, key: StreamKey) -> StreamKey:
        parent = self.parent.setdefault(key, key)
        while parent != key:
            grand = self.parent[parent]
            self.parent[key] = grand
            key, parent = parent, grand
        return key

    def union(self, first: StreamKey, second: StreamKey) -> None:
        one, other = self.find(first), self.find(second)
        if one != other:
            self.parent[max(one, other)] = min(one, other)


def link_incarnations(streams: Mapping[StreamKey, Sequence[JournalRecord]]) -> list[list[StreamKey]]:
    """Streams of one queue incarnation: those sharing a replicated operation, and each
    dead-letter stream with its source stream on the same journal (the source with the
    highest local id below the dead-letter queue's, as both are created together)."""
    links = _Links()
    first_holder: dict[tuple[Any, ...], StreamKey] = {}
    for key, records in streams.items():
        links.find(key)
        position = 0
        for record in records:
            index = record.index
            if index <= 0 or record.op == EPOCH_OP:
                continue
            position += 1
            # A sample is enough: members of one incarnation share long runs of indices, and
            # a stream that starts later (a new replica) shares its first indices.
            if position > LINK_HEAD_RECORDS and index % LINK_STRIDE:
                continue
            identity = (record.queue, index, record.op, record.message_id, record.at_ms, record.dedupe_id)
            holder = first_holder.setdefault(identity, key)
            if holder != key:
                links.union(holder, key)
    for key, source in dead_letter_sources(streams).items():
        links.union(key, source)
    for key, successor in _replaced_empty_instances(streams).items():
        links.union(key, successor)
    components: dict[StreamKey, list[StreamKey]] = {}
    for key in streams:
        components.setdefault(links.find(key), []).append(key)
    return sorted(sorted(members) for members in components.values())


def _replaced_empty_instances(streams: Mapping[StreamKey, Sequence[JournalRecord]]) -> dict[StreamKey, StreamKey]:
    """An instance that journaled nothing but its epoch records was replaced before it held
    anything (a new replica wiped to take a snapshot): it belongs with the next instance of
    the same queue on the same journal."""
    keys = sorted(streams)
    successors: dict[StreamKey, StreamKey] = {}
    for key in keys:
        if any(record.op != EPOCH_OP for record in streams[key]):
            continue
        later = [other for other in keys if other[:3] == key[:3] and other[3] > key[3]]
        if later:
            successors[key] = later[0]
    return successors


def dead_letter_sources(streams: Iterable[StreamKey]) -> dict[StreamKey, StreamKey]:
    keys = sorted(streams)
    sources: dict[StreamKey, StreamKey] = {}
    for key in keys:
        node, journal_id, queue, queue_id = key
        if not queue.endswith(DEAD_LETTER_SUFFIX):
            continue
        candidates = [other for other in keys if other[:2] == (node, journal_id)
                      and other[2] == group_of(queue) and other[3] < queue_id]
        if candidates:
            sources[key] = max(candidates, key=lambda other: other[3])
    return sources
