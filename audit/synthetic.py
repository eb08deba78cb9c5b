"""Synthetic journals that a correct cluster could have written: for the benchmark and for
tests that need more records than a real run makes quickly.

Each queue is a pair on two of three nodes (queue k: master n(k mod 3)+1, replica the next
node); even queues are `full`, odd ones `producer`. Producers enqueue batches with random
priorities; consumers lease the best ready message (priority, then index, as the queue core
does), and ack it, or now and then release it or let its lease expire (it is delivered again
later). Some messages stay queued at the end. Every member journals what it applied, with the
checksums storage writes, and the files are written as the exporter writes them.
"""
from __future__ import annotations

import heapq
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pyarrow.parquet as pq

from qserver.storage.journal_export import columns_table
from replication.journal import JOURNAL_FIELDS, RECORD_COLUMNS

NODES = ("n1", "n2", "n3")
BASE_MS = 1_790_000_000_000


@dataclass
class _Journal:
    node: str
    journal_id: str
    columns: dict[str, list[Any]] = field(default_factory=lambda: {name: [] for name in RECORD_COLUMNS})
    sequence: int = 0

    def append(self, fields: list[Any]) -> None:
        self.sequence += 1
        columns = self.columns
        for name, item in zip(JOURNAL_FIELDS, fields, strict=True):
            columns[name].append(item)
        columns["journal_id"].append(self.journal_id)
        columns["sequence"].append(self.sequence)
        columns["record_crc32"].append(zlib.crc32(msgpack.packb(fields, use_bin_type=True)))
        columns["extra"].append(None)

    def __len__(self) -> int:
        return self.sequence


class _Queue:
    """One queue pair's life: the ops it decides, journaled by both members."""

    def __init__(self, number: int, journals: dict[str, _Journal], rng: random.Random) -> None:
        self.name = f"queue-{number:04d}"
        self.full = number % 2 == 0
        self.master = NODES[number % 3]
        self.replica = NODES[(number + 1) % 3]
        self.queue_id = number + 1
        self.journals, self.rng = journals, rng
        self.order = 0
        self.now_ms = BASE_MS + number
        self.ready: dict[str, list[tuple[int, int]]] = {self.master: [], self.replica: []}
        self.priorities: dict[int, int] = {}

    def _journal(self, node: str, op: str, index: int, message_id: int, priority: int,
                 dedupe_id: str | None = None, payload_crc32: int = 0, payload_size: int = 0) -> None:
        role = "master" if node == self.master else "replica"
        client = "" if op in ("release", "expire") else "producer"
        self.journals[node].append([self.now_ms, self.name, self.queue_id, 1, index, op, message_id, dedupe_id,
                                    priority, payload_size, payload_crc32, role, node, client])

    def enqueue_batch(self, count: int) -> int:
        written = 0
        for _ in range(count):
            self.order += 1
            message_id = self.order
            priority = self.rng.choice((1, 4, 4, 4, 7, 9))
            self.priorities[message_id] = priority
            crc = zlib.crc32(message_id.to_bytes(8, "big"))
            for node in (self.master, self.replica):
                self._journal(node, "enqueue", message_id, message_id, priority, f"d{self.name}-{message_id}",
                              crc, 100)
                heapq.heappush(self.ready[node], (-priority, message_id))
                written += 1
        self.now_ms += 1
        return written

    def consume(self, keep: int) -> int:
        """Consume until `keep` messages are left; returns the records written."""
        written = 0
        consumers = [self.master] if self.full else [self.master, self.replica]
        for node in consumers:
            ready = self.ready[node]
            while len(ready) > keep:
                written += self._deliver(node, ready)
        if self.full:
            self.ready[self.replica] = list(self.ready[self.master])
        return written

    def _deliver(self, node: str, ready: list[tuple[int, int]]) -> int:
        _, message_id = heapq.heappop(ready)
        priority = self.priorities[message_id]
        members = (self.master, self.replica) if self.full else (node,)
        roll = self.rng.random()
        outcome = "ack" if roll < 0.97 else "release" if roll < 0.985 else "expire"
        written = 0
        for op in ("lease", outcome):
            index = 0
            if self.full:
                self.order += 1
                index = self.order
            for member in members:
                self._journal(member, op, index, message_id, priority)
                written += 1
        if outcome != "ack":
            heapq.heappush(ready, (-priority, message_id))
        self.now_ms += 1
        return written


def synthesize(directory: Path, records: int, *, queues: int = 24, seed: int = 1,
               segment_records_max: int = 250_000) -> int:
    """Write about `records` journal records as Parquet segments under `directory` (one
    subdirectory per node). Returns the number written."""
    rng = random.Random(seed)
    journals = {node: _Journal(node, f"{zlib.crc32(f'{seed}-{node}'.encode()):08x}") for node in NODES}
    pairs = [_Queue(number, journals, rng) for number in range(queues)]
    written = 0
    while written < records:
        for pair in pairs:
            written += pair.enqueue_batch(rng.randint(5, 40))
            written += pair.consume(keep=rng.randint(0, 8))
    for journal in journals.values():
        _write(directory, journal, segment_records_max)
    return written


def _write(directory: Path, journal: _Journal, segment_records_max: int) -> None:
    target = directory / journal.node
    target.mkdir(parents=True, exist_ok=True)
    table = columns_table(journal.columns)
    for start in range(0, len(journal), segment_records_max):
        part = table.slice(start, segment_records_max)
        first, last = start + 1, start + part.num_rows
        name = f"journal-{journal.node}-{journal.journal_id}-{first:020d}-{last:020d}.parquet"
        pq.write_table(part, target / name, compression="zstd")
