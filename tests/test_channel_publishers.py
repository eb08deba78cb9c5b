"""Several advertisers of one channel and what a report tells (issue 37 item 11; seed 002
advertise, unadvertise, subscribe, report; docs/PROTOCOL.md "Channels").

Units: who leads (qserver/features/channels/publishers.py) and a report's state
(hub.py Report). One real 3-node cluster through the client library, REST and raw WebSocket
frames: the earliest advertiser leads and a standby's publish is refused E_STANDBY, the
override, the leader's connection lost and unadvertise passing the lead on, REST publishers,
the bound and the feature gate; a late subscriber that acks turns `failed` into `delivered`; a
report keeps the class its message was published under; skip_last_value."""
from __future__ import annotations

from typing import Any

import msgpack
import pytest

from client import AsyncClient
from client.credentials import Credentials, load_credentials
from qserver.features.channels.hub import Report
from qserver.features.channels.publishers import ADVERTISERS_PER_CHANNEL_MAX, Publishers
from tests.support import RawApi, code_of, next_channel_message, raw_session, until
from wire.protocol import AdvertiseOp, ErrorReply, OkReply, decode_server_frame, encode_frame


# --- units ------------------------------------------------------------------------------------------
def test_an_override_leads_and_without_one_every_advertiser_publishes() -> None:
    publishers = Publishers()
    assert publishers.leader("c") is None and publishers.may_publish("c", "a")    # nobody advertised
    publishers.advertise("c", "a")
    publishers.advertise("c", "b")
    assert publishers.leader("c") is None and publishers.may_publish("c", "b")     # none leads: as 0.2.0
    publishers.advertise("c", "a")                          # again: no ill effect (seed 002)
    assert publishers.count("c") == 2
    publishers.advertise("c", "b", leader=True)             # the override
    assert publishers.leader("c") == "b" and not publishers.may_publish("c", "a")
    publishers.advertise("c", "d")
    publishers.withdraw("c", "b")                           # the leader goes: none leads, all publish
    assert publishers.leader("c") is None and publishers.may_publish("c", "a")
    publishers.advertise("c", "d", leader=True)
    publishers.advertise("c", "a", leader=True)             # the most recent override wins
    assert publishers.leader("c") == "a" and not publishers.may_publish("c", "d")
    publishers.withdraw("c", "a")
    assert publishers.leader("c") is None
    publishers.withdraw("c", "d")
    publishers.withdraw("c", "nobody")
    assert publishers.channels == {}


def test_advertisers_are_bounded_per_channel() -> None:
    publishers = Publishers()
    for number in range(ADVERTISERS_PER_CHANNEL_MAX):
        assert publishers.advertise("c", number)
    assert not publishers.advertise("c", "one more") and publishers.count("c") == ADVERTISERS_PER_CHANNEL_MAX
    assert publishers.advertise("c", 3, leader=True) and publishers.leader("c") == 3


def test_a_report_is_judged_by_its_class_and_a_late_ack_turns_failed_into_delivered() -> None:
    assert Report("latest", set()).state() == "delivered"
    pending = Report("acked", {"a", "b"}, {"a"})
    assert pending.state() == "pending_ack"
    pending.acked.add("b")
    assert pending.state() == "delivered"
    failed = Report("acked", {"a"}, failed={"a"})
    assert failed.state() == "failed"
    failed.late.add("z")
    assert failed.state() == "failed"                       # sent to a late subscriber: not yet
    failed.late_acked = True
    assert failed.state() == "delivered"


# --- a real cluster ------------------------------------------------------------------------------------



