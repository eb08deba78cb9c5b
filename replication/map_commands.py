"""The cluster map's commands and their wire form (msgpack rows, tagged by `TAG`).

What the membership layer replicates: each command is proposed as `encode_command` bytes and
applied to every copy of the map (`ClusterMap.apply` in `replication/cluster_map.py`). Apart
from the map because the codec and the command types are the membership log's format, read by
proposers and tests that never apply one. Tags are stable: never renumber or reuse one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from replication.map_entries import FastestBy


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
    # The forward's own bands and weights (ForwardEntry.control): encoded only when given, and
    # proposed only at feature level 3 (FEATURES "forward_control"): 0.2.0 cannot decode it.
    control: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True, slots=True)
class SetFeatureLevel:
    """Raise the cluster feature level (wire/versions.py; docs/OPERATIONS.md, "The cluster
    feature level"), never lower it. Proposed only by `POST /v1/cluster/finalize` once every
    node runs a release that supports `level`: release 0.1.0 does not know this tag (it logs
    and skips an entry it cannot decode), so it must never reach one of its nodes."""
    TAG = 20
    level: int


@dataclass(frozen=True, slots=True)
class SetQueueOptions:
    """Change options of an existing queue (`PATCH /v1/queues/{q}`; docs/PROTOCOL.md, "Changing
    a queue's options"): `options` names only those it changes, each one of
    replication/options.py CHANGEABLE_OPTIONS; the queue's incarnation is named so that a change
    meant for a queue deleted meanwhile never reaches one created again under its name. Applied
    only at cluster feature level 3: release 0.2.0 does not know this tag."""
    TAG = 21
    name: str
    incarnation: int
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SetChannelAttributes:
    """Replace a channel's attributes (replication/map_channels.py ATTRIBUTES: what its data is
    like, and whether subscribing sends the last value). Applied only at cluster feature level
    3: release 0.2.0 does not know this tag."""
    TAG = 23
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SetForwardControl:
    """Replace a forward's own bands, weights and fill unit (`PATCH /v1/forwards/{f}`;
    ForwardEntry.control, checked by the route). `created_ms` names the forward's incarnation: a
    change meant for one deleted meanwhile never reaches one made again under its name. Applied
    only at cluster feature level 3: release 0.2.0 does not know this tag."""
    TAG = 26
    name: str
    created_ms: int
    control: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SetQueueHealth:
    """A queue's master records that the queue cannot serve (`reason`, one of
    replication/queue_health.py REASONS, with `detail` and `since_ms`, its wall time), or serves
    again (`reason` ""), so every node's map and `qctl status` show FAILED. Named by
    incarnation; applied only at cluster feature level 3: release 0.2.0 does not know this tag."""
    TAG = 24
    name: str
    incarnation: int
    reason: str
    detail: str
    since_ms: int


Command = (AddNode | SetNodeState | CreateQueue | DeleteQueue | ChangePair | ChangePairs | PutClient | SetAlternatives
           | CreateMacro | DeleteMacro | PutMacroMember | RemoveMacroMember | PutChannel | DeleteChannel | PutRecipient
           | PutForward | DeleteForward | RemoveRecipient | NoteRecipient | SetFeatureLevel | SetQueueOptions
           | SetForwardControl | SetQueueHealth | SetChannelAttributes)
COMMAND_TYPES: dict[int, type] = {kind.TAG: kind for kind in (AddNode, SetNodeState, CreateQueue, DeleteQueue,
                                                              ChangePair, ChangePairs, PutClient, SetAlternatives,
                                                              CreateMacro, DeleteMacro, PutMacroMember,
                                                              RemoveMacroMember, PutChannel, DeleteChannel,
                                                              PutRecipient, PutForward, DeleteForward,
                                                              RemoveRecipient, NoteRecipient, SetFeatureLevel,
                                                              SetQueueOptions, SetForwardControl, SetQueueHealth,
                                                              SetChannelAttributes)}


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
        row = [command.TAG, command.name, command.source, command.destination, list(command.urls),
               command.client_id, command.secret, command.created_ms, command.token]
        return row + [command.control] if command.control else row
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
        if tag == SetFeatureLevel.TAG:
            (level,) = values
            if not isinstance(level, int) or isinstance(level, bool) or level < 1:
                raise CommandError(f"a feature level is an integer from 1, not {level!r}"[:120])
            return SetFeatureLevel(level)
        if tag == SetQueueOptions.TAG:
            name, incarnation, options = values
            if not isinstance(name, str) or type(incarnation) is not int or not isinstance(options, dict):
                raise CommandError("SetQueueOptions is [tag, name, incarnation, {option: value}]")
            return SetQueueOptions(name, incarnation, options)
        if tag == SetForwardControl.TAG:
            name, created_ms, control = values
            if not isinstance(name, str) or type(created_ms) is not int or not isinstance(control, dict):
                raise CommandError("SetForwardControl is [tag, name, created_ms, {field: value}]")
            return SetForwardControl(name, created_ms, control)
        if tag == SetChannelAttributes.TAG:
            name, attributes = values
            if not isinstance(name, str) or not isinstance(attributes, dict):
                raise CommandError("SetChannelAttributes is [tag, name, {attribute: value}]")
            return SetChannelAttributes(name, attributes)
        if tag == SetQueueHealth.TAG:
            name, incarnation, reason, detail, since_ms = values
            if not (isinstance(name, str) and type(incarnation) is int and isinstance(reason, str)
                    and isinstance(detail, str) and type(since_ms) is int):
                raise CommandError("SetQueueHealth is [tag, name, incarnation, reason, detail, since_ms]")
            return SetQueueHealth(name, incarnation, reason, detail, since_ms)
        return COMMAND_TYPES[tag](*values)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise CommandError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What applying one command (or one change of a batch) did."""
    name: str
    applied: bool
    reason: str = ""
