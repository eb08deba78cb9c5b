"""The console's Cluster, Queues, Queue and Message pages against one real 3-node cluster (docs/
CONSOLE.md, "Cluster", "Queues", "A queue and its messages"), over HTTP as a browser would ask
(the pages in a real browser: tests/test_console_browser.py): the nodes and the membership
leader; 120 queues paged 50 at a time on the node, forwards and back, and filtered by name; a
client with `get` on `a*` sees only those queues; a queue's messages browsed without taking them;
a payload that is a script shown escaped in every view; the hex and JSON views; the listing's
filter and backward paging over REST (and a node too old for them); a node that does not answer
shown down; the same pages at a node alone; and the pure parts (paging, /metrics, hex, graphs)."""
from __future__ import annotations

import asyncio
import html
import io
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from client.aio import AsyncClient
from client.credentials import load_credentials
from client.http import HttpClient
from client.qctl import main as qctl_main
from qserver.api.queue_routes import page_around
from qserver.console.pages_queues import shown_payload
from qserver.console.sampling import parse_metrics, rate, sparkline
from qserver.dev.devcluster import LocalCluster
from tests.conftest import fail_on_unexpected_ends
from wire.console_link import signin_link
from wire.errors import QueueError
from wire.signing import Signer, private_key_from_text

pytestmark = pytest.mark.asyncio

PAGED = [f"pg-{i:03d}" for i in range(120)]
SCRIPT = b"<script>alert(1)</script>"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("console-pages"), 3)
    local.start_all()
    try:
        yield local
    finally:
        local.kill_all()
    fail_on_unexpected_ends(local.problems())


def jar() -> aiohttp.CookieJar:
    return aiohttp.CookieJar(unsafe=True)      # cookies of 127.0.0.1 (an IP address) kept


async def signed_in(url: str, signer: Signer) -> aiohttp.ClientSession:
    browser = aiohttp.ClientSession(cookie_jar=jar())
    async with browser.get(signin_link(url, signer), allow_redirects=False) as answer:
        assert answer.status == 303, (answer.status, await answer.text())
    return browser


@pytest_asyncio.fixture
async def admin_browser(cluster: LocalCluster) -> AsyncIterator[aiohttp.ClientSession]:
    browser = await signed_in(cluster.urls["n1"], load_credentials(cluster.credentials_path).signer())
    async with browser:
        yield browser


async def page(browser: aiohttp.ClientSession, url: str, status: int = 200) -> str:
    async with browser.get(url, allow_redirects=False) as answer:
        text = await answer.text()
        assert answer.status == status, (url, answer.status, text[:2000])
        return text


def rows(text: str, attribute: str) -> list[str]:
    return [html.unescape(found) for found in re.findall(rf'<tr {attribute}="([^"]*)"', text)]


def link(text: str, element_id: str) -> str | None:
    found = re.search(rf'<a id="{element_id}" href="([^"]*)"', text)
    return html.unescape(found.group(1)) if found else None


def element(text: str, tag: str, element_id: str) -> str:
    found = re.search(rf'<{tag} id="{element_id}"[^>]*>(.*?)</{tag}>', text, re.S)
    assert found is not None, (element_id, text[:3000])
    return found.group(1)


async def create(cluster: LocalCluster, names: list[str]) -> None:
    async with HttpClient(cluster.urls["n1"], load_credentials(cluster.credentials_path).signer()) as http:
        for name in names:
            await http.create_queue(name)


# --- the pure parts ------------------------------------------------------------------------------
@pytest.mark.timeout(10)
async def test_pages_around_a_name_forwards_and_back_with_a_filter() -> None:
    names = sorted(f"q{i:02d}" for i in range(30))

    def odd(name: str) -> bool:
        return int(name[1:]) % 2 == 1
    assert page_around(names, "", "", 5, odd) == (["q01", "q03", "q05", "q07", "q09"], "q09", None)
    assert page_around(names, "q09", "", 5, odd) == (["q11", "q13", "q15", "q17", "q19"], "q19", "q11")
    assert page_around(names, "", "q11", 5, odd) == (["q01", "q03", "q05", "q07", "q09"], "q09", None)
    assert page_around(names, "", "q21", 5, odd) == (["q11", "q13", "q15", "q17", "q19"], "q19", "q11")
    assert page_around(names, "q19", "", 5, odd) == (["q21", "q23", "q25", "q27", "q29"], None, "q21")
    assert page_around(names, "", "r", 5, odd) == (["q21", "q23", "q25", "q27", "q29"], None, "q21")
    assert page_around(names, "", "", 5, lambda name: False) == ([], None, None)


