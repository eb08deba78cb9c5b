"""The cluster event feed of one node (docs/PROTOCOL.md, "Events"; docs/CONSOLE.md, "Events").

What happened to the cluster as this node saw it: handoffs, failovers, moves, in-sync flips,
recipients changing state, nodes going down and up, the membership leader changing, queues
created and deleted. Most of it is read from the cluster map's commands as the membership
layer applies them here (`on_applied`, chained after the engine's in qserver/assembly.py): a
ChangePair names why the pair changed (`Reason`: a handoff and a failover both swap master and
replica, only the reason tells them apart). The membership leader is not in the map: the feed
asks the membership layer who leads, every LEADER_CHECK_S, and notes a change.

Each node keeps its own feed, in memory, in a bounded ring (EVENTS_KEPT): a sequence number of
its own (from 1 at every start: `started_ms` tells a follower the node restarted), a wall-clock
time, a kind, the queue and/or node it concerns and a sentence. Readers wait for the next event
with `wait_for` (the REST long poll, qserver/api/event_routes.py).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from qserver.cluster.membership import ChangeAll
from qserver.metrics import render_family
from replication.cluster_map import (
    AddNode,
    ChangePair,
    ChangePairs,
    CreateQueue,
    DeleteQueue,
    NodeState,
    Outcome,
    PutRecipient,
    Reason,
    SetFeatureLevel,
    SetNodeState,
)
from replication.map_commands import SetQueueHealth

EVENTS_KEPT = 1_000          # the ring: older events are dropped (a follower that lags sees a gap)
LEADER_CHECK_S = 0.25        # how often the feed asks the membership layer who leads
# A ChangePair's reason -> the event's kind (Reason, replication/map_entries.py).
PAIR_KINDS = {Reason.HANDOFF.value: "handoff", Reason.REBALANCE.value: "handoff", Reason.FAILOVER.value: "failover",
              Reason.UNCLEAN.value: "failover", Reason.MOVE.value: "move", Reason.IN_SYNC.value: "in_sync",
              Reason.RESTARTED_MASTER.value: "master_restarted", Reason.CREATE.value: "queue_created"}
NODE_KINDS = {NodeState.DOWN.value: "node_down", NodeState.UP.value: "node_up"}
# Every kind the feed produces (docs/PROTOCOL.md, "Events").
KINDS = ("handoff", "failover", "move", "in_sync", "master_restarted", "queue_created", "queue_deleted",
         "recipient_state", "node_added", "node_lost_data", "node_down", "node_up", "node_state",
         "leader", "feature_level", "map_replaced", "queue_failed", "queue_open")


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    at_ms: int
    kind: str
    text: str
    queue: str | None = None
    node: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"seq": self.seq, "at_ms": self.at_ms, "kind": self.kind, "text": self.text}
        if self.queue is not None:
            answer["queue"] = self.queue
        if self.node is not None:
            answer["node"] = self.node
        answer.update(self.details)
        return answer


# What one event is before the feed numbers it: kind, text, queue, node, details.
Noted = tuple[str, str, str | None, str | None, dict[str, Any]]


def events_of(command: Any, outcomes: list[Outcome]) -> list[Noted]:
    """The events a map command applied here makes (a pure function of the command and what
    applying it did: a refused command or change makes none, nor do commands of clients, macro
    queues, channels and forwards)."""
    found: list[Noted] = []
    if isinstance(command, ChangePair | ChangePairs):
        changes = command.changes if isinstance(command, ChangePairs) else (command,)
        for change, outcome in zip(changes, outcomes, strict=False):
            if outcome.applied:
                found.append(_pair_event(change))
    elif isinstance(command, CreateQueue) and outcomes and outcomes[0].applied:
        found.append(("queue_created", f"queue {command.name} created: master {command.master}, replica "
                      f"{command.replica}", command.name, command.master,
                      {"master": command.master, "replica": command.replica}))
    elif isinstance(command, DeleteQueue) and outcomes and outcomes[0].applied:
        found.append(("queue_deleted", f"queue {command.name} deleted", command.name, None, {}))
    elif isinstance(command, SetNodeState) and outcomes and outcomes[0].applied:
        kind = NODE_KINDS.get(command.state, "node_state")
        found.append((kind, f"node {command.node_id} is {command.state}", None, command.node_id,
                      {"state": command.state}))
    elif isinstance(command, AddNode) and outcomes and outcomes[0].applied:
        first, rest = outcomes[0], outcomes[1:]
        if first.reason == "lost its data":
            found.append(("node_lost_data", f"node {command.node_id} came back without its data (another disk)",
                          None, command.node_id, {}))
            for outcome in rest:       # what the map did about it (ClusterMap._forget_data_of)
                kind = "failover" if outcome.reason.startswith("master") else "in_sync"
                found.append((kind, f"{outcome.name}: {outcome.reason} (node {command.node_id})", outcome.name,
                              command.node_id, {"reason": outcome.reason}))
        elif first.reason != "known":
            found.append(("node_added", f"node {command.node_id} joined at {command.url}", None, command.node_id,
                          {"url": command.url}))
    elif isinstance(command, PutRecipient) and outcomes and outcomes[0].applied:
        why = f" ({command.reason})" if command.reason else ""
        found.append(("recipient_state", f"recipient {command.name} of {command.queue} is {command.state}{why}",
                      command.queue, None, {"recipient": command.name, "state": command.state,
                                            "since_ms": command.since_ms}))
    elif isinstance(command, SetQueueHealth) and outcomes and outcomes[0].applied:
        # A queue's master recorded that it cannot serve, or serves again (replication/queue_health.py).
        if command.reason:
            found.append(("queue_failed", f"queue {command.name} FAILED ({command.reason}): {command.detail}",
                          command.name, None, {"reason": command.reason, "since_ms": command.since_ms}))
        else:
            found.append(("queue_open", f"queue {command.name} serves again (OPEN)", command.name, None, {}))
    elif isinstance(command, SetFeatureLevel) and outcomes and outcomes[0].applied:
        found.append(("feature_level", f"the cluster feature level is now {command.level}", None, None,
                      {"level": command.level}))
    return found


def _pair_event(change: ChangePair) -> Noted:
    epoch0, master0, replica0, _ = change.expected
    epoch, master, replica, in_sync = change.new
    kind = PAIR_KINDS.get(change.reason, "move")
    details: dict[str, Any] = {"epoch": epoch, "master": master, "replica": replica, "in_sync": in_sync,
                               "previous_master": master0, "reason": change.reason}
    name = change.name
    if kind == "handoff":
        text = f"handoff of {name}: master {master0} -> {master} (epoch {epoch})"
    elif kind == "failover":
        unclean = change.reason == Reason.UNCLEAN.value
        details["unclean"] = unclean
        text = (f"failover of {name}: {master} promoted{' UNCLEAN (not known to be in sync)' if unclean else ''}, "
                f"master {master0} lost (epoch {epoch})")
    elif kind == "move":
        text = f"{name} moved: master {master}, replica {replica0} -> {replica} (epoch {epoch})"
    elif kind == "in_sync":
        text = f"replica {replica} of {name} is {'in sync' if in_sync else 'out of sync'}"
    else:
        text = f"master {master} of {name} restarted (epoch {epoch0} -> {epoch})"
    return kind, text, name, master, details


class EventFeed:
    """The ring of one node's events, its readers' wake-up, and the leader watch."""

    def __init__(self, node_id: str, *, kept: int = EVENTS_KEPT, clock_ms: Callable[[], int] | None = None,
                 membership: Any = None) -> None:
        self.node_id = node_id
        self.ring: collections.deque[Event] = collections.deque(maxlen=kept)
        self.seq = 0
        self.totals: collections.Counter[str] = collections.Counter()
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self.started_ms = self._clock_ms()
        self.membership = membership
        self._leader: str | None = None
        self._replayed_until = 0          # the map version up to which commands are replayed (start)
        self.replayed = 0
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # --- what goes in --------------------------------------------------------------------------
    def on_applied(self, command: Any, outcomes: list[Outcome]) -> None:
        """After the membership layer applied `command` to this node's map (on the loop)."""
        try:
            if command is ChangeAll:
                # A snapshot replaced the whole map: what it changed is not told.
                self.note("map_replaced", "the cluster map was replaced by a snapshot from the membership leader")
                return
            cluster = getattr(self.membership, "cluster_map", None)
            if cluster is not None and cluster.version <= self._replayed_until:
                self.replayed += 1        # from the log as it was at the start: no news (see start)
                return
            for kind, text, queue, node, details in events_of(command, outcomes):
                self.note(kind, text, queue=queue, node=node, **details)
        finally:
            self.check_leader()

    def note(self, kind: str, text: str, *, queue: str | None = None, node: str | None = None,
             **details: Any) -> Event:
        self.seq += 1
        event = Event(self.seq, self._clock_ms(), kind, text, queue, node, details)
        self.ring.append(event)
        self.totals[kind] += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return event

    def check_leader(self) -> None:
        """Note a change of membership leader (the map does not hold it: docs/RAFT.md)."""
        membership = self.membership
        if membership is None:
            return
        leader = membership.leader_id()
        if leader is not None and leader != self._leader:
            self._leader = leader
            term = membership.term()
            self.note("leader", f"node {leader} is the membership leader (term {term})", node=leader, term=term)

    # --- what comes out ------------------------------------------------------------------------
    @property
    def first_seq(self) -> int:
        return self.ring[0].seq if self.ring else self.seq + 1

    def since(self, after: int, limit: int, visible: Callable[[Event], bool]) -> tuple[list[Event], int]:
        """The first `limit` visible events after `after`, and where the next read starts: the
        last event returned when the page is full, else the newest event looked at (so events
        this reader may not see are not looked at again). An `after` beyond the newest event
        (the node restarted since the reader's last read) reads from the oldest kept."""
        if after > self.seq:
            after = 0
        found: list[Event] = []
        next_after = after
        for event in self._after(after):
            if visible(event):
                if len(found) == limit:
                    return found, found[-1].seq
                found.append(event)
            next_after = event.seq
        return found, max(next_after, after)

    def _after(self, after: int) -> Iterable[Event]:
        # The ring holds consecutive numbers first_seq..seq: the event numbered s is at s - first_seq.
        for position in range(max(0, after + 1 - self.first_seq), len(self.ring)):
            yield self.ring[position]

    async def wait_for(self, after: int, limit: int, visible: Callable[[Event], bool],
                       wait_s: float) -> tuple[list[Event], int]:
        """`since`, waiting up to `wait_s` for a visible event when there is none yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            found, next_after = self.since(after, limit, visible)
            remaining = deadline - loop.time()
            if found or remaining <= 0:
                return found, next_after
            after = next_after
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    # --- the leader watch ---------------------------------------------------------------------
    def start(self) -> None:
        """Right after the membership layer started, before it applied anything: the map
        commands its log holds then (applied again at every start, after the map's snapshot)
        happened before this start, and are not noted again as if they had happened now."""
        if self.membership is not None and self._task is None:
            self._replayed_until = self.membership.version_when_applied()
            self._task = asyncio.get_running_loop().create_task(self._watch_leader())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch_leader(self) -> None:
        while True:
            self.check_leader()
            await asyncio.sleep(LEADER_CHECK_S)

    def render_metrics(self) -> list[str]:
        lines = render_family("qserver_events_kept", "gauge", "cluster events this node keeps for GET /v1/events",
                              [({}, len(self.ring))])
        lines += render_family("qserver_events_total", "counter", "cluster events this node noted since it started",
                               [({"kind": kind}, self.totals.get(kind, 0)) for kind in KINDS])
        return lines
