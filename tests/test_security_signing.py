"""Attack tests for request signing (issue 32, items 4 and 5, and the Low findings of
qserver/api/auth.py): each performs the attack against real nodes on loopback (or, for the nonce
tables, against the real Authenticator) and checks that it no longer works. A captured request
is made the way an on-path observer would record it: the exact headers and body the client
sent, signed here with wire/signing.py as the client library signs them."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import time
from typing import Any

import aiohttp
import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials
from client.http import queue_path
from qserver.api import auth
from qserver.api.auth import CLUSTER_CLIENT, Authenticator, DelegatedSigner, pass_on_headers
from qserver.dev.devcluster import LocalCluster
from tests.support import raw_session
from wire.signing import Signer, new_private_key, private_key_from_text, public_key_text

pytestmark = pytest.mark.asyncio


def host_of(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


async def send(session: aiohttp.ClientSession, cluster: LocalCluster, url: str, method: str, path: str,
               body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """One raw request; (status, X-Error-Code or "", body)."""
    async with session.request(method, url + path, data=body, headers=headers,
                               ssl=cluster.ssl_context or True) as answer:
        return answer.status, answer.headers.get("X-Error-Code", ""), await answer.read()


def secret_of(cluster: LocalCluster) -> bytes:
    return (cluster.root / "n1" / "cluster.secret").read_text().strip().encode()


async def test_a_request_captured_at_one_node_is_refused_at_every_other(qcluster_factory: Any) -> None:
    """Issue 32, item 4. Nonces are kept per node and the QS1 signature named no node: an
    observer who recorded an administrator's `PUT /v1/clients/{id}/grants` (granting a worker
    `admin`) at n1 replayed it at n2 and n3 within 300 s, after the administrator had taken the
    grant back, and the worker was an admin again. The QS2 signature names the node addressed
    (its Host): at n2 and n3 the replay is refused, sent with their Host or with n1's."""
    cluster: LocalCluster = qcluster_factory(3)
    signer = load_credentials(cluster.credentials_path).signer()
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, raw_session() as session:
        worker = await admin.register_client("worker", [{"pattern": "jobs", "privileges": ["get"]}])
        path = f"/v1/clients/{worker['id']}/grants"
        body = b'{"grants": [{"pattern": "*", "privileges": ["admin", "get", "post", "delete"]}]}'
        captured = signer.headers("PUT", path, [], body, audience=cluster.urls["n1"])
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "PUT", path, body, captured)
        assert status == 200, code
        await admin.set_grants(worker["id"], [{"pattern": "jobs", "privileges": ["get"]}])     # taken back
        for node in ("n2", "n3"):
            status, code, _ = await send(session, cluster, cluster.urls[node], "PUT", path, body, captured)
            assert (status, code) == (401, "E_UNAUTHENTICATED"), f"replayed at {node}: {status} {code}"
            addressed_to_n1 = {**captured, "Host": host_of(cluster.urls["n1"])}
            status, code, answer = await send(session, cluster, cluster.urls[node], "PUT", path, body, addressed_to_n1)
            assert (status, code) == (401, "E_UNAUTHENTICATED"), f"replayed at {node} as n1: {status} {code}"
            assert b"not to this node" in answer
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "PUT", path, body, captured)
        assert (status, code) == (401, "E_REPLAYED_REQUEST")
        for node in ("n1", "n2", "n3"):
            async with AsyncClient(cluster.urls[node], cluster.credentials_path) as at_node:
                record = next(r for r in await at_node.list_clients() if r["id"] == worker["id"])
                assert record["grants"] == [{"pattern": "jobs", "privileges": ["get"]}], node


