"""The replica role of one queue's pair: apply what the master ordered, in order.

A (re)joining replica sends Open with its last (epoch, ordering index) and rolling digest;
the master answers SyncBegin and streams what is missing from its op log, or, when the log
no longer reaches back that far or the histories differ, the queue's state at one order in
SnapshotChunks (`replication/snapshot.py`), and then SyncEnd with its digest at the end of
the transfer; the replica acknowledges the open (OpenAck) once its own digest matches (seed
004 FIG. 22). Live operations keep flowing during and after the transfer. A snapshot counts
as this member's position only once every chunk arrived, its content hash matched and its
installation is durable: until then the member reports the position it had. Every Append names the order of the
operation before it, so a gap (a lost or reordered message) is noticed and the master
streams again from the replica's durable point; repeats are skipped.

Acknowledgements carry 0 in the ordering field and, separately, the highest ordering index
held durably (seed 004), which is what lets the master commit. Clients of the replica see
only what the master has committed (`visible_order`), and operations its clients send are
relayed to the master, which answers with the ordering index that places each one.

Pure: effects accumulate in `resets` (wipe the queue and start from this record), `discards`
(drop what is held past this order), `snapshot_rows` (rows of a snapshot to store, through the
chunk `snapshot_rows_through` names: once stored, the driver calls `snapshot_rows_durable`), `installs`
(a complete snapshot to install), `applied` (operations to persist with their digests),
`outbox` and `relay_results`; the driver drains them in that order after every call.
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Any

from replication.digest import EMPTY_DIGEST, fold_encoded
from replication.invariants import InvariantViolation
from replication.master import RESYNC, STORAGE_FULL, ReplicationLimits
from replication.messages import (
    Append,
    AppendAck,
    Message,
    MessageError,
    Open,
    OpenAck,
    Refused,
    RelayRequest,
    RelayResult,
    SnapshotAck,
    SnapshotChunk,
    SyncBegin,
    SyncEnd,
    decode_entry,
)
from replication.operations import DeadLettered, Operation
from replication.oplog import LogEntry, OpLogReader
from replication.options import Strength
from replication.queue_core import QueueCore
from replication.snapshot import EMPTY_STATE_HASH, decode_rows, fold_rows


@dataclass(frozen=True, slots=True)
class SnapshotInstall:
    """A snapshot that arrived whole and matched its content hash: the driver makes it this
    member's state at `order` (with the dead-letter queue's, under `full`) in one batch."""
    order: int
    digest: bytes
    record: dict[str, Any]
    keep_upto: int                         # `producer`: the member kept its own state up to here
    dead_letter: list[Any] | None          # [order, digest, record] of the dead-letter queue


@dataclass(slots=True)
class _Transfer:
    order: int
    keep_upto: int
    record: dict[str, Any]
    number: int                # which transfer of this role: a late durability notice names it
    next_sequence: int = 1
    durable_sequence: int = 0  # chunks up to here are stored: what SnapshotAck reports
    state_hash: bytes = EMPTY_STATE_HASH
    gap_reported_at: int = 0


class ReplicaPhase(enum.StrEnum):
    OPENING = "opening"        # Open sent; waiting for the master's SyncBegin
    SYNCING = "syncing"        # receiving the transfer
    FOLLOWING = "following"    # digests matched: applying live operations
    FENCED = "fenced"          # a newer epoch exists elsewhere: stop


PHASE_TRANSITIONS: dict[ReplicaPhase, frozenset[ReplicaPhase]] = {
    ReplicaPhase.OPENING: frozenset({ReplicaPhase.OPENING, ReplicaPhase.SYNCING, ReplicaPhase.FENCED}),
    ReplicaPhase.SYNCING: frozenset({ReplicaPhase.OPENING, ReplicaPhase.SYNCING, ReplicaPhase.FOLLOWING,
                                     ReplicaPhase.FENCED}),
    ReplicaPhase.FOLLOWING: frozenset({ReplicaPhase.OPENING, ReplicaPhase.SYNCING, ReplicaPhase.FENCED}),
    ReplicaPhase.FENCED: frozenset(),
}


class ReplicaRole:
    def __init__(self, core: QueueCore, oplog: OpLogReader, *, node_id: str, master_id: str, epoch: int,
                 incarnation: int, applied_order: int, digest: bytes, last_epoch: int,
                 limits: ReplicationLimits | None = None, session_base: int = 0, durable_order: int | None = None,
                 commit_order: int = 0, known_committed: int = 0) -> None:
        """`durable_order` and `commit_order`: for a member that was master until now, what is
        durable here and what it knew committed (so its clients keep seeing those);
        `known_committed`: an order known committed from before (the queue record's, after a
        restart), told to the master in Open."""
        self.core = core
        self.oplog = oplog
        self.node_id = node_id
        self.master_id = master_id
        self.epoch = epoch
        self.incarnation = incarnation
        self.last_epoch = last_epoch
        self.limits = limits or ReplicationLimits()
        self.phase = ReplicaPhase.OPENING
        self.applied_order = applied_order
        self.durable_order = applied_order if durable_order is None else durable_order
        self.digest = digest
        self.master_commit_order = commit_order
        self.known_committed = max(known_committed, commit_order)
        self.master_recorded_commit = 0     # the commit point the master's storage holds (Append)
        self._transfer: _Transfer | None = None     # a snapshot being received
        self.snapshots_installed = 0
        self.snapshots_resumed = 0    # transfers continued after a broken link (the driver counts and zeroes it)
        self.resync_source = False    # a dead-letter queue's member asks for its queue's snapshot
        self.dead_letter_resyncs = 0   # times the two streams of a dead-letter queue disagreed
        self._recent_digests: collections.deque[tuple[int, bytes]] = collections.deque()   # not yet durable
        self._last_open_ms: int | None = None
        self._gap_reported_at = -1
        self._last_progress_ms = 0
        self._now_ms = 0
        # Every Open starts a new session: what the master sent, or we acknowledged, for an
        # earlier one (before a restart or a reset) must not count in this one. The base
        # differs per process so a restarted replica never reuses a session number.
        self.session = session_base
        self.gates_visibility = True   # False for a dead-letter queue: see qserver/cluster/pairs.py
        core.visible_upto = self.visible_order
        self.resets: list[dict[str, Any]] = []
        self.discards: list[int] = []
        self.snapshot_rows: list[list[Any]] = []
        # (transfer number, chunk sequence) of the last chunk whose rows are in snapshot_rows:
        # the driver calls snapshot_rows_durable with it once they are stored.
        self.snapshot_rows_through: tuple[int, int] | None = None
        self.snapshot_keep_upto = 0          # of the latest transfer: this member keeps its state up to it
        self._transfers = 0
        self.installs: list[SnapshotInstall] = []
        self.applied: list[LogEntry] = []    # entries applied, for the driver to persist
        self.outbox: list[tuple[str, Message]] = []
        self.relay_results: list[RelayResult] = []

    @property
    def visible_order(self) -> int:
        """Clients here may see operations up to this order: committed by the master and
        durable here."""
        return min(self.master_commit_order, self.durable_order)

    # --- opening ---------------------------------------------------------------------------
    def start(self, now_ms: int) -> None:
        """Send Open (again): at start, when the link comes back, or after a mismatch."""
        self._set_phase(ReplicaPhase.OPENING)
        self._last_open_ms = now_ms
        self._last_progress_ms = now_ms
        self.session += 1
        committed = min(self.applied_order, max(self.known_committed, self.master_commit_order))
        # A snapshot under way asks to be resumed after its last chunk: the master goes on
        # from the same read view if it still holds it, or starts another (which first
        # erases what this one stored).
        transfer = self._transfer
        resume_order, resume_after = (transfer.order, transfer.next_sequence - 1) if transfer is not None else (0, 0)
        self._send(Open(self.core.name, self.incarnation, self.epoch, self.last_epoch, self.applied_order, self.digest,
                        self.session, committed, resume_order, resume_after))

    @property
    def never_opened(self) -> bool:
        """No Open was sent since the last link change (the driver starts one when it can)."""
        return self._last_open_ms is None

    @property
    def quiet(self) -> bool:
        """Nothing for `tick` to do until a message comes: it follows its master, is fenced,
        or waits to be started (its link is down, or its node may not open it yet: the driver
        starts it when the link comes back or the node may; issue 31)."""
        return self.phase in (ReplicaPhase.FOLLOWING, ReplicaPhase.FENCED) \
            or (self.phase is ReplicaPhase.OPENING and self._last_open_ms is None)

    def tick(self, now_ms: int) -> None:
        if self._last_open_ms is None:
            return
        if self.phase is ReplicaPhase.OPENING and now_ms - self._last_open_ms >= self.limits.open_retry_ms:
            self.start(now_ms)
        elif self.phase is ReplicaPhase.SYNCING and now_ms - self._last_progress_ms >= self._stall_ms():
            # A transfer that stopped moving (its Open or SyncEnd lost with a broken link, or
            # the master answering an older session): open again from where we are; only
            # what is missing comes again.
            self.start(now_ms)

    def _stall_ms(self) -> int:
        """How long a transfer may go without progress. A snapshot is given longer: starting
        one over costs all of it again, and a lost chunk is resent by the master anyway."""
        return 2 * self.limits.open_retry_ms if self._transfer is None else 10 * self.limits.open_retry_ms

    def link_down(self) -> None:
        if self.phase is not ReplicaPhase.FENCED:
            self._set_phase(ReplicaPhase.OPENING)
            self._last_open_ms = None   # the driver calls start() when the link is back

    def rebind(self, core: QueueCore) -> None:
        """The queue's core was rebuilt from storage after a batch that applied nothing of
        this role's stream could not be stored: go on with it."""
        self.core = core
        if self.gates_visibility:
            core.visible_upto = self.visible_order

    def refuse_for_storage(self) -> None:
        """This member's storage is full: it stops following (as on a broken link: the driver
        opens it again once there is room) and tells the master, which then need not wait for
        it. A new session, so that answers to its last Open find nothing to start."""
        self.link_down()
        self.session += 1
        self._send(Refused(self.core.name, self.incarnation, self.epoch, STORAGE_FULL,
                           "the replica's storage is full: it takes nothing until it has room"))

    # --- messages from the master ----------------------------------------------------------
    def receive(self, message: Message, now_ms: int) -> None:
        self._now_ms = now_ms
        if message.epoch < self.epoch:
            self._send(Refused(self.core.name, self.incarnation, self.epoch, "E_FENCED",
                               f"epoch {message.epoch} is older than {self.epoch}"))
            return
        if message.epoch > self.epoch:
            self._set_phase(ReplicaPhase.FENCED)   # placement changed: the driver re-reads it
            return
        if isinstance(message, Refused):
            # The master repeats a RESYNC until an Open comes: one that meets a member already
            # starting over (waiting to open, or opening) asks for nothing more.
            if message.code == RESYNC and self.core.record.dead_letter_of is not None:
                if not self.never_opened:
                    self.resync_source = True   # a dead-letter queue's state comes with its queue's
            elif message.code == RESYNC and self.phase is not ReplicaPhase.OPENING:
                self.start(now_ms)              # our position left the master's log: open again
            # Otherwise, of our own epoch, it refuses what this node sent in an older epoch (as
            # the master it was before a handoff, say), so it is stale. Fencing on it would stop
            # this replica for good: the map, which is already current, would never re-read it.
            return
        if isinstance(message, Append):
            self._on_append(message)
        elif isinstance(message, SyncBegin):
            self._on_sync_begin(message)
        elif isinstance(message, SnapshotChunk):
            self._on_snapshot_chunk(message, now_ms)
        elif isinstance(message, SyncEnd):
            self._on_sync_end(message, now_ms)
        elif isinstance(message, RelayResult):
            self.relay_results.append(message)

    def _on_append(self, append: Append) -> None:
        if self.phase not in (ReplicaPhase.SYNCING, ReplicaPhase.FOLLOWING) or self._transfer is not None:
            return                      # not opened yet (or taking a snapshot): the transfer carries these
        self.master_commit_order = max(self.master_commit_order, append.commit_order)
        self.master_recorded_commit = max(self.master_recorded_commit, append.recorded_commit)
        if self.gates_visibility:
            self.core.visible_upto = self.visible_order
        previous = append.prev_order
        repeated = False
        for encoded in append.entries:
            try:
                ops = decode_entry(encoded)
            except MessageError:
                self._report_gap()      # never applied: the master streams it again
                return
            last = ops[-1].order
            if last <= self.applied_order:
                previous = last         # already applied (a resend)
                repeated = True
                continue
            if previous != self.applied_order:
                # A gap: an Append was lost, or this one was sent before our last Open.
                self._report_gap()
                return
            if ops[0].order <= self.applied_order:
                raise InvariantViolation(f"queue {self.core.name}: a log entry {ops[0].order}..{last} straddles "
                                         f"the applied order {self.applied_order} (both members' entries are the same)")
            if self._dead_letters_ran_ahead(ops):
                return
            apply = self.core.apply
            for op in ops:
                apply(self._localized(op))
            self.digest = fold_encoded(self.digest, encoded)
            self.applied_order = last
            self._recent_digests.append((last, self.digest))
            self.applied.append(LogEntry(ops, self.digest, encoded))
            previous = last
            self._last_progress_ms = self._now_ms
            repeated = False
        if repeated:
            # The master streams again when an acknowledgement was lost: say it once more.
            self._send(AppendAck(self.core.name, self.incarnation, self.epoch, 0, self.durable_order,
                                 session=self.session))

    def _dead_letters_ran_ahead(self, ops: list[Operation]) -> bool:
        """Under `full` a dead-letter queue's ordering indexes come from two streams: its own
        (leases, acks of dead letters) and its queue's (each dead letter's index). The master
        gave them out in one sequence; a member that followed its queue's stream while its
        dead-letter queue's stream was not open yet (a deposed master catching up, say) has
        placed dead letters past an index its own stream still holds. Neither stream can
        then be applied as sent: this member takes both states again from one view of its
        queue's snapshot (as when the dead-letter queue's position left the log) instead of
        stopping the node on the index it cannot take (a chaos run, seed 41, crash-looped
        on it)."""
        core = self.core
        if core.options.strength is not Strength.FULL:
            return False
        if core.record.dead_letter_of is not None:
            behind = next((op.order for op in ops if op.order and op.order < core.record.next_index), None)
            if behind is None:
                return False
            self.resync_source = True
        else:
            dead = core.dead_letter_core
            if dead is None:
                return False
            behind = next((op.dead_letter_index for op in ops if type(op) is DeadLettered
                           and op.dead_letter_index < dead.record.next_index), None)
            if behind is None:
                return False
            self.wipe(core.record.to_json())
        self.dead_letter_resyncs += 1
        return True

    def _report_gap(self) -> None:
        """Ask the master to stream again from what we hold durably: once per position, as
        everything in flight behind a gap shows the same gap."""
        if self._gap_reported_at != self.applied_order:
            self._gap_reported_at = self.applied_order
            self._send(AppendAck(self.core.name, self.incarnation, self.epoch, 0, self.durable_order, True,
                                 self.session))

    def _on_sync_begin(self, begin: SyncBegin) -> None:
        if begin.session != self.session:
            return                      # the answer to an earlier Open
        if begin.snapshot:
            self._begin_snapshot(begin)
            return
        self._transfer = None           # a snapshot cut short that the master does not continue
        if begin.reset:
            if begin.record is None:
                return
            # Our history differs from the master's (an uncommitted suffix of a deposed master,
            # or a pruned log): start from an empty queue and take everything.
            self.resets.append(begin.record)
            self.applied_order = 0
            self.durable_order = 0
            self.digest = EMPTY_DIGEST
            self._recent_digests.clear()
            self.applied.clear()
        elif begin.from_order != self.applied_order + 1:
            return                      # an answer to an older Open; the newer one follows
        self._set_phase(ReplicaPhase.SYNCING)
        self._last_progress_ms = self._now_ms

    def _begin_snapshot(self, begin: SyncBegin) -> None:
        if self.phase is not ReplicaPhase.OPENING:
            return                      # a repeated SyncBegin: the transfer is under way
        transfer = self._transfer
        if begin.resume_after:
            if transfer is not None and transfer.order == begin.snapshot_order \
                    and transfer.next_sequence - 1 == begin.resume_after and transfer.keep_upto == begin.keep_upto:
                transfer.gap_reported_at = 0
                self.snapshots_resumed += 1
                self._set_phase(ReplicaPhase.SYNCING)
                self._last_progress_ms = self._now_ms
            return                      # not the transfer we hold: our next Open sorts it out
        if begin.reset:
            if begin.record is None:
                return
            # Start from an empty instance (the old one's records are erased): until the
            # snapshot is installed and durable this member holds, and reports, nothing.
            self.resets.append(begin.record)
            self.applied_order = self.durable_order = 0
            self.digest = EMPTY_DIGEST
            self._recent_digests.clear()
            self.applied.clear()
        else:
            if begin.keep_upto != self.applied_order or begin.keep_upto > self.durable_order:
                return                  # not what we opened with; our next Open sorts it out
            # Rows past keep_upto may remain from a transfer a crash cut short: drop them.
            self.discards.append(begin.keep_upto)
        self._transfers += 1
        self.snapshot_keep_upto = begin.keep_upto
        self._transfer = _Transfer(begin.snapshot_order, begin.keep_upto, begin.record or {}, self._transfers)
        self._set_phase(ReplicaPhase.SYNCING)
        self._last_progress_ms = self._now_ms

    def _on_snapshot_chunk(self, chunk: SnapshotChunk, now_ms: int) -> None:
        transfer = self._transfer
        if transfer is None or chunk.session != self.session or self.phase is not ReplicaPhase.SYNCING:
            return
        if chunk.sequence < transfer.next_sequence:
            # Resent because our acknowledgement was lost: say it again (a chunk not stored
            # yet is acknowledged when it is).
            if transfer.durable_sequence == transfer.next_sequence - 1:
                self._send(SnapshotAck(self.core.name, self.incarnation, self.epoch, self.session,
                                       transfer.durable_sequence))
            return
        if chunk.sequence > transfer.next_sequence:
            # One before it was lost or overtaken: say where we are, once per position, and
            # the master sends again from there.
            if transfer.gap_reported_at != transfer.next_sequence:
                transfer.gap_reported_at = transfer.next_sequence
                self._send(SnapshotAck(self.core.name, self.incarnation, self.epoch, self.session,
                                       transfer.durable_sequence))
            return
        try:
            rows = decode_rows(chunk.rows)
        except MessageError:
            return                      # never applied; resent, or the transfer starts over
        transfer.state_hash = fold_rows(transfer.state_hash, chunk.rows)
        transfer.next_sequence += 1
        self._last_progress_ms = now_ms
        if rows:
            self.snapshot_rows.extend(rows)
        # Acknowledged once stored (snapshot_rows_durable): the master's window of chunks in
        # flight then bounds what waits in this member's memory for its disk.
        self.snapshot_rows_through = (transfer.number, chunk.sequence)
        if not chunk.last:
            return
        self._transfer = None
        if chunk.state_hash != transfer.state_hash or chunk.order != transfer.order:
            # What arrived is not what the master sent: take it all again, from empty.
            self.snapshot_rows.clear()
            self.resets.append(self.core.record.to_json() if not transfer.record else transfer.record)
            self.applied_order = self.durable_order = 0
            self.digest = EMPTY_DIGEST
            self.start(now_ms)
            return
        self.installs.append(SnapshotInstall(chunk.order, chunk.digest, transfer.record, transfer.keep_upto,
                                             chunk.dead_letter))
        self.applied_order = chunk.order
        self.digest = chunk.digest
        self._recent_digests.clear()
        self._recent_digests.append((chunk.order, chunk.digest))
        self.snapshots_installed += 1

    @property
    def log_floor(self) -> int:
        """This member's op log may lose records below this: what the master committed and
        its own storage recorded (a deposed master returns at or above it, so if this member
        is promoted it catches the other up from the log), and this member holds."""
        if self.phase is not ReplicaPhase.FOLLOWING:
            return 0           # a transfer compares digests at orders it has not named yet
        return min(self.visible_order, self.master_recorded_commit)

    @property
    def receiving_snapshot(self) -> bool:
        return self._transfer is not None

    @property
    def snapshot_order(self) -> int | None:
        """The order of the snapshot being received (kept across a broken link), if any."""
        return self._transfer.order if self._transfer is not None else None

    def wipe(self, record: dict[str, Any]) -> None:
        """Start over from an empty instance and a new Open (a dead-letter queue's member asked
        for this queue's snapshot, which carries both states from one view)."""
        self.resets.append(record)
        self.applied_order = self.durable_order = 0
        self.digest = EMPTY_DIGEST
        self._recent_digests.clear()
        self.applied.clear()
        self.link_down()          # the driver opens again

    def rebase(self, order: int, digest: bytes) -> None:
        """A dead-letter queue's state was installed at `order` with its queue's snapshot (or
        wiped, awaiting it): follow on from there; the driver opens when the queue is synced."""
        self.applied_order = self.durable_order = order
        self.digest = digest
        self._recent_digests.clear()
        self.applied.clear()
        self.link_down()

    def _on_sync_end(self, end: SyncEnd, now_ms: int) -> None:
        if self.phase is not ReplicaPhase.SYNCING or self._transfer is not None:
            return
        ours = self._digest_at(end.order)
        if ours is None:
            return                      # not there yet: the master repeats SyncEnd on our acks
        if ours != end.digest:
            # Same index, different history: wipe and take everything from the master.
            self.resets.append(self.core.record.to_json())
            self.applied_order = 0
            self.durable_order = 0
            self.digest = EMPTY_DIGEST
            self._recent_digests.clear()
            self.start(now_ms)
            return
        self._set_phase(ReplicaPhase.FOLLOWING)
        self.last_epoch = self.epoch
        self._send(OpenAck(self.core.name, self.incarnation, self.epoch, end.order, self.session))

    # --- durability and relays ------------------------------------------------------------
    def snapshot_rows_durable(self, transfer_number: int, sequence: int) -> None:
        """The rows of the transfer's chunks up to `sequence` are in local storage."""
        transfer = self._transfer
        if transfer is None or transfer.number != transfer_number or sequence <= transfer.durable_sequence:
            return               # a transfer that ended or started over since: nothing to say
        transfer.durable_sequence = sequence
        if self.phase is ReplicaPhase.SYNCING:
            self._send(SnapshotAck(self.core.name, self.incarnation, self.epoch, self.session, sequence))

    def local_durable_to(self, order: int) -> None:
        """Everything applied up to `order` is in local storage: tell the master."""
        if order <= self.durable_order:
            return
        self.durable_order = order
        if self.gates_visibility:
            self.core.visible_upto = self.visible_order
        while self._recent_digests and self._recent_digests[0][0] <= order:
            self._recent_digests.popleft()
        if self.phase is ReplicaPhase.OPENING:
            # The Open names our position and the master decides from it what we share: an
            # ack of a commit that was under way (a deposed master's suffix, say) would tell
            # it we hold, in this session, what it is about to replace.
            return
        self._send(AppendAck(self.core.name, self.incarnation, self.epoch, 0, order, session=self.session))

    def relay(self, request_id: int, request: list[Any]) -> None:
        self._send(RelayRequest(self.core.name, self.incarnation, self.epoch, request_id, request))

    # --- internals -------------------------------------------------------------------------
    def _localized(self, op: Operation) -> Operation:
        """Queue ids in operations are the master's node-local storage ids: use ours. (The
        encoded bytes stay as the master sent them: both members digest and log the same.)"""
        op.queue_id = self.core.queue_id
        if type(op) is DeadLettered:
            dead = self.core.dead_letter_core
            if dead is None:
                raise InvariantViolation(f"queue {self.core.name} dead-letters but has no dead-letter queue here")
            op.dead_letter_queue_id = dead.queue_id
        return op

    def _digest_at(self, order: int) -> bytes | None:
        if order == self.applied_order:
            return self.digest
        for recent_order, digest in self._recent_digests:
            if recent_order == order:
                return digest
        if order > self.applied_order:
            return None
        return self.oplog.digest_at(self.core.queue_id, order)

    def _send(self, message: Message) -> None:
        self.outbox.append((self.master_id, message))

    def _set_phase(self, phase: ReplicaPhase) -> None:
        if phase is not self.phase and phase not in PHASE_TRANSITIONS[self.phase]:
            return   # FENCED is final
        self.phase = phase
