"""The membership layer behind one narrow interface: pysyncobj (Raft) for real nodes, an
in-memory twin for the simulations (DESIGN.md 4.2).

    membership.cluster_map           the local copy of the replicated map (read on the loop)
    membership.propose(cmd, done)    done(outcomes) on the loop once applied, done(None) when
                                     it could not be (no leader within the timeout, ...)
    membership.on_applied            called on the loop after every command applied locally
    membership.is_leader() / leader_id() / term()

Raft words (leader, term, log) stay inside this module; nothing outside derives queue
mastership from them: masters come from the map, which only compare-and-set commands change.

pysyncobj runs its own thread. Commands reach it as msgpack bytes (it pickles only those);
its state machine applies each one to its copy of the map and hands the same bytes to the
event loop (`call_soon_threadsafe`, in order), where `cluster_map` applies them again. So the
loop never reads an object the Raft thread writes.

Durability: pysyncobj writes its journal through mmap without fsync. `DurableFileJournal`
syncs the journal after every append or truncation and the term/vote file on every change,
so a vote or an entry is on disk before any message that depends on it is sent.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pysyncobj.syncobj as _syncobj_module
from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.journal import FileJournal, MemoryJournal
from pysyncobj.monotonic import monotonic as _raft_monotonic
from pysyncobj.node import Node, TCPNode

from replication.cluster_map import ClusterMap, Command, Outcome, decode_command, encode_command

log = logging.getLogger("qserver.membership")

Done = Callable[[list[Outcome] | None], None]
OnApplied = Callable[[Command, list[Outcome]], None]
PROPOSAL_TIMEOUT_S = 5.0


class Membership(Protocol):
    cluster_map: ClusterMap
    on_applied: OnApplied

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def propose(self, command: Command, done: Done) -> None: ...
    def is_leader(self) -> bool: ...
    def leader_id(self) -> str | None: ...
    def term(self) -> int: ...


def _ignore_applied(command: Command, outcomes: list[Outcome]) -> None:
    pass


# --- pysyncobj ---------------------------------------------------------------------------------
# Logical id -> (host, port) this process dials for it. A node's identity is its id, never the
# address a peer reached it at, so a proxy can sit on every membership link (DESIGN.md 4.7).
DIAL_ADDRESSES: dict[str, tuple[str, int]] = {}


class MembershipNode(TCPNode):
    """A pysyncobj TCP node whose id (and announced `address`) is the logical node id; host
    and port come from this process's dial table. Pickled between nodes, so it must stay
    importable under this module path on every node."""

    def __init__(self, node_id: str, **kwargs: Any) -> None:
        Node.__init__(self, node_id, **kwargs)

    @property
    def address(self) -> str:
        return str(self.id)

    @property
    def host(self) -> str:
        return DIAL_ADDRESSES[self.id][0]

    @property
    def port(self) -> int:
        return DIAL_ADDRESSES[self.id][1]

    @property
    def ip(self) -> str:
        return DIAL_ADDRESSES[self.id][0]

    def __repr__(self) -> str:
        return f"MembershipNode({self.id!r})"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableFileJournal(FileJournal):
    """pysyncobj's file journal, synced to disk on every change (it only msyncs on close)."""

    def __init__(self, journal_file: str) -> None:
        super().__init__(journal_file)
        self._path = journal_file

    def _sync(self) -> None:
        self.flush()                       # msync(MS_SYNC) of the mapped pages
        _fsync_path(self._path)            # and the file's size and metadata

    def add(self, command: bytes, idx: int, term: int) -> None:
        super().add(command, idx, term)
        self._sync()

    def clear(self) -> None:
        super().clear()
        self._sync()

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802,N803 (pysyncobj's names)
        super().deleteEntriesFrom(entryFrom)
        self._sync()

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802,N803
        super().deleteEntriesTo(entryTo)
        self._sync()

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802,N803
        super().setCurrentTerm(term, votedForNodeId)     # written to a temp file, renamed
        meta = self._path + ".meta"
        _fsync_path(meta)
        _fsync_path(os.path.dirname(os.path.abspath(meta)))


def _create_journal(journal_file: str | None = None) -> Any:
    return MemoryJournal() if journal_file is None else DurableFileJournal(journal_file)


# pysyncobj builds its journal through this module-level factory; a node runs one SyncObj.
_syncobj_module.createJournal = _create_journal   # type: ignore[attr-defined]


class _MapMachine(SyncObjConsumer):
    """The replicated state: the cluster map (pysyncobj serialises what is set after
    SyncObjConsumer.__init__ for its snapshots)."""

    def __init__(self, deliver: Callable[[bytes], None], deliver_snapshot: Callable[[ClusterMap], None]) -> None:
        self._deliver = deliver
        self._deliver_snapshot = deliver_snapshot
        super().__init__()
        self.cluster_map = ClusterMap()

    @replicated
    def apply_command(self, data: bytes) -> list[tuple[str, bool, str]]:
        try:
            command = decode_command(data)
        except ValueError:
            return []
        outcomes = self.cluster_map.apply(command)
        self._deliver(data)
        return [(o.name, o.applied, o.reason) for o in outcomes]

    def _deserialize(self, data: dict[str, Any]) -> None:
        super()._deserialize(data)
        self._deliver_snapshot(self.cluster_map.copy())


class RaftMembership:
    """pysyncobj with a durable journal and a full-dump file beside it, logical node ids and
    the cluster password (its messages are pickled: never run it without one)."""

    def __init__(self, node_id: str, voters: dict[str, str], directory: Path, password: str, *,
                 loop: asyncio.AbstractEventLoop, election_timeout_s: tuple[float, float] = (0.5, 1.0),
                 heartbeat_s: float = 0.1, leader_fallback_s: float = 1.0, connection_timeout_s: float = 1.5,
                 connection_retry_s: float = 0.5) -> None:
        if not password:
            raise ValueError("the membership layer needs the cluster password (its messages are pickled)")
        # A node that is not one of the (3 or 5) voters follows the map without voting: a
        # pysyncobj read-only node, which dials every voter and passes its proposals on.
        self.voter = node_id in voters
        for voter, address in voters.items():
            host, port = address.rsplit(":", 1)
            DIAL_ADDRESSES[voter] = (host, int(port))
        self.node_id = node_id
        self.cluster_map = ClusterMap()
        self.on_applied: OnApplied = _ignore_applied
        self._loop = loop
        directory.mkdir(parents=True, exist_ok=True)
        self._conf = SyncObjConf(
            password=password, bindAddress=voters[node_id] if self.voter else None,
            journalFile=str(directory / "raft.journal"), fullDumpFile=str(directory / "raft.dump"),
            raftMinTimeout=election_timeout_s[0], raftMaxTimeout=election_timeout_s[1],
            appendEntriesPeriod=heartbeat_s, leaderFallbackTimeout=leader_fallback_s,
            connectionTimeout=connection_timeout_s, connectionRetryTime=connection_retry_s,
            autoTickPeriod=0.01, commandsWaitLeader=True, dynamicMembershipChange=False,
            appendEntriesUseBatch=False)   # send a command at once: map changes are rare, latency matters
        self._voters = voters
        self._leader_fallback_s = leader_fallback_s
        self._syncobj: SyncObj | None = None
        self._machine = _MapMachine(self._from_raft_thread, self._snapshot_from_raft_thread)

    def start(self) -> None:
        others = [MembershipNode(voter) for voter in sorted(self._voters) if voter != self.node_id]
        self._syncobj = SyncObj(MembershipNode(self.node_id) if self.voter else None, others, conf=self._conf,
                                consumers=[self._machine], nodeClass=MembershipNode)

    def stop(self) -> None:
        if self._syncobj is not None:
            self._syncobj.destroy()
            self._syncobj = None

    # --- the Raft thread hands over to the loop ---------------------------------------------
    def _from_raft_thread(self, data: bytes) -> None:
        self._loop.call_soon_threadsafe(self._apply_local, data)

    def _snapshot_from_raft_thread(self, snapshot: ClusterMap) -> None:
        self._loop.call_soon_threadsafe(self._install_snapshot, snapshot)

    def _apply_local(self, data: bytes) -> None:
        command = decode_command(data)
        outcomes = self.cluster_map.apply(command)
        self.on_applied(command, outcomes)

    def _install_snapshot(self, snapshot: ClusterMap) -> None:
        if snapshot.version >= self.cluster_map.version:
            self.cluster_map = snapshot
            self.on_applied(ChangeAll, [])

    # --- interface ---------------------------------------------------------------------------
    def propose(self, command: Command, done: Done) -> None:
        finished = False

        def finish(outcomes: list[Outcome] | None) -> None:
            nonlocal finished
            if not finished:
                finished = True
                done(outcomes)

        def callback(result: Any, error: Any) -> None:        # on the Raft thread
            outcomes = None if error != 0 or result is None else [Outcome(*row) for row in result]
            self._loop.call_soon_threadsafe(finish, outcomes)

        timer = self._loop.call_later(PROPOSAL_TIMEOUT_S, finish, None)
        self._loop.call_soon(lambda: None)   # keep the loop's time fresh for the timer
        try:
            self._machine.apply_command(encode_command(command), callback=callback)
        except Exception:
            log.exception("membership proposal failed")
            timer.cancel()
            finish(None)

    def is_leader(self) -> bool:
        """Leads, and heard from a majority of the voters within leader_fallback_s. pysyncobj's
        own flag stays up after the process was paused (SIGSTOP) or cut off until its thread
        notices; a leader on a stale flag would grant leases (its own too) and promote, after
        the majority has elected another and promoted a replica (DESIGN.md 4.2: never derive
        anything from that flag alone)."""
        syncobj = self._syncobj
        if syncobj is None or not syncobj._isLeader():
            return False
        others = list(syncobj._SyncObj__otherNodes)                 # pysyncobj 0.3.17 internals
        responses = syncobj._SyncObj__lastResponseTime
        deadline = _raft_monotonic() - self._leader_fallback_s
        heard = 1 + sum(1 for node in others if responses.get(node, 0.0) > deadline)
        return heard > (len(others) + 1) / 2

    def leader_id(self) -> str | None:
        leader = self._syncobj._getLeader() if self._syncobj is not None else None
        return None if leader is None else str(leader.id)

    def term(self) -> int:
        return int(self._syncobj._getTerm()) if self._syncobj is not None else 0


class _ChangeAll:
    """Passed to `on_applied` when a snapshot replaced the whole map."""


ChangeAll: Any = _ChangeAll()


# --- the in-memory twin ------------------------------------------------------------------------
class MemoryMembershipGroup:
    """One replicated log in memory, for simulations: every member's copy applies the same
    commands in the same order, delivered by the loop after `apply_delay_s`. A member cut off
    from the majority (`isolate`) can neither propose nor learn until `heal`; the leader is
    the first member in `order` that is not isolated (or the one `elect` names)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, members: list[str], apply_delay_s: float = 0.005) -> None:
        self.loop = loop
        self.members: dict[str, MemoryMembership] = {m: MemoryMembership(self, m) for m in members}
        self.log: list[bytes] = []
        self.isolated: set[str] = set()
        self.apply_delay_s = apply_delay_s
        self._term = 1
        self._leader: str | None = members[0] if members else None

    def member(self, node_id: str) -> MemoryMembership:
        return self.members[node_id]

    def isolate(self, node_id: str) -> None:
        self.isolated.add(node_id)
        if self._leader == node_id:
            self.elect(None)

    def heal(self, node_id: str) -> None:
        self.isolated.discard(node_id)
        if self._leader is None and self.has_majority():
            self.elect(None)      # every member was cut off: with a majority back, Raft elects one
        self.members[node_id].catch_up()

    def elect(self, node_id: str | None) -> None:
        """A new leader (a new term); None: the first member not isolated."""
        candidates = [m for m in self.members if m not in self.isolated]
        self._leader = node_id if node_id is not None else (candidates[0] if candidates else None)
        self._term += 1

    def leader(self) -> str | None:
        return self._leader

    def term(self) -> int:
        return self._term

    def has_majority(self) -> bool:
        return len(self.members) - len(self.isolated) > len(self.members) // 2

    def append(self, data: bytes) -> int:
        self.log.append(data)
        index = len(self.log)
        for member in self.members.values():
            if member.node_id not in self.isolated:
                self.loop.call_later(self.apply_delay_s, member.catch_up)
        return index


class MemoryMembership:
    def __init__(self, group: MemoryMembershipGroup, node_id: str) -> None:
        self.group = group
        self.node_id = node_id
        self.cluster_map = ClusterMap()
        self.on_applied: OnApplied = _ignore_applied
        self.applied = 0
        self._waiting: dict[int, Done] = {}

    def start(self) -> None:
        self.group.loop.call_soon(self.catch_up)

    def stop(self) -> None:
        for done in self._waiting.values():
            done(None)
        self._waiting.clear()

    def restart(self) -> None:
        """A crash: the copy is rebuilt from the log (the journal) on start."""
        self._waiting.clear()
        self.cluster_map = ClusterMap()
        self.applied = 0

    def propose(self, command: Command, done: Done) -> None:
        group = self.group
        if self.node_id in group.isolated or not group.has_majority() or group.leader() is None:
            group.loop.call_later(0.05, done, None)
            return
        index = group.append(encode_command(command))
        self._waiting[index] = done

    def catch_up(self) -> None:
        if self.node_id in self.group.isolated:
            return
        while self.applied < len(self.group.log):
            data = self.group.log[self.applied]
            self.applied += 1
            command = decode_command(data)
            outcomes = self.cluster_map.apply(command)
            self.on_applied(command, outcomes)
            done = self._waiting.pop(self.applied, None)
            if done is not None:
                done(outcomes)

    def is_leader(self) -> bool:
        return self.group.leader() == self.node_id and self.node_id not in self.group.isolated

    def leader_id(self) -> str | None:
        return self.group.leader()

    def term(self) -> int:
        return self.group.term()
