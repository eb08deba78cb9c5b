"""The cluster map: what the membership layer replicates (DESIGN.md 4.2), as a pure state machine.

Every node holds a copy; the membership layer (a Raft core driven by `qserver/cluster/membership.py`, an
in-memory twin in the simulations) applies the same commands in the same order to each copy,
so `apply` must be deterministic: no clock, no randomness, no I/O. Reads are local.

Writes are rare commands: creating or deleting a queue, node state changes, client records,
changes of a queue's pair, and the definitions of macro queues (one name over member queues,
seed 004; each member stays an ordinary queue with its own pair). A pair change is a compare-and-set: it names the
(epoch, master, replica, in_sync) it expects and is refused when applied against anything
else, so a late or repeated proposal never undoes a newer one (DESIGN.md 4.1). A change of
master or replica raises the epoch by exactly one; an in-sync flip keeps it.

The module also holds the pure decisions the membership leader and the nodes make from the
map: placement of a new queue, the failover plan for nodes whose lease lapsed, the moves
that replace a long-lost replica, and the handoffs that spread masters evenly.
"""
from __future__ import annotations

import bisect
import copy
import enum
import heapq
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack


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

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "class": self.delivery_class, "resend_interval_s": self.resend_interval_s,
                "queue": channel_queue(self.name)}


CHANNEL_QUEUE_OPTIONS = {"strength": "full", "dead_letter": False, "type": "queued_ack", "max_depth": 100_000}


# --- commands --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddNode:
    """A node enters the map, or comes back with another disk (`storage_id`): then it holds
    none of its queues' data, so it is recorded out of sync wherever it is the replica, and
    its in-sync replicas take over wherever it was the master."""
    TAG = 1
    node_id: str
    url: str
    voter: bool = True
    storage_id: int = 0


@dataclass(frozen=True, slots=True)
class SetNodeState:
    TAG = 2
    node_id: str
    state: str
    expected: str | None = None       # compare-and-set on the current state when given


@dataclass(frozen=True, slots=True)
class CreateQueue:
    TAG = 3
    name: str
    options: dict[str, Any]
    master: str
    replica: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    TAG = 4
    name: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class ChangePair:
    """Compare-and-set of one queue's pair. Several in one command (a failover of every queue
    of a dead node) are applied one by one, each on its own expectation."""
    TAG = 5
    name: str
    expected: tuple[int, str, str, bool]      # PairState fields: epoch, master, replica, in_sync
    new: tuple[int, str, str, bool]
    reason: str


@dataclass(frozen=True, slots=True)
class ChangePairs:
    TAG = 6
    changes: tuple[ChangePair, ...]


@dataclass(frozen=True, slots=True)
class PutClient:
    TAG = 7
    client_id: str
    record: dict[str, Any] | None       # None removes it


ALTERNATIVES_MAX = 16


@dataclass(frozen=True, slots=True)
class SetAlternatives:
    """Alternative recipients of a push recipient, an ordered chain (seed 001 fault
    surveillance: a recipient in the fault state has its messages tried at each in turn).
    The administrator names the queue of each alternative (`queues`, one for one): a move goes
    into that queue and no other, and the chain binds each alternative's name to its queue, so
    a client that took the name first cannot have the messages moved to a queue of its own.
    `set_by`: the administrator's client id; a move needs its `post` grant on the queue."""
    TAG = 8
    recipient: str
    alternatives: tuple[str, ...]
    queues: tuple[str, ...] = ()
    set_by: str = ""


@dataclass(frozen=True, slots=True)
class CreateMacro:
    """Define a macro queue; again with the same policies it is a no-op, with others refused."""
    TAG = 9
    name: str
    producer: str
    consumer: str
    fastest_by: str = FastestBy.RESPONSE_TIME.value


@dataclass(frozen=True, slots=True)
class DeleteMacro:
    """Forget a macro queue; its members and their messages stay as they are."""
    TAG = 10
    name: str


@dataclass(frozen=True, slots=True)
class PutMacroMember:
    """Add a member queue to a macro queue, or set a member's priority and weight."""
    TAG = 11
    name: str
    queue: str
    priority: int = 0
    weight: int = 1


@dataclass(frozen=True, slots=True)
class RemoveMacroMember:
    TAG = 12
    name: str
    queue: str


@dataclass(frozen=True, slots=True)
class PutChannel:
    """Create a channel (with its queue, on the nodes the proposer chose) or change its delivery
    class and resend interval (a change applies from the next publish)."""
    TAG = 13
    name: str
    delivery_class: str
    resend_interval_s: float
    master: str
    replica: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class DeleteChannel:
    """Forget a channel and delete its queue."""
    TAG = 14
    name: str


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


@dataclass(frozen=True, slots=True)
class PutRecipient:
    """Register a recipient of `queue`, or change its state (fault surveillance). A recipient
    receives from one queue: naming another is refused."""
    TAG = 15
    name: str
    queue: str
    state: str
    since_ms: int
    reason: str = ""
    owner: str = ""          # the subscribing client, when this binds a new name (see RecipientEntry)


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

    @property
    def identity(self) -> str:
        """What the destination knows the forward by (its session, its streams' keys): forwards
        of several clusters into one root may share a name, never this."""
        return f"{self.name}.{self.token}" if self.token else self.name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.identity, "source": self.source, "destination": self.destination,
                "urls": list(self.urls), "client_id": self.client_id, "created_ms": self.created_ms}


