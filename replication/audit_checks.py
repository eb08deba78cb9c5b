"""Pure checkers of the journal audit (DESIGN.md 4.6): the one definition of "correct" for
qaudit's Spark job, its pure-Python path, the chaos runner and the tests.

Spark only reads the exported journal files, brings each queue's records together and hands
them to `check_group`; the pure-Python path does the same with plain lists. Both then call
`assemble_report`. So the two paths cannot disagree about what a violation is, only about how
the records travelled (which is what tests/test_audit_spark.py compares).

The units of work:
  * a *journal*: one node's append-only record stream (node id + journal id: a node that lost
    its disk starts a new journal). `check_journal_runs` checks its sequence numbers.
  * a *queue group*: a queue and its dead-letter queue (`q` and `q.dlq`), every incarnation,
    every member's records. `check_group` runs every per-queue check on it.
Inside a group:
  * a *stream* is one member's records of one local queue instance: (node, journal, queue,
    local queue id), in journal order;
  * streams of different nodes that share a replicated operation (same ordering index, op,
    message id, time and dedupe id) belong to the same *incarnation* of the queue, and so does
    a dead-letter queue's stream with its source's stream on the same node.

Dead-letter queues have no enqueue records of their own: a message arrives there when its
source journals `dead_letter`. The journal does not carry the dead-letter queue's message id,
so it is derived: the queue's ids and (under `full`) its ordering indices come from one
counter, so the k-th arrival takes the k-th positive integer that none of the dead-letter
queue's own records uses as an ordering index.

Records whose op is "epoch" (written by the membership layer when a member starts a role in
an epoch: `index` = the last ordering index it holds, `dedupe_id` = the reason: create,
restart, handoff, failover, unclean, move, rejoin, snapshot) are used when present: they give a stream
its base index, explain a truncated suffix, name the handoffs and failovers of the timeline and
flag forced (`unclean`) promotions. Every check also works without them.

A member that took a queue's state by snapshot (DESIGN.md 4.1) journals each message it took
over as `snapshot` (ready) or `snapshot_lease` (leased), index 0, then an epoch record with
reason `snapshot` whose index is the snapshot's order: its stream goes on from there, without
a gap, holding those messages.

Pure: no I/O, no clock. Records are `JournalRecord` tuples; results are JSON-ready dicts whose
lists are sorted, so equal inputs give equal results whichever path produced them.
"""
from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

import msgpack

from replication.invariants import epochs_with_two_masters, lost_acknowledged, seen_but_uncommitted

# The journal record as qserver/storage/lmdb_store.py writes it (a test holds the two equal).
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


DEAD_LETTER_SUFFIX = ".dlq"
PRIORITIES = 10
CONSUMPTION_OPS = frozenset({"lease", "extend", "ack", "reply", "release", "expire", "dead_letter", "purge",
                             "ttl_expire", "delay", "mature"})
# A channel's durable subscriptions (qserver/features/channels/hub.py): the subscription's name rides in the
# record's dedupe_id column; an ack names its message.
SUBSCRIPTION_OPS = frozenset({"subscribe", "subscriber_ack", "unsubscribe"})
HISTORY_OP = "history"            # a client-side history entry travelling with the records
ARRIVAL_OP = "dead_letter_arrival"   # derived, never stored
EPOCH_OP = "epoch"
RESTART_REASON = "restart"          # an epoch record's reason when a member restarted in its role
SNAPSHOT_REASON = "snapshot"        # an epoch record's reason when a member installed a snapshot
SNAPSHOT_OPS = frozenset({"snapshot", "snapshot_lease"})   # a message taken over by snapshot
ENQUEUE_OPS = frozenset({"enqueue", *SNAPSHOT_OPS})        # records that hold a message's payload
UNDECODABLE_OP = "undecodable"    # the exporter could not decode the record body
HISTORY_STATUSES = ("ok", "unknown", "fail")

