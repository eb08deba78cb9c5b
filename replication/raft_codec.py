"""The one codec of the membership layer's values: Raft messages on the wire, and entries,
snapshots and hard state on disk (qserver/storage/lmdb_store.py stores exactly these bytes).

Encoded as msgpack rows. A wire frame is `[PROTOCOL_VERSION, tag, fields...]`; tags are fixed,
never reused, only added. Besides the core's messages (replication/raft_messages.py) the
frame carries the driver's own four (qserver/cluster/membership.py): a node that is not in the
configuration yet asks to join, a follower passes a proposal to the leader and hears where it
landed, and a frame too large for one message (a snapshot of a large map) travels in
`FrameChunk`s. Anything malformed raises `MessageError`: the driver counts it and the transport
drops that link, the node goes on (bad input from a peer is never fatal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from replication.messages import MessageError
from replication.raft_messages import (
    PROTOCOL_VERSION,
    AppendRequest,
    AppendResponse,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    Message,
    PreVoteRequest,
    PreVoteResponse,
    RaftMessage,
    Snapshot,
    SnapshotRequest,
    VoteRequest,
    VoteResponse,
)
from wire.versions import MEMBERSHIP_PROTOCOL

# --- the driver's messages (not the core's: the core never sees them) --------------------------


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A node outside the configuration (new, or back with a new disk) asks to be added."""
    sender: str
    storage_id: bytes
    wants_vote: bool


@dataclass(frozen=True, slots=True)
class ProposeRequest:
    """A follower's command for the leader to propose (`request_id`: the follower's)."""
    sender: str
    request_id: int
    command: bytes


@dataclass(frozen=True, slots=True)
class ProposeResponse:
    """Where the command went: (index, term) of its entry, or the refusal (index 0)."""
    sender: str
    request_id: int
    index: int
    term: int
    refusal: str


@dataclass(frozen=True, slots=True)
class FrameChunk:
    """One piece of a frame too large for one peer message (a snapshot of a large map): the
    driver splits the encoded frame and the receiver joins the pieces of one `transfer`, in
    order, before decoding it (docs/RAFT.md, "Snapshots in chunks")."""
    sender: str
    transfer: int
    sequence: int
    count: int
    data: bytes


DriverMessage = JoinRequest | ProposeRequest | ProposeResponse | FrameChunk
Frame = Message | DriverMessage

_ENTRY_KINDS = {EntryKind.COMMAND: 0, EntryKind.CONFIGURATION: 1, EntryKind.LEADER_START: 2}
_ENTRY_KIND_OF = {tag: kind for kind, tag in _ENTRY_KINDS.items()}


# --- values -------------------------------------------------------------------------------------
def _configuration_row(configuration: Configuration) -> list[Any]:
    return [sorted([m.node_id, m.storage_id] for m in configuration.voters),
            sorted([m.node_id, m.storage_id] for m in configuration.learners)]


def _configuration(row: Any) -> Configuration:
    if not isinstance(row, list) or len(row) != 2:
        raise MessageError("a configuration is [voters, learners]")
    sets = []
    for members in row:
        if not isinstance(members, list) or not all(
                isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], bytes) for m in members):
            raise MessageError("a member is [node id, storage id]")
        sets.append(frozenset(Member(node_id, storage_id) for node_id, storage_id in members))
    try:
        return Configuration(sets[0], sets[1])
    except ValueError as exc:
        raise MessageError(str(exc)) from None


def _entry_row(entry: Entry) -> list[Any]:
    configuration = None if entry.configuration is None else _configuration_row(entry.configuration)
    return [entry.index, entry.term, _ENTRY_KINDS[entry.kind], entry.command, configuration]