async def test_a_websocket_upgrade_captured_at_one_node_is_refused_at_another(qcluster_factory: Any) -> None:
    """Issue 32, item 4. A WebSocket upgrade (a session that stays open) recorded at n1 opened
    a session at n2 too, and so did the node's own delegated `@cluster` upgrade (signed with the
    cluster secret, every privilege). Both name n1 now: n2 refuses them, n1 takes each once."""
    cluster: LocalCluster = qcluster_factory(3)
    signer = load_credentials(cluster.credentials_path).signer()
    node_signer = DelegatedSigner(CLUSTER_CLIENT, secret_of(cluster))
    async with raw_session() as session:
        for who in (signer, node_signer):
            captured = who.headers("GET", "/v1/ws", [], b"", audience=cluster.urls["n1"])
            for node in ("n2", "n3"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(cluster.urls[node] + "/v1/ws", headers=captured,
                                             ssl=cluster.ssl_context or True)
                assert refused.value.status == 401, (who.client_id, node)
                assert refused.value.headers is not None
                assert refused.value.headers.get("X-Error-Code") == "E_UNAUTHENTICATED"
            ws = await session.ws_connect(cluster.urls["n1"] + "/v1/ws", headers=captured,
                                          ssl=cluster.ssl_context or True)
            await ws.close()
            with pytest.raises(aiohttp.WSServerHandshakeError) as again:
                await session.ws_connect(cluster.urls["n1"] + "/v1/ws", headers=captured,
                                         ssl=cluster.ssl_context or True)
            assert again.value.status == 401


@pytest.mark.parametrize("header, signed, sent", [
    ("X-Priority", "0", "9"),                                   # jumps the queue
    ("X-Dedupe-Id", "order-17", "order-16"),                     # a repeat of another: dropped silently
    ("X-Headers", '{"reply-to": "alice.replies"}', '{"reply-to": "mallory.inbox"}'),  # return to sender redirected
])
async def test_a_header_changed_after_signing_is_refused(qcluster_factory: Any, header: str, signed: str,
                                                         sent: str) -> None:
    """Issue 32, item 5. QS1 covered method, path, query, time, nonce and body, not X-Priority,
    X-Dedupe-Id or X-Headers: an on-path party changed them and the node took the message so
    (a message dropped as a repeat of another, its return to sender redirected). QS2 signs
    them: the changed request is refused and nothing is stored; the one as signed passes."""
    cluster: LocalCluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    signer = load_credentials(cluster.credentials_path).signer()
    path = queue_path("orders", "messages")
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, raw_session() as session:
        await admin.create_queue("orders", strength="full")
        fields = {header: signed}
        captured = {**fields, **signer.headers("POST", path, [], b"order", audience=cluster.urls["n1"], headers=fields)}
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"order",
                                     {**captured, header: sent})
        assert (status, code) == (401, "E_UNAUTHENTICATED")
        assert (await admin.queue_stats("orders"))["depth"] == 0
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"order", captured)
        assert status == 201, code
        [message] = await admin.receive("orders", max_messages=1)
        if header == "X-Priority":
            assert message.priority == 0
        if header == "X-Headers":
            assert message.headers == {"reply-to": "alice.replies"}


async def test_server_control_headers_from_a_client_get_no_server_behaviour(qcluster_factory: Any) -> None:
    """Issue 32, item 5. X-Forwarded-By, X-Placement and X-Own-Copy were honoured from anyone:
    a client (or an on-path party adding them) purged one member of a `producer` pair only,
    placed a new queue where it chose, and kept a non-master from passing a request on. Only a
    request passed on (node-authenticated) may carry them now; from a client they are refused
    with E_BAD_REQUEST and nothing happens."""
    cluster: LocalCluster = qcluster_factory(3, {"events": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("events", strength="producer")
        await admin.enqueue_many("events", [b"e%d" % number for number in range(5)])
        with pytest.raises(QueueError) as refused:
            await admin.http.request("POST", queue_path("events", "purge"), headers={"X-Own-Copy": "1"})
        assert refused.value.code == "E_BAD_REQUEST" and "X-Own-Copy" in refused.value.message
        assert (await admin.queue_stats("events"))["depth"] == 5
        with pytest.raises(QueueError) as refused:
            await admin.http.request("PUT", queue_path("placed"), body=b"{}",
                                     headers={"X-Forwarded-By": "n2", "X-Placement": "n3,n2"})
        assert refused.value.code == "E_BAD_REQUEST"
        assert "placed" not in [q["name"] for q in await admin.list_queues()]
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as at_n3:
            with pytest.raises(QueueError) as refused:
                await at_n3.http.request("POST", queue_path("events", "messages"), body=b"x",
                                         headers={"X-Forwarded-By": "n1"})
            assert refused.value.code == "E_BAD_REQUEST"
            answer = await admin.purge("events")              # the honest purge: both members' copies
            assert set(answer["members"]) == {"n1", "n2"}, answer


async def test_a_pass_on_envelope_holds_only_at_the_node_it_names(qcluster_factory: Any) -> None:
    """Issue 32, item 4. A node passing a request on signs an envelope with the cluster secret
    naming itself, the target and the principal (it no longer passes the client's replayable
    signature on). The envelope made for n1 is refused at n3 and a second time at n1, one made
    without the secret is refused, and one naming a client n1 does not know is refused there."""
    cluster: LocalCluster = qcluster_factory(3, {"jobs": ["n1", "n2"]})
    secret = secret_of(cluster)
    creds = load_credentials(cluster.credentials_path)
    path = queue_path("jobs", "messages")
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin, raw_session() as session:
        await admin.create_queue("jobs", strength="full")
        await admin.enqueue("jobs", b"through n2")          # an honest client at the replica: passed on
        fields = {"X-Priority": "3"}
        envelope = {**fields, **pass_on_headers(secret, "n2", "n1", creds.client_id, "POST", path, [], fields, b"job")}
        status, code, _ = await send(session, cluster, cluster.urls["n3"], "POST", path, b"job", envelope)
        assert (status, code) == (401, "E_UNAUTHENTICATED")
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"job", envelope)
        assert status == 201, code
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"job", envelope)
        assert (status, code) == (401, "E_REPLAYED_REQUEST")
        forged = pass_on_headers(b"not the secret", "n2", "n1", creds.client_id, "POST", path, [], {}, b"job")
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"job", forged)
        assert (status, code) == (401, "E_UNAUTHENTICATED")
        stranger = pass_on_headers(secret, "n2", "n1", "c-removed", "POST", path, [], {}, b"job")
        status, code, _ = await send(session, cluster, cluster.urls["n1"], "POST", path, b"job", stranger)
        assert (status, code) == (401, "E_UNAUTHENTICATED")
        assert (await admin.queue_stats("jobs"))["depth"] == 2


