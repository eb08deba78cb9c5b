"""What a replica role asks for, performed on the node: its applied entries and the snapshots it
receives stored in the open batch, instances reset or trimmed, a snapshot served once it is
durable, and the dead-letter queue's member kept on the same view as its queue's.

Separate from the pair driver because it is the replica's half of "persist, then send, then
answer" (docs/PROTOCOL.md, "The bounded op log and snapshots"): the driver decides which role a
queue has and when it runs; this module carries out a replica role's requests and owns the state
of the snapshots under way (`received`, `installing`).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Protocol

from qserver.cluster.relay_answers import RelayAnswers
from qserver.core.ports import Instances, Staging
from replication.digest import EMPTY_DIGEST
from replication.invariants import InvariantViolation
from replication.master import MasterRole
from replication.options import Strength, dead_letter_name
from replication.replica import ReplicaPhase, ReplicaRole, SnapshotInstall
from replication.snapshot import InstalledState

log = logging.getLogger("qserver.cluster.pairs")


class RoleOutput(Protocol):
    """What follows a role's step, done by the pair driver: its messages sent, its queue looked
    at again, the answers its commit point passed released."""

    def flush(self, role: MasterRole | ReplicaRole) -> None:
        ...

    def wake(self, name: str) -> None:
        ...

    def release_committed(self, name: str | None = None) -> None:
        ...


class ReplicaEffects:
    def __init__(self, output: RoleOutput, replicas: Mapping[str, ReplicaRole], staging: Staging,
                 instances: Instances, relayed: RelayAnswers) -> None:
        self.output = output
        self.replicas = replicas          # the pair driver's: queue name -> replica role
        self.staging = staging
        self.instances = instances
        self.relayed = relayed
        self.received: dict[str, InstalledState] = {}     # queue name -> rows of the snapshot under way
        # Queues whose snapshot install is being written: a replica role made meanwhile (a new
        # epoch) opens only once it is in memory too (see _installed and PairDriver.may_open).
        self.installing: set[str] = set()
        self.snapshots_installed = 0
        self.snapshots_resumed = 0

    def forget(self, name: str) -> None:
        """The queue's role is gone or starts again from storage: no snapshot of it is under way."""
        self.received.pop(name, None)
        self.installing.discard(name)

    def drain(self, replica: ReplicaRole) -> None:
        """Carry out what the role asked for in its last step, then send and answer."""
        if replica.dead_letter_resyncs:
            replica.dead_letter_resyncs = 0
            log.warning("queue %s: a dead letter's index and the dead-letter queue's own stream disagree here; "
                        "both states are taken again from one snapshot of the queue", replica.core.name)
        for record in replica.resets:
            self.instances.reset_replica_instance(replica, record)
            self.received.pop(replica.core.name, None)
            self._reset_dead_letters_with(replica)
        replica.resets.clear()
        for order in replica.discards:
            self.received.pop(replica.core.name, None)
            if not self.staging.discard_uncommitted(replica.core, order):
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
            self.staging.stage_snapshot_rows(replica.core, replica.snapshot_rows,
                                             functools.partial(self._snapshot_rows_stored, replica,
                                                               *replica.snapshot_rows_through))
            replica.snapshot_rows, replica.snapshot_rows_through = [], None
        for install in replica.installs:
            self.installing.add(replica.core.name)
            received = self.received.pop(replica.core.name, InstalledState())
            self.staging.stage_snapshot_install(replica.core, install, received,
                                                functools.partial(self._installed, replica, install, received))
        replica.installs.clear()
        if replica.resync_source:
            replica.resync_source = False
            source = self.replicas.get(replica.core.record.dead_letter_of or "")
            if source is not None:
                log.info("queue %s: its dead-letter queue is behind the log: taking a snapshot of both",
                         source.core.name)
                source.wipe(source.core.record.to_json())
                self.drain(source)
        if replica.applied:
            self.staging.stage_applied(replica.core, replica.applied)
            replica.applied.clear()
        results, replica.relay_results = replica.relay_results, []
        for result in results:
            self.relayed.answered(replica.core.name, result)
        self.output.flush(replica)
        self.output.release_committed(replica.core.name)
        if replica.phase is ReplicaPhase.FOLLOWING and replica.core.record.dead_letter_of is None:
            # Its dead-letter queue's member may have waited for this one to follow (may_open).
            dead = self.replicas.get(dead_letter_name(replica.core.name))
            if dead is not None and dead.never_opened:
                self.output.wake(dead.core.name)

    def _reset_dead_letters_with(self, replica: ReplicaRole) -> None:
        """Under `full` a queue's snapshot carries its dead-letter queue's state from the same
        view: wipe that member too; it opens again once the snapshot is installed."""
        core = replica.core
        dead = core.dead_letter_core
        dead_role = self.replicas.get(dead.name) if dead is not None else None
        if dead_role is None or core.options.strength is not Strength.FULL:
            return
        self.instances.reset_replica_instance(dead_role, dead_role.core.record.to_json())
        core.dead_letter_core = dead_role.core
        dead_role.rebase(0, EMPTY_DIGEST)

    def _snapshot_rows_stored(self, replica: ReplicaRole, transfer_number: int, sequence: int) -> None:
        if self.replicas.get(replica.core.name) is replica:
            replica.snapshot_rows_durable(transfer_number, sequence)
            self.output.flush(replica)

    def _installed(self, replica: ReplicaRole, install: SnapshotInstall, received: InstalledState) -> None:
        """The batch installing a snapshot committed: the core serves its messages (and the
        dead-letter queue's member follows on from the same view)."""
        core = replica.core
        self.installing.discard(core.name)
        if self.instances.cores.get(core.name) is not core:
            return              # the instance was wiped or removed meanwhile: nothing to serve
        # Even when a new epoch gave the member a new role meanwhile: that role took its
        # position from this one (the snapshot's order), and storage holds the snapshot, so
        # the core must serve it; left empty, it refused the first release or ack of a lease
        # the snapshot carried (the node simulation, seed 480194086 under `full`). That role
        # has not opened yet (may_open waits for `installing`): nothing it applied comes
        # before the snapshot's state (a chaos run saw acked messages delivered again when it
        # had opened, and applied acks, before this install).
        core.install_snapshot(received.ready if install.keep_upto else None, received.leases)
        self.output.wake(core.name)     # a role made meanwhile opens now (the tick starts it)
        self.snapshots_installed += 1
        log.info("queue %s: snapshot at order %d installed (%d messages)", core.name, install.order,
                 received.ready_count + received.delayed_count + len(received.leases))
        dead = core.dead_letter_core
        dead_role = self.replicas.get(dead.name) if dead is not None else None
        if install.dead_letter is None or dead is None or dead_role is None:
            return
        dead.install_snapshot(None, received.dead_letter_leases)
        dead_role.rebase(int(install.dead_letter[0]), bytes(install.dead_letter[1]))