@dataclass(frozen=True, slots=True)
class PutForward:
    """Create a forward (its source must be a `full` queue of this cluster: under `producer`
    a replica's copy of a message would never be forwarded); one per source queue."""
    TAG = 16
    name: str
    source: str
    destination: str
    urls: tuple[str, ...]
    client_id: str
    secret: str = field(repr=False)      # sealed (qserver/features/forwards/forwarder.py seal_secret); never in a repr
    created_ms: int
    token: str = ""


@dataclass(frozen=True, slots=True)
class DeleteForward:
    TAG = 17
    name: str


@dataclass(frozen=True, slots=True)
class RemoveRecipient:
    """Forget a recipient (fault surveillance): its state and its own chain of alternatives.
    Chains of other recipients that name it keep the name, as they may name recipients that
    never subscribed; a process still consuming under it is registered again by its next
    subscription or fault."""
    TAG = 18
    name: str


@dataclass(frozen=True, slots=True)
class NoteRecipient:
    """Restate why a recipient is in its state, the state and `since_ms` kept: its queue's
    master does when what made it so no longer holds (a purge emptied the queue of a recipient
    in fault). A compare-and-set on the state and since: a note about an earlier spell is refused."""
    TAG = 19
    name: str
    queue: str
    state: str
    since_ms: int
    reason: str


Command = (AddNode | SetNodeState | CreateQueue | DeleteQueue | ChangePair | ChangePairs | PutClient | SetAlternatives
           | CreateMacro | DeleteMacro | PutMacroMember | RemoveMacroMember | PutChannel | DeleteChannel | PutRecipient
           | PutForward | DeleteForward | RemoveRecipient | NoteRecipient)
COMMAND_TYPES: dict[int, type] = {kind.TAG: kind for kind in (AddNode, SetNodeState, CreateQueue, DeleteQueue,
                                                              ChangePair, ChangePairs, PutClient, SetAlternatives,
                                                              CreateMacro, DeleteMacro, PutMacroMember,
                                                              RemoveMacroMember, PutChannel, DeleteChannel,
                                                              PutRecipient, PutForward, DeleteForward,
                                                              RemoveRecipient, NoteRecipient)}


class CommandError(ValueError):
    """Bytes that are not a well-formed map command."""


def encode_command(command: Command) -> bytes:
    """Commands travel as msgpack (the membership library pickles only this byte string)."""
    return msgpack.packb(_row(command), use_bin_type=True)


def _row(command: Command) -> list[Any]:
    if isinstance(command, ChangePairs):
        return [command.TAG, [_row(change) for change in command.changes]]
    if isinstance(command, ChangePair):
        return [command.TAG, command.name, list(command.expected), list(command.new), command.reason]
    if isinstance(command, SetAlternatives):
        return [command.TAG, command.recipient, list(command.alternatives), list(command.queues), command.set_by]
    if isinstance(command, PutForward):
        return [command.TAG, command.name, command.source, command.destination, list(command.urls),
                command.client_id, command.secret, command.created_ms, command.token]
    return [command.TAG, *(getattr(command, name) for name in command.__dataclass_fields__)]


def decode_command(data: bytes) -> Command:
    try:
        row = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise CommandError(f"not msgpack: {type(exc).__name__}") from None
    return _from_row(row)


