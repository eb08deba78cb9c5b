"""The chaos runner's pure parts: the history checker on hand-made histories (safety and
liveness), the scenario files and the seeded fault schedule."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from chaos import checker
from chaos.history import History, payload_for, tag_of
from chaos.liveness import LIVENESS_STALL_MAX_S
from chaos.nemesis import FAULT_KINDS, RESTART_NOW_DELAY_MAX_S, Fault, FaultSpec, plan
from chaos.scenario import available, load_scenario, parse_scenario


class Recorder:
    """Builds a history with explicit times (seconds)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def enqueue(self, tag: str, status: str, t: tuple[float, float], message_id: int | None = None,
                queue: str = "q", priority: int = 4) -> None:
        self.entries.append({"op": "enqueue", "queue": queue, "status": status, "dedupe_id": tag, "id": message_id,
                             "priority": priority, "t_invoke": t[0], "t_complete": t[1], "process": "p"})

    def receive(self, messages: list[tuple[int, str, int]], t: tuple[float, float], node: str = "n1",
                queue: str = "q", priority: int = 4, via: str = "poll", process: str | None = None) -> None:
        self.entries.append({"op": "receive", "queue": queue, "status": "ok", "t_invoke": t[0], "t_complete": t[1],
                             "messages": [{"id": i, "tag": tag, "deliveries": d, "priority": priority, "node": node,
                                           "via": via} for i, tag, d in messages]})
        if process is not None:
            self.entries[-1]["process"] = process

    def ack(self, message_id: int, status: str, t: tuple[float, float], node: str = "n1", queue: str = "q",
            deliveries: int | None = None) -> None:
        self.entries.append({"op": "ack", "queue": queue, "status": status, "id": message_id, "node": node,
                             "t_invoke": t[0], "t_complete": t[1], "deliveries": deliveries})


    def purge(self, status: str, t: tuple[float, float], upto: int | None = None, queue: str = "q") -> None:
        self.entries.append({"op": "purge", "queue": queue, "status": status, "upto": upto, "t_invoke": t[0],
                             "t_complete": t[1]})


def verdict(recorder: Recorder, strength: str = "full", observations: Any = ()) -> dict[str, Any]:
    return checker.check(recorder.entries, {"q": strength}, observations)


def test_a_clean_history_is_valid_and_counts_every_outcome() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "unknown", (1, 2))
    history.enqueue("c", "fail", (2, 3))
    history.receive([(1, "a", 1), (2, "b", 1)], (3, 4))
    history.ack(1, "ok", (4, 5))
    result = verdict(history)
    assert result["valid"], result["violations"]
    assert result["counts"]["recovered"] == 1 and result["counts"]["enqueue_fail"] == 1


def test_a_one_way_answer_promises_nothing_a_lost_message_and_a_reused_id_are_not_violations() -> None:
    """A one_way queue answers before the message is durable (seed 004 One_Way): a master that
    failed before storing "a" lost it and gave its id 1 again to "b" after the failover."""
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "ok", (2, 3), 1)
    history.receive([(1, "b", 1)], (4, 5))
    history.ack(1, "ok", (5, 6))
    assert not verdict(history)["valid"]                          # judged as a durable queue
    result = checker.check(history.entries, {"q": "full"}, one_way=["q"])
    assert result["valid"], result["violations"]
    assert result["counts"]["enqueue_unknown"] == 2 and result["counts"]["recovered"] == 1


def test_a_scenario_takes_a_queue_type_and_refuses_an_unknown_one() -> None:
    scenario = parse_scenario("t", {"queues": [{"name": "q", "type": "one_way"}]})
    assert scenario.one_way_queues() == ["q"] and scenario.queues[0].options()["type"] == "one_way"
    with pytest.raises(ValueError, match="type is one of"):
        parse_scenario("t", {"queues": [{"name": "q", "type": "sometimes"}]})


