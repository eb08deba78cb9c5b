"""Map commands the pair driver proposes on its own: recording a replica in or out of sync, and
asking a new epoch for the masters restarted here.

Separate from the pair driver because it is about the membership layer, not the roles: batching
many records into one command, pacing the asks, and bringing each decision back onto the core's
task (`Scheduler.invoke`), where the driver settles it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from qserver.cluster.view import ClusterView
from qserver.core.ports import Scheduler
from replication.cluster_map import ChangePair, ChangePairs, Outcome, Reason

Decided = Callable[[list[Outcome] | None], None]
NEW_EPOCH_ASK_INTERVAL_MS = 200  # how often restarted masters ask again for their new epochs
IN_SYNC_CHANGES_MAX = 500       # in-sync records per map command (see _propose_in_sync_changes)


class MapProposals:
    def __init__(self, view: ClusterView, scheduler: Scheduler, node_id: str) -> None:
        self.view = view
        self.scheduler = scheduler
        self.node_id = node_id
        self._in_sync_changes: list[tuple[ChangePair, Decided]] = []   # to propose at the end of this turn
        self._next_epoch_ask_ms = 0
        self._epoch_ask_pending = False

    def propose_in_sync(self, change: ChangePair, decided: Decided) -> None:
        """Record a replica in (or out of) sync: at the end of this turn of the loop, with the
        other records asked for in it (at once outside a loop: a unit test)."""
        membership = self.view.membership
        if membership is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:          # a driver outside a loop (a unit test): at once
            membership.propose(change, decided)
            return
        if not self._in_sync_changes:
            loop.call_soon(self._propose_in_sync_changes)
        self._in_sync_changes.append((change, decided))

    def _propose_in_sync_changes(self) -> None:
        """The in-sync records asked for in one turn of the loop, in one map command per
        IN_SYNC_CHANGES_MAX (ChangePairs: each change decided on its own): when a node dies,
        every master whose replica it held records it out of sync at about the same moment,
        and 2,000 commands of one change each held the membership layer, and the failover
        behind them, for 20 s (issue 31)."""
        batch, self._in_sync_changes = self._in_sync_changes, []
        membership = self.view.membership
        if membership is None:
            return
        for start in range(0, len(batch), IN_SYNC_CHANGES_MAX):
            part = batch[start:start + IN_SYNC_CHANGES_MAX]
            if len(part) == 1:
                membership.propose(*part[0])
                continue

            def decided(outcomes: list[Outcome] | None, part: list[Any] = part) -> None:
                for position, (_, done) in enumerate(part):
                    done(None if outcomes is None else outcomes[position:position + 1])
            membership.propose(ChangePairs(tuple(change for change, _ in part)), decided)

    def ask_new_epochs(self, restarted: Mapping[str, int], mono_ms: int) -> None:
        """Propose a new epoch, same members, replica out of sync, for each master restarted
        here (`restarted`: queue -> the epoch it restarted in; one command for all of them, one
        at a time). A compare-and-set: if the map moved on meanwhile (a failover), it fails, and
        the change of role the map brings ends the wait."""
        membership = self.view.membership
        if not restarted or membership is None or self._epoch_ask_pending or mono_ms < self._next_epoch_ask_ms:
            return
        self._next_epoch_ask_ms = mono_ms + NEW_EPOCH_ASK_INTERVAL_MS
        changes = []
        for name, epoch in restarted.items():
            entry = self.view.entry(name)
            if entry is not None and entry.master == self.node_id and entry.epoch == epoch:
                changes.append(ChangePair(name, (epoch, self.node_id, entry.replica, entry.in_sync),
                                          (epoch + 1, self.node_id, entry.replica, False), Reason.RESTARTED_MASTER.value))
        if not changes:
            return
        self._epoch_ask_pending = True

        def decided(outcomes: list[Outcome] | None) -> None:
            self.scheduler.invoke(lambda now_ms: setattr(self, "_epoch_ask_pending", False))
        membership.propose(changes[0] if len(changes) == 1 else ChangePairs(tuple(changes)), decided)
