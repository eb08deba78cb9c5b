"""Room in a node's LMDB environment: what is left on its disk and in its map, how far the map
may grow, and the two refusals a write meets when there is none (`MapGrowthNeeded`,
`StorageFull`).

Separate from the store because these are questions about the file and its disk, not about
rows: the engine (and the membership layer's Raft store) act on the answers without reading
any record, and `database_usage` reads a running node's environment from beside it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from qserver.storage.rows import DB_NAMES

# A write LMDB could not make while its disk held less than this was refused for lack of space
# (a short write past the disk's end comes back as EIO, not ENOSPC).
DISK_FULL_FREE_BYTES = 1 << 20
MAP_GRANULE_BYTES = 64 << 10                 # the map grows by whole multiples of this (of the OS page)


class StorageFull(Exception):
    """No room: the map is at its configured maximum (`map_limit`), or the disk is full or
    would leave less than its reserve free. Nothing of the transaction was stored."""

    def __init__(self, message: str, *, map_limit: bool = False) -> None:
        super().__init__(message)
        self.map_limit = map_limit


class MapGrowthNeeded(Exception):
    """The write transaction hit the map's end; the loop thread grows the map and retries."""


@dataclass(frozen=True, slots=True)
class StorageSpace:
    """What the environment may still take: on its disk (free there, plus the pages its file
    holds that no database uses any more, which LMDB reuses first), and in its map (up to
    map_size_max_bytes)."""
    disk_free_bytes: int
    map_free_bytes: int
    used_bytes: int = 0        # the pages the databases use (what the node stores, in LMDB's pages)


def measure_space(env: lmdb.Environment, dbs: list[Any], path: Path, map_size_max_bytes: int) -> StorageSpace | None:
    """What is left (a few stat calls); None when it cannot be read."""
    try:
        with env.begin() as txn:
            stats = [env.stat(), *(txn.stat(db) for db in dbs)]
        file_bytes = os.path.getsize(path / "data.mdb")
        disk_free = shutil.disk_usage(path).free
    except (OSError, lmdb.Error):
        return None
    used = (2 + sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)) * stats[0]["psize"]
    return StorageSpace(disk_free + max(0, file_bytes - used), max(0, map_size_max_bytes - used), used)


def disk_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < DISK_FULL_FREE_BYTES
    except OSError:
        return False


def grown_map_size(current: int, map_size_max_bytes: int, path: Path, disk_reserve_bytes: int) -> int:
    """The map's next size: double, or as far as the disk allows beside its reserve. Raises
    StorageFull when it cannot grow at all."""
    if current >= map_size_max_bytes:
        raise StorageFull(f"the storage map is full at its limit of {map_size_max_bytes} bytes", map_limit=True)
    free = shutil.disk_usage(path).free
    used = os.path.getsize(path / "data.mdb")
    # The map is sparse, but keeping it within the disk keeps a disk-full error out of LMDB's fsync.
    target = min(current * 2, map_size_max_bytes, used + free - disk_reserve_bytes)
    if target < map_size_max_bytes:
        target -= target % MAP_GRANULE_BYTES
    if target <= current:
        raise StorageFull(f"the storage map at {current} bytes cannot grow: {free} bytes free on its disk, "
                          f"{disk_reserve_bytes} kept in reserve")
    return target


def database_usage(path: str | Path) -> dict[str, dict[str, int]]:
    """Entries and used pages of every database of a node's LMDB, opened read-only beside a
    running node (`_main`: the catalog of named databases). Pages on LMDB's free list are
    reused by later writes and are not counted; the file's size is a high-water mark."""
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=len(DB_NAMES) + 2)
    try:
        with env.begin() as txn:
            stats = {"_main": txn.stat(env.open_db(None, txn=txn))}  # type: ignore[arg-type]
            for name in DB_NAMES:
                stats[name] = txn.stat(env.open_db(name.encode(), txn=txn, create=False))
        return {name: {"entries": stat["entries"], "pages": stat["branch_pages"] + stat["leaf_pages"]
                       + stat["overflow_pages"], "page_bytes": stat["psize"]} for name, stat in stats.items()}
    finally:
        env.close()