def test_an_acknowledged_enqueue_never_delivered_is_lost() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "ok", (0, 1), 2)
    history.receive([(1, "a", 1)], (2, 3))
    result = verdict(history)
    assert result["violation_counts"] == {"lost": 1} and result["violations"]["lost"][0]["id"] == 2


def test_a_purge_explains_what_it_took_and_a_message_it_covered_delivered_after_it_is_a_violation() -> None:
    history = Recorder()
    for number in range(1, 5):
        history.enqueue(f"m{number}", "ok", (0, 1), number)
    history.receive([(1, "m1", 1)], (1, 2))
    history.purge("ok", (3, 4), upto=2)                 # took 2 (1 was delivered before)
    history.purge("unknown", (5, 6))                    # may have taken 3 and 4
    result = verdict(history)
    assert result["valid"], result["violations"]
    assert (result["counts"]["purged"], result["counts"]["lost"]) == (3, 0)
    pushed = Recorder()
    pushed.entries = list(history.entries)
    pushed.receive([(2, "m2", 1)], (7, 8), via="push")  # leased before the purge, taken from the buffer after
    assert verdict(pushed)["valid"]
    history.receive([(2, "m2", 1)], (7, 8))             # id 2 outlived the answered purge
    result = verdict(history)
    assert result["violation_counts"] == {"delivered_after_purge": 1}
    bare = Recorder()
    bare.enqueue("m1", "ok", (0, 1), 1)
    bare.purge("fail", (2, 3))                         # refused: it took nothing
    assert verdict(bare)["violation_counts"] == {"lost": 1}


def test_a_delivered_message_whose_enqueue_failed_or_was_never_made_is_unexpected() -> None:
    history = Recorder()
    history.enqueue("a", "fail", (0, 1))
    history.receive([(1, "a", 1), (2, "ghost", 1)], (2, 3))
    assert verdict(history)["violation_counts"] == {"unexpected": 2}


def test_a_forward_is_judged_by_tag_from_its_source_to_its_destination() -> None:
    """Source ids and destination ids differ: a forward is judged by tag (check_forward)."""
    history = Recorder()
    for tag, status in (("a", "ok"), ("b", "ok"), ("c", "ok"), ("d", "unknown"), ("e", "fail")):
        history.enqueue(tag, status, (0, 1), queue="outbox")
    history.receive([(7, "a", 1), (7, "a", 2), (8, "b", 1), (9, "b", 1), (10, "d", 1), (11, "ghost", 1)], (2, 3),
                    queue="inbox")
    history.receive([(1, "c", 1)], (4, 5), queue="inbox.dlq")        # dead-lettered at the destination: delivered
    judged = checker.check_forward(history.entries, "f", "outbox", "inbox")
    assert judged["violation_counts"] == {"forward_duplicated": 1, "forward_unexpected": 1}
    assert judged["violations"]["forward_duplicated"][0]["tag"] == "b"
    assert judged["counts"]["recovered"] == 1 and judged["counts"]["delivered_messages"] == 5
    history.enqueue("z", "ok", (6, 7), queue="outbox")
    assert checker.check_forward(history.entries, "f", "outbox", "inbox")["violation_counts"]["forward_lost"] == 1


def test_a_repeat_under_a_new_lease_is_explained_and_one_lease_given_twice_is_not() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(1, "a", 1)], (1, 2))
    history.receive([(1, "a", 2)], (8, 9))          # the lease expired: the count grew
    result = verdict(history)
    assert result["valid"] and result["duplicates_explained"] == {"redelivered_under_a_new_lease": 1}
    history.receive([(1, "a", 2)], (10, 11))        # the same lease again
    assert verdict(history)["violation_counts"] == {"unexplained_redelivery": 1}


def test_a_first_lease_whose_answer_arrives_after_a_later_lease_is_no_repeat_of_it() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(1, "a", 2)], (7, 8))          # the second lease
    history.receive([(1, "a", 1)], (1, 9))          # the first one, held back by a partition
    assert verdict(history)["valid"]


