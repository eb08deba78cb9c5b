"""Typed replication messages between the two members of a queue pair, and their one codec.

Every message names the queue, its incarnation and the sender's epoch (fencing: a member
refuses anything from an older epoch: docs/ARCHITECTURE.md, "Queue pairs"). Encoded as msgpack
`[PROTOCOL_VERSION, tag, field, ...]`; tags are fixed, never reused, only added. Operations
travel in log entries: a run of consecutive replicated operations, encoded together by
`encode_entry`, which is also what the rolling digest hashes and the op log stores, so both
members digest and log byte-identical records, one per entry (not one per operation).

The flows (seed 004 FIG. 21-22, with ordering-index acknowledgements):
    master -> replica   Append(entries, commit_order)  every replicated operation, in order, in entries
    replica -> master   AppendAck(ordering=0, durable_order)   what the replica holds durably
    replica -> master   Open(last_epoch, last_order, digest, committed_order)   a (re)joining replica
    master -> replica   SyncBegin(from_order) · Append... · SyncEnd(order, digest)   what it lacks, from the log
                  or    SyncBegin(snapshot at S) · SnapshotChunk... (last: digest at S, state hash)
                        · Append after S... · SyncEnd(order, digest)      the queue's state at S
    replica -> master   SnapshotAck(sequence)          a chunk was taken (flow control)
    replica -> master   OpenAck(order)                 it matched the master's digest
    replica -> master   RelayRequest(request_id, request)   a client's operation received at the replica
    master -> replica   RelayResult(request_id, outcomes)   the orders that place it
    either              Refused(code, message)         fenced (older epoch), unknown queue, ...
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from replication.operations import OPERATION_TYPES, Operation
from wire.versions import REPLICATION_PROTOCOL

PROTOCOL_VERSION = 8       # 8: durable subscriptions' operations (SubscriptionOpened, SubscriberAcked, SubscriptionDropped)
                           # 7: Enqueued.ttl_ms, Expired, DeadLettered.expired and .leased, a snapshot message row's ttl_ms.
# 2: snapshots (SyncBegin.snapshot, SnapshotChunk, SnapshotAck), Open.committed_order
                           # 3: a snapshot resumed after a broken link (Open.snapshot_*, SyncBegin.resume_after)
                           # 4: Append carries log entries (runs of operations), not single operations
                           # 5: SnapshotChunk carries its rows encoded once (what the content hash folds)
                           # 6: a Leased operation and a snapshot's lease carry the lease's duration;
                           #    Extended operations (a lease given a new duration), Purged operations
_OPERATION_FIELDS = {tag: tuple(f.name for f in fields(kind)) for tag, kind in OPERATION_TYPES.items()}
# What each field of an operation may hold when it comes from a peer (bool is an int too, and
# msgpack gives bools where ints were sent only if a bool was sent).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "bool": (bool,), "str": (str,), "bytes": (bytes,),
                                             "str | None": (str, type(None)), "bytes | None": (bytes, type(None)),
                                             "dict[str, str] | None": (dict, type(None))}
# Every shape a well-formed row may have, as the tuple of its values' types: one C-level
# lookup per operation on the replica's hot path instead of a check per field.
_OPERATION_SHAPES = {tag: frozenset((int, *shape) for shape in itertools.product(
    *(_FIELD_TYPES[str(f.type)] for f in fields(kind)))) for tag, kind in OPERATION_TYPES.items()}
# One C call reads an operation's fields in order (packed as [tag, fields...]).
_OPERATION_GETTERS = {kind: (tag, operator.attrgetter(*_OPERATION_FIELDS[tag])) for tag, kind in OPERATION_TYPES.items()}


class MessageError(ValueError):
    """Bytes from a peer that are not a well-formed message of this protocol version."""


def encode_entry(ops: list[Operation]) -> bytes:
    """One log entry: the operations of a run, in order (at least one)."""
    getters = _OPERATION_GETTERS
    rows = []
    for op in ops:
        tag, getter = getters[type(op)]
        rows.append((tag, *getter(op)))
    return msgpack.packb(rows, use_bin_type=True)


def decode_entry(data: bytes) -> list[Operation]:
    try:
        rows = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(rows, list) or not rows:
        raise MessageError("a log entry is a non-empty list of operations")
    return [_operation_from_row(row) for row in rows]


def _operation_from_row(row: Any) -> Operation:
    if not isinstance(row, list) or not row or type(row[0]) is not int or row[0] not in OPERATION_TYPES:
        raise MessageError("an operation is [tag, fields...]")
    if tuple(map(type, row)) not in _OPERATION_SHAPES[row[0]]:
        names = _OPERATION_FIELDS[row[0]]
        raise MessageError(f"operation {row[0]} has {len(names)} fields ({', '.join(names)}) of other types")
    return OPERATION_TYPES[row[0]](*row[1:])  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Append:
    TAG: ClassVar[int] = 1
    queue: str
    incarnation: int
    epoch: int
    prev_order: int            # the ordering index of the op sent just before these (gap check)
    entries: tuple[bytes, ...]  # encoded log entries (encode_entry): logged and digested as is
    commit_order: int          # the master's commit point, so the replica may expose up to it
    # The commit point the master's own storage has recorded (a master restarted after a crash
    # follows on from it): the replica keeps its op log from there, so that if it is promoted,
    # the returning member catches up from the log instead of by snapshot.
    recorded_commit: int = 0


@dataclass(frozen=True, slots=True)
class AppendAck:
    TAG: ClassVar[int] = 2
    queue: str
    incarnation: int
    epoch: int
    ordering: int              # always 0: an acknowledgement is not itself ordered (seed 004)
    durable_order: int         # the highest ordering index the replica holds durably
    gap: bool = False          # the replica saw a gap: resend everything after durable_order
    session: int = 0           # the Open this answers to: older sessions' acks are ignored


@dataclass(frozen=True, slots=True)
class Open:
    TAG: ClassVar[int] = 3
    queue: str
    incarnation: int
    epoch: int
    last_epoch: int
    last_order: int
    digest: bytes
    session: int = 0           # new for every Open; echoed by SyncBegin, AppendAck and OpenAck
    # The highest order it holds that it knows was committed: when it is `last_order`, its
    # history is a prefix of the master's (committed operations are never undone), so a
    # `producer` member behind the log's start may keep its own consumption state.
    committed_order: int = 0
    # A snapshot it was taking when its link broke: its order and the last chunk it holds
    # (0, 0: none). The master continues it from the same read view if it still holds it.
    snapshot_order: int = 0
    snapshot_received: int = 0


@dataclass(frozen=True, slots=True)
class SyncBegin:
    TAG: ClassVar[int] = 4
    queue: str
    incarnation: int
    epoch: int
    from_order: int
    reset: bool                # start from an empty queue (new, wiped or diverged member)
    record: dict[str, Any] | None = None   # the queue record to start from when reset
    session: int = 0
    # The queue's state at `snapshot_order` follows in SnapshotChunks instead of the log:
    # the member's position is behind the log's start, or its history differs.
    snapshot: bool = False
    snapshot_order: int = 0
    keep_upto: int = 0         # `producer`: the member keeps its own state up to here (reset is False)
    resume_after: int = 0      # the snapshot at snapshot_order goes on after this chunk (its Open's)


@dataclass(frozen=True, slots=True)
class SyncEnd:
    TAG: ClassVar[int] = 5
    queue: str
    incarnation: int
    epoch: int
    order: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    """master -> replica: part of a queue's state at one order, from one read view.
    Rows (see replication.snapshot): messages of the queue, dedupe entries and, under `full`,
    the dead-letter queue's messages. The last chunk vouches for the whole transfer."""
    TAG: ClassVar[int] = 17
    queue: str
    incarnation: int
    epoch: int
    session: int
    sequence: int              # 1, 2, ...: a chunk out of sequence is dropped (resent)
    rows: bytes                # the rows, msgpack-encoded (replication.snapshot.encode_rows)
    last: bool = False
    order: int = 0             # on the last chunk: the snapshot's order, digest and content hash
    digest: bytes = b""
    state_hash: bytes = b""
    dead_letter: list[Any] | None = None   # on the last chunk, `full`: [order, digest, record] of the dead-letter queue


