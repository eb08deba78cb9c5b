"""The master role of one queue's pair: ordering-index replication to the replica.

The queue core decides (which message, which lease) and gives each replicated operation the
next ordering index; this role streams those operations to the replica in order, learns from
the replica's acknowledgements which index it holds durably, and computes the commit point:
only operations at or below `commit_order` may be answered to clients or be visible to them
(DESIGN.md 3.1, 4.1). It also runs state transfer for a (re)joining replica from the op log,
and asks the membership layer to record the replica in or out of sync.

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
from dataclasses import dataclass

from client.errors import E_NOT_ENOUGH_REPLICAS, E_NOT_MASTER, QueueError
from replication.digest import fold_encoded
from replication.messages import (
    Append,
    AppendAck,
    Forward,
    ForwardResult,
    Message,
    Open,
    OpenAck,
    Refused,
    SyncBegin,
    SyncEnd,
    encode_operation,
)
from replication.operations import Enqueued, Operation
from replication.oplog import OpLogReader
from replication.options import Strength
from replication.queue_core import QueueCore


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


@dataclass(frozen=True, slots=True)
class Applied:
    """A replicated operation with the rolling digest after it: one row of the op log."""
    op: Operation
    digest: bytes
    encoded: bytes          # encode_operation(op): what is streamed, digested and logged


@dataclass(frozen=True, slots=True)
class InSyncProposal:
    """Ask the membership layer to record the replica in (or out of) sync, as a
    compare-and-set on the record it expects (DESIGN.md 4.1 "Compare-and-set")."""
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
                 replica_durable: int = 0) -> None:
        """`durable_order`: what is durable here when it is below `last_order` (a member taking
        this role with operations staged but not yet committed); `replica_durable`: what the
        replica is known to hold (a promoted replica knows its old commit point was on both)."""
        self.core = core
        self.oplog = oplog
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
        # Every replicated op after `_recent_floor` is in memory; older ones come from the op log.
        self._recent: collections.deque[tuple[int, bytes]] = collections.deque()   # (order, encoded)
        self._recent_floor = last_order
        self._pending_proposal: InSyncProposal | None = None
        self._sent_commit = 0                 # the commit point the replica was last told
        self._session = -1                    # the replica's current Open (see ReplicaRole.session)
        self._last_rewind_ms = -(10**12)      # when the stream last went back after a gap
        self._in_flight: collections.deque[tuple[int, int]] = collections.deque()   # (last order, bytes)
        self._in_flight_bytes = 0
        self.rewinds = 0                      # counters for the queue statistics
        self.appends_sent = 0
        self._last_progress_ms = 0
        self._last_attempt_ms = 0             # the last resend or repeated SyncEnd
        self.outbox: list[tuple[str, Message]] = []
        self.proposals: list[InSyncProposal] = []
        self.forwarded: list[Forward] = []    # requests from the replica's clients, for the driver
        self.to_log: list[Applied] = []       # replicated ops with their digests: the op log's rows
        self.gates_visibility = True   # False for a dead-letter queue: see qserver/pairs.py
        core.visible_upto = self.commit_order

    # --- commit point ----------------------------------------------------------------------
    @property
    def commit_order(self) -> int:
        if self.recorded_in_sync or self._pending_proposal is not None:
            return min(self.local_durable, self.replica_durable)
        return self.local_durable

    def check_writable(self) -> None:
        """Refuse before anything is persisted (DESIGN.md 3.8, E_NOT_ENOUGH_REPLICAS)."""
        if self.progress is ReplicaProgress.FENCED:
            raise QueueError(E_NOT_MASTER, f"queue {self.core.name}: a newer epoch than {self.epoch} exists")
        if self.core.options.min_in_sync >= 2 and not self.recorded_in_sync:
            raise QueueError(E_NOT_ENOUGH_REPLICAS, f"queue {self.core.name} needs its replica in sync")

    # --- operations decided by the core ----------------------------------------------------
    def replicate(self, ops: list[Operation], now_ms: int) -> None:
        """Take the operations the core just decided (in order) into the replicated stream."""

        strength = self.core.options.strength
        for op in ops:
            if not is_replicated(op, strength):
                continue
            encoded = encode_operation(op)
            self.digest = fold_encoded(self.digest, encoded)
            self.last_order = op.order
            self._recent.append((op.order, encoded))
            self.to_log.append(Applied(op, self.digest, encoded))
        while len(self._recent) > self.limits.replica_lag_max:
            self._recent_floor = self._recent.popleft()[0]    # the op log serves a lagging replica
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
        if isinstance(message, AppendAck):
            self._on_ack(message, now_ms)
        elif isinstance(message, Open):
            self._on_open(message, now_ms)
        elif isinstance(message, OpenAck):
            self._on_open_ack(message, now_ms)
        elif isinstance(message, Forward):
            self.forwarded.append(message)

    def _on_ack(self, ack: AppendAck, now_ms: int) -> None:
        if ack.session != self._session:
            return                          # about an earlier session: the replica has moved on
        if ack.durable_order > self.replica_durable:
            self.replica_durable = min(ack.durable_order, self.last_order)
            self._last_progress_ms = now_ms
            while self._recent and self._recent[0][0] <= self.replica_durable:
                self._recent_floor = self._recent.popleft()[0]
        if (ack.gap or ack.durable_order < self.replica_durable) and self.sent_order > self.replica_durable \
                and now_ms - self._last_rewind_ms >= self.limits.resend_after_ms // 4:
            self.sent_order = self.replica_durable   # stream again from what it holds
            self._last_rewind_ms = now_ms
            self.rewinds += 1
        if self.progress is ReplicaProgress.CATCHING_UP and self.replica_durable >= self._sync_target:
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
        self._pump(now_ms)

    def _on_open(self, request: Open, now_ms: int) -> None:
        """A replica (re)joins: stream only what it lacks, or everything if histories differ."""
        ours = self._digest_at(request.last_order) if request.last_order <= self.last_order else None
        reset = ours is None or ours != request.digest
        start = 0 if reset else request.last_order
        record = self.core.record.to_json() if reset else None
        self._session = request.session
        self._send(SyncBegin(self.core.name, self.incarnation, self.epoch, start + 1, reset, record, request.session))
        self.replica_durable = start
        self.sent_order = start
        self._sent_commit = 0                 # a restarted replica knows no commit point yet
        self._sync_target = self.last_order
        self._last_progress_ms = now_ms
        self._set_progress(ReplicaProgress.CATCHING_UP)
        if self.replica_durable >= self._sync_target:
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
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
    def tick(self, now_ms: int) -> None:
        outstanding = self.last_order > self.replica_durable
        silent_ms = now_ms - self._last_progress_ms
        lagging = self.last_order - self.replica_durable > self.limits.replica_lag_max
        if self.recorded_in_sync and outstanding and (lagging or silent_ms > self.limits.replica_lag_max_ms):
            self._propose(False)
        # Resends and repeated SyncEnds are paced from the last attempt; the silence that
        # records the replica out of sync counts from its last real progress only.
        since_attempt_ms = min(silent_ms, now_ms - self._last_attempt_ms)
        if outstanding and since_attempt_ms > self.limits.resend_after_ms and self.sent_order > self.replica_durable:
            self.sent_order = self.replica_durable   # an Append was lost with a broken link
            self._last_attempt_ms = now_ms
            self.rewinds += 1
        if self.progress is ReplicaProgress.CAUGHT_UP and not self.recorded_in_sync \
                and self.replica_durable >= self.last_order:
            # Recorded out of sync after a silence, it has since caught up in the same session.
            self._propose(True)
        if self.progress is ReplicaProgress.CATCHING_UP and self.replica_durable >= self._sync_target \
                and since_attempt_ms > self.limits.resend_after_ms:
            # SyncEnd (or the replica's OpenAck) was lost: vouch for the transfer again.
            self._last_attempt_ms = now_ms
            self._send(SyncEnd(self.core.name, self.incarnation, self.epoch, self._sync_target,
                               self._digest_at(self._sync_target)))
        self._pump(now_ms)

    def answer_forward(self, request: Forward, outcomes: list[object]) -> None:
        """The driver ran a request forwarded by the replica: each outcome is the ordering
        index that places it (after the operation itself in the stream), or [code, message]."""
        self._send(ForwardResult(self.core.name, self.incarnation, self.epoch, request.request_id, list(outcomes)))

    def link_down(self) -> None:
        """The peer link broke: the replica must Open again before anything is streamed."""
        if self.progress is not ReplicaProgress.FENCED:
            self._set_progress(ReplicaProgress.PROBING)

    # --- streaming -------------------------------------------------------------------------
    def _pump(self, now_ms: int) -> None:
        if self.gates_visibility:
            self.core.visible_upto = self.commit_order
        if self.progress not in (ReplicaProgress.CATCHING_UP, ReplicaProgress.CAUGHT_UP):
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
            ops = self._next_ops(min(limits.append_batch_max, limits.window_max - (self.sent_order - self.replica_durable)))
            if not ops:
                break
            size = sum(len(encoded) for _, encoded in ops)
            in_flight.append((ops[-1][0], size))
            self._in_flight_bytes += size
            self._sent_commit = self.commit_order
            self.appends_sent += 1
            self._send(Append(self.core.name, self.incarnation, self.epoch, self.sent_order,
                              tuple(encoded for _, encoded in ops), self._sent_commit))
            self.sent_order = ops[-1][0]
        if self.commit_order > self._sent_commit:
            # Nothing new to stream, but the replica's clients wait on the commit point.
            self._sent_commit = self.commit_order
            self._send(Append(self.core.name, self.incarnation, self.epoch, self.sent_order, (), self._sent_commit))

    def _next_ops(self, limit: int) -> list[tuple[int, bytes]]:
        """The next (order, encoded operation) after sent_order: from memory, or older ones
        from the op log (which holds what is durable here; the rest follows once it is)."""
        if self.sent_order >= self._recent_floor:
            ops = []
            for entry in self._recent:
                if entry[0] > self.sent_order:
                    ops.append(entry)
                    if len(ops) == limit:
                        break
            return ops
        older = self.oplog.read(self.core.queue_id, self.sent_order, limit)
        return [entry for entry in older if entry[0] <= self._recent_floor]

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