def test_an_older_lease_taken_from_a_push_buffer_after_a_later_lease_was_acked_is_no_delivery_after_ack() -> None:
    """Found by the 5-minute `combined` run: a push of the first lease (count 1) sat in the
    consumer's prefetch buffer while that lease expired and the new master's second lease
    (count 2) was acked; the worker took the stale push afterwards (its ack then failed)."""
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(1, "a", 2)], (5, 6), node="n2")
    history.ack(1, "ok", (6, 7), node="n2", deliveries=2)
    history.receive([(1, "a", 1)], (9, 9), via="push")       # taken from the buffer
    history.ack(1, "fail", (9, 10), deliveries=1)
    assert verdict(history)["valid"]
    history.receive([(1, "a", 3)], (11, 12))                 # a lease granted after the ack
    assert verdict(history)["violation_counts"] == {"delivered_after_ack": 1}


def test_under_producer_each_member_delivers_once_but_a_member_never_redelivers_what_it_acked() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(1, "a", 1)], (1, 2), node="n1")
    history.ack(1, "ok", (2, 3), node="n1")
    history.receive([(1, "a", 1)], (3, 4), node="n2")
    history.ack(1, "ok", (4, 5), node="n2")
    result = verdict(history, "producer")
    assert result["valid"] and result["duplicates_explained"] == {"another_member": 1}
    history.receive([(1, "a", 1)], (6, 7), node="n1")
    history.ack(1, "ok", (7, 8), node="n1")
    assert verdict(history, "producer")["violation_counts"] == {
        "acked_twice": 1, "delivered_after_ack": 1, "unexplained_redelivery": 1}


def test_under_producer_a_node_that_left_the_pair_and_came_back_is_a_new_member() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(1, "a", 1)], (1, 2), node="n1")
    history.ack(1, "ok", (2, 3), node="n1")
    history.receive([(1, "a", 1)], (20, 21), node="n1")     # n1's replica moved away at 10, back at 15
    history.ack(1, "ok", (21, 22), node="n1")
    pairs = [("q", 1, 0.0, "n2", "n1"), ("q", 2, 10.0, "n2", "n3"), ("q", 3, 15.0, "n2", "n1")]
    result = checker.check(history.entries, {"q": "producer"}, (), pairs)
    assert result["valid"] and result["duplicates_explained"] == {"member_recreated": 1}, result["violations"]
    assert not checker.check(history.entries, {"q": "producer"})["valid"]     # without the moves: violations


def test_one_enqueue_stored_under_two_ids_is_a_duplicate_enqueue() -> None:
    history = Recorder()
    history.enqueue("a", "unknown", (0, 1))
    history.receive([(1, "a", 1), (2, "a", 1)], (2, 3))
    assert verdict(history)["violation_counts"] == {"duplicate_enqueue": 1}


def test_ids_grow_in_real_time() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 5)
    history.enqueue("b", "ok", (2, 3), 4)            # invoked after a completed: must be higher
    history.enqueue("c", "ok", (0.5, 4), 3)          # concurrent with a: either order
    history.receive([(3, "c", 1), (4, "b", 1), (5, "a", 1)], (5, 6))
    assert verdict(history)["violation_counts"] == {"enqueue_order": 1}


def test_a_committed_ready_message_may_not_be_skipped_under_full() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "ok", (0, 1), 2)
    history.receive([(2, "b", 1)], (2, 3))           # 1 was committed and ready
    history.receive([(1, "a", 1)], (4, 5))
    assert verdict(history)["violation_counts"] == {"delivery_order": 1}
    assert verdict(history, "producer")["valid"]      # each member's own order: not judged here


def test_a_message_whose_first_lease_time_is_unknown_is_not_judged_for_order() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "ok", (0, 1), 2)
    history.receive([(2, "b", 1)], (2, 3))
    history.receive([(1, "a", 2)], (9, 10))          # 1 was leased by a receive whose answer was lost
    assert verdict(history)["valid"]


