"""Bad input never costs data (docs/ARCHITECTURE.md, Guarantee 7): every malformed request, unknown name,
oversized body, bad signature or missing grant gets a stable E_* code, and afterwards the
stored messages and other clients' connections are exactly as they were."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import msgpack
import pytest
import pytest_asyncio
from yarl import URL

from tests.support import RawApi, error_code, raw_session
from wire.protocol import (
    AckOp,
    Closing,
    EnqueueBatchOp,
    EnqueueOp,
    ErrorReply,
    OkReply,
    PingOp,
    ReceiveOp,
    decode_server_frame,
    encode_frame,
)
from wire.signing import Signer, private_key_from_text

pytestmark = pytest.mark.asyncio
BODY_LIMIT = 1 << 20


@pytest_asyncio.fixture
async def api(qnode):  # type: ignore[no-untyped-def]
    async with raw_session() as session:
        admin = RawApi.for_credentials(session, qnode.credentials_path)
        await admin.request("PUT", "/v1/queues/keep", {})
        for n in range(3):
            await admin.request("POST", "/v1/queues/keep/messages", f"kept-{n}".encode())
        yield admin
        # The guarantee every test here checks: the stored messages are untouched.
        _, stats, _ = await admin.request("GET", "/v1/queues/keep")
        assert stats["depth"] == 3 and stats["total_enqueued"] == 3


async def client_with(api: RawApi, grants: list[dict[str, Any]]) -> RawApi:
    status, body, _ = await api.request("POST", "/v1/clients", {"name": f"c{time.monotonic_ns()}", "grants": grants})
    assert status == 201, body
    return RawApi(api.session, api.url, Signer(body["id"], private_key_from_text(body["private_key"])))


async def ws_exchange(ws: aiohttp.ClientWebSocketResponse, frame: bytes, *, text: bool = False) -> list[Any]:
    if text:
        await ws.send_str(frame.decode(errors="replace"))
    else:
        await ws.send_bytes(frame)
    message = await asyncio.wait_for(ws.receive(), 5)
    assert message.type == aiohttp.WSMsgType.BINARY, message
    return decode_server_frame(message.data)


@pytest.mark.parametrize("raw", [
    b"GET /v1/queues/" + b"q" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",          # request line over the limit
    b"GET /v1/queues HTTP/1.1\r\nHost: x\r\nX-Dedupe-Id: " + b"d" * 10_000 + b"\r\n\r\n",  # a header over it
    b"NOT HTTP AT ALL\r\n\r\n",
    b"POST /v1/queues/keep/messages HTTP/1.1\r\nHost: x\r\nContent-Length: nine\r\n\r\n",
], ids=["long-request-line", "long-header", "not-http", "bad-content-length"])
async def test_what_aiohttp_refuses_before_any_handler_is_answered_with_the_envelope(api: RawApi, raw: bytes) -> None:
    url = URL(api.url)
    reader, writer = await asyncio.open_connection(url.host, url.port, ssl=url.scheme == "https" or None)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)        # the server closes after it
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.split(b" ", 2)[1] == b"400" and b"application/json" in head, head
    assert json.loads(body)["error"]["code"] == "E_BAD_REQUEST" and b"X-Error-Code: E_BAD_REQUEST" in head


@pytest.mark.parametrize("body, code", [
    (b"{not json", "E_BAD_JSON"),
    (b'{"max_depth": "ten"}', "E_INVALID_OPTION"),
    (b'{"max_depth": 0}', "E_INVALID_OPTION"),
    (b'{"max_depth": true}', "E_INVALID_OPTION"),
    (b'{"strength": "strong"}', "E_INVALID_OPTION"),
    (b'{"colour": "blue"}', "E_INVALID_OPTION"),
    (b'[1, 2]', "E_INVALID_OPTION"),
])
async def test_a_malformed_queue_definition_is_refused_with_its_code(api: RawApi, body: bytes, code: str) -> None:
    status, answer, _ = await api.request("PUT", "/v1/queues/newq", body)
    assert status == 400 and error_code(answer) == code
    assert answer["error"]["retriable"] is False and answer["error"]["outcome_unknown"] is False
    assert (await api.request("GET", "/v1/queues/newq"))[0] == 404


@pytest.mark.parametrize("path", ["/v1/queues/a%2Fb", "/v1/queues/" + "x" * 201, "/v1/queues/bad%01name",
                                  "/v1/queues/.hidden", "/v1/queues/sp%20ace"])
async def test_an_invalid_queue_name_is_refused(api: RawApi, path: str) -> None:
    for method, suffix in (("PUT", ""), ("POST", "/messages"), ("POST", "/receive")):
        status, answer, _ = await api.request(method, path + suffix, b"{}" if method == "PUT" else b"x")
        assert status in (400, 404), (method, path, answer)
        assert error_code(answer) in ("E_INVALID_NAME", "E_NOT_FOUND")
    status, answer, _ = await api.request("PUT", path, b"{}")
    assert error_code(answer) in ("E_INVALID_NAME", "E_NOT_FOUND")


async def test_an_empty_queue_name_is_refused(api: RawApi) -> None:
    status, answer, _ = await api.request("PUT", "/v1/queues/", b"{}")
    assert status == 400 and error_code(answer) == "E_INVALID_NAME"


async def test_operations_on_an_unknown_queue_name_it(api: RawApi) -> None:
    for method, path in (("POST", "/v1/queues/ghost/messages"), ("POST", "/v1/queues/ghost/receive"),
                         ("GET", "/v1/queues/ghost"), ("DELETE", "/v1/queues/ghost"),
                         ("DELETE", "/v1/queues/ghost/messages/1")):
        status, answer, _ = await api.request(method, path, b"x", query={"receipt": "r"} if "messages/1" in path else None)
        assert status == 404 and error_code(answer) == "E_UNKNOWN_QUEUE", (method, path, answer)


async def test_an_oversized_body_is_refused_before_it_is_stored(api: RawApi) -> None:
    status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x" * (BODY_LIMIT + 1))
    assert status == 413 and error_code(answer) == "E_PAYLOAD_TOO_LARGE"


@pytest.mark.parametrize("headers, query, code", [
    ({"X-Priority": "10"}, None, "E_INVALID_OPTION"),
    ({"X-Priority": "high"}, None, "E_INVALID_OPTION"),
    ({"X-Dedupe-Id": "d" * 129}, None, "E_INVALID_OPTION"),
])
async def test_bad_enqueue_headers_are_refused(api: RawApi, headers: dict[str, str], query: Any, code: str) -> None:
    status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x", headers=headers)
    assert status == 400 and error_code(answer) == code


async def test_a_dedupe_id_that_is_not_utf8_is_refused(api: RawApi) -> None:
    # aiohttp clients cannot send such a header, so write the request by hand.
    assert api.signer is not None
    path, body = "/v1/queues/keep/messages", b"odd"
    # Signed as the node reads the header (UTF-8 with surrogate escapes), so the handler sees it.
    signed = api.signer.headers("POST", path, {}, body, audience=api.url, headers={"X-Dedupe-Id": "order-\udcff"})
    url = URL(api.url)
    reader, writer = await asyncio.open_connection(url.host, url.port, ssl=url.scheme == "https" or None)
    head = "".join(f"{k}: {v}\r\n" for k, v in signed.items()).encode()
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + f"{url.host}:{url.port}".encode() + b"\r\n" + head
                 + b"X-Dedupe-Id: order-\xff\r\nContent-Length: 3\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 400") and b"E_INVALID_OPTION" in answer, answer[:200]


@pytest.mark.parametrize("path, query, code", [
    ("/v1/queues/keep/receive", {"wait_s": "soon"}, "E_INVALID_OPTION"),
    ("/v1/queues/keep/receive", {"wait_s": "-1"}, "E_INVALID_OPTION"),
    ("/v1/queues/keep/receive", {"visibility_timeout_s": "nan"}, "E_INVALID_OPTION"),
    ("/v1/queues/keep/messages/abc/release", {"receipt": "r"}, "E_INVALID_OPTION"),
    ("/v1/queues/keep/messages/1/release", None, "E_BAD_REQUEST"),
])
async def test_bad_parameters_are_refused(api: RawApi, path: str, query: Any, code: str) -> None:
    status, answer, _ = await api.request("POST", path, b"", query=query)
    assert status == 400 and error_code(answer) == code, answer


async def test_an_unsigned_request_is_refused(api: RawApi) -> None:
    status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x", sign=False)
    assert status == 401 and error_code(answer) == "E_UNAUTHENTICATED"


async def test_a_signature_over_another_body_is_refused(api: RawApi) -> None:
    assert api.signer is not None
    headers = api.signer.headers("POST", "/v1/queues/keep/messages", {}, b"original", audience=api.url)
    status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"tampered", signed_headers=headers)
    assert status == 401 and error_code(answer) == "E_UNAUTHENTICATED"


async def test_a_signature_by_an_unknown_client_is_refused(api: RawApi) -> None:
    from wire.signing import new_private_key
    stranger = RawApi(api.session, api.url, Signer("c-nobody", new_private_key()))
    status, answer, _ = await stranger.request("GET", "/v1/queues")
    assert status == 401 and error_code(answer) == "E_UNAUTHENTICATED"


async def test_a_stale_timestamp_is_refused(api: RawApi) -> None:
    assert api.signer is not None
    old = api.signer.headers("GET", "/v1/queues", {}, b"", timestamp_ms=int(time.time() * 1000) - 3_600_000, audience=api.url)
    status, answer, _ = await api.request("GET", "/v1/queues", signed_headers=old)
    assert status == 401 and error_code(answer) == "E_STALE_REQUEST"


async def test_a_replayed_request_is_refused_and_not_applied_twice(api: RawApi) -> None:
    assert api.signer is not None
    await api.request("PUT", "/v1/queues/replayed", {})
    headers = api.signer.headers("POST", "/v1/queues/replayed/messages", {}, b"once", audience=api.url)
    status, _, _ = await api.request("POST", "/v1/queues/replayed/messages", b"once", signed_headers=headers)
    assert status == 201
    status, answer, _ = await api.request("POST", "/v1/queues/replayed/messages", b"once", signed_headers=headers)
    assert status == 401 and error_code(answer) == "E_REPLAYED_REQUEST"
    _, stats, _ = await api.request("GET", "/v1/queues/replayed")
    assert stats["depth"] == 1


@pytest.mark.parametrize("restart", ["sigterm", "sigkill"])
async def test_a_request_replayed_after_the_node_restarts_is_refused_and_not_applied(
        api: RawApi, qnode: Any, restart: str) -> None:
    """An orderly stop keeps the replay window's nonces for the next start; after a crash the
    node refuses whatever was signed before it started. A fresh request passes either way."""
    assert api.signer is not None
    await api.request("PUT", "/v1/queues/replayed", {})
    headers = api.signer.headers("POST", "/v1/queues/replayed/messages", {}, b"once", audience=api.url)
    status, _, _ = await api.request("POST", "/v1/queues/replayed/messages", b"once", signed_headers=headers)
    assert status == 201
    if restart == "sigterm":
        assert await asyncio.to_thread(qnode.stop) == 0
    else:
        await asyncio.to_thread(qnode.kill)
    await asyncio.to_thread(qnode.start)
    status, answer, _ = await api.request("POST", "/v1/queues/replayed/messages", b"once", signed_headers=headers)
    expected = "E_REPLAYED_REQUEST" if restart == "sigterm" else "E_STALE_REQUEST"
    assert status == 401 and error_code(answer) == expected
    status, _, _ = await api.request("POST", "/v1/queues/replayed/messages", b"fresh")
    assert status == 201
    _, stats, _ = await api.request("GET", "/v1/queues/replayed")
    assert stats["depth"] == 2


async def test_a_client_without_the_grant_is_forbidden_and_changes_nothing(api: RawApi) -> None:
    producer = await client_with(api, [{"pattern": "keep", "privileges": ["post"]}])
    status, answer, _ = await producer.request("POST", "/v1/queues/keep/receive")
    assert status == 403 and error_code(answer) == "E_FORBIDDEN"
    status, answer, _ = await producer.request("DELETE", "/v1/queues/keep")
    assert status == 403 and error_code(answer) == "E_FORBIDDEN"
    status, answer, _ = await producer.request("POST", "/v1/queues/other/messages", b"x")
    assert status == 403 and error_code(answer) == "E_FORBIDDEN"
    status, answer, _ = await producer.request("POST", "/v1/clients", {"name": "sneaky", "grants": []})
    assert status == 403 and error_code(answer) == "E_FORBIDDEN"


@pytest.mark.parametrize("body", [{"name": "x", "grants": [{"pattern": "*", "privileges": ["root"]}]},
                                  {"name": "x", "grants": "all"}, {"name": "bad/name", "grants": []},
                                  {"name": "x", "public_key": "not-a-key", "grants": []}])
async def test_a_malformed_client_registration_is_refused(api: RawApi, body: dict[str, Any]) -> None:
    status, answer, _ = await api.request("POST", "/v1/clients", body)
    assert status == 400 and error_code(answer) in ("E_INVALID_OPTION", "E_INVALID_NAME")


async def test_garbage_on_the_websocket_gets_e_bad_frame_and_the_socket_keeps_working(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/scratch", {})
    bystander = await api.ws()
    ws = await api.ws()
    try:
        for garbage in (b"\xc1\xff\x00", msgpack.packb({"not": "a frame"}), msgpack.packb([99, []]),
                        msgpack.packb([1, "items"]), b""):
            [item] = await ws_exchange(ws, garbage)
            assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME" and item.request_id == 0
        [item] = await ws_exchange(ws, b"text frame", text=True)
        assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME"
        mixed = msgpack.packb([1, [[1, 7, "keep", "not-bytes", 4, None], [8, 8], [42, 9]]])
        items = await ws_exchange(ws, mixed)
        by_id = {i.request_id: i for i in items}
        assert isinstance(by_id[7], ErrorReply) and by_id[7].code == "E_BAD_FRAME"
        assert isinstance(by_id[8], OkReply)
        assert isinstance(by_id[9], ErrorReply) and by_id[9].code == "E_BAD_FRAME"
        oversized = encode_frame([EnqueueOp(10, "keep", b"x" * (BODY_LIMIT + 1), 4, None)])
        [item] = await ws_exchange(ws, oversized)
        assert isinstance(item, ErrorReply) and item.code == "E_PAYLOAD_TOO_LARGE"
        batch = EnqueueBatchOp(13, "scratch", 4, (b"ok", b"x" * (BODY_LIMIT + 1), b"ok"), (None, None, "\x00bad"))
        [item] = await ws_exchange(ws, encode_frame([batch]))
        _, outcomes = item.result
        assert type(outcomes[0]) is int and outcomes[1][0] == "E_PAYLOAD_TOO_LARGE" and outcomes[2][0] == "E_INVALID_OPTION"
        [item] = await ws_exchange(ws, encode_frame([AckOp(11, "keep", 999, "nope")]))
        assert isinstance(item, ErrorReply) and item.code == "E_UNKNOWN_MESSAGE"
        [item] = await ws_exchange(ws, encode_frame([EnqueueOp(12, "no/such", b"x", 4, None)]))
        assert isinstance(item, ErrorReply) and item.code == "E_INVALID_NAME"
        [item] = await ws_exchange(bystander, encode_frame([PingOp(1)]))
        assert isinstance(item, OkReply)
    finally:
        await ws.close()
        await bystander.close()


async def test_a_bad_time_to_live_or_delay_is_refused_and_stores_nothing(api: RawApi) -> None:
    for ttl in ("0", "-1", "abc", "nan", "1209601"):
        status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x", query={"ttl_s": ttl})
        assert status == 400 and error_code(answer) == "E_INVALID_OPTION", ttl
    for delay in ("-1", "901", "soon", "inf"):
        status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x", query={"delay_s": delay})
        assert status == 400 and error_code(answer) == "E_INVALID_OPTION", delay
    for ttl in (-1, "60", True, 1_209_601):
        status, answer, _ = await api.request("PUT", "/v1/queues/timed", {"message_ttl_s": ttl})
        assert status == 400 and error_code(answer) == "E_INVALID_OPTION", ttl
    ws = await api.ws()
    try:
        for request_id, ttl_ms in ((1, -5), (2, "1000"), (3, 1_209_600_001)):
            [item] = await ws_exchange(ws, msgpack.packb([1, [[1, request_id, "keep", b"x", 4, None, ttl_ms]]]))
            assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME" and item.request_id == request_id
            [item] = await ws_exchange(ws, msgpack.packb([1, [[9, request_id, "keep", 4, [b"x"], None, ttl_ms]]]))
            assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME"
        for request_id, delay_ms in ((4, -1), (5, 900_001), (6, 1.5)):
            [item] = await ws_exchange(ws, msgpack.packb([1, [[1, request_id, "keep", b"x", 4, None, 0, delay_ms]]]))
            assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME" and item.request_id == request_id
    finally:
        await ws.close()
    status, stats, _ = await api.request("GET", "/v1/queues/keep")
    assert status == 200 and stats["depth"] == 3 and stats["total_expired"] == 0


async def test_bad_headers_are_refused_with_a_clear_code_and_store_nothing(api: RawApi) -> None:
    for raw in ("not json", '["a"]', '{"n": 1}', '{"' + "x" * 65 + '": "v"}'):
        status, answer, _ = await api.request("POST", "/v1/queues/keep/messages", b"x", headers={"X-Headers": raw})
        assert status == 400 and error_code(answer) == "E_INVALID_OPTION", raw
    ws = await api.ws()
    try:
        [item] = await ws_exchange(ws, msgpack.packb([1, [[1, 1, "keep", b"x", 4, None, 0, 0, ["n", "v"]]]]))
        assert isinstance(item, ErrorReply) and item.code == "E_BAD_FRAME"
        [item] = await ws_exchange(ws, msgpack.packb([1, [[1, 2, "keep", b"x", 4, None, 0, 0, {"n": 5}]]]))
        assert isinstance(item, ErrorReply) and item.code == "E_INVALID_OPTION"
        [item] = await ws_exchange(ws, msgpack.packb([1, [[9, 3, "keep", 4, [b"x"], None, 0, 0, {"": "v"}]]]))
        assert isinstance(item, ErrorReply) and item.code == "E_INVALID_OPTION"
    finally:
        await ws.close()
    status, stats, _ = await api.request("GET", "/v1/queues/keep")
    assert status == 200 and stats["depth"] == 3


async def test_removing_a_client_closes_its_websocket(api: RawApi) -> None:
    consumer = await client_with(api, [{"pattern": "keep", "privileges": ["get"]}])
    ws = await consumer.ws()
    [item] = await ws_exchange(ws, encode_frame([ReceiveOp(1, "keep", 1, 0, 60_000)]))
    assert isinstance(item, OkReply) and len(item.result) == 1
    # Give the lease back so the fixture's queue holds its three messages unleased.
    row = item.result[0]
    await ws_exchange(ws, encode_frame([__import__("wire.protocol").protocol.ReleaseOp(2, "keep", row[0], row[1])]))
    status, _, _ = await api.request("DELETE", f"/v1/clients/{consumer.signer.client_id}")  # type: ignore[union-attr]
    assert status == 200
    message = await asyncio.wait_for(ws.receive(), 5)
    assert message.type == aiohttp.WSMsgType.BINARY
    [closing] = decode_server_frame(message.data)
    assert isinstance(closing, Closing) and closing.code == "E_UNAUTHENTICATED"
    assert (await asyncio.wait_for(ws.receive(), 5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    status, answer, _ = await consumer.request("GET", "/v1/queues")
    assert status == 401


async def test_revoking_a_grant_closes_the_clients_websocket(api: RawApi) -> None:
    worker = await client_with(api, [{"pattern": "keep", "privileges": ["get", "post"]}])
    ws = await worker.ws()
    [item] = await ws_exchange(ws, encode_frame([PingOp(1)]))
    assert isinstance(item, OkReply)
    client_id = worker.signer.client_id  # type: ignore[union-attr]
    status, _, _ = await api.request("PUT", f"/v1/clients/{client_id}/grants",
                                     {"grants": [{"pattern": "keep", "privileges": ["post"]}]})
    assert status == 200
    [closing] = decode_server_frame((await asyncio.wait_for(ws.receive(), 5)).data)
    assert isinstance(closing, Closing) and closing.code == "E_FORBIDDEN"
    await ws.close()
