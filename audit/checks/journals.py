"""One journal's sequence numbers: they run without a gap or a repeat. Per journal, not per
queue, so Spark's driver merges these from every partition while the queue checks run in the
workers (audit/spark_job.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from audit.checks.violations import (
    DEFAULT_SETTINGS,
    SEQUENCE_GAP,
    SEQUENCE_REPEATED,
    AuditSettings,
    cap_violations,
    violation,
)


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
