"""The rules of fault surveillance (qserver/features/surveillance/decide.py), each on its own,
deterministically: no clock, no cluster, only what the watch would have seen and `now`."""
from __future__ import annotations

import asyncio
import json
import os
import random
import types
from dataclasses import dataclass
from typing import Any, cast

from qserver.features.surveillance import decide
from qserver.features.surveillance.decide import NOTHING_WAITS, WAIT_AGAIN, Clock, ReturnRoute, Verdict
from qserver.features.surveillance.watch import RecipientWatch
from replication.cluster_map import RecipientEntry, RecipientState
from replication.options import QueueOptions, QueueType, Strength
from wire.errors import QueueError
from wire.protocol import DeliveredMessage

OK, FAULT, DEFUNCT = RecipientState.OK, RecipientState.FAULT, RecipientState.DEFUNCT


@dataclass(frozen=True)
class Intervals:
    fault_interval_s: float = 5.0
    defunct_interval_s: float = 20.0
    message_interval_s: float = 0.0
    strength: Strength = Strength.FULL


def test_the_queue_options_are_intervals() -> None:
    options: decide.Intervals = QueueOptions(fault_interval_s=5.0)
    assert decide.watches_idleness(None, options, subscribed_here=True)


def test_a_subscription_or_a_take_makes_a_recipient_ok() -> None:
    assert decide.on_subscribe(None) == Verdict(OK, "subscribed")         # a new name is registered
    assert decide.on_subscribe(FAULT) == Verdict(OK, "subscribed")
    assert decide.on_subscribe(DEFUNCT) == Verdict(OK, "subscribed")
    assert decide.on_subscribe(OK) is None
    assert decide.on_take(FAULT) == Verdict(OK, "took a message")          # its probe
    assert decide.on_take(DEFUNCT) == Verdict(OK, "took a message")
    assert decide.on_take(OK) is None
    assert decide.on_take(None) is None                                     # taking registers no name


def test_idleness_counts_from_the_last_take_or_since_messages_wait_whichever_came_later() -> None:
    assert decide.idle_for(100.0, waiting_since=90.0, last_take=40.0) == 10.0     # idle over an empty queue
    assert decide.idle_for(100.0, waiting_since=40.0, last_take=97.5) == 2.5
    assert decide.idle_for(100.0, waiting_since=None, last_take=0.0) == 0.0      # offered nothing: not judged


def test_a_recipient_idle_past_the_fault_interval_while_messages_wait_is_in_fault() -> None:
    options = Intervals()
    assert decide.watches_idleness(OK, options, subscribed_here=True)
    assert decide.fault_verdict(4.999, 3, options, subscribed_here=True) is None
    assert decide.fault_verdict(5.0, 3, options, subscribed_here=True) == \
        Verdict(FAULT, "took no message for 5 s while 3 offered to it waited")
    assert decide.fault_verdict(7.0, 1, Intervals(fault_interval_s=0.5), subscribed_here=False) == \
        Verdict(FAULT, "not subscribed for 0.5 s while 1 waited")


def test_who_idleness_can_put_in_fault() -> None:
    full, producer, off = Intervals(), Intervals(strength=Strength.PRODUCER), Intervals(fault_interval_s=0.0)
    assert decide.watches_idleness(None, full, subscribed_here=True)        # subscribed, not registered yet
    assert not decide.watches_idleness(FAULT, full, subscribed_here=True)   # in fault already
    assert not decide.watches_idleness(DEFUNCT, full, subscribed_here=True)
    assert not decide.watches_idleness(OK, off, subscribed_here=True)       # surveillance off
    assert decide.watches_idleness(OK, full, subscribed_here=False)         # subscribed nowhere here
    assert not decide.watches_idleness(OK, producer, subscribed_here=False)  # maybe at the other member
    assert not decide.watches_idleness(None, full, subscribed_here=False)
    assert not decide.watches_idleness(FAULT, full, subscribed_here=False)


def test_in_fault_past_the_defunct_interval_a_recipient_is_defunct() -> None:
    options = Intervals(defunct_interval_s=20.0)
    assert decide.defunct_verdict(FAULT, 1_000, 20_999, options) is None
    assert decide.defunct_verdict(FAULT, 1_000, 21_000, options) == Verdict(DEFUNCT, "in fault for 20 s")
    assert decide.defunct_verdict(OK, 1_000, 99_000, options) is None
    assert decide.defunct_verdict(DEFUNCT, 1_000, 99_000, options) is None
    assert decide.defunct_verdict(FAULT, 1_000, 99_000, Intervals(defunct_interval_s=0.0)) is None


