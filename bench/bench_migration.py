"""The storage migration 7 -> 8 on a node directory of a million messages (issue 34, item 2):
run by hand, one process, no cluster.

    .venv/bin/python bench/bench_migration.py [--messages 1000000] [--queues 1000] [--streams 10]
                                              [--numbers 100] [--payload-bytes 64] [--dir DIR]

Builds the directory with this release's storage API (Storage.commit of Enqueued operations,
batches of 10,000, payloads held in the message rows) and then makes it layout 7 data as 0.1.0
and the releases before it left it: every queue record holding its numbered streams inside
(--streams per queue, --numbers kept per stream; layout 7 moved them to rows only at the
record's next write), the layout number 7, no release or history in `meta`. Then it opens the
directory with Storage, which migrates it before anything else (qserver/storage/migrate.py),
while a thread samples the data file's size and `du` of the directory every 10 ms.

One JSON line: messages, queues, streams moved, the migration's seconds and messages/s (the
directory's messages over the step's time: the step never reads a message row, so this is the
rate a node of that size is brought to layout 8 at), the data file and `du` before, at the
peak during the migration and after (extra disk: peak - before), and a check that every
message row, ready row and stream is there afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lmdb  # noqa: E402

from qserver.storage.lmdb_store import SealedBatch, Storage  # noqa: E402
from qserver.storage.rows import DB_NAMES, Q  # noqa: E402
from replication.operations import Enqueued, Operation  # noqa: E402
from replication.options import QueueOptions  # noqa: E402
from replication.queue_record import QueueRecord  # noqa: E402

BATCH = 10_000


def du_bytes(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def build(path: Path, messages: int, queues: int, streams: int, numbers: int, payload_bytes: int) -> None:
    storage = Storage(path, node_id="n1", map_size_bytes=8 << 30)
    per_queue = messages // queues
    records = {}
    for queue_id in range(1, queues + 1):
        record = QueueRecord(queue_id, f"q{queue_id}", QueueOptions(max_depth=per_queue + 1), 1_000,
                             next_index=per_queue + 1, ready_count=per_queue, total_enqueued=per_queue)
        # As layout 7 left a record written before streams had rows: its streams inside.
        record.sequences = {f"c-{s}\x1fstream": [1, {n: n for n in range(1, numbers + 1)}] for s in range(streams)}
        records[f"q{queue_id}"] = record.to_json()
    payload = b"p" * payload_bytes
    operations: list[Operation] = []
    for queue_id in range(1, queues + 1):
        for index in range(1, per_queue + 1):
            operations.append(Enqueued(queue_id, index, index % 8, 1_000 + index, None, "c-1", payload))
            if len(operations) >= BATCH:
                storage.commit(SealedBatch(operations=operations))
                operations = []
    storage.commit(SealedBatch(operations=operations, queue_records=records))
    storage.close()
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES) + 2, map_size=8 << 30)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"schema_version", Q.pack(7))
        txn.delete(b"release")
        txn.delete(b"layout_history")
    env.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=1_000)
    parser.add_argument("--streams", type=int, default=10, help="numbered streams inside each queue record")
    parser.add_argument("--numbers", type=int, default=100, help="numbers each stream keeps")
    parser.add_argument("--payload-bytes", type=int, default=64)
    parser.add_argument("--dir", type=Path, help="where to build the node directory (default: a temporary one)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-migration-"))
    path = root / "lmdb"
    shutil.rmtree(path, ignore_errors=True)
    built = time.perf_counter()
    build(path, args.messages, args.queues, args.streams, args.numbers, args.payload_bytes)
    build_s = time.perf_counter() - built
    before_file, before_du = (path / "data.mdb").stat().st_size, du_bytes(path)
    peak = {"file": before_file, "du": before_du}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["file"] = max(peak["file"], os.path.getsize(path / "data.mdb"))
            peak["du"] = max(peak["du"], du_bytes(path))
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    storage = Storage(path, node_id="n1", map_size_bytes=8 << 30)
    open_s = time.perf_counter() - started
    done.set()
    sampler.join()
    [step] = storage.migrated
    counts = {name: storage.count(name) for name in ("messages", "ready", "streams")}
    loaded = storage.load_queue_records()
    storage.close()
    after_file, after_du = (path / "data.mdb").stat().st_size, du_bytes(path)
    peak["file"], peak["du"] = max(peak["file"], after_file), max(peak["du"], after_du)
    per_queue = args.messages // args.queues
    ok = (counts["messages"] == counts["ready"] == per_queue * args.queues
          and counts["streams"] == args.queues * args.streams
          and all(len(r.sequences) == args.streams for r in loaded))
    print(json.dumps({
        "bench": "migration", "from": step.from_layout, "to": step.to_layout, "messages": per_queue * args.queues,
        "queues": args.queues, "streams_moved": step.rewritten.get("streams", 0),
        "records_rewritten": step.rewritten.get("queues", 0), "build_s": round(build_s, 1),
        "migration_s": round(step.seconds, 3), "open_with_migration_s": round(open_s, 3),
        "messages_per_s": round(per_queue * args.queues / step.seconds),
        "data_file_bytes": {"before": before_file, "peak": peak["file"], "after": after_file},
        "du_bytes": {"before": before_du, "peak": peak["du"], "after": after_du},
        "extra_disk_bytes": peak["du"] - before_du, "estimated_extra_disk_bytes": step.extra_disk_bytes,
        "intact": ok}))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
