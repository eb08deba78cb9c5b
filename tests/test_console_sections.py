"""The console's sections at the HTTP level, on one real 3-node cluster (docs/CONSOLE.md, "Macros,
channels, forwards, recipients", "Clients and grants", "Events"): each page renders the cluster's
real data through the signed-in client; the clients page lists clients and grants for an
administrator and shows E_FORBIDDEN in words to anyone else; the events page lists a handoff (and
a queue created), as rows `tr.event[data-kind]` inside the live element `#events-live`.
"""
from __future__ import annotations

import asyncio
import html
import re

import aiohttp
import pytest

from client.aio import AsyncClient
from client.credentials import load_credentials
from tests.test_failover import wait_for as until
from wire.console_link import signin_link
from wire.errors import QueueError
from wire.signing import Signer, private_key_from_text

pytestmark = pytest.mark.asyncio


async def signed_in(url: str, signer: Signer, session: aiohttp.ClientSession) -> None:
    async with session.get(signin_link(url, signer), allow_redirects=False) as answer:
        assert answer.status == 303, answer.status


async def page(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, allow_redirects=False) as answer:
        text = await answer.text()
        assert answer.status == 200, (url, answer.status, text[:500])
        return text


def rows(text: str, css_class: str) -> list[str]:
    return re.findall(rf'<tr class="{css_class}"[^>]*>.*?</tr>', text, re.S)


@pytest.mark.timeout(180)
async def test_each_section_renders_real_data_and_the_events_page_lists_a_handoff(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"], "fast": ["n1", "n3"], "slow": ["n2", "n3"],
                                   "src": ["n1", "n2"], "dst": ["n2", "n3"], "backup": ["n3", "n1"]})
    url = cluster.urls["n1"]
    admin_signer = load_credentials(cluster.credentials_path).signer()
    async with AsyncClient(url, cluster.credentials_path) as admin, \
            AsyncClient(url, cluster.credentials_path) as reader, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as viewer_browser:
        for name, strength in (("orders", "full"), ("fast", "producer"), ("slow", "producer"), ("src", "full"),
                               ("dst", "full"), ("backup", "full")):
            await admin.create_queue(name, strength=strength)
        await admin.create_macro("work", consumer="prioritized")
        await admin.add_macro_member("work", "fast", priority=7, weight=3)
        await admin.add_macro_member("work", "slow", priority=1)
        await admin.create_channel("ledger", "durable")
        await reader.subscribe("ledger", durable="audit")
        await admin.advertise("ledger")
        for index in range(3):
            await admin.publish("ledger", f"entry {index}".encode())
        await admin.create_forward("fw", "src", "dst")
        await admin.enqueue_many("src", [b"a", b"b", b"c"])
        await admin.set_alternatives("packer", ["spare=backup"])
        for _ in range(100):        # a handoff waits for a replica in sync: until the new one is
            try:
                await admin.handoff("orders")
                break
            except QueueError as error:
                assert error.code == "E_HANDOFF_REFUSED", error
                await asyncio.sleep(0.1)
        viewer = await admin.register_client("viewer", [{"pattern": "orders*", "privileges": ["get"]}])
        viewer_signer = Signer(viewer["id"], private_key_from_text(viewer["private_key"]))

        async with admin.consume("orders", prefetch=1, recipient="packer"):
            async def packer_known() -> bool:
                return any(r["recipient"] == "packer" and r["state"] == "ok" for r in await admin.recipients())
            await until(packer_known, 15.0, "the recipient packer registered")

            await signed_in(url, admin_signer, browser)
            macros = await page(browser, url + "/console/macros")
            (work,) = rows(macros, "macro")
            assert "<b>work</b>" in work and "prioritized" in work and "round_robin" in work
            members = rows(macros, "member")
            assert len(members) == 2 and ">fast</a>" in members[0] and ">7<" in members[0] and ">3<" in members[0]

            async def backlog_shown() -> str | None:
                text = await page(browser, url + "/console/channels")
                found = rows(text, "subscription")
                return text if found and '<td class="num backlog">3</td>' in found[0] else None
            channels = await until(backlog_shown, 15.0, "the durable subscription's backlog of 3")
            (ledger,) = rows(channels, "channel")            # up to its inner table's first row
            assert "<b>ledger</b>" in ledger and "durable" in ledger
            assert 'data-name="audit"' in rows(channels, "subscription")[0]

            async def forwarded() -> str | None:      # open, the three messages stored at dst
                text = await page(browser, url + "/console/forwards")
                found = rows(text, "forward")
                return text if found and "<td>open</td>" in found[0] and '<td class="num">3</td>' in found[0] else None
            forwards = await until(forwarded, 30.0, "the forward fw open with 3 messages stored")
            (fw,) = rows(forwards, "forward")
            assert "<b>fw</b>" in fw and "<td>src</td>" in fw and "dst" in fw and "Assigned rate" in forwards \
                and "Overflows" in forwards
            # The achieved rate: from the stored count at the page's previous look (none more: 0.0).
            (fw,) = rows(await page(browser, url + "/console/forwards"), "forward")
            assert re.findall(r'<td class="num">([^<]*)</td>', fw)[1] == "0.0", fw

            recipients = await page(browser, url + "/console/recipients")
            (packer,) = [row for row in rows(recipients, "recipient") if 'data-name="packer"' in row]
            assert 'data-state="ok"' in packer and ">orders<" in packer and "spare" in packer \
                and "(queue backup)" in packer and "UTC" in packer

            clients = await page(browser, url + "/console/clients")
            listed = rows(clients, "client")
            assert any(viewer["id"] in row and "orders*" in row and "get" in row for row in listed)
            assert any("(you)" in row and "admin" in row for row in listed)

            async def handoff_listed() -> str | None:
                text = await page(browser, url + "/console/events")
                return text if 'data-kind="handoff"' in text else None
            events = await until(handoff_listed, 10.0, "the handoff on the events page")
            assert re.search(r'<section id="events-live" data-refresh="2">', events)
            handoff = [row for row in rows(events, "event") if 'data-kind="handoff"' in row]
            assert 'data-queue="orders"' in handoff[0] and "handoff of orders: master n1 -&gt; n2" in handoff[0]
            assert any('data-kind="queue_created"' in row and 'data-queue="ledger' not in row
                       for row in rows(events, "event"))

        # A client without admin: the clients page says E_FORBIDDEN in words; the events page
        # shows its queue's events and the cluster's, none of another queue.
        await signed_in(url, viewer_signer, viewer_browser)
        refused = await page(viewer_browser, url + "/console/clients")
        match = re.search(r'<p class="notice error" id="refused">(.*?)</p>', refused, re.S)
        assert match is not None and html.unescape(match[1]).startswith("E_FORBIDDEN: client ")
        assert "/console/clients" not in refused.split("<main>")[0]      # not offered in the navigation
        seen = rows(await page(viewer_browser, url + "/console/events"), "event")
        queues = {m for row in seen for m in re.findall(r'data-queue="([^"]*)"', row)}
        assert queues == {"orders"}, queues
        nothing = await page(viewer_browser, url + "/console/macros")
        assert 'id="no-macros"' in nothing
