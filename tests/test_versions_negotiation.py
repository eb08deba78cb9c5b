"""Version negotiation on every link (issue 34, item 3; docs/PROTOCOL.md, "Versions and negotiation").

Pure units for the range and header rules (wire/version_headers.py); two in-process peer
transports for the dialer's and responder's halves (a range with no overlap is refused, and both
sides report why); real nodes for /healthz `links`, the client headers and E_VERSION_MISMATCH;
and a real node of release 0.1.0 (its `git worktree`, run with this environment) in one cluster
with a node of this release: queues mastered on either serve, and this release's client says
"0.1.0 (or older)" on what the old node lacks. That last test is skipped, with the reason, when
the clone lacks the release commit (tests/upgrade_support.py checks the release out).
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from client import AsyncClient, Client, QueueError, qctl
from client import connection as client_connection
from client import http as client_http
from client.credentials import load_credentials
from qserver.dev.devcluster import REPOSITORY, LocalCluster
from qserver.transport.peer_link import HEADER_NONCE, PEER_PATH, auth_headers, dial_handshake
from replication import raft_codec
from replication.messages import AppendAck, MessageError, decode_message, encode_message
from tests import upgrade_support
from tests.conftest import fail_on_unexpected_ends, free_port
from tests.support import raw_session
from tests.test_peers import SECRET, eventually, make_node, url  # noqa: F401  (make_node is a fixture)
from wire import version_headers as vh
from wire import versions
from wire.errors import E_BAD_REQUEST, E_INVALID_OPTION, E_NOT_FOUND, E_UNKNOWN_QUEUE, E_VERSION_MISMATCH
from wire.versions import VersionRange

pytestmark = pytest.mark.timeout(90)


# --- the rules, pure ------------------------------------------------------------------------------
def test_the_highest_common_version_wins_and_none_is_a_mismatch_naming_both_sides() -> None:
    assert VersionRange(8, 9).common(VersionRange(7, 8)) == 8
    assert VersionRange(8, 10).common(VersionRange(9, 12)) == 10
    mine, theirs = vh.Side("0.3.0", VersionRange(9, 10)), vh.Side(None, VersionRange(8, 8))
    with pytest.raises(QueueError) as refused:
        vh.negotiate("replication", mine, theirs)
    assert refused.value.code == E_VERSION_MISMATCH.code
    for named in ("0.3.0", "9-10", "0.1.0 (or older)", "8-8", "replication"):
        assert named in refused.value.message


def test_a_silent_side_speaks_the_versions_of_release_0_1_0() -> None:
    for purpose in ("client", "replication", "membership"):
        side = vh.silent_side(purpose)
        assert side.release is None and side.protocol == versions.SILENT_PEER[purpose]
    assert vh.peer_side("replication", {}) == vh.silent_side("replication")
    assert vh.parse_side(None) == vh.silent_side("client")
    assert vh.check_client(None).release is None      # a 0.1.0 client is served as before


def test_peer_headers_round_trip_and_malformed_ones_are_bad_requests() -> None:
    offer = vh.peer_offer(vh.own_side("replication"))
    assert offer == {vh.PEER_VERSIONS: versions.REPLICATION_PROTOCOL.render(), vh.PEER_RELEASE: versions.RELEASE}
    side = vh.peer_side("replication", offer)
    assert side == vh.Side(versions.RELEASE, versions.REPLICATION_PROTOCOL)
    for bad in ({vh.PEER_VERSIONS: "8-8"}, {vh.PEER_VERSIONS: "eight", vh.PEER_RELEASE: "0.2.0"},
                {vh.PEER_VERSIONS: "9-8", vh.PEER_RELEASE: "0.2.0"}, {vh.PEER_VERSIONS: "8", vh.PEER_RELEASE: "new"}):
        with pytest.raises(QueueError) as refused:
            vh.peer_side("replication", bad)
        assert refused.value.code == E_BAD_REQUEST.code, bad
    # The dialer's reading of the 101: the responder's choice, or the silent responder's versions.
    assert vh.dialer_outcome("membership", {}) == (1, vh.silent_side("membership"))
    chosen, other = vh.dialer_outcome("replication", vh.peer_answer(vh.own_side("replication"), 8))
    assert chosen == 8 and other.release == versions.RELEASE
    with pytest.raises(QueueError) as outside:
        vh.dialer_outcome("replication", {**vh.peer_answer(vh.own_side("replication"), None), vh.PEER_VERSION: "99"})
    assert outside.value.code == E_VERSION_MISMATCH.code


def test_client_headers_parse_and_a_client_without_a_common_range_is_refused() -> None:
    node = vh.parse_side(vh.node_header(2))
    assert (node.release, node.protocol, node.feature_level) == (versions.RELEASE, versions.CLIENT_PROTOCOL, 2)
    assert vh.parse_side("0.9.1; protocol=1-3; future=yes").protocol == VersionRange(1, 3)   # unknown keys ignored
    assert vh.check_client(vh.client_header()).release == versions.RELEASE
    with pytest.raises(QueueError) as mismatch:
        vh.check_client("0.9.0; protocol=7-9")
    assert mismatch.value.code == E_VERSION_MISMATCH.code and "7-9" in mismatch.value.message
    for bad in ("0.2.0", "0.2.0; protocol", "0.2.0; protocol=x", "banana; protocol=1-1", "0.2.0; protocol=1; feature-level=z",
                "0.2.0; protocol=1-1" + " " * 300):
        with pytest.raises(QueueError) as refused:
            vh.check_client(bad)
        assert refused.value.code == E_BAD_REQUEST.code, bad


def test_an_older_node_error_says_so_and_keeps_its_code() -> None:
    lacking = QueueError(E_NOT_FOUND, "no route POST /v1/cluster/finalize")
    explained = vh.explain_older_node(lacking, None, "POST /v1/cluster/finalize")
    assert explained.code == E_NOT_FOUND.code
    assert explained.message.startswith("the node runs qserver 0.1.0 (or older), which does not support POST "
                                        "/v1/cluster/finalize; upgrade the cluster")
    assert vh.explain_older_node(QueueError(E_INVALID_OPTION, "unknown options: dlq_x"), "0.1.0", "PUT /q").message \
        .startswith("the node runs qserver 0.1.0, which does not support an option or value of PUT /q")
    out_of_range = QueueError(E_INVALID_OPTION, "max_priority must be at most 9")
    assert vh.explain_older_node(out_of_range, None, "PUT /q") is out_of_range            # the caller's mistake
    assert vh.explain_older_node(lacking, versions.RELEASE, "POST /x") is lacking        # same release: as is
    other = QueueError(E_UNKNOWN_QUEUE, "no queue")
    assert vh.explain_older_node(other, None, "GET /q") is other                         # not about a lack


def test_codecs_take_the_version_and_read_every_version_of_this_range() -> None:
    message = AppendAck("q", 1, 2, 3, 4)
    data = encode_message(message, versions.REPLICATION_PROTOCOL.high)
    assert msgpack.unpackb(data)[0] == versions.REPLICATION_PROTOCOL.high
    assert decode_message(data) == message
    with pytest.raises(ValueError):
        encode_message(message, versions.REPLICATION_PROTOCOL.high + 1)
    row = msgpack.unpackb(data)
    with pytest.raises(MessageError, match="speaks"):
        decode_message(msgpack.packb([versions.REPLICATION_PROTOCOL.high + 1, *row[1:]]))
    join = raft_codec.JoinRequest("n2", b"disk", True)
    assert raft_codec.decode_frame(raft_codec.encode_frame(join, versions.MEMBERSHIP_PROTOCOL.low)) == join
    with pytest.raises(MessageError):
        raft_codec.decode_frame(msgpack.packb([versions.MEMBERSHIP_PROTOCOL.high + 1, 20, "n2", b"disk", True]))


# --- the peer transport's two halves, in process ----------------------------------------------------
@pytest.mark.asyncio
async def test_peer_transports_negotiate_and_a_range_without_overlap_is_refused_on_both_sides(make_node, caplog) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    caplog.set_level(logging.WARNING, logger="qserver.transport.peers")
    port1, port2 = free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2)})
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    await eventually(lambda: n1.transport.is_up("n2") and n2.transport.is_up("n1"))
    for mine, peer in ((n1, "n2"), (n2, "n1")):
        assert mine.transport.link_versions()[peer] == {"up": True, "version": versions.REPLICATION_PROTOCOL.high,
                                                        "release": versions.RELEASE, "refused": None}
        assert mine.transport.version(peer) == versions.REPLICATION_PROTOCOL.high

    # A dialer of a future release that speaks only 99: refused, and both sides say why.
    port3, port4 = free_port(), free_port()
    n3 = await make_node("n3", port3, {"n4": url(port4)}, start=False)
    n3.transport._mine = vh.Side("9.0.0", VersionRange(99, 99))
    n4 = await make_node("n4", port4, {"n3": url(port3)})
    await n3.start()
    await eventually(lambda: n3.transport.link_versions()["n4"]["refused"] is not None
                     and n4.transport.link_versions()["n3"]["refused"] is not None)
    await asyncio.sleep(0.3)            # a few redials: still no link
    for side, peer in ((n3, "n4"), (n4, "n3")):
        state = side.transport.link_versions()[peer]
        assert state["up"] is False and state["version"] is None, state
        for named in ("9.0.0", "99-99", versions.RELEASE, versions.REPLICATION_PROTOCOL.render()):
            assert named in state["refused"], state
    assert n4.transport.refused[E_VERSION_MISMATCH.code] >= 2, "the dialer keeps redialing"
    # ... and each side logs the refusal once, not once per redial.
    logged = [record.getMessage() for record in caplog.records if "99-99" in record.getMessage()]
    assert sum(line.startswith("refused a peer link from peer n3") for line in logged) == 1, logged
    assert sum(line.startswith("the link was refused by peer n4") for line in logged) == 1, logged
    assert n3.transport.version("n4") is None


@pytest.mark.asyncio
async def test_a_silent_dialer_as_0_1_0_dials_is_taken_to_speak_its_versions(make_node) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    port1, port2 = free_port(), free_port()
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    async with raw_session() as session:
        headers = auth_headers(SECRET, "n1", "n2")       # only the signed X-Peer-* headers, as 0.1.0 sends
        ws = await session.ws_connect(url(port2) + PEER_PATH, headers=headers)
        answer = ws._response.headers
        assert answer[vh.PEER_VERSION] == str(versions.SILENT_PEER["replication"].high)
        assert answer[vh.PEER_RELEASE] == versions.RELEASE
        await dial_handshake(ws, SECRET, "replication", "n1", "n2", headers[HEADER_NONCE], 5.0)
        await eventually(lambda: n2.transport.is_up("n1"))
        assert n2.transport.link_versions()["n1"] == {"up": True, "version": versions.SILENT_PEER["replication"].high,
                                                      "release": None, "refused": None}
        await ws.close()


@pytest.mark.asyncio
async def test_after_finalize_a_node_of_an_older_release_may_not_link_either_way(make_node) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    # The node's rule (qserver/node.py _admits_peer) on a cluster at level 2: 0.1.0 names no release.
    assert versions.peer_too_old(1, None) is None and versions.peer_too_old(2, "0.2.0.dev0") is None
    assert "0.1.0 or older" in (versions.peer_too_old(2, None) or "")
    assert "needs release 0.2.0" in (versions.peer_too_old(2, "0.1.5") or "")
    port1, port2 = free_port(), free_port()
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    n2.transport.admits = lambda side: versions.peer_too_old(2, side.release)
    async with raw_session() as session:
        headers = auth_headers(SECRET, "n1", "n2")       # a silent dialer, as 0.1.0 dials
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url(port2) + PEER_PATH, headers=headers)
        assert refused.value.status == E_VERSION_MISMATCH.http_status
    assert not n2.transport.is_up("n1") and "feature level 2" in n2.transport.link_versions()["n1"]["refused"]
    # The dialer's half: a responder of this release is admitted, one that names no release is not.
    n1 = await make_node("n1", port1, {"n2": url(port2)}, start=False)
    n1.transport.admits = lambda side: versions.peer_too_old(2, None)
    await n1.start()
    await eventually(lambda: n1.transport.link_versions()["n2"]["refused"] is not None)
    assert not n1.transport.is_up("n2")


# --- real nodes of this release ---------------------------------------------------------------------
def _metrics(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def _secret(cluster: LocalCluster, node: str) -> bytes:
    return (cluster.root / node / "cluster.secret").read_bytes().strip()


async def _raw_peer_upgrade(base_url: str, secret: bytes, offered: str) -> tuple[int, dict[str, Any], Any]:
    """An upgrade to n2's /v1/peer as n1, offering `offered`, read as plain HTTP (to see the body)."""
    headers = auth_headers(secret, "n1", "n2") | {vh.PEER_VERSIONS: offered, vh.PEER_RELEASE: "9.0.0",
                                                 "Connection": "Upgrade", "Upgrade": "websocket",
                                                 "Sec-WebSocket-Version": "13",
                                                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    async with raw_session() as session, session.get(base_url + PEER_PATH, headers=headers) as answer:
        return answer.status, await answer.json(content_type=None), answer.headers


@pytest.mark.asyncio
async def test_real_nodes_negotiate_links_and_clients(qcluster_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    cluster: LocalCluster = await asyncio.to_thread(qcluster_factory, 2)

    # Both purposes' links are up at the negotiated version, and name the peer's release.
    def negotiated() -> bool:
        links = cluster.health("n1").get("links", {})
        return isinstance(links, dict) and all(
            links.get(purpose, {}).get("n2", {}).get("up") for purpose in ("replication", "membership"))
    await eventually(negotiated, 15.0)
    links = cluster.health("n2")["links"]
    assert links["replication"]["n1"] == {"up": True, "version": versions.REPLICATION_PROTOCOL.high,  # type: ignore[index]
                                          "release": versions.RELEASE, "refused": None}
    assert links["membership"]["n1"]["version"] == versions.MEMBERSHIP_PROTOCOL.high  # type: ignore[index]
    metrics = await asyncio.to_thread(_metrics, cluster.urls["n1"])
    assert (f'qserver_peer_link_version{{purpose="replication",peer="n2",release="{versions.RELEASE}"}} '
            f"{versions.REPLICATION_PROTOCOL.high}") in metrics

    # A dialer offering a range with no overlap is refused with both ranges and releases.
    status, body, headers = await _raw_peer_upgrade(cluster.urls["n2"], _secret(cluster, "n2"), "99-99")
    assert status == E_VERSION_MISMATCH.http_status and body["error"]["code"] == E_VERSION_MISMATCH.code
    for named in ("99-99", "9.0.0", versions.RELEASE, versions.REPLICATION_PROTOCOL.render()):
        assert named in body["error"]["message"], body
    assert headers[vh.PEER_VERSIONS] == versions.REPLICATION_PROTOCOL.render()
    assert cluster.health("n2")["links"]["replication"]["n1"]["up"] is True  # type: ignore[index]  # the real link stays

    # A client without the header (as 0.1.0's) is served, and every answer names the node.
    signer = load_credentials(cluster.credentials_path).signer()
    async with raw_session() as session:
        path = "/v1/queues"
        signed = signer.headers("GET", path, [], b"", audience=cluster.urls["n1"])
        async with session.get(cluster.urls["n1"] + path, headers=signed) as answer:
            assert answer.status == 200
            node = vh.parse_side(answer.headers[vh.NODE_HEADER])
        # A malformed header is bad input: refused before anything runs, and the answer names the node.
        path = "/v1/queues/malformed-versions"
        signed = signer.headers("PUT", path, [], b"", audience=cluster.urls["n1"])
        async with session.put(cluster.urls["n1"] + path, headers={**signed, vh.CLIENT_HEADER: "soon; protocol=1-1"}) \
                as answer:
            assert answer.status == 400 and (await answer.json())["error"]["code"] == E_BAD_REQUEST.code
            assert vh.NODE_HEADER in answer.headers
        async with session.get(cluster.urls["n1"] + "/v1/queues",
                               headers=signer.headers("GET", "/v1/queues", [], b"", audience=cluster.urls["n1"])) as answer:
            assert "malformed-versions" not in json.dumps(await answer.json())
    assert node.release == versions.RELEASE and node.protocol == versions.CLIENT_PROTOCOL
    assert node.feature_level is not None and versions.OLDEST_FEATURE_LEVEL <= node.feature_level <= versions.FEATURE_LEVEL

    # This release's client records what the node named, over REST and the WebSocket.
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        assert client.server_release == versions.RELEASE      # the WebSocket's 101 named it
        await client.create_queue("negotiated")
        await client.enqueue("negotiated", b"x")
        [message] = await client.receive("negotiated", wait_s=2)
        await message.ack()
        assert client.cluster_feature_level == node.feature_level
        with pytest.raises(QueueError) as unknown:             # same release: the message as the node said it
            await client.http.request("POST", "/v1/no-such-route")
        assert unknown.value.code == E_NOT_FOUND.code and "0.1.0" not in unknown.value.message

    def sync_client_sees() -> tuple[str | None, int | None]:
        with Client(cluster.urls["n2"], cluster.credentials_path) as sync:
            sync.list_queues()
            return sync.server_release, sync.cluster_feature_level
    assert await asyncio.to_thread(sync_client_sees) == (versions.RELEASE, node.feature_level)

    # A client of a future release that shares no client protocol gets E_VERSION_MISMATCH.
    monkeypatch.setattr(client_http, "client_header", lambda: "9.0.0; protocol=7-9")
    monkeypatch.setattr(client_connection, "client_header", lambda: "9.0.0; protocol=7-9")
    future = AsyncClient(cluster.urls["n1"], cluster.credentials_path, connect_timeout_s=5)
    try:
        with pytest.raises(QueueError) as rest:
            await future.http.request("GET", "/v1/queues")
        assert rest.value.code == E_VERSION_MISMATCH.code and "7-9" in rest.value.message
        with pytest.raises(QueueError) as socket:
            await future.connect()
        assert socket.value.code == E_VERSION_MISMATCH.code and "7-9" in socket.value.message
        assert future.server_release == versions.RELEASE     # the refusal named the node too
    finally:
        await future.close()


# --- a real node of release 0.1.0 beside one of this release ---------------------------------------
# Release 0.1.0 itself, not whichever release precedes this one: these checks are of a node that
# names no versions (0.1.0 is the last release that did not); tests/test_upgrade.py rolls from
# the previous release, whichever it is.
PREVIOUS = next(r for r in upgrade_support.releases() if r["version"] == "0.1.0")
WHY_NOT = upgrade_support.skip_reason(PREVIOUS["commit"])


async def _serve_one(master: AsyncClient, replica: AsyncClient, queue: str) -> None:
    """Enqueue at the queue's master, receive and ack at its replica."""
    await master.create_queue(queue)
    assert (await master.queue_stats(queue))["master_status"] == "master", queue
    at, reader = master, replica
    payloads = [f"{queue}-{i}".encode() for i in range(5)]
    for payload in payloads:
        await at.enqueue(queue, payload)
    taken: list[bytes] = []
    for _ in range(50):
        for message in await reader.receive(queue, max_messages=10, wait_s=0.5):
            taken.append(message.payload)
            await message.ack()
        if len(taken) >= len(payloads):
            break
    assert sorted(taken) == sorted(payloads), queue
    assert await reader.receive(queue, wait_s=0.2) == []        # acked: nothing comes back


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
@pytest.mark.asyncio
async def test_a_node_of_the_previous_release_and_one_of_this_release_share_a_cluster(tmp_path: Path) -> None:
    with upgrade_support.release_tree(PREVIOUS["commit"], tmp_path / f"release-{PREVIOUS['version']}") as old_tree:
        # Both nodes initialised by the old release (as in a rolling upgrade); n1 then runs this
        # one. n1 sorts lower, so this release dials the old node on both purposes (the other
        # direction, a silent dialer, is the in-process test above).
        placement = {"old-master": ["n2", "n1"], "new-master": ["n1", "n2"]}
        cluster = LocalCluster(tmp_path / "cluster", 2, placement, code=old_tree, tls=False)
        try:
            cluster.start("n1", wait=False, code=REPOSITORY)
            cluster.start("n2", wait=False)
            await asyncio.to_thread(cluster.wait_ready)
            new_health, old_health = cluster.health("n1"), cluster.health("n2")
            assert "release" not in old_health and new_health["release"] == versions.RELEASE

            # The new node's links to the old one: the silent peer's versions, release unknown.
            def linked() -> bool:
                links = cluster.health("n1").get("links", {})
                return isinstance(links, dict) and all(
                    links.get(p, {}).get("n2", {}).get("up") for p in ("replication", "membership"))
            await eventually(linked, 15.0)
            links = cluster.health("n1")["links"]
            assert links["replication"]["n2"] == {"up": True, "version": versions.SILENT_PEER["replication"].high,  # type: ignore[index]
                                                  "release": None, "refused": None}
            assert links["membership"]["n2"]["version"] == versions.SILENT_PEER["membership"].high  # type: ignore[index]
            metrics = await asyncio.to_thread(_metrics, cluster.urls["n1"])
            assert 'qserver_peer_link_version{purpose="membership",peer="n2",release="unknown"} 1' in metrics

            async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as old_node, \
                    AsyncClient(cluster.urls["n1"], cluster.credentials_path) as new_node:
                await _serve_one(old_node, new_node, "old-master")   # master on 0.1.0, replica on this release
                await _serve_one(new_node, old_node, "new-master")   # and the reverse
                # This client against the old node: it named no release, and what it lacks says so.
                assert old_node.server_release is None and old_node.cluster_feature_level is None
                assert new_node.server_release == versions.RELEASE
                with pytest.raises(QueueError) as lacking:
                    await old_node.http.request("POST", "/v1/cluster/finalize")
                assert lacking.value.code == E_NOT_FOUND.code
                assert "the node runs qserver 0.1.0 (or older), which does not support POST /v1/cluster/finalize" \
                    in lacking.value.message
            # qctl prints it (a command of this release against the old node).
            out, err = io.StringIO(), io.StringIO()
            code = await asyncio.to_thread(qctl.main, ["--url", cluster.urls["n2"], "--credentials",
                                                       str(cluster.credentials_path), "definitions", "export"],
                                           stdout=out, stderr=err)
            assert code != 0 and "E_NOT_FOUND" in err.getvalue(), (code, err.getvalue())
            assert "the node runs qserver 0.1.0 (or older), which does not support GET /v1/definitions; upgrade " \
                   "the cluster" in err.getvalue(), err.getvalue()
        finally:
            await asyncio.to_thread(cluster.kill_all)
        fail_on_unexpected_ends(cluster.problems())

