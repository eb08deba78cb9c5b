"""The cluster map: what the membership layer replicates (docs/PROTOCOL.md "Cluster map
commands"), as a pure state machine.

Every node holds a copy; the membership layer (a Raft core driven by `qserver/cluster/membership.py`, an
in-memory twin in the simulations) applies the same commands in the same order to each copy,
so `apply` must be deterministic: no clock, no randomness, no I/O. Reads are local.

Writes are rare commands: creating or deleting a queue, node state changes, client records,
changes of a queue's pair, the definitions of macro queues (one name over member queues,
seed 004; each member stays an ordinary queue with its own pair), and the cluster feature level
(`SetFeatureLevel`, raised by `qctl cluster finalize`, never lowered). A pair change is a
compare-and-set: it names the (epoch, master, replica, in_sync) it expects and is refused when
applied against anything else, so a late or repeated proposal never undoes a newer one (the
same section, tag 5). A change of master or replica raises the epoch by exactly one; an
in-sync flip keeps it.

This module owns the map (`ClusterMap`, its `MapIndex`, `apply`) and its snapshot codec. Its
vocabulary lives beside it and is re-exported from here, where most readers import it:
`replication/map_entries.py` (the entries and their limits), `replication/map_commands.py`
(the commands and their codec) and `replication/map_planning.py` (the pure decisions made from
the map: placement, failover, moves, rebalance).
"""
from __future__ import annotations

import bisect
import copy
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from replication.invariants import InvariantViolation
from replication.map_channels import set_channel_attributes
from replication.map_commands import (
    ALTERNATIVES_MAX,
    AddNode,
    ChangePair,
    ChangePairs,
    Command,
    CommandError,
    CreateMacro,
    CreateQueue,
    DeleteChannel,
    DeleteForward,
    DeleteMacro,
    DeleteQueue,
    NoteRecipient,
    Outcome,
    PutChannel,
    PutClient,
    PutForward,
    PutMacroMember,
    PutRecipient,
    RemoveMacroMember,
    RemoveRecipient,
    SetAlternatives,
    SetChannelAttributes,
    SetFeatureLevel,
    SetForwardControl,
    SetNodeState,
    SetQueueHealth,
    SetQueueOptions,
    decode_command,
    encode_command,
)
from replication.map_entries import (
    CHANNEL_PREFIX,
    CHANNEL_QUEUE_OPTIONS,
    CHANNEL_RESEND_MAX_S,
    FORWARDS_MAX,
    MACRO_MEMBER_WEIGHT_MAX,
    MACRO_MEMBERS_MAX,
    RECIPIENTS_MAX,
    RECIPIENTS_PER_CLIENT_MAX,
    REVOKED_CLIENTS_MAX,
    ChannelEntry,
    ConsumerPolicy,
    DeliveryClass,
    FastestBy,
    ForwardEntry,
    MacroEntry,
    MacroMember,
    NodeEntry,
    NodeState,
    PairState,
    ProducerPolicy,
    QueueEntry,
    Reason,
    RecipientEntry,
    RecipientState,
    astuple,
    channel_queue,
    macro_policy_problem,
)
from replication.map_forwards import control_refusal, set_forward_control
from replication.map_planning import (
    choose_pair,
    plan_failover,
    plan_member_moves,
    plan_rebalance,
    plan_replacements,
)
from replication.options import LEVEL3_OPTIONS, OptionError, changed_options
from replication.queue_health import apply_queue_health, decode_health, encode_health, health_json
from wire.versions import FEATURE_LEVEL, FEATURES, OLDEST_FEATURE_LEVEL, RELEASE

