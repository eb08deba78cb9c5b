"""What one durable write costs on this machine's disk, by storage shape (issue 38, item 1).

    .venv/bin/python bench/bench_durability.py [--writes 2000] [--processes 1,2] [--out FILE]

Each shape makes `--writes` durable writes of one 1 KiB message in a row, alone and with a second
process doing the same at the same moment (a master and its replica on one disk), in a
temporary directory on the project's disk:

- `log_appended`    write() at the end of a file, fdatasync (the file grows: its size is flushed too)
- `log_prealloc`    pwrite() into a file written with zeros beforehand, fdatasync (data only)
- `log_fallocated`  pwrite() into a posix_fallocate'd file, fdatasync (extents convert on write)
- `lmdb_one_table`  one put in one LMDB database, commit with sync + metasync (two fsyncs)
- `lmdb_six_tables` a put in each of six databases (a node's commit of one enqueue), synced
- `lmdb_unsynced`   the same six puts, LMDB's sync off (what a write-ahead log would leave LMDB)

Output: one JSON line per shape and process count (p50/p90/p99 µs), on stdout and appended to --out.
The figures of 2026-11-28 and what they meant for a write-ahead log: bench/RESULTS.md, "A
write-ahead log, built and measured".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

RECORD = os.urandom(1100)           # a 1 KiB message with its framing
SHAPES = ("log_appended", "log_prealloc", "log_fallocated", "lmdb_one_table", "lmdb_six_tables", "lmdb_unsynced")


def _writer(shape: str, directory: Path, writes: int) -> Callable[[int], None]:
    """A function making write number i durable in `shape`, with what it needs set up."""
    if shape.startswith("log_"):
        path = directory / "log"
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_APPEND if shape == "log_appended" else 0))
        if shape == "log_prealloc":
            os.pwrite(descriptor, b"\0" * (writes * len(RECORD) + 4096), 0)
            os.fsync(descriptor)
        elif shape == "log_fallocated":
            os.posix_fallocate(descriptor, 0, writes * len(RECORD) + 4096)
            os.fsync(descriptor)

        def log_write(i: int) -> None:
            if shape == "log_appended":
                os.write(descriptor, RECORD)
            else:
                os.pwrite(descriptor, RECORD, i * len(RECORD))
            os.fdatasync(descriptor)
        return log_write
    synced = shape != "lmdb_unsynced"
    env = lmdb.open(str(directory / "env"), map_size=1 << 30, max_dbs=8, sync=synced, metasync=synced)
    tables = [env.open_db(str(n).encode()) for n in range(1 if shape == "lmdb_one_table" else 6)]

    def lmdb_write(i: int) -> None:
        with env.begin(write=True) as txn:
            for n, table in enumerate(tables):
                txn.put(i.to_bytes(8, "big"), RECORD if n == 0 else RECORD[:64], db=table)
    return lmdb_write


def _run(shape: str, writes: int, start: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    directory = Path(tempfile.mkdtemp(prefix=f"durability-{shape}-", dir=Path(__file__).resolve().parent.parent))
    try:
        write = _writer(shape, directory, writes)
        start.wait()
        seconds = []
        for i in range(writes):
            began = time.perf_counter()
            write(i)
            seconds.append(time.perf_counter() - began)
        seconds.sort()
        results.put([seconds[int(len(seconds) * q)] * 1e6 for q in (0.5, 0.9, 0.99)])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def measure(shape: str, writes: int, processes: int) -> dict[str, object]:
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_run, args=(shape, writes, start, results)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    figures = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    p50, p90, p99 = (round(max(figure[n] for figure in figures)) for n in range(3))    # the slower process
    return {"bench": "durability", "shape": shape, "processes": processes, "writes": writes,
            "p50_us": p50, "p90_us": p90, "p99_us": p99, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for processes in (int(n) for n in args.processes.split(",")):
        for shape in args.shapes.split(","):
            line = json.dumps(measure(shape, min(args.writes, 100_000), processes))
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(line + "\n")


if __name__ == "__main__":
    main()
