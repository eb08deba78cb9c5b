"""Attack tests for issue 32, item 6 (peer and membership links): each performs the attack against
real `qserver` processes on loopback where the link is between processes, and against the real
transport (qserver/transport/peers.py, real sockets) where what is checked is inside one process.

The attacks are on plaintext links (TLS would hide the captured bytes), so these clusters run
without TLS whatever $QSERVER_TEST_TLS says.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from qserver.cluster.membership import RaftMembership, raft_limits, tick_ms
from qserver.dev.devcluster import REPOSITORY, LocalCluster, free_port, start_qserver
from qserver.storage.lmdb_store import MapGrowthNeeded, Storage
from qserver.storage.raft_store import MemoryRaftStore, RaftStore, storage_id_bytes
from qserver.transport.peer_link import HEADER_NONCE, PEER_PATH, auth_headers, dial_handshake, encode_frame
from qserver.transport.peers import PeerTransport
from replication.cluster_map import PutClient, encode_map
from replication.raft import Ready
from replication.raft_codec import encode_frame as encode_raft
from replication.raft_messages import (
    AppendRequest,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    Snapshot,
    SnapshotRequest,
)
from tests.conftest import fail_on_unexpected_ends
from tests.support import raw_session

WAIT_S = 10.0
SECRET = b"the-cluster-secret"


# --- helpers ---------------------------------------------------------------------------------
async def eventually(predicate: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(0.02)


def metric(url: str, name: str, labels: str) -> float | None:
    """One sample of a node's /metrics (None: the node does not export it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def rewrite_config(cluster: LocalCluster, node: str, old: str, new: str) -> None:
    path = cluster.root / f"{node}.toml"
    text = path.read_text()
    assert text.count(old) == 1, (old, text)
    path.write_text(text.replace(old, new))


@pytest.fixture
def plain_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """A three-node cluster in plaintext on loopback; `before_start` may edit its config files."""
    clusters: list[LocalCluster] = []

    def make(before_start: Callable[[LocalCluster], None] | None = None, ready: bool = True) -> LocalCluster:
        """`ready`: wait until the cluster is whole (else only until each node answers)."""
        cluster = LocalCluster(tmp_path / f"cluster{len(clusters)}", 3, tls=False)
        clusters.append(cluster)
        if before_start is not None:
            before_start(cluster)
        if ready:
            cluster.start_all()
        else:
            for node in cluster.ids:
                cluster.start(node, wait=False)
        return cluster
    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.kill_all()
    fail_on_unexpected_ends(problem for cluster in clusters for problem in cluster.problems())


