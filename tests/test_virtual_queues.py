"""Virtual queues (issue 37, item 5; seed 000; docs/PROTOCOL.md "Virtual queues"): named, filtered
views of one queue by a header's value, by producer client or by origin, received from and browsed
through while the queue itself goes on as before.

Pure units of the filters, their validation and the option `views`; the lease through a view on a
real queue core (the queue's order across storage pages after a restart, a spent scan budget, a
message leased through a view twice then drained once by the queue; tests/test_decide_apply.py
also mixes view leases into its master/replica equality); a fake node of release 0.2.0 (the client
says E_FEATURE_DISABLED). One real lone node: header, producer and origin views, receiving through
a view beside a plain consumer with the order kept, depths in stats and metrics, peek, the bad input
and its stable codes, a grant naming only a view and the attack on it (REST and the WebSocket),
qctl and the sync client. One real 3-node cluster: the feature-level gate, the views in the map
followed by both members, kept across a handoff and a failover (kill -9 of the master)."""
from __future__ import annotations

import asyncio
import io
import json
import re
import time
from typing import Any

import pytest
from aiohttp import web

from client import AsyncClient, Client
from client.credentials import Credentials, load_credentials
from client.http import HttpClient
from client.qctl import main as qctl
from client.views import ViewCalls
from qserver.dev.devcluster import free_port
from qserver.http_errors import error_response
from replication.options import OptionError, QueueOptions, changed_options, options_from_json, parse_changes
from replication.view_lease import lease_matching
from replication.views import VIEWS_MAX, View, ViewError, grant_name, parse_view, parse_views
from wire.errors import E_METHOD_NOT_ALLOWED, E_NOT_FOUND, QueueError
from wire.message_input import FAILED_OVER_FROM, ORIGIN_PRODUCER, RETURNED_FROM
from wire.signing import Signer, new_private_key
from wire.version_headers import NODE_HEADER

EU = {"header": "region", "equals": "eu"}


async def code_of(call: Any) -> str:
    with pytest.raises(QueueError) as raised:
        await call
    return raised.value.code


def run_qctl(url: str, credentials: Any, *argv: str) -> tuple[int, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(credentials), "--url", url, *argv], stdout=out, stderr=err)
    text = out.getvalue()
    try:
        return code, json.loads(text) if text.strip() else json.loads(err.getvalue() or "null")
    except ValueError:
        return code, text + err.getvalue()


# --- units ------------------------------------------------------------------------------------------
def test_filters_match_by_header_producer_and_origin() -> None:
    eu = parse_view("eu", EU)
    assert eu.matches("p1", {"region": "eu"}) and not eu.matches("p1", {"region": "us"}) and not eu.matches("p1", None)
    either = parse_view("europe", {"header": "region", "in": ["eu", "uk", "eu"]})
    assert either.values == ("eu", "uk") and either.matches("x", {"region": "uk"})
    assert either.to_json() == {"header": "region", "in": ["eu", "uk"]} and eu.to_json() == EU
    mine = parse_view("mine", {"producer": "alice"})
    assert mine.matches("alice", {}) and not mine.matches("bob", {})
    # a message the cluster moved (enqueued as @cluster) is its first producer's
    assert mine.matches("@cluster", {ORIGIN_PRODUCER: "alice", FAILED_OVER_FROM: "r1"})
    assert not mine.matches("alice", {ORIGIN_PRODUCER: "bob"})
    direct, moved = parse_view("d", {"origin": "direct"}), parse_view("m", {"origin": "moved"})
    failed, returned = parse_view("f", {"origin": "failed_over"}), parse_view("r", {"origin": "returned"})
    assert direct.matches("a", {}) and not moved.matches("a", {})
    assert moved.matches("@cluster", {FAILED_OVER_FROM: "r"}) and failed.matches("@cluster", {FAILED_OVER_FROM: "r"})
    assert not returned.matches("@cluster", {FAILED_OVER_FROM: "r"}) and returned.matches("x", {RETURNED_FROM: "r"})
    assert grant_name("orders", "eu") == "orders/eu"