def _from_row(row: Any) -> Command:
    if not isinstance(row, list) or not row or row[0] not in COMMAND_TYPES:
        raise CommandError("a command is [tag, fields...]")
    tag, values = row[0], row[1:]
    try:
        if tag == ChangePairs.TAG:
            return ChangePairs(tuple(_from_row(change) for change in values[0]))  # type: ignore[misc]
        if tag == ChangePair.TAG:
            name, expected, new, reason = values
            return ChangePair(name, tuple(expected), tuple(new), reason)  # type: ignore[arg-type]
        if tag == SetAlternatives.TAG:
            recipient, names, *rest = values     # a chain from before queues were named has none
            return SetAlternatives(recipient, tuple(names), tuple(rest[0]) if rest else (), *rest[1:])
        if tag == PutForward.TAG:
            name, source, destination, urls, *rest = values
            return PutForward(name, source, destination, tuple(urls), *rest)
        return COMMAND_TYPES[tag](*values)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise CommandError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What applying one command (or one change of a batch) did."""
    name: str
    applied: bool
    reason: str = ""


# --- the map ---------------------------------------------------------------------------------
SUMMARY_NAMES_MAX = 100      # names a summary of the map lists (out-of-sync queues, recipients not ok)


def _add(index: dict[str, set[str]], key: str, name: str) -> None:
    index.setdefault(key, set()).add(name)


def _discard(index: dict[str, set[str]], key: str, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]


class MapIndex:
    """What the map's dicts imply, kept by `ClusterMap.apply` in step with them, so that one
    command costs what it changes and not the size of the map (issue 31): the queues each node
    masters and replicates (placement, failover and move plans, a node's removal), the queue
    names in order (paged listings), and the recipients, macros and forwards that name each
    queue (what a deleted queue takes with it). Derived, never encoded: a decoded or
    constructed map builds its own (`rebuilt` is the reference the tests compare with)."""
    __slots__ = ("mastered", "replicated", "names", "out_of_sync", "recipients_of", "not_ok", "macros_of",
                 "forwards_of")

    def __init__(self) -> None:
        self.mastered: dict[str, set[str]] = {}      # node -> queues it masters
        self.replicated: dict[str, set[str]] = {}    # node -> queues it is the replica of
        self.names: list[str] = []                   # every queue name, sorted
        self.out_of_sync: set[str] = set()           # queues whose replica is not in sync
        self.recipients_of: dict[str, set[str]] = {}     # queue -> recipients of it
        self.not_ok: set[str] = set()                    # recipients in fault or defunct
        self.macros_of: dict[str, set[str]] = {}         # queue -> macro queues it is a member of
        self.forwards_of: dict[str, set[str]] = {}       # source queue -> forwards of it

    @classmethod
    def rebuilt(cls, cluster: ClusterMap) -> MapIndex:
        index = cls()
        for entry in cluster.queues.values():
            _add(index.mastered, entry.master, entry.name)
            _add(index.replicated, entry.replica, entry.name)
        index.names = sorted(cluster.queues)
        index.out_of_sync = {entry.name for entry in cluster.queues.values() if not entry.in_sync}
        for recipient in cluster.recipients.values():
            _add(index.recipients_of, recipient.queue, recipient.name)
        index.not_ok = {r.name for r in cluster.recipients.values() if r.state != RecipientState.OK.value}
        for macro in cluster.macros.values():
            for member in macro.members:
                _add(index.macros_of, member.queue, macro.name)
        for forward in cluster.forwards.values():
            _add(index.forwards_of, forward.source, forward.name)
        return index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MapIndex) and all(getattr(self, name) == getattr(other, name)
                                                   for name in self.__slots__)

    def added(self, entry: QueueEntry) -> None:
        _add(self.mastered, entry.master, entry.name)
        _add(self.replicated, entry.replica, entry.name)
        bisect.insort(self.names, entry.name)
        self.synced(entry)

    def removed(self, entry: QueueEntry) -> None:
        _discard(self.mastered, entry.master, entry.name)
        _discard(self.replicated, entry.replica, entry.name)
        self.out_of_sync.discard(entry.name)
        position = bisect.bisect_left(self.names, entry.name)
        if position < len(self.names) and self.names[position] == entry.name:
            del self.names[position]

    def moved(self, name: str, before: tuple[str, str], after: tuple[str, str]) -> None:
        """The queue's (master, replica) changed from `before` to `after`."""
        if before[0] != after[0]:
            _discard(self.mastered, before[0], name)
            _add(self.mastered, after[0], name)
        if before[1] != after[1]:
            _discard(self.replicated, before[1], name)
            _add(self.replicated, after[1], name)

    def synced(self, entry: QueueEntry) -> None:
        """The queue's in-sync flag may have changed."""
        if entry.in_sync:
            self.out_of_sync.discard(entry.name)
        else:
            self.out_of_sync.add(entry.name)

    def recipient_put(self, entry: RecipientEntry) -> None:
        _add(self.recipients_of, entry.queue, entry.name)
        if entry.state == RecipientState.OK.value:
            self.not_ok.discard(entry.name)
        else:
            self.not_ok.add(entry.name)

    def recipient_gone(self, entry: RecipientEntry) -> None:
        _discard(self.recipients_of, entry.queue, entry.name)
        self.not_ok.discard(entry.name)

    def holding(self, nodes: Iterable[str], *, masters: bool = True, replicas: bool = True) -> list[str]:
        """The queues of which any of `nodes` is a member (the master, the replica, or
        either), sorted by name."""
        found: set[str] = set()
        for node in nodes:
            if masters:
                found |= self.mastered.get(node, set())
            if replicas:
                found |= self.replicated.get(node, set())
        return sorted(found)


@dataclass
class ClusterMap:
    """The map. Change it only through `apply` (and build it whole, or decode it): the index
    follows what `apply` does, not what other code might write into the dicts."""
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    queues: dict[str, QueueEntry] = field(default_factory=dict)
    clients: dict[str, dict[str, Any]] = field(default_factory=dict)
    alternatives: dict[str, tuple[str, ...]] = field(default_factory=dict)
    alternative_queues: dict[str, tuple[str, ...]] = field(default_factory=dict)   # one for one with the names
    alternatives_set_by: dict[str, str] = field(default_factory=dict)
    recipients: dict[str, RecipientEntry] = field(default_factory=dict)
    macros: dict[str, MacroEntry] = field(default_factory=dict)
    channels: dict[str, ChannelEntry] = field(default_factory=dict)
    forwards: dict[str, ForwardEntry] = field(default_factory=dict)
    revoked_clients: dict[str, int] = field(default_factory=dict)   # client id -> version that removed it
    version: int = 0          # commands applied; every copy agrees at the same version
    index: MapIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.index = MapIndex.rebuilt(self)

    def copy(self) -> ClusterMap:
        return copy.deepcopy(self)

    # --- reads ----------------------------------------------------------------------------
    def live_nodes(self) -> list[str]:
        """Nodes that may take new members: up (not draining, down or removed)."""
        return sorted(n for n, entry in self.nodes.items() if entry.state is NodeState.UP)

    def masters_per_node(self) -> dict[str, int]:
        return {node: len(self.index.mastered.get(node, ())) for node in self.live_nodes()}

    def members_per_node(self) -> dict[str, int]:
        index = self.index
        return {node: len(index.mastered.get(node, ())) + len(index.replicated.get(node, ()))
                for node in self.live_nodes()}

    def queue_names(self) -> list[str]:
        """Every queue's name, sorted: the index's own list, to read (bisect it for a page)."""
        return self.index.names

    def summary(self) -> dict[str, Any]:
        """Counts instead of entries, at the cost of the nodes (GET /v1/cluster?summary=1):
        each node with the queues it masters and replicates, and the map's sizes."""
        index = self.index
        return {"version": self.version,
                "nodes": [{"id": n.node_id, "url": n.url, "state": n.state.value, "voter": n.voter,
                           "masters": len(index.mastered.get(n.node_id, ())),
                           "replicas": len(index.replicated.get(n.node_id, ()))}
                          for n in sorted(self.nodes.values(), key=lambda n: n.node_id)],
                "counts": {"queues": len(self.queues), "out_of_sync": len(index.out_of_sync),
                           "macros": len(self.macros), "channels": len(self.channels),
                           "recipients": len(self.recipients), "recipients_not_ok": len(index.not_ok),
                           "forwards": len(self.forwards)},
                # The first few by name (the whole lists: GET /v1/queues, GET /v1/recipients).
                "out_of_sync": heapq.nsmallest(SUMMARY_NAMES_MAX, index.out_of_sync),
                "recipients_not_ok": heapq.nsmallest(SUMMARY_NAMES_MAX, index.not_ok)}

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version,
                "nodes": [{"id": n.node_id, "url": n.url, "state": n.state.value, "voter": n.voter}
                          for n in sorted(self.nodes.values(), key=lambda n: n.node_id)],
                "queues": {name: entry.to_json() for name, entry in sorted(self.queues.items())},
                "macros": {name: entry.to_json() for name, entry in sorted(self.macros.items())},
                "alternatives": {name: list(chain) for name, chain in sorted(self.alternatives.items())},
                "recipients": {name: entry.to_json() for name, entry in sorted(self.recipients.items())},
                "channels": {name: entry.to_json() for name, entry in sorted(self.channels.items())},
                "forwards": {name: entry.to_json() for name, entry in sorted(self.forwards.items())}}

    # --- the state machine ----------------------------------------------------------------
    def apply(self, command: Command) -> list[Outcome]:
        self.version += 1
        if isinstance(command, ChangePairs):
            return [self._change_pair(change) for change in command.changes]
        if isinstance(command, ChangePair):
            return [self._change_pair(command)]
        if isinstance(command, CreateQueue):
            return [self._create(command)]
        if isinstance(command, DeleteQueue):
            entry = self.queues.get(command.name)
            if entry is None or entry.incarnation != command.incarnation:
                return [Outcome(command.name, False, "no such incarnation")]
            del self.queues[command.name]
            index = self.index
            index.removed(entry)
            for macro_name in index.macros_of.pop(command.name, ()):    # no macro's member any more
                macro = self.macros[macro_name]
                macro.members = [member for member in macro.members if member.queue != command.name]
            for recipient in index.recipients_of.get(command.name, set()).copy():     # nor has it recipients
                index.recipient_gone(self.recipients.pop(recipient))
            for forward in index.forwards_of.pop(command.name, ()):   # nor is it forwarded
                del self.forwards[forward]
            return [Outcome(command.name, True)]
        if isinstance(command, AddNode):
            existing = self.nodes.get(command.node_id)
            if existing is not None and existing.state is NodeState.REMOVED:
                return [Outcome(command.node_id, False, "a removed node id is never reused")]
            if existing is not None:
                existing.url = command.url
                if command.storage_id and existing.storage_id and command.storage_id != existing.storage_id:
                    existing.storage_id = command.storage_id
                    return [Outcome(command.node_id, True, "lost its data"), *self._forget_data_of(command.node_id)]
                existing.storage_id = command.storage_id or existing.storage_id
                return [Outcome(command.node_id, True, "known")]
            self.nodes[command.node_id] = NodeEntry(command.node_id, command.url, NodeState.UP, command.voter,
                                                    command.storage_id)
            return [Outcome(command.node_id, True)]
        if isinstance(command, SetNodeState):
            return [self._set_node_state(command)]
        if isinstance(command, PutClient):
            if command.record is None:
                if self.clients.pop(command.client_id, None) is not None:
                    self.revoked_clients[command.client_id] = self.version
                    while len(self.revoked_clients) > REVOKED_CLIENTS_MAX:
                        del self.revoked_clients[next(iter(self.revoked_clients))]
            else:
                # A name names one client: decided here, in log order, so two registrations of
                # one name through two nodes cannot both succeed (issue 32).
                name = command.record.get("name")
                if name is not None and any(other != command.client_id and record.get("name") == name
                                            for other, record in self.clients.items()):
                    return [Outcome(command.client_id, False, f"a client named {name} exists")]
                self.clients[command.client_id] = dict(command.record)
                self.revoked_clients.pop(command.client_id, None)
            return [Outcome(command.client_id, True)]
        if isinstance(command, SetAlternatives):
            return [self._set_alternatives(command)]
        if isinstance(command, CreateMacro | DeleteMacro | PutMacroMember | RemoveMacroMember):
            return [self._macro(command)]
        if isinstance(command, PutChannel):
            return [self._put_channel(command)]
        if isinstance(command, PutRecipient):
            return [self._put_recipient(command)]
        if isinstance(command, RemoveRecipient):
            return [self._remove_recipient(command)]
        if isinstance(command, NoteRecipient):
            return [self._note_recipient(command)]
        if isinstance(command, PutForward):
            return [self._put_forward(command)]
        if isinstance(command, DeleteForward):
            gone = self.forwards.pop(command.name, None)
            if gone is None:
                return [Outcome(command.name, False, "no such forward")]
            _discard(self.index.forwards_of, gone.source, gone.name)
            return [Outcome(command.name, True)]
        if isinstance(command, DeleteChannel):
            if self.channels.pop(command.name, None) is None:
                return [Outcome(command.name, False, "no such channel")]
            queue = self.queues.pop(channel_queue(command.name), None)
            if queue is not None:
                self.index.removed(queue)
            return [Outcome(command.name, True)]
        return [Outcome("", False, f"unknown command {type(command).__name__}")]

    def chain_binding(self, recipient: str) -> str | None:
        """The queue an administrator's chain binds `recipient` to (the first chain naming it
        with a queue), or None."""
        for chain, names in self.alternatives.items():
            queues = self.alternative_queues.get(chain, ())
            for name, queue in zip(names, queues, strict=False):
                if name == recipient:
                    return queue
        return None

    def _set_alternatives(self, command: SetAlternatives) -> Outcome:
        if command.queues and len(command.queues) != len(command.alternatives):
            return Outcome(command.recipient, False, "a chain names one queue per alternative")
        if not command.alternatives:                # an empty chain: none any more
            for kept in (self.alternatives, self.alternative_queues, self.alternatives_set_by):
                kept.pop(command.recipient, None)
            return Outcome(command.recipient, True)
        self.alternatives[command.recipient] = tuple(command.alternatives)
        self.alternative_queues[command.recipient] = tuple(command.queues)
        self.alternatives_set_by[command.recipient] = command.set_by
        for name, queue in zip(command.alternatives, command.queues, strict=False):   # none: from an older log
            entry = self.recipients.get(name)
            if entry is not None and entry.queue != queue:
                # The administrator's binding wins over a client's: whoever subscribed under
                # the name on another queue loses it (its subscriptions there go on serving
                # that queue, under a name the map no longer lists for it).
                self.index.recipient_gone(self.recipients.pop(name))
        return Outcome(command.recipient, True)

    def _put_recipient(self, command: PutRecipient) -> Outcome:
        if command.state not in set(RecipientState) or command.queue not in self.queues:
            return Outcome(command.name, False, f"no queue {command.queue}, or an unknown state {command.state}")
        entry = self.recipients.get(command.name)
        if entry is not None and entry.queue != command.queue:
            return Outcome(command.name, False, f"recipient {command.name} receives from {entry.queue}")
        if entry is None:
            if len(self.recipients) >= RECIPIENTS_MAX:
                return Outcome(command.name, False, f"the map holds {RECIPIENTS_MAX} recipients")
            bound = self.chain_binding(command.name)
            if bound is not None and bound != command.queue:
                return Outcome(command.name, False, f"recipient {command.name} receives from {bound} (an "
                                                    "administrator's chain names it so)")
            if command.owner and bound is None and sum(
                    1 for other in self.recipients.values() if other.owner == command.owner) >= RECIPIENTS_PER_CLIENT_MAX:
                return Outcome(command.name, False, f"client {command.owner} bound {RECIPIENTS_PER_CLIENT_MAX} "
                                                    "recipient names already")
        if entry is not None and entry.state == command.state:
            return Outcome(command.name, False, "unchanged")
        owner = entry.owner if entry is not None else "" if self.chain_binding(command.name) else command.owner
        self.recipients[command.name] = put = RecipientEntry(command.name, command.queue, command.state,
                                                             command.since_ms, command.reason, owner)
        self.index.recipient_put(put)
        return Outcome(command.name, True, command.state)

    def _remove_recipient(self, command: RemoveRecipient) -> Outcome:
        known = self.recipients.pop(command.name, None)
        if known is not None:
            self.index.recipient_gone(known)
        chain = self.alternatives.pop(command.name, None)
        self.alternative_queues.pop(command.name, None)
        self.alternatives_set_by.pop(command.name, None)
        if known is None and chain is None:
            return Outcome(command.name, False, f"no recipient {command.name}")
        return Outcome(command.name, True)

    def _note_recipient(self, command: NoteRecipient) -> Outcome:
        entry = self.recipients.get(command.name)
        if entry is None or (entry.queue, entry.state, entry.since_ms) != (command.queue, command.state,
                                                                           command.since_ms):
            return Outcome(command.name, False, f"recipient {command.name} is not {command.state} since then")
        if entry.reason == command.reason:
            return Outcome(command.name, False, "unchanged")
        self.recipients[command.name] = RecipientEntry(entry.name, entry.queue, entry.state, entry.since_ms,
                                                       command.reason, entry.owner)
        return Outcome(command.name, True, "noted")

    def _put_forward(self, command: PutForward) -> Outcome:
        source = self.queues.get(command.source)
        if command.name in self.forwards:
            return Outcome(command.name, False, f"forward {command.name} exists")
        if source is None:
            return Outcome(command.name, False, f"no queue {command.source}")
        if source.options.get("strength") != "full":
            return Outcome(command.name, False, f"queue {command.source} is not `full`: under `producer` a "
                                                "replica's copy of a message would never be forwarded")
        if not command.urls and command.destination == command.source:
            return Outcome(command.name, False, "a forward into its own source")
        if self.index.forwards_of.get(command.source):
            return Outcome(command.name, False, f"queue {command.source} is forwarded already")
        if len(self.forwards) >= FORWARDS_MAX:
            return Outcome(command.name, False, f"the map holds {FORWARDS_MAX} forwards")
        self.forwards[command.name] = ForwardEntry(command.name, command.source, command.destination,
                                                   tuple(command.urls), command.client_id, command.secret,
                                                   command.created_ms, command.token)
        _add(self.index.forwards_of, command.source, command.name)
        return Outcome(command.name, True)

    def _forget_data_of(self, node: str) -> list[Outcome]:
        outcomes = []
        for name in self.index.holding([node]):
            entry = self.queues[name]
            if entry.replica == node and entry.in_sync:
                entry.in_sync = False
                entry.last_reason = Reason.IN_SYNC.value
                self.index.synced(entry)
                outcomes.append(Outcome(name, True, "replica lost its data"))
            elif entry.master == node:
                # With its replica out of sync too (it lost its disk right after it was promoted,
                # before the old master caught up as its replica), the replica still holds every
                # operation it did; the empty master must not serve, or the replica would take
                # its empty state. What the lost master acknowledged alone is gone either way.
                detail = "master lost its data: its " + ("in-sync " if entry.in_sync else "out-of-sync ") \
                    + "replica took over"
                entry.epoch, entry.master, entry.replica, entry.in_sync = entry.epoch + 1, entry.replica, node, False
                entry.last_reason = Reason.FAILOVER.value
                self.index.moved(name, (node, entry.master), (entry.master, node))
                self.index.synced(entry)
                outcomes.append(Outcome(name, True, detail))
        return outcomes

    def _create(self, command: CreateQueue) -> Outcome:
        if command.name in self.queues:
            return Outcome(command.name, False, "exists")
        if command.name in self.macros:
            return Outcome(command.name, False, "a macro queue has this name")
        for member in (command.master, command.replica):
            entry = self.nodes.get(member)
            if entry is None or entry.state is not NodeState.UP:
                return Outcome(command.name, False, f"node {member} is not up")
        if command.master == command.replica:
            return Outcome(command.name, False, "master and replica must be different nodes")
        created = QueueEntry(command.name, dict(command.options), command.master, command.replica, 1, True,
                             command.incarnation)
        self.queues[command.name] = created
        self.index.added(created)
        return Outcome(command.name, True)

    def _macro(self, command: CreateMacro | DeleteMacro | PutMacroMember | RemoveMacroMember) -> Outcome:
        name = command.name
        if isinstance(command, CreateMacro):
            problem = macro_policy_problem(command.producer, command.consumer, command.fastest_by)
            if problem:
                return Outcome(name, False, problem)
            if name in self.queues:
                return Outcome(name, False, "a queue has this name")
            existing = self.macros.get(name)
            if existing is not None:
                same = (existing.producer, existing.consumer, existing.fastest_by) == \
                    (command.producer, command.consumer, command.fastest_by)
                return Outcome(name, same, "exists" if same else "exists with other policies")
            self.macros[name] = MacroEntry(name, command.producer, command.consumer, command.fastest_by)
            return Outcome(name, True, "created")
        macro = self.macros.get(name)
        if macro is None:
            return Outcome(name, False, "no such macro queue")
        if isinstance(command, DeleteMacro):
            del self.macros[name]
            for member in macro.members:
                _discard(self.index.macros_of, member.queue, name)
            return Outcome(name, True)
        if isinstance(command, RemoveMacroMember):
            if macro.member(command.queue) is None:
                return Outcome(name, False, f"{command.queue} is not a member")
            macro.members = [member for member in macro.members if member.queue != command.queue]
            _discard(self.index.macros_of, command.queue, name)
            return Outcome(name, True)
        problem = self._member_problem(macro, command)
        if problem:
            return Outcome(name, False, problem)
        existing_member = macro.member(command.queue)
        if existing_member is not None:
            existing_member.priority, existing_member.weight = command.priority, command.weight
        else:
            macro.members.append(MacroMember(command.queue, command.priority, command.weight))
            _add(self.index.macros_of, command.queue, name)
        return Outcome(name, True)

    def _put_channel(self, command: PutChannel) -> Outcome:
        if command.delivery_class not in [kind.value for kind in DeliveryClass] or \
                not 0 <= command.resend_interval_s <= CHANNEL_RESEND_MAX_S:
            return Outcome(command.name, False, f"the class is one of {', '.join(k.value for k in DeliveryClass)}, "
                                                f"the resend interval 0-{CHANNEL_RESEND_MAX_S} s")
        existing = self.channels.get(command.name)
        if existing is not None:
            existing.delivery_class, existing.resend_interval_s = command.delivery_class, command.resend_interval_s
            return Outcome(command.name, True, "changed")
        created = self._create(CreateQueue(channel_queue(command.name), dict(CHANNEL_QUEUE_OPTIONS), command.master,
                                           command.replica, command.incarnation))
        if not created.applied:
            return Outcome(command.name, False, created.reason)
        self.channels[command.name] = ChannelEntry(command.name, command.delivery_class, command.resend_interval_s)
        return Outcome(command.name, True, "created")

    def _member_problem(self, macro: MacroEntry, command: PutMacroMember) -> str:
        """Seed 004's validation routine: a member must be compatible with the others."""
        if command.queue in self.macros:
            return "a macro queue cannot be a member (members are queues)"
        entry = self.queues.get(command.queue)
        if entry is None:
            return f"no queue named {command.queue}"
        if not 0 <= command.priority <= 9 or not 1 <= command.weight <= MACRO_MEMBER_WEIGHT_MAX:
            return f"priority is 0-9 and weight 1-{MACRO_MEMBER_WEIGHT_MAX}"
        if macro.member(command.queue) is None and len(macro.members) >= MACRO_MEMBERS_MAX:
            return f"at most {MACRO_MEMBERS_MAX} members"
        kind = entry.options.get("type")
        for member in macro.members:
            other = self.queues.get(member.queue)
            if member.queue != command.queue and other is not None and other.options.get("type") != kind:
                return (f"{command.queue} is a {kind} queue but {member.queue} is {other.options.get('type')}: "
                        "a macro queue's members answer the same way")
        return ""

    def _change_pair(self, change: ChangePair) -> Outcome:
        entry = self.queues.get(change.name)
        if entry is None:
            return Outcome(change.name, False, "no such queue")
        expected, new = PairState(*change.expected), PairState(*change.new)
        if entry.pair != expected:
            return Outcome(change.name, False, f"expected {expected}, found {entry.pair}")
        members_changed = (new.master, new.replica) != (expected.master, expected.replica)
        if new.master == new.replica:
            return Outcome(change.name, False, "master and replica must be different nodes")
        if new.epoch != expected.epoch + (1 if members_changed or change.reason == Reason.RESTARTED_MASTER else 0):
            return Outcome(change.name, False, "a change of members or a master's restart raises the epoch by one, "
                                               "an in-sync flip keeps it")
        if change.reason == Reason.RESTARTED_MASTER and (members_changed or new.in_sync):
            return Outcome(change.name, False, "a restart keeps the members and records the replica out of sync")
        for member in {new.master, new.replica} - {expected.master, expected.replica}:
            node = self.nodes.get(member)
            if node is None or node.state is not NodeState.UP:
                return Outcome(change.name, False, f"node {member} is not up")
        entry.epoch, entry.master, entry.replica, entry.in_sync = new.epoch, new.master, new.replica, new.in_sync
        self.index.moved(change.name, (expected.master, expected.replica), (new.master, new.replica))
        self.index.synced(entry)
        entry.last_reason = change.reason
        if change.reason == Reason.UNCLEAN:
            entry.unclean_promotions += 1
        return Outcome(change.name, True, change.reason)

    def _set_node_state(self, command: SetNodeState) -> Outcome:
        entry = self.nodes.get(command.node_id)
        if entry is None:
            return Outcome(command.node_id, False, "no such node")
        if command.expected is not None and entry.state.value != command.expected:
            return Outcome(command.node_id, False, f"expected {command.expected}, found {entry.state.value}")
        state = NodeState(command.state)
        if entry.state is NodeState.REMOVED:
            return Outcome(command.node_id, False, "removed")
        if state is NodeState.REMOVED and (self.index.mastered.get(command.node_id)
                                            or self.index.replicated.get(command.node_id)):
            return Outcome(command.node_id, False, "it still holds queue members: drain it first")
        entry.state = state
        return Outcome(command.node_id, True)


