"""Publish/subscribe channels (issue 15, items 1-2: the `latest`, `acked` and `durable` classes;
seed 002) on a real 3-node cluster through the client library, REST and qctl."""
from __future__ import annotations

import asyncio
import contextlib
import io
import re
import time
from typing import Any

import msgpack
import pytest

from audit.inputs import read_records
from audit.local import audit_records
from client import AsyncClient, Client
from client.qctl import main as qctl
from qserver.storage.journal_export import export_environment
from tests.support import RawApi, raw_session
from tests.test_client_integration import run_qctl
from wire.errors import QueueError
from wire.protocol import ChannelSubscribeOp, ErrorReply, decode_server_frame, encode_frame


async def code_of(call: Any) -> str:
    with pytest.raises(QueueError) as raised:
        await call
    return raised.value.code


async def wait_for_message(client: AsyncClient, timeout_s: float = 5.0) -> Any:
    return await asyncio.wait_for(client.next_channel_message(), timeout_s)


@pytest.mark.asyncio
async def test_latest_gives_the_last_value_on_subscribe_then_only_the_newest(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as producer, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as reader:
        created = await admin.create_channel("prices")
        assert (created["class"], created["queue"]) == ("latest", "channel:prices")
        await admin.create_channel("news")
        assert await code_of(producer.publish("prices", b"9.99")) == "E_NOT_ADVERTISED"
        await producer.advertise("prices", "news")
        first = await producer.publish("prices", b"10.00")
        answer = await reader.subscribe("prices", "news")              # several at once
        assert answer == {"prices": first, "news": None}
        last = await wait_for_message(reader)
        assert (last.channel, last.id, last.payload, last.resent) == ("prices", first, b"10.00", True)
        ids = [await producer.publish("prices", b"%d" % n) for n in range(5)]
        await asyncio.sleep(0.5)                                       # a slow reader
        assert reader.poll() == ["prices"]
        newest = reader.read("prices")
        assert (newest.id, newest.payload) == (ids[-1], b"4") and reader.read("prices") is None
        await producer.publish("news", b"headline")
        got = await wait_for_message(reader)
        assert (got.channel, got.payload) == ("news", b"headline")
        assert await code_of(reader.subscribe("prices", "nothing")) == "E_UNKNOWN_CHANNEL"   # all or none
        await reader.unsubscribe("prices")
        assert await code_of(reader.subscribe("news", "nothing")) == "E_UNKNOWN_CHANNEL"
        await producer.publish("prices", b"unseen")
        await asyncio.sleep(0.3)
        assert reader.poll() == []                                     # no longer subscribed to prices
        rest = await admin.http.publish_http("news", b"by rest")       # REST: the request is the declaration
        assert (await wait_for_message(reader)).id == rest["id"]


@pytest.mark.asyncio
async def test_acked_reports_who_acknowledged_and_a_subscriber_that_left_fails_it(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n1"], cluster.credentials_path) as first, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as second:
        await admin.create_channel("orders", "acked")
        assert (await admin.typeof("orders"))["class"] == "acked"
        await first.subscribe("orders")
        await second.subscribe("orders")
        await admin.advertise("orders")
        ids = [await admin.publish("orders", b"o%d" % n) for n in range(3)]
        for reader in (first, second):
            got = [await wait_for_message(reader) for _ in ids]
            assert [m.id for m in got] == ids                          # every message, in order
            if reader is first:
                for message in got:
                    await message.ack()
        assert (await admin.report("orders", ids[0]))["state"] == "pending_ack"
        for message in [m for m in got]:
            await message.ack()
        report = await admin.report("orders", ids[0])
        assert (report["state"], report["subscribers"], report["acked"]) == ("delivered", 2, 2)
        later = await admin.publish("orders", b"late")
        await wait_for_message(second)
        await second.close()                                           # leaves without acking
        await asyncio.sleep(0.3)
        assert (await admin.report("orders", later))["state"] == "failed"
        await admin.characterize("orders", "latest")                   # from the next publish on
        newest = await admin.publish("orders", b"now latest")
        assert (await admin.report("orders", newest))["state"] == "delivered"


@pytest.mark.asyncio
async def test_the_last_value_survives_a_failover_and_subscribers_follow_the_channel(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as admin:
        await admin.create_channel("state", resend_interval_s=1.0)
        master = (await admin.typeof("state"))["master"]
        other = next(n for n in cluster.urls if n != master)
        async with AsyncClient(cluster.urls[other], cluster.credentials_path) as producer, \
                AsyncClient(cluster.urls[other], cluster.credentials_path) as reader:
            await producer.advertise("state")
            await reader.subscribe("state")
            kept = await producer.publish("state", b"v1")
            assert (await wait_for_message(reader)).id == kept
            started = time.monotonic()
            resent = await wait_for_message(reader, 3.0)                # the resend interval
            assert (resent.id, resent.resent) == (kept, True) and time.monotonic() - started >= 0.5
            await asyncio.to_thread(cluster.kill, master)
            deadline = time.monotonic() + 30
            while (await admin.typeof("state"))["master"] == master and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            async with AsyncClient(cluster.urls[other], cluster.credentials_path) as newcomer:
                assert await newcomer.subscribe("state") == {"state": kept}      # the last value survived
                assert (await wait_for_message(newcomer)).payload == b"v1"
            newer = await producer.publish("state", b"v2")             # follows the new master
            message = await wait_for_message(reader, 15.0)
            while message.id != newer:
                message = await wait_for_message(reader, 15.0)
            assert message.payload == b"v2"
            await asyncio.to_thread(cluster.start, master)


def test_qctl_and_the_sync_client_run_a_channel(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    code, created, _ = run_qctl(cluster, "channel", "create", "alerts", "--class", "latest")
    assert code == 0 and created["class"] == "latest"
    assert run_qctl(cluster, "channel", "publish", "alerts", "disk full")[0] == 0
    code, heard, _ = run_qctl(cluster, "channel", "listen", "alerts", "--count", "1", "--wait-s", "5")
    assert code == 0 and heard["messages"][0]["payload"] == "disk full" and heard["messages"][0]["resent"]
    with Client(cluster.urls["n2"], cluster.credentials_path) as client:
        client.subscribe("alerts")
        client.next_channel_message(5.0)                              # the last value
        client.advertise("alerts")
        sent = client.publish("alerts", b"cpu hot")
        got = client.next_channel_message(5.0)
        assert got is not None and (got.id, got.payload) == (sent, b"cpu hot")
        assert [c["name"] for c in client.list_channels()] == ["alerts"]
    shown = io.StringIO()
    assert qctl(["--credentials", str(cluster.credentials_path), "status"], stdout=shown, stderr=io.StringIO()) == 0
    assert re.search(r"^alerts +latest", shown.getvalue(), re.M), shown.getvalue()     # qctl status lists channels
    code, typed, _ = run_qctl(cluster, "channel", "typeof", "alerts")
    assert code == 0 and typed["queue"] == "channel:alerts"
    code, kept, _ = run_qctl(cluster, "channel", "create", "jobs", "--class", "durable")
    assert code == 0 and kept["class"] == "durable"
    code, first, err = run_qctl(cluster, "channel", "listen", "jobs", "--durable", "worker", "--count", "1",
                                "--wait-s", "0.5")
    assert code == 1 and first["messages"] == []                      # opened: the backlog starts now
    assert err.startswith("error: E_TIMEOUT: 0 of 1 messages came")   # (and none came: fewer than --count)
    for text in ("one", "two"):
        assert run_qctl(cluster, "channel", "publish", "jobs", text)[0] == 0
    code, listed, _ = run_qctl(cluster, "channel", "subscriptions", "jobs")
    assert code == 0 and [(s["name"], s["waiting"], s["attached"]) for s in listed["subscriptions"]] == \
        [("worker", 2, False)]
    code, heard, _ = run_qctl(cluster, "channel", "listen", "jobs", "--durable", "worker", "--count", "2")
    assert code == 0 and [m["payload"] for m in heard["messages"]] == ["one", "two"]
    code, listed, _ = run_qctl(cluster, "channel", "subscriptions", "jobs")
    assert listed["subscriptions"][0]["waiting"] == 0                  # qctl acknowledged what it printed
    assert run_qctl(cluster, "channel", "drop", "jobs", "worker")[0] == 0
    code, document, _ = run_qctl(cluster, "channel", "drop", "jobs", "worker")
    assert code == 1 and document["error"]["code"] == "E_UNKNOWN_SUBSCRIPTION"
    assert run_qctl(cluster, "channel", "delete", "alerts")[0] == 0
    code, document, _ = run_qctl(cluster, "channel", "typeof", "alerts")
    assert code == 1 and document["error"]["code"] == "E_UNKNOWN_CHANNEL"


@pytest.mark.asyncio
async def test_bad_channel_requests_get_stable_codes_and_change_nothing(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("c1")
        assert await code_of(admin.create_channel("c2", "sometimes")) == "E_INVALID_OPTION"
        assert await code_of(admin.create_channel("c2", "latest", -1)) == "E_INVALID_OPTION"
        assert await code_of(admin.typeof("c2")) == "E_UNKNOWN_CHANNEL"
        assert await code_of(admin.http.publish_http("c2", b"x")) == "E_UNKNOWN_CHANNEL"
        assert await code_of(admin.advertise("c2")) == "E_UNKNOWN_CHANNEL"
        assert await code_of(admin.create_queue("channel:c1")) == "E_RESERVED_NAME"
        assert await code_of(admin.enqueue("channel:c1", b"sneaked")) == "E_RESERVED_NAME"
        assert await code_of(admin.delete_queue("channel:c1")) == "E_RESERVED_NAME"
        async with raw_session() as session:
            raw = RawApi.for_credentials(session, cluster.credentials_path)
            ws = await raw.ws()
            await ws.send_bytes(encode_frame([ChannelSubscribeOp(3, ("c1", "nothing"), True)]))
            [reply] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(reply, ErrorReply) and reply.code == "E_UNKNOWN_CHANNEL"
            await ws.send_bytes(msgpack.packb([1, [[12, 4, "not a list", True]]]))
            [reply] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(reply, ErrorReply) and reply.code == "E_BAD_FRAME"
            await ws.close()
        assert (await admin.typeof("c1"))["subscribers_here"] == 0
        assert (await admin.queue_stats("channel:c1"))["depth"] == 0


async def take(reader: AsyncClient, count: int, timeout_s: float = 10.0) -> list[Any]:
    return [await wait_for_message(reader, timeout_s) for _ in range(count)]


@pytest.mark.asyncio
async def test_a_durable_subscription_keeps_its_backlog_until_acknowledged(qcluster_factory: Any) -> None:
    """One replicated backlog per durable subscription: kept while its reader is away (past the
    trim that a live channel gets), resent until acknowledged, reported, listed and dropped."""
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as producer:
        await admin.create_channel("ledger", "durable", resend_interval_s=1.0)
        await producer.advertise("ledger")
        before = await producer.publish("ledger", b"before anyone")     # in no backlog
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as reader:
            floor = (await reader.subscribe("ledger", durable="audit"))["ledger"]
            assert floor is not None and floor > before
            ids = [await producer.publish("ledger", b"m%d" % n) for n in range(5)]
            got = await take(reader, 5)
            assert [m.id for m in got] == ids and [m.payload for m in got] == [b"m%d" % n for n in range(5)]
            for message in got[:2]:
                await message.ack()
            assert (await producer.report("ledger", ids[0]))["state"] == "delivered"
            assert (await producer.report("ledger", ids[2]))["state"] == "pending_ack"
        # The reader is gone; its subscription is not: 100 more wait for it (a live channel
        # would have been trimmed to its newest messages past 64).
        later = [await producer.publish("ledger", b"l%d" % n) for n in range(100)]
        [listed] = await admin.subscriptions("ledger")
        assert (listed["name"], listed["waiting"], listed["attached"]) == ("audit", 103, False)
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as reader:
            await reader.subscribe("ledger", durable="audit")
            got = await take(reader, 103)
            assert [m.id for m in got] == ids[2:] + later              # in order, from the floor on
            for message in got[1:]:
                await message.ack()
            again = await wait_for_message(reader, 5.0)                  # the one left unacknowledged
            assert (again.id, again.resent) == (ids[2], True)
            await again.ack()
            deadline = time.monotonic() + 5
            while (await admin.subscriptions("ledger"))[0]["waiting"] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert (await admin.subscriptions("ledger"))[0]["waiting"] == 0
            await admin.subscribe("ledger", durable="billing")          # a second one starts from now
            newest = await producer.publish("ledger", b"both")
            for each in (reader, admin):
                assert (await wait_for_message(each)).id == newest
            assert (await producer.report("ledger", newest))["state"] == "pending_ack"
            assert sorted(s["name"] for s in await admin.subscriptions("ledger")) == ["audit", "billing"]
        await admin.drop_subscription("ledger", "audit")
        assert await code_of(admin.drop_subscription("ledger", "audit")) == "E_UNKNOWN_SUBSCRIPTION"
        assert [s["name"] for s in await admin.subscriptions("ledger")] == ["billing"]


@pytest.mark.asyncio
async def test_a_durable_subscription_survives_its_masters_death_and_is_read_by_one_connection(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("events", "durable", resend_interval_s=1.0)
        master = (await admin.typeof("events"))["master"]
        other = next(n for n in cluster.urls if n != master)
        async with AsyncClient(cluster.urls[other], cluster.credentials_path) as producer, \
                AsyncClient(cluster.urls[other], cluster.credentials_path) as reader:
            await producer.advertise("events")
            await reader.subscribe("events", durable="indexer")
            ids = [await producer.publish("events", b"e%d" % n, dedupe_id=f"e{n}") for n in range(20)]
            got = await take(reader, 20)
            for message in got[:10]:
                await message.ack()
            await asyncio.to_thread(cluster.kill, master)
            # The unacknowledged half comes again from the new master (after the reader follows
            # the channel there); what was acknowledged does not.
            seen: list[int] = []
            deadline = time.monotonic() + 30
            while len(set(seen)) < 10 and time.monotonic() < deadline:
                message = await wait_for_message(reader, 30.0)
                seen.append(message.id)
                with contextlib.suppress(QueueError):
                    await message.ack()
            assert set(seen) == set(ids[10:]), seen
            async with AsyncClient(cluster.urls[other], cluster.credentials_path) as thief:
                await thief.subscribe("events", durable="indexer")       # one reader at a time: the newest
                published = await producer.publish("events", b"after")
                assert (await wait_for_message(thief)).id == published
                await asyncio.sleep(0.3)
                assert reader.poll() == []
            await asyncio.to_thread(cluster.start, master)
    # The journals prove it: every message of the subscription's backlog was acknowledged by it
    # or still waits for it, none trimmed before (durable_skipped), on every member.
    journals = cluster.root / "journals"
    for node in cluster.ids:
        export_environment(cluster.root / node / "lmdb", str(journals))
    report = audit_records(read_records([str(journals)]), [])
    assert report["verdict"] == "clean", report["violations"]
    [summary] = [q for i in report["incarnations"] for q in i["queues"] if q["queue"] == "channel:events"]
    durable = summary["durable"]["indexer"]
    assert durable["backlog"] == 21 and durable["acknowledged"] + durable["waiting"] == 21, durable


@pytest.mark.asyncio
async def test_bad_durable_requests_get_stable_codes(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("live")
        await admin.create_channel("kept", "durable")
        assert await code_of(admin.subscribe("live", durable="x")) == "E_INVALID_OPTION"
        assert await code_of(admin.subscribe("kept", durable="not a name")) == "E_INVALID_NAME"
        assert await code_of(admin.drop_subscription("kept", "nobody")) == "E_UNKNOWN_SUBSCRIPTION"
        assert await admin.subscriptions("kept") == []
        assert await code_of(admin.subscriptions("nothing")) == "E_UNKNOWN_CHANNEL"


@pytest.mark.asyncio
async def test_durable_subscriptions_reach_a_rebuilt_replica_in_its_snapshot(qcluster_factory: Any) -> None:
    """The subscriptions are queue state in the channel queue's record: a replica that lost its
    disk takes them over by snapshot, floors and out-of-order acknowledgements included, and
    serves them once it is master."""
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("feed", "durable", resend_interval_s=60)
        described = await admin.typeof("feed")
        master, replica = described["master"], described["replica"]
        third = next(n for n in cluster.urls if n not in (master, replica))
        async with AsyncClient(cluster.urls[third], cluster.credentials_path) as producer, \
                AsyncClient(cluster.urls[third], cluster.credentials_path) as reader:
            await producer.advertise("feed")
            await reader.subscribe("feed", durable="a")
            ids = [await producer.publish("feed", b"f%d" % n) for n in range(10)]
            got = await take(reader, 10)
            await asyncio.to_thread(cluster.wipe, replica)
            for message in got[:4] + got[6:7]:                    # a floor, and one acked out of order
                await message.ack()
            await reader.unsubscribe("feed")
            await asyncio.to_thread(cluster.start, replica)

            async def in_sync() -> bool:
                try:
                    return (await producer.queue_stats("channel:feed"))["replication_state"] == "in_sync"
                except QueueError:       # the rebuilt node learns the clients with the map, a moment later
                    return False
            deadline = time.monotonic() + 30
            while not await in_sync() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert (await producer.queue_stats("channel:feed"))["snapshots_sent"] >= 1
            await asyncio.to_thread(cluster.kill, master)
            deadline = time.monotonic() + 30
            while (await producer.typeof("feed"))["master"] != replica and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            async with AsyncClient(cluster.urls[third], cluster.credentials_path) as again:
                await again.subscribe("feed", durable="a")
                rest = await take(again, 5, 15.0)
                assert [m.id for m in rest] == ids[4:6] + ids[7:]
                [listed] = await again.subscriptions("feed")
                assert (listed["floor"], listed["waiting"]) == (ids[3], 5)
            await asyncio.to_thread(cluster.start, master)
