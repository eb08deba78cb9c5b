"""Attack tests (issue 32, item 13, and the Low finding on `register_client`): a message's
status and two-way reply belong to its producer, ids never issued have no status, and a
client name is registered once. Real nodes on loopback, the real client library.

The status is a REST call (`GET /v1/queues/{q}/messages/{id}/status`, what
`AsyncClient.message_status` sends); the WebSocket has no status op. A node that is not the
queue's master passes the request on to it, so the attacks run at the master and through
another node both."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials
from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.cluster_map import ClusterMap, PutClient
from replication.operations import Acked, Enqueued, Leased, Operation
from replication.options import QueueOptions
from replication.queue_core import QueueRecord
from replication.store import MemoryStore

pytestmark = pytest.mark.asyncio


async def _refused(attempt: Any) -> str:
    with pytest.raises(QueueError) as caught:
        answer = await attempt
        pytest.fail(f"the status was answered: {answer}")
    return caught.value.code


async def _known_everywhere(cluster: Any, record: dict[str, Any], ca_file: str | None) -> None:
    """Wait until every node has applied the client's registration (the map carries it)."""
    deadline = time.monotonic() + 10
    for node, url in cluster.urls.items():
        while True:
            try:
                async with AsyncClient(url, Credentials(record["id"], record["private_key"], url, ca_file)) as client:
                    await client.http.cluster_summary()
                break
            except QueueError as error:
                if error.code != "E_UNAUTHENTICATED" or time.monotonic() > deadline:
                    raise AssertionError(f"{node} does not know client {record['name']}") from error
                await asyncio.sleep(0.1)