class TcpProxy:
    """A TCP forwarder that records what each connection's client sent, and can flip the last
    byte of the next client chunk of at least `flip_min_bytes` (an on-path attacker)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent: list[bytearray] = []          # per connection: the bytes the dialer sent
        self.flip_min_bytes: int | None = None
        self.flipped = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.append(upstream_writer)
        record = bytearray()
        self.sent.append(record)
        for source, target, log in ((reader, upstream_writer, record), (upstream_reader, writer, None)):
            task = asyncio.get_running_loop().create_task(self._pump(source, target, log))
            self._tasks.add(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: bytearray | None) -> None:
        try:
            while data := await reader.read(65536):
                if log is not None:
                    log += data
                    if self.flip_min_bytes is not None and len(data) >= self.flip_min_bytes:
                        data = data[:-1] + bytes([data[-1] ^ 0x01])
                        self.flip_min_bytes = None
                        self.flipped += 1
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest_asyncio.fixture
async def proxies() -> AsyncIterator[list[TcpProxy]]:
    made: list[TcpProxy] = []
    yield made
    for proxy in made:
        await proxy.stop()


def split_head(stream: bytes) -> tuple[bytes, bytes]:
    """(the HTTP request head, what followed it)."""
    end = stream.index(b"\r\n\r\n") + 4
    return stream[:end], stream[end:]


def frame_length(data: bytes) -> int | None:
    """Bytes of the first WebSocket frame in `data` (None: not all there yet)."""
    if len(data) < 2:
        return None
    length, offset = data[1] & 0x7F, 2
    if length == 126:
        length, offset = int.from_bytes(data[2:4], "big"), 4
    elif length == 127:
        length, offset = int.from_bytes(data[2:10], "big"), 10
    total = offset + (4 if data[1] & 0x80 else 0) + length
    return total if len(data) >= total else None


async def replay(port: int, data: bytes, listen_s: float = 2.0) -> tuple[str, list[tuple[int, bytes]]]:
    """Send raw captured bytes to a port; the status line, and the WebSocket frames (opcode,
    payload) the node sent back within `listen_s` if it upgraded."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frames: list[tuple[int, bytes]] = []
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        status = head.split(b"\r\n", 1)[0].decode()
        if " 101 " not in status + " ":
            return status, frames
        buffered = b""
        deadline = time.monotonic() + listen_s
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            except TimeoutError:
                break
            if not chunk:
                break
            buffered += chunk
            while (length := frame_length(buffered)) is not None:
                header = 2 + {126: 2, 127: 8}.get(buffered[1] & 0x7F, 0)
                frames.append((buffered[0] & 0x0F, buffered[header:length]))
                buffered = buffered[length:]
            if frames and frames[-1][0] == 0x8:     # a close frame: the node ended it
                break
        return status, frames
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def raft_port(cluster: LocalCluster, node: str) -> int:
    return int(cluster.raft_addresses[node].rsplit(":", 1)[1])


def http_port(cluster: LocalCluster, node: str) -> int:
    return int(cluster.urls[node].rsplit(":", 1)[1])


# --- (a) a captured handshake replayed -------------------------------------------------------
@pytest.mark.asyncio
async def test_a_captured_membership_handshake_replayed_to_either_port_gets_no_link(
        plain_cluster: Callable[..., LocalCluster], proxies: list[TcpProxy]) -> None:
    """Issue 32, item 6 (a). An on-path observer records the bytes n1 sends when it dials n2's
    membership port (the upgrade request and what follows it), and replays them to n2's
    replication port (the other purpose) and to the membership port itself, also after n2
    restarted and forgot the nonces it had seen. The old handshake named no purpose and each
    port kept its own nonces, so the replay to the replication port was a link as n1 (101, and n2
    sent it n1's frames); after a restart the same-port replay worked too. Now the upgrade is
    bound to its purpose, and the link to a challenge-response over a fresh nonce of n2's: every
    replay gets no link and nothing of n1's."""
    proxy = TcpProxy(0)
    proxies.append(proxy)
    proxy_port = await proxy.start()

    def through_proxy(cluster: LocalCluster) -> None:   # n1 (the lower id) dials n2's membership port via it
        proxy.target_port = raft_port(cluster, "n2")
        rewrite_config(cluster, "n1", f'n2 = "{cluster.raft_addresses["n2"]}"', f'n2 = "127.0.0.1:{proxy_port}"')
    cluster = await asyncio.to_thread(plain_cluster, through_proxy)
    await eventually(lambda: bool(proxy.sent) and b"\r\n\r\n" in proxy.sent[0]
                     and frame_length(split_head(bytes(proxy.sent[0]))[1]) is not None, what="a captured dial")
    head, rest = split_head(bytes(proxy.sent[0]))
    first_frame = rest[:frame_length(rest)]
    captured = head + first_frame      # the upgrade and the first frame the dialer sent on it

    targets = [("replication port", http_port(cluster, "n2")), ("membership port", raft_port(cluster, "n2"))]
    for name, port in targets:
        status, frames = await replay(port, captured)
        assert " 101 " not in status + " ", f"the replay to n2's {name} was upgraded: {status}, {frames[:3]}"
    await asyncio.to_thread(cluster.kill, "n2")          # a restarted node has forgotten every nonce
    await asyncio.to_thread(cluster.start, "n2")
    for name, port in targets:
        status, frames = await replay(port, captured)
        if " 101 " in status + " ":
            # The upgrade passed (its nonce is forgotten); the link must not: n2 sends its
            # challenge and, on the replayed answer, closes. Nothing meant for n1.
            assert [opcode for opcode, _ in frames] == [0x2, 0x8], (name, frames)
            assert len(frames[0][1]) == 48 and b"E_UNAUTHENTICATED" in frames[1][1], (name, frames)
        else:
            assert status.startswith("HTTP/1.1 401"), (name, status)
    await asyncio.to_thread(cluster.wait_ready)          # the real links are unharmed