def test_a_higher_priority_goes_first_whatever_its_id() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1, priority=4)
    history.enqueue("b", "ok", (0, 1), 2, priority=7)
    history.entries.append({"op": "receive", "queue": "q", "status": "ok", "t_invoke": 2, "t_complete": 3,
                            "messages": [{"id": 1, "tag": "a", "deliveries": 1, "priority": 4, "node": "n1"}]})
    history.entries.append({"op": "receive", "queue": "q", "status": "ok", "t_invoke": 4, "t_complete": 5,
                            "messages": [{"id": 2, "tag": "b", "deliveries": 1, "priority": 7, "node": "n1"}]})
    assert verdict(history)["violation_counts"] == {"delivery_order": 1}


def test_two_masters_named_for_one_epoch_by_any_node_is_a_violation() -> None:
    history = Recorder()
    result = verdict(history, observations=[("q", 1, "n1"), ("q", 2, "n2"), ("q", 2, "n3")])
    assert result["violation_counts"] == {"two_masters_in_epoch": 1}
    assert result["epochs_observed"] == {"q": 2}


def test_a_dead_lettered_message_delivered_from_the_dead_letter_queue_is_not_lost() -> None:
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.receive([(7, "a", 1)], (2, 3), queue="q.dlq")
    assert verdict(history)["valid"]


def test_history_lines_are_qaudit_history_entries(tmp_path: Path) -> None:
    from audit.inputs import read_history
    history = History(tmp_path / "history.jsonl")
    operation = history.invoke("p-1", "enqueue", "q", dedupe_id="q.0.1", payload_crc32=5)
    history.complete(operation, "ok", id=1)
    history.info("nemesis", "nemesis", event="start", kind="kill")
    history.invoke("p-1", "enqueue", "q", dedupe_id="q.0.2")
    history.close()
    lines = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines] == ["ok", "info", "unknown"]
    entries = read_history(tmp_path / "history.jsonl")
    assert [(e.status, e.message_id, e.dedupe_id) for e in entries] == [("ok", 1, "q.0.1"), ("unknown", None, "q.0.2")]
    assert tag_of(payload_for("q.0.1", 64)) == "q.0.1" and len(payload_for("q.0.1", 64)) == 64


# --- scenarios and schedules -------------------------------------------------------------------------
@pytest.mark.parametrize("name", available())
def test_every_shipped_scenario_loads_and_plans_within_its_time(name: str) -> None:
    scenario = load_scenario(name)
    schedule = plan(scenario.nemesis, scenario.time_s, random.Random(scenario.seed))
    assert schedule, f"{name} injects no fault"
    assert all(item.at_s >= 0 and item.at_s + item.fault.duration_s <= scenario.time_s for item in schedule)
    if scenario.remote is not None:
        assert plan(scenario.remote.nemesis, scenario.time_s, random.Random(scenario.seed + 1))


def test_a_forward_needs_a_consumerless_full_source_and_a_remote_destination() -> None:
    raw = {"queues": [{"name": "outbox", "consumers": 0}], "remote": {"queues": [{"name": "inbox", "producers": 0}]},
           "forwards": [{"name": "f", "source": "outbox", "destination": "inbox"}]}
    assert parse_scenario("ok", raw).forwarded() == {"outbox", "inbox"}
    for broken in ({**raw, "queues": [{"name": "outbox"}]},                      # consumers would steal from it
                   {**raw, "forwards": [{"name": "f", "source": "outbox", "destination": "elsewhere"}]},
                   {**raw, "remote": {"queues": [{"name": "outbox"}]}}):
        with pytest.raises(ValueError):
            parse_scenario("broken", broken)


