"""One node's statistics in one call, and a queue's clients counted over the whole cluster
(issue 37 item 3; qserver/api/node_routes.py, `qctl node stats`), on real processes."""
from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError
from client.credentials import Credentials, load_credentials
from client.qctl import main as qctl
from tests.support import RawApi, error_code, raw_session
from tests.test_full_disk_pair import until
from wire.signing import Signer, private_key_from_text

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
TOP_KEYS = {"node", "url", "release", "feature_level", "uptime_s", "queues", "clients", "rates", "storage", "map",
            "loop_lag", "lease", "membership", "inbox_commands"}


def run_qctl(credentials: Any, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(credentials), *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


async def _enqueue_rate_seen(client: AsyncClient) -> bool:
    return bool((await client.node_stats())["rates"]["enqueued_per_s"] > 0)


async def _window_started(client: AsyncClient) -> bool:
    return bool((await client.node_stats())["rates"]["window_s"] > 0)


async def test_a_node_alone_reports_its_statistics_in_every_client_and_refuses_bad_input(qnode) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("jobs")
        await client.create_queue("other")
        # Rates are differences between samples (every second): enqueue once two are taken.
        await until(lambda: _window_started(client), 10, "two rate samples")
        for n in range(20):
            await client.enqueue("jobs", f"m{n}".encode())
        [message] = await client.receive("jobs", wait_s=1)       # a consumer on the WebSocket
        await message.ack()
        await until(lambda: _enqueue_rate_seen(client), 10, "an enqueue rate over the window")
        stats = await client.node_stats()
        assert TOP_KEYS <= set(stats), set(stats)
        assert stats["node"] == "n1" and stats["release"] and stats["uptime_s"] > 0
        mastered = stats["queues"]["mastered"]
        assert {"jobs", "other"} <= set(mastered["names"]) and mastered["count"] == len(mastered["names"])
        assert stats["queues"]["replicated"]["count"] == 0 and stats["queues"]["failed"]["count"] == 0
        assert stats["clients"]["connections"] >= 1 and stats["clients"]["distinct_clients"] == 1
        assert stats["clients"]["producing"] >= 1 and stats["clients"]["consuming"] >= 1
        assert stats["rates"]["acked_per_s"] >= 0 and stats["rates"]["window_s"] > 0
        storage = stats["storage"]
        assert storage["file_bytes"] > 0 and storage["map_bytes"] > 0 and storage["disk_free_bytes"] > 0
        assert storage["full"] is None
        assert stats["lease"]["held"] is True and stats["loop_lag"]["max_s"] >= 0
        assert stats["map"] == {} and stats["membership"] == {}            # a node alone: no map, no Raft
        # The queue's own statistics count its clients here (no other node to ask).
        jobs = await client.queue_stats("jobs")
        assert (jobs["producer_clients"], jobs["consumer_clients"], jobs["remote_clients"]) == (1, 1, 1)
        assert jobs["client_counts_missing"] == [] and jobs["client_counts_nodes"] == ["n1"]

    with Client(qnode.url, qnode.credentials_path) as sync_client:
        assert TOP_KEYS <= set(sync_client.node_stats())
    code, out, err = await asyncio.to_thread(run_qctl, qnode.credentials_path, "node", "stats", "--json")
    assert code == 0, err
    assert TOP_KEYS <= set(json.loads(out))
    code, out, err = await asyncio.to_thread(run_qctl, qnode.credentials_path, "node", "stats")
    assert code == 0, err
    assert out.startswith("node n1 (") and "mastered" in out and "lease: held" in out

    async with raw_session() as session:
        admin = RawApi.for_credentials(session, qnode.credentials_path)
        status, body, _ = await admin.request("GET", "/v1/node", query={"verbose": "1"})
        assert status == 400 and error_code(body) == "E_INVALID_OPTION", body
        status, body, _ = await admin.request("GET", "/v1/node/clients", query={"queue": "no such/name"})
        assert error_code(body) == "E_INVALID_NAME", body
        status, body, _ = await admin.request("GET", "/v1/node", sign=False)
        assert status == 401 and error_code(body) == "E_UNAUTHENTICATED", body
        # A client granted `jobs` alone sees the counts, and only the names its grants cover.
        status, made, _ = await admin.request("POST", "/v1/clients", {"name": f"c{time.monotonic_ns()}",
                                                                      "grants": [{"pattern": "jobs",
                                                                                  "privileges": ["get"]}]})
        assert status == 201, made
        narrow = RawApi(session, admin.url, Signer(made["id"], private_key_from_text(made["private_key"])))
        status, body, _ = await narrow.request("GET", "/v1/node")
        assert status == 200 and body["queues"]["mastered"]["names"] == ["jobs"], body
        assert body["queues"]["mastered"]["count"] >= 2
        status, body, _ = await narrow.request("GET", "/v1/node/clients", query={"queue": "other"})
        assert status == 403 and error_code(body) == "E_FORBIDDEN", body


async def test_a_queues_clients_are_counted_over_the_cluster_and_a_silent_node_is_named(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = await asyncio.to_thread(qcluster_factory, 3, {"jobs": ["n1", "n2"]})
    ca_file = load_credentials(cluster.credentials_path).ca_file
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("jobs")
        worker = await admin.register_client("worker", [{"pattern": "jobs", "privileges": ["post", "get"]}])

        def as_worker(node: str) -> AsyncClient:
            return AsyncClient(cluster.urls[node], Credentials(worker["id"], worker["private_key"], cluster.urls[node],
                                                               ca_file))
        async def known_at(node: str) -> bool:      # the registration reaches each node with the map
            try:
                async with as_worker(node) as probe:
                    await probe.node_stats()
                return True
            except QueueError as error:
                assert error.code == "E_UNAUTHENTICATED", error
                return False
        for node in ("n2", "n3"):
            await until(lambda node=node: known_at(node), 20, f"the worker known at {node}")  # type: ignore[misc]
        async with as_worker("n2") as consumer, as_worker("n3") as producer:
            await producer.enqueue("jobs", b"from n3")
            assert await consumer.receive("jobs", wait_s=10)     # a consumer's socket on n2
            # Each node's own sockets (the client library may also open one to the master itself):
            # the queue's statistics are their sum, asked at n1 (the master), at n2 or n3 (passed
            # on to the master) alike; n2's consumer and n3's producer are counted at n1.
            local = {}
            for node in cluster.ids:
                async with AsyncClient(cluster.urls[node], cluster.credentials_path) as asker:
                    local[node] = await asker.http._json("GET", "/v1/node/clients", query=[("queue", "jobs")])
            assert local["n2"]["consumer_clients"] == 1 and local["n3"]["producer_clients"] == 1, local
            for node in cluster.ids:
                async with AsyncClient(cluster.urls[node], cluster.credentials_path) as asker:
                    stats = await asker.queue_stats("jobs")
                assert stats["producer_clients"] == sum(c["producer_clients"] for c in local.values()), (node, stats)
                assert stats["consumer_clients"] == sum(c["consumer_clients"] for c in local.values()), (node, stats)
                assert stats["remote_clients"] == 1, (node, stats)         # one client id, however many sockets
                assert sorted(stats["client_counts_nodes"]) == ["n1", "n2", "n3"] and stats["client_counts_missing"] == []
            node_stats = await admin.node_stats()
            assert node_stats["membership"]["role"] and node_stats["map"]["queues"] >= 1
            assert node_stats["lease"]["held"] is True and node_stats["lease"]["remaining_ms"] > 0
            assert "jobs" in node_stats["queues"]["mastered"]["names"]
            async with as_worker("n2") as at_replica:
                assert "jobs" in (await at_replica.node_stats())["queues"]["replicated"]["names"]

            await asyncio.to_thread(cluster.kill, "n3")
            stats = await admin.queue_stats("jobs")
            # n3 either did not answer (named) or is already recorded down (not asked): its producer
            # is counted in neither case, and the answer did not wait for it.
            assert "n3" not in stats["client_counts_nodes"], stats
            assert stats["producer_clients"] == local["n1"]["producer_clients"] + local["n2"]["producer_clients"]
            assert stats["consumer_clients"] == local["n1"]["consumer_clients"] + local["n2"]["consumer_clients"]
