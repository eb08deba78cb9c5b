"""How a node's LMDB rows are laid out: the named databases, their keys and values, and the
small readers every user of the environment shares (a queue's key prefix, its stream rows,
its last op-log record, the payloads held in op-log entries).

Separate from `lmdb_store` (which opens the environment and reads it on the loop), `commit`
(which writes one transaction) and `snapshot_view` (which reads one queue for a transfer):
all three read and write these rows, and the layout is one thing that SCHEMA_VERSION names.

Key layout (big-endian integers so LMDB's byte order is numeric order):
    queues    name                                -> msgpack QueueRecord
    messages  queue_id:8 index:8                  -> msgpack [priority, enqueued_ms, dedupe_id, client, payload]
                                                     where payload is the bytes, or the last order of the
                                                     op-log entry that holds them (an int: see EntryPayloads)
    ready     queue_id:8 priority:1 index:8       -> deliveries so far (4 bytes, empty when 0)
    leases    queue_id:8 index:8                  -> msgpack [priority, receipt, visibility_ms, deliveries, leased_ms]
    status    queue_id:8 index:8                  -> msgpack [state, at_ms, reply, producer]   (completed
                                                     messages; rows written before issue 32 lack the producer)
    dedupe    queue_id:8 dedupe_id                -> index:8 enqueued_ms:8
    ttl       queue_id:8 index:8                  -> priority:1 ttl_ms:8   (live messages with a time to live)
    delayed   queue_id:8 index:8                  -> priority:1 delay_ms:8 (messages not ready until they mature:
                                                     no ready row meanwhile)
    headers   queue_id:8 index:8                  -> msgpack {name: value}  (messages that have headers)
    streams   queue_id:8 key                      -> msgpack [floor, [[number, message id], ...]]  (a producer's
                                                     numbered stream, replication/queue_core.py; the key
                                                     names its producer: replication/options.py producer_key)
    expiry    kind:1 at_ms:8 queue_id:8 index:8   -> ""   (completion statuses to prune, oldest first)
    doomed    queue_id:8                          -> ""   (deleted incarnations still being erased)
    epochs    name                                -> epoch:8
    journal   sequence:8                          -> msgpack record + crc32:4 (a producer's batch: one run
                                                     record under its last row's sequence,
                                                     replication/journal.py RUN_MARK)
    oplog     queue_id:8 last order:8             -> digest:16 + first order:8 + encoded log entry (a run
                                                     of replicated operations, replication/oplog.py);
                                                     a snapshot's mark is the digest alone
              queue_id:8 0:8                      -> 0:16 + log start:8 (once truncated: records
                                                     below the start are gone)
    clients   client_id                           -> JSON client record
    meta      b"schema_version" | b"next_queue_id" | b"journal_sequence" | b"node_id" | b"storage_id"
              | b"release" | b"layout_history"
              (journal_sequence: written by the journal's prune, which may empty the journal;
              release, layout_history: qserver/storage/migrate.py)
    raft_state, raft_log      the membership layer's Raft state (qserver/storage/raft_store.py reads and
                              writes them)
"""
from __future__ import annotations

import itertools
import struct
from typing import Any

import lmdb
import msgpack

from replication.digest import DIGEST_BYTES, EMPTY_DIGEST
from replication.invariants import InvariantViolation
from replication.messages import MessageError, decode_entry
from replication.operations import Enqueued

# 2: bounded op log (its start record at order 0, snapshot marks); no reader of layout 1.
# 3: the op log holds entries (runs of operations) keyed by their last order; no reader of 2.
# 4: a message row may name the op-log entry holding its payload instead; no reader of 3.
# 5: the membership layer's Raft state in raft_state and raft_log (qserver/storage/raft_store.py), not
#    in pysyncobj's journal files; no reader of 4.
# 6: a lease row (and a Leased operation in the op log) holds the lease's duration, not a
#    wall-clock deadline; no reader of 5.
# 7: messages with a time to live have a row in ttl (operations.Enqueued.ttl_ms), delayed ones a row
#    in delayed and none in ready until they mature, messages with headers a row in headers; no
#    reader of 6.
#    Within 7: numbered streams have rows of their own in streams (written when they change, not
#    with every batch that touches the queue); a record that still held them was read as before
#    and its streams moved to rows at its next write.
# 8: every numbered stream is in its row of streams (in the form with a floor), none in a queue
#    record, and no record holds the retired in_sync field: migrate.py's step 7 -> 8 finishes the
#    moves layout 7 left to each record's next write, so nothing reads streams out of records.
#    meta holds b"release" (the release that last wrote the directory) and b"layout_history".
#    Layout 7's code reads layout 8 rows: `qserver migrate --to 7` only renumbers (migrate.py).
SCHEMA_VERSION = 8
DB_NAMES = ("queues", "messages", "ready", "leases", "status", "dedupe", "expiry", "doomed",
            "epochs", "journal", "clients", "meta", "oplog", "raft_state", "raft_log", "ttl", "delayed", "headers",
            "streams")
