"""The console's sign-in, session cookie and CSRF check against a real node (docs/CONSOLE.md,
"Signing in"): a link of `qctl console` signs in once within its minute, into a cookie that is
HttpOnly and SameSite=Strict; a signed-out visitor sees only the sign-in page; a form without the
session's CSRF token changes nothing; a removed client's session ends. The pages themselves are
driven in a real browser by tests/test_console_browser.py."""
from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client.aio import AsyncClient
from client.credentials import load_credentials
from client.http import HttpClient
from client.qctl import main as qctl_main
from wire.console_link import signin_link
from wire.signing import Signer, private_key_from_text

pytestmark = pytest.mark.asyncio


def jar() -> aiohttp.CookieJar:
    return aiohttp.CookieJar(unsafe=True)      # cookies of 127.0.0.1 (an IP address) kept


async def sign_in(session: aiohttp.ClientSession, link: str) -> aiohttp.ClientResponse:
    async with session.get(link, allow_redirects=False) as answer:
        await answer.read()
        return answer


def link_of(credentials_path: Path, url: str) -> str:
    credentials = load_credentials(credentials_path)
    return HttpClient(url, credentials.signer()).console_link()


@pytest.mark.timeout(120)
async def test_a_link_signs_in_once_into_a_strict_httponly_cookie(qnode) -> None:  # type: ignore[no-untyped-def]
    out = io.StringIO()
    assert await asyncio.to_thread(qctl_main, ["--json", "--credentials", str(qnode.credentials_path), "--url",
                                               qnode.url, "console", "--no-open"], stdout=out) == 0
    printed = json.loads(out.getvalue())
    link = printed["url"]
    assert link.startswith(qnode.url + "/console/signin?")
    async with aiohttp.ClientSession(cookie_jar=jar()) as browser:
        async with browser.get(qnode.url + "/console/cluster", allow_redirects=False) as answer:
            assert answer.status == 303 and answer.headers["Location"].startswith("/console/signin")
        async with browser.get(qnode.url + "/console/cluster") as answer:
            page = await answer.text()
            assert "qctl console" in page and "signed in as" not in page       # the sign-in page only
        answer = await sign_in(browser, link)
        assert answer.status == 303, answer.status
        cookie = answer.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie, cookie
        assert "Secure" not in cookie          # plain HTTP here: tests/test_tls.py has the TLS case
        async with browser.get(qnode.url + "/console/cluster") as answer:
            page = await answer.text()
            assert answer.status == 200 and "signed in as <b>admin</b>" in page, page[:500]
            assert "default-src 'self'" in answer.headers["Content-Security-Policy"]
            assert answer.headers["X-Frame-Options"] == "DENY"
    async with aiohttp.ClientSession(cookie_jar=jar()) as thief:       # the same link, again: refused
        async with thief.get(link, allow_redirects=False) as answer:
            assert answer.status == 401 and "E_REPLAYED_REQUEST" in await answer.text()
            assert "Set-Cookie" not in answer.headers
        async with thief.get(qnode.url + "/metrics") as answer:
            metrics = await answer.text()
    assert "qserver_console_sessions 1" in metrics
    assert 'qserver_console_signins_total{outcome="ok"} 1' in metrics
    assert 'qserver_console_signins_total{outcome="E_REPLAYED_REQUEST"} 1' in metrics


@pytest.mark.timeout(120)
async def test_expired_forged_and_foreign_links_are_refused(qnode) -> None:  # type: ignore[no-untyped-def]
    credentials = load_credentials(qnode.credentials_path)
    signer = credentials.signer()
    expired = signin_link(qnode.url, signer, timestamp_ms=int(time.time() * 1000) - 2 * 60_000)
    parts = dict(parse_qsl(urlsplit(link_of(qnode.credentials_path, qnode.url)).query))
    forged = qnode.url + "/console/signin?" + urlencode({**parts, "client": "someone-else"})
    wrong_key = signin_link(qnode.url, Signer(credentials.client_id, Ed25519PrivateKey.generate()))
    # Minted for another node, brought here.
    foreign = qnode.url + "/console/signin?" + urlsplit(signin_link("http://127.0.0.1:1", signer)).query
    cases = [(expired, "E_STALE_REQUEST"), (forged, "E_UNAUTHENTICATED"), (wrong_key, "E_UNAUTHENTICATED"),
             (foreign, "E_UNAUTHENTICATED"), (qnode.url + "/console/signin?s=x&client=admin&t=abc&n=1",
                                              "E_UNAUTHENTICATED")]
    async with aiohttp.ClientSession(cookie_jar=jar()) as browser:
        for link, code in cases:
            async with browser.get(link, allow_redirects=False) as answer:
                text = await answer.text()
                assert answer.status == 401 and code in text, (link, answer.status, text[:300])
                assert "Set-Cookie" not in answer.headers
        async with browser.get(qnode.url + "/console/cluster", allow_redirects=False) as answer:
            assert answer.status == 303        # still signed out


@pytest.mark.timeout(120)
async def test_a_form_without_the_sessions_csrf_token_changes_nothing(qnode) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        await admin.create_queue("kept")
        await admin.enqueue("kept", b"stays")
    async with aiohttp.ClientSession(cookie_jar=jar()) as browser:
        await sign_in(browser, link_of(qnode.credentials_path, qnode.url))
        for form in ({"confirmed": "yes", "typed": "kept"}, {"csrf": "guess", "confirmed": "yes", "typed": "kept"}):
            async with browser.post(qnode.url + "/console/queues/kept/purge", data=form,
                                    allow_redirects=False) as answer:
                assert answer.status in (403, 404), answer.status     # 404 until the queues pages exist
        async with browser.post(qnode.url + "/console/signout", data={}, allow_redirects=False) as answer:
            assert answer.status == 303
        async with browser.get(qnode.url + "/console/cluster", allow_redirects=False) as answer:
            assert answer.status == 200 or answer.status == 303
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        assert (await admin.queue_stats("kept"))["depth"] == 1


@pytest.mark.timeout(120)
async def test_a_removed_clients_session_ends(qnode) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        record: dict[str, Any] = await admin.register_client("viewer", [{"pattern": "*", "privileges": ["get"]}])
        signer = Signer(record["id"], private_key_from_text(record["private_key"]))
        async with aiohttp.ClientSession(cookie_jar=jar()) as browser:
            answer = await sign_in(browser, signin_link(qnode.url, signer))
            assert answer.status == 303, answer.status
            async with browser.get(qnode.url + "/console/cluster", allow_redirects=False) as answer:
                assert answer.status == 200 and f"signed in as <b>{record['id']}</b>" in await answer.text()
            await admin.remove_client(record["id"])
            for _ in range(50):
                async with browser.get(qnode.url + "/console/cluster", allow_redirects=False) as answer:
                    if answer.status == 303:
                        break
                await asyncio.sleep(0.1)
            assert answer.status == 303, "the removed client's session still shows pages"
