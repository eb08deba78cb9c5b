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


# --- a forward's own bands and weights (seed 003 figure 6; issue 37 item 12) ------------------
def test_a_forwards_own_thresholds_and_weights_give_its_weight() -> None:
    from qserver.features.forwards.decide import fill_of
    figure6 = {"bands": [0.2, 0.5, 0.8], "weights": [1, 2, 5, 9]}
    assert [fill_of(figure6, depth, 200, 0, 10).weight for depth in (0, 39, 40, 99, 100, 159, 160, 200)] \
        == [1, 1, 2, 2, 5, 5, 9, 9]                     # at a threshold: the band above (§4.2 "equal to or greater")
    assert fill_of(figure6, 100, 200, 0, 10).band == 2
    # No control: the root's uniform bands, the weight the band's number (as before item 12).
    assert [fill_of({}, depth, 200, 0, 10).weight for depth in (0, 19, 20, 100, 199, 200)] == [0, 0, 1, 5, 9, 9]
    # Weights only: as many uniform bands as weights; bands only: the weight is the band's number.
    assert [fill_of({"weights": [0, 3, 7]}, depth, 300, 0, 10).weight for depth in (0, 99, 100, 299, 300)] \
        == [0, 0, 3, 7, 7]
    assert [fill_of({"bands": [0.9]}, depth, 100, 0, 10).weight for depth in (89, 90)] == [0, 1]
    # The root's ceiling (its bands - 1) caps a weight of its own, and says so.
    capped = fill_of({"weights": [0, 50]}, 90, 100, 0, 10)
    assert capped.weight == 9 and capped.capped and capped.band == 1


def test_a_fill_in_bytes_counts_bytes_against_fill_bytes_not_messages() -> None:
    from qserver.features.forwards.decide import fill_of
    control = {"fill_unit": "bytes", "fill_bytes": 1_000_000, "bands": [0.5]}
    few_large = fill_of(control, 5, 1000, 600_000, 10)         # 5 messages of 120 kB
    many_small = fill_of(control, 900, 1000, 90_000, 10)       # 900 messages of 100 B
    assert few_large.band == 1 and many_small.band == 0
    assert few_large.unit == "bytes" and few_large.amount == 600_000 and few_large.capacity == 1_000_000
    messages = fill_of({"bands": [0.5]}, 900, 1000, 90_000, 10)
    assert messages.band == 1                                   # the same queues by messages: the other way round


@pytest.mark.parametrize(("raw", "fragment"), [
    ("x", "object"), ({"bandz": 3}, "no field"), ({"bands": 0}, "1..64"), ({"bands": [0.5, 0.5]}, "increasing"),
    ({"bands": [0.0, 0.5]}, "increasing"), ({"bands": [0.5, 1.0]}, "increasing"), ({"bands": [True]}, "increasing"),
    ({"bands": [0.5], "weights": [1, 2, 3]}, "2 bands"), ({"weights": [-1]}, "integers"),
    ({"weights": []}, "integers"), ({"weights": [1.5]}, "integers"), ({"fill_unit": "kg"}, "fill_unit"),
    ({"fill_unit": "bytes"}, "fill_bytes"), ({"fill_bytes": 0}, "fill_bytes"), ({"fill_bytes": "9"}, "fill_bytes"),
    ({"bands": list(range(1, 70))}, "increasing"),
])
def test_a_malformed_control_is_refused(raw: object, fragment: str) -> None:
    from qserver.features.forwards.decide import ControlProblem, checked_control
    with pytest.raises(ControlProblem, match=fragment):
        checked_control(raw)


def test_a_control_is_kept_as_given_and_changed_field_by_field() -> None:
    from qserver.features.forwards.decide import checked_control, merged_control
    assert checked_control(None) == {} and checked_control({}) == {}
    assert checked_control({"bands": 4}) == {"bands": [0.25, 0.5, 0.75]}
    made = checked_control({"bands": [0.5, 0.9], "weights": [0, 2, 8], "fill_unit": "bytes", "fill_bytes": 4096})
    assert made == {"bands": [0.5, 0.9], "weights": [0, 2, 8], "fill_unit": "bytes", "fill_bytes": 4096}
    assert merged_control(made, {"weights": [1, 2, 3]})["weights"] == [1, 2, 3]
    assert "weights" not in merged_control(made, {"bands": [0.3]})       # new bands drop weights not given
    back = merged_control(made, {"fill_unit": None, "fill_bytes": None})
    assert checked_control(back) == {"bands": [0.5, 0.9], "weights": [0, 2, 8]}


def test_a_forward_control_travels_in_the_map_only_from_level_3() -> None:
    from replication.cluster_map import (
        AddNode,
        ClusterMap,
        CreateQueue,
        PutForward,
        SetFeatureLevel,
        SetForwardControl,
        decode_command,
        decode_map,
        encode_command,
        encode_map,
    )
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}", True, 1))
    cluster.apply(SetFeatureLevel(2))
    assert cluster.apply(CreateQueue("src", {"strength": "full"}, "n1", "n2", 7))[0].applied
    control = {"bands": [0.5], "weights": [1, 4]}
    plain = PutForward("f", "src", "dst", (), "", "", 5, "ab")
    assert len(encode_command(plain)) == len(encode_command(PutForward("f", "src", "dst", (), "", "", 5, "ab", {})))
    assert decode_command(encode_command(plain)) == plain                 # no control: the row 0.2.0 reads
    with_control = PutForward("f", "src", "dst", (), "", "", 5, "ab", control)
    assert decode_command(encode_command(with_control)) == with_control
    refused = cluster.apply(with_control)[0]
    assert not refused.applied and "level 3" in refused.reason and "f" not in cluster.forwards
    assert cluster.apply(plain)[0].applied
    change = SetForwardControl("f", 5, control)
    assert decode_command(encode_command(change)) == change
    assert not cluster.apply(change)[0].applied and cluster.forwards["f"].control == {}
    plain_snapshot = encode_map(cluster)
    cluster.apply(SetFeatureLevel(3))
    assert not cluster.apply(SetForwardControl("f", 4, control))[0].applied     # another incarnation
    assert cluster.apply(change)[0].applied and cluster.forwards["f"].control == control
    assert cluster.apply(change)[0].reason == "unchanged"
    assert decode_map(encode_map(cluster)).forwards["f"].control == control
    assert decode_map(plain_snapshot).forwards["f"].control == {}
    assert cluster.forwards["f"].to_json()["control"] == control
