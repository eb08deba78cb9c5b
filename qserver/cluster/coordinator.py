"""A node's part in the cluster beyond its queues' streams: its lease, the membership leader's
duties (failover, node states, replacing lost replicas), handoffs, and the operator's
commands that change the map (create, delete, move, promote --unclean, drain, undrain, rebalance).

Runs on the core's task (the core calls `tick`, the pair driver passes peer messages and map
changes in; the results of proposals come back through `Scheduler.invoke`, one of the ports of
qserver/core/ports.py). Decisions are the pure functions of `replication/cluster_map.py` and
`replication/leases.py`; this module only times them, proposes them and keeps the bookkeeping
of what is in flight.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qserver.config import NodeConfig
from qserver.core.ports import Instances, Scheduler
from replication.cluster_map import (
    AddNode,
    ChangePair,
    ChangePairs,
    Command,
    NodeState,
    Outcome,
    Reason,
    SetNodeState,
    astuple,
    plan_failover,
    plan_member_moves,
    plan_rebalance,
    plan_replacements,
)
from replication.drain_check import PairView, drain_refusals
from replication.leases import LeaseTable, NodeLease
from replication.master import MasterRole
from replication.messages import HandoffAnswer, HandoffOrder, HandoffRequest, LeaseGrant, LeaseRenew, Message
from replication.options import base_name, dead_letter_name
from wire.errors import (
    E_HANDOFF_REFUSED,
    E_INVALID_OPTION,
    E_NOT_MASTER,
    E_QUEUE_UNAVAILABLE,
    E_TIMEOUT,
    E_UNKNOWN_QUEUE,
    QueueError,
)

if TYPE_CHECKING:
    from qserver.cluster.membership import Membership
    from qserver.cluster.pairs import PairDriver
    from qserver.core.commands import Command as CoreCommand

log = logging.getLogger("qserver.cluster.coordinator")
Finish = Callable[[Any], None]          # finish(result) or finish(QueueError)
HANDOFF_TIMEOUT_MS = 5_000
LEADER_PROPOSAL_INTERVAL_MS = 250
DRAIN_HANDOFFS_AT_ONCE = 16
MAINTENANCE_HANDOFF_EVERY_MS = 1_000     # a node in maintenance hands back a master it gained, this often
NOT_DRAINING_HINTS = {
    NodeState.UP: "it serves already (nothing to undo)",
    NodeState.DOWN: "it is set up again by itself once it runs and renews its lease",
    NodeState.REMOVED: "it was removed for good, and a removed node id is never reused",
}


@dataclass
class Handoff:
    """A master-side handoff in progress: commands for the queue are parked meanwhile."""
    queue: str
    initiator: str
    started_ms: int
    deadline_ms: int
    finishes: list[Finish] = field(default_factory=list)
    replica_request: tuple[str, int] | None = None      # (peer, request id) when the replica asked
    proposed: bool = False
    parked: list[CoreCommand] = field(default_factory=list)


class Coordinator:
    """`storage_id`: this node's storage's (a node on another disk than the map knows gets no
    lease until the map records it); lease timings, node id and URL from `config`; every
    deadline on `scheduler.monotonic_ms`."""

    def __init__(self, pairs: PairDriver, membership: Membership, *, config: NodeConfig, storage_id: int,
                 scheduler: Scheduler, instances: Instances) -> None:
        self.pairs = pairs
        self.membership = membership
        self.config = config
        self.storage_id = storage_id
        self.scheduler = scheduler
        self.instances = instances
        self.node_id = config.node_id
        self.monotonic_ms = scheduler.monotonic_ms
        self.lease = NodeLease(config.lease_ms, first_sequence=(scheduler.random_bits(40) << 20) + 1)
        self.table = LeaseTable(config.lease_ms, config.lease_margin_ms)
        self.renew_interval_ms = config.lease_renew_interval_ms
        self.replica_replace_after_ms = int(config.replica_replace_after_s * 1000)
        self.accept_replica_handoffs = config.accept_replica_handoffs
        self.handoffs: dict[str, Handoff] = {}
        self.asked: dict[int, tuple[str, Finish, int]] = {}     # replica's handoff request id -> (queue, finish, deadline)
        self.promised: dict[str, tuple[Finish, int]] = {}      # accepted: waiting for the local map to show it
        self._next_request = (scheduler.random_bits(40) << 20) + 1
        self._next_renew_ms = 0
        # (map version, renewal sequence) of grants this node's map has not caught up with;
        # bounded like the renewals they answer (older ones no longer count).
        self._grants_waiting: deque[tuple[int, int]] = deque(maxlen=self.lease.outstanding_max)
        self._leader_term: int | None = None
        self._leader_busy_until_ms = 0
        self._registering = False
        self.failovers = 0
        self.lease_lapses = 0
        # Nodes this node knows to be drained for maintenance (docs/OPERATIONS.md, "Rolling
        # upgrade"): node-local, never in the map, so a 0.1.0 node in the cluster reads nothing
        # new. A master here hands off to none of them, a rebalance planned here picks none, and
        # a node that finds itself here hands back any master it gains (a failover onto it).
        self.maintenance: set[str] = set()
        self._next_maintenance_ms = 0

    # --- the lease ---------------------------------------------------------------------------
    def lease_valid(self) -> bool:
        return self.lease.valid(self.monotonic_ms())

    def _accept_grants(self) -> None:
        """Grants count once this node's map has applied what the leader's log held when it
        granted (LeaseGrant): a node restarted on its own stale copy of the map, which still
        named it master of queues that failed over meanwhile, decided operations in the old
        epoch. A grant whose version is never reached (the leader's uncommitted commands were
        replaced) is passed over by the next one that is."""
        version, waiting = self.membership.cluster_map.version, self._grants_waiting
        ready = [sequence for needed, sequence in waiting if needed <= version]
        if ready:
            latest = max(ready)
            now = self.monotonic_ms()
            lapsed = 0 < self.lease.valid_until_ms <= now
            self.lease.granted(latest)          # drops the renewals sent before it
            if lapsed and self.lease.valid(now):
                self.lease_lapses += 1          # qserver_node_lease_lapses_total (docs/OPERATIONS.md, "Monitoring")
            kept = [(needed, sequence) for needed, sequence in waiting if sequence > latest]
            waiting.clear()
            waiting.extend(kept)

    def tick(self, mono: int) -> None:
        """`mono`: the monotonic clock (every deadline here is on it)."""
        self._accept_grants()
        if mono >= self._next_renew_ms:
            self._next_renew_ms = mono + self.renew_interval_ms
            self._renew(mono)
        self._register_self()
        if self.membership.is_leader():
            self._lead(mono)
        elif self._leader_term is not None:
            self._leader_term = None
            self.table.stepped_down()
        self._handoff_timeouts(mono)
        self.check_handoffs()
        me = self.membership.cluster_map.nodes.get(self.node_id)
        if me is not None and me.state is NodeState.DRAINING and self.pairs.masters:
            self.hand_off_all(limit=DRAIN_HANDOFFS_AT_ONCE)
        elif self.node_id in self.maintenance and self.pairs.masters and mono >= self._next_maintenance_ms:
            self._next_maintenance_ms = mono + MAINTENANCE_HANDOFF_EVERY_MS
            self.hand_back_in_maintenance()

    def _renew(self, mono: int) -> None:
        leader = self.membership.leader_id()
        if leader is None:
            return
        sequence = self.lease.renewal(mono)
        if leader == self.node_id:
            known = self.membership.cluster_map.nodes.get(self.node_id)
            if self.membership.is_leader() and known is not None \
                    and known.storage_id == self.storage_id:
                self.table.grant(self.node_id, mono)
                # Its own log may hold a failover of its queues decided by a predecessor.
                self._grants_waiting.append((self.membership.version_when_applied(), sequence))
                self._accept_grants()
            return
        self.pairs.send_message(leader, LeaseRenew("", self.storage_id, self.membership.term(), sequence))

    def on_message(self, peer: str, message: Message) -> None:
        if isinstance(message, LeaseRenew):
            known = self.membership.cluster_map.nodes.get(peer)
            # A node on another disk than the map knows gets no lease until that is recorded
            # (it holds none of its queues' data; `incarnation` carries its storage id).
            if self.membership.is_leader() and known is not None and known.storage_id == message.incarnation:
                self.table.grant(peer, self.monotonic_ms())
                self.pairs.send_message(peer, LeaseGrant("", 0, self.membership.term(), message.sequence,
                                                         self.membership.version_when_applied()))
        elif isinstance(message, LeaseGrant):
            self._grants_waiting.append((message.map_version, message.sequence))
            self._accept_grants()
        elif isinstance(message, HandoffOrder):
            entry = self.membership.cluster_map.queues.get(message.queue)
            if entry is not None and entry.master == self.node_id and entry.epoch == message.epoch:
                self.start_handoff(message.queue, "master", None)
        elif isinstance(message, HandoffRequest):
            self._replica_asks(peer, message)
        elif isinstance(message, HandoffAnswer):
            asked = self.asked.pop(message.request_id, None)
            if asked is not None:
                _, finish, deadline = asked
                if message.accepted:
                    self.promised[message.queue] = (finish, deadline)   # answered once the map says so
                    self.map_changed(message.queue)
                else:
                    finish(QueueError(E_HANDOFF_REFUSED, message.reason))

    def _register_self(self) -> None:
        """A node enters the map by proposing itself (once a membership leader exists)."""
        cluster = self.membership.cluster_map
        known = cluster.nodes.get(self.node_id)
        storage_id = self.storage_id
        if (known is not None and known.storage_id == storage_id) or self._registering \
                or self.membership.leader_id() is None:
            return
        self._registering = True

        def done(outcomes: list[Outcome] | None) -> None:
            self._registering = False
        voter = self.node_id in self.config.membership_nodes
        self.membership.propose(AddNode(self.node_id, self.config.own_url, voter, storage_id), done)

    # --- the membership leader's duties ------------------------------------------------------
    def _lead(self, mono: int) -> None:
        term = self.membership.term()
        if self._leader_term != term:
            self._leader_term = term
            self.table.became_leader(mono)       # it cannot know what its predecessor granted
            self.table.grant(self.node_id, mono)
        if mono < self._leader_busy_until_ms:
            return
        cluster = self.membership.cluster_map
        watched = [n for n, e in cluster.nodes.items() if e.state is not NodeState.REMOVED and n != self.node_id]
        lapsed = self.table.lapsed(watched, mono)
        command: Command | None = None
        # Each plan walks the map: only when a node lapsed or drains (issue 31).
        changes, stuck = plan_failover(cluster, lapsed) if lapsed else ([], [])
        if changes:
            command = ChangePairs(tuple(changes))
            granted = {node: mono - self.table.last_grant_ms.get(node, self.table.leader_since_ms or mono)
                       for node in sorted(lapsed)}
            log.warning("failover of %d queue(s) mastered by %s (lease last granted %s ms ago)%s", len(changes),
                        sorted(lapsed), granted,
                        f"; {len(stuck)} stay unavailable (replica not in sync)" if stuck else "")
            self.failovers += len(changes)
        else:
            for node in sorted(lapsed):
                if cluster.nodes[node].state is NodeState.UP:
                    command = SetNodeState(node, NodeState.DOWN.value, NodeState.UP.value)
                    break
            for node, entry in sorted(cluster.nodes.items()):
                if command is None and entry.state is NodeState.DOWN and node not in lapsed \
                        and node in self.table.last_grant_ms:
                    command = SetNodeState(node, NodeState.UP.value, NodeState.DOWN.value)
            if command is None:
                gone = {n for n in lapsed if self.table.lapsed_for_ms(n, mono) > self.replica_replace_after_ms}
                gone |= {n for n, e in cluster.nodes.items() if e.state is NodeState.DRAINING}
                replacements = plan_replacements(cluster, gone) if gone else []
                if replacements:
                    command = ChangePairs(tuple(replacements))
                    log.warning("moving %d replica(s) off %s", len(replacements), sorted(gone))
        if command is not None:
            self._leader_busy_until_ms = mono + LEADER_PROPOSAL_INTERVAL_MS
            self.membership.propose(command, lambda outcomes: None)

    # --- handoff (seed 004 FIG. 23-25) ---------------------------------------------------------
    def handoff(self, queue: str, initiator: str, finish: Finish) -> None:
        """Operator's request at this node, as the given member of the pair."""
        entry = self.membership.cluster_map.queues.get(queue)
        if entry is None:
            finish(QueueError(E_UNKNOWN_QUEUE, f"no queue named {queue!r}"))
            return
        if initiator == "master":
            if queue not in self.pairs.masters:
                finish(QueueError(E_NOT_MASTER, f"queue {queue} is mastered by {entry.master}"))
                return
            self.start_handoff(queue, "master", finish)
            return
        role = self.pairs.replicas.get(queue)
        if role is None:
            finish(QueueError(E_INVALID_OPTION, f"this node is not the replica of {queue} (that is {entry.replica})"))
            return
        request_id = self._next_request
        self._next_request += 1
        self.asked[request_id] = (queue, finish, self.monotonic_ms() + HANDOFF_TIMEOUT_MS)
        self.pairs.send_message(role.master_id, HandoffRequest(queue, role.incarnation, role.epoch, request_id))

    def _replica_asks(self, peer: str, request: HandoffRequest) -> None:
        role = self.pairs.masters.get(request.queue)

        def refuse(reason: str) -> None:
            self.pairs.send_message(peer, HandoffAnswer(request.queue, request.incarnation, request.epoch,
                                                        request.request_id, False, reason))
        if role is None or role.replica_id != peer or role.epoch != request.epoch:
            refuse("the asker is not this queue's replica in the current epoch")
        elif request.queue in self.handoffs:
            refuse("the master's own handoff is in progress (the master's request wins)")
        elif not self.accept_replica_handoffs:
            refuse("the master's node does not accept handoffs asked by replicas (accept_replica_handoffs = false)")
        else:
            self.start_handoff(request.queue, "replica", None, replica_request=(peer, request.request_id))

    def start_handoff(self, queue: str, initiator: str, finish: Finish | None,
                      replica_request: tuple[str, int] | None = None, *, linked: bool = False) -> None:
        """`linked`: refuse at once when the replica's node is not linked to this one (a node
        that stops or drains hands off only to peers it still reaches; an operator's handoff
        waits through a brief break of the link instead)."""
        role = self.pairs.masters.get(queue)
        existing = self.handoffs.get(queue)
        if existing is not None:
            if finish is not None:
                existing.finishes.append(finish)
            if initiator == "master" and existing.replica_request is not None:
                # The replica's request reached this master first, but the master's own request
                # wins whenever it arrives before the swap commits (docs/PROTOCOL.md): the replica
                # is refused, and the handoff goes on as the master's.
                self._answer_replica(queue, existing.replica_request,
                                     "the master's own handoff is in progress (the master's request wins)")
                existing.replica_request, existing.initiator = None, "master"
            return
        now = self.monotonic_ms()
        handoff = Handoff(queue, initiator, now, now + HANDOFF_TIMEOUT_MS, replica_request=replica_request)
        if finish is not None:
            handoff.finishes.append(finish)
        if role is None or not role.recorded_in_sync:
            self.handoffs[queue] = handoff
            self._end_handoff(queue, "the replica is not in sync")
            return
        if not self._may_take_over(role.replica_id, linked=linked):
            # It could not catch up and take the queue: waiting would only hold writes until
            # the handoff's timeout (every node of a stopping cluster waited ~10 s for peers
            # already gone, with no membership majority left to record them down).
            self.handoffs[queue] = handoff
            self._end_handoff(queue, f"the replica's node {role.replica_id} is " + (
                "drained for maintenance (qctl node undrain ends it)" if role.replica_id in self.maintenance
                else "unreachable or not up" if linked else "not up"))
            return
        self.handoffs[queue] = handoff      # from here the master assigns no new index
        self.master_progress(role)

    def _may_take_over(self, node: str, *, linked: bool) -> bool:
        """A node a handoff may go to: up in the map (not draining, down or removed), not in
        maintenance as far as this node knows, and, if asked, linked to this one."""
        entry = self.membership.cluster_map.nodes.get(node)
        return entry is not None and entry.state is NodeState.UP and node not in self.maintenance \
            and (not linked or bool(self.pairs.link_up(node)))

    def parks(self, queue: str) -> bool:
        """Whether commands for `queue` wait: a handoff of it (or of its dead-letter queue's
        queue) is under way."""
        return queue in self.handoffs or base_name(queue) in self.handoffs

    def park(self, queue: str, command: CoreCommand) -> None:
        self.handoffs[queue if queue in self.handoffs else base_name(queue)].parked.append(command)

    def check_handoffs(self) -> None:
        """After a commit or a tick: a handoff whose replica had caught up before this node's
        own copy was durable may commit now."""
        for name in [name for name, handoff in self.handoffs.items() if not handoff.proposed]:
            role = self.pairs.masters.get(name)
            if role is not None:
                self.master_progress(role)

    def master_progress(self, role: MasterRole) -> None:
        """The replica acknowledged more: a handoff waiting for it may now commit."""
        name = role.core.record.dead_letter_of or role.core.name
        handoff = self.handoffs.get(name)
        if handoff is None or handoff.proposed:
            return
        main = self.pairs.masters.get(name)
        dead = self.pairs.masters.get(dead_letter_name(name))
        if main is None or not main.caught_up or (dead is not None and not dead.caught_up):
            return
        entry = self.membership.cluster_map.queues.get(name)
        if entry is None or entry.master != self.node_id or not entry.in_sync:
            self._end_handoff(name, "the map changed first")
            return
        handoff.proposed = True
        change = ChangePair(name, astuple(entry.pair), (entry.epoch + 1, entry.replica, entry.master, True),
                            Reason.HANDOFF.value)

        def decided(outcomes: list[Outcome] | None) -> None:
            def settle(now_ms: int) -> None:
                if outcomes and outcomes[0].applied:
                    return     # it ends when the local copy of the map shows it (map_changed)
                self._end_handoff(name, f"the membership layer did not commit the swap "
                                        f"({outcomes[0].reason if outcomes else 'no answer'})")
            self.scheduler.invoke(settle)
        self.membership.propose(change, decided)

    def map_changed(self, name: str) -> None:
        handoff = self.handoffs.get(name)
        entry = self.membership.cluster_map.queues.get(name)
        promised = self.promised.get(name)
        if promised is not None and entry is not None and entry.master == self.node_id:
            del self.promised[name]
            promised[0](self._handoff_result(name))
        if handoff is None:
            return
        if entry is None:
            self._end_handoff(name, "the queue was deleted")
        elif entry.master != self.node_id:
            # Proposed: the swap (or anything after it) is in the map. Not proposed yet: the
            # master changed under it (a failover while it waited for its replica); the writes
            # it parked go on now, to the new roles, not at its timeout (a chaos run's consumer
            # waited 5 s after the heal for a handoff its node no longer mastered).
            self._end_handoff(name, None if handoff.proposed else "the queue's master changed first")

    def _end_handoff(self, name: str, failure: str | None) -> None:
        handoff = self.handoffs.pop(name, None)
        if handoff is None:
            return
        pause_ms = self.monotonic_ms() - handoff.started_ms
        result: Any = QueueError(E_HANDOFF_REFUSED, failure) if failure else {**self._handoff_result(name),
                                                                                "pause_ms": pause_ms}
        if failure:
            log.info("handoff of %s ended without a swap: %s", name, failure)
        for finish in handoff.finishes:
            finish(result)
        if handoff.replica_request is not None:
            self._answer_replica(name, handoff.replica_request, failure)
        for command in handoff.parked:           # they meet the new roles (a replica relays)
            self.scheduler.resubmit(command)

    def _answer_replica(self, name: str, request: tuple[str, int], failure: str | None) -> None:
        peer, request_id = request
        role = self.pairs.masters.get(name) or self.pairs.replicas.get(name)
        epoch = role.epoch if role is not None else 0
        self.pairs.send_message(peer, HandoffAnswer(name, 0 if role is None else role.incarnation, epoch,
                                                    request_id, failure is None, failure or ""))

    def _handoff_result(self, name: str) -> dict[str, Any]:
        entry = self.membership.cluster_map.queues.get(name)
        if entry is None:
            return {"queue": name}
        return {"queue": name, "master": entry.master, "replica": entry.replica, "epoch": entry.epoch}

    def _handoff_timeouts(self, now_ms: int) -> None:
        for name, handoff in list(self.handoffs.items()):
            if now_ms >= handoff.deadline_ms + (HANDOFF_TIMEOUT_MS if handoff.proposed else 0):
                self._end_handoff(name, "the replica did not catch up in time (" + "; ".join(
                    f"{role.core.name}: {role.progress.value}, it holds {role.replica_durable} of {role.last_order}, "
                    f"durable here {role.local_durable}" for role in filter(None, (
                        self.pairs.masters.get(name), self.pairs.masters.get(dead_letter_name(name))))) + ")")
        for request_id, (_, finish, deadline) in list(self.asked.items()):
            if now_ms >= deadline:
                del self.asked[request_id]
                finish(QueueError(E_TIMEOUT, "the master did not answer the handoff request"))
        for name, (finish, deadline) in list(self.promised.items()):
            if now_ms >= deadline:
                del self.promised[name]
                finish(QueueError(E_TIMEOUT, "the swap was accepted but this node's map has not shown it yet",
                                  outcome_unknown=True))

    # --- operator commands ---------------------------------------------------------------------
    def propose_checked(self, command: Command, finish: Finish, result: Callable[[list[Outcome]], Any]) -> None:
        """Propose and finish with result(outcomes), or E_QUEUE_UNAVAILABLE / the refusal."""
        def decided(outcomes: list[Outcome] | None) -> None:
            def settle(now_ms: int) -> None:
                if outcomes is None:
                    finish(QueueError(E_QUEUE_UNAVAILABLE, "the membership layer did not answer (no majority?)"))
                else:
                    finish(result(outcomes))
            self.scheduler.invoke(settle)
        self.membership.propose(command, decided)

    def rebalance(self) -> list[str]:
        """Hand masters back to spread them evenly: each chosen queue's master node is told to
        hand off (over the peer link; the masters run the handoffs concurrently)."""
        cluster = self.membership.cluster_map
        chosen = [name for name in plan_rebalance(cluster) if cluster.queues[name].replica not in self.maintenance]
        for name in chosen:
            self.order_handoff(name)
        return chosen

    def rebalance_members(self, finish: Finish) -> None:
        """Move replicas onto up nodes that hold fewer members (plan_member_moves), before the
        handoffs of `rebalance`: a node back from a drain holds no member, and no handoff
        reaches it until it does. Finishes with the moves the map applied."""
        changes = plan_member_moves(self.membership.cluster_map)
        if not changes:
            finish([])
            return

        def applied(outcomes: list[Outcome]) -> list[dict[str, str]]:
            return [{"queue": change.name, "from": change.expected[2], "to": change.new[2]}
                    for change, outcome in zip(changes, outcomes, strict=False) if outcome.applied]
        log.info("rebalance: moving %d replica(s) onto nodes that hold fewer members", len(changes))
        self.propose_checked(ChangePairs(tuple(changes)), finish, applied)

    def undrain(self, node_id: str, finish: Finish) -> None:
        """A draining node serves again: up, so handoffs, moves and new queues may reach it.
        A compare-and-set on `draining`: a node removed meanwhile, or set up by another request,
        is left as it is."""
        entry = self.membership.cluster_map.nodes.get(node_id)
        if entry is None:
            known = ", ".join(sorted(self.membership.cluster_map.nodes)) or "none"
            finish(QueueError(E_INVALID_OPTION, f"no node named {node_id!r} in the cluster (nodes: {known})"))
            return
        if entry.state is not NodeState.DRAINING:
            finish(QueueError(E_INVALID_OPTION, f"node {node_id} is {entry.state.value}, not draining: "
                                                + NOT_DRAINING_HINTS[entry.state]))
            return
        command = SetNodeState(node_id, NodeState.UP.value, NodeState.DRAINING.value)

        def result(outcomes: list[Outcome]) -> Any:
            if not outcomes[0].applied:
                return QueueError(E_INVALID_OPTION, f"node {node_id} was not set up: {outcomes[0].reason}")
            return {"node": node_id, "state": NodeState.UP.value, "done": True}
        self.propose_checked(command, finish, result)

    def order_handoff(self, name: str) -> None:
        entry = self.membership.cluster_map.queues.get(name)
        if entry is None:
            return
        if entry.master == self.node_id:
            self.start_handoff(name, "master", None)
        else:
            self.pairs.send_message(entry.master, HandoffOrder(name, entry.incarnation, entry.epoch))

    def hand_off_all(self, limit: int | None = None) -> int:
        """Start a handoff of every queue mastered here (draining, SIGTERM); returns how many
        are in progress. `limit` bounds how many run at once."""
        for name in sorted(self.pairs.masters):
            if limit is not None and len(self.handoffs) >= limit:
                break
            core = self.instances.cores.get(name)
            if core is None or core.record.dead_letter_of is not None or name in self.handoffs:
                continue
            self.start_handoff(name, "master", None, linked=True)
        return len(self.handoffs)

    # --- maintenance drain (docs/OPERATIONS.md, "Rolling upgrade") ------------------------------
    def hand_back_in_maintenance(self) -> int:
        """This node is in maintenance and masters queues (a failover or a 0.1.0 node's handoff
        put them here): hand each back once its replica is in sync on a node that may take it.
        Those that may not yet wait for the next try (no handoff is started only to fail)."""
        started = 0
        for name, role in sorted(self.pairs.masters.items()):
            core = self.instances.cores.get(name)
            if core is None or core.record.dead_letter_of is not None or name in self.handoffs \
                    or not role.recorded_in_sync or not self._may_take_over(role.replica_id, linked=True):
                continue
            self.start_handoff(name, "master", None, linked=True)
            started += 1
        return started

    def drain_refusals(self, node_id: str) -> list[str]:
        """Why draining `node_id` for maintenance and stopping it would leave a queue without an
        in-sync copy (replication/drain_check.py), on this node's map and maintenance marks."""
        cluster = self.membership.cluster_map
        up = {node for node, entry in cluster.nodes.items() if entry.state is NodeState.UP}
        pairs = (PairView(name, entry.master, entry.replica, entry.in_sync) for name, entry in cluster.queues.items())
        return drain_refusals(node_id, pairs, up, self.maintenance)

    def masters_of(self, node_id: str) -> list[str]:
        """The queues the map names `node_id` master of (a dead-letter queue goes with its queue)."""
        return sorted(name for name, entry in self.membership.cluster_map.queues.items() if entry.master == node_id)

    def status(self) -> dict[str, Any]:
        cluster = self.membership.cluster_map.to_json()
        return {**cluster, "node": self.node_id, "leader": self.membership.leader_id(),
                "term": self.membership.term(), "lease_remaining_ms": self.lease.remaining_ms(self.monotonic_ms()),
                "failovers_proposed": self.failovers, "membership": self.membership.status()}