@dataclass(frozen=True, slots=True)
class SnapshotAck:
    TAG: ClassVar[int] = 18
    queue: str
    incarnation: int
    epoch: int
    session: int
    sequence: int


@dataclass(frozen=True, slots=True)
class OpenAck:
    TAG: ClassVar[int] = 6
    queue: str
    incarnation: int
    epoch: int
    order: int
    session: int = 0


@dataclass(frozen=True, slots=True)
class RelayRequest:
    TAG: ClassVar[int] = 7
    queue: str
    incarnation: int
    epoch: int
    request_id: int
    request: list[Any]         # [kind, args...]: see qserver.cluster.relay.relayed_request


@dataclass(frozen=True, slots=True)
class RelayResult:
    TAG: ClassVar[int] = 8
    queue: str
    incarnation: int
    epoch: int
    request_id: int
    outcomes: list[Any]        # per item: an ordering index, or [code, message]


@dataclass(frozen=True, slots=True)
class Refused:
    TAG: ClassVar[int] = 9
    queue: str
    incarnation: int
    epoch: int                 # the refusing member's epoch: a fenced sender learns it
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Create:
    """master -> replica: hold an instance of this queue (idempotent; repeated on reconnect)."""
    TAG: ClassVar[int] = 10
    queue: str
    incarnation: int
    epoch: int
    record: dict[str, Any]     # the master's queue record: name, options, created_ms


