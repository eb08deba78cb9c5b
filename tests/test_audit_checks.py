"""The pure audit checkers (audit/checks/) on small hand-written journals: each
rule says what it means, and a journal that breaks it is named for it."""
from __future__ import annotations

import zlib
from typing import Any

import msgpack

from audit.checks import violations
from audit.checks.history import HistoryEnqueue
from audit.checks.journals import check_journal_runs, check_journal_sequences, sequence_runs
from audit.local import audit_records
from replication.journal import JournalRecord


class Journal:
    """Records of one node's journal, with the checksums storage would write."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.records: list[JournalRecord] = []

    def add(self, op: str, index: int, message_id: int, *, queue: str = "q", epoch: int = 1, role: str = "master",
            priority: int = 4, queue_id: int = 1, dedupe_id: str | None = None, at_ms: int | None = None,
            crc: int | None = None) -> Journal:
        sequence = len(self.records) + 1
        fields: list[Any] = [at_ms if at_ms is not None else 1_000 + sequence, queue, queue_id, epoch, index, op,
                             message_id, dedupe_id if op != "enqueue" or dedupe_id else f"d{message_id}",
                             priority, 10 if op == "enqueue" else 0,
                             (crc if crc is not None else message_id * 7) if op == "enqueue" else 0,
                             role, self.node, "c"]
        record = JournalRecord(f"j-{self.node}", sequence, *fields,
                               record_crc32=zlib.crc32(msgpack.packb(fields, use_bin_type=True)))
        self.records.append(record)
        return self

    def enqueue(self, *message_ids: int, priority: int = 4, **options: Any) -> Journal:
        for message_id in message_ids:
            self.add("enqueue", message_id, message_id, priority=priority, **options)
        return self


def kinds(report: dict[str, Any]) -> dict[str, int]:
    return dict(report["violation_counts"])


def audit(*journals: Journal, history: list[HistoryEnqueue] | None = None) -> dict[str, Any]:
    return audit_records([r for journal in journals for r in journal.records], history or [])


def test_a_message_delivered_while_an_earlier_one_of_the_same_priority_waits_breaks_fifo() -> None:
    journal = Journal("n1").enqueue(1, 2).add("lease", 0, 2).add("ack", 0, 2)
    report = audit(journal)
    assert kinds(report) == {violations.DELIVERY_ORDER: 1}
    assert "message 1 (priority 4) was ready" in report["violations"][0]["detail"]


def test_a_higher_priority_goes_first_and_a_later_higher_priority_is_not_judged() -> None:
    good = Journal("n1").enqueue(1, priority=2).enqueue(2, priority=8).add("lease", 0, 2, priority=8) \
        .add("lease", 0, 1, priority=2).enqueue(3, priority=9).add("ack", 0, 1, priority=2)
    assert audit(good)["verdict"] == "clean"
    bad = Journal("n1").enqueue(1, priority=8).enqueue(2, priority=2).add("lease", 0, 2, priority=2)
    assert kinds(audit(bad)) == {violations.DELIVERY_ORDER: 1}


def test_redeliveries_are_explained_by_release_expiry_or_a_change_of_master() -> None:
    journal = (Journal("n1").enqueue(1, 2, 3)
               .add("lease", 0, 1).add("release", 0, 1).add("lease", 0, 1)        # released
               .add("lease", 0, 2).add("expire", 0, 2).add("lease", 0, 2)         # expired
               .add("lease", 0, 3).add("lease", 0, 3, epoch=2))                   # the master changed
    report = audit(journal)
    assert report["verdict"] == "clean"
    counts = report["incarnations"][0]["queues"][0]["counts"]
    assert (counts["redelivered_release"], counts["redelivered_expire"], counts["redelivered_change_of_master"]) == (1, 1, 1)
    unexplained = Journal("n1").enqueue(1).add("lease", 0, 1).add("lease", 0, 1)
    assert kinds(audit(unexplained)) == {violations.UNEXPLAINED_REDELIVERY: 1}


def test_an_ack_twice_or_without_a_lease_and_an_ack_of_a_message_never_enqueued_are_named() -> None:
    journal = Journal("n1").enqueue(1, 2).add("lease", 0, 1).add("ack", 0, 1).add("ack", 0, 1) \
        .add("ack", 0, 2).add("ack", 0, 9)
    assert kinds(audit(journal)) == {violations.DUPLICATED: 1, violations.CONSUMED_WITHOUT_LEASE: 1, violations.UNEXPECTED: 1}


def test_members_of_a_full_pair_must_agree_op_for_op_within_an_epoch() -> None:
    master = Journal("n1").enqueue(1, 2).add("lease", 3, 1).add("ack", 4, 1)
    replica = Journal("n2").enqueue(1, role="replica").enqueue(2, role="replica", crc=5).add(
        "lease", 3, 1, role="replica").add("ack", 4, 2, role="replica")
    report = audit(master, replica)
    assert kinds(report)[violations.PAYLOAD_MISMATCH] == 1 and kinds(report)[violations.MEMBER_DISAGREEMENT] == 1
    assert report["totals"]["incarnations"] == 1, "the shared records link the two members"


def test_a_suffix_of_an_older_epoch_replaced_in_a_newer_one_is_flagged_not_failed() -> None:
    old_master = Journal("n1").enqueue(1, 2, 3).add("epoch", 2, 0, epoch=2, role="replica", dedupe_id="rejoin") \
        .add("enqueue", 3, 3, epoch=2, role="replica", dedupe_id="d3-new")
    new_master = Journal("n2").enqueue(1, 2, role="replica").add("epoch", 2, 0, epoch=2, dedupe_id="failover") \
        .add("enqueue", 3, 3, epoch=2, dedupe_id="d3-new")
    report = audit(old_master, new_master)
    assert report["verdict"] == "clean", report["violations"]
    assert {flag["kind"] for flag in report["flags"]} == {violations.DISCARDED_SUFFIX}
    epochs = report["incarnations"][0]["epochs"]
    assert [(e["epoch"], e["masters"], e["reason"]) for e in epochs] == [(1, ["n1"], "create"), (2, ["n2"], "failover")]


def test_two_masters_in_one_epoch_and_a_forced_promotion() -> None:
    one = Journal("n1").enqueue(1, 2)
    other = Journal("n2").enqueue(1, 2)
    assert kinds(audit(one, other)) == {violations.TWO_MASTERS: 1}
    forced = Journal("n2").enqueue(1, role="replica").add("epoch", 1, 0, epoch=2, dedupe_id="unclean").enqueue(2, epoch=2)
    report = audit(Journal("n1").enqueue(1), forced)
    assert report["verdict"] == "clean" and [f["kind"] for f in report["flags"]] == [violations.UNCLEAN_PROMOTION]


def test_index_gaps_repeats_and_the_head_of_a_complete_journal() -> None:
    journal = Journal("n1").enqueue(2, 3, 5).add("enqueue", 5, 5, dedupe_id="again")
    found = audit(journal)["violations"]
    assert [(v["kind"], v["index"]) for v in found] == [(violations.INDEX_GAP, 1), (violations.INDEX_GAP, 4),
                                                         (violations.INDEX_REPEATED, 5)]


def test_journal_sequence_numbers_run_without_gaps_or_repeats_however_they_are_split() -> None:
    assert sequence_runs([1, 2, 3, 7, 8, 5]) == [(1, 3), (7, 8), (5, 5)]
    result = check_journal_runs("n1", "j", [(5, 9), (1, 3), (9, 10), (12, 12)])
    assert [(v["kind"], v["index"]) for v in result["violations"]] == [
        (violations.SEQUENCE_GAP, 4), (violations.SEQUENCE_GAP, 11), (violations.SEQUENCE_REPEATED, 9)]
    assert (result["records"], result["first_sequence"], result["last_sequence"]) == (11, 1, 12)
    whole = check_journal_sequences("n1", "j", range(1, 100))
    assert whole == check_journal_runs("n1", "j", [(1, 50), (51, 99)]) and not whole["violations"]


def test_dead_letter_queue_messages_arrive_by_dead_lettering_under_both_strengths() -> None:
    full = (Journal("n1").enqueue(1, 2).add("lease", 3, 1).add("dead_letter", 4, 1)
            .add("lease", 2, 1, queue="q.dlq", queue_id=2).add("ack", 3, 1, queue="q.dlq", queue_id=2))
    report = audit(full)
    assert report["verdict"] == "clean", report["violations"]
    dead = next(q for q in report["incarnations"][0]["queues"] if q["queue"] == "q.dlq")
    assert dead["counts"]["acked"] == 1 and dead["members"][0]["first_index"] == 1
    producer = (Journal("n1").enqueue(1).add("lease", 0, 1).add("dead_letter", 0, 1)
                .add("lease", 0, 1, queue="q.dlq", queue_id=2).add("lease", 0, 2, queue="q.dlq", queue_id=2))
    assert kinds(audit(producer)) == {violations.UNEXPECTED: 1}, "only one message was dead-lettered"


def test_a_committed_message_the_final_master_lacks_is_lost() -> None:
    old = Journal("n1").enqueue(1, 2, 3)
    new = Journal("n2").enqueue(1, 2, 3, role="replica").add("epoch", 3, 0, epoch=2, dedupe_id="failover")
    survivor = Journal("n3").enqueue(1, 2, role="replica").add("epoch", 2, 0, epoch=3, dedupe_id="unclean") \
        .enqueue(4, epoch=3)
    report = audit(old, new, survivor)
    lost = [v for v in report["violations"] if v["kind"] == violations.LOST]
    assert [(v["message_id"], v["node"]) for v in lost] == [(3, "n3")]
    assert report["total_queue"]["lost"] == 1 and report["flags"][0]["kind"] == violations.UNCLEAN_PROMOTION


def test_history_acknowledged_missing_misnumbered_failed_but_applied_and_recovered() -> None:
    journal = Journal("n1").enqueue(1, 2, 3)
    history = [HistoryEnqueue("q", "ok", 1, "d1"), HistoryEnqueue("q", "ok", 7, "d2"),
               HistoryEnqueue("q", "ok", 9, "d9"), HistoryEnqueue("q", "fail", None, "d3"),
               HistoryEnqueue("q", "unknown", None, "d8"), HistoryEnqueue("q", "unknown", None, "d1"),
               HistoryEnqueue("q", "maybe", None, "d1")]
    report = audit(journal, history=history)
    assert kinds(report) == {violations.HISTORY_MISMATCH: 1, violations.ACKNOWLEDGED_MISSING: 1, violations.UNEXPECTED: 1,
                             violations.HISTORY_MALFORMED: 1}
    assert report["history"] == {"ok": 3, "unknown": 2, "fail": 1, "recovered": 1}
    assert report["total_queue"]["lost"] == 1 and report["total_queue"]["recovered"] == 1


def test_one_dedupe_id_stored_as_two_messages_is_a_duplicate() -> None:
    journal = Journal("n1").add("enqueue", 1, 1, dedupe_id="same").add("enqueue", 2, 2, dedupe_id="same")
    assert kinds(audit(journal)) == {violations.DUPLICATED: 1}


def test_a_record_that_does_not_match_its_checksum_is_named() -> None:
    journal = Journal("n1").enqueue(1, 2)
    journal.records[1] = journal.records[1]._replace(priority=9)
    assert kinds(audit(journal)) == {violations.RECORD_CHECKSUM: 1}


def test_a_member_that_took_the_queue_over_by_snapshot_counts_what_was_consumed_before_it() -> None:
    """A replica that joined late holds only the messages still queued at its snapshot; the
    queue's counts still cover the whole history (the earlier ack is in the old master's)."""
    master = Journal("n1").enqueue(1, 2, 3).add("lease", 4, 1).add("ack", 5, 1) \
        .add("epoch", 5, 0, epoch=2, role="replica", dedupe_id="handoff") \
        .add("enqueue", 6, 6, epoch=2, role="replica", at_ms=5_000)
    late = Journal("n2").add("snapshot", 0, 2, role="replica").add("snapshot", 0, 3, role="replica") \
        .add("epoch", 5, 0, role="replica", dedupe_id="snapshot").add("epoch", 5, 0, epoch=2, dedupe_id="handoff") \
        .add("enqueue", 6, 6, epoch=2, at_ms=5_000)
    report = audit(master, late)
    assert report["verdict"] == "clean", report["violations"]
    [queue] = report["incarnations"][0]["queues"]
    assert queue["final_master"] == "n2"
    assert {key: queue["counts"][key] for key in ("enqueued", "acked", "queued")} == {"enqueued": 4, "acked": 1, "queued": 3}
    assert report["total_queue"]["enqueued"] == 4


def test_a_channel_message_trimmed_before_a_durable_subscription_acknowledged_it_is_skipped() -> None:
    """Messages enqueued after a subscription opened are its backlog: acknowledged, then they
    may be trimmed; one trimmed unacknowledged is named, and the summary proves the rest."""
    queue = "channel:c"
    good = Journal("n1").enqueue(1, queue=queue).add("subscribe", 2, 0, queue=queue, dedupe_id="s") \
        .enqueue(3, 4, 5, queue=queue).add("subscriber_ack", 6, 3, queue=queue, dedupe_id="s") \
        .add("purge", 7, 1, queue=queue).add("purge", 8, 3, queue=queue)
    report = audit(good)
    assert report["verdict"] == "clean", report["violations"]
    [summary] = report["incarnations"][0]["queues"]
    assert summary["durable"] == {"s": {"opened_at": 2, "backlog": 3, "acknowledged": 1, "waiting": 2}}
    skipped = Journal("n1").enqueue(1, queue=queue).add("subscribe", 2, 0, queue=queue, dedupe_id="s") \
        .enqueue(3, queue=queue).add("purge", 4, 3, queue=queue).add("subscriber_ack", 5, 1, queue=queue,
                                                                      dedupe_id="s")
    assert kinds(audit(skipped)) == {violations.DURABLE_SKIPPED: 1, violations.DURABLE_UNKNOWN: 1}
