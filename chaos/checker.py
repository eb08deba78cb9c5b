"""Judging a chaos history: Jepsen's total-queue checks plus order and one master per epoch.

Pure: no I/O, no clock. Input is the history as written (chaos.history: one dict per
operation), each queue's strength, and the (queue, epoch, master) triples the observer read
from every node's cluster map during the run. The rules:

* **lost** (violation): an enqueue acknowledged ok whose message no consumer was ever given
  (`replication.invariants.lost_acknowledged`; the drain at the end takes what is left, so
  nothing may still be held). A message that was dead-lettered counts as delivered when the
  drain takes it from the dead-letter queue.
* **unexpected** (violation): a delivered message whose tag no enqueue was invoked with, or
  whose enqueue definitely failed; a delivered message under another id than its enqueue was
  answered with (`id_mismatch`).
* **duplicated**: a message delivered more than once. Every repeat must be explained, by a
  new lease (another delivery count: a lease expired, was released, or its ack was not
  confirmed), or under `producer` by the other member (each member serves its own consumers)
  or by a member re-created on the same node (its replica moved away and back: the observer's
  maps show it out of the pair in between; the new instance starts from the master's queue).
  A repeat after the message's ack was confirmed (a lease granted after it: its delivery
  count is not below the acked lease's; an older lease taken late by a slow link or from a
  push consumer's buffer had ended before the ack), one delivery count handed out twice on one
  member, one enqueue stored as two messages, or two confirmed acks of one message on one
  member are violations.
* **recovered**: an enqueue whose outcome was unknown, delivered after all (not a violation).
* **purged**: an acknowledged message an operator's purge took (ids up to an answered purge's
  `upto`, or acknowledged before a purge whose answer was lost): not lost. A message delivered
  from a receive invoked after a purge answered, at an id up to its `upto`, is a violation
  (**delivered_after_purge**); a pushed one is not judged (it may have been leased before the
  purge and taken from the consumer's buffer after it: the purge ends its lease, and its ack
  answers E_LEASE_EXPIRED).
* **expired**: an acknowledged message enqueued with a time to live (`ttl_s`) that no
  consumer was given: its time ran out in a queue without a dead-letter queue (with one, the
  drain takes it from there and it counts as delivered): not lost. (When it expired is the
  master's clock's to decide, restarted by a restart or a takeover, so a delivery after `ttl_s`
  is not judged.)
* **delivered_early** (violation): a message enqueued with a delivery delay (`delay_s`) given
  to a consumer before that delay had passed since its enqueue was invoked. A delayed message
  is not judged as one a delivery skipped (when it became ready is the master's to decide).
* **order** (violation): an enqueue that completed before another was invoked got the lower
  id; and under `full`, a consumer was not given a message of a lower id and the same or a
  higher priority that was committed and ready (see `_first_delivery_order`).
* **redriven**: a redrive (an operator's, in the workload) moves dead letters back into their
  queue as new messages; the ids its answer lists are acknowledged messages of their own, judged
  by every rule above (lost if nobody is given one); see `_fold_redrives`.
* **macro copies**: an enqueue through a macro queue under `all` is recorded as one enqueue per
  member (the copy's own dedupe id, which the journals hold, and the payload's tag, which the
  consumers of that member see), each completed with that member's outcome, so every rule above
  judges each copy in its member; `macros` counts the calls by how many copies were
  acknowledged.
* **channels** (`latest`): a subscriber handed a value older than one it had seen
  (**older_value**), a value no publish made or one under another id than its publish was
  answered with (**unexpected_value**), or a subscriber that does not reach the newest
  acknowledged value within the catch-up after the heal (**stale_at_end**); see `_check_channels`.
  `durable`: per durable subscription, the total-queue terms: an acknowledged publish it was
  never given (**durable_lost**), a value no publish made (**unexpected_value**), a message
  given again after its ack was answered (**durable_redelivered_after_ack**); repeats before
  that are at-least-once delivery, counted; see `_check_durable`.
* **forwards** (seed 003): a forward's source is taken from by its forwarder only, its
  destination fed by it only, so they are judged together (`check_forward`), by tag: an
  acknowledged enqueue into the source whose message no consumer of the destination (or its
  dead-letter queue) was given (**forward_lost**), a tag stored under two ids of the
  destination (**forward_duplicated**: the forward stored one message twice), a delivered tag
  whose enqueue was never invoked or failed (**forward_unexpected**). Redeliveries of one
  destination message are its consumers' at-least-once, counted.
* **two masters** (violation): two nodes named master of one queue in one epoch, in any
  node's cluster map at any sample (`replication.invariants.epochs_with_two_masters`).
* **liveness** (chaos/liveness.py): per client (producer or consumer) the longest time it
  made no progress while it had work; a stall lasting more than `liveness_stall_max_s` outside
  every fault window the nemesis recorded (after a heal, or in quiet time) is a violation
  (**liveness_stall**).
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chaos.liveness import LIVENESS_STALL_MAX_S, judge
from replication.invariants import epochs_with_two_masters, lost_acknowledged
from replication.options import DEAD_LETTER_SUFFIX

LISTED_MAX = 20          # violations listed per kind (all are counted)
MEMBER_ANY = "*"         # under `full` the members' consumption is one state


@dataclass
class Delivery:
    queue: str           # the source queue (a dead-letter delivery is folded into its source)
    message_id: int
    tag: str | None
    deliveries: int
    priority: int
    node: str
    t_invoke: float
    t_complete: float
    polled: bool         # a receive call (its invoke time bounds the lease); False: pushed
    dead_letter: bool


@dataclass
class QueueFacts:
    enqueues: dict[str, dict[str, Any]] = field(default_factory=dict)   # tag -> enqueue entry
    deliveries: list[Delivery] = field(default_factory=list)
    acks: list[dict[str, Any]] = field(default_factory=list)
    purges: list[dict[str, Any]] = field(default_factory=list)     # an operator's purges
    redrives: list[dict[str, Any]] = field(default_factory=list)   # an operator's redrives
    # tag -> the keys of the messages a redrive made of it (see _fold_redrives)
    redriven: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


@dataclass
class Findings:
    violations: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, Any] = field(default_factory=dict)

    def add(self, kind: str, **detail: Any) -> None:
        self.violations[kind].append(detail)


def source_queue(queue: str) -> tuple[str, bool]:
    if queue.endswith(DEAD_LETTER_SUFFIX):
        return queue[:-len(DEAD_LETTER_SUFFIX)], True
    return queue, False


def gather(history: Iterable[Mapping[str, Any]]) -> dict[str, QueueFacts]:
    facts: dict[str, QueueFacts] = defaultdict(QueueFacts)
    for entry in history:
        queue = entry.get("queue")
        if not queue:
            continue
        source, dead = source_queue(queue)
        if entry["op"] == "enqueue":      # a macro queue's copy: its payload's tag, its own dedupe id
            facts[source].enqueues[entry.get("tag") or entry["dedupe_id"]] = dict(entry)
        elif entry["op"] == "receive" and entry["status"] == "ok":
            for message in entry.get("messages", []):
                facts[source].deliveries.append(Delivery(
                    source, message["id"], message.get("tag"), message["deliveries"], message["priority"],
                    message.get("node") or "?", entry["t_invoke"], entry["t_complete"], message.get("via") != "push",
                    dead))
        elif entry["op"] == "ack" and not dead:
            facts[source].acks.append(dict(entry))
        elif entry["op"] == "purge" and not dead:
            facts[source].purges.append(dict(entry))
        elif entry["op"] == "redrive" and not dead:
            facts[source].redrives.append(dict(entry))
    return facts


def _fold_redrives(facts: QueueFacts) -> None:
    """A redrive moves dead letters back into their queue as new messages: new ids, the same
    payload, so the same tag. Each becomes an enqueue of its own, keyed `<tag>~<new id>`,
    acknowledged when a redrive's answer listed the id (invoked and completed with that redrive),
    so it must be delivered like any acknowledged message; when a redrive's answer was lost,
    a delivery of an acknowledged tag under another id is taken as such a message (outcome
    unknown). A listed id nobody was given is lost. A dead-letter delivery of a tag counts for
    every message made of it (which of them the drain took, the tag cannot say)."""
    listed: dict[int, dict[str, Any]] = {}
    answers_lost = False
    for redrive in facts.redrives:
        if redrive["status"] == "ok":
            answers_lost |= bool(redrive.get("ids_truncated"))
            for new_id in redrive.get("ids", []):
                listed.setdefault(new_id, redrive)
        elif redrive["status"] == "unknown":
            answers_lost = True
    if not listed and not answers_lost:
        return
    made: set[int] = set()
    for delivery in facts.deliveries:
        original = facts.enqueues.get(delivery.tag or "")
        if delivery.dead_letter or original is None or delivery.message_id == original.get("id"):
            continue
        answered = listed.get(delivery.message_id)
        if answered is None and (not answers_lost or original.get("id") is None):
            continue                   # judged as it is (an id mismatch, or one enqueue stored twice)
        key = f"{delivery.tag}~{delivery.message_id}"
        if key not in facts.enqueues:
            facts.enqueues[key] = {"op": "enqueue", "dedupe_id": key, "id": delivery.message_id, "redriven": True,
                                   "status": "ok" if answered else "unknown", "priority": delivery.priority,
                                   "t_invoke": (answered or {}).get("t_invoke", delivery.t_invoke),
                                   "t_complete": (answered or {}).get("t_complete", delivery.t_invoke)}
            facts.redriven[delivery.tag or ""].append(key)
        made.add(delivery.message_id)
        delivery.tag = key
    for new_id, redrive in listed.items():
        if new_id not in made:         # never delivered: judged as an acknowledged message nobody got
            facts.enqueues[f"~{new_id}"] = {"op": "enqueue", "dedupe_id": f"~{new_id}", "id": new_id, "redriven": True,
                                           "status": "ok", "priority": 0, "t_invoke": redrive["t_invoke"],
                                           "t_complete": redrive["t_complete"]}


def check(history: Iterable[Mapping[str, Any]], strengths: Mapping[str, str],
          observations: Iterable[tuple[str, int, str]] = (),
          pairs: Iterable[tuple[str, int, float, str, str | None]] = (),
          one_way: Iterable[str] = (), liveness_stall_max_s: float = LIVENESS_STALL_MAX_S) -> dict[str, Any]:
    """The verdict over a history: counts per queue, violations by kind (listed up to
    LISTED_MAX each, all counted), explained duplicates by explanation. `pairs`: (queue, epoch,
    when first seen, master, replica) as the observer saw the maps (see Departures).
    `one_way`: queues of type one_way, whose enqueue is answered before it is durable (seed
    004 One_Way): such an answer promises nothing, so it counts as an outcome unknown (never
    `lost` if the message is gone; `recovered` when it is delivered), its id included (a
    master that failed before storing it gave the id to nothing, and its successor may give it
    to another message). `liveness_stall_max_s`: the longest stall a client may have outside
    every fault window (chaos/liveness.py)."""
    history = list(history)
    one_way = list(one_way)
    facts = gather(history)
    for queue in one_way:
        for tag, entry in facts[queue].enqueues.items():
            if entry["status"] == "ok":
                facts[queue].enqueues[tag] = {**entry, "status": "unknown", "id": None}
    findings = Findings()
    members: dict[str, list[tuple[float, frozenset[str]]]] = defaultdict(list)
    for queue, _, seen, master, replica in pairs:
        members[queue].append((seen, frozenset(n for n in (master, replica) if n)))
    per_queue = {}
    for queue in sorted(set(facts) | set(strengths)):
        per_queue[queue] = _check_queue(queue, facts[queue], strengths.get(queue, "full"), findings,
                                        Departures(members.get(queue, ())))
    masters = _check_masters(observations, findings)
    channels = _check_channels(history, findings)
    liveness = judge(history, liveness_stall_max_s, one_way)
    for stall in liveness["invalidating"]:
        findings.add("liveness_stall", **stall)
    counts = {name: sum(q[name] for q in per_queue.values()) for name in
              ("enqueue_ok", "enqueue_fail", "enqueue_unknown", "delivered", "delivered_messages", "lost",
               "purged", "expired", "unexpected", "duplicated", "recovered")}
    explained: dict[str, int] = defaultdict(int)
    for queue_counts in per_queue.values():
        for reason, count in queue_counts["duplicates_explained"].items():
            explained[reason] += count
    violation_counts = {kind: len(items) for kind, items in sorted(findings.violations.items())}
    return {"valid": not violation_counts, "counts": counts, "duplicates_explained": dict(sorted(explained.items())),
            "violation_counts": violation_counts,
            "violations": {kind: items[:LISTED_MAX] for kind, items in sorted(findings.violations.items())},
            "queues": per_queue, "macros": _macro_copies(facts), "channels": channels, "epochs_observed": masters,
            "liveness": liveness}


def check_forward(history: Iterable[Mapping[str, Any]], name: str, source: str, destination: str) -> dict[str, Any]:
    """One forward's verdict: counts, and violations by kind (see the module docstring)."""
    enqueues: dict[str, Mapping[str, Any]] = {}
    stored: dict[str, set[int]] = defaultdict(set)
    deliveries = 0
    for entry in history:
        queue = entry.get("queue")
        if queue == source and entry["op"] == "enqueue":
            enqueues[entry.get("tag") or entry["dedupe_id"]] = entry
        elif queue in (destination, destination + DEAD_LETTER_SUFFIX) and entry["op"] == "receive" \
                and entry["status"] == "ok":
            for message in entry.get("messages", []):
                deliveries += 1
                if queue == destination and message.get("tag") is not None:
                    stored[message["tag"]].add(message["id"])
                else:       # a dead letter of the destination: delivered, its id is the dead-letter queue's
                    stored.setdefault(message.get("tag"), set())
    findings = Findings()
    statuses: dict[str, int] = defaultdict(int)
    for tag, entry in enqueues.items():
        statuses[entry["status"]] += 1
        if entry["status"] == "ok" and tag not in stored:
            findings.add("forward_lost", forward=name, tag=tag)
    for tag, ids in sorted(stored.items(), key=lambda item: str(item[0])):
        invoked = enqueues.get(tag or "")
        if invoked is None or invoked["status"] == "fail":
            findings.add("forward_unexpected", forward=name, tag=tag, ids=sorted(ids))
        if len(ids) > 1:
            findings.add("forward_duplicated", forward=name, tag=tag, ids=sorted(ids))
    violation_counts = {kind: len(items) for kind, items in sorted(findings.violations.items())}
    return {"valid": not violation_counts, "violation_counts": violation_counts,
            "violations": {kind: items[:LISTED_MAX] for kind, items in sorted(findings.violations.items())},
            "counts": {"enqueue_ok": statuses["ok"], "enqueue_fail": statuses["fail"],
                       "enqueue_unknown": statuses["unknown"], "delivered": deliveries,
                       "delivered_messages": len(stored),
                       "recovered": sum(1 for t, e in enqueues.items() if e["status"] == "unknown" and t in stored)}}


