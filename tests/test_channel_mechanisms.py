"""How a channel's messages travel (issue 37 item 10; seed 002's title claim; docs/PROTOCOL.md
"How a channel's messages travel"): the publisher characterizes its data (size, frequency, loss
tolerance) and the channel's master chooses best effort, staged, point to point or replicated.

Units: the pure rule (qserver/features/channels/transport.py), the attributes' checks and their
map command and snapshot row (replication/map_channels.py). One real 3-node cluster through the
client library, REST, qctl and raw WebSocket frames: the feature-level gate and bad attributes,
each mechanism's path (nothing stored for best effort and point to point, references fetched
for staged), ids not stored ordered apart from stored ones, a relay whose subscriber leaves
before its receipt stored instead, and a subscriber of release 0.2.0 (no offers asked) sent
everything inline while the channel keeps to the stored path for it."""
from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from client import AsyncClient
from client.qctl import main as qctl
from qserver.features.channels.transport import (
    BEST_EFFORT_SIZE_MAX,
    STAGE_FROM,
    Mechanism,
    choose,
    volatile_id,
)
from replication.cluster_map import ChannelEntry, ClusterMap, PutChannel, decode_map, encode_map
from replication.map_channels import attributes_problem, normalized, set_channel_attributes
from replication.map_commands import SetChannelAttributes, decode_command, encode_command
from tests.support import RawApi, code_of, error_code, next_channel_message, raw_session
from wire.channel_ops import ChannelOffer, ChannelOffersOp
from wire.protocol import (
    AdvertiseOp,
    ChannelMessage,
    ChannelSubscribeOp,
    OkReply,
    PublishOp,
    decode_server_frame,
    encode_frame,
)

SMALL_FREQUENT_LOSSY = {"size_bytes": 200, "per_second": 50.0, "loss_tolerant": True}
LARGE = {"size_bytes": 2 * STAGE_FROM}


# --- units ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("delivery_class", "attributes", "subscribers", "takers", "expected"), [
    ("latest", {}, 3, 3, Mechanism.REPLICATED),                          # nobody characterized it
    ("latest", SMALL_FREQUENT_LOSSY, 3, 3, Mechanism.BEST_EFFORT),
    ("latest", SMALL_FREQUENT_LOSSY, 3, 2, Mechanism.REPLICATED),        # a 0.2.0 subscriber keeps it stored
    ("acked", SMALL_FREQUENT_LOSSY, 3, 3, Mechanism.REPLICATED),         # acked data is not lost on purpose
    ("durable", LARGE, 1, 1, Mechanism.REPLICATED),                      # a durable backlog is stored
    ("latest", {**SMALL_FREQUENT_LOSSY, "per_second": 0.5}, 1, 1, Mechanism.REPLICATED),   # not frequent
    ("latest", {**SMALL_FREQUENT_LOSSY, "size_bytes": BEST_EFFORT_SIZE_MAX + 1}, 2, 2, Mechanism.REPLICATED),
    ("latest", {**SMALL_FREQUENT_LOSSY, "loss_tolerant": False}, 2, 2, Mechanism.REPLICATED),
    ("latest", LARGE, 2, 2, Mechanism.STAGED),
    ("acked", LARGE, 0, 0, Mechanism.STAGED),
    ("latest", LARGE, 1, 1, Mechanism.POINT_TO_POINT),
    ("acked", LARGE, 1, 0, Mechanism.STAGED),                            # its one subscriber takes no offers
])
def test_the_mechanism_follows_the_data_and_the_subscribers(delivery_class: str, attributes: dict[str, Any],
                                                            subscribers: int, takers: int,
                                                            expected: Mechanism) -> None:
    assert choose(delivery_class, attributes, subscribers, takers) is expected


def test_ids_not_stored_grow_with_the_clock_and_never_repeat() -> None:
    assert volatile_id(0, 1_000) == 1_000
    assert volatile_id(1_000, 1_000) == 1_001 and volatile_id(5_000, 1_000) == 5_001


def test_attributes_are_checked_and_stored_normalized_behind_the_feature_level() -> None:
    assert attributes_problem({"size_bytes": 10, "per_second": 2, "loss_tolerant": True}) is None
    for bad in ({"size_bytes": -1}, {"size_bytes": 1.5}, {"size_bytes": True}, {"per_second": "9"},
                {"loss_tolerant": 1}, {"colour": "red"}, {"per_second": 2e6}, []):
        assert attributes_problem(bad) is not None, bad
    assert normalized({"per_second": 2, "loss_tolerant": False, "size_bytes": 0}) == {"per_second": 2.0}
    channels = {"c": ChannelEntry("c", "latest")}
    refused = set_channel_attributes(channels, 2, SetChannelAttributes("c", {"size_bytes": 5}))
    assert not refused.applied and "feature level 3" in refused.reason and channels["c"].attributes == {}
    assert set_channel_attributes(channels, 3, SetChannelAttributes("c", {"size_bytes": 5})).applied
    assert not set_channel_attributes(channels, 3, SetChannelAttributes("c", {"size_bytes": 5})).applied  # unchanged
    assert not set_channel_attributes(channels, 3, SetChannelAttributes("c", {"size_bytes": -5})).applied
    assert not set_channel_attributes(channels, 3, SetChannelAttributes("gone", {})).applied
    command = SetChannelAttributes("c", {"loss_tolerant": True})
    assert decode_command(encode_command(command)) == command


