"""The write-ahead log: what makes a node's write durable (docs/ARCHITECTURE.md, "Durability").

LMDB commits a write transaction without flushing it: its pages reach the page cache, readers
see them at once, and a commit costs ~15 µs instead of ~350 µs (two fsyncs of pages scattered
over six B-trees; bench/RESULTS.md, "The write-ahead log"). What makes the transaction durable
is its record here: every put and delete it made (`RecordingTransaction`), appended to one
preallocated file and flushed with one `fdatasync` (~100 µs on this machine's disk).

A *checkpoint* (`Storage.checkpoint`) flushes LMDB, copies its two meta pages (which name the
root of every tree as of that transaction) into a checkpoint slot, and starts the log over at
its beginning under a new generation. Until the next checkpoint a read transaction stays open on
the checkpoint's snapshot, so LMDB reuses none of its pages: whatever the disk kept of the
writes after it, the tree that the saved meta pages name is whole.

Opening a data directory after any stop but a clean one (kill -9, a machine that lost power,
a failed open): the saved meta pages are written back, which returns LMDB exactly to the
checkpoint, and the log's records of that generation are applied again in order, each in a
transaction of its own. What comes back is every write whose record was flushed: each one a
member answered or acknowledged, and perhaps a few after it that nobody was answered about yet.

Files, in `<data>/wal/`: `log` (records, preallocated and written over from the start after each
checkpoint) and `checkpoint-0`/`checkpoint-1` (generation g goes to slot g % 2, so a torn slot
write leaves the one before it, whose log is still whole: the log starts over only after the new
slot is flushed). A record: length, CRC-32, generation, sequence, then its writes (msgpack).
Reading stops at the first record that is torn, of another generation or out of sequence: the
log's tail beyond the last flushed record is whatever an earlier generation left there.
"""
from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import msgpack

LOG_BYTES = 32 << 20            # preallocated: an overwrite flushes no file-size metadata
CHECKPOINT_LOG_BYTES = 8 << 20  # a checkpoint when the log passes this (the file keeps room for a large write)
CHECKPOINT_S = 0.25             # ... or this long after the last one (what LMDB cannot reuse meanwhile)
FORMAT = 1

_HEADER = struct.Struct("<IIQQ")        # length of the writes, CRC-32 of the rest, generation, sequence
_SLOT = struct.Struct("<II")            # length, CRC-32 of the body


class WalError(Exception):
    """The log or its checkpoint cannot be used as found (the node refuses to open)."""


@dataclass(frozen=True)
class Checkpoint:
    generation: int
    sequence: int               # the last write transaction LMDB holds as of the checkpoint
    meta_pages: bytes           # data.mdb's first two pages, as flushed at the checkpoint
    clean: bool                 # taken at a clean close: LMDB holds everything, nothing to replay

    def encode(self) -> bytes:
        body = msgpack.packb([FORMAT, self.generation, self.sequence, self.meta_pages, self.clean],
                             use_bin_type=True)
        return _SLOT.pack(len(body), zlib.crc32(body)) + body

    @classmethod
    def decode(cls, raw: bytes) -> Checkpoint | None:
        if len(raw) < _SLOT.size:
            return None
        length, crc = _SLOT.unpack_from(raw)
        body = raw[_SLOT.size:_SLOT.size + length]
        if length == 0 or len(body) != length or zlib.crc32(body) != crc:
            return None
        fields = msgpack.unpackb(body)
        if fields[0] != FORMAT:
            raise WalError(f"checkpoint format {fields[0]} is not {FORMAT} (written by another release)")
        return cls(int(fields[1]), int(fields[2]), bytes(fields[3]), bool(fields[4]))


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def stopped_cleanly(directory: Path) -> bool:
    """Whether the node whose log this is has nothing to replay (or never had a log): a tool that
    writes to LMDB itself must not run before the node replayed it."""
    found = []
    for slot in (0, 1):
        path = directory / f"checkpoint-{slot}"
        if path.exists():
            with open(path, "rb") as handle:
                found.append(Checkpoint.decode(handle.read(1 << 20)))
    whole = [checkpoint for checkpoint in found if checkpoint is not None]
    return not whole or max(whole, key=lambda checkpoint: checkpoint.generation).clean