def _entry(row: Any) -> Entry:
    if not isinstance(row, list) or len(row) != 5 or not _counts(row[0], row[1]) \
            or row[2] not in _ENTRY_KIND_OF or not isinstance(row[3], bytes):
        raise MessageError("an entry is [index, term, kind, command, configuration]")
    kind = _ENTRY_KIND_OF[row[2]]
    if (kind is EntryKind.CONFIGURATION) != (row[4] is not None):
        raise MessageError("a configuration entry, and only one, carries a configuration")
    return Entry(row[0], row[1], kind, row[3], None if row[4] is None else _configuration(row[4]))


def _snapshot_row(snapshot: Snapshot) -> list[Any]:
    return [snapshot.index, snapshot.term, _configuration_row(snapshot.configuration), snapshot.data]


def _snapshot(row: Any) -> Snapshot:
    if not isinstance(row, list) or len(row) != 4 or not _counts(row[0], row[1]) or not isinstance(row[3], bytes):
        raise MessageError("a snapshot is [index, term, configuration, data]")
    return Snapshot(row[0], row[1], _configuration(row[2]), row[3])


def _counts(*values: Any) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"not msgpack: {type(exc).__name__}") from None


def encode_entry(entry: Entry) -> bytes:
    return msgpack.packb(_entry_row(entry), use_bin_type=True)


def decode_entry(data: bytes) -> Entry:
    return _entry(_unpack(data))


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return msgpack.packb(_snapshot_row(snapshot), use_bin_type=True)


def decode_snapshot(data: bytes) -> Snapshot:
    return _snapshot(_unpack(data))


def encode_hard_state(state: HardState) -> bytes:
    return msgpack.packb([state.term, state.vote, state.commit], use_bin_type=True)


def decode_hard_state(data: bytes) -> HardState:
    row = _unpack(data)
    if not isinstance(row, list) or len(row) != 3 or not _counts(row[0], row[2]) \
            or not (row[1] is None or isinstance(row[1], str)):
        raise MessageError("a hard state is [term, vote, commit]")
    return HardState(row[0], row[1], row[2])


# --- frames -------------------------------------------------------------------------------------
TAGS: dict[type, int] = {PreVoteRequest: 1, PreVoteResponse: 2, VoteRequest: 3, VoteResponse: 4,
                         AppendRequest: 5, AppendResponse: 6, SnapshotRequest: 7,
                         JoinRequest: 20, ProposeRequest: 21, ProposeResponse: 22, FrameChunk: 23}
_TYPES: dict[int, type] = {tag: kind for kind, tag in TAGS.items()}


def encode_frame(message: Frame, version: int = PROTOCOL_VERSION) -> bytes:
    """`version`: the one negotiated with the peer's membership link (docs/PROTOCOL.md, "Versions
    and negotiation"); 1 is the only one so far."""
    if not MEMBERSHIP_PROTOCOL.low <= version <= MEMBERSHIP_PROTOCOL.high:
        raise ValueError(f"membership protocol {version} is outside {MEMBERSHIP_PROTOCOL.render()}")
    tag = TAGS[type(message)]
    if isinstance(message, RaftMessage):
        head: list[Any] = [version, tag, message.term, message.sender, message.recipient,
                           message.sender_storage_id]
        return msgpack.packb(head + _raft_fields(message), use_bin_type=True)
    if isinstance(message, JoinRequest):
        body: list[Any] = [message.sender, message.storage_id, message.wants_vote]
    elif isinstance(message, ProposeRequest):
        body = [message.sender, message.request_id, message.command]
    elif isinstance(message, FrameChunk):
        body = [message.sender, message.transfer, message.sequence, message.count, message.data]
    else:
        body = [message.sender, message.request_id, message.index, message.term, message.refusal]
    return msgpack.packb([version, tag, *body], use_bin_type=True)