# Violation kinds: stable names, used by the report, the tests and the chaos runner.
RECORD_CHECKSUM = "record_checksum_mismatch"
SEQUENCE_GAP = "journal_sequence_gap"
SEQUENCE_REPEATED = "journal_sequence_repeated"
INDEX_GAP = "index_gap"
INDEX_OUT_OF_ORDER = "index_out_of_order"
INDEX_REPEATED = "index_repeated"
MEMBER_DISAGREEMENT = "member_disagreement"
PAYLOAD_MISMATCH = "payload_checksum_mismatch"
TWO_MASTERS = "two_masters_in_epoch"
LOST = "lost"
UNEXPECTED = "unexpected"
DUPLICATED = "duplicated"
SEEN_UNCOMMITTED = "seen_but_uncommitted"
DELIVERY_ORDER = "delivery_order"
UNEXPLAINED_REDELIVERY = "unexplained_redelivery"
CONSUMED_WITHOUT_LEASE = "consumed_without_lease"
ACKNOWLEDGED_MISSING = "acknowledged_enqueue_missing"
HISTORY_MISMATCH = "history_mismatch"
HISTORY_MALFORMED = "history_malformed"
VIOLATION_KINDS = (RECORD_CHECKSUM, SEQUENCE_GAP, SEQUENCE_REPEATED, INDEX_GAP, INDEX_OUT_OF_ORDER, INDEX_REPEATED,
                   MEMBER_DISAGREEMENT, PAYLOAD_MISMATCH, TWO_MASTERS, LOST, UNEXPECTED, DUPLICATED,
                   SEEN_UNCOMMITTED, DELIVERY_ORDER, UNEXPLAINED_REDELIVERY, CONSUMED_WITHOUT_LEASE,
                   ACKNOWLEDGED_MISSING, HISTORY_MISMATCH, HISTORY_MALFORMED)
# Flags are reported, never fail the audit by themselves.
UNCLEAN_PROMOTION = "unclean_promotion"
DISCARDED_SUFFIX = "discarded_suffix"
DURABLE_SKIPPED = "durable_skipped"          # a message left the queue before a durable subscription acknowledged it
DURABLE_UNKNOWN = "durable_unknown_message"  # a durable subscription acknowledged what is not in its backlog

REDELIVERY_CAUSES = ("release", "expire", "change_of_master")
LINK_HEAD_RECORDS = 16      # linking streams looks at each stream's first replicated records ...
LINK_STRIDE = 16            # ... and at every index divisible by this
BUCKET_WIDTHS_MS = (10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000, 600_000,
                    1_800_000, 3_600_000, 21_600_000, 86_400_000)

_READY, _LEASED, _DELAYED, _ACKED, _DEAD, _PURGED, _EXPIRED = 1, 2, 3, 4, 5, 6, 7     # from _ACKED on: consumed
_CONSUMED_COUNTS = {_ACKED: "acked", _DEAD: "dead_lettered", _PURGED: "purged", _EXPIRED: "expired"}
_TAKING_OPS = {"dead_letter": _DEAD, "purge": _PURGED, "ttl_expire": _EXPIRED}   # ready or leased -> gone
_TAKEN_STATES = frozenset(_TAKING_OPS.values())


class JournalRecord(NamedTuple):
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


class HistoryEnqueue(NamedTuple):
    """One client-side enqueue outcome (docs/AUDIT.md, "History file")."""
    queue: str
    status: str                   # ok | unknown | fail
    message_id: int | None
    dedupe_id: str | None
    payload_crc32: int | None = None
    at_ms: int | None = None
    client: str | None = None


@dataclass(frozen=True)
class AuditSettings:
    violations_listed_max: int = 100          # per kind and group (and per journal); all are counted
    records_per_violation_max: int = 4
    dedupe_window_ms: int = 300_000           # same dedupe id twice within this: a duplicated enqueue
    buckets_max: int = 120                    # chart resolution


DEFAULT_SETTINGS = AuditSettings()
StreamKey = tuple[str, str, str, int]     # (node, journal_id, queue, local queue id)


def group_of(queue: str) -> str:
    """The queue group a queue belongs to: a dead-letter queue goes with its source."""
    return queue[:-len(DEAD_LETTER_SUFFIX)] if queue.endswith(DEAD_LETTER_SUFFIX) else queue


def history_as_record(entry: HistoryEnqueue) -> JournalRecord:
    """A history entry shaped as a record, so that it can travel with the journals (Spark)."""
    return JournalRecord("", 0, entry.at_ms or 0, entry.queue, 0, 0, 0, HISTORY_OP, entry.message_id,
                         entry.dedupe_id, 0, 0, -1 if entry.payload_crc32 is None else entry.payload_crc32,
                         entry.status, "", entry.client)


def record_as_history(record: JournalRecord) -> HistoryEnqueue:
    return HistoryEnqueue(record.queue, record.role, record.message_id, record.dedupe_id,
                          None if record.payload_crc32 in (-1, None) else record.payload_crc32,
                          record.at_ms or None, record.client)


_FIELDS = slice(2, 2 + len(JOURNAL_FIELDS))     # a JournalRecord's journal fields, in storage order
_CONTENT = slice(7, 13)       # op, message_id, dedupe_id, priority, payload_size, payload_crc32
_SEQUENCE = itemgetter(1)


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


