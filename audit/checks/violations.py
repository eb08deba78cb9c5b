"""What the checks report: the violation and flag kinds, a violation's JSON shape, the
settings that bound a report. Apart from the checks so that every check, the report and its
readers (the chaos runner, the tests) share one list of stable names.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from replication.journal import JournalRecord

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


@dataclass(frozen=True)
class AuditSettings:
    violations_listed_max: int = 100          # per kind and group (and per journal); all are counted
    records_per_violation_max: int = 4
    dedupe_window_ms: int = 300_000           # same dedupe id twice within this: a duplicated enqueue
    buckets_max: int = 120                    # chart resolution


DEFAULT_SETTINGS = AuditSettings()


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
