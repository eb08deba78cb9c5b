"""Attack tests (issue 32): each performs an attack from the security review against real
nodes on loopback, through the real client library, and checks that it no longer works."""
from __future__ import annotations

import asyncio
import time

import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials
from tests.test_surveillance import until

pytestmark = pytest.mark.asyncio
COMPACT_EVERY = 10          # map commands between two snapshots of the map (the default is 1,000)


async def test_a_client_removed_while_a_node_was_down_is_refused_there_after_it_catches_up_by_a_snapshot(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, item 2. A consumer is removed while n3, the replica of its `producer` queue,
    is down, and enough map commands follow for the log that held the removal to be compacted:
    n3 catches up by the map's snapshot. The snapshot held the clients that exist, and n3 kept
    the removed one with its grants: it went on taking the queue's messages there (a replica
    serves its own consumers under `producer`)."""
    cluster = qcluster_factory(3, {"billing": ["n1", "n3"]}, {"membership_compact_every": COMPACT_EVERY})
    ca_file = load_credentials(cluster.credentials_path).ca_file
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("billing", strength="producer")
        await admin.enqueue_many("billing", [b"invoice %d" % number for number in range(20)])
        record = await admin.register_client("biller", [{"pattern": "billing", "privileges": ["post", "get"]}])

        def as_biller(node: str) -> AsyncClient:
            return AsyncClient(cluster.urls[node], Credentials(record["id"], record["private_key"], cluster.urls[node],
                                                               ca_file))

        deadline = time.monotonic() + 10
        while True:                              # every node knows the client before n3 goes
            try:
                async with as_biller("n3") as biller:
                    taken = await biller.receive("billing", max_messages=1, wait_s=1.0)
                    assert taken, "the replica serves its own consumers"
                break
            except QueueError as error:
                if error.code != "E_UNAUTHENTICATED" or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        await asyncio.to_thread(cluster.stop, "n3")
        await admin.remove_client(record["id"])
        for number in range(2 * COMPACT_EVERY):      # the removal's log entry is compacted away
            await admin.register_client(f"filler-{number}", [{"pattern": "other", "privileges": ["get"]}])
        version = (await admin.http.cluster_summary())["version"]
        await asyncio.to_thread(cluster.start, "n3")
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin_at_n3:
            deadline = time.monotonic() + 20
            while (await admin_at_n3.http.cluster_summary())["version"] < version:
                assert time.monotonic() < deadline, "n3 did not catch up with the map"
                await asyncio.sleep(0.1)
        for node in ("n1", "n2", "n3"):
            with pytest.raises(QueueError) as refused:
                async with as_biller(node) as biller:
                    taken = await biller.receive("billing", max_messages=10, wait_s=1.0)
                    pytest.fail(f"a removed client took {len(taken)} message(s) at {node}")
            assert refused.value.code == "E_UNAUTHENTICATED", (node, refused.value)


def as_client(cluster, record: dict, node: str = "n1") -> AsyncClient:  # type: ignore[no-untyped-def]
    """A client of `cluster` with the credentials `register_client` answered."""
    ca_file = load_credentials(cluster.credentials_path).ca_file
    return AsyncClient(cluster.urls[node], Credentials(record["id"], record["private_key"], cluster.urls[node], ca_file))


async def consume_into(client: AsyncClient, queue: str, recipient: str, taken: list[bytes]) -> None:
    async with client.consume(queue, prefetch=4, recipient=recipient) as messages:
        async for message in messages:
            await message.ack()
            taken.append(message.payload)


@pytest.mark.timeout(120)
async def test_a_client_that_squats_an_alternatives_name_receives_none_of_the_recipients_messages(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, item 1. A client with `get` on a queue of its own subscribed there under the name
    `billing-b`, the alternative of `billing-a` (names any client could list). The name was bound
    to its queue, and when billing-a stopped, the cluster (as `@cluster`, with admin grants) moved
    every `billing` message into the squatter's queue. Now the administrator's chain names the
    alternative's queue: the move goes there, the real billing-b subscribes on it, and the
    squatter takes nothing of `billing`."""
    cluster = qcluster_factory(3, {"billing": ["n1", "n2"], "billing-b": ["n1", "n3"], "squat": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        # A short visibility timeout: the node may read billing-a's closed socket after the
        # invoices arrive, and what it pushed there stays leased to billing-a until it expires.
        await admin.create_queue("billing", strength="full", fault_interval_s=1.0, visibility_timeout_s=3)
        await admin.create_queue("billing-b", strength="full")
        await admin.create_queue("squat", strength="full")
        squatter_record = await admin.register_client("squatter", [{"pattern": "squat", "privileges": ["get", "post"]}])
        squatted: list[bytes] = []
        async with as_client(cluster, squatter_record) as squatter:
            squatting = asyncio.create_task(consume_into(squatter, "squat", "billing-b", squatted))

            async def bound() -> bool:
                return any(r["recipient"] == "billing-b" for r in await admin.recipients())
            await until(bound, "the squatter's name in the map")
            await admin.set_alternatives("billing-a", ["billing-b=billing-b"])
            real_b: list[bytes] = []
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as service_b:
                serving_b = asyncio.create_task(consume_into(service_b, "billing-b", "billing-b", real_b))
                async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as service_a:
                    billing_a: list[bytes] = []
                    serving_a = asyncio.create_task(consume_into(service_a, "billing", "billing-a", billing_a))

                    async def a_subscribed() -> bool:
                        return any(r["recipient"] == "billing-a" for r in await admin.recipients())
                    await until(a_subscribed, "billing-a in the map")
                    serving_a.cancel()          # billing-a stops: not subscribed, it enters fault
                await admin.enqueue_many("billing", [b"invoice %d" % n for n in range(10)])

                async def moved() -> bool:
                    return len(real_b) == 10
                try:
                    await until(moved, "the invoices at the real billing-b", timeout_s=30.0)
                except AssertionError as late:
                    # Failed once in CI (not reproduced alone or under CPU load): say where things stood.
                    stats = {q: {k: v for k, v in (await admin.queue_stats(q)).items()
                                 if k in ("depth", "ready", "in_flight", "delayed", "consumers")}
                             for q in ("billing", "billing-b", "squat")}
                    raise AssertionError(f"{late}; real billing-b got {len(real_b)}, squatter {len(squatted)}; "
                                         f"recipients {await admin.recipients()}; queues {stats}") from None
                serving_b.cancel()
            squatting.cancel()
        assert squatted == [], "the squatter took messages of billing"
        assert sorted(real_b) == sorted(b"invoice %d" % n for n in range(10))


async def test_another_client_cannot_claim_a_producers_stream_numbers_or_dedupe_ids(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, item 3. Any client with `post` on a forward's destination sent one message naming
    the forward's stream (`x-sequence-key`, stamped on every forwarded message) with number
    999999999999: from then on every forwarded message was answered as a repeat, acknowledged at
    the source and stored nowhere. The same with a producer's dedupe id sent first. Streams and
    dedupe ids are now their producer's own."""
    cluster = qcluster_factory(3, {"outbox": ["n1", "n2"], "collect": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("outbox", strength="full")
        await admin.create_queue("collect", strength="full", forward_rate=1000.0)
        await admin.create_forward("f1", "outbox", "collect")
        await admin.enqueue("outbox", b"first")
        [first] = await until(lambda: admin.receive("collect", 1, wait_s=1.0), "the first forwarded message")
        await first.ack()
        stream = first.headers["x-sequence-key"]
        record = await admin.register_client("poster", [{"pattern": "collect", "privileges": ["post"]}])
        async with as_client(cluster, record) as poster:
            await poster.enqueue("collect", b"claim", headers={"x-sequence-key": stream, "x-sequence": "999999999999"})
            await poster.enqueue("collect", b"claim", dedupe_id="order-7")
        await admin.enqueue_many("outbox", [b"forwarded %d" % n for n in range(20)])
        await admin.enqueue("collect", b"order 7 itself", dedupe_id="order-7")
        received: list[bytes] = []

        async def all_arrived() -> bool:
            received.extend(m.payload for m in await admin.receive("collect", 100, wait_s=0.5))
            return len([p for p in received if p.startswith(b"forwarded")]) >= 20
        await until(all_arrived, "every forwarded message in collect", timeout_s=30.0)
        assert sorted(p for p in received if p.startswith(b"forwarded")) == sorted(b"forwarded %d" % n for n in range(20))
        assert b"order 7 itself" in received + [m.payload for m in await admin.receive("collect", 100, wait_s=0.5)]


async def test_a_client_may_neither_set_the_clusters_headers_nor_name_a_reply_queue_it_may_not_post_to(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32, items 3 and 7. A message returned to its sender is enqueued into the queue its
    `reply-to` names; a producer naming a queue it may not post to had the cluster write there
    (for a moved message, as `@cluster`, with admin grants). And a client could set the headers
    the cluster itself sets on the messages it moves (`x-failed-over-from`, `x-origin-producer`,
    ...). Both are refused now, and nothing is stored."""
    cluster = qcluster_factory(3, {"tasks": ["n1", "n2"], "private": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("tasks", strength="full")
        await admin.create_queue("private", strength="full")
        record = await admin.register_client("producer", [{"pattern": "tasks", "privileges": ["post", "get"]}])
        async with as_client(cluster, record) as producer:
            for headers, code in (({"reply-to": "private"}, "E_FORBIDDEN"),
                                  ({"x-origin-producer": "admin"}, "E_RESERVED_HEADER"),
                                  ({"x-failed-over-from": "billing-a"}, "E_RESERVED_HEADER")):
                with pytest.raises(QueueError) as refused:
                    await producer.enqueue("tasks", b"sneaky", headers=headers)
                assert refused.value.code == code, headers
            await producer.enqueue("tasks", b"fine", headers={"reply-to": "tasks"})
        assert (await admin.queue_stats("tasks"))["depth"] == 1
