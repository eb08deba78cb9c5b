"""The membership layer behind one narrow interface: our own Raft core, run on the node's
event loop (docs/RAFT.md); the engine simulation runs the same driver on its virtual loop.

    membership.cluster_map           the local copy of the replicated map (read on the loop)
    membership.propose(cmd, done)    done(outcomes) on the loop once applied, done(None) when
                                     it could not be (no leader within the timeout, ...)
    membership.on_applied            called on the loop after every command applied locally
    membership.is_leader() / leader_id() / term()

Raft words (leader, term, log) stay inside this module and replication/raft*.py; nothing
outside derives queue mastership from them: masters come from the map, which only
compare-and-set commands change.

`RaftMembership` drives the pure core (replication/raft.py) on the event loop: ticks from the
loop's timer, frames over a peer transport of its own (its own port, so heartbeats never wait
behind replication frames or snapshot chunks, and a proxy can sit on every link), its state
in the node's LMDB environment (qserver/storage/raft_store.py) written by the node's writer thread
before any message that depends on it leaves, and committed commands applied to the one
`cluster_map` on the loop.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from qserver.core.failstop import stop_process
from qserver.metrics import Histogram, render_family
from qserver.storage.lmdb_store import MapGrowthNeeded, StorageFull
from qserver.storage.raft_store import RaftStorage, storage_id_bytes
from qserver.transport.peer_link import RefusedMessage
from replication.cluster_map import (
    ClusterMap,
    Command,
    CommandError,
    NodeState,
    Outcome,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from replication.invariants import InvariantViolation
from replication.messages import MessageError
from replication.raft import (
    ChangeKind,
    ConfigurationChange,
    ProposalOutcome,
    Proposed,
    RaftLimits,
    RaftNode,
    Ready,
    Refusal,
    Refused,
)
from replication.raft_codec import (
    FrameChunk,
    JoinRequest,
    ProposeRequest,
    ProposeResponse,
    decode_frame,
    encode_frame,
)
from replication.raft_messages import AppendRequest, EntryKind, SnapshotRequest

log = logging.getLogger("qserver.cluster.membership")

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
    def version_when_applied(self) -> int: ...
    def status(self) -> dict[str, Any]: ...


def _ignore_applied(command: Command, outcomes: list[Outcome]) -> None:
    pass


# --- the Raft driver ----------------------------------------------------------------------------
JOIN_EVERY_TICKS = 8                # a node outside the configuration asks to join this often
RECONCILE_EVERY_TICKS = 4           # the leader looks for learners to promote and removed nodes
COMPACT_EVERY_ENTRIES = 1_000       # applied entries between two snapshots of the map
INBOX_ITEMS_MAX = 10_000            # frames and proposals waiting for the core (more are dropped)
PARKED_PROPOSALS_MAX = 1_000        # proposals waiting for a leader to be known
# A Raft write refused for lack of space is tried again after these delays, doubling: the core
# waits meanwhile (it takes no input between ready() and advance()), as behind a slow disk.
PERSIST_RETRY_INITIAL_S, PERSIST_RETRY_MAX_S = 0.05, 1.0
# A frame larger than one chunk (a snapshot of a large map: one message used to be refused by
# the transport's 8 MiB queue bound, silently, and the node behind it never caught up) goes in
# pieces (docs/RAFT.md, "Snapshots in chunks"), paced so that the link's queue keeps room for
# heartbeats. The core asks again for a snapshot every few ticks until it is answered: a
# transfer under way, or done less than FRAME_RESEND_S (plus a second per 8 MiB) ago, is not
# started again.
FRAME_CHUNK_BYTES = 1 << 20
CHUNKS_PENDING_BYTES_MAX = 2 << 20
CHUNKED_FRAME_BYTES_MAX = 1 << 30    # what a receiver joins (the map's own bound is far below)
FRAME_RESEND_S = 2.0


@dataclasses.dataclass(eq=False)
class _Outgoing:
    transfer: int
    key: tuple[int, int] | None        # the snapshot's (index, term)
    chunks: list[memoryview]
    count: int
    resend_after_s: float
    next: int = 0
    done_at: float | None = None


@dataclasses.dataclass(eq=False)
class _Incoming:
    transfer: int
    count: int
    parts: list[bytes] = dataclasses.field(default_factory=list)


def tick_ms(heartbeat_ms: int) -> int:
    """The core counts time in ticks of this length: half a heartbeat (25 ms by default), so
    that the leader lease (RaftNode.lease_remaining_ticks) loses little to rounding."""
    return max(5, heartbeat_ms // 2)


def raft_limits(election_timeout_ms: tuple[int, int], heartbeat_ms: int) -> RaftLimits:
    """The core's timers, in ticks, from the node's configuration in milliseconds."""
    tick = tick_ms(heartbeat_ms)
    low, high = (max(2, round(ms / tick)) for ms in election_timeout_ms)
    heartbeat = max(1, round(heartbeat_ms / tick))
    return RaftLimits(election_timeout_min_ticks=low, election_timeout_max_ticks=max(high, low + 1),
                      heartbeat_interval_ticks=min(heartbeat, low - 1), resend_after_ticks=max(1, min(5, low - 1)))


_CAMPAIGN = object()    # an inbox item: stand for election now (RaftMembership.campaign)


class _Proposal:
    __slots__ = ("data", "deadline", "done", "finished")

    def __init__(self, command: Command, done: Done, deadline: float) -> None:
        self.data = encode_command(command)
        self.done = done
        self.deadline = deadline
        self.finished = False

    def finish(self, outcomes: list[Outcome] | None) -> None:
        if not self.finished:
            self.finished = True
            self.done(outcomes)


class RaftMembership:
    """The pure Raft core (replication/raft.py) run on the node's event loop.

    One task owns the core. Inputs (ticks, frames from peers, proposals) wait in a bounded
    inbox while a Ready is being persisted (the core takes no input between `ready()` and
    `advance()`); then the task feeds them all, takes the next Ready, has the writer thread
    persist it (queued behind at most one queue commit), sends its messages, applies its
    committed commands to the one `cluster_map` and calls `advance`. No second thread, no
    second copy of the map.

    Around the core, three driver messages (replication/raft_codec.py): a node outside the
    configuration sends `JoinRequest` to every voter until the leader added it (as a learner;
    a configured voter is promoted once it has caught up, a disk that changed is removed
    first and added again); a follower passes its proposals to the leader (`ProposeRequest`)
    and waits for the entry the answer names."""

    def __init__(self, node_id: str, storage_id: int, store: RaftStorage, *, voters: set[str],
                 send: Callable[[str, bytes], bool], writer: Callable[[], Executor],
                 loop: asyncio.AbstractEventLoop, limits: RaftLimits, tick_s: float, seed: int | None = None,
                 grow_storage: Callable[[], None] | None = None,
                 compact_every_entries: int = COMPACT_EVERY_ENTRIES,
                 pending_bytes: Callable[[str], int] | None = None) -> None:
        """`grow_storage`: grows the node's LMDB map between two writer jobs (Engine.grow_storage;
        raises StorageFull at its limit), for a Raft write that found the map full.
        `compact_every_entries`: applied entries between two snapshots of the map.
        `pending_bytes`: what the link to a peer holds unsent (paces a chunked frame)."""
        self._compact_every = compact_every_entries
        self.node_id = node_id
        self.cluster_map = ClusterMap()
        self.on_applied: OnApplied = _ignore_applied
        self._storage_id = storage_id_bytes(storage_id)
        self._store = store
        self._voters = voters                 # the configured voters: who is promoted once caught up
        self._send = send
        self._pending_bytes = pending_bytes
        self._outgoing: dict[str, _Outgoing] = {}     # peer -> the chunked frame being sent to it
        self._incoming: dict[str, _Incoming] = {}     # peer -> the chunked frame being joined
        self._transfer_ids = itertools.count(random.SystemRandom().randrange(1, 1 << 31))
        self.frames_chunked = 0
        self.chunks_dropped = 0
        self._writer = writer
        self._grow_storage = grow_storage
        self._loop = loop
        self._limits = limits
        self._tick_s = tick_s
        self._random = random.Random(seed)
        self._core: RaftNode | None = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._next_tick_at = 0.0          # loop time of the next tick not counted yet
        self._ticks_due = 0               # counted, not yet fed to the core
        self._tick_count = 0
        self._waiting: dict[int, tuple[int, _Proposal]] = {}       # entry index -> (term, proposal)
        self._forwarded: dict[int, _Proposal] = {}                 # request id -> proposal at the leader
        self._parked: list[_Proposal] = []                         # no leader known yet
        self._request_ids = itertools.count(1)
        self.frames_dropped = 0
        self.bad_frames = 0
        self.persists_refused = 0           # Raft writes refused for lack of space (tried again)
        # The Raft write shares the node's one writer thread with queue commits: how long it
        # waits behind them (issue 12 bounds it at 10 ms), and how long it takes itself.
        self.persist_wait_seconds = Histogram(
            "qserver_membership_persist_wait_seconds", "Raft writes: wait for the node's writer thread",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.persist_seconds = Histogram(
            "qserver_membership_persist_seconds", "Raft writes: the LMDB transaction with its fsync",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        persisted = self._store.load()
        self._core = RaftNode(self.node_id, self._storage_id, persisted, self._limits, self._random)
        self.cluster_map = decode_map(persisted.snapshot.data)
        self._task = self._loop.create_task(self._run())
        self._task.add_done_callback(_task_ended)
        self._next_tick_at = self._loop.time() + self._tick_s
        self._ticker = self._loop.call_at(self._next_tick_at, self._tick)

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._task is not None:
            self._task.cancel()
        for proposal in [*self._parked, *self._forwarded.values(), *(p for _, p in self._waiting.values())]:
            proposal.finish(None)
        self._parked, self._forwarded, self._waiting = [], {}, {}

    # --- reads ----------------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """Leads, and holds the leader lease: no other leader can have been elected yet (the
        core's exact rule, RaftNode.lease_remaining_ticks). A leader cut off, or paused and
        resumed, stops granting node leases and deciding failovers at once, before
        check-quorum steps it down (docs/RAFT.md, "Leases")."""
        core = self._core
        # The core counts only the ticks it was fed. Those the clock has passed and it has not
        # seen count against the lease too: they wait while a Ready is persisted (behind a
        # slow fsync, or a disk stalled with its process), and a paused process's timer fires
        # once, late. Found by the engine simulation: a leader resumed from a pause granted
        # itself a node lease before its core saw the time go by, while another node already
        # mastered its queue.
        return core is not None and core.is_leader \
            and core.lease_remaining_ticks > self._ticks_due + self._ticks_passed()

    def leader_id(self) -> str | None:
        return None if self._core is None else self._core.leader_id

    def version_when_applied(self) -> int:
        """The map version this node's copy will have once it has applied every map command
        in its log and every proposal of its own on its way there. A node lease the leader
        grants counts only from that version on (LeaseGrant.map_version): granted against the
        applied map alone, it let a master act in its old epoch while the leader's failover
        of its queues was still uncommitted (engine simulation, seed 2093 under `producer`)."""
        core = self._core
        pending = sum(1 for item in self._inbox if isinstance(item, _Proposal))
        if core is not None and core.last_index > core.applied_index:
            pending += sum(1 for entry in core.log.entries_between(core.applied_index + 1, core.last_index)
                           if entry.kind is EntryKind.COMMAND)
        return self.cluster_map.version + pending

    def term(self) -> int:
        return 0 if self._core is None else self._core.term

    def status(self) -> dict[str, Any]:
        core = self._core
        if core is None:
            return {}
        configuration = core.configuration
        return {"role": core.role.value, "term": core.term, "leader": core.leader_id, "commit_index": core.commit_index,
                "applied_index": core.applied_index, "last_index": core.last_index, "snapshot_index": core.snapshot_index,
                "voters": configuration.voter_ids(),
                "learners": sorted(set(configuration.node_ids()) - set(configuration.voter_ids()))}

    def render_metrics(self) -> list[str]:
        core = self._core
        if core is None:
            return []
        lines = render_family("qserver_membership_term", "gauge", "the membership layer's current term", [({}, core.term)])
        lines += render_family("qserver_membership_leader", "gauge", "1 while this node leads and holds the leader lease",
                               [({}, 1.0 if self.is_leader() else 0.0)])
        lines += render_family("qserver_membership_index", "gauge", "the Raft log's indices on this node",
                               [({"kind": "commit"}, core.commit_index), ({"kind": "applied"}, core.applied_index),
                                ({"kind": "last"}, core.last_index), ({"kind": "snapshot"}, core.snapshot_index)])
        lines += render_family("qserver_membership_voters", "gauge", "voters in the configuration in force",
                               [({}, len(core.configuration.voter_ids()))])
        lines += render_family("qserver_membership_frames_refused_total", "counter",
                               "membership frames dropped (inbox full) or refused (malformed, wrong sender)",
                               [({"why": "inbox_full"}, self.frames_dropped), ({"why": "bad"}, self.bad_frames)])
        lines += render_family("qserver_membership_frames_chunked_total", "counter",
                               "frames too large for one message (map snapshots) sent in chunks, and chunked frames "
                               "given up for a lost piece", [({"what": "sent"}, self.frames_chunked),
                                                             ({"what": "dropped"}, self.chunks_dropped)])
        lines += render_family("qserver_membership_persists_refused_total", "counter",
                               "Raft writes refused for lack of space (the same write is tried again)",
                               [({}, self.persists_refused)])
        return lines + self.persist_wait_seconds.render() + self.persist_seconds.render()

    # --- inputs -----------------------------------------------------------------------------------
    def propose(self, command: Command, done: Done) -> None:
        self._put(_Proposal(command, done, self._loop.time() + PROPOSAL_TIMEOUT_S))

    def campaign(self) -> None:
        """Stand for election now, as if the election timer had fired (the simulation's
        "new leader" fault; refused by the core unless this node is a voter on this disk)."""
        self._put(_CAMPAIGN)

    def on_frame(self, peer: str, data: bytes) -> None:
        """A frame from the membership link (loop thread). Bad input from an authenticated peer
        never reaches the core, whose checks would take it for a broken invariant and stop the
        node: it is counted and refused, and the transport drops that link (RefusedMessage)."""
        try:
            frame = decode_frame(data)
            if isinstance(frame, FrameChunk):
                joined = self._join(peer, frame)
                if joined is None:
                    return
                frame = decode_frame(joined)
                if isinstance(frame, FrameChunk):
                    raise MessageError("a chunk inside a chunked frame")
            if getattr(frame, "sender", peer) != peer:
                raise MessageError(f"a message from {getattr(frame, 'sender', '?')!r} on {peer}'s link")
            _check_contents(frame)
        except InvariantViolation as error:
            # The cluster runs at a feature level this release cannot follow (it was finalized
            # for a newer release): stop rather than serve a map that differs from everyone's.
            stop_process(f"the membership leader {peer} sent a map this release cannot follow: {error}", error)
            return
        except MessageError as error:
            self.bad_frames += 1
            log.warning("refused a bad membership frame from %s, dropping the link: %s", peer, error)
            raise RefusedMessage(str(error)) from None
        self._put(frame)

    def _join(self, peer: str, chunk: FrameChunk) -> bytes | None:
        """The whole frame once its last piece came; None before. Pieces of one transfer come in
        order on one link; a gap (pieces lost with a broken link) drops what was joined, and
        the sender sends the frame again whole when the core asks again."""
        if chunk.sender != peer:
            raise MessageError(f"a chunk from {chunk.sender!r} on {peer}'s link")
        if len(chunk.data) > FRAME_CHUNK_BYTES or chunk.count > CHUNKED_FRAME_BYTES_MAX // FRAME_CHUNK_BYTES:
            raise MessageError("a chunked frame beyond the bounds")
        incoming = self._incoming.get(peer)
        if chunk.sequence == 0:
            incoming = self._incoming[peer] = _Incoming(chunk.transfer, chunk.count)
        elif incoming is None or (incoming.transfer, incoming.count, len(incoming.parts)) != \
                (chunk.transfer, chunk.count, chunk.sequence):
            self._incoming.pop(peer, None)
            self.chunks_dropped += 1
            return None
        incoming.parts.append(chunk.data)
        if len(incoming.parts) < incoming.count:
            return None
        del self._incoming[peer]
        return b"".join(incoming.parts)

    def _send_frame(self, message: Any) -> None:
        """Send one of the core's messages: whole, or in chunks when it is larger than one."""
        data = encode_frame(message)
        peer = message.recipient
        if len(data) <= FRAME_CHUNK_BYTES:
            self._send(peer, data)
            return
        key = (message.snapshot.index, message.snapshot.term) if isinstance(message, SnapshotRequest) else None
        current = self._outgoing.get(peer)
        if current is not None and key is not None and current.key == key and (
                current.done_at is None or self._loop.time() - current.done_at < current.resend_after_s):
            return      # under way, or just sent: its answer is on its way
        view = memoryview(data)
        chunks = [view[start:start + FRAME_CHUNK_BYTES] for start in range(0, len(data), FRAME_CHUNK_BYTES)]
        self._outgoing[peer] = _Outgoing(next(self._transfer_ids), key, chunks, len(chunks),
                                         FRAME_RESEND_S + len(data) / (8 << 20))
        self.frames_chunked += 1
        self._pump_chunks()

    def _pump_chunks(self) -> None:
        """Hand the transport the next pieces of each chunked frame, while its queue for that
        peer has room (each tick, so a large snapshot flows without starving heartbeats)."""
        for peer, outgoing in self._outgoing.items():
            while outgoing.next < outgoing.count:
                if self._pending_bytes is not None and self._pending_bytes(peer) >= CHUNKS_PENDING_BYTES_MAX:
                    break
                chunk = FrameChunk(self.node_id, outgoing.transfer, outgoing.next, outgoing.count,
                                   bytes(outgoing.chunks[outgoing.next]))
                if not self._send(peer, encode_frame(chunk)):
                    break
                outgoing.next += 1
            if outgoing.next == outgoing.count and outgoing.done_at is None:
                outgoing.done_at = self._loop.time()
                outgoing.chunks = []

    def _put(self, item: Any) -> None:
        if len(self._inbox) >= INBOX_ITEMS_MAX:
            self.frames_dropped += 1      # Raft retransmits; a proposal times out
            return
        self._inbox.append(item)
        self._wake.set()

    def _ticks_passed(self) -> int:
        """Ticks whose time the loop's clock has passed and that `_tick` has not counted."""
        late = self._loop.time() - self._next_tick_at
        return 0 if late < 0 else int(late // self._tick_s) + 1

    def _tick(self) -> None:
        """Count every tick the clock passed since the last one (at least this one: a timer
        may fire a little early), so that ticks keep time after a pause. At most a minimum
        election timeout's worth is fed at once: enough to end any lease, and no burst of
        elections."""
        passed = max(1, self._ticks_passed())
        self._next_tick_at += passed * self._tick_s
        self._ticker = self._loop.call_at(self._next_tick_at, self._tick)
        self._ticks_due = min(self._ticks_due + passed, self._limits.election_timeout_min_ticks)
        self._wake.set()

    # --- the task that owns the core --------------------------------------------------------
    async def _run(self) -> None:
        core = self._core
        if core is None:
            raise InvariantViolation("the membership task started before its Raft core")
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._feed(core)
            while core.has_ready():
                ready = core.ready()
                if ready.must_persist:
                    await self._persist_until_stored(ready)
                for message in ready.messages:
                    self._send_frame(message)
                self._apply(ready)
                core.advance(ready)
                self._feed(core)

    async def _persist_until_stored(self, ready: Ready) -> None:
        """A full disk or map is an operating error, not a broken invariant: the node keeps
        running and this member waits, unadvanced, as behind a stalled disk (its votes and
        acknowledgements wait too; the other voters go on without it), and writes the same
        Ready once there is room. Anything else LMDB raises still ends the task (see _task_ended)."""
        delay_s = PERSIST_RETRY_INITIAL_S
        refused = 0
        while True:
            try:
                await self._loop.run_in_executor(self._writer(), self._persist, ready, time.perf_counter())
                if refused:
                    log.warning("membership: a Raft write refused %d time(s) for lack of space is stored now", refused)
                return
            except MapGrowthNeeded:
                if self._grow_storage is not None and self._grew_storage():
                    continue
            except StorageFull as error:
                if not refused:
                    log.warning("membership: a Raft write was refused (%s); trying again until there is room", error)
            refused += 1
            self.persists_refused += 1
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, PERSIST_RETRY_MAX_S)

    def _grew_storage(self) -> bool:
        try:
            self._grow_storage()  # type: ignore[misc]
        except StorageFull as error:
            log.warning("membership: a Raft write found the storage map full and it cannot grow (%s)", error)
            return False
        return True

    def _persist(self, ready: Ready, submitted: float) -> None:
        """On the writer thread."""
        started = time.perf_counter()
        self._store.persist(ready)
        self.persist_wait_seconds.observe(started - submitted)
        self.persist_seconds.observe(time.perf_counter() - started)

    def _feed(self, core: RaftNode) -> None:
        while self._ticks_due:
            self._ticks_due -= 1
            self._tick_count += 1
            core.tick()
            self._on_tick(core)
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            if isinstance(item, _Proposal):
                self._propose(core, item)
            elif isinstance(item, JoinRequest):
                self._on_join(core, item)
            elif isinstance(item, ProposeRequest):
                self._on_forwarded(core, item)
            elif isinstance(item, ProposeResponse):
                self._on_forward_answer(item)
            elif item is _CAMPAIGN:
                core.campaign()
            else:
                core.step(item)
        if core.applied_index - core.snapshot_index >= self._compact_every:
            core.compact(core.applied_index, encode_map(self.cluster_map))

    def _on_tick(self, core: RaftNode) -> None:
        now = self._loop.time()
        if self._outgoing:
            self._pump_chunks()
        if self._parked and core.leader_id is not None:
            parked, self._parked = self._parked, []
            for proposal in parked:
                self._propose(core, proposal)
        for proposal in [p for p in self._parked if p.deadline <= now]:
            self._parked.remove(proposal)
            proposal.finish(None)
        for request_id in [r for r, p in self._forwarded.items() if p.deadline <= now]:
            self._forwarded.pop(request_id).finish(None)
        for index in [i for i, (_, p) in self._waiting.items() if p.deadline <= now]:
            self._waiting.pop(index)[1].finish(None)
        if self._tick_count % JOIN_EVERY_TICKS == 0 and core.configuration.storage_id_of(self.node_id) != self._storage_id:
            join = encode_frame(JoinRequest(self.node_id, self._storage_id, self.node_id in self._voters))
            for voter in self._voters - {self.node_id}:
                self._send(voter, join)
        if core.is_leader and self._tick_count % RECONCILE_EVERY_TICKS == 0:
            self._reconcile(core)

    # --- proposals ----------------------------------------------------------------------------
    def _propose(self, core: RaftNode, proposal: _Proposal) -> None:
        if proposal.finished:
            return
        if core.is_leader:
            self._await_entry(proposal, core.propose(proposal.data))
        elif core.leader_id is not None:
            request_id = next(self._request_ids)
            self._forwarded[request_id] = proposal
            self._send(core.leader_id, encode_frame(ProposeRequest(self.node_id, request_id, proposal.data)))
        elif len(self._parked) < PARKED_PROPOSALS_MAX:
            self._parked.append(proposal)
        else:
            proposal.finish(None)

    def _await_entry(self, proposal: _Proposal, outcome: ProposalOutcome) -> None:
        if isinstance(outcome, Proposed):
            self._waiting[outcome.index] = (outcome.term, proposal)
        else:
            log.info("membership proposal refused: %s", outcome.reason.value)
            proposal.finish(None)

    def _on_forwarded(self, core: RaftNode, request: ProposeRequest) -> None:
        """At the leader: propose a follower's command and say where it went."""
        outcome = core.propose(request.command) if core.is_leader else Refused(Refusal.NOT_LEADER)
        if isinstance(outcome, Proposed):
            answer = ProposeResponse(self.node_id, request.request_id, outcome.index, outcome.term, "")
        else:
            answer = ProposeResponse(self.node_id, request.request_id, 0, 0, outcome.reason.value)
        self._send(request.sender, encode_frame(answer))

    def _on_forward_answer(self, answer: ProposeResponse) -> None:
        proposal = self._forwarded.pop(answer.request_id, None)
        if proposal is None:
            return
        if answer.index == 0:
            if answer.refusal == Refusal.NOT_LEADER.value:
                self._put(proposal)         # the leader changed meanwhile: again, to the new one
            else:
                proposal.finish(None)
        elif answer.index <= (self._core.applied_index if self._core else 0):
            proposal.finish(None)           # already applied (or compacted) here: outcome unknown
        else:
            self._waiting[answer.index] = (answer.term, proposal)

    # --- membership changes (the leader) ----------------------------------------------------
    def _on_join(self, core: RaftNode, request: JoinRequest) -> None:
        if not core.is_leader:
            return
        entry = self.cluster_map.nodes.get(request.sender)
        if entry is not None and entry.state is NodeState.REMOVED:
            return                  # gone for good: a removed id is never reused (ClusterMap)
        known = core.configuration.storage_id_of(request.sender)
        if known == request.storage_id:
            return
        if known is not None:
            # Back with another disk: what it promised (votes, entries) is gone. It is removed,
            # and added again as a new member on its next request.
            self._change(core, ConfigurationChange(ChangeKind.REMOVE_MEMBER, request.sender))
        else:
            self._change(core, ConfigurationChange(ChangeKind.ADD_LEARNER, request.sender, request.storage_id))

    def _reconcile(self, core: RaftNode) -> None:
        configuration = core.configuration
        for node_id in sorted(set(configuration.node_ids()) - set(configuration.voter_ids())):
            if node_id in self._voters:
                self._change(core, ConfigurationChange(ChangeKind.PROMOTE_LEARNER, node_id))
        # The leader removes itself too: it steps down once that commits, and the others elect
        # a leader when their timers fire (there is no leadership transfer; docs/RAFT.md).
        for node_id, entry in sorted(self.cluster_map.nodes.items()):
            if entry.state is NodeState.REMOVED and configuration.is_member(node_id):
                self._change(core, ConfigurationChange(ChangeKind.REMOVE_MEMBER, node_id))

    def _change(self, core: RaftNode, change: ConfigurationChange) -> None:
        """Propose one change; the core refuses it while another is pending, and refuses a
        change already made (so asking again every reconcile period costs nothing)."""
        outcome = core.propose_change(change)
        if isinstance(outcome, Proposed):
            log.info("membership: %s %s (entry %d, term %d)", change.kind.value, change.node_id, outcome.index,
                     outcome.term)

    # --- applying -----------------------------------------------------------------------------
    def _apply(self, ready: Ready) -> None:
        snapshot = ready.install_snapshot
        if snapshot is not None:
            self.cluster_map = decode_map(snapshot.data)
            for index in [i for i in self._waiting if i <= snapshot.index]:
                self._waiting.pop(index)[1].finish(None)
            self.on_applied(ChangeAll, [])
        for entry in ready.committed_entries:
            waiting = self._waiting.pop(entry.index, None)
            outcomes: list[Outcome] | None = None
            if entry.kind is EntryKind.COMMAND:
                try:
                    command = decode_command(entry.command)
                except CommandError as error:
                    # Every replica skips the same bytes the same way: the maps stay equal.
                    log.error("membership entry %d is not a map command: %s", entry.index, error)
                else:
                    outcomes = self.cluster_map.apply(command)
                    self.on_applied(command, outcomes)
            if waiting is not None:
                term, proposal = waiting
                proposal.finish(outcomes if term == entry.term else None)


def _check_contents(frame: Any) -> None:
    """What a leader's messages always are (docs/RAFT.md): an append's entries consecutive after
    previous_index, of terms that never fall, from previous_term up to the sender's term; a
    snapshot of a term no later than the sender's, holding a map that decodes. The core takes
    anything else for a broken invariant (its log refuses the entries) or installs it (a map that
    does not decode ends the task): from a peer it is bad input, refused like a malformed frame
    (issue 32, Low: a malformed message crashed the receiver)."""
    if isinstance(frame, AppendRequest):
        last_index, last_term = frame.previous_index, frame.previous_term
        for entry in frame.entries:
            if entry.index != last_index + 1 or not last_term <= entry.term <= frame.term:
                raise MessageError(f"entry {entry.index} of term {entry.term} cannot follow {last_index} of term "
                                   f"{last_term} in an append of term {frame.term}")
            last_index, last_term = entry.index, entry.term
    elif isinstance(frame, SnapshotRequest):
        if frame.snapshot.term > frame.term:
            raise MessageError("a snapshot's last entry is of a term after the sender's")
        try:
            decode_map(frame.snapshot.data)
        except InvariantViolation:
            raise           # a well-formed map at a feature level this release cannot run: see on_frame
        except Exception as error:  # noqa: BLE001 (garbage raises many types)
            raise MessageError(f"a snapshot whose map does not decode: {type(error).__name__}") from None


def _task_ended(task: asyncio.Task[None]) -> None:
    """The task ends only when cancelled. Anything else is a broken invariant (the core
    refusing to truncate a committed entry, say): the node stops at once, before it acts on
    a map it can no longer trust, and its supervisor restarts it from what is on disk."""
    if not task.cancelled() and task.exception() is not None:
        stop_process("the membership task died", task.exception())


class _ChangeAll:
    """Passed to `on_applied` when a snapshot replaced the whole map."""


ChangeAll: Any = _ChangeAll()