@pytest.mark.asyncio
async def test_a_dialer_speaking_the_old_handshake_is_refused_with_a_message_naming_the_new_one(
        plain_cluster: Callable[..., LocalCluster]) -> None:
    """Issue 32, item 6: protocol 1 (QP1, the dialer-only HMAC) is a protocol version now refused,
    with a message that names protocol 2, at both ports (the old code accepted it)."""
    cluster = await asyncio.to_thread(plain_cluster)
    secret = (cluster.root / "n1" / "cluster.secret").read_text().strip().encode()
    stamp, nonce = str(int(time.time() * 1000)), os.urandom(16).hex()
    signature = hmac.new(secret, f"QP1\nn1\nn2\n{stamp}\n{nonce}".encode(), hashlib.sha256).hexdigest()
    old = {"X-Peer-From": "n1", "X-Peer-To": "n2", "X-Peer-Timestamp": stamp, "X-Peer-Nonce": nonce,
           "X-Peer-Protocol": "1", "X-Peer-Auth": signature}
    async with raw_session() as session:
        for port in (http_port(cluster, "n2"), raft_port(cluster, "n2")):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(f"http://127.0.0.1:{port}{PEER_PATH}", headers=old)
            assert refused.value.status == 400
            async with session.get(f"http://127.0.0.1:{port}{PEER_PATH}", headers=old) as answer:
                body = await answer.json()
            assert body["error"]["code"] == "E_BAD_REQUEST" and "protocol 2" in body["error"]["message"], body


# --- (b) a fake responder ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_fake_responder_gets_no_link_and_nothing_beyond_the_upgrade_request(
        plain_cluster: Callable[..., LocalCluster]) -> None:
    """Issue 32, item 6 (b). Whoever answers at n2's replication address (an aiohttp server that
    accepts any upgrade, sends a hello-sized guess and records every message) is not n2. The old
    dialer never authenticated the responder: n1 took the impostor's socket for its link to n2
    (its link-up metric said so) and sent it n2's replication traffic. Now n1 checks the
    responder's proof over its own fresh nonce: no link comes up, nothing is sent after the
    upgrade request, and n1 counts the refused responder."""
    upgrades: list[dict[str, str]] = []
    received: list[aiohttp.WSMessage] = []

    async def impostor(request: web.Request) -> web.WebSocketResponse:
        upgrades.append(dict(request.headers))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if len(upgrades) % 2:
            await ws.send_bytes(os.urandom(48))   # a guess at the hello; every other time, silence
        async for message in ws:
            received.append(message)
        return ws

    app = web.Application()
    app.router.add_get(PEER_PATH, impostor)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    fake_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", fake_port).start()
    try:
        def to_the_impostor(cluster: LocalCluster) -> None:
            rewrite_config(cluster, "n1", f'n2 = "{cluster.urls["n2"]}"', f'n2 = "http://127.0.0.1:{fake_port}"')
        # n1 never reaches the real n2's replication port, so the cluster is never whole.
        cluster = await asyncio.to_thread(plain_cluster, to_the_impostor, False)
        n1 = cluster.urls["n1"]
        await eventually(lambda: len(upgrades) >= 1, what="n1 dialing the impostor")
        await asyncio.sleep(0.5)
        assert metric(n1, "qserver_peer_link_up", 'peer="n2"') == 0.0, "n1 took the impostor for n2"
        # Both kinds of impostor refused: the wrong guess at once, the silent one after the
        # handshake's timeout (connect_timeout_s, 5 s); n1 keeps redialing.
        await eventually(lambda: (metric(n1, "qserver_peer_responders_refused_total", 'purpose="replication"')
                                  or 0) >= 2 and len(upgrades) >= 3, timeout_s=20, what="n1 refusing the impostors")
        assert metric(n1, "qserver_peer_link_up", 'peer="n2"') == 0.0
        data = [message for message in received if message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT)]
        assert data == [], f"n1 sent the impostor {len(data)} message(s)"
        assert all(headers.get("X-Peer-Purpose") == "replication" for headers in upgrades)
    finally:
        await runner.cleanup()


