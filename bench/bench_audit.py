"""qaudit over synthetic journals: wall time of the whole command, Spark start included (run by
hand, not in CI; local only).

    .venv/bin/python bench/bench_audit.py [--sizes 1000000 5000000] [--runs 3] [--master local[2]]

Each size is written once (audit/synthetic.py: 24 queue pairs on three nodes, both strengths,
Parquet segments as the exporter writes them) and cached under --cache; then `qaudit` runs as a
fresh process (so every run starts its own JVM) --runs times. Every run must find the journals
clean. Prints the median and spread and appends every run to bench/results-audit-<date>.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
from audit.synthetic import synthesize  # noqa: E402


def journals(cache: Path, records: int) -> Path:
    target = cache / f"synthetic-{records}"
    done = target / "written"
    if not done.exists():
        started = time.perf_counter()
        written = synthesize(target, records)
        done.write_text(str(written))
        print(f"wrote {written} records in {time.perf_counter() - started:.1f}s to {target}", flush=True)
    return target


def one_run(path: Path, master: str, out: Path, engine: str) -> dict[str, Any]:
    started = time.perf_counter()
    answer = subprocess.run([sys.executable, "-m", "audit.cli", "--journals", str(path), "--master", master,
                             "--engine", engine, "--out", str(out), "--quiet"],
                            cwd=REPOSITORY, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if answer.returncode != 0:
        raise RuntimeError(f"qaudit failed ({answer.returncode}): {answer.stdout}{answer.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"seconds": seconds, "records": report["totals"]["records"], "verdict": report["verdict"],
            "job_seconds": report["inputs"]["elapsed_s"]}


def main() -> None:
    parse = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parse.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parse.add_argument("--runs", type=int, default=3)
    parse.add_argument("--master", default="local[2]")
    parse.add_argument("--engine", default="spark", choices=("spark", "python"))
    parse.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "qaudit-bench")
    arguments = parse.parse_args()
    date = datetime.date.today().isoformat()
    results_path = REPOSITORY / "bench" / f"results-audit-{date}.jsonl"
    summaries = []
    for size in arguments.sizes:
        path = journals(arguments.cache, size)
        runs = []
        for run in range(1, arguments.runs + 1):
            result = one_run(path, arguments.master, arguments.cache / "report", arguments.engine)
            assert result["verdict"] == "clean", result
            line = {"workload": "audit", "target_records": size, "run": run, "master": arguments.master,
                    "engine": arguments.engine, **result,
                    "records_per_s": result["records"] / result["seconds"]}
            runs.append(line)
            with results_path.open("a") as results:
                results.write(json.dumps(line) + "\n")
            print(f"{size:>9} records  run {run}: {result['seconds']:.1f}s", flush=True)
        seconds = [r["seconds"] for r in runs]
        summaries.append((runs[0]["records"], statistics.median(seconds), min(seconds), max(seconds)))
    print("\n| records | seconds, median [spread] | records/s (median) |\n|---|---|---|")
    for records, median, low, high in summaries:
        print(f"| {records:,} | {median:.1f} [{low:.1f} – {high:.1f}] | {records / median:,.0f} |")
    if len(summaries) > 1:
        (small, small_s, _, _), (large, large_s, _, _) = summaries[0], summaries[-1]
        print(f"\n{large / small:.1f}x the records took {large_s / small_s:.2f}x the time")


if __name__ == "__main__":
    main()