def qs1_headers(creds: Credentials, method: str, path: str, body: bytes) -> dict[str, str]:
    """A request signed the way clients signed before QS2 (wire/signing.py at dfe307a)."""
    stamp, nonce = int(time.time() * 1000), os.urandom(16).hex()
    text = "\n".join(("QS1", method, path, "", str(stamp), nonce, hashlib.sha256(body).hexdigest())).encode()
    signature = base64.b64encode(private_key_from_text(creds.private_key_text).sign(text)).decode()
    return {"X-Client-Id": creds.client_id, "X-Timestamp": str(stamp), "X-Nonce": nonce, "X-Signature": signature}


async def test_a_request_signed_the_old_way_is_told_the_scheme_it_needs(qcluster_factory: Any) -> None:
    """Issue 32, items 4 and 5: the signing change is a protocol version. A request signed with
    QS1 (no audience, no headers) gets E_UNAUTHENTICATED whose message names QS2."""
    cluster: LocalCluster = qcluster_factory(3)
    creds = load_credentials(cluster.credentials_path)
    async with raw_session() as session:
        status, code, body = await send(session, cluster, cluster.urls["n1"], "GET", "/v1/clients", b"",
                                        qs1_headers(creds, "GET", "/v1/clients", b""))
    assert (status, code) == (401, "E_UNAUTHENTICATED")
    assert "QS2" in body.decode(), body


@pytest.mark.parametrize("pattern, queue", [("?", "q"), ("[!a]", "q"), ("[*]", None)])
async def test_a_one_character_pattern_does_not_make_a_cluster_admin(qcluster_factory: Any, pattern: str,
                                                                     queue: str | None) -> None:
    """Issue 32, Low. Cluster-wide privileges were tested as fnmatch("*", pattern): a client
    granted `admin` on one-character queue names (`?`, `[*]`) was a cluster admin (clients,
    nodes). Only a grant of exactly `*` is cluster-wide now; the grant still covers its queues."""
    cluster: LocalCluster = qcluster_factory(3)
    ca_file = load_credentials(cluster.credentials_path).ca_file
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        record = await admin.register_client("narrow", [{"pattern": pattern, "privileges": ["admin"]}])
        creds = Credentials(record["id"], record["private_key"], cluster.urls["n1"], ca_file)
        async with AsyncClient(cluster.urls["n1"], creds) as narrow:
            with pytest.raises(QueueError) as refused:
                await narrow.list_clients()
            assert refused.value.code == "E_FORBIDDEN"
            with pytest.raises(QueueError) as refused:
                await narrow.register_client("mine", [{"pattern": "*", "privileges": ["admin"]}])
            assert refused.value.code == "E_FORBIDDEN"
            if queue is not None:
                await narrow.create_queue(queue)                # its own queues it administers