@pytest.mark.asyncio
async def test_one_advertiser_leads_and_a_standby_takes_over(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("mapping")
        # Below level 3 the override is refused by the client before it is sent.
        assert await code_of(admin.advertise("mapping", leader=True)) == "E_FEATURE_DISABLED"
        await admin.finalize_cluster()
        master = cluster.urls[(await admin.typeof("mapping"))["master"]]
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as first, \
                AsyncClient(cluster.urls["n3"], cluster.credentials_path) as second, \
                AsyncClient(cluster.urls["n1"], cluster.credentials_path) as reader:
            await reader.subscribe("mapping")
            await first.advertise("mapping", leader=True)
            await second.advertise("mapping")
            described = await admin.typeof("mapping")
            assert described["advertisers"] == 2 and described["leader"] is not None
            sent = await first.publish("mapping", b"from the leader")
            assert (await next_channel_message(reader)).id == sent
            assert await code_of(second.publish("mapping", b"standby")) == "E_STANDBY"
            # REST declares its publisher by itself: the leader's client goes out, another is a standby.
            answered = await admin.http.publish_http("mapping", b"by rest")
            assert (await next_channel_message(reader)).id == answered["id"]
            record = await admin.register_client("other", [{"pattern": "mapping", "privileges": ["post"]}])
            async with as_client(cluster, record) as other:
                assert await code_of(other.http.publish_http("mapping", b"not the leader")) == "E_STANDBY"

            # The override: the second takes the lead; the first is a standby now.
            await second.advertise("mapping", leader=True)
            overridden = await second.publish("mapping", b"override")
            assert (await next_channel_message(reader)).payload == b"override" and overridden > sent
            assert await code_of(first.publish("mapping", b"now standby")) == "E_STANDBY"
            # The leader withdraws: none leads, the first publishes again at once.
            await second.unadvertise("mapping")
            assert await code_of(second.publish("mapping", b"withdrawn")) == "E_NOT_ADVERTISED"
            await first.publish("mapping", b"leading again")
            assert (await next_channel_message(reader)).payload == b"leading again"
            await second.unadvertise("mapping")               # not advertised: nothing happens
            # The leader's connection is lost: the standby publishes.
            await second.advertise("mapping")
            await first.advertise("mapping", leader=True)
            assert await code_of(second.publish("mapping", b"standby")) == "E_STANDBY"
            await first.close()
            await until(lambda: _leader_count(admin, "mapping", 1))
            await second.publish("mapping", b"after the leader left")
            assert (await next_channel_message(reader)).payload == b"after the leader left"

        # Raw frames: leader must be a boolean; an unknown channel is refused with its code.
        async with raw_session() as session:
            raw = RawApi(session, master, RawApi.for_credentials(session, cluster.credentials_path).signer)
            ws = await raw.ws()
            await ws.send_bytes(encode_frame([AdvertiseOp(1, ("nothing",), True, True)]))
            [refused] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(refused, ErrorReply) and refused.code == "E_UNKNOWN_CHANNEL"
            await ws.send_bytes(msgpack.packb([1, [[15, 2, ["mapping"], True, "yes"]]]))
            [bad] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(bad, ErrorReply) and bad.code == "E_BAD_FRAME"
            await ws.send_bytes(encode_frame([AdvertiseOp(3, ("mapping",), True, True)]))
            [took] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(took, OkReply)
            status, body, _ = await raw.request("POST", "/v1/channels/mapping/messages", b"rest while led")
            assert status == 201            # the leading socket's client
            await ws.close()
            status, body, _ = await raw.request("GET", "/metrics")
            assert status == 200 and b"qserver_channel_advertisers" in body


def as_client(cluster: Any, record: dict[str, Any]) -> AsyncClient:
    ca_file = load_credentials(cluster.credentials_path).ca_file
    url = cluster.urls["n1"]
    return AsyncClient(url, Credentials(record["id"], record["private_key"], url, ca_file))


async def _leader_count(admin: AsyncClient, channel: str, count: int) -> bool:
    return bool((await admin.typeof(channel))["advertisers"] == count)


@pytest.mark.asyncio
async def test_reports_by_the_published_class_and_a_late_subscriber(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as producer:
        await admin.finalize_cluster()
        await admin.create_channel("orders", "acked")
        await producer.advertise("orders")
        leaver = await AsyncClient(cluster.urls["n3"], cluster.credentials_path).__aenter__()
        await leaver.subscribe("orders")
        sent = await producer.publish("orders", b"order 1")
        await next_channel_message(leaver)
        await leaver.close()                                # left without acknowledging: failed
        await until(lambda: _state(producer, "orders", sent, "failed"))
        # A subscriber joining later gets it as the last value; its ack turns failed into delivered.
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as late:
            await late.subscribe("orders")
            last = await next_channel_message(late)
            assert (last.id, last.resent) == (sent, True)
            await last.ack()
            assert (await producer.report("orders", sent))["state"] == "delivered"
            # Characterized as latest: the message published under acked is still judged as acked.
            pending = await producer.publish("orders", b"order 2")
            await admin.characterize("orders", "latest")
            await until(lambda: _state(producer, "orders", pending, "pending_ack"))
            later = await producer.publish("orders", b"order 3")
            assert (await producer.report("orders", later))["state"] == "delivered"
            assert (await producer.report("orders", pending))["state"] == "pending_ack"

        # skip_last_value: subscribing sends nothing until the next publish (under `acked` every
        # message waits in order, so a last value sent on subscribing would come first).
        await admin.characterize("orders", "acked", skip_last_value=True)
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as quiet:
            answer = await quiet.subscribe("orders")
            assert answer == {"orders": later}
            fresh = await producer.publish("orders", b"order 4")
            assert (await next_channel_message(quiet)).id == fresh


async def _state(producer: AsyncClient, channel: str, message_id: int, state: str) -> bool:
    return bool((await producer.report(channel, message_id))["state"] == state)