def _check_channels(history: list[Mapping[str, Any]], findings: Findings) -> dict[str, dict[str, int]]:
    """`latest` channels: each subscriber is handed values never older than one it has seen
    (**older_value**), each one published by a publish that did not fail definitely, under the
    id that publish was answered with (**unexpected_value**), and after the heal it reaches
    the newest acknowledged value (**stale_at_end**)."""
    published: dict[tuple[str, str], Mapping[str, Any]] = {}
    for entry in history:
        if entry.get("op") == "publish":
            published[(entry["channel"], entry["tag"])] = entry
    summary: dict[str, dict[str, int]] = defaultdict(lambda: {"published_ok": 0, "published_unknown": 0,
                                                              "published_fail": 0, "values_seen": 0,
                                                              "subscribers_at_end": 0})
    for (channel, _), entry in published.items():
        summary[channel][f"published_{entry['status']}"] += 1
    highest: dict[tuple[str, str], int] = {}
    for entry in sorted((e for e in history if e.get("op") == "channel_value"), key=lambda e: e["t_invoke"]):
        channel, process, message_id = entry["channel"], entry["process"], entry["id"]
        summary[channel]["values_seen"] += 1
        before = highest.get((channel, process), 0)
        if message_id < before and not entry.get("subscription"):     # a durable backlog repeats: at least once
            findings.add("older_value", channel=channel, subscriber=process, id=message_id, after=before)
        highest[(channel, process)] = max(before, message_id)
        source = published.get((channel, entry.get("tag") or ""))
        if source is None or source["status"] == "fail" or (source["status"] == "ok" and source["id"] != message_id):
            findings.add("unexpected_value", channel=channel, subscriber=process, id=message_id, tag=entry.get("tag"),
                         publish=None if source is None else source["status"])
    for entry in history:
        if entry.get("op") == "channel_end":
            summary[entry["channel"]]["subscribers_at_end"] += 1
            if not entry.get("subscription") and entry["last_id"] < entry["last_published"]:
                findings.add("stale_at_end", channel=entry["channel"], subscriber=entry["process"],
                             last_seen=entry["last_id"], last_published=entry["last_published"])
    durable = _check_durable(history, published, findings)
    for channel, subscriptions in durable.items():
        summary[channel]["durable"] = subscriptions      # type: ignore[assignment]
    return dict(summary)


