"""Backup and restore of one node's data directory (docs/OPERATIONS.md, "Backup and restore").

`take_backup` copies a node's directory while the node runs, from another process: LMDB lets a
second process open the environment and copy it under one read transaction (a consistent cut,
compacted), so the node's loop is never asked for anything. The cost to the node is disk
bandwidth and, while the copy's read transaction lasts, pages the node frees cannot be reused
(its map may grow a little). The rest of the directory is copied as files, and the manifest
(every file's size and sha256) is written last: a backup without a manifest is unfinished.

`restore_backup` puts a backup back as a data directory, and must keep the membership layer's
promises. The node's Raft state in the backup (its votes, the entries it acknowledged) is older
than what the node may have promised since: Raft's safety holds only if a member never forgets
these, so the restored directory is given what a node that lost its disk has (docs/RAFT.md,
"The node's side"; qserver/cluster/membership.py `_on_join`): its Raft state is dropped and it
takes a NEW storage id. On start it sends JoinRequest; the leader removes the member with the old
storage id and adds it again as a learner (promoted once caught up, from the leader's snapshot
of the map). The map's AddNode with the new storage id (replication/map_commands.py) records it
out of sync wherever it is a replica and lets an in-sync replica take over wherever it was the
master: it is never master of an epoch it missed, and its queues catch up from their masters
(log or state transfer). The new storage id also gives it a new journal id
(qserver/storage/journal_export.py), so journal sequences it writes again never collide with
ones already exported.

Not copied: the LMDB lock file, the node's process lock (qserver.lock), the replay window
(replay-window.json: an old window would accept replays of requests seen after the backup; without
it the node refuses every request signed before its start, as after a crash), and exported
journal files (journal-export/: they are archives the node only writes; a backup of them is the
archive's own business, and they can be large)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from qserver.storage.rows import DB_NAMES, SCHEMA_VERSION
from replication.messages import MessageError
from replication.raft_codec import decode_hard_state, decode_snapshot
from wire.versions import RELEASE

MANIFEST = "manifest.json"
FORMAT = 1
DATA = "data"                       # the data directory's copy, under the backup directory
CONFIG = "node.toml"                # the node's config file, when one was named
SKIPPED = frozenset({"qserver.lock", "replay-window.json", "journal-export"})
_Q = struct.Struct(">Q")
_CHUNK = 1 << 20


class BackupError(Exception):
    """A backup or restore refused (nothing was changed). `code`: a wire/errors.py code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class RestoreReport:
    data_dir: str
    node_id: str
    old_storage_id: int
    new_storage_id: int
    moved_aside: str | None
    storage_layout: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def take_backup(data_dir: Path, to: Path, config_file: Path | None = None) -> dict[str, Any]:
    """Copy the (running or stopped) node's `data_dir` into the new or empty directory `to`;
    returns the manifest. Raises BackupError (E_INVALID_OPTION) when `to` holds anything or
    `data_dir` is not a node's."""
    source = data_dir / "lmdb"
    if not (source / "data.mdb").is_file():
        raise BackupError("E_INVALID_OPTION", f"{data_dir} is not a node's data directory (no lmdb/data.mdb)")
    if to.resolve().is_relative_to(data_dir.resolve()):
        raise BackupError("E_INVALID_OPTION", f"{to} is inside the data directory {data_dir}: back up elsewhere")
    if to.exists() and not _is_empty_dir(to):
        raise BackupError("E_INVALID_OPTION", f"{to} is not empty: a backup goes to a new or empty directory")
    started = time.time()
    (to / DATA / "lmdb").mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(to, 0o700)             # it holds the cluster secret (docs/OPERATIONS.md)
    _copy_environment(source, to / DATA / "lmdb")
    for path in sorted(data_dir.rglob("*")):
        relative = path.relative_to(data_dir)
        if relative.parts[0] in SKIPPED or relative.parts[0] == "lmdb" or not path.is_file():
            continue
        target = to / DATA / relative
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.copy2(path, target)
    if config_file is not None:
        shutil.copy2(config_file, to / CONFIG)
    facts = read_facts(to / DATA / "lmdb")
    files = {}
    for path in sorted(p for p in to.rglob("*") if p.is_file()):
        files[path.relative_to(to).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    manifest = {"format": FORMAT, "release": RELEASE, "created_ms": int(started * 1000),
                "seconds": round(time.time() - started, 3), "source": str(data_dir.resolve()), **facts,
                "files": files}
    partial = to / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with open(partial, "rb") as handle:
        os.fsync(handle.fileno())
    partial.rename(to / MANIFEST)        # last: a backup without a manifest is unfinished
    return manifest


def _copy_environment(source: Path, target: Path) -> None:
    """One consistent, compacted copy (LMDB's mdb_env_copy2 with MDB_CP_COMPACT, under one read
    transaction), from this process: the node's own process is not involved."""
    for _ in range(8):
        env = lmdb.open(str(source), readonly=True, lock=True, max_dbs=len(DB_NAMES) + 2, create=False,
                        readahead=False, map_size=0)
        try:
            env.copy(str(target), compact=True)
            return
        except lmdb.MapResizedError:     # the node grew its map meanwhile: open again at the new size
            for name in os.listdir(target):
                os.unlink(target / name)
        finally:
            env.close()
    raise BackupError("E_UNAVAILABLE", f"{source}: the node kept growing its map during the copy; try again")


def read_facts(lmdb_dir: Path) -> dict[str, Any]:
    """What the manifest says of a copied environment: node, storage id, layout, Raft position."""
    env = lmdb.open(str(lmdb_dir), readonly=True, lock=False, max_dbs=len(DB_NAMES) + 2, create=False)
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            layout = txn.get(b"schema_version", db=meta)
            storage_id = txn.get(b"storage_id", db=meta)
            node_id = txn.get(b"node_id", db=meta)
            release = txn.get(b"release", db=meta)
            raft: dict[str, Any] = {}
            try:
                state = env.open_db(b"raft_state", txn=txn, create=False)
                hard, snapshot = txn.get(b"hard", db=state), txn.get(b"snapshot", db=state)
                if hard is not None:
                    decoded = decode_hard_state(hard)
                    raft["term"], raft["commit_index"] = decoded.term, decoded.commit
                if snapshot is not None:
                    raft["snapshot_index"] = decode_snapshot(snapshot).index
            except (lmdb.NotFoundError, MessageError):
                pass                     # no Raft state (a single node), or one we cannot read: not needed
    finally:
        env.close()
    return {"storage_layout": _Q.unpack(layout)[0] if layout else None,
            "storage_id": _Q.unpack(storage_id)[0] if storage_id else None,
            "node_id": node_id.decode() if node_id else None,
            "written_by": release.decode() if release else None, "raft": raft}


def verify(backup: Path) -> dict[str, Any]:
    """The manifest of a complete, untouched backup; BackupError (E_INVALID_OPTION) otherwise:
    no manifest, a file missing, changed or added."""
    try:
        manifest = json.loads((backup / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise BackupError("E_INVALID_OPTION", f"{backup} holds no readable {MANIFEST} (an unfinished backup?): {error}") from None
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    present = {p.relative_to(backup).as_posix() for p in backup.rglob("*") if p.is_file()} - {MANIFEST}
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        raise BackupError("E_INVALID_OPTION", f"{backup} does not match its manifest: missing {missing}, not listed {extra}")
    for name, facts in sorted(files.items()):
        path = backup / name
        if path.stat().st_size != facts["size"] or sha256_of(path) != facts["sha256"]:
            raise BackupError("E_INVALID_OPTION", f"{backup}/{name}: its size or sha256 is not the manifest's")
    return dict(manifest)


def restore_backup(backup: Path, data_dir: Path, *, node_id: str | None = None, force: bool = False) -> RestoreReport:
    """Put `backup` back as `data_dir`, with a new storage id and no Raft state (see the module's
    docstring). Refuses (BackupError, nothing changed): a backup that does not verify, one of a
    newer storage layout than this release reads (E_VERSION_MISMATCH), one of another node than
    `node_id`, a `data_dir` that holds anything unless `force` (which moves it aside, to a sibling
    named .replaced-<time>; it is never deleted). The caller holds the node's lock on `data_dir`."""
    manifest = verify(backup)
    layout = manifest.get("storage_layout")
    if not isinstance(layout, int) or layout > SCHEMA_VERSION:
        raise BackupError("E_VERSION_MISMATCH", f"the backup holds storage layout {layout}; this release "
                                                f"(qserver {RELEASE}) reads layouts up to {SCHEMA_VERSION}")
    if layout < 5:
        raise BackupError("E_VERSION_MISMATCH", f"the backup holds storage layout {layout}, older than the "
                                                "membership layer's Raft rows (layout 5): restore it with its own release")
    if node_id is not None and manifest.get("node_id") not in (None, node_id):
        raise BackupError("E_INVALID_OPTION", f"the backup is of node {manifest.get('node_id')}, not {node_id}")
    holds_data = data_dir.exists() and not _is_empty_dir(data_dir) \
        and any(p.name != "qserver.lock" for p in data_dir.iterdir())
    if holds_data and not force:
        raise BackupError("E_INVALID_OPTION", f"{data_dir} holds data: restore into a new or empty directory, "
                                              "or with --force (the old directory is moved aside, not deleted)")
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    staging = data_dir.with_name(f"{data_dir.name}.restoring-{stamp}")
    shutil.copytree(backup / DATA, staging)
    os.chmod(staging, 0o700)
    old_id, new_id = _forget_promises(staging / "lmdb")
    moved = None
    if holds_data:
        moved = data_dir.with_name(f"{data_dir.name}.replaced-{stamp}")
        data_dir.rename(moved)
    elif data_dir.exists():
        shutil.rmtree(data_dir)          # empty, or only the process lock file
    staging.rename(data_dir)
    return RestoreReport(str(data_dir), str(manifest.get("node_id")), old_id, new_id,
                         None if moved is None else str(moved), layout)


def _forget_promises(lmdb_dir: Path) -> tuple[int, int]:
    """Drop the Raft state and take a new storage id, in one transaction: the restored node
    rejoins as a node that lost its disk (never with promises it no longer remembers)."""
    size = (lmdb_dir / "data.mdb").stat().st_size
    env = lmdb.open(str(lmdb_dir), map_size=max(1 << 30, size + (64 << 20)), max_dbs=len(DB_NAMES) + 2,
                    create=False, sync=True, metasync=True)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            old = txn.get(b"storage_id", db=meta)
            old_id = _Q.unpack(old)[0] if old else 0
            new_id = old_id
            while new_id in (old_id, 0):
                new_id = int.from_bytes(os.urandom(8), "big") >> 1
            txn.put(b"storage_id", _Q.pack(new_id), db=meta)
            for name in (b"raft_state", b"raft_log"):
                txn.drop(env.open_db(name, txn=txn, create=True), delete=False)
        env.sync(True)
    finally:
        env.close()
    return old_id, new_id