# --- (c) frames altered in flight -------------------------------------------------------------
class Node:
    """A PeerTransport at GET /v1/peer of a real aiohttp server, recording what it delivers."""

    def __init__(self, node_id: str, port: int, peers: dict[str, str], **options: Any) -> None:
        self.port = port
        self.received: list[tuple[str, bytes]] = []
        self.link_changes: list[tuple[str, bool]] = []
        self.transport = PeerTransport(
            node_id, SECRET, peers, on_message=lambda peer, message: self.received.append((peer, message)),
            on_link_change=lambda peer, up: self.link_changes.append((peer, up)),
            reconnect_delay_initial_s=0.02, reconnect_delay_max_s=0.2, **options)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PEER_PATH, self.transport.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        await self.transport.start()

    async def stop(self) -> None:
        await self.transport.stop()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        await node.stop()


@pytest.mark.asyncio
async def test_a_frame_altered_in_flight_drops_the_link_and_is_not_delivered(
        nodes: list[Node], proxies: list[TcpProxy]) -> None:
    """Issue 32, item 6 (c). An on-path attacker between n1 and n2 flips one bit of a frame n1
    sends. Frames carried no MAC: the altered message was delivered to n2 as if n1 had sent it.
    Now each frame carries an HMAC under the link's key over its direction, counter and bytes:
    the altered frame is refused and counted, its link dropped, nothing of it delivered; n1
    redials and later messages arrive."""
    port1, port2 = free_port(), free_port()
    proxy = TcpProxy(port2)
    proxies.append(proxy)
    proxy_port = await proxy.start()
    options = {"heartbeat_s": 30.0}     # no ping may share the chunk the attacker alters
    n1 = Node("n1", port1, {"n2": f"http://127.0.0.1:{proxy_port}"}, **options)
    n2 = Node("n2", port2, {"n1": f"http://127.0.0.1:{port1}"}, **options)
    nodes.extend((n1, n2))
    await n1.start()
    await n2.start()
    await eventually(lambda: n1.transport.is_up("n2") and n2.transport.is_up("n1"))
    proxy.flip_min_bytes = 500
    original = b"pay 100 to alice " * 60
    assert n1.transport.send("n2", original)
    await eventually(lambda: proxy.flipped == 1, what="the attacker altering a frame")
    await eventually(lambda: n2.transport.bad_frames == 1, what="the altered frame refused")
    await eventually(lambda: n2.link_changes.count(("n1", True)) == 2, what="the link dropped and redialed")
    assert n2.received == [], f"n2 delivered {n2.received!r}"
    assert n1.transport.send("n2", b"after")
    await eventually(lambda: n2.received == [("n1", b"after")])