def test_bad_definitions_are_refused_and_views_are_bounded() -> None:
    for name, raw, says in (("eu", {}, "filter"), ("eu", {"header": "region"}, "filter"),
                            ("eu", {"header": "region", "equals": ""}, "header value"),
                            ("eu", {"header": "", "equals": "x"}, "header name"),
                            ("eu", {"header": "r", "in": []}, "in is a list"),
                            ("eu", {"origin": "mars"}, "origin is one of"),
                            ("eu", {"producer": 5}, "client id"), ("eu", {"producer": "a", "origin": "direct"}, "filter"),
                            ("-eu", EU, "view name"), ("e/u", EU, "view name"), ("x" * 65, EU, "view name")):
        with pytest.raises(ViewError, match=says):
            parse_view(name, raw)
    with pytest.raises(ViewError, match=f"at most {VIEWS_MAX}"):
        parse_views({f"v{n}": EU for n in range(VIEWS_MAX + 1)})
    assert len(parse_views({f"v{n}": EU for n in range(VIEWS_MAX)})) == VIEWS_MAX


def test_views_are_a_level_3_option_stored_only_when_set() -> None:
    assert "views" not in QueueOptions().to_json() and QueueOptions().to_json(every=True)["views"] == {}
    changes = parse_changes({"views": {"eu": EU}})
    stored = changed_options(QueueOptions().to_json(), changes)
    assert stored["views"] == {"eu": EU}
    assert options_from_json(stored).views == (View("eu", "header", ("eu",), "region"),)
    assert "views" not in changed_options(stored, {"views": {}})
    with pytest.raises(OptionError, match="filter"):
        parse_changes({"views": {"eu": {"nope": 1}}})