def test_a_message_waiting_past_the_message_interval_is_overdue() -> None:
    options = Intervals(message_interval_s=2.0)
    assert not decide.is_overdue(10_000, 11_999, options)
    assert decide.is_overdue(10_000, 12_000, options)
    assert not decide.is_overdue(None, 99_000, options)                     # no longer stored


def test_a_reason_is_restated_when_it_no_longer_says_what_holds_once_settled() -> None:
    entered = "took no message for 5 s while 3 waited"
    assert decide.restated_reason(entered, waiting=True) is None
    assert decide.restated_reason(entered, waiting=False) == f"took no message for 5 s; {NOTHING_WAITS}"
    emptied = f"took no message for 5 s; {NOTHING_WAITS}"
    assert decide.restated_reason(emptied, waiting=False) is None
    assert decide.restated_reason(emptied, waiting=True) == f"took no message for 5 s; {WAIT_AGAIN}"
    assert decide.restated_reason("in fault for 20 s", waiting=False) == f"in fault for 20 s; {NOTHING_WAITS}"
    assert not decide.settled(10.0, 10.0 + decide.NOTE_SETTLE_S - 0.001)
    assert decide.settled(10.0, 10.0 + decide.NOTE_SETTLE_S)


def test_state_changes_are_announced_once_by_the_queues_master() -> None:
    assert decide.announces(OK, FAULT, master_here=True)
    assert not decide.announces(OK, FAULT, master_here=False)
    assert not decide.announces(FAULT, FAULT, master_here=True)             # once
    assert decide.announces(None, FAULT, master_here=True)                  # found not ok at the start
    assert not decide.announces(None, OK, master_here=True)                 # found ok: nothing to say
    assert decide.announces(FAULT, OK, master_here=True)


def test_the_overdue_mover_runs_while_ok_the_other_while_not() -> None:
    assert decide.mover_runs(OK, overdue_only=True) and not decide.mover_runs(OK, overdue_only=False)
    assert decide.mover_runs(FAULT, overdue_only=False) and not decide.mover_runs(FAULT, overdue_only=True)
    assert decide.mover_runs(DEFUNCT, overdue_only=False)
    assert not decide.mover_runs(None, overdue_only=False) and not decide.mover_runs(None, overdue_only=True)


def _recipients(*entries: tuple[str, str, str]) -> dict[str, RecipientEntry]:
    return {name: RecipientEntry(name, queue, state) for name, queue, state in entries}


def test_a_waiting_message_goes_to_the_first_ok_alternative_of_the_chain() -> None:
    a = RecipientEntry("a", "q", FAULT)
    recipients = _recipients(("a", "q", FAULT), ("b", "qb", FAULT), ("c", "qc", OK), ("d", "qd", OK))
    chain, queues = ("b", "c", "d"), ("qb", "qc", "qd")
    assert list(decide.ok_alternatives(a, chain, queues, recipients.get)) == [("c", "qc"), ("d", "qd")]
    recipients["b"] = RecipientEntry("b", "qb", OK)
    assert next(decide.ok_alternatives(a, chain, queues, recipients.get)) == ("b", "qb")


def test_an_alternative_is_skipped_unless_it_consumes_the_queue_the_chain_names_other_than_the_recipients() -> None:
    a = RecipientEntry("a", "q", DEFUNCT)
    recipients = _recipients(("b", "elsewhere", OK), ("c", "q", OK), ("e", "qe", OK))
    chain, queues = ("b", "c", "unknown", "e"), ("qb", "q", "qu", "qe")
    assert list(decide.ok_alternatives(a, chain, queues, recipients.get)) == [("e", "qe")]


def test_alternatives_are_judged_as_the_mover_comes_to_them() -> None:
    a = RecipientEntry("a", "q", FAULT)
    recipients = _recipients(("b", "qb", OK), ("c", "qc", OK))
    chosen = decide.ok_alternatives(a, ("b", "c"), ("qb", "qc"), recipients.get)
    assert next(chosen) == ("b", "qb")
    recipients["c"] = RecipientEntry("c", "qc", FAULT)          # while b was refusing the message
    assert list(chosen) == []