def _check_durable(history: list[Mapping[str, Any]], published: Mapping[tuple[str, str], Mapping[str, Any]],
                   findings: Findings) -> dict[str, dict[str, dict[str, int]]]:
    """Durable subscriptions (opened before the first publish), each as a total queue: every
    acknowledged publish is given to it at least once by the end (**durable_lost**), and no
    message is given again once its ack was answered (**durable_redelivered_after_ack**)."""
    given: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    acked_at: dict[tuple[str, str, int], float] = {}
    for entry in history:
        name = entry.get("subscription")
        if not name:
            continue
        if entry.get("op") == "channel_value":
            given[(entry["channel"], name)].append(entry)
        elif entry.get("op") == "durable_ack" and entry.get("status") == "ok":
            key = (entry["channel"], name, entry["id"])
            acked_at[key] = min(acked_at.get(key, entry["t_complete"]), entry["t_complete"])
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for (channel, name), values in sorted(given.items()):
        ids = {entry["id"] for entry in values}
        for (of, _), publish in published.items():
            if of == channel and publish["status"] == "ok" and publish["id"] not in ids:
                findings.add("durable_lost", channel=channel, subscription=name, id=publish["id"], tag=publish["tag"])
        for entry in values:
            answered = acked_at.get((channel, name, entry["id"]))
            if answered is not None and entry["t_invoke"] > answered:
                findings.add("durable_redelivered_after_ack", channel=channel, subscription=name, id=entry["id"])
        out[channel][name] = {"given": len(values), "distinct": len(ids),
                              "resent": sum(1 for entry in values if entry.get("resent")),
                              "acknowledged": sum(1 for (c, n, _) in acked_at if (c, n) == (channel, name))}
    return dict(out)