def _raft_fields(message: RaftMessage) -> list[Any]:
    if isinstance(message, PreVoteRequest | VoteRequest):
        return [message.last_log_index, message.last_log_term]
    if isinstance(message, PreVoteResponse | VoteResponse):
        return [message.granted]
    if isinstance(message, AppendRequest):
        return [message.previous_index, message.previous_term, [_entry_row(e) for e in message.entries],
                message.leader_commit, message.lease_context]
    if isinstance(message, AppendResponse):
        return [message.success, message.match_index, message.rejected_index, message.hint_index, message.hint_term,
                message.lease_context]
    if isinstance(message, SnapshotRequest):
        return [_snapshot_row(message.snapshot)]
    raise TypeError(f"no codec for {type(message).__name__}")


def decode_frame(data: bytes) -> Frame:
    row = _unpack(data)
    if not isinstance(row, list) or len(row) < 2:
        raise MessageError("a membership frame is [version, tag, fields...]")
    # Every version of this node's range is read (a peer encodes with the negotiated one).
    if type(row[0]) is not int or not MEMBERSHIP_PROTOCOL.low <= row[0] <= MEMBERSHIP_PROTOCOL.high:
        raise MessageError(f"membership protocol version {row[0]!r}; this node speaks {MEMBERSHIP_PROTOCOL.render()}")
    kind = _TYPES.get(row[1]) if type(row[1]) is int else None
    if kind is None:
        raise MessageError(f"unknown membership message tag {row[1]!r}")
    fields = row[2:]
    if kind in (JoinRequest, ProposeRequest, ProposeResponse, FrameChunk):
        return _driver_message(kind, fields)
    if len(fields) < 4 or not _counts(fields[0]) or not isinstance(fields[1], str) \
            or not isinstance(fields[2], str) or not isinstance(fields[3], bytes):
        raise MessageError("a Raft message starts with term, sender, recipient, storage id")
    return _raft_message(kind, fields[:4], fields[4:])


def _raft_message(kind: type, head: list[Any], rest: list[Any]) -> Message:
    term, sender, recipient, storage_id = head
    if kind in (PreVoteRequest, VoteRequest):
        if len(rest) == 2 and _counts(*rest):
            return kind(*head, *rest)  # type: ignore[no-any-return]
    elif kind in (PreVoteResponse, VoteResponse):
        if len(rest) == 1 and isinstance(rest[0], bool):
            return kind(*head, *rest)  # type: ignore[no-any-return]
    elif kind is AppendRequest:
        if len(rest) == 5 and _counts(rest[0], rest[1], rest[3], rest[4]) and isinstance(rest[2], list):
            return AppendRequest(term, sender, recipient, storage_id, rest[0], rest[1],
                                 tuple(_entry(e) for e in rest[2]), rest[3], rest[4])
    elif kind is AppendResponse:
        if len(rest) == 6 and isinstance(rest[0], bool) and _counts(*rest[1:]):
            return AppendResponse(*head, *rest)
    elif kind is SnapshotRequest and len(rest) == 1:
        return SnapshotRequest(term, sender, recipient, storage_id, _snapshot(rest[0]))
    raise MessageError(f"a malformed {kind.__name__}")


def _driver_message(kind: type, fields: list[Any]) -> DriverMessage:
    if not fields or not isinstance(fields[0], str):
        raise MessageError(f"a {kind.__name__} starts with its sender")
    if kind is JoinRequest and len(fields) == 3 and isinstance(fields[1], bytes) and isinstance(fields[2], bool):
        return JoinRequest(*fields)
    if kind is ProposeRequest and len(fields) == 3 and _counts(fields[1]) and isinstance(fields[2], bytes):
        return ProposeRequest(*fields)
    if kind is ProposeResponse and len(fields) == 5 and _counts(*fields[1:4]) and isinstance(fields[4], str):
        return ProposeResponse(*fields)
    if kind is FrameChunk and len(fields) == 5 and _counts(*fields[1:4]) and fields[2] < fields[3] \
            and isinstance(fields[4], bytes):
        return FrameChunk(*fields)
    raise MessageError(f"a malformed {kind.__name__}")
