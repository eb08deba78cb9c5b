"""The rules of fault surveillance (qserver/features/surveillance/decide.py), each on its own,
deterministically: no clock, no cluster, only what the watch would have seen and `now`."""
from __future__ import annotations

import asyncio
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


def test_a_recipient_idle_past_the_fault_interval_while_messages_wait_is_in_fault() -> None:
    options = Intervals()
    assert decide.watches_idleness(OK, options, subscribed_here=True)
    assert decide.fault_verdict(4.999, 3, options, subscribed_here=True) is None
    assert decide.fault_verdict(5.0, 3, options, subscribed_here=True) == \
        Verdict(FAULT, "took no message for 5 s while 3 waited")
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
    assert decide.fault_text(RecipientEntry("a", "q", FAULT)) == "recipient a is fault and no alternative is ok"


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


class _Services:
    """A stand-in for NodeServices: one queue `q` mastered here, recipient `a` subscribed here;
    the map commands the watch proposes are kept, not applied."""

    def __init__(self, options: QueueOptions, depth: int) -> None:
        self.cluster_map = types.SimpleNamespace(recipients={}, channels={}, alternatives={}, alternative_queues={},
                                                 alternatives_set_by={})
        self.core = types.SimpleNamespace(name="q", queue_id=1, options=options, depth=depth, head=lambda: None)
        self.clustered = True
        self.proposed: list[Any] = []
        self.journal: list[str] = []

    def recipients_here(self) -> dict[tuple[str, str], list[Any]]:
        return {("q", "a"): []}

    def master_core(self, queue: str) -> Any:
        return self.core if queue == "q" else None

    held_core = master_core

    def is_master(self, queue: str) -> bool:
        return queue == "q"

    def propose(self, command: Any, finish: Any, result: Any) -> None:
        self.proposed.append(command)

    def journal_event(self, core: Any, op: str, subject: str, detail: str) -> None:
        self.journal.append(detail)

    async def call(self, factory: Any) -> list[Any]:
        return []          # the mover finds nothing to move


def test_the_watch_judges_with_its_injected_clock() -> None:
    """The driver (RecipientWatch) reads time only from its clock: idle 5 s with 3 waiting is a
    fault proposal stamped with the wall clock, and 20 s in fault a defunct one."""
    async def run() -> None:
        mono, wall = [100.0], [1_000_000]
        options = QueueOptions(fault_interval_s=5.0, defunct_interval_s=20.0, strength=Strength.FULL)
        services = _Services(options, depth=3)
        watch = RecipientWatch(cast(Any, services), cast(Any, None), Clock(lambda: mono[0], lambda: wall[0]))
        watch._check()                                   # first seen: idleness counts from now
        mono[0] += 4.9
        watch._check()
        assert services.proposed == []
        mono[0] += 0.1
        watch._check()
        assert [(p.name, p.state, p.since_ms, p.reason) for p in services.proposed] == [
            ("a", FAULT, 1_000_000, "took no message for 5 s while 3 waited")]
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
