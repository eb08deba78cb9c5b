"""The audit's verdict, assembled from the per-journal and per-group results: the last step
of both paths, so they cannot disagree about the report's shape.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from audit.checks.violations import (
    ACKNOWLEDGED_MISSING,
    DEFAULT_SETTINGS,
    DUPLICATED,
    LOST,
    UNEXPECTED,
    AuditSettings,
    violation_order,
)
from replication.options import DEAD_LETTER_SUFFIX


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
