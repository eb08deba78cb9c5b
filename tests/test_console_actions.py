"""The console's actions against a real 3-node cluster, at the HTTP level (docs/CONSOLE.md,
"Actions"): each asks for a confirmation first, then does what it says through the signed-in
client's own grants and shows its result, or its `E_*` error, in words on the page it returns to.
A purge or a delete needs the queue's name typed (a mistyped name does nothing); a get-only client
is refused with E_FORBIDDEN and nothing changes; a form without the session's CSRF token changes
nothing; a GET of an action answers 405. tests/test_console_browser.py drives the same forms in
a real browser."""
from __future__ import annotations

import html
import re
from typing import Any

import aiohttp
import pytest

from client.aio import AsyncClient
from client.credentials import load_credentials
from qserver.console.frame import Console as ConsoleFrame
from wire.console_link import signin_link
from wire.signing import Signer, private_key_from_text

NOTICE = re.compile(r'<p class="notice (ok|error)" role="status">(.*?)</p>', re.S)
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
BACK = "/console/cluster"           # a page that shows notices whatever else exists


class Console:
    """A signed-in visitor, as a browser would be, at one node."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session, self.csrf = url, session, ""

    @classmethod
    async def sign_in(cls, url: str, signer: Signer, session: aiohttp.ClientSession) -> Console:
        console = cls(url, session)
        async with session.get(signin_link(url, signer), allow_redirects=False) as answer:
            assert answer.status == 303, answer.status
        page = await console.get(BACK)
        console.csrf = CSRF.search(page)[1]             # type: ignore[index]
        return console

    async def get(self, path: str) -> str:
        async with self.session.get(self.url + path) as answer:
            assert answer.status == 200, (path, answer.status)
            return await answer.text()

    async def post(self, path: str, form: dict[str, str],
                   headers: dict[str, str] | None = None) -> tuple[int, str]:
        data = {"csrf": self.csrf, "back": BACK, **form}
        async with self.session.post(self.url + path, data=data, headers=headers) as answer:
            return answer.status, await answer.text()

    async def act(self, path: str, form: dict[str, str], typed: str | None = None) -> tuple[str, str]:
        """Ask for the confirmation page, then confirm: the notice shown after (kind, text)."""
        status, page = await self.post(path, form)
        assert status == 200 and 'id="confirm-form"' in page, (status, page[:800])
        confirm = {"confirmed": "yes"} if typed is None else {"confirmed": "yes", "typed": typed}
        status, page = await self.post(path, {**form, **confirm})
        assert status == 200, (status, page[:800])
        [(kind, text)] = NOTICE.findall(page)
        return kind, html.unescape(text)


def jar() -> aiohttp.CookieJar:
    return aiohttp.CookieJar(unsafe=True)


async def depth(admin: AsyncClient, queue: str) -> int:
    return int((await admin.queue_stats(queue))["depth"])


async def placement(admin: AsyncClient, queue: str) -> tuple[str, str]:
    cluster = await admin.http.cluster(queues=(queue,))
    entry = cluster["queues"][queue]
    return entry["master"], entry["replica"]


@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_every_action_confirms_then_acts_within_the_clients_grants(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    url = cluster.urls["n1"]
    async with AsyncClient(url, cluster.credentials_path) as admin, \
            aiohttp.ClientSession(cookie_jar=jar()) as browser, aiohttp.ClientSession(cookie_jar=jar()) as other:
        console = await Console.sign_in(url, load_credentials(cluster.credentials_path).signer(), browser)

        # Create: the confirmation says what, nothing exists before it is confirmed.
        status, page = await console.post("/console/create-queue", {"name": "jobs", "max_deliveries": "1",
                                                                    "strength": "full", "dead_letter": "on"})
        assert status == 200 and "Create the queue &#39;jobs&#39; with" in page and "max_deliveries 1" in page
        assert "jobs" not in [queue["name"] for queue in await admin.list_queues()]
        kind, text = await console.act("/console/create-queue", {"name": "jobs", "max_deliveries": "1",
                                                                 "strength": "full", "dead_letter": "on"})
        assert kind == "ok" and text.startswith("Queue jobs is there (master n"), text
        assert (await admin.queue_stats("jobs"))["depth"] == 0
        kind, text = await console.act("/console/create-queue", {"name": "bad", "max_depth": "many"})
        assert (kind, text) == ("error", "E_INVALID_OPTION: max_depth must be a whole number, not 'many'")
        kind, text = await console.act("/console/create-queue", {"name": "bad", "visibility_timeout_s": "inf"})
        assert (kind, text) == ("error", "E_INVALID_OPTION: visibility_timeout_s must be a number, not 'inf'")
        assert "bad" not in [queue["name"] for queue in await admin.list_queues()]

        # Put test messages, with headers; a header line without `=` puts nothing.
        kind, text = await console.act("/console/queues/jobs/put", {"payload": "hello\r\nconsole", "priority": "7",
                                                                   "headers": "kind=test\r\n\r\norigin = console"})
        assert kind == "ok" and re.fullmatch(r"Test message \d+ put into jobs at priority 7\.", text), text
        [message] = await admin.receive("jobs", wait_s=2.0)
        assert (message.payload, message.priority, message.headers) == \
               (b"hello\nconsole", 7, {"kind": "test", "origin": "console"})
        kind, text = await console.act("/console/queues/jobs/put", {"payload": "x", "headers": "no equals sign"})
        assert kind == "error" and text.startswith("E_INVALID_OPTION: header line 1 is not name=value"), text
        # Redrive: the released message was its last delivery (max_deliveries 1), so it is a dead letter.
        await message.release()
        kind, text = await console.act("/console/queues/jobs/redrive", {"limit": ""})
        assert (kind, text) == ("ok", "Queue jobs: 1 dead letters redriven."), text
        assert await depth(admin, "jobs") == 1
        for number in range(2):
            await console.act("/console/queues/jobs/put", {"payload": f"message {number}", "priority": "4"})
        assert await depth(admin, "jobs") == 3

        # Hand off: master and replica swap; move the replica to the node that held neither.
        master, replica = await placement(admin, "jobs")
        kind, text = await console.act("/console/queues/jobs/handoff", {})
        assert kind == "ok" and text.startswith(f"Queue jobs handed off: master {replica}, replica {master}"), text
        assert await placement(admin, "jobs") == (replica, master)
        spare = next(node for node in cluster.ids if node not in (master, replica))
        kind, text = await console.act("/console/queues/jobs/move", {"member": "replica", "to": spare})
        assert kind == "ok" and f"now master {replica}, replica {spare}" in text, text
        kind, text = await console.act("/console/queues/jobs/move", {"member": "replica", "to": "n9"})
        assert kind == "error" and text.startswith("E_INVALID_OPTION"), text

        # A get-only client is offered the same forms and refused where the call lands.
        record: dict[str, Any] = await admin.register_client("viewer", [{"pattern": "*", "privileges": ["get"]}])
        viewer = await Console.sign_in(url, Signer(record["id"], private_key_from_text(record["private_key"])), other)
        for path, form in (("/console/queues/jobs/purge", {}), ("/console/queues/jobs/handoff", {}),
                           ("/console/create-queue", {"name": "theirs"})):
            kind, text = await viewer.act(path, form, typed="jobs" if path.endswith("purge") else None)
            assert kind == "error" and text.startswith("E_FORBIDDEN"), (path, text)
        assert await depth(admin, "jobs") == 3 and await placement(admin, "jobs") == (replica, spare)

        # Purge: a mistyped name purges nothing; a wrong CSRF token changes nothing; then the name.
        status, page = await console.post("/console/queues/jobs/purge", {"confirmed": "yes", "typed": "job"})
        assert status == 400 and 'id="mistyped"' in page and 'id="typed"' in page
        status, page = await console.post("/console/queues/jobs/purge", {"csrf": "guess", "confirmed": "yes",
                                                                        "typed": "jobs"})
        assert status == 403 and "CSRF" in page
        # The session's token, from another site: refused. A browser sends `Origin: null` for the
        # console's own forms (its Referrer-Policy is no-referrer): Sec-Fetch-Site tells them apart.
        for headers in ({"Origin": "http://evil.example"}, {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
                        {"Origin": "null"}):
            status, page = await console.post("/console/queues/jobs/purge", {"confirmed": "yes", "typed": "jobs"},
                                              headers)
            assert status == 403, (headers, status)
        status, page = await console.post("/console/queues/jobs/redrive", {}, {"Origin": "null",
                                          "Sec-Fetch-Site": "same-origin"})
        assert status == 200 and 'id="confirm-form"' in page
        async with browser.get(url + "/console/queues/jobs/purge", allow_redirects=False) as answer:
            assert answer.status == 405
        assert await depth(admin, "jobs") == 3
        kind, text = await console.act("/console/queues/jobs/purge", {}, typed="jobs")
        assert (kind, text) == ("ok", "Queue jobs purged: 3 messages taken out."), text
        assert await depth(admin, "jobs") == 0

        # Delete: the name typed as for a purge.
        status, page = await console.post("/console/queues/jobs/delete", {"confirmed": "yes", "typed": ""})
        assert status == 400 and "jobs" in [queue["name"] for queue in await admin.list_queues()]
        kind, text = await console.act("/console/queues/jobs/delete", {}, typed="jobs")
        assert (kind, text) == ("ok", "Queue jobs deleted."), text
        assert "jobs" not in [queue["name"] for queue in await admin.list_queues()]


@pytest.mark.timeout(10)
def test_the_forms_render_with_or_without_what_the_including_page_has() -> None:
    templates = ConsoleFrame(None).templates
    session = type("Session", (), {"csrf": "token-1"})()
    one = templates.get_template("queue_actions.html")
    for context in ({}, {"stats": None, "entry": None},
                    {"stats": {"depth": 12}, "entry": {"master": "n2", "replica": "n3"}}):
        page = one.render(queue="a:b", session=session, path="/console/queues/a:b", **context)
        for form in ("handoff", "move", "purge", "redrive", "put", "delete"):
            assert re.search(rf'<form id="{form}" method="post" action="/console/queues/a%3Ab/{form}"', page), form
        assert page.count('name="csrf" value="token-1"') == 6
        assert page.count('name="back" value="/console/queues/a:b"') == 5      # a delete goes back to the list
    assert "Purge 12 messages…" in page and "Hand off (n2 ⇄ n3)…" in page
    page = templates.get_template("queues_actions.html").render(session=session, path="/console/queues?q=x")
    assert '<form id="create" method="post" action="/console/create-queue"' in page
    assert 'name="back" value="/console/queues?q=x"' in page and 'value="token-1"' in page