@dataclass(frozen=True, slots=True)
class Delete:
    """master -> replica: drop this incarnation of the queue."""
    TAG: ClassVar[int] = 11
    queue: str
    incarnation: int
    epoch: int


@dataclass(frozen=True, slots=True)
class HandoffRequest:
    """replica -> master: please hand mastership to me (seed 004 FIG. 24)."""
    TAG: ClassVar[int] = 12
    queue: str
    incarnation: int
    epoch: int
    request_id: int


@dataclass(frozen=True, slots=True)
class HandoffAnswer:
    """master -> replica: the swap committed (accepted) or the request was refused, and why."""
    TAG: ClassVar[int] = 13
    queue: str
    incarnation: int
    epoch: int
    request_id: int
    accepted: bool
    reason: str


@dataclass(frozen=True, slots=True)
class HandoffOrder:
    """any node -> master: an operator asked (rebalance): hand this queue to its replica."""
    TAG: ClassVar[int] = 16
    queue: str
    incarnation: int
    epoch: int


# Node-level messages on the same links (queue "", incarnation: the sender's storage id): the lease of a node from
# the membership leader (docs/ARCHITECTURE.md, "Membership"); `epoch` carries the leader's term.
@dataclass(frozen=True, slots=True)
class LeaseRenew:
    """node -> membership leader: renew my lease (counted from when I sent this)."""
    TAG: ClassVar[int] = 14
    queue: str
    incarnation: int
    epoch: int
    sequence: int


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """membership leader -> node: the renewal `sequence` is granted. It counts once the node's
    copy of the cluster map has applied `map_version` commands, as many as the leader's will
    have once it applies what its log holds: a node restarted or cut off on a stale map must
    not act on roles that changed, or are changing, meanwhile."""
    TAG: ClassVar[int] = 15
    queue: str
    incarnation: int
    epoch: int
    sequence: int
    map_version: int


Message = (Append | AppendAck | Open | SyncBegin | SyncEnd | OpenAck | RelayRequest | RelayResult | Refused | Create
           | Delete | HandoffRequest | HandoffAnswer | HandoffOrder | LeaseRenew | LeaseGrant | SnapshotChunk
           | SnapshotAck)
MESSAGE_TYPES: dict[int, type] = {kind.TAG: kind for kind in (Append, AppendAck, Open, SyncBegin, SyncEnd, OpenAck,
                                                              RelayRequest, RelayResult, Refused, Create, Delete,
                                                              HandoffRequest, HandoffAnswer, HandoffOrder, LeaseRenew,
                                                              LeaseGrant, SnapshotChunk, SnapshotAck)}
_MESSAGE_FIELDS = {tag: tuple(f.name for f in fields(kind)) for tag, kind in MESSAGE_TYPES.items()}


def encode_message(message: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """`version`: the one negotiated with the peer's link (qserver/transport/peers.py, `version`;
    docs/PROTOCOL.md, "Versions and negotiation"). Version 8 is the only one so far: a release
    that adds 9 writes a 9-only field here only when `version` >= 9."""
    if not REPLICATION_PROTOCOL.low <= version <= REPLICATION_PROTOCOL.high:
        raise ValueError(f"replication protocol {version} is outside {REPLICATION_PROTOCOL.render()}")
    row: list[Any] = [version, message.TAG]
    for name in _MESSAGE_FIELDS[message.TAG]:
        value = getattr(message, name)
        row.append(list(value) if name == "entries" else value)
    return msgpack.packb(row, use_bin_type=True)


def decode_message(data: bytes) -> Message:
    try:
        row = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(row, list) or len(row) < 2:
        raise MessageError("a message is [version, tag, fields...]")
    # Every version of this node's range is read (a peer encodes with the negotiated one).
    if type(row[0]) is not int or not REPLICATION_PROTOCOL.low <= row[0] <= REPLICATION_PROTOCOL.high:
        raise MessageError(f"unsupported replication protocol {row[0]!r}; this node speaks "
                           f"{REPLICATION_PROTOCOL.render()}")
    kind = MESSAGE_TYPES.get(row[1]) if type(row[1]) is int else None
    if kind is None:
        raise MessageError(f"unknown message tag {row[1]!r}")
    names = _MESSAGE_FIELDS[row[1]]
    values = row[2:]
    if len(values) != len(names):
        raise MessageError(f"message {kind.__name__} has {len(names)} fields")
    arguments = dict(zip(names, values, strict=True))
    if "entries" in arguments:
        entries = arguments["entries"]
        if not isinstance(entries, list) or not all(isinstance(entry, bytes) for entry in entries):
            raise MessageError("entries are encoded log entries")
        arguments["entries"] = tuple(entries)
    try:
        return kind(**arguments)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise MessageError(str(exc)) from None