# --- decisions from the map (pure; proposed as commands) -----------------------------------------
def choose_pair(cluster: ClusterMap, preferred: tuple[str | None, str | None] = (None, None)) -> tuple[str, str] | None:
    """Master and replica for a new queue: two different live nodes; the master where fewest
    masters are, the replica where fewest members are (ties by id). None: fewer than two."""
    live = cluster.live_nodes()
    want_master, want_replica = preferred
    if len(live) < 2 or (want_master and want_master not in live) or (want_replica and want_replica not in live):
        return None
    masters, members = cluster.masters_per_node(), cluster.members_per_node()
    master = want_master or min((n for n in live if n != want_replica), key=lambda n: (masters[n], members[n], n))
    replica = want_replica or min((n for n in live if n != master), key=lambda n: (members[n], masters[n], n))
    return (master, replica) if master != replica else None


def plan_failover(cluster: ClusterMap, lapsed: set[str]) -> tuple[list[ChangePair], list[str]]:
    """Promote the in-sync replica of every queue mastered by a node whose lease lapsed (epoch+1).
    The old master stays in the pair as the replica and rejoins by state transfer; the
    replica it gets is recorded out of sync until then. Returns the changes and the queues that
    stay unavailable (replica out of sync or itself lapsed: DESIGN.md 3.4)."""
    changes, stuck = [], []
    for name in cluster.index.holding(lapsed, replicas=False):      # what the lapsed nodes master, by name
        entry = cluster.queues[name]
        replica_node = cluster.nodes.get(entry.replica)
        if not entry.in_sync or entry.replica in lapsed or replica_node is None \
                or replica_node.state not in (NodeState.UP, NodeState.DRAINING):
            stuck.append(name)
            continue
        changes.append(ChangePair(name, astuple(entry.pair),
                                  (entry.epoch + 1, entry.replica, entry.master, False), Reason.FAILOVER.value))
    return changes, stuck