def test_a_schedule_is_the_same_for_the_same_seed_and_bounded() -> None:
    spec = FaultSpec(kinds=FAULT_KINDS[:6], duration_s=(1, 3), quiet_s=(0.5, 1), tracks=2)
    first, again = plan(spec, 60, random.Random(4)), plan(spec, 60, random.Random(4))
    assert first == again and plan(spec, 60, random.Random(5)) != first
    for track in (0, 1):
        faults = [item for item in first if item.track == track]
        for earlier, later in zip(faults, faults[1:], strict=False):
            assert earlier.at_s + earlier.fault.duration_s <= later.at_s      # one at a time per track


def test_a_bad_scenario_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="majority-ring needs 5"):
        parse_scenario("ring", {"nodes": 3, "queues": [{"name": "q"}], "nemesis": {"kinds": ["majority-ring"]}})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_scenario("typo", {"queues": [{"name": "q", "produsers": 2}]})
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("meteor", 1.0)


def test_macro_copies_are_judged_in_their_members_and_counted_per_call() -> None:
    """Under `all`, one call is one enqueue per member: the copy's dedupe id (tag@member, as the
    journals hold it) and the payload's tag (as the member's consumers see it)."""
    history = Recorder()
    for tag, outcomes in (("m.0.1", {"a": ("ok", 1), "b": ("ok", 1)}), ("m.0.2", {"a": ("ok", 2), "b": ("fail", None)})):
        for member, (status, message_id) in outcomes.items():
            history.enqueue(f"{tag}@{member}", status, (0, 1), message_id, queue=member)
            history.entries[-1].update(tag=tag, macro="m")
    history.receive([(1, "m.0.1", 1), (2, "m.0.2", 1)], (2, 3), queue="a")
    history.receive([(1, "m.0.1", 1)], (2, 3), queue="b")
    result = checker.check(history.entries, {"a": "full", "b": "full"})
    assert result["valid"], result["violations"]
    assert result["macros"] == {"m": {"calls": 2, "every_copy_ok": 1, "some_copies_ok": 1, "no_copy_ok": 0}}
    history.entries.pop()                                     # b's copy of the first call never delivered
    lost = checker.check(history.entries, {"a": "full", "b": "full"})
    assert lost["violation_counts"] == {"lost": 1} and lost["violations"]["lost"][0]["queue"] == "b"


def test_redriven_messages_are_new_messages_that_must_be_delivered() -> None:
    """A dead letter redriven into its queue comes back under a new id with its old tag."""
    history = Recorder()
    history.enqueue("a", "ok", (0, 1), 1)
    history.enqueue("b", "ok", (0, 1), 2)
    history.receive([(1, "a", 1), (2, "b", 1)], (1, 2))          # both leased, never acked: dead-lettered
    history.entries.append({"op": "redrive", "queue": "q", "status": "ok", "ids": [3, 4], "t_invoke": 5,
                            "t_complete": 6})
    history.receive([(3, "a", 1), (4, "b", 1)], (7, 8))
    history.ack(3, "ok", (8, 9))
    history.ack(4, "ok", (8, 9))
    result = verdict(history)
    assert result["valid"], result["violations"]
    assert result["queues"]["q"]["redriven"] == 2 and result["counts"]["lost"] == 0
    history.entries.pop()
    history.entries.pop()
    history.entries.pop()
    history.receive([(3, "a", 1)], (7, 8))                       # 4 was never given to anyone
    assert verdict(history)["violation_counts"] == {"lost": 1}
    history.entries[3]["status"] = "unknown"                     # the redrive's answer was lost
    history.entries[3].pop("ids")
    assert verdict(history)["valid"]                             # 3 is taken as made by it
    history.entries[3]["status"] = "ok"
    history.entries[3]["ids"] = []                                # answered, and 3 is not in it
    assert "id_mismatch" in verdict(history)["violation_counts"]