class WriteAheadLog:
    """The files of `<data>/wal/`. Used under Storage's write lock only."""

    def __init__(self, directory: Path, *, log_bytes: int = LOG_BYTES) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, exist_ok=True)
        self._log_bytes = log_bytes
        fresh = not (directory / "log").exists()
        self._log = os.open(directory / "log", os.O_RDWR | os.O_CREAT, 0o600)
        if fresh or os.fstat(self._log).st_size < log_bytes:
            # Written with zeros, not fallocated: a later overwrite then changes no extent and
            # fdatasync flushes the data alone (101 µs against 107 µs fallocated and 154 µs appended).
            os.pwrite(self._log, b"\0" * (log_bytes - os.fstat(self._log).st_size), os.fstat(self._log).st_size)
            os.fsync(self._log)
            _fsync_directory(directory)
        self._slots = [os.open(directory / f"checkpoint-{slot}", os.O_RDWR | os.O_CREAT, 0o600) for slot in (0, 1)]
        if fresh:
            _fsync_directory(directory)
        self.generation = 0
        self.position = 0           # where the next record goes
        self.sequence = 0           # the last write transaction recorded or checkpointed

    def close(self) -> None:
        for descriptor in (self._log, *self._slots):
            os.close(descriptor)

    # --- checkpoints ------------------------------------------------------------------------
    def last_checkpoint(self) -> Checkpoint | None:
        """The newest whole checkpoint slot (None: this directory never had one)."""
        found = [Checkpoint.decode(os.pread(slot, 1 << 20, 0)) for slot in self._slots]
        whole = [checkpoint for checkpoint in found if checkpoint is not None]
        return max(whole, key=lambda checkpoint: checkpoint.generation) if whole else None

    def save_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Flush the slot, then start the log over under the checkpoint's generation."""
        slot = self._slots[checkpoint.generation % 2]
        raw = checkpoint.encode()
        os.pwrite(slot, raw + b"\0" * 8, 0)
        os.fdatasync(slot)
        self.generation, self.sequence, self.position = checkpoint.generation, checkpoint.sequence, 0

    # --- records ----------------------------------------------------------------------------
    def fits(self, size: int) -> bool:
        return self.position + _HEADER.size + size <= self._log_bytes

    def append(self, writes: bytes) -> int:
        """Write the next record (the caller checked `fits`) and flush it. Returns its sequence."""
        sequence = self.sequence + 1
        rest = struct.pack("<QQ", self.generation, sequence) + writes
        os.pwrite(self._log, struct.pack("<II", len(writes), zlib.crc32(rest)) + rest, self.position)
        os.fdatasync(self._log)
        self.position += _HEADER.size + len(writes)
        self.sequence = sequence
        return sequence

    def records(self, checkpoint: Checkpoint) -> Iterator[tuple[int, bytes]]:
        """The flushed records written after `checkpoint`, in order (sequence, writes)."""
        position, expected = 0, checkpoint.sequence + 1
        size = os.fstat(self._log).st_size
        while position + _HEADER.size <= size:
            length, crc, generation, sequence = _HEADER.unpack(os.pread(self._log, _HEADER.size, position))
            if generation != checkpoint.generation or sequence != expected or \
                    position + _HEADER.size + length > size:
                return
            writes = os.pread(self._log, length, position + _HEADER.size)
            if zlib.crc32(struct.pack("<QQ", generation, sequence) + writes) != crc:
                return
            yield sequence, writes
            position += _HEADER.size + length
            expected += 1

    @property
    def used_bytes(self) -> int:
        return self.position


# --- what a write transaction did ----------------------------------------------------------
# One entry per change, in the order made: (database number, key, value), value None for a
# delete; (database number, None, None) empties the database (txn.drop(db, delete=False)).

