"""The write-ahead log (qserver/storage/wal.py): what a crash leaves, brought back exactly.

A process killed at any moment leaves its files as the page cache held them; a machine that
loses power leaves, of every page written since the last flush, either the old or the new
contents. Both are made here from real files: a copy taken while the storage is open (kill -9),
and a copy whose every page written since the last checkpoint is, at random, the checkpoint's
or the latest (power lost; the seed replays it). Opening either must give every write that
returned: no fewer (each was answered), and nothing that was not written.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from qserver.storage.lmdb_store import Storage
from qserver.storage.migrate import StorageLayoutError, open_environment
from qserver.storage.rows import DB_NAMES

SEEDS = range(8)
TABLES = ("messages", "ready", "dedupe", "headers", "raft_log")


def state(storage: Storage) -> dict[str, dict[bytes, bytes]]:
    with storage.env.begin() as txn:
        return {name: {bytes(key): bytes(value) for key, value in txn.cursor(db=storage.db[name])}
                for name in DB_NAMES}


def random_write(storage: Storage, rng: random.Random) -> None:
    """One write transaction of every kind of change the node makes (put, overwrite, delete,
    pop, cursor deletes, putmulti, drop)."""
    with storage.write_transaction() as txn:
        for _ in range(rng.randint(1, 12)):
            db = storage.db[rng.choice(TABLES)]
            key = rng.randrange(400).to_bytes(4, "big")
            action = rng.random()
            if action < 0.55:
                txn.put(key, os.urandom(rng.choice((8, 300, 3000))), db=db)
            elif action < 0.7:
                txn.delete(key, db=db)
            elif action < 0.8:
                txn.pop(key, db=db)
            elif action < 0.9:
                cursor = txn.cursor(db=db)
                if cursor.set_range(key):
                    for _ in range(rng.randint(1, 5)):
                        if not cursor.key() or not cursor.delete():
                            break
            elif action < 0.995:
                start = rng.randrange(400)
                txn.cursor(db=db).putmulti([((start + n).to_bytes(4, "big"), os.urandom(64)) for n in range(20)])
            else:
                txn.drop(db, delete=False)


def open_storage(path: Path) -> Storage:
    return Storage(path, node_id="n1", map_size_bytes=64 << 20, disk_reserve_bytes=0)


def copy_open(source: Path, target: Path) -> None:
    """The files as a kill -9 leaves them: what the page cache holds."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("lock.mdb"))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_killed_process_comes_back_with_every_write_that_returned(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    storage = open_storage(tmp_path / "live")
    try:
        for _ in range(rng.randint(50, 400)):
            random_write(storage, rng)
        expected = state(storage)
        copy_open(tmp_path / "live", tmp_path / "killed")
    finally:
        storage.close()
    reopened = open_storage(tmp_path / "killed")
    try:
        assert state(reopened) == expected, f"seed {seed}"
    finally:
        reopened.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_machine_that_lost_power_comes_back_with_every_write_that_returned(tmp_path: Path, seed: int) -> None:
    """Of each page written since the last checkpoint, the disk kept the old contents or the new
    (the meta pages too); the log's tail beyond its last record is torn. Replay gives back the
    state after the last write that returned, whatever the mix."""
    rng = random.Random(seed)
    live = tmp_path / "live"
    storage = open_storage(live)
    try:
        flushed = (live / "data.mdb").read_bytes()      # opening ends with a checkpoint
        seen = storage.checkpoints
        for _ in range(rng.randint(100, 600)):
            random_write(storage, rng)
            if storage.checkpoints != seen:       # what the disk holds for sure from here
                seen, flushed = storage.checkpoints, (live / "data.mdb").read_bytes()
        latest = (live / "data.mdb").read_bytes()
        expected = state(storage)
        copy_open(live, tmp_path / "lost")
    finally:
        storage.close()
    page = 4096
    mixed = bytearray(latest)
    for start in range(0, len(latest), page):
        if rng.random() < 0.5:     # this page's write never reached the disk
            old = flushed[start:start + page]
            mixed[start:start + page] = old + bytes(page - len(old))
    (tmp_path / "lost" / "data.mdb").write_bytes(bytes(mixed))
    with open(tmp_path / "lost" / "wal" / "log", "r+b") as log:    # a record torn as it was written
        log.seek(_log_end(tmp_path / "lost" / "wal" / "log"))
        log.write(os.urandom(rng.randint(1, 200)))
    reopened = open_storage(tmp_path / "lost")
    try:
        assert state(reopened) == expected, f"seed {seed}"
        random_write(reopened, rng)         # and it goes on writing
    finally:
        reopened.close()


def _log_end(path: Path) -> int:
    """Where the log's records end (the first zero length)."""
    import struct
    with open(path, "rb") as log:
        position = 0
        while True:
            log.seek(position)
            header = log.read(24)
            length = struct.unpack_from("<I", header)[0]
            if length == 0:
                return position
            position += 24 + length


def test_a_clean_close_leaves_nothing_to_replay_and_a_crash_after_reopening_still_recovers(tmp_path: Path) -> None:
    rng = random.Random(1)
    storage = open_storage(tmp_path / "db")
    for _ in range(100):
        random_write(storage, rng)
    storage.close()
    storage = open_storage(tmp_path / "db")
    assert storage.replayed == 0
    for _ in range(50):
        random_write(storage, rng)
    expected = state(storage)
    copy_open(tmp_path / "db", tmp_path / "killed")
    storage.close()
    reopened = open_storage(tmp_path / "killed")
    try:
        assert state(reopened) == expected
    finally:
        reopened.close()


def test_the_offline_migration_refuses_a_node_that_did_not_stop_cleanly(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "db")
    random_write(storage, random.Random(3))
    copy_open(tmp_path / "db", tmp_path / "killed")
    storage.close()
    with pytest.raises(StorageLayoutError, match="did not stop cleanly"):
        open_environment(str(tmp_path / "killed"), dry_run=True)
    env, _ = open_environment(str(tmp_path / "db"), dry_run=True)      # stopped cleanly: opens
    env.close()


def test_a_storage_from_before_the_log_opens_and_takes_its_first_checkpoint(tmp_path: Path) -> None:
    """In-place migration: a data directory written by a release without the log (every commit
    flushed) has no wal/; opening it starts one from a checkpoint of what LMDB holds."""
    storage = open_storage(tmp_path / "db")
    random_write(storage, random.Random(4))
    expected = state(storage)
    storage.close()
    shutil.rmtree(tmp_path / "db" / "wal")
    reopened = open_storage(tmp_path / "db")
    try:
        assert state(reopened) == expected and (tmp_path / "db" / "wal" / "log").exists()
    finally:
        reopened.close()


def test_what_a_checkpoint_held_is_reused_after_the_next(tmp_path: Path) -> None:
    """The checkpoint's snapshot keeps LMDB from reusing pages until the next checkpoint; the
    file stops growing once checkpoints come (a bounded overwrite load)."""
    storage = open_storage(tmp_path / "db")
    try:
        sizes = []
        for _ in range(6):
            for n in range(300):
                with storage.write_transaction() as txn:
                    txn.put(n.to_bytes(4, "big"), os.urandom(2000), db=storage.db["messages"])
            with storage._write_lock:
                storage._checkpoint(clean=False)
            sizes.append(storage.env.info()["last_pgno"])
        assert sizes[-1] <= sizes[2] * 1.2, sizes
    finally:
        storage.close()