def test_a_latest_channel_is_judged_per_subscriber() -> None:
    history: list[dict[str, Any]] = [
        {"op": "publish", "channel": "p", "tag": "p.0.1", "status": "ok", "id": 3, "t_invoke": 0, "t_complete": 1},
        {"op": "publish", "channel": "p", "tag": "p.0.2", "status": "unknown", "t_invoke": 1, "t_complete": 2},
        {"op": "publish", "channel": "p", "tag": "p.0.3", "status": "ok", "id": 9, "t_invoke": 2, "t_complete": 3}]

    def value(t: float, message_id: int, tag: str, subscriber: str = "s1") -> dict[str, Any]:
        return {"op": "channel_value", "channel": "p", "process": subscriber, "id": message_id, "tag": tag,
                "t_invoke": t, "t_complete": t}
    history += [value(1.5, 3, "p.0.1"), value(2.5, 6, "p.0.2"), value(3.5, 9, "p.0.3"), value(4, 9, "p.0.3"),
                {"op": "channel_end", "channel": "p", "process": "s1", "last_id": 9, "last_published": 9,
                 "t_invoke": 5, "t_complete": 5}]
    result = checker.check(history, {})
    assert result["valid"], result["violations"]
    assert result["channels"]["p"]["values_seen"] == 4 and result["channels"]["p"]["published_unknown"] == 1
    bad = history + [value(6, 3, "p.0.1"), value(7, 7, "p.0.9", "s2"),
                     {"op": "channel_end", "channel": "p", "process": "s2", "last_id": 7, "last_published": 9,
                      "t_invoke": 8, "t_complete": 8}]
    assert checker.check(bad, {})["violation_counts"] == {"older_value": 1, "stale_at_end": 1,
                                                          "unexpected_value": 1}


# --- liveness (chaos/liveness.py) ---------------------------------------------------------------------
PRODUCE_EVERY_S = 0.5
TAKE_AFTER_S = 0.1


def info(op: str, process: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"op": op, "process": process, "status": "info", "t_invoke": t, "t_complete": t, **fields}


def fault(began: float, healed: float, name: str) -> list[dict[str, Any]]:
    """A fault as the nemesis records it: the start record follows its first effect."""
    return [info("nemesis", "nemesis", began + 0.05, event="start", kind="kill-restart-now", fault=name,
                 began_s=began),
            info("nemesis", "nemesis", healed, event="stop", kind="kill-restart-now", fault=name, healed_s=healed)]


def worker(process: str, role: str, start: float, stop: float) -> list[dict[str, Any]]:
    return [info("worker", process, start, queue="q", role=role, event="start"),
            info("worker", process, stop, queue="q", role=role, event="stop")]


def steady_run(consumer_down: tuple[float, float] | None, faults: list[tuple[float, float]],
               until_s: float = 40.0) -> Recorder:
    """Producer `p` enqueues a message every PRODUCE_EVERY_S until `until_s`; push consumer `s`
    takes each TAKE_AFTER_S after its enqueue, except while it is down: then it takes them when
    it comes back, or never (the drain after the run takes them)."""
    history = Recorder()
    history.entries += worker("p", "producer", 0.0, until_s) + worker("s", "consumer", 0.0, until_s)
    for number, (began, healed) in enumerate(faults):
        history.entries += fault(began, healed, f"f{number}")
    for number in range(int(until_s / PRODUCE_EVERY_S)):
        enqueued = number * PRODUCE_EVERY_S
        history.enqueue(f"m{number}", "ok", (enqueued, enqueued + 0.02), number + 1)
        taken = enqueued + TAKE_AFTER_S
        if consumer_down is not None and consumer_down[0] <= taken < consumer_down[1]:
            taken = consumer_down[1] + number * 0.001
        if taken < until_s:
            history.receive([(number + 1, f"m{number}", 1)], (taken, taken), via="push", process="s")
        else:
            history.receive([(number + 1, f"m{number}", 1)], (until_s + 5, until_s + 5.1), process="drain")
            history.entries[-1]["phase"] = "drain"
    history.entries.sort(key=lambda entry: entry["t_complete"])
    return history