def plan_replacements(cluster: ClusterMap, gone: set[str]) -> list[ChangePair]:
    """A node down longer than `replica_replace_after_s` (or draining) loses its replicas: each
    is re-created on another live node (a move; the new one is out of sync until transferred)."""
    changes: list[ChangePair] = []
    if not gone:
        return changes
    members = cluster.members_per_node()
    live = cluster.live_nodes()
    for name in cluster.index.holding(gone, masters=False):         # the replicas on gone nodes, by name
        entry = cluster.queues[name]
        if entry.master in gone:
            continue
        candidates = [n for n in live if n not in (entry.master, entry.replica)]
        if not candidates:
            continue
        target = min(candidates, key=lambda n: (members[n], n))
        members[target] += 1
        changes.append(ChangePair(name, astuple(entry.pair), (entry.epoch + 1, entry.master, target, False),
                                  Reason.MOVE.value))
    return changes


def plan_member_moves(cluster: ClusterMap) -> list[ChangePair]:
    """Replicas to move onto up nodes that hold fewer members than others. Handoffs alone
    cannot reach a node that holds no member (one back from a drain, a new one), so the
    members spread first: from the node with most to the one with fewest while they differ
    by two or more. A queue whose master's node masters most goes first, so the handoffs
    that follow can relieve that node; a `min_in_sync` 2 queue goes last (it refuses writes
    until its new replica is in sync). Only in-sync pairs move; each new replica is out of
    sync until its state transfer ends."""
    members, masters = cluster.members_per_node(), cluster.masters_per_node()
    changes: list[ChangePair] = []

    def last_of_pair(entry: QueueEntry) -> tuple[bool, str]:
        return int(entry.options.get("min_in_sync", 1)) >= 2, entry.name

    # Each move takes the first queue by (min_in_sync 2 last, its master's masters most, its
    # replica's members most, name). Within one (master, replica) pair only the first and last
    # of these differ, so each pair offers its queues in that order (a stack, best on top), and
    # a move looks at one queue per pair, not at the whole map.
    by_pair: dict[tuple[str, str], list[QueueEntry]] = {}
    for entry in cluster.queues.values():
        if entry.in_sync and entry.master in members and entry.replica in members:
            by_pair.setdefault((entry.master, entry.replica), []).append(entry)
    for stack in by_pair.values():
        stack.sort(key=last_of_pair, reverse=True)
    while members:
        low = min(members, key=lambda n: (members[n], n))
        best: tuple[tuple[bool, int, int, str], list[QueueEntry]] | None = None
        for (master, replica), stack in by_pair.items():
            if not stack or low in (master, replica) or members[replica] - members[low] < 2:
                continue
            in_sync_two, name = last_of_pair(stack[-1])
            key = (in_sync_two, -masters[master], -members[replica], name)
            if best is None or key < best[0]:
                best = (key, stack)
        if best is None:
            return changes
        entry = best[1].pop()
        members[entry.replica] -= 1
        members[low] += 1
        changes.append(ChangePair(entry.name, astuple(entry.pair), (entry.epoch + 1, entry.master, low, False),
                                  Reason.MOVE.value))
    return changes