def _macro_copies(facts: Mapping[str, QueueFacts]) -> dict[str, dict[str, int]]:
    """Per macro queue, its calls by how many members acknowledged their copy (under `all`
    the call succeeds only when every one did; each copy is judged in its member above)."""
    copies: dict[tuple[str, str], list[str]] = defaultdict(list)
    for queue_facts in facts.values():
        for tag, entry in queue_facts.enqueues.items():
            if entry.get("macro"):
                copies[(entry["macro"], tag)].append(entry["status"])
    summary: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "every_copy_ok": 0, "some_copies_ok": 0,
                                                              "no_copy_ok": 0})
    for (macro, _), statuses in sorted(copies.items()):
        oks = statuses.count("ok")
        summary[macro]["calls"] += 1
        summary[macro]["every_copy_ok" if oks == len(statuses) else "some_copies_ok" if oks else "no_copy_ok"] += 1
    return dict(summary)


def _check_queue(queue: str, facts: QueueFacts, strength: str, findings: Findings,
                 departures: Departures) -> dict[str, Any]:
    _fold_redrives(facts)
    statuses: dict[str, int] = defaultdict(int)
    for entry in facts.enqueues.values():
        statuses[entry["status"]] += 1
    acknowledged = {tag: entry["id"] for tag, entry in facts.enqueues.items() if entry["status"] == "ok"}
    delivered_tags = {d.tag for d in facts.deliveries}
    ids_of_tag = _ids_of_tags(queue, facts, acknowledged, findings)
    _check_unexpected(queue, facts, findings)
    delivered_ids = {ids_of_tag[d.tag] for d in facts.deliveries if d.tag in ids_of_tag}
    delivered_ids |= {ids_of_tag[key] for d in facts.deliveries if d.dead_letter
                      for key in facts.redriven.get(d.tag or "", ()) if key in ids_of_tag}
    purged = _purged(queue, facts, acknowledged, findings) - delivered_ids
    expired = {acknowledged[tag] for tag, entry in facts.enqueues.items()
               if tag in acknowledged and entry.get("ttl_s")} - delivered_ids - purged
    lost = lost_acknowledged(acknowledged.values(), (), delivered_ids | purged | expired)
    tag_of_id = {message_id: tag for tag, message_id in acknowledged.items()}
    for message_id in sorted(lost):
        findings.add("lost", queue=queue, id=message_id, tag=tag_of_id.get(message_id))
    recovered = sorted(tag for tag, entry in facts.enqueues.items()
                       if entry["status"] == "unknown" and tag in delivered_tags)
    confirmed = _confirmed_acks(facts, strength)
    explained = _check_repeats(queue, facts, strength, confirmed, findings, departures)
    _check_acks(queue, strength, confirmed, findings, departures)
    _check_enqueue_order(queue, facts, findings)
    _check_delays(queue, facts, findings)
    if strength == "full":
        _first_delivery_order(queue, facts, acknowledged, findings)
    repeated = sum(1 for count in _delivery_counts(facts).values() if count > 1)
    return {"strength": strength, "enqueue_ok": statuses["ok"], "enqueue_fail": statuses["fail"],
            "enqueue_unknown": statuses["unknown"], "delivered": len(facts.deliveries),
            "delivered_messages": len(delivered_tags), "lost": len(lost), "purged": len(purged), "expired": len(expired),
            "unexpected": sum(1 for t in delivered_tags if t not in facts.enqueues
                              or facts.enqueues[t]["status"] == "fail"),
            "duplicated": repeated, "duplicates_explained": explained, "recovered": len(recovered),
            "redriven": sum(1 for entry in facts.enqueues.values() if entry.get("redriven")),
            "acks_ok": sum(1 for a in facts.acks if a["status"] == "ok")}