QI = struct.Struct(">QQ")                    # queue_id, index (or order)
QPI = struct.Struct(">QBQ")                  # queue_id, priority, index: a ready row
Q = struct.Struct(">Q")
U32 = struct.Struct(">I")
EXPIRY = struct.Struct(">BQQ")               # kind, at_ms, queue_id (then the index)
TTL = struct.Struct(">BQ")                   # priority, a duration: ttl and delayed rows
EXPIRY_STATUS = 1
LOG_START = 0                                # the order of a queue's log-start record
ENTRY_AT = DIGEST_BYTES + 8                  # where an op-log value's encoded entry begins


def queue_prefix(queue_id: int) -> bytes:
    return Q.pack(queue_id)


def streams_of(cursor: lmdb.Cursor, queue_id: int) -> dict[str, Any]:
    """A queue's numbered streams as stored in their rows: key -> [floor, [[number, id], ...]]."""
    prefix = queue_prefix(queue_id)
    found: dict[str, Any] = {}
    if cursor.set_range(prefix):
        for raw_key, value in cursor:
            key = bytes(raw_key)
            if not key.startswith(prefix):
                break
            found[key[len(prefix):].decode()] = msgpack.unpackb(value)
    return found


def delete_prefix(cursor: lmdb.Cursor, prefix: bytes) -> None:
    if cursor.set_range(prefix):
        while bytes(cursor.key()).startswith(prefix):
            if not cursor.delete():
                break


def put_in_order(cursor: lmdb.Cursor, puts: list[tuple[bytes, bytes]]) -> None:
    """Rows in ascending key order that all sort after the database's last key are appended
    (MDB_APPEND fills pages instead of splitting them: fewer pages for the commit to write);
    any others are put as usual. A snapshot's rows usually qualify: they fill an instance
    created for the transfer, whose local queue id is the newest (+26% transfer speed in an
    A/B, bench/RESULTS.md)."""
    if (not cursor.last() or bytes(cursor.key()) < puts[0][0]) and all(
            earlier[0] < later[0] for earlier, later in itertools.pairwise(puts)):
        cursor.putmulti(puts, append=True)
    else:
        cursor.putmulti(puts)


def last_logged(cursor: lmdb.Cursor, queue_id: int) -> tuple[int, bytes]:
    """(order, digest) of the queue's last op-log record, by a cursor on `oplog`; (0, empty)
    when it has none (the log-start record at order 0 is not one)."""
    found = cursor.prev() if cursor.set_range(QI.pack(queue_id + 1, 0)) else cursor.last()
    if found:
        owner, order = QI.unpack(cursor.key())
        if owner == queue_id and order != LOG_START:
            return order, bytes(cursor.value()[:DIGEST_BYTES])
    return 0, EMPTY_DIGEST


class EntryPayloads:
    """Payloads whose one copy is their enqueue's op-log entry: a message row holds the
    entry's last order (an int) instead of the bytes. Each entry is decoded once per use
    (a commit, a snapshot view): a batch of leases or a snapshot chunk reads its messages in
    order, so most of them come out of one or two entries."""
    __slots__ = ("_txn", "_oplog", "_entries")
    KEPT_MAX = 8

    def __init__(self, txn: lmdb.Transaction, oplog: Any) -> None:
        self._txn, self._oplog = txn, oplog
        self._entries: dict[tuple[int, int], dict[int, bytes]] = {}

    def resolve(self, queue_id: int, index: int, held: bytes | int) -> bytes:
        if type(held) is not int:
            return held  # type: ignore[return-value]
        entry = self._entries.get((queue_id, held))
        if entry is None:
            raw = self._txn.get(QI.pack(queue_id, held), db=self._oplog)
            if raw is None or len(raw) <= ENTRY_AT:
                raise InvariantViolation(f"message {queue_id}/{index} names op-log entry {held}, which is gone")
            try:
                ops = decode_entry(bytes(raw[ENTRY_AT:]))
            except MessageError as error:
                raise InvariantViolation(f"op-log entry {queue_id}/{held} does not decode: {error}") from None
            entry = {op.index: op.payload for op in ops if type(op) is Enqueued}
            if len(self._entries) >= self.KEPT_MAX:
                self._entries.clear()
            self._entries[(queue_id, held)] = entry
        payload = entry.get(index)
        if payload is None:
            raise InvariantViolation(f"op-log entry {queue_id}/{held} holds no enqueue of message {index}")
        return payload
