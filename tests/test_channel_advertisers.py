"""Several advertisers of one channel and late acknowledgements where the client library's
routing and the hub's bookkeeping matter (issue 37 item 11; seed 002 advertise, unadvertise,
report; docs/PROTOCOL.md "Channels"). tests/test_channel_publishers.py has the rules themselves.

Here: a report's acknowledgements and departures (a unit); on a real 3-node cluster, a node
below feature level 3 refuses the override itself, an unadvertise from a client whose own node
is the channel's replica reaches the master (the lead passes on, its publishes are refused), an
unadvertise of an unknown channel is refused with its code, after the master dies each
advertiser advertises again at the new master as it publishes (the override's flag included),
and a subscriber that left and subscribes again turns `failed` into `delivered` by acking."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client import AsyncClient
from client.channels import channel_queue
from client.credentials import Credentials, load_credentials
from qserver.features.channels.hub import Report
from qserver.features.channels.publishers import ADVERTISERS_PER_CHANNEL_MAX
from tests.support import RawApi, code_of, next_channel_message, raw_session, until
from wire.errors import QueueError
from wire.protocol import AdvertiseOp, ErrorReply, OkReply, decode_server_frame, encode_frame


async def advertisers(admin: AsyncClient, channel: str) -> tuple[int, str | None]:
    described = await admin.typeof(channel)
    return described.get("advertisers", -1), described.get("leader")


def test_who_acknowledges_and_who_leaves_decide_a_report() -> None:
    report = Report("acked", {"a", "b"})
    report.acknowledged("a")
    report.left("a")                                 # acknowledged, then left: nothing fails
    assert report.state() == "pending_ack"
    report.left("b")
    assert report.state() == "failed" and report.failed == {"b"}
    report.late.add("c")
    report.left("c")                                 # a late subscriber gone unacknowledged: forgotten
    assert report.late == set() and report.state() == "failed"
    report.late.add("b")                             # b subscribes again and is sent it as the last value
    report.acknowledged("b")
    assert report.state() == "delivered"
    steady = Report("acked", {"a"})
    steady.late.add("a")                             # subscribed again while still subscribed
    steady.acknowledged("a")
    assert steady.acked == {"a"} and not steady.late_acked and steady.state() == "delivered"
    steady.left("a")
    assert steady.state() == "delivered"             # one delivered stays so


@pytest.mark.asyncio
async def test_unadvertise_reaches_the_master_from_the_replicas_node(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("feed")
        described = await admin.typeof("feed")
        master, replica = described["master"], described["replica"]
        # Below level 3 the node itself refuses the override (a client that skips its own check).
        async with raw_session() as session:
            raw = RawApi(session, cluster.urls[master], RawApi.for_credentials(session, cluster.credentials_path).signer)
            ws = await raw.ws()
            await ws.send_bytes(encode_frame([AdvertiseOp(1, ("feed",), True, True)]))
            [refused] = decode_server_frame(await ws.receive_bytes())
            assert isinstance(refused, ErrorReply) and refused.code == "E_FEATURE_DISABLED"
            await ws.close()
        assert await advertisers(admin, "feed") == (0, None)      # the refusal changed nothing
        await admin.finalize_cluster()
        third = next(node for node in cluster.urls if node not in (master, replica))
        async with AsyncClient(cluster.urls[replica], cluster.credentials_path) as first, \
                AsyncClient(cluster.urls[third], cluster.credentials_path) as second, \
                AsyncClient(cluster.urls[third], cluster.credentials_path) as reader:
            await reader.subscribe("feed")
            await first.advertise("feed", leader=True)    # its own node is the replica: sent to the master
            await second.advertise("feed")
            assert (await advertisers(admin, "feed"))[0] == 2
            sent = await first.publish("feed", b"first leads")
            assert (await next_channel_message(reader)).id == sent
            assert await code_of(second.publish("feed", b"standby")) == "E_STANDBY"
            await first.unadvertise("feed")
            assert (await advertisers(admin, "feed"))[0] == 1
            sent = await second.publish("feed", b"second leads")     # the lead passed on
            assert (await next_channel_message(reader)).id == sent
            assert await code_of(first.publish("feed", b"withdrawn")) == "E_NOT_ADVERTISED"
            await first.unadvertise("feed")                   # not advertised any more: nothing happens
            assert await code_of(first.unadvertise("nothing")) == "E_UNKNOWN_CHANNEL"
            assert (await advertisers(admin, "feed"))[0] == 1
        await until(lambda: _count_is(admin, "feed", 0))            # the clients' sockets closed
        # The bound, at the master: 64 advertising sockets; the 65th is refused and changes nothing.
        async with raw_session() as session:
            raw = RawApi(session, cluster.urls[master], RawApi.for_credentials(session, cluster.credentials_path).signer)
            sockets = [await raw.ws() for _ in range(ADVERTISERS_PER_CHANNEL_MAX + 1)]
            for number, ws in enumerate(sockets):
                await ws.send_bytes(encode_frame([AdvertiseOp(1, ("feed",), True)]))
                [answer] = decode_server_frame(await ws.receive_bytes())
                if number < ADVERTISERS_PER_CHANNEL_MAX:
                    assert isinstance(answer, OkReply), answer
                else:
                    assert isinstance(answer, ErrorReply) and answer.code == "E_ADVERTISERS_FULL"
            assert await advertisers(admin, "feed") == (ADVERTISERS_PER_CHANNEL_MAX, None)    # none claimed the lead
            await sockets[0].send_bytes(encode_frame([AdvertiseOp(2, ("feed",), True, True)]))   # again: fine
            assert isinstance(decode_server_frame(await sockets[0].receive_bytes())[0], OkReply)
            for ws in sockets:
                await ws.close()
        await until(lambda: _count_is(admin, "feed", 0))            # dropped with the sockets


@pytest.mark.asyncio
async def test_after_a_failover_the_override_takes_the_lead_again_at_the_new_master(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.finalize_cluster()
        await admin.create_channel("state")
        master = (await admin.typeof("state"))["master"]
        others = [node for node in cluster.urls if node != master]
        async with AsyncClient(cluster.urls[others[0]], cluster.credentials_path) as earliest, \
                AsyncClient(cluster.urls[others[1]], cluster.credentials_path) as override, \
                AsyncClient(cluster.urls[others[1]], cluster.credentials_path) as reader:
            await reader.subscribe("state")
            await earliest.advertise("state")
            await override.advertise("state", leader=True)
            before = await override.publish("state", b"before")
            assert (await next_channel_message(reader)).id == before
            assert await code_of(earliest.publish("state", b"standby")) == "E_STANDBY"
            await asyncio.to_thread(cluster.kill, master)
            await until(lambda: _moved(earliest, "state", master))     # (admin's node may be the one killed)
            # The new master knows no advertiser until each publishes there: none leads, so the
            # earliest publishes, until the override's next publish advertises it again, flag included.
            after = await earliest.publish("state", b"earliest, alone at the new master")
            taken = await override.publish("state", b"the override again")
            assert taken > after
            assert await code_of(earliest.publish("state", b"standby again")) == "E_STANDBY"
            seen = [(await next_channel_message(reader)).payload]
            while seen[-1] != b"the override again":
                seen.append((await next_channel_message(reader)).payload)
            assert b"standby again" not in seen
            count, leader = await advertisers(earliest, "state")
            assert count == 2 and leader is not None
        await asyncio.to_thread(cluster.start, master)


async def _count_is(admin: AsyncClient, channel: str, count: int) -> bool:
    return (await advertisers(admin, channel))[0] == count


async def _moved(admin: AsyncClient, channel: str, old_master: str) -> bool:
    try:
        return bool((await admin.typeof(channel))["master"] != old_master)
    except QueueError:
        return False


@pytest.mark.asyncio
async def test_a_subscriber_that_comes_back_and_acks_turns_failed_into_delivered(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("orders", "acked")
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as producer, \
                AsyncClient(cluster.urls["n3"], cluster.credentials_path) as subscriber:
            await producer.advertise("orders")
            await subscriber.subscribe("orders")
            sent = await producer.publish("orders", b"order 1")
            assert (await next_channel_message(subscriber)).id == sent
            await subscriber.unsubscribe("orders")           # left without acknowledging: failed
            await until(lambda: _state(producer, "orders", sent, "failed"))
            # A late subscriber that leaves without acknowledging changes nothing.
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as passing:
                await passing.subscribe("orders")
                assert (await next_channel_message(passing)).id == sent
            assert (await producer.report("orders", sent))["state"] == "failed"
            # The same connection subscribes again, is sent it as the last value and acks it.
            await subscriber.subscribe("orders")
            again = await next_channel_message(subscriber)
            assert (again.id, again.resent) == (sent, True)
            await again.ack()
            assert (await producer.report("orders", sent))["state"] == "delivered"


async def _state(producer: AsyncClient, channel: str, message_id: int, state: str) -> bool:
    return bool((await producer.report(channel, message_id))["state"] == state)


@pytest.mark.asyncio
async def test_the_override_survives_its_socket_being_replaced(qcluster_factory: Any) -> None:
    """Sessions end every 1.5 s (E_SESSION_EXPIRED): each client's socket is replaced, and the
    library advertises again on the new one, the override's `leader` flag included."""
    cluster = qcluster_factory(3, None, {"websocket_session_max_s": 1.5})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.finalize_cluster()
        await admin.create_channel("lead")
        grants = [{"pattern": "lead", "privileges": ["post", "get"]}]
        a, b = await admin.register_client("instance-a", grants), await admin.register_client("instance-b", grants)
        async with _as(cluster, a) as earliest, _as(cluster, b) as override:
            await earliest.advertise("lead")
            await override.advertise("lead", leader=True)
            socket = override._router.consume_target(channel_queue("lead"))
            first_session = socket.sessions
            await until(lambda: _replaced_and_leading(admin, socket, first_session, b["id"]))
            assert await code_of(earliest.publish("lead", b"standby")) == "E_STANDBY"
            await override.publish("lead", b"still the leader")


async def _replaced_and_leading(admin: AsyncClient, socket: Any, first_session: int, leader: str) -> bool:
    return socket.sessions > first_session and await advertisers(admin, "lead") == (2, leader)


def _as(cluster: Any, record: dict[str, Any]) -> AsyncClient:
    url = cluster.urls["n1"]
    return AsyncClient(url, Credentials(record["id"], record["private_key"], url,
                                        load_credentials(cluster.credentials_path).ca_file))