def test_a_consumer_that_stalls_after_a_fault_heals_makes_the_run_invalid() -> None:
    history = steady_run(consumer_down=(10.0, 60.0), faults=[(10.0, 12.0)])
    result = verdict(history)
    assert result["violation_counts"] == {"liveness_stall": 1}, result["violations"]
    stall = result["liveness"]["invalidating"][0]
    assert (stall["process"], stall["role"], stall["after_heal_at"]) == ("s", "consumer", 12.0)
    assert stall["stall_from"] == pytest.approx(10.0, abs=0.2) and stall["stall_to"] == 40.0
    assert stall["outside_faults_s"] == pytest.approx(28.0)
    clients = result["liveness"]["clients"]
    assert clients["s"]["longest_stall_s"] == pytest.approx(30.0, abs=0.2)
    assert clients["p"]["longest_stall_s"] < 1.0 and clients["p"]["role"] == "producer"
    assert result["liveness"]["fault_windows"] == [[10.0, 12.0]]


def test_a_stall_inside_a_fault_or_ending_within_the_limit_after_its_heal_is_fine() -> None:
    inside = verdict(steady_run(consumer_down=(10.0, 19.0), faults=[(9.8, 19.5)]))
    assert inside["valid"], inside["violations"]
    assert inside["liveness"]["clients"]["s"]["longest_stall_s"] == pytest.approx(9.0, abs=0.3)
    soon_after = steady_run(consumer_down=(10.0, 12.0 + LIVENESS_STALL_MAX_S - 1), faults=[(10.0, 12.0)])
    assert verdict(soon_after)["valid"]
    overlapping = steady_run(consumer_down=(10.0, 24.0), faults=[(10.0, 15.0), (14.0, 20.0)])
    assert verdict(overlapping)["valid"]            # two faults, one window: 4 s after the last heal
    too_late = steady_run(consumer_down=(10.0, 12.0 + LIVENESS_STALL_MAX_S + 1), faults=[(10.0, 12.0)])
    assert verdict(too_late)["violation_counts"] == {"liveness_stall": 1}
    quiet = steady_run(consumer_down=(20.0, 27.0), faults=[(5.0, 8.0)])
    assert verdict(quiet)["liveness"]["invalidating"][0]["after_heal_at"] is None    # a stall in quiet time
    relaxed = checker.check(quiet.entries, {"q": "full"}, liveness_stall_max_s=10.0)
    assert relaxed["valid"], relaxed["violations"]


def test_a_consumer_with_no_work_is_never_stalled() -> None:
    """An idle queue is no stall; nor are messages another consumer takes at once: they were
    never left waiting for this one."""
    history = Recorder()
    history.entries += worker("s", "consumer", 0.0, 60.0) + worker("c", "consumer", 0.0, 60.0)
    history.enqueue("a", "ok", (0.0, 0.1), 1)
    history.entries[-1]["process"] = "once"         # a producer that enqueued once
    history.receive([(1, "a", 1)], (0.2, 0.2), via="push", process="s")
    for number in range(2, 40):                     # from 20 s on, consumer c takes each at once
        enqueued = 18.0 + number
        history.enqueue(f"m{number}", "ok", (enqueued, enqueued + 0.05), number)
        history.receive([(number, f"m{number}", 1)], (enqueued + 0.1, enqueued + 0.2), process="c")
    result = verdict(history)
    assert result["valid"], result["violations"]
    assert result["liveness"]["clients"]["s"]["longest_stall_s"] < 0.2