@pytest.mark.asyncio
async def test_forged_and_replayed_frames_on_an_established_link_drop_it_undelivered(nodes: list[Node]) -> None:
    """Issue 32, item 6 (c). On a live link, a writer that does not hold the link's key (a
    hijacker of the socket, here its own socket object) sends a well-formed frame of its own,
    then a copy of a frame the peer really sent (a replay): each drops the link, is counted,
    and is never delivered. Without MACs the forged frame was delivered, and the copy twice."""
    port1, port2 = free_port(), free_port()
    n1 = Node("n1", port1, {"n2": f"http://127.0.0.1:{port2}"})
    n2 = Node("n2", port2, {"n1": f"http://127.0.0.1:{port1}"})
    nodes.extend((n1, n2))
    await n1.start()
    await n2.start()
    await eventually(lambda: n1.transport.is_up("n2") and n2.transport.is_up("n1"))
    link = n1.transport._peers["n2"].link
    assert link is not None
    await link.ws.send_bytes(encode_frame([b"forged: pay 100 to mallory"]))
    await eventually(lambda: n2.transport.bad_frames == 1, what="the forged frame refused")
    await eventually(lambda: n1.transport.is_up("n2") and n2.link_changes.count(("n1", True)) == 2)
    assert n2.received == []
    link = n1.transport._peers["n2"].link
    assert link is not None
    ws = link.ws
    written: list[bytes] = []
    send_bytes = ws.send_bytes

    async def recording(data: bytes, *args: Any, **kwargs: Any) -> None:
        written.append(data)
        await send_bytes(data, *args, **kwargs)
    ws.send_bytes = recording  # type: ignore[method-assign]
    assert n1.transport.send("n2", b"once")
    await eventually(lambda: n2.received == [("n1", b"once")])
    await send_bytes(written[0])                       # the same frame again, as the wire carried it
    await eventually(lambda: n2.transport.bad_frames == 2, what="the replayed frame refused")
    assert n2.received == [("n1", b"once")]


# --- (d) plaintext beyond loopback --------------------------------------------------------------
def init_plain_node(data_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(data_dir),
                    "--credentials", str(data_dir / "admin.json")],
                   check=True, capture_output=True, cwd=REPOSITORY)


@pytest.mark.parametrize("listen", ["host", "membership"])
def test_a_node_listening_beyond_loopback_in_plaintext_refuses_to_start_unless_allowed(
        tmp_path: Path, listen: str) -> None:
    """Issue 32, item 6 (d). `qserver run` with a non-loopback listen address (its HTTP host,
    or its membership port) and no TLS used to start and serve peer links, client requests and
    frames in plaintext to the network. Now it refuses, naming `allow_plaintext`; with
    `allow_plaintext = true` it starts and logs a warning (0.0.0.0 on a free port; traffic stays
    local)."""
    data_dir = tmp_path / "n1"
    init_plain_node(data_dir)
    port, raft = free_port(), free_port()
    lines = ["[node]", 'node_id = "n1"', f'data_dir = "{data_dir}"', f"port = {port}"]
    if listen == "host":
        lines.append('host = "0.0.0.0"')
    else:
        lines.append(f'membership_bind = "0.0.0.0:{raft}"')
    # Its peers never run: the node starts (and answers /healthz) without them.
    cluster = ["[cluster.nodes]", f'n1 = "http://127.0.0.1:{port}"', 'n2 = "http://127.0.0.1:1"',
               'n3 = "http://127.0.0.1:3"',
               "[cluster.membership]", f'n1 = "127.0.0.1:{raft}"', 'n2 = "127.0.0.1:2"', 'n3 = "127.0.0.1:3"']
    config = tmp_path / "n1.toml"
    config.write_text("\n".join(lines + cluster) + "\n")
    refused = subprocess.run([sys.executable, "-m", "qserver", "run", "--config", str(config)],
                             capture_output=True, text=True, cwd=REPOSITORY, timeout=60)
    assert refused.returncode != 0
    assert "allow_plaintext = true" in refused.stderr and "0.0.0.0" in refused.stderr, refused.stderr

    config.write_text("\n".join(lines + ["allow_plaintext = true"] + cluster) + "\n")
    log_path = tmp_path / "n1.log"
    process = start_qserver(["--config", str(config), "--log-level", "WARNING"], f"http://127.0.0.1:{port}", log_path)
    try:
        assert "allow_plaintext = true" in log_path.read_text()
    finally:
        process.kill()
        process.wait(timeout=10)


