"""The client library and qctl against a real qserver process (the `qnode` fixture).

These prove what mocks cannot: that signing, the REST paths and the WebSocket frames agree
with the server, that a kill -9 of the node costs no acknowledged enqueue, and that dedupe
ids make the client's retries after a reconnect store each message once.
"""
from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError
from client.qctl import main as qctl

REPOSITORY = Path(__file__).resolve().parent.parent


def run_qctl(qnode: Any, *argv: str) -> tuple[int, Any, str]:
    """Run qctl in-process with --json; returns (exit code, parsed document, stderr).
    qctl runs its own event loop, so async tests call this through asyncio.to_thread."""
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(qnode.credentials_path), "--json", *argv], stdout=out, stderr=err)
    return code, json.loads(out.getvalue()) if out.getvalue() else None, err.getvalue()


async def drain(client: AsyncClient, queue: str) -> list[bytes]:
    """Receive and ack everything in the queue; the payloads in delivery order."""
    payloads: list[bytes] = []
    while True:
        messages = await client.receive(queue, max_messages=500, wait_s=0.2)
        if not messages:
            return payloads
        payloads.extend(m.payload for m in messages)
        await asyncio.gather(*(m.ack() for m in messages))


# --- messages -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_enqueued_message_is_received_and_acked_through_the_async_client(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("orders", strength="full")
        message_id = await client.enqueue("orders", b"hello", priority=6)
        [message] = await client.receive("orders", wait_s=1.0)
        assert (message.id, message.payload, message.priority, message.deliveries) == (message_id, b"hello", 6, 1)
        await message.ack()
        assert await client.receive("orders") == []
        stats = await client.queue_stats("orders")
    assert stats["total_acked"] == 1 and stats["depth"] == 0


