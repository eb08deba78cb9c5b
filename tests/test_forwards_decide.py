"""The forward root's session rules (qserver/features/forwards/decide.py), deterministically:
which sessions are dropped, when the rates are sent, how soon the root looks again."""
from __future__ import annotations

import pytest

from qserver.features.forwards.decide import TICK_MAX_S, Heard, hold_s, keepalive_s, review


def test_the_hold_time_is_three_keepalives_and_at_least_three_seconds() -> None:
    assert keepalive_s(2.0) == 1.0 and keepalive_s(0.5) == 0.5
    assert hold_s(2.0) == 3.0 and hold_s(0.5) == 3.0 and hold_s(0.01) == 3.0


def test_a_session_silent_past_its_hold_time_or_closed_is_dropped() -> None:
    heard = {"quiet": Heard(100.0, False), "alive": Heard(102.5, False), "closed": Heard(103.0, True),
             "edge": Heard(100.5, False)}
    plan = review(heard, 103.5, computed_at=103.0, forward_interval_s=2.0, mode="adaptive")
    assert plan.silent == ["quiet", "closed"]           # edge: silent 3.0 s, not past the hold
    assert not plan.emptied and not plan.rates_at_once and not plan.rates_due
    assert plan.next_look_s == TICK_MAX_S


def test_the_rates_are_sent_every_interval() -> None:
    heard = {"a": Heard(10.0, False)}
    early = review(heard, 11.0, computed_at=10.0, forward_interval_s=2.0, mode="adaptive")
    assert not early.rates_due and early.next_look_s == TICK_MAX_S
    almost = review(heard, 11.9, computed_at=10.0, forward_interval_s=2.0, mode="adaptive")
    assert not almost.rates_due and almost.next_look_s == pytest.approx(0.1)
    due = review(heard, 12.0, computed_at=10.0, forward_interval_s=2.0, mode="adaptive")
    assert due.rates_due and not due.rates_at_once and due.next_look_s == TICK_MAX_S
    never = review(heard, 11.0, computed_at=0.0, forward_interval_s=2.0, mode="static")
    assert never.rates_due                                # never sent: at once
    fast = review(heard, 10.001, computed_at=10.0, forward_interval_s=0.005, mode="adaptive")
    assert fast.next_look_s == 0.01                       # not sooner than this


def test_in_static_mode_a_drop_resends_r_over_n_at_once_and_restarts_the_interval() -> None:
    heard = {"a": Heard(0.0, False), "b": Heard(9.0, False)}
    static = review(heard, 10.0, computed_at=9.0, forward_interval_s=2.0, mode="static")
    assert static.silent == ["a"] and static.rates_at_once and not static.rates_due
    adaptive = review(heard, 10.0, computed_at=9.0, forward_interval_s=2.0, mode="adaptive")
    assert adaptive.silent == ["a"] and not adaptive.rates_at_once and not adaptive.rates_due
    assert adaptive.next_look_s == TICK_MAX_S
    later = review(heard, 11.5, computed_at=9.0, forward_interval_s=2.0, mode="static")
    assert later.rates_at_once and not later.rates_due    # once, not twice


def test_a_queue_whose_sessions_all_went_silent_leaves_the_table() -> None:
    plan = review({"a": Heard(0.0, False), "b": Heard(9.0, True)}, 10.0, computed_at=9.0, forward_interval_s=2.0,
                  mode="static")
    assert plan.emptied and plan.silent == ["a", "b"] and not plan.rates_at_once and not plan.rates_due
    assert review({}, 10.0, computed_at=0.0, forward_interval_s=2.0, mode="adaptive").emptied
