"""The FAILED state of the queues this node masters (replication/queue_health.py holds the rule):
looked at from the engine's and the pairs' own state, at every description of a queue (its
statistics are never behind) and every LOOK_INTERVAL_S (metrics, the log, since when).

The master is the one that judges: it is the member that refuses the writes. A queue whose
master is gone is not judged here (no node masters it; `qctl status` shows its master down and
the map its replica out of sync); a replica that fail-stopped is noticed by its master like any
replica gone, and under `min_in_sync: 2` the queue reports `replica_unavailable` naming it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from qserver.metrics import render_family
from replication.map_commands import SetQueueHealth
from replication.queue_health import QueueHealth, judge, map_differs
from wire.versions import FEATURES

log = logging.getLogger("qserver.cluster.queue_health")
LOOK_INTERVAL_S = 1.0      # how often every mastered queue is looked at (a few attribute reads each)
# A queue's health goes to the map at most this often per queue (SetQueueHealth): a queue that
# flaps, or refuses a thousand writes a second, costs the membership layer one command a while.
PROPOSE_INTERVAL_S = 2.0


class QueueHealthWatch:
    def __init__(self, engine: Any, wall_ms: Callable[[], int] | None = None) -> None:
        self.engine = engine
        self.wall_ms = wall_ms or (lambda: int(time.time() * 1000))
        self.health = QueueHealth()
        self.failures_total = 0          # times a queue mastered here entered FAILED
        self.recoveries_total = 0        # times one came back to OPEN
        self.proposals_total = 0         # SetQueueHealth commands proposed
        self._proposing: set[str] = set()              # a proposal of theirs is on its way
        self._last_proposed: dict[str, float] = {}     # monotonic s, for PROPOSE_INTERVAL_S

    def _mastered(self) -> dict[str, Any]:
        """name -> its MasterRole here, or None for a queue outside a cluster (mastered alone)."""
        pairs = self.engine.pairs
        if not pairs.clustered:
            return {name: None for name in self.engine.cores}
        return {name: role for name, role in pairs.masters.items() if name in self.engine.cores}

    def _judge(self, name: str, role: Any) -> tuple[str, str] | None:
        core = self.engine.cores.get(name)
        if core is None:
            return None
        return judge(storage_full=self.engine.storage_full, min_in_sync=core.options.min_in_sync,
                     replicated=role is not None and role.replica_id is not None,
                     replica=None if role is None else role.replica_id,
                     replica_in_sync=role is None or role.recorded_in_sync,
                     replica_storage_full=role is not None and role.replica_storage_full)

    def _observe(self, name: str, role: Any, wall_ms: int) -> None:
        change = self.health.observe(name, self._judge(name, role), wall_ms)
        if change == "failed":
            self.failures_total += 1
            failure = self.health.failures[name]
            log.warning("queue %s FAILED (%s): %s", name, failure.reason, failure.detail)
        elif change == "recovered":
            self.recoveries_total += 1
            log.warning("queue %s serves again: OPEN", name)

    def look(self) -> None:
        """Judge every queue mastered here now; forget those no longer mastered."""
        mastered, wall_ms = self._mastered(), self.wall_ms()
        self.health.keep_only(set(mastered))
        for name, role in mastered.items():
            self._observe(name, role, wall_ms)
        self._to_the_map(mastered)

    def _to_the_map(self, mastered: dict[str, Any]) -> None:
        """At cluster feature level 3, propose SetQueueHealth for each queue mastered here whose
        record in the map disagrees with this master's judgement (failed or not, the reason):
        a new master corrects what its predecessor left (or could not clear: it is gone).
        One proposal per queue on its way, at most one per PROPOSE_INTERVAL_S."""
        coordinator = self.engine.coordinator
        if coordinator is None:
            return
        cluster = coordinator.membership.cluster_map
        if cluster.feature_level < FEATURES["queue_health"]:
            return
        for name in [name for name in self._last_proposed if name not in mastered]:
            del self._last_proposed[name]
        now = time.monotonic()
        for name in mastered:
            entry = cluster.queues.get(name)
            failure = self.health.failures.get(name)
            if entry is None or name in self._proposing or not map_differs(cluster.queue_health.get(name), failure):
                continue
            if now - self._last_proposed.get(name, -PROPOSE_INTERVAL_S) < PROPOSE_INTERVAL_S:
                continue
            command = SetQueueHealth(name, entry.incarnation, failure.reason if failure else "",
                                     failure.detail if failure else "", failure.since_ms if failure else 0)
            self._propose(coordinator, command)
            self._last_proposed[name] = now

    def _propose(self, coordinator: Any, command: SetQueueHealth) -> None:
        self._proposing.add(command.name)
        self.proposals_total += 1

        def finish(result: Any) -> None:      # an outcome list, or a QueueError: the next look tries again
            self._proposing.discard(command.name)
        self.engine.invoke(lambda now_ms: coordinator.propose_checked(command, finish, lambda outcomes: outcomes))

    def fields(self, name: str) -> dict[str, Any]:
        """The statistics' fields of one queue (engine.describe): judged at this moment when
        this node masters it; a replica's description says nothing of failure (its master does)."""
        pairs = self.engine.pairs          # one queue's lookups: a listing describes up to 1,000
        if not pairs.clustered:
            role = None
        else:
            role = pairs.masters.get(name)
            if role is None:
                return {}
        if name not in self.engine.cores:
            return {}
        self._observe(name, role, self.wall_ms())
        return self.health.fields(name)

    async def run(self, also: Callable[[], None] = lambda: None) -> None:
        """Look every LOOK_INTERVAL_S; `also` runs at the same pace (the node's rate samples)."""
        while True:
            await asyncio.sleep(LOOK_INTERVAL_S)
            try:
                self.look()
                also()
            except Exception:             # a look must never end the watch (it is only a report)
                log.exception("looking at the queues' health failed")

    def render_metrics(self) -> list[str]:
        failed = sorted(self.health.failures.items())
        return render_family("qserver_queue_failed", "gauge",
                             "1 for each queue mastered here that cannot serve (state FAILED), by reason",
                             [({"queue": name, "reason": failure.reason}, 1.0) for name, failure in failed]) + \
            render_family("qserver_queue_failed_transitions_total", "counter",
                          "queues mastered here that entered FAILED, and that came back to OPEN",
                          [({"to": "FAILED"}, self.failures_total), ({"to": "OPEN"}, self.recoveries_total)])
