"""The cluster map's vocabulary: its entries (nodes, queues and their pairs, macro queues,
channels, recipients, forwards), their enums and the limits on them.

Apart from `replication/cluster_map.py` (the map and its `apply`) so that the commands, the
placement decisions and the many readers of an entry (the node's APIs, features, chaos) name
these types without the state machine. Pure data: no clock, no I/O.
"""
from __future__ import annotations

import copy
import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class NodeState(enum.StrEnum):
    UP = "up"
    DRAINING = "draining"      # hands off its masters and moves its replicas away; takes none
    DOWN = "down"              # its lease lapsed (set by the membership leader)
    REMOVED = "removed"        # gone for good; may not rejoin under the same id


class Reason(enum.StrEnum):
    """Why a pair changed; the journals record it and the audit reads it."""
    CREATE = "create"
    HANDOFF = "handoff"
    FAILOVER = "failover"
    UNCLEAN = "unclean"        # `qctl promote --unclean`: a replica not known to be in sync
    MOVE = "move"
    IN_SYNC = "in_sync"        # an in-sync flip (no change of epoch)
    RESTARTED_MASTER = "restarted_master"   # the same members in a new epoch (docs/PROTOCOL.md)
    REBALANCE = "rebalance"


@dataclass(frozen=True, slots=True)
class PairState:
    epoch: int
    master: str
    replica: str
    in_sync: bool


@dataclass(slots=True)
class NodeEntry:
    node_id: str
    url: str
    state: NodeState = NodeState.UP
    voter: bool = True
    storage_id: int = 0      # which disk it runs on: another one means it lost its data


@dataclass(slots=True)
class QueueEntry:
    name: str
    options: dict[str, Any]
    master: str
    replica: str
    epoch: int
    in_sync: bool
    incarnation: int
    unclean_promotions: int = 0
    last_reason: str = Reason.CREATE.value

    @property
    def pair(self) -> PairState:
        return PairState(self.epoch, self.master, self.replica, self.in_sync)

    def to_json(self) -> dict[str, Any]:
        # What dataclasses.asdict gave (the same keys, in order, and a copy of the options),
        # without its recursive walk: /v1/cluster describes every queue of the map.
        return {"name": self.name, "options": _copied(self.options), "master": self.master, "replica": self.replica,
                "epoch": self.epoch, "in_sync": self.in_sync, "incarnation": self.incarnation,
                "unclean_promotions": self.unclean_promotions, "last_reason": self.last_reason}


def _copied(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of a queue's options that shares no container with them (options are flat
    scalars; a nested value, from some older writer, is copied deeply as asdict did)."""
    return {key: copy.deepcopy(value) if isinstance(value, (dict, list, tuple)) else value
            for key, value in options.items()}


class ProducerPolicy(enum.StrEnum):
    """Which member(s) an enqueue on a macro queue goes to (seed 004 SetProducerOptions)."""
    ALL = "all"                          # a copy to every member
    ROUND_ROBIN = "round_robin"          # the members in turn, `weight` turns each per cycle
    FIRST_AVAILABLE = "first_available"  # the first member, in member order, that takes it
    FASTEST = "fastest"                  # by `fastest_by`


class ConsumerPolicy(enum.StrEnum):
    """Which member a receive on a macro queue leases from (seed 004 SetConsumerOptions)."""
    PRIORITIZED = "prioritized"          # the highest-priority member that has a message
    CHRONOLOGICAL = "chronological"      # the member whose head was enqueued first
    ROUND_ROBIN = "round_robin"          # the members in turn, skipping empty ones
    # The highest-priority ready message of any member, the oldest first among equals. Release
    # 0.1.0 refuses this value, so a node proposes it only at cluster feature level 2
    # (wire/versions.py FEATURES, qserver/features/macro/api.py).
    HIGHEST_PRIORITY = "highest_priority"


class FastestBy(enum.StrEnum):
    """What `fastest` compares (seed 004: response time, number queued, average service time)."""
    RESPONSE_TIME = "response_time"
    QUEUE_LENGTH = "queue_length"
    SERVICE_TIME = "service_time"


MACRO_MEMBERS_MAX = 64
MACRO_MEMBER_WEIGHT_MAX = 100


@dataclass(slots=True)
class MacroMember:
    queue: str
    priority: int = 0       # prioritized consumer policy: the highest drains first (0-9)
    weight: int = 1         # round_robin producer policy: turns per cycle (1-100)


@dataclass(slots=True)
class MacroEntry:
    """A macro queue: routing only. It holds no message; every message lives in a member."""
    name: str
    producer: str
    consumer: str
    fastest_by: str
    members: list[MacroMember] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "producer": self.producer, "consumer": self.consumer,
                "fastest_by": self.fastest_by, "members": [asdict(member) for member in self.members]}

    def member(self, queue: str) -> MacroMember | None:
        return next((member for member in self.members if member.queue == queue), None)


class DeliveryClass(enum.StrEnum):
    """A channel's delivery class (seed 002 UDP / UDP_ACK / UDP_ACK_RETRY, in our terms)."""
    LATEST = "latest"        # best effort: the last value on subscribe, then each new one; no backlog
    ACKED = "acked"          # each subscriber acknowledges; what is not acknowledged is reported, not resent
    DURABLE = "durable"      # a replicated backlog per durable subscriber, resent until acknowledged


