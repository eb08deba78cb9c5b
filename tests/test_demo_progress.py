"""The demo tells the truth about its clients (qserver/dev/demo_progress.py, qserver/dev/local.py).

A consumer that stops taking messages while its queue fills, or a producer whose enqueues stop
succeeding, raises no error by itself; the demo's view must still say so. The trackers are
driven by a fake clock; the traffic loops by a fake client, so that no node is started.
"""
from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from client import QueueError
from qserver.dev import local
from qserver.dev.demo_progress import (
    ProgressTracker,
    errors_text,
    make_clients,
    observe_depths,
    status_lines,
    summary,
)
from wire.errors import E_FORBIDDEN, E_NOT_MASTER, E_UNAVAILABLE


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_consumer_that_takes_nothing_while_its_queue_holds_messages_is_stalled_after_five_seconds() -> None:
    clock = FakeClock()
    clients = make_clients(["orders"], clock)
    consumer = clients["orders consumer"]
    observe_depths(clients.values(), {"orders": 26_800})
    clock.advance(4.9)
    assert status_lines([consumer], {"orders": 26_800}) == []
    clock.advance(2.3)
    assert status_lines([consumer], {"orders": 26_800}) == ["orders consumer: stalled 7.2 s (depth 26,800)"]
    assert consumer.tracker.stalls == 1


def test_an_idle_consumer_of_an_empty_queue_is_not_stalled() -> None:
    clock = FakeClock()
    clients = make_clients(["orders"], clock)
    clients["orders producer"].tracker.progressed()
    for _ in range(10):
        clock.advance(1.0)
        clients["orders producer"].tracker.progressed()
        observe_depths(clients.values(), {"orders": 0})
    assert status_lines(clients.values(), {"orders": 0}) == []
    assert clients["orders consumer"].tracker.longest_stall_s == 0.0


def test_messages_that_arrive_for_an_idle_consumer_count_from_when_they_were_seen() -> None:
    clock = FakeClock()
    tracker = ProgressTracker(clock)
    tracker.progressed()
    clock.advance(60.0)                     # idle for a minute: nothing to do
    tracker.observe_work(True)
    clock.advance(3.0)
    assert tracker.stalled_s() is None
    assert tracker.waiting_s() == pytest.approx(3.0)


def test_a_depth_the_view_could_not_read_leaves_the_consumer_as_it_was() -> None:
    clock = FakeClock()
    clients = make_clients(["orders"], clock)
    observe_depths(clients.values(), {"orders": 5})
    clock.advance(6.0)
    observe_depths(clients.values(), {})      # no node answered this second
    assert status_lines([clients["orders consumer"]], {}) == ["orders consumer: stalled 6.0 s (depth unknown now)"]


def test_progress_ends_a_stall_and_the_summary_keeps_the_longest_and_how_many_reached_five_seconds() -> None:
    clock = FakeClock()
    tracker = ProgressTracker(clock, has_work=True)
    for pause_s in (0.5, 7.0, 2.0, 12.5, 5.0):
        clock.advance(pause_s)
        tracker.progressed()
    assert tracker.stalled_s() is None
    assert tracker.longest_stall_s == pytest.approx(12.5)
    assert tracker.stalls == 3


def test_a_stall_still_going_when_the_demo_stops_is_in_the_summary() -> None:
    clock = FakeClock()
    clients = make_clients(["orders"], clock)
    clients["orders consumer"].count_error(E_NOT_MASTER.code)
    observe_depths(clients.values(), {"orders": 100})
    clock.advance(31.0)
    entry = summary(clients.values())["orders consumer"]
    assert entry == {"longest_stall_s": 31.0, "stalls_over_5_s": 1, "errors": {"E_NOT_MASTER": 1}, "replaced": 0}


def test_a_producer_whose_enqueues_stop_succeeding_is_stalled_with_its_last_error() -> None:
    clock = FakeClock()
    clients = make_clients(["orders"], clock)
    producer = clients["orders producer"]
    producer.tracker.progressed()
    clock.advance(5.5)
    assert status_lines(clients.values(), {}) == ["orders producer: stalled 5.5 s (an enqueue has not returned)"]
    producer.count_error(E_UNAVAILABLE.code)
    assert status_lines(clients.values(), {}) == ["orders producer: stalled 5.5 s (last error E_UNAVAILABLE)"]


def test_errors_are_shown_by_client_and_code() -> None:
    clients = make_clients(["orders", "events"], FakeClock())
    assert errors_text(clients.values()) == "none"
    clients["orders consumer"].count_error(E_NOT_MASTER.code)
    clients["orders consumer"].count_error(E_NOT_MASTER.code)
    clients["events producer"].count_error(E_UNAVAILABLE.code)
    assert errors_text(clients.values()) == "orders consumer E_NOT_MASTER 2, events producer E_UNAVAILABLE 1"


# --- the demo's traffic loops (qserver/dev/local.py), with a fake client -----------------------------
class FakeMessage:
    def __init__(self, payload: bytes = struct.pack(">d", 0.0) + b"demo message") -> None:
        self.payload = payload

    async def ack(self) -> None:
        return None


