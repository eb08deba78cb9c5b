"""The node side of queue pairs: placement, the replication roles, and their glue to the engine.

Placement is static for now (DESIGN.md: until the membership layer lands, configuration says
who is master): a queue listed under `[cluster.placement]` uses its pair, any other queue is
placed by a hash of its name over the sorted node ids (master, then the next node as
replica); a dead-letter queue follows its queue. The membership release replaces
`Placement` with the cluster map and supplies (master, replica, epoch); nothing else here
needs to change for that.

Everything runs on the engine's task: the engine calls in after stepping commands, before
and after each group commit, for peer messages, link changes and ticks. The roles are pure
(`replication/master.py`, `replication/replica.py`); this module performs their effects in
the required order: persist (into the engine's open batch), then send, then answer.
"""
from __future__ import annotations

import collections
import logging
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client.errors import E_NOT_MASTER, E_UNKNOWN_QUEUE, QueueError
from replication.master import InSyncProposal, MasterRole, ReplicationLimits, is_replicated
from replication.messages import (
    Create,
    Delete,
    ForwardResult,
    Message,
    MessageError,
    decode_message,
    encode_message,
)
from replication.operations import DeadLettered, Operation
from replication.options import DEAD_LETTER_SUFFIX
from replication.queue_core import QueueCore
from replication.replica import ReplicaRole

if TYPE_CHECKING:
    from qserver.engine import Engine

log = logging.getLogger("qserver.pairs")
STATIC_EPOCH = 1     # no change of master without the membership layer


@dataclass(frozen=True, slots=True)
class Pair:
    master: str
    replica: str
    epoch: int = STATIC_EPOCH


class Placement:
    """Who holds each queue: configured pairs, else a hash of the name over the nodes."""

    def __init__(self, nodes: dict[str, str], configured: dict[str, list[str]]) -> None:
        self.nodes = dict(nodes)
        self.order = sorted(nodes)
        self.configured = {name: Pair(pair[0], pair[1]) for name, pair in configured.items()}

    @property
    def clustered(self) -> bool:
        return len(self.order) >= 2

    def pair(self, queue: str) -> Pair:
        base = queue[:-len(DEAD_LETTER_SUFFIX)] if queue.endswith(DEAD_LETTER_SUFFIX) else queue
        configured = self.configured.get(base)
        if configured is not None:
            return configured
        first = zlib.crc32(base.encode()) % len(self.order)
        return Pair(self.order[first], self.order[(first + 1) % len(self.order)])

    def url(self, node: str) -> str:
        return self.nodes[node]


@dataclass(slots=True)
class HeldAnswer:
    """An answer released once the queue's commit point passes `required_order`."""
    required_order: int
    release: Any              # a no-argument callable: answer
    refuse: Any = None        # callable(QueueError): the queue went away first


