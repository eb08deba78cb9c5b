"""The node's side of queue pairs: one replication role per queue it holds, taken from the
cluster map, and the effects of those roles performed in order.

Who holds each queue comes from the cluster map the membership layer replicates
(`replication/cluster_map.py`, `qserver/cluster/membership.py`): its master, replica, epoch and
in-sync flag. A dead-letter queue follows its queue's entry. When a map change names this
node in a new role (creation, handoff, failover, move), `reconcile` rebuilds the queue's role
from the old one's in-memory state, so nothing staged but not yet durable is forgotten, and
the epoch it persists with the next batch never goes backwards.

Everything runs on the core's task: the core calls in after stepping commands, before and
after each group commit, for peer messages, link changes, map changes and ticks. The roles are
pure (`replication/master.py`, `replication/replica.py`); this module performs their effects in
the required order: persist (into the open batch, `Staging`), then send, then answer. What it
needs of the core it reaches through the ports of `qserver/core/ports.py`. This module decides
which role each queue has and when it runs (attach, assume, become, reload, ticks); its
neighbours here own the rest: `view.py` (the map as read), `peer_inbox.py` (routing peer
messages), `master_effects.py` and `replica_effects.py` (what a role asks for, carried out),
`batches.py` (the roles' side of each group commit), `holds.py` (answers held for a commit
point), `relay_answers.py` (requests relayed to the master), `proposals.py` (in-sync records
and new epochs asked of the map).
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Protocol

from qserver.cluster.batches import PairBatches
from qserver.cluster.holds import DeadLetterGate, HeldAnswers
from qserver.cluster.master_effects import MasterEffects
from qserver.cluster.options_sync import follow_entry_options
from qserver.cluster.peer_inbox import PeerInbox
from qserver.cluster.proposals import MapProposals
from qserver.cluster.relay_answers import RelayAnswers
from qserver.cluster.replica_effects import ReplicaEffects
from qserver.cluster.view import ClusterView
from qserver.config import NodeConfig
from qserver.core.ports import Instances, PairEvents, Scheduler, Staging
from replication.cluster_map import (
    Command,
    CreateQueue,
    DeleteChannel,
    DeleteQueue,
    Outcome,
    PutChannel,
    PutClient,
    QueueEntry,
    channel_queue,
)
from replication.invariants import InvariantViolation
from replication.master import MasterRole, ReplicationLimits, is_replicated
from replication.messages import (
    Create,
    Message,
    Open,
    encode_message,
)
from replication.operations import Operation
from replication.oplog import OpLogReader
from replication.options import DEAD_LETTER_SUFFIX, Strength, base_name, dead_letter_name
from replication.queue_core import QueueCore
from replication.replica import ReplicaPhase, ReplicaRole
from replication.snapshot import SnapshotSource
from wire.errors import E_NOT_MASTER, E_QUEUE_UNAVAILABLE, E_UNAVAILABLE, QueueError

if TYPE_CHECKING:
    from qserver.cluster.coordinator import Coordinator

log = logging.getLogger("qserver.cluster.pairs")
ANNOUNCE_INTERVAL_MS = 1_000    # how often a master repeats Create to a replica that has not opened
STORAGE_FULL_NOTICE_MS = 1_000  # how often a replica on a full node tells its master it follows no more
# Roles with nothing in flight are not ticked (issue 31); besides those with work, each tick
# looks at this many others in turn, so a role nothing woke is still looked at now and then.
TICK_SWEEP_ROLES = 32


class PairStorage(OpLogReader, SnapshotSource, Protocol):
    """What the roles read of this node's storage: the op log and snapshots of committed state."""


