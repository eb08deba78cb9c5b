"""The channel hub's rules (qserver/features/channels/decide.py), deterministically: when a last
value or a durable message is sent again, what a read of a durable backlog sends, and where a
new publish goes."""
from __future__ import annotations

from qserver.features.channels import decide
from qserver.features.channels.decide import DURABLE_RESEND_S, DURABLE_WINDOW, Fill, Offer


def test_a_last_value_is_resent_once_its_interval_has_passed_since_it_was_last_sent() -> None:
    assert not decide.last_value_due(0.0, 0.0, 1_000.0)            # no resend interval: never
    assert decide.last_value_due(2.0, 0.0, 1_000.0)                # never sent here
    assert not decide.last_value_due(2.0, 999.0, 1_000.0)
    assert decide.last_value_due(2.0, 998.0, 1_000.0)


def test_unacknowledged_durable_messages_are_resent_after_the_interval() -> None:
    assert decide.durable_resend_interval(0.0) == DURABLE_RESEND_S
    assert decide.durable_resend_interval(1.5) == 1.5
    sent = {7: 10.0, 3: 12.0, 9: 11.0}
    assert decide.resends_due(sent, 15.0, 5.0) == [7]
    assert decide.resends_due(sent, 16.0, 5.0) == [7, 9]
    assert decide.resends_due(sent, 17.0, 5.0) == [7, 3, 9]        # in the order sent
    assert decide.resends_due({}, 99.0, 5.0) == []


def _rows(*indexes: int) -> list[tuple[int, bytes]]:
    return [(index, b"m%d" % index) for index in indexes]


def test_a_backlog_read_sends_up_to_the_window_skipping_the_acknowledged() -> None:
    assert decide.window_room(0) == DURABLE_WINDOW and decide.window_room(DURABLE_WINDOW) == 0
    fill = decide.plan_fill(_rows(4, 5, 6), asked=5, room=4, acked={5}, visible_upto=None, cursor=3)
    assert fill == Fill(_rows(4, 6), 6, True)                        # fewer rows than asked: its end
    full = decide.plan_fill(_rows(4, 5, 6, 7, 8), asked=5, room=2, acked={5}, visible_upto=None, cursor=3)
    assert full == Fill(_rows(4, 6), 6, False)                       # the window is full before 7
    exact = decide.plan_fill(_rows(4, 5, 6), asked=3, room=3, acked=set(), visible_upto=None, cursor=3)
    assert exact == Fill(_rows(4, 5, 6), 6, False)                   # as many as asked: maybe more


def test_a_backlog_read_stops_at_what_is_committed() -> None:
    fill = decide.plan_fill(_rows(4, 5, 6, 7), asked=4, room=4, acked=set(), visible_upto=5, cursor=0)
    assert fill == Fill(_rows(4, 5), 5, True)                        # 6 and 7 go out as they commit
    empty = decide.plan_fill([], asked=10, room=10, acked=set(), visible_upto=None, cursor=12)
    assert empty == Fill([], 12, True)


def test_a_new_publish_goes_straight_to_a_caught_up_reader_with_room() -> None:
    assert decide.offer(10, cursor=9, caught_up=True, unacknowledged=0) is Offer.SEND
    assert decide.offer(10, cursor=9, caught_up=True, unacknowledged=DURABLE_WINDOW) is Offer.LATER
    assert decide.offer(10, cursor=9, caught_up=False, unacknowledged=0) is Offer.LATER
    assert decide.offer(10, cursor=10, caught_up=True, unacknowledged=0) is Offer.SENT
    assert decide.offer(10, cursor=12, caught_up=False, unacknowledged=DURABLE_WINDOW) is Offer.SENT


def test_a_publish_answered_after_a_later_one_is_not_passed_over_by_a_durable_reader() -> None:
    # Release 0.2.0's rolling upgrade found a durable reader that got 466, then 469 onwards,
    # never 468: 468's answer came late (its publisher retried the dedupe id across a node's
    # stop), after 469's had moved the reader's cursor past it.
    assert decide.passed_over(468, sent={469: 1.0}, floor=466, acked=[])
    assert not decide.passed_over(468, sent={468: 1.0}, floor=466, acked=[])      # sent, awaiting its ack
    assert not decide.passed_over(468, sent={}, floor=468, acked=[])               # acknowledged (floor)
    assert not decide.passed_over(468, sent={}, floor=466, acked=[468])            # acknowledged (above floor)

    from types import SimpleNamespace

    from qserver.features.channels.hub import ChannelHub, DurableReader

    emitted: list[int] = []
    record = SimpleNamespace(subscriptions={"feed": [466, []]})
    services = SimpleNamespace(held_core=lambda queue: SimpleNamespace(record=record, queue_id=1, visible_upto=None),
                               cluster_map=None)
    hub = ChannelHub(services, clock=lambda: 5.0)  # type: ignore[arg-type]
    connection = SimpleNamespace(emit=lambda item: emitted.append(item.message_id))
    hub.durable["prices"] = {"feed": DurableReader(connection, "prices", "feed", cursor=466, caught_up=True)}
    hub._trim = lambda channel, message_id: None  # type: ignore[method-assign]  # storage trimming is not this test's
    hub.published("prices", 469, b"469")
    hub.published("prices", 468, b"468")          # late
    hub.published("prices", 469, b"469")          # a repeat of one it has: not again
    assert emitted == [469, 468]
