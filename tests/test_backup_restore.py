"""`qserver backup` of a running node and `qserver restore` (qserver/storage/backup.py;
docs/OPERATIONS.md, "Backup and restore"), on real processes: the restored node rejoins as a
node that lost its disk, catches up, masters nothing it missed, and then survives a failover
onto it with every acknowledged message still there."""
from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import REPOSITORY, code_environment

# ledger: full strength, master n1, replica n2 (the node restored); orders: producer strength,
# master n2 until it stops (its orderly stop hands it to n1).
PLACEMENT = {"ledger": ["n1", "n2"], "orders": ["n2", "n1"]}


def qserver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qserver", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPOSITORY, env=code_environment(REPOSITORY))


def loop_lag_max_s(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("qserver_loop_lag_max_seconds "):
                return float(line.split()[1])
    raise AssertionError("no qserver_loop_lag_max_seconds in /metrics")


async def stats(client: AsyncClient, queue: str) -> dict[str, Any]:
    return await client.queue_stats(queue)


async def wait_in_sync(master_side: AsyncClient, replica_side: AsyncClient, queue: str,
                       timeout_s: float = 60.0) -> tuple[dict[str, Any], dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        m, r = await stats(master_side, queue), await stats(replica_side, queue)
        if m.get("master_status") == "master" and m["replication_state"] == "in_sync" \
                and r["replication_state"] == "following" and m["last_order"] == r["last_order"] \
                and m["commit_order"] == r["commit_order"] and m["digest"] == r["digest"]:
            return m, r
        if time.monotonic() > deadline:
            raise AssertionError(f"{queue} did not converge: master side {m}, replica side {r}")
        await asyncio.sleep(0.2)


async def drain(client: AsyncClient, queue: str, expected: int, timeout_s: float = 60.0) -> list[bytes]:
    payloads: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(payloads) < expected and time.monotonic() < deadline:
        try:
            batch = await client.receive(queue, max_messages=100, wait_s=1, visibility_timeout_s=600)
        except Exception:        # noqa: BLE001 (the failover is under way: E_NOT_MASTER, E_QUEUE_UNAVAILABLE)
            await asyncio.sleep(0.2)
            continue
        payloads += [message.payload for message in batch]
    return payloads


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["sigterm", "kill"])
async def test_a_restored_node_rejoins_catches_up_and_survives_a_failover(qcluster_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                          end: str) -> None:
    """`end`: how n2 ends before its disk is lost. SIGTERM hands orders to n1 first; kill -9
    leaves the map naming n2 master of orders until the leader fails it over, and the restored
    node may first see a map that still does: it gets no lease under its new storage id
    (qserver/cluster/coordinator.py), so it masters nothing meanwhile either."""
    cluster = qcluster_factory(3, PLACEMENT)
    acknowledged: dict[str, list[bytes]] = {"ledger": [], "orders": []}
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as n1:
        await n1.create_queue("ledger", strength="full")
        await n1.create_queue("orders", strength="producer")

        async def write(tag: str, count: int) -> None:
            for queue in acknowledged:
                payloads = [f"{queue}-{tag}-{i}".encode() for i in range(count)]
                await n1.enqueue_many(queue, payloads)
                acknowledged[queue] += payloads
        await write("before", 200)

        # The backup, while a light load keeps writing through n1.
        stop_load = asyncio.Event()

        async def load() -> None:
            round_ = 0
            while not stop_load.is_set():
                await write(f"during{round_}", 10)
                round_ += 1
                await asyncio.sleep(0.05)
        loader = asyncio.create_task(load())
        backup = tmp_path / "backup-n2"
        lag_before = loop_lag_max_s(cluster.urls["n2"])
        done = await asyncio.to_thread(qserver, "backup", "--config", str(cluster.root / "n2.toml"),
                                       "--to", str(backup), "--json")
        lag_after = loop_lag_max_s(cluster.urls["n2"])       # the longest lag of the last 10 s
        stop_load.set()
        await loader
        assert done.returncode == 0, done.stderr
        manifest = json.loads(done.stdout)
        assert manifest == json.loads((backup / "manifest.json").read_text())
        assert manifest["node_id"] == "n2" and manifest["storage_layout"] >= 8 and manifest["raft"]["term"] >= 1
        assert {"data/lmdb/data.mdb", "data/cluster.secret", "node.toml"} <= set(manifest["files"])
        assert not any(name.endswith(("lock.mdb", "qserver.lock", "replay-window.json")) for name in manifest["files"])
        for name, facts in manifest["files"].items():
            data = (backup / name).read_bytes()
            assert len(data) == facts["size"] and hashlib.sha256(data).hexdigest() == facts["sha256"], name
        print(f"n2 loop lag max (last 10 s) around the backup: {lag_before * 1000:.1f} ms before, "
              f"{lag_after * 1000:.1f} ms after")
        assert lag_after < 0.5, "the backup runs beside the node: its loop never waits for it (loose bound)"

        # A backup goes only to a new or empty directory.
        again = await asyncio.to_thread(qserver, "backup", "--config", str(cluster.root / "n2.toml"), "--to", str(backup))
        assert again.returncode == 2 and "E_INVALID_OPTION" in again.stderr

        await write("after-backup", 100)          # what the backup does not hold
        if end == "sigterm":
            await asyncio.to_thread(cluster.stop, "n2")     # orderly: orders' mastership goes to n1
        else:
            async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as old_n2:
                await wait_in_sync(old_n2, n1, "orders")    # every acknowledged enqueue is on n1 too
            await asyncio.to_thread(cluster.kill, "n2")
        await write("n2-down", 50)

        # The disk is lost; the directory is restored from the backup.
        shutil.rmtree(cluster.root / "n2")
        restored = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--config",
                                           str(cluster.root / "n2.toml"), "--json")
        assert restored.returncode == 0, restored.stderr
        report = json.loads(restored.stdout)
        assert report["old_storage_id"] == manifest["storage_id"] != report["new_storage_id"]
        refused = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--config",
                                          str(cluster.root / "n2.toml"))
        assert refused.returncode == 2 and "E_INVALID_OPTION" in refused.stderr, "it holds data: --force needed"

        await asyncio.to_thread(cluster.start, "n2")      # waits until it is a voter again, and up
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as n2:
            for queue in acknowledged:
                # Never master of a queue whose epochs it missed: n1 masters both, n2 follows.
                assert (await stats(n2, queue)).get("master_status") != "master", queue
                master, replica = await wait_in_sync(n1, n2, queue)
                assert master["depth"] == replica["depth"] == len(acknowledged[queue]), queue
            await write("rejoined", 20)
            for queue in acknowledged:
                await wait_in_sync(n1, n2, queue)

            # Failover onto the restored node: nothing acknowledged is lost.
            await asyncio.to_thread(cluster.kill, "n1")
            for queue, expected in acknowledged.items():
                received = await drain(n2, queue, len(expected))
                assert sorted(received) == sorted(expected), \
                    f"{queue}: missing {sorted(set(expected) - set(received))[:5]}, extra {len(received) - len(expected)}"


