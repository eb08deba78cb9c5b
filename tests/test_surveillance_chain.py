"""Fault surveillance: the chain travels with the message, defunct and never-subscribed
recipients, and a move whose answer was lost (issue 37, items 8 and 9; seed 001), on real
processes (tests/recipient_app.py, stopped with SIGSTOP like a hung service). Items 6 and 7:
tests/test_surveillance_offers.py; the rules themselves: tests/test_surveillance_decide.py."""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import LocalCluster
from qserver.features.surveillance.watch import LOSE_MOVE_ANSWERS_ENV
from tests.test_surveillance import metrics_of, numbers, recipients_of, states, until, until_state
from tests.test_surveillance_offers import fault_events
from wire.errors import QueueError

__all__ = ["recipients_of"]       # the fixture, used by name


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_defunct_recipient_that_subscribes_again_is_ok_and_gets_what_waited(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Item 8. Hung, in fault, then defunct (its subscription ended with E_RECIPIENT_DEFUNCT);
    restarted, it subscribes again: ok, and what waited for it (no alternative) is its own
    again, each message once. A fault interval shorter than the message interval is refused."""
    cluster: LocalCluster = qcluster_factory(3, {"quotes": ["n1", "n2"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        with pytest.raises(QueueError) as refused:
            await admin.create_queue("bad", strength="full", fault_interval_s=1.0, message_interval_s=2.0)
        assert refused.value.code == "E_INVALID_OPTION" and "message_interval_s" in refused.value.message
        await admin.create_queue("quotes", strength="full", fault_interval_s=0.5, defunct_interval_s=1.5,
                                 visibility_timeout_s=120)
        recipients.start("quoter", "quotes")
        await until_state(admin, "ok", "quoter")
        recipients.signal("quoter", signal.SIGSTOP)
        for n in range(6):
            await admin.enqueue("quotes", b"q%d" % n)
        await until_state(admin, "fault", "quoter")
        await until_state(admin, "defunct", "quoter")
        recipients.processes["quoter"].kill()                     # gone: restarted below
        recipients.processes["quoter"].wait(timeout=10)
        recipients.start("quoter", "quotes")                       # subscribes again
        await until_state(admin, "ok", "quoter")
        [listed] = [r for r in await admin.recipients() if r["recipient"] == "quoter"]
        assert listed["reason"] == "subscribed", listed
        await until(lambda: asyncio.sleep(0, sorted(numbers(recipients.taken("quoter"))) == list(range(6))),
                    "the six at the restarted quoter")
        assert (await admin.queue_stats("quotes"))["depth"] == 0
        assert 'qserver_recipient_events_total{recipient="quoter",state="defunct"} 1' in await metrics_of(cluster, "n1")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_moved_message_keeps_the_chain_it_started_on_past_a_recipient_that_never_subscribed(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Item 8. billing-a's chain names `ghost` (never subscribed: skipped, never judged) and
    billing-b. A message moved to billing-b, which hangs in turn, follows billing-a's chain, not
    billing-b's own (to billing-x): none is left, and it returns to its sender naming the
    recipients tried."""
    placement = {"billing": ["n1", "n2"], "billing-b": ["n2", "n3"], "billing-x": ["n3", "n1"], "returns": ["n1", "n3"]}
    cluster: LocalCluster = qcluster_factory(3, placement)
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        for queue in ("billing", "billing-b", "billing-x"):
            await admin.create_queue(queue, strength="full", fault_interval_s=1.0, visibility_timeout_s=120)
        await admin.create_queue("returns", strength="full")
        await admin.set_alternatives("billing-a", ["ghost=ghost-q", "billing-b=billing-b"])
        await admin.set_alternatives("billing-b", ["billing-x=billing-x"])
        for name, queue in (("billing-a", "billing"), ("billing-b", "billing-b"), ("billing-x", "billing-x")):
            recipients.start(name, queue)
        await until_state(admin, "ok", "billing-a", "billing-b", "billing-x")

        recipients.signal("billing-a", signal.SIGSTOP)
        for n in range(3):
            await admin.enqueue("billing", b"m%d" % n, headers={"reply-to": "returns"})
        await until_state(admin, "fault", "billing-a")
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("billing-b")) == [1, 2]), "m1, m2 at billing-b")
        assert "ghost" not in await states(admin) and await fault_events(cluster, "ghost") == []   # never judged

        # billing-b hangs, pushed d9 (its own: its probe once in fault) and then m3, moved from
        # billing-a: in fault it gives m3 back, and m3 goes on along billing-a's chain.
        recipients.signal("billing-b", signal.SIGSTOP)
        await admin.enqueue("billing-b", b"d9")
        await admin.enqueue("billing", b"m3", headers={"reply-to": "returns"})
        await until_state(admin, "fault", "billing-b")
        returned = await until(lambda: admin.receive("returns", max_messages=5, wait_s=0.5), "m3 returned", 20)
        assert [message.payload for message in returned] == [b"m3"]
        headers = returned[0].headers
        assert headers["x-returned-from"] == "billing-a" and headers["x-failed-over-from"] == "billing-a"
        assert headers["x-failed-over-tried"] == "billing-a,billing-b"
        assert headers["x-fault"] == ("recipients billing-a (fault), billing-b (fault), ghost (not registered) "
                                      "not ok and no alternative is ok")
        await returned[0].ack()
        assert recipients.taken("billing-x") == []                  # billing-b's own chain was not followed
        for name in ("billing-a", "billing-b"):
            recipients.signal(name, signal.SIGCONT)
        await until_state(admin, "ok", "billing-a", "billing-b")
        await until(lambda: asyncio.sleep(0, "d9" in recipients.taken("billing-b")), "d9 at billing-b")
        taken = numbers(recipients.taken("billing-a") + recipients.taken("billing-b"))
        assert sorted(taken) == [0, 1, 2, 9], taken                  # m3 went back to its sender only


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_move_whose_answer_was_lost_is_settled_at_that_alternative_not_copied_to_the_next(
        qcluster_factory: Any, recipients_of: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 9. The answers of moves into billing-b are lost (the watch's test hook: the enqueue
    is stored, its answer dropped), and billing-b hangs and enters fault meanwhile: the mover
    tries billing-b again (same dedupe id) and never billing-c, which is ok. Once billing-b
    answers, the move is settled there: one copy."""
    losing = tmp_path / "lose-move-answers"
    monkeypatch.setenv(LOSE_MOVE_ANSWERS_ENV, str(losing))             # inherited by the nodes
    placement = {"billing": ["n1", "n2"], "billing-b": ["n2", "n3"], "billing-c": ["n3", "n1"]}
    cluster: LocalCluster = qcluster_factory(3, placement)
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        for queue in placement:
            await admin.create_queue(queue, strength="full", fault_interval_s=1.0, visibility_timeout_s=120)
        await admin.set_alternatives("billing-a", ["billing-b=billing-b", "billing-c=billing-c"])
        for name, queue in (("billing-a", "billing"), ("billing-b", "billing-b"), ("billing-c", "billing-c")):
            recipients.start(name, queue)
        await until_state(admin, "ok", "billing-a", "billing-b", "billing-c")

        losing.write_text("billing-b\n")
        recipients.signal("billing-a", signal.SIGSTOP)
        recipients.signal("billing-b", signal.SIGSTOP)
        for n in range(2):
            await admin.enqueue("billing", b"m%d" % n)           # m0 stays billing-a's probe
        await until_state(admin, "fault", "billing-a")

        async def unsettled() -> bool:
            return "qserver_recipient_moves_unsettled 1" in await metrics_of(cluster, "n1")
        await until(unsettled, "m1's move to billing-b unsettled")
        await until_state(admin, "fault", "billing-b")              # offered m1, hung
        # The mover retries every second (MOVE_PAUSE_S): three more tries with billing-c ok.
        await asyncio.sleep(3.0)
        assert recipients.taken("billing-c") == [] and (await states(admin))["billing-c"] == "ok"
        assert "qserver_recipient_moves_unsettled 1" in await metrics_of(cluster, "n1")

        losing.unlink()                                             # billing-b answers again
        await until(lambda: settled(cluster), "the move settled")
        assert (await admin.queue_stats("billing"))["depth"] == 1    # the probe only: m1 left once
        recipients.signal("billing-b", signal.SIGCONT)
        recipients.signal("billing-a", signal.SIGCONT)
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("billing-b")) == [1]), "m1 at billing-b")
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("billing-a")) == [0]), "m0 at billing-a")
        assert recipients.taken("billing-c") == []
        assert (await admin.queue_stats("billing-b"))["depth"] == 0


async def settled(cluster: LocalCluster) -> bool:
    text = await metrics_of(cluster, "n1")
    return "qserver_recipient_moves_unsettled 0" in text and \
        'qserver_recipient_failed_over_total{recipient="billing-a",to="billing-b"} 1' in text