def test_with_no_ok_alternative_a_message_returns_to_its_sender_or_waits() -> None:
    assert decide.return_route("replies", QueueType.QUEUED_ACK) is ReturnRoute.REPLY_TO
    assert decide.return_route("replies", QueueType.TWO_WAY) is ReturnRoute.REPLY_TO
    assert decide.return_route(None, QueueType.TWO_WAY) is ReturnRoute.REPLY
    assert decide.return_route("", QueueType.TWO_WAY) is ReturnRoute.REPLY
    assert decide.return_route(None, QueueType.QUEUED_ACK) is ReturnRoute.WAIT
    assert decide.fault_text([("a", FAULT)]) == "recipient a (fault) not ok and no alternative is ok"
    assert decide.fault_text([("a", FAULT), ("b", DEFUNCT), ("c", None)]) == \
        "recipients a (fault), b (defunct), c (not registered) not ok and no alternative is ok"


def test_a_pushed_message_past_its_message_interval_is_overdue_too() -> None:
    options = Intervals(message_interval_s=2.0)
    assert decide.overdue_pushed({7: 10_000, 8: 11_000, 9: None}, 12_000, options) == [7]
    assert decide.overdue_pushed({7: 10_000, 8: 11_000}, 13_000, options) == [7, 8]
    assert decide.overdue_pushed({7: 0}, 99_000, Intervals(message_interval_s=0.0)) == []    # off


def test_the_chain_travels_with_the_message() -> None:
    assert decide.route_of("a", None, None) == decide.Route("a", ("a",))            # at its first recipient
    assert decide.route_of("b", "a", "a") == decide.Route("a", ("a", "b"))          # moved from a to b
    assert decide.route_of("b", "a", "a,b") == decide.Route("a", ("a", "b"))        # b's own mover again
    assert decide.route_of("c", "a", None) == decide.Route("a", ("a", "c"))         # moved before the list
    # At b (in fault), a's chain b, c, d: b was tried, c is next; b's own chain is not followed.
    b = RecipientEntry("b", "qb", FAULT)
    recipients = _recipients(("b", "qb", FAULT), ("c", "qc", OK), ("d", "qd", OK))
    route = decide.route_of("b", "a", "a")
    assert list(decide.ok_alternatives(b, ("b", "c", "d"), ("qb", "qc", "qd"), recipients.get, route.tried)) == \
        [("c", "qc"), ("d", "qd")]


def test_a_move_whose_answer_was_lost_is_settled_at_that_alternative() -> None:
    answer, settle, gone, following = (decide.move_answer, decide.MoveAnswer.SETTLE_HERE, decide.MoveAnswer.GONE,
                                       decide.MoveAnswer.NEXT)
    assert answer("E_TIMEOUT", outcome_unknown=True, retriable=True, unsettled=False) is settle
    assert answer("E_NOT_MASTER", outcome_unknown=False, retriable=True, unsettled=False) is settle
    assert answer("E_QUEUE_FULL", outcome_unknown=False, retriable=True, unsettled=False) is following
    assert answer("E_FORBIDDEN", outcome_unknown=False, retriable=False, unsettled=False) is following
    assert answer("E_UNKNOWN_QUEUE", outcome_unknown=False, retriable=False, unsettled=False) is following
    # Once unknown: any refusal of the retry keeps it there (it does not say the first stored
    # nothing), except its queue gone.
    assert answer("E_QUEUE_FULL", outcome_unknown=False, retriable=True, unsettled=True) is settle
    assert answer("E_FORBIDDEN", outcome_unknown=False, retriable=False, unsettled=True) is settle
    assert answer("E_UNKNOWN_QUEUE", outcome_unknown=False, retriable=False, unsettled=True) is gone


