"""`qserver backup` of a running node holding many messages (issue 34: the node's loop stalls
<= 20 ms meanwhile; run by hand, not in CI; loopback only).

    .venv/bin/python bench/bench_backup.py [--messages 1000000] [--payload-bytes 1024]

A 3-node cluster on loopback; `bench` (full strength) is mastered by n1 and replicated on n2.
The messages go in as batches of 1000, then, with a light enqueue load on n1 (one call every
10 ms, its latency recorded), `qserver backup --config n1.toml` copies n1's directory from
another process. n1's loop-lag histogram (qserver/metrics.py LoopLag) is read before and after:
the longest lag during the backup is at most the smallest bucket bound holding every lag
between the two reads. Reports the backup's time, its size against n1's data directory (the
LMDB file holds free pages and the map's unused tail; the copy is compacted), and the lags.
Prints one JSON line and appends it to bench/results-backup-<date>.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
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
from bench.loop_stall import longest_lag_bound_ms, scrape  # noqa: E402
from client import AsyncClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster, code_environment  # noqa: E402


def tree_bytes(path: Path) -> int:
    """Bytes the files take on disk (LMDB's data.mdb is sparse: its apparent size is the map)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


async def run(messages: int, payload_bytes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root), 3, placement={"bench": ["n1", "n2"]},
                               settings={"journal_export_check_interval_s": 3600})
        cluster.start_all()
        try:
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
                await client.create_queue("bench", strength="full", max_depth=messages * 2)
                batch, pending = [b"m" * payload_bytes] * 1000, set()
                fill_started = time.perf_counter()
                for _ in range(messages // len(batch)):
                    pending.add(asyncio.ensure_future(client.enqueue_many("bench", batch)))
                    if len(pending) >= 8:
                        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.gather(*pending)
                fill_s = time.perf_counter() - fill_started
                await asyncio.sleep(11)      # the recent-max window (10 s) forgets the fill
                before = await asyncio.to_thread(scrape, cluster.urls["n1"])
                latencies: list[float] = []
                done = asyncio.Event()

                async def light_load() -> None:
                    while not done.is_set():
                        started = time.perf_counter()
                        await client.enqueue("bench", b"during")
                        latencies.append(time.perf_counter() - started)
                        await asyncio.sleep(0.01)
                load = asyncio.create_task(light_load())
                target = Path(root) / "backup"
                started = time.perf_counter()
                done_backup = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "qserver", "backup", "--config", str(Path(root) / "n1.toml"),
                                     "--to", str(target), "--json"],
                    capture_output=True, text=True, cwd=REPOSITORY, env=code_environment(REPOSITORY))
                backup_s = time.perf_counter() - started
                after = await asyncio.to_thread(scrape, cluster.urls["n1"])
                done.set()
                await load
                if done_backup.returncode != 0:
                    raise RuntimeError(done_backup.stderr)
                manifest = json.loads(done_backup.stdout)
                data_dir = Path(root) / "n1"
                return {
                    "bench": "backup", "date": datetime.date.today().isoformat(), "messages": messages,
                    "payload_bytes": payload_bytes, "fill_s": round(fill_s, 1), "backup_s": round(backup_s, 2),
                    "backup_bytes": sum(f["size"] for f in manifest["files"].values()),
                    "data_dir_disk_bytes": tree_bytes(data_dir),
                    "data_mdb_apparent_bytes": (data_dir / "lmdb" / "data.mdb").stat().st_size,
                    "loop_lag_max_ms_at_most": longest_lag_bound_ms(before, after),
                    "loop_lag_recent_max_ms": round(after["qserver_loop_lag_max_seconds"] * 1000, 1),
                    "lags_over_20ms": int((after["+Inf"] - before["+Inf"]) - (after["0.02"] - before["0.02"])),
                    "light_load_calls": len(latencies),
                    "light_load_p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
                    "light_load_max_ms": round(max(latencies) * 1000, 2) if latencies else None,
                }
        finally:
            cluster.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    args = parser.parse_args()
    result = asyncio.run(run(args.messages, args.payload_bytes))
    line = json.dumps(result)
    print(line)
    with open(REPOSITORY / "bench" / f"results-backup-{result['date']}.jsonl", "a") as out:
        out.write(line + "\n")


if __name__ == "__main__":
    main()
