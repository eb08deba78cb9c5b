"""Housekeeping keeps pace with what a node writes: dedupe ids and completion statuses past their
retention are pruned in bounded passes, and passes that are behind follow each other every 50 ms
(qserver/storage/housekeeping.py, CATCH_UP_INTERVAL_MS) instead of one a second. At one pass a
second of 5,000 keys, a producer's dedupe ids (every client enqueue carries one, and they grow)
ran ahead of the sweep for as long as the load went on, and the expired ones behind it stayed."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from client import AsyncClient
from qserver.storage import housekeeping
from qserver.storage.housekeeping import CATCH_UP_INTERVAL_MS, PRUNE_KEYS_PER_BATCH_MAX, PassSchedule
from qserver.storage.lmdb_store import SealedBatch, Storage
from qserver.storage.space import database_usage
from replication.operations import Acked, Enqueued, Operation
from tests.support import RawApi, raw_session

QUEUE = 1
AT_MS = 1_700_000_000_000
ROWS = 2 * PRUNE_KEYS_PER_BATCH_MAX + 2_000      # more than two passes' budget


def entries(storage: Storage, name: str) -> int:
    with storage.env.begin() as txn:
        return int(txn.stat(storage.db[name])["entries"])


def test_a_pass_that_stops_on_its_budget_says_so_and_the_passes_after_it_prune_everything(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=256 << 20)
    try:
        enqueues = [Enqueued(QUEUE, index, 4, AT_MS, f"id-{index}", "producer", b"x") for index in range(1, ROWS + 1)]
        acks = [Acked(QUEUE, index, 4, "consumer", AT_MS + 1, True, None) for index in range(1, ROWS + 1)]
        storage.commit(SealedBatch(operations=[*enqueues, *acks]))
        assert entries(storage, "dedupe") == ROWS and entries(storage, "status") == ROWS

        def one_pass(now_ms: int) -> None:
            storage.commit(SealedBatch(housekeeping_ms=now_ms, dedupe_window_ms=1_000, status_retention_ms=1_000))

        one_pass(AT_MS + 500)                 # nothing has passed its retention: nothing to catch up
        assert not storage.housekeeping_behind
        assert entries(storage, "dedupe") == ROWS and entries(storage, "status") == ROWS

        now_ms = AT_MS + 10_000
        one_pass(now_ms)
        assert storage.housekeeping_behind, "a pass that pruned its whole budget of statuses must ask for another"
        assert entries(storage, "status") == ROWS - PRUNE_KEYS_PER_BATCH_MAX
        passes = 0
        while storage.housekeeping_behind:
            passes += 1
            assert passes <= 10, "the passes never caught up"
            now_ms += CATCH_UP_INTERVAL_MS
            one_pass(now_ms)
        assert entries(storage, "status") == 0 and entries(storage, "expiry") == 0
        one_pass(now_ms + 1_000)              # the dedupe sweep's next walk starts from the first id
        assert entries(storage, "dedupe") == 0
    finally:
        storage.close()


def test_the_dedupe_sweep_keeps_up_with_ids_written_ahead_of_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's dedupe ids grow, so every new row lands ahead of the sweep. Scaled down (a
    budget of 500 keys a pass, 2,000 ids a second, a 5 s window, passes asked for by the engine's
    PassSchedule: one a second, one every 50 ms while the last was behind), the table stays near
    what one and a half windows write; at one pass a second it grew for as long as the writes went
    on (to ~100,000 in these 60 simulated seconds)."""
    monkeypatch.setattr(housekeeping, "PRUNE_KEYS_PER_BATCH_MAX", 500)
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=256 << 20)
    rate, window_ms, step_ms = 2_000, 5_000, CATCH_UP_INTERVAL_MS
    schedule = PassSchedule(interval_ms=1_000)
    now_ms, index, largest = AT_MS, 0, 0
    try:
        for _ in range(60_000 // step_ms):
            now_ms += step_ms
            count = rate * step_ms // 1_000
            ops: list[Operation] = [Enqueued(QUEUE, index + n, 4, now_ms, f"p-{index + n:012x}", "producer", b"")
                   for n in range(1, count + 1)]
            index += count
            pass_ms = now_ms if schedule.due(now_ms, storage.housekeeping_behind) else None
            storage.commit(SealedBatch(operations=ops, housekeeping_ms=pass_ms, dedupe_window_ms=window_ms))
            largest = max(largest, entries(storage, "dedupe"))
        in_window = rate * window_ms // 1_000
        assert largest <= 2 * in_window, f"{largest} dedupe ids stored; the window holds {in_window}"
    finally:
        storage.close()


@pytest.mark.asyncio
async def test_a_node_prunes_a_burst_of_expired_dedupe_ids_in_seconds_not_one_pass_a_second(
        qnode_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """100,000 enqueues with a dedupe window of 1 s: at 5,000 ids a pass and one pass a second
    the ids left after the burst took 10 s and more to go; passing again every 50 ms while a pass
    is behind takes them in a few hundred milliseconds (8 s allows a loaded machine)."""
    config = tmp_path / "node.toml"
    config.write_text("[node]\ndedupe_window_s = 1.0\n")
    node = qnode_factory("n1", ["--config", str(config)])
    await asyncio.to_thread(node.start)
    messages = 100_000
    async with AsyncClient(node.url, node.credentials_path) as client:
        await client.create_queue("burst", max_depth=messages)
        pending: set[asyncio.Future[object]] = set()
        for n in range(messages // 250):
            pending.add(asyncio.ensure_future(client.enqueue_many("burst", [b"%d" % (n * 250 + i) for i in range(250)])))
            if len(pending) >= 8:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)
        filled = time.monotonic()
        assert (await client.queue_stats("burst"))["depth"] == messages
        lmdb_dir = node.data_dir / "lmdb"
        left = await asyncio.to_thread(lambda: database_usage(lmdb_dir)["dedupe"]["entries"])
        while left > 0:
            assert time.monotonic() - filled < 1.0 + 8.0, f"{left} expired dedupe ids still stored"
            await asyncio.sleep(0.2)
            left = await asyncio.to_thread(lambda: database_usage(lmdb_dir)["dedupe"]["entries"])
        # Nothing but the ids went: every message is still there to take.
        assert (await client.queue_stats("burst"))["depth"] == messages
    async with raw_session() as session:
        raw = RawApi.for_credentials(session, node.credentials_path)
        for _ in range(50):             # the last pass (it found nothing more) says it caught up
            status, body, _ = await raw.request("GET", "/metrics")
            assert status == 200
            gauge = [line for line in body.decode().splitlines() if line.startswith("qserver_housekeeping_behind ")]
            assert len(gauge) == 1
            if gauge[0].endswith(" 0"):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"still behind with nothing left to prune: {gauge[0]}")
