"""The master role of one queue's pair: ordering-index replication to the replica.

The queue core decides (which message, which lease) and gives each replicated operation the
next ordering index; this role streams those operations to the replica in order, learns from
the replica's acknowledgements which index it holds durably, and computes the commit point:
only operations at or below `commit_order` may be answered to clients or be visible to them
(docs/ARCHITECTURE.md, Guarantee 1 and "Queue pairs"). It runs state transfer for a (re)joining replica: from the op log when
the log still reaches back to the replica's position and their histories agree, otherwise by
snapshot (`replication/snapshot.py`); it says how far the op log may be truncated
(`log_floor`), and asks the membership layer to record the replica in or out of sync.

    commit_order = min(local_durable, replica_durable)   while the membership layer records
                                                          the replica in sync (or a change of
                                                          that record is pending)
                 = local_durable                          once it records "out of sync"
                                                          (degraded mode, min_in_sync 1)

Pure: no I/O, no clock; time arrives as `now_ms`. Effects accumulate in `outbox` (messages
for the replica) and `proposals` (for the membership layer); the driver drains both after
every call, after persisting what the core decided (persist, then send).
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, replace

from replication.digest import fold_encoded
from replication.messages import (
    Append,
    AppendAck,
    Message,
    Open,
    OpenAck,
    Refused,
    RelayRequest,
    RelayResult,
    SnapshotAck,
    SnapshotChunk,
    SyncBegin,
    SyncEnd,
    encode_entry,
)
from replication.operations import Enqueued, Operation
from replication.oplog import LogEntry, OpLogReader, runs
from replication.options import Strength
from replication.queue_core import QueueCore
from replication.snapshot import (
    EMPTY_STATE_HASH,
    SnapshotSource,
    SnapshotView,
    SnapshotViewLost,
    encode_rows,
    fold_rows,
)
from wire.errors import E_NOT_ENOUGH_REPLICAS, E_NOT_MASTER, QueueError


class ReplicaProgress(enum.StrEnum):
    """What the master knows of its replica's stream (not the membership record)."""
    PROBING = "probing"            # no Open yet: nothing is streamed
    CATCHING_UP = "catching_up"    # streaming what it lacks; live operations follow in order
    CAUGHT_UP = "caught_up"        # its digest matched at the end of the transfer
    FENCED = "fenced"              # a newer epoch exists: this member is no longer master


