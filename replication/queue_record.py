"""A queue's persisted record: its identity, counters, durable subscriptions and numbered
streams, and its JSON as storage, snapshots and the journal hold it.

Apart from the queue core (replication/queue_core.py), which changes a record, because the
record is also what storage loads and writes (qserver/storage/) and what a snapshot carries:
they read this format without the core's decisions. Its JSON is a storage format: a field is
added with a default and a removed one is still read (see `from_json`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replication.options import QueueOptions, QueueState, options_from_json


@dataclass(slots=True)
class QueueRecord:
    """A queue's persisted identity and counters; written in every batch that touched it."""
    queue_id: int          # the incarnation: a new id each time a name is (re)created
    name: str
    options: QueueOptions
    created_ms: int
    next_index: int = 1
    epoch: int = 1
    state: QueueState = QueueState.UNKNOWN
    ready_count: int = 0
    delayed_count: int = 0     # messages waiting for their delivery delay (not ready yet)
    dead_letter_of: str | None = None
    total_enqueued: int = 0
    total_acked: int = 0
    total_dead_lettered: int = 0
    total_purged: int = 0
    total_expired: int = 0     # messages whose time to live ran out (dropped or dead-lettered)
    total_redelivered: int = 0
    highest_depth: int = 0
    service_ms_total: int = 0
    service_count: int = 0
    incarnation: int = 0     # the queue's identity across the cluster (0: a single node's queue)
    # The pair's commit point as this member knew it when the batch was sealed (written with
    # every batch that touches the queue, so it covers every message consumed here): a member
    # restarted after a crash drops what it holds past it (discard_after). 0: not known.
    commit_order: int = 0
    # Durable subscriptions of a channel's queue: name -> [floor, acked]. Every message of the
    # subscription's backlog with index <= floor is acknowledged (it began at floor, its
    # SubscriptionOpened's ordering index); `acked` lists those above the floor acknowledged out
    # of order. Queue state, so it travels with the record: every batch, restart and snapshot.
    subscriptions: dict[str, list[Any]] = field(default_factory=dict)
    # Numbered streams of producers (SEQUENCE_KEY_HEADER): key -> [floor, {number: message id}]:
    # every number below the floor is settled, and those kept (at or above it) are stored. A
    # message whose number is either is a repeat, not stored again.
    sequences: dict[str, list[Any]] = field(default_factory=dict)
    # Streams changed since the record was last sealed for storage: the store keeps each stream
    # in a row of its own (LMDB `streams`), written when it changes, not with every batch that
    # touches the queue (a queue's producers may number many). Not part of the record's JSON.
    changed_streams: set[str] = field(default_factory=set, compare=False, repr=False)

    def to_json(self, *, streams: bool = True) -> dict[str, Any]:
        """The record as JSON; `streams=False`: without its streams (stored apart, see
        `changed_streams`), as every batch that touches the queue writes it."""
        # Written with every batch that touches the queue: a plain copy of the fields, not
        # dataclasses.asdict (which deep-copies recursively and cost ~100 µs of each commit).
        out = {name: getattr(self, name) for name in self.__slots__ if name != "changed_streams"}
        out["options"] = self.options.to_json()
        out["state"] = self.state.value
        if self.subscriptions:      # packed later, off the engine's task: a copy, not the live lists
            out["subscriptions"] = {name: [floor, list(acked)] for name, (floor, acked) in self.subscriptions.items()}
        del out["sequences"]
        if streams and self.sequences:
            out["sequences"] = {key: self.stream_json(key) for key in self.sequences}
        return out

    def stream_json(self, key: str) -> list[Any] | None:
        """One stream as stored ([floor, [[number, id], ...]]), None when the record has none."""
        stream = self.sequences.get(key)
        return None if stream is None else [stream[0], [[number, index] for number, index in stream[1].items()]]

    def take_changed_streams(self) -> list[tuple[str, list[Any] | None]]:
        """The streams changed since the last call, as stored (None: gone), for the batch being sealed."""
        changed = [(key, self.stream_json(key)) for key in sorted(self.changed_streams)]
        self.changed_streams.clear()
        return changed

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> QueueRecord:
        fields = {**raw, "options": options_from_json(raw["options"]), "state": QueueState(raw["state"])}
        fields.pop("sequences", None)
        # Records stored before issue 33 carry `in_sync`, which nothing read (the map's entry
        # says whether a replica is in sync): it is dropped when read, and gone from the next write.
        fields.pop("in_sync", None)
        record = cls(**fields)
        # Streams come with a record in a snapshot or the journal; a stored one (layout 8) has
        # none: they are in rows of their own (qserver/storage/rows.py), which the store adds.
        record.sequences = sequences_from_json(raw.get("sequences", {}))
        return record


def sequences_from_json(raw: dict[str, Any]) -> dict[str, list[Any]]:
    """Streams as stored ([floor, [[number, id], ...]]); a record written before floors
    ([highest number, its id]) reads as that number's floor with it stored."""
    out: dict[str, list[Any]] = {}
    for key, (floor, stored) in raw.items():
        pairs = [(floor, stored)] if isinstance(stored, int) else stored
        out[str(key)] = [int(floor), {int(number): int(index) for number, index in pairs}]
    return out