class PairDriver:
    def __init__(self, engine: Engine, placement: Placement, limits: ReplicationLimits) -> None:
        self.engine = engine
        self.placement = placement
        self.limits = limits
        self.node_id = engine.config.node_id
        self.masters: dict[str, MasterRole] = {}
        # Dead letters enter a dead-letter queue through its source queue's stream, so under
        # `full` one becomes visible when the source's DeadLettered is committed:
        # dead-letter queue name -> (source order, dead-letter index) not yet committed.
        self.dead_letters_pending: dict[str, collections.deque[tuple[int, int]]] = {}
        self.replicas: dict[str, ReplicaRole] = {}
        self.held: dict[str, collections.deque[HeldAnswer]] = {}
        self.forwards: dict[int, Any] = {}      # forward request id -> callback(outcome)
        # Unique per engine instance: an answer the master sends to a crashed predecessor of
        # this engine must never match one of our requests.
        self._next_forward = (engine.random_bits(40) << 20) + 1
        self.link_up: Any = lambda peer: False       # set by the node: PeerTransport.is_up
        self.send: Any = lambda peer, data: False   # set by the node: PeerTransport.send

    # --- roles -----------------------------------------------------------------------------
    def attach(self, core: QueueCore) -> None:
        """Give a loaded or new core its role, from placement (no role on a single node)."""
        if not self.placement.clustered:
            return
        pair = self.placement.pair(core.name)
        record = core.record
        last_order, digest = self.engine.storage.last(core.queue_id)
        incarnation = record.incarnation or record.queue_id
        role: MasterRole | ReplicaRole
        if pair.master == self.node_id:
            role = self.masters[core.name] = MasterRole(
                core, self.engine.storage, node_id=self.node_id, replica_id=pair.replica, epoch=pair.epoch,
                incarnation=incarnation, recorded_in_sync=record.in_sync, last_order=last_order, digest=digest,
                limits=self.limits)
            self.replicas.pop(core.name, None)
        elif pair.replica == self.node_id:
            role = self.replicas[core.name] = ReplicaRole(
                core, self.engine.storage, node_id=self.node_id, master_id=pair.master, epoch=pair.epoch,
                incarnation=incarnation, applied_order=last_order, digest=digest, last_epoch=record.epoch,
                limits=self.limits, session_base=self.engine.random_bits(40) << 20)
            self.masters.pop(core.name, None)
        else:
            return
        if record.dead_letter_of is not None:
            # Its messages arrive through the source queue's stream (see _gate_dead_letters).
            role.gates_visibility = False
            core.visible_upto = None

    def detach(self, name: str) -> None:
        self.masters.pop(name, None)
        self.replicas.pop(name, None)
        for held in self.held.pop(name, ()):
            if held.refuse is not None:   # never committed: the queue is gone
                held.refuse(QueueError(E_UNKNOWN_QUEUE, f"queue {name} was deleted", outcome_unknown=True))

    def refuse_if_not_master(self, name: str) -> None:
        """Client commands for a queue this node neither masters nor holds go to its master."""
        if not self.placement.clustered or name in self.masters or name in self.replicas:
            return
        pair = self.placement.pair(name)
        if pair.master == self.node_id:
            return                      # ours to master: the queue simply does not exist
        raise QueueError(E_NOT_MASTER, f"queue {name} is mastered by {pair.master} at {self.placement.url(pair.master)}")

    def announce(self, core: QueueCore) -> None:
        """A new queue mastered here: tell its replica to hold an instance (and repeat it when
        the link comes back, until the replica opens)."""
        role = self.masters.get(core.name)
        if role is not None:
            self._send(role.replica_id, Create(core.name, role.incarnation, role.epoch, core.record.to_json()))

    def retire(self, name: str) -> None:
        role = self.masters.get(name)
        if role is not None:
            self._send(role.replica_id, Delete(name, role.incarnation, role.epoch))
        self.detach(name)

    # --- the engine's batches --------------------------------------------------------------
    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, bytes, bytes]],
                      now_ms: int) -> None:
        """Stream the batch's replicated operations (persist and send in the same step) and
        add their op-log rows to the transaction."""
        if not self.masters:
            return
        by_queue: dict[int, list[Operation]] = {}
        for op in operations:
            by_queue.setdefault(op.queue_id, []).append(op)
        for role in self.masters.values():
            ops = by_queue.get(role.core.queue_id)
            if ops:
                role.replicate(ops, now_ms)
                for row in role.to_log:
                    oplog_rows.append((role.core.queue_id, row.op.order, row.digest, row.encoded))
                role.to_log.clear()
                self._flush(role)

    def after_commit(self, operations: list[Operation], now_ms: int) -> None:
        """The batch is durable: advance each role's durable point and answer what committed."""
        durable: dict[int, int] = {}
        for op in operations:
            if op.order > durable.get(op.queue_id, 0):
                durable[op.queue_id] = op.order
        for role in self.masters.values():
            order = durable.get(role.core.queue_id)
            if order:
                role.local_durable_to(order, now_ms)
                self._flush(role)
        for replica in self.replicas.values():
            order = durable.get(replica.core.queue_id)
            if order:
                replica.local_durable_to(order)
                self._flush(replica)
        self.release_committed()

    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None) -> bool:
        """Park an answer until the commit point passes required_order; False: answer now."""
        commit = self.commit_order(name)
        if commit is None or required_order <= commit:
            return False
        self.held.setdefault(name, collections.deque()).append(HeldAnswer(required_order, release, refuse))
        return True

    def commit_order(self, name: str) -> int | None:
        master = self.masters.get(name)
        if master is not None:
            return master.commit_order
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

    def release_committed(self) -> None:
        if self.dead_letters_pending:
            self._gate_dead_letters()
        for name, waiting in self.held.items():
            commit = self.commit_order(name)
            # Answers are held in (nearly) increasing order: release from the front. One that
            # needs less than the one before it only waits for that one.
            while waiting and commit is not None and waiting[0].required_order <= commit:
                waiting.popleft().release()

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
        request_id = self._next_forward
        self._next_forward += 1
        self.forwards[request_id] = answer
        role.forward(request_id, request)
        self._flush(role)

    def _forward_answered(self, name: str, result: ForwardResult) -> None:
        answer = self.forwards.pop(result.request_id, None)
        if answer is None:
            return
        commit, outcome = result.outcomes
        if not self.hold(name, commit, lambda: answer(outcome)):
            answer(outcome)

    # --- peers -----------------------------------------------------------------------------
    def on_peer_message(self, peer: str, data: bytes, now_ms: int) -> None:
        try:
            message = decode_message(data)
        except MessageError as error:
            log.warning("bad replication message from %s: %s", peer, error)
            return
        if isinstance(message, Create):
            self.engine.hold_replica_instance(message.queue, message.incarnation, message.record)
            role = self.replicas.get(message.queue)
            if role is not None and role.phase.value == "opening":
                role.start(now_ms)
                self._flush(role)
            return
        if isinstance(message, Delete):
            self.engine.drop_replica_instance(message.queue, message.incarnation)
            return
        master = self.masters.get(message.queue)
        if master is not None and master.incarnation == message.incarnation:
            master.receive(message, now_ms)
            self._drain_master(master)
            return
        replica = self.replicas.get(message.queue)
        if replica is not None and replica.incarnation == message.incarnation:
            replica.receive(message, now_ms)
            self._drain_replica(replica)

    def on_link_change(self, peer: str, up: bool, now_ms: int) -> None:
        for role in self.masters.values():
            if role.replica_id != peer:
                continue
            if up:
                self.announce(role.core)
            else:
                role.link_down()
        for replica in self.replicas.values():
            if replica.master_id != peer:
                continue
            if up:
                replica.start(now_ms)
                self._flush(replica)
            else:
                replica.link_down()

    def tick(self, now_ms: int) -> None:
        for role in self.masters.values():
            role.tick(now_ms)
            self._drain_master(role)
        for replica in self.replicas.values():
            if replica.phase.value == "opening" and replica.never_opened and self.link_up(replica.master_id):
                replica.start(now_ms)       # the link came up before this role existed
            replica.tick(now_ms)
            self._drain_replica(replica)
        self.release_committed()

    def _drain_master(self, role: MasterRole) -> None:
        forwarded, role.forwarded = role.forwarded, []
        for request in forwarded:
            self.engine.run_forwarded(role, request)
        for proposal in role.proposals:
            self._decide(role, proposal)
        role.proposals.clear()
        self._flush(role)
        self.release_committed()

    def _decide(self, role: MasterRole, proposal: InSyncProposal) -> None:
        """The static stand-in for the membership layer: a compare-and-set on the queue record,
        persisted with the next batch (the membership release makes this a Raft write)."""
        record = role.core.record
        if record.in_sync == proposal.expected_in_sync:
            record.in_sync = proposal.in_sync
            self.engine.touch(role.core)
            log.info("queue %s: replica %s recorded %s", record.name, proposal.replica,
                     "in sync" if proposal.in_sync else "out of sync")
        role.membership_decided(record.in_sync)

    def _drain_replica(self, replica: ReplicaRole) -> None:
        for record in replica.resets:
            self.engine.reset_replica_instance(replica, record)
        replica.resets.clear()
        if replica.applied:
            self.engine.stage_applied(replica.core, replica.applied)
            replica.applied.clear()
        results, replica.forward_results = replica.forward_results, []
        for result in results:
            self._forward_answered(replica.core.name, result)
        self._flush(replica)
        self.release_committed()

    def masters_hint(self, name: str) -> str:
        pair = self.placement.pair(name)
        return f"{pair.master} ({self.placement.url(pair.master)})"

    def flush(self, role: MasterRole | ReplicaRole) -> None:
        self._flush(role)

    def _flush(self, role: MasterRole | ReplicaRole) -> None:
        for peer, message in role.outbox:
            self._send(peer, message)
        role.outbox.clear()

    def _send(self, peer: str, message: Message) -> None:
        if not self.send(peer, encode_message(message)):
            log.debug("send queue to %s full: %s dropped (the protocol resends)", peer, type(message).__name__)

    def describe(self, name: str) -> dict[str, Any]:
        """Replication fields of the queue statistics (seed 004 QueueStats)."""
        master = self.masters.get(name)
        if master is not None:
            return {"replication_state": "in_sync" if master.recorded_in_sync else "out_of_sync",
                    "master_status": "master", "replica": master.replica_id, "last_order": master.last_order,
                    "commit_order": master.commit_order, "replica_durable_order": master.replica_durable,
                    "replica_progress": master.progress.value, "digest": master.digest.hex(), "epoch": master.epoch,
                    "appends_sent": master.appends_sent, "stream_rewinds": master.rewinds}
        replica = self.replicas.get(name)
        if replica is not None:
            return {"replication_state": replica.phase.value, "master_status": "replica", "master": replica.master_id,
                    "replica": self.node_id, "last_order": replica.applied_order,
                    "commit_order": replica.visible_order, "digest": replica.digest.hex(), "epoch": replica.epoch}
        return {}

