"""Producers that wait for the consumer (issue 37 item 1; seed 004 One_Way_Acknowledged, Two_Way,
CheckMsgCompletion; docs/PROTOCOL.md, "Producers that wait"), on real `qserver` processes with
the real client library: the wait over the WebSocket (op 21) and REST (`wait`, `wait_s`), the
callback, a wait that runs out, bad input, the per-connection bound, and a wait that survives a
handoff and a kill -9 of the queue's master."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time
from io import StringIO
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError
from client.http import queue_path
from client.qctl import main as qctl_main
from client.waits import Completion
from qserver.dev.devcluster import LocalCluster
from tests.support import raw_session
from tests.test_surveillance import until
from wire.protocol import CompletionWaitOp

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


async def metric(url: str, name: str) -> float:
    async with raw_session() as session, session.get(url + "/metrics") as answer:
        text = await answer.text()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in {url}/metrics"
    return float(found.group(1))


async def take_one(consumer: AsyncClient, queue: str, timeout_s: float = 20.0) -> Any:
    """The next message of `queue`, asked again through a failover (the consumer follows it)."""
    async def taken() -> Any:
        try:
            messages = await consumer.receive(queue, wait_s=0.5)
        except QueueError as error:
            if not error.retriable:
                raise
            return None
        return messages[0] if messages else None
    return await until(taken, f"a message of {queue}", timeout_s)


async def depth(client: AsyncClient, queue: str) -> int:
    return int((await client.queue_stats(queue))["depth"])


# --- one node ----------------------------------------------------------------------------------------
async def test_a_producer_waits_for_the_ack_and_for_the_reply_and_a_callback_hears_once(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as producer, \
            AsyncClient(qnode.url, qnode.credentials_path) as consumer:
        await producer.create_queue("acks", type="one_way_ack")
        await producer.create_queue("rpc", type="two_way")

        waiting = asyncio.create_task(producer.enqueue("acks", b"job", wait="ack", timeout_s=20))
        message = await take_one(consumer, "acks")
        assert not waiting.done()                 # stored, and waiting for the consumer
        await message.ack()
        completion = await asyncio.wait_for(waiting, 10)
        assert isinstance(completion, Completion)
        assert (completion.queue, completion.message_id, completion.outcome) == ("acks", message.id, "acked")
        assert completion.reply is None and completion.completed and completion.error is None

        asked = asyncio.create_task(producer.enqueue("rpc", b"question", wait="reply", timeout_s=20))
        message = await take_one(consumer, "rpc")
        await consumer.reply("rpc", message.id, message.receipt, b"answer")
        completion = await asyncio.wait_for(asked, 10)
        assert (completion.outcome, completion.reply, completion.message_id) == ("replied", b"answer", message.id)

        heard: list[Completion] = []
        done = asyncio.Event()

        def on_complete(completion: Completion) -> None:
            heard.append(completion)
            done.set()
        message_id = await producer.enqueue("acks", b"fire and continue", on_complete=on_complete)
        assert isinstance(message_id, int) and not heard        # returned at once, the wait goes on
        message = await take_one(consumer, "acks")
        await message.ack()
        await asyncio.wait_for(done.wait(), 10)
        assert [(c.message_id, c.outcome) for c in heard] == [(message_id, "acked")]

        # enqueue_many waits for each of its messages.
        many = asyncio.create_task(producer.enqueue_many("acks", [b"a", b"b"], wait="ack", timeout_s=20))
        for _ in range(2):
            await (await take_one(consumer, "acks")).ack()
        assert [c.outcome for c in await asyncio.wait_for(many, 10)] == ["acked", "acked"]
        await asyncio.sleep(0)
        assert len(heard) == 1                   # the callback heard its message once
        assert await metric(qnode.url, "qserver_producer_completions_total") >= 5
        assert await metric(qnode.url, "qserver_producer_waits") == 0


async def test_a_wait_that_runs_out_leaves_the_message_and_bad_waits_store_nothing(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as producer, \
            AsyncClient(qnode.url, qnode.credentials_path) as consumer:
        await producer.create_queue("acks", type="one_way_ack")
        await producer.create_queue("plain")                       # queued_ack: keeps no completion
        await producer.create_queue("rpc", type="two_way")

        started = time.monotonic()
        with pytest.raises(QueueError) as ran_out:
            await producer.enqueue("acks", b"nobody takes it", wait="ack", timeout_s=0.5)
        assert ran_out.value.code == "E_WAIT_TIMEOUT" and "stays in the queue" in ran_out.value.message
        assert 0.5 <= time.monotonic() - started < 5
        message = await take_one(consumer, "acks")              # still there
        assert message.payload == b"nobody takes it"
        await message.ack()

        # A consumer that acks a two_way message without a reply ends a reply wait too.
        asked = asyncio.create_task(producer.enqueue("rpc", b"q", wait="reply", timeout_s=20))
        await (await take_one(consumer, "rpc")).ack()
        assert (await asyncio.wait_for(asked, 10)).outcome == "acked"

        for queue, kind in (("plain", "ack"), ("plain", "reply"), ("acks", "reply")):
            with pytest.raises(QueueError) as refused:
                await producer.enqueue(queue, b"x", wait=kind)
            assert refused.value.code == "E_WAIT_UNSUPPORTED", refused.value
        with pytest.raises(ValueError):
            await producer.enqueue("acks", b"x", wait="done")
        with pytest.raises(ValueError):
            await producer.enqueue("acks", b"x", wait="ack", timeout_s=0)
        with pytest.raises(QueueError) as unknown:
            await producer.enqueue("nowhere", b"x", wait="ack")
        assert unknown.value.code == "E_UNKNOWN_QUEUE"
        assert (await depth(producer, "plain"), await depth(producer, "acks")) == (0, 0)      # nothing stored

        # The op itself: a kind it does not know, and an id never issued.
        home = producer._home
        with pytest.raises(QueueError) as bad_kind:
            await home.call(CompletionWaitOp(home.next_id(), "acks", 1, 0, "done"))
        assert bad_kind.value.code == "E_INVALID_OPTION"
        with pytest.raises(QueueError) as never:
            await home.call(CompletionWaitOp(home.next_id(), "acks", 10_000, 0, "ack"))
        assert never.value.code == "E_UNKNOWN_MESSAGE"


async def test_rest_holds_the_enqueue_answer_until_the_reply_and_qctl_waits_too(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("rpc", type="two_way")
        await client.create_queue("plain")
        http = client.http

        async def post(queue: str, query: list[tuple[str, str]], wait_s: float = 0.0) -> dict[str, Any]:
            answer = await http.request("POST", queue_path(queue, "messages"), body=b"question", query=query,
                                        headers={"Content-Type": "application/octet-stream"}, idempotent=False,
                                        wait_s=wait_s)
            return dict(answer.json())

        asked = asyncio.create_task(post("rpc", [("wait", "reply"), ("wait_s", "20")], 20))
        message = await take_one(client, "rpc")
        await client.reply("rpc", message.id, message.receipt, b"answer")
        answer = await asyncio.wait_for(asked, 10)
        assert answer["id"] == message.id and answer["state"] == "replied" and answer["completed"] is True
        assert base64.b64decode(answer["reply_b64"]) == b"answer"

        answer = await post("rpc", [("wait", "ack"), ("wait_s", "0.3")], 0.3)
        assert answer["completed"] is False and answer["state"] == "queued"      # stored, not yet taken
        await (await take_one(client, "rpc")).ack()

        for query, code in (([("wait", "done")], "E_INVALID_OPTION"),
                            ([("wait", "ack"), ("wait_s", "61")], "E_INVALID_OPTION"),
                            ([("wait_s", "5")], "E_INVALID_OPTION")):
            with pytest.raises(QueueError) as refused:
                await post("rpc", query)
            assert refused.value.code == code, (query, refused.value)
        with pytest.raises(QueueError) as unsupported:
            await post("plain", [("wait", "ack"), ("wait_s", "1")])
        assert unsupported.value.code == "E_WAIT_UNSUPPORTED"
        assert (await depth(client, "rpc"), await depth(client, "plain")) == (0, 0)

        # qctl put --wait reply --json
        out, err = StringIO(), StringIO()
        qctl = asyncio.create_task(asyncio.to_thread(
            qctl_main, ["--json", "--credentials", str(qnode.credentials_path), "put", "rpc", "ping", "--wait", "reply",
                        "--timeout-s", "20"], stdout=out, stderr=err))
        message = await take_one(client, "rpc")
        await client.reply("rpc", message.id, message.receipt, b"pong")
        assert await asyncio.wait_for(qctl, 20) == 0, err.getvalue()
        shown = json.loads(out.getvalue())
        assert (shown["id"], shown["state"], shown["reply"]) == (message.id, "replied", "pong")
        out, err = StringIO(), StringIO()
        code = await asyncio.to_thread(qctl_main, ["--json", "--credentials", str(qnode.credentials_path), "put", "rpc",
                                                   "late", "--wait", "ack", "--timeout-s", "0.3"],
                                       stdout=out, stderr=err)
        assert code != 0 and "E_WAIT_TIMEOUT" in out.getvalue() + err.getvalue()
        assert await depth(client, "rpc") == 1


async def test_waits_a_connection_holds_are_bounded(qnode_factory: Any, tmp_path: Any) -> None:
    config = tmp_path / "bounded.toml"
    config.write_text("[node]\nlisteners_per_connection_max = 2\n")
    node = qnode_factory("bounded", ["--config", str(config)])
    await asyncio.to_thread(node.start)
    async with AsyncClient(node.url, node.credentials_path) as client:
        await client.create_queue("acks", type="one_way_ack")
        ids = await client.enqueue_many("acks", [b"1", b"2", b"3"])
        home = client._home
        held = [asyncio.create_task(home.call(CompletionWaitOp(home.next_id(), "acks", ids[n], 5_000, "ack")))
                for n in range(2)]

        async def two_held() -> bool:
            return await metric(node.url, "qserver_producer_waits") == 2
        await until(two_held, "two waits held")
        with pytest.raises(QueueError) as over:
            await home.call(CompletionWaitOp(home.next_id(), "acks", ids[2], 5_000, "ack"))
        assert over.value.code == "E_OVERLOADED"
        # Answered, they give their places back: a third wait is held again.
        messages = await client.receive("acks", max_messages=3, wait_s=1)
        await asyncio.gather(*(m.ack() for m in messages))
        assert [(await task)["state"] for task in held] == ["acked", "acked"]
        third = await home.call(CompletionWaitOp(home.next_id(), "acks", ids[2], 5_000, "ack"))
        assert third["state"] == "acked"

        # A connection that closes takes its waits with it (not at their 60 s deadline).
        another = await client.enqueue("acks", b"4")
        leaving = AsyncClient(node.url, node.credentials_path)
        await leaving.connect()
        lost = asyncio.create_task(leaving._home.call(CompletionWaitOp(leaving._home.next_id(), "acks", another,
                                                                       60_000, "ack")))

        async def held(count: int) -> bool:
            return await metric(node.url, "qserver_producer_waits") == count
        await until(lambda: held(1), "the leaving connection's wait held")
        await leaving.close()
        await until(lambda: held(0), "the wait dropped with its connection", timeout_s=10)
        with pytest.raises(QueueError):
            await lost


# --- a cluster: the wait follows the queue's master ----------------------------------------------------
async def test_a_wait_survives_a_handoff_and_completes_at_the_new_master(qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"rpc": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as producer, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as consumer:
        await producer.create_queue("rpc", strength="full", type="two_way")
        await producer.refresh_placement()
        # Below feature level 3 (a cluster that may hold 0.2.0 nodes) op 21 is refused, and the
        # client waits through the REST status call instead.
        home = producer._home
        with pytest.raises(QueueError) as disabled:
            await home.call(CompletionWaitOp(home.next_id(), "rpc", 1, 0, "reply"))
        assert disabled.value.code == "E_FEATURE_DISABLED" and "producer_waits" in disabled.value.message
        asked = asyncio.create_task(producer.enqueue("rpc", b"early", wait="reply", timeout_s=30))
        message = await take_one(consumer, "rpc")
        await consumer.reply("rpc", message.id, message.receipt, b"by status")
        assert (await asyncio.wait_for(asked, 20)).reply == b"by status"
        await producer.finalize_cluster()

        asked = asyncio.create_task(producer.enqueue("rpc", b"question", wait="reply", timeout_s=60))

        async def held_at_n1() -> bool:
            return await metric(cluster.urls["n1"], "qserver_producer_waits") >= 1
        await until(held_at_n1, "the wait held at the master n1")
        assert (await producer.handoff("rpc"))["master"] == "n2"

        async def held_at_n2() -> bool:
            return await metric(cluster.urls["n2"], "qserver_producer_waits") >= 1
        await until(held_at_n2, "the wait asked again at the new master n2")
        assert not asked.done()
        message = await take_one(consumer, "rpc")
        await consumer.reply("rpc", message.id, message.receipt, b"answer")
        completion = await asyncio.wait_for(asked, 20)
        assert (completion.outcome, completion.reply, completion.message_id) == ("replied", b"answer", message.id)
        assert await metric(cluster.urls["n2"], "qserver_producer_completions_total") >= 1


async def test_a_wait_survives_a_kill_of_the_master_and_completes_at_the_new_one(qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3, {"acks": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path, reconnect_delay_max_s=0.2) as producer, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as consumer:
        await producer.create_queue("acks", strength="full", type="one_way_ack")
        await producer.refresh_placement()
        await producer.finalize_cluster()
        waiting = asyncio.create_task(producer.enqueue("acks", b"job", wait="ack", timeout_s=60))

        async def held_at_n1() -> bool:
            return await metric(cluster.urls["n1"], "qserver_producer_waits") >= 1
        await until(held_at_n1, "the wait held at the master n1")
        await asyncio.to_thread(cluster.kill, "n1")
        message = await take_one(consumer, "acks", timeout_s=40)     # served by n2 once it took over
        assert message.payload == b"job" and not waiting.done()
        await message.ack()
        completion = await asyncio.wait_for(waiting, 30)
        assert (completion.outcome, completion.message_id) == ("acked", message.id)


async def test_the_sync_client_blocks_until_the_ack_and_runs_the_callback_on_its_loop_thread(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as consumer:
        await consumer.create_queue("acks", type="one_way_ack")
        with Client(qnode.url, qnode.credentials_path) as producer:
            waiting = asyncio.create_task(asyncio.to_thread(producer.enqueue, "acks", b"sync", wait="ack", timeout_s=20))
            message = await take_one(consumer, "acks")
            await message.ack()
            completion = await asyncio.wait_for(waiting, 10)
            assert (completion.message_id, completion.outcome) == (message.id, "acked")

            threads: list[str] = []
            heard = threading.Event()

            def on_complete(done: Completion) -> None:
                threads.append(threading.current_thread().name)
                heard.set()
            message_id = await asyncio.to_thread(producer.enqueue, "acks", b"later", on_complete=on_complete)
            message = await take_one(consumer, "acks")
            assert message.id == message_id
            await message.ack()
            assert await asyncio.to_thread(heard.wait, 10)
            assert threads and threads[0] != threading.current_thread().name