# --- Low: a malformed Raft message from an authenticated peer -----------------------------------
async def dial_membership_as(port: int, secret: bytes, from_id: str, to_id: str) -> tuple[Any, Any, Any]:
    """A membership link to a real node, opened by hand as `from_id` (with the cluster secret)."""
    session = aiohttp.ClientSession()
    headers = auth_headers(secret, from_id, to_id, purpose="membership")
    ws = await session.ws_connect(f"http://127.0.0.1:{port}{PEER_PATH}", headers=headers)
    keys = await dial_handshake(ws, secret, "membership", from_id, to_id, headers[HEADER_NONCE], WAIT_S)
    return session, ws, keys


@pytest.mark.asyncio
@pytest.mark.parametrize("malformed", ["snapshot_map", "append_gap"])
async def test_a_malformed_raft_message_from_an_authenticated_peer_drops_its_link_not_the_node(
        plain_cluster: Callable[..., LocalCluster], malformed: str) -> None:
    """Issue 32, Low. A peer holding the cluster secret (a buggy or compromised node) sends n2 a
    well-formed Raft message with impossible contents: a snapshot of a later term whose map does
    not decode, or an append whose entries skip an index. The core took the first for a map to
    install and the second for a broken invariant: n2's membership task died and the node
    stopped (exit 70). Now the message is refused as bad input: the frame is counted, that link
    dropped, and n2 keeps serving."""
    cluster = await asyncio.to_thread(plain_cluster)
    secret = (cluster.root / "n1" / "cluster.secret").read_text().strip().encode()
    raft = cluster.health("n2")["membership"]["raft"]  # type: ignore[index]
    term, last = int(raft["term"]), int(raft["last_index"])
    storage = bytes(8)
    if malformed == "snapshot_map":
        configuration = Configuration(frozenset({Member("n1", storage)}))
        message: Any = SnapshotRequest(term + 1, "n1", "n2", storage,
                                       Snapshot(last + 1000, term + 1, configuration, b"\xc1 not a map"))
    else:
        message = AppendRequest(term + 1, "n1", "n2", storage, last, term,
                                (Entry(last + 1, term + 1, EntryKind.COMMAND, b"x"),
                                 Entry(last + 5, term + 1, EntryKind.COMMAND, b"y")), 0)
    session, ws, keys = await dial_membership_as(raft_port(cluster, "n2"), secret, "n1", "n2")
    try:
        await ws.send_bytes(keys.seal(encode_frame([encode_raft(message)])))
        closing = await asyncio.wait_for(ws.receive(), WAIT_S)
        while closing.type is aiohttp.WSMsgType.BINARY:      # n2's own frames for n1, until it closes
            closing = await asyncio.wait_for(ws.receive(), WAIT_S)
        assert closing.type is aiohttp.WSMsgType.CLOSE and closing.extra == "E_BAD_FRAME", closing
    finally:
        await ws.close()
        await session.close()
    assert metric(cluster.urls["n2"], "qserver_membership_frames_refused_total", 'why="bad"') == 1.0
    await asyncio.to_thread(cluster.wait_ready)           # n2 is up, and n1's real link is back