def test_leasing_through_a_view_keeps_the_queue_order_the_pages_and_the_budget() -> None:
    """On a real queue core: after a restart (ready messages paged in from storage, 1,024 a page)
    the view's messages come in the queue's order; a message leased through a view, released and
    leased again through it is leased once each time and then delivered exactly once to the queue's
    plain consumer with the rest, in order; a spent budget answers what was found."""
    from tests.test_queue_core import Driver
    driver = Driver()
    ids = [driver.enqueue(f"m{n}".encode(), commit=False) for n in range(3000)]
    driver.commit()
    driver.restart()                     # nothing in memory: every ready message is on a page

    def through(accept: Any, count: int) -> list[int]:
        leased = driver._run(lambda out: lease_matching(driver.core, accept, count, None, "c", driver.now_ms, out), True)
        return [op.index for op in leased]

    sevens = through(lambda index: index % 700 == 0, 10)
    assert sevens == [index for index in ids if index % 700 == 0]
    assert len(sevens) == 4 and sevens[-1] > 2048       # past two pages
    looked: list[int] = []

    def spent_after_5(index: int) -> bool | None:
        looked.append(index)
        return None if len(looked) > 5 else index % 2 == 1
    assert through(spent_after_5, 10) == [1, 3, 5]
    # a non-head message leased through a view twice (released between), then the queue drains once
    [again] = through(lambda index: index == 1500, 1)
    lease = driver.core._leases[again]
    driver.release_index(again, lease.receipt)
    assert through(lambda index: index == 1500, 1) == [1500]
    driver.release_index(1500, driver.core._leases[1500].receipt)
    drained = [op.index for op in driver.lease(5000)]
    assert sorted(drained) == drained and len(drained) == len(set(drained)) == 3000 - 4 - 3
    assert 1500 in drained and not set(drained) & {*sevens, 1, 3, 5}


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_node_before_0_3_0_is_reported_too_old_for_views() -> None:
    """Release 0.2.0 has no /virtual routes (E_NOT_FOUND, E_METHOD_NOT_ALLOWED): the client says
    E_FEATURE_DISABLED naming the node's release."""
    async def refuse(request: web.Request) -> web.Response:
        kind = E_NOT_FOUND if request.method == "GET" else E_METHOD_NOT_ALLOWED
        response = error_response(QueueError(kind))
        response.headers[NODE_HEADER] = "0.2.0; protocol=1-1; feature-level=2"
        return response
    app = web.Application()
    app.router.add_route("*", "/v1/queues/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with HttpClient(f"http://127.0.0.1:{port}", Signer("c-1", new_private_key())) as http:
            views = _RestViews(http)
            for call in (views.create_view("orders", "eu", EU), views.list_views("orders"),
                         views.receive_view("orders", "eu"), views.peek_view("orders", "eu")):
                with pytest.raises(QueueError) as refused:
                    await call
                assert refused.value.code == "E_FEATURE_DISABLED" and "0.2.0" in refused.value.message, refused.value
    finally:
        await runner.cleanup()


class _RestViews(ViewCalls):
    def __init__(self, http: HttpClient) -> None:
        self.http = http


# --- a lone node --------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_receive_and_peek_through_views_beside_the_queue_on_a_lone_node(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        await admin.create_queue("orders")
        created = await admin.create_view("orders", "eu", EU)
        assert created["filter"] == EU and created["views"] == {"eu": EU}
        await admin.create_view("orders", "direct", {"origin": "direct"})
        ids = []
        for n, region in enumerate(["us", "eu", "us", "eu", "eu", "us"]):
            ids.append(await admin.enqueue("orders", f"m{n}".encode(), headers={"region": region}))
        eu_ids = [ids[1], ids[3], ids[4]]
        # the depth of each view in the queue's stats and its list
        stats = await admin.queue_stats("orders")
        assert stats["views"]["eu"]["depth"] == 3 and stats["views"]["eu"]["depth_exact"] is True, stats
        assert stats["views"]["direct"]["depth"] == 6
        assert (await admin.list_views("orders"))["eu"]["depth"] == 3
        metrics = (await admin.http.request("GET", "/metrics")).body.decode()
        assert re.search(r'^qserver_queue_views\{queue="orders",role="[a-z]+"\} 2(\.0)?$', metrics, re.M), metrics[-800:]
        # peek through the view: only its messages, in the queue's order
        page = await admin.peek_view("orders", "eu")
        assert [m["id"] for m in page["messages"]] == eu_ids and page["next_after"] is None
        # receive through the view takes the first eu message; a plain receive the queue's head
        [first] = await admin.receive_view("orders", "eu")
        assert first.id == ids[1] and first.headers == {"region": "eu"}
        [plain] = await admin.receive("orders", 1)
        assert plain.id == ids[0]
        [second] = await admin.receive_view("orders", "eu")
        assert second.id == ids[3]
        await first.ack()
        await second.release()              # back in its place: the view's next again
        [again] = await admin.receive_view("orders", "eu")
        assert again.id == ids[3] and again.deliveries == 2
        await again.ack()
        await plain.ack()
        # the plain consumer gets the rest in order, the view's last message among them
        rest = await admin.receive("orders", 10)
        assert [m.id for m in rest] == [ids[2], ids[4], ids[5]]
        for message in rest:
            await message.ack()
        assert await admin.receive_view("orders", "eu") == []
        assert (await admin.queue_stats("orders"))["views"]["eu"]["depth"] == 0

        # bad input: stable codes, nothing changed
        assert await code_of(admin.receive_view("orders", "nope")) == "E_UNKNOWN_VIEW"
        assert await code_of(admin.peek_view("orders", "nope")) == "E_UNKNOWN_VIEW"
        assert await code_of(admin.delete_view("orders", "nope")) == "E_UNKNOWN_VIEW"
        assert await code_of(admin.create_view("orders", "bad", {"header": "region"})) == "E_INVALID_OPTION"
        assert await code_of(admin.create_view("orders", "-bad", EU)) == "E_INVALID_NAME"
        assert await code_of(admin.create_view("missing", "eu", EU)) == "E_UNKNOWN_QUEUE"
        assert await code_of(admin.create_view("orders.dlq", "eu", EU)) == "E_RESERVED_NAME"
        for n in range(VIEWS_MAX - 2):
            await admin.create_view("orders", f"v{n}", {"producer": f"p{n}"})
        assert await code_of(admin.create_view("orders", "one-more", EU)) == "E_VIEWS_FULL"
        await admin.create_view("orders", "eu", {"header": "region", "in": ["eu", "uk"]})   # a change fits
        assert len(await admin.list_views("orders")) == VIEWS_MAX
        for n in range(VIEWS_MAX - 2):
            await admin.delete_view("orders", f"v{n}")
        assert set(await admin.list_views("orders")) == {"eu", "direct"}
        assert await code_of(admin.http.request("POST", "/v1/queues/orders/virtual/eu/receive",
                                                query=[("wait_s", "1")], idempotent=False)) == "E_INVALID_OPTION"


def _as(node: Any, record: dict[str, Any]) -> AsyncClient:
    ca_file = load_credentials(node.credentials_path).ca_file
    return AsyncClient(node.url, Credentials(record["id"], record["private_key"], node.url, ca_file))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_producer_and_origin_views_and_a_grant_that_names_only_a_view(qnode: Any) -> None:
    """A client granted `orders/eu` receives, browses and settles eu messages through the view,
    and nothing else: not the queue, not another view, not a definition."""
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        await admin.create_queue("orders")
        await admin.create_view("orders", "eu", EU)
        await admin.create_view("orders", "us", {"header": "region", "equals": "us"})
        alice = await admin.register_client("alice", [{"pattern": "orders", "privileges": ["post"]}])
        bob = await admin.register_client("bob", [{"pattern": "orders", "privileges": ["post"]}])
        reader = await admin.register_client("eu-reader", [{"pattern": "orders/eu", "privileges": ["get", "delete"]}])
        await admin.create_view("orders", "from-alice", {"producer": alice["id"]})   # its id, not its name
        await admin.create_view("orders", "direct", {"origin": "direct"})
        await admin.create_view("orders", "moved", {"origin": "moved"})
        async with _as(qnode, alice) as producer_a, _as(qnode, bob) as producer_b:
            a1 = await producer_a.enqueue("orders", b"a-us", headers={"region": "us"})
            b1 = await producer_b.enqueue("orders", b"b-eu", headers={"region": "eu"})
            a2 = await producer_a.enqueue("orders", b"a-eu", headers={"region": "eu"})
            b2 = await producer_b.enqueue("orders", b"b-us", headers={"region": "us"})
        views = await admin.list_views("orders")
        assert {name: views[name]["depth"] for name in views} == \
            {"eu": 2, "us": 2, "from-alice": 2, "direct": 4, "moved": 0}, views
        assert [m["id"] for m in (await admin.peek_view("orders", "from-alice"))["messages"]] == [a1, a2]
        assert (await admin.peek_view("orders", "moved"))["messages"] == []

        async with _as(qnode, reader) as eu_reader:
            # the attack: the queue itself, another view, a definition, the queue's own ack route
            assert await code_of(eu_reader.receive("orders", 1)) == "E_FORBIDDEN"
            assert await code_of(eu_reader.peek("orders")) == "E_FORBIDDEN"
            assert await code_of(eu_reader.receive_view("orders", "us")) == "E_FORBIDDEN"
            assert await code_of(eu_reader.peek_view("orders", "us")) == "E_FORBIDDEN"
            for method, path in (("POST", "/v1/queues/orders/virtual/us/receive"), ("POST", "/v1/queues/orders/receive"),
                                 ("GET", "/v1/queues/orders/virtual/us/messages"), ("GET", "/v1/queues/orders/messages")):
                assert await code_of(eu_reader.http.request(method, path, idempotent=False)) == "E_FORBIDDEN", path
            assert await code_of(eu_reader.create_view("orders", "all", {"origin": "direct"})) == "E_FORBIDDEN"
            assert await code_of(eu_reader.delete_view("orders", "eu")) == "E_FORBIDDEN"
            assert await code_of(eu_reader.http.request(
                "POST", "/v1/queues/orders%2Feu/receive", idempotent=False)) in ("E_INVALID_NAME", "E_FORBIDDEN")
            # through its view: only eu messages, in the queue's order
            page = await eu_reader.peek_view("orders", "eu")
            assert [m["id"] for m in page["messages"]] == [b1, a2]
            taken = await eu_reader.receive_view("orders", "eu", max_messages=5)
            assert [m.id for m in taken] == [b1, a2] and {m.headers["region"] for m in taken} == {"eu"}
            assert await code_of(eu_reader.ack("orders", taken[0].id, taken[0].receipt)) == "E_FORBIDDEN"
            await taken[0].extend(20)
            for message in taken:
                await message.ack()
            assert await eu_reader.receive_view("orders", "eu") == []
        # the us messages are all still there, for the queue's consumers
        rest = await admin.receive("orders", 10)
        assert [m.id for m in rest] == [a1, b2]

        # qctl and the sync client reach the same calls
        code, listed = await asyncio.to_thread(run_qctl, qnode.url, qnode.credentials_path,
                                               "queue", "view", "list", "orders", "--json")
        assert code == 0 and listed["views"]["eu"]["filter"] == EU, listed
        code, made = await asyncio.to_thread(run_qctl, qnode.url, qnode.credentials_path, "queue", "view", "create",
                                             "orders", "uk", "--header", "region=uk", "--json")
        assert code == 0 and made["filter"] == {"header": "region", "equals": "uk"}, made
        code, refused = await asyncio.to_thread(run_qctl, qnode.url, qnode.credentials_path, "queue", "view",
                                                "delete", "orders", "nope", "--json")
        assert code == 1 and refused["error"]["code"] == "E_UNKNOWN_VIEW", refused

        def sync_side() -> None:
            with Client(qnode.url, qnode.credentials_path) as client:
                client.enqueue("orders", b"uk-1", headers={"region": "uk"})
                assert [m["payload"] for m in client.peek_view("orders", "uk")["messages"]] == [b"uk-1"]
                [message] = client.receive_view("orders", "uk")
                assert message.payload == b"uk-1"
                message.ack()
                assert client.list_views("orders")["uk"]["depth"] == 0
                assert client.delete_view("orders", "uk")["deleted"] == "uk"
        await asyncio.to_thread(sync_side)
        code, got = await asyncio.to_thread(run_qctl, qnode.url, qnode.credentials_path, "get", "orders", "--view",
                                            "eu", "--json")
        assert code == 0, got


# --- a real cluster -----------------------------------------------------------------------------------
async def _until_views_at(cluster: Any, node: str, queue: str, wanted: dict[str, Any]) -> dict[str, Any]:
    """The member on `node` follows its map entry's views (its own core's options, and their depths)."""
    deadline = time.monotonic() + 15
    async with AsyncClient(cluster.urls[node], cluster.credentials_path) as client:
        while True:
            stats = await client.queue_stats(queue)
            if stats["options"].get("views", {}) == wanted:
                return stats
            assert time.monotonic() < deadline, (node, stats["options"])
            await asyncio.sleep(0.1)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_views_live_in_the_map_follow_both_members_and_survive_a_handoff(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        # below feature level 3 nothing 0.2.0 could not read is proposed: refused, nothing changed
        assert await code_of(client.create_view("orders", "eu", EU)) == "E_FEATURE_DISABLED"
        assert await code_of(client.create_queue("other", views={"eu": EU})) == "E_FEATURE_DISABLED"
        assert "views" not in (await client.queue_stats("orders"))["options"] or \
            (await client.queue_stats("orders"))["options"]["views"] == {}
        await client.finalize_cluster()

        await client.create_view("orders", "eu", EU)
        for node in ("n1", "n2"):
            await _until_views_at(cluster, node, "orders", {"eu": EU})
        ids = [await client.enqueue("orders", f"m{n}".encode(), headers={"region": region})
               for n, region in enumerate(["us", "eu", "us", "eu", "us", "eu"])]
        [first] = await client.receive_view("orders", "eu")       # asked at n3: passed on to the master
        assert first.id == ids[1]
        [plain] = await client.receive("orders", 1)
        assert plain.id == ids[0]
        await first.ack()
        await plain.ack()

        await client.handoff("orders")
        deadline = time.monotonic() + 15
        while next(q for q in await client.list_queues() if q["name"] == "orders")["master"] != "n2":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        stats = await _until_views_at(cluster, "n2", "orders", {"eu": EU})
        assert stats["views"]["eu"]["depth"] == 2, stats
        # the new master serves the view in the queue's order; asked at the replica (n1) too
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as at_replica:
            assert [m["id"] for m in (await at_replica.peek_view("orders", "eu"))["messages"]] == [ids[3], ids[5]]
            [second] = await at_replica.receive_view("orders", "eu")
            assert second.id == ids[3]
            await second.ack()

        # a failover: the master (n2) killed, the replica (n1) masters the queue with its views
        await asyncio.to_thread(cluster.kill, "n2")
        deadline = time.monotonic() + 20
        while next(q for q in await client.list_queues() if q["name"] == "orders")["master"] != "n1":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        stats = await _until_views_at(cluster, "n1", "orders", {"eu": EU})
        assert stats["views"]["eu"]["depth"] == 1, stats
        [third] = await client.receive_view("orders", "eu", visibility_timeout_s=30)
        assert third.id == ids[5]
        rest = await client.receive("orders", 10)
        assert [m.id for m in rest] == [ids[2], ids[4]]          # the plain consumer: the rest, in order
        for message in [third, *rest]:
            await message.ack()
        await client.delete_view("orders", "eu")
        await _until_views_at(cluster, "n1", "orders", {})


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_origin_and_producer_views_of_messages_the_cluster_moved(qcluster_factory: Any, tmp_path: Any) -> None:
    """Fault surveillance returns a message to its sender's `reply-to` queue as `@cluster`, with
    x-returned-from and x-origin-producer: the origin views sort it from a direct enqueue, and the
    producer view still names the client that enqueued it first."""
    import signal
    import subprocess
    import sys

    from qserver.dev.devcluster import REPOSITORY
    cluster = qcluster_factory(3, {"alerts": ["n1", "n2"], "returns": ["n2", "n3"]})
    admin_id = load_credentials(cluster.credentials_path).client_id
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.finalize_cluster()
        await admin.create_queue("returns", strength="full")
        await admin.create_queue("alerts", strength="full", fault_interval_s=0.5, visibility_timeout_s=1.0)
        await admin.create_view("returns", "returned", {"origin": "returned"})
        await admin.create_view("returns", "moved", {"origin": "moved"})
        await admin.create_view("returns", "direct", {"origin": "direct"})
        await admin.create_view("returns", "mine", {"producer": admin_id})
        pager = subprocess.Popen([sys.executable, "-m", "tests.recipient_app", cluster.urls["n3"],
                                  str(cluster.credentials_path), "alerts", "pager", str(tmp_path / "pager.txt")],
                                 cwd=REPOSITORY)
        try:
            deadline = time.monotonic() + 20
            while {r["recipient"]: r["state"] for r in await admin.recipients()}.get("pager") != "ok":
                assert time.monotonic() < deadline, await admin.recipients()
                await asyncio.sleep(0.1)
            pager.send_signal(signal.SIGSTOP)           # hung: it takes nothing, enters fault
            moved = [await admin.enqueue("alerts", b"a%d" % n, headers={"reply-to": "returns"}) for n in range(3)]
            direct = await admin.enqueue("returns", b"direct")
            deadline = time.monotonic() + 30
            while (await admin.list_views("returns"))["returned"]["depth"] < len(moved):
                assert time.monotonic() < deadline, await admin.list_views("returns")
                await asyncio.sleep(0.2)
        finally:
            pager.send_signal(signal.SIGCONT)
            pager.kill()
            pager.wait(timeout=10)
        views = await admin.list_views("returns")
        assert {name: view["depth"] for name, view in views.items()} == \
            {"returned": 3, "moved": 3, "direct": 1, "mine": 4}, views
        [only] = await admin.receive_view("returns", "direct")
        assert only.id == direct and only.payload == b"direct"
        back = await admin.receive_view("returns", "returned", max_messages=5)
        assert sorted(m.payload for m in back) == [b"a0", b"a1", b"a2"]
        assert all(m.headers["x-returned-from"] == "pager" and m.headers["x-origin-producer"] == admin_id
                   for m in back), [m.headers for m in back]
        for message in [only, *back]:
            await message.ack()
        assert (await admin.list_views("returns"))["mine"]["depth"] == 0
