"""Liveness of a chaos run: did every client keep making progress whenever it had work?

The safety rules (chaos/checker.py) cannot see a client that stops: a consumer that is never
given another message loses nothing and repeats nothing. Issue 40 was such a case: after a
master was killed and restarted at once, consumers hung, and the workload hid it by replacing
any consumer that was idle for a few seconds. This module judges progress, purely, from the
history (chaos/history.py); no I/O, no clock.

* **Clients** are the workload's producers (processes that enqueue) and consumers (processes
  that receive), in the run and recovery phases (the drain at the end is not judged). Each is
  active from its `worker` `start` record to its `stop` record (without them: from its first
  operation to its last).
* **Progress**: for a producer, an enqueue completed ok; for a consumer, a message taken (a
  receive completed ok with at least one message; a push consumer records each message it
  takes from its consumer).
* **Had work**: a producer always has work while it is active (it is always trying to
  enqueue). A consumer has work at time t when some message of its queue is *waiting for it*
  then. Message m waits for consumer X from when m could first be taken, its enqueue
  acknowledged ok (plus its `delay_s`), until the first of: m's first lease (delivery count 1)
  began (the invocation of the receive that was given it, when another client polled it), X
  took m (when m was pushed to X: from X's own prefetch buffer X could take it all along),
  an operator's purge that covers m was invoked, or m's time to live (`ttl_s`) ran out counted
  from its enqueue's invocation. Where the history cannot say when m stopped waiting, m is no
  work for anyone: m's first lease pushed to another consumer (the push may have come at once),
  m's first recorded delivery a redelivery (the first lease's answer was lost), an enqueue whose
  outcome is unknown, a `one_way` queue's enqueue (its answer promises nothing), a message a
  redrive made. Every choice errs towards less work, so a reported stall is a real one: under
  `producer` the first lease on either member ends the wait on both.
* A **stall** of a client is an interval during which it had work all along and made no
  progress: its work, cut at each point of progress.
* **Fault windows** come from the nemesis's records: each fault from `began_s` (when the
  nemesis began applying it) to `healed_s` (when undoing it had finished: for a kill, when the
  node answered again), overlapping faults merged. Part of a stall inside a window is excused.
* **Invalid** (`liveness_stall`): a stall with a part outside every fault window longer than
  `stall_max_s` (`LIVENESS_STALL_MAX_S`, or the scenario's `liveness_stall_max_s`): the client
  stalled that long after a fault healed, or in quiet time. A stall inside a fault, or one that
  began in a fault and ended within `stall_max_s` of the heal, is fine.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LIVENESS_STALL_MAX_S = 5.0
JUDGED_PHASES = ("run", "recovery")
ROUNDING_DIGITS = 3

Interval = tuple[float, float]


@dataclass
class Client:
    """One producer or consumer of the workload, as the history shows it."""
    process: str
    role: str                                   # producer | consumer
    queues: set[str] = field(default_factory=set)
    active_from: float = math.inf
    active_to: float = -math.inf
    started: float | None = None                # its `worker` records, when it wrote them
    stopped: float | None = None
    progress: list[float] = field(default_factory=list)

    def active(self) -> Interval:
        begin = self.started if self.started is not None else self.active_from
        end = self.stopped if self.stopped is not None else self.active_to
        return begin, end


@dataclass(frozen=True)
class FirstLease:
    """A message's first lease on one member (delivery count 1), as the history recorded it."""
    process: str
    polled: bool
    t_invoke: float
    t_complete: float


@dataclass
class WaitingMessage:
    """An acknowledged message: takeable from `ready`, gone by `gone` at the latest."""
    acknowledged: float
    ready: float
    gone: float = math.inf
    first_leases: list[FirstLease] = field(default_factory=list)   # one per member at most
    delivered: bool = False

    def waiting_for(self, process: str) -> Interval | None:
        """When this message waited for consumer `process` (None: never, or unknown)."""
        if self.delivered and not self.first_leases:
            return None                # its first lease's answer was lost: when it began is unknown
        end = self.gone
        for lease in self.first_leases:
            if lease.polled:
                end = min(end, lease.t_invoke)
            elif lease.process == process:
                end = min(end, lease.t_complete)
            else:
                return None            # pushed to another consumer, at an unknown time
        return (self.ready, end) if end > self.ready else None