def _check_delays(queue: str, facts: QueueFacts, findings: Findings) -> None:
    for delivery in facts.deliveries:
        enqueue = facts.enqueues.get(delivery.tag or "")
        if enqueue is not None and enqueue.get("delay_s") and \
                delivery.t_complete < enqueue["t_invoke"] + enqueue["delay_s"]:
            findings.add("delivered_early", queue=queue, id=delivery.message_id, tag=delivery.tag,
                         delay_s=enqueue["delay_s"], after_s=round(delivery.t_complete - enqueue["t_invoke"], 3))


def _purged(queue: str, facts: QueueFacts, acknowledged: Mapping[str, int], findings: Findings) -> set[int]:
    """The acknowledged ids an operator's purge may have taken: up to an answered purge's
    `upto` (everything the queue held when it began), and for a purge whose answer was lost,
    every message acknowledged before it completed. A message delivered from a receive invoked
    after a purge answered, at an id up to its `upto`, outlived it: a violation."""
    covered: set[int] = set()
    for purge in facts.purges:
        if purge["status"] == "ok":
            upto = purge["upto"]
            covered.update(message_id for message_id in acknowledged.values() if message_id <= upto)
            for delivery in facts.deliveries:
                # A pushed message's lease may predate the purge (taken later from the consumer's
                # buffer): only a polled receive's invocation bounds when the message was leased.
                if delivery.polled and not delivery.dead_letter and delivery.t_invoke > purge["t_complete"] \
                        and delivery.message_id <= upto:
                    findings.add("delivered_after_purge", queue=queue, id=delivery.message_id, upto=upto,
                                 at=round(delivery.t_invoke, 3))
        elif purge["status"] == "unknown":
            covered.update(acknowledged[tag] for tag, entry in facts.enqueues.items()
                           if tag in acknowledged and entry["t_complete"] < purge["t_complete"])
    return covered


