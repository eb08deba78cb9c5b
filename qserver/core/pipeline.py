"""The commit pipeline: the open batch every step of a turn writes into, the one writer thread,
group commit, and the release of what a batch owes once it is durable.

The order, for every batch (docs/PROTOCOL.md, "Replication messages"):

    1. decide   the turn's steps decide operations into the open batch (`open`), and what a
                replica applies, or a snapshot it installs, is staged into it (`stage_*`);
    2. send     `start_commit` seals it and the pair driver streams it to the replicas
                (`before_commit`), before this node's own fsync;
    3. persist  the writer thread commits it (one LMDB transaction, one fsync) while the next
                batch fills (`_submit_commit`);
    4. answer   `finish_commit`: the cores advance, the pair driver hears of the commit
                (`after_commit`), and `release` answers clients and pushes to subscribers;
                answers about replicated operations wait further for the pair's commit point
                (the pair driver's `hold`).

A batch that cannot be stored is abandoned: its answers fail and the queues it touched are
rebuilt from storage (`_abandon`). Separate from the engine's task and command steps so the
order above reads in one place, and the staging the cluster side uses
(qserver/core/ports.py, `Staging`) is this object's and nothing more.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from qserver.config import NodeConfig
from qserver.core.batch import Messages, OpenBatch
from qserver.core.deadlines import DueQueues
from qserver.core.ports import OUTCOME_UNKNOWN
from qserver.metrics import Histogram
from qserver.storage.lmdb_store import CommitResult, MapGrowthNeeded, SealedBatch, Storage, StorageFull
from replication.invariants import InvariantViolation
from replication.operations import Leased, Operation
from replication.options import Strength, base_name, dead_letter_name
from replication.queue_core import QueueCore, sequences_from_json
from wire.errors import E_INTERNAL, E_STORAGE_FULL, QueueError
from wire.protocol import DeliveredMessage

if TYPE_CHECKING:
    from qserver.core.listeners import Listeners
    from qserver.core.registry import QueueRegistry
    from qserver.core.replication_port import Pairs
    from qserver.core.space import StorageRoom
    from qserver.tracing import BatchTrace, NodeTracing
    from replication.oplog import LogEntry
    from replication.replica import SnapshotInstall
    from replication.snapshot import InstalledState

log = logging.getLogger("qserver.core.engine")


class LockedWriter(Executor):
    """The writer's executor, holding `lock` while each job runs, so that the loop thread can
    act between two write transactions (growing the map)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self.inner.submit(self._locked, fn, args, kwargs)

    def _locked(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self.lock:
            return fn(*args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)


class CommitPipeline:
    pairs: Pairs                     # given by Engine.connect
    registry: QueueRegistry          # set by the engine once made (they refer to each other)
    # The node's spans (qserver/tracing.py; set by qserver/node.py when configured): the
    # committing batch's traced messages, if any (not configured: a test at a batch's seal and commit).
    tracing: NodeTracing | None = None
    _traced: BatchTrace | None = None

    def __init__(self, config: NodeConfig, storage: Storage, writer: Executor, *, clock_ms: Callable[[], int],
                 monotonic_ms: Callable[[], int], listeners: Listeners, room: StorageRoom, due: DueQueues,
                 wake: Callable[[], None], fail: Callable[[str, BaseException | None], None],
                 failed: Callable[[], bool], self_checks: Callable[[], bool]) -> None:
        """`wake`: the engine's task takes another turn; `fail`: the engine stops (memory and
        storage may disagree), `failed`: it has; `self_checks`: a simulation's switch
        (Engine.self_checks)."""
        self.config = config
        self.storage = storage
        self.clock_ms = clock_ms
        self.monotonic_ms = monotonic_ms
        self.listeners = listeners
        self.room = room
        self._due = due
        self._wake = wake
        self._fail = fail
        self._failed = failed
        self._self_checks = self_checks
        self.open = OpenBatch()
        self.committing: OpenBatch | None = None
        self.writer = LockedWriter(writer)
        self.commit_seconds = Histogram("qserver_commit_seconds", "LMDB commit (fsync) latency",
                                        [0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0])
        self.batch_operations = Histogram("qserver_commit_batch_operations", "operations per commit",
                                          [1, 2, 5, 10, 50, 100, 500, 1000, 5000, 20000])
        self.batches_abandoned = 0

    # --- 1. decide: what goes into the open batch -----------------------------------------
    def touch(self, core: QueueCore) -> None:
        """The queue's record changed: written with the open batch."""
        self.open.touched[core.name] = core
        self._due.changed.add(core.name)      # what changed it may have moved its next timed step

    def decided(self, core: QueueCore, ops: list[Operation]) -> None:
        """The core decided `ops` on its own (expiries): replicated and stored like a command's."""
        self.pairs.note_decided(core, ops)
        self.touch(core)
        to_serve = self.listeners.to_serve
        if core.dead_letter_core is not None:
            self.touch(core.dead_letter_core)
            to_serve.add(core.dead_letter_core.name)
        to_serve.add(core.name)

    def staged(self) -> SealedBatch:
        """The batch being filled: operations decided here and not yet streamed or committed."""
        return self.open.sealed

    def unstage(self, queue_id: int, after: int | None = None) -> None:
        """Take the open batch's operations and op-log rows of `queue_id` past order `after`
        out of it (every one of them with None, those without an order too)."""
        sealed = self.open.sealed
        kept = [op.queue_id != queue_id or (after is not None and op.order <= after) for op in sealed.operations]
        # Journal marks stay before the operation they preceded (their positions shrink).
        before = [0, *itertools.accumulate(kept)]
        sealed.journal_marks[:] = [(before[position], mark) for position, mark in sealed.journal_marks]
        sealed.operations[:] = [op for op, keep in zip(sealed.operations, kept, strict=True) if keep]
        sealed.oplog_rows[:] = [row for row in sealed.oplog_rows
                                if row[0] != queue_id or (after is not None and row[2] <= after)]

    def discard_uncommitted(self, core: QueueCore, order: int) -> bool:
        """A deposed `producer` master becomes replica: drop its suffix past the commit point
        `order` (QueueCore.discard_after) from memory, from the open batch and, first thing in
        the next transaction, from storage (a batch already being written lands before it).
        False when the core cannot (the member then takes the master's whole history)."""
        if core.discard_after(order) is None:
            return False
        self.unstage(core.queue_id, order)
        self.open.sealed.truncations.append((core.queue_id, order))
        self.touch(core)
        return True

    def stage_applied(self, core: QueueCore, applied: list[LogEntry]) -> None:
        """Log entries the replica applied: persist their operations and op-log rows."""
        sealed = self.open.sealed
        for entry in applied:
            sealed.operations.extend(entry.ops)
            sealed.oplog_rows.append(entry.row(core.queue_id))
        self.touch(core)
        if core.dead_letter_core is not None:
            self.touch(core.dead_letter_core)
        self.listeners.to_serve.add(core.name)

    def stage_snapshot_rows(self, core: QueueCore, rows: list[Any], on_stored: Callable[[], None]) -> None:
        """Rows of a snapshot this replica is receiving: stored now, served once installed;
        `on_stored` once they are durable."""
        dead = core.dead_letter_core
        self.open.sealed.snapshot_rows.append((core.queue_id, dead.queue_id if dead is not None else None, rows))
        self.open.sealed.on_commit.append(on_stored)
        self.touch(core)
        if dead is not None:
            self.touch(dead)

    def stage_snapshot_install(self, core: QueueCore, install: SnapshotInstall, received: InstalledState,
                               on_installed: Callable[[], None]) -> None:
        """A complete snapshot: its counters go into the queue record(s) and its mark into the
        log in this batch; once committed, `on_installed` makes the core(s) serve it."""
        record, full = core.record, core.options.strength is Strength.FULL
        messages = received.ready_count + received.delayed_count + len(received.leases)
        if install.keep_upto:
            record.ready_count += received.ready_count
            record.total_enqueued += messages
        elif full:
            for counter in ("total_enqueued", "total_acked", "total_dead_lettered", "total_purged", "total_expired",
                            "total_redelivered", "highest_depth", "service_ms_total", "service_count"):
                setattr(record, counter, int(install.record.get(counter, 0)))
            record.ready_count = received.ready_count
            # Durable subscriptions are queue state in the record (QueueRecord.subscriptions).
            record.subscriptions = {str(name): [int(floor), [int(i) for i in acked]]
                                    for name, (floor, acked) in install.record.get("subscriptions", {}).items()}
            record.sequences = sequences_from_json(install.record.get("sequences", {}))
            record.changed_streams = set(record.sequences)
            self.open.sealed.stream_resets.add(core.queue_id)     # the snapshot's streams replace this member's
        else:
            record.ready_count = received.ready_count
            record.total_enqueued = messages
        record.next_index = install.order + 1
        sealed = self.open.sealed
        sealed.snapshot_installs.append((core.queue_id, install.order, install.digest))
        dead = core.dead_letter_core
        if install.dead_letter is not None and dead is not None:
            dead_order, dead_digest, dead_record = install.dead_letter
            dead.record.next_index = max(int(dead_record.get("next_index", 1)), dead_order + 1)
            dead.record.ready_count = received.dead_letter_ready_count
            dead.record.total_enqueued = int(dead_record.get("total_enqueued", 0))
            sealed.snapshot_installs.append((dead.queue_id, dead_order, dead_digest))
            # Its base is its counter at the view: its later orders and arrivals come after it.
            self.journal_mark(dead, "replica", dead.record.next_index - 1, "snapshot")
        self.journal_mark(core, "replica", install.order, "snapshot")
        sealed.on_commit.append(on_installed)
        self.listeners.to_serve.add(core.name)

    def journal_mark(self, core: QueueCore, role: str, index: int, reason: str) -> None:
        """A journal record of a member taking a role in an epoch (the audit's "epoch" op)."""
        sealed = self.open.sealed
        sealed.journal_marks.append((len(sealed.operations), [
            self.clock_ms(), core.name, core.queue_id, core.record.epoch, index, "epoch", 0, reason, 0, 0, 0, role,
            self.config.node_id, ""]))
        self.touch(core)

    def journal_event(self, core: QueueCore, op: str, subject: str, detail: str) -> None:
        """A journal record of an event about the queue that is no operation on it (a
        recipient's state change): at index 0, `subject` in the dedupe id's column."""
        self.open.sealed.journal_marks.append((len(self.open.sealed.operations), [
            self.clock_ms(), core.name, core.queue_id, core.record.epoch, 0, op, 0, subject, 0, 0, 0,
            "master", self.config.node_id, detail[:200]]))
        self.touch(core)

    def outcomes_unknown(self, queue: str, after_order: int) -> None:
        """This node stopped mastering `queue`: the answers the batches in flight owe about
        its orders past `after_order` (the commit point it reached as master) will say their
        outcome is unknown instead of waiting for a commit point of another history."""
        for batch in (self.committing, self.open):
            if batch is None:
                continue
            for holds in (batch.holds, batch.push_holds):
                for position, (name, required) in holds.items():
                    if name == queue and required > after_order:
                        holds[position] = (name, OUTCOME_UNKNOWN)

    # --- 2. send, 3. persist ---------------------------------------------------------------
    def start_commit(self) -> None:
        """Seal the open batch, stream it to the replicas, and commit it on the writer thread:
        never on the loop, whose heartbeats and lease renewals must not wait for an fsync
        (committing a lone message inline saved no measurable latency: bench/RESULTS.md, "The
        hot path")."""
        batch, self.open = self.open, OpenBatch()
        sealed = batch.sealed
        sealed.dedupe_window_ms = int(self.config.dedupe_window_s * 1000)
        sealed.status_retention_ms = int(self.config.status_retention_s * 1000)
        touched = batch.touched
        pairs = self.pairs
        if self.tracing is not None:
            self._traced = self.tracing.sealed(sealed.operations, touched)
        if self._self_checks():
            self._check_touched(batch)
        pairs.before_commit(sealed.operations, sealed.oplog_rows, self.monotonic_ms(), touched)     # send
        self.room.count_written(sealed)
        sealed.log_floors = pairs.log_floors()
        replicas = pairs.replicas
        sealed.replica_queue_ids = {core.queue_id for name, core in touched.items() if name in replicas}
        for name, core in batch.touched.items():
            known, may_answer = pairs.answer_point(name)
            # A master without a lease acknowledges nothing (docs/PROTOCOL.md, "A master restarted inside its lease"): what it commits
            # alone meanwhile is not known committed (a snapshot lets a member keep what is).
            if known is not None and may_answer:
                core.record.commit_order = known
            sealed.queue_records[name] = core.record.to_json(streams=False)
            if core.record.changed_streams:
                sealed.stream_puts.extend((core.queue_id, key, stream) for key, stream in
                                          core.record.take_changed_streams())
            core.seal()
        self.committing = batch
        # A master's batch went to its replica in this same step (before_commit). The writer
        # gets the batch on the loop's next turn, after the peer links' writers have put the
        # Append on the wire: the replica's commit, the longer of the two, starts ~0.1 ms
        # sooner, and the writer thread does not take the GIL from the loop in the middle of
        # its step (one at a time -12% p50, 100 in flight +25%: bench/RESULTS.md).
        asyncio.get_running_loop().call_soon(self._submit_commit, sealed)

    def _check_touched(self, batch: OpenBatch) -> None:
        """A simulation's check: every queue the batch holds anything of is among its touched
        queues (the commit's bookkeeping visits only those)."""
        ids = {core.queue_id for core in batch.touched.values()}
        sealed = batch.sealed
        held = {op.queue_id for op in sealed.operations} | {row[0] for row in sealed.oplog_rows} | {
            queue_id for queue_id, _, _ in sealed.snapshot_installs}
        held &= {core.queue_id for core in self.registry.cores.values()}      # not those deleted meanwhile
        if not held <= ids:
            raise InvariantViolation(f"a batch holds operations of queues {sorted(held - ids)} it does not list")

    def _submit_commit(self, sealed: SealedBatch) -> None:
        # Runs as a loop callback, where an exception would only be logged: a writer that
        # takes no more work leaves every answer waiting for ever.
        try:
            future = asyncio.get_running_loop().run_in_executor(self.writer, self.storage.commit, sealed)
        except Exception as error:
            self._fail("the writer thread takes no more commits", error)
            return
        future.add_done_callback(self._commit_done)

    def _commit_done(self, future: asyncio.Future[CommitResult]) -> None:
        """A done-callback: anything raised here would be logged by the loop and forgotten while
        the engine went on with memory storage may not match, so it stops the node instead."""
        if self._failed() or future.cancelled():   # cancelled: a simulation's crash of the node
            return
        try:
            self.finish_commit(future)
        except Exception as error:
            self._fail("completing a commit failed", error)

    # --- 4. answer -------------------------------------------------------------------------
    def finish_commit(self, future: asyncio.Future[CommitResult]) -> None:
        """The writer is done with the committing batch: answer it (`_committed`), or retry it
        on a grown map, or abandon it (nothing of it was stored)."""
        batch = self.committing
        if batch is None:
            raise InvariantViolation("a commit completed while none was under way")
        try:
            result = future.result()
        except MapGrowthNeeded:
            self._grow_and_retry(batch)
            return
        except InvariantViolation:
            raise               # the writer found storage and memory apart: no retry, no rebuild
        except StorageFull as error:    # an operating error: nothing was stored
            self.committing = None
            self._abandon(batch, error)
            return
        except Exception as error:  # an LMDB failure (I/O): nothing was stored
            log.exception("commit failed")
            self.committing = None
            self._abandon(batch, error)
            return
        self.committing = None
        self._committed(batch, result)

    def _committed(self, batch: OpenBatch, result: CommitResult) -> None:
        """The batch is durable here: its cores advance (their dedupe overlays drop what the
        reader now sees), snapshots it installed serve, the pair driver learns this member's
        durable point (a master then releases what the replica acknowledged too), and the
        answers and pushes go out (`release`)."""
        self.commit_seconds.observe(result.commit_seconds)
        self.batch_operations.observe(result.operations)
        for core in batch.touched.values():
            core.advance()
        for installed in batch.sealed.on_commit:
            installed()
        try:
            self.pairs.after_commit(batch.sealed.operations, self.monotonic_ms(), batch.touched,
                                    [(queue_id, order) for queue_id, order, _ in batch.sealed.snapshot_installs])
        finally:
            self.storage.end_read()
        self.release(batch, result.payloads, result.headers)
        if self._traced is not None:
            self._trace_committed(None)
        self._wake()

    def _trace_committed(self, error: BaseException | None) -> None:
        """The committing batch's `commit` span, and on a master each traced queue's
        `replicate` span once its commit point passes the batch (a hold that answers no one).
        Spans are an observer's: a failing exporter is logged, never the node's failure."""
        traced, self._traced = self._traced, None
        assert traced is not None
        pairs = self.pairs
        try:
            traced.committed(pairs.replicas, error)
            if error is not None:
                return
            for queue in traced.traced:
                master = pairs.masters.get(queue)
                if master is not None and master.replica_id:
                    done = functools.partial(traced.replicated, queue, master.replica_id)
                    if not pairs.hold(queue, traced.last_index(queue), done):
                        done()
        except Exception:
            log.exception("tracing a commit failed")

    def release(self, batch: OpenBatch, payloads: list[bytes | None], headers: list[dict[str, str] | None]) -> None:
        """Answer what this batch decided. Answers about replicated operations of a pair wait
        until the queue's commit point passes them (docs/PROTOCOL.md, "Replication messages"): the pair driver holds
        those and releases them when the replica's acknowledgement arrives."""
        holds, hold = batch.holds, self.pairs.hold
        for position, (replier, request_id, result) in enumerate(batch.replies):
            if type(result) is Messages:
                result = _messages(result.leased, payloads, headers, result.first)
            held = holds.get(position) if holds else None
            if held is None or not hold(held[0], held[1], functools.partial(replier.reply, request_id, result),
                                        functools.partial(replier.fail, request_id),
                                        write=position in batch.write_holds):
                replier.reply(request_id, result)
        for position, (subscription, first, leased) in enumerate(batch.pushes):
            messages = _messages(leased, payloads, headers, first)
            push = functools.partial(subscription.connection.push, subscription.subscription_id, messages)
            held = batch.push_holds.get(position)
            if held is None or not hold(held[0], held[1], push):
                push()
        for callback in batch.after_commit:
            callback()
        self.listeners.wake_status_waiters(batch.sealed.operations)

    # --- a batch that could not be stored --------------------------------------------------
    def grow_storage(self) -> None:
        """Grow the LMDB map (loop thread), or raise StorageFull. Between two of the writer's
        jobs: LMDB refuses to resize the map while a write transaction is active, and the
        membership layer's writes and journal prunes share the writer with the commits (one of
        them running here left a batch committing for ever: the engine answered nothing more
        and could not stop). The membership layer calls it for a Raft write that found the map full."""
        self.storage.end_read()
        with self.writer.lock:
            size = self.storage.grow_map()
        log.info("storage map grown to %d bytes", size)

    def _grow_and_retry(self, batch: OpenBatch) -> None:
        try:
            self.grow_storage()
        except Exception as error:     # StorageFull, or LMDB's refusal: nothing was stored
            if not isinstance(error, StorageFull):
                log.exception("growing the storage map failed")
            self.committing = None
            self._abandon(batch, error)
            return
        self._submit_commit(batch.sealed)

    def _abandon(self, batch: OpenBatch, error: Exception) -> None:
        """A batch could not be stored. Its commands, and those stepped on top of it, fail; the
        queues they touched are rebuilt from storage, which still holds exactly what was
        committed (the others, and their roles, go on as they are). Storage found full refuses
        new messages from now on, until there is room again (StorageRoom.check)."""
        self.batches_abandoned += 1
        if self._traced is not None:
            self._trace_committed(error)
        if isinstance(error, StorageFull):
            self.room.found_full(batch, error)
        later, self.open = self.open, OpenBatch()
        for failed in (batch, later):
            for position, (replier, request_id, _) in enumerate(failed.replies):
                # The lost batch's replicated operations went to the replicas, which may store them.
                replier.fail(request_id, _refusal(error, streamed=failed is batch and position in failed.holds))
            for subscription, _, leased in failed.pushes:
                subscription.credit += len(leased)
        if isinstance(error, InvariantViolation):
            raise error
        self._reload(batch, later)
        self.listeners.to_serve.update(self.registry.cores)
        self._wake()

    def _reload(self, *lost: OpenBatch) -> None:
        """Rebuild from storage the queues the lost batches touched, with their dead-letter
        partners (QueueRegistry.reload)."""
        names: set[str] = set()
        reached: set[int] = set()           # queue ids whose op log, snapshot or suffix they wrote
        for failed in lost:
            sealed = failed.sealed
            names.update(failed.touched)
            names.update(name for name, _ in sealed.deleted_queues)
            reached.update(row[0] for row in sealed.oplog_rows)
            reached.update(row[0] for row in sealed.snapshot_rows)
            reached.update(row[0] for row in sealed.snapshot_installs)
            reached.update(queue_id for queue_id, _ in sealed.truncations)
        names |= {dead_letter_name(base) for base in map(base_name, names)} | set(map(base_name, names))
        self.registry.reload(names, reached)


def _messages(leased: list[Leased], payloads: list[bytes | None], headers: list[dict[str, str] | None],
              first: int) -> list[DeliveredMessage]:
    out = []
    for position, op in enumerate(leased, first):
        payload = payloads[position]
        if payload is None:
            raise InvariantViolation(f"leased message {op.queue_id}/{op.index} has no payload")
        out.append(DeliveredMessage(op.index, op.receipt, op.priority, op.deliveries, payload,
                                    headers[position] if headers else None))
    return out


def _refusal(error: Exception, *, streamed: bool) -> QueueError:
    """The answer to a command of a batch that could not be stored. `streamed`: its operations
    went to the queue's replica, which may have stored them (they come back only if that
    replica is promoted before it opens again): its outcome is unknown."""
    if isinstance(error, StorageFull):
        return QueueError(E_STORAGE_FULL, f"{error}; nothing was stored here", outcome_unknown=streamed)
    return QueueError(E_INTERNAL, f"storage failure: {error}", outcome_unknown=streamed)

