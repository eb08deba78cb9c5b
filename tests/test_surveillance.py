"""Fault surveillance of recipients (issue 15, items 5-8; seed 001) on real processes: recipient
applications run as processes of their own (tests/recipient_app.py), stopped with SIGSTOP like
a hung service and resumed with SIGCONT."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from audit.inputs import read_records
from audit.local import audit_records
from client import AsyncClient
from client.credentials import load_credentials
from client.qctl_features import _recipient_text
from qserver.dev.devcluster import REPOSITORY, LocalCluster
from qserver.storage.journal_export import export_environment
from tests.support import raw_session
from tests.test_client_integration import run_qctl
from wire.errors import QueueError
from wire.protocol import ErrorReply, SubscribeOp, decode_server_frame, encode_frame

PLACEMENT = {"billing": ["n1", "n2"], "billing-b": ["n2", "n3"], "billing-c": ["n3", "n1"], "returns": ["n1", "n3"]}


class Recipients:
    """Recipient application processes, each appending what it acknowledged to a file."""

    def __init__(self, cluster: LocalCluster, directory: Path) -> None:
        self.cluster, self.directory = cluster, directory
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, queue: str, node: str = "n3") -> None:
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.recipient_app", self.cluster.urls[node], str(self.cluster.credentials_path),
             queue, name, str(self.directory / f"{name}.txt")], cwd=REPOSITORY)

    def taken(self, name: str) -> list[str]:
        """The payloads recipient `name` acknowledged, in the order it did."""
        path = self.directory / f"{name}.txt"
        return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []

    def signal(self, name: str, number: int) -> None:
        self.processes[name].send_signal(number)

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def recipients_of(tmp_path: Path) -> Iterator[Callable[[LocalCluster], Recipients]]:
    made: list[Recipients] = []

    def make(cluster: LocalCluster) -> Recipients:
        made.append(Recipients(cluster, tmp_path))
        return made[-1]
    yield make
    for recipients in made:
        recipients.stop_all()


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def next_event(client: AsyncClient, recipient: str, state: str) -> dict[str, Any] | None:
    """The next state change published on qcluster.events for `recipient` into `state`, if any."""
    while client.poll():
        message = client.read("qcluster.events")
        event = json.loads(message.payload) if message is not None else {}
        if (event.get("name"), event.get("state")) == (recipient, state):
            return dict(event)
    return None


async def states(client: AsyncClient) -> dict[str, str]:
    return {r["recipient"]: r["state"] for r in await client.recipients()}


async def until_state(client: AsyncClient, state: str, *names: str, timeout_s: float = 20.0) -> None:
    """Wait until each recipient named is in `state` in the map."""
    async def reached() -> bool:
        known = await states(client)
        return all(known.get(name) == state for name in names)
    await until(reached, f"{', '.join(names)} {state}", timeout_s)

async def pager_in_fault_with_three_messages(admin: AsyncClient, recipients: Any, visibility_timeout_s: float) -> None:
    """`alerts` (fault interval 0.5 s, max_deliveries 3) with its one recipient `pager` stopped
    (SIGSTOP) and in fault, three messages m0..m2 enqueued meanwhile, and no alternative."""
    await admin.create_queue("alerts", strength="full", fault_interval_s=0.5, max_deliveries=3,
                             visibility_timeout_s=visibility_timeout_s)
    recipients.start("pager", "alerts")
    await until_state(admin, "ok", "pager")
    recipients.signal("pager", signal.SIGSTOP)
    for n in range(3):
        await admin.enqueue("alerts", b"m%d" % n)
    await until_state(admin, "fault", "pager")



def numbers(payloads: list[str]) -> list[int]:
    return [int(payload[1:]) for payload in payloads]


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_stopped_recipient_fails_over_along_its_chain_then_back_to_its_sender_and_recovers(
        qcluster_factory: Any, recipients_of: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, PLACEMENT)
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("billing", strength="full", fault_interval_s=1.0, visibility_timeout_s=120)
        await admin.create_queue("billing-b", strength="full", fault_interval_s=1.0, visibility_timeout_s=120)
        await admin.create_queue("billing-c", strength="full", fault_interval_s=1.0, visibility_timeout_s=120)
        await admin.create_queue("returns", strength="full")
        await admin.set_alternatives("billing-a", ["billing-b=billing-b", "billing-c=billing-c"])
        await admin.create_channel("qcluster.events", "acked")      # the state changes are published there
        await admin.subscribe("qcluster.events")
        for name, queue in (("billing-a", "billing"), ("billing-b", "billing-b"), ("billing-c", "billing-c")):
            recipients.start(name, queue)

        await until_state(admin, "ok", "billing-a", "billing-b", "billing-c")      # registered
        for n in range(10):
            await admin.enqueue("billing", b"m%d" % n)
        await until(lambda: asyncio.sleep(0, len(recipients.taken("billing-a")) == 10), "billing-a to take 10")

        # billing-a hangs: it enters fault within its interval, and what waits for it, and what
        # comes next, goes to billing-b in order; it keeps one message (its probe).
        recipients.signal("billing-a", signal.SIGSTOP)
        stopped = time.monotonic()
        for n in range(10, 40):
            await admin.enqueue("billing", b"m%d" % n)

        await until_state(admin, "fault", "billing-a")
        assert time.monotonic() - stopped < 1.0 + 3.0

        def moved_to_b() -> list[int]:
            return numbers(recipients.taken("billing-b"))
        await until(lambda: asyncio.sleep(0, len(moved_to_b()) >= 29), "29 of 30 at billing-b")
        taken_a, taken_b = numbers(recipients.taken("billing-a")), moved_to_b()
        assert taken_a == list(range(10)) and taken_b == sorted(taken_b), (taken_a, taken_b)   # in order
        assert not set(taken_a) & set(taken_b)
        [listed] = [r for r in await admin.recipients() if r["recipient"] == "billing-a"]
        assert listed["alternatives"] == ["billing-b", "billing-c"] and "took no message" in listed["reason"]
        event = await until(lambda: next_event(admin, "billing-a", "fault"), "the fault event on qcluster.events")
        assert event["queue"] == "billing"
        code, status, _ = await asyncio.to_thread(run_qctl, cluster, "status")
        assert code == 0 and status["recipients"]["billing-a"]["state"] == "fault"
        async with raw_session() as session, \
                session.get(cluster.urls["n1"] + "/metrics", ssl=cluster.ssl_context or True) as answer:
            metrics = await answer.text()
        assert 'qserver_recipient_state{recipient="billing-a",queue="billing",state="fault"} 1' in metrics

        # billing-b hangs too: the chain goes on to billing-c.
        recipients.signal("billing-b", signal.SIGSTOP)
        await admin.enqueue("billing-b", b"direct")            # something waits for it

        await until_state(admin, "fault", "billing-b")
        for n in range(40, 45):
            await admin.enqueue("billing", b"m%d" % n)
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("billing-c")) == list(range(40, 45))),
                    "m40..m44 at billing-c")

        # Every alternative down: back to the sender, in its reply queue, with the fault.
        recipients.signal("billing-c", signal.SIGSTOP)
        await admin.enqueue("billing-c", b"direct")

        await until_state(admin, "fault", "billing-c")
        await admin.enqueue("billing", b"m45", headers={"reply-to": "returns"})
        [returned] = await until(lambda: admin.receive("returns", max_messages=5, wait_s=0.5), "m45 returned", 20)
        assert returned.payload == b"m45" and returned.headers["x-returned-from"] == "billing-a"
        assert "no alternative is ok" in returned.headers["x-fault"]
        await returned.ack()

        # billing-a resumes: it takes its probe, is ok again, and gets its messages again.
        recipients.signal("billing-a", signal.SIGCONT)

        await until_state(admin, "ok", "billing-a")
        await admin.enqueue("billing", b"m46")
        await until(lambda: asyncio.sleep(0, "m46" in recipients.taken("billing-a")), "m46 at billing-a")
        everything = numbers(recipients.taken("billing-a") + recipients.taken("billing-b")
                             + recipients.taken("billing-c")) + [45]
        assert sorted(everything) == list(range(47)), sorted(everything)      # none lost, none taken twice
        stats = await admin.queue_stats("billing")
        assert stats["depth"] == 0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_recipient_idle_over_an_empty_queue_has_its_interval_to_take_what_arrives(
        qcluster_factory: Any) -> None:
    """The interval counts from the last take or from when messages began to wait, whichever
    is later: an idle recipient is not in fault the moment a message arrives (it was, under
    load, when the watch looked between the push and the ack: an alternative went into fault
    as the first failed-over message reached it)."""
    cluster: LocalCluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.create_queue("orders", strength="full", fault_interval_s=2.0)
        async with admin.consume("orders", prefetch=1, recipient="packer") as messages:
            await until_state(admin, "ok", "packer")
            await asyncio.sleep(2.5)                             # idle over an empty queue
            for n in range(2):
                await admin.enqueue("orders", b"o%d" % n)
                message = await anext(messages)
                await asyncio.sleep(0.8)                         # slow, within its interval
                await message.ack()
        assert (await states(admin))["packer"] == "ok"
    async with raw_session() as session:
        for node in cluster.ids:
            async with session.get(cluster.urls[node] + "/metrics", ssl=cluster.ssl_context or True) as answer:
                assert 'qserver_recipient_events_total{recipient="packer",state="fault"}' not in await answer.text()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_subscription_refused_at_a_replica_does_not_make_its_recipient_ok(qcluster_factory: Any) -> None:
    """Only the node that took the subscription marks the recipient ok: the replica of a `full`
    queue refuses it (E_NOT_MASTER) and must not (it did, and a test waiting for "ok" stopped
    its recipient before it had subscribed at the master: nothing watched its messages)."""
    cluster: LocalCluster = qcluster_factory(3, {"alerts": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.create_queue("alerts", strength="full", fault_interval_s=1.0)
        signer = load_credentials(cluster.credentials_path).signer()
        async with raw_session() as session, session.ws_connect(
                cluster.urls["n2"] + "/v1/ws", headers=signer.headers("GET", "/v1/ws", {}, b"", audience=cluster.urls["n2"]),
                ssl=cluster.ssl_context or True) as ws:
            await ws.send_bytes(encode_frame([SubscribeOp(1, "alerts", 4, None, "pager")]))
            [reply] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(reply, ErrorReply) and reply.code == "E_NOT_MASTER", reply
            await asyncio.sleep(1.0)                               # a proposal would have been decided
        assert "pager" not in await states(admin)
        async with admin.consume("alerts", recipient="pager"):     # at the master: ok
            await until_state(admin, "ok", "pager")


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_states_survive_a_failover_and_a_defunct_recipient_is_dropped(qcluster_factory: Any,
                                                                            recipients_of: Any) -> None:
    """The state is in the map: the new master of the queue keeps failing its messages over;
    past the defunct interval the recipient's subscription ends; two_way senders get the fault
    as their reply when no alternative is ok."""
    cluster: LocalCluster = qcluster_factory(3, {"quotes": ["n1", "n2"], "quotes-b": ["n2", "n3"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.create_queue("quotes", strength="full", type="two_way", fault_interval_s=1.0,
                                 defunct_interval_s=4.0, visibility_timeout_s=120)
        await admin.create_queue("quotes-b", strength="full", fault_interval_s=1.0)
        await admin.set_alternatives("quoter", ["quoter-b=quotes-b"])
        recipients.start("quoter", "quotes")
        recipients.start("quoter-b", "quotes-b")

        await until_state(admin, "ok", "quoter", "quoter-b")
        recipients.signal("quoter", signal.SIGSTOP)
        first = await admin.enqueue("quotes", b"q0")

        await until_state(admin, "fault", "quoter")
        await asyncio.to_thread(cluster.kill, "n1")          # the master of quotes
        assert (await states(admin))["quoter"] == "fault"
        for n in range(1, 4):
            await admin.enqueue("quotes", b"q%d" % n)
        await until(lambda: asyncio.sleep(0, len(recipients.taken("quoter-b")) >= 3), "q1..q3 at quoter-b", 40)
        await until_state(admin, "defunct", "quoter")
        recipients.signal("quoter-b", signal.SIGSTOP)            # no alternative ok any more
        await admin.enqueue("quotes-b", b"direct")

        await until_state(admin, "fault", "quoter-b")
        last = await admin.enqueue("quotes", b"q4")
        status = await admin.message_status("quotes", last, wait_s=20, until="replied")
        assert status["state"] == "replied" and json.loads(base64.b64decode(status["reply_b64"]))["returned"] is True
        assert first < last
        await asyncio.to_thread(cluster.start, "n1")
    # The journals of the moves and state changes audit clean (the `recipient` records are events).
    journals = cluster.root / "journals"
    for node in cluster.ids:
        export_environment(cluster.root / node / "lmdb", str(journals))
    report = audit_records(read_records([str(journals)]), [])
    assert report["verdict"] == "clean", report["violations"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_message_waiting_past_the_message_interval_fails_over_on_its_own(qcluster_factory: Any,
                                                                                 recipients_of: Any) -> None:
    """No fault interval here: the recipient is not judged; each message fails over once it
    has waited the message interval, those pushed to it (4) as well as those it left waiting
    (issue 37, item 7: the pushed ones waited for their visibility timeout)."""
    cluster: LocalCluster = qcluster_factory(3, {"mail": ["n1", "n2"], "mail-b": ["n2", "n3"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await admin.create_queue("mail", strength="full", message_interval_s=1.0, visibility_timeout_s=120)
        await admin.create_queue("mail-b", strength="full")
        await admin.set_alternatives("mailer", ["mailer-b=mail-b"])
        recipients.start("mailer", "mail")
        recipients.start("mailer-b", "mail-b")

        await until_state(admin, "ok", "mailer", "mailer-b")
        recipients.signal("mailer", signal.SIGSTOP)
        for n in range(6):
            await admin.enqueue("mail", b"m%d" % n)
        started = time.monotonic()
        await until(lambda: asyncio.sleep(0, sorted(numbers(recipients.taken("mailer-b"))) == list(range(6))),
                    "m0..m5 at mailer-b")
        assert time.monotonic() - started >= 0.9
        assert (await states(admin))["mailer"] == "ok"              # one slow message is no fault
        recipients.signal("mailer", signal.SIGCONT)                 # its acks of m0..m3 are refused
        await admin.enqueue("mail", b"m6")
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("mailer")) == [6]), "m6 at mailer")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_messages_nothing_can_take_wait_without_being_dead_lettered(qcluster_factory: Any,
                                                                         recipients_of: Any) -> None:
    """In fault with no alternative and no way back to the sender, messages wait: the mover
    holds them (one delivery each) rather than taking and giving them back each second, which
    would dead-letter them at max_deliveries; the recipient gets them once it runs again."""
    cluster: LocalCluster = qcluster_factory(3, {"alerts": ["n1", "n2"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await pager_in_fault_with_three_messages(admin, recipients, visibility_timeout_s=120)
        await asyncio.sleep(5)                                   # five tries of the mover
        stats = await admin.queue_stats("alerts")
        assert (stats["depth"], stats["total_dead_lettered"]) == (3, 0), stats
        recipients.signal("pager", signal.SIGCONT)
        await until(lambda: asyncio.sleep(0, sorted(numbers(recipients.taken("pager"))) == [0, 1, 2]), "all three")
        assert (await admin.queue_stats("alerts"))["total_dead_lettered"] == 0


def readme_surveillance() -> tuple[list[list[str]], list[tuple[str, str]]]:
    """The README's fault surveillance example: its qctl commands (the queues and the chain),
    and each (queue, recipient) its Python example consumes."""
    readme = (REPOSITORY / "README.md").read_text()
    commands = [shlex.split(line.split("  #")[0])[1:] for line in readme.splitlines()
                if line.startswith(".venv/bin/qctl ") and ("invoices" in line or " recipient " in line)]
    section = readme[readme.index("Fault surveillance (seed 001)"):readme.index("Store-and-forward (seed 003)")]
    # Each service the example runs: serve("QUEUE", "RECIPIENT"), as the README's script calls it.
    return commands, re.findall(r'serve\("([^"]+)", "([^"]+)"\)', section)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_readme_surveillance_example_fails_over_to_billing_b_and_comes_back_to_billing_a(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Issue 39: the README showed billing-b as a second consumer of `invoices`, where the mover
    never moves a message to it and both ended in fault. As rewritten, each alternative consumes
    a queue of its own, and its commands and consumers work as written."""
    commands, consumers = readme_surveillance()
    assert [command[:2] for command in commands] == [["queue", "create"], ["queue", "create"],
                                                      ["recipient", "alternatives"], ["recipient", "list"]]
    assert consumers == [("invoices", "billing-a"), ("invoices-b", "billing-b")]
    cluster: LocalCluster = qcluster_factory(3)
    recipients = recipients_of(cluster)
    for command in commands:
        code, _, error = await asyncio.to_thread(run_qctl, cluster, *command)
        assert code == 0, (command, error)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        for queue, name in consumers:
            recipients.start(name, queue)
        await until_state(admin, "ok", "billing-a", "billing-b")
        for n in range(4):
            await admin.enqueue("invoices", b"i%d" % n)
        await until(lambda: asyncio.sleep(0, len(recipients.taken("billing-a")) == 4), "billing-a to take 4")

        # billing-a hangs: within its fault interval (5 s) what waits in invoices moves to
        # billing-b, in order, except the one message billing-a keeps (its probe).
        recipients.signal("billing-a", signal.SIGSTOP)
        for n in range(4, 10):
            await admin.enqueue("invoices", b"i%d" % n)
        await until_state(admin, "fault", "billing-a", timeout_s=30)
        await until(lambda: asyncio.sleep(0, len(recipients.taken("billing-b")) == 5), "5 of 6 at billing-b")
        moved = numbers(recipients.taken("billing-b"))
        assert moved == sorted(moved) and set(moved) < set(range(4, 10)), moved
        assert (await states(admin))["billing-b"] == "ok"                   # never in fault

        # billing-a runs again: it takes its probe, is ok, and what comes next is its own again.
        recipients.signal("billing-a", signal.SIGCONT)
        await until_state(admin, "ok", "billing-a")
        for n in range(10, 13):
            await admin.enqueue("invoices", b"i%d" % n)
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("billing-a"))[-3:] == [10, 11, 12]),
                    "i10..i12 at billing-a")
        taken_a = numbers(recipients.taken("billing-a"))
        assert sorted(taken_a + moved) == list(range(13)) and numbers(recipients.taken("billing-b")) == moved
        assert (await states(admin)) == {"billing-a": "ok", "billing-b": "ok"}
        assert (await admin.queue_stats("invoices"))["depth"] == 0