def _ids_of_tags(queue: str, facts: QueueFacts, acknowledged: Mapping[str, int],
                 findings: Findings) -> dict[str, int]:
    """tag -> message id in the queue (from the enqueue's answer, else from deliveries); one
    tag under two ids of the queue is one enqueue stored twice."""
    ids: dict[str, int] = dict(acknowledged)
    seen: dict[str, set[int]] = defaultdict(set)
    for delivery in facts.deliveries:
        if delivery.tag is not None and not delivery.dead_letter:
            seen[delivery.tag].add(delivery.message_id)
    for tag, message_ids in sorted(seen.items()):
        if len(message_ids) > 1:
            findings.add("duplicate_enqueue", queue=queue, tag=tag, ids=sorted(message_ids))
        expected = acknowledged.get(tag)
        if expected is not None and message_ids - {expected}:
            findings.add("id_mismatch", queue=queue, tag=tag, answered=expected, delivered=sorted(message_ids))
        ids.setdefault(tag, min(message_ids))
    return ids


def _check_unexpected(queue: str, facts: QueueFacts, findings: Findings) -> None:
    reported: set[str | None] = set()
    for delivery in facts.deliveries:
        if delivery.tag in reported:
            continue
        entry = facts.enqueues.get(delivery.tag or "")
        if entry is None:
            findings.add("unexpected", queue=queue, id=delivery.message_id, tag=delivery.tag,
                         why="no enqueue was invoked with this tag")
        elif entry["status"] == "fail":
            findings.add("unexpected", queue=queue, id=delivery.message_id, tag=delivery.tag,
                         why=f"its enqueue failed definitely ({entry.get('error')})")
        else:
            continue
        reported.add(delivery.tag)


def _delivery_counts(facts: QueueFacts) -> dict[tuple[int, bool], int]:
    counts: dict[tuple[int, bool], int] = defaultdict(int)
    for delivery in facts.deliveries:
        counts[(delivery.message_id, delivery.dead_letter)] += 1
    return counts