# --- Low: a full map under a Raft write ---------------------------------------------------------
def test_a_raft_write_that_finds_the_map_full_asks_for_growth_and_is_stored_after(tmp_path: Path) -> None:
    """Issue 32, Low. A Raft write (here a snapshot install bigger than the whole map) hit
    LMDB's MapFullError, which the membership task did not expect: the task died and the node
    stopped. Now the store turns it into MapGrowthNeeded, nothing of the transaction is stored,
    and once the map has grown the same Ready is written whole (qserver/cluster/membership.py retries)."""
    storage = Storage(tmp_path / "lmdb", node_id="n1", map_size_bytes=1 << 20, disk_reserve_bytes=0)
    try:
        store = RaftStore(storage)
        store.bootstrap("n1", storage.storage_id)
        configuration = Configuration(frozenset({Member("n1", storage_id_bytes(storage.storage_id))}))
        data = os.urandom(3 << 20)
        ready = Ready(HardState(2, None, 5), Snapshot(5, 2, configuration, data), None, None, (), (), ())
        grown = 0
        while True:
            try:
                store.persist(ready)
                break
            except MapGrowthNeeded:
                assert store.load().snapshot.data == b"", "nothing of a refused write is stored"
                storage.grow_map()
                grown += 1
                assert grown < 10
        assert grown >= 1 and store.load().snapshot.data == data
    finally:
        storage.close()


# --- Low: a Raft map snapshot over 8 MiB --------------------------------------------------------
@pytest.mark.asyncio
async def test_a_node_behind_a_map_snapshot_over_8_mib_catches_up(nodes: list[Node]) -> None:
    """Issue 32, Low. The map grew past 8 MiB (here 44 clients of 240 KiB each) and was
    compacted into a snapshot; n2 joins and can only catch up by it. One SnapshotRequest of
    over 8 MiB exceeded the membership transport's queue bound, so `send` refused it, silently,
    every time the core asked again: n2 never caught up. Now the driver sends it in 1 MiB chunks
    over the real membership transport, paced by the link's queue, and n2 joins them and
    installs the map."""
    loop = asyncio.get_running_loop()
    writers = [ThreadPoolExecutor(max_workers=1) for _ in range(2)]
    members: dict[str, RaftMembership] = {}
    port1, port2 = free_port(), free_port()
    urls = {"n1": f"http://127.0.0.1:{port1}", "n2": f"http://127.0.0.1:{port2}"}

    class MemberNode(Node):
        def __init__(self, node_id: str, port: int, number: int) -> None:
            super().__init__(node_id, port, {other: url for other, url in urls.items() if other != node_id},
                             purpose="membership")
            store = MemoryRaftStore()
            if node_id == "n1":
                store.bootstrap(node_id, number)
            transport = self.transport
            members[node_id] = RaftMembership(
                node_id, number, store, voters={"n1", "n2"}, send=transport.send,
                writer=lambda: writers[number - 1], loop=loop, limits=raft_limits((200, 400), 50),
                tick_s=tick_ms(50) / 1000, seed=number, compact_every_entries=10,
                pending_bytes=transport.pending_bytes)
            transport._on_message = members[node_id].on_frame

    n1 = MemberNode("n1", port1, 1)
    nodes.append(n1)
    members["n1"].start()
    try:
        await n1.start()
        await eventually(members["n1"].is_leader, what="n1 leading alone")
        for number in range(44):
            done: asyncio.Future[Any] = loop.create_future()
            members["n1"].propose(PutClient(f"big-{number}", {"name": f"big-{number}", "pad": "x" * (240 << 10)}),
                                  done.set_result)
            assert await asyncio.wait_for(done, WAIT_S)
        await eventually(lambda: members["n1"]._core is not None and members["n1"]._core.snapshot_index >= 40,
                         what="a compaction")
        assert len(encode_map(members["n1"].cluster_map)) > 8 << 20
        n2 = MemberNode("n2", port2, 2)
        nodes.append(n2)
        members["n2"].start()
        await n2.start()
        await eventually(lambda: len(members["n2"].cluster_map.clients) >= 44, timeout_s=60,
                         what="n2 catching up by the map's snapshot")
        assert members["n1"].frames_chunked >= 1
    finally:
        for member in members.values():
            member.stop()
        for writer in writers:
            writer.shutdown()