async def metrics_of(cluster: LocalCluster, node: str) -> str:
    async with raw_session() as session, \
            session.get(cluster.urls[node] + "/metrics", ssl=cluster.ssl_context or True) as answer:
        return await answer.text()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_removing_a_recipient_forgets_it_at_every_node_and_gives_back_what_the_mover_held(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """A recipient in fault with nowhere to send its messages: the mover holds them. Once the
    recipient is gone and removed, no node lists or counts it, and its messages are back in
    the queue for any consumer, in order, none dead-lettered."""
    cluster: LocalCluster = qcluster_factory(3, {"alerts": ["n1", "n2"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await pager_in_fault_with_three_messages(admin, recipients, visibility_timeout_s=2)
        recipients.processes["pager"].kill()                   # gone for good
        recipients.processes["pager"].wait(timeout=10)

        async def held_by_the_mover() -> bool:                  # its probe too, once its lease ran out
            return (await admin.queue_stats("alerts"))["in_flight"] == 3
        await until(held_by_the_mover, "the mover to hold all three")
        assert 'recipient="pager"' in await metrics_of(cluster, "n1")        # the master counted its fault

        code, answer, _ = await asyncio.to_thread(run_qctl, cluster, "recipient", "remove", "pager")
        assert code == 0 and answer == {"recipient": "pager", "removed": True, "named_by": []}

        async def given_back() -> bool:
            stats = await admin.queue_stats("alerts")
            return (stats["ready"], stats["in_flight"]) == (3, 0)
        await until(given_back, "the three messages back in the queue", 10)
        for node in cluster.ids:
            async with AsyncClient(cluster.urls[node], cluster.credentials_path) as at_node:
                await until(_without(at_node, "pager"), f"pager gone at {node}", 5)
            assert 'recipient="pager"' not in await metrics_of(cluster, node)
        taken = await admin.receive("alerts", max_messages=10, wait_s=1.0)
        assert [message.payload for message in taken] == [b"m0", b"m1", b"m2"]
        for message in taken:
            await message.ack()
        assert (await admin.queue_stats("alerts"))["total_dead_lettered"] == 0
        with pytest.raises(QueueError) as unknown:
            await admin.remove_recipient("pager")
        assert unknown.value.code == "E_UNKNOWN_RECIPIENT"


def _without(client: AsyncClient, name: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return name not in [r["recipient"] for r in await client.recipients()]
    return check


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_recipients_reason_says_what_holds_now_after_a_purge_and_once_it_recovers(
        qcluster_factory: Any, recipients_of: Any) -> None:
    """Issue 39: `recipient list` said "4 waited" after a purge had emptied the queue. The
    reason now follows what waits for the recipient while it stays in fault (the state does not
    change: it is ok again when it takes a message), and says why it is ok once it is."""
    cluster: LocalCluster = qcluster_factory(3, {"alerts": ["n1", "n2"]})
    recipients = recipients_of(cluster)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.create_queue("alerts", strength="full", fault_interval_s=0.5, visibility_timeout_s=120)
        recipients.start("pager", "alerts")
        await until_state(admin, "ok", "pager")
        recipients.signal("pager", signal.SIGSTOP)
        for n in range(4):
            await admin.enqueue("alerts", b"m%d" % n)
        await until_state(admin, "fault", "pager")

        async def reason() -> str:
            [listed] = [r for r in await admin.recipients() if r["recipient"] == "pager"]
            return str(listed["reason"])

        def reason_is(expected: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return await reason() == expected
            return check
        assert re.fullmatch(r"took no message for 0\.5 s while \d offered to it waited", await reason())

        await admin.purge("alerts")
        await until(reason_is("took no message for 0.5 s; nothing waits for it now"), "the reason after the purge", 10)
        code, listed, _ = await asyncio.to_thread(run_qctl, cluster, "recipient", "list")
        [pager] = [r for r in listed["recipients"] if r["recipient"] == "pager"]
        assert code == 0 and pager["state"] == "fault" and "waited" not in pager["reason"]
        assert _recipient_text(pager, {"pager": "alerts"}) == \
            "pager: fault on alerts (took no message for 0.5 s; nothing waits for it now)"
        code, status, _ = await asyncio.to_thread(run_qctl, cluster, "status")
        assert code == 0 and status["recipients"]["pager"]["reason"] == pager["reason"]     # the map's

        for n in range(4, 6):                                      # wait: nothing can take them
            await admin.enqueue("alerts", b"m%d" % n)
        await until(reason_is("took no message for 0.5 s; messages wait for it again"),
                    "the reason once messages wait again", 10)

        # It runs again and answers for what it was given: ok, and the two that waited are its
        # own (its interval starts once the mover gave them back: with one shorter than the
        # mover's pause it was in fault again before it was offered them).
        recipients.signal("pager", signal.SIGCONT)
        await until_state(admin, "ok", "pager")
        assert await reason() in ("took a message", "subscribed")
        await until(lambda: asyncio.sleep(0, numbers(recipients.taken("pager")) == [4, 5]), "m4, m5 at the pager")
