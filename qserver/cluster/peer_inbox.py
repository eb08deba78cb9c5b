"""Replication messages from peers: decoded, handed to the coordinator (leases, handoffs), to the
core (a master's Create and Delete of a replica instance), or to the queue's role; and those of
an epoch this node has not acted on yet kept until its roles follow the map.

Separate from the pair driver because it is the routing of one inbound stream (docs/PROTOCOL.md,
"Replication messages"); the driver owns the roles it routes to (`RoleDirectory`).
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from qserver.cluster.master_effects import MasterEffects
from qserver.cluster.replica_effects import ReplicaEffects
from qserver.cluster.view import ClusterView
from qserver.core.ports import Instances, Scheduler
from replication.master import MasterRole
from replication.messages import (
    Create,
    Delete,
    HandoffAnswer,
    HandoffOrder,
    HandoffRequest,
    LeaseGrant,
    LeaseRenew,
    Message,
    MessageError,
    decode_message,
    encode_message,
)
from replication.options import dead_letter_name
from replication.replica import ReplicaRole

if TYPE_CHECKING:
    from qserver.cluster.coordinator import Coordinator

log = logging.getLogger("qserver.cluster.pairs")
EARLY_MESSAGES_MAX = 10_000     # per queue; beyond it the protocol's resends recover


class RoleDirectory(Protocol):
    """The roles this node holds, as the pair driver keeps them."""

    @property
    def masters(self) -> Mapping[str, MasterRole]:
        ...

    @property
    def replicas(self) -> Mapping[str, ReplicaRole]:
        ...

    @property
    def coordinator(self) -> Coordinator | None:
        ...

    def may_open(self, replica: ReplicaRole) -> bool:
        ...

    def flush(self, role: MasterRole | ReplicaRole) -> None:
        ...


class PeerInbox:
    def __init__(self, roles: RoleDirectory, view: ClusterView, instances: Instances, scheduler: Scheduler,
                 masters: MasterEffects, replicas: ReplicaEffects) -> None:
        self.roles = roles
        self.view = view
        self.instances = instances
        self.scheduler = scheduler
        self.master_effects = masters
        self.replica_effects = replicas
        # Peer messages of an epoch this node's map does not know yet (see ahead_of_map).
        self.early: dict[str, collections.deque[tuple[str, bytes]]] = {}

    def receive(self, peer: str, data: bytes, mono_ms: int) -> None:
        try:
            message = decode_message(data)
        except MessageError as error:
            log.warning("bad replication message from %s: %s", peer, error)
            return
        coordinator = self.roles.coordinator
        if isinstance(message, (LeaseRenew, LeaseGrant, HandoffRequest, HandoffAnswer, HandoffOrder)):
            if coordinator is not None:
                coordinator.on_message(peer, message)
            return
        if isinstance(message, Create) and self.ahead_of_map(peer, message):
            return      # e.g. a move to this node that this node's map has not applied yet
        if isinstance(message, Create):
            entry = self.view.entry(message.queue)
            if entry is not None and (entry.replica != self.view.node_id or entry.master != peer):
                return      # a stale announcement: the map says otherwise
            self.instances.hold_replica_instance(message.queue, message.incarnation, message.record)
            role = self.roles.replicas.get(message.queue)
            if role is not None and role.phase.value == "opening" and self.roles.may_open(role):
                role.start(mono_ms)
                self.roles.flush(role)
            return
        if isinstance(message, Delete):
            self.instances.drop_replica_instance(message.queue, message.incarnation)
            return
        if self.ahead_of_map(peer, message):
            return
        master = self.roles.masters.get(message.queue)
        if master is not None and master.incarnation == message.incarnation:
            master.receive(message, mono_ms)
            self.master_effects.drain(master)
            if coordinator is not None:
                coordinator.master_progress(master)
            return
        replica = self.roles.replicas.get(message.queue)
        if replica is not None and replica.incarnation == message.incarnation:
            replica.receive(message, mono_ms)
            self.replica_effects.drain(replica)

    def ahead_of_map(self, peer: str, message: Message) -> bool:
        """A message from a newer epoch than this node has acted on (the peer applied a
        handoff or failover first) waits until this node has taken its role in that epoch:
        delivered now, it would fence the role this node is about to leave and be lost. The
        node's copy of the map is not enough: it changes as soon as the membership layer
        applies a command, and the roles follow when the core's task gets to it (a RelayRequest
        that arrived in between reached the old, fenced replica and was never answered)."""
        entry = self.view.entry(message.queue)
        if entry is None:
            return False
        role = self.roles.masters.get(message.queue) or self.roles.replicas.get(message.queue)
        acted_on = entry.epoch if role is None else min(entry.epoch, role.epoch)
        if message.epoch <= acted_on:
            return False
        waiting = self.early.setdefault(message.queue, collections.deque())
        if len(waiting) < EARLY_MESSAGES_MAX:
            waiting.append((peer, encode_message(message)))
        return True

    def replay_early(self, name: str) -> None:
        """The roles of queue `name` follow the map now: the messages kept for them go in."""
        for queue in (name, dead_letter_name(name)):
            waiting = self.early.pop(queue, None)
            entry = self.view.entry(queue)
            while waiting and entry is not None:
                peer, data = waiting.popleft()
                self.receive(peer, data, self.scheduler.monotonic_ms())