async def test_one_client_filling_its_nonce_table_does_not_lock_out_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, Low. One table of 2,000,000 nonces served every client: one client signing
    that many requests within the window locked every other out (E_OVERLOADED). Each client has
    its own table now (bounds made small here, against the real Authenticator): the flooder is
    refused, another client is not."""
    monkeypatch.setattr(auth, "NONCES_KEPT_MAX", 50)                    # the old shared table
    monkeypatch.setattr(auth, "NONCES_PER_CLIENT_MAX", 50, raising=False)
    keys = {name: new_private_key() for name in ("flooder", "victim")}
    clients = {name: {"public_key": public_key_text(key), "grants": [{"pattern": "q", "privileges": ["post"]}]}
               for name, key in keys.items()}
    authenticator = Authenticator(clients, skew_max_s=300)
    if hasattr(authenticator, "bind"):
        authenticator.bind("n1", ["http://127.0.0.1:7101"])

    def attempt(name: str) -> str:
        headers = Signer(name, keys[name]).headers("POST", "/v1/queues/q/messages", [], b"x",
                                                   audience="http://127.0.0.1:7101")
        try:
            authenticator.authenticate("POST", "/v1/queues/q/messages", [], {**headers, "Host": "127.0.0.1:7101"},
                                       b"x")
        except QueueError as error:
            return error.code
        return "ok"

    outcomes = [attempt("flooder") for _ in range(60)]
    assert outcomes[:50] == ["ok"] * 50 and set(outcomes[50:]) == {"E_OVERLOADED"}
    assert [attempt("victim") for _ in range(10)] == ["ok"] * 10


async def raw_request(cluster: LocalCluster, url: str, head: bytes) -> bytes:
    """Write one request by hand (what aiohttp would refuse to send) and read the answer."""
    host, port = host_of(url).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=cluster.ssl_context)
    writer.write(head)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def test_malformed_signing_headers_answer_4xx_with_a_code_never_500(qcluster_factory: Any) -> None:
    """Issue 32, Low. Unauthenticated requests made the node answer 500 with a traceback in its
    log: a timestamp of thousands of digits (int() refuses over 4,300), a nonce or client id
    that is not UTF-8 (the canonical string could not be encoded). Each answers 4xx with an
    E_ code now, and so do the other malformations tried here."""
    cluster: LocalCluster = qcluster_factory(3)
    creds = load_credentials(cluster.credentials_path)
    url = cluster.urls["n1"]
    now = str(int(time.time() * 1000))
    good = Signer(creds.client_id, private_key_from_text(creds.private_key_text)).headers(
        "GET", "/v1/queues", [], b"", audience=url)
    cases: list[dict[str, str]] = [
        {**good, "X-Timestamp": "9" * 5000},
        {**good, "X-Timestamp": "１２３"},
        {**good, "X-Signature": "QS2:not base64!"},
        {**good, "X-Signature": "QS2:" + "A" * 300},
        {**good, "X-Signature": "QD2:zz"},
        {**good, "X-Signature": "QR1:zz"},
        {**good, "X-Client-Id": "c" * 7000},
        {**good, "X-Nonce": "n" * 65},
        {**good, "Host": "x://[::"},
        {**good, "Host": ""},
        {"X-Client-Id": creds.client_id, "X-Timestamp": now},
    ]
    async with raw_session() as session:
        for headers in cases:
            status, code, body = await send(session, cluster, url, "GET", "/v1/queues", b"", headers)
            assert 400 <= status < 500 and code.startswith("E_"), (status, code, body[:200], list(headers.items())[:4])
    # Bytes aiohttp will not send: a nonce and a client id that are not UTF-8, a huge header.
    lines = "".join(f"{k}: {v}\r\n" for k, v in good.items() if k not in ("X-Nonce",)).encode()
    heads = [
        b"GET /v1/queues HTTP/1.1\r\nHost: " + host_of(url).encode() + b"\r\n" + lines
        + b"X-Nonce: \xff\xfe\r\nConnection: close\r\n\r\n",
        b"GET /v1/queues HTTP/1.1\r\nHost: " + host_of(url).encode() + b"\r\nX-Client-Id: \xff\r\nX-Timestamp: "
        + now.encode() + b"\r\nX-Nonce: ab\r\nX-Signature: QS2:AAAA\r\nConnection: close\r\n\r\n",
        b"GET /v1/queues HTTP/1.1\r\nHost: " + host_of(url).encode() + b"\r\nX-Signature: " + b"A" * 20000
        + b"\r\nConnection: close\r\n\r\n",
    ]
    for head in heads:
        answer = await raw_request(cluster, url, head)
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500 and b'"code": "E_' in answer, answer[:300]
    async with AsyncClient(url, cluster.credentials_path) as admin:      # the node is fine
        await admin.create_queue("after")
