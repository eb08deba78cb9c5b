"""The pairs' side of each group commit: the masters' operations streamed as the batch is sealed
(persist and send in the same step), each role's durable point advanced once it is written, and
the op log's floors the batch may truncate to.

Separate from the pair driver because it follows the commit pipeline's rhythm (sealed, then
durable), not the map's or the peers': the driver calls it from `before_commit`/`after_commit`
and answers what committed afterwards (docs/PROTOCOL.md, "The bounded op log and snapshots").
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from qserver.cluster.replica_effects import RoleOutput
from qserver.core.ports import Scheduler, Staging
from replication.invariants import InvariantViolation
from replication.operations import Operation

if TYPE_CHECKING:
    from replication.master import MasterRole
    from replication.queue_core import QueueCore
    from replication.replica import ReplicaRole
    from replication.snapshot import InstalledState


class PairBatches:
    def __init__(self, output: RoleOutput, masters: Mapping[str, MasterRole], replicas: Mapping[str, ReplicaRole],
                 received: Mapping[str, InstalledState], staging: Staging, scheduler: Scheduler) -> None:
        self.output = output
        self.masters = masters          # the pair driver's roles (shared, never replaced)
        self.replicas = replicas
        self.received = received        # snapshots under way (ReplicaEffects.received)
        self.staging = staging
        self.scheduler = scheduler
        self.sent_floors: dict[int, int] = {}            # queue id -> the floor last sent to storage
        # Roles whose log floor may have moved since the last batch was sealed (issue 31).
        self.floors_changed: dict[str, None] = {}

    def stream(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
               mono_ms: int, touched: Mapping[str, QueueCore]) -> None:
        """Stream the batch's replicated operations and add their op-log rows to the transaction.
        `touched`: the queues the batch holds anything of (every operation's queue among them)."""
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
                self.output.flush(role)

    def stream_staged(self, role: MasterRole) -> None:
        """A master deposed while its core has decided operations still in the open
        batch (not yet streamed): take them into its history, with their op-log rows, so the
        replica role it becomes starts after them and they count as its uncommitted suffix
        (discarded, or the new master resets it). Left out, they would be committed beside
        the stream, and the new master's operations at the same indices would collide with
        them. Nobody in the old epoch takes them any more: nothing is sent."""
        staged = self.staging.staged()
        # Not what it applied as replica earlier in this batch: that is in its history already.
        ops = [op for op in staged.operations if op.queue_id == role.core.queue_id and op.order > role.last_order]
        if not ops:
            return
        role.replicate(ops, self.scheduler.monotonic_ms())
        for entry in role.to_log:
            staged.oplog_rows.append(entry.row(role.core.queue_id))
        role.to_log.clear()
        role.outbox.clear()

    def durable(self, operations: list[Operation], mono_ms: int, touched: Mapping[str, QueueCore],
                installed: list[tuple[int, int]] | None = None) -> None:
        """The batch is durable: advance each role's durable point. `touched`: the queues the
        batch held anything of (their records were written)."""
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
                self.output.flush(role)
        for replica in filter(None, map(self.replicas.get, touched)):
            order = durable.get(replica.core.queue_id)
            if order:
                replica.local_durable_to(order)
                self.output.flush(replica)

    def log_floors(self) -> dict[int, int]:
        """For the batch being sealed: queue id -> delete op-log records below this order, for
        each queue whose floor moved."""
        floors: dict[int, int] = {}
        changed, self.floors_changed = self.floors_changed, {}
        sent = self.sent_floors
        for name in changed:
            queue_id, floor = self._log_floor(name)
            if queue_id is None:
                continue
            if floor is None:
                sent.pop(queue_id, None)     # a snapshot under way: looked at once installed
                continue
            done = sent.get(queue_id, 0)
            if floor > done:
                floors[queue_id] = floor
            sent[queue_id] = max(floor, done)
            master = self.masters.get(name)
            if master is not None:
                master.truncated_to(sent[queue_id])
        if self.scheduler.self_checks:
            for name in [*self.masters, *self.replicas]:
                queue_id, floor = self._log_floor(name)
                if queue_id is not None and floor is not None and sent.get(queue_id, 0) < floor:
                    raise InvariantViolation(f"queue {name}: its log floor moved to {floor} unnoticed "
                                             f"(the last one sent to storage is {sent.get(queue_id)})")
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

    def passed_by_every_member(self) -> dict[int, int]:
        """Local queue id -> the highest ordering index both members hold durably (a journal
        record at or below it is no longer needed for catch-up)."""
        floors = {role.core.queue_id: min(role.local_durable, role.replica_durable) for role in self.masters.values()}
        floors.update({role.core.queue_id: role.visible_order for role in self.replicas.values()})
        return floors