def test_a_snapshot_keeps_attributes_and_a_channel_without_any_encodes_as_before() -> None:
    cluster = ClusterMap()
    cluster.channels["plain"] = ChannelEntry("plain", "latest")
    cluster.channels["big"] = ChannelEntry("big", "acked", 0.0, {"size_bytes": 1 << 20})
    again = decode_map(encode_map(cluster))
    assert again.channels["big"].attributes == {"size_bytes": 1 << 20} and again.channels["plain"].attributes == {}
    import msgpack
    rows = msgpack.unpackb(encode_map(cluster), raw=False)
    assert ["plain", "latest", 0.0] in rows[6]          # the row release 0.2.0 reads
    assert PutChannel.TAG == 13 and SetChannelAttributes.TAG == 23


# --- a real cluster ------------------------------------------------------------------------------------
async def run_qctl(url: str, credentials: Any, *argv: str) -> tuple[int, Any]:
    """qctl in-process with --json (it runs its own event loop: in a thread)."""
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(qctl, ["--credentials", str(credentials), "--url", url, "--json", *argv],
                                   stdout=out, stderr=err)
    return code, json.loads(out.getvalue() or err.getvalue() or "null")




async def master_client(admin: AsyncClient, cluster: Any, channel: str) -> tuple[str, str]:
    described = await admin.typeof(channel)
    return described["master"], cluster.urls[described["master"]]


