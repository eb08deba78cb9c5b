"""Ordering indices of one stream: each once, in increasing order, without a gap; epoch
records give a stream its base and explain a discarded suffix. Apart from the message states
(audit/checks/messages.py): indices say whether the member's history is whole, messages what
happened to each message in it.

A member that took a queue's state by snapshot journals each message it took over as
`snapshot` or `snapshot_lease` (index 0), then an epoch record with reason `snapshot` whose
index is the snapshot's order (replication/journal.py): its stream goes on from there, without
a gap, holding those messages.
"""
from __future__ import annotations

from typing import Any

from audit.checks.replay import StreamReplay
from audit.checks.units import ARRIVAL_OP
from audit.checks.violations import (
    DISCARDED_SUFFIX,
    INDEX_GAP,
    INDEX_OUT_OF_ORDER,
    INDEX_REPEATED,
    AuditSettings,
    violation,
)
from replication.journal import RESTART_REASON, SNAPSHOT_REASON, JournalRecord


class Continuity:
    """Ordering indices of one stream: each one once, in increasing order, without a gap.

    An epoch record names the last index the member held when it took its role: records of
    an *older* epoch above it were discarded (a suffix that was never committed, replaced in
    the new epoch), and after a restart those of its own epoch too. Storage journals such a
    record where it happened among its transaction's operations; journals written before
    that have it after them, so records of the new epoch may lie above its base (see step)."""

    def __init__(self, replay: StreamReplay, settings: AuditSettings) -> None:
        self.replay, self.settings = replay, settings
        self.high: int | None = None
        self.missing: list[list[Any]] = []      # [first, last, record after the gap]
        self.high_by_epoch: dict[int, int] = {}   # highest index of each epoch's records (not derived ones)

    def base(self, record: JournalRecord) -> None:
        base, epoch = record.index, record.epoch
        if self.high is None:
            self.high = base
            self.replay.first_index = base + 1
            return
        if record.dedupe_id == SNAPSHOT_REASON:
            # The member took the queue's state at `base`: what lies between is in that state.
            self.missing = [gap for gap in self.missing if gap[0] <= base]
            self.high = max(self.high, base)
            return
        # A member restarted after a crash drops what it held past the commit point it had
        # recorded, of its own epoch too (a `producer` member's never visible, never committed
        # suffix); its mark is journaled before anything it did after the restart.
        restart = record.dedupe_id == RESTART_REASON
        discarded = [older for older in self.high_by_epoch if older < epoch or restart and older == epoch]
        stale = max((self.high_by_epoch[older] for older in discarded), default=base)
        if stale > base:
            what = "held past the commit point discarded when the member restarted in" if restart else \
                "of an older epoch discarded when the member took its role in"
            self.replay.flags.append({"kind": DISCARDED_SUFFIX, "queue": self.replay.queue, "node": self.replay.node,
                                      "epoch": epoch, "first": base + 1, "last": stale,
                                      "detail": f"indices {base + 1}..{stale} {what} epoch {epoch} (never committed)"})
            self.missing = [gap for gap in self.missing if gap[0] <= base]
            for older in discarded:
                self.high_by_epoch[older] = min(self.high_by_epoch[older], base)
            self.high = max([base, *(high for newer, high in self.high_by_epoch.items() if newer >= epoch)])
        elif base > self.high:
            self.missing.append([self.high + 1, base, record])
            self.high = base

    def step(self, record: JournalRecord) -> None:
        index = record.index
        high = self.high
        if record.op != ARRIVAL_OP:
            self.high_by_epoch[record.epoch] = index
        if high is None:
            self.replay.first_index = 1 if self.replay.complete else index
            high = 0 if self.replay.complete else index - 1
        if index == high + 1:
            self.high = index
        elif index > high:
            self.missing.append([high + 1, index - 1, record])
            self.high = index
        elif self._fill(index):
            self.replay.found.append(violation(
                INDEX_OUT_OF_ORDER, self.replay.queue, f"index {index} journaled after index {high}",
                node=self.replay.node, index=index, message_id=record.message_id, records=[record],
                settings=self.settings))
            self.high = high
        elif any(older < record.epoch and older_high >= index for older, older_high in self.high_by_epoch.items()):
            # A newer epoch's record at an index an older epoch's suffix used, journaled before
            # its transaction's epoch record (storage writes that one last): the member took its
            # role with its suffix discarded, from index - 1 at most.
            self.base(record._replace(index=index - 1))
        else:
            self.replay.found.append(violation(
                INDEX_REPEATED, self.replay.queue, f"index {index} journaled again", node=self.replay.node,
                index=index, message_id=record.message_id, records=[record], settings=self.settings))
            self.high = high

    def _fill(self, index: int) -> bool:
        for position, (first, last, after) in enumerate(self.missing):
            if first <= index <= last:
                parts = [[first, index - 1, after]] if first < index else []
                parts += [[index + 1, last, after]] if index < last else []
                self.missing[position:position + 1] = parts
                return True
        return False

    def finish(self) -> None:
        self.replay.last_index = self.high or 0
        for first, last, after in self.missing:
            what = f"index {first}" if first == last else f"indices {first}..{last}"
            self.replay.found.append(violation(
                INDEX_GAP, self.replay.queue, f"{what} missing before this record", node=self.replay.node,
                index=first, records=[after], settings=self.settings))
