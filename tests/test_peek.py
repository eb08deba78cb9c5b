"""Browsing without taking (issue 35, item 1; docs/PROTOCOL.md "Browsing messages (peek)") on a
real 3-node cluster, through the WebSocket (the client library), REST and qctl: the order and
the states (ready, leased after a receive, delayed), deliveries and statistics untouched by
peeks, paging by cursor, the preview cut at 1 KiB, a message read by id, the refusals, and who
serves it (the master, a `full` queue's replica, a request passed on to the master)."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from client import AsyncClient, Client
from client.credentials import Credentials, load_credentials
from client.http import HttpClient
from client.qctl import main as qctl
from qserver.core.peek import cursor_of, place_of
from qserver.dev.devcluster import REPOSITORY, free_port
from tests.support import RawApi
from tests.upgrade_support import previous_release, skip_reason
from wire.errors import QueueError
from wire.protocol import PeekOp, ReadOp, decode_client_frame, encode_frame

BIG = bytes(range(256)) * 12          # 3,072 bytes, not UTF-8
# The statistics a peek must leave as they were (the rest are rates and ages, which move by themselves).
# next_index: no ordering index taken, so no operation decided, logged or journaled (under `full`
# a lease or an ack takes one).
STILL = ("depth", "ready", "in_flight", "delayed", "next_index", "highest_depth", "overflows")


async def code_of(call: Any) -> str:
    with pytest.raises(QueueError) as raised:
        await call
    return raised.value.code


def still(stats: dict[str, Any]) -> dict[str, Any]:
    kept = {key: value for key, value in stats.items() if key in STILL or key.startswith("total_")}
    assert {"depth", "in_flight", "delayed", "next_index", "total_redelivered"} <= kept.keys(), stats
    return kept


def run_qctl(url: str, credentials: Any, *argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(credentials), "--url", url, *argv], stdout=out, stderr=err)
    return code, out.getvalue() + err.getvalue()


@pytest.mark.timeout(10)
def test_cursor_names_a_place_in_the_order_and_the_frames_round_trip() -> None:
    assert place_of(0) == (9, 0)                       # the start: before everything of priority 9
    for priority in range(10):
        assert place_of(cursor_of(12345, priority)) == (priority, 12345)
    ops = [PeekOp(1, "q", 57, 0, True), ReadOp(2, "q", 7)]
    assert decode_client_frame(encode_frame(ops)) == ops     # limit 0 is the node's to refuse


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_peek_and_read_browse_without_taking(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"browse": ["n1", "n2"], "made": ["n1", "n3"]})
    credentials = load_credentials(cluster.credentials_path)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("browse", strength="full")
        await admin.create_queue("made", strength="producer")
        a = await admin.enqueue("browse", b"a")
        b = await admin.enqueue("browse", b"b")
        c = await admin.enqueue("browse", b"c", priority=9)
        late = await admin.enqueue("browse", b"later", delay_s=600)
        big = await admin.enqueue("browse", BIG, headers={"kind": "big"})
        low = await admin.enqueue("browse", b"low", priority=0)
        taken = await admin.receive("browse", visibility_timeout_s=600)
        assert [m.id for m in taken] == [c]

        # Delivery order: priority 9 first, then by id; leased and delayed at their place.
        before = await admin.http.queue_stats("browse")
        page = await admin.peek("browse")
        assert page["served_by"] == {"node": "n1", "role": "master"} and page["next_after"] is None
        listed = [(m["id"], m["state"], m["priority"], m["deliveries"]) for m in page["messages"]]
        assert listed == [(c, "leased", 9, 1), (a, "ready", 4, 0), (b, "ready", 4, 0), (late, "delayed", 4, 0),
                          (big, "ready", 4, 0), (low, "ready", 0, 0)]
        shown = {m["id"]: m for m in page["messages"]}
        assert shown[big]["payload"] == BIG and shown[big]["size"] == len(BIG) and not shown[big]["truncated"]
        assert shown[big]["headers"] == {"kind": "big"} and shown[a]["headers"] == {}
        assert abs(shown[a]["enqueued_at_ms"] - time.time() * 1000) < 60_000

        # Paging: the cursor of each page takes the next one up exactly, and the last says null.
        seen, after, pages = [], 0, 0
        while True:
            part = await admin.peek("browse", after=after, limit=2)
            seen += [m["id"] for m in part["messages"]]
            pages += 1
            if part["next_after"] is None:
                break
            after = part["next_after"]
        assert seen == [c, a, b, late, big, low] and pages == 3

        # The preview: the first KiB, said to be cut.
        cut = {m["id"]: m for m in (await admin.peek("browse", preview=True))["messages"]}[big]
        assert cut["payload"] == BIG[:1024] and cut["truncated"] and cut["size"] == len(BIG)
        assert (await admin.read("browse", big))["payload"] == BIG                 # read: in full
        one = await admin.read_message("browse", late)
        assert (one["id"], one["state"], one["served_by"]["role"]) == (late, "delayed", "master")

        # Refusals, each changing nothing.
        assert await code_of(admin.read("browse", 999_999)) == "E_UNKNOWN_MESSAGE"
        assert await code_of(admin.peek("nothing-here")) == "E_UNKNOWN_QUEUE"
        assert await code_of(admin.peek("browse", limit=0)) == "E_INVALID_OPTION"
        assert await code_of(admin.peek("browse", limit=1001)) == "E_INVALID_OPTION"
        assert len((await admin.peek("browse", limit=1000))["messages"]) == 6
        producer = await admin.register_client("poster", [{"pattern": "browse", "privileges": ["post"]}])
        poster_credentials = Credentials(producer["id"], producer["private_key"], cluster.urls["n1"],
                                         credentials.ca_file)
        async with AsyncClient(cluster.urls["n1"], poster_credentials) as poster:
            assert await code_of(poster.peek("browse")) == "E_FORBIDDEN"
            assert await code_of(poster.read("browse", a)) == "E_FORBIDDEN"
        async with HttpClient(cluster.urls["n1"], poster_credentials.signer()) as poster_http:
            assert await code_of(poster_http.peek("browse")) == "E_FORBIDDEN"

        # Nothing moved: the statistics, the deliveries, and the next receive gets `a` first.
        after_stats = await admin.http.queue_stats("browse")
        assert still(after_stats) == still(before), (before, after_stats)
        again = await admin.receive("browse", visibility_timeout_s=600)
        assert [(m.id, m.deliveries) for m in again] == [(a, 1)]

        # REST, at each node: the master serves, the `full` replica serves itself, a node with
        # no member passes the request on; the payload in base64 as a status's reply is.
        async with aiohttp.ClientSession() as session:
            for node in ("n1", "n2", "n3"):
                raw = RawApi(session, cluster.urls[node], credentials.signer())
                deadline = time.monotonic() + 10
                while True:
                    status, body, _ = await raw.request("GET", "/v1/queues/browse/messages", query={"limit": "10"})
                    assert status == 200, body
                    states = [(m["id"], m["state"]) for m in body["messages"]]
                    if states[:2] == [(c, "leased"), (a, "leased")] or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)         # the replica applies the lease a moment later
                assert states == [(c, "leased"), (a, "leased"), (b, "ready"), (late, "delayed"), (big, "ready"),
                                  (low, "ready")], (node, states)
                role = {"n1": "master", "n2": "replica", "n3": "master"}[node]
                assert body["served_by"] == {"node": "n2" if node == "n2" else "n1", "role": role}, node
                payloads = {m["id"]: base64.b64decode(m["payload_b64"]) for m in body["messages"]}
                assert payloads[big] == BIG and "payload" not in body["messages"][0]
                status, body, _ = await raw.request("GET", f"/v1/queues/browse/messages/{b}")
                assert status == 200 and body["id"] == b and base64.b64decode(body["payload_b64"]) == b"b"
                for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"after": "-1"}, {"preview": "2"}):
                    status, body, _ = await raw.request("GET", "/v1/queues/browse/messages", query=query)
                    assert (status, body["error"]["code"]) == (400, "E_INVALID_OPTION"), (node, query)
                status, body, _ = await raw.request("GET", "/v1/queues/browse/messages/123456")
                assert (status, body["error"]["code"]) == (404, "E_UNKNOWN_MESSAGE")
                status, body, _ = await raw.request("GET", "/v1/queues/absent/messages")
                assert (status, body["error"]["code"]) == (404, "E_UNKNOWN_QUEUE")
            # A `producer` queue is browsed at its master, wherever the request lands.
            made = await admin.enqueue("made", b"made")
            for node in ("n2", "n3"):
                async with HttpClient(cluster.urls[node], credentials.signer()) as http:
                    page = await http.peek("made")
                    assert [m["id"] for m in page["messages"]] == [made], node
                    assert page["served_by"] == {"node": "n1", "role": "master"}, node

    # The synchronous client, and qctl (a table for people, the REST answer with --json).
    with Client(cluster.urls["n1"], cluster.credentials_path) as sync_client:
        assert [m["id"] for m in sync_client.peek("browse", limit=3)["messages"]] == [c, a, b]
        assert sync_client.read("browse", low)["payload"] == b"low"
    code, out = await asyncio.to_thread(run_qctl, cluster.urls["n2"], cluster.credentials_path, "--json", "peek",
                                        "browse", "--limit", "2")
    assert code == 0, out
    document = json.loads(out)
    assert [m["id"] for m in document["messages"]] == [c, a] and document["next_after"] is not None
    code, out = await asyncio.to_thread(run_qctl, cluster.urls["n1"], cluster.credentials_path, "peek", "browse",
                                        "--after", str(document["next_after"]), "--preview")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["id", "state", "priority", "deliveries", "age", "size", "payload"], out
    assert [line.split()[0] for line in lines[1:5]] == [str(b), str(late), str(big), str(low)], out
    assert "served by n1 as master)" in out
    code, out = await asyncio.to_thread(run_qctl, cluster.urls["n1"], cluster.credentials_path, "peek", "browse",
                                        "--id", str(late))
    assert code == 0 and "state" in out and "delayed" in out and "later" in out, out
    code, out = await asyncio.to_thread(run_qctl, cluster.urls["n1"], cluster.credentials_path, "--json", "peek",
                                        "browse", "--id", "424242")
    assert code == 1 and json.loads(out.splitlines()[0])["error"]["code"] == "E_UNKNOWN_MESSAGE", out


OLD = previous_release()
WHY_NOT_OLD = "releases.toml names no release older than this one" if OLD is None else skip_reason(OLD["commit"])


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.skipif(WHY_NOT_OLD is not None, reason=WHY_NOT_OLD or "")
async def test_a_node_of_the_previous_release_is_said_to_be_too_old_to_browse(tmp_path: Any) -> None:
    """Release 0.2.0 knows neither the routes nor the WebSocket items: the client libraries say
    the node is too old (E_FEATURE_DISABLED) instead of passing on its E_METHOD_NOT_ALLOWED or
    E_BAD_FRAME, and the socket goes on serving."""
    assert OLD is not None
    tree = tmp_path / "tree"
    tree.mkdir()
    # The release's code read out of git (no worktree: the checkout's git state is left alone).
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", OLD["commit"]], check=True,
                             capture_output=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=60)
    port = free_port()
    url, credentials = f"http://127.0.0.1:{port}", tmp_path / "admin.json"
    subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(tmp_path / "n1"), "--credentials",
                    str(credentials), "--url", url], check=True, capture_output=True, cwd=tree, timeout=60)
    node = subprocess.Popen([sys.executable, "-m", "qserver", "run", "--data-dir", str(tmp_path / "n1"), "--port",
                             str(port), "--log-level", "WARNING"], cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(url + "/healthz") as answer:
                        if answer.status == 200 and (await answer.json())["release"] == OLD["version"]:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the old node did not start"
                await asyncio.sleep(0.2)
        async with AsyncClient(url, credentials) as client:
            await client.create_queue("old")
            await client.enqueue("old", b"kept")
            for call in (client.peek("old"), client.read("old", 1), client.http.peek("old"),
                         client.http.read_message("old", 1)):
                with pytest.raises(QueueError) as refused:
                    await call
                assert refused.value.code == "E_FEATURE_DISABLED", refused.value
                assert "too old to browse messages" in refused.value.message, refused.value
            assert [m.payload for m in await client.receive("old")] == [b"kept"]
    finally:
        node.kill()
        node.wait(timeout=10)
