"""What one commit is given and what it gives back: `SealedBatch` and `CommitResult`.

Separate from the store because the engine builds batches on the loop thread and the
simulation's in-memory storage (tests/sim/memory_storage.py) commits the same batches:
neither needs LMDB to name them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replication.operations import Operation


@dataclass
class SealedBatch:
    """Everything one transaction writes. Built on the loop thread, then only read."""
    operations: list[Operation] = field(default_factory=list)
    queue_records: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> record JSON
    deleted_queues: list[tuple[str, int]] = field(default_factory=list)      # (name, queue_id)
    client_puts: dict[str, dict[str, Any]] = field(default_factory=dict)
    client_deletes: list[str] = field(default_factory=list)
    payload_reads: list[tuple[int, int]] = field(default_factory=list)       # (queue_id, index)
    epochs: dict[str, int] = field(default_factory=dict)                     # queue name -> epoch
    # Log entries: (queue_id, first order, last order, digest after it, encoded entry).
    oplog_rows: list[tuple[int, int, int, bytes, bytes]] = field(default_factory=list)
    # A deposed master's uncommitted suffix to erase first: (queue_id, last order kept).
    truncations: list[tuple[int, int]] = field(default_factory=list)
    # Snapshot transfer on a replica: rows to store ((queue_id, dead-letter queue id, rows)),
    # then the marks of complete snapshots ((queue_id, order, digest)).
    snapshot_rows: list[tuple[int, int | None, list[Any]]] = field(default_factory=list)
    snapshot_installs: list[tuple[int, int, bytes]] = field(default_factory=list)
    log_floors: dict[int, int] = field(default_factory=dict)   # queue_id -> delete op-log records below
    # Numbered streams (QueueRecord.sequences), each in a row of its own: queues whose rows go
    # first (a snapshot installed), then (queue_id, key, [floor, [[number, id], ...]] or None).
    stream_resets: set[int] = field(default_factory=set)
    stream_puts: list[tuple[int, str, list[Any] | None]] = field(default_factory=list)
    # Run on the loop once the batch is committed, before anything is answered (not stored).
    on_commit: list[Any] = field(default_factory=list)
    # Journal-only records: a member taking a role in an epoch (op "epoch"; replication/journal.py),
    # each as (position, record): it is journaled before operations[position], where it
    # happened, so the audit reads every stream in the order its member lived it.
    journal_marks: list[tuple[int, list[Any]]] = field(default_factory=list)
    next_queue_id: int | None = None
    replica_queue_ids: set[int] = field(default_factory=set)                 # journal role "replica"
    housekeeping_ms: int | None = None                                       # prune older than this
    dedupe_window_ms: int = 300_000
    status_retention_ms: int = 3_600_000


@dataclass(frozen=True)
class CommitResult:
    payloads: list[bytes | None]
    commit_seconds: float
    operations: int
    headers: list[dict[str, str] | None] = field(default_factory=list)    # beside payloads, where any