@pytest.mark.asyncio
async def test_a_tampered_or_unfinished_backup_is_refused_and_changes_nothing(qcluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {})
    backup = tmp_path / "backup-n3"
    done = await asyncio.to_thread(qserver, "backup", "--config", str(cluster.root / "n3.toml"), "--to", str(backup))
    assert done.returncode == 0, done.stderr
    target = tmp_path / "restored-n3"
    secret = backup / "data" / "cluster.secret"
    original = secret.read_bytes()
    # One character changed (a fixed "0" left the file as it was whenever it ended in "0": 1 in 16)
    secret.write_bytes(original[:-2] + (b"1" if original[-2:-1] == b"0" else b"0") + original[-1:])
    refused = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target))
    assert refused.returncode == 2 and "sha256" in refused.stderr
    assert not target.exists(), "a refused restore leaves nothing behind"
    secret.write_bytes(original)
    (backup / "data" / "extra").write_text("not in the manifest")
    refused = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target))
    assert refused.returncode == 2 and "not listed" in refused.stderr
    (backup / "data" / "extra").unlink()
    (backup / "manifest.json").rename(backup / "manifest.later")      # as if the backup had not finished
    refused = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target))
    assert refused.returncode == 2 and "manifest" in refused.stderr
    (backup / "manifest.later").rename(backup / "manifest.json")
    manifest = json.loads((backup / "manifest.json").read_text())
    (backup / "manifest.json").write_text(json.dumps({**manifest, "storage_layout": 99}))
    newer = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target))
    assert newer.returncode == 2 and "E_VERSION_MISMATCH" in newer.stderr and not target.exists()
    (backup / "manifest.json").write_text(json.dumps(manifest))
    # Over a running node's directory: refused even with --force (the node's lock).
    busy = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--config",
                                   str(cluster.root / "n3.toml"), "--force")
    assert busy.returncode == 2 and "E_UNAVAILABLE" in busy.stderr
    ok = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target), "--json")
    assert ok.returncode == 0, ok.stderr
    assert (target / "lmdb" / "data.mdb").is_file() and (target / "cluster.secret").read_bytes() == original
    first = json.loads(ok.stdout)["new_storage_id"]
    # Over a directory that holds data: only with --force, which moves the old one aside.
    refused = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target))
    assert refused.returncode == 2 and "--force" in refused.stderr
    forced = await asyncio.to_thread(qserver, "restore", "--from", str(backup), "--data-dir", str(target),
                                     "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    report = json.loads(forced.stdout)
    aside = Path(report["moved_aside"])
    assert aside.parent == target.parent and (aside / "lmdb" / "data.mdb").is_file()
    assert report["new_storage_id"] not in (first, manifest["storage_id"]), "each restore takes a new storage id"


def test_a_backup_of_an_older_layout_is_restored_and_migrated_at_open(tmp_path: Path) -> None:
    """A layout 7 directory (release 0.1.0's) backed up while stopped: the restore keeps its
    rows, drops its Raft state, takes a new storage id; opening it migrates it to this layout."""
    from qserver.storage.lmdb_store import Storage
    from qserver.storage.raft_store import RaftStore
    from qserver.storage.rows import SCHEMA_VERSION
    data = tmp_path / "n1"
    assert qserver("init", "--data-dir", str(data), "--credentials", str(tmp_path / "c.json")).returncode == 0
    down = qserver("migrate", "--data-dir", str(data), "--to", "7")
    assert down.returncode == 0, down.stderr
    done = qserver("backup", "--data-dir", str(data), "--to", str(tmp_path / "backup"), "--json")
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)
    assert manifest["storage_layout"] == 7 and manifest["raft"]["term"] >= 1 and manifest["node_id"] == "n1"
    restored = qserver("restore", "--from", str(tmp_path / "backup"), "--data-dir", str(tmp_path / "again"), "--json")
    assert restored.returncode == 0, restored.stderr
    storage = Storage(tmp_path / "again" / "lmdb", node_id="n1")
    try:
        assert storage.storage_id == json.loads(restored.stdout)["new_storage_id"] != manifest["storage_id"]
        assert RaftStore(storage).is_empty(), "the restored node promised nothing: it joins as a new member"
        assert [step.to_layout for step in storage.migrated] == [SCHEMA_VERSION]
        assert storage.env.stat()["entries"] > 0
    finally:
        storage.close()