# (message id, member, dead letter?) -> (completion time, delivery count of the acked lease) of
# its acks confirmed ok, in order
ConfirmedAcks = dict[tuple[int, str, bool], list[tuple[float, int]]]


class Departures:
    """When a node was out of a queue's pair, as the observer saw the map: a node that left the
    pair (its replica moved away) and came back holds a new instance, made by state transfer
    from the master's queue; under `producer` its consumption state starts afresh there."""

    def __init__(self, pairs: Iterable[tuple[float, frozenset[str]]] = ()) -> None:
        self.pairs = sorted(pairs, key=lambda pair: pair[0])     # (first seen, members of the epoch)

    def left_between(self, node: str, start: float, end: float) -> bool:
        return any(start < seen <= end and node not in members for seen, members in self.pairs)


def _check_repeats(queue: str, facts: QueueFacts, strength: str, confirmed: ConfirmedAcks, findings: Findings,
                   departures: Departures) -> dict[str, int]:
    """Each later delivery of a message, against the earlier ones on the same member: every
    lease carries the member's delivery count (replicated under `full`), so two deliveries
    with one count are one lease given twice. Counts are compared as a set, not in order: the
    answer of a receive held back by a partition may arrive after a later lease's. Under
    `producer` a member re-created on the same node (it left the pair and came back) starts
    afresh."""
    explained: dict[str, int] = defaultdict(int)
    by_message: dict[tuple[int, bool], list[Delivery]] = defaultdict(list)
    for delivery in facts.deliveries:
        by_message[(delivery.message_id, delivery.dead_letter)].append(delivery)
    for deliveries in by_message.values():
        if len(deliveries) < 2:
            continue
        deliveries.sort(key=lambda d: (d.t_complete, d.deliveries))
        counts_on: dict[str, dict[int, Delivery]] = {}     # member -> delivery count -> delivery
        last_on: dict[str, Delivery] = {}
        for delivery in deliveries:
            member = delivery.node if strength == "producer" else MEMBER_ANY
            # A delivery whose count is below the acked lease's was granted before that lease
            # (a push buffered by the client, or an answer held back by a slow link, taken late):
            # its lease was over before the ack; only a lease granted after the ack repeats it.
            acked_at = [t for t, count in confirmed.get((delivery.message_id, member, delivery.dead_letter), ())
                        if t < delivery.t_invoke and count <= delivery.deliveries]
            if acked_at and not departures.left_between(delivery.node, acked_at[-1], delivery.t_invoke):
                findings.add("delivered_after_ack", queue=queue, id=delivery.message_id, tag=delivery.tag,
                             node=delivery.node, deliveries=delivery.deliveries, acked_at=round(acked_at[-1], 3),
                             delivered_at=round(delivery.t_complete, 3))
            before = last_on.get(member)
            if before is not None and strength == "producer" \
                    and departures.left_between(member, before.t_complete, delivery.t_invoke):
                counts_on[member] = {}
                explained["member_recreated"] += 1
            counts = counts_on.setdefault(member, {})
            previous = counts.get(delivery.deliveries)
            if previous is not None:
                # One lease (its delivery count) handed out twice on one member.
                findings.add("unexplained_redelivery", queue=queue, id=delivery.message_id, tag=delivery.tag,
                             node=delivery.node, deliveries=delivery.deliveries, previous_node=previous.node,
                             previous_at=round(previous.t_complete, 3), at=round(delivery.t_complete, 3))
            elif counts:
                explained["redelivered_under_a_new_lease"] += 1
            elif len(counts_on) > 1 and before is None:    # delivered before by the other member (`producer`)
                explained["another_member"] += 1
            counts[delivery.deliveries] = delivery
            last_on[member] = delivery
    return dict(sorted(explained.items()))


def _confirmed_acks(facts: QueueFacts, strength: str) -> ConfirmedAcks:
    """(message id, member, dead letter?) -> (completion time, delivery count) of its acks
    confirmed ok, in order."""
    confirmed: dict[tuple[int, str, bool], list[tuple[float, int]]] = defaultdict(list)
    for ack in sorted(facts.acks, key=lambda a: a["t_complete"]):
        if ack["status"] == "ok":
            member = (ack.get("node") or "?") if strength == "producer" else MEMBER_ANY
            confirmed[(ack["id"], member, False)].append((ack["t_complete"], int(ack.get("deliveries") or 0)))
    return confirmed


