"""The pure-Python path: the same checkers over records read with pyarrow, no JVM.

For small inputs (tests, a single node's journal, a quick look) and as the reference the
Spark job is compared with (tests/test_audit.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from audit.checks.group import check_group
from audit.checks.history import HistoryEnqueue, history_as_record
from audit.checks.journals import check_journal_sequences
from audit.checks.report import assemble_report
from audit.checks.units import group_of
from audit.checks.violations import DEFAULT_SETTINGS, AuditSettings
from audit.inputs import read_history, read_records
from replication.journal import JournalRecord

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def audit_records(records: Iterable[JournalRecord], history: Iterable[HistoryEnqueue] = (),
                  settings: AuditSettings = DEFAULT_SETTINGS, progress: Progress = _quiet) -> dict[str, Any]:
    """The report over records already in memory (the chaos runner and tests call this)."""
    by_journal: dict[tuple[str, str], list[int]] = {}
    by_group: dict[str, list[JournalRecord]] = {}
    for record in records:
        by_journal.setdefault((record.node, record.journal_id), []).append(record.sequence)
        by_group.setdefault(group_of(record.queue), []).append(record)
    for entry in history:
        by_group.setdefault(group_of(entry.queue), []).append(history_as_record(entry))
    progress(f"checking {len(by_journal)} journals")
    journals = [check_journal_sequences(node, journal_id, sequences, settings)
                for (node, journal_id), sequences in sorted(by_journal.items())]
    starts = {(j["node"], j["journal_id"]): j["first_sequence"] for j in journals}
    groups = []
    for done, (group, group_records) in enumerate(sorted(by_group.items()), 1):
        groups.append(check_group(group, group_records, settings, starts))
        progress(f"queue {done}/{len(by_group)}: {group}")
    return assemble_report(journals, groups, settings)


def audit_paths(journals: list[str], history_path: str | None = None, settings: AuditSettings = DEFAULT_SETTINGS,
                progress: Progress = _quiet) -> dict[str, Any]:
    progress(f"reading journals from {len(journals)} path(s)")
    records = read_records(journals)
    history = read_history(history_path) if history_path else []
    progress(f"{len(records)} records, {len(history)} history entries")
    return audit_records(records, history, settings, progress)
