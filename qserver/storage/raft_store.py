"""The membership layer's durable state, in the node's own LMDB environment (issue 12, item 2).

Two named databases of the environment `qserver/storage/lmdb_store.py` opens (it lists them in
DB_NAMES; this module only reads and writes them):

    raft_state  b"hard"      -> hard state [term, vote, commit]   (replication/raft_codec.py)
                b"snapshot"  -> snapshot [index, term, configuration, cluster map]
    raft_log    index:8      -> entry [index, term, kind, command, configuration]

`MemoryRaftStore` is the in-memory twin (the engine simulation's nodes keep it across their
crashes, as a disk would); tests/test_membership_layer.py runs one contract against both.

`persist` writes everything one `Ready` asks for in ONE transaction, fsync'd before it returns
(the environment syncs every commit), so a crash leaves either all of it or none: a
truncation is never on disk without the entries that replace it, a snapshot never without
the log compacted below it. It runs on the node's writer thread, behind at most the queue
commit in flight, never on the event loop. A full map or disk refuses the whole transaction:
the membership layer tries the same Ready again once there is room (qserver/cluster/membership.py).
"""
from __future__ import annotations

import struct
from typing import Protocol

import lmdb

from qserver.storage.lmdb_store import Storage
from replication.raft import PersistedState, Ready, bootstrap_state, empty_state
from replication.raft_codec import (
    decode_entry,
    decode_hard_state,
    decode_snapshot,
    encode_entry,
    encode_hard_state,
    encode_snapshot,
)
from replication.raft_messages import Configuration, Member

_INDEX = struct.Struct(">Q")
_HARD = b"hard"
_SNAPSHOT = b"snapshot"


def storage_id_bytes(storage_id: int) -> bytes:
    """A disk's identity as the Raft configuration names it."""
    return _INDEX.pack(storage_id)


class RaftStorage(Protocol):
    def load(self) -> PersistedState: ...
    def is_empty(self) -> bool: ...
    def bootstrap(self, node_id: str, storage_id: int) -> None: ...
    def persist(self, ready: Ready) -> None: ...


def _founding_state(node_id: str, storage_id: int) -> PersistedState:
    return bootstrap_state(Configuration(frozenset({Member(node_id, storage_id_bytes(storage_id))})))


class RaftStore:
    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._env = storage.env
        self._state = storage.db["raft_state"]
        self._log = storage.db["raft_log"]

    def load(self) -> PersistedState:
        """What this disk holds (an empty state for a node that never took part)."""
        with self._env.begin() as txn:
            hard = txn.get(_HARD, db=self._state)
            snapshot = txn.get(_SNAPSHOT, db=self._state)
            entries = tuple(decode_entry(value) for _, value in txn.cursor(db=self._log))
        empty = empty_state()
        return PersistedState(decode_hard_state(hard) if hard is not None else empty.hard_state,
                              decode_snapshot(snapshot) if snapshot is not None else empty.snapshot, entries)

    def is_empty(self) -> bool:
        with self._env.begin() as txn:
            return txn.get(_HARD, db=self._state) is None and txn.cursor(db=self._log).first() is False

    def bootstrap(self, node_id: str, storage_id: int) -> None:
        """The founding node of a cluster (`qserver init` without --join): the first
        configuration is this node alone, as a voter; the others join it."""
        if not self.is_empty():
            raise RuntimeError("this node already holds membership state")
        state = _founding_state(node_id, storage_id)
        with self._env.begin(write=True) as txn:
            txn.put(_HARD, encode_hard_state(state.hard_state), db=self._state)
            for entry in state.entries:
                txn.put(_INDEX.pack(entry.index), encode_entry(entry), db=self._log)

    def persist(self, ready: Ready) -> None:
        """Writer thread: what `ready` says must be durable before its messages are sent.
        Raises MapGrowthNeeded or StorageFull (qserver/storage/lmdb_store.py) when there is no room:
        nothing was written, and the same Ready may be persisted again."""
        with self._storage.space_errors(), self._env.begin(write=True) as txn:
            if ready.install_snapshot is not None:
                txn.drop(self._log, delete=False)
                txn.put(_SNAPSHOT, encode_snapshot(ready.install_snapshot), db=self._state)
            if ready.compaction is not None:
                txn.put(_SNAPSHOT, encode_snapshot(ready.compaction), db=self._state)
                self._delete_from(txn, 0, ready.compaction.index)
            if ready.truncate_from is not None:
                self._delete_from(txn, ready.truncate_from, None)
            if ready.entries:
                txn.cursor(db=self._log).putmulti(
                    [(_INDEX.pack(entry.index), encode_entry(entry)) for entry in ready.entries])
            if ready.hard_state is not None:
                txn.put(_HARD, encode_hard_state(ready.hard_state), db=self._state)

    def _delete_from(self, txn: lmdb.Transaction, first: int, last: int | None) -> None:
        """Delete the entries first..last (inclusive; None: to the end). Bounded by the log
        itself: the core compacts every few hundred entries and truncates only a suffix."""
        cursor = txn.cursor(db=self._log)
        if not cursor.set_range(_INDEX.pack(first)):
            return
        while cursor.key() and (last is None or _INDEX.unpack(cursor.key())[0] <= last):
            cursor.delete()


class MemoryRaftStore:
    """The twin: the same state in memory, replaced as a whole by each `persist` (atomic)."""

    def __init__(self) -> None:
        self._state = empty_state()

    def load(self) -> PersistedState:
        return self._state

    def is_empty(self) -> bool:
        return self._state == empty_state()

    def bootstrap(self, node_id: str, storage_id: int) -> None:
        if not self.is_empty():
            raise RuntimeError("this node already holds membership state")
        self._state = _founding_state(node_id, storage_id)

    def persist(self, ready: Ready) -> None:
        state = self._state
        snapshot, entries = state.snapshot, list(state.entries)
        if ready.install_snapshot is not None:
            snapshot, entries = ready.install_snapshot, []
        if ready.compaction is not None:
            snapshot = ready.compaction
            entries = [entry for entry in entries if entry.index > snapshot.index]
        if ready.truncate_from is not None:
            entries = [entry for entry in entries if entry.index < ready.truncate_from]
        entries.extend(ready.entries)
        self._state = PersistedState(ready.hard_state or state.hard_state, snapshot, tuple(entries))
