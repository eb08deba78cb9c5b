"""Unit tests of the client library and qctl that need no qserver.

The WebSocket and REST behaviour is checked against `FakeNode`, a small aiohttp server in
this file that verifies signatures with wire/signing.py and speaks the frame protocol
with wire/protocol.py, so coalescing, reconnects, dedupe-id retries, subscriptions and
credit can be observed frame by frame, including failures a real server rarely shows.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import WSMsgType, web

from client import AsyncClient, Client, Credentials, QueueError, load_credentials, save_credentials
from client.credentials import ENV_CREDENTIALS
from client.http import HttpClient, queue_path
from client.qctl import build_parser, main, parse_grant
from client.qctl_render import format_fields, format_table
from wire.protocol import (
    AckBatchOp,
    Closing,
    CreditOp,
    DeliveredMessage,
    Delivery,
    EnqueueBatchOp,
    ErrorReply,
    ExtendOp,
    OkReply,
    ReceiveOp,
    ReleaseOp,
    SubscribeOp,
    UnsubscribeOp,
    decode_client_frame,
    encode_frame,
)
from wire.signing import (
    HEADER_CLIENT,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    audience_of,
    canonical_string,
    new_private_key,
    private_key_to_text,
    verify,
)

FAST = {"reconnect_delay_initial_s": 0.01, "reconnect_delay_max_s": 0.05}


# --- a fake node --------------------------------------------------------------------------------
class FakeNode:
    """Verifies every signature, answers WebSocket frames and canned REST routes, and records
    what it got. Switches let a test lose a frame's answers or send a Closing item."""

    def __init__(self) -> None:
        key = new_private_key()
        self.credentials = Credentials("c-test", private_key_to_text(key), "")
        self._public_key = key.public_key()
        self.frames: list[list[Any]] = []
        self.rest_requests: list[dict[str, Any]] = []
        self.rest_answers: dict[tuple[str, str], tuple[int, Any]] = {}
        self.stored_by_dedupe: dict[str, int] = {}
        self.ready: list[DeliveredMessage] = []
        self.credit_given: list[int] = []
        self.acked: list[int] = []
        self.connections = 0
        self.drop_next_frame_unanswered = False
        self.hold_receives = False
        self.hold_extends = False
        self.unknown_after_ack = False   # an ack of a message acked before answers E_UNKNOWN_MESSAGE
        self.ack_refusals: list[str] = []                # codes the next ack batches answer
        self.subscribe_refusals: list[str | None] = []   # codes the next subscribes answer (None: no answer)
        self.closing_on_next_frame: Closing | None = None
        self.not_master_answers = 0      # the next enqueue batches or receives answer E_NOT_MASTER, outcome unknown
        self._sockets: set[web.WebSocketResponse] = set()
        self._subscriptions: dict[int, int] = {}  # subscription id -> credit left
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/ws", self._websocket)
        app.router.add_route("*", "/{tail:.*}", self._rest)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self.credentials = Credentials(self.credentials.client_id, self.credentials.private_key_text, self.url)

    async def stop(self) -> None:
        await self.drop_connections()
        if self._runner is not None:
            await self._runner.cleanup()

    async def drop_connections(self) -> None:
        for ws in list(self._sockets):
            await ws.close()

    def signature_ok(self, request: web.Request, body: bytes) -> bool:
        headers = request.headers
        if any(h not in headers for h in (HEADER_CLIENT, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)):
            return False
        text = canonical_string(request.method, request.raw_path.split("?", 1)[0],
                                request.rel_url.query.items(), int(headers[HEADER_TIMESTAMP]),
                                headers[HEADER_NONCE], body, client_id=headers[HEADER_CLIENT],
                                audience=audience_of(request.host), headers=headers)
        return headers[HEADER_CLIENT] == self.credentials.client_id and \
            verify(self._public_key, headers[HEADER_SIGNATURE].removeprefix("QS2:"), text)

    async def _rest(self, request: web.Request) -> web.Response:
        body = await request.read()
        path = request.raw_path.split("?", 1)[0]
        self.rest_requests.append({"method": request.method, "path": path, "body": body,
                                   "query": dict(request.rel_url.query), "query_items": list(request.rel_url.query.items()),
                                   "headers": dict(request.headers)})
        if not self.signature_ok(request, body):
            return web.json_response(QueueError("E_UNAUTHENTICATED").envelope(), status=401)
        status, document = self.rest_answers.get((request.method, path), (404, QueueError("E_NOT_FOUND").envelope()))
        return web.json_response(document, status=status)

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        if not self.signature_ok(request, b""):
            return web.json_response(QueueError("E_UNAUTHENTICATED").envelope(), status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self._sockets.add(ws)
        try:
            async for message in ws:
                if message.type is WSMsgType.BINARY:
                    await self._answer(ws, message.data)
        finally:
            self._sockets.discard(ws)
        return ws

    async def _answer(self, ws: web.WebSocketResponse, data: bytes) -> None:
        ops = decode_client_frame(data)
        self.frames.append(ops)
        replies: list[Any] = []
        for op in ops:
            replies.extend(self._apply(op))
        if self.closing_on_next_frame is not None:
            closing, self.closing_on_next_frame = self.closing_on_next_frame, None
            await ws.send_bytes(encode_frame([closing]))
            await ws.close()
            return
        if self.drop_next_frame_unanswered:
            self.drop_next_frame_unanswered = False
            await ws.close()
            return
        if replies:
            await ws.send_bytes(encode_frame(replies))

    def _apply(self, op: Any) -> list[Any]:
        if isinstance(op, EnqueueBatchOp):
            if op.queue == "forbidden":
                return [ErrorReply(op.request_id, "E_FORBIDDEN", "no post on forbidden", False)]
            if self.not_master_answers:
                self.not_master_answers -= 1
                return [ErrorReply(op.request_id, "E_NOT_MASTER", "this member became the master", True)]
            outcomes: list[Any] = []
            for payload, dedupe_id in zip(op.payloads, op.dedupe_ids or [None] * len(op.payloads), strict=True):
                if payload == b"refuse":
                    outcomes.append(["E_QUEUE_FULL", "full"])
                else:
                    outcomes.append(self.stored_by_dedupe.setdefault(dedupe_id or "", len(self.stored_by_dedupe) + 1))
            return [OkReply(op.request_id, [1, outcomes])]
        if isinstance(op, AckBatchOp) and self.ack_refusals:
            return [ErrorReply(op.request_id, self.ack_refusals.pop(0), "refused by the fake node", False)]
        if isinstance(op, AckBatchOp):
            outcomes = [["E_UNKNOWN_MESSAGE", "no such message"] if self.unknown_after_ack and message_id in self.acked
                        else None for message_id, _ in op.items]
            self.acked.extend(message_id for message_id, _ in op.items)
            return [OkReply(op.request_id, outcomes)]
        if isinstance(op, ExtendOp) and self.hold_extends:
            return []
        if isinstance(op, ReceiveOp):
            if self.not_master_answers:
                self.not_master_answers -= 1
                return [ErrorReply(op.request_id, "E_NOT_MASTER", "this member became the master", True)]
            if self.hold_receives:
                return []
            taken, self.ready = self.ready[:op.max_messages], self.ready[op.max_messages:]
            return [OkReply(op.request_id, taken)]
        if isinstance(op, SubscribeOp):
            if self.subscribe_refusals:
                code = self.subscribe_refusals.pop(0)
                return [] if code is None else [ErrorReply(op.request_id, code, "refused by the fake node", False)]
            subscription_id = len(self._subscriptions) + 1
            self._subscriptions[subscription_id] = op.credit
            self.credit_given.append(op.credit)
            return [OkReply(op.request_id, subscription_id), *self._push(subscription_id)]
        if isinstance(op, CreditOp):
            self._subscriptions[op.subscription_id] += op.credit
            self.credit_given.append(op.credit)
            return [OkReply(op.request_id, None), *self._push(op.subscription_id)]
        if isinstance(op, UnsubscribeOp):
            self._subscriptions.pop(op.subscription_id, None)
        return [OkReply(op.request_id, None)]

    def _push(self, subscription_id: int) -> list[Any]:
        credit = self._subscriptions[subscription_id]
        taken, self.ready = self.ready[:credit], self.ready[credit:]
        self._subscriptions[subscription_id] = credit - len(taken)
        return [Delivery(subscription_id, tuple(taken))] if taken else []

    def ops_of(self, kind: type) -> list[Any]:
        return [op for frame in self.frames for op in frame if isinstance(op, kind)]


def ready_messages(count: int) -> list[DeliveredMessage]:
    return [DeliveredMessage(i, f"r{i}", 4, 1, f"m{i}".encode()) for i in range(1, count + 1)]


@pytest_asyncio.fixture
async def fake_node() -> AsyncIterator[FakeNode]:
    node = FakeNode()
    await node.start()
    yield node
    await node.stop()


@pytest_asyncio.fixture
async def client(fake_node: FakeNode) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(credentials=fake_node.credentials, **FAST) as connected:  # type: ignore[arg-type]
        yield connected


async def eventually(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


# --- credentials --------------------------------------------------------------------------------
def test_saved_credentials_load_back_identically_and_are_private_to_the_owner(tmp_path: Path) -> None:
    creds = Credentials("c-1", private_key_to_text(new_private_key()), "http://127.0.0.1:7100")
    path = tmp_path / "deep" / "credentials.json"
    save_credentials(path, creds)
    assert load_credentials(path) == creds
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"client_id": "c-1", "private_key": creds.private_key_text,
                                            "url": "http://127.0.0.1:7100"}


def test_saving_over_a_world_readable_file_leaves_it_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text("{}")
    path.chmod(0o644)
    save_credentials(str(path), Credentials("c-2", private_key_to_text(new_private_key())))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials(path).client_id == "c-2"


def _write(path: Path, client_id: str) -> None:
    save_credentials(path, Credentials(client_id, private_key_to_text(new_private_key())))


@pytest.fixture
def credential_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home directory, a working directory and an env file, each holding a different id."""
    home, work = tmp_path / "home", tmp_path / "work"
    places = {"explicit": tmp_path / "explicit.json", "env": tmp_path / "env.json",
              "local": work / ".qserver" / "credentials.json",
              "user": home / ".config" / "qserver" / "credentials.json"}
    for name, path in places.items():
        _write(path, name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setenv(ENV_CREDENTIALS, str(places["env"]))
    return places


def test_credentials_are_searched_explicit_then_env_then_local_then_user(
        credential_places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_credentials(credential_places["explicit"]).client_id == "explicit"
    assert load_credentials().client_id == "env"
    monkeypatch.delenv(ENV_CREDENTIALS)
    assert load_credentials().client_id == "local"
    credential_places["local"].unlink()
    assert load_credentials().client_id == "user"
    credential_places["user"].unlink()
    with pytest.raises(QueueError) as caught:
        load_credentials()
    assert caught.value.code == "E_UNAUTHENTICATED" and "looked in" in caught.value.message


def test_a_missing_explicit_or_env_file_is_an_error_rather_than_another_identity(
        credential_places: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(QueueError, match="no credentials file"):
        load_credentials(tmp_path / "absent.json")
    monkeypatch.setenv(ENV_CREDENTIALS, str(tmp_path / "absent.json"))
    with pytest.raises(QueueError, match="no credentials file"):
        load_credentials()


@pytest.mark.parametrize("content", ["not json", "[]", '{"client_id": "x"}',
                                     '{"client_id": "x", "private_key": "AAAA"}'])
def test_a_malformed_credentials_file_is_refused_with_a_clear_code(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(QueueError) as caught:
        load_credentials(path)
    assert caught.value.code == "E_UNAUTHENTICATED" and str(path) in caught.value.message


# --- REST -------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_rest_requests_are_signed_over_the_encoded_path_query_and_body(fake_node: FakeNode) -> None:
    name = "odd name/with+slash"
    path = queue_path(name, "messages", 7)
    fake_node.rest_answers[("DELETE", path)] = (200, {"acked": 7})
    fake_node.rest_answers[("PUT", queue_path(name))] = (201, {"name": name, "strength": "full"})
    async with HttpClient(fake_node.url, fake_node.credentials.signer()) as http:
        await http.ack_http(name, 7, "receipt+with/odd=chars")
        created = await http.create_queue(name, strength="full", max_depth=None)
    assert created == {"name": name, "strength": "full"}
    ack, create = fake_node.rest_requests
    assert ack["path"] == "/v1/queues/odd%20name%2Fwith%2Bslash/messages/7"
    assert ack["query"] == {"receipt": "receipt+with/odd=chars"}
    assert json.loads(create["body"]) == {"strength": "full"}  # None options are not sent


@pytest.mark.asyncio
async def test_a_non_2xx_answer_raises_the_servers_error_with_its_traits(fake_node: FakeNode) -> None:
    envelope = QueueError("E_OPTIONS_MISMATCH", "max_depth differs").envelope()
    fake_node.rest_answers[("PUT", "/v1/queues/orders")] = (409, envelope)
    async with HttpClient(fake_node.url, fake_node.credentials.signer()) as http:
        with pytest.raises(QueueError) as caught:
            await http.create_queue("orders", max_depth=5)
        assert (caught.value.code, caught.value.message) == ("E_OPTIONS_MISMATCH", "max_depth differs")
        with pytest.raises(QueueError) as missing:
            await http.queue_stats("nowhere")
        assert missing.value.code == "E_NOT_FOUND"


@pytest.mark.asyncio
async def test_a_create_the_cluster_cannot_place_yet_is_asked_again_until_the_request_timeout(
        fake_node: FakeNode) -> None:
    unplaceable = QueueError("E_QUEUE_UNAVAILABLE", "no two live nodes for orders").envelope()
    fake_node.rest_answers[("PUT", "/v1/queues/orders")] = (503, unplaceable)

    async def node_back() -> None:
        await asyncio.sleep(0.3)
        fake_node.rest_answers[("PUT", "/v1/queues/orders")] = (201, {"name": "orders", "created": True})
    async with HttpClient(fake_node.url, fake_node.credentials.signer()) as http:
        back = asyncio.create_task(node_back())
        assert (await http.create_queue("orders"))["created"] is True
        await back
    assert len(fake_node.rest_requests) >= 2
    fake_node.rest_answers[("PUT", "/v1/queues/orders")] = (503, unplaceable)
    async with HttpClient(fake_node.url, fake_node.credentials.signer(), request_timeout_s=0.5) as http:
        started = time.monotonic()
        with pytest.raises(QueueError) as caught:
            await http.create_queue("orders")
    assert caught.value.code == "E_QUEUE_UNAVAILABLE" and time.monotonic() - started < 2.0


@pytest.mark.asyncio
async def test_a_wrong_key_is_refused_as_unauthenticated(fake_node: FakeNode) -> None:
    impostor = Credentials(fake_node.credentials.client_id, private_key_to_text(new_private_key()), fake_node.url)
    async with HttpClient(fake_node.url, impostor.signer()) as http:
        with pytest.raises(QueueError) as caught:
            await http.list_queues()
    assert caught.value.code == "E_UNAUTHENTICATED" and not caught.value.retriable


@pytest.mark.asyncio
async def test_an_unreachable_node_is_unavailable_and_retriable(unused_tcp_port: int) -> None:
    creds = Credentials("c", private_key_to_text(new_private_key()))
    async with HttpClient(f"http://127.0.0.1:{unused_tcp_port}", creds.signer()) as http:
        with pytest.raises(QueueError) as caught:
            await http.enqueue_http("orders", b"x")
    assert caught.value.code == "E_UNAVAILABLE" and caught.value.retriable
    assert not caught.value.outcome_unknown  # the connection was refused: nothing was sent


@pytest.mark.asyncio
async def test_receive_http_returns_the_message_from_its_headers(fake_node: FakeNode) -> None:
    async def receive(request: web.Request) -> web.Response:
        return web.Response(body=b"payload", headers={"X-Message-Id": "9", "X-Receipt": "rc",
                                                      "X-Priority": "7", "X-Deliveries": "2"})
    app = web.Application()
    app.router.add_post("/v1/queues/{q}/receive", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with HttpClient(f"http://127.0.0.1:{port}", fake_node.credentials.signer()) as http:
            message = await http.receive_http("orders", wait_s=0.5)
    finally:
        await runner.cleanup()
    assert message == DeliveredMessage(9, "rc", 7, 2, b"payload")


# --- WebSocket: signing, coalescing, answers ---------------------------------------------------
@pytest.mark.asyncio
async def test_the_websocket_upgrade_is_signed_and_a_bad_key_is_fatal(fake_node: FakeNode) -> None:
    async with AsyncClient(credentials=fake_node.credentials) as good:
        await good.ping()
    impostor = Credentials("c-test", private_key_to_text(new_private_key()), fake_node.url)
    bad = AsyncClient(credentials=impostor, **FAST)  # type: ignore[arg-type]
    with pytest.raises(QueueError) as caught:
        await bad.connect()
    assert caught.value.code == "E_UNAUTHENTICATED"
    with pytest.raises(QueueError):
        await bad.enqueue("orders", b"x")  # no endless reconnecting after a fatal answer
    await bad.close()


@pytest.mark.asyncio
async def test_one_hundred_concurrent_enqueues_travel_as_one_batch_in_one_frame(
        fake_node: FakeNode, client: AsyncClient) -> None:
    ids = await asyncio.gather(*(client.enqueue("orders", b"x" * 1024) for _ in range(100)))
    [frame] = fake_node.frames
    [batch] = frame
    assert isinstance(batch, EnqueueBatchOp) and len(batch.payloads) == 100
    assert ids == list(range(1, 101))  # answers map back to callers in order
    assert batch.dedupe_ids is not None and len(set(batch.dedupe_ids)) == 100
    assert all(d is not None and len(d) == 32 for d in batch.dedupe_ids)


@pytest.mark.asyncio
async def test_concurrent_calls_of_one_turn_share_a_frame_with_one_batch_per_queue_and_priority(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(1)
    await asyncio.gather(client.enqueue("a", b"1"), client.enqueue("a", b"2", priority=9),
                         client.enqueue("b", b"3"), client.enqueue("a", b"4"),
                         client.ack("a", 1, "r1"), client.ack("a", 2, "r2"), client.receive("a"))
    # Acks join their batch when called, enqueues when their task first runs: at most two frames.
    assert len(fake_node.frames) <= 2
    frame = [op for sent in fake_node.frames for op in sent]
    batches = {(op.queue, op.priority): op.payloads for op in frame if isinstance(op, EnqueueBatchOp)}
    assert batches == {("a", 4): (b"1", b"4"), ("a", 9): (b"2",), ("b", 4): (b"3",)}
    [acks] = [op for op in frame if isinstance(op, AckBatchOp)]
    assert acks.items == ((1, "r1"), (2, "r2"))
    assert len(fake_node.ops_of(ReceiveOp)) == 1


@pytest.mark.asyncio
async def test_enqueue_many_sends_one_batch_and_returns_ids_in_order(fake_node: FakeNode, client: AsyncClient) -> None:
    ids = await client.enqueue_many("orders", [b"a", b"b", b"c"], priority=7, dedupe_ids=["d1", "d2", "d3"])
    assert ids == [1, 2, 3]
    [[batch]] = fake_node.frames
    assert (batch.payloads, batch.priority, batch.dedupe_ids) == ((b"a", b"b", b"c"), 7, ("d1", "d2", "d3"))


@pytest.mark.asyncio
async def test_batches_and_frames_are_split_at_the_frame_byte_limit(fake_node: FakeNode) -> None:
    async with AsyncClient(credentials=fake_node.credentials, frame_bytes_max=10_000) as small:
        ids = await small.enqueue_many("orders", [b"x" * 4000] * 5)
    assert ids == [1, 2, 3, 4, 5]
    assert [[len(op.payloads) for op in frame] for frame in fake_node.frames] == [[2], [2], [1]]


@pytest.mark.asyncio
async def test_a_refused_item_fails_only_its_own_call(fake_node: FakeNode, client: AsyncClient) -> None:
    results = await asyncio.gather(client.enqueue("orders", b"1"), client.enqueue("orders", b"refuse"),
                                   client.enqueue("orders", b"3"), return_exceptions=True)
    assert isinstance(results[1], QueueError) and results[1].code == "E_QUEUE_FULL"
    assert results[1].retriable and not results[1].outcome_unknown
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert len(fake_node.frames) == 1


@pytest.mark.asyncio
async def test_a_refused_batch_fails_each_of_its_calls_and_nothing_else(fake_node: FakeNode, client: AsyncClient) -> None:
    results = await asyncio.gather(client.enqueue("forbidden", b"1"), client.enqueue("forbidden", b"2"),
                                   client.enqueue("orders", b"3"), return_exceptions=True)
    assert [getattr(r, "code", r) for r in results] == ["E_FORBIDDEN", "E_FORBIDDEN", 1]
    with pytest.raises(QueueError, match="E_FORBIDDEN"):
        await client.enqueue_many("forbidden", [b"x", b"y"])


@pytest.mark.asyncio
async def test_receive_returns_messages_bound_to_the_client_for_ack_and_release(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(2)
    first, second = await client.receive("orders", max_messages=5, wait_s=1.5, visibility_timeout_s=2)
    await asyncio.gather(first.ack(), second.release())
    [receive] = fake_node.ops_of(ReceiveOp)
    assert (receive.max_messages, receive.wait_ms, receive.visibility_ms) == (5, 1500, 2000)
    [ack] = fake_node.ops_of(AckBatchOp)
    assert (ack.queue, ack.items) == ("orders", ((1, "r1"),))
    assert fake_node.ops_of(ReleaseOp)[0].message_id == 2
    assert (first.queue, first.payload, first.deliveries) == ("orders", b"m1", 1)
    assert await client.receive("orders") == []


# --- WebSocket: connection loss ------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_retried_enqueue_after_reconnect_keeps_its_dedupe_id_and_is_stored_once(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.drop_next_frame_unanswered = True  # stored, but the answer is lost
    message_id = await client.enqueue("orders", b"once")
    sent = fake_node.ops_of(EnqueueBatchOp)
    assert len(sent) == 2 and sent[0].dedupe_ids == sent[1].dedupe_ids
    assert fake_node.connections == 2
    assert len(fake_node.stored_by_dedupe) == 1 and message_id == 1


@pytest.mark.asyncio
async def test_other_pending_ops_fail_with_outcome_unknown_when_the_connection_drops(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.hold_extends = True
    waiting = asyncio.ensure_future(client.extend("orders", 1, "r1", 30))
    await eventually(lambda: fake_node.ops_of(ExtendOp))
    await fake_node.drop_connections()
    with pytest.raises(QueueError) as caught:
        await waiting
    assert caught.value.code == "E_UNAVAILABLE" and caught.value.outcome_unknown
    await eventually(lambda: client.connected)
    assert await client.receive("orders") == []  # the client reconnected on its own


@pytest.mark.asyncio
async def test_a_receive_in_flight_when_the_connection_drops_is_asked_again_on_the_next_one(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.hold_receives = True
    waiting = asyncio.ensure_future(client.receive("orders", wait_s=30))
    await eventually(lambda: fake_node.ops_of(ReceiveOp))
    fake_node.hold_receives = False
    fake_node.ready = ready_messages(1)
    await fake_node.drop_connections()
    [message] = await waiting
    assert message.id == 1 and fake_node.connections == 2 and len(fake_node.ops_of(ReceiveOp)) == 2


@pytest.mark.asyncio
async def test_an_ack_in_flight_when_the_connection_drops_is_sent_again_and_a_gone_message_counts_as_acked(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.drop_next_frame_unanswered = True       # applied, but the answer is lost
    fake_node.unknown_after_ack = True                # the repeat finds the message gone
    await client.ack("orders", 7, "r7")
    assert [op.items for op in fake_node.ops_of(AckBatchOp)] == [((7, "r7"),), ((7, "r7"),)]
    assert fake_node.connections == 2


@pytest.mark.asyncio
async def test_enqueues_wait_for_a_node_that_is_down_and_fail_after_their_retry_time(unused_tcp_port: int) -> None:
    creds = Credentials("c", private_key_to_text(new_private_key()), f"http://127.0.0.1:{unused_tcp_port}")
    lonely = AsyncClient(credentials=creds, enqueue_retry_time_s=0.2, request_timeout_s=0.6,
                         **FAST)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(QueueError) as enqueue_error:
        await lonely.enqueue("orders", b"x")
    assert 0.2 <= loop.time() - started < 1.5       # asked again until the call's deadline
    assert enqueue_error.value.code == "E_UNAVAILABLE" and not enqueue_error.value.outcome_unknown
    started = loop.time()
    with pytest.raises(QueueError) as receive_error:
        await lonely.receive("orders")
    assert loop.time() - started < 1.5 and receive_error.value.code == "E_UNAVAILABLE"
    await lonely.close()


def _map_naming(fake_node: FakeNode, other_port: int) -> tuple[int, dict[str, Any]]:
    """This node the master of `ledger` (it has just become it), the other node unreachable."""
    return 200, {"nodes": [{"id": "n1", "url": fake_node.url}, {"id": "n2", "url": f"http://127.0.0.1:{other_port}"}],
                 "queues": {"ledger": {"master": "n1", "replica": "n2", "epoch": 3}}}


@pytest.mark.asyncio
async def test_an_enqueue_forwarded_by_a_replica_that_just_became_the_master_is_retried_there_once(
        fake_node: FakeNode, unused_tcp_port: int) -> None:
    fake_node.rest_answers[("GET", "/v1/cluster")] = _map_naming(fake_node, unused_tcp_port)
    async with AsyncClient(credentials=fake_node.credentials, **FAST) as client:  # type: ignore[arg-type]
        await client.refresh_placement()
        fake_node.not_master_answers = 1
        assert await client.enqueue_many("ledger", [b"a", b"b"], dedupe_ids=["d-a", "d-b"]) == [1, 2]
        fake_node.not_master_answers = 5                 # it says so a while: asked again with backoff
        assert await client.enqueue("ledger", b"c", dedupe_id="d-c") == 3
    assert [op.dedupe_ids for op in fake_node.ops_of(EnqueueBatchOp)] == [
        ("d-a", "d-b"), ("d-a", "d-b")] + [("d-c",)] * 6


@pytest.mark.asyncio
async def test_an_enqueue_refused_until_its_deadline_fails_with_the_latest_error(
        fake_node: FakeNode, unused_tcp_port: int) -> None:
    fake_node.rest_answers[("GET", "/v1/cluster")] = _map_naming(fake_node, unused_tcp_port)
    async with AsyncClient(credentials=fake_node.credentials, request_timeout_s=0.5,
                           **FAST) as client:  # type: ignore[arg-type]
        await client.refresh_placement()
        fake_node.not_master_answers = 1000
        started = asyncio.get_running_loop().time()
        with pytest.raises(QueueError) as caught:
            await client.enqueue("ledger", b"c", dedupe_id="d-c")
        assert asyncio.get_running_loop().time() - started < 1.5
    assert caught.value.code == "E_NOT_MASTER" and caught.value.outcome_unknown
    assert {op.dedupe_ids for op in fake_node.ops_of(EnqueueBatchOp)} == {("d-c",)}
    assert len(fake_node.ops_of(EnqueueBatchOp)) >= 3


@pytest.mark.asyncio
async def test_a_receive_from_a_dead_letter_queue_follows_its_queue_to_the_new_master(
        fake_node: FakeNode, unused_tcp_port: int) -> None:
    """The map has no entry for `ledger.dlq`: it lives in `ledger`'s pair and moves with it."""
    fake_node.rest_answers[("GET", "/v1/cluster")] = _map_naming(fake_node, unused_tcp_port)
    async with AsyncClient(credentials=fake_node.credentials, **FAST) as client:  # type: ignore[arg-type]
        fake_node.not_master_answers = 1                 # forwarded to the old master as this node took over
        assert await client.receive("ledger.dlq") == []  # retried once here, the new master
    assert [op.queue for op in fake_node.ops_of(ReceiveOp)] == ["ledger.dlq", "ledger.dlq"]


@pytest.mark.asyncio
async def test_a_closing_item_for_a_removed_client_fails_pending_and_stops_reconnecting(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.closing_on_next_frame = Closing("E_UNAUTHENTICATED", "client removed")
    with pytest.raises(QueueError) as caught:
        await client.ping()
    assert caught.value.code == "E_UNAUTHENTICATED"
    await asyncio.sleep(0.1)
    assert fake_node.connections == 1
    with pytest.raises(QueueError, match="client removed"):
        await client.enqueue("orders", b"x")


@pytest.mark.asyncio
async def test_a_closing_item_for_shutdown_is_followed_by_a_reconnect(fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.closing_on_next_frame = Closing("E_SHUTTING_DOWN", "stopping")
    with pytest.raises(QueueError) as caught:
        await client.ping()
    assert caught.value.code == "E_SHUTTING_DOWN" and caught.value.outcome_unknown
    await client.ping()
    assert fake_node.connections == 2


# --- consume --------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_consume_grants_credit_in_half_prefetch_batches_as_messages_are_taken(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(25)
    taken = []
    async with client.consume("orders", prefetch=10, visibility_timeout_s=5) as messages:
        async for message in messages:
            taken.append(message.id)
            if len(taken) == 25:
                break
    assert taken == list(range(1, 26))
    [subscribe] = fake_node.ops_of(SubscribeOp)
    assert (subscribe.credit, subscribe.visibility_ms) == (10, 5000)
    assert fake_node.credit_given[1:] == [5] * (len(fake_node.credit_given) - 1)
    await eventually(lambda: fake_node.ops_of(UnsubscribeOp))


@pytest.mark.asyncio
async def test_several_tasks_can_iterate_one_consumer_and_share_its_messages(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(30)
    taken: list[int] = []
    async with client.consume("orders", prefetch=6) as messages:
        async def worker() -> None:
            async for message in messages:
                taken.append(message.id)
                await message.ack()
                if len(taken) >= 30:
                    return
        workers = [asyncio.ensure_future(worker()) for _ in range(4)]
        await eventually(lambda: len(taken) >= 30)
        for each in workers:
            each.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert sorted(taken) == list(range(1, 31))
    assert sorted(fake_node.acked) == list(range(1, 31))


@pytest.mark.asyncio
async def test_closing_a_consumer_releases_what_it_buffered(fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(4)
    consumer = client.consume("orders", prefetch=4)
    first = await consumer.__anext__()
    await eventually(lambda: len(consumer._buffer) == 3)
    await consumer.close()
    assert first.id == 1
    assert sorted(op.message_id for op in fake_node.ops_of(ReleaseOp)) == [2, 3, 4]
    with pytest.raises(StopAsyncIteration):
        await consumer.__anext__()


@pytest.mark.asyncio
async def test_a_push_that_arrives_after_the_consumer_let_go_of_its_subscription_is_released(
        fake_node: FakeNode, client: AsyncClient) -> None:
    """The node may push for a subscription in the moment the consumer unsubscribes: the
    connection no longer maps its id to a consumer, yet hands the lease back at once rather
    than leave the message leased until its visibility timeout."""
    fake_node.ready = ready_messages(1)
    consumer = client.consume("orders", prefetch=1)
    assert (await consumer.__anext__()).id == 1
    connection, subscription_id = consumer._client, consumer._subscription_id
    assert subscription_id is not None
    await consumer.close()
    connection._on_delivery(Delivery(subscription_id, (DeliveredMessage(7, "r7", 4, 1, b"late"),)))
    await eventually(lambda: [op.message_id for op in fake_node.ops_of(ReleaseOp)] == [7])
    assert fake_node.ops_of(ReleaseOp)[0].queue == "orders"


@pytest.mark.asyncio
async def test_consume_resubscribes_after_reconnect_with_the_credit_still_owed(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(3)
    async with client.consume("orders", prefetch=8) as messages:
        assert (await messages.__anext__()).id == 1
        await eventually(lambda: len(messages._buffer) == 2)
        await fake_node.drop_connections()
        await eventually(lambda: len(fake_node.ops_of(SubscribeOp)) == 2)
        fake_node.ready = ready_messages(1)
        await fake_node.drop_connections()  # once more, so the new message arrives on a third socket
        await eventually(lambda: len(fake_node.ops_of(SubscribeOp)) == 3)
        assert [(await messages.__anext__()).id for _ in range(3)] == [2, 3, 1]
    credits = [op.credit for op in fake_node.ops_of(SubscribeOp)]
    assert credits == [8, 6, 6]  # prefetch minus the two still buffered


@pytest.mark.asyncio
async def test_an_ack_refused_for_a_passing_reason_is_sent_again_and_one_refused_for_good_fails(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ack_refusals = ["E_QUEUE_UNAVAILABLE", "E_OVERLOADED"]
    await client.ack("orders", 7, "r7")
    assert len(fake_node.ops_of(AckBatchOp)) == 3 and fake_node.acked == [7]
    fake_node.ack_refusals = ["E_FORBIDDEN"]
    with pytest.raises(QueueError) as caught:
        await client.ack("orders", 8, "r8")
    assert caught.value.code == "E_FORBIDDEN" and len(fake_node.ops_of(AckBatchOp)) == 4


RETRIABLE_SUBSCRIBE_REFUSALS = ["E_QUEUE_UNAVAILABLE", "E_OVERLOADED", "E_NOT_MASTER", "E_UNAVAILABLE",
                                "E_SHUTTING_DOWN", "E_TIMEOUT", "E_RECIPIENT_DEFUNCT", "E_NOT_ENOUGH_REPLICAS"]


@pytest.mark.asyncio
@pytest.mark.parametrize("code", RETRIABLE_SUBSCRIBE_REFUSALS)
async def test_a_consumer_whose_subscribe_is_refused_for_a_passing_reason_subscribes_again(
        fake_node: FakeNode, client: AsyncClient, code: str) -> None:
    fake_node.subscribe_refusals = [code, code]
    fake_node.ready = ready_messages(2)
    async with client.consume("orders", prefetch=4) as messages:
        async with asyncio.timeout(2):
            assert [(await messages.__anext__()).id for _ in range(2)] == [1, 2]
    assert len(fake_node.ops_of(SubscribeOp)) == 3


@pytest.mark.asyncio
async def test_a_consumer_whose_subscribe_is_never_answered_subscribes_again_after_the_request_timeout(
        fake_node: FakeNode) -> None:
    fake_node.subscribe_refusals = [None]
    fake_node.ready = ready_messages(1)
    async with AsyncClient(credentials=fake_node.credentials, request_timeout_s=0.5,
                           **FAST) as client:  # type: ignore[arg-type]
        async with client.consume("orders", prefetch=4) as messages:
            async with asyncio.timeout(3):
                assert (await messages.__anext__()).id == 1
    assert len(fake_node.ops_of(SubscribeOp)) == 2


@pytest.mark.asyncio
async def test_a_consumer_refused_past_the_request_timeout_raises_the_error_once_then_goes_on(
        fake_node: FakeNode) -> None:
    fake_node.subscribe_refusals = ["E_QUEUE_UNAVAILABLE"] * 10_000
    async with AsyncClient(credentials=fake_node.credentials, request_timeout_s=0.5,
                           **FAST) as client:  # type: ignore[arg-type]
        async with client.consume("orders", prefetch=4) as messages:
            with pytest.raises(QueueError) as caught:
                async with asyncio.timeout(3):
                    await messages.__anext__()
            assert caught.value.code == "E_QUEUE_UNAVAILABLE" and "no subscription for" in caught.value.message
            fake_node.subscribe_refusals = []
            fake_node.ready = ready_messages(1)
            async with asyncio.timeout(3):
                assert (await messages.__anext__()).id == 1


@pytest.mark.asyncio
async def test_a_consumer_with_a_full_window_takes_new_messages_after_its_connection_is_lost(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.ready = ready_messages(4)
    async with client.consume("orders", prefetch=4) as messages:
        await eventually(lambda: len(messages._buffer) == 4)        # the window is full
        fake_node.subscribe_refusals = ["E_QUEUE_UNAVAILABLE"]      # a master restarted inside its lease
        await fake_node.drop_connections()
        async with asyncio.timeout(3):
            assert [(await messages.__anext__()).id for _ in range(4)] == [1, 2, 3, 4]
            fake_node.ready = [DeliveredMessage(5, "r5", 4, 1, b"m5")]
            assert (await messages.__anext__()).id == 5


@pytest.mark.asyncio
async def test_a_consumer_whose_full_window_empties_after_its_node_died_follows_the_map_to_the_new_master(
        fake_node: FakeNode) -> None:
    promoted = FakeNode()            # the replica's node, which the map names once the master died
    await promoted.start()
    try:
        def cluster_map(master: str) -> tuple[int, dict[str, Any]]:
            return 200, {"nodes": [{"id": "n1", "url": fake_node.url}, {"id": "n2", "url": promoted.url}],
                         "queues": {"ledger": {"master": master, "replica": "n2" if master == "n1" else "n1",
                                               "epoch": 3 if master == "n1" else 4}}}
        promoted.credentials = fake_node.credentials     # one client, known to both
        promoted._public_key = fake_node._public_key
        fake_node.rest_answers[("GET", "/v1/cluster")] = promoted.rest_answers[("GET", "/v1/cluster")] = \
            cluster_map("n1")
        fake_node.ready = ready_messages(2)
        async with AsyncClient(credentials=fake_node.credentials, **FAST) as client:  # type: ignore[arg-type]
            await client.refresh_placement()
            async with client.consume("ledger", prefetch=2) as messages:
                await eventually(lambda: len(messages._buffer) == 2)      # the window is full
                promoted.rest_answers[("GET", "/v1/cluster")] = cluster_map("n2")
                promoted.ready = [DeliveredMessage(3, "r3", 4, 1, b"m3")]
                await fake_node.stop()                                     # the master's node is gone
                # Seen gone while the window was still full: no recovery was needed then.
                await eventually(lambda: not client.connected and messages._recovering is None)
                async with asyncio.timeout(5):
                    assert [(await messages.__anext__()).id for _ in range(3)] == [1, 2, 3]
    finally:
        await promoted.stop()


@pytest.mark.asyncio
async def test_a_subscription_the_server_ends_for_a_lasting_reason_ends_the_iteration(
        fake_node: FakeNode, client: AsyncClient) -> None:
    fake_node.subscribe_refusals = ["E_FORBIDDEN"]
    async with client.consume("orders", prefetch=4) as messages:
        with pytest.raises(QueueError) as caught:
            await messages.__anext__()
    assert caught.value.code == "E_FORBIDDEN" and len(fake_node.ops_of(SubscribeOp)) == 1


# --- the synchronous client ------------------------------------------------------------------------
@pytest.fixture
def threaded_fake_node() -> Iterator[FakeNode]:
    """A FakeNode on its own loop and thread, for callers that block."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    node = FakeNode()
    asyncio.run_coroutine_threadsafe(node.start(), loop).result()
    yield node
    asyncio.run_coroutine_threadsafe(node.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def test_the_sync_client_enqueues_receives_acks_and_consumes(threaded_fake_node: FakeNode) -> None:
    threaded_fake_node.ready = ready_messages(1)
    with Client(credentials=threaded_fake_node.credentials) as sync_client:
        assert sync_client.enqueue("orders", b"x") == 1
        assert sync_client.enqueue_many("orders", [b"y", b"z"]) == [2, 3]
        [message] = sync_client.receive("orders")
        message.ack()
        threaded_fake_node.ready = ready_messages(3)
        with sync_client.consume("orders", prefetch=2) as consumer:
            assert [next(consumer).id for _ in range(3)] == [1, 2, 3]
    assert threaded_fake_node.acked == [1]


def test_a_sync_client_that_cannot_authenticate_raises_and_stops_its_thread(threaded_fake_node: FakeNode) -> None:
    impostor = Credentials("c-test", private_key_to_text(new_private_key()), threaded_fake_node.url)
    before = threading.active_count()
    with pytest.raises(QueueError) as caught, Client(credentials=impostor):
        pass
    assert caught.value.code == "E_UNAUTHENTICATED"
    assert threading.active_count() == before


# --- qctl -----------------------------------------------------------------------------------------------
def test_format_table_aligns_columns_and_shows_missing_values_as_dashes() -> None:
    table = format_table(["NAME", "DEPTH"], [["orders", 12], ["a", None]])
    assert table.splitlines() == ["NAME    DEPTH", "orders  12", "a       -"]


def test_format_fields_flattens_nested_objects() -> None:
    assert format_fields({"id": 3, "stats": {"depth": 1}}).splitlines() == ["id:          3",
                                                                          "stats.depth: 1"]


def test_grants_parse_from_pattern_and_privileges() -> None:
    assert parse_grant("orders.*:post,get") == {"pattern": "orders.*", "privileges": ["post", "get"]}
    assert parse_grant("a:b:c:admin")["pattern"] == "a:b:c"


@pytest.mark.parametrize("argv", [["clients", "add", "x", "--grant", "orders:fly"],
                                  ["clients", "add", "x", "--grant", "nocolon"],
                                  ["put", "q", "data", "--priority", "12"],
                                  ["queue", "create", "q", "--strength", "weak"], []])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_global_options_are_accepted_before_or_after_the_command() -> None:
    parser = build_parser()
    after = parser.parse_args(["queue", "create", "q", "--json", "--dead-letter", "--min-in-sync", "2"])
    before = parser.parse_args(["--json", "--url", "http://x", "queue", "stats", "q"])
    assert after.json and after.dead_letter is True and after.min_in_sync == 2
    assert before.json and before.url == "http://x" and before.name == "q"


def test_qctl_without_credentials_prints_the_error_code_and_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CREDENTIALS, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert main(["--json", "queue", "list"], stdout=out, stderr=err) == 1
    assert err.getvalue().startswith("error: E_UNAUTHENTICATED: no credentials found")
    assert json.loads(out.getvalue())["error"]["code"] == "E_UNAUTHENTICATED"


def test_qctl_json_prints_exactly_one_document(threaded_fake_node: FakeNode, tmp_path: Path) -> None:
    creds_path = tmp_path / "admin.json"
    save_credentials(creds_path, threaded_fake_node.credentials)
    threaded_fake_node.rest_answers[("GET", "/v1/queues")] = (200, {"queues": [{"name": "orders", "depth": 3}]})
    out = io.StringIO()
    assert main(["--credentials", str(creds_path), "--json", "queue", "list"], stdout=out) == 0
    assert json.loads(out.getvalue()) == {"queues": [{"name": "orders", "depth": 3}]}
    human = io.StringIO()
    assert main(["--credentials", str(creds_path), "queue", "list"], stdout=human) == 0
    assert human.getvalue().splitlines() == ["NAME    DEPTH", "orders  3"]


def test_qctl_status_on_a_large_map_shows_its_counts_and_asks_for_no_queue(threaded_fake_node: FakeNode,
                                                                            tmp_path: Path) -> None:
    """issue 31: `qctl status` costs the nodes, not the map, beyond 200 queues (the summary)."""
    creds_path = tmp_path / "admin.json"
    save_credentials(creds_path, threaded_fake_node.credentials)
    summary = {"version": 9, "node": "n1", "leader": "n1", "term": 2, "membership": {"voters": ["n1", "n2"]},
               "nodes": [{"id": node, "url": f"http://{node}", "state": "up", "voter": True, "masters": 5000,
                          "replicas": 5000} for node in ("n1", "n2")],
               "counts": {"queues": 10_000, "out_of_sync": 101, "macros": 0, "channels": 2, "recipients": 1,
                          "recipients_not_ok": 1, "forwards": 0},
               "out_of_sync": [f"q{number:05d}" for number in range(100)], "recipients_not_ok": ["worker"]}
    threaded_fake_node.rest_answers[("GET", "/v1/cluster")] = (200, summary)
    out = io.StringIO()
    assert main(["--credentials", str(creds_path), "status"], stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "membership leader: n1 (term 2)"
    assert lines[2].split() == ["NODE", "URL", "STATE", "MEMBERSHIP", "MASTERS", "REPLICAS"]
    assert "10000 queues, 101 with a replica out of sync; 0 macro queues, 2 channels, 0 forwards, 1 recipients " \
           "(1 not ok)" in lines
    assert lines[-2].startswith("out of sync: q00000, q00001") and lines[-2].endswith("q00099 (and 1 more)")
    assert lines[-1] == "recipients not ok: worker"
    assert [(r["path"], r["query"]) for r in threaded_fake_node.rest_requests] == [("/v1/cluster", {"summary": "1"})]
    out = io.StringIO()
    assert main(["--credentials", str(creds_path), "--json", "status"], stdout=out) == 0
    assert json.loads(out.getvalue()) == summary


def test_qctl_clients_add_sends_only_the_public_key_and_writes_a_usable_credentials_file(
        threaded_fake_node: FakeNode, tmp_path: Path) -> None:
    creds_path, new_path = tmp_path / "admin.json", tmp_path / "new" / "worker.json"
    save_credentials(creds_path, threaded_fake_node.credentials)
    grants = [{"pattern": "orders.*", "privileges": ["post"]}]
    threaded_fake_node.rest_answers[("POST", "/v1/clients")] = (201, {"id": "c-9", "name": "worker", "grants": grants})
    out = io.StringIO()
    argv = ["--credentials", str(creds_path), "clients", "add", "worker", "--grant", "orders.*:post",
            "--out", str(new_path), "--json"]
    assert main(argv, stdout=out) == 0
    document = json.loads(out.getvalue())
    assert document["credentials_file"] == str(new_path) and "private_key" not in document
    sent = json.loads(threaded_fake_node.rest_requests[-1]["body"])
    assert sent["grants"] == grants and len(base64.b64decode(sent["public_key"])) == 32
    written = load_credentials(new_path)
    assert written.client_id == "c-9" and written.url == threaded_fake_node.url
    assert stat.S_IMODE(os.stat(new_path).st_mode) == 0o600


@pytest.mark.asyncio
async def test_calls_that_need_the_map_at_once_share_one_reading_of_it(fake_node: FakeNode, client: AsyncClient) -> None:
    """issue 13: after a failover, thousands of calls in flight each read the map from every
    node. Calls share readings: one that asks while a reading is under way waits for it and
    then for the next one (the first may predate what made it ask), which serves everyone who
    asked meanwhile: a burst of 1,000 costs two readings, not 1,000."""
    fake_node.rest_answers[("GET", "/v1/cluster")] = (200, {"nodes": [{"id": "n1", "url": fake_node.url}], "queues": {}})

    def readings() -> int:
        return len([r for r in fake_node.rest_requests if r["path"] == "/v1/cluster"])
    await asyncio.gather(*(client.refresh_placement() for _ in range(1000)))
    assert 1 <= readings() <= 2
    before = readings()
    await client.refresh_placement()          # alone: a reading of its own
    assert readings() == before + 1
    # issue 31: calls that follow their own queues (after a failover of a node's thousands of
    # queues) share readings too, each asking for the names its callers took,
    # PLACEMENT_QUEUES_MAX to a request, never the whole map (bench_scale: 10,000 queues'
    # map is 5.6 MB, read from every node by every stalled call's reading).
    from client.router import PLACEMENT_QUEUES_MAX
    before = readings()
    await asyncio.gather(*(client.refresh_placement(f"q{n}") for n in range(10)), client.refresh_placement("q3.dlq"))
    scoped = [r for r in fake_node.rest_requests if r["path"] == "/v1/cluster"][before:]
    assert len(scoped) == 1 and sorted(scoped[0]["query_items"]) == sorted(("queue", f"q{n}") for n in range(10))
    before = readings()
    await asyncio.gather(*(client.refresh_placement(f"q{n}") for n in range(PLACEMENT_QUEUES_MAX + 1)))
    wide = [r for r in fake_node.rest_requests if r["path"] == "/v1/cluster"][before:]
    assert sorted(len(r["query_items"]) for r in wide) == [1, PLACEMENT_QUEUES_MAX]


@pytest.mark.asyncio
async def test_a_signed_request_is_never_resent_by_aiohttp_with_the_same_nonce(fake_node: FakeNode) -> None:
    """aiohttp sends a GET, PUT or DELETE again, with the same headers, when the kept-alive
    connection it reused turns out closed. A node may have taken the first copy and then
    refuses the second as a replay: a WebSocket upgrade refused so ended a client for good
    after a black-holed link healed. Here the server answers the first request on a
    connection and closes the connection on the second without an answer."""
    nonces: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answered in (True, False):
            head = await reader.readuntil(b"\r\n\r\n")
            nonces.extend(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                          if line.lower().startswith(b"x-nonce:"))
            if not answered:
                break
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}')
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with HttpClient(f"http://127.0.0.1:{port}", fake_node.credentials.signer()) as http:
            await http.cluster()
            with pytest.raises(QueueError):
                await http.cluster()             # the connection closes under it: no second copy
    finally:
        server.close()
        await server.wait_closed()
    assert len(nonces) == len(set(nonces)), f"a nonce was sent twice: {nonces}"


def test_a_call_tried_at_two_nodes_reports_its_first_failure_unknown_when_any_attempt_may_have_been_applied() -> None:
    from client.router import first_failure as _first_failure
    definite = QueueError("E_UNAVAILABLE", "cannot reach n1")
    unknown = QueueError("E_UNAVAILABLE", "the connection failed after the request went out", outcome_unknown=True)
    combined = _first_failure(_first_failure(None, definite), unknown)
    assert (combined.code, combined.message, combined.outcome_unknown) == ("E_UNAVAILABLE", "cannot reach n1", True)
    assert _first_failure(unknown, definite) is unknown
    assert _first_failure(definite, QueueError("E_TIMEOUT")) is definite
