"""Per-message headers (issue 14, item 11): a small map of names to strings that the producer
gives a message and every consumer gets with it, through the WebSocket, REST and qctl, into
the dead-letter queue and back by a redrive, and to a member that takes the queue by snapshot."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest

from client import AsyncClient, QueueError
from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.operations import Acked, DeadLettered, Enqueued, Leased
from tests.test_client_integration import run_qctl
from tests.test_failover import map_of, wait_for
from wire.message_input import HEADERS_MAX, checked_headers
from wire.protocol import DeliveredMessage, OkReply, decode_server_frame, encode_frame, messages_from_result

TRACE = {"trace-id": "4bf92f3577b34da6", "content-type": "application/json"}


def test_the_limits_refuse_what_does_not_fit_and_an_empty_map_is_none() -> None:
    assert checked_headers({}) is None and checked_headers(None) is None
    assert checked_headers(TRACE) == TRACE
    for bad in ({"n": 1}, {"": "v"}, {"x" * 65: "v"}, {f"n{i}": "v" for i in range(HEADERS_MAX + 1)},
                {"n": "v" * 4_096}, {"n": "line\nbreak"}, ["n", "v"]):
        with pytest.raises(QueueError) as refused:
            checked_headers(bad)
        assert refused.value.code == "E_INVALID_OPTION"


def test_a_delivery_carries_its_headers_on_the_wire_and_one_without_stays_five_fields() -> None:
    with_headers = DeliveredMessage(7, "r", 4, 1, b"p", TRACE)
    plain = DeliveredMessage(8, "r", 4, 1, b"p")
    frame = encode_frame([OkReply(1, [with_headers, plain])])
    assert [len(row) for row in msgpack.unpackb(frame)[1][0][2]] == [6, 5]
    [reply] = decode_server_frame(frame)
    assert isinstance(reply, OkReply) and messages_from_result(reply.result) == [with_headers, plain]


def test_storage_keeps_headers_with_the_message_into_the_dead_letter_queue_and_drops_them_with_it(
        tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=64 << 20)
    try:
        storage.commit(SealedBatch(operations=[
            Enqueued(1, 1, 4, 0, None, "p", b"a", headers=TRACE), Enqueued(1, 2, 4, 0, None, "p", b"b"),
            Enqueued(1, 3, 4, 0, None, "p", b"c", headers={"k": "v"})]))
        result = storage.commit(SealedBatch(operations=[Leased(1, 1, 4, "r1", 1_000, 1, "c", 0),
                                                        Leased(1, 2, 4, "r2", 1_000, 1, "c", 0)],
                                            payload_reads=[(1, 1), (1, 2)]))
        assert result.payloads == [b"a", b"b"] and result.headers == [TRACE, None]
        storage.commit(SealedBatch(operations=[DeadLettered(1, 1, 4, 1, 2, 1, 0, False), Acked(1, 2, 4, "c", 0, False),
                                               Leased(1, 3, 4, "r3", 1_000, 1, "c", 0), Acked(1, 3, 4, "c", 0, False)]))
        moved = storage.commit(SealedBatch(operations=[Leased(2, 1, 4, "r4", 1_000, 1, "c", 0)], payload_reads=[(2, 1)]))
        assert moved.headers == [TRACE]
        with storage.env.begin() as txn:
            assert txn.stat(storage.db["headers"])["entries"] == 1      # only the dead letter's
    finally:
        storage.close()


@pytest.mark.asyncio
async def test_headers_reach_consumers_the_dead_letter_queue_a_redrive_and_a_new_member(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, {"jobs": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("jobs", strength="full", max_deliveries=1)
        await client.enqueue("jobs", b"one", headers=TRACE)
        await client.enqueue_many("jobs", [b"two", b"three"], headers={"batch": "b7"})
        await client.enqueue("jobs", b"plain")
        received = await client.receive("jobs", max_messages=4, wait_s=1.0)
        assert [(m.payload, m.headers) for m in received] == [
            (b"one", TRACE), (b"two", {"batch": "b7"}), (b"three", {"batch": "b7"}), (b"plain", {})]
        await received[0].release()                        # max_deliveries 1: to jobs.dlq, headers with it
        for message in received[1:]:
            await message.ack()
        [dead] = await client.receive("jobs.dlq", wait_s=2.0)
        assert dead.headers == TRACE
        await dead.release()
        assert (await client.redrive("jobs"))["redriven"] == 1
        await client.move_queue("jobs", "replica", "n3")    # n3 takes the queue by snapshot ...

        async def n3_in_sync() -> bool:
            entry = (await map_of(cluster, "n1"))["queues"]["jobs"]
            return bool(entry["replica"] == "n3" and entry["in_sync"])
        await wait_for(n3_in_sync, 20.0, "n3 in sync")
        await client.handoff("jobs")                         # ... and serves it
        [again] = await client.receive("jobs", wait_s=2.0)
        assert (again.payload, again.headers) == (b"one", TRACE)


def test_qctl_puts_headers_and_get_shows_them(qnode: Any) -> None:
    assert run_qctl(qnode, "queue", "create", "mail")[0] == 0
    code, _, _ = run_qctl(qnode, "put", "mail", "hi", "--header", "to=ops", "--header", "lang=en")
    assert code == 0
    code, got, _ = run_qctl(qnode, "get", "mail", "--ack")
    assert code == 0 and got["headers"] == {"to": "ops", "lang": "en"}
    assert run_qctl(qnode, "put", "mail", "x", "--header", "novalue")[0] == 1
    assert run_qctl(qnode, "queue", "stats", "mail")[1]["depth"] == 0


@pytest.mark.asyncio
async def test_a_numbered_stream_is_stored_once_through_the_websocket_rest_and_a_handoff(qcluster_factory: Any) -> None:
    """x-sequence-key and x-sequence (the forwarder's exactly-once, issue 16): a number sent
    again, under another dedupe id, after the master moved, is answered with the stored id."""
    cluster = qcluster_factory(3, {"root": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("root", strength="full")

        def numbered(number: int) -> dict[str, str]:
            return {"x-sequence-key": "site-7@1", "x-sequence": str(number)}
        ids = [await client.enqueue("root", b"r%d" % n, headers=numbered(n)) for n in (1, 2, 3)]
        assert await client.enqueue("root", b"r2", headers=numbered(2)) == ids[2]     # the stream's last id
        await client.handoff("root")                      # the replica kept the marks: it is master now

        async def enqueue_over_rest() -> int:
            """As a REST caller does: a retriable answer is asked again (n3 may pass the request
            to n2 while n2 still forwards to n1, and fails it when it becomes the master)."""
            for _ in range(50):
                try:
                    return await client.http.enqueue_http("root", b"r3", headers=numbered(3))
                except QueueError as error:
                    if not error.retriable:
                        raise
                    await asyncio.sleep(0.1)
            raise AssertionError("the REST enqueue was refused for 5 s")
        assert await enqueue_over_rest() == ids[2]
        assert (await client.queue_stats("root"))["depth"] == 3
        with pytest.raises(QueueError) as refused:
            await client.enqueue("root", b"r?", headers={"x-sequence-key": "site-7@1", "x-sequence": "x"})
        assert refused.value.code == "E_INVALID_OPTION"
