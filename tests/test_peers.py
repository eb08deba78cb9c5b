"""The peer transport (qserver/transport/peers.py): real aiohttp links on loopback, and its in-memory twin.

Every wait is bounded by `eventually`; the whole file runs in a few seconds.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import pytest_asyncio
from aiohttp import web

from qserver.transport.memory_peers import MemoryPeerNetwork, MemoryPeerTransport
from qserver.transport.peer_link import (
    HEADER_NONCE,
    PEER_PATH,
    FrameError,
    LinkKeys,
    auth_headers,
    decode_frame,
    dial_handshake,
    encode_frame,
)
from qserver.transport.peers import PeerTransport
from tests.conftest import free_port
from tests.support import raw_session

pytestmark = pytest.mark.asyncio
SECRET = b"the-cluster-secret"
WAIT_S = 5.0
FAST = {"reconnect_delay_initial_s": 0.02, "reconnect_delay_max_s": 0.2}


async def eventually(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


class Node:
    """A PeerTransport mounted at GET /v1/peer of a real aiohttp server, recording what it sees."""

    def __init__(self, node_id: str, port: int, peers: dict[str, str], **options: Any) -> None:
        self.node_id = node_id
        self.port = port
        self.received: list[tuple[str, bytes]] = []
        self.link_changes: list[tuple[str, bool]] = []
        self.transport = PeerTransport(node_id, SECRET, peers, on_message=self._on_message,
                                       on_link_change=self._on_link_change, **{**FAST, **options})
        self._runner: web.AppRunner | None = None

    def _on_message(self, peer_id: str, message: bytes) -> None:
        self.received.append((peer_id, message))

    def _on_link_change(self, peer_id: str, up: bool) -> None:
        self.link_changes.append((peer_id, up))

    def messages_from(self, peer_id: str) -> list[bytes]:
        return [message for source, message in self.received if source == peer_id]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PEER_PATH, self.transport.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        await self.transport.start()

    async def stop(self) -> None:
        await self.transport.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


MakeNode = Callable[..., Awaitable[Node]]


@pytest_asyncio.fixture
async def make_node() -> AsyncIterator[MakeNode]:
    """Start nodes on demand; every node still running is stopped at the end."""
    nodes: list[Node] = []

    async def make(node_id: str, port: int, peers: dict[str, str], *, start: bool = True, **options: Any) -> Node:
        node = Node(node_id, port, peers, **options)
        nodes.append(node)
        if start:
            await node.start()
        return node
    yield make
    for node in nodes:
        await node.stop()


async def linked_pair(make_node: MakeNode, **options: Any) -> tuple[Node, Node]:
    port1, port2 = free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2)}, **options)
    n2 = await make_node("n2", port2, {"n1": url(port1)}, **options)
    await eventually(lambda: n1.transport.is_up("n2") and n2.transport.is_up("n1"))
    return n1, n2


async def dial_as(session: aiohttp.ClientSession, port: int, from_id: str, to_id: str,
                  secret: bytes = SECRET) -> tuple[aiohttp.ClientWebSocketResponse, LinkKeys]:
    """Open a peer link by hand, as node `from_id` would (upgrade, then the challenge-response)."""
    headers = auth_headers(secret, from_id, to_id)
    ws = await session.ws_connect(url(port) + PEER_PATH, headers=headers)
    return ws, await dial_handshake(ws, secret, "replication", from_id, to_id, headers[HEADER_NONCE], WAIT_S)


# --- frames ----------------------------------------------------------------------------------
async def test_a_frame_round_trips_and_anything_else_is_a_frame_error() -> None:
    assert decode_frame(encode_frame([b"a", b"", b"\x00" * 300])) == [b"a", b"", b"\x00" * 300]
    for garbage in (b"", b"\xc1", msgpack.packb([2, [b"a"]]), msgpack.packb([1, ["text"]]), msgpack.packb([1, b"a"]),
                    msgpack.packb([True, [b"a"]]), msgpack.packb({"1": [b"a"]}), msgpack.packb([1, [b"a"], 3])):
        with pytest.raises(FrameError):
            decode_frame(garbage)


# --- the real transport -----------------------------------------------------------------------
async def test_two_nodes_exchange_messages_both_ways_in_order_batched_into_few_frames(make_node: MakeNode) -> None:
    n1, n2 = await linked_pair(make_node)
    count = 2000
    for index in range(count):   # one loop turn: the writers find everything queued
        assert n1.transport.send("n2", b"to-n2 %d" % index)
        assert n2.transport.send("n1", b"to-n1 %d" % index)
    await eventually(lambda: len(n2.received) == count and len(n1.received) == count)
    assert n2.messages_from("n1") == [b"to-n2 %d" % index for index in range(count)]
    assert n1.messages_from("n2") == [b"to-n1 %d" % index for index in range(count)]
    assert n1.transport.frames_sent <= 3 and n2.transport.frames_received == n1.transport.frames_sent
    assert n1.transport.pending_bytes("n2") == 0 and n2.transport.pending_bytes("n1") == 0


async def test_frames_stay_under_frame_bytes_max_and_a_larger_message_goes_alone(make_node: MakeNode) -> None:
    n1, n2 = await linked_pair(make_node, frame_bytes_max=4096)
    messages = [bytes([index]) * 1000 for index in range(20)] + [b"L" * 10_000, b"tail"]
    for message in messages:
        assert n1.transport.send("n2", message)
    await eventually(lambda: len(n2.received) == len(messages))
    assert n2.messages_from("n1") == messages
    # Four 1000-byte messages fit a 4096-byte frame: 5 frames, the large one alone, then the tail.
    assert n1.transport.frames_sent == 7


async def test_only_the_lower_id_dials_so_the_higher_needs_no_reachable_address(make_node: MakeNode) -> None:
    # String order: "n10" < "n9", so n10 dials and n9's address for it is never used.
    port10, port9 = free_port(), free_port()
    n9 = await make_node("n9", port9, {"n10": "http://127.0.0.1:1"})
    n10 = await make_node("n10", port10, {"n9": url(port9)})
    await eventually(lambda: n10.transport.is_up("n9") and n9.transport.is_up("n10"))
    assert n9.transport.send("n10", b"from n9") and n10.transport.send("n9", b"from n10")
    await eventually(lambda: n10.received == [("n9", b"from n9")] and n9.received == [("n10", b"from n10")])
    assert (n10.transport.links_dialed, n10.transport.links_accepted) == (1, 0)
    assert (n9.transport.links_dialed, n9.transport.links_accepted) == (0, 1)


async def test_bad_credentials_are_refused_with_401_and_the_real_link_keeps_working(make_node: MakeNode) -> None:
    port1, port2, port3 = free_port(), free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2)})
    n2 = await make_node("n2", port2, {"n1": url(port1), "n3": url(port3)})   # n3 never runs
    await eventually(lambda: n1.transport.is_up("n2"))
    now_ms = int(time.time() * 1000)
    valid = auth_headers(SECRET, "n1", "n2")
    cases = [
        (auth_headers(b"another secret", "n1", "n2"), 401, "E_UNAUTHENTICATED"),
        (auth_headers(SECRET, "n1", "n7"), 401, "E_UNAUTHENTICATED"),            # not n2's id
        (auth_headers(SECRET, "n0", "n2"), 401, "E_UNAUTHENTICATED"),            # not n2's peer
        (auth_headers(SECRET, "n1", "n2", timestamp_ms=now_ms - 301_000), 401, "E_STALE_REQUEST"),
        ({**auth_headers(SECRET, "n1", "n2"), "X-Peer-Protocol": "1"}, 400, "E_BAD_REQUEST"),   # the old scheme
        ({}, 401, "E_UNAUTHENTICATED"),
        (auth_headers(SECRET, "n3", "n2"), 400, "E_BAD_REQUEST"),                # n2 dials n3, not the reverse
        (valid, 400, "E_BAD_REQUEST"),                                           # signed, but no upgrade
        (valid, 401, "E_REPLAYED_REQUEST"),
    ]
    async with raw_session() as session:
        for headers, status, code in cases:
            async with session.get(url(port2) + PEER_PATH, headers=headers) as answer:
                body = await answer.json()
                assert (answer.status, body["error"]["code"], answer.headers["X-Error-Code"]) == (status, code, code)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url(port2) + PEER_PATH, headers=auth_headers(b"wrong", "n1", "n2"))
        assert refused.value.status == 401 and refused.value.headers is not None
        assert refused.value.headers["X-Error-Code"] == "E_UNAUTHENTICATED"
    assert n2.transport.refused["E_UNAUTHENTICATED"] == 5
    assert n1.transport.send("n2", b"still here")
    await eventually(lambda: n2.received == [("n1", b"still here")])
    assert n1.link_changes == [("n2", True)] and n2.link_changes == [("n1", True)]


async def send_raw_frame(node: Node, peer_id: str, data: bytes) -> None:
    """Write bytes the transport itself would never write, on its live link to `peer_id`."""
    link = node.transport._peers[peer_id].link
    assert link is not None
    await link.ws.send_bytes(data)


async def test_garbage_frames_from_a_peer_close_only_its_link_which_then_reestablishes(make_node: MakeNode) -> None:
    port1, port2, port3 = free_port(), free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2), "n3": url(port3)})
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    n3 = await make_node("n3", port3, {"n1": url(port1)})
    # Both ends of each link: n1 may count a link up a moment before n2 holds its end of it
    # (the frame below is written on n2's end; CI once found it not there yet).
    await eventually(lambda: n1.transport.is_up("n2") and n1.transport.is_up("n3")
                     and n2.transport.is_up("n1") and n3.transport.is_up("n1"))
    await send_raw_frame(n2, "n1", b"\xc1 not msgpack")
    await eventually(lambda: n1.link_changes.count(("n2", True)) == 2)
    assert n1.transport.bad_frames == 1
    assert [change for change in n1.link_changes if change[0] == "n2"] == [("n2", True), ("n2", False), ("n2", True)]
    assert n3.link_changes == [("n1", True)] and n1.link_changes.count(("n3", True)) == 1
    assert n2.transport.send("n1", b"after") and n3.transport.send("n1", b"unaffected")
    await eventually(lambda: ("n2", b"after") in n1.received and ("n3", b"unaffected") in n1.received)


async def test_an_authenticated_peer_sending_garbage_is_closed_and_counted(make_node: MakeNode) -> None:
    port1, port5 = free_port(), free_port()
    n1 = await make_node("n1", port1, {"n5": url(port5)})
    n5 = await make_node("n5", port5, {"n1": url(port1), "n2": "http://127.0.0.1:1"})
    await eventually(lambda: n1.transport.is_up("n5"))
    async with raw_session() as session:
        for garbage in (b"\x93\x01", "a text frame"):
            ws, _ = await dial_as(session, port5, "n2", "n5")
            await (ws.send_bytes(garbage) if isinstance(garbage, bytes) else ws.send_str(garbage))
            closing = await asyncio.wait_for(ws.receive(), WAIT_S)
            assert closing.type is aiohttp.WSMsgType.CLOSE and closing.extra == "E_BAD_FRAME"
            await ws.close()
    assert n5.transport.bad_frames == 2
    await eventually(lambda: not n5.transport.is_up("n2"))
    assert n1.link_changes == [("n5", True)] and n5.transport.is_up("n1")


async def test_a_second_link_from_the_same_peer_replaces_the_first(make_node: MakeNode) -> None:
    port5 = free_port()
    n5 = await make_node("n5", port5, {"n2": "http://127.0.0.1:1"})
    async with raw_session() as session:
        first, _ = await dial_as(session, port5, "n2", "n5")
        await eventually(lambda: n5.transport.is_up("n2"))
        second, keys = await dial_as(session, port5, "n2", "n5")
        closing = await asyncio.wait_for(first.receive(), WAIT_S)
        assert closing.type is aiohttp.WSMsgType.CLOSE and closing.extra == "superseded"
        assert n5.transport.send("n2", b"on the newer link")
        frame = await asyncio.wait_for(second.receive(), WAIT_S)
        assert decode_frame(keys.open(frame.data)) == [b"on the newer link"]
        await second.send_bytes(keys.seal(encode_frame([b"back"])))
        await eventually(lambda: n5.received == [("n2", b"back")])
        await first.close()
        await second.close()
    await eventually(lambda: not n5.transport.is_up("n2"))
    assert n5.link_changes == [("n2", True), ("n2", False), ("n2", True), ("n2", False)]


async def test_a_restarted_peer_reconnects_and_gets_what_was_queued_while_it_was_down(make_node: MakeNode) -> None:
    port1, port2 = free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2)})
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    await eventually(lambda: n1.transport.is_up("n2"))
    await n2.stop()    # the acceptor goes away: the dialer keeps what it is given
    await eventually(lambda: not n1.transport.is_up("n2"))
    queued = [b"while down %d" % index for index in range(100)]
    assert all(n1.transport.send("n2", message) for message in queued)
    assert n1.transport.pending_bytes("n2") == sum(map(len, queued))
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    await eventually(lambda: n2.messages_from("n1") == queued)
    assert n1.transport.pending_bytes("n2") == 0
    await n1.stop()    # now the dialer goes away: the acceptor keeps what it is given
    await eventually(lambda: not n2.transport.is_up("n1"))
    assert n2.transport.send("n1", b"for the new n1")
    n1 = await make_node("n1", port1, {"n2": url(port2)})
    await eventually(lambda: n1.received == [("n2", b"for the new n1")])


async def test_three_nodes_keep_exactly_one_link_per_pair(make_node: MakeNode) -> None:
    ports = {node_id: free_port() for node_id in ("n1", "n2", "n3")}
    everyone = {node_id: url(port) for node_id, port in ports.items()}
    nodes = [await make_node(node_id, port, everyone) for node_id, port in ports.items()]
    await eventually(lambda: all(node.transport.is_up(other.node_id) for node in nodes for other in nodes
                                 if other is not node))
    await asyncio.sleep(0.3)   # room for a duplicate link to appear, if one could
    counts = [(node.transport.links_dialed, node.transport.links_accepted) for node in nodes]
    assert counts == [(2, 0), (1, 1), (0, 2)]
    for node in nodes:
        assert sorted(node.link_changes) == sorted((other.node_id, True) for other in nodes if other is not node)


async def test_a_removed_peer_loses_its_link_and_an_added_one_gains_one(make_node: MakeNode) -> None:
    port1, port2, port3 = free_port(), free_port(), free_port()
    n1 = await make_node("n1", port1, {"n2": url(port2)})
    n2 = await make_node("n2", port2, {"n1": url(port1)})
    n3 = await make_node("n3", port3, {"n1": url(port1)})
    await eventually(lambda: n1.transport.is_up("n2"))
    n1.transport.set_peers({"n1": url(port1), "n3": url(port3)})   # its own entry is ignored
    await eventually(lambda: n1.transport.is_up("n3") and not n2.transport.is_up("n1"))
    assert not n1.transport.is_up("n2") and not n1.transport.send("n2", b"gone")
    assert ("n2", False) in n1.link_changes and n3.link_changes == [("n1", True)]


class BlackHoleProxy:
    """A TCP forwarder that can silently drop every byte, as a dead route would (no FIN, no RST)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.black_holed = False
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pumps: set[asyncio.Task[None]] = set()

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
        for source, target in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(source, target))
            self._pumps.add(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.black_holed:
                    writer.write(data)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass
        if self._server is not None:
            await self._server.wait_closed()


@pytest_asyncio.fixture
async def proxies() -> AsyncIterator[list[BlackHoleProxy]]:
    made: list[BlackHoleProxy] = []
    yield made
    for proxy in made:
        await proxy.stop()


async def test_a_black_holed_link_is_detected_by_heartbeats_and_redialed_after(
        make_node: MakeNode, proxies: list[BlackHoleProxy]) -> None:
    heartbeat_s = 0.2
    options = {"heartbeat_s": heartbeat_s, "connect_timeout_s": 0.5}
    port1, port2 = free_port(), free_port()
    proxy = BlackHoleProxy(port2)
    proxies.append(proxy)
    proxy_port = await proxy.start()
    n1 = await make_node("n1", port1, {"n2": url(proxy_port)}, **options)   # n1 reaches n2 only through the proxy
    n2 = await make_node("n2", port2, {"n1": url(port1)}, **options)
    await eventually(lambda: n1.transport.is_up("n2") and n2.transport.is_up("n1"))
    proxy.black_holed = True
    cut_s = time.monotonic()
    await eventually(lambda: not n1.transport.is_up("n2") and not n2.transport.is_up("n1"), timeout_s=2.0)
    assert time.monotonic() - cut_s < 2 * heartbeat_s + 0.3
    assert n1.transport.send("n2", b"after the outage")
    proxy.black_holed = False
    await eventually(lambda: n2.received == [("n1", b"after the outage")])
    assert n1.link_changes == [("n2", True), ("n2", False), ("n2", True)]


# --- the in-memory twin -----------------------------------------------------------------------
class MemoryNode:
    def __init__(self, network: MemoryPeerNetwork, node_id: str, **options: Any) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.link_changes: list[tuple[str, bool]] = []
        self.transport: MemoryPeerTransport = network.transport(
            node_id, lambda peer, message: self.received.append((peer, message)),
            lambda peer, up: self.link_changes.append((peer, up)), **options)

    def messages_from(self, peer_id: str) -> list[bytes]:
        return [message for source, message in self.received if source == peer_id]

    async def start(self) -> None:
        await self.transport.start()


async def settle() -> None:
    """Let every call_soon delivery already scheduled (and the ones they schedule) run."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_memory_twin_delivers_in_order_per_pair() -> None:
    network = MemoryPeerNetwork()
    a, b, c = (MemoryNode(network, node_id) for node_id in ("a", "b", "c"))
    assert a.transport.send("b", b"queued before start")
    for node in (a, b, c):
        await node.transport.start()
    for index in range(50):
        assert a.transport.send("b", b"a%d" % index) and c.transport.send("b", b"c%d" % index)
        assert b.transport.send("a", b"b%d" % index)
    await settle()
    assert [m for p, m in b.received if p == "a"] == [b"queued before start"] + [b"a%d" % i for i in range(50)]
    assert [m for p, m in b.received if p == "c"] == [b"c%d" % i for i in range(50)]
    assert a.received == [("b", b"b%d" % i) for i in range(50)]
    assert sorted(b.link_changes) == [("a", True), ("c", True)]


async def test_the_memory_twin_partition_drops_in_flight_reports_down_and_heal_reconnects() -> None:
    network = MemoryPeerNetwork()
    a, b, c = (MemoryNode(network, node_id) for node_id in ("a", "b", "c"))
    for node in (a, b, c):
        await node.transport.start()
    await settle()
    assert a.transport.send("b", b"in flight") and a.transport.send("c", b"to c")
    network.partition("a", "b")
    assert not a.transport.is_up("b") and not b.transport.is_up("a") and a.transport.is_up("c")
    assert a.transport.send("b", b"while cut")
    assert a.transport.pending_bytes("b") == len(b"while cut")
    await settle()
    assert b.received == [] and c.received == [("a", b"to c")]
    assert a.link_changes[-1] == ("b", False) and b.link_changes[-1] == ("a", False)
    network.heal_all()
    await settle()
    assert b.received == [("a", b"while cut")] and a.transport.pending_bytes("b") == 0
    assert a.link_changes[-1] == ("b", True) and b.link_changes[-1] == ("a", True)
    assert sorted(c.link_changes) == [("a", True), ("b", True)]
    network.partition("c", "a")
    await settle()
    assert not c.transport.is_up("a") and c.transport.is_up("b")
    network.heal("a", "c")
    await settle()
    assert c.transport.is_up("a") and c.link_changes[-2:] == [("a", False), ("a", True)]


async def test_the_memory_twin_bounds_its_queue_and_a_stopped_peer_is_down() -> None:
    network = MemoryPeerNetwork()
    a, b = MemoryNode(network, "a", send_queue_bytes_max=10), MemoryNode(network, "b")
    await a.transport.start()
    assert a.transport.send("b", b"12345") and a.transport.send("b", b"67890")
    assert not a.transport.send("b", b"!") and not a.transport.send("nobody", b"?")
    await b.transport.start()
    await settle()
    assert b.received == [("a", b"12345"), ("a", b"67890")]
    await b.transport.stop()
    await settle()
    assert not a.transport.is_up("b") and a.link_changes == [("b", True), ("b", False)]


# --- one contract, both implementations -------------------------------------------------------
QUEUE_BYTES_MAX = 10_000


@pytest_asyncio.fixture(params=["aiohttp", "memory"])
async def unstarted_pair(request: pytest.FixtureRequest, make_node: MakeNode) -> tuple[Any, Any]:
    """n1 (its send queue bounded at QUEUE_BYTES_MAX) and n2, neither started, on either transport."""
    if request.param == "memory":
        network = MemoryPeerNetwork()
        return MemoryNode(network, "n1", send_queue_bytes_max=QUEUE_BYTES_MAX), MemoryNode(network, "n2")
    port1, port2 = free_port(), free_port()
    return (await make_node("n1", port1, {"n2": url(port2)}, start=False, send_queue_bytes_max=QUEUE_BYTES_MAX),
            await make_node("n2", port2, {"n1": url(port1)}, start=False))


async def test_messages_sent_before_the_link_is_up_arrive_in_order_once_it_is(unstarted_pair: tuple[Any, Any]) -> None:
    n1, n2 = unstarted_pair
    for index in range(50):
        assert n1.transport.send("n2", b"one %d" % index) and n2.transport.send("n1", b"two %d" % index)
    await n1.start()
    assert not n1.transport.is_up("n2")
    await n2.start()
    await eventually(lambda: len(n1.received) == 50 and len(n2.received) == 50)
    assert n2.messages_from("n1") == [b"one %d" % index for index in range(50)]
    assert n1.messages_from("n2") == [b"two %d" % index for index in range(50)]
    assert n1.link_changes == [("n2", True)] and n2.link_changes == [("n1", True)]


async def test_send_refuses_past_the_queue_bound_while_the_link_is_down_and_loses_nothing_accepted(
        unstarted_pair: tuple[Any, Any]) -> None:
    n1, n2 = unstarted_pair
    await n1.start()
    accepted = []
    for index in range(1000):
        message = b"%03d" % index + b"." * 97
        if not n1.transport.send("n2", message):
            break
        accepted.append(message)
    assert len(accepted) == 100 and n1.transport.pending_bytes("n2") == QUEUE_BYTES_MAX
    assert not n1.transport.send("n2", b"x") and n1.transport.pending_bytes("n2") == QUEUE_BYTES_MAX
    assert not n1.transport.send("unknown", b"x")
    await n2.start()
    await eventually(lambda: len(n2.received) == len(accepted))
    assert n2.messages_from("n1") == accepted and n1.transport.pending_bytes("n2") == 0
    assert n1.transport.send("n2", b"room again")
    await eventually(lambda: n2.received[-1] == ("n1", b"room again"))