@pytest.mark.timeout(10)
async def test_node_figures_count_each_queue_once_and_payloads_show_in_hex() -> None:
    with_roles = "\n".join([
        '# TYPE qserver_queue_enqueued_total counter',
        'qserver_queue_enqueued_total{queue="a",role="master"} 10',
        'qserver_queue_enqueued_total{queue="b",role="replica"} 99',
        'qserver_queue_acked_total{queue="a",role="master"} 4',
        'qserver_loop_lag_max_seconds 0.012',
        'qserver_storage_free_bytes{where="disk"} 5000', 'qserver_storage_free_bytes{where="map"} 300',
        'qserver_storage_used_bytes 1000'])
    reading = parse_metrics(with_roles)
    assert (reading.enqueued, reading.acked, reading.loop_lag_s) == (10, 4, 0.012)
    assert (reading.disk_free_bytes, reading.used_bytes, reading.map_free_bytes) == (5000, 1000, 300)
    assert parse_metrics('qserver_queue_enqueued_total{queue="a"} 3\nqserver_queue_enqueued_total{queue="b"} 4').enqueued == 7
    assert rate([(0.0, 10.0), (2.0, 30.0)]) == 10.0 and rate([(0.0, 10.0)]) is None
    shown, note = shown_payload(b"ab<\x00" * 5, "hex")
    assert shown.splitlines() == ["00000000  61 62 3c 00 61 62 3c 00 61 62 3c 00 61 62 3c 00  ab<.ab<.ab<.ab<.",
                                  "00000010  61 62 3c 00" + " " * 36 + "  ab<."] and note is None
    assert shown_payload(b"{not json", "json")[1] is not None
    spark = sparkline([0.0, 5.0, 10.0])
    assert spark is not None and spark["points"].startswith("0.0,17.0") and sparkline([1.0]) is None


@pytest.mark.timeout(60)
async def test_the_cluster_page_lists_the_nodes_and_the_leader(cluster: LocalCluster,
                                                                 admin_browser: aiohttp.ClientSession) -> None:
    text = await page(admin_browser, cluster.urls["n1"] + "/console/cluster")
    assert sorted(rows(text, "data-node")) == ["n1", "n2", "n3"]
    assert '<table id="nodes" data-refresh="5">' in text
    leader = element(text, "b", "leader")
    assert leader in ("n1", "n2", "n3"), leader
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        assert (await client.http.cluster_summary())["leader"] == leader
    for node in ("n1", "n2", "n3"):
        row = re.search(rf'<tr data-node="{node}">(.*?)</tr>', text, re.S)
        assert row is not None and '<td class="state up">up</td>' in row.group(1), row
        assert ("leader" if node == leader else "follower") in row.group(1)