class RecordingTransaction:
    """An LMDB write transaction that notes each change it makes, for the log. Reads pass
    through; `default` is the database of `begin(db=...)`."""

    def __init__(self, txn: lmdb.Transaction, numbers: dict[Any, int], default: Any) -> None:
        self._txn, self._numbers, self._default = txn, numbers, default
        self.writes: list[tuple[int, bytes | None, bytes | None]] = []

    def _number(self, db: Any) -> int:
        return self._numbers[db if db is not None else self._default]

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        return self._txn.get(key, default, db=db if db is not None else self._default)

    def put(self, key: bytes, value: bytes, dupdata: bool = True, overwrite: bool = True, append: bool = False,
            db: Any = None) -> bool:
        stored = self._txn.put(key, value, dupdata=dupdata, overwrite=overwrite, append=append,
                               db=db if db is not None else self._default)
        if stored:
            self.writes.append((self._number(db), bytes(key), bytes(value)))
        return bool(stored)

    def replace(self, key: bytes, value: bytes, db: Any = None) -> Any:
        old = self._txn.replace(key, value, db=db if db is not None else self._default)
        self.writes.append((self._number(db), bytes(key), bytes(value)))
        return old

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        removed = self._txn.delete(key, value, db=db if db is not None else self._default)
        if removed:
            self.writes.append((self._number(db), bytes(key), None))
        return bool(removed)

    def pop(self, key: bytes, db: Any = None) -> Any:
        value = self._txn.pop(key, db=db if db is not None else self._default)
        if value is not None:
            self.writes.append((self._number(db), bytes(key), None))
        return value

    def drop(self, db: Any, delete: bool = True) -> None:
        if delete:
            raise WalError("a database is never deleted while the node runs")
        self._txn.drop(db, delete=False)
        self.writes.append((self._number(db), None, None))

    def cursor(self, db: Any = None) -> RecordingCursor:
        target = db if db is not None else self._default
        return RecordingCursor(self._txn.cursor(db=target), self._number(target), self.writes)

    def stat(self, db: Any) -> Any:
        return self._txn.stat(db)


class RecordingCursor:
    """A cursor of a `RecordingTransaction`: moves and reads pass through, changes are noted."""

    def __init__(self, cursor: lmdb.Cursor, number: int, writes: list[tuple[int, bytes | None, bytes | None]]) -> None:
        self._cursor, self._number, self._writes = cursor, number, writes

    def __getattr__(self, name: str) -> Any:          # first, last, set_range, key, value, next, ...
        return getattr(self._cursor, name)

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self._cursor)  # type: ignore[arg-type]

    def put(self, key: bytes, value: bytes, dupdata: bool = True, overwrite: bool = True, append: bool = False) -> bool:
        stored = self._cursor.put(key, value, dupdata=dupdata, overwrite=overwrite, append=append)
        if stored:
            self._writes.append((self._number, bytes(key), bytes(value)))
        return bool(stored)

    def putmulti(self, items: Any, dupdata: bool = True, overwrite: bool = True, append: bool = False) -> tuple[int, int]:
        if not overwrite:
            raise WalError("putmulti without overwrite cannot say which items it stored")
        items = [(bytes(key), bytes(value)) for key, value in items]
        result = self._cursor.putmulti(items, dupdata=dupdata, overwrite=True, append=append)
        self._writes.extend((self._number, key, value) for key, value in items)
        return result  # type: ignore[no-any-return]

    def replace(self, key: bytes, value: bytes) -> Any:
        old = self._cursor.replace(key, value)
        self._writes.append((self._number, bytes(key), bytes(value)))
        return old

    def delete(self, dupdata: bool = False) -> bool:
        key = bytes(self._cursor.key())
        removed = self._cursor.delete(dupdata=dupdata)
        if removed:
            self._writes.append((self._number, key, None))
        return bool(removed)

    def pop(self, key: bytes) -> Any:
        value = self._cursor.pop(key)
        if value is not None:
            self._writes.append((self._number, bytes(key), None))
        return value


def encode_writes(writes: list[tuple[int, bytes | None, bytes | None]]) -> bytes:
    return msgpack.packb(writes, use_bin_type=True)  # type: ignore[no-any-return]


def apply_writes(txn: lmdb.Transaction, databases: list[Any], raw: bytes) -> None:
    """Make a record's changes again, in their order (opening after a crash)."""
    for number, key, value in msgpack.unpackb(raw):
        db = databases[number]
        if key is None:
            txn.drop(db, delete=False)
        elif value is None:
            txn.delete(key, db=db)
        else:
            txn.put(key, value, db=db)