def plan_rebalance(cluster: ClusterMap) -> list[str]:
    """Queues whose master should hand off to its replica so that masters spread evenly:
    from the node with most masters to its replica while that lowers the spread."""
    masters = cluster.masters_per_node()
    chosen: list[str] = []
    for name, entry in sorted(cluster.queues.items()):
        if entry.master not in masters or entry.replica not in masters or not entry.in_sync:
            continue
        if masters[entry.master] - masters[entry.replica] >= 2:
            masters[entry.master] -= 1
            masters[entry.replica] += 1
            chosen.append(name)
    return chosen


def macro_policy_problem(producer: str, consumer: str, fastest_by: str) -> str:
    for value, kind in ((producer, ProducerPolicy), (consumer, ConsumerPolicy), (fastest_by, FastestBy)):
        allowed = [member.value for member in kind]
        if value not in allowed:
            return f"{value!r} is not one of {', '.join(allowed)}"
    return ""


def astuple(pair: PairState) -> tuple[int, str, str, bool]:
    return (pair.epoch, pair.master, pair.replica, pair.in_sync)


# --- snapshots of the map (the membership layer compacts its log below one) ------------------
def encode_map(cluster: ClusterMap) -> bytes:
    nodes = [[n.node_id, n.url, n.state.value, n.voter, n.storage_id] for n in cluster.nodes.values()]
    queues = [[q.name, q.options, q.master, q.replica, q.epoch, q.in_sync, q.incarnation, q.unclean_promotions,
               q.last_reason] for q in cluster.queues.values()]
    alternatives = {recipient: list(names) for recipient, names in cluster.alternatives.items()}
    macros = [[m.name, m.producer, m.consumer, m.fastest_by, [[x.queue, x.priority, x.weight] for x in m.members]]
              for m in cluster.macros.values()]
    channels = [[c.name, c.delivery_class, c.resend_interval_s] for c in cluster.channels.values()]
    recipients = [[r.name, r.queue, r.state, r.since_ms, r.reason, r.owner] for r in cluster.recipients.values()]
    chains = {recipient: [list(cluster.alternative_queues.get(recipient, ())),
                          cluster.alternatives_set_by.get(recipient, "")] for recipient in cluster.alternatives}
    forwards = [[f.name, f.source, f.destination, list(f.urls), f.client_id, f.secret, f.created_ms, f.token]
                for f in cluster.forwards.values()]
    return msgpack.packb([cluster.version, nodes, queues, cluster.clients, alternatives, macros, channels,
                          recipients, forwards, list(cluster.revoked_clients.items()), chains], use_bin_type=True)


