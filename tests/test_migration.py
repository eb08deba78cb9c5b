"""Storage layouts and their migration (qserver/storage/migrate.py; docs/OPERATIONS.md, "Storage
layouts and migration"): each step on a hand-built layout 7 environment, the dry run, a crash
in the middle, an undecodable row, a newer layout, the way back, and a data directory written
by release 0.1.0 itself (its `git worktree`, tests/upgrade_support.py)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest

from client import AsyncClient
from qserver.dev.devcluster import REPOSITORY, LocalCluster
from qserver.storage import migrate
from qserver.storage.lmdb_store import SealedBatch, Storage, StorageLayoutError
from qserver.storage.rows import DB_NAMES, SCHEMA_VERSION, Q
from replication.options import QueueOptions, Strength
from replication.queue_record import QueueRecord
from replication.queue_streams import SEQUENCE_HEADER, SEQUENCE_KEY_HEADER
from tests.upgrade_support import release_tree, releases, run_qserver, skip_reason
from wire.versions import RELEASE

STREAMS: dict[str, list[Any]] = {"c-1\x1fp": [3, {3: 1, 5: 2}], "c-2\x1fother": [1, {1: 3}]}


def rows(path: Path, env: lmdb.Environment | None = None) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every row of every database of the environment at `path` (or `env`, open already)."""
    own = env is None
    env = env or lmdb.open(str(path), max_dbs=len(DB_NAMES) + 2, readonly=True, lock=False)
    try:
        out = {}
        with env.begin() as txn:
            for name in DB_NAMES:
                out[name] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.open_db(name.encode(), txn=txn))]
        return out
    finally:
        if own:
            env.close()


def file_digest(path: Path) -> str:
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


def set_meta(path: Path, **values: bytes | None) -> None:
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES) + 2)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        for key, value in values.items():
            if value is None:
                txn.delete(key.encode())
            else:
                txn.put(key.encode(), value)
    env.close()


def put_row(path: Path, db: str, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES) + 2)
    with env.begin(write=True, db=env.open_db(db.encode())) as txn:
        txn.put(key, value)
    env.close()


def layout7(path: Path) -> Path:
    """A layout 7 environment as 0.1.0 (and the releases before it) left them: one queue record
    still holding its streams and the retired in_sync field, a stream row newer than the
    record's copy of that stream, a stream row in the form before floors, a record already
    without streams; no release or history in meta."""
    storage = Storage(path, node_id="n1")
    old = QueueRecord(1, "collect", QueueOptions(strength=Strength.FULL), 1_000, next_index=4)
    old.sequences = {key: [floor, dict(kept)] for key, (floor, kept) in STREAMS.items()}
    held = {**old.to_json(), "in_sync": True}
    plain = QueueRecord(2, "plain", QueueOptions(), 1_000)
    storage.commit(SealedBatch(queue_records={"collect": held, "plain": plain.to_json(streams=False)},
                               stream_puts=[(1, "c-1\x1fp", [3, [[3, 1], [5, 2], [6, 4]]])]))
    storage.close()
    put_row(path, "streams", Q.pack(2) + b"c-9\x1fold", msgpack.packb([7, 12]))       # before floors
    set_meta(path, schema_version=Q.pack(7), release=None, layout_history=None)
    return path


def data_dir(tmp_path: Path) -> Path:
    """A node data directory (what `qserver migrate --data-dir` names) holding a layout 7 lmdb/."""
    layout7(tmp_path / "node" / "lmdb")
    return tmp_path / "node"


