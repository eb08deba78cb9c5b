"""What one member's replayed stream shows (`StreamReplay`) and the states a message goes
through in it. The state that audit/checks/indexes.py (ordering indices) and
audit/checks/messages.py (message lives) fill in as audit/checks/streams.py walks the records,
and that the group checks read: a module of its own so that those three share it without
importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from audit.checks.units import StreamKey
from replication.journal import JournalRecord

READY, LEASED, DELAYED, ACKED, DEAD, PURGED, EXPIRED = 1, 2, 3, 4, 5, 6, 7     # from ACKED on: consumed
CONSUMED_COUNTS = {ACKED: "acked", DEAD: "dead_lettered", PURGED: "purged", EXPIRED: "expired"}
TAKING_OPS = {"dead_letter": DEAD, "purge": PURGED, "ttl_expire": EXPIRED}   # ready or leased -> gone
TAKEN_STATES = frozenset(TAKING_OPS.values())


@dataclass
class StreamReplay:
    """What one member's records of one queue instance show, replayed in journal order."""
    key: StreamKey
    queue: str
    complete: bool                              # the journal holds every record from sequence 1
    first_index: int | None = None              # first ordering index the stream covers
    last_index: int = 0
    records: int = 0
    last_sequence: int = 0
    enqueued: dict[int, JournalRecord] = field(default_factory=dict)   # message id -> enqueue/arrival
    states: dict[int, int] = field(default_factory=dict)
    leased_ids: set[int] = field(default_factory=set)
    master_epochs: set[int] = field(default_factory=set)
    consumption: int = 0                        # consumption records
    consumption_replicated: int = 0             # ... of which carry an ordering index (`full`)
    redeliveries: list[tuple[int, str]] = field(default_factory=list)   # (at_ms, cause)
    consumed_times: list[int] = field(default_factory=list)             # acks and dead-letterings
    epoch_records: list[JournalRecord] = field(default_factory=list)
    # A channel queue's durable subscriptions: name -> [the index it opened at (None: opened
    # before this stream began, e.g. in a snapshot's state), message ids it acknowledged].
    subscriptions: dict[str, list[Any]] = field(default_factory=dict)
    # epoch -> [first at_ms, records, first record written as master (or None), reason of an epoch record]
    epochs: dict[int, list[Any]] = field(default_factory=dict)
    found: list[dict[str, Any]] = field(default_factory=list)
    flags: list[dict[str, Any]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.key[0]

    def final_counts(self) -> dict[str, int]:
        counts = {"enqueued": len(self.enqueued), "acked": 0, "dead_lettered": 0, "purged": 0, "expired": 0,
                  "queued": 0, "leased": 0}
        for state in self.states.values():
            if state >= ACKED:
                counts[CONSUMED_COUNTS[state]] += 1
            else:
                counts["queued"] += 1
                counts["leased"] += state == LEASED
        return counts

    def held(self) -> tuple[set[int], set[int]]:
        """(still held: ready or leased, consumed: acked or dead-lettered) message ids."""
        held: set[int] = set()
        consumed: set[int] = set()
        for message_id, state in self.states.items():
            (consumed if state >= ACKED else held).add(message_id)
        return held, consumed