def decode_map(data: bytes) -> ClusterMap:
    """The map a snapshot holds (b"": the empty map of a log that starts at its beginning)."""
    if not data:
        return ClusterMap()
    try:
        version, nodes, queues, clients, alternatives, *rest = msgpack.unpackb(data, raw=False)
        macros = rest[0] if rest else []        # a snapshot from before macro queues has none
        channels = rest[1] if len(rest) > 1 else []
        recipients = rest[2] if len(rest) > 2 else []
        forwards = rest[3] if len(rest) > 3 else []
        revoked = rest[4] if len(rest) > 4 else []      # nor one from before revoked clients were kept
        chains = rest[5] if len(rest) > 5 else {}       # nor one from before chains named queues
        return ClusterMap(
            nodes={row[0]: NodeEntry(row[0], row[1], NodeState(row[2]), row[3], row[4]) for row in nodes},
            queues={row[0]: QueueEntry(*row) for row in queues},
            clients=clients, alternatives={recipient: tuple(names) for recipient, names in alternatives.items()},
            alternative_queues={recipient: tuple(chain[0]) for recipient, chain in chains.items()},
            alternatives_set_by={recipient: str(chain[1]) for recipient, chain in chains.items()},
            macros={row[0]: MacroEntry(row[0], row[1], row[2], row[3], [MacroMember(*member) for member in row[4]])
                    for row in macros},
            channels={row[0]: ChannelEntry(row[0], row[1], row[2]) for row in channels},
            recipients={row[0]: RecipientEntry(*row) for row in recipients},
            forwards={row[0]: ForwardEntry(row[0], row[1], row[2], tuple(row[3]), *row[4:]) for row in forwards},
            revoked_clients={str(client_id): int(at) for client_id, at in revoked}, version=version)
    except Exception as exc:  # msgpack and the constructors raise several unrelated types
        raise CommandError(f"not a cluster map snapshot: {type(exc).__name__}: {exc}") from None