def judge(history: Iterable[Mapping[str, Any]], stall_max_s: float = LIVENESS_STALL_MAX_S,
          one_way: Iterable[str] = ()) -> dict[str, Any]:
    """Per client its longest stall and the longest part of a stall outside every fault
    window; the stalls that make the run invalid (see the module docstring)."""
    entries = list(history)
    windows = fault_windows(entries)
    clients = gather_clients(entries)
    waiting = waiting_messages(entries, set(one_way))
    report: dict[str, Any] = {}
    invalidating: list[dict[str, Any]] = []
    for process, client in sorted(clients.items()):
        stalls = client_stalls(client, waiting)
        report[process] = client_report(client, stalls, windows)
        invalidating += [stall for stall in (_invalidating(client, s, windows, stall_max_s) for s in stalls)
                         if stall is not None]
    invalidating.sort(key=lambda stall: -stall["outside_faults_s"])
    return {"stall_max_s": stall_max_s, "fault_windows": [[_round(a), _round(b)] for a, b in windows],
            "clients": report, "invalidating": invalidating}


# --- the history's facts ------------------------------------------------------------------------
def fault_windows(entries: Iterable[Mapping[str, Any]]) -> list[Interval]:
    """Each fault the nemesis started (or tried to: a start that failed half-way may have
    acted), from when it began to when it was healed; merged where they overlap. A fault never
    healed by its own record ends with the run's `healed` record, else with the history."""
    opened: dict[str, float] = {}
    windows: list[Interval] = []
    last = 0.0
    for entry in entries:
        last = max(last, float(entry.get("t_complete") or 0.0))
        if entry.get("op") != "nemesis":
            continue
        event, name = entry.get("event"), entry.get("fault")
        if event in ("start", "error") and name:
            opened[name] = float(entry.get("began_s", entry["t_invoke"]))
        elif event == "stop" and name in opened:
            windows.append((opened.pop(name), float(entry.get("healed_s", entry["t_complete"]))))
        elif event == "healed":
            windows += [(began, float(entry["t_complete"])) for began in opened.values()]
            opened.clear()
    windows += [(began, last) for began in opened.values()]
    return merge(windows)


def gather_clients(entries: Iterable[Mapping[str, Any]]) -> dict[str, Client]:
    """The producers and consumers of the run and recovery phases, with their points of progress."""
    clients: dict[str, Client] = {}
    for entry in entries:
        process, op = entry.get("process"), entry.get("op")
        if not process or entry.get("phase", "run") not in JUDGED_PHASES:
            continue
        if op == "worker":
            _worker_record(clients, process, entry)
            continue
        if op not in ("enqueue", "receive"):
            continue
        client = clients.setdefault(process, Client(process, "producer" if op == "enqueue" else "consumer"))
        client.queues.add(str(entry.get("queue")))
        client.active_from = min(client.active_from, float(entry["t_invoke"]))
        client.active_to = max(client.active_to, float(entry["t_complete"]))
        if entry.get("status") == "ok" and (op == "enqueue" or entry.get("messages")):
            client.progress.append(float(entry["t_complete"]))
    for client in clients.values():
        client.progress.sort()
    return {process: client for process, client in clients.items() if client.active()[0] < client.active()[1]}


def _worker_record(clients: dict[str, Client], process: str, entry: Mapping[str, Any]) -> None:
    role = "producer" if entry.get("role") == "producer" else "consumer"
    client = clients.setdefault(process, Client(process, role))
    if entry.get("queue"):
        client.queues.add(str(entry["queue"]))
    if entry.get("event") == "start":
        client.started = float(entry["t_complete"])
    elif entry.get("event") == "stop":
        client.stopped = float(entry["t_complete"])


def waiting_messages(entries: list[Mapping[str, Any]], one_way: set[str]) -> dict[str, dict[str, WaitingMessage]]:
    """queue -> tag -> its acknowledged message: when it became takeable, when it was gone at
    the latest (purge, time to live) and its first lease."""
    waiting: dict[str, dict[str, WaitingMessage]] = defaultdict(dict)
    ids: dict[str, dict[str, int]] = defaultdict(dict)
    for entry in entries:
        queue = entry.get("queue")
        if entry.get("op") != "enqueue" or entry.get("status") != "ok" or not queue or queue in one_way:
            continue
        tag = str(entry.get("tag") or entry.get("dedupe_id"))
        acknowledged = float(entry["t_complete"])
        gone = float(entry["t_invoke"]) + float(entry["ttl_s"]) if entry.get("ttl_s") else math.inf
        waiting[queue][tag] = WaitingMessage(acknowledged, acknowledged + float(entry.get("delay_s") or 0.0), gone)
        if entry.get("id") is not None:
            ids[queue][tag] = int(entry["id"])
    for entry in entries:
        queue = entry.get("queue")
        if queue in waiting and entry.get("op") == "purge" and entry.get("status") in ("ok", "unknown"):
            _purge(waiting[queue], ids[queue], entry)
    _first_leases(entries, waiting, ids)
    return waiting