class FakeConsumer:
    """Yields what its script says: a number of messages, or an error to raise."""

    def __init__(self, script: Iterable[int | QueueError]) -> None:
        self.script = list(script)
        self.closed = False

    def __aiter__(self) -> AsyncIterator[FakeMessage]:
        return self

    async def __anext__(self) -> FakeMessage:
        await asyncio.sleep(0)
        if not self.script:
            await asyncio.Event().wait()          # waits for good, as a stuck consumer does
        step = self.script[0]
        if isinstance(step, QueueError):
            self.script.pop(0)
            raise step
        self.script[0] = step - 1
        if self.script[0] == 0:
            self.script.pop(0)
        return FakeMessage()

    async def __aenter__(self) -> FakeConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.closed = True


class FakeClient:
    def __init__(self, consumers: list[FakeConsumer], enqueue_outcomes: list[QueueError | None]) -> None:
        self.consumers, self.made = consumers, 0
        self.enqueue_outcomes = enqueue_outcomes

    def consume(self, queue: str, prefetch: int) -> FakeConsumer:
        self.made += 1
        return self.consumers.pop(0)

    async def enqueue_many(self, queue: str, payloads: Any, priority: int) -> None:
        outcome = self.enqueue_outcomes.pop(0) if self.enqueue_outcomes else None
        if outcome is not None:
            raise outcome


async def run_for(demo: local.Demo, coroutine: Any, seconds: float) -> asyncio.Task[None]:
    task = asyncio.create_task(coroutine)
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return task


@pytest.mark.asyncio
async def test_the_demo_iterates_the_same_consumer_again_after_a_retriable_error() -> None:
    stuck_after_outage = FakeConsumer([3, QueueError(E_NOT_MASTER), 2])
    client = FakeClient([stuck_after_outage], [])
    demo = local.Demo(client, rate_per_s=1000)  # type: ignore[arg-type]
    await run_for(demo, demo.consume("orders"), 0.3)
    consumer = demo.clients["orders consumer"]
    assert client.made == 1
    assert demo.consumed["orders"] == 5
    assert consumer.errors == {"E_NOT_MASTER": 1} and consumer.replacements == 0


@pytest.mark.asyncio
async def test_the_demo_replaces_a_consumer_only_after_a_non_retriable_error_and_says_so() -> None:
    refused = FakeConsumer([1, QueueError(E_FORBIDDEN, "no grant")])
    client = FakeClient([refused, FakeConsumer([2])], [])
    demo = local.Demo(client, rate_per_s=1000)  # type: ignore[arg-type]
    await run_for(demo, demo.consume("orders"), 0.5)
    consumer = demo.clients["orders consumer"]
    assert client.made == 2 and refused.closed
    assert consumer.replacements == 1 and demo.consumed["orders"] == 3
    assert any("orders consumer replaced by a new consumer: E_FORBIDDEN: no grant" in event for event in demo.events)
    assert status_lines(demo.clients.values(), {}) == [
        "orders consumer: replaced 1 time(s) after a non-retriable error (last E_FORBIDDEN)"]


@pytest.mark.asyncio
async def test_the_demo_producer_goes_on_after_errors_and_counts_them() -> None:
    client = FakeClient([], [QueueError(E_UNAVAILABLE), QueueError(E_FORBIDDEN)])
    demo = local.Demo(client, rate_per_s=1000)  # type: ignore[arg-type]
    await run_for(demo, demo.produce("orders"), 0.6)
    assert demo.clients["orders producer"].errors == {"E_UNAVAILABLE": 1, "E_FORBIDDEN": 1}
    assert demo.produced["orders"] > 0


@pytest.mark.asyncio
async def test_a_traffic_loop_that_ends_on_a_bug_is_shown_as_ended() -> None:
    class Broken(FakeClient):
        async def enqueue_many(self, queue: str, payloads: Any, priority: int) -> None:
            raise TypeError("a bug")
    demo = local.Demo(Broken([], []), rate_per_s=1000)  # type: ignore[arg-type]
    task = asyncio.create_task(demo.produce("orders"))
    demo.watch("orders producer", task)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)                     # the done callback runs
    assert status_lines(demo.clients.values(), {}) == ["orders producer: ENDED (TypeError: a bug)"]


@pytest.mark.asyncio
async def test_the_demo_consumer_takes_a_message_it_did_not_produce_and_goes_on() -> None:
    """`qctl put orders hi` while the demo runs: a payload without the demo's stamp is acked
    like the others (it ended the consumer, reading a stamp from 2 bytes)."""
    demo = local.Demo(FakeClient([], []), rate_per_s=1000)  # type: ignore[arg-type]
    consumer = demo.clients["orders consumer"]
    for message in (FakeMessage(b"hi"), FakeMessage(b"price 12.30 USD!"), FakeMessage()):
        demo._take(consumer, message)  # type: ignore[arg-type]
    await asyncio.sleep(0.01)                 # the acks and their callbacks (all ready before this timer)
    assert demo.consumed["orders"] == 3 and len(demo.latencies_ms) == 1