def test_random_histories_keep_the_invariants() -> None:
    """A recipient's life replayed from random events, the way the watch applies the rules
    each tick: it is never left ok while idle past its interval with messages waiting, never
    in fault past the defunct interval, and a take or a subscription always makes it ok."""
    seed = int(os.environ.get("SURVEILLANCE_SEED", random.randrange(2**32)))
    print(f"seed {seed} (SURVEILLANCE_SEED={seed} replays it)")
    rng = random.Random(seed)
    for _ in range(200):
        options = Intervals(fault_interval_s=rng.choice([0.5, 1.0, 3.0]), defunct_interval_s=rng.choice([0.0, 5.0]))
        now, since, last_take, depth = 0.0, 0.0, 0.0, 0
        waiting_since: float | None = None
        state_is: str | None = None
        for _ in range(100):
            now += rng.choice([0.05, 0.2, 0.7, 2.0])
            event = rng.random()
            if event < 0.1:
                verdict = decide.on_take(state_is)
                last_take = now
                if state_is is not None:
                    assert state_is == OK or verdict == Verdict(OK, "took a message")
            elif event < 0.15:
                verdict = decide.on_subscribe(state_is)
                last_take = now
                assert state_is == OK or verdict == Verdict(OK, "subscribed")
            elif event < 0.4:
                depth = rng.choice([0, 0, 1, 7])
                verdict = None
            else:
                verdict = None
            if verdict is not None:
                state_is, since = verdict.state, now
                continue
            if depth == 0:
                waiting_since = None
                idle = 0.0
            else:
                waiting_since = now if waiting_since is None else waiting_since
                idle = decide.idle_for(now, waiting_since, last_take)
            if decide.watches_idleness(state_is, options, subscribed_here=True):
                verdict = decide.fault_verdict(idle, depth, options, subscribed_here=True)
                if verdict is not None:
                    state_is, since = verdict.state, now
                else:
                    assert idle < options.fault_interval_s
            elif state_is == FAULT:
                verdict = decide.defunct_verdict(FAULT, int(since * 1000), int(now * 1000), options)
                if verdict is not None:
                    assert verdict.state == DEFUNCT
                    state_is, since = verdict.state, now
            # The invariants after the tick.
            if state_is in (None, OK) and depth:
                assert idle < options.fault_interval_s, (seed, now, idle)
            if state_is == FAULT and options.defunct_interval_s:
                assert now - since < options.defunct_interval_s + 0.002, (seed, now, since)


@dataclass
class _Subscription:
    subscription_id: int
    pushed: dict[int, str]
    held: bool = False


class _Services:
    """A stand-in for NodeServices: one queue `q` mastered here, recipients subscribed here as
    `subscriptions` says; the map commands the watch proposes and the commands it submits are
    kept, not applied."""

    def __init__(self, options: QueueOptions, depth: int, subscriptions: dict[tuple[str, str], list[Any]] | None = None,
                 enqueued: dict[int, int] | None = None) -> None:
        self.cluster_map = types.SimpleNamespace(recipients={}, channels={}, alternatives={}, alternative_queues={},
                                                 alternatives_set_by={})
        self.core = types.SimpleNamespace(name="q", queue_id=1, options=options, depth=depth, in_flight=0,
                                          head=lambda: None, has_ready=lambda: depth > 0,
                                          record=types.SimpleNamespace(incarnation=5))
        self.subscriptions = {("q", "a"): [_Subscription(1, {1: "r1", 2: "r2", 3: "r3"})]} \
            if subscriptions is None else subscriptions
        self.enqueued = enqueued or {}
        self.clustered = True
        self.auth_enabled = False
        self.proposed: list[Any] = []
        self.submitted: list[Any] = []
        self.served: list[str] = []
        self.journal: list[str] = []
        self.calls: list[Any] = []

    def recipients_here(self) -> dict[tuple[str, str], list[Any]]:
        return self.subscriptions

    def recipient_subscriptions(self, queue: str, recipient: str) -> list[Any]:
        return self.subscriptions.get((queue, recipient), [])

    def master_core(self, queue: str) -> Any:
        return self.core if queue == "q" else None

    held_core = master_core

    def is_master(self, queue: str) -> bool:
        return queue == "q"

    def propose(self, command: Any, finish: Any, result: Any) -> None:
        self.proposed.append(command)

    def submit(self, command: Any) -> None:
        self.submitted.append(command)

    def serve_soon(self, queue: str) -> None:
        self.served.append(queue)

    def enqueued_ms(self, queue_id: int, message_id: int) -> int | None:
        return self.enqueued.get(message_id)

    def producer(self, queue_id: int, message_id: int) -> str | None:
        return "producer"

    def journal_event(self, core: Any, op: str, subject: str, detail: str) -> None:
        self.journal.append(detail)

    async def call(self, factory: Any) -> list[Any]:
        self.calls.append(factory(None))
        return []          # the mover finds nothing to move