# --- violations ---------------------------------------------------------------------------
def record_view(record: JournalRecord) -> dict[str, Any]:
    """The fields of a record a reader needs to see why it is cited."""
    return {"node": record.node, "journal_id": record.journal_id, "sequence": record.sequence,
            "queue": record.queue, "queue_id": record.queue_id, "epoch": record.epoch, "index": record.index,
            "op": record.op, "message_id": record.message_id, "priority": record.priority,
            "payload_size": record.payload_size, "payload_crc32": record.payload_crc32, "role": record.role,
            "at_ms": record.at_ms, "dedupe_id": record.dedupe_id}


def violation(kind: str, queue: str, detail: str, *, node: str | None = None, index: int | None = None,
              message_id: int | None = None, records: Iterable[JournalRecord] = (),
              settings: AuditSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    cited = sorted(records, key=lambda r: (r.node, r.journal_id, r.sequence))
    return {"kind": kind, "queue": queue, "node": node, "index": index, "message_id": message_id,
            "detail": detail, "records": [record_view(r) for r in cited[:settings.records_per_violation_max]]}


def violation_order(item: dict[str, Any]) -> tuple[Any, ...]:
    return (item["kind"], item["queue"], item["node"] or "", -1 if item["index"] is None else item["index"],
            -1 if item["message_id"] is None else item["message_id"], item["detail"])


def cap_violations(found: list[dict[str, Any]], settings: AuditSettings) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Sorted, at most `violations_listed_max` listed per kind; every one counted."""
    counts: dict[str, int] = {}
    listed = []
    for item in sorted(found, key=violation_order):
        counts[item["kind"]] = counts.get(item["kind"], 0) + 1
        if counts[item["kind"]] <= settings.violations_listed_max:
            listed.append(item)
    return listed, counts


# --- journals: sequence numbers -----------------------------------------------------------
def sequence_runs(sequences: Iterable[int]) -> list[tuple[int, int]]:
    """Sequence numbers, in the order given, as runs of consecutive numbers [(first, last)]."""
    runs: list[tuple[int, int]] = []
    first = last = None
    for sequence in sequences:
        if last is not None and sequence == last + 1:
            last = sequence
            continue
        if first is not None and last is not None:
            runs.append((first, last))
        first = last = sequence
    if first is not None and last is not None:
        runs.append((first, last))
    return runs


def check_journal_runs(node: str, journal_id: str, runs: Iterable[tuple[int, int]],
                       settings: AuditSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """A journal's sequence numbers must run without a gap or a repeat from its first exported
    record to its last: a missing number is a record lost from the journal, a repeated one a
    record written (or exported) twice. `runs` are (first, last) runs of consecutive numbers
    in any order and split any way (Spark gives one list per input split)."""
    found: list[dict[str, Any]] = []
    ordered = sorted(runs)
    covered: int | None = None
    records = 0
    for first, last in ordered:
        records += last - first + 1
        if covered is not None and first > covered + 1:
            found.append(_sequence_violation(SEQUENCE_GAP, node, journal_id, covered + 1, first - 1, settings))
        elif covered is not None and first <= covered:
            found.append(_sequence_violation(SEQUENCE_REPEATED, node, journal_id, first, min(last, covered), settings))
        covered = last if covered is None else max(covered, last)
    listed, counts = cap_violations(found, settings)
    return {"node": node, "journal_id": journal_id, "records": records,
            "first_sequence": ordered[0][0] if ordered else None, "last_sequence": covered,
            "violations": listed, "violation_counts": counts}


def check_journal_sequences(node: str, journal_id: str, sequences: Iterable[int],
                            settings: AuditSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """`check_journal_runs` over plain sequence numbers."""
    return check_journal_runs(node, journal_id, sequence_runs(sequences), settings)


def _sequence_violation(kind: str, node: str, journal_id: str, first: int, last: int,
                        settings: AuditSettings) -> dict[str, Any]:
    what = f"sequence {first}" if first == last else f"sequences {first}..{last}"
    detail = (f"journal {journal_id} of {node}: {what} " +
              ("appears more than once" if kind == SEQUENCE_REPEATED else "missing"))
    return violation(kind, "", detail, node=node, index=first, settings=settings)


# --- one member's stream ------------------------------------------------------------------
@dataclass
class StreamReplay:
    """What one member's records of one queue instance show, replayed in journal order."""
    key: StreamKey
    queue: str
    complete: bool                              # the journal holds every record from sequence 1
    first_index: int | None = None              # first ordering index the stream covers
    last_index: int = 0
    records: int = 0
    last_sequence: int = 0
    enqueued: dict[int, JournalRecord] = field(default_factory=dict)   # message id -> enqueue/arrival
    states: dict[int, int] = field(default_factory=dict)
    leased_ids: set[int] = field(default_factory=set)
    master_epochs: set[int] = field(default_factory=set)
    consumption: int = 0                        # consumption records
    consumption_replicated: int = 0             # ... of which carry an ordering index (`full`)
    redeliveries: list[tuple[int, str]] = field(default_factory=list)   # (at_ms, cause)
    consumed_times: list[int] = field(default_factory=list)             # acks and dead-letterings
    epoch_records: list[JournalRecord] = field(default_factory=list)
    # A channel queue's durable subscriptions: name -> [the index it opened at (None: opened
    # before this stream began, e.g. in a snapshot's state), message ids it acknowledged].
    subscriptions: dict[str, list[Any]] = field(default_factory=dict)
    # epoch -> [first at_ms, records, first record written as master (or None), reason of an epoch record]
    epochs: dict[int, list[Any]] = field(default_factory=dict)
    found: list[dict[str, Any]] = field(default_factory=list)
    flags: list[dict[str, Any]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.key[0]

    def final_counts(self) -> dict[str, int]:
        counts = {"enqueued": len(self.enqueued), "acked": 0, "dead_lettered": 0, "purged": 0, "expired": 0,
                  "queued": 0, "leased": 0}
        for state in self.states.values():
            if state >= _ACKED:
                counts[_CONSUMED_COUNTS[state]] += 1
            else:
                counts["queued"] += 1
                counts["leased"] += state == _LEASED
        return counts

    def held(self) -> tuple[set[int], set[int]]:
        """(still held: ready or leased, consumed: acked or dead-lettered) message ids."""
        held: set[int] = set()
        consumed: set[int] = set()
        for message_id, state in self.states.items():
            (consumed if state >= _ACKED else held).add(message_id)
        return held, consumed


class _Continuity:
    """Ordering indices of one stream: each one once, in increasing order, without a gap.

    An epoch record names the last index the member held when it took its role: records of
    an *older* epoch above it were discarded (a suffix that was never committed, replaced in
    the new epoch), and after a restart those of its own epoch too. Storage journals such a
    record where it happened among its transaction's operations; journals written before
    that have it after them, so records of the new epoch may lie above its base (see step)."""

    def __init__(self, replay: StreamReplay, settings: AuditSettings) -> None:
        self.replay, self.settings = replay, settings
        self.high: int | None = None
        self.missing: list[list[Any]] = []      # [first, last, record after the gap]
        self.high_by_epoch: dict[int, int] = {}   # highest index of each epoch's records (not derived ones)

    def base(self, record: JournalRecord) -> None:
        base, epoch = record.index, record.epoch
        if self.high is None:
            self.high = base
            self.replay.first_index = base + 1
            return
        if record.dedupe_id == SNAPSHOT_REASON:
            # The member took the queue's state at `base`: what lies between is in that state.
            self.missing = [gap for gap in self.missing if gap[0] <= base]
            self.high = max(self.high, base)
            return
        # A member restarted after a crash drops what it held past the commit point it had
        # recorded, of its own epoch too (a `producer` member's never visible, never committed
        # suffix); its mark is journaled before anything it did after the restart.
        restart = record.dedupe_id == RESTART_REASON
        discarded = [older for older in self.high_by_epoch if older < epoch or restart and older == epoch]
        stale = max((self.high_by_epoch[older] for older in discarded), default=base)
        if stale > base:
            what = "held past the commit point discarded when the member restarted in" if restart else \
                "of an older epoch discarded when the member took its role in"
            self.replay.flags.append({"kind": DISCARDED_SUFFIX, "queue": self.replay.queue, "node": self.replay.node,
                                      "epoch": epoch, "first": base + 1, "last": stale,
                                      "detail": f"indices {base + 1}..{stale} {what} epoch {epoch} (never committed)"})
            self.missing = [gap for gap in self.missing if gap[0] <= base]
            for older in discarded:
                self.high_by_epoch[older] = min(self.high_by_epoch[older], base)
            self.high = max([base, *(high for newer, high in self.high_by_epoch.items() if newer >= epoch)])
        elif base > self.high:
            self.missing.append([self.high + 1, base, record])
            self.high = base

    def step(self, record: JournalRecord) -> None:
        index = record.index
        high = self.high
        if record.op != ARRIVAL_OP:
            self.high_by_epoch[record.epoch] = index
        if high is None:
            self.replay.first_index = 1 if self.replay.complete else index
            high = 0 if self.replay.complete else index - 1
        if index == high + 1:
            self.high = index
        elif index > high:
            self.missing.append([high + 1, index - 1, record])
            self.high = index
        elif self._fill(index):
            self.replay.found.append(violation(
                INDEX_OUT_OF_ORDER, self.replay.queue, f"index {index} journaled after index {high}",
                node=self.replay.node, index=index, message_id=record.message_id, records=[record],
                settings=self.settings))
            self.high = high
        elif any(older < record.epoch and older_high >= index for older, older_high in self.high_by_epoch.items()):
            # A newer epoch's record at an index an older epoch's suffix used, journaled before
            # its transaction's epoch record (storage writes that one last): the member took its
            # role with its suffix discarded, from index - 1 at most.
            self.base(record._replace(index=index - 1))
        else:
            self.replay.found.append(violation(
                INDEX_REPEATED, self.replay.queue, f"index {index} journaled again", node=self.replay.node,
                index=index, message_id=record.message_id, records=[record], settings=self.settings))
            self.high = high

    def _fill(self, index: int) -> bool:
        for position, (first, last, after) in enumerate(self.missing):
            if first <= index <= last:
                parts = [[first, index - 1, after]] if first < index else []
                parts += [[index + 1, last, after]] if index < last else []
                self.missing[position:position + 1] = parts
                return True
        return False

    def finish(self) -> None:
        self.replay.last_index = self.high or 0
        for first, last, after in self.missing:
            what = f"index {first}" if first == last else f"indices {first}..{last}"
            self.replay.found.append(violation(
                INDEX_GAP, self.replay.queue, f"{what} missing before this record", node=self.replay.node,
                index=first, records=[after], settings=self.settings))


def replay_stream(key: StreamKey, records: Sequence[JournalRecord], *, complete: bool,
                  settings: AuditSettings = DEFAULT_SETTINGS) -> StreamReplay:
    """Replay one stream (sorted by sequence): index continuity, each message's life
    (enqueue, leases, acks, releases, expiries, dead-lettering), delivery order by priority
    then index, and the cause of every redelivery."""
    replay = StreamReplay(key, key[2], complete)
    continuity = _Continuity(replay, settings)
    consumer = _Consumption(replay, settings)
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
            if op == "ack" and states.get(message_id) == _LEASED:      # type: ignore[arg-type]
                states[message_id] = _ACKED                            # type: ignore[index]
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


class _Consumption:
    """Message states of one stream, with a ready set per priority to judge delivery order."""

    def __init__(self, replay: StreamReplay, settings: AuditSettings) -> None:
        self.replay, self.settings = replay, settings
        self.ready: list[list[int]] = [[] for _ in range(PRIORITIES)]
        self.ready_count = [0] * PRIORITIES
        self.priority: dict[int, int] = {}
        self.lease_epoch: dict[int, int] = {}
        self.ready_cause: dict[int, str] = {}
        self.lowest_enqueued: int | None = None

    def enqueue(self, record: JournalRecord) -> None:
        message_id = record.message_id
        if message_id is None:
            return
        if message_id in self.replay.enqueued:
            known = self.replay.enqueued[message_id]
            if known.op != "enqueue" or known.epoch >= record.epoch:
                return        # a repeated index is reported by the continuity check
            self._forget(message_id)   # a discarded suffix's message (its epoch record may follow)
        self.replay.enqueued[message_id] = record
        self.replay.states[message_id] = _READY
        priority = min(max(record.priority, 0), PRIORITIES - 1)
        self.priority[message_id] = priority
        heapq.heappush(self.ready[priority], message_id)
        self.ready_count[priority] += 1
        if self.lowest_enqueued is None or message_id < self.lowest_enqueued:
            self.lowest_enqueued = message_id

    def take_over(self, record: JournalRecord) -> None:
        """A message this member took over by snapshot, ready or leased as the master held it."""
        message_id = record.message_id
        if message_id is None:
            return
        if message_id in self.replay.enqueued:
            self._forget(message_id)   # a transfer cut short, taken again
        self.enqueue(record._replace(op="enqueue"))
        self.replay.enqueued[message_id] = record
        if record.op == "snapshot_lease":
            self.ready_count[self.priority[message_id]] -= 1
            self.replay.states[message_id] = _LEASED
            self.replay.leased_ids.add(message_id)
            self.lease_epoch[message_id] = record.epoch

    def discard_after(self, base: int, epoch: int) -> None:
        """A member took a role in `epoch` holding indices up to `base`: messages it had
        enqueued past `base` in an older epoch were a discarded, never committed suffix (a
        deposed `producer` master drops it and follows on from its commit point); the new
        epoch's messages at the same ids replace them. (A restart passes epoch + 1: its own
        epoch's suffix past the commit point was discarded too.)"""
        replay = self.replay
        discarded = []
        for message_id in reversed(replay.enqueued):    # enqueues come in increasing id order
            if message_id <= base:
                break
            record = replay.enqueued[message_id]
            if record.op == "enqueue" and record.epoch < epoch:
                discarded.append(message_id)
        for message_id in discarded:
            self._forget(message_id)

    def _forget(self, message_id: int) -> None:
        replay = self.replay
        del replay.enqueued[message_id]
        if replay.states.pop(message_id, None) == _READY:
            self.ready_count[self.priority[message_id]] -= 1
        replay.leased_ids.discard(message_id)

    def consume(self, record: JournalRecord) -> None:
        message_id = record.message_id
        state = self.replay.states.get(message_id) if message_id is not None else None
        if state is None:
            self._unknown(record)
        elif record.op == "lease":
            self._lease(record, message_id, state)   # type: ignore[arg-type]
        elif record.op == "extend":
            if state != _LEASED:          # a new duration for a lease in flight: nothing else moves
                self._refuse(record, state)
        elif record.op in ("ack", "reply"):
            if state == _LEASED:
                self.replay.states[message_id] = _ACKED   # type: ignore[index]
                self.replay.consumed_times.append(record.at_ms)
            else:
                self._refuse(record, state)
        elif record.op in ("release", "expire"):
            if state == _LEASED:
                self._make_ready(message_id, record.op)   # type: ignore[arg-type]
            else:
                self._refuse(record, state)
        elif record.op == "delay":           # journaled right after its enqueue: not ready yet
            if state == _READY:
                self.ready_count[self.priority[message_id]] -= 1    # type: ignore[index]
                self.replay.states[message_id] = _DELAYED         # type: ignore[index]
            else:
                self._refuse(record, state)
        elif record.op == "mature":
            if state == _DELAYED:
                self.replay.states[message_id] = _READY           # type: ignore[index]
                priority = self.priority[message_id]              # type: ignore[index]
                heapq.heappush(self.ready[priority], message_id)  # type: ignore[arg-type,misc]
                self.ready_count[priority] += 1
            else:
                self._refuse(record, state)
        elif record.op in _TAKING_OPS:
            if self.replay.subscriptions:
                self._check_backlogs(record, message_id)    # type: ignore[arg-type]
            if state in (_LEASED, _READY, _DELAYED):
                if state == _READY:
                    self.ready_count[self.priority[message_id]] -= 1    # type: ignore[index]
                self.replay.states[message_id] = _TAKING_OPS[record.op]  # type: ignore[index]
                self.replay.consumed_times.append(record.at_ms)
            else:
                self._refuse(record, state)

    def subscription_step(self, record: JournalRecord) -> None:
        """A durable subscription opened, acknowledged a message of its backlog, or dropped."""
        subscriptions, name = self.replay.subscriptions, str(record.dedupe_id)
        if record.op == "subscribe":
            subscriptions[name] = [record.index, set()]
        elif record.op == "unsubscribe":
            subscriptions.pop(name, None)
        else:
            opened, acked = subscriptions.setdefault(name, [None, set()])
            message_id = record.message_id
            if message_id is None:
                return
            state = self.replay.states.get(message_id)
            if (opened is not None and message_id <= opened) or (state is not None and state >= _ACKED) or \
                    (state is None and self.replay.complete):
                self.replay.found.append(violation(
                    DURABLE_UNKNOWN, self.replay.queue, f"durable subscription {name} acknowledged message "
                    f"{message_id}, which is not in its backlog", node=self.replay.node, index=record.index or None,
                    message_id=message_id, records=[record], settings=self.settings))
            acked.add(message_id)

    def _check_backlogs(self, record: JournalRecord, message_id: int) -> None:
        """A message leaves a channel's queue (a trim) only once every durable subscription
        whose backlog holds it (opened before it) has acknowledged it."""
        for name, (opened, acked) in self.replay.subscriptions.items():
            if opened is not None and message_id > opened and message_id not in acked:
                self.replay.found.append(violation(
                    DURABLE_SKIPPED, self.replay.queue, f"message {message_id} left the queue ({record.op}) before "
                    f"durable subscription {name} acknowledged it", node=self.replay.node,
                    index=record.index or None, message_id=message_id,
                    records=[self.replay.enqueued.get(message_id, record), record], settings=self.settings))

    def _lease(self, record: JournalRecord, message_id: int, state: int) -> None:
        replay = self.replay
        if state == _READY:
            self._check_order(record, message_id)
            self.ready_count[self.priority[message_id]] -= 1
            if message_id in replay.leased_ids:
                replay.redeliveries.append((record.at_ms, self.ready_cause.pop(message_id, "release")))
        elif state == _LEASED and record.epoch > self.lease_epoch.get(message_id, record.epoch):
            replay.redeliveries.append((record.at_ms, "change_of_master"))
        elif state == _LEASED:
            replay.found.append(violation(
                UNEXPLAINED_REDELIVERY, replay.queue,
                f"message {message_id} leased again in epoch {record.epoch} without a release, expiry "
                "or change of master", node=replay.node, index=record.index or None, message_id=message_id,
                records=[record], settings=self.settings))
        else:
            self._refuse(record, state)
            return
        replay.states[message_id] = _LEASED
        replay.leased_ids.add(message_id)
        self.lease_epoch[message_id] = record.epoch

    def _check_order(self, record: JournalRecord, message_id: int) -> None:
        """No ready message of the same or a higher priority with a lower index may wait while
        this one is delivered. (A higher priority with a higher index may not have been
        committed yet, which the journal cannot show, so that case is not judged.)"""
        states, priorities = self.replay.states, self.priority
        for priority in range(priorities[message_id], PRIORITIES):
            if not self.ready_count[priority]:
                continue
            heap = self.ready[priority]
            while heap and (states.get(heap[0]) != _READY or priorities[heap[0]] != priority):
                heapq.heappop(heap)
            if heap and heap[0] < message_id:
                waiting = self.replay.enqueued[heap[0]]
                self.replay.found.append(violation(
                    DELIVERY_ORDER, self.replay.queue,
                    f"message {message_id} (priority {priorities[message_id]}) delivered while message {heap[0]} "
                    f"(priority {priority}) was ready", node=self.replay.node, index=record.index or None,
                    message_id=message_id, records=[waiting, record], settings=self.settings))
                return

    def _make_ready(self, message_id: int, cause: str) -> None:
        self.replay.states[message_id] = _READY
        priority = self.priority[message_id]
        heapq.heappush(self.ready[priority], message_id)
        self.ready_count[priority] += 1
        self.ready_cause[message_id] = cause

    def _refuse(self, record: JournalRecord, state: int) -> None:
        replay = self.replay
        if state >= _ACKED:
            kind, why = DUPLICATED, "after it was " + {_ACKED: "acknowledged", _DEAD: "dead-lettered",
                                                       _PURGED: "purged", _EXPIRED: "expired"}[state]
        else:
            kind, why = CONSUMED_WITHOUT_LEASE, "while it was not leased"
        replay.found.append(violation(kind, replay.queue, f"{record.op} of message {record.message_id} {why}",
                                      node=replay.node, index=record.index or None, message_id=record.message_id,
                                      records=[record], settings=self.settings))

    def _unknown(self, record: JournalRecord) -> None:
        """A consumption step of a message this stream never enqueued. When the journal's
        beginning was pruned, messages below the first enqueue seen cannot be judged."""
        message_id = record.message_id
        pruned_before = not self.replay.complete and (
            self.lowest_enqueued is None or message_id is None or message_id < self.lowest_enqueued)
        if pruned_before:
            return
        self.replay.found.append(violation(
            UNEXPECTED, self.replay.queue, f"{record.op} of message {message_id}, which was never enqueued here",
            node=self.replay.node, index=record.index or None, message_id=message_id, records=[record],
            settings=self.settings))


# --- a queue group ------------------------------------------------------------------------
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
            template.queue if template else record.queue + DEAD_LETTER_SUFFIX,
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
    for key, source in _dead_letter_sources(streams).items():
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


def _dead_letter_sources(streams: Iterable[StreamKey]) -> dict[StreamKey, StreamKey]:
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


def check_group(group: str, records: Iterable[JournalRecord], settings: AuditSettings = DEFAULT_SETTINGS,
                journal_starts: Mapping[tuple[str, str], int | None] | None = None) -> dict[str, Any]:
    """Every per-queue check on one queue group (journal records and history entries, in any
    order). `journal_starts` gives each (node, journal id)'s first sequence present: a journal
    that starts at 1 is complete, so each of its streams must start at index 1 (or at the base
    an epoch record names)."""
    journal_starts = journal_starts or {}
    history, streams, found = _split(records, settings)
    sources = _dead_letter_sources(streams)
    replays: dict[StreamKey, StreamReplay] = {}
    for key, stream_records in streams.items():
        if key in sources:
            arrivals = dead_letter_arrivals(streams[sources[key]], stream_records)
            stream_records = sorted([*stream_records, *arrivals], key=lambda r: (r.sequence, r.op != ARRIVAL_OP))
        replays[key] = replay_stream(key, stream_records, complete=journal_starts.get(key[:2]) == 1,
                                     settings=settings)
        found += replays[key].found
    components = link_incarnations(streams)
    acknowledged, history_found, history_counts = _check_history(history, components, replays, settings)
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


# --- one incarnation ----------------------------------------------------------------------
def _check_incarnation(members: list[StreamKey], streams: Mapping[StreamKey, Sequence[JournalRecord]],
                       replays: Mapping[StreamKey, StreamReplay], acknowledged: Mapping[str, set[int]],
                       settings: AuditSettings) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    flags: list[dict[str, Any]] = [flag for key in members for flag in replays[key].flags]
    found = _check_agreement(members, streams, flags, settings)
    found += _check_masters(members, replays, settings)
    queues: dict[str, list[StreamKey]] = {}
    for key in members:
        queues.setdefault(key[2], []).append(key)
    summaries = []
    for queue in sorted(queues):
        summary, queue_found = _check_queue(queue, queues[queue], replays, acknowledged.get(queue, set()), settings)
        summaries.append(summary)
        found += queue_found
    epochs, epoch_flags = _timeline(members, replays)
    first = members[0]
    incarnation = {"id": f"{first[2]}@{first[0]}/{first[1]}/{first[3]}", "queue": group_of(first[2]),
                   "queues": summaries, "epochs": epochs}
    return incarnation, found, flags + epoch_flags


def _content(record: JournalRecord) -> Any:
    return record[_CONTENT]


def _check_agreement(members: list[StreamKey], streams: Mapping[StreamKey, Sequence[JournalRecord]],
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


def _check_masters(members: list[StreamKey], replays: Mapping[StreamKey, StreamReplay],
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


def _final_master(keys: list[StreamKey], replays: Mapping[StreamKey, StreamReplay]) -> StreamKey:
    """The stream of the latest master (highest epoch as master, then latest record)."""
    return max(keys, key=lambda key: (max(replays[key].master_epochs, default=-1), replays[key].last_index,
                                      replays[key].last_sequence, key))


def _check_queue(queue: str, keys: list[StreamKey], replays: Mapping[StreamKey, StreamReplay],
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
                if member.states.get(message_id) in _TAKEN_STATES and message_id not in acked:
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
            if state >= _ACKED and message_id not in final.enqueued:
                earlier[message_id] = max(state, earlier.get(message_id, state))
    counts["enqueued"] += len(earlier)
    for state in earlier.values():
        counts[_CONSUMED_COUNTS[state]] += 1
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


def _timeline(members: list[StreamKey], replays: Mapping[StreamKey, StreamReplay]) -> tuple[
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


# --- history ------------------------------------------------------------------------------
def _check_history(history: list[HistoryEnqueue], components: list[list[StreamKey]],
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


# --- the report ---------------------------------------------------------------------------
def assemble_report(journals: Iterable[dict[str, Any]], groups: Iterable[dict[str, Any]],
                    settings: AuditSettings = DEFAULT_SETTINGS) -> dict[str, Any]:
    """The audit's verdict from the per-journal and per-group results, in any order."""
    journals = sorted(journals, key=lambda j: (j["node"], j["journal_id"]))
    groups = sorted(groups, key=lambda g: g["group"])
    found = [item for source in (*journals, *groups) for item in source["violations"]]
    counts: dict[str, int] = {}
    for source in (*journals, *groups):
        for kind, count in source["violation_counts"].items():
            counts[kind] = counts.get(kind, 0) + count
    incarnations = sorted((incarnation for group in groups for incarnation in group["incarnations"]),
                          key=lambda i: (i["queue"], i["id"]))
    history = {"ok": 0, "unknown": 0, "fail": 0, "recovered": 0}
    for group in groups:
        for key, value in group["history"].items():
            history[key] += value
    finals = [queue["counts"] for incarnation in incarnations for queue in incarnation["queues"]
              if not queue["queue"].endswith(DEAD_LETTER_SUFFIX)]     # their messages are counted at the source
    total_queue = {
        "lost": counts.get(LOST, 0) + counts.get(ACKNOWLEDGED_MISSING, 0),
        "unexpected": counts.get(UNEXPECTED, 0),
        "duplicated": counts.get(DUPLICATED, 0),
        "recovered": history["recovered"],
        **{name: sum(final[name] for final in finals)
           for name in ("enqueued", "acked", "dead_lettered", "purged", "expired", "queued")},
    }
    flags = sorted((flag for group in groups for flag in group["flags"]),
                   key=lambda flag: (flag["kind"], flag["queue"], flag["node"] or "", flag["epoch"], flag["first"]))
    violation_total = sum(counts.values())
    return {
        "format": "qaudit-report/1",
        "verdict": "violations" if violation_total else "clean",
        "totals": {"records": sum(j["records"] for j in journals), "journals": len(journals),
                   "nodes": len({j["node"] for j in journals}), "queues": len(groups),
                   "incarnations": len(incarnations), "violations": violation_total, "flags": len(flags)},
        "total_queue": total_queue,
        "history": history,
        "violation_counts": dict(sorted(counts.items())),
        "violations": sorted(found, key=violation_order),
        "flags": flags,
        "journals": journals,
        "incarnations": incarnations,
    }
