"""The engine: the one task that owns every queue core of a node.

API handlers push commands into a bounded inbox; the engine's task drains it, steps each
command into its queue core, and collects the resulting operations into the open batch.
One batch at a time is committed by the writer thread (one LMDB transaction, one fsync)
while the next one fills: group commit. Replies are released only when the batch holding
their operations is durable, errors right away. No locks: only this task
touches cores; the writer thread only reads a sealed batch.

Order per batch: persist, then answer clients and push to subscribers, then
advance the cores (their dedupe overlays drop what the reader now sees).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from qserver.api.auth import CLUSTER_CLIENT, Principal
from qserver.cluster.coordinator import Coordinator
from qserver.cluster.membership import Membership
from qserver.cluster.pairs import OUTCOME_UNKNOWN, ClusterView, PairDriver, Redirect
from qserver.cluster.relay import (
    QUEUE_TRAFFIC,
    WRITES,
    ForwardReplier,
    answer_from_master,
    command_from_forward,
    forwarded_request,
)
from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.deadlines import DueQueues
from qserver.metrics import Histogram
from qserver.storage.lmdb_store import CommitResult, MapGrowthNeeded, SealedBatch, Storage, StorageFull, StorageSpace
from replication.cluster_map import CreateQueue, DeleteQueue, QueueEntry, choose_pair
from replication.cluster_map import PutClient as MapPutClient
from replication.invariants import InvariantViolation
from replication.master import ReplicationLimits
from replication.operations import DeadLettered, Enqueued, Leased, Operation, SubscriptionDropped, SubscriptionOpened
from replication.options import (
    DEAD_LETTER_SUFFIX,
    REPLY_TO,
    RESERVED_HEADERS,
    OptionError,
    QueueOptions,
    QueueState,
    QueueType,
    Strength,
    checked_headers,
    dead_letter_name,
    is_valid_queue_name,
    mismatched_options,
    options_from_json,
    valid_dedupe_id,
)
from replication.queue_core import QueueCore, QueueRecord, sequences_from_json
from wire.errors import (
    E_BAD_REQUEST,
    E_CLIENT_EXISTS,
    E_FORBIDDEN,
    E_INTERNAL,
    E_INVALID_NAME,
    E_INVALID_OPTION,
    E_MACRO_QUEUE,
    E_MACRO_REFUSED,
    E_MASTER_EXISTS,
    E_NOT_MASTER,
    E_OPTIONS_MISMATCH,
    E_OVERLOADED,
    E_PAYLOAD_TOO_LARGE,
    E_QUEUE_UNAVAILABLE,
    E_RESERVED_HEADER,
    E_RESERVED_NAME,
    E_SHUTTING_DOWN,
    E_STORAGE_FULL,
    E_UNKNOWN_CLIENT,
    E_UNKNOWN_MESSAGE,
    E_UNKNOWN_QUEUE,
    QueueError,
)
from wire.protocol import DeliveredMessage

log = logging.getLogger("qserver.core.engine")
TERMINAL_STATES = frozenset({"acked", "replied", "dead_lettered", "purged", "expired"})
REPLICATION_TICK_MS = 50    # how often replication roles check lag, resends and retries
PURGE_STEP_MAX = 5_000      # messages a purge takes out per engine turn (a few ms of work)
SPACE_CHECK_INTERVAL_MS = 100   # how often the storage's room is looked at (a few stat calls)
# Within this of the reserve, what each batch writes is counted against the room last measured,
# so a fast producer does not run 100 ms of writes past the line (twice its payloads: rows,
# indices and copied pages come with them).
SPACE_COUNTED_BYTES = 256 << 20
SPACE_RESUME_BYTES = 1 << 20    # room beyond the reserve before a full node takes new messages again
# After a write found no room, the node takes new data again no sooner than this, doubling while
# writes keep failing soon after it resumes (a replica whose disk cannot hold its master's state
# would otherwise start over every few hundred milliseconds), and back to the first once none has
# failed for FULL_HOLD_RESET_MS.
FULL_HOLD_INITIAL_MS, FULL_HOLD_MAX_MS, FULL_HOLD_RESET_MS = 1_000, 30_000, 120_000


def _refuse(command: c.Command, error: QueueError) -> None:
    if command.replier is not None:   # an unsubscribe from a closed socket expects no answer
        command.replier.fail(command.request_id, error)


def wall_ms() -> int:
    return int(time.time() * 1000)


def monotonic_clock_ms() -> int:
    return int(time.monotonic() * 1000)


@dataclass(slots=True)
class Waiter:
    """A receive (or a look at the head) that found nothing and waits for a message until
    `deadline_ms` (the engine's monotonic clock, as every deadline below); `key` is its place in
    its queue's waiters and in the deadline heap."""
    command: c.Receive | c.Head
    deadline_ms: int
    key: int = 0


class Listening:
    """The replier of a request that waits in the engine (a receive or a status wait): it
    holds the request's place under its connection's and its client's listener bounds until
    the answer goes out (docs/PROTOCOL.md, "Errors": E_OVERLOADED)."""
    __slots__ = ("inner", "holders", "counts")

    def __init__(self, inner: Any, holders: tuple[Any, ...], counts: dict[Any, int]) -> None:
        self.inner, self.holders, self.counts = inner, holders, counts

    def reply(self, request_id: int, result: Any) -> None:
        self._done()
        self.inner.reply(request_id, result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self._done()
        self.inner.fail(request_id, error)

    def _done(self) -> None:
        holders, self.holders = self.holders, ()
        for holder in holders:
            _count_down(self.counts, holder)


DEADLINES_COMPACT_MIN = 4_096      # deadline heap entries kept before a rebuild is considered


def _count_down(counts: dict[Any, int], holder: Any) -> None:
    left = counts.get(holder, 0) - 1
    if left > 0:
        counts[holder] = left
    else:
        counts.pop(holder, None)


# Commands whose answer waits for everything the queue decided so far, not only their own
# operations: a repeated dedupe id answers with an earlier id, which may not be committed yet;
# a purge's last step answers for the operations of its earlier steps too; a repeated
# subscription step answers for one decided a moment ago, maybe uncommitted.
ANSWERED_AFTER_EVERYTHING_DECIDED = frozenset({*WRITES, c.Purge, c.DurableSubscription})


@dataclass(slots=True)
class Subscription:
    subscription_id: int
    queue: str
    connection: Any
    credit: int
    visibility_ms: int | None
    client: str
    # A recipient (fault surveillance, qserver/features/surveillance/watch.py): what it was pushed and has not
    # taken (id -> receipt), and whether pushing to it is held (in fault).
    recipient: str | None = None
    pushed: dict[int, str] = field(default_factory=dict)
    held: bool = False


@dataclass(slots=True)
class StatusWaiter:
    command: c.MessageStatus
    queue_id: int
    deadline_ms: int
    tracks_status: bool = False      # the queue keeps completion statuses (QueueOptions.tracks_status)


def _no_status(command: c.MessageStatus) -> QueueError:
    """One answer for an id never issued, a status no longer kept and another producer's
    message (docs/PROTOCOL.md, "Grants"): the caller learns nothing about ids not its own."""
    return QueueError(E_UNKNOWN_MESSAGE, f"queue {command.queue} has no message {command.message_id} whose status "
                                         f"client {command.client} may read")


@dataclass
class OpenBatch:
    sealed: SealedBatch = field(default_factory=SealedBatch)
    # (replier, request_id, result) answered after commit; results of receives are built
    # from ("messages", first payload position, leased ops).
    replies: list[tuple[Any, int, Any]] = field(default_factory=list)
    pushes: list[tuple[Subscription, int, list[Leased]]] = field(default_factory=list)
    touched: dict[str, QueueCore] = field(default_factory=dict)
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    # Answers about replicated operations also wait for the queue's commit point:
    # position in replies / pushes -> (queue name, ordering index required).
    holds: dict[int, tuple[str, int]] = field(default_factory=dict)
    push_holds: dict[int, tuple[str, int]] = field(default_factory=dict)
    write_holds: set[int] = field(default_factory=set)     # positions in replies of enqueues' answers

    def empty(self) -> bool:
        s = self.sealed
        return not (s.operations or self.replies or self.pushes or s.queue_records or s.deleted_queues
                    or s.truncations or s.client_puts or s.client_deletes or s.housekeeping_ms is not None
                    or self.after_commit or s.snapshot_rows or s.snapshot_installs)


class _Messages:
    """Marks a reply result to be built from leased operations once payloads are read."""
    __slots__ = ("first", "leased")

    def __init__(self, first: int, leased: list[Leased]) -> None:
        self.first = first
        self.leased = leased


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


class Engine:
    # A simulation turns this on: after each turn the engine checks its bookkeeping of what
    # changed (timers, ticking pairs, log floors) against a walk over every queue.
    self_checks = False

    def __init__(self, config: NodeConfig, storage: Storage, *, rng: random.Random | None = None,
                 clock_ms: Callable[[], int] = wall_ms, writer: Executor | None = None,
                 membership: Membership | None = None, monotonic_ms: Callable[[], int] | None = None,
                 on_fatal: Callable[[str, BaseException | None], None] | None = None) -> None:
        """`on_fatal(reason, error)`: called once when the engine can no longer trust its
        memory (a broken invariant, its task ending on an error); a node passes
        qserver.core.failstop.stop_process, which ends the process. Without it (in-process tests,
        simulations) the engine stops serving and `failed` says why."""
        self.config = config
        self._on_fatal = on_fatal
        self.failed: BaseException | None = None
        self.storage = storage
        # Two clocks. `clock_ms` (the wall clock) is what records say: enqueue and lease times,
        # the dedupe window, the journal. `monotonic_ms` times everything that waits: leases,
        # receive waits, held answers, forwards, handoffs, replication ticks; a wall clock that
        # steps (NTP) or differs between nodes must not move a deadline.
        self.clock_ms = clock_ms
        self.monotonic_ms = monotonic_ms or monotonic_clock_ms
        self._rng = rng or random.Random()
        self.cores: dict[str, QueueCore] = {}
        self.pairs = PairDriver(self, ClusterView(config.node_id, config.cluster_nodes, membership),
                                ReplicationLimits(replica_lag_max=config.replica_lag_max,
                                                  replica_lag_max_ms=config.replica_lag_max_ms,
                                                  log_retain_max_bytes=config.log_retain_max_bytes,
                                                  snapshot_chunk_bytes_max=config.snapshot_chunk_bytes_max,
                                                  snapshot_chunks_in_flight_max=config.snapshot_chunks_in_flight_max,
                                                  sync_view_max_ms=int(config.sync_view_max_s * 1000)))
        self.membership = membership
        self.coordinator: Coordinator | None = None
        if membership is not None:
            self.coordinator = self.pairs.coordinator = Coordinator(
                self, membership, lease_ms=config.lease_ms, lease_margin_ms=config.lease_margin_ms,
                renew_interval_ms=config.lease_renew_interval_ms,
                replica_replace_after_ms=int(config.replica_replace_after_s * 1000),
                accept_replica_handoffs=config.accept_replica_handoffs,
                monotonic_ms=self.monotonic_ms)
            membership.on_applied = lambda command, outcomes: self.invoke(
                lambda now_ms: self.pairs.map_applied(command, outcomes))
        self._pending_creates: dict[str, list[tuple[Any, int]]] = {}   # queue -> (replier, request id)
        self._created_waiting: dict[str, list[tuple[Any, int]]] = {}
        self.clients: dict[str, dict[str, Any]] = {}
        self._inbox: collections.deque[c.Command] = collections.deque()
        self._wake = asyncio.Event()
        self._open = OpenBatch()
        self._committing: OpenBatch | None = None
        # The one writer. A simulation passes an executor that runs commits deterministically.
        self._writer = LockedWriter(writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmdb-writer"))
        # Each queue's waiting receives in arrival order, by Waiter.key (a receive answered or
        # timed out leaves in O(1)); their deadlines in a heap, so a turn looks at due ones only.
        self._waiters: dict[str, collections.OrderedDict[int, Waiter]] = {}
        self._waiter_deadlines: list[tuple[int, int, Waiter]] = []
        self._status_deadlines: list[tuple[int, int, StatusWaiter]] = []
        self._waiter_keys = itertools.count(1)
        self._compact_deadlines_at = DEADLINES_COMPACT_MIN      # heap entries (see _compact_deadlines)
        # Listeners held per connection (its replier) and per ("client", id): issue 32, item 11.
        self._listening: dict[Any, int] = {}
        # Each queue's subscriptions by id, in subscription order (an unsubscribe is O(1)).
        self._subscriptions: dict[str, dict[int, Subscription]] = {}
        self._subscriptions_by_id: dict[int, Subscription] = {}
        self._next_subscription_id = 1
        self._status_waiters: dict[tuple[int, int], list[StatusWaiter]] = {}
        self._to_serve: set[str] = set()
        self._due = DueQueues()                  # each queue's next timed step (qserver/core/deadlines.py)
        self._may_decide_time = True             # _full_master_may_decide() as of the last turn
        self._next_queue_id = storage.next_queue_id()
        self._next_housekeeping_ms = 0
        self._next_replication_tick_ms = 0
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self.on_clients_changed: Callable[[], None] = lambda: None
        self.commit_seconds = Histogram("qserver_commit_seconds", "LMDB commit (fsync) latency",
                                        [0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0])
        self.batch_operations = Histogram("qserver_commit_batch_operations", "operations per commit",
                                          [1, 2, 5, 10, 50, 100, 500, 1000, 5000, 20000])
        self.rejected = collections.Counter[str]()
        # Why new messages are refused with E_STORAGE_FULL (None: there is room; see _check_space).
        self.storage_full: str | None = None
        self.space: StorageSpace | None = None          # as last looked at
        self._map_full = False                          # a write found the map at its limit
        self._resume_bytes = SPACE_RESUME_BYTES         # room beyond the reserve to take messages again
        self._next_space_check_ms = 0
        self._written_since_measured = 0                # estimated bytes committed since `space`
        self._full_until_ms = 0                         # no room before then (see FULL_HOLD_INITIAL_MS)
        self._full_hold_ms = FULL_HOLD_INITIAL_MS
        self._last_found_full_ms: int | None = None
        self.batches_abandoned = 0

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._load()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")
        self._task.add_done_callback(self._task_ended)

    @property
    def serving(self) -> bool:
        """The engine's task runs and takes commands (/healthz answers 503 otherwise)."""
        return self._task is not None and not self._task.done() and not self._stopping and self.failed is None

    def fail(self, reason: str, error: BaseException | None = None) -> None:
        """Memory and storage may disagree: stop serving at once, commit nothing more."""
        if self.failed is not None:
            return
        self.failed = error or InvariantViolation(reason)
        log.critical("the engine failed: %s", reason, exc_info=error)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._on_fatal is not None:
            self._on_fatal(reason, error)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """The task ends only when stop() asks it to (or a simulation's crash cancels it)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.fail("the engine's task died", error)
        elif not self._stopping:
            self.fail("the engine's task returned without being stopped")

    def _load(self) -> None:
        """Rebuild cores from storage: queue records and leases only, never the messages."""
        self.cores = {}
        for record in self.storage.load_queue_records():
            self.cores[record.name] = self._new_core(record, self.storage.load_leases(record.queue_id))
        for name, core in self.cores.items():
            if not name.endswith(DEAD_LETTER_SUFFIX):
                core.dead_letter_core = self.cores.get(dead_letter_name(name))
        self.pairs.masters.clear()
        self.pairs.replicas.clear()
        for core in self.cores.values():
            self.pairs.attach(core)
        self._due.changed_all(self.cores)
        self.storage.end_read()
        self.clients = self.storage.load_clients()
        self._next_queue_id = self.storage.next_queue_id()

    @property
    def writer(self) -> Executor:
        """The storage writer's thread (also for pruning the journal between commits)."""
        return self._writer

    def random_bits(self, bits: int) -> int:
        return self._rng.getrandbits(bits)

    def _new_core(self, record: QueueRecord, leases: list[Any]) -> QueueCore:
        return QueueCore(record, self.storage, self._rng, lease_clock=self.monotonic_ms, leases=leases,
                         dedupe_window_ms=int(self.config.dedupe_window_s * 1000))

    async def stop(self) -> None:
        """Answer what is queued with E_SHUTTING_DOWN, commit what was decided, stop."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._writer.shutdown(wait=True)

    # --- the inbox -------------------------------------------------------------------------
    def submit(self, command: c.Command) -> None:
        if self.failed is not None:
            _refuse(command, QueueError(E_INTERNAL, "this node is stopping on an internal failure"))
            return
        if self._stopping:
            _refuse(command, QueueError(E_SHUTTING_DOWN))
            return
        if len(self._inbox) >= self.config.inbox_commands_max:
            self.rejected["overloaded"] += 1
            _refuse(command, QueueError(E_OVERLOADED))
            return
        self._inbox.append(command)
        if not self._wake.is_set():
            self._wake.set()

    async def call(self, command_factory: Callable[[c.FutureReplier], c.Command]) -> Any:
        """Submit one command and wait for its answer (the HTTP path)."""
        replier = c.FutureReplier()
        self.submit(command_factory(replier))
        return await replier.future

    # --- the task --------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            now_ms, mono_ms = self.clock_ms(), self.monotonic_ms()
            self.storage.begin_read()
            try:
                self._step_inbox(now_ms)
                if self.coordinator is not None and mono_ms >= self._next_replication_tick_ms:
                    self.coordinator.tick(mono_ms)
                    self.pairs.tick(mono_ms)
                    self._next_replication_tick_ms = mono_ms + REPLICATION_TICK_MS
                self._run_timed_steps(now_ms, mono_ms)
                self._serve(now_ms)
                self._expire_waiters(mono_ms)
                self._check_space(mono_ms)
            finally:
                self.storage.end_read()
            if mono_ms >= self._next_housekeeping_ms:
                self._open.sealed.housekeeping_ms = now_ms      # what is older than this is pruned
                self._next_housekeeping_ms = mono_ms + self.config.housekeeping_interval_ms
                for core in self.pairs.commit_points_to_record():
                    self._touch(core)
                # Listeners are served when their queue's role moves (listeners_may_see_more);
                # once a housekeeping interval, every listened queue is looked at all the same,
                # so a change that woke nothing delays a delivery by one interval at most.
                self._to_serve.update(self._waiters)
                self._to_serve.update(self._subscriptions)
            if self._committing is None and not self._open.empty():
                self._start_commit()
            if self._stopping and not self._inbox and self._committing is None:
                self._fail_waiters_on_stop()
                return
            self._arm_timer(mono_ms)

    def _step_inbox(self, now_ms: int) -> None:
        """Step queued commands into the open batch. When the writer is idle and the batch
        already holds `commit_early_operations`, it goes to disk at once and stepping goes
        on into the next batch: the commit overlaps the stepping instead of following it,
        and the first answers leave sooner (a window of many requests arrives together)."""
        inbox = self._inbox
        step = self._step
        early = self.config.commit_early_operations
        stepped = 0
        while inbox and stepped < self.config.batch_operations_max:
            command = inbox.popleft()
            if self._stopping:
                _refuse(command, QueueError(E_SHUTTING_DOWN))
                continue
            try:
                step(command, now_ms)
            except QueueError as error:
                _refuse(command, error)
            stepped += 1
            if self._committing is None and len(self._open.sealed.operations) >= early:
                self._start_commit()
        if inbox:
            self._wake.set()   # more to do: come back after this batch goes to disk

    def _step(self, command: c.Command, now_ms: int) -> None:
        kind = type(command)
        queue = getattr(command, "queue", None)
        if queue is not None and self.pairs.clustered and kind in QUEUE_TRAFFIC:
            if self._step_clustered(command, queue, now_ms):
                return
        self._step_local(command, now_ms)

    def _step_clustered(self, command: c.Command, queue: str, now_ms: int) -> bool:
        """Route a client's queue operation in a cluster: True when it was handled here (a
        replica forwards to its master); raises for a node that holds neither member."""
        pairs = self.pairs
        if self.coordinator is not None and self.coordinator.parks(queue):
            self.coordinator.park(queue, command)      # a handoff: no new index until it ends
            return True
        if queue in pairs.replicas:
            return self._step_at_replica(command, queue)
        pairs.refuse_if_not_master(queue)
        master = pairs.masters.get(queue)
        if master is None:
            return False
        pairs.check_serving(queue)          # a master restarted in its role, before its new epoch
        if type(command) in WRITES or master.core.options.strength.value == "full":
            pairs.check_writable(master)
        batch = self._open
        op_mark, reply_mark = len(batch.sealed.operations), len(batch.replies)
        self._step_local(command, now_ms)
        decided = batch.sealed.operations[op_mark:]
        pairs.note_decided(master.core, decided)
        required = pairs.replicated_order(master.core, decided)
        if type(command) in ANSWERED_AFTER_EVERYTHING_DECIDED:
            required = max(required, master.core.record.next_index - 1)
        if required:
            for position in range(reply_mark, len(batch.replies)):
                batch.holds.setdefault(position, (queue, required))
            if type(command) in WRITES:
                batch.write_holds.update(range(reply_mark, len(batch.replies)))
        return True

    def _step_local(self, command: c.Command, now_ms: int) -> None:
        kind = type(command)
        if kind is c.EnqueueMany:
            self._step_enqueue_many(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.AckMany:
            self._step_ack_many(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Enqueue:
            self._step_enqueue(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Ack:
            self._step_ack(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Receive:
            self._step_receive(command, now_ms)  # type: ignore[arg-type]
        else:
            self._STEP_OTHER[kind](self, command, now_ms)

    def _step_at_replica(self, command: Any, queue: str) -> bool:
        """At the replica: enqueues always go to the master (it orders them); under `full`
        consumption too. Under `producer` this member serves its own consumers (False)."""
        full = self.cores[queue].options.strength.value == "full"
        if type(command) is c.Subscribe and full:
            raise QueueError(E_NOT_MASTER, f"subscribe to {queue} at its master {self.pairs.masters_hint(queue)}")
        if type(command) not in WRITES and not full:
            return False
        self.pairs.refuse_forward_when_full(queue)
        self.pairs.forward(queue, forwarded_request(command), answer_from_master(command))
        return True

    def run_forwarded(self, role: Any, request: Any) -> None:
        """At the master: run a request a replica forwarded, as if its client were here; the
        answer (sent after commit) carries the commit point the replica must reach first."""
        replier = ForwardReplier(self.pairs, role, request)
        try:
            command = command_from_forward(request, replier)
            self._step(command, self.clock_ms())
        except (QueueError, ValueError, TypeError) as error:
            replier.fail(0, error if isinstance(error, QueueError) else QueueError(E_BAD_REQUEST, str(error)))

    # --- replica instances (called by the pair driver) -------------------------------------
    def hold_replica_instance(self, name: str, incarnation: int, record_json: dict[str, Any]) -> None:
        core = self.cores.get(name)
        if core is not None and (core.record.incarnation or core.queue_id) == incarnation:
            return
        if core is not None:
            self._remove_core(core)
        options = QueueRecord.from_json(record_json).options
        dead_letter = name.endswith(DEAD_LETTER_SUFFIX)
        created = self._create_core(name, options, record_json.get("created_ms", self.clock_ms()),
                                    dead_letter_of=record_json.get("dead_letter_of") if dead_letter else None,
                                    incarnation=incarnation)
        if not dead_letter and self.cores.get(dead_letter_name(name)) is not None:
            created.dead_letter_core = self.cores[dead_letter_name(name)]
        if dead_letter and record_json.get("dead_letter_of") in self.cores:
            self.cores[record_json["dead_letter_of"]].dead_letter_core = created
        self.pairs.attach(created, created=True)

    def drop_replica_instance(self, name: str, incarnation: int) -> None:
        core = self.cores.get(name)
        if core is not None and (core.record.incarnation or core.queue_id) == incarnation \
                and name in self.pairs.replicas:
            self._remove_core(core)

    def reset_replica_instance(self, role: Any, record_json: dict[str, Any]) -> None:
        """Histories differ: drop this instance's contents and start again from empty."""
        old = role.core
        dead_letter = old.dead_letter_core
        # What it applied into the open batch goes with it (the master sends it again): written
        # after the instance is gone, its journal records named no queue, and the audit found
        # an index gap (a chaos run, seed 41, when a dead-letter queue asked for a snapshot of
        # both while its queue was following).
        self._unstage(old.queue_id)
        self._remove_core(old, keep_role=True)
        # The same epoch as the instance it replaces: its journal records and its durable
        # epoch must not go back to the default (a node never accepts an older epoch).
        fresh = self._create_core(old.name, old.options, old.record.created_ms,
                                  dead_letter_of=old.record.dead_letter_of, incarnation=role.incarnation,
                                  epoch=old.record.epoch)
        fresh.dead_letter_core = dead_letter
        role.core = fresh
        fresh.visible_upto = role.visible_order

    def discard_uncommitted(self, core: QueueCore, order: int) -> bool:
        """A deposed `producer` master becomes replica: drop its suffix past the commit point
        `order` (QueueCore.discard_after) from memory, from the open batch and, first thing in
        the next transaction, from storage (a batch already being written lands before it).
        False when the core cannot (the member then takes the master's whole history)."""
        if core.discard_after(order) is None:
            return False
        self._unstage(core.queue_id, order)
        self._open.sealed.truncations.append((core.queue_id, order))
        self._touch(core)
        return True

    def _unstage(self, queue_id: int, after: int | None = None) -> None:
        """Take the open batch's operations and op-log rows of `queue_id` past order `after`
        out of it (every one of them with None, those without an order too)."""
        sealed = self._open.sealed
        kept = [op.queue_id != queue_id or (after is not None and op.order <= after) for op in sealed.operations]
        # Journal marks stay before the operation they preceded (their positions shrink).
        before = [0, *itertools.accumulate(kept)]
        sealed.journal_marks[:] = [(before[position], mark) for position, mark in sealed.journal_marks]
        sealed.operations[:] = [op for op, keep in zip(sealed.operations, kept, strict=True) if keep]
        sealed.oplog_rows[:] = [row for row in sealed.oplog_rows
                                if row[0] != queue_id or (after is not None and row[2] <= after)]

    def stage_applied(self, core: QueueCore, applied: list[Any]) -> None:
        """Log entries the replica applied: persist their operations and op-log rows."""
        sealed = self._open.sealed
        for entry in applied:
            sealed.operations.extend(entry.ops)
            sealed.oplog_rows.append(entry.row(core.queue_id))
        self._touch(core)
        if core.dead_letter_core is not None:
            self._touch(core.dead_letter_core)
        self._to_serve.add(core.name)

    def touch(self, core: QueueCore) -> None:
        self._touch(core)

    # --- snapshots (called by the pair driver) ---------------------------------------------
    def stage_snapshot_rows(self, core: QueueCore, rows: list[Any], on_stored: Callable[[], None]) -> None:
        """Rows of a snapshot this replica is receiving: stored now, served once installed;
        `on_stored` once they are durable."""
        dead = core.dead_letter_core
        self._open.sealed.snapshot_rows.append((core.queue_id, dead.queue_id if dead is not None else None, rows))
        self._open.sealed.on_commit.append(on_stored)
        self._touch(core)
        if dead is not None:
            self._touch(dead)

    def stage_snapshot_install(self, core: QueueCore, install: Any, received: Any, on_installed: Any) -> None:
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
            self._open.sealed.stream_resets.add(core.queue_id)     # the snapshot's streams replace this member's
        else:
            record.ready_count = received.ready_count
            record.total_enqueued = messages
        record.next_index = install.order + 1
        sealed = self._open.sealed
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
        self._to_serve.add(core.name)

    def staged(self) -> SealedBatch:
        """The batch being filled: operations decided here and not yet streamed or committed."""
        return self._open.sealed

    def outcomes_unknown(self, queue: str, after_order: int) -> None:
        """This node stopped mastering `queue`: the answers the batches in flight owe about
        its orders past `after_order` (the commit point it reached as master) will say their
        outcome is unknown instead of waiting for a commit point of another history."""
        for batch in (self._committing, self._open):
            if batch is None:
                continue
            for holds in (batch.holds, batch.push_holds):
                for position, (name, required) in holds.items():
                    if name == queue and required > after_order:
                        holds[position] = (name, OUTCOME_UNKNOWN)

    def _remove_core(self, core: QueueCore, *, keep_role: bool = False) -> None:
        del self.cores[core.name]
        self._open.touched.pop(core.name, None)
        self._due.changed(core.name)
        self._open.sealed.deleted_queues.append((core.name, core.queue_id))
        self._drop_queue_listeners(core.name)
        if not keep_role:
            self.pairs.detach(core.name)

    def _core(self, name: str) -> QueueCore:
        core = self.cores.get(name)
        if core is None:
            entry = self.pairs.view.entry(name)
            if entry is not None and entry.master != self.config.node_id:
                raise QueueError(E_NOT_MASTER, f"queue {name} is held by {self.pairs.masters_hint(name)}")
            if self.pairs.clustered and name in self.pairs.view.cluster_map.macros:
                raise QueueError(E_MACRO_QUEUE, f"{name} is a macro queue: its policies run in the client library, "
                                                "which sends each message to a member")
            raise QueueError(E_UNKNOWN_QUEUE, f"no queue named {name!r}")
        return core

    def _touch(self, core: QueueCore) -> None:
        self._open.touched[core.name] = core
        self._due.changed(core.name)      # what changed it may have moved its next timed step

    def role_changed(self, name: str) -> None:
        """The pair driver gave queue `name` a role, or took it: who decides its timed steps
        may have changed (see _decides_time)."""
        self._due.changed(name)

    def _refuse_when_full(self) -> None:
        """New messages are refused before anything is decided while the storage is full: in a
        pair nothing reaches the replica that this member might not store."""
        if self.storage_full is not None:
            raise QueueError(E_STORAGE_FULL, f"the storage of node {self.config.node_id} is full ({self.storage_full}); "
                                             "nothing was stored")

    def _step_enqueue(self, command: c.Enqueue, now_ms: int) -> None:
        self._refuse_when_full()
        core = self._core(command.queue)
        batch = self._open
        index, _ = core.enqueue(command.payload, command.priority, command.dedupe_id, command.client,
                                now_ms, batch.sealed.operations, command.ttl_ms, command.delay_ms,
                                self._producer_headers(command.client, command.headers))
        self._touch(core)
        result = [index, core.record.epoch]
        if core.options.type is QueueType.ONE_WAY:
            command.replier.reply(command.request_id, result)   # seed 004 One_Way: no durable ack
        else:
            batch.replies.append((command.replier, command.request_id, result))
        self._to_serve.add(core.name)

    def _producer_headers(self, client: str, raw: Any) -> dict[str, str] | None:
        """A message's headers, checked against its producer (docs/PROTOCOL.md, "Message
        headers"): the headers the cluster sets on the messages it moves are the cluster's
        alone, and a `reply-to` must name a queue the producer may post to (a message returned
        to its sender is enqueued there; naming any queue would write where the producer may not)."""
        headers = _headers(raw)
        if headers is None or client == CLUSTER_CLIENT:
            return headers
        reserved = RESERVED_HEADERS.intersection(headers)
        if reserved:
            raise QueueError(E_RESERVED_HEADER, f"the cluster sets {', '.join(sorted(reserved))} itself")
        reply_to = headers.get(REPLY_TO)
        record = self.clients.get(client)
        if reply_to is not None and record is not None and not Principal(client, record["grants"]).allows("post",
                                                                                                          reply_to):
            raise QueueError(E_FORBIDDEN, f"client {client} may not post to {reply_to}, which its {REPLY_TO} names")
        return headers

    def _step_enqueue_many(self, command: c.EnqueueMany, now_ms: int) -> None:
        self._refuse_when_full()
        core = self._core(command.queue)
        batch = self._open
        payloads, dedupe_ids = command.payloads, command.dedupe_ids or (None,) * len(command.payloads)
        if len(dedupe_ids) != len(payloads):
            raise QueueError(E_INVALID_OPTION, "dedupe ids must match the messages one for one")
        # Refused items (too large, a malformed dedupe id) keep their place in the answer.
        body_bytes_max = self.config.body_bytes_max
        outcomes: list[Any] = [None] * len(payloads)
        placed: list[int] = []
        for position, (payload, dedupe_id) in enumerate(zip(payloads, dedupe_ids, strict=True)):
            if len(payload) > body_bytes_max:
                outcomes[position] = [E_PAYLOAD_TOO_LARGE.code, f"message over {body_bytes_max} bytes"]
            elif dedupe_id is not None and not valid_dedupe_id(dedupe_id):
                outcomes[position] = [E_INVALID_OPTION.code, "dedupe ids are 1-128 printable characters"]
            else:
                placed.append(position)
        results = core.enqueue_many([payloads[p] for p in placed], command.priority, [dedupe_ids[p] for p in placed],
                                    command.client, now_ms, batch.sealed.operations, command.ttl_ms, command.delay_ms,
                                    self._producer_headers(command.client, command.headers))
        for position, outcome in zip(placed, results, strict=True):
            outcomes[position] = [outcome.code, outcome.message] if type(outcome) is QueueError else outcome
        self._touch(core)
        result = [core.record.epoch, outcomes]
        if core.options.type is QueueType.ONE_WAY:
            command.replier.reply(command.request_id, result)
        else:
            batch.replies.append((command.replier, command.request_id, result))
        self._to_serve.add(core.name)

    def _step_ack_many(self, command: c.AckMany, now_ms: int) -> None:
        core = self._core(command.queue)
        operations = self._open.sealed.operations
        ack, client = core.ack, command.client
        outcomes: list[Any] = []
        for message_id, receipt in command.items:
            try:
                ack(message_id, receipt, client, now_ms, operations)
                outcomes.append(None)
            except QueueError as error:
                outcomes.append([error.code, error.message])
        self._touch(core)
        self._open.replies.append((command.replier, command.request_id, outcomes))

    def _step_receive(self, command: c.Receive, now_ms: int) -> None:
        core = self._core(command.queue)
        leased = self._lease(core, command.max_messages, command.visibility_ms, command.client, now_ms)
        if leased:
            self._answer_with_messages(core, command.replier, command.request_id, leased)
        elif command.wait_ms > 0:
            self._wait(core.name, command, command.client)
        else:
            command.replier.reply(command.request_id, [])

    def _hold_listener(self, command: Any, client: str | None) -> None:
        """Count one more listener (a waiting receive or status wait, a subscription) of the
        command's connection and of `client`, or refuse it with E_OVERLOADED past either bound
        (issue 32, item 11: one client held every turn of the node). A waiting request's
        replier becomes a Listening, which gives the place back with its answer."""
        listening, config = self._listening, self.config
        connection = ("connection", id(command.replier))
        if listening.get(connection, 0) >= config.listeners_per_connection_max:
            raise QueueError(E_OVERLOADED, f"this connection holds {config.listeners_per_connection_max} waiting "
                                           "receives, status waits and subscriptions, the most a connection may")
        holders: tuple[Any, ...] = (connection,)
        if client is not None:
            if listening.get(("client", client), 0) >= config.listeners_per_client_max:
                raise QueueError(E_OVERLOADED, f"client {client} holds {config.listeners_per_client_max} waiting "
                                               "receives, status waits and subscriptions, the most a client may")
            holders = (connection, ("client", client))
        for holder in holders:
            listening[holder] = listening.get(holder, 0) + 1
        if type(command) is not c.Subscribe:
            command.replier = Listening(command.replier, holders, listening)

    def _wait(self, name: str, command: c.Receive | c.Head, client: str | None) -> None:
        self._hold_listener(command, client)
        waiter = Waiter(command, self.monotonic_ms() + command.wait_ms, next(self._waiter_keys))
        self._waiters.setdefault(name, collections.OrderedDict())[waiter.key] = waiter
        heapq.heappush(self._waiter_deadlines, (waiter.deadline_ms, waiter.key, waiter))

    def _step_head(self, command: c.Head, now_ms: int) -> None:
        """The message a receive here would lease next, leased by no one: `[]` when none (after
        `wait_ms`), else `[{"id", "priority", "enqueued_ms"}]`. Where a receive would be
        forwarded (a `full` queue's replica) or a node holds no member, the master answers."""
        pairs = self.pairs
        if pairs.clustered:
            if command.queue in pairs.replicas and self.cores[command.queue].options.strength.value == "full":
                entry = pairs.view.entry(command.queue)
                if entry is not None:
                    raise Redirect(entry.master, f"queue {command.queue} is served by its master {entry.master}")
            pairs.refuse_if_not_master(command.queue)
        core = self._core(command.queue)
        if not self._answer_head(core, command, now_ms):
            if command.wait_ms > 0:
                self._wait(core.name, command, None)
            else:
                command.replier.reply(command.request_id, [])

    def _answer_head(self, core: QueueCore, command: c.Head, now_ms: int) -> bool:
        head = core.head()
        if head is None:
            return False
        index, priority = head
        with_read = not self.storage.reading
        if with_read:
            self.storage.begin_read()
        try:
            enqueued_ms = self.storage.enqueued_ms(core.queue_id, index)
        finally:
            if with_read:
                self.storage.end_read()
        # Not stored yet: enqueued in the batch now going to disk (answers wait for it).
        found = {"id": index, "priority": priority, "enqueued_ms": now_ms if enqueued_ms is None else enqueued_ms}
        self._open.replies.append((command.replier, command.request_id, [found]))
        return True

    def _lease(self, core: QueueCore, max_messages: int, visibility_ms: int | None, client: str,
               now_ms: int) -> list[Leased]:
        """A lease that may take messages past their time to live out of the queue on its way
        (QueueCore.lease): those operations are decided as the expiry sweep's are."""
        operations = self._open.sealed.operations
        mark = len(operations)
        leased = core.lease(max_messages, visibility_ms, client, now_ms, operations)
        if len(operations) - mark > len(leased):
            self._decided(core, operations[mark:])
        return leased

    def _decided(self, core: QueueCore, ops: list[Operation]) -> None:
        """The core decided `ops` on its own (expiries): replicated and stored like a command's."""
        self.pairs.note_decided(core, ops)
        self._touch(core)
        if core.dead_letter_core is not None:
            self._touch(core.dead_letter_core)
            self._to_serve.add(core.dead_letter_core.name)
        self._to_serve.add(core.name)

    def _answer_with_messages(self, core: QueueCore, replier: Any, request_id: int, leased: list[Leased]) -> None:
        batch = self._open
        reads = batch.sealed.payload_reads
        required = self.pairs.replicated_order(core, list(leased))
        if required:
            batch.holds[len(batch.replies)] = (core.name, required)
        batch.replies.append((replier, request_id, _Messages(len(reads), leased)))
        reads.extend((op.queue_id, op.index) for op in leased)
        self._touch(core)

    def _step_ack(self, command: c.Ack, now_ms: int) -> None:
        core = self._core(command.queue)
        operations = self._open.sealed.operations
        mark = len(operations)
        try:
            if command.release:
                core.release(command.message_id, command.receipt, now_ms, operations)
                self._to_serve.add(core.name)
            elif command.extend_ms is not None:
                core.extend(command.message_id, command.receipt, command.extend_ms, command.client, now_ms,
                            operations)
            elif command.reply_payload is not None:
                core.reply(command.message_id, command.receipt, command.reply_payload, command.client, now_ms, operations)
            else:
                core.ack(command.message_id, command.receipt, command.client, now_ms, operations)
        finally:
            self._touch(core)   # a refused ack may still have ended an overdue lease
            dead = core.dead_letter_core
            if dead is not None and any(type(op) is DeadLettered for op in operations[mark:]):
                # The lease it ended was the message's last delivery: the dead-letter queue's
                # record (its counter) goes into this commit with the message's new row.
                self._touch(dead)
                self._to_serve.add(dead.name)
        self._open.replies.append((command.replier, command.request_id, None))

    def _step_subscribe(self, command: c.Subscribe, now_ms: int) -> None:
        core = self._core(command.queue)
        self._hold_listener(command, command.client)
        subscription = Subscription(self._next_subscription_id, core.name, command.replier,
                                    min(command.credit, self.config.subscription_credit_max),
                                    command.visibility_ms, command.client, command.recipient)
        self._next_subscription_id += 1
        self._subscriptions.setdefault(core.name, {})[subscription.subscription_id] = subscription
        self._subscriptions_by_id[subscription.subscription_id] = subscription
        command.replier.subscription_started(subscription)
        command.replier.reply(command.request_id, subscription.subscription_id)
        self._to_serve.add(core.name)

    def _step_credit(self, command: c.Credit, now_ms: int) -> None:
        subscription = self._subscriptions_by_id.get(command.subscription_id)
        if subscription is None:
            raise QueueError(E_UNKNOWN_QUEUE, f"no subscription {command.subscription_id}")
        subscription.credit = min(subscription.credit + command.credit, self.config.subscription_credit_max)
        self._to_serve.add(subscription.queue)
        command.replier.reply(command.request_id, None)

    # --- recipients (fault surveillance: qserver/features/surveillance/watch.py) ----------------------------
    def recipient_subscriptions(self, queue: str, recipient: str) -> list[Subscription]:
        return [s for s in self._subscriptions.get(queue, {}).values() if s.recipient == recipient]

    def recipients_here(self) -> dict[tuple[str, str], list[Subscription]]:
        """(queue, recipient) -> its subscriptions on this node."""
        out: dict[tuple[str, str], list[Subscription]] = {}
        for queue, subscriptions in self._subscriptions.items():
            for subscription in subscriptions.values():
                if subscription.recipient is not None:
                    out.setdefault((queue, subscription.recipient), []).append(subscription)
        return out

    def end_subscription(self, subscription: Subscription, error: QueueError) -> None:
        """Stop pushing to a subscription (a defunct recipient): its client is told."""
        if self._subscriptions_by_id.pop(subscription.subscription_id, None) is not None:
            self._forget_subscription(subscription)
            subscription.connection.subscription_ended(subscription.subscription_id, error)

    def _forget_subscription(self, subscription: Subscription) -> None:
        subscriptions = self._subscriptions[subscription.queue]
        del subscriptions[subscription.subscription_id]
        if not subscriptions:       # only queues with listeners are looked at (listeners_may_see_more)
            del self._subscriptions[subscription.queue]
        self._subscription_gone(subscription)

    def _subscription_gone(self, subscription: Subscription) -> None:
        """Its place under its connection's and client's listener bounds (_hold_listener)."""
        _count_down(self._listening, ("connection", id(subscription.connection)))
        _count_down(self._listening, ("client", subscription.client))

    def _step_unsubscribe(self, command: c.Unsubscribe, now_ms: int) -> None:
        subscription = self._subscriptions_by_id.pop(command.subscription_id, None)
        if subscription is not None:
            self._forget_subscription(subscription)
        if command.replier is not None:
            command.replier.reply(command.request_id, None)

    def _step_create(self, command: c.CreateQueue, now_ms: int) -> None:
        name = command.name
        if not is_valid_queue_name(name):
            raise QueueError(E_INVALID_NAME, "queue names are 1-196 of A-Z a-z 0-9 . _ : - starting alphanumeric")
        if name.endswith(DEAD_LETTER_SUFFIX):
            raise QueueError(E_RESERVED_NAME, f"names ending {DEAD_LETTER_SUFFIX} belong to dead-letter queues")
        existing = self.cores.get(name)
        entry = self.pairs.view.entry(name)
        if existing is not None or entry is not None:
            if command.placement.get("master_required"):
                raise QueueError(E_MASTER_EXISTS, f"queue {name} already has a master")
            options = existing.options if existing is not None else options_from_json(entry.options)  # type: ignore[union-attr]
            different = mismatched_options(options, command.options)
            if different:
                raise QueueError(E_OPTIONS_MISMATCH, f"queue {name} exists with other {', '.join(different)}")
            if existing is None:
                self.pairs.refuse_if_not_master(name)
                raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name} is being created; retry")
            self._open.replies.append((command.replier, command.request_id, {"created": False, **self.describe(existing)}))
            return
        options = QueueOptions(**command.options)
        if self.coordinator is not None:
            self._propose_create(command, options)
            return
        core = self._create_core(name, options, now_ms, dead_letter_of=None)
        if options.dead_letter:
            core.dead_letter_core = self._create_core(dead_letter_name(name), _dead_letter_options(options), now_ms,
                                                      dead_letter_of=name)
        self._open.replies.append((command.replier, command.request_id, {"created": True, **self.describe(core)}))

    def _propose_create(self, command: c.CreateQueue, options: QueueOptions) -> None:
        """In a cluster a queue exists once the map says so: place it (seed 004 `master` and
        `replica` options, else spread evenly), and the master proposes it. A node that is
        not the chosen master passes the request on (E_NOT_MASTER with the node to ask)."""
        cluster = self.pairs.view.cluster_map
        if command.name in cluster.macros:
            raise QueueError(E_MACRO_REFUSED, f"{command.name} is a macro queue")
        preferred = self.config.placement.get(command.name, [None, None])
        wanted = (command.placement.get("master", preferred[0]), command.placement.get("replica", preferred[1]))
        pair = choose_pair(cluster, wanted)
        if pair is None:
            unknown = [node for node in wanted if node and node not in cluster.nodes]
            raise QueueError(E_INVALID_OPTION if unknown else E_QUEUE_UNAVAILABLE,
                             f"no node {unknown[0]} in the cluster" if unknown else
                             f"no two live nodes for {command.name} (asked {wanted[0] or 'any'} / {wanted[1] or 'any'})")
        master, replica = pair
        if master != self.config.node_id:
            raise Redirect(master, f"queue {command.name} is created by its master {master}", (master, replica))
        if self.coordinator is None:
            raise InvariantViolation(f"queue {command.name} was placed without a membership layer")
        self._pending_creates.setdefault(command.name, []).append((command.replier, command.request_id))
        if len(self._pending_creates[command.name]) > 1:
            return
        create = CreateQueue(command.name, options.to_json(), master, replica, self._rng.getrandbits(62) | 1)

        def decided(outcomes: Any) -> None:
            waiting = self._pending_creates.pop(command.name, [])
            if isinstance(outcomes, QueueError) or not outcomes[0].applied:
                for replier, request_id in waiting:       # lost a race: it exists now, or try again
                    self.submit(c.CreateQueue(command.name, command.options, {}, replier, request_id))
                return
            self._created_waiting.setdefault(command.name, []).extend(waiting)
            self._answer_created(command.name)
        self.coordinator.propose_checked(create, decided, lambda outcomes: outcomes)

    def _answer_created(self, name: str) -> None:
        """Creators wait for the local copy of the map to have made the instance."""
        core = self.cores.get(name)
        if core is None:
            return
        for replier, request_id in self._created_waiting.pop(name, []):
            self._open.replies.append((replier, request_id, {"created": True, **self.describe(core)}))

    def create_master_instance(self, entry: QueueEntry) -> None:
        """The map names this node master of a queue it does not hold: create its instance
        (and dead-letter queue) with the map's incarnation; the replica learns of it once it
        is durable here."""
        now_ms = self.clock_ms()
        options = options_from_json(entry.options)
        core = self._create_core(entry.name, options, now_ms, dead_letter_of=None, incarnation=entry.incarnation,
                                 epoch=entry.epoch)
        created = [core]
        if options.dead_letter:
            dead = self._create_core(dead_letter_name(entry.name), _dead_letter_options(options), now_ms,
                                     dead_letter_of=entry.name, incarnation=entry.incarnation + 1, epoch=entry.epoch)
            core.dead_letter_core = dead
            created.append(dead)
        for queue in created:
            self.pairs.attach(queue, created=True)
            self._open.after_commit.append(functools.partial(self.pairs.announce, queue))
        self._answer_created(entry.name)

    def drop_instance(self, core: QueueCore) -> None:
        """The map no longer lists this node for the queue (deleted, or moved away)."""
        if self.cores.get(core.name) is not core:
            return
        if core.record.state is QueueState.OPEN:
            core.transition(QueueState.CLOSING)
            core.transition(QueueState.CLOSED)
        self._remove_core(core)

    def journal_mark(self, core: QueueCore, role: str, index: int, reason: str) -> None:
        """A journal record of a member taking a role in an epoch (the audit's "epoch" op)."""
        sealed = self._open.sealed
        sealed.journal_marks.append((len(sealed.operations), [
            self.clock_ms(), core.name, core.queue_id, core.record.epoch, index, "epoch", 0, reason, 0, 0, 0, role,
            self.config.node_id, ""]))
        self._touch(core)

    def journal_event(self, core: QueueCore, op: str, subject: str, detail: str) -> None:
        """A journal record of an event about the queue that is no operation on it (a
        recipient's state change): at index 0, `subject` in the dedupe id's column."""
        self._open.sealed.journal_marks.append((len(self._open.sealed.operations), [
            self.clock_ms(), core.name, core.queue_id, core.record.epoch, 0, op, 0, subject, 0, 0, 0,
            "master", self.config.node_id, detail[:200]]))
        self._touch(core)

    def serve_soon(self, queue: str) -> None:
        """Look at the queue's waiting receives and subscriptions in this turn (one unheld)."""
        self._to_serve.add(queue)
        self._wake.set()

    def invoke(self, action: Callable[[int], None]) -> None:
        """Run action(now_ms) on the engine's task (from callbacks of the membership layer)."""
        self._inbox.append(c.Invoke(action))
        if not self._wake.is_set():
            self._wake.set()

    def resubmit(self, command: c.Command) -> None:
        self._inbox.appendleft(command)
        self._wake.set()

    def _step_purge(self, command: c.Purge, now_ms: int) -> None:
        """One bounded step of an operator's purge (PURGE_STEP_MAX messages); the rest goes on
        in the engine's next turn, after this batch is on its way to disk, so purging millions
        never holds the loop or grows one batch without bound."""
        core = self._core(command.queue)
        if not command.upto:
            command.upto = core.record.next_index - 1
        purged, done = core.purge(command.upto, PURGE_STEP_MAX, now_ms, self._open.sealed.operations)
        command.purged += purged
        if purged:
            self._touch(core)
        if done:
            self._open.replies.append((command.replier, command.request_id,
                                       {"queue": command.queue, "purged": command.purged, "upto": command.upto}))
        else:
            asyncio.get_running_loop().call_soon(self._continue, command)

    def _step_durable_subscription(self, command: c.DurableSubscription, now_ms: int) -> None:
        core = self._core(command.queue)
        operations = self._open.sealed.operations
        if command.action == "open":
            result: Any = core.open_subscription(command.subscription, command.client, now_ms, operations)
        elif command.action == "ack":
            result = core.subscriber_ack(command.subscription, command.message_id, command.client, now_ms, operations)
        else:
            core.drop_subscription(command.subscription, command.client, now_ms, operations)
            result = None
        self._touch(core)
        self._open.replies.append((command.replier, command.request_id, result))

    def _continue(self, command: c.Command) -> None:
        """A command's next step, in the engine's next turn."""
        if self._stopping or self.failed is not None:
            _refuse(command, QueueError(E_SHUTTING_DOWN, outcome_unknown=True))
            return
        self._inbox.append(command)
        self._wake.set()

    def _step_invoke(self, command: c.Invoke, now_ms: int) -> None:
        command.action(now_ms)

    def _create_core(self, name: str, options: QueueOptions, now_ms: int, dead_letter_of: str | None,
                     incarnation: int = 0, epoch: int = 1) -> QueueCore:
        record = QueueRecord(self._next_queue_id, name, options, now_ms, dead_letter_of=dead_letter_of,
                             incarnation=incarnation, epoch=epoch)
        self._next_queue_id += 1
        self._open.sealed.next_queue_id = self._next_queue_id
        core = self._new_core(record, [])
        core.transition(QueueState.CONFIGURING)
        core.transition(QueueState.CONFIGURED)
        core.transition(QueueState.OPENING)
        core.transition(QueueState.OPEN)
        self.cores[name] = core
        self._open.sealed.epochs[name] = record.epoch
        self._touch(core)
        return core

    def _step_delete(self, command: c.DeleteQueue, now_ms: int) -> None:
        core = self._core(command.name)
        if core.record.dead_letter_of is not None:
            raise QueueError(E_RESERVED_NAME, f"{command.name} goes with queue {core.record.dead_letter_of}")
        if self.coordinator is not None:
            if command.name not in self.pairs.masters:
                raise QueueError(E_NOT_MASTER, f"queue {command.name} is deleted by its master "
                                               f"{self.pairs.masters_hint(command.name)}")
            incarnation = core.record.incarnation or core.queue_id

            def deleted(outcomes: Any) -> None:
                if isinstance(outcomes, QueueError):
                    command.replier.fail(command.request_id, outcomes)
                elif not outcomes[0].applied:
                    command.replier.fail(command.request_id, QueueError(E_UNKNOWN_QUEUE, outcomes[0].reason))
                else:
                    self._open.replies.append((command.replier, command.request_id, {"deleted": command.name}))
            self.coordinator.propose_checked(DeleteQueue(command.name, incarnation), deleted, lambda o: o)
            return
        for victim in filter(None, (core, self.cores.get(dead_letter_name(core.name)))):
            self.drop_instance(victim)
        self._open.replies.append((command.replier, command.request_id, {"deleted": command.name}))

    def _drop_queue_listeners(self, name: str, error: QueueError | None = None) -> None:
        """Waiting receivers and subscribers of a queue this node no longer serves."""
        error = error or QueueError(E_UNKNOWN_QUEUE, f"queue {name} was deleted")
        for waiter in self._waiters.pop(name, {}).values():
            waiter.command.replier.fail(waiter.command.request_id, error)
        for subscription in self._subscriptions.pop(name, {}).values():
            self._subscriptions_by_id.pop(subscription.subscription_id, None)
            self._subscription_gone(subscription)
            subscription.connection.subscription_ended(subscription.subscription_id, error)

    def master_left(self, core: QueueCore, new_master: str) -> None:
        """This node stopped mastering a `full` queue: its waiters and subscribers go to the
        new master (the client follows E_NOT_MASTER)."""
        if core.options.strength.value == "full":
            self._drop_queue_listeners(core.name, QueueError(E_NOT_MASTER, f"queue {core.name} is now mastered by "
                                                                           f"{new_master}"))

    def _step_status(self, command: c.MessageStatus, now_ms: int) -> None:
        core = self._core(command.queue)
        if not 1 <= command.message_id < core.record.next_index:
            raise _no_status(command)
        if command.wait_ms > 0:
            self._hold_listener(command, command.client)
        waiter = StatusWaiter(command, core.queue_id, self.monotonic_ms() + command.wait_ms,
                              core.record.options.tracks_status)
        # Read after the batch in flight lands, so the answer never shows uncommitted state.
        self._open.after_commit.append(lambda: self._check_status(waiter, final=command.wait_ms == 0))

    def _step_put_client(self, command: c.PutClient, now_ms: int) -> None:
        if command.record is None and command.client_id not in self.clients:
            raise QueueError(E_UNKNOWN_CLIENT, f"no client {command.client_id}")
        name = None if command.record is None else command.record.get("name")
        if name is not None and any(other != command.client_id and record.get("name") == name
                                    for other, record in self.clients.items()):
            # Checked again here, in the engine's one thread: the handler's check and this step
            # are apart by an await, and two registrations of one name both passed it (issue 32).
            raise QueueError(E_CLIENT_EXISTS, f"a client named {name} exists")
        if self.coordinator is not None:
            # The registry is part of the cluster map: every node stores what the map applies.
            def decided(outcomes: Any) -> None:
                if isinstance(outcomes, QueueError):
                    command.replier.fail(command.request_id, outcomes)
                    return
                if outcomes and not outcomes[0].applied:
                    # The map refused it: a registration of the name through another node was
                    # applied first (cluster_map.py, PutClient).
                    command.replier.fail(command.request_id, QueueError(E_CLIENT_EXISTS, outcomes[0].reason))
                    return
                self.store_client(command.client_id, command.record)
                self._open.replies.append((command.replier, command.request_id, command.record))
            self.coordinator.propose_checked(MapPutClient(command.client_id, command.record), decided, lambda o: o)
            return
        self.store_client(command.client_id, command.record)
        self._open.replies.append((command.replier, command.request_id, command.record))

    def store_client(self, client_id: str, record: dict[str, Any] | None) -> None:
        """Put (or, with None, remove) a client record here; idempotent."""
        if record is None:
            if self.clients.pop(client_id, None) is None:
                return
            self._open.sealed.client_deletes.append(client_id)
        else:
            if self.clients.get(client_id) == record:
                return
            self.clients[client_id] = record
            self._open.sealed.client_puts[client_id] = record
        self._open.after_commit.append(self.on_clients_changed)

    def _step_peer_message(self, command: c.PeerMessage, now_ms: int) -> None:
        self.pairs.on_peer_message(command.peer, command.data, self.monotonic_ms())

    def _step_link_change(self, command: c.LinkChange, now_ms: int) -> None:
        self.pairs.on_link_change(command.peer, command.up, self.monotonic_ms())

    _STEP_OTHER: dict[type, Callable[[Engine, Any, int], None]] = {
        c.Subscribe: _step_subscribe, c.Credit: _step_credit, c.Unsubscribe: _step_unsubscribe,
        c.CreateQueue: _step_create, c.DeleteQueue: _step_delete, c.MessageStatus: _step_status,
        c.PutClient: _step_put_client, c.PeerMessage: _step_peer_message, c.LinkChange: _step_link_change,
        c.Invoke: _step_invoke, c.Purge: _step_purge, c.Head: _step_head,
        c.DurableSubscription: _step_durable_subscription,
    }

    # --- time-driven work ------------------------------------------------------------------
    def _full_master_may_decide(self) -> bool:
        """Under `full`, a master takes ordering indices on its own (expiry, serving waiting
        receives) only while it holds its lease: one cut off, or just restarted on a map that
        has moved on, would write a suffix in its old epoch at indices the pair's history uses
        for other operations (its replica never accepts them; the audit sees two operations at
        one index of one epoch)."""
        return self.coordinator is None or self.coordinator.lease_valid()

    def _run_timed_steps(self, now_ms: int, mono_ms: int) -> None:
        """The timed steps whose time has come: leases run out, delayed messages mature,
        messages past their time to live expire (each queue this node decides them for)."""
        operations = self._open.sealed.operations
        may_decide = self._refresh_deadlines()
        for name in self._due.pop_due(mono_ms):
            core = self.cores.get(name)
            if core is None or not self._decides_time(core, may_decide):
                continue
            deadline = core.next_deadline()
            if deadline is None or deadline > mono_ms:
                continue
            mark = len(operations)
            ended = core.expire_leases(now_ms, operations)
            ended += core.mature_messages(now_ms, operations) + core.expire_messages(now_ms, operations)
            if ended:
                self._decided(core, operations[mark:])

    def _refresh_deadlines(self) -> bool:
        """Bring the timer heap up to date with what changed; returns whether a `full` master
        may decide now. A node that regains its lease has every queue asked again (rare): the
        `full` masters it holds were left out while it could not decide."""
        may_decide = self._full_master_may_decide()
        if may_decide and not self._may_decide_time:
            self._due.changed_all(self.cores)
            self._to_serve.update([*self._waiters, *self._subscriptions])   # their waiters waited on
        self._may_decide_time = may_decide
        self._due.refresh(functools.partial(self._deadline_decided_here, may_decide=may_decide))
        return may_decide

    def _deadline_decided_here(self, name: str, *, may_decide: bool) -> int | None:
        core = self.cores.get(name)
        return core.next_deadline() if core is not None and self._decides_time(core, may_decide) else None

    def _decides_time(self, core: QueueCore, may_decide: bool) -> bool:
        """Whether this node decides the queue's timed steps: under `full` the master, while it
        may decide (see _full_master_may_decide), and the replica applies its decisions; under
        `producer` each member for its own copy (each serves its own consumers). A core with no
        role yet (the map not replayed after a restart) decides nothing: under `full` it would
        take ordering indices outside the stream, under `producer` its steps would be journaled
        under no member's role. Nor does its timer wake for them: a `full` replica's applied
        leases left deadlines in its heap that nothing popped, and once the first had passed its
        node woke every millisecond for good (0.06 of a core on an idle cluster against 0.02)."""
        pairs = self.pairs
        if not pairs.clustered:
            return True
        if pairs.restarting(core.name):
            return False
        if core.options.strength is Strength.FULL:
            return may_decide and core.name in pairs.masters
        return core.name in pairs.masters or core.name in pairs.replicas

    def listeners_may_see_more(self, name: str) -> None:
        """In a pair, ready is not enough: only committed messages are visible, and the commit
        point moves with the replica's acknowledgements. The pair driver calls this whenever
        something happened to the queue's role; a queue with listeners is served then."""
        if name in self._waiters or name in self._subscriptions:
            self._to_serve.add(name)

    def _serve(self, now_ms: int) -> None:
        """Hand ready messages to waiting receives, then to subscriptions with credit: of the
        queues something happened to in this turn (never a walk over every queue)."""
        may_decide = True
        if self.pairs.clustered:
            may_decide = self._full_master_may_decide()
        # A lease may dead-letter expired messages on its way: their queues are served next turn.
        serving, self._to_serve = self._to_serve, set()
        for name in serving:
            core = self.cores.get(name)
            if core is None or not core.has_ready():
                continue
            if not may_decide and core.options.strength.value == "full" and name in self.pairs.masters:
                continue          # see _full_master_may_decide; the waiters wait on
            if self.pairs.restarting(name):
                continue          # its new epoch first (PairDriver.restarted)
            waiters = self._waiters.get(name)
            while waiters:
                command = next(iter(waiters.values())).command
                if not isinstance(command, c.Receive):        # a look at the head (c.Head)
                    if not self._answer_head(core, command, now_ms):
                        break
                    waiters.popitem(last=False)
                    continue
                leased = self._lease(core, command.max_messages, command.visibility_ms, command.client, now_ms)
                if not leased:
                    break       # nothing visible yet: the waiter keeps waiting
                waiters.popitem(last=False)
                self._answer_with_messages(core, command.replier, command.request_id, leased)
            if waiters is not None and not waiters:
                del self._waiters[name]
            for subscription in self._subscriptions.get(name, {}).values():
                if subscription.credit > 0 and not subscription.held:
                    leased = self._lease(core, subscription.credit, subscription.visibility_ms, subscription.client,
                                         now_ms)
                    if not leased:
                        break
                    subscription.credit -= len(leased)
                    if subscription.recipient is not None and core.options.fault_interval_s:
                        subscription.pushed.update((op.index, op.receipt) for op in leased)
                    self._push(core, subscription, leased)
        if self._to_serve:
            self._wake.set()

    def _push(self, core: QueueCore, subscription: Subscription, leased: list[Leased]) -> None:
        batch = self._open
        reads = batch.sealed.payload_reads
        required = self.pairs.replicated_order(core, list(leased))
        if required:
            batch.push_holds[len(batch.pushes)] = (core.name, required)
        batch.pushes.append((subscription, len(reads), leased))
        reads.extend((op.queue_id, op.index) for op in leased)
        self._touch(core)

    def _expire_waiters(self, now_ms: int) -> None:
        """Answer receives whose wait ran out (empty) and status waits (with the state now):
        only those due, from the deadline heaps (issue 32, item 11: every turn walked every
        waiter). A heap entry of a waiter answered meanwhile is dropped as it comes up."""
        heap = self._waiter_deadlines
        while heap and heap[0][0] <= now_ms:
            _, key, waiter = heapq.heappop(heap)
            name = waiter.command.queue
            waiters = self._waiters.get(name)
            if waiters is None or waiters.get(key) is not waiter:
                continue                          # answered already
            del waiters[key]
            if not waiters:
                del self._waiters[name]
            waiter.command.replier.reply(waiter.command.request_id, [])
        if len(self._waiter_deadlines) + len(self._status_deadlines) > self._compact_deadlines_at:
            self._compact_deadlines()
        status_heap = self._status_deadlines
        while status_heap and status_heap[0][0] <= now_ms:
            status_waiter = heapq.heappop(status_heap)[2]
            held_key = (status_waiter.queue_id, status_waiter.command.message_id)
            held = self._status_waiters.get(held_key, [])
            position = next((i for i, w in enumerate(held) if w is status_waiter), None)
            if position is None:
                continue                          # answered already, or held again (a later entry)
            del held[position]
            if not held:
                del self._status_waiters[held_key]
            self._check_status(status_waiter, final=True)

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heaps from the waiters still waiting: an entry of a waiter
        answered early stays until its deadline, and would hold its request (and reply) that
        long. Run when the heaps pass twice what they held after the last rebuild: amortized
        O(1) per waiter."""
        self._waiter_deadlines = [(w.deadline_ms, w.key, w) for waiters in self._waiters.values()
                                  for w in waiters.values()]
        heapq.heapify(self._waiter_deadlines)
        self._status_deadlines = [(w.deadline_ms, next(self._waiter_keys), w) for held in self._status_waiters.values()
                                  for w in held]
        heapq.heapify(self._status_deadlines)
        self._compact_deadlines_at = max(DEADLINES_COMPACT_MIN,
                                         2 * (len(self._waiter_deadlines) + len(self._status_deadlines)))

    def _arm_timer(self, now_ms: int) -> None:
        deadlines = [self._next_housekeeping_ms]
        if self.pairs.clustered:
            deadlines.append(self._next_replication_tick_ms)
        may_decide = self._refresh_deadlines()
        if self.self_checks and may_decide:
            self._due.check(self.cores, functools.partial(self._deadline_decided_here, may_decide=True))
        timed = self._due.next_deadline()
        if timed is not None:
            deadlines.append(timed)
        if self._waiter_deadlines:
            deadlines.append(self._waiter_deadlines[0][0])
        if self._status_deadlines:
            deadlines.append(self._status_deadlines[0][0])
        delay_s = max(0.0, (min(deadlines) - now_ms) / 1000) + 0.001
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(min(delay_s, 1.0), self._wake.set)

    # --- group commit ----------------------------------------------------------------------
    def _start_commit(self) -> None:
        """Seal the open batch and commit it on the writer thread: never on the loop, whose
        heartbeats and lease renewals must not wait for an fsync (committing a lone message
        inline saved no measurable latency: bench/RESULTS.md, "The hot path")."""
        batch, self._open = self._open, OpenBatch()
        sealed = batch.sealed
        sealed.dedupe_window_ms = int(self.config.dedupe_window_s * 1000)
        sealed.status_retention_ms = int(self.config.status_retention_s * 1000)
        touched = batch.touched
        if self.self_checks:
            self._check_touched(batch)
        self.pairs.before_commit(sealed.operations, sealed.oplog_rows, self.monotonic_ms(), touched)
        self._count_written(sealed)
        sealed.log_floors = self.pairs.log_floors()
        replicas = self.pairs.replicas
        sealed.replica_queue_ids = {core.queue_id for name, core in touched.items() if name in replicas}
        for name, core in batch.touched.items():
            known = self.pairs.commit_order(name)
            # A master without a lease acknowledges nothing (docs/PROTOCOL.md, "A master restarted inside its lease"): what it commits
            # alone meanwhile is not known committed (a snapshot lets a member keep what is).
            if known is not None and self.pairs.may_answer(name):
                core.record.commit_order = known
            sealed.queue_records[name] = core.record.to_json(streams=False)
            if core.record.changed_streams:
                sealed.stream_puts.extend((core.queue_id, key, stream) for key, stream in
                                          core.record.take_changed_streams())
            core.seal()
        self._committing = batch
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
        held &= {core.queue_id for core in self.cores.values()}      # not those deleted meanwhile
        if not held <= ids:
            raise InvariantViolation(f"a batch holds operations of queues {sorted(held - ids)} it does not list")

    def _submit_commit(self, sealed: SealedBatch) -> None:
        # Runs as a loop callback, where an exception would only be logged: a writer that
        # takes no more work leaves every answer waiting for ever.
        try:
            future = asyncio.get_running_loop().run_in_executor(self._writer, self.storage.commit, sealed)
        except Exception as error:
            self.fail("the writer thread takes no more commits", error)
            return
        future.add_done_callback(self._commit_done)

    def _commit_done(self, future: asyncio.Future[CommitResult]) -> None:
        """A done-callback: anything raised here would be logged by the loop and forgotten while
        the engine went on with memory storage may not match, so it stops the node instead."""
        if self.failed is not None or future.cancelled():   # cancelled: a simulation's crash of the node
            return
        try:
            self._finish_commit(future)
        except Exception as error:
            self.fail("completing a commit failed", error)

    def _finish_commit(self, future: asyncio.Future[CommitResult]) -> None:
        batch = self._committing
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
            self._committing = None
            self._abandon(batch, error)
            return
        except Exception as error:  # an LMDB failure (I/O): nothing was stored
            log.exception("commit failed")
            self._committing = None
            self._abandon(batch, error)
            return
        self._committing = None
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
        self._release(batch, result.payloads, result.headers)
        self._wake.set()

    def grow_storage(self) -> None:
        """Grow the LMDB map (loop thread), or raise StorageFull. Between two of the writer's
        jobs: LMDB refuses to resize the map while a write transaction is active, and the
        membership layer's writes and journal prunes share the writer with the commits (one of
        them running here left a batch committing for ever: the engine answered nothing more
        and could not stop). The membership layer calls it for a Raft write that found the map full."""
        self.storage.end_read()
        with self._writer.lock:
            size = self.storage.grow_map()
        log.info("storage map grown to %d bytes", size)

    def _grow_and_retry(self, batch: OpenBatch) -> None:
        try:
            self.grow_storage()
        except Exception as error:     # StorageFull, or LMDB's refusal: nothing was stored
            if not isinstance(error, StorageFull):
                log.exception("growing the storage map failed")
            self._committing = None
            self._abandon(batch, error)
            return
        self._submit_commit(batch.sealed)

    def _abandon(self, batch: OpenBatch, error: Exception) -> None:
        """A batch could not be stored. Its commands, and those stepped on top of it, fail; the
        queues they touched are rebuilt from storage, which still holds exactly what was
        committed (the others, and their roles, go on as they are). Storage found full refuses
        new messages from now on, until there is room again (_check_space)."""
        self.batches_abandoned += 1
        if isinstance(error, StorageFull):
            self._found_full(batch, error)
        later, self._open = self._open, OpenBatch()
        for failed in (batch, later):
            for position, (replier, request_id, _) in enumerate(failed.replies):
                # The lost batch's replicated operations went to the replicas, which may store them.
                replier.fail(request_id, _refusal(error, streamed=failed is batch and position in failed.holds))
            for subscription, _, leased in failed.pushes:
                subscription.credit += len(leased)
        if isinstance(error, InvariantViolation):
            raise error
        self._reload(batch, later)
        self._to_serve.update(self.cores)
        self._wake.set()

    def _reload(self, *lost: OpenBatch) -> None:
        """Rebuild from storage the queues the lost batches touched (records and leases, as at a
        start, with their dead-letter partners), and give each its role again (PairDriver.reload)."""
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
        names |= {dead_letter_name(base) for base in map(_base_name, names)} | set(map(_base_name, names))
        self._due.changed_all(names)
        stored = {record.name: record for record in self.storage.load_queue_records() if record.name in names}
        for name in names:
            old = self.cores.pop(name, None)
            record = stored.get(name)
            if record is not None:
                self.cores[name] = self._new_core(record, self.storage.load_leases(record.queue_id))
            elif old is not None:
                self._drop_queue_listeners(name)         # created in the lost batch: never stored
        for name in names:
            core = self.cores.get(name)
            if core is not None and not name.endswith(DEAD_LETTER_SUFFIX):
                core.dead_letter_core = self.cores.get(dead_letter_name(name))
        mono_ms = self.monotonic_ms()
        for name in sorted(names):           # a queue before its dead-letter queue
            self.pairs.reload(name, self.cores.get(name), reached, mono_ms)
        self.pairs.release_committed()
        self.storage.end_read()
        self.clients = self.storage.load_clients()
        self._next_queue_id = self.storage.next_queue_id()

    # --- room in storage -------------------------------------------------------------------
    def _found_full(self, batch: OpenBatch, error: StorageFull) -> None:
        """A write found no room: refuse new messages now. Taken again once the disk has its
        reserve free with this batch's size twice over to spare (it may come again), or the
        map has room (it was at its limit), and the hold has passed (FULL_HOLD_INITIAL_MS)."""
        sealed = batch.sealed
        size = sum(len(row[4]) for row in sealed.oplog_rows) + sum(
            len(op.payload) for op in sealed.operations if type(op) is Enqueued)
        self._resume_bytes = SPACE_RESUME_BYTES + 2 * size
        self._map_full = self._map_full or error.map_limit
        mono_ms = self.monotonic_ms()
        if self._last_found_full_ms is not None and mono_ms - self._last_found_full_ms > FULL_HOLD_RESET_MS:
            self._full_hold_ms = FULL_HOLD_INITIAL_MS
        self._last_found_full_ms = mono_ms
        self._full_until_ms = mono_ms + self._full_hold_ms
        self._full_hold_ms = min(2 * self._full_hold_ms, FULL_HOLD_MAX_MS)
        self._set_storage_full(str(error), mono_ms)
        self._next_space_check_ms = 0

    def _count_written(self, sealed: SealedBatch) -> None:
        """Near the reserve, what this batch will write counts against the room last measured
        (without a reserve, writes go on to the disk's end and a full disk refuses them)."""
        space, reserve = self.space, self.config.disk_reserve_bytes
        if space is None or not reserve or space.disk_free_bytes - self._written_since_measured > \
                reserve + SPACE_COUNTED_BYTES:
            return
        logged = sum(len(row[4]) for row in sealed.oplog_rows)    # in a pair the entries hold the payloads
        payloads = logged or sum(len(op.payload) for op in sealed.operations if type(op) is Enqueued)
        self._written_since_measured += 2 * payloads

    def _check_space(self, mono_ms: int) -> None:
        """Refuse new messages while the disk has less than its reserve free (acknowledgements,
        deletes and the membership layer's writes may use the reserve), or once a write found
        no room; take them again when there is room with some to spare, so a node at the edge
        does not flip at every commit. Measured every SPACE_CHECK_INTERVAL_MS (a few stat
        calls), and between two measurements less what the batches since wrote."""
        if mono_ms >= self._next_space_check_ms:
            self._next_space_check_ms = mono_ms + SPACE_CHECK_INTERVAL_MS
            measure = getattr(self.storage, "space", None)   # an in-memory twin (tests/sim) has no disk to measure
            measured = measure() if measure is not None else None
            if measured is not None:
                self.space, self._written_since_measured = measured, 0
        space = self.space
        if space is None:
            return
        disk_free = space.disk_free_bytes - self._written_since_measured
        reserve = self.config.disk_reserve_bytes
        slack = self._resume_bytes if self.storage_full is not None else 0
        if self._map_full and space.map_free_bytes >= slack + min(SPACE_RESUME_BYTES, self.storage.map_size_max_bytes // 16):
            self._map_full = False
        why: str | None = None
        if disk_free < reserve + slack:
            why = f"{max(0, disk_free)} bytes free on its disk, {reserve} kept in reserve"
        elif self._map_full:
            why = f"its map is full at its limit of {self.storage.map_size_max_bytes} bytes"
        elif mono_ms < self._full_until_ms:
            why = self.storage_full       # a write found no room a moment ago
        self._set_storage_full(why, mono_ms)

    def _set_storage_full(self, why: str | None, mono_ms: int) -> None:
        was_full = self.storage_full is not None
        self.storage_full = why
        if was_full == (why is not None):
            return
        if why is not None:
            log.warning("storage full (%s): new messages are refused with E_STORAGE_FULL and this node's replicas "
                        "stop following until there is room", why)
        else:
            log.warning("storage has room again: new messages are taken and this node's replicas catch up")
            self._resume_bytes = SPACE_RESUME_BYTES
        self.pairs.storage_full_changed(why is not None, mono_ms)
        if why is None:
            self._recreate_lost_masters()

    def _recreate_lost_masters(self) -> None:
        """Instances the map gives this node as master that a lost batch was creating."""
        if not self.pairs.clustered:
            return
        for name, entry in self.pairs.view.cluster_map.queues.items():
            if entry.master == self.config.node_id and name not in self.cores:
                self.create_master_instance(entry)

    def _release(self, batch: OpenBatch, payloads: list[bytes | None], headers: list[dict[str, str] | None]) -> None:
        """Answer what this batch decided. Answers about replicated operations of a pair wait
        until the queue's commit point passes them (docs/PROTOCOL.md, "Replication messages"): the pair driver holds
        those and releases them when the replica's acknowledgement arrives."""
        holds, hold = batch.holds, self.pairs.hold
        for position, (replier, request_id, result) in enumerate(batch.replies):
            if type(result) is _Messages:
                result = self._messages(result.leased, payloads, headers, result.first)
            held = holds.get(position) if holds else None
            if held is None or not hold(held[0], held[1], functools.partial(replier.reply, request_id, result),
                                        functools.partial(replier.fail, request_id),
                                        write=position in batch.write_holds):
                replier.reply(request_id, result)
        for position, (subscription, first, leased) in enumerate(batch.pushes):
            messages = self._messages(leased, payloads, headers, first)
            push = functools.partial(subscription.connection.push, subscription.subscription_id, messages)
            held = batch.push_holds.get(position)
            if held is None or not hold(held[0], held[1], push):
                push()
        for callback in batch.after_commit:
            callback()
        if self._status_waiters:
            self._wake_status_waiters(batch.sealed.operations)

    @staticmethod
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

    # --- message status (seed 004 CheckMsgCompletion) --------------------------------------
    def _check_status(self, waiter: StatusWaiter, *, final: bool) -> None:
        command = waiter.command
        with_read = not self.storage.reading
        if with_read:
            self.storage.begin_read()
        try:
            found = self.storage.message_status(waiter.queue_id, command.message_id)
            producer = None if found is None or command.admin else \
                self.storage.status_producer(waiter.queue_id, command.message_id)
        finally:
            if with_read:
                self.storage.end_read()
        # Only the producer, or an admin of the queue, reads a status and its reply
        # (docs/PROTOCOL.md, "Grants"; issue 32, item 13). Checked on every look, a waiter's too.
        if found is None:
            if waiter.tracks_status:
                # A queue that keeps statuses holds none for this id: never a message's (under
                # `full` consumption steps take ids too), or its status passed the retention.
                command.replier.fail(command.request_id, _no_status(command))
                return
            found = ("acked", 0, None)   # no status kept: a message that left leaves no record
        elif not command.admin and (producer is None or producer != command.client):
            # Another producer's message (or a status row older than the producer field: an
            # admin's): answered as an unknown id, so ids and their states are not revealed.
            command.replier.fail(command.request_id, _no_status(command))
            return
        state, deliveries, reply = found
        if final or state in command.until:
            result: dict[str, Any] = {"id": command.message_id, "state": state, "deliveries": deliveries}
            if reply is not None:
                result["reply"] = reply
            command.replier.reply(command.request_id, result)
        else:
            self._status_waiters.setdefault((waiter.queue_id, command.message_id), []).append(waiter)
            heapq.heappush(self._status_deadlines, (waiter.deadline_ms, next(self._waiter_keys), waiter))

    def _wake_status_waiters(self, operations: list[Operation]) -> None:
        for op in operations:
            if isinstance(op, SubscriptionOpened | SubscriptionDropped):
                continue                 # a subscription's step names no message
            waiters = self._status_waiters.pop((op.queue_id, op.index), None)
            for waiter in waiters or ():
                self._check_status(waiter, final=False)

    def _fail_waiters_on_stop(self) -> None:
        for name in list(self._waiters):
            for waiter in self._waiters.pop(name).values():
                waiter.command.replier.fail(waiter.command.request_id, QueueError(E_SHUTTING_DOWN))
        for status_waiters in self._status_waiters.values():
            for status_waiter in status_waiters:
                status_waiter.command.replier.fail(status_waiter.command.request_id, QueueError(E_SHUTTING_DOWN))
        self._status_waiters.clear()

    # --- views -----------------------------------------------------------------------------
    def describe(self, core: QueueCore) -> dict[str, Any]:
        """Seed 004 QueueStats for one queue (replication fields filled by later releases)."""
        record = core.record
        replication = self.pairs.describe(core.name)
        return {**{
            "name": record.name, "incarnation": record.incarnation or record.queue_id, "state": record.state.value,
            "options": record.options.to_json(), "epoch": record.epoch,
            "master": self.config.node_id, "replica": None, "replication_state": "unreplicated",
            "master_status": "local",
            "depth": core.depth, "in_flight": core.in_flight, "ready": record.ready_count,
            "delayed": record.delayed_count,
            "total_enqueued": record.total_enqueued, "total_acked": record.total_acked,
            "total_dead_lettered": record.total_dead_lettered, "total_purged": record.total_purged,
            "total_expired": record.total_expired,
            "total_redelivered": record.total_redelivered,
            "highest_depth": record.highest_depth, "configured_depth": record.options.max_depth,
            "overflows": core.overflows,
            "average_service_ms": (record.service_ms_total / record.service_count) if record.service_count else 0.0,
            "next_index": record.next_index, "dead_letter_of": record.dead_letter_of,
        }, **replication}

    def pending_commands(self) -> int:
        return len(self._inbox)


def _refusal(error: Exception, *, streamed: bool) -> QueueError:
    """The answer to a command of a batch that could not be stored. `streamed`: its operations
    went to the queue's replica, which may have stored them (they come back only if that
    replica is promoted before it opens again): its outcome is unknown."""
    if isinstance(error, StorageFull):
        return QueueError(E_STORAGE_FULL, f"{error}; nothing was stored here", outcome_unknown=streamed)
    return QueueError(E_INTERNAL, f"storage failure: {error}", outcome_unknown=streamed)


def _base_name(queue: str) -> str:
    return queue[:-len(DEAD_LETTER_SUFFIX)] if queue.endswith(DEAD_LETTER_SUFFIX) else queue


def _headers(headers: Any) -> dict[str, str] | None:
    try:
        return checked_headers(headers)
    except OptionError as error:
        raise QueueError(E_INVALID_OPTION, str(error)) from None


def _dead_letter_options(options: QueueOptions) -> QueueOptions:
    return QueueOptions(max_depth=2**40, dead_letter=False, strength=options.strength)