PROGRESS_TRANSITIONS: dict[ReplicaProgress, frozenset[ReplicaProgress]] = {
    ReplicaProgress.PROBING: frozenset({ReplicaProgress.CATCHING_UP, ReplicaProgress.FENCED}),
    ReplicaProgress.CATCHING_UP: frozenset({ReplicaProgress.CATCHING_UP, ReplicaProgress.CAUGHT_UP,
                                            ReplicaProgress.PROBING, ReplicaProgress.FENCED}),
    ReplicaProgress.CAUGHT_UP: frozenset({ReplicaProgress.CATCHING_UP, ReplicaProgress.PROBING,
                                          ReplicaProgress.FENCED}),
    ReplicaProgress.FENCED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class ReplicationLimits:
    replica_lag_max: int = 100_000        # operations behind before the replica is out of sync
    replica_lag_max_ms: int = 2_000       # silence (with operations outstanding) before the same
    resend_after_ms: int = 1_000          # no progress this long: stream again from its durable point
                                          # (below replica_lag_max_ms: a resend comes before giving up)
    window_max: int = 20_000              # operations sent and not yet acknowledged
    window_bytes_max: int = 4 << 20       # their encoded bytes: below the peer link's send queue,
                                          # so streaming never overruns it (an overrun is a loss)
    append_batch_max: int = 1_000         # operations per Append message
    open_retry_ms: int = 1_000            # a replica repeats Open this often until answered
    snapshot_chunk_bytes_max: int = 256 << 10   # payload bytes per SnapshotChunk
    snapshot_chunks_in_flight_max: int = 16     # chunks sent and not yet stored by the replica (below
                                                # the peer link's send queue, like window_bytes_max)
    sync_view_max_ms: int = 60_000        # a snapshot's read view is dropped after this long without
                                          # progress (it keeps LMDB from reusing pages); a new one follows
    log_retain_max_bytes: int = 64 << 20  # op log kept for a replica recorded out of sync; past
                                          # it the log is truncated and the replica gets a snapshot


APPEND_BYTES_MAX = 1 << 20      # encoded entries per Append beyond its first: a peer link's send
                                # queue must take it whole (an overrun is a loss, and a resend)
RESYNC = "E_RESYNC"     # Refused code: the replica's position is gone from the log: Open again
STORAGE_FULL = "E_STORAGE_FULL"   # Refused code from a replica: its storage is full, it follows no more


@dataclass(frozen=True, slots=True)
class InSyncProposal:
    """Ask the membership layer to record the replica in (or out of) sync, as a
    compare-and-set on the record it expects (docs/ARCHITECTURE.md, "Queue pairs": compare-and-set)."""
    queue: str
    epoch: int
    replica: str
    in_sync: bool
    expected_in_sync: bool


def is_replicated(op: Operation, strength: Strength) -> bool:
    """Under `producer` only enqueues are replicated; under `full` everything with an order."""
    return type(op) is Enqueued or (strength is Strength.FULL and op.order > 0)


class MasterRole:
    def __init__(self, core: QueueCore, oplog: OpLogReader, *, node_id: str, replica_id: str, epoch: int,
                 incarnation: int, recorded_in_sync: bool, last_order: int, digest: bytes,
                 limits: ReplicationLimits | None = None, durable_order: int | None = None,
                 replica_durable: int = 0, snapshots: SnapshotSource | None = None,
                 log_start: int = 0, replica_returns_from: int | None = None) -> None:
        """`durable_order`: what is durable here when it is below `last_order` (a member taking
        this role with operations staged but not yet committed); `replica_durable`: what the
        replica is known to hold (a promoted replica knows its old commit point was on both)."""
        self.core = core
        self.oplog = oplog
        self.snapshots = snapshots
        self.node_id = node_id
        self.replica_id = replica_id
        self.epoch = epoch
        self.incarnation = incarnation
        self.limits = limits or ReplicationLimits()
        self.recorded_in_sync = recorded_in_sync
        self.progress = ReplicaProgress.PROBING
        self.last_order = last_order          # highest replicated order decided here
        self.digest = digest                  # rolling digest after last_order
        self.local_durable = last_order if durable_order is None else durable_order
        self.replica_durable = min(replica_durable, last_order)
        self.sent_order = 0                   # highest order streamed to the replica
        self._sync_target = 0                 # the order SyncEnd will vouch for
        # Every log entry after `_recent_floor` is in memory; older ones come from the op log.
        self._recent: collections.deque[tuple[int, int, bytes]] = collections.deque()   # (first, last, encoded)
        self._recent_floor = last_order
        self._pending_proposal: InSyncProposal | None = None
        self._sent_commit = 0                 # the commit point the replica was last told
        self.recorded_commit = 0              # the commit point this member's storage holds (see Append)
        self._sent_recorded_commit = 0
        # Where the replica is expected to open from, until it does: a deposed master returns
        # from the commit point its own storage recorded, which may lie below the one it reached.
        self._replica_returns_from = self.replica_durable if replica_returns_from is None \
            else min(replica_returns_from, self.replica_durable)
        self._session = -1                    # the replica's current Open (see ReplicaRole.session)
        self._last_rewind_ms = -(10**12)      # when the stream last went back after a gap
        self._in_flight: collections.deque[tuple[int, int]] = collections.deque()   # (last order, bytes)
        self._in_flight_bytes = 0
        self.rewinds = 0                      # counters for the queue statistics
        self.appends_sent = 0
        self._last_progress_ms = 0
        self._last_attempt_ms = 0             # the last resend or repeated SyncEnd
        self._resync_sent_ms: int | None = None   # a RESYNC awaiting the replica's Open
        self._probing_since_ms: int | None = None  # since when no replica has opened (see tick)
        self.replica_storage_full = False     # the replica said its storage is full (until it opens)
        self.outbox: list[tuple[str, Message]] = []
        self.proposals: list[InSyncProposal] = []
        self.relayed: list[RelayRequest] = []    # requests from the replica's clients, for the driver
        self.to_log: list[LogEntry] = []      # new log entries with their digests: the op log's rows
        # The op log holds every order from `log_start` on (its row at log_start may be a
        # snapshot's marker); below it, records were truncated (see log_floor).
        self.log_start = log_start
        self._log_bytes: collections.deque[tuple[int, int]] = collections.deque()   # (order, bytes through it)
        self._log_bytes_total = 0
        self._snapshot: SnapshotView | None = None    # a transfer in progress, and its state
        self._snapshot_opened_ms = 0
        self._snapshot_keep_upto = 0
        self._snapshot_sequence = 0
        self._snapshot_hash = EMPTY_STATE_HASH
        self._snapshot_done = False                   # every row sent (the last chunk too)
        self._snapshot_unacked: collections.deque[SnapshotChunk] = collections.deque()
        self.snapshots_sent = 0
        self.gates_visibility = True   # False for a dead-letter queue: see qserver/cluster/pairs.py
        core.visible_upto = self.commit_order

    # --- commit point ----------------------------------------------------------------------
    @property
    def commit_order(self) -> int:
        if self.recorded_in_sync or self._pending_proposal is not None:
            return min(self.local_durable, self.replica_durable)
        return self.local_durable

    def check_writable(self) -> None:
        """Refuse before anything is persisted (docs/ARCHITECTURE.md, Guarantee 8: E_NOT_ENOUGH_REPLICAS)."""
        if self.progress is ReplicaProgress.FENCED:
            raise QueueError(E_NOT_MASTER, f"queue {self.core.name}: a newer epoch than {self.epoch} exists")
        if self.core.options.min_in_sync < 2:
            return
        leaving = self._pending_proposal is not None and not self._pending_proposal.in_sync
        if not self.recorded_in_sync or leaving:
            why = " (its storage is full)" if self.replica_storage_full else ""
            raise QueueError(E_NOT_ENOUGH_REPLICAS, f"queue {self.core.name} needs its replica {self.replica_id} in "
                                                    f"sync{why}; nothing was stored")

    # --- operations decided by the core ----------------------------------------------------
    def replicate(self, ops: list[Operation], now_ms: int) -> None:
        """Take the operations the core just decided (in order) into the replicated stream:
        as log entries of many operations each, encoded and digested once per entry."""
        strength = self.core.options.strength
        replicated = [op for op in ops if is_replicated(op, strength)]
        for run in runs(replicated):
            encoded = encode_entry(run)
            self.digest = fold_encoded(self.digest, encoded)
            self.last_order = run[-1].order
            self._recent.append((run[0].order, self.last_order, encoded))
            self.to_log.append(LogEntry(run, self.digest, encoded))
            self._log_bytes_total += len(encoded)
        if replicated:
            self._log_bytes.append((self.last_order, self._log_bytes_total))
        # Memory holds about replica_lag_max operations; the op log serves a lagging replica.
        while self._recent and self._recent[0][1] < self.last_order - self.limits.replica_lag_max:
            self._recent_floor = self._recent.popleft()[1]
        self._pump(now_ms)

    def local_durable_to(self, order: int, now_ms: int) -> None:
        self.local_durable = max(self.local_durable, order)
        self._pump(now_ms)

    # --- messages from the replica ---------------------------------------------------------
    def receive(self, message: Message, now_ms: int) -> None:
        if message.epoch < self.epoch:
            self._send(Refused(self.core.name, self.incarnation, self.epoch, "E_FENCED",
                               f"epoch {message.epoch} is older than {self.epoch}"))
            return
        if message.epoch > self.epoch:
            self._set_progress(ReplicaProgress.FENCED)   # deposed: a newer master exists
            return
        if isinstance(message, Refused):
            if message.code == STORAGE_FULL:
                self._on_replica_full()
        elif isinstance(message, AppendAck):
            self._on_ack(message, now_ms)
        elif isinstance(message, Open):
            self._on_open(message, now_ms)
        elif isinstance(message, OpenAck):
            self._on_open_ack(message, now_ms)
        elif isinstance(message, SnapshotAck):
            self._on_snapshot_ack(message, now_ms)
        elif isinstance(message, RelayRequest):
            self.relayed.append(message)

    def _on_ack(self, ack: AppendAck, now_ms: int) -> None:
        if ack.session != self._session:
            return                          # about an earlier session: the replica has moved on
        if ack.durable_order > self.replica_durable:
            self.replica_durable = min(ack.durable_order, self.last_order)
            self._last_progress_ms = now_ms
            while self._recent and self._recent[0][1] <= self.replica_durable:
                self._recent_floor = self._recent.popleft()[1]
        if (ack.gap or ack.durable_order < self.replica_durable) and self.sent_order > self.replica_durable \
                and self._snapshot is None and now_ms - self._last_rewind_ms >= self.limits.resend_after_ms // 4:
            self.sent_order = self.replica_durable   # stream again from what it holds
            self._last_rewind_ms = now_ms
            self.rewinds += 1
        if self.progress is ReplicaProgress.CATCHING_UP and self.replica_durable >= self._sync_target \
                and self._snapshot is None:
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
        self._pump(now_ms)

    def _on_replica_full(self) -> None:
        """The replica's storage is full: it takes nothing more until it opens again (once it
        has room). Streaming to it would only fill its send queue; waiting replica_lag_max_ms
        for its silence would hold every answer that long. It is recorded out of sync now:
        this master goes on alone (under min_in_sync 2 it refuses writes instead)."""
        self.replica_storage_full = True
        self._end_snapshot()
        self._set_progress(ReplicaProgress.PROBING)
        if self.recorded_in_sync:
            self._propose(False)

    def _on_open(self, request: Open, now_ms: int) -> None:
        """A replica (re)joins: stream only what it lacks from the log, or its state by snapshot
        when the log no longer reaches back to it or the histories differ."""
        self._resync_sent_ms = None
        self.replica_storage_full = False
        if self._resume_snapshot(request, now_ms):
            return
        self._end_snapshot()
        ours = self._digest_at(request.last_order) \
            if self.log_start <= request.last_order <= self.last_order else None
        self._session = request.session
        self._sent_commit = self._sent_recorded_commit = 0   # a restarted replica knows no commit point yet
        # A member starting from nothing takes a queue with a dead-letter queue by snapshot
        # under `full`: the dead-letter queue's state (whose arrivals are in this stream, and
        # its own consumption in its own) must come from the same view.
        fresh_with_dead_letters = request.last_order == 0 and self.snapshots is not None \
            and self.core.dead_letter_core is not None and self.core.options.strength is Strength.FULL
        if ours is not None and ours == request.digest and not fresh_with_dead_letters:
            self._last_progress_ms = now_ms
            self._send(SyncBegin(self.core.name, self.incarnation, self.epoch, request.last_order + 1, False, None,
                                 request.session))
            self._start_transfer(request.last_order, now_ms)
            return
        if self.snapshots is None or self.core.record.dead_letter_of is not None:
            # A dead-letter queue's state travels with its queue's snapshot (same read view):
            # the replica opens that queue again, wiped.
            self._send(Refused(self.core.name, self.incarnation, self.epoch, RESYNC,
                               f"order {request.last_order} is not in the log (it starts at {self.log_start})"))
            return
        self._open_snapshot(request, now_ms)

    def _start_transfer(self, start: int, now_ms: int) -> None:
        self.replica_durable = start
        self.sent_order = start
        self._sync_target = max(self.last_order, start)
        self._set_progress(ReplicaProgress.CATCHING_UP)
        if self.replica_durable >= self._sync_target:
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
        self._pump(now_ms)

    def _open_snapshot(self, request: Open, now_ms: int) -> None:
        """Cut a snapshot from one read view and start streaming it. A `producer` member
        whose whole history is committed keeps its own state (and consumers' acks) and takes
        only the messages above it; any other member starts from empty."""
        if self.snapshots is None:
            return
        full = self.core.options.strength is Strength.FULL
        # Only a member behind the log's start is taken at its word: within the log, a digest
        # that differs at its order means its history does (a deposed master's suffix).
        keep_upto = request.last_order if not full and 0 < request.last_order <= request.committed_order \
            and request.last_order < self.log_start else 0
        # What the replica holds now, whether or not a view can be cut at once: its commit point
        # must not count on what it no longer has (it goes out of sync if this lasts).
        self.replica_durable = min(self.replica_durable, keep_upto)
        dead = self.core.dead_letter_core
        view = self.snapshots.open_snapshot(
            self.core.name, self.core.queue_id, consumption=full, after_index=keep_upto,
            dead_letter=(dead.name, dead.queue_id) if full and dead is not None else None)
        if view is None:
            return
        if view.order > self.commit_order or view.order < keep_upto:
            # The view holds operations not yet committed (the replica is recorded in sync and
            # behind): never transfer those. The replica repeats its Open.
            view.close()
            return
        self._snapshot, self._snapshot_opened_ms, self._snapshot_keep_upto = view, now_ms, keep_upto
        self._last_progress_ms = now_ms
        self._snapshot_sequence, self._snapshot_hash, self._snapshot_done = 0, EMPTY_STATE_HASH, False
        self.snapshots_sent += 1
        self._send(SyncBegin(self.core.name, self.incarnation, self.epoch, view.order + 1, keep_upto == 0,
                             view.record if keep_upto == 0 else None, request.session, True, view.order, keep_upto))
        self.replica_durable = keep_upto
        self.sent_order = view.order          # live operations follow once the snapshot is installed
        self._sync_target = max(self.last_order, view.order)
        self._set_progress(ReplicaProgress.CATCHING_UP)
        self._pump(now_ms)

    def _resume_snapshot(self, request: Open, now_ms: int) -> bool:
        """The replica was taking this master's snapshot when its link broke, and this master
        still holds the read view: go on after the last chunk the replica holds, from the
        same view (a transfer never mixes views). False: the Open is answered as any other."""
        view = self._snapshot
        if view is None or request.snapshot_order != view.order or request.snapshot_received < 1:
            return False
        unacked = self._snapshot_unacked
        acknowledged = unacked[0].sequence - 1 if unacked else self._snapshot_sequence
        if not acknowledged <= request.snapshot_received <= self._snapshot_sequence:
            return False
        self._session = request.session
        self._sent_commit = self._sent_recorded_commit = 0
        self._snapshot_unacked = collections.deque(replace(chunk, session=request.session) for chunk in unacked
                                                   if chunk.sequence > request.snapshot_received)
        self._last_progress_ms = self._last_attempt_ms = now_ms
        self._send(SyncBegin(self.core.name, self.incarnation, self.epoch, view.order + 1, False, None,
                             request.session, True, view.order, self._snapshot_keep_upto,
                             request.snapshot_received))
        for chunk in self._snapshot_unacked:
            self._send(chunk)
        self._sync_target = max(self.last_order, view.order)
        self._set_progress(ReplicaProgress.CATCHING_UP)
        self._pump(now_ms)
        return True

    @property
    def snapshot_order(self) -> int | None:
        """The order of the snapshot being transferred (the log must keep it), if any."""
        return None if self._snapshot is None else self._snapshot.order

    @property
    def snapshot_dead_letter_order(self) -> int | None:
        """The dead-letter queue's order in that snapshot (its log must keep it), if any."""
        if self._snapshot is None or self._snapshot.dead_letter is None:
            return None
        return int(self._snapshot.dead_letter[0])

    def _end_snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None
        self._snapshot_unacked.clear()

    def _pump_snapshot(self, now_ms: int) -> bool:
        """Send snapshot chunks within the window; True while the snapshot holds back the log
        stream (until the replica acknowledges the installed state at its order)."""
        view = self._snapshot
        if view is None:
            return False
        if self.replica_durable >= view.order and self._snapshot_done:
            self._end_snapshot()               # installed: follow the log from here
            if self.replica_durable >= self._sync_target:
                self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                                   self._digest_at(self._sync_target)))
            return False
        if now_ms - max(self._snapshot_opened_ms, self._last_progress_ms) > self.limits.sync_view_max_ms:
            # A view held by a transfer that stopped moving keeps LMDB from reusing pages: drop
            # it; the replica, hearing nothing, opens again and gets a snapshot from a new view.
            self._end_snapshot()
            self._set_progress(ReplicaProgress.PROBING)
            return True
        limits = self.limits
        while not self._snapshot_done and len(self._snapshot_unacked) < limits.snapshot_chunks_in_flight_max:
            try:
                rows = view.next_rows(limits.snapshot_chunk_bytes_max)
            except SnapshotViewLost:
                # A map growth ended the view's read transaction (issue 32, item 8): the rest of
                # that state is gone, and rows from a newer view would not match the order and
                # digest this one claims. The transfer starts over: the replica opens again and a
                # new snapshot's SyncBegin erases what this one stored (docs/PROTOCOL.md "The
                # bounded op log and snapshots").
                self._end_snapshot()
                self._set_progress(ReplicaProgress.PROBING)
                self._send_resync(now_ms)
                return True
            encoded = encode_rows(rows)
            self._snapshot_sequence += 1
            self._snapshot_hash = fold_rows(self._snapshot_hash, encoded)
            last = not rows
            chunk = SnapshotChunk(self.core.name, self.incarnation, self.epoch, self._session, self._snapshot_sequence,
                                  encoded, last, view.order if last else 0, view.digest if last else b"",
                                  self._snapshot_hash if last else b"", view.dead_letter if last else None)
            self._snapshot_done = last
            self._snapshot_unacked.append(chunk)
            self._send(chunk)
        return True

    def _on_snapshot_ack(self, ack: SnapshotAck, now_ms: int) -> None:
        if ack.session != self._session:
            return
        unacked = self._snapshot_unacked
        progressed = False
        while unacked and unacked[0].sequence <= ack.sequence:
            unacked.popleft()
            progressed = True
        if progressed:
            self._last_progress_ms = now_ms
        elif unacked and ack.sequence == unacked[0].sequence - 1 \
                and now_ms - self._last_rewind_ms >= self.limits.resend_after_ms // 4:
            # The replica is missing the first chunk in flight (lost, or overtaken): resend.
            self._last_rewind_ms = now_ms
            for chunk in unacked:
                self._send(chunk)
        self._pump(now_ms)

    def _on_open_ack(self, ack: OpenAck, now_ms: int) -> None:
        if self.progress is not ReplicaProgress.CATCHING_UP or ack.order != self._sync_target \
                or ack.session != self._session:
            return
        self._set_progress(ReplicaProgress.CAUGHT_UP)
        # In sync means the replica holds every index acknowledged so far. Acknowledging alone
        # meanwhile, this master may have answered for live operations past the transfer's
        # end that the replica has not yet made durable; a failover right after the record
        # would lose them. Until it has them, `tick` proposes once it does.
        if not self.recorded_in_sync and self.replica_durable >= self.commit_order:
            self._propose(True)

    # --- membership ------------------------------------------------------------------------
    @property
    def proposal_pending(self) -> bool:
        return self._pending_proposal is not None

    @property
    def caught_up(self) -> bool:
        """The replica holds every operation decided here (a handoff may commit)."""
        return self.progress is ReplicaProgress.CAUGHT_UP and self.replica_durable >= self.last_order \
            and self.local_durable >= self.last_order

    def membership_decided(self, in_sync: bool) -> None:
        """The membership layer's record after a proposal (accepted or not)."""
        self._pending_proposal = None
        self.recorded_in_sync = in_sync

    def _propose(self, in_sync: bool) -> None:
        if self._pending_proposal is not None:
            return
        proposal = InSyncProposal(self.core.name, self.epoch, self.replica_id, in_sync, self.recorded_in_sync)
        self._pending_proposal = proposal
        self.proposals.append(proposal)

    # --- time ------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Nothing for `tick` to do until a message, a write or a commit comes (the driver then
        ticks the role again): the replica, recorded in sync, holds everything and has been
        told both commit points; no transfer, no proposal, no probe. Or it waits for its
        replica's Open (the replica's node is down, or the link is): the link coming back, a
        message or a write wakes it, and nothing is timed unless it must record the replica out
        of sync (recorded in sync with writes outstanding, or under min_in_sync 2) or repeat a
        RESYNC. After a failover of thousands of queues, their new masters all wait so for the
        node that died: ticking each every 50 ms took most of the loop (issue 31)."""
        if self.progress is ReplicaProgress.PROBING:
            outstanding = self.last_order > self.replica_durable
            return self._pending_proposal is None and self._resync_sent_ms is None \
                and self._snapshot is None and not self._snapshot_unacked \
                and (not outstanding or self.sent_order <= self.replica_durable) \
                and (not self.recorded_in_sync or (not outstanding and self.core.options.min_in_sync < 2))
        return self.progress is ReplicaProgress.CAUGHT_UP and self.recorded_in_sync \
            and self._pending_proposal is None and self._probing_since_ms is None \
            and self.replica_durable >= self.last_order and self.sent_order >= self.last_order \
            and self._snapshot is None and not self._snapshot_unacked \
            and self.commit_order <= self._sent_commit and self.recorded_commit <= self._sent_recorded_commit

    def tick(self, now_ms: int) -> None:
        outstanding = self.last_order > self.replica_durable
        silent_ms = now_ms - self._last_progress_ms
        lagging = self.last_order - self.replica_durable > self.limits.replica_lag_max
        if self.recorded_in_sync and outstanding and (lagging or silent_ms > self.limits.replica_lag_max_ms):
            self._propose(False)
        if self.progress is not ReplicaProgress.PROBING:
            self._probing_since_ms = None
        elif self._probing_since_ms is None:
            self._probing_since_ms = now_ms
        elif self.recorded_in_sync and self.core.options.min_in_sync >= 2 \
                and now_ms - self._probing_since_ms > self.limits.replica_lag_max_ms:
            # A replica gone (its link down, or it never opened) with nothing outstanding is
            # recorded out of sync too under min_in_sync 2: the next write is then refused
            # before it is stored, instead of being stored here and left without an answer.
            self._propose(False)
        # Resends and repeated SyncEnds are paced from the last attempt; the silence that
        # records the replica out of sync counts from its last real progress only.
        since_attempt_ms = min(silent_ms, now_ms - self._last_attempt_ms)
        if self._snapshot is not None and self.progress is not ReplicaProgress.CATCHING_UP \
                and now_ms - max(self._snapshot_opened_ms, self._last_progress_ms) > self.limits.sync_view_max_ms:
            self._end_snapshot()                    # kept for a resume that never came
        if self._snapshot_unacked and self.progress is ReplicaProgress.CATCHING_UP \
                and since_attempt_ms > self.limits.resend_after_ms:
            self._last_attempt_ms = now_ms          # a chunk or its acknowledgement was lost
            for chunk in self._snapshot_unacked:
                self._send(chunk)
        if outstanding and self._snapshot is None and since_attempt_ms > self.limits.resend_after_ms \
                and self.sent_order > self.replica_durable:
            self.sent_order = self.replica_durable   # an Append was lost with a broken link
            self._last_attempt_ms = now_ms
            self.rewinds += 1
        if self.progress is ReplicaProgress.CAUGHT_UP and not self.recorded_in_sync \
                and self.replica_durable >= self.last_order:
            # Recorded out of sync after a silence, it has since caught up in the same session.
            self._propose(True)
        if self.progress is ReplicaProgress.CATCHING_UP and self.replica_durable >= self._sync_target \
                and self._snapshot is None and since_attempt_ms > self.limits.resend_after_ms:
            # SyncEnd (or the replica's OpenAck) was lost: vouch for the transfer again.
            self._last_attempt_ms = now_ms
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
        if self.progress is ReplicaProgress.PROBING and self._resync_sent_ms is not None \
                and now_ms - self._resync_sent_ms > self.limits.resend_after_ms:
            self._send_resync(now_ms)
        self._pump(now_ms)

    def answer_relay(self, request: RelayRequest, outcomes: list[object]) -> None:
        """The driver ran a request the replica relayed: each outcome is the ordering
        index that places it (after the operation itself in the stream), or [code, message]."""
        self._send(RelayResult(self.core.name, self.incarnation, self.epoch, request.request_id, list(outcomes)))

    def rebind(self, core: QueueCore) -> None:
        """The queue's core was rebuilt from storage after a batch that did not reach this
        role's stream could not be stored: go on with it."""
        self.core = core
        if self.gates_visibility:
            core.visible_upto = self.commit_order

    def resync_replica(self, now_ms: int) -> None:
        """This role was rebuilt from storage after a batch could not be stored (the engine's
        abandon), and its replica, following the role it replaces, may hold operations this
        member lost: it opens again (RESYNC, repeated until its Open comes), and the digests
        decide what it keeps."""
        if self.progress is ReplicaProgress.PROBING:
            self._send_resync(now_ms)

    def link_down(self, *, going_away: bool = False) -> None:
        """The peer link broke: the replica must Open again before anything is streamed. A
        snapshot under way keeps its read view, so that the Open may resume it, until
        `sync_view_max_ms` pass without progress (see tick). `going_away`: the replica's node
        said it stops (an orderly stop, the last step of a drain in a rolling upgrade): it is
        recorded out of sync now rather than after `replica_lag_max_ms` of silence, so writes
        that need it pause for a map commit, not for the lag bound (recording a replica out of
        sync is always safe: it only stops counting on it)."""
        self._resync_sent_ms = None       # the replica opens again once the link is back
        if self.progress is not ReplicaProgress.FENCED:
            self._set_progress(ReplicaProgress.PROBING)
            if going_away and self.recorded_in_sync:
                self._propose(False)

    # --- the bounded log -------------------------------------------------------------------
    @property
    def log_floor(self) -> int:
        """Op-log records below this order may be deleted (docs/ARCHITECTURE.md, "Queue pairs": bounded log): it
        is at most the commit point and the order of a snapshot being transferred, and at most
        the replica's durable order while the replica is recorded in sync (it may need any
        record after that to catch up). A replica recorded out of sync holds the log back only
        within `log_retain_max_bytes`; past that, it gets a snapshot when it returns."""
        floor = min(self.commit_order, self.local_durable)
        if self._snapshot is not None:
            floor = min(floor, self._snapshot.order)
        holds = self.replica_durable if self._session >= 0 else self._replica_returns_from
        if self.progress is ReplicaProgress.CATCHING_UP:
            holds = min(holds, self._sync_target)     # SyncEnd vouches for the digest there
        if self.recorded_in_sync or self._pending_proposal is not None:
            floor = min(floor, holds)
        else:
            floor = min(floor, max(holds, self._retain_floor()))
        return max(floor, self.log_start)

    def _retain_floor(self) -> int:
        """The lowest order from which the log stays within log_retain_max_bytes (0: all of
        it does, as far as this role has seen it grow; it does not know older rows' sizes)."""
        sizes, total, budget = self._log_bytes, self._log_bytes_total, self.limits.log_retain_max_bytes
        while len(sizes) > 1 and total - sizes[1][1] > budget:
            sizes.popleft()          # the entry after it is over the budget too: never needed again
        if len(sizes) > 1 and total - sizes[0][1] > budget:
            return sizes[1][0]
        return 0

    def truncated_to(self, floor: int) -> None:
        """The driver deleted (or is deleting, in this batch) every record below `floor`."""
        self.log_start = max(self.log_start, floor)
        while len(self._log_bytes) > 1 and self._log_bytes[1][0] <= floor:
            self._log_bytes.popleft()

    # --- streaming -------------------------------------------------------------------------
    def _pump(self, now_ms: int) -> None:
        if self.gates_visibility:
            self.core.visible_upto = self.commit_order
        if self.progress not in (ReplicaProgress.CATCHING_UP, ReplicaProgress.CAUGHT_UP):
            return
        if self._pump_snapshot(now_ms) or self._lost_from_log(now_ms):
            return
        limits = self.limits
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] <= self.replica_durable:
            self._in_flight_bytes -= in_flight.popleft()[1]
        if self.sent_order <= self.replica_durable:       # a rewind: nothing is in flight any more
            in_flight.clear()
            self._in_flight_bytes = 0
        while self.sent_order < self.last_order and self.sent_order - self.replica_durable < limits.window_max \
                and self._in_flight_bytes < limits.window_bytes_max:
            entries = self._next_entries(min(limits.append_batch_max,
                                             limits.window_max - (self.sent_order - self.replica_durable)))
            if not entries:
                break
            size = sum(len(encoded) for _, _, encoded in entries)
            in_flight.append((entries[-1][1], size))
            self._in_flight_bytes += size
            self._sent_commit = self.commit_order
            self._sent_recorded_commit = self.recorded_commit
            self.appends_sent += 1
            self._send(Append(self.core.name, self.incarnation, self.epoch, self.sent_order,
                              tuple(encoded for _, _, encoded in entries), self._sent_commit, self.recorded_commit))
            self.sent_order = entries[-1][1]
        if self._lost_from_log(now_ms):
            return
        if self.commit_order > self._sent_commit or self.recorded_commit > self._sent_recorded_commit:
            # Nothing new to stream, but the replica's clients wait on the commit point (and its
            # log's floor on the recorded one).
            self._sent_commit = self.commit_order
            self._sent_recorded_commit = self.recorded_commit
            self._send(Append(self.core.name, self.incarnation, self.epoch, self.sent_order, (), self._sent_commit,
                              self.recorded_commit))

    def _next_entries(self, limit: int) -> list[tuple[int, int, bytes]]:
        """The next log entries (first, last, encoded) after sent_order for one Append: at
        least one, then up to `limit` operations and APPEND_BYTES_MAX bytes. From memory, or
        older ones from the op log (which holds what is durable here; the rest follows once
        it is)."""
        sent = self.sent_order
        if sent >= self._recent_floor:
            entries = []
            size = 0
            for entry in self._recent:
                if entry[1] > sent:
                    entries.append(entry)
                    size += len(entry[2])
                    if entry[1] - sent >= limit or size >= APPEND_BYTES_MAX:
                        break
            return entries
        older = self.oplog.read(self.core.queue_id, sent, limit, APPEND_BYTES_MAX)
        if older and older[0][0] != sent + 1 and self.core.record.dead_letter_of is None:
            # A queue's orders have no holes (a dead-letter queue's do: its arrivals take
            # indices of their own), so this one was truncated away: see _lost_from_log.
            self.log_start = max(self.log_start, older[0][0])
            return []
        return [entry for entry in older if entry[1] <= self._recent_floor]

    def _lost_from_log(self, now_ms: int) -> bool:
        """What the replica needs next, or the order its transfer vouches for, was truncated (it
        was recorded out of sync and fell behind past log_retain_max_bytes): it opens again and
        gets a snapshot."""
        vouchable = self.progress is not ReplicaProgress.CATCHING_UP or self._sync_target >= self.log_start
        if vouchable and (self.sent_order >= self.log_start or self.sent_order >= self.last_order
                          or self.sent_order >= self._recent_floor):
            return False
        self._set_progress(ReplicaProgress.PROBING)
        self._send_resync(now_ms)
        return True

    def _send_resync(self, now_ms: int) -> None:
        """Tell a following replica its position left the log; repeated (see tick) until its
        Open comes, since a lost one would leave it following a master that streams nothing."""
        self._resync_sent_ms = now_ms
        self._send(Refused(self.core.name, self.incarnation, self.epoch, RESYNC,
                           f"order {self.sent_order} is no longer in the log (it starts at {self.log_start})"))

    def _digest_at(self, order: int) -> bytes:
        if order == self.last_order:
            return self.digest
        digest = self.oplog.digest_at(self.core.queue_id, order)
        return digest if digest is not None else b""

    def _send(self, message: Message) -> None:
        self.outbox.append((self.replica_id, message))

    def _set_progress(self, progress: ReplicaProgress) -> None:
        if progress is not self.progress and progress not in PROGRESS_TRANSITIONS[self.progress]:
            return   # e.g. FENCED is final
        self.progress = progress