class PairDriver:
    """The node's side of its queue pairs: one role per queue it holds. Every `mono_ms` here
    is the core's monotonic clock (`Scheduler.monotonic_ms`: the roles' timers, held answers,
    relayed requests)."""

    def __init__(self, view: ClusterView, limits: ReplicationLimits, *, config: NodeConfig, storage: PairStorage,
                 staging: Staging, instances: Instances, scheduler: Scheduler, events: PairEvents) -> None:
        self.view = view
        # Whether the node is in a cluster, fixed with its view's membership: an attribute, as
        # the core asks it several times a command (its turn, its steps).
        self.clustered = view.clustered
        self.limits = limits
        self.storage = storage
        self.staging = staging
        self.instances = instances
        self.scheduler = scheduler
        self.events = events
        self.node_id = config.node_id
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
        # with the same replica recorded out of sync (MapProposals.ask_new_epochs; docs/PROTOCOL.md,
        # "A master restarted inside its lease"): one operation per (epoch, order), always.
        self.restarted: dict[str, int] = {}      # queue (map entry) name -> the epoch it restarted in
        self.replicas: dict[str, ReplicaRole] = {}
        wait_max_ms = int(config.commit_wait_max_s * 1000)
        self.holds = HeldAnswers(self, scheduler.monotonic_ms, clustered=view.clustered, wait_max_ms=wait_max_ms)
        self.dead_letters = DeadLetterGate(self.masters, lambda: instances.cores)
        # Unique per node run: an answer the master sends to a crashed predecessor must never
        # match one of our requests.
        self.relayed = RelayAnswers(self.holds, scheduler.monotonic_ms, first_id=(scheduler.random_bits(40) << 20) + 1,
                                    wait_max_ms=wait_max_ms)
        self.proposals = MapProposals(view, scheduler, config.node_id)
        # Work proportional to what changed (issue 31), as ordered sets (dicts: a simulation
        # replays the same order): roles with something in flight, which the tick visits;
        # masters whose commit point may have passed their record's since housekeeping last
        # looked (and PairBatches.floors_changed).
        self._ticking: dict[str, None] = {}
        self._commits_changed: dict[str, None] = {}
        self._sweep: list[str] = []
        self._next_announce_ms = 0
        self._unopened: dict[str, None] = {}     # masters announced whose replica has not opened
        # This node's storage is full (the core's space check): its replicas follow no more.
        self.storage_full = False
        self._next_full_notice_ms = 0
        self.role_starts: collections.Counter[str] = collections.Counter()   # "master"/"replica" -> roles made
        self.opens_sent = 0            # Opens this node's replicas sent (a role that keeps restarting shows here)
        self.link_up: Any = lambda peer: False       # set by the node: PeerTransport.is_up
        self.send: Any = lambda peer, data: False   # set by the node: PeerTransport.send
        self.coordinator: Coordinator | None = None  # set in a cluster, once it is made
        self.replica_effects = ReplicaEffects(self, self.replicas, staging, instances, self.relayed)
        self.master_effects = MasterEffects(self, self.masters, view=view, proposals=self.proposals, holds=self.holds,
                                            scheduler=scheduler, events=events)
        self.inbox = PeerInbox(self, view, instances, scheduler, self.master_effects, self.replica_effects)
        self.batches = PairBatches(self, self.masters, self.replicas, self.replica_effects.received, staging, scheduler)

    @property
    def snapshots_installed(self) -> int:
        return self.replica_effects.snapshots_installed

    @property
    def snapshots_resumed(self) -> int:
        return self.replica_effects.snapshots_resumed

    # --- roles -----------------------------------------------------------------------------
    def attach(self, core: QueueCore, *, created: bool = False) -> None:
        """Give a loaded or new core its role from the cluster map (none outside a cluster,
        and none yet while the local copy of the map is older than the queue's epoch)."""
        entry = self.view.entry(core.name)
        if entry is None:
            return
        follow_entry_options(core, entry, self.staging)     # changed while this node was away
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
            last_order, digest = self.storage.last(core.queue_id)
            durable, commit = last_order, min(commit_known, last_order)
        elif isinstance(previous, MasterRole):
            last_order, digest, durable, commit = (previous.last_order, previous.digest, previous.local_durable,
                                                   self.commit_order(core.name) or 0)
        else:
            last_order, digest, durable, commit = (previous.applied_order, previous.digest, previous.durable_order,
                                                   previous.visible_order)
        role: MasterRole | ReplicaRole
        if entry.master == self.node_id:
            log_start = max(self.storage.first(core.queue_id), self.batches.sent_floors.get(core.queue_id, 0))
            role = self.masters[core.name] = MasterRole(
                core, self.storage, node_id=self.node_id, replica_id=entry.replica, epoch=entry.epoch,
                incarnation=incarnation, recorded_in_sync=entry.in_sync, last_order=last_order, digest=digest,
                limits=self.limits, durable_order=durable,
                replica_durable=commit if isinstance(previous, ReplicaRole) else min(replica_holds, last_order),
                snapshots=self.storage, log_start=log_start,
                replica_returns_from=previous.master_recorded_commit if isinstance(previous, ReplicaRole) else None)
            self.replica_effects.received.pop(core.name, None)
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
            # it has caught up (found by the node simulation, seed 2092 under `producer`).
            if (previous is None and record.epoch == entry.epoch) or entry.in_sync:
                known_commit = 0
            if known_commit and last_order > known_commit:
                kept = self._discard_uncommitted(core, known_commit)
                if kept is not None:
                    last_order, digest, durable = known_commit, kept, min(durable, known_commit)
            role = self.replicas[core.name] = ReplicaRole(
                core, self.storage, node_id=self.node_id, master_id=entry.master, epoch=entry.epoch,
                incarnation=incarnation, applied_order=last_order, digest=digest, last_epoch=record.epoch,
                limits=self.limits, session_base=self.scheduler.random_bits(40) << 20, durable_order=durable,
                commit_order=commit, known_committed=record.commit_order)
            self.replica_effects.received.pop(core.name, None)
            self.masters.pop(core.name, None)
            self.unconfirmed.pop(core.name, None)
            self.restarted.pop(core.name, None)
            if isinstance(previous, ReplicaRole) and previous.epoch != entry.epoch:
                # What its clients relayed in the older epoch the master of this one refuses
                # (E_FENCED) and never answers: they ask again now (dedupe ids make it safe),
                # not after commit_wait_max_s (a master killed and started again at once).
                self.relayed.fail(core.name, f"the master of {core.name} serves epoch {entry.epoch} now",
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
                self.staging.touch(core)
            self.staging.journal_mark(core, role_name, last_order, reason)
            log.info("queue %s: %s at epoch %d (%s), last order %d", core.name, role_name, entry.epoch, reason,
                     last_order)
        if record.dead_letter_of is not None:
            # Its messages arrive through the source queue's stream (see DeadLetterGate).
            role.gates_visibility = False
            core.visible_upto = None

    def detach(self, name: str) -> None:
        master, replica = self.masters.pop(name, None), self.replicas.pop(name, None)
        for role in (master, replica):
            if role is not None:
                self.batches.sent_floors.pop(role.core.queue_id, None)
        self.unconfirmed.pop(name, None)
        self.restarted.pop(name, None)
        self.replica_effects.installing.discard(name)
        self._role_changed(name)
        self.holds.drop(name)           # never committed: the queue is gone
        self.relayed.fail(name, "the queue left this node")

    def reload(self, name: str, core: QueueCore | None, reached: set[int], mono_ms: int) -> None:
        """A batch touching queue `name` could not be stored, and the core rebuilt it from
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
        if entry is not None:       # the lost batch may have held the record with the map's options
            follow_entry_options(core, entry, self.staging)
        if old is None:
            if entry is not None:
                self._assume(core, entry, None, "reload")
            return
        last_order = self.storage.last(core.queue_id)[0]
        position = old.last_order if isinstance(old, MasterRole) else old.applied_order
        if old.core.queue_id == core.queue_id and core.queue_id not in reached and position == last_order \
                and core.record.epoch == old.epoch:      # else the lost batch held the role's epoch mark
            old.rebind(core)
            return
        self.masters.pop(name, None)
        self.replicas.pop(name, None)
        self.replica_effects.forget(name)       # the lost batch held its install, or it committed
        self._role_changed(name)
        if entry is None:
            return
        log.warning("queue %s: its %s role starts again from storage (last order %d): a batch it wrote was lost",
                    name, _role_name(old), last_order)
        self._assume(core, entry, None, "reload", master.replica_durable if master is not None else 0,
                     replica.visible_order if replica is not None else 0)
        rebuilt = self.masters.get(name)
        if rebuilt is not None:
            pending = self.dead_letters.pending.get(dead_letter_name(name))
            if pending:      # dead letters the lost batch decided: their orders are given again
                self.dead_letters.pending[dead_letter_name(name)] = collections.deque(
                    item for item in pending if item[0] <= last_order)
            rebuilt.resync_replica(mono_ms)
            self.flush(rebuilt)

    def storage_full_changed(self, full: bool, mono_ms: int) -> None:
        """This node's storage ran out of room, or has room again. Its replicas stop taking their
        masters' streams (which would eat the reserve that acknowledgements and the membership
        layer need) and tell their masters, which record them out of sync at once and go on
        alone, or refuse writes under min_in_sync 2, instead of holding every answer until it
        times out. The requests their clients relayed are answered: they ask the master. With
        room again, they open and catch up (the tick starts them)."""
        self.storage_full = full
        self._next_full_notice_ms = mono_ms + STORAGE_FULL_NOTICE_MS
        if not full:
            for name in self.replicas:      # those that waited to open (may_open) start now
                self.wake(name)
            return
        for replica in self.replicas.values():
            replica.refuse_for_storage()
            self.flush(replica)
            self.relayed.fail(replica.core.name, "this replica's storage is full: ask the master")

    def refuse_relay_when_full(self, name: str) -> None:
        """A replica on a full node relays no client request: its answer would wait for a
        commit point this member no longer follows. The client asks the master instead."""
        if self.storage_full:
            raise QueueError(E_NOT_MASTER, f"queue {name}: this replica's storage is full; its master is "
                                           f"{self.masters_hint(name)}")

    def reconcile(self, name: str, *, deleted: bool = False) -> None:
        """The map changed for queue `name` (and its dead-letter queue): take the role it gives
        this node, create the master's instance, or drop an instance that moved away."""
        entry = self.view.cluster_map.queues.get(name)
        cores = [core for core in (self.instances.cores.get(name), self.instances.cores.get(dead_letter_name(name)))
                 if core is not None]
        if entry is None:
            if deleted:
                for core in cores:
                    self.instances.drop_instance(core)
            return
        if entry.master == self.node_id and self.instances.cores.get(name) is None:
            self.instances.create_master_instance(entry)
            return
        member = self.node_id in (entry.master, entry.replica)
        for core in cores:
            expected = entry.incarnation + (1 if core.record.dead_letter_of is not None else 0)
            if expected != (core.record.incarnation or core.queue_id):
                if member or core.record.epoch <= entry.epoch:
                    self.instances.drop_instance(core)     # an older incarnation of the name
                continue
            if not member:
                if core.record.epoch <= entry.epoch:
                    self.instances.drop_instance(core)     # moved away from this node
                continue
            follow_entry_options(core, entry, self.staging)     # SetQueueOptions, or a snapshot of the map
            self._become(core, entry)
        if self.coordinator is not None:
            self.coordinator.map_changed(name)
        self.inbox.replay_early(name)

    def _become(self, core: QueueCore, entry: QueueEntry) -> None:
        name = core.name
        master, replica = self.masters.get(name), self.replicas.get(name)
        if entry.master == self.node_id:
            if master is not None and master.epoch == entry.epoch and master.replica_id == entry.replica:
                if master.recorded_in_sync != entry.in_sync and not master.proposal_pending:
                    master.membership_decided(entry.in_sync)
                    if not entry.in_sync and core.options.min_in_sync >= 2:
                        self.holds.refuse_unreplicated_writes(master)
                    self.flush(master)
                return
            previous: MasterRole | ReplicaRole | None = master or replica
            self.relayed.fail(name, "this member became the master")
            self._assume(core, entry, previous)
            new = self.masters.get(name)
            if new is not None:
                self.announce(core)
                new.tick(self.scheduler.monotonic_ms())
                self.flush(new)
            self.release_committed()
            return
        if replica is not None and replica.epoch == entry.epoch and replica.master_id == entry.master:
            return
        previous = master or replica
        self.release_committed()
        if master is not None:
            self.batches.stream_staged(master)
            deposed_commit = master.commit_order
        self._assume(core, entry, previous)
        if master is not None:
            # Answers the batches in flight still owe about what it decided past its commit
            # point are released after this: their fate is the new master's to decide.
            self.staging.outcomes_unknown(name, deposed_commit)
            self.events.master_left(core, entry.master)
        role = self.replicas.get(name)
        if role is None:
            return
        if master is not None:
            # What it decided past its commit point may not survive, even after a handoff (the
            # handoff covered what it had decided then; a `producer` suffix after it is
            # discarded): the new master gives those indices to its own operations.
            self.holds.settle(name, QueueError(E_NOT_MASTER, f"queue {name} has a new master {entry.master}",
                                              outcome_unknown=True), deposed_commit)
        if self.may_open(role):
            role.start(self.scheduler.monotonic_ms())
            self.flush(role)

    def _discard_uncommitted(self, core: QueueCore, commit: int) -> bytes | None:
        """A deposed master about to follow: under `producer`, drop what it holds past its
        commit point and open from there (the new master holds everything committed), so its
        consumers keep their own acks and leases; the digest at `commit`, or None when the
        suffix stays (then the master finds the histories differ and sends everything)."""
        digest = self.storage.digest_at(core.queue_id, commit)
        if digest is None or not self.staging.discard_uncommitted(core, commit):
            return None
        log.info("queue %s: uncommitted suffix after %d discarded", core.name, commit)
        return digest

    def refuse_if_not_master(self, name: str) -> None:
        """Client commands for a queue this node neither masters nor holds go to its master."""
        if not self.clustered or name in self.masters or name in self.replicas:
            return
        entry = self.view.entry(name)
        if entry is None:
            if name in self.instances.cores:
                raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name}: this node's map does not list it yet")
            return
        if entry.master == self.node_id:
            if self.instances.cores.get(name) is None:
                return                   # ours to master: the instance is being created
            raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name} is taking its new role here; retry")
        raise QueueError(E_NOT_MASTER, f"queue {name} is mastered by {entry.master} at {self.view.url(entry.master)}")

    def restarting(self, name: str) -> bool:
        """Whether queue `name` (or the queue whose dead letters it holds) is mastered here by a
        master restarted in its role, waiting for its new epoch (see `restarted`)."""
        return bool(self.restarted) and base_name(name) in self.restarted

    def admit(self, name: str, *, write: bool) -> MasterRole | None:
        """A client's operation here, at a node that is not the queue's replica (Pairs.admit in
        qserver/core/replication_port.py): the master role that takes it, None, or refused."""
        master = self.masters.get(name)
        if master is None:
            self.refuse_if_not_master(name)
            return None
        if self.restarting(name):       # a master restarted in its role, before its new epoch
            raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name}: its master restarted and waits for its new epoch")
        if write or master.core.options.strength is Strength.FULL:
            master.check_writable()
            if self.coordinator is not None and not self.coordinator.lease_valid():
                raise QueueError(E_QUEUE_UNAVAILABLE, "this node's lease from the membership layer has lapsed")
        return master

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

    # --- the core's batches -----------------------------------------------------------------
    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
                      mono_ms: int, touched: dict[str, QueueCore]) -> None:
        """The batch is being sealed: stream what its masters decided (PairBatches.stream)."""
        self.batches.stream(operations, oplog_rows, mono_ms, touched)

    def after_commit(self, operations: list[Operation], mono_ms: int, touched: dict[str, QueueCore],
                     installed: list[tuple[int, int]] | None = None) -> None:
        """The batch is durable: advance each role's durable point and answer what committed."""
        self.batches.durable(operations, mono_ms, touched, installed)
        self.release_committed()
        if self.coordinator is not None and self.coordinator.handoffs:
            self.coordinator.check_handoffs()

    def log_floors(self) -> dict[int, int]:
        return self.batches.log_floors()

    def passed_by_every_member(self) -> dict[int, int]:
        return self.batches.passed_by_every_member()

    # --- answers held for a commit point (holds.py) ------------------------------------------
    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *, write: bool = False) -> bool:
        """Park an answer until the commit point passes required_order; False: answer now."""
        return self.holds.hold(name, required_order, release, refuse, write=write)

    def may_answer(self, name: str) -> bool:
        """A master whose lease lapsed stops acknowledging (docs/PROTOCOL.md, "Replication
        messages": LeaseGrant), and so does one restarted in its role until its new epoch."""
        if name not in self.masters:
            return True
        return (self.coordinator is None or self.coordinator.lease_valid()) and not self.restarting(name)

    def answer_point(self, name: str) -> tuple[int | None, bool]:
        """The queue's commit point here and whether its answers may go out now, together."""
        return self.commit_order(name), self.may_answer(name)

    def commit_order(self, name: str) -> int | None:
        master = self.masters.get(name)
        if master is not None:
            kept = self.unconfirmed.get(name)
            return master.commit_order if kept is None else min(master.commit_order, kept)
        replica = self.replicas.get(name)
        return None if replica is None else replica.visible_order

    def note_decided(self, core: QueueCore, ops: list[Operation]) -> int:
        """Called as soon as a master's core decided `ops` (see DeadLetterGate); the ordering
        index a client answer about them waits for (replicated_order)."""
        self.dead_letters.note_decided(core, ops)
        return self.replicated_order(core, ops)

    def release_committed(self, name: str | None = None) -> None:
        """Answer what the commit point has passed: of queue `name` (and its dead-letter
        queue) after something happened to its role, or of every queue. Not every queue
        after each message: a burst of 2,000 writes to 2,000 queues held 2,000 answers,
        each AppendAck looked at all of them, and the burst took 10 s (issue 31)."""
        if self.dead_letters.pending:
            self.dead_letters.gate()
        if name is None:
            self.holds.release(list(self.holds.held))
        else:
            base = base_name(name)
            self.holds.release((base, dead_letter_name(base)))

    def replicated_order(self, core: QueueCore, ops: list[Operation]) -> int:
        """The ordering index a client answer about these operations must wait for."""
        if core.name not in self.masters:
            return 0
        strength = core.options.strength
        return max((op.order for op in ops if is_replicated(op, strength)), default=0)

    # --- relaying (a replica's clients; relay_answers.py) ------------------------------------
    def relay(self, name: str, request: list[Any], answer: Any) -> None:
        """Relay a client's operation to the master; `answer(outcome)` once it is visible here."""
        role = self.replicas[name]
        if not self.link_up(role.master_id):
            # Sent now, it would be lost and answered only by expire_waiting: the client asks
            # again (the link comes back, or the map names another master) instead.
            answer([E_UNAVAILABLE.code, f"no link to the master {role.master_id} of {name} now"])
            return
        role.relay(self.relayed.add(name, request, answer), request)
        self.flush(role)

    def expire_waiting(self, mono_ms: int) -> None:
        """Relayed requests and held answers past their deadline end with an outcome-unknown
        E_TIMEOUT (the node's commit_wait_max_s)."""
        self.relayed.expire(mono_ms)
        self.holds.expire(mono_ms)

    # --- peers -----------------------------------------------------------------------------
    def on_peer_message(self, peer: str, data: bytes, mono_ms: int) -> None:
        self.inbox.receive(peer, data, mono_ms)

    def on_link_change(self, peer: str, up: bool, mono_ms: int, *, going_away: bool = False) -> None:
        for role in self.masters.values():
            if role.replica_id != peer:
                continue
            self.wake(role.core.name)       # probing from now on: the tick counts how long
            if up:
                self.announce(role.core)
            else:
                role.link_down(going_away=going_away)
        for replica in self.replicas.values():
            if replica.master_id != peer:
                continue
            self.wake(replica.core.name)
            if up and self.may_open(replica):
                replica.start(mono_ms)
                self.flush(replica)
            elif not up:
                replica.link_down()
                # A relayed request on the lost link is answered by no one (a master killed and started
                # again at once keeps its role, so no map change fails it either): its client
                # asks again now, with the same dedupe ids, rather than after commit_wait_max_s.
                self.relayed.fail(replica.core.name, f"the link to the master {peer} was lost", E_UNAVAILABLE)

    def confirm_restarted_masters(self) -> None:
        """With a lease, this node's map is as new as the leader's was when it granted: the
        masters that map still gives this node are confirmed (see `unconfirmed`)."""
        if self.unconfirmed and (self.coordinator is None or self.coordinator.lease_valid()):
            for name in self.unconfirmed:
                self.wake(name)          # their commit points count now: listeners may see more
            self.unconfirmed.clear()

    def tick(self, mono_ms: int) -> None:
        self.confirm_restarted_masters()
        self.proposals.ask_new_epochs(self.restarted, mono_ms)
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
                self.master_effects.drain(role)
                if role.quiet:
                    self._ticking.pop(name, None)
                continue
            replica = self.replicas.get(name)
            if replica is None:
                continue
            if notice:
                replica.refuse_for_storage()     # a new master, or one that missed the last notice
            if replica.phase.value == "opening" and replica.never_opened and self.may_open(replica):
                replica.start(mono_ms)       # the link came up before this role existed (or it waited)
            replica.tick(mono_ms)
            self.replica_effects.drain(replica)
            if replica.quiet:
                self._ticking.pop(name, None)
        if self.scheduler.self_checks:
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
                    and role.never_opened and self.may_open(role):
                raise InvariantViolation(f"queue {name}: its replica role may open ({self.describe(name)}) "
                                         f"and is not ticked")

    def may_open(self, replica: ReplicaRole) -> bool:
        """A dead-letter queue's member under `full` opens once its queue's member follows
        (its state may come with that queue's snapshot). None opens while this node's storage
        is full."""
        if self.storage_full or not self.link_up(replica.master_id) or replica.core.name in self.replica_effects.installing:
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
                if role.commit_order > role.core.record.commit_order and self.may_answer(role.core.name)]

    def map_applied(self, command: Command, outcomes: list[Outcome]) -> None:
        """A command the membership layer applied to the local copy of the map."""
        if isinstance(command, PutClient):
            if not outcomes or outcomes[0].applied:     # refused: its name was taken first
                self.events.store_client(command.client_id, command.record)
            return
        if not outcomes:        # a snapshot replaced the whole map: the registry too
            cluster = self.view.cluster_map
            for client_id, record in cluster.clients.items():
                self.events.store_client(client_id, record)
            # Removals this node missed (the log that held them was compacted while it was
            # away): a revoked key must not go on working here (issue 32). A client the map
            # never held (the first admin `qserver init` stored on the founding node) stays.
            for client_id in [client_id for client_id in self.events.clients if client_id in cluster.revoked_clients]:
                self.events.store_client(client_id, None)
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
            names = sorted(set(self.view.cluster_map.queues) | {base_name(n) for n in self.instances.cores})
        for name in names:
            self.reconcile(name)

    def masters_hint(self, name: str) -> str:
        entry = self.view.entry(name)
        if entry is None:
            return "(unknown: not in this node's map yet)"
        return f"{entry.master} ({self.view.url(entry.master)})"

    def _role_changed(self, name: str) -> None:
        """Queue `name` got a role, lost it, or its role changed state: it is ticked, its log
        floor looked at, and the core asks again who decides its timed steps."""
        self.wake(name)
        self.events.role_changed(name)

    def wake(self, name: str) -> None:
        """Something happened to the role of `name` (a message, a write, a commit, a link)."""
        self._ticking[name] = None
        self.batches.floors_changed[name] = None
        self._commits_changed[name] = None
        if name.endswith(DEAD_LETTER_SUFFIX):
            self.events.listeners_may_see_more(name)      # its commit point may have moved
            return
        # Its dead-letter queue's floor follows its snapshot, and dead letters become visible
        # as its stream commits (DeadLetterGate).
        dead_letters = dead_letter_name(name)
        self.batches.floors_changed[dead_letters] = None
        self.events.listeners_may_see_more(name)
        self.events.listeners_may_see_more(dead_letters)

    def flush(self, role: MasterRole | ReplicaRole) -> None:
        """Look at the role's queue again and send what it queued."""
        self.wake(role.core.name)
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