async def test_a_message_status_and_its_reply_are_read_by_its_producer_and_admins_only(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, item 13. Client B, with `post` on the two_way queue `rpc` like producer A,
    read the status of A's message and the consumer's reply to A (a two-way answer meant for A
    alone), at the master and through another node, and even waited on it; and ids that no
    message ever had (past the queue's next id, 0, and under `full` the ids its consumption
    steps took) answered `acked`. Now B gets E_UNKNOWN_MESSAGE, exactly as for an id never
    issued (so ids are not revealed), and those ids answer E_UNKNOWN_MESSAGE; A and an admin
    of the queue still read the status and the reply everywhere."""
    cluster = qcluster_factory(3, {"rpc": ["n1", "n2"]})
    ca_file = load_credentials(cluster.credentials_path).ca_file
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("rpc", type="two_way", strength="full")
        records = {name: await admin.register_client(name, [{"pattern": "rpc", "privileges": privileges}])
                   for name, privileges in (("alice", ["post"]), ("bob", ["post"]), ("worker", ["get", "delete"]),
                                            ("keeper", ["post", "admin"]))}
        for record in records.values():
            await _known_everywhere(cluster, record, ca_file)

        def client(name: str, node: str) -> AsyncClient:
            url = cluster.urls[node]
            return AsyncClient(url, Credentials(records[name]["id"], records[name]["private_key"], url, ca_file))

        async with client("alice", "n1") as alice, client("worker", "n1") as worker:
            answered = await alice.enqueue("rpc", b"what is my balance?")
            pending = await alice.enqueue("rpc", b"and my limit?")
            leased = (await worker.receive("rpc", max_messages=1, wait_s=5.0))[0]
            assert leased.id == answered
            await worker.reply("rpc", leased.id, leased.receipt, b"balance: 1,234.56")
            queued = await alice.enqueue("rpc", b"one more")
            taken_ids = sorted(set(range(1, queued)) - {answered, pending})     # consumption steps under `full`
            assert taken_ids, "under `full` the lease and the reply took ids of their own"
        for node in ("n1", "n3"):              # n1 masters rpc; n3 holds no member and passes it on
            async with client("bob", node) as bob:
                for attempt in (bob.message_status("rpc", answered),
                                bob.message_status("rpc", answered, wait_s=2.0, until="replied"),
                                bob.message_status("rpc", queued),
                                bob.message_status("rpc", queued, wait_s=1.0, until="acked"),
                                bob.http.message_status("rpc", answered)):
                    assert await _refused(attempt) == "E_UNKNOWN_MESSAGE", node
            async with client("alice", node) as alice:
                for never in (queued + 1000, 0, *taken_ids):
                    assert await _refused(alice.message_status("rpc", never)) == "E_UNKNOWN_MESSAGE", (node, never)
            for reader in ("alice", "keeper"):
                async with client(reader, node) as honest:
                    status = await honest.message_status("rpc", answered)
                    assert status["state"] == "replied", (node, reader, status)
                    assert status["reply_b64"] == "YmFsYW5jZTogMSwyMzQuNTY=", (node, reader, status)
                    assert (await honest.message_status("rpc", queued))["state"] == "queued"
            status = await admin.message_status("rpc", answered)     # the cluster's own admin too
            assert status["state"] == "replied"


async def test_a_client_name_registered_concurrently_through_every_node_is_registered_once(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, Low: `register_client`'s name check ran in the handler, before an await, and
    the map applied any PutClient: registrations of one name sent at once (through one node,
    or through several) all passed and made several clients of that name. Now the engine checks
    again in its own thread and the map refuses a second client of a name in log order: exactly
    one registration succeeds, the others get E_CLIENT_EXISTS."""
    cluster = qcluster_factory(3)
    admins = [AsyncClient(url, cluster.credentials_path) for url in cluster.urls.values()]
    try:
        for admin in admins:
            await admin.__aenter__()
        for round_number in range(3):
            name = f"twin-{round_number}"
            outcomes = await asyncio.gather(*(admin.register_client(name, [{"pattern": "twins", "privileges": ["get"]}])
                                              for admin in admins for _ in range(3)), return_exceptions=True)
            made = [outcome for outcome in outcomes if isinstance(outcome, dict)]
            refusals = [outcome for outcome in outcomes if not isinstance(outcome, dict)]
            assert len(made) == 1, (name, outcomes)
            assert all(isinstance(refusal, QueueError) and refusal.code == "E_CLIENT_EXISTS" for refusal in refusals), \
                refusals
            deadline = time.monotonic() + 10
            for admin in admins:              # every node's registry holds the one client of that name
                while True:
                    named = [record for record in await admin.list_clients() if record["name"] == name]
                    if [record["id"] for record in named] == [made[0]["id"]]:
                        break
                    assert time.monotonic() < deadline, (name, named)
                    await asyncio.sleep(0.1)
    finally:
        for admin in admins:
            await admin.__aexit__(None, None, None)


async def test_a_status_row_names_its_producer_and_an_older_row_reads_as_the_admins(tmp_path: Path) -> None:
    """Issue 32, item 13 (storage): the status row of a completed message kept only
    [state, at_ms, reply], so once the message row was gone nothing said whose status and reply
    it was, and any `post` client read them. The row now keeps the producer (from the message
    row, read before it goes); a row written before keeps reading, with no producer: only an
    admin of the queue reads it (qserver/core/engine.py, _check_status)."""
    at_ms = 1_700_000_000_000
    storage = Storage(tmp_path / "db", node_id="n1", map_size_bytes=64 << 20)
    try:
        record = QueueRecord(1, "rpc", QueueOptions(), at_ms, next_index=3).to_json()
        operations: list[Operation] = [
            Enqueued(1, 1, 4, at_ms, None, "c-alice", b"question"),
            Enqueued(1, 2, 4, at_ms, None, "c-alice", b"second question"),
            Leased(1, 1, 4, "r1", 30_000, 1, "c-worker", at_ms),
            Acked(1, 1, 4, "c-worker", at_ms + 1, True, b"answer"),
        ]
        storage.commit(SealedBatch(operations=operations, queue_records={"rpc": record}, next_queue_id=2,
                                   epochs={"rpc": 1}))
        twin = MemoryStore()                       # the in-memory twin answers the same
        twin.apply(operations)
        assert (twin.status_producer(1, 1), twin.status_producer(1, 2), twin.status_producer(1, 3)) == \
            ("c-alice", "c-alice", None)
        with storage.reads():
            assert storage.message_status(1, 1) == ("replied", 0, b"answer")
            assert storage.status_producer(1, 1) == "c-alice"       # the message row is gone: the status row's
            assert storage.message_status(1, 2) == ("queued", 0, None)
            assert storage.status_producer(1, 2) == "c-alice"       # the message row's
        with storage.env.begin(write=True) as txn:                  # a row as written before issue 32
            txn.put((1).to_bytes(8, "big") + (2).to_bytes(8, "big"), msgpack.packb(["acked", at_ms, None]),
                    db=storage.db["status"])
        with storage.reads():
            assert storage.message_status(1, 2) == ("acked", 0, None)
            assert storage.status_producer(1, 2) is None
    finally:
        storage.close()


async def test_the_map_refuses_a_second_client_of_a_name_in_log_order() -> None:
    """Issue 32, Low (`register_client`): the map applied any PutClient, so registrations of
    one name through two nodes (each checked only its own registry) both became clients. The
    second, in log order, is refused now; a client's own update (new grants) still applies."""
    cluster = ClusterMap()
    record = {"id": "c-1", "name": "app", "public_key": "k", "grants": [], "created_ms": 0}
    assert cluster.apply(PutClient("c-1", record))[0].applied
    [second] = cluster.apply(PutClient("c-2", {**record, "id": "c-2"}))
    assert not second.applied and "app" in second.reason
    assert list(cluster.clients) == ["c-1"]
    assert cluster.apply(PutClient("c-1", {**record, "grants": [{"pattern": "q", "privileges": ["get"]}]}))[0].applied
    cluster.apply(PutClient("c-1", None))
    assert cluster.apply(PutClient("c-2", {**record, "id": "c-2"}))[0].applied     # the name is free again