@pytest.mark.timeout(120)
async def test_the_queues_page_pages_on_the_node_and_filters(cluster: LocalCluster,
                                                              admin_browser: aiohttp.ClientSession) -> None:
    await create(cluster, PAGED)
    base = cluster.urls["n1"]
    first = await page(admin_browser, base + "/console/queues?q=pg-")
    assert rows(first, "data-queue") == PAGED[:50]
    assert link(first, "previous") is None and '<table id="queues" data-refresh="5">' in first
    second = await page(admin_browser, base + str(link(first, "next")))
    assert rows(second, "data-queue") == PAGED[50:100]
    third = await page(admin_browser, base + str(link(second, "next")))
    assert rows(third, "data-queue") == PAGED[100:] and link(third, "next") is None
    back = await page(admin_browser, base + str(link(third, "previous")))
    assert rows(back, "data-queue") == PAGED[50:100]
    assert rows(await page(admin_browser, base + str(link(back, "previous"))), "data-queue") == PAGED[:50]
    # Every queue of the page has its master (from the map) and its figures (from its master).
    assert all(cell in ("n1", "n2", "n3") for cell in re.findall(r'<td class="master">([^<]*)</td>', second))
    assert re.findall(r'<td class="num depth">([^<]*)</td>', second) == ["0"] * 50
    # A filter is a part of the name, on the node: one page, no pager.
    only = await page(admin_browser, base + "/console/queues?q=g-11")
    assert rows(only, "data-queue") == [f"pg-11{i}" for i in range(10)]
    assert link(only, "next") is None and link(only, "previous") is None
    assert rows(await page(admin_browser, base + "/console/queues?q=nothing-has-this"), "data-queue") == []
    unfiltered = await page(admin_browser, base + "/console/queues")
    assert len(rows(unfiltered, "data-queue")) == 50 and link(unfiltered, "next") is not None
    await page(admin_browser, base + "/console/queues?after=..bad", status=400)


@pytest.mark.timeout(60)
async def test_the_rest_listing_filters_pages_back_and_refuses_bad_cursors(cluster: LocalCluster) -> None:
    await create(cluster, [f"rest-{i}" for i in range(7)])
    async with HttpClient(cluster.urls["n3"], load_credentials(cluster.credentials_path).signer()) as http:
        page = await http.queue_page_around(3, match="rest-")
        assert [q["name"] for q in page["queues"]] == ["rest-0", "rest-1", "rest-2"]
        assert (page["next"], page["previous"], page["match"]) == ("rest-2", None, "rest-")
        later = await http.queue_page_around(3, page["next"], match="rest-")
        assert [q["name"] for q in later["queues"]] == ["rest-3", "rest-4", "rest-5"] and later["previous"] == "rest-3"
        back = await http.queue_page_around(3, before=later["previous"], match="rest-")
        assert [q["name"] for q in back["queues"]] == ["rest-0", "rest-1", "rest-2"] and back["previous"] is None
        for query in ([("before", "..no")], [("match", "x" * 201)]):
            with pytest.raises(QueueError) as refused:
                await http.request("GET", "/v1/queues", query=query)
            assert refused.value.code == "E_INVALID_OPTION"
        out = io.StringIO()
        assert await asyncio.to_thread(qctl_main, ["--json", "--credentials", str(cluster.credentials_path), "--url",
                                                   cluster.urls["n2"], "queue", "list", "--match", "rest-"],
                                       stdout=out) == 0
        assert [q["name"] for q in json.loads(out.getvalue())["queues"]] == [f"rest-{i}" for i in range(7)]
        plain = await http.queue_page(2)           # a listing without them answers as before 0.3.0
        assert set(plain) == {"queues", "next"}

        async def older_node(*args: Any, **kwargs: Any) -> dict[str, Any]:
            return {"queues": [], "next": None}     # what a node of 0.2.0 answers: no `previous`
        http._json = older_node  # type: ignore[method-assign]
        with pytest.raises(QueueError) as too_old:
            await http.queue_page_around(3, match="rest-")
        assert too_old.value.code == "E_VERSION_MISMATCH" and "too old" in too_old.value.message


@pytest.mark.timeout(120)
async def test_a_client_sees_only_the_queues_its_grants_name(cluster: LocalCluster) -> None:
    await create(cluster, ["a-one", "a-two", "b-one"])
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        record: dict[str, Any] = await admin.register_client("a-reader", [{"pattern": "a*", "privileges": ["get"]}])
    browser = await signed_in(cluster.urls["n1"], Signer(record["id"], private_key_from_text(record["private_key"])))
    async with browser:
        text = await page(browser, cluster.urls["n1"] + "/console/queues")
        assert rows(text, "data-queue") == ["a-one", "a-two"]
        assert rows(await page(browser, cluster.urls["n1"] + "/console/queues?q=one"), "data-queue") == ["a-one"]
        refused = await page(browser, cluster.urls["n1"] + "/console/queues/b-one", status=403)
        assert "E_FORBIDDEN" in refused