def _watch(services: _Services, mono: list[float], wall: list[int], macros: Any = None) -> RecipientWatch:
    return RecipientWatch(cast(Any, services), cast(Any, macros), Clock(lambda: mono[0], lambda: wall[0]))


def test_the_watch_judges_with_its_injected_clock() -> None:
    """The driver (RecipientWatch) reads time only from its clock: idle 5 s holding 3 messages
    offered to it is a fault proposal stamped with the wall clock, and 20 s in fault a defunct one."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        options = QueueOptions(fault_interval_s=5.0, defunct_interval_s=20.0, strength=Strength.FULL)
        services = _Services(options, depth=3)
        watch = _watch(services, mono, wall)
        watch._check()                                   # first seen: idleness counts from now
        mono[0] += 4.9
        watch._check()
        assert services.proposed == []
        mono[0] += 0.1
        watch._check()
        assert [(p.name, p.state, p.since_ms, p.reason) for p in services.proposed] == [
            ("a", FAULT, 1_000_000, "took no message for 5 s while 3 offered to it waited")]
        services.proposed.clear()
        services.cluster_map.recipients["a"] = RecipientEntry("a", "q", FAULT, 1_000_000, "took no message")
        wall[0] += 19_999
        watch._check()
        assert services.proposed == [] and services.journal == ["fault: took no message"]
        wall[0] += 1
        watch._check()
        assert [(p.state, p.reason) for p in services.proposed] == [(DEFUNCT, "in fault for 20 s")]
        await watch.stop()
    asyncio.run(run())


def test_a_recipient_offered_nothing_is_not_judged_while_the_queue_holds_messages() -> None:
    """Issue 37, item 6: two recipients of one queue, the engine filled the first: the second,
    offered nothing while 9 messages are in the queue (held by the first and a pull receiver),
    is never in fault; the first, holding what it was offered, is after the interval."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        options = QueueOptions(fault_interval_s=1.0, strength=Strength.FULL)
        first, second = _Subscription(1, {1: "r1", 2: "r2", 3: "r3", 4: "r4"}), _Subscription(2, {})
        services = _Services(options, depth=9, subscriptions={("q", "a"): [first], ("q", "b"): [second]})
        services.cluster_map.recipients.update(_recipients(("a", "q", OK), ("b", "q", OK)))
        watch = _watch(services, mono, wall)
        for _ in range(30):
            watch._check()
            mono[0] += 0.2
        assert [(p.name, p.state) for p in services.proposed] == [("a", FAULT)]
        # b is offered a message now: its interval starts then, and it answers within it.
        second.pushed[5] = "r5"
        watch._check()
        mono[0] += 0.9
        watch._check()
        watch.took("q", "b", [5])
        mono[0] += 5.0
        watch._check()
        assert [(p.name, p.state) for p in services.proposed] == [("a", FAULT)]
        await watch.stop()
    asyncio.run(run())


def test_a_pushed_message_past_its_interval_is_taken_back_and_pushing_held_until_an_answer() -> None:
    """Issue 37, item 7: the message interval is each message's deadline, also once pushed: the
    watch releases the lease (as the cluster) and holds the subscription, which an answer frees."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        options = QueueOptions(message_interval_s=2.0, fault_interval_s=10.0, strength=Strength.FULL)
        hung = _Subscription(1, {1: "r1", 2: "r2"})
        services = _Services(options, depth=2, subscriptions={("q", "a"): [hung]},
                             enqueued={1: 999_000, 2: 1_000_500})
        services.cluster_map.recipients.update(_recipients(("a", "q", OK)))
        watch = _watch(services, mono, wall)
        watch._check()
        assert services.submitted == [] and not hung.held
        wall[0] += 1_000                                   # message 1 enqueued 2 s ago
        watch._check()
        assert [(s.message_id, s.receipt, s.release, s.client) for s in services.submitted] == \
            [(1, "r1", True, "@cluster")]
        assert hung.pushed == {2: "r2"} and hung.held and watch.taken_back["a"] == 1
        wall[0] += 1_500
        watch._check()
        assert [s.message_id for s in services.submitted] == [1, 2] and hung.pushed == {}
        watch._check()
        assert hung.held                                    # still owes an answer
        watch.took("q", "a", [1])                           # its late ack (refused by the queue)
        assert not hung.held and services.served == ["q"]
        assert any('qserver_recipient_taken_back_total{recipient="a"} 2' in line for line in watch.render_metrics())
        await watch.stop()
    asyncio.run(run())


class _LosingClient:
    """The cluster's client as the mover sees it: each enqueue is stored, and its answer lost
    while `losing` (outcome unknown)."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, str, dict[str, str]]] = []
        self.losing = True

    def client_for(self, client_id: str) -> Any:
        return self

    async def enqueue(self, queue: str, payload: bytes, priority: int, dedupe: str, *, headers: dict[str, str]) -> int:
        if (queue, dedupe) not in [(q, d) for q, d, _ in self.stored]:
            self.stored.append((queue, dedupe, headers))
        if self.losing:
            raise QueueError("E_TIMEOUT", "lost", outcome_unknown=True)
        return 1


