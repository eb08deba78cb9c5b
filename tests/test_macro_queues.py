"""Macro queues (issue 14, items 1-5; seed 004): one name over member queues, the definition in
the cluster map, the policies in the client library. Real 3-node clusters with members mastered
on different nodes, and the map's state machine on its own."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import re
import time
from typing import Any

import pytest

from client import AsyncClient, Client
from client.macro import MacroEnqueued, MacroEnqueueError, MacroQueue, member_dedupe_id
from client.qctl import main as qctl
from qserver.api.auth import DelegatedSigner
from replication.cluster_map import (
    AddNode,
    ClusterMap,
    CreateMacro,
    CreateQueue,
    DeleteMacro,
    DeleteQueue,
    PutMacroMember,
    RemoveMacroMember,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from tests.support import RawApi, error_code, raw_session
from tests.test_client_integration import drain, run_qctl
from wire.errors import QueueError
from wire.protocol import EnqueueOp, ErrorReply, decode_server_frame, encode_frame

# a on n1, b on n2, c on n3: every member's master on its own node.
PLACEMENT = {"a": ["n1", "n2"], "b": ["n2", "n3"], "c": ["n3", "n1"]}


# --- the map (pure) ------------------------------------------------------------------------------
def _map_with_queues(*kinds: tuple[str, str]) -> ClusterMap:
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}"))
    for number, (name, kind) in enumerate(kinds, start=1):
        assert cluster.apply(CreateQueue(name, {"type": kind}, "n1", "n2", number))[0].applied
    return cluster


def test_the_map_defines_macros_checks_members_and_keeps_them_through_a_snapshot() -> None:
    cluster = _map_with_queues(("a", "queued_ack"), ("b", "queued_ack"), ("w", "two_way"))
    assert cluster.apply(CreateMacro("m", "round_robin", "prioritized"))[0].reason == "created"
    assert cluster.apply(CreateMacro("m", "round_robin", "prioritized"))[0].applied          # the same again
    assert not cluster.apply(CreateMacro("m", "all", "prioritized"))[0].applied              # other policies
    assert not cluster.apply(CreateMacro("a", "all", "prioritized"))[0].applied              # a queue's name
    assert not cluster.apply(CreateMacro("x", "sometimes", "prioritized"))[0].applied
    assert cluster.apply(PutMacroMember("m", "a", 5, 2))[0].applied
    assert cluster.apply(PutMacroMember("m", "b"))[0].applied
    refusals = [cluster.apply(command)[0] for command in (
        PutMacroMember("m", "w"),                 # a two_way member among queued_ack ones
        PutMacroMember("m", "m"),                 # a macro of macros
        PutMacroMember("m", "nothing"),
        PutMacroMember("m", "a", 10, 1),
        PutMacroMember("m", "a", 0, 0),
        RemoveMacroMember("m", "w"),
        DeleteMacro("none"))]
    assert not any(outcome.applied for outcome in refusals), refusals
    assert not cluster.apply(CreateQueue("m", {"type": "queued_ack"}, "n1", "n2", 9))[0].applied
    assert cluster.apply(PutMacroMember("m", "a", 7, 3))[0].applied    # set priority and weight
    for command in (CreateMacro("m", "all", "chronological", "queue_length"), PutMacroMember("m", "a", 7, 3),
                    RemoveMacroMember("m", "a"), DeleteMacro("m")):
        assert decode_command(encode_command(command)) == command
    restored = decode_map(encode_map(cluster))
    assert restored.macros == cluster.macros and restored.to_json()["macros"]["m"]["members"] == [
        {"queue": "a", "priority": 7, "weight": 3}, {"queue": "b", "priority": 0, "weight": 1}]
    assert cluster.apply(DeleteQueue("a", 1))[0].applied           # a deleted queue leaves every macro
    assert [member.queue for member in cluster.macros["m"].members] == ["b"]
    assert cluster.apply(DeleteMacro("m"))[0].applied and not cluster.macros


class _FakeClient:
    http = None


def test_weighted_round_robin_spreads_turns_and_fastest_prefers_the_smaller_number() -> None:
    definition = {"name": "m", "producer": "round_robin", "consumer": "prioritized",
                  "members": [{"queue": "a", "weight": 3}, {"queue": "b", "weight": 1}, {"queue": "c", "weight": 1}]}
    macro = MacroQueue(_FakeClient(), definition, None)  # type: ignore[arg-type]
    turns = [macro._producer_order()[0] for _ in range(10)]
    assert collections.Counter(turns) == {"a": 6, "b": 2, "c": 2}
    assert all(turns[i:i + 2] != ["a", "a"] or turns[i + 2:i + 3] != ["a"] for i in range(8))   # spread out
    macro.update({**definition, "producer": "fastest", "fastest_by": "response_time"})
    macro._state["a"].response_ms, macro._state["b"].response_ms, macro._state["c"].response_ms = 3.0, 1.0, 2.0
    assert macro._producer_order() == ["b", "c", "a"]
    macro._state["b"].suspect_until = time.monotonic() + 60      # unreachable lately: tried last
    assert macro._producer_order() == ["c", "a", "b"]
    assert member_dedupe_id("x", "a") == "x@a" and len(member_dedupe_id("x" * 128, "a")) == 64


# --- on a real cluster -------------------------------------------------------------------------------
async def _members(client: AsyncClient, macro: str, producer: str, consumer: str, *,
                   fastest_by: str = "response_time", priorities: dict[str, int] | None = None,
                   weights: dict[str, int] | None = None, queue_options: dict[str, Any] | None = None) -> None:
    for queue in PLACEMENT:
        await client.create_queue(queue, strength="full", **(queue_options or {}))
    await client.create_macro(macro, producer, consumer, fastest_by)
    for queue in PLACEMENT:
        await client.add_macro_member(macro, queue, (priorities or {}).get(queue, 0), (weights or {}).get(queue, 1))


@pytest.mark.asyncio
async def test_round_robin_by_weight_then_prioritized_drains_the_highest_member_first(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await _members(client, "work", "round_robin", "prioritized", priorities={"a": 5, "b": 0, "c": 9},
                       weights={"a": 2})
        described = await client.describe_macro("work")
        assert [(m["queue"], m["master"]) for m in described["members"]] == [("a", "n1"), ("b", "n2"), ("c", "n3")]
        answers = [await client.enqueue("work", b"m%d" % n, headers={"n": str(n)}) for n in range(8)]
        assert all(isinstance(answer, MacroEnqueued) for answer in answers)
        assert collections.Counter(answer.queue for answer in answers) == {"a": 4, "b": 2, "c": 2}
        for queue in PLACEMENT:          # the answer names the member and the message's index in it
            assert [int(a) for a in answers if a.queue == queue] == list(range(1, 1 + sum(
                a.queue == queue for a in answers)))
        received = []
        while messages := await client.receive("work", wait_s=0.2):
            [message] = messages
            received.append(message.queue)
            assert message.headers["n"] == message.payload[1:].decode()
            await message.ack()                                  # acked at its member, transparently
        assert received == ["c", "c", "a", "a", "a", "a", "b", "b"]
        for queue in PLACEMENT:
            assert (await client.queue_stats(queue))["depth"] == 0


@pytest.mark.asyncio
async def test_chronological_and_round_robin_consumers_lease_only_what_they_deliver(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        await _members(client, "merged", "first_available", "chronological")
        order = ["b", "a", "c", "a", "b", "c"]
        for number, queue in enumerate(order):                    # directly into the members, in this order
            await client.enqueue(queue, b"%d" % number, priority=9 if queue == "c" else 4)
            await asyncio.sleep(0.005)
        got = []
        for _ in order:
            [message] = await client.receive("merged", wait_s=1.0)
            got.append((message.queue, message.payload))
            assert message.deliveries == 1                     # nothing was leased and given back
            await message.ack()
        assert got == [(queue, b"%d" % n) for n, queue in enumerate(order)]
        await client.create_macro("turns", "round_robin", "round_robin")
        for queue in PLACEMENT:
            await client.add_macro_member("turns", queue)
            for number in range(2):
                await client.enqueue(queue, f"{queue}{number}".encode())
        got = []
        while messages := await client.receive("turns", wait_s=0.2):
            got.append(messages[0].payload)
            await messages[0].ack()
        assert got == [b"a0", b"b0", b"c0", b"a1", b"b1", b"c1"]


@pytest.mark.asyncio
async def test_a_waiting_receive_wakes_on_the_first_message_of_any_member(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await _members(client, "inbox", "round_robin", "prioritized")
        started = time.monotonic()
        waiting = asyncio.ensure_future(client.receive("inbox", wait_s=10.0))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await client.enqueue("c", b"late")                        # the member mastered on n3
        [message] = await asyncio.wait_for(waiting, 5.0)
        assert (message.queue, message.payload) == ("c", b"late") and time.monotonic() - started < 3.0
        await message.ack()
        empty_started = time.monotonic()
        assert await client.receive("inbox", wait_s=0.5) == []
        assert 0.45 < time.monotonic() - empty_started < 3.0
        async with client.consume("inbox", prefetch=10) as messages:      # a consumer over every member
            for queue in ("a", "b", "c"):
                await client.enqueue(queue, queue.encode())
            seen = set()
            async for message in messages:
                seen.add(message.payload)
                await message.ack()
                if len(seen) == 3:
                    break
        assert seen == {b"a", b"b", b"c"}


@pytest.mark.asyncio
async def test_all_copies_to_every_member_once_even_when_retried(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await _members(client, "fanout", "all", "prioritized")
        answer = await client.enqueue("fanout", b"copy me", dedupe_id="order-1")
        assert set(answer.copies) == {"a", "b", "c"} and answer.copies["a"] == int(answer) == 1
        again = await client.enqueue("fanout", b"copy me", dedupe_id="order-1")       # a retry
        assert again.copies == answer.copies
        for queue in PLACEMENT:
            assert await drain(client, queue) == [b"copy me"]
        await client.create_queue("small", strength="full", max_depth=1)
        await client.add_macro_member("fanout", "small")
        await client.enqueue("small", b"fills it")
        with pytest.raises(MacroEnqueueError) as failed:
            await client.enqueue("fanout", b"second", dedupe_id="order-2")
        outcomes = failed.value.outcomes
        assert failed.value.code == "E_QUEUE_FULL" and isinstance(outcomes["small"], QueueError)
        assert all(isinstance(outcomes[queue], int) for queue in PLACEMENT)
        await drain(client, "small")
        retried = await client.enqueue("fanout", b"second", dedupe_id="order-2")   # only small gets a new copy
        assert {queue: retried.copies[queue] for queue in PLACEMENT} == {q: outcomes[q] for q in PLACEMENT}
        for queue in PLACEMENT:
            assert await drain(client, queue) == [b"second"]


@pytest.mark.asyncio
async def test_first_available_passes_over_a_full_member_and_fastest_by_length_picks_the_shortest(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await _members(client, "spill", "first_available", "prioritized", queue_options={"max_depth": 3})
        answers = [await client.enqueue("spill", b"%d" % n) for n in range(7)]
        assert [a.queue for a in answers] == ["a"] * 3 + ["b"] * 3 + ["c"]
        for _ in range(2):
            await client.enqueue("c", b"filler")
        with pytest.raises(QueueError) as full:
            await client.enqueue("spill", b"no room")
        assert full.value.code == "E_QUEUE_FULL"
        await client.create_macro("short", "fastest", "prioritized", "queue_length")
        for queue in ("c", "b", "a"):                        # c is full, b holds 3 and a 3
            await client.add_macro_member("short", queue)
        await drain(client, "a")
        await client.enqueue("short", b"reads the lengths")     # the first call starts reading them
        await asyncio.sleep(1.2)
        placed = collections.Counter([(await client.enqueue("short", b"x")).queue for _ in range(2)])
        assert placed == {"a": 2}, placed


@pytest.mark.asyncio
@pytest.mark.parametrize("producer", ["first_available", "all"])
async def test_a_member_whose_master_is_killed_mid_stream_loses_and_doubles_nothing(
        qcluster_factory: Any, producer: str) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await _members(client, "stream", producer, "prioritized")
        acknowledged: dict[bytes, MacroEnqueued] = {}
        failed: list[QueueError] = []

        async def produce(count: int) -> None:
            for number in range(count):
                payload = b"p%04d" % number
                try:
                    acknowledged[payload] = await client.enqueue("stream", payload)
                except QueueError as error:
                    failed.append(error)
        producer_task = asyncio.ensure_future(produce(300))
        while len(acknowledged) < 60:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(cluster.kill, "n1")          # the master of member a
        await asyncio.wait_for(producer_task, 120)
        await asyncio.to_thread(cluster.start, "n1")
        assert not failed, failed[:3]
        held = {queue: collections.Counter(await drain(client, queue)) for queue in PLACEMENT}
        for queue, counts in held.items():
            assert all(count == 1 for count in counts.values()), (queue, counts.most_common(3))
        if producer == "all":
            for queue, counts in held.items():
                assert set(counts) == set(acknowledged), queue
        else:
            stored = [payload for counts in held.values() for payload in counts]
            assert sorted(stored) == sorted(acknowledged)
            for payload, answer in acknowledged.items():
                assert payload in held[answer.queue]


@pytest.mark.asyncio
async def test_rest_callers_use_a_macro_queue_through_the_node_with_their_own_grants(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as admin:
        await _members(admin, "rest", "all", "chronological")
        await admin.enqueue("b", b"older")
        answer = await admin.http.enqueue_answer("rest", b"everywhere", dedupe_id="r-1")
        assert answer["macro"] == "rest" and set(answer["copies"]) == {"a", "b", "c"}
        assert await admin.http.enqueue_answer("rest", b"everywhere", dedupe_id="r-1") == answer    # a retry
        queue, message = await admin.http.receive_from("rest", wait_s=1.0)
        assert (queue, message.payload, message.deliveries) == ("b", b"older", 1)      # the oldest head
        await admin.http.ack_http(queue, message.message_id, message.receipt)         # at the member
        seen = []
        while found := await admin.http.receive_from("rest", wait_s=0.2):
            seen.append(found[0])
            await admin.http.ack_http(found[0], found[1].message_id, found[1].receipt)
        assert sorted(seen) == ["a", "b", "c"]
        async with raw_session() as session, session.get(cluster.urls["n2"] + "/metrics") as answer:
            metrics = await answer.text()
        assert "qserver_macro_queues 1" in metrics and 'qserver_macro_members{macro="rest"} 3' in metrics
        assert 'qserver_macro_rest_calls_total{op="enqueue",outcome="ok"} 2' in metrics
        assert 'qserver_macro_rest_calls_total{op="receive",outcome="ok"} 5' in metrics
        # A client allowed the macro's name but not a member's: the node acts in its name.
        limited = await admin.register_client("limited", [{"pattern": "rest", "privileges": ["post", "get"]},
                                                          {"pattern": "a", "privileges": ["post"]}])
        creds_path = cluster.root / "limited.json"
        creds_path.write_text(json.dumps({"client_id": limited["id"], "private_key": limited["private_key"],
                                          "url": cluster.urls["n3"]}))
        async with raw_session() as session:
            raw = RawApi.for_credentials(session, creds_path)
            # A registration reaches the other nodes with the map, a moment later: the node serving
            # the call, and those of the members it calls in the client's name, must know it.
            deadline = time.monotonic() + 10
            for url in cluster.urls.values():
                known = RawApi(session, url, raw.signer)
                while (await known.request("GET", "/v1/cluster"))[0] != 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            status, body, _ = await raw.request("POST", "/v1/queues/rest/messages", b"x")
            assert status == 403 and error_code(body) == "E_FORBIDDEN"
        for member in PLACEMENT:          # refused copies are not stored; a's may be (its grant allows it)
            assert (await admin.queue_stats(member))["depth"] <= (1 if member == "a" else 0)


def test_qctl_and_the_sync_client_manage_and_use_a_macro_queue(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    node = cluster          # qctl reads its credentials (n1 first, then the map)
    for queue in PLACEMENT:
        assert run_qctl(node, "queue", "create", queue)[0] == 0
    code, created, _ = run_qctl(node, "macro", "create", "jobs", "--producer", "round_robin",
                                "--consumer", "prioritized")
    assert code == 0 and created["name"] == "jobs" and created["members"] == []
    assert run_qctl(node, "macro", "add", "jobs", "a", "--priority", "3")[0] == 0
    code, described, _ = run_qctl(node, "macro", "add", "jobs", "b", "--weight", "2")
    assert code == 0 and [(m["queue"], m["priority"], m["weight"]) for m in described["members"]] == [
        ("a", 3, 1), ("b", 0, 2)]
    code, put, _ = run_qctl(node, "put", "jobs", "hello")
    assert code == 0 and put["queue"] in ("a", "b")
    code, got, _ = run_qctl(node, "get", "jobs", "--ack")
    assert code == 0 and got["payload"] == "hello" and got["queue"] == put["queue"]
    with Client(cluster.urls["n1"], cluster.credentials_path) as client:
        answer = client.enqueue("jobs", b"sync")
        [message] = client.receive("jobs", wait_s=1.0)
        assert (message.queue, message.id) == (answer.queue, int(answer))
        message.ack()
        assert [m["name"] for m in client.list_macros()] == ["jobs"]
    shown = io.StringIO()
    assert qctl(["--credentials", str(cluster.credentials_path), "status"], stdout=shown, stderr=io.StringIO()) == 0
    assert re.search(r"^jobs +round_robin +prioritized +a, b", shown.getvalue(), re.M), shown.getvalue()
    code, listed, _ = run_qctl(node, "macro", "list")
    assert code == 0 and [m["name"] for m in listed["macros"]] == ["jobs"]
    assert run_qctl(node, "macro", "remove", "jobs", "b")[1]["members"][0]["queue"] == "a"
    assert run_qctl(node, "macro", "delete", "jobs")[0] == 0
    code, document, _ = run_qctl(node, "macro", "describe", "jobs")
    assert code == 1 and document["error"]["code"] == "E_UNKNOWN_MACRO"


@pytest.mark.asyncio
async def test_bad_macro_requests_get_stable_codes_and_change_nothing(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await _members(client, "m", "round_robin", "prioritized")
        await client.create_queue("replies", type="two_way")
        before = await client.describe_macro("m")

        async def code_of(call: Any) -> str:
            with pytest.raises(QueueError) as raised:
                await call
            return raised.value.code
        assert await code_of(client.create_macro("m", "all", "prioritized")) == "E_MACRO_REFUSED"
        assert await code_of(client.http.create_macro("x", "sometimes", "prioritized")) == "E_INVALID_OPTION"
        assert await code_of(client.create_macro("a", "all", "prioritized")) == "E_MACRO_REFUSED"
        assert await code_of(client.add_macro_member("m", "replies")) == "E_MACRO_REFUSED"
        assert await code_of(client.add_macro_member("m", "m")) == "E_MACRO_REFUSED"
        assert await code_of(client.add_macro_member("m", "nothing")) == "E_MACRO_REFUSED"
        assert await code_of(client.add_macro_member("m", "a", priority=12)) == "E_MACRO_REFUSED"
        assert await code_of(client.add_macro_member("none", "a")) == "E_UNKNOWN_MACRO"
        assert await code_of(client.describe_macro("none")) == "E_UNKNOWN_MACRO"
        assert await code_of(client.create_queue("m")) == "E_MACRO_REFUSED"
        async with raw_session() as session:
            raw = RawApi.for_credentials(session, cluster.credentials_path)
            # A raw WebSocket does not run the policies: a macro name there is a clear error.
            ws = await raw.ws()
            await ws.send_bytes(encode_frame([EnqueueOp(7, "m", b"x", 4, None)]))
            [reply] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(reply, ErrorReply) and (reply.request_id, reply.code) == (7, "E_MACRO_QUEUE")
            await ws.close()
            # A delegated signature (node to node) made without the cluster secret is refused.
            forged = DelegatedSigner(raw.signer.client_id, b"not the secret")      # type: ignore[union-attr]
            status, body, _ = await raw.request("GET", "/v1/macros", signed_headers=forged.headers(
                "GET", "/v1/macros", {}, b"", audience=raw.url))
            assert status == 401 and error_code(body) == "E_UNAUTHENTICATED"
        assert await client.describe_macro("m") == before
        for queue in PLACEMENT:
            assert (await client.queue_stats(queue))["depth"] == 0
        with contextlib.suppress(QueueError):
            await client.delete_macro("m")
        assert await code_of(client.delete_macro("m")) == "E_UNKNOWN_MACRO"
