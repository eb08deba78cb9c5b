"""The Raft log as one node holds it: a snapshot, then the entries after it, and the
configurations those entries carry.

It also remembers what changed since the node last handed its changes out in a `Ready`:
the lowest index it appended or rewrote (`unpersisted_from`) and the last index the disk
holds (`persisted_last_index`). A rewrite below the latter is a truncation the driver must
make in the same transaction as the entries that replace it, so a crash never leaves a
truncated log without its new entries (pysyncobj's third hole).

Entries at or below the commit index are never truncated: an attempt is a broken invariant.
Terms never decrease along a log, which lets the conflict search bisect.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

from replication.invariants import InvariantViolation
from replication.raft_messages import Configuration, Entry, EntryKind, Snapshot


def _entry_term(entry: Entry) -> int:
    return entry.term


class RaftLog:
    __slots__ = ("_snapshot", "_entries", "_configurations", "_unpersisted_from", "_persisted_last_index")

    def __init__(self, snapshot: Snapshot, entries: Sequence[Entry]) -> None:
        self._snapshot = snapshot
        self._entries: list[Entry] = list(entries)
        for offset, entry in enumerate(self._entries):
            if entry.index != snapshot.index + 1 + offset:
                raise InvariantViolation(f"log entries not contiguous after snapshot {snapshot.index}: {entry.index}")
        # (index, configuration) of every configuration entry still in the log, in order.
        self._configurations: list[tuple[int, Configuration]] = [
            (entry.index, entry.configuration) for entry in self._entries if entry.configuration is not None]
        self._unpersisted_from: int | None = None
        self._persisted_last_index = self.last_index

    # --- reading ----------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def first_index(self) -> int:
        """The first index held as an entry (the snapshot covers everything before it)."""
        return self._snapshot.index + 1

    @property
    def last_index(self) -> int:
        return self._snapshot.index + len(self._entries)

    @property
    def last_term(self) -> int:
        return self._entries[-1].term if self._entries else self._snapshot.term

    def term_at(self, index: int) -> int | None:
        """The term of the entry at `index`, or None when the log does not know it
        (compacted below the snapshot, or past the end)."""
        offset = index - self._snapshot.index
        if offset == 0:
            return self._snapshot.term
        if 0 < offset <= len(self._entries):
            return self._entries[offset - 1].term
        return None

    def entry(self, index: int) -> Entry:
        if not self._snapshot.index < index <= self.last_index:
            raise InvariantViolation(f"entry {index} is outside the log ({self.first_index}..{self.last_index})")
        return self._entries[index - self._snapshot.index - 1]

    def entries_between(self, first: int, last: int) -> tuple[Entry, ...]:
        """Entries first..last inclusive; all of them must be held."""
        if first > last:
            return ()
        if first <= self._snapshot.index or last > self.last_index:
            raise InvariantViolation(f"entries {first}..{last} are outside the log ({self.first_index}..{self.last_index})")
        base = self._snapshot.index + 1
        return tuple(self._entries[first - base:last - base + 1])

    def entries_for_append(self, first: int, count_max: int, bytes_max: int) -> tuple[Entry, ...]:
        """Entries from `first` on, at most `count_max` of them and `bytes_max` bytes (always at
        least one when any exists: a proposal larger than the byte limit is refused upstream)."""
        base = self._snapshot.index + 1
        candidates = self._entries[first - base:first - base + count_max]
        total = 0
        for count, entry in enumerate(candidates):
            total += entry.size_bytes()
            if total > bytes_max and count > 0:
                return tuple(candidates[:count])
        return tuple(candidates)

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Is a log ending at (last_index, last_term) at least as up to date as this one (§5.4.1)?"""
        own_term = self.last_term
        return last_term > own_term or (last_term == own_term and last_index >= self.last_index)

    def last_at_or_below(self, index: int, term: int) -> tuple[int, int]:
        """The last entry at or below `index` whose term is at most `term`, as (index, term):
        the point a leader and a follower may agree on (fast backtracking). Below the
        snapshot nothing is known: the snapshot's own position is returned."""
        index = min(index, self.last_index)
        if index <= self._snapshot.index:
            return self._snapshot.index, self._snapshot.term
        position = bisect.bisect_right(self._entries, term, 0, index - self._snapshot.index, key=_entry_term)
        if position == 0:
            return self._snapshot.index, self._snapshot.term
        entry = self._entries[position - 1]
        return entry.index, entry.term

    # --- configurations ----------------------------------------------------------------------
    @property
    def configuration(self) -> Configuration:
        """The configuration in force: the last one appended (Raft thesis §4.1)."""
        return self._configurations[-1][1] if self._configurations else self._snapshot.configuration

    @property
    def configuration_index(self) -> int:
        """The index of the entry that carries the configuration in force (the snapshot's
        index when it came with the snapshot)."""
        return self._configurations[-1][0] if self._configurations else self._snapshot.index

    def configuration_at(self, index: int) -> Configuration:
        """The configuration in force at `index` (at or after the snapshot)."""
        for entry_index, configuration in reversed(self._configurations):
            if entry_index <= index:
                return configuration
        return self._snapshot.configuration

    # --- changing ----------------------------------------------------------------------------
    def append(self, entry: Entry) -> None:
        if entry.index != self.last_index + 1:
            raise InvariantViolation(f"appending entry {entry.index} after {self.last_index}")
        if self._entries and entry.term < self._entries[-1].term:
            raise InvariantViolation(f"entry {entry.index} of term {entry.term} after term {self._entries[-1].term}")
        self._entries.append(entry)
        if entry.kind is EntryKind.CONFIGURATION and entry.configuration is not None:
            self._configurations.append((entry.index, entry.configuration))
        if self._unpersisted_from is None:
            self._unpersisted_from = entry.index

    def merge(self, entries: Sequence[Entry], commit_index: int) -> int:
        """A follower takes a leader's entries whose predecessor it holds: it skips those it
        already holds with the same term, truncates from the first whose term differs (never
        an entry that matches) and appends the rest. Returns the number of entries removed."""
        for position, entry in enumerate(entries):
            own_term = self.term_at(entry.index)
            if own_term == entry.term:
                continue
            removed = 0
            if own_term is not None:
                removed = self.truncate_from(entry.index, commit_index)
            for new_entry in entries[position:]:
                self.append(new_entry)
            return removed
        return 0

    def truncate_from(self, index: int, commit_index: int) -> int:
        """Drop every entry from `index` on; returns how many. Committed entries never go."""
        if index <= commit_index:
            raise InvariantViolation(f"truncating from {index} would remove committed entries (commit {commit_index})")
        if index <= self._snapshot.index:
            raise InvariantViolation(f"truncating from {index} below the snapshot at {self._snapshot.index}")
        removed = self.last_index - index + 1
        del self._entries[index - self._snapshot.index - 1:]
        while self._configurations and self._configurations[-1][0] >= index:
            self._configurations.pop()
        if self._unpersisted_from is None or index < self._unpersisted_from:
            self._unpersisted_from = index
        return removed

    def compact(self, snapshot: Snapshot) -> None:
        """The application's own snapshot: entries it covers leave the log."""
        if not self._snapshot.index < snapshot.index <= self.last_index:
            raise InvariantViolation(f"compacting to {snapshot.index} outside {self.first_index}..{self.last_index}")
        del self._entries[:snapshot.index - self._snapshot.index]
        self._configurations = [(index, configuration) for index, configuration in self._configurations
                                if index > snapshot.index]
        self._snapshot = snapshot

    def install(self, snapshot: Snapshot) -> None:
        """A leader's snapshot replaces the whole log; the driver empties the durable log in
        the same transaction, so nothing written before is left behind it."""
        self._snapshot = snapshot
        self._entries = []
        self._configurations = []
        self._unpersisted_from = None
        self._persisted_last_index = snapshot.index

    # --- what the disk must catch up with -----------------------------------------------------
    def has_unpersisted(self) -> bool:
        return self._unpersisted_from is not None

    def unpersisted(self) -> tuple[int | None, tuple[Entry, ...]]:
        """(truncate_from, entries): what to delete from the durable log (None: nothing) and
        the entries to write after it, as one unit."""
        start = self._unpersisted_from
        if start is None:
            return None, ()
        entries = self.entries_between(start, self.last_index)
        truncate_from = start if start <= self._persisted_last_index else None
        return truncate_from, entries

    def mark_persisted(self) -> None:
        """The driver wrote what `unpersisted` returned."""
        self._unpersisted_from = None
        self._persisted_last_index = self.last_index
