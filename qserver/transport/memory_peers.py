"""The in-memory twin of the peer transport (qserver/transport/peers.py): the same surface
(send, is_up, pending_bytes, start, stop, set_peers, the callbacks of qserver/transport/peer_link.py),
with links a test or the simulator cuts and heals at will, and delivery on the event loop.

Separate so that the simulator and unit tests get the transport's contract without aiohttp's
sockets, and the real transport's module holds only the real links.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from qserver.transport.peer_link import (
    OnLinkChange,
    OnMessage,
    RefusedMessage,
    ignore_link_change,
)


class MemoryPeerNetwork:
    """Peers in one process: delivery by `loop.call_soon`, FIFO per pair; partitions on demand.

    A pair's link is up when both transports are started, each lists the other as a peer
    and the pair is not partitioned. Each time a link goes down its generation advances, so
    what was in flight on it is dropped, as on a socket that broke."""

    def __init__(self) -> None:
        self._transports: dict[str, MemoryPeerTransport] = {}
        self._cut: set[frozenset[str]] = set()
        self._up: set[frozenset[str]] = set()
        self._generation: collections.Counter[frozenset[str]] = collections.Counter()

    def transport(self, node_id: str, on_message: OnMessage, on_link_change: OnLinkChange = ignore_link_change,
                  *, peers: Iterable[str] | None = None, send_queue_bytes_max: int = 8 << 20) -> MemoryPeerTransport:
        """A node's transport; `peers` defaults to every other node of the network."""
        if node_id in self._transports:
            raise ValueError(f"node {node_id} already has a transport on this network")
        transport = MemoryPeerTransport(self, node_id, on_message, on_link_change, peers, send_queue_bytes_max)
        self._transports[node_id] = transport
        return transport

    def partition(self, a: str, b: str) -> None:
        self._cut.add(frozenset((a, b)))
        self._refresh(a, b)

    def heal(self, a: str, b: str) -> None:
        self._cut.discard(frozenset((a, b)))
        self._refresh(a, b)

    def heal_all(self) -> None:
        cut, self._cut = self._cut, set()
        for pair in cut:
            self._refresh(*sorted(pair))

    def is_up(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._up

    def _refresh_all(self, node_id: str) -> None:
        for other in list(self._transports):
            if other != node_id:
                self._refresh(node_id, other)

    def _refresh(self, a: str, b: str) -> None:
        pair = frozenset((a, b))
        up = pair not in self._cut and self._wants(a, b) and self._wants(b, a)
        if up == (pair in self._up):
            return
        loop = asyncio.get_running_loop()
        if up:
            self._up.add(pair)
        else:
            self._up.discard(pair)
            self._generation[pair] += 1   # drops what is in flight on the old link
        for here, there in ((a, b), (b, a)):
            transport = self._transports[here]
            loop.call_soon(transport.notify_link_change, there, up)
        if up:   # after the notifications, so a node learns of the link before its messages
            self._transports[a].flush(b)
            self._transports[b].flush(a)

    def _wants(self, here: str, there: str) -> bool:
        transport = self._transports.get(here)
        return transport is not None and transport.running and transport.has_peer(there)

    def _carry(self, source: str, target: str, message: bytes) -> None:
        pair = frozenset((source, target))
        generation = self._generation[pair]
        asyncio.get_running_loop().call_soon(self._arrive, pair, generation, source, target, message)

    def _arrive(self, pair: frozenset[str], generation: int, source: str, target: str, message: bytes) -> None:
        if self._generation[pair] == generation and pair in self._up:
            self._transports[target].receive(source, message)


class MemoryPeerTransport:
    """The twin of `PeerTransport`: same send/is_up/pending_bytes/start/stop/set_peers."""

    def __init__(self, network: MemoryPeerNetwork, node_id: str, on_message: OnMessage,
                 on_link_change: OnLinkChange, peers: Iterable[str] | None, send_queue_bytes_max: int) -> None:
        self.node_id = node_id
        self.running = False
        self._network = network
        self._on_message = on_message
        self._on_link_change = on_link_change
        self._peers: set[str] | None = None if peers is None else set(peers) - {node_id}
        self._send_queue_bytes_max = send_queue_bytes_max
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._queued_bytes: collections.Counter[str] = collections.Counter()

    async def start(self) -> None:
        self.running = True
        self._network._refresh_all(self.node_id)

    async def stop(self) -> None:
        self.running = False
        self._network._refresh_all(self.node_id)
        self._queues.clear()
        self._queued_bytes.clear()

    def set_peers(self, peers: dict[str, str] | Iterable[str]) -> None:
        self._peers = set(peers) - {self.node_id}
        for peer_id in list(self._queues):
            if peer_id not in self._peers:
                del self._queues[peer_id]
                del self._queued_bytes[peer_id]
        self._network._refresh_all(self.node_id)

    def has_peer(self, peer_id: str) -> bool:
        return peer_id != self.node_id and (self._peers is None or peer_id in self._peers)

    def send(self, peer_id: str, message: bytes) -> bool:
        # Like the real transport, it queues before start() too.
        if not self.has_peer(peer_id) or peer_id not in self._network._transports:
            return False
        if self._network.is_up(self.node_id, peer_id):
            self._network._carry(self.node_id, peer_id, message)
            return True
        if self._queued_bytes[peer_id] + len(message) > self._send_queue_bytes_max:
            return False
        self._queues[peer_id].append(message)
        self._queued_bytes[peer_id] += len(message)
        return True

    def is_up(self, peer_id: str) -> bool:
        return self._network.is_up(self.node_id, peer_id)

    def pending_bytes(self, peer_id: str) -> int:
        return self._queued_bytes[peer_id]

    def flush(self, peer_id: str) -> None:
        """The link came up: what waited goes out, in order."""
        queue = self._queues.pop(peer_id, None)
        self._queued_bytes.pop(peer_id, None)
        for message in queue or ():
            self._network._carry(self.node_id, peer_id, message)

    def notify_link_change(self, peer_id: str, up: bool) -> None:
        if self.running or not up:
            self._on_link_change(peer_id, up)

    def receive(self, peer_id: str, message: bytes) -> None:
        if self.running:
            try:
                self._on_message(peer_id, message)
            except RefusedMessage:
                pass          # the real transport drops the link too; here the message goes