def test_step_7_to_8_moves_every_stream_into_its_row_and_records_the_history(tmp_path: Path) -> None:
    path = layout7(tmp_path / "lmdb")
    storage = Storage(path, node_id="n1")
    assert [(s.from_layout, s.to_layout) for s in storage.migrated] == [(7, 8)]
    stored = rows(path, storage.env)
    records = {k: msgpack.unpackb(v) for k, v in stored["queues"]}
    assert all("sequences" not in r and "in_sync" not in r for r in records.values())
    streams = {k: msgpack.unpackb(v) for k, v in stored["streams"]}
    assert streams == {Q.pack(1) + b"c-1\x1fp": [3, [[3, 1], [5, 2], [6, 4]]],     # the row was newer
                       Q.pack(1) + b"c-2\x1fother": [1, [[1, 3]]],                 # moved out of the record
                       Q.pack(2) + b"c-9\x1fold": [7, [[7, 12]]]}                          # given its floor
    meta = dict(stored["meta"])
    assert Q.unpack(meta[b"schema_version"])[0] == SCHEMA_VERSION == 8
    assert meta[b"release"] == RELEASE.encode()
    [entry] = json.loads(meta[b"layout_history"])
    assert (entry["release"], entry["from"], entry["to"]) == (RELEASE, 7, 8)
    loaded = {r.name: r for r in storage.load_queue_records()}
    assert loaded["collect"].sequences == {"c-1\x1fp": [3, {3: 1, 5: 2, 6: 4}], "c-2\x1fother": [1, {1: 3}]}
    assert not loaded["collect"].changed_streams
    view = storage.open_snapshot("collect", 1, consumption=True, after_index=0, dead_letter=None)
    assert view is not None and QueueRecord.from_json(view.record).sequences == loaded["collect"].sequences
    view.close()
    storage.close()
    before = rows(path)
    Storage(path, node_id="n1").close()          # a second start: nothing to do
    assert rows(path) == before


def test_a_dry_run_says_what_it_would_do_and_changes_nothing(tmp_path: Path) -> None:
    node = data_dir(tmp_path)
    before, digest = rows(node / "lmdb"), file_digest(node / "lmdb")
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["stored_layout"], report["target_layout"], report["dry_run"]) == (7, 8, True)
    [step] = report["steps"]
    assert step["rewritten"] == {"queues": 1, "streams": 2} and step["examined"]["queues"] == 2
    assert step["extra_disk_bytes"] > 0
    assert rows(node / "lmdb") == before and file_digest(node / "lmdb") == digest
    text = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--dry-run")
    assert "step 7 -> 8" in text.stdout and "nothing was changed" in text.stdout
    assert rows(node / "lmdb") == before
    done = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["history"][-1]["to"] == 8
    again = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--dry-run")
    assert "nothing to do" in again.stdout and f"last written by qserver {RELEASE}" in again.stdout
    assert "layout 7 -> layout 8" in again.stdout       # the history


def test_a_failure_inside_the_step_leaves_layout_7_and_the_next_start_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = layout7(tmp_path / "lmdb")
    before = rows(path)
    monkeypatch.setenv(migrate.TEST_HOOK_ENV, "fail:5")     # after it wrote a stream row
    with pytest.raises(RuntimeError, match="failing the migration after 5 rows"):
        Storage(path, node_id="n1")
    assert rows(path) == before
    monkeypatch.delenv(migrate.TEST_HOOK_ENV)
    Storage(path, node_id="n1").close()
    assert Q.unpack(dict(rows(path)["meta"])[b"schema_version"])[0] == 8
    assert len(rows(path)["streams"]) == 3


def test_a_migration_killed_mid_step_leaves_layout_7_and_a_restart_completes(tmp_path: Path) -> None:
    node = data_dir(tmp_path)
    before = rows(node / "lmdb")
    process = subprocess.Popen([sys.executable, "-m", "qserver", "migrate", "--data-dir", str(node)], cwd=REPOSITORY,
                               env={**os.environ, migrate.TEST_HOOK_ENV: "stall:5"}, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 30
        seen = b""
        while b"MIGRATION-STALLED" not in seen and time.monotonic() < deadline:
            seen += process.stderr.readline()
        assert b"MIGRATION-STALLED" in seen, seen
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
    assert rows(node / "lmdb") == before
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"][0]["rewritten"] == {"queues": 1, "streams": 2}
    assert len(rows(node / "lmdb")["streams"]) == 3


def test_an_undecodable_row_stops_the_migration_naming_it_and_changes_nothing(tmp_path: Path) -> None:
    path = layout7(tmp_path / "lmdb")
    put_row(path, "queues", b"broken", b"\xc1\x00")
    before = rows(path)
    with pytest.raises(migrate.MigrationError, match="database 'queues', key b'broken'.*nothing was changed"):
        Storage(path, node_id="n1")
    assert rows(path) == before
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(tmp_path), "--json")
    assert result.returncode == 2 and json.loads(result.stdout)["error"]["code"] == "E_VERSION_MISMATCH"
    assert "b'broken'" in result.stderr and rows(path) == before