def test_a_move_whose_answer_was_lost_goes_nowhere_else_even_once_that_alternative_is_in_fault() -> None:
    """Issue 37, item 9: b's answer was lost, then b left the ok state: the next try is at b
    again (same dedupe id), never at c, until b answers; one copy."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        services = _Services(QueueOptions(fault_interval_s=1.0, strength=Strength.FULL), depth=1, subscriptions={})
        cluster = services.cluster_map
        cluster.recipients.update(_recipients(("a", "q", FAULT), ("b", "qb", OK), ("c", "qc", OK)))
        cluster.alternatives["a"], cluster.alternative_queues["a"] = ("b", "c"), ("qb", "qc")
        client = _LosingClient()
        watch = _watch(services, mono, wall, client)
        message = DeliveredMessage(7, "receipt-7", 4, 1, b"m", {})
        entry = cluster.recipients["a"]
        assert not await watch._fail_over(entry, cast(Any, services.core), message)
        cluster.recipients["b"] = RecipientEntry("b", "qb", FAULT)
        for _ in range(3):
            assert not await watch._fail_over(entry, cast(Any, services.core), message)
        assert [queue for queue, _, _ in client.stored] == ["qb"]
        client.losing = False
        assert await watch._fail_over(entry, cast(Any, services.core), message)
        [(queue, dedupe, headers)] = client.stored
        assert (queue, dedupe) == ("qb", "fo:5:7") and watch.moved[("a", "b")] == 1
        assert (headers["x-failed-over-from"], headers["x-failed-over-tried"]) == ("a", "a")
        assert [(call.message_id, call.release) for call in services.calls] == [(7, False)]      # acked once
        assert watch._unsettled_moves == {}
        await watch.stop()
    asyncio.run(run())


def test_a_moved_message_follows_the_chain_it_started_on_and_returns_naming_those_tried() -> None:
    """Issue 37, item 8: at b (in fault) a message moved from a goes on along a's chain (to c),
    not along b's own (to x); with none ok it returns naming a, b and c."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        services = _Services(QueueOptions(fault_interval_s=1.0, strength=Strength.FULL, type=QueueType.TWO_WAY),
                             depth=1, subscriptions={})
        cluster = services.cluster_map
        cluster.recipients.update(_recipients(("a", "qa", FAULT), ("b", "q", FAULT), ("c", "qc", OK),
                                              ("x", "qx", OK)))
        cluster.alternatives.update({"a": ("b", "c"), "b": ("x",)})
        cluster.alternative_queues.update({"a": ("q", "qc"), "b": ("qx",)})
        client = _LosingClient()
        client.losing = False
        watch = _watch(services, mono, wall, client)
        moved = DeliveredMessage(8, "receipt-8", 4, 1, b"m", {"x-failed-over-from": "a", "x-failed-over-tried": "a"})
        assert await watch._fail_over(cluster.recipients["b"], cast(Any, services.core), moved)
        [(queue, _, headers)] = client.stored
        assert queue == "qc" and (headers["x-failed-over-from"], headers["x-failed-over-tried"]) == ("a", "a,b")
        cluster.recipients["c"] = RecipientEntry("c", "qc", DEFUNCT)
        assert await watch._fail_over(cluster.recipients["b"], cast(Any, services.core), moved)
        reply = json.loads(services.calls[-1].reply_payload)
        assert reply == {"returned": True, "recipient": "a",
                         "fault": "recipients a (fault), b (fault), c (defunct) not ok and no alternative is ok"}
        await watch.stop()
    asyncio.run(run())