RECIPIENTS_MAX = 10_000          # named push consumers in the map (fault surveillance)
RECIPIENTS_PER_CLIENT_MAX = 100  # of them, names one client may bind by subscribing
FORWARDS_MAX = 256               # forwards in the map (store-and-forward, seed 003)
# Clients removed from the map, remembered (by id, with the map version that removed them) so
# that a node catching up by a snapshot removes them too: a snapshot holds the clients that
# exist, and a node that missed the removal would otherwise keep a revoked key (issue 32).
# Client ids are random and never reused; the oldest are forgotten beyond this many.
REVOKED_CLIENTS_MAX = 100_000
CHANNEL_PREFIX = "channel:"      # a channel's messages live in the queue `channel:<name>` (its pair)
CHANNEL_RESEND_MAX_S = 86_400


def channel_queue(channel: str) -> str:
    return CHANNEL_PREFIX + channel


@dataclass(slots=True)
class ChannelEntry:
    """A publish/subscribe channel (seed 002). Its last values live in the queue
    `channel:<name>`, an ordinary `full` pair created and deleted with it: the channel's master
    is that queue's master, where publishes are ordered and subscribers are served."""
    name: str
    delivery_class: str
    resend_interval_s: float = 0.0      # `latest`: the last value is sent again after this long without a publish
    # What its data is like and how subscribing behaves (replication/map_channels.py ATTRIBUTES;
    # only those that differ from 0/false; set at cluster feature level 3).
    attributes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "class": self.delivery_class, "resend_interval_s": self.resend_interval_s,
                "queue": channel_queue(self.name), "attributes": dict(self.attributes)}


CHANNEL_QUEUE_OPTIONS = {"strength": "full", "dead_letter": False, "type": "queued_ack", "max_depth": 100_000}


class RecipientState(enum.StrEnum):
    """Fault surveillance (seed 001): a recipient takes its messages (ok), took none for its
    queue's fault interval while some waited (fault: its messages fail over), or stayed in
    fault for the defunct interval (defunct: its subscriptions were ended)."""
    OK = "ok"
    FAULT = "fault"
    DEFUNCT = "defunct"


@dataclass(slots=True)
class RecipientEntry:
    """A named push consumer of a queue (qserver/features/surveillance/watch.py) and its state, which every
    node knows and which outlives a failover of the queue's master."""
    name: str
    queue: str
    state: str = RecipientState.OK.value
    since_ms: int = 0
    reason: str = ""
    owner: str = ""          # the client that bound the name by subscribing ("": an administrator's chain)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "queue": self.queue, "state": self.state, "since_ms": self.since_ms,
                "reason": self.reason, "owner": self.owner}


@dataclass(slots=True)
class ForwardEntry:
    """A forward (seed 003 store-and-forward; qserver/features/forwards/forwarder.py): the master of `source`
    moves its messages into `destination`, a queue of the cluster at `urls` (none: this
    cluster), signed as `client_id` there. The secret stays in the map (like the clients'
    secrets): it is never shown."""
    name: str
    source: str
    destination: str
    urls: tuple[str, ...] = ()
    client_id: str = ""
    # Sealed with the cluster secret (qserver/features/forwards/forwarder.py seal_secret); never in a repr.
    secret: str = field(default="", repr=False)
    created_ms: int = 0
    token: str = ""          # random, made at creation: with the name, unique across clusters
    # Its own fill bands, weights and fill unit (seed 003 figure 6; qserver/features/forwards/decide.py
    # checked_control). Empty: the root's uniform bands. Set only at feature level 3 (0.2.0 cannot read it).
    control: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> str:
        """What the destination knows the forward by (its session, its streams' keys): forwards
        of several clusters into one root may share a name, never this."""
        return f"{self.name}.{self.token}" if self.token else self.name

    def to_json(self) -> dict[str, Any]:
        shown = {"name": self.name, "id": self.identity, "source": self.source, "destination": self.destination,
                 "urls": list(self.urls), "client_id": self.client_id, "created_ms": self.created_ms}
        if self.control:
            shown["control"] = dict(self.control)
        return shown


def macro_policy_problem(producer: str, consumer: str, fastest_by: str) -> str:
    for value, kind in ((producer, ProducerPolicy), (consumer, ConsumerPolicy), (fastest_by, FastestBy)):
        allowed = [member.value for member in kind]
        if value not in allowed:
            return f"{value!r} is not one of {', '.join(allowed)}"
    return ""


def astuple(pair: PairState) -> tuple[int, str, str, bool]:
    return (pair.epoch, pair.master, pair.replica, pair.in_sync)