def test_a_newer_layout_is_refused_naming_both_layouts_and_both_releases(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    Storage(path, node_id="n1").close()
    set_meta(path, schema_version=Q.pack(9), release=b"0.3.0")
    before = rows(path)
    expected = f"layout 9 written by qserver 0.3.0; this is qserver {RELEASE}, which reads layout 8"
    with pytest.raises(StorageLayoutError, match=expected):
        Storage(path, node_id="n1")
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(tmp_path))
    assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "node.toml").write_text(f'[node]\nnode_id = "n1"\ndata_dir = "{tmp_path}"\nport = 1\n')
    started = run_qserver(REPOSITORY, "run", "--config", str(tmp_path / "node.toml"))
    assert started.returncode == 2 and expected in started.stderr and "Traceback" not in started.stderr
    assert rows(path) == before


def test_the_way_back_renumbers_to_7_and_refuses_what_7_cannot_read(tmp_path: Path) -> None:
    node = data_dir(tmp_path)
    Storage(node / "lmdb", node_id="n1").close()
    migrated = rows(node / "lmdb")
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--to", "7", "--json")
    assert result.returncode == 0, result.stderr
    history = json.loads(result.stdout)["history"]
    assert [(h["from"], h["to"]) for h in history] == [(7, 8), (8, 7)]
    back = rows(node / "lmdb")
    assert Q.unpack(dict(back["meta"])[b"schema_version"])[0] == 7
    assert b"release" not in dict(back["meta"])         # 0.1.0, the next writer, would not keep it current
    assert {n: r for n, r in back.items() if n != "meta"} == {n: r for n, r in migrated.items() if n != "meta"}
    # A record with a field layout 7's code does not know: refused, nothing changed.
    Storage(node / "lmdb", node_id="n1").close()           # up to 8 again
    record: dict[str, Any] = msgpack.unpackb(dict(rows(node / "lmdb")["queues"])[b"plain"])
    put_row(node / "lmdb", "queues", b"plain", msgpack.packb({**record, "future_field": 1}))
    before = rows(node / "lmdb")
    refused = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--to", "7")
    assert refused.returncode == 2 and "future_field" in refused.stderr and "b'plain'" in refused.stderr
    assert rows(node / "lmdb") == before
    bad = run_qserver(REPOSITORY, "migrate", "--data-dir", str(node), "--to", "6", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["code"] == "E_INVALID_OPTION"


# --- a data directory written by release 0.1.0 itself ----------------------------------------------
# Release 0.1.0, the release of layout 7: the 7 -> 8 step is what these tests migrate (the
# previous release, whichever it is, is tests/test_upgrade.py's).
OLD = next((r for r in releases() if r["version"] == "0.1.0"), None)
STREAM = {SEQUENCE_KEY_HEADER: "orders-feed"}


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if OLD is None:
        pytest.skip("releases.toml names no release 0.1.0")
    reason = skip_reason(OLD["commit"])
    if reason is not None:
        pytest.skip(reason)
    with release_tree(OLD["commit"], tmp_path_factory.mktemp("release") / "tree") as tree:
        yield tree


def layout_report(cluster: LocalCluster, node: str) -> dict[str, Any]:
    result = run_qserver(REPOSITORY, "migrate", "--data-dir", str(cluster.root / node), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


async def write_as_old_release(url: str, credentials: Path) -> dict[str, Any]:
    """Queues of both strengths, messages (some numbered in a stream, some with headers), and
    leases held across the upgrade; what was written, as the old release answered it."""
    async with AsyncClient(url, credentials) as client:
        await client.create_queue("strong", strength="full", visibility_timeout_s=600)
        await client.create_queue("weak", strength="producer", visibility_timeout_s=600)
        stored: dict[str, dict[int, bytes]] = {"strong": {}, "weak": {}}
        numbered: dict[int, int] = {}
        for queue in ("strong", "weak"):
            for i in range(30):
                payload = f"{queue}-{i}".encode()
                stored[queue][await client.enqueue(queue, payload, priority=i % 8)] = payload
        for number in range(1, 11):
            payload = f"numbered-{number}".encode()
            numbered[number] = await client.enqueue("strong", payload, headers={**STREAM, SEQUENCE_HEADER: str(number)})
            stored["strong"][numbered[number]] = payload
        leased = {queue: {m.id: m.receipt for m in await client.receive(queue, max_messages=5)}
                  for queue in ("strong", "weak")}
        return {"stored": stored, "numbered": numbered, "leased": leased}


async def check_as_new_release(url: str, credentials: Path, written: dict[str, Any]) -> None:
    """Every message served with its id and payload, the leases still held (their receipts
    ack), and the numbered stream's numbers still known (a repeat is answered, not stored)."""
    async with AsyncClient(url, credentials) as client:
        assert await client.enqueue("strong", b"again", headers={**STREAM, SEQUENCE_HEADER: "10"}) \
            == written["numbered"][10]
        for queue in ("strong", "weak"):
            stats = await client.queue_stats(queue)
            assert stats["depth"] == len(written["stored"][queue]), stats
            seen: dict[int, bytes] = {}
            deadline = time.monotonic() + 20
            while len(seen) < len(written["stored"][queue]) - len(written["leased"][queue]):
                assert time.monotonic() < deadline, f"{queue}: {len(seen)} served"
                for message in await client.receive(queue, max_messages=100, wait_s=0.2):
                    seen[message.id] = message.payload
            leased = written["leased"][queue]
            assert not set(seen) & set(leased), "a lease held across the upgrade was delivered again"
            assert {**seen, **{i: written["stored"][queue][i] for i in leased}} == written["stored"][queue]
            for message_id, receipt in leased.items():
                await client.ack(queue, message_id, receipt)


def test_a_data_directory_of_release_0_1_0_migrates_at_start_and_serves_every_message(
        old_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Release 0.1.0's nodes (its own code) write the data; this release's nodes start on it:
    a first start failed mid-migration (the test hook) leaves layout 7, the next one migrates,
    serves everything as it was, and a start after that has nothing to do. Then the way back:
    `qserver migrate --to 7`, and 0.1.0's nodes serve it again."""
    placement = {"strong": ["n1", "n2"], "weak": ["n1", "n2"]}
    cluster = LocalCluster(tmp_path, 2, placement, code=old_tree, tls=False)
    try:
        cluster.start_all()
        written = asyncio.run(write_as_old_release(cluster.urls["n1"], cluster.credentials_path))
        cluster.stop_all()
        assert [layout_report(cluster, n)["stored_layout"] for n in cluster.ids] == [7, 7]
        monkeypatch.setenv(migrate.TEST_HOOK_ENV, "fail:2")
        with pytest.raises(RuntimeError):
            cluster.start("n1", wait=False, code=REPOSITORY)
        monkeypatch.delenv(migrate.TEST_HOOK_ENV)
        report = layout_report(cluster, "n1")
        assert report["stored_layout"] == 7 and report["steps"][0]["from"] == 7
        cluster.log_level = "INFO"
        for node in cluster.ids:
            cluster.start(node, wait=False, code=REPOSITORY)
        cluster.wait_ready()
        assert "migrated layout 7 -> 8" in (tmp_path / "n1.log").read_text()
        asyncio.run(check_as_new_release(cluster.urls["n1"], cluster.credentials_path, written))
        cluster.stop_all()
        for node in cluster.ids:
            report = layout_report(cluster, node)
            assert report["stored_layout"] == 8 and report["steps"] == []
            assert [(h["from"], h["to"]) for h in report["history"]] == [(7, 8)]
        cluster.start_all()                  # a second start: nothing to migrate
        cluster.stop_all()
        for node in cluster.ids:
            assert len(layout_report(cluster, node)["history"]) == 1
            back = run_qserver(REPOSITORY, "migrate", "--data-dir", str(cluster.root / node), "--to", "7")
            assert back.returncode == 0 and "migrated to layout 7" in back.stdout, back.stderr
        for node in cluster.ids:
            cluster.start(node, wait=False, code=old_tree)
        cluster.wait_ready()
        asyncio.run(check_rolled_back(cluster.urls["n1"], cluster.credentials_path, written))
    finally:
        cluster.kill_all()


async def check_rolled_back(url: str, credentials: Path, written: dict[str, Any]) -> None:
    """0.1.0 again on the data this release migrated and brought back: the messages left (all
    but the leased ones, acknowledged) and the stream's numbers."""
    async with AsyncClient(url, credentials) as client:
        for queue in ("strong", "weak"):
            stats = await client.queue_stats(queue)
            assert stats["depth"] == len(written["stored"][queue]) - len(written["leased"][queue]), stats
        assert await client.enqueue("strong", b"again", headers={**STREAM, SEQUENCE_HEADER: "10"}) \
            == written["numbered"][10]
