"""Where the audit's records come from.

A `--journals` path is one of: a directory of exported segments (searched recursively for
`*.parquet`), one `.parquet` file, a URI pyarrow.fs understands (hdfs://, s3://, ...), or a
node's LMDB environment (a directory with `data.mdb`, or a node data directory with
`lmdb/data.mdb`), which is exported into the output directory first, read-only.

The history file (`--history`) is JSON lines, one client-side enqueue outcome per line; the
format is in docs/AUDIT.md.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from audit.checks.history import HistoryEnqueue
from qserver.storage.journal_export import export_environment, filesystem_for
from replication.journal import RECORD_COLUMNS, JournalRecord

HISTORY_STRING_FIELDS = ("queue", "status", "dedupe_id", "client", "op")
HISTORY_INT_FIELDS = ("id", "payload_crc32", "at_ms")


def lmdb_environment(path: Path) -> Path | None:
    """The LMDB environment at or under `path` (a node data directory), if any."""
    for candidate in (path, path / "lmdb"):
        if (candidate / "data.mdb").is_file():
            return candidate
    return None


def resolve_journals(paths: Iterable[str], export_root: Path) -> list[str]:
    """Every input as a Parquet file or directory path (or URI), exporting LMDB environments
    into `export_root`; duplicates removed, order kept."""
    resolved: list[str] = []
    for raw in paths:
        if "://" not in raw:
            local = Path(raw)
            if not local.exists():
                raise FileNotFoundError(f"no such journal path: {raw}")
            environment = lmdb_environment(local)
            if environment is not None:
                target = export_root / f"env-{len(resolved)}"
                export_environment(environment, str(target))
                target.mkdir(parents=True, exist_ok=True)   # a node that journaled nothing: no files
                raw = str(target)
            else:
                raw = str(local.resolve())
        if raw not in resolved:
            resolved.append(raw)
    return resolved


def parquet_files(paths: Iterable[str]) -> list[tuple[pafs.FileSystem, str]]:
    """(filesystem, file) for every Parquet file under the inputs, sorted per input; names
    starting with "_" or "." are skipped (unfinished exports), as Spark skips them."""
    found: list[tuple[pafs.FileSystem, str]] = []
    for path in paths:
        filesystem, base = filesystem_for(path)
        info = filesystem.get_file_info(base)
        if info.type == pafs.FileType.File:
            found.append((filesystem, base))
            continue
        selector = pafs.FileSelector(base, recursive=True)
        files = sorted(item.path for item in filesystem.get_file_info(selector)
                       if item.type == pafs.FileType.File and item.base_name.endswith(".parquet")
                       and not any(part.startswith(("_", ".")) for part in item.path[len(base):].split("/")))
        found += [(filesystem, file) for file in files]
    return found


def read_records(paths: Iterable[str]) -> list[JournalRecord]:
    """Every journal record of the inputs (the pure-Python path)."""
    tables = [pq.read_table(file, filesystem=filesystem, columns=list(RECORD_COLUMNS))
              for filesystem, file in parquet_files(paths)]
    if not tables:
        return []
    return records_from_columns({name: column.to_pylist() for name, column in
                                 zip(RECORD_COLUMNS, pa.concat_tables(tables).columns, strict=True)})


def records_from_columns(columns: Mapping[str, list[Any]]) -> list[JournalRecord]:
    return list(map(JournalRecord._make, zip(*(columns[name] for name in RECORD_COLUMNS), strict=True)))


def read_history(path: str | Path) -> list[HistoryEnqueue]:
    """The enqueue outcomes of a history file (lines whose "op", if given, is not "enqueue"
    are other operations and skipped). A line that is not such an object raises ValueError."""
    return list(_history_entries(Path(path)))


def _history_entries(path: Path) -> Iterator[HistoryEnqueue]:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            fields = {name: _typed(item.get(name), name, path, number) for name in
                      (*HISTORY_STRING_FIELDS, *HISTORY_INT_FIELDS)}
            if fields["op"] not in (None, "enqueue"):
                continue
            yield HistoryEnqueue(fields["queue"] or "", fields["status"], fields["id"], fields["dedupe_id"],
                                 fields["payload_crc32"], fields["at_ms"], fields["client"])


def _typed(value: Any, name: str, path: Path, number: int) -> Any:
    if value is None:
        return None
    if name in HISTORY_INT_FIELDS:
        if type(value) is not int:
            raise ValueError(f"{path}:{number}: {name} must be an integer")
        return value
    if type(value) is int:
        return str(value)
    if type(value) is not str:
        raise ValueError(f"{path}:{number}: {name} must be a string")
    return value