# The map's vocabulary and decisions are re-exported: most of the project imports them from here.
__all__ = ["ALTERNATIVES_MAX", "AddNode", "CHANNEL_PREFIX", "CHANNEL_QUEUE_OPTIONS", "CHANNEL_RESEND_MAX_S",
           "ChangePair", "ChangePairs", "ChannelEntry", "ClusterMap", "Command", "CommandError", "ConsumerPolicy",
           "CreateMacro", "CreateQueue", "DeleteChannel", "DeleteForward", "DeleteMacro", "DeleteQueue",
           "DeliveryClass", "FORWARDS_MAX", "FastestBy", "ForwardEntry", "MACRO_MEMBERS_MAX",
           "MACRO_MEMBER_WEIGHT_MAX", "MacroEntry", "MacroMember", "MapIndex", "NodeEntry", "NodeState",
           "NoteRecipient", "Outcome", "PairState", "ProducerPolicy", "PutChannel", "PutClient", "PutForward",
           "PutMacroMember", "PutRecipient", "QueueEntry", "RECIPIENTS_MAX", "RECIPIENTS_PER_CLIENT_MAX",
           "REVOKED_CLIENTS_MAX", "Reason", "RecipientEntry", "RecipientState", "RemoveMacroMember",
           "RemoveRecipient", "SUMMARY_NAMES_MAX", "SetAlternatives", "SetChannelAttributes", "SetFeatureLevel", "SetForwardControl", "SetNodeState", "SetQueueOptions", "astuple", "channel_queue",
           "choose_pair", "decode_command", "decode_map", "encode_command", "encode_map", "macro_policy_problem",
           "plan_failover", "plan_member_moves", "plan_rebalance", "plan_replacements"]


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
    queue_health: dict[str, tuple[str, str, int]] = field(default_factory=dict)   # FAILED queues (queue_health.py)
    version: int = 0          # commands applied; every copy agrees at the same version
    # The cluster feature level (wire/versions.py; docs/OPERATIONS.md, "The cluster feature
    # level"): raised by SetFeatureLevel, never lowered; a map that never recorded one (every
    # map of release 0.1.0) is at the oldest level.
    feature_level: int = OLDEST_FEATURE_LEVEL
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
        return {"version": self.version, "feature_level": self.feature_level,
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
        return {"version": self.version, "feature_level": self.feature_level,
                "nodes": [{"id": n.node_id, "url": n.url, "state": n.state.value, "voter": n.voter}
                          for n in sorted(self.nodes.values(), key=lambda n: n.node_id)],
                "queues": {name: {**entry.to_json(), **health_json(self, name)}
                           for name, entry in sorted(self.queues.items())},
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
            self.queue_health.pop(command.name, None)
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
        if isinstance(command, SetFeatureLevel):
            return [self._set_feature_level(command.level)]
        if isinstance(command, SetQueueOptions):
            return [self._set_queue_options(command)]
        if isinstance(command, SetQueueHealth):
            return [apply_queue_health(self, command)]
        if isinstance(command, SetForwardControl):
            return [set_forward_control(self.forwards, self.feature_level, command)]
        if isinstance(command, SetChannelAttributes):
            return [set_channel_attributes(self.channels, self.feature_level, command)]
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

    def _set_feature_level(self, level: int) -> Outcome:
        """Raise the level; asking for the level the map has, or a lower one, changes nothing."""
        check_feature_level(level)
        if level <= self.feature_level:
            return Outcome("feature_level", False, f"the cluster runs at feature level {self.feature_level} already")
        self.feature_level = level
        return Outcome("feature_level", True, f"raised to {level}")

    def _set_queue_options(self, command: SetQueueOptions) -> Outcome:
        """Change the named options of a queue's entry; its members' cores take them from the
        entry (qserver/cluster/pairs.py, reconcile). Refused below feature level 3 on every node,
        as a proposal that bypassed the route's gate must leave every copy of the map the same."""
        entry = self.queues.get(command.name)
        if entry is None or entry.incarnation != command.incarnation:
            return Outcome(command.name, False, "no such incarnation")
        if self.feature_level < FEATURES["queue_options_change"]:
            return Outcome(command.name, False, f"changing a queue's options needs cluster feature level "
                                                f"{FEATURES['queue_options_change']}")
        try:
            options = changed_options(entry.options, command.options)
        except (OptionError, TypeError, ValueError, KeyError) as error:
            return Outcome(command.name, False, str(error)[:200])
        if options == entry.options:
            return Outcome(command.name, True, "unchanged")
        entry.options = options
        return Outcome(command.name, True, "changed")

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
        refusal = control_refusal(self.feature_level, command.name, command.control)
        if refusal is not None:
            return refusal
        self.forwards[command.name] = ForwardEntry(command.name, command.source, command.destination,
                                                   tuple(command.urls), command.client_id, command.secret,
                                                   command.created_ms, command.token, dict(command.control))
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
        if self.feature_level < FEATURES["queue_delay_and_wait"] and any(command.options.get(name)
                                                                          for name in LEVEL3_OPTIONS):
            return Outcome(command.name, False, f"the options {', '.join(sorted(LEVEL3_OPTIONS))} need cluster feature "
                                                f"level {FEATURES['queue_delay_and_wait']}")
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
            # Refused below its level on every node, as 0.1.0 refuses a policy it does not know: a
            # proposal that bypassed the route's gate still leaves every copy of the map the same.
            if command.consumer == "highest_priority" and self.feature_level < FEATURES["macro_highest_priority"]:
                return Outcome(name, False, f"the consumer policy highest_priority needs cluster feature level "
                                            f"{FEATURES['macro_highest_priority']}")
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


def check_feature_level(level: int) -> None:
    """A map at a level above what this code runs at holds what this code may misread: the
    node cannot follow the cluster, and stops (a broken invariant, docs/ARCHITECTURE.md "Three
    kinds of failure") rather than act on it. Only a node of an older release that came back
    after `qctl cluster finalize` meets one (docs/OPERATIONS.md, "The cluster feature level")."""
    if level > FEATURE_LEVEL:
        raise InvariantViolation(f"the cluster runs at feature level {level}, above {FEATURE_LEVEL}, the highest this "
                                 f"release ({RELEASE}) supports: this node cannot follow the cluster's map. Start it "
                                 "with a release that supports that level (a finalized cluster is never rolled back)")


# --- snapshots of the map (the membership layer compacts its log below one) ------------------
def encode_map(cluster: ClusterMap) -> bytes:
    nodes = [[n.node_id, n.url, n.state.value, n.voter, n.storage_id] for n in cluster.nodes.values()]
    queues = [[q.name, q.options, q.master, q.replica, q.epoch, q.in_sync, q.incarnation, q.unclean_promotions,
               q.last_reason] for q in cluster.queues.values()]
    alternatives = {recipient: list(names) for recipient, names in cluster.alternatives.items()}
    macros = [[m.name, m.producer, m.consumer, m.fastest_by, [[x.queue, x.priority, x.weight] for x in m.members]]
              for m in cluster.macros.values()]
    channels = [[c.name, c.delivery_class, c.resend_interval_s, *([c.attributes] if c.attributes else [])]
                for c in cluster.channels.values()]                                   # as 0.2.0's when none
    recipients = [[r.name, r.queue, r.state, r.since_ms, r.reason, r.owner] for r in cluster.recipients.values()]
    chains = {recipient: [list(cluster.alternative_queues.get(recipient, ())),
                          cluster.alternatives_set_by.get(recipient, "")] for recipient in cluster.alternatives}
    forwards = [[f.name, f.source, f.destination, list(f.urls), f.client_id, f.secret, f.created_ms, f.token,
                 *([f.control] if f.control else [])] for f in cluster.forwards.values()]    # as 0.2.0's when none
    rows = [cluster.version, nodes, queues, cluster.clients, alternatives, macros, channels, recipients, forwards,
            list(cluster.revoked_clients.items()), chains]
    if cluster.feature_level > OLDEST_FEATURE_LEVEL:
        # Only then: a map at the oldest level encodes byte for byte as release 0.1.0's does
        # (whose decoder ignores rows beyond the eleventh anyway).
        rows.append(cluster.feature_level)
        if cluster.queue_health:             # only at level 3 (SetQueueHealth): rows 0.2.0 never sees
            rows.append(encode_health(cluster))
    return msgpack.packb(rows, use_bin_type=True)


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
        level = rest[6] if len(rest) > 6 else OLDEST_FEATURE_LEVEL     # nor one at the oldest feature level
        health = decode_health(rest[7]) if len(rest) > 7 else {}        # nor one without a FAILED queue
        if not isinstance(level, int) or isinstance(level, bool) or level < OLDEST_FEATURE_LEVEL:
            raise ValueError(f"a feature level is an integer from {OLDEST_FEATURE_LEVEL}, not {level!r}"[:120])
        cluster = ClusterMap(
            nodes={row[0]: NodeEntry(row[0], row[1], NodeState(row[2]), row[3], row[4]) for row in nodes},
            queues={row[0]: QueueEntry(*row) for row in queues},
            clients=clients, alternatives={recipient: tuple(names) for recipient, names in alternatives.items()},
            alternative_queues={recipient: tuple(chain[0]) for recipient, chain in chains.items()},
            alternatives_set_by={recipient: str(chain[1]) for recipient, chain in chains.items()},
            macros={row[0]: MacroEntry(row[0], row[1], row[2], row[3], [MacroMember(*member) for member in row[4]])
                    for row in macros},
            channels={row[0]: ChannelEntry(row[0], row[1], row[2], *row[3:4]) for row in channels},
            recipients={row[0]: RecipientEntry(*row) for row in recipients},
            forwards={row[0]: ForwardEntry(row[0], row[1], row[2], tuple(row[3]), *row[4:]) for row in forwards},
            revoked_clients={str(client_id): int(at) for client_id, at in revoked}, version=version,
            feature_level=level, queue_health=health)
    except Exception as exc:  # msgpack and the constructors raise several unrelated types
        raise CommandError(f"not a cluster map snapshot: {type(exc).__name__}: {exc}") from None
    check_feature_level(cluster.feature_level)      # outside the try: a broken invariant, not bad bytes
    return cluster
