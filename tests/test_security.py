"""Attack tests (issue 32): each performs an attack from the security review against real
nodes on loopback, through the real client library, and checks that it no longer works."""
from __future__ import annotations

import asyncio
import time

import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials

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