def _check_acks(queue: str, strength: str, confirmed: ConfirmedAcks, findings: Findings,
                departures: Departures) -> None:
    """Exactly-once acknowledgement: one message is acked ok at most once per member (a member
    re-created on the same node is another member)."""
    for (message_id, member, _), acks in confirmed.items():
        times = [t for t, _ in acks]
        for first, second in zip(times, times[1:], strict=False):
            if strength != "producer" or not departures.left_between(member, first, second):
                findings.add("acked_twice", queue=queue, id=message_id, node=None if member == MEMBER_ANY else member,
                             first_at=round(first, 3), second_at=round(second, 3))


def _check_enqueue_order(queue: str, facts: QueueFacts, findings: Findings) -> None:
    """Indices grow in real time: an enqueue that completed before another was invoked has
    the lower id (ids are ordering indices, strictly increasing across epochs)."""
    done = sorted((e for e in facts.enqueues.values() if e["status"] == "ok"), key=lambda e: e["t_complete"])
    started = sorted(done, key=lambda e: e["t_invoke"])
    highest: dict[str, Any] | None = None
    position = 0
    for entry in started:
        while position < len(done) and done[position]["t_complete"] < entry["t_invoke"]:
            if highest is None or done[position]["id"] > highest["id"]:
                highest = done[position]
            position += 1
        if highest is not None and highest["id"] >= entry["id"]:
            findings.add("enqueue_order", queue=queue, earlier_id=highest["id"], earlier_tag=highest["dedupe_id"],
                         later_id=entry["id"], later_tag=entry["dedupe_id"])


def _first_delivery_order(queue: str, facts: QueueFacts, acknowledged: Mapping[str, int], findings: Findings) -> None:
    """Under `full`: when a receive was given message a, no message b of a higher priority,
    or of the same priority and a lower id, may have been committed (its enqueue acknowledged before the receive was
    invoked) and still never leased (b's first lease started after the receive completed).

    Only what the history pins down is judged: b's first lease must be a polled delivery with
    a delivery count of 1 (a lease hidden in a receive whose answer was lost, or pushed at an
    unknown time, makes b's first lease time unknown, so b is not judged), and `a` a polled
    first delivery. Candidates are kept per priority in heaps ordered by id."""
    first: dict[str, Delivery] = {}
    unknown_first: set[str] = set()
    for delivery in sorted(facts.deliveries, key=lambda d: d.t_complete):
        if delivery.dead_letter or delivery.tag is None or delivery.tag in first or delivery.tag in unknown_first:
            continue
        if delivery.deliveries == 1 and delivery.polled:
            first[delivery.tag] = delivery
        else:
            unknown_first.add(delivery.tag)
    committed = sorted((facts.enqueues[tag]["t_complete"], tag) for tag in acknowledged
                       if tag in first and not facts.enqueues[tag].get("delay_s"))
    heaps: dict[int, list[tuple[int, str]]] = defaultdict(list)
    position = 0
    for delivery in sorted(first.values(), key=lambda d: d.t_invoke):
        while position < len(committed) and committed[position][0] < delivery.t_invoke:
            tag = committed[position][1]
            heapq.heappush(heaps[first[tag].priority], (acknowledged[tag], tag))
            position += 1
        for priority, heap in heaps.items():
            if priority < delivery.priority:
                continue
            while heap and first[heap[0][1]].t_invoke <= delivery.t_complete:
                heapq.heappop(heap)        # leased by then: no longer a candidate (never again)
            # A higher priority goes first whatever its id; the same priority by id.
            if heap and (priority > delivery.priority or heap[0][0] < delivery.message_id):
                skipped_id, skipped_tag = heap[0]
                findings.add("delivery_order", queue=queue, delivered_id=delivery.message_id,
                             delivered_priority=delivery.priority, skipped_id=skipped_id, skipped_priority=priority,
                             skipped_tag=skipped_tag, at=round(delivery.t_complete, 3))


def _check_masters(observations: Iterable[tuple[str, int, str]], findings: Findings) -> dict[str, int]:
    by_queue: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for queue, epoch, master in observations:
        by_queue[queue].append((epoch, master))
    epochs = {}
    for queue, pairs in sorted(by_queue.items()):
        for epoch, masters in sorted(epochs_with_two_masters(pairs).items()):
            findings.add("two_masters_in_epoch", queue=queue, epoch=epoch, masters=sorted(masters))
        epochs[queue] = len({epoch for epoch, _ in pairs})
    return epochs
