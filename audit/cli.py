"""`qaudit`: audit the journals of a cluster and write a JSON report and an HTML page.

    qaudit --journals PATH... [--history FILE] [--out DIR] [--master URL] [--engine spark|python]

Exit status: 0 when the journals show no violation, 1 when they do, 2 when the audit could
not run (bad arguments, unreadable inputs). docs/AUDIT.md explains the checks and the report.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from audit.checks.violations import AuditSettings
from audit.html import render_html
from audit.inputs import resolve_journals

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(prog="qaudit", description="Audit queue journals: nothing lost, duplicated "
                                    "or reordered (docs/AUDIT.md).")
    parse.add_argument("--journals", nargs="+", required=True, metavar="PATH",
                       help="exported segment directories or files (local or hdfs://, s3://, ...), or node "
                            "LMDB environments / data directories (exported on the fly)")
    parse.add_argument("--history", metavar="FILE", help="client-side enqueue outcomes, JSON lines (docs/AUDIT.md)")
    parse.add_argument("--out", default="qaudit-report", metavar="DIR", help="where report.json and report.html go")
    parse.add_argument("--master", default="local[*]", metavar="URL",
                       help="Spark master: local[*] (default), spark://host:7077, yarn, k8s://https://...")
    parse.add_argument("--engine", choices=("spark", "python"), default="spark",
                       help="spark (default) or the pure-Python path for small inputs (no JVM)")
    parse.add_argument("--partitions", type=int, help="Spark partitions for the per-queue pass")
    parse.add_argument("--driver-memory", default="2g", help="Spark driver memory (default 2g)")
    parse.add_argument("--spark-ui", action="store_true", help="keep Spark's web UI on while the job runs")
    parse.add_argument("--violations-listed", type=int, default=AuditSettings.violations_listed_max,
                       help="violations listed per kind and queue (all are counted)")
    parse.add_argument("--quiet", action="store_true", help="no progress output")
    return parse


def run(arguments: argparse.Namespace) -> dict[str, Any]:
    """The report (with an `inputs` section saying how it was made)."""
    started = time.monotonic()

    def progress(message: str) -> None:
        if not arguments.quiet:
            print(f"qaudit [{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = AuditSettings(violations_listed_max=arguments.violations_listed)
    journals = resolve_journals(arguments.journals, out / "exported")
    if arguments.engine == "python":
        from audit.local import audit_paths
        report = audit_paths(journals, arguments.history, settings, progress)
    else:
        report = _spark(arguments, journals, settings, progress)
    report["inputs"] = {"journals": journals, "history": arguments.history, "engine": arguments.engine,
                        "master": arguments.master if arguments.engine == "spark" else None,
                        "elapsed_s": round(time.monotonic() - started, 3),
                        "generated_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    return report


def _spark(arguments: argparse.Namespace, journals: list[str], settings: AuditSettings, progress: Any) -> dict[str, Any]:
    from audit.spark_job import audit_spark, spark_session, stop_session

    progress(f"starting Spark ({arguments.master})")
    spark = spark_session(arguments.master, partitions=arguments.partitions, driver_memory=arguments.driver_memory,
                          ui=arguments.spark_ui)
    try:
        return audit_spark(spark, journals, arguments.history, settings, progress)
    finally:
        stop_session(spark)


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    json_path, html_path = out / "report.json", out / "report.html"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    html_path.write_text(render_html(report))
    return json_path, html_path


def summary(report: dict[str, Any]) -> str:
    totals, total_queue = report["totals"], report["total_queue"]
    lines = [f"verdict: {report['verdict'].upper()}",
             f"{totals['records']} records, {totals['journals']} journals, {totals['queues']} queues, "
             f"{totals['incarnations']} incarnations",
             "total queue: " + ", ".join(f"{name} {total_queue[name]}" for name in
                                         ("enqueued", "acked", "dead_lettered", "purged", "expired", "queued", "lost", "unexpected",
                                          "duplicated", "recovered"))]
    for kind, count in report["violation_counts"].items():
        lines.append(f"  {kind}: {count}")
    for flag in report["flags"]:
        lines.append(f"  flag {flag['kind']}: {flag['queue']} {flag['detail']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    try:
        report = run(arguments)
    except (FileNotFoundError, ValueError, PermissionError) as error:
        print(f"qaudit: {error}", file=sys.stderr)
        return EXIT_ERROR
    json_path, html_path = write_report(report, Path(arguments.out))
    print(summary(report))
    print(f"report: {json_path}\npage:   {html_path}")
    return EXIT_VIOLATIONS if report["verdict"] != "clean" else EXIT_CLEAN


if __name__ == "__main__":
    sys.exit(main())
