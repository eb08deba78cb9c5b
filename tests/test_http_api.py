"""The REST API of a real node: queue semantics end to end through signed HTTP."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio

from qserver.api.http_common import until_map_version
from qserver.storage.rows import SCHEMA_VERSION
from tests.support import RawApi, error_code, raw_session
from wire import versions

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def api(qnode):  # type: ignore[no-untyped-def]
    async with raw_session() as session:
        yield RawApi.for_credentials(session, qnode.credentials_path)


async def put(api: RawApi, queue: str, payload: bytes, priority: int = 4, **headers: str) -> int:
    status, body, _ = await api.request("POST", f"/v1/queues/{queue}/messages", payload,
                                        headers={"X-Priority": str(priority), **headers})
    assert status == 201, body
    return int(body["id"])


async def get(api: RawApi, queue: str, **query: str) -> tuple[int, bytes, dict[str, str]]:
    status, body, headers = await api.request("POST", f"/v1/queues/{queue}/receive", query=query)
    return status, body, dict(headers)


async def test_creating_a_queue_twice_opens_it_and_other_options_are_refused(api: RawApi) -> None:
    status, body, _ = await api.request("PUT", "/v1/queues/orders", {"max_depth": 10, "strength": "full"})
    assert status == 201 and body["created"] and body["incarnation"] >= 1 and body["state"] == "OPEN"
    status, body, _ = await api.request("PUT", "/v1/queues/orders", {"max_depth": 10})
    assert status == 200 and not body["created"]
    status, body, _ = await api.request("PUT", "/v1/queues/orders", {"max_depth": 11})
    assert status == 409 and error_code(body) == "E_OPTIONS_MISMATCH" and "max_depth" in body["error"]["message"]
    status, body, _ = await api.request("PUT", "/v1/queues/orders", {"master_required": True})
    assert status == 409 and error_code(body) == "E_MASTER_EXISTS"


async def test_messages_are_delivered_by_priority_then_by_order_of_arrival(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/work", {})
    for payload, priority in [(b"a4", 4), (b"b9", 9), (b"c0", 0), (b"d9", 9), (b"e4", 4)]:
        await put(api, "work", payload, priority)
    seen = []
    for _ in range(5):
        status, body, headers = await get(api, "work")
        assert status == 200
        seen.append(body)
        assert (await api.request("DELETE", f"/v1/queues/work/messages/{headers['X-Message-Id']}",
                                  query={"receipt": headers["X-Receipt"]}))[0] == 200
    assert seen == [b"b9", b"d9", b"a4", b"e4", b"c0"]
    assert (await get(api, "work"))[0] == 204


async def test_a_waiting_receive_gets_a_message_enqueued_after_it_started(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/slow", {})
    waiting = asyncio.create_task(get(api, "slow", wait_s="5"))
    await asyncio.sleep(0.2)
    message_id = await put(api, "slow", b"late")
    status, body, headers = await asyncio.wait_for(waiting, 5)
    assert status == 200 and body == b"late" and int(headers["X-Message-Id"]) == message_id


async def test_a_stale_receipt_is_refused_and_a_release_redelivers_with_a_higher_count(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/leases", {})
    message_id = await put(api, "leases", b"m")
    _, _, first = await get(api, "leases")
    assert first["X-Deliveries"] == "1"
    status, body, _ = await api.request("DELETE", f"/v1/queues/leases/messages/{message_id}", query={"receipt": "0" * 16})
    assert status == 409 and error_code(body) == "E_LEASE_EXPIRED"
    status, _, _ = await api.request("POST", f"/v1/queues/leases/messages/{message_id}/release",
                                     query={"receipt": first["X-Receipt"]})
    assert status == 200
    _, body, second = await get(api, "leases")
    assert body == b"m" and second["X-Deliveries"] == "2" and second["X-Receipt"] != first["X-Receipt"]
    status, body, _ = await api.request("DELETE", f"/v1/queues/leases/messages/{message_id}",
                                        query={"receipt": first["X-Receipt"]})
    assert status == 409 and error_code(body) == "E_LEASE_EXPIRED"


async def test_an_expired_lease_is_redelivered_and_dead_lettered_after_max_deliveries(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/flaky", {"max_deliveries": 2, "visibility_timeout_s": 0.2})
    message_id = await put(api, "flaky", b"poison")
    for delivery in (1, 2):
        status, _, headers = await get(api, "flaky", wait_s="3")
        assert status == 200 and headers["X-Deliveries"] == str(delivery)
    status, body, headers = await get(api, "flaky.dlq", wait_s="3")
    assert status == 200 and body == b"poison"
    assert (await get(api, "flaky"))[0] == 204
    _, status_body, _ = await api.request("GET", f"/v1/queues/flaky/messages/{message_id}/status")
    assert status_body["state"] == "dead_lettered"
    _, stats, _ = await api.request("GET", "/v1/queues/flaky")
    assert stats["total_dead_lettered"] == 1 and stats["depth"] == 0


async def test_a_full_queue_refuses_enqueues_and_keeps_what_it_holds(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/tiny", {"max_depth": 2})
    await put(api, "tiny", b"1")
    await put(api, "tiny", b"2")
    status, body, _ = await api.request("POST", "/v1/queues/tiny/messages", b"3")
    assert status == 507 and error_code(body) == "E_QUEUE_FULL" and body["error"]["retriable"]
    _, stats, _ = await api.request("GET", "/v1/queues/tiny")
    assert stats["depth"] == 2 and stats["total_enqueued"] == 2


async def test_a_repeated_dedupe_id_returns_the_first_message_id_and_stores_once(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/dedupe", {})
    first = await put(api, "dedupe", b"x", **{"X-Dedupe-Id": "order-17"})
    again = await put(api, "dedupe", b"x", **{"X-Dedupe-Id": "order-17"})
    assert first == again
    _, stats, _ = await api.request("GET", "/v1/queues/dedupe")
    assert stats["depth"] == 1


async def test_a_two_way_producer_waits_for_the_consumers_reply(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/rpc", {"type": "two_way"})
    message_id = await put(api, "rpc", b"question")
    waiting = asyncio.create_task(api.request("GET", f"/v1/queues/rpc/messages/{message_id}/status",
                                              query={"wait_s": "5", "until": "replied"}))
    await asyncio.sleep(0.1)
    _, status_now, _ = await api.request("GET", f"/v1/queues/rpc/messages/{message_id}/status")
    assert status_now["state"] == "queued"
    _, _, headers = await get(api, "rpc")
    status, _, _ = await api.request("POST", f"/v1/queues/rpc/messages/{message_id}/reply", b"answer",
                                     query={"receipt": headers["X-Receipt"]})
    assert status == 200
    _, answer, _ = await asyncio.wait_for(waiting, 5)
    import base64
    assert answer["state"] == "replied" and base64.b64decode(answer["reply_b64"]) == b"answer"


async def test_a_reply_on_a_queue_that_is_not_two_way_is_refused(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/oneway", {})
    message_id = await put(api, "oneway", b"q")
    _, _, headers = await get(api, "oneway")
    status, body, _ = await api.request("POST", f"/v1/queues/oneway/messages/{message_id}/reply", b"a",
                                        query={"receipt": headers["X-Receipt"]})
    assert status == 409 and error_code(body) == "E_WRONG_QUEUE_TYPE"


async def test_a_one_way_enqueue_is_answered_with_202(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/fire", {"type": "one_way"})
    status, body, _ = await api.request("POST", "/v1/queues/fire/messages", b"f")
    assert status == 202 and body["id"] == 1


async def test_deleting_and_recreating_a_queue_starts_a_new_incarnation_from_index_one(api: RawApi) -> None:
    _, created, _ = await api.request("PUT", "/v1/queues/again", {})
    await put(api, "again", b"old")
    await put(api, "again", b"old")
    status, _, _ = await api.request("DELETE", "/v1/queues/again")
    assert status == 200
    status, body, _ = await api.request("GET", "/v1/queues/again")
    assert status == 404 and error_code(body) == "E_UNKNOWN_QUEUE"
    assert (await api.request("GET", "/v1/queues/again.dlq"))[0] == 404
    _, recreated, _ = await api.request("PUT", "/v1/queues/again", {})
    assert recreated["incarnation"] != created["incarnation"]
    assert await put(api, "again", b"new") == 1
    assert (await get(api, "again"))[1] == b"new"


async def test_dead_letter_queues_cannot_be_created_or_deleted_on_their_own(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/parent", {})
    status, body, _ = await api.request("PUT", "/v1/queues/parent.dlq", {})
    assert status == 409 and error_code(body) == "E_RESERVED_NAME"
    status, body, _ = await api.request("DELETE", "/v1/queues/parent.dlq")
    assert status == 409 and error_code(body) == "E_RESERVED_NAME"


async def test_queue_statistics_follow_seed_004_queue_stats(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/stats", {"max_depth": 50})
    for _ in range(3):
        await put(api, "stats", b"s")
    _, _, headers = await get(api, "stats")
    await api.request("DELETE", f"/v1/queues/stats/messages/{headers['X-Message-Id']}", query={"receipt": headers["X-Receipt"]})
    _, stats, _ = await api.request("GET", "/v1/queues/stats")
    assert {k: stats[k] for k in ("state", "depth", "total_enqueued", "total_acked", "highest_depth",
                                  "configured_depth", "in_flight")} == {
        "state": "OPEN", "depth": 2, "total_enqueued": 3, "total_acked": 1, "highest_depth": 3,
        "configured_depth": 50, "in_flight": 0}
    assert {"average_service_ms", "replication_state", "master_status", "producer_clients",
            "consumer_clients", "remote_clients"} <= stats.keys()
    _, listing, _ = await api.request("GET", "/v1/queues")
    assert "stats" in [q["name"] for q in listing["queues"]]


async def test_queues_are_listed_a_page_at_a_time_and_a_bad_limit_or_cursor_is_refused(api: RawApi) -> None:
    for name in ("e", "a", "d", "c", "b"):
        status, body, _ = await api.request("PUT", f"/v1/queues/{name}", {"dead_letter": False})
        assert status == 201, body
    names: list[str] = []
    after = None
    for _ in range(3):
        status, page, _ = await api.request("GET", "/v1/queues", query={"limit": "2", **({"after": after} if after
                                                                                         else {})})
        assert status == 200 and len(page["queues"]) <= 2
        names += [queue["name"] for queue in page["queues"]]
        after = page["next"]
        assert after == (names[-1] if len(names) < 5 else None)
    assert names == ["a", "b", "c", "d", "e"]
    _, page, _ = await api.request("GET", "/v1/queues", query={"after": "bb"})     # need not name a queue
    assert [queue["name"] for queue in page["queues"]] == ["c", "d", "e"] and page["next"] is None
    for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"limit": "1.5"}, {"limit": "-1"},
                  {"limit": "\u00b2"}, {"after": "no good"}, {"after": "x" * 300}):
        status, body, _ = await api.request("GET", "/v1/queues", query=query)
        assert (status, error_code(body)) == (400, "E_INVALID_OPTION"), query
    status, body, _ = await api.request("GET", "/v1/cluster", query={"summary": "1"})
    assert status == 200 and body["counts"] == {"queues": 5} and "queues" not in body
    status, body, _ = await api.request("GET", "/v1/cluster", query={"summary": "yes"})
    assert (status, error_code(body)) == (400, "E_INVALID_OPTION")


async def test_cluster_operations_on_a_node_outside_a_cluster_are_refused_clearly(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/later", {})
    status, body, _ = await api.request("POST", "/v1/queues/later/handoff", {"initiator": "master"})
    assert status == 400 and error_code(body) == "E_INVALID_OPTION"
    status, body, _ = await api.request("POST", "/v1/cluster/rebalance", {})
    assert status == 400 and error_code(body) == "E_INVALID_OPTION"
    status, cluster, _ = await api.request("GET", "/v1/cluster")
    assert status == 200 and cluster["nodes"][0]["id"] == "n1" and cluster["queues"]["later"]["master"] == "n1"


async def test_health_and_metrics_need_no_signature(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/metered", {})
    await put(api, "metered", b"m")
    status, health, _ = await api.request("GET", "/healthz", sign=False)
    assert status == 200 and health["status"] == "ok"
    # What an operator compares during a rolling upgrade (docs/OPERATIONS.md, "Releases and versions").
    assert health["release"] == versions.RELEASE and health["storage_layout"] == SCHEMA_VERSION
    assert health["protocols"]["replication"] == versions.REPLICATION_PROTOCOL.render()
    assert health["feature_levels"] == [versions.OLDEST_FEATURE_LEVEL, versions.FEATURE_LEVEL]
    status, text, _ = await api.request("GET", "/metrics", sign=False)
    text = text.decode()
    for family in ("qserver_queue_depth{queue=\"metered\",role=\"master\"} 1", "qserver_queue_in_flight",
                   'qserver_queue_oldest_message_age_seconds{queue="metered",role="master"} ',
                   'qserver_queue_consumers{queue="metered",role="master"} 0',
                   "qserver_queue_enqueued_total", "qserver_queue_acked_total", "qserver_commit_seconds_bucket",
                   "qserver_commit_batch_operations_bucket", "qserver_loop_lag_seconds_bucket",
                   'qserver_gc_pause_seconds_count{generation="0"}', 'qserver_gc_pause_seconds_bucket{generation="2",'):
        assert family in text


async def test_journal_export_on_demand_writes_parquet_segments_under_the_data_directory(api: RawApi) -> None:
    await api.request("PUT", "/v1/queues/audited", {})
    await put(api, "audited", b"a")
    status, answer, _ = await api.request("POST", "/v1/journal/export", {})
    assert status == 200 and answer["segments_written"] and answer["exported_through"] >= 1, answer
    assert answer["destination"].endswith("journal-export") and answer["pending_records"] == 0


async def test_the_export_process_goes_when_its_node_is_killed(qnode, api: RawApi) -> None:  # type: ignore[no-untyped-def]
    """The export runs in a process of its own (spawned by the node); a SIGKILL of the node
    leaves no orphan behind (tests and supervisors kill nodes all the time)."""
    await api.request("PUT", "/v1/queues/audited", {})
    await put(api, "audited", b"a")
    status, _, _ = await api.request("POST", "/v1/journal/export", {})
    assert status == 200
    children = [int(pid) for pid in Path(f"/proc/{qnode.process.pid}/task/{qnode.process.pid}/children")
                .read_text().split()]
    assert children, "the export ran in a child process"
    await asyncio.to_thread(qnode.kill)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in children):
        assert time.monotonic() < deadline, f"export process {children} outlived its node"
        await asyncio.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"



@pytest.mark.asyncio
async def test_a_request_passed_on_waits_until_the_map_here_has_what_the_passing_node_saw() -> None:
    """A channel created through n1 and at once asked about at its master n2 (proxied): n2
    answers once its map has applied n1's version, not E_UNKNOWN_CHANNEL a command too early."""
    cluster_map = SimpleNamespace(version=7)
    node = SimpleNamespace(engine=SimpleNamespace(pairs=SimpleNamespace(view=SimpleNamespace(
        membership=SimpleNamespace(cluster_map=cluster_map)))))
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, setattr, cluster_map, "version", 8)
    started = loop.time()
    await until_map_version(node, "8")
    assert cluster_map.version == 8 and loop.time() - started >= 0.04
    started = loop.time()
    await until_map_version(node, "not a number")          # a client's own header changes nothing
    await until_map_version(node, "3")                      # behind: no wait
    assert loop.time() - started < 0.05