def _purge(waiting: dict[str, WaitingMessage], ids: Mapping[str, int], purge: Mapping[str, Any]) -> None:
    """A purge takes, at the earliest when it was invoked, the messages up to its answer's
    `upto`; one whose answer was lost, those acknowledged before it completed."""
    answered = purge.get("status") == "ok"
    for tag, message in waiting.items():
        if answered:
            covered = tag in ids and ids[tag] <= int(purge["upto"])
        else:
            covered = message.acknowledged < float(purge["t_complete"])
        if covered:
            message.gone = min(message.gone, float(purge["t_invoke"]))


def _first_leases(entries: list[Mapping[str, Any]], waiting: Mapping[str, dict[str, WaitingMessage]],
                  ids: Mapping[str, Mapping[str, int]]) -> None:
    """Each message's first leases (delivery count 1: one per member); a message delivered
    only with higher counts had a first lease whose answer was lost. A delivery of its tag under
    another id is another message (a redrive's)."""
    for entry in entries:
        queue = str(entry.get("queue"))
        if entry.get("op") != "receive" or entry.get("status") != "ok" or queue not in waiting:
            continue
        for delivered in entry.get("messages", []):
            tag = delivered.get("tag")
            message = waiting[queue].get(tag)
            if message is None or delivered.get("id") != ids[queue].get(tag, delivered.get("id")):
                continue
            message.delivered = True
            if int(delivered.get("deliveries") or 0) == 1:
                message.first_leases.append(FirstLease(str(entry.get("process") or ""), delivered.get("via") != "push",
                                                       float(entry["t_invoke"]), float(entry["t_complete"])))


# --- stalls ---------------------------------------------------------------------------------------
def client_stalls(client: Client, waiting: Mapping[str, Mapping[str, WaitingMessage]]) -> list[Interval]:
    """The client's stalls: the times it had work, clipped to when it was active and cut at
    each point of its progress."""
    begin, end = client.active()
    if client.role == "producer":
        work = [(begin, end)]
    else:
        intervals = [interval for queue in client.queues for message in waiting.get(queue, {}).values()
                     if (interval := message.waiting_for(client.process)) is not None]
        work = clip(merge(intervals), begin, end)
    return cut(work, client.progress)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip(intervals: Iterable[Interval], begin: float, end: float) -> list[Interval]:
    return [(max(start, begin), min(stop, end)) for start, stop in intervals if stop > begin and start < end]


def cut(intervals: Iterable[Interval], points: list[float]) -> list[Interval]:
    """Each interval split at the (sorted) points inside it."""
    pieces: list[Interval] = []
    for start, end in intervals:
        position = bisect.bisect_right(points, start)
        while position < len(points) and points[position] < end:
            pieces.append((start, points[position]))
            start = points[position]
            position += 1
        pieces.append((start, end))
    return [(start, end) for start, end in pieces if end > start]


def outside(interval: Interval, windows: list[Interval]) -> list[Interval]:
    """The parts of `interval` outside every (merged, sorted) fault window."""
    start, end = interval
    parts: list[Interval] = []
    for window_start, window_end in windows:
        if window_end <= start:
            continue
        if window_start >= end:
            break
        if window_start > start:
            parts.append((start, window_start))
        start = max(start, window_end)
    if start < end:
        parts.append((start, end))
    return parts


def client_report(client: Client, stalls: list[Interval], windows: list[Interval]) -> dict[str, Any]:
    longest = max(stalls, key=lambda s: s[1] - s[0], default=None)
    outside_longest = max((part[1] - part[0] for stall in stalls for part in outside(stall, windows)), default=0.0)
    return {"role": client.role, "queues": sorted(client.queues), "progress": len(client.progress),
            "longest_stall_s": _round(longest[1] - longest[0]) if longest else 0.0,
            "longest_stall_at": [_round(longest[0]), _round(longest[1])] if longest else None,
            "longest_outside_faults_s": _round(outside_longest)}


def _invalidating(client: Client, stall: Interval, windows: list[Interval], stall_max_s: float) -> dict[str, Any] | None:
    """The stall's longest part outside every fault window, when it is longer than the limit."""
    if stall[1] - stall[0] <= stall_max_s:
        return None
    part = max(outside(stall, windows), key=lambda p: p[1] - p[0], default=None)
    if part is None or part[1] - part[0] <= stall_max_s:
        return None
    healed = [end for _, end in windows if end == part[0]]
    return {"process": client.process, "role": client.role, "queues": sorted(client.queues),
            "stall_from": _round(stall[0]), "stall_to": _round(stall[1]), "stall_s": _round(stall[1] - stall[0]),
            "outside_faults_s": _round(part[1] - part[0]), "outside_from": _round(part[0]),
            "after_heal_at": _round(healed[0]) if healed else None}


def _round(value: float) -> float:
    return round(value, ROUNDING_DIGITS)