async def metric(raw: RawApi, name: str) -> float:
    status, body, _ = await raw.request("GET", "/metrics")
    assert status == 200
    values = [float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


@pytest.mark.asyncio
async def test_each_mechanism_on_a_real_cluster(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_channel("ticks")
        # Below level 3 the attributes are refused, and nothing changes.
        assert await code_of(admin.characterize("ticks", **SMALL_FREQUENT_LOSSY)) == "E_FEATURE_DISABLED"
        await admin.finalize_cluster()
        assert await code_of(admin.characterize("ticks", size_bytes=-1)) == "E_INVALID_OPTION"
        assert await code_of(admin.characterize("ticks", per_second=float("inf"))) in ("E_INVALID_OPTION",
                                                                                       "E_BAD_REQUEST")
        assert (await admin.typeof("ticks"))["attributes"] == {}
        changed = await admin.characterize("ticks", **SMALL_FREQUENT_LOSSY)
        assert changed["attributes"] == SMALL_FREQUENT_LOSSY and changed["class"] == "latest"
        master, master_url = await master_client(admin, cluster, "ticks")
        async with AsyncClient(master_url, cluster.credentials_path) as at_master:
            assert (await at_master.typeof("ticks"))["mechanism"] == "best_effort"

        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as producer, \
                AsyncClient(cluster.urls["n3"], cluster.credentials_path) as reader:
            await admin.refresh_placement()
            await producer.advertise("ticks")
            await reader.subscribe("ticks")
            sent = await producer.publish("ticks", b"1.01")
            got = await next_channel_message(reader)
            assert (got.id, got.payload) == (sent, b"1.01") and sent > 10**12    # not an ordering index
            assert (await admin.queue_stats("channel:ticks"))["depth"] == 0      # not stored anywhere
            await got.ack()                                                      # nothing to acknowledge: no error
            # A late subscriber gets the last value from the master's memory.
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as late:
                await late.subscribe("ticks")
                last = await next_channel_message(late)
                assert (last.id, last.payload, last.resent) == (sent, b"1.01", True)
            # Characterized again (loss no longer tolerated): stored, with a smaller id, still handed out.
            await admin.characterize("ticks", loss_tolerant=False)
            stored = await producer.publish("ticks", b"1.02")
            got = await next_channel_message(reader)
            assert (got.id, got.payload) == (stored, b"1.02") and stored < sent
            assert (await admin.queue_stats("channel:ticks"))["depth"] >= 1

            # Staged: two subscribers get a reference each and fetch the payload.
            await admin.create_channel("maps", "acked", **LARGE)
            await admin.refresh_placement()
            other = await AsyncClient(cluster.urls["n1"], cluster.credentials_path).__aenter__()
            try:
                await producer.advertise("maps")
                await reader.subscribe("maps")
                await other.subscribe("maps")
                big = bytes(range(256)) * (STAGE_FROM // 128)
                first = await producer.publish("maps", big)
                for client in (reader, other):
                    got = await next_channel_message(client)
                    assert (got.channel, got.id, got.payload) == ("maps", first, big)
                    await got.ack()
                assert (await producer.report("maps", first))["state"] == "delivered"
                maps_master, maps_url = await master_client(admin, cluster, "maps")
                async with raw_session() as session:
                    raw = RawApi(session, maps_url, RawApi.for_credentials(session, cluster.credentials_path).signer)
                    status, body, _ = await raw.request("GET", f"/v1/channels/maps/messages/{first}")
                    assert status == 200 and body == big
                    status, body, _ = await raw.request("GET", "/v1/channels/maps/messages/999999")
                    assert status == 404 and error_code(body) == "E_UNKNOWN_MESSAGE"
                    status, body, _ = await raw.request("GET", "/v1/channels/maps/messages/x1")
                    assert status == 400 and error_code(body) == "E_INVALID_OPTION"
                    status, body, _ = await raw.request("GET", "/v1/channels/nothing/messages/1")
                    assert status == 404 and error_code(body) == "E_UNKNOWN_CHANNEL"
                    assert await metric(raw, 'qserver_channel_publishes_total{mechanism="staged"}') >= 1
            finally:
                await other.__aexit__(None, None, None)

            # Point to point: with one subscriber left, the message is relayed, not stored.
            await asyncio.sleep(0.3)                     # the other's unsubscribe reaches the master
            async with AsyncClient(maps_url, cluster.credentials_path) as at_master:
                assert (await at_master.typeof("maps"))["mechanism"] == "point_to_point"
            depth = (await admin.queue_stats("channel:maps"))["depth"]
            relayed = await producer.publish("maps", big[::-1])
            got = await next_channel_message(reader)
            assert (got.id, got.payload) == (relayed, big[::-1]) and relayed > 10**12
            assert (await admin.queue_stats("channel:maps"))["depth"] == depth

            code, listed = await run_qctl(cluster.urls["n1"], cluster.credentials_path, "channel", "typeof", "maps")
            assert code == 0 and listed["attributes"] == LARGE


@pytest.mark.asyncio
async def test_a_relay_whose_subscriber_leaves_is_stored_and_a_subscriber_without_offers_gets_it_inline(
        qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.finalize_cluster()
        code, created = await run_qctl(cluster.urls["n1"], cluster.credentials_path, "channel", "create", "files",
                                 "--size-bytes", str(STAGE_FROM), "--skip-last-value")
        assert code == 0 and created["attributes"] == {"size_bytes": STAGE_FROM, "skip_last_value": True}
        master, url = await master_client(admin, cluster, "files")
        async with raw_session() as session:
            signer = RawApi.for_credentials(session, cluster.credentials_path).signer
            raw = RawApi(session, url, signer)
            # A subscriber that takes offers, and leaves without acknowledging the relay.
            subscriber = await raw.ws()
            await subscriber.send_bytes(encode_frame([ChannelOffersOp(1), ChannelSubscribeOp(2, ("files",), True)]))
            replies = decode_server_frame(await subscriber.receive_bytes())
            while len(replies) < 2:
                replies += decode_server_frame(await subscriber.receive_bytes())
            assert all(isinstance(reply, OkReply) for reply in replies)
            publisher = await raw.ws()
            await publisher.send_bytes(encode_frame([AdvertiseOp(1, ("files",)), PublishOp(2, "files", b"f" * 100)]))
            [relay] = decode_server_frame(await subscriber.receive_bytes())
            assert isinstance(relay, ChannelOffer) and (relay.kind, relay.size, relay.payload) == \
                ("relay", 100, b"f" * 100)
            await subscriber.close()                        # gone before its receipt: stored instead
            answers: list[Any] = []
            while len(answers) < 2:
                answers += decode_server_frame(await asyncio.wait_for(publisher.receive_bytes(), 10))
            stored_id, _ = answers[1].result
            assert stored_id < relay.message_id             # an ordering index: it was stored
            assert (await admin.queue_stats("channel:files"))["depth"] >= 1

            # A subscriber of release 0.2.0 (asks no offers): stored path, payload inline.
            old = await raw.ws()
            await old.send_bytes(encode_frame([ChannelSubscribeOp(1, ("files",), True)]))
            [answer] = decode_server_frame(await old.receive_bytes())
            assert isinstance(answer, OkReply) and answer.result == {"files": stored_id}   # skip_last_value: no item
            async with AsyncClient(url, cluster.credentials_path) as at_master:
                assert (await at_master.typeof("files"))["mechanism"] == "staged"
            await publisher.send_bytes(encode_frame([PublishOp(3, "files", b"g" * 10)]))
            [message] = decode_server_frame(await asyncio.wait_for(old.receive_bytes(), 10))
            assert isinstance(message, ChannelMessage) and message.payload == b"g" * 10
            # Bad input: a fetch of a channel it may not know, of an id never published.
            status, body, _ = await raw.request("PUT", "/v1/channels/files", {"size_bytes": "big"})
            assert status == 400 and error_code(body) == "E_INVALID_OPTION"
            status, body, _ = await raw.request("PUT", "/v1/channels/files", {"colour": "red"})
            assert status == 400 and error_code(body) == "E_INVALID_OPTION"
            assert (await admin.typeof("files"))["attributes"] == {"size_bytes": STAGE_FROM, "skip_last_value": True}
            for ws in (old, publisher):
                await ws.close()