@pytest.mark.timeout(120)
async def test_a_queue_page_browses_its_messages_and_shows_payloads_escaped(
        cluster: LocalCluster, admin_browser: aiohttp.ClientSession) -> None:
    await create(cluster, ["browsed"])
    document = {"order": 7, "items": ["<b>x</b>", 2]}
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        ids = [await client.enqueue("browsed", SCRIPT), await client.enqueue("browsed", json.dumps(document).encode()),
               await client.enqueue("browsed", bytes(range(40)))]
    base = cluster.urls["n1"]
    text = await page(admin_browser, base + "/console/queues/browsed")
    assert rows(text, "data-message") == [str(i) for i in ids]
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "browsed.dlq" in element(text, "td", "dead-letter")
    dead_letters = await page(admin_browser, base + "/console/queues/browsed.dlq")
    assert 'href="/console/queues/browsed">browsed</a>' in dead_letters and rows(dead_letters, "data-message") == []
    message = f"{base}/console/queues/browsed/messages/{ids[0]}"
    for view in ("text", "json", "hex"):
        shown = await page(admin_browser, f"{message}?view={view}")
        assert "<script>alert" not in shown, view
        payload = element(shown, "pre", "payload")
        if view == "hex":
            assert payload.startswith("00000000  3c 73 63 72 69 70 74 3e") and "|" not in payload[:8], payload
            assert "&lt;script&gt;" in payload       # the printable column, escaped too
        else:
            assert html.unescape(payload) == SCRIPT.decode(), (view, payload)
    pretty = element(await page(admin_browser, f"{base}/console/queues/browsed/messages/{ids[1]}?view=json"),
                     "pre", "payload")
    assert html.unescape(pretty) == json.dumps(document, indent=2, ensure_ascii=False)
    assert "&lt;b&gt;x&lt;/b&gt;" in pretty
    hexed = element(await page(admin_browser, f"{base}/console/queues/browsed/messages/{ids[2]}?view=hex"),
                    "pre", "payload")
    assert hexed.splitlines()[1].startswith("00000010  10 11 12 13") and len(hexed.splitlines()) == 3
    await page(admin_browser, f"{message}?view=pdf", status=400)
    # Browsing took nothing: every message is still there, never delivered.
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        stats = await client.queue_stats("browsed")
        assert stats["depth"] == 3 and stats["total_redelivered"] == 0


@pytest.mark.timeout(60)
async def test_a_node_alone_shows_the_same_pages(qnode) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        await admin.create_queue("solo")
        message_id = await admin.enqueue("solo", b"one")
    browser = await signed_in(qnode.url, load_credentials(qnode.credentials_path).signer())
    async with browser:
        cluster_text = await page(browser, qnode.url + "/console/cluster")
        assert rows(cluster_text, "data-node") == ["n1"] and element(cluster_text, "b", "leader") == "none"
        assert "solo" in rows(await page(browser, qnode.url + "/console/queues"), "data-queue")
        queue_text = await page(browser, qnode.url + "/console/queues/solo")
        assert rows(queue_text, "data-message") == [str(message_id)]
        assert element(queue_text, "b", "depth") == "1"
        shown = await page(browser, f"{qnode.url}/console/queues/solo/messages/{message_id}")
        assert element(shown, "pre", "payload") == "one"


@pytest.mark.timeout(60)
async def test_a_node_that_does_not_answer_is_shown_down_not_an_error(cluster: LocalCluster,
                                                                      admin_browser: aiohttp.ClientSession) -> None:
    """Last in this file: it kills a node of the cluster the others share."""
    leader = cluster.membership_leader()
    victim = next(node for node in ("n3", "n2") if node != leader)
    cluster.kill(victim)
    started = time.monotonic()
    text = await page(admin_browser, cluster.urls["n1"] + "/console/cluster")
    assert time.monotonic() - started < 5.0
    row = re.search(rf'<tr data-node="{victim}">(.*?)</tr>', text, re.S)
    assert row is not None and '<td class="state down">down</td>' in row.group(1), row
    assert sorted(rows(text, "data-node")) == ["n1", "n2", "n3"]