def test_a_message_pushed_to_another_consumer_is_no_work_for_this_one_but_its_own_buffer_is() -> None:
    history = Recorder()
    history.entries += worker("s1", "consumer", 0.0, 30.0) + worker("s2", "consumer", 0.0, 30.0)
    history.enqueue("a", "ok", (0.0, 0.1), 1)
    history.enqueue("b", "ok", (0.0, 0.1), 2)
    history.receive([(1, "a", 1)], (20.0, 20.0), via="push", process="s1")     # in s1's buffer for 20 s
    history.receive([(2, "b", 1)], (20.5, 20.5), via="push", process="s1")
    clients = checker.check(history.entries, {"q": "full"})["liveness"]["clients"]
    assert clients["s1"]["longest_stall_s"] == pytest.approx(19.9)
    assert clients["s2"]["longest_stall_s"] == 0.0


def test_a_producer_that_cannot_enqueue_long_after_a_heal_stalls() -> None:
    history = Recorder()
    history.entries += worker("p", "producer", 0.0, 40.0) + fault(10.0, 12.0, "f1")
    for number in range(20):                         # every 0.5 s until 10 s
        history.enqueue(f"m{number}", "ok", (number / 2, number / 2 + 0.01), number + 1)
    for number, at in enumerate((10.0, 18.0, 26.0)):  # then each times out
        history.enqueue(f"late{number}", "unknown", (at, at + 8.0))
    result = verdict(history)
    stall = result["liveness"]["invalidating"][0]
    assert (stall["process"], stall["role"], stall["after_heal_at"]) == ("p", "producer", 12.0)
    assert stall["stall_s"] == pytest.approx(30.49) and "liveness_stall" in result["violation_counts"]
    history.enqueue("back", "ok", (15.0, 16.0), 21)   # enqueuing again 4 s after the heal
    history.entries.append(info("worker", "p", 16.5, queue="q", role="producer", event="stop"))
    history.entries = [e for e in history.entries if not (e["op"] == "worker" and e["t_complete"] == 40.0)]
    assert "liveness_stall" not in verdict(history)["violation_counts"]


def test_fault_windows_come_from_the_nemesis_records_and_an_unhealed_fault_ends_with_the_heal() -> None:
    from chaos.liveness import fault_windows
    entries = fault(5.0, 7.0, "f1") + [
        info("nemesis", "nemesis", 10.0, event="error", kind="kill", fault="f2", began_s=9.5),
        info("nemesis", "nemesis", 10.5, event="stop", kind="kill", fault="f2", healed_s=10.5),
        info("nemesis", "nemesis", 20.0, event="start", kind="pause", fault="f3", began_s=19.9),
        info("nemesis", "nemesis", 25.0, event="healed")]
    assert fault_windows(entries) == [(5.0, 7.0), (9.5, 10.5), (19.9, 25.0)]


def test_kill_restart_now_starts_the_node_again_within_half_a_second() -> None:
    schedule = plan(FaultSpec(kinds=("kill-restart-now",), duration_s=(1, 20), quiet_s=(1, 2)), 60, random.Random(3))
    assert schedule and all(0 <= item.fault.duration_s <= RESTART_NOW_DELAY_MAX_S for item in schedule)
    assert Fault("kill-restart-now", 0.0).duration_s == 0.0
    with pytest.raises(ValueError, match="within"):
        Fault("kill-restart-now", 3.0)
    for name in ("kill-restart", "combined"):
        scenario = load_scenario(name)
        assert "kill-restart-now" in scenario.nemesis.kinds
        assert any(queue.push_hold_s and queue.push_consumers and not queue.consumers for queue in scenario.queues)


def test_a_push_hold_needs_push_consumers_and_must_fit_in_the_lease() -> None:
    held = {"name": "q", "push_consumers": 1, "push_hold_s": 0.25}
    assert parse_scenario("ok", {"queues": [held]}).queues[0].push_hold_s == 0.25
    for broken in ({**held, "push_consumers": 0}, {**held, "push_hold_s": 1.0}):
        with pytest.raises(ValueError, match="push_hold_s"):
            parse_scenario("broken", {"queues": [broken]})
    assert parse_scenario("t", {"queues": [{"name": "q"}], "liveness_stall_max_s": 8}).liveness_stall_max_s == 8.0
