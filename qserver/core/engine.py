"""The engine: the one task that owns every queue core of a node.

API handlers push commands into a bounded inbox; the engine's task drains it, steps each
command into its queue core (qserver/core/steps.py), and collects the resulting operations
into the open batch. One batch at a time is committed by the writer thread (one LMDB
transaction, one fsync) while the next one fills: group commit (qserver/core/pipeline.py, which
also says the order of one batch: decide, send, persist, answer). No locks: only this task
touches cores; the writer thread only reads a sealed batch.

The engine owns the turn: the inbox, the replication tick, the timed steps (leases run out,
delayed messages mature, messages expire), serving listeners (qserver/core/listeners.py), the
storage's room (qserver/core/space.py), housekeeping, and starting a commit. Which cores exist
is the registry's (qserver/core/registry.py). The cluster side (pairs, coordinator, relay)
comes in through `connect` as the protocols of qserver/core/replication_port.py; it sees the
core through qserver/core/ports.py. qserver/assembly.py wires the two.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.deadlines import DueQueues
from qserver.core.listeners import Listeners, Subscription
from qserver.core.pipeline import CommitPipeline
from qserver.core.registry import QueueRegistry
from qserver.core.replication_port import HandoffGate, LeaseCheck, Pairs, Relay
from qserver.core.space import StorageRoom
from qserver.core.steps import CommandSteps
from qserver.metrics import Histogram
from qserver.storage.housekeeping import PassSchedule
from qserver.storage.lmdb_store import Storage, StorageSpace
from replication.invariants import InvariantViolation
from replication.master import MasterRole
from replication.messages import RelayRequest
from replication.options import Strength
from replication.queue_core import QueueCore
from wire.errors import E_INTERNAL, E_OVERLOADED, E_SHUTTING_DOWN, QueueError

log = logging.getLogger("qserver.core.engine")
TERMINAL_STATES = frozenset({"acked", "replied", "dead_lettered", "purged", "expired"})
REPLICATION_TICK_MS = 50    # how often replication roles check lag, resends and retries


# The cluster side's types, as the assembly made them (qserver/assembly.py): the node reads
# `engine.pairs` and `engine.coordinator` as what they are; the core only as the ports.
P = TypeVar("P", bound=Pairs)
G = TypeVar("G", bound=HandoffGate)


def _refuse(command: c.Command, error: QueueError) -> None:
    if command.replier is not None:   # an unsubscribe from a closed socket expects no answer
        command.replier.fail(command.request_id, error)


def wall_ms() -> int:
    return int(time.time() * 1000)


def monotonic_clock_ms() -> int:
    return int(time.monotonic() * 1000)


class Engine(Generic[P, G]):
    """The task and its turn. For the cluster side it is the `Scheduler` and the `PairEvents`
    of qserver/core/ports.py; its `pipeline` is the `Staging`, its `registry` the `Instances`."""

    # A simulation turns this on: after each turn the engine checks its bookkeeping of what
    # changed (timers, ticking pairs, log floors) against a walk over every queue.
    self_checks = False
    pairs: P                                # given by connect (qserver/assembly.py)
    coordinator: G | None
    listeners_may_see_more: Callable[[str], None]
    master_left: Callable[[QueueCore, str], None]
    role_changed: Callable[[str], None]
    run_relayed: Callable[[MasterRole, RelayRequest], None]
    store_client: Callable[[str, dict[str, Any] | None], None]

    def __init__(self, config: NodeConfig, storage: Storage, *, rng: random.Random | None = None,
                 clock_ms: Callable[[], int] = wall_ms, writer: Executor | None = None,
                 monotonic_ms: Callable[[], int] | None = None,
                 on_fatal: Callable[[str, BaseException | None], None] | None = None) -> None:
        """`on_fatal(reason, error)`: called once when the engine can no longer trust its
        memory (a broken invariant, its task ending on an error); a node passes
        qserver.core.failstop.stop_process, which ends the process. Without it (in-process tests,
        simulations) the engine stops serving and `failed` says why. The engine serves once
        `connect` gave it its cluster side (qserver/assembly.py, build_engine)."""
        self.config = config
        self._on_fatal = on_fatal
        self.failed: BaseException | None = None
        self.storage = storage
        # Two clocks. `clock_ms` (the wall clock) is what records say: enqueue and lease times,
        # the dedupe window, the journal. `monotonic_ms` times everything that waits: leases,
        # receive waits, held answers, relayed requests, handoffs, replication ticks; a wall
        # clock that steps (NTP) or differs between nodes must not move a deadline.
        self.clock_ms = clock_ms
        self.monotonic_ms = monotonic_ms or monotonic_clock_ms
        self._rng = rng or random.Random()
        self._inbox: collections.deque[c.Command] = collections.deque()
        self._wake = asyncio.Event()
        wake = self._wake_up
        self._due = DueQueues()                  # each queue's next timed step (qserver/core/deadlines.py)
        self.room = StorageRoom(config, storage, self.monotonic_ms)
        self.listeners = Listeners(config, storage, self.monotonic_ms, wake)
        # The one writer. A simulation passes an executor that runs commits deterministically.
        self.pipeline = CommitPipeline(
            config, storage, writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmdb-writer"),
            clock_ms=clock_ms, monotonic_ms=self.monotonic_ms, listeners=self.listeners, room=self.room,
            due=self._due, wake=wake, fail=self.fail, failed=lambda: self.failed is not None,
            self_checks=lambda: self.self_checks)
        self.registry = QueueRegistry(config, storage, self._rng, clock_ms=clock_ms, monotonic_ms=self.monotonic_ms,
                                      pipeline=self.pipeline, listeners=self.listeners, due=self._due)
        self.listeners.pipeline = self.pipeline
        self.listeners.registry = self.registry
        self.pipeline.registry = self.registry
        self.steps = CommandSteps(config, self._rng, clock_ms=clock_ms, monotonic_ms=self.monotonic_ms,
                                  registry=self.registry, pipeline=self.pipeline, listeners=self.listeners,
                                  room=self.room, submit=self.submit, continue_later=self._continue)
        self.room.on_changed = self._storage_full_changed
        # PairEvents (qserver/core/ports.py), each handled by the part that owns it: listeners are
        # served again when their queue's commit point may have moved, or dropped when a `full`
        # queue's master moved away; a role given or taken may change who decides the queue's
        # timed steps (see _decides_time); a replica's relayed request is stepped here.
        self.listeners_may_see_more = self.listeners.listeners_may_see_more
        self.master_left = self.listeners.master_left
        self.role_changed = self._due.changed.add
        self.run_relayed = self.steps.run_relayed
        self.store_client = self.registry.store_client
        self.coordinator = None
        self._lease: LeaseCheck | None = None    # the coordinator's lease (full_master_may_decide)
        self._may_decide_time = True             # full_master_may_decide() as of the last turn
        self._housekeeping = PassSchedule(config.housekeeping_interval_ms)
        self._next_replication_tick_ms = 0
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self.rejected = collections.Counter[str]()
        # A queue's FAILED state and reason, judged by the cluster side (set by the node).
        self.health_fields: Callable[[str], dict[str, Any]] = lambda name: {}

    def connect(self, pairs: P, coordinator: G | None, relay: Relay) -> None:
        """The cluster side: the pair driver (every node has one; outside a cluster it holds no
        role), the coordinator (None outside a cluster), the relay between pair members."""
        self.pairs, self.coordinator = pairs, coordinator
        self._lease = coordinator.lease if coordinator is not None else None
        self.registry.pairs = self.listeners.pairs = self.pipeline.pairs = pairs
        self.steps.connect(pairs, coordinator, relay)

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.registry.load()
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

    async def stop(self) -> None:
        """Answer what is queued with E_SHUTTING_DOWN, commit what was decided, stop."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self.pipeline.writer.shutdown(wait=True)

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

    def invoke(self, action: Callable[[int], None]) -> None:
        """Run action(now_ms) on the engine's task (from callbacks of the membership layer)."""
        self._inbox.append(c.Invoke(action))
        if not self._wake.is_set():
            self._wake.set()

    def resubmit(self, command: c.Command) -> None:
        self._inbox.appendleft(command)
        self._wake.set()

    def _continue(self, command: c.Command) -> None:
        """A command's next step, in the engine's next turn."""
        if self._stopping or self.failed is not None:
            _refuse(command, QueueError(E_SHUTTING_DOWN, outcome_unknown=True))
            return
        self._inbox.append(command)
        self._wake.set()

    def _wake_up(self) -> None:
        # The event is looked up at each call: a simulation's pause swaps it for a stand-in.
        self._wake.set()

    def pending_commands(self) -> int:
        return len(self._inbox)

    # --- the task --------------------------------------------------------------------------
    async def _run(self) -> None:
        pipeline, listeners = self.pipeline, self.listeners
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
                listeners.serve(now_ms, self.full_master_may_decide() if self.pairs.clustered else True)
                listeners.expire(mono_ms)
                self.room.check(mono_ms)
            finally:
                self.storage.end_read()
            housekeeping = self._housekeeping.due(mono_ms, self.storage.housekeeping_behind)
            if housekeeping is not None:
                pipeline.open.sealed.housekeeping_ms = now_ms      # what is older than this is pruned
            if housekeeping == "interval":       # a catch-up pass (storage/housekeeping.py) only prunes
                for core in self.pairs.commit_points_to_record():
                    pipeline.touch(core)
                # Listeners are served when their queue's role moves (listeners_may_see_more);
                # once a housekeeping interval, every listened queue is looked at all the same,
                # so a change that woke nothing delays a delivery by one interval at most.
                listeners.to_serve.update(listeners.listened())
            if pipeline.committing is None and not pipeline.open.empty():
                pipeline.start_commit()
            if self._stopping and not self._inbox and pipeline.committing is None:
                listeners.fail_on_stop()
                return
            self._arm_timer(mono_ms)

    def _step_inbox(self, now_ms: int) -> None:
        """Step queued commands into the open batch. When the writer is idle and the batch
        already holds `commit_early_operations`, it goes to disk at once and stepping goes
        on into the next batch: the commit overlaps the stepping instead of following it,
        and the first answers leave sooner (a window of many requests arrives together)."""
        inbox = self._inbox
        step = self.steps.step
        pipeline = self.pipeline
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
            if pipeline.committing is None and len(pipeline.open.sealed.operations) >= early:
                pipeline.start_commit()
        if inbox:
            self._wake.set()   # more to do: come back after this batch goes to disk

    def _arm_timer(self, now_ms: int) -> None:
        deadlines = [self._housekeeping.deadline(self.storage.housekeeping_behind)]
        if self.pairs.clustered:
            deadlines.append(self._next_replication_tick_ms)
        may_decide, deadlines_of = self._deadlines_asked()
        timed = self._due.refresh(deadlines_of)
        if self.self_checks and may_decide:
            self._due.check(self.cores, functools.partial(self._deadlines_decided_here, may_decide=True))
        if timed is not None:
            deadlines.append(timed)
        waits = self.listeners.next_deadline()
        if waits is not None:
            deadlines.append(waits)
        delay_s = max(0.0, (min(deadlines) - now_ms) / 1000) + 0.001
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(min(delay_s, 1.0), self._wake.set)

    # --- time-driven work ------------------------------------------------------------------
    def full_master_may_decide(self) -> bool:
        """Under `full`, a master takes ordering indices on its own (expiry, serving waiting
        receives) only while it holds its lease: one cut off, or just restarted on a map that
        has moved on, would write a suffix in its old epoch at indices the pair's history uses
        for other operations (its replica never accepts them; the audit sees two operations at
        one index of one epoch). The engine asks the lease itself, against a clock read at each
        call as the coordinator's `lease_valid` does: three times a turn, a round trip through
        the coordinator for it crossed six files."""
        lease = self._lease
        return lease is None or lease.valid(self.monotonic_ms())

    def _run_timed_steps(self, now_ms: int, mono_ms: int) -> None:
        """The timed steps whose time has come: leases run out, delayed messages mature,
        messages past their time to live expire (each queue this node decides them for)."""
        operations = self.pipeline.open.sealed.operations
        cores = self.registry.cores
        may_decide, deadlines_of = self._deadlines_asked()
        due = self._due
        due.refresh(deadlines_of)
        for name in due.pop_due(mono_ms):
            core = cores.get(name)
            if core is None or not self._decides_time(name, core, may_decide):
                continue
            deadline = core.next_deadline()
            if deadline is None or deadline > mono_ms:
                continue
            mark = len(operations)
            ended = core.expire_leases(now_ms, operations)
            ended += core.mature_messages(now_ms, operations) + core.expire_messages(now_ms, operations)
            if ended:
                self.pipeline.decided(core, operations[mark:])

    def _deadlines_asked(self) -> tuple[bool, Callable[[list[str]], list[int | None]]]:
        """Before the timer heap is brought up to date with what changed (DueQueues.refresh,
        which the caller runs next to its own use of the heap): whether a `full` master may
        decide now, and how the heap asks the changed queues for their deadlines. A node that
        regains its lease has every queue asked again (rare): the `full` masters it holds were
        left out while it could not decide."""
        may_decide = self.full_master_may_decide()
        if may_decide and not self._may_decide_time:
            self._due.changed.update(self.registry.cores)
            self.listeners.to_serve.update(self.listeners.listened())   # their waiters waited on
        self._may_decide_time = may_decide
        return may_decide, functools.partial(self._deadlines_decided_here, may_decide=may_decide)

    def _deadlines_decided_here(self, names: list[str], *, may_decide: bool) -> list[int | None]:
        """Each queue's next timed step, where this node decides it (None: not here, or none)."""
        cores, decides_time = self.registry.cores, self._decides_time
        deadlines: list[int | None] = []
        for name in names:
            core = cores.get(name)
            deadlines.append(core.next_deadline() if core is not None and decides_time(name, core, may_decide) else None)
        return deadlines

    def _decides_time(self, name: str, core: QueueCore, may_decide: bool) -> bool:
        """Whether this node decides the timed steps of queue `name` (its core `core`): under
        `full` the master, while it may decide (see full_master_may_decide), and the replica
        applies its decisions; under `producer` each member for its own copy (each serves its
        own consumers). A core with no role yet (the map not replayed after a restart) decides
        nothing: under `full` it would take ordering indices outside the stream, under
        `producer` its steps would be journaled under no member's role. Nor does its timer wake for them: a `full` replica's applied
        leases left deadlines in its heap that nothing popped, and once the first had passed its
        node woke every millisecond for good (0.06 of a core on an idle cluster against 0.02)."""
        pairs = self.pairs
        if not pairs.clustered:
            return True
        if pairs.restarting(name):
            return False
        if core.options.strength is Strength.FULL:
            return may_decide and name in pairs.masters
        return name in pairs.masters or name in pairs.replicas

    def _storage_full_changed(self, full: bool, mono_ms: int) -> None:
        self.pairs.storage_full_changed(full, mono_ms)
        if not full:
            self.registry.recreate_lost_masters()

    # --- Scheduler (qserver/core/ports.py) --------------------------------------------------
    def random_bits(self, bits: int) -> int:
        return self._rng.getrandbits(bits)

    # --- PairEvents (qserver/core/ports.py) -------------------------------------------------
    # Besides `clients`, each event is bound in __init__ straight to the part that owns it.
    @property
    def clients(self) -> dict[str, dict[str, Any]]:
        """The registered clients (a new dict after each load: read it, do not keep it)."""
        return self.registry.clients

    # --- what the node, the API and the features read ---------------------------------------
    @property
    def cores(self) -> Mapping[str, QueueCore]:
        return self.registry.cores

    def describe(self, core: QueueCore) -> dict[str, Any]:
        described = self.registry.describe(core)
        described.update(self.health_fields(core.name))    # FAILED and why (qserver/cluster/queue_health.py)
        return described

    @property
    def on_clients_changed(self) -> Callable[[], None]:
        return self.registry.on_clients_changed

    @on_clients_changed.setter
    def on_clients_changed(self, callback: Callable[[], None]) -> None:
        self.registry.on_clients_changed = callback

    @property
    def writer(self) -> Executor:
        """The storage writer's thread (also for pruning the journal between commits)."""
        return self.pipeline.writer

    def grow_storage(self) -> None:
        self.pipeline.grow_storage()

    @property
    def storage_full(self) -> str | None:
        """Why new messages are refused with E_STORAGE_FULL (None: there is room)."""
        return self.room.storage_full

    @property
    def space(self) -> StorageSpace | None:
        return self.room.space

    @property
    def commit_seconds(self) -> Histogram:
        return self.pipeline.commit_seconds

    @property
    def batch_operations(self) -> Histogram:
        return self.pipeline.batch_operations

    @property
    def batches_abandoned(self) -> int:
        return self.pipeline.batches_abandoned

    def journal_event(self, core: QueueCore, op: str, subject: str, detail: str) -> None:
        self.pipeline.journal_event(core, op, subject, detail)

    def serve_soon(self, queue: str) -> None:
        self.listeners.serve_soon(queue)

    def recipient_subscriptions(self, queue: str, recipient: str) -> list[Subscription]:
        return self.listeners.recipient_subscriptions(queue, recipient)

    def recipients_here(self) -> dict[tuple[str, str], list[Subscription]]:
        return self.listeners.recipients_here()

    def end_subscription(self, subscription: Subscription, error: QueueError) -> None:
        self.listeners.end_subscription(subscription, error)
