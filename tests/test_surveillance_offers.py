"""Fault surveillance judges each recipient on what it was offered, and the message interval is
each message's deadline (issue 37, items 6 and 7; seed 001), on real processes: recipient
applications of their own (tests/recipient_app.py), stopped with SIGSTOP like a hung service.
Items 8 and 9: tests/test_surveillance_chain.py; the rules: tests/test_surveillance_decide.py."""
from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from audit.inputs import read_records
from audit.local import audit_records
from client import AsyncClient
from qserver.dev.devcluster import LocalCluster
from qserver.storage.journal_export import export_environment
from tests.test_surveillance import metrics_of, numbers, recipients_of, states, until, until_state

__all__ = ["recipients_of"]       # the fixture, used by name


async def fault_events(cluster: LocalCluster, recipient: str) -> list[str]:
    """The lines of every node's metrics counting a fault of `recipient` (none: never in fault)."""
    found = []
    for node in cluster.ids:
        found += [line for line in (await metrics_of(cluster, node)).splitlines()
                  if line.startswith(f'qserver_recipient_events_total{{recipient="{recipient}",state="fault"}}')]
    return found


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_two_recipients_and_a_pull_consumer_of_one_queue_are_each_judged_on_what_they_were_offered(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Item 6. A pull consumer holds six leases for longer than the fault interval while both
    recipients, offered nothing, wait: neither is in fault (each was, when "the queue held
    messages" was enough). Then `first` hangs: only it, holding what it was offered, enters
    fault; `second`, which takes what it is offered, stays ok throughout."""
    cluster: LocalCluster = qcluster_factory(3, {"work": ["n1", "n2"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await admin.create_queue("work", strength="full", fault_interval_s=1.0, visibility_timeout_s=60)
        await admin.enqueue_many("work", [b"p%d" % n for n in range(6)])
        pulled = await admin.receive("work", max_messages=6, wait_s=2.0)     # leased by the pull consumer
        assert len(pulled) == 6
        recipients.start("first", "work")
        await until_state(admin, "ok", "first")
        recipients.start("second", "work")
        await until_state(admin, "ok", "second")

        async def six_in_flight_for(seconds: float) -> None:
            deadline = asyncio.get_running_loop().time() + seconds
            while asyncio.get_running_loop().time() < deadline:
                stats = await admin.queue_stats("work")
                assert stats["depth"] == 6 and stats["in_flight"] == 6, stats
                assert await states(admin) == {"first": "ok", "second": "ok"}
                await asyncio.sleep(0.2)
        await six_in_flight_for(2.5)            # 2.5 fault intervals with messages in the queue
        assert await fault_events(cluster, "first") == [] and await fault_events(cluster, "second") == []

        recipients.signal("first", signal.SIGSTOP)
        for n in range(12):                     # one at a time: each goes to whichever has credit
            await admin.enqueue("work", b"m%d" % n)
        await until_state(admin, "fault", "first")
        [first] = [r for r in await admin.recipients() if r["recipient"] == "first"]
        assert "offered to it waited" in first["reason"], first
        await until(lambda: asyncio.sleep(0, len(recipients.taken("second")) >= 8), "second to take 8")
        assert (await states(admin))["second"] == "ok" and await fault_events(cluster, "second") == []

        for message in pulled:
            await message.ack()
        recipients.signal("first", signal.SIGCONT)                  # it takes its probe: ok again
        await until_state(admin, "ok", "first")

        async def all_taken() -> bool:
            return len(recipients.taken("first")) + len(recipients.taken("second")) == 12
        await until(all_taken, "the twelve taken")
        taken = numbers(recipients.taken("first") + recipients.taken("second"))
        assert sorted(taken) == list(range(12)), taken                # each once
        assert (await admin.queue_stats("work"))["depth"] == 0
        assert await fault_events(cluster, "second") == []


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_message_pushed_to_a_hung_recipient_fails_over_at_its_message_interval(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Item 7. The four messages pushed to the hung mailer fail over at their message interval
    like the two still in the queue, long before their visibility timeout (120 s) and before
    the fault interval; the mailer's late acks are refused (their leases were taken back), count
    as its answer, and it is pushed to again. The journals audit clean (the take-back is a
    release by the cluster)."""
    cluster: LocalCluster = qcluster_factory(3, {"mail": ["n1", "n2"], "mail-b": ["n2", "n3"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await admin.create_queue("mail", strength="full", message_interval_s=1.0, fault_interval_s=8.0,
                                 visibility_timeout_s=120)
        await admin.create_queue("mail-b", strength="full")
        await admin.set_alternatives("mailer", ["mailer-b=mail-b"])
        recipients.start("mailer", "mail")
        recipients.start("mailer-b", "mail-b")
        await until_state(admin, "ok", "mailer", "mailer-b")

        recipients.signal("mailer", signal.SIGSTOP)
        started = asyncio.get_running_loop().time()
        for n in range(6):
            await admin.enqueue("mail", b"m%d" % n)
        await until(lambda: asyncio.sleep(0, sorted(numbers(recipients.taken("mailer-b"))) == list(range(6))),
                    "all six at mailer-b", timeout_s=6.0)
        assert 0.9 <= asyncio.get_running_loop().time() - started < 6.0
        assert (await states(admin))["mailer"] == "ok"               # within its fault interval
        assert 'qserver_recipient_taken_back_total{recipient="mailer"} 4' in await metrics_of(cluster, "n1")
        stats = await admin.queue_stats("mail")
        assert (stats["depth"], stats["total_dead_lettered"]) == (0, 0), stats

        recipients.signal("mailer", signal.SIGCONT)                 # its acks of m0..m3: refused
        await admin.enqueue("mail", b"m6")
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("mailer")) == [6]), "m6 at mailer")
        assert sorted(numbers(recipients.taken("mailer-b"))) == list(range(6))
    journals = cluster.root / "journals"
    for node in cluster.ids:
        export_environment(cluster.root / node / "lmdb", str(journals))
    report = audit_records(read_records([str(journals)]), [])
    assert report["verdict"] == "clean", report["violations"]
