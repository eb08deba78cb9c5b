"""The journal format: what a member writes for every operation it applies, and what the audit
reads back (docs/AUDIT.md, "The journal record").

One definition for both sides: the node's storage (qserver/storage/) writes records of
`JOURNAL_FIELDS` and run records (`RUN_MARK`) in the transaction of the operation, its exporter
(qserver/storage/journal_export.py) turns them into rows of `RECORD_COLUMNS`, and the audit
(audit/checks/) reads those rows as `JournalRecord`s by the op names below. It lives in the
protocol package, apart from the audit, because the node must not import the audit to write
its journal, and the audit must read exactly what the node writes.

Records whose op is "epoch" are written when a member starts a role in an epoch: `index` =
the last ordering index it holds, `dedupe_id` = the reason: create, restart, handoff,
failover, unclean, move, rejoin, snapshot. A member that took a queue's state by snapshot
journals each message it took over as `snapshot` (ready) or `snapshot_lease` (leased), index
0, then an epoch record with reason `snapshot` whose index is the snapshot's order.

Pure: no I/O, no clock.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

# The journal record as storage writes it: a msgpack list of these fields, with a crc32 of the
# encoding stored beside it.
JOURNAL_FIELDS = ("at_ms", "queue", "queue_id", "epoch", "index", "op", "message_id", "dedupe_id",
                  "priority", "payload_size", "payload_crc32", "role", "node", "client")
# An exported row: where the record came from, the record, its stored checksum and any fields
# past the known ones (msgpack, so the checksum can be recomputed). Parquet column order.
RECORD_COLUMNS = ("journal_id", "sequence", *JOURNAL_FIELDS, "record_crc32", "extra")

# A run record: one stored journal record for consecutive enqueues of one queue that share
# time, priority and client (a producer's batch), or for a run of such messages a replica took
# over by snapshot. Its 14 fields are the first message's; past them: RUN_MARK, count, then one
# list per varying field. Rows i = 0..count-1 are the first's with message_id = first + i, the
# ordering index first's + i (a snapshot's rows have none: 0 in every row) and the i-th dedupe
# id, payload size and crc32. It is stored under the journal sequence of its last row (its rows
# take the sequences before).
RUN_MARK = "run"
_RUN_FIELDS = len(JOURNAL_FIELDS) + 5

# Op names the node writes and the audit reads (docs/AUDIT.md lists what each means).
EPOCH_OP = "epoch"
RESTART_REASON = "restart"          # an epoch record's reason when a member restarted in its role
SNAPSHOT_REASON = "snapshot"        # an epoch record's reason when a member installed a snapshot
SNAPSHOT_OPS = frozenset({"snapshot", "snapshot_lease"})   # a message taken over by snapshot
ENQUEUE_OPS = frozenset({"enqueue", *SNAPSHOT_OPS})        # records that hold a message's payload
CONSUMPTION_OPS = frozenset({"lease", "extend", "ack", "reply", "release", "expire", "dead_letter", "purge",
                             "ttl_expire", "delay", "mature"})
# A channel's durable subscriptions (qserver/features/channels/hub.py): the subscription's name rides in the
# record's dedupe_id column; an ack names its message.
SUBSCRIPTION_OPS = frozenset({"subscribe", "subscriber_ack", "unsubscribe"})
UNDECODABLE_OP = "undecodable"    # the exporter could not decode the record body


def run_rows(record: list[Any]) -> list[list[Any]] | None:
    """A run record's rows (each a plain record of the 14 fields); None if `record` is no
    well-formed run record (the exporter then names it undecodable)."""
    if len(record) != _RUN_FIELDS or record[14] != RUN_MARK:
        return None
    count, dedupe_ids, sizes, crcs = record[15:]
    if type(count) is not int or count < 1 or not all(
            isinstance(column, list) and len(column) == count for column in (dedupe_ids, sizes, crcs)):
        return None
    at_ms, queue, queue_id, epoch, order, op, first, _, priority, _, _, role, node, client = record[:14]
    if type(order) is not int or type(first) is not int:
        return None
    step = 1 if order else 0
    return [[at_ms, queue, queue_id, epoch, order + i * step, op, first + i, dedupe_ids[i], priority, sizes[i],
             crcs[i], role, node, client] for i in range(count)]


def is_run(record: list[Any]) -> bool:
    return len(record) > 14 and record[14] == RUN_MARK


def run_count(record: list[Any]) -> int:
    """How many rows (journal sequences, message ids) a stored record covers: a run record's
    count, else one."""
    if is_run(record) and len(record) > 15 and type(record[15]) is int and record[15] >= 1:
        return int(record[15])
    return 1


class JournalRecord(NamedTuple):
    """One exported row (`RECORD_COLUMNS`, in order)."""
    journal_id: str
    sequence: int
    at_ms: int
    queue: str
    queue_id: int
    epoch: int
    index: int            # type: ignore[assignment]   # the journal's name; shadows tuple.index
    op: str
    message_id: int | None
    dedupe_id: str | None
    priority: int
    payload_size: int
    payload_crc32: int
    role: str
    node: str
    client: str | None
    record_crc32: int | None = None
    extra: bytes | None = None


_FIELDS = slice(2, 2 + len(JOURNAL_FIELDS))     # a JournalRecord's journal fields, in storage order


def record_checksum_ok(record: JournalRecord, pack: Callable[[Any], bytes] | None = None) -> bool:
    """Recompute the journal's crc32 from the fields (msgpack, as storage writes them).
    `pack`: a reused `msgpack.Packer(use_bin_type=True).pack`, which is much cheaper per call."""
    if record.record_crc32 is None:
        return True
    fields: Any = record[_FIELDS]
    if record.extra:
        fields = [*fields, *msgpack.unpackb(record.extra)]
    body = pack(fields) if pack is not None else msgpack.packb(fields, use_bin_type=True)
    return zlib.crc32(body) == record.record_crc32
