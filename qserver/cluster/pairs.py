"""The node side of queue pairs: the cluster map's view, the replication roles, and their glue
to the engine.

Who holds each queue comes from the cluster map the membership layer replicates
(`replication/cluster_map.py`, `qserver/cluster/membership.py`): its master, replica, epoch and
in-sync flag. A dead-letter queue follows its queue's entry. When a map change names this
node in a new role (creation, handoff, failover, move), `reconcile` rebuilds the queue's role
from the old one's in-memory state, so nothing staged but not yet durable is forgotten, and
the epoch it persists with the next batch never goes backwards.

Everything runs on the engine's task: the engine calls in after stepping commands, before
and after each group commit, for peer messages, link changes, map changes and ticks. The
roles are pure (`replication/master.py`, `replication/replica.py`); this module performs
their effects in the required order: persist (into the engine's open batch), then send,
then answer.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replication.cluster_map import (
    ChangePair,
    ChangePairs,
    ClusterMap,
    Command,
    CreateQueue,
    DeleteChannel,
    DeleteQueue,
    Outcome,
    PutChannel,
    PutClient,
    QueueEntry,
    Reason,
    channel_queue,
)
from replication.digest import EMPTY_DIGEST
from replication.invariants import InvariantViolation
from replication.master import InSyncProposal, MasterRole, ReplicationLimits, is_replicated
from replication.messages import (
    Create,
    Delete,
    ForwardResult,
    HandoffAnswer,
    HandoffOrder,
    HandoffRequest,
    LeaseGrant,
    LeaseRenew,
    Message,
    MessageError,
    Open,
    decode_message,
    encode_message,
)
from replication.operations import DeadLettered, Operation
from replication.options import DEAD_LETTER_SUFFIX, Strength, dead_letter_name
from replication.queue_core import QueueCore
from replication.replica import ReplicaPhase, ReplicaRole, SnapshotInstall
from replication.snapshot import InstalledState
from wire.errors import (
    E_NOT_ENOUGH_REPLICAS,
    E_NOT_MASTER,
    E_QUEUE_UNAVAILABLE,
    E_TIMEOUT,
    E_UNAVAILABLE,
    E_UNKNOWN_QUEUE,
    ErrorKind,
    QueueError,
)

if TYPE_CHECKING:
    from qserver.cluster.coordinator import Coordinator
    from qserver.cluster.membership import Membership
    from qserver.core.engine import Engine

log = logging.getLogger("qserver.cluster.pairs")
OUTCOME_UNKNOWN = -1      # in place of a held answer's required order: see Engine.outcomes_unknown
EARLY_MESSAGES_MAX = 10_000     # per queue; beyond it the protocol's resends recover
ANNOUNCE_INTERVAL_MS = 1_000    # how often a master repeats Create to a replica that has not opened
NEW_EPOCH_ASK_INTERVAL_MS = 200  # how often restarted masters ask again for their new epochs
STORAGE_FULL_NOTICE_MS = 1_000  # how often a replica on a full node tells its master it follows no more
# Roles with nothing in flight are not ticked (issue 31); besides those with work, each tick
# looks at this many others in turn, so a role nothing woke is still looked at now and then.
TICK_SWEEP_ROLES = 32
IN_SYNC_CHANGES_MAX = 500       # in-sync records per map command (see _propose_in_sync_changes)



def base_name(queue: str) -> str:
    return queue[:-len(DEAD_LETTER_SUFFIX)] if queue.endswith(DEAD_LETTER_SUFFIX) else queue


class Redirect(QueueError):
    """E_NOT_MASTER naming the node that must handle the request (e.g. a new queue's master)."""

    def __init__(self, node: str, message: str, placement: tuple[str, str] | None = None) -> None:
        super().__init__(E_NOT_MASTER, message)
        self.node = node
        self.placement = placement      # a new queue's chosen (master, replica), passed along


class ClusterView:
    """The local copy of the cluster map, as the engine reads it (None outside a cluster)."""

    def __init__(self, node_id: str, urls: dict[str, str], membership: Membership | None) -> None:
        self.node_id = node_id
        self.urls = dict(urls)
        self.membership = membership

    @property
    def clustered(self) -> bool:
        return self.membership is not None

    @property
    def cluster_map(self) -> ClusterMap:
        return self.membership.cluster_map if self.membership is not None else ClusterMap()

    def entry(self, queue: str) -> QueueEntry | None:
        if self.membership is None:
            return None
        return self.membership.cluster_map.queues.get(base_name(queue))

    def url(self, node: str) -> str:
        """Where this node dials `node` (HTTP passing-on): its own [cluster.nodes] entry first,
        as for the peer link, so a proxy on that link carries both (DESIGN.md 4.7); the URL
        the map publishes (how clients reach the node) only for nodes the table lacks."""
        if self.urls.get(node):
            return self.urls[node]
        entry = self.cluster_map.nodes.get(node)
        return entry.url if entry is not None and entry.url else ""


@dataclass(slots=True)
class HeldAnswer:
    """An answer released once the queue's commit point passes `required_order`."""
    required_order: int
    release: Any              # a no-argument callable: answer
    refuse: Any = None        # callable(QueueError): the queue went away first, or the deadline passed
    deadline_ms: int = 0      # refused (outcome unknown) if still held then: see expire_waiting
    write: bool = False       # an enqueue's answer (see refuse_unreplicated_writes)


class PairDriver:
    """The node's side of its queue pairs: one role per queue it holds. Every `mono_ms` here
    is the engine's monotonic clock (the roles' timers, held answers, forwards)."""

    def __init__(self, engine: Engine, view: ClusterView, limits: ReplicationLimits) -> None:
        self.engine = engine
        self.view = view
        self.limits = limits
        self.node_id = engine.config.node_id
        self.masters: dict[str, MasterRole] = {}
        # Masters taken up at a restart from this node's own copy of the map, which may be
        # stale (the queue failed over while the node was down): until the node holds a lease,
        # granted against a map as new as the leader's (Coordinator._accept_grants), such a
        # master claims no commit point past the one its queue record kept. Its copy may say
        # the replica is out of sync, which would make everything it holds look committed.
        self.unconfirmed: dict[str, int] = {}     # queue name -> commit point kept at the restart
        # Masters restarted in their role (a kill -9 and a start inside the lease): a batch goes
        # to the replica before this member's own fsync, so the replica may hold orders of this
        # epoch that this member lost, and would assign again to other operations. Such a master
        # serves nothing (no index, no delivery, no answer) until the map gives it a new epoch,
        # with the same replica recorded out of sync (_ask_new_epochs; docs/PROTOCOL.md, "A
        # master restarted inside its lease"): one operation per (epoch, order), always.
        self.restarted: dict[str, int] = {}      # queue (map entry) name -> the epoch it restarted in
        self._next_epoch_ask_ms = 0
        self._epoch_ask_pending = False
        # Dead letters enter a dead-letter queue through its source queue's stream, so under
        # `full` one becomes visible when the source's DeadLettered is committed:
        # dead-letter queue name -> (source order, dead-letter index) not yet committed.
        self.dead_letters_pending: dict[str, collections.deque[tuple[int, int]]] = {}
        self.replicas: dict[str, ReplicaRole] = {}
        self.held: dict[str, collections.deque[HeldAnswer]] = {}
        self.forwards: dict[int, tuple[str, Any]] = {}   # forward request id -> (queue, callback(outcome))
        # Peer messages of an epoch this node's map does not know yet (see _ahead_of_map).
        self.early: dict[str, collections.deque[tuple[str, bytes]]] = {}
        self.received: dict[str, InstalledState] = {}     # queue name -> rows of the snapshot under way
        self._log_floors: dict[int, int] = {}             # queue id -> the floor last sent to storage
        # Work proportional to what changed (issue 31), as ordered sets (dicts: a simulation
        # replays the same order): roles with something in flight, which the tick visits; roles
        # whose log floor may have moved since the last batch was sealed; masters whose commit
        # point may have passed their record's since housekeeping last looked.
        self._ticking: dict[str, None] = {}
        self._floors_changed: dict[str, None] = {}
        self._commits_changed: dict[str, None] = {}
        self._sweep: list[str] = []
        self._in_sync_changes: list[tuple[ChangePair, Any]] = []   # to propose at the end of this turn
        # Queues whose snapshot install is being written: a replica role made meanwhile (a new
        # epoch) opens only once it is in memory too (see _installed).
        self.installing: set[str] = set()
        self.snapshots_installed = 0
        self.snapshots_resumed = 0
        self._next_announce_ms = 0
        self._unopened: dict[str, None] = {}     # masters announced whose replica has not opened
        # This node's storage is full (Engine._check_space): its replicas follow no more.
        self.storage_full = False
        self._next_full_notice_ms = 0
        self.role_starts: collections.Counter[str] = collections.Counter()   # "master"/"replica" -> roles made
        self.opens_sent = 0            # Opens this node's replicas sent (a role that keeps restarting shows here)
        # Unique per engine instance: an answer the master sends to a crashed predecessor of
        # this engine must never match one of our requests.
        self._next_forward = (engine.random_bits(40) << 20) + 1
        self._forward_deadlines: list[tuple[int, int]] = []      # heap of (deadline ms, forward request id)
        self.commit_wait_max_ms = int(engine.config.commit_wait_max_s * 1000)
        self.link_up: Any = lambda peer: False       # set by the node: PeerTransport.is_up
        self.send: Any = lambda peer, data: False   # set by the node: PeerTransport.send
        self.coordinator: Coordinator | None = None  # set by the engine in a cluster

    @property
    def clustered(self) -> bool:
        return self.view.clustered

    # --- roles -----------------------------------------------------------------------------
    def attach(self, core: QueueCore, *, created: bool = False) -> None:
        """Give a loaded or new core its role from the cluster map (none outside a cluster,
        and none yet while the local copy of the map is older than the queue's epoch)."""
        entry = self.view.entry(core.name)
        if entry is None:
            return
        self._assume(core, entry, None, "create" if created else "restart")

    def _assume(self, core: QueueCore, entry: QueueEntry, previous: MasterRole | ReplicaRole | None,
                first_reason: str = "restart", replica_holds: int = 0, commit_known: int = 0) -> None:
        """`first_reason` when there is no previous role: "create", "restart", or "reload" (a
        role rebuilt after a batch could not be stored: the same member in the same epoch, so
        nothing is journaled); then what the role it replaces knew: as master, what the replica
        holds durably (`replica_holds`), as replica, the master's commit point (`commit_known`)."""
        record = core.record
        if entry.epoch < record.epoch:
            log.info("queue %s: map epoch %d is older than the stored %d; waiting for the map", core.name,
                     entry.epoch, record.epoch)
            return
        incarnation = record.incarnation or record.queue_id
        if previous is None:
            last_order, digest = self.engine.storage.last(core.queue_id)
            durable, commit = last_order, min(commit_known, last_order)
        elif isinstance(previous, MasterRole):
            last_order, digest, durable, commit = (previous.last_order, previous.digest, previous.local_durable,
                                                   self.commit_order(core.name) or 0)
        else:
            last_order, digest, durable, commit = (previous.applied_order, previous.digest, previous.durable_order,
                                                   previous.visible_order)
        role: MasterRole | ReplicaRole
        if entry.master == self.node_id:
            log_start = max(self.engine.storage.first(core.queue_id), self._log_floors.get(core.queue_id, 0))
            role = self.masters[core.name] = MasterRole(
                core, self.engine.storage, node_id=self.node_id, replica_id=entry.replica, epoch=entry.epoch,
                incarnation=incarnation, recorded_in_sync=entry.in_sync, last_order=last_order, digest=digest,
                limits=self.limits, durable_order=durable,
                replica_durable=commit if isinstance(previous, ReplicaRole) else min(replica_holds, last_order),
                snapshots=self.engine.storage, log_start=log_start,
                replica_returns_from=previous.master_recorded_commit if isinstance(previous, ReplicaRole) else None)
            self.received.pop(core.name, None)
            self.replicas.pop(core.name, None)
            if isinstance(previous, ReplicaRole):
                core.inherit_leases()      # a takeover: leases run from now on this clock
            if previous is None and first_reason == "restart":
                self.unconfirmed[core.name] = record.commit_order
                if record.dead_letter_of is None:          # it shares its queue's entry
                    self.restarted[core.name] = entry.epoch
            elif self.restarted.get(core.name, entry.epoch) < entry.epoch:
                del self.restarted[core.name]
                log.info("queue %s: restarted master serves again at epoch %d", core.name, entry.epoch)
            role_name = "master"
        elif entry.replica == self.node_id:
            # A deposed master, or a member restarted after a crash (it may have been one): what
            # it holds past the commit point may be an uncommitted suffix. After a restart only
            # the commit point its record kept is known.
            known_commit = max(commit, record.commit_order) if not isinstance(previous, ReplicaRole) else 0
            # A member restarted as the replica of the epoch its record is at (every change of
            # master raises the epoch, so it was this epoch's replica all along) keeps everything:
            # its master may have committed on its acknowledgements, and the map still counts it
            # in sync. Should the master have lost some of it, their digests differ when it
            # opens, and it takes a snapshot. So does a deposed master the map counts in sync:
            # only a handoff makes one (a failover records it out of sync), and a handoff swaps
            # only once the new master holds everything the old one assigned, so nothing it holds
            # is uncommitted; its record's commit point lags what it acknowledged, and dropping
            # past that point would lose acknowledged writes should it be promoted again before
            # it has caught up (found by the engine simulation, seed 2092 under `producer`).
            if (previous is None and record.epoch == entry.epoch) or entry.in_sync:
                known_commit = 0
            if known_commit and last_order > known_commit:
                kept = self._discard_uncommitted(core, known_commit)
                if kept is not None:
                    last_order, digest, durable = known_commit, kept, min(durable, known_commit)
            role = self.replicas[core.name] = ReplicaRole(
                core, self.engine.storage, node_id=self.node_id, master_id=entry.master, epoch=entry.epoch,
                incarnation=incarnation, applied_order=last_order, digest=digest, last_epoch=record.epoch,
                limits=self.limits, session_base=self.engine.random_bits(40) << 20, durable_order=durable,
                commit_order=commit, known_committed=record.commit_order)
            self.received.pop(core.name, None)
            self.masters.pop(core.name, None)
            self.unconfirmed.pop(core.name, None)
            self.restarted.pop(core.name, None)
            if isinstance(previous, ReplicaRole) and previous.epoch != entry.epoch:
                # What its clients forwarded in the older epoch the master of this one refuses
                # (E_FENCED) and never answers: they ask again now (dedupe ids make it safe),
                # not after commit_wait_max_s (a master killed and started again at once).
                self._fail_forwards(core.name, f"the master of {core.name} serves epoch {entry.epoch} now",
                                    E_UNAVAILABLE)
            role_name = "replica"
        else:
            return
        self.role_starts[role_name] += 1
        self._role_changed(core.name)
        changed = role_name != _role_name(previous) if previous is not None else first_reason != "reload"
        if record.epoch != entry.epoch or changed:
            reason = entry.last_reason if previous is not None or record.epoch != entry.epoch else first_reason
            if record.epoch != entry.epoch:
                record.epoch = entry.epoch
                self.engine.touch(core)
            self.engine.journal_mark(core, role_name, last_order, reason)
            log.info("queue %s: %s at epoch %d (%s), last order %d", core.name, role_name, entry.epoch, reason,
                     last_order)
        if record.dead_letter_of is not None:
            # Its messages arrive through the source queue's stream (see _gate_dead_letters).
            role.gates_visibility = False
            core.visible_upto = None

    def detach(self, name: str) -> None:
        master, replica = self.masters.pop(name, None), self.replicas.pop(name, None)
        for role in (master, replica):
            if role is not None:
                self._log_floors.pop(role.core.queue_id, None)
        self.unconfirmed.pop(name, None)
        self.restarted.pop(name, None)
        self.installing.discard(name)
        self._role_changed(name)
        for held in self.held.pop(name, ()):
            if held.refuse is not None:   # never committed: the queue is gone
                held.refuse(QueueError(E_UNKNOWN_QUEUE, f"queue {name} was deleted", outcome_unknown=True))
        self._fail_forwards(name, "the queue left this node")

    def reload(self, name: str, core: QueueCore | None, reached: set[int], mono_ms: int) -> None:
        """A batch touching queue `name` could not be stored, and the engine rebuilt its core from
        storage (`core`; None: nothing of it was stored). A role the lost batch did not reach
        (`reached`: queue ids whose op log, snapshot or suffix it wrote) goes on with the rebuilt
        core, so a full disk does not make every role start again. One it reached starts again
        from what storage holds: as master it has the replica open again (it may hold what this
        member lost); as replica it opens once it may (not while this node's storage is full)."""
        master, replica = self.masters.get(name), self.replicas.get(name)
        old = master or replica
        if core is None:
            if old is not None:
                self.detach(name)
            return
        entry = self.view.entry(name)
        if old is None:
            if entry is not None:
                self._assume(core, entry, None, "reload")
            return
        last_order = self.engine.storage.last(core.queue_id)[0]
        position = old.last_order if isinstance(old, MasterRole) else old.applied_order
        if old.core.queue_id == core.queue_id and core.queue_id not in reached and position == last_order \
                and core.record.epoch == old.epoch:      # else the lost batch held the role's epoch mark
            old.rebind(core)
            return
        self.masters.pop(name, None)
        self.replicas.pop(name, None)
        self.received.pop(name, None)
        self.installing.discard(name)       # the lost batch held it, or it committed
        self._role_changed(name)
        if entry is None:
            return
        log.warning("queue %s: its %s role starts again from storage (last order %d): a batch it wrote was lost",
                    name, _role_name(old), last_order)
        self._assume(core, entry, None, "reload", master.replica_durable if master is not None else 0,
                     replica.visible_order if replica is not None else 0)
        rebuilt = self.masters.get(name)
        if rebuilt is not None:
            pending = self.dead_letters_pending.get(dead_letter_name(name))
            if pending:      # dead letters the lost batch decided: their orders are given again
                self.dead_letters_pending[dead_letter_name(name)] = collections.deque(
                    item for item in pending if item[0] <= last_order)
            rebuilt.resync_replica(mono_ms)
            self._flush(rebuilt)

    def storage_full_changed(self, full: bool, mono_ms: int) -> None:
        """This node's storage ran out of room, or has room again. Its replicas stop taking their
        masters' streams (which would eat the reserve that acknowledgements and the membership
        layer need) and tell their masters, which record them out of sync at once and go on
        alone, or refuse writes under min_in_sync 2, instead of holding every answer until it
        times out. The requests their clients forwarded are answered: they ask the master. With
        room again, they open and catch up (the tick starts them)."""
        self.storage_full = full
        self._next_full_notice_ms = mono_ms + STORAGE_FULL_NOTICE_MS
        if not full:
            for name in self.replicas:      # those that waited to open (_may_open) start now
                self._wake(name)
            return
        for replica in self.replicas.values():
            replica.refuse_for_storage()
            self._flush(replica)
            self._fail_forwards(replica.core.name, "this replica's storage is full: ask the master")

    def refuse_forward_when_full(self, name: str) -> None:
        """A replica on a full node passes no client request on: its answer would wait for a
        commit point this member no longer follows. The client asks the master instead."""
        if self.storage_full:
            raise QueueError(E_NOT_MASTER, f"queue {name}: this replica's storage is full; its master is "
                                           f"{self.masters_hint(name)}")

    def reconcile(self, name: str, *, deleted: bool = False) -> None:
        """The map changed for queue `name` (and its dead-letter queue): take the role it gives
        this node, create the master's instance, or drop an instance that moved away."""
        entry = self.view.cluster_map.queues.get(name)
        cores = [core for core in (self.engine.cores.get(name), self.engine.cores.get(dead_letter_name(name)))
                 if core is not None]
        if entry is None:
            if deleted:
                for core in cores:
                    self.engine.drop_instance(core)
            return
        if entry.master == self.node_id and self.engine.cores.get(name) is None:
            self.engine.create_master_instance(entry)
            return
        member = self.node_id in (entry.master, entry.replica)
        for core in cores:
            expected = entry.incarnation + (1 if core.record.dead_letter_of is not None else 0)
            if expected != (core.record.incarnation or core.queue_id):
                if member or core.record.epoch <= entry.epoch:
                    self.engine.drop_instance(core)     # an older incarnation of the name
                continue
            if not member:
                if core.record.epoch <= entry.epoch:
                    self.engine.drop_instance(core)     # moved away from this node
                continue
            self._become(core, entry)
        if self.coordinator is not None:
            self.coordinator.map_changed(name)
        self._replay_early(name)

    def _become(self, core: QueueCore, entry: QueueEntry) -> None:
        name = core.name
        master, replica = self.masters.get(name), self.replicas.get(name)
        if entry.master == self.node_id:
            if master is not None and master.epoch == entry.epoch and master.replica_id == entry.replica:
                if master.recorded_in_sync != entry.in_sync and not master.proposal_pending:
                    master.membership_decided(entry.in_sync)
                    if not entry.in_sync and core.options.min_in_sync >= 2:
                        self.refuse_unreplicated_writes(master)
                    self._flush(master)
                return
            previous: MasterRole | ReplicaRole | None = master or replica
            self._fail_forwards(name, "this member became the master")
            self._assume(core, entry, previous)
            new = self.masters.get(name)
            if new is not None:
                self.announce(core)
                new.tick(self.engine.monotonic_ms())
                self._flush(new)
            self.release_committed()
            return
        if replica is not None and replica.epoch == entry.epoch and replica.master_id == entry.master:
            return
        previous = master or replica
        self.release_committed()
        if master is not None:
            self._stream_staged(master)
            deposed_commit = master.commit_order
        self._assume(core, entry, previous)
        if master is not None:
            # Answers the batches in flight still owe about what it decided past its commit
            # point are released after this: their fate is the new master's to decide.
            self.engine.outcomes_unknown(name, deposed_commit)
            self.engine.master_left(core, entry.master)
        role = self.replicas.get(name)
        if role is None:
            return
        if master is not None:
            # What it decided past its commit point may not survive, even after a handoff (the
            # handoff covered what it had decided then; a `producer` suffix after it is
            # discarded): the new master gives those indices to its own operations.
            self._refuse_held(name, QueueError(E_NOT_MASTER, f"queue {name} has a new master {entry.master}",
                                               outcome_unknown=True), deposed_commit)
        if self._may_open(role):
            role.start(self.engine.monotonic_ms())
            self._flush(role)

    def _stream_staged(self, role: MasterRole) -> None:
        """A master deposed while its core has decided operations still in the engine's open
        batch (not yet streamed): take them into its history, with their op-log rows, so the
        replica role it becomes starts after them and they count as its uncommitted suffix
        (discarded, or the new master resets it). Left out, they would be committed beside
        the stream, and the new master's operations at the same indices would collide with
        them. Nobody in the old epoch takes them any more: nothing is sent."""
        staged = self.engine.staged()
        # Not what it applied as replica earlier in this batch: that is in its history already.
        ops = [op for op in staged.operations if op.queue_id == role.core.queue_id and op.order > role.last_order]
        if not ops:
            return
        role.replicate(ops, self.engine.monotonic_ms())
        for entry in role.to_log:
            staged.oplog_rows.append(entry.row(role.core.queue_id))
        role.to_log.clear()
        role.outbox.clear()

    def _discard_uncommitted(self, core: QueueCore, commit: int) -> bytes | None:
        """A deposed master about to follow: under `producer`, drop what it holds past its
        commit point and open from there (the new master holds everything committed), so its
        consumers keep their own acks and leases; the digest at `commit`, or None when the
        suffix stays (then the master finds the histories differ and sends everything)."""
        digest = self.engine.storage.digest_at(core.queue_id, commit)
        if digest is None or not self.engine.discard_uncommitted(core, commit):
            return None
        log.info("queue %s: uncommitted suffix after %d discarded", core.name, commit)
        return digest

    def _refuse_held(self, name: str, error: QueueError, commit: int) -> None:
        """Answer every held answer: released when committed (up to `commit`), else refused."""
        waiting = self.held.get(name)
        if not waiting:
            return
        kept: collections.deque[HeldAnswer] = collections.deque()
        for held in waiting:
            if held.required_order <= commit:
                held.release()
            elif held.refuse is not None:
                held.refuse(error)
            # a push without refusal is dropped: its lease runs out and it is delivered again
        self.held[name] = kept

    def _fail_forwards(self, name: str, why: str, kind: ErrorKind = E_NOT_MASTER) -> None:
        failed = [request_id for request_id, (queue, _) in self.forwards.items() if queue == name]
        for request_id in failed:
            _, answer = self.forwards.pop(request_id)
            answer([kind.code, f"{why}; the outcome is unknown, retry (dedupe ids make it safe)"])

    def refuse_if_not_master(self, name: str) -> None:
        """Client commands for a queue this node neither masters nor holds go to its master."""
        if not self.clustered or name in self.masters or name in self.replicas:
            return
        entry = self.view.entry(name)
        if entry is None:
            if name in self.engine.cores:
                raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name}: this node's map does not list it yet")
            return
        if entry.master == self.node_id:
            if self.engine.cores.get(name) is None:
                return                   # ours to master: the instance is being created
            raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name} is taking its new role here; retry")
        raise QueueError(E_NOT_MASTER, f"queue {name} is mastered by {entry.master} at {self.view.url(entry.master)}")

    def restarting(self, name: str) -> bool:
        """Whether queue `name` (or the queue whose dead letters it holds) is mastered here by a
        master restarted in its role, waiting for its new epoch (see `restarted`)."""
        return bool(self.restarted) and base_name(name) in self.restarted

    def check_serving(self, name: str) -> None:
        if self.restarting(name):
            raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name}: its master restarted and waits for its new epoch")

    def _ask_new_epochs(self, mono_ms: int) -> None:
        """Propose a new epoch, same members, replica out of sync, for each master restarted
        here (one command for all of them, one at a time). A compare-and-set: if the map moved
        on meanwhile (a failover), it fails, and the change of role the map brings ends the wait."""
        membership = self.view.membership
        if not self.restarted or membership is None or self._epoch_ask_pending or mono_ms < self._next_epoch_ask_ms:
            return
        self._next_epoch_ask_ms = mono_ms + NEW_EPOCH_ASK_INTERVAL_MS
        changes = []
        for name, epoch in self.restarted.items():
            entry = self.view.entry(name)
            if entry is not None and entry.master == self.node_id and entry.epoch == epoch:
                changes.append(ChangePair(name, (epoch, self.node_id, entry.replica, entry.in_sync),
                                          (epoch + 1, self.node_id, entry.replica, False), Reason.RESTARTED_MASTER.value))
        if not changes:
            return
        self._epoch_ask_pending = True

        def decided(outcomes: list[Outcome] | None) -> None:
            self.engine.invoke(lambda now_ms: setattr(self, "_epoch_ask_pending", False))
        membership.propose(changes[0] if len(changes) == 1 else ChangePairs(tuple(changes)), decided)

    def check_writable(self, role: MasterRole) -> None:
        self.check_serving(role.core.name)
        role.check_writable()
        if self.coordinator is not None and not self.coordinator.lease_valid():
            raise QueueError(E_QUEUE_UNAVAILABLE, "this node's lease from the membership layer has lapsed")

    def announce(self, core: QueueCore) -> None:
        """A queue mastered here: tell its replica to hold an instance (and repeat it when
        the link comes back, until the replica opens)."""
        role = self.masters.get(core.name)
        if role is not None:
            self._send(role.replica_id, Create(core.name, role.incarnation, role.epoch, core.record.to_json()))
            if role.progress.value == "probing":
                self._unopened[core.name] = None

    def _announce_again(self) -> None:
        """Once an ANNOUNCE_INTERVAL_MS: a Create the replica may have missed goes again, while
        its role has not opened and the link is up. One whose link is down is forgotten: the
        link coming back announces every master of that replica (on_link_change)."""
        for name in list(self._unopened):
            role = self.masters.get(name)
            if role is None or role.progress.value != "probing" or not self.link_up(role.replica_id):
                del self._unopened[name]
            else:
                self.announce(role.core)

    def retire(self, name: str) -> None:
        role = self.masters.get(name)
        if role is not None:
            self._send(role.replica_id, Delete(name, role.incarnation, role.epoch))
        self.detach(name)

    # --- the engine's batches --------------------------------------------------------------
    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
                      mono_ms: int, touched: dict[str, QueueCore]) -> None:
        """Stream the batch's replicated operations (persist and send in the same step) and
        add their op-log rows to the transaction. `touched`: the queues the batch holds
        anything of (every operation's queue among them)."""
        if not self.masters:
            return
        by_queue: dict[int, list[Operation]] = {}
        for op in operations:
            by_queue.setdefault(op.queue_id, []).append(op)
        for role in filter(None, map(self.masters.get, touched)):
            # Only what this master decided: operations it applied as replica earlier in the
            # same batch (it was promoted or handed the queue before the batch sealed) are in
            # its history already, and folding them in again would break its digest chain.
            ops = [op for op in by_queue.get(role.core.queue_id, ()) if op.order > role.last_order]
            if ops:
                role.replicate(ops, mono_ms)
                for entry in role.to_log:
                    oplog_rows.append(entry.row(role.core.queue_id))
                role.to_log.clear()
                self._flush(role)

    def after_commit(self, operations: list[Operation], mono_ms: int, touched: dict[str, QueueCore],
                     installed: list[tuple[int, int]] | None = None) -> None:
        """The batch is durable: advance each role's durable point and answer what committed.
        `touched`: the queues the batch held anything of (their records were written)."""
        durable: dict[int, int] = dict(installed or ())
        for op in operations:
            if op.order > durable.get(op.queue_id, 0):
                durable[op.queue_id] = op.order
        for role in filter(None, map(self.masters.get, touched)):
            # No batch was sealed since this one: the record's commit point is what storage holds.
            role.recorded_commit = role.core.record.commit_order
            order = durable.get(role.core.queue_id)
            if order:
                role.local_durable_to(order, mono_ms)
                self._flush(role)
        for replica in filter(None, map(self.replicas.get, touched)):
            order = durable.get(replica.core.queue_id)
            if order:
                replica.local_durable_to(order)
                self._flush(replica)
        self.release_committed()
        if self.coordinator is not None and self.coordinator.handoffs:
            self.coordinator.check_handoffs()

    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *, write: bool = False) -> bool:
        """Park an answer until the commit point passes required_order; False: answer now.
        `write`: an enqueue's answer (see refuse_unreplicated_writes)."""
        commit = self.commit_order(name)
        if required_order == OUTCOME_UNKNOWN or (commit is None and self.clustered):
            # Decided here as the master, which this node stopped being (or it no longer holds
            # the queue) before it committed: it may or may not survive.
            if refuse is not None:
                refuse(QueueError(E_NOT_MASTER, f"queue {name}: this node stopped being its master before the "
                                                "operation committed", outcome_unknown=True))
            return True          # a push is dropped: its lease runs out and it is delivered again
        if commit is None or (required_order <= commit and self._may_answer(name)):
            return False
        self.held.setdefault(name, collections.deque()).append(
            HeldAnswer(required_order, release, refuse, self.engine.monotonic_ms() + self.commit_wait_max_ms, write))
        return True

    def refuse_unreplicated_writes(self, role: MasterRole) -> None:
        """Under min_in_sync 2 a replica just recorded out of sync: the enqueues waiting for it
        are not acknowledged on this member's disk alone. They are stored here and may yet be
        delivered (committed once the replica is back, or by this member's commit point), so
        their answer says the outcome is unknown; a retry with the same dedupe id is safe."""
        name = role.core.name
        waiting = self.held.get(name)
        if not waiting:
            return
        error = QueueError(E_NOT_ENOUGH_REPLICAS, f"queue {name}: its replica {role.replica_id} was recorded out of "
                                                  "sync before it held this message", outcome_unknown=True)
        kept: collections.deque[HeldAnswer] = collections.deque()
        for held in waiting:
            if held.write and held.refuse is not None and held.required_order > role.replica_durable:
                held.refuse(error)
            else:
                kept.append(held)
        self.held[name] = kept

    def may_answer(self, name: str) -> bool:
        return self._may_answer(name)

    def _may_answer(self, name: str) -> bool:
        """A master whose lease lapsed stops acknowledging (DESIGN.md 3.3), and so does one
        restarted in its role until its new epoch."""
        if name not in self.masters:
            return True
        return (self.coordinator is None or self.coordinator.lease_valid()) and not self.restarting(name)

    def commit_order(self, name: str) -> int | None:
        master = self.masters.get(name)
        if master is not None:
            kept = self.unconfirmed.get(name)
            return master.commit_order if kept is None else min(master.commit_order, kept)
        replica = self.replicas.get(name)
        return None if replica is None else replica.visible_order

    def note_decided(self, core: QueueCore, ops: list[Operation]) -> None:
        """Called as soon as a master's core decided `ops`: a replicated dead-lettering must
        not make its message visible in the dead-letter queue before it commits."""
        dead = core.dead_letter_core
        if dead is None or core.name not in self.masters:
            return
        added = False
        for op in ops:
            if type(op) is DeadLettered and op.order:
                self.dead_letters_pending.setdefault(dead.name, collections.deque()).append(
                    (op.order, op.dead_letter_index))
                added = True
        if added:
            self._gate_dead_letters()

    def _gate_dead_letters(self) -> None:
        """A dead-letter queue shows messages up to its first dead letter not yet committed."""
        for name, pending in self.dead_letters_pending.items():
            dead = self.engine.cores.get(name)
            source = self.masters.get(dead.record.dead_letter_of or "") if dead is not None else None
            if dead is None or source is None:
                pending.clear()
                continue
            while pending and pending[0][0] <= source.commit_order:
                pending.popleft()
            dead.visible_upto = pending[0][1] - 1 if pending else None
        # Only queues with something pending are looked at again (issue 31).
        for name in [name for name, pending in self.dead_letters_pending.items() if not pending]:
            del self.dead_letters_pending[name]

    def release_committed(self, name: str | None = None) -> None:
        """Answer what the commit point has passed: of queue `name` (and its dead-letter
        queue) after something happened to its role, or of every queue. Not every queue
        after each message: a burst of 2,000 writes to 2,000 queues held 2,000 answers,
        each AppendAck looked at all of them, and the burst took 10 s (issue 31)."""
        if self.dead_letters_pending:
            self._gate_dead_letters()
        if name is None:
            names: Iterable[str] = list(self.held)
        else:
            base = base_name(name)
            names = [queue for queue in (base, dead_letter_name(base)) if queue in self.held]
        for queue in names:
            waiting = self.held[queue]
            if not waiting or not self._may_answer(queue):
                continue
            commit = self.commit_order(queue)
            # Answers are held in (nearly) increasing order: release from the front. One that
            # needs less than the one before it only waits for that one.
            while waiting and commit is not None and waiting[0].required_order <= commit:
                waiting.popleft().release()
            if not waiting:
                del self.held[queue]

    def _forget_answered(self) -> None:
        """Only queues with answers still held are looked at again (issue 31)."""
        for name in [name for name, waiting in self.held.items() if not waiting]:
            del self.held[name]

    def replicated_order(self, core: QueueCore, ops: list[Operation]) -> int:
        """The ordering index a client answer about these operations must wait for."""
        if core.name not in self.masters:
            return 0
        strength = core.options.strength
        return max((op.order for op in ops if is_replicated(op, strength)), default=0)

    # --- forwarding (a replica's clients) --------------------------------------------------
    def forward(self, name: str, request: list[Any], answer: Any) -> None:
        """Send a client's operation to the master; `answer(outcome)` once it is visible here."""
        role = self.replicas[name]
        if not self.link_up(role.master_id):
            # Sent now, it would be lost and answered only by expire_waiting: the client asks
            # again (the link comes back, or the map names another master) instead.
            answer([E_UNAVAILABLE.code, f"no link to the master {role.master_id} of {name} now"])
            return
        request_id = self._next_forward
        self._next_forward += 1
        self.forwards[request_id] = (name, answer)
        wait_ms = request[2] if request[0] == "receive" else 0
        heapq.heappush(self._forward_deadlines, (self.engine.monotonic_ms() + self.commit_wait_max_ms + wait_ms, request_id))
        role.forward(request_id, request)
        self._flush(role)

    def expire_waiting(self, mono_ms: int) -> None:
        """Forwards and held answers past their deadline end with an outcome-unknown E_TIMEOUT
        (the node's commit_wait_max_s: an answer held for a commit point that does not come, a
        Forward lost with a broken link; nothing waits for ever or leaks). A late ForwardResult then finds no entry and is dropped."""
        deadlines = self._forward_deadlines
        while deadlines and (deadlines[0][0] <= mono_ms or deadlines[0][1] not in self.forwards):
            _, request_id = heapq.heappop(deadlines)
            entry = self.forwards.pop(request_id, None)
            if entry is not None:
                entry[1]([E_TIMEOUT.code, f"the master of {entry[0]} did not answer a forwarded request in "
                                          f"{self.commit_wait_max_ms} ms; the outcome is unknown"])
        for name, waiting in self.held.items():
            while waiting and waiting[0].deadline_ms <= mono_ms:
                held = waiting.popleft()
                if held.refuse is not None:      # a push without refusal: its lease runs out instead
                    held.refuse(QueueError(E_TIMEOUT, f"queue {name}: not committed within {self.commit_wait_max_ms} ms "
                                                      "(no lease or no replica?)", outcome_unknown=True))
        self._forget_answered()

    def _forward_answered(self, name: str, result: ForwardResult) -> None:
        entry = self.forwards.pop(result.request_id, None)
        if entry is None:
            return
        answer = entry[1]
        commit, outcome = result.outcomes
        if not self.hold(name, commit, lambda: answer(outcome), answer):   # refused: answer(the QueueError)
            answer(outcome)

    # --- peers -----------------------------------------------------------------------------
    def on_peer_message(self, peer: str, data: bytes, mono_ms: int) -> None:
        try:
            message = decode_message(data)
        except MessageError as error:
            log.warning("bad replication message from %s: %s", peer, error)
            return
        if isinstance(message, (LeaseRenew, LeaseGrant, HandoffRequest, HandoffAnswer, HandoffOrder)):
            if self.coordinator is not None:
                self.coordinator.on_message(peer, message)
            return
        if isinstance(message, Create) and self._ahead_of_map(peer, message):
            return      # e.g. a move to this node that this node's map has not applied yet
        if isinstance(message, Create):
            entry = self.view.entry(message.queue)
            if entry is not None and (entry.replica != self.node_id or entry.master != peer):
                return      # a stale announcement: the map says otherwise
            self.engine.hold_replica_instance(message.queue, message.incarnation, message.record)
            role = self.replicas.get(message.queue)
            if role is not None and role.phase.value == "opening" and self._may_open(role):
                role.start(mono_ms)
                self._flush(role)
            return
        if isinstance(message, Delete):
            self.engine.drop_replica_instance(message.queue, message.incarnation)
            return
        if self._ahead_of_map(peer, message):
            return
        master = self.masters.get(message.queue)
        if master is not None and master.incarnation == message.incarnation:
            master.receive(message, mono_ms)
            self._drain_master(master)
            if self.coordinator is not None:
                self.coordinator.master_progress(master)
            return
        replica = self.replicas.get(message.queue)
        if replica is not None and replica.incarnation == message.incarnation:
            replica.receive(message, mono_ms)
            self._drain_replica(replica)

    def _ahead_of_map(self, peer: str, message: Message) -> bool:
        """A message from a newer epoch than this node has acted on (the peer applied a
        handoff or failover first) waits until this node has taken its role in that epoch:
        delivered now, it would fence the role this node is about to leave and be lost. The
        node's copy of the map is not enough: it changes as soon as the membership layer
        applies a command, and the roles follow when the engine's task gets to it (a Forward
        that arrived in between reached the old, fenced replica and was never answered)."""
        entry = self.view.entry(message.queue)
        if entry is None:
            return False
        role = self.masters.get(message.queue) or self.replicas.get(message.queue)
        acted_on = entry.epoch if role is None else min(entry.epoch, role.epoch)
        if message.epoch <= acted_on:
            return False
        waiting = self.early.setdefault(message.queue, collections.deque())
        if len(waiting) < EARLY_MESSAGES_MAX:
            waiting.append((peer, encode_message(message)))
        return True

    def _replay_early(self, name: str) -> None:
        for queue in (name, dead_letter_name(name)):
            waiting = self.early.pop(queue, None)
            entry = self.view.entry(queue)
            while waiting and entry is not None:
                peer, data = waiting.popleft()
                self.on_peer_message(peer, data, self.engine.monotonic_ms())

    def on_link_change(self, peer: str, up: bool, mono_ms: int) -> None:
        for role in self.masters.values():
            if role.replica_id != peer:
                continue
            self._wake(role.core.name)       # probing from now on: the tick counts how long
            if up:
                self.announce(role.core)
            else:
                role.link_down()
        for replica in self.replicas.values():
            if replica.master_id != peer:
                continue
            self._wake(replica.core.name)
            if up and self._may_open(replica):
                replica.start(mono_ms)
                self._flush(replica)
            elif not up:
                replica.link_down()
                # A Forward on the lost link is answered by no one (a master killed and started
                # again at once keeps its role, so no map change fails it either): its client
                # asks again now, with the same dedupe ids, rather than after commit_wait_max_s.
                self._fail_forwards(replica.core.name, f"the link to the master {peer} was lost", E_UNAVAILABLE)

    def confirm_restarted_masters(self) -> None:
        """With a lease, this node's map is as new as the leader's was when it granted: the
        masters that map still gives this node are confirmed (see `unconfirmed`)."""
        if self.unconfirmed and (self.coordinator is None or self.coordinator.lease_valid()):
            for name in self.unconfirmed:
                self._wake(name)          # their commit points count now: listeners may see more
            self.unconfirmed.clear()

    def tick(self, mono_ms: int) -> None:
        self.confirm_restarted_masters()
        self._ask_new_epochs(mono_ms)
        announce = mono_ms >= self._next_announce_ms
        if announce:
            self._next_announce_ms = mono_ms + ANNOUNCE_INTERVAL_MS
        notice = self.storage_full and mono_ms >= self._next_full_notice_ms
        if notice:
            self._next_full_notice_ms = mono_ms + STORAGE_FULL_NOTICE_MS
            self._ticking.update(dict.fromkeys(self.replicas))
        if announce:
            self._announce_again()
        # Roles something woke, then a slice of the others in turn (see TICK_SWEEP_ROLES).
        if not self._sweep:
            self._sweep = [*self.masters, *self.replicas]
        names = list(dict.fromkeys([*self._ticking, *self._sweep[-TICK_SWEEP_ROLES:]]))
        del self._sweep[-TICK_SWEEP_ROLES:]
        self._ticking = {}
        for name in names:
            role = self.masters.get(name)
            if role is not None:
                role.tick(mono_ms)
                self._drain_master(role)
                if role.quiet:
                    self._ticking.pop(name, None)
                continue
            replica = self.replicas.get(name)
            if replica is None:
                continue
            if notice:
                replica.refuse_for_storage()     # a new master, or one that missed the last notice
            if replica.phase.value == "opening" and replica.never_opened and self._may_open(replica):
                replica.start(mono_ms)       # the link came up before this role existed (or it waited)
            replica.tick(mono_ms)
            self._drain_replica(replica)
            if replica.quiet:
                self._ticking.pop(name, None)
        if self.engine.self_checks:
            self._check_ticking()
        self.release_committed()
        self.expire_waiting(mono_ms)

    def _check_ticking(self) -> None:
        """A simulation's check: every role the tick does not visit has nothing to do."""
        roles: list[tuple[str, MasterRole | ReplicaRole]] = [*self.masters.items(), *self.replicas.items()]
        for name, role in roles:
            if name not in self._ticking and not role.quiet:
                raise InvariantViolation(f"queue {name}: its {_role_name(role)} role has work in flight "
                                         f"({self.describe(name)}) and is not ticked")
            if name not in self._ticking and isinstance(role, ReplicaRole) and role.phase is ReplicaPhase.OPENING \
                    and role.never_opened and self._may_open(role):
                raise InvariantViolation(f"queue {name}: its replica role may open ({self.describe(name)}) "
                                         f"and is not ticked")

    def _drain_master(self, role: MasterRole) -> None:
        forwarded, role.forwarded = role.forwarded, []
        for request in forwarded:
            self.engine.run_forwarded(role, request)
        for proposal in role.proposals:
            self._propose_in_sync(role, proposal)
        role.proposals.clear()
        # Answers first: a commit point that moved on an AppendAck is what the clients wait
        # for; the replica's notice of it (in the outbox) only widens what it may expose.
        self.release_committed(role.core.name)
        self._flush(role)

    def _propose_in_sync(self, role: MasterRole, proposal: InSyncProposal) -> None:
        """Record the replica in (or out of) sync: a compare-and-set on the map; until the
        outcome is known the role holds acknowledgements (see MasterRole.commit_order)."""
        membership = self.view.membership
        if membership is None:
            return
        name = role.core.name
        if role.core.record.dead_letter_of is not None:
            # A dead-letter queue shares its queue's map entry: that queue's role proposes.
            entry = self.view.entry(name)
            role.membership_decided(entry.in_sync if entry is not None else role.recorded_in_sync)
            return
        change = ChangePair(name, (proposal.epoch, self.node_id, proposal.replica, proposal.expected_in_sync),
                            (proposal.epoch, self.node_id, proposal.replica, proposal.in_sync), Reason.IN_SYNC.value)

        def decided(outcomes: list[Outcome] | None) -> None:
            def settle(now_ms: int) -> None:
                if self.masters.get(name) is not role:
                    return
                entry = self.view.entry(name)
                applied = bool(outcomes) and outcomes[0].applied    # type: ignore[index]
                recorded = proposal.in_sync if applied else (entry.in_sync if entry is not None
                                                              and entry.epoch == role.epoch else role.recorded_in_sync)
                role.membership_decided(recorded)
                log.info("queue %s: replica %s recorded %s%s", name, proposal.replica,
                         "in sync" if recorded else "out of sync", "" if applied else " (proposal not applied)")
                if not recorded and role.core.options.min_in_sync >= 2:
                    self.refuse_unreplicated_writes(role)
                self._drain_master(role)
            self.engine.invoke(settle)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:          # a driver outside a loop (a unit test): at once
            membership.propose(change, decided)
            return
        if not self._in_sync_changes:
            loop.call_soon(self._propose_in_sync_changes)
        self._in_sync_changes.append((change, decided))

    def _propose_in_sync_changes(self) -> None:
        """The in-sync records asked for in one turn of the loop, in one map command per
        IN_SYNC_CHANGES_MAX (ChangePairs: each change decided on its own): when a node dies,
        every master whose replica it held records it out of sync at about the same moment,
        and 2,000 commands of one change each held the membership layer, and the failover
        behind them, for 20 s (issue 31)."""
        batch, self._in_sync_changes = self._in_sync_changes, []
        membership = self.view.membership
        if membership is None:
            return
        for start in range(0, len(batch), IN_SYNC_CHANGES_MAX):
            part = batch[start:start + IN_SYNC_CHANGES_MAX]
            if len(part) == 1:
                membership.propose(*part[0])
                continue

            def decided(outcomes: list[Outcome] | None, part: list[Any] = part) -> None:
                for position, (_, done) in enumerate(part):
                    done(None if outcomes is None else outcomes[position:position + 1])
            membership.propose(ChangePairs(tuple(change for change, _ in part)), decided)

    def _drain_replica(self, replica: ReplicaRole) -> None:
        if replica.dead_letter_resyncs:
            replica.dead_letter_resyncs = 0
            log.warning("queue %s: a dead letter's index and the dead-letter queue's own stream disagree here; "
                        "both states are taken again from one snapshot of the queue", replica.core.name)
        for record in replica.resets:
            self.engine.reset_replica_instance(replica, record)
            self.received.pop(replica.core.name, None)
            self._reset_dead_letters_with(replica)
        replica.resets.clear()
        for order in replica.discards:
            self.received.pop(replica.core.name, None)
            if not self.engine.discard_uncommitted(replica.core, order):
                raise InvariantViolation(f"queue {replica.core.name}: a producer member cannot keep its state "
                                         f"up to {order}")
        replica.discards.clear()
        if replica.snapshots_resumed:
            log.info("queue %s: the snapshot at order %s goes on after a broken link", replica.core.name,
                     replica.snapshot_order)
            self.snapshots_resumed += replica.snapshots_resumed
            replica.snapshots_resumed = 0
        if replica.snapshot_rows_through is not None:
            received = self.received.setdefault(replica.core.name, InstalledState(replica.snapshot_keep_upto > 0))
            received.take(replica.snapshot_rows)
            self.engine.stage_snapshot_rows(replica.core, replica.snapshot_rows,
                                            functools.partial(self._snapshot_rows_stored, replica,
                                                              *replica.snapshot_rows_through))
            replica.snapshot_rows, replica.snapshot_rows_through = [], None
        for install in replica.installs:
            self.installing.add(replica.core.name)
            received = self.received.pop(replica.core.name, InstalledState())
            self.engine.stage_snapshot_install(replica.core, install, received,
                                               functools.partial(self._installed, replica, install, received))
        replica.installs.clear()
        if replica.resync_source:
            replica.resync_source = False
            source = self.replicas.get(replica.core.record.dead_letter_of or "")
            if source is not None:
                log.info("queue %s: its dead-letter queue is behind the log: taking a snapshot of both",
                         source.core.name)
                source.wipe(source.core.record.to_json())
                self._drain_replica(source)
        if replica.applied:
            self.engine.stage_applied(replica.core, replica.applied)
            replica.applied.clear()
        results, replica.forward_results = replica.forward_results, []
        for result in results:
            self._forward_answered(replica.core.name, result)
        self._flush(replica)
        self.release_committed(replica.core.name)
        if replica.phase is ReplicaPhase.FOLLOWING and replica.core.record.dead_letter_of is None:
            # Its dead-letter queue's member may have waited for this one to follow (_may_open).
            dead = self.replicas.get(dead_letter_name(replica.core.name))
            if dead is not None and dead.never_opened:
                self._wake(dead.core.name)

    # --- snapshots on the replica ----------------------------------------------------------
    def _reset_dead_letters_with(self, replica: ReplicaRole) -> None:
        """Under `full` a queue's snapshot carries its dead-letter queue's state from the same
        view: wipe that member too; it opens again once the snapshot is installed."""
        core = replica.core
        dead = core.dead_letter_core
        dead_role = self.replicas.get(dead.name) if dead is not None else None
        if dead_role is None or core.options.strength is not Strength.FULL:
            return
        self.engine.reset_replica_instance(dead_role, dead_role.core.record.to_json())
        core.dead_letter_core = dead_role.core
        dead_role.rebase(0, EMPTY_DIGEST)

    def _snapshot_rows_stored(self, replica: ReplicaRole, transfer_number: int, sequence: int) -> None:
        if self.replicas.get(replica.core.name) is replica:
            replica.snapshot_rows_durable(transfer_number, sequence)
            self._flush(replica)

    def _installed(self, replica: ReplicaRole, install: SnapshotInstall, received: InstalledState) -> None:
        """The batch installing a snapshot committed: the core serves its messages (and the
        dead-letter queue's member follows on from the same view)."""
        core = replica.core
        self.installing.discard(core.name)
        if self.engine.cores.get(core.name) is not core:
            return              # the instance was wiped or removed meanwhile: nothing to serve
        # Even when a new epoch gave the member a new role meanwhile: that role took its
        # position from this one (the snapshot's order), and storage holds the snapshot, so
        # the core must serve it; left empty, it refused the first release or ack of a lease
        # the snapshot carried (the engine simulation, seed 480194086 under `full`). That role
        # has not opened yet (_may_open waits for `installing`): nothing it applied comes
        # before the snapshot's state (a chaos run saw acked messages delivered again when it
        # had opened, and applied acks, before this install).
        core.install_snapshot(received.ready if install.keep_upto else None, received.leases)
        self._wake(core.name)     # a role made meanwhile opens now (the tick starts it)
        self.snapshots_installed += 1
        log.info("queue %s: snapshot at order %d installed (%d messages)", core.name, install.order,
                 received.ready_count + received.delayed_count + len(received.leases))
        dead = core.dead_letter_core
        dead_role = self.replicas.get(dead.name) if dead is not None else None
        if install.dead_letter is None or dead is None or dead_role is None:
            return
        dead.install_snapshot(None, received.dead_letter_leases)
        dead_role.rebase(int(install.dead_letter[0]), bytes(install.dead_letter[1]))

    def _may_open(self, replica: ReplicaRole) -> bool:
        """A dead-letter queue's member under `full` opens once its queue's member follows
        (its state may come with that queue's snapshot). None opens while this node's storage
        is full."""
        if self.storage_full or not self.link_up(replica.master_id) or replica.core.name in self.installing:
            return False
        source_name = replica.core.record.dead_letter_of
        if source_name is None or replica.core.options.strength is not Strength.FULL:
            return True
        source = self.replicas.get(source_name)
        return source is None or (source.phase is ReplicaPhase.FOLLOWING and not source.receiving_snapshot)

    def commit_points_to_record(self) -> list[QueueCore]:
        """Masters whose commit point moved past the one their record holds (the last batch
        that touched the queue was sealed before its acknowledgements came): housekeeping writes
        their records, so a restart keeps more and the replica may truncate to the end."""
        changed, self._commits_changed = self._commits_changed, {}
        return [role.core for role in filter(None, map(self.masters.get, changed))
                if role.commit_order > role.core.record.commit_order and self._may_answer(role.core.name)]

    def log_floors(self) -> dict[int, int]:
        """For the batch being sealed: queue id -> delete op-log records below this order, for
        each queue whose floor moved (DESIGN.md 4.1 "Bounded log")."""
        floors: dict[int, int] = {}
        changed, self._floors_changed = self._floors_changed, {}
        for name in changed:
            queue_id, floor = self._log_floor(name)
            if queue_id is None:
                continue
            if floor is None:
                self._log_floors.pop(queue_id, None)     # a snapshot under way: looked at once installed
                continue
            done = self._log_floors.get(queue_id, 0)
            if floor > done:
                floors[queue_id] = floor
            self._log_floors[queue_id] = max(floor, done)
            master = self.masters.get(name)
            if master is not None:
                master.truncated_to(self._log_floors[queue_id])
        if self.engine.self_checks:
            for name in [*self.masters, *self.replicas]:
                queue_id, floor = self._log_floor(name)
                if queue_id is not None and floor is not None and self._log_floors.get(queue_id, 0) < floor:
                    raise InvariantViolation(f"queue {name}: its log floor moved to {floor} unnoticed "
                                             f"(the last one sent to storage is {self._log_floors.get(queue_id)})")
        return floors

    def _log_floor(self, name: str) -> tuple[int | None, int | None]:
        """(queue id, the floor of its role's op log now); None for the floor while a replica
        receives a snapshot, for both when this node holds no role of `name`."""
        role = self.masters.get(name)
        if role is not None:
            floor = role.log_floor
            source = self.masters.get(role.core.record.dead_letter_of or "")
            if source is not None and source.snapshot_dead_letter_order is not None:
                floor = min(floor, source.snapshot_dead_letter_order)
            return role.core.queue_id, floor
        replica = self.replicas.get(name)
        if replica is None:
            return None, None
        if replica.receiving_snapshot or name in self.received:
            return replica.core.queue_id, None
        # What the master committed and this member holds: if it becomes master, the other
        # member returns at or above it, or takes a snapshot.
        return replica.core.queue_id, replica.log_floor

    def map_applied(self, command: Command, outcomes: list[Outcome]) -> None:
        """A command the membership layer applied to the local copy of the map."""
        if isinstance(command, PutClient):
            if not outcomes or outcomes[0].applied:     # refused: its name was taken first
                self.engine.store_client(command.client_id, command.record)
            return
        if not outcomes:        # a snapshot replaced the whole map: the registry too
            cluster = self.view.cluster_map
            for client_id, record in cluster.clients.items():
                self.engine.store_client(client_id, record)
            # Removals this node missed (the log that held them was compacted while it was
            # away): a revoked key must not go on working here (issue 32). A client the map
            # never held (the first admin `qserver init` stored on the founding node) stays.
            for client_id in [client_id for client_id in self.engine.clients if client_id in cluster.revoked_clients]:
                self.engine.store_client(client_id, None)
        if isinstance(command, (CreateQueue, DeleteQueue)):
            if outcomes and outcomes[0].applied:
                self.reconcile(command.name, deleted=isinstance(command, DeleteQueue))
            return
        if isinstance(command, (PutChannel, DeleteChannel)):      # a channel's queue goes with it
            if outcomes and outcomes[0].applied and outcomes[0].reason != "changed":
                self.reconcile(channel_queue(command.name), deleted=isinstance(command, DeleteChannel))
            return
        names = [o.name for o in outcomes if o.applied and o.name in self.view.cluster_map.queues]
        if not outcomes:        # a snapshot replaced the whole map
            names = sorted(set(self.view.cluster_map.queues) | {base_name(n) for n in self.engine.cores})
        for name in names:
            self.reconcile(name)

    def masters_hint(self, name: str) -> str:
        entry = self.view.entry(name)
        if entry is None:
            return "(unknown: not in this node's map yet)"
        return f"{entry.master} ({self.view.url(entry.master)})"

    def flush(self, role: MasterRole | ReplicaRole) -> None:
        self._flush(role)

    def _role_changed(self, name: str) -> None:
        """Queue `name` got a role, lost it, or its role changed state: it is ticked, its log
        floor looked at, and the engine asks again who decides its timed steps."""
        self._wake(name)
        self.engine.role_changed(name)

    def _wake(self, name: str) -> None:
        """Something happened to the role of `name` (a message, a write, a commit, a link)."""
        self._ticking[name] = None
        self._floors_changed[name] = None
        self._commits_changed[name] = None
        self.engine.listeners_may_see_more(name)      # its commit point may have moved
        if not name.endswith(DEAD_LETTER_SUFFIX):
            # Its dead-letter queue's floor follows its snapshot, and dead letters become
            # visible as its stream commits (_gate_dead_letters).
            dead_letters = dead_letter_name(name)
            self._floors_changed[dead_letters] = None
            self.engine.listeners_may_see_more(dead_letters)

    def _flush(self, role: MasterRole | ReplicaRole) -> None:
        self._wake(role.core.name)
        for peer, message in role.outbox:
            self._send(peer, message)
        role.outbox.clear()

    def _send(self, peer: str, message: Message) -> None:
        if type(message) is Open:
            self.opens_sent += 1
        if not self.send(peer, encode_message(message)):
            log.debug("send queue to %s full: %s dropped (the protocol resends)", peer, type(message).__name__)

    def send_message(self, peer: str, message: Message) -> None:
        self._send(peer, message)

    def passed_by_every_member(self) -> dict[int, int]:
        """Local queue id -> the highest ordering index both members hold durably (a journal
        record at or below it is no longer needed for catch-up)."""
        floors = {role.core.queue_id: min(role.local_durable, role.replica_durable) for role in self.masters.values()}
        floors.update({role.core.queue_id: role.visible_order for role in self.replicas.values()})
        return floors

    def describe(self, name: str) -> dict[str, Any]:
        """Replication fields of the queue statistics (seed 004 QueueStats)."""
        master = self.masters.get(name)
        if master is not None:
            return {"replication_state": "in_sync" if master.recorded_in_sync else "out_of_sync",
                    "master_status": "master", "master": self.node_id, "replica": master.replica_id,
                    "last_order": master.last_order, "commit_order": master.commit_order,
                    "replica_durable_order": master.replica_durable, "replica_lag": master.last_order
                    - master.replica_durable, "replica_progress": master.progress.value,
                    "digest": master.digest.hex(), "epoch": master.epoch, "appends_sent": master.appends_sent,
                    "stream_rewinds": master.rewinds, "log_start": master.log_start,
                    "snapshots_sent": master.snapshots_sent, "snapshot_order": master.snapshot_order}
        replica = self.replicas.get(name)
        if replica is not None:
            return {"replication_state": replica.phase.value, "master_status": "replica", "master": replica.master_id,
                    "replica": self.node_id, "last_order": replica.applied_order,
                    "commit_order": replica.visible_order, "digest": replica.digest.hex(), "epoch": replica.epoch,
                    "receiving_snapshot": replica.receiving_snapshot}
        return {}


def _role_name(role: MasterRole | ReplicaRole) -> str:
    return "master" if isinstance(role, MasterRole) else "replica"