@pytest.mark.asyncio
async def test_a_released_message_is_delivered_again_with_its_delivery_count_raised(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("orders")
        await client.enqueue("orders", b"again")
        [first] = await client.receive("orders", wait_s=1.0)
        await first.release()
        [second] = await client.receive("orders", wait_s=1.0)
        await second.ack()
    assert (second.id, second.deliveries) == (first.id, 2)


@pytest.mark.asyncio
async def test_priority_decides_delivery_order_then_the_ordering_index(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("orders")
        for payload, priority in ((b"low", 1), (b"high-1", 9), (b"mid", 4), (b"high-2", 9)):
            await client.enqueue("orders", payload, priority=priority)
        assert await drain(client, "orders") == [b"high-1", b"high-2", b"mid", b"low"]


@pytest.mark.asyncio
async def test_enqueue_many_returns_increasing_ids_and_every_payload_arrives_in_order(qnode: Any) -> None:
    payloads = [f"batch-{i}".encode() for i in range(1000)]
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("batch")
        ids = await client.enqueue_many("batch", payloads)
        assert ids == sorted(ids) and len(set(ids)) == 1000
        assert await drain(client, "batch") == payloads


@pytest.mark.asyncio
async def test_the_same_dedupe_id_enqueued_twice_is_stored_once(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("orders")
        first = await client.enqueue("orders", b"one", dedupe_id="order-17")
        second = await client.enqueue("orders", b"one", dedupe_id="order-17")
        assert first == second
        assert await drain(client, "orders") == [b"one"]


@pytest.mark.asyncio
async def test_consume_with_prefetch_delivers_every_message_once(qnode: Any) -> None:
    payloads = [f"c-{i}".encode() for i in range(600)]
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("work")
        await client.enqueue_many("work", payloads)
        seen: list[bytes] = []
        async with client.consume("work", prefetch=50) as messages:
            async for message in messages:
                seen.append(message.payload)
                await message.ack()
                if len(seen) == len(payloads):
                    break
        assert seen == payloads
        stats = await client.queue_stats("work")
    assert stats["depth"] == 0 and stats["total_acked"] == 600


@pytest.mark.asyncio
async def test_a_consumer_gets_messages_enqueued_after_it_subscribed(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("later")
        async with client.consume("later", prefetch=4) as messages:
            await asyncio.sleep(0.1)
            await client.enqueue("later", b"late")
            message = await asyncio.wait_for(messages.__anext__(), 5)
            await message.ack()
    assert message.payload == b"late"


def test_the_sync_client_round_trips_a_message_and_consumes(qnode: Any) -> None:
    with Client(credentials=str(qnode.credentials_path)) as client:
        client.create_queue("sync")
        message_id = client.enqueue("sync", b"plain")
        assert client.enqueue_many("sync", [b"a", b"b"]) == [message_id + 1, message_id + 2]
        [message] = client.receive("sync", wait_s=1.0)
        assert (message.id, message.payload) == (message_id, b"plain")
        message.ack()
        with client.consume("sync", prefetch=2) as consumer:
            taken = [next(consumer), next(consumer)]
            for each in taken:
                each.ack()
        assert [m.payload for m in taken] == [b"a", b"b"]
        assert client.queue_stats("sync")["depth"] == 0
        client.enqueue("sync", b"long")
        [long_job] = client.receive("sync", wait_s=1.0, visibility_timeout_s=0.5)
        with long_job.keep_alive(visibility_timeout_s=0.5, every_s=0.15) as keeper:
            time.sleep(1.2)                                    # the job outlives the 0.5 s lease
            assert client.receive("sync") == []
        assert keeper.lost is None
        long_job.extend(5.0)
        long_job.ack()


@pytest.mark.asyncio
async def test_a_two_way_reply_reaches_the_producer_through_message_status(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("rpc", type="two_way")
        message_id = await client.enqueue("rpc", b"question")
        [message] = await client.receive("rpc", wait_s=1.0)
        await client.reply("rpc", message.id, message.receipt, b"answer")
        status = await client.message_status("rpc", message_id, wait_s=2.0, until="replied")
    assert status["state"] == "replied"
    assert status.get("reply_b64") == "YW5zd2Vy"


# --- failures -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_retried_enqueue_after_reconnect_is_stored_once_and_none_acknowledged_is_lost(qnode: Any) -> None:
    """Producers keep enqueueing while the node is killed (-9) and restarted; the client
    resends what was in flight with the same dedupe ids."""
    acknowledged: list[bytes] = []
    async with AsyncClient(credentials=str(qnode.credentials_path), reconnect_delay_max_s=0.2) as client:
        await client.create_queue("durable")
        stop = asyncio.Event()

        async def producer(number: int) -> None:
            sequence = 0
            while not stop.is_set():
                payload = f"{number}-{sequence}".encode()
                await client.enqueue("durable", payload)
                acknowledged.append(payload)
                sequence += 1

        producers = [asyncio.ensure_future(producer(n)) for n in range(20)]
        await asyncio.sleep(0.5)
        before_kill = len(acknowledged)
        await asyncio.to_thread(qnode.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(qnode.start)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*producers)
        assert len(acknowledged) > before_kill > 0
        stored = await drain(client, "durable")
    assert set(acknowledged) <= set(stored), "an acknowledged enqueue was lost"
    assert len(stored) == len(set(stored)), "a retried enqueue was stored twice"


@pytest.mark.asyncio
async def test_a_receive_in_flight_when_the_node_dies_fails_as_outcome_unknown(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path), reconnect_delay_max_s=0.2) as client:
        await client.create_queue("idle")
        waiting = asyncio.ensure_future(client.receive("idle", wait_s=30))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(qnode.kill)
        with pytest.raises(QueueError) as caught:
            await waiting
        assert caught.value.code == "E_UNAVAILABLE" and caught.value.outcome_unknown
        await asyncio.to_thread(qnode.start)
        await client.enqueue("idle", b"back")  # reconnects by itself
        assert await drain(client, "idle") == [b"back"]


@pytest.mark.asyncio
async def test_a_websocket_call_to_a_paused_node_ends_at_its_deadline_with_an_outcome_unknown_timeout(
        qnode: Any) -> None:
    """SIGSTOP: the socket stays open and nothing is answered. Every call ends with a
    retriable E_TIMEOUT after request_timeout_s (a receive's wait added), and the client
    works again once the node resumes."""
    timeout_s = 1.0
    async with AsyncClient(qnode.url, qnode.credentials_path, request_timeout_s=timeout_s) as client:
        await client.create_queue("paused")
        await client.enqueue("paused", b"before")
        qnode.process.send_signal(signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            calls = await asyncio.gather(client.enqueue("paused", b"lost?"), client.receive("paused", wait_s=0.5),
                                         client.ping(), return_exceptions=True)
            elapsed = loop.time() - started
        finally:
            qnode.process.send_signal(signal.SIGCONT)
        for outcome in calls:
            assert isinstance(outcome, QueueError) and outcome.code == "E_TIMEOUT", calls
            assert outcome.retriable and outcome.outcome_unknown
        assert timeout_s <= elapsed < timeout_s + 0.5 + 1.0
        await client.enqueue("paused", b"after")
        # The node took the calls once it resumed (their outcome was unknown, not failed): the
        # enqueue stored "lost?", and the receive leased "before" to an answer nobody read.
        assert (await client.queue_stats("paused"))["depth"] == 3
        payloads = {m.payload for m in await client.receive("paused", max_messages=10, wait_s=1.0)}
        assert payloads == {b"lost?", b"after"}


@pytest.mark.asyncio
async def test_a_client_with_only_the_post_grant_is_forbidden_to_receive(qnode: Any, tmp_path: Path) -> None:
    producer_path = tmp_path / "producer.json"
    code, document, _ = await asyncio.to_thread(run_qctl, qnode, "clients", "add", "producer",
                                                "--grant", "orders*:post", "--out", str(producer_path))
    assert code == 0 and "private_key" not in document
    async with AsyncClient(credentials=str(qnode.credentials_path)) as admin:
        await admin.create_queue("orders")
    async with AsyncClient(credentials=str(producer_path)) as producer:
        await producer.enqueue("orders", b"allowed")
        with pytest.raises(QueueError) as over_websocket:
            await producer.receive("orders")
        with pytest.raises(QueueError) as over_rest:
            await producer.http.receive_http("orders")
        with pytest.raises(QueueError) as elsewhere:
            await producer.enqueue("payments", b"not granted")
    for caught in (over_websocket, over_rest, elsewhere):
        assert caught.value.code == "E_FORBIDDEN" and not caught.value.retriable


@pytest.mark.asyncio
async def test_one_grant_rule_on_rest_and_websocket_get_receives_and_releases_delete_acks_post_reads_status(
        qnode: Any, tmp_path: Path) -> None:
    """docs/PROTOCOL.md "Grants": release gives a leased message back and removes nothing, so
    the `get` that leased it suffices; ack and reply remove it (`delete`), and an ack refused for
    want of it releases the lease instead; a message's status (with a two-way reply) belongs to
    whoever posted it (`post`)."""
    paths = {name: tmp_path / f"{name}.json" for name in ("poster", "taker", "deleter")}
    for name, privileges in (("poster", "post"), ("taker", "get"), ("deleter", "delete")):
        code, _, _ = await asyncio.to_thread(run_qctl, qnode, "clients", "add", name, "--grant",
                                             f"orders:{privileges}", "--out", str(paths[name]))
        assert code == 0
    async with AsyncClient(credentials=str(qnode.credentials_path)) as admin:
        await admin.create_queue("orders")
    async with AsyncClient(credentials=str(paths["poster"])) as poster, \
            AsyncClient(credentials=str(paths["taker"])) as taker, \
            AsyncClient(credentials=str(paths["deleter"])) as deleter:
        first, second = await poster.enqueue("orders", b"one"), await poster.enqueue("orders", b"two")
        assert (await poster.message_status("orders", first))["state"] == "queued"
        over_websocket = (await taker.receive("orders"))[0]
        await taker.release("orders", over_websocket.id, over_websocket.receipt)
        over_rest = await taker.http.receive_http("orders")
        assert over_rest is not None
        await taker.http.release_http("orders", over_rest.message_id, over_rest.receipt)
        leased = (await taker.receive("orders"))[0]
        refusals = []
        for attempt in (taker.ack("orders", leased.id, leased.receipt),
                        taker.http.ack_http("orders", leased.id, leased.receipt),
                        taker.message_status("orders", second),
                        deleter.message_status("orders", second),
                        deleter.receive("orders")):
            with pytest.raises(QueueError) as caught:
                await attempt
            refusals.append(caught.value)
        assert [refusal.code for refusal in refusals] == ["E_FORBIDDEN"] * 5
        assert f"message {leased.id} was released instead" in refusals[0].message
        assert f"releasing message {leased.id} failed too (E_LEASE_EXPIRED" in refusals[1].message
        again = (await taker.receive("orders"))[0]          # released by the refused ack: at once
        assert again.id == leased.id
        await deleter.ack("orders", again.id, again.receipt)
        assert (await poster.message_status("orders", leased.id))["state"] == "acked"


@pytest.mark.asyncio
async def test_a_removed_client_is_disconnected_and_does_not_reconnect(qnode: Any, tmp_path: Path) -> None:
    worker_path = tmp_path / "worker.json"
    code, document, _ = await asyncio.to_thread(run_qctl, qnode, "clients", "add", "worker",
                                                "--grant", "*:post,get", "--out", str(worker_path))
    assert code == 0
    async with AsyncClient(credentials=str(qnode.credentials_path)) as admin:
        await admin.create_queue("orders")
        async with AsyncClient(credentials=str(worker_path)) as worker:
            await worker.enqueue("orders", b"before")
            await admin.remove_client(document["id"])
            with pytest.raises(QueueError) as caught:
                for _ in range(50):
                    await worker.ping()
                    await asyncio.sleep(0.05)
            assert caught.value.code == "E_UNAUTHENTICATED"
            assert not worker.connected


@pytest.mark.asyncio
async def test_a_consumer_of_a_deleted_queue_ends_with_unknown_queue(qnode: Any) -> None:
    async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
        await client.create_queue("doomed")
        async with client.consume("doomed", prefetch=4) as messages:
            await client.ping()
            await client.delete_queue("doomed")
            with pytest.raises(QueueError) as caught:
                await asyncio.wait_for(messages.__anext__(), 5)
    assert caught.value.code == "E_UNKNOWN_QUEUE"


# --- qctl -----------------------------------------------------------------------------------------
def test_qctl_manages_queues_and_messages_end_to_end_with_json(qnode: Any) -> None:
    assert run_qctl(qnode, "queue", "create", "jobs", "--strength", "full", "--max-depth", "100",
                    "--dead-letter")[0] == 0
    code, put, _ = run_qctl(qnode, "put", "jobs", "payload one", "--priority", "7", "--dedupe-id", "job-1")
    assert code == 0 and put["id"] == 1
    assert run_qctl(qnode, "put", "jobs", "again", "--dedupe-id", "job-1")[1]["id"] == 1
    code, stats, _ = run_qctl(qnode, "queue", "stats", "jobs")
    assert stats["depth"] == 1 and stats["options"]["max_depth"] == 100
    code, got, _ = run_qctl(qnode, "get", "jobs", "--wait-s", "1", "--visibility-timeout-s", "30")
    assert (got["id"], got["payload"], got["priority"], got["acked"]) == (1, "payload one", 7, False)
    assert run_qctl(qnode, "ack", "jobs", str(got["id"]), got["receipt"]) == (0, {"queue": "jobs", "acked": 1}, "")
    assert run_qctl(qnode, "get", "jobs")[1] is None
    names = [q["name"] for q in run_qctl(qnode, "queue", "list")[1]["queues"]]
    assert "jobs" in names
    code, status, _ = run_qctl(qnode, "status")
    assert status["cluster"]["nodes"][0]["state"] == "up" and "jobs" in status["cluster"]["queues"]
    assert run_qctl(qnode, "queue", "delete", "jobs")[0] == 0
    code, document, err = run_qctl(qnode, "queue", "stats", "jobs")
    assert code == 1 and document["error"]["code"] == "E_UNKNOWN_QUEUE"
    assert err.startswith("error: E_UNKNOWN_QUEUE: ")


def test_qctl_and_rest_extend_a_lease_and_refuse_a_bad_extension_with_a_stable_code(qnode: Any) -> None:
    run_qctl(qnode, "queue", "create", "slow", "--visibility-timeout-s", "1")
    run_qctl(qnode, "put", "slow", "x")
    code, got, _ = run_qctl(qnode, "get", "slow")
    assert code == 0
    code, extended, _ = run_qctl(qnode, "extend", "slow", str(got["id"]), got["receipt"], "--visibility-timeout-s", "30")
    assert code == 0 and extended == {"queue": "slow", "extended": got["id"], "visibility_timeout_s": 30.0}
    time.sleep(1.5)                                  # past the queue's 1 s: the extension holds
    assert run_qctl(qnode, "get", "slow")[1] is None
    code, document, _ = run_qctl(qnode, "extend", "slow", str(got["id"]), "0" * 16, "--visibility-timeout-s", "5")
    assert code == 1 and document["error"]["code"] == "E_LEASE_EXPIRED"

    async def refusals() -> list[str]:
        async with AsyncClient(credentials=str(qnode.credentials_path)) as client:
            codes = []
            for query in ([("receipt", got["receipt"])],                                   # no duration
                          [("receipt", got["receipt"]), ("visibility_timeout_s", "-1")],
                          [("receipt", got["receipt"]), ("visibility_timeout_s", "9e9")]):
                with pytest.raises(QueueError) as refused:
                    await client.http.request("POST", f"/v1/queues/slow/messages/{got['id']}/extend", query=query)
                codes.append(refused.value.code)
            return codes
    assert asyncio.run(refusals()) == ["E_INVALID_OPTION"] * 3
    assert run_qctl(qnode, "ack", "slow", str(got["id"]), got["receipt"])[0] == 0     # the lease was untouched


def test_qctl_get_with_ack_deletes_the_message(qnode: Any) -> None:
    run_qctl(qnode, "queue", "create", "once")
    run_qctl(qnode, "put", "once", "x")
    code, got, _ = run_qctl(qnode, "get", "once", "--ack")
    assert code == 0 and got["acked"] is True
    assert run_qctl(qnode, "queue", "stats", "once")[1]["depth"] == 0


def test_qctl_clients_add_list_and_remove(qnode: Any, tmp_path: Path) -> None:
    code, added, _ = run_qctl(qnode, "clients", "add", "reader", "--grant", "jobs.*:get,delete",
                              "--grant", "audit:get")
    assert code == 0 and len(added["private_key"]) > 40  # no --out: shown once
    listed = {c["name"]: c for c in run_qctl(qnode, "clients", "list")[1]["clients"]}
    assert listed["reader"]["grants"] == [{"pattern": "jobs.*", "privileges": ["delete", "get"]},
                                          {"pattern": "audit", "privileges": ["get"]}]
    assert run_qctl(qnode, "clients", "remove", added["id"])[0] == 0
    assert "reader" not in {c["name"] for c in run_qctl(qnode, "clients", "list")[1]["clients"]}


def test_the_qctl_command_prints_tables_and_reports_errors_with_exit_codes(qnode: Any) -> None:
    def command(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "client.qctl", "--credentials", str(qnode.credentials_path), *argv],
                              capture_output=True, text=True, cwd=REPOSITORY, timeout=60)
    assert command("queue", "create", "shown").returncode == 0
    assert command("put", "shown", "hello").stdout.strip() == "id: 1"
    status = command("status")
    assert status.returncode == 0
    lines = status.stdout.splitlines()
    assert lines[0].split() == ["NODE", "URL", "STATE"] and lines[1].split() == ["n1", qnode.url, "up"]
    assert any(line.split()[:1] == ["shown"] for line in lines)
    missing = command("queue", "stats", "absent")
    assert missing.returncode == 1 and missing.stderr.startswith("error: E_UNKNOWN_QUEUE: ")
    assert command("queue", "frobnicate").returncode == 2
