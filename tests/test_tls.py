"""TLS on every link (issue 13, qserver/transport/tls.py): a cluster made with `qserver init --tls` links
its nodes (peer and membership links) and serves its clients over TLS only; a plaintext
connection, or a client that does not trust the cluster's CA, gets nowhere."""
from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from client import AsyncClient, QueueError
from client.credentials import load_credentials
from client.http import HttpClient
from client.qctl import main as qctl
from qserver.transport.tls import make_tls_files
from tests.conftest import fail_on_unexpected_ends

pytestmark = pytest.mark.asyncio


@pytest.fixture
def tls_cluster(tmp_path: Path) -> Any:
    from qserver.dev.devcluster import LocalCluster
    cluster = LocalCluster(tmp_path / "cluster", 3, {"orders": ["n1", "n2"]}, tls=True)
    cluster.start_all()
    try:
        yield cluster
    finally:
        cluster.kill_all()
    fail_on_unexpected_ends(cluster.problems())


async def test_a_tls_cluster_replicates_and_serves_its_clients_over_tls(tls_cluster: Any) -> None:
    credentials = load_credentials(tls_cluster.credentials_path)
    assert credentials.url.startswith("https://") and Path(credentials.ca_file).is_file()
    async with AsyncClient(tls_cluster.urls["n3"], tls_cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        acknowledged = await client.enqueue_many("orders", [b"a", b"b", b"c"])
        [listed] = await client.list_queues()
        assert listed["master"] == "n1" and listed["replica"] == "n2"
        assert [m.id for m in await client.receive("orders", max_messages=3, wait_s=2)] == acknowledged
    # The pair came in sync over the peer link, and the map over the membership links.
    with urllib.request.urlopen(tls_cluster.urls["n2"] + "/healthz", context=tls_cluster.ssl_context) as answer:
        assert json.loads(answer.read())["membership"]["lease_valid"]
    out = _Capture()
    assert await asyncio.to_thread(qctl, ["--credentials", str(tls_cluster.credentials_path), "--json", "status"],
                                   stdout=out) == 0
    assert json.loads(out.text)["queues"]["orders"]["in_sync"]


async def test_the_console_signs_in_over_tls_with_a_secure_cookie(tls_cluster: Any) -> None:
    """docs/CONSOLE.md, "Signing in": under TLS the session cookie is Secure as well."""
    credentials = load_credentials(tls_cluster.credentials_path)
    url = tls_cluster.urls["n2"]
    link = HttpClient(url, credentials.signer()).console_link()
    connector = aiohttp.TCPConnector(ssl=tls_cluster.ssl_context)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(link, allow_redirects=False) as answer:
            assert answer.status == 303, await answer.text()
            cookie = answer.headers["Set-Cookie"]
            assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        async with browser.get(url + "/console/cluster") as answer:
            assert answer.status == 200 and "signed in as <b>admin</b>" in await answer.text()


async def test_a_plaintext_connection_to_a_tls_node_is_refused(tls_cluster: Any) -> None:
    plain = tls_cluster.urls["n1"].replace("https://", "http://")
    async with HttpClient(plain, load_credentials(tls_cluster.credentials_path).signer()) as http:
        with pytest.raises(QueueError) as caught:
            await http.cluster()
        assert caught.value.code == "E_UNAVAILABLE"
    with pytest.raises(QueueError) as connecting:          # the WebSocket too
        async with AsyncClient(plain, tls_cluster.credentials_path, connect_timeout_s=2):
            pass
    assert connecting.value.code == "E_UNAVAILABLE"


async def test_a_client_that_does_not_trust_the_clusters_ca_is_refused(tls_cluster: Any, tmp_path: Path) -> None:
    other_ca = make_tls_files(tmp_path / "elsewhere", "x")["tls_ca_file"]
    with pytest.raises(QueueError) as caught:
        async with AsyncClient(tls_cluster.urls["n1"], tls_cluster.credentials_path, ca_file=other_ca,
                               connect_timeout_s=2):
            pass
    assert caught.value.code == "E_UNAVAILABLE" and "certificate" in caught.value.message.lower()
    if "SSL_CERT_FILE" not in os.environ:       # (a QSERVER_TEST_TLS run trusts its one test CA everywhere)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):   # nor do the system's CAs
            urllib.request.urlopen(tls_cluster.urls["n1"] + "/healthz", timeout=2)


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass
