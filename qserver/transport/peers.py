"""Peer transport: one authenticated WebSocket per pair of nodes (docs/PROTOCOL.md, "Peer links").

Replication messages are opaque bytes here (their codec lives in replication/); this module
only moves them between two nodes, in order and batched, over exactly one link per pair that
multiplexes every queue the two nodes share. The node whose logical id sorts lower dials and
the other only accepts, so two nodes never race to open two links. A peer's identity is the
signed X-Peer-From header, never the address it came from or was reached at, so a proxy can
sit on every link (Toxiproxy in the chaos tests).

What the replication protocol above may assume, per peer:
- messages arrive in the order they were sent, each at most once, to `on_message` on the loop;
- messages sent while the link is down wait in a bounded queue and go out, in order, once it
  is up; `send` refuses (returns False) rather than grow that queue past its bound;
- messages already written to a socket that then broke MAY BE LOST, and so may frames still
  being read from a link a newer one replaced. The protocol retransmits from its acknowledged
  index when `on_link_change(peer, True)` reports a (re)established link.

The callbacks must not raise, except `on_message` with `RefusedMessage`: the peer sent a
message the layer above cannot take (a malformed Raft message), so the frame is counted as bad
and the link dropped, like a frame that fails its shape. Anything else they raise is a
programmer error and ends that link's task.

The link's wire (its upgrade headers, the challenge-response, the per-link keys and the
framing with a MAC on every frame) is qserver/transport/peer_link.py's; `MemoryPeerNetwork`,
the in-memory twin with the same surface for the simulator and unit tests, is
qserver/transport/memory_peers.py's. This module is the links' lifecycle: dialing, accepting,
one link per pair, the send queues, heartbeats and reconnects.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from qserver.core.failstop import stop_process
from qserver.http_errors import error_response
from qserver.transport.peer_link import (
    FRAME_OVERHEAD_BYTES,
    HEADER_AUTH,
    HEADER_FROM,
    HEADER_NONCE,
    HEADER_PROTOCOL,
    HEADER_PURPOSE,
    HEADER_TIMESTAMP,
    HEADER_TO,
    ITEM_OVERHEAD_BYTES,
    PEER_PROTOCOL,
    PEER_PROTOCOL_NAME,
    PURPOSES,
    FrameError,
    LinkKeys,
    OnLinkChange,
    OnMessage,
    RefusedMessage,
    auth_headers,
    check_dialer_answer,
    decode_frame,
    dial_handshake,
    dial_url,
    encode_frame,
    ignore_link_change,
    peer_signature,
    responder_hello,
)
from wire import errors as e
from wire.errors import QueueError
from wire.http_session import signed_session
from wire.version_headers import Side, dialer_outcome, negotiate, own_side, peer_answer, peer_offer, peer_side

log = logging.getLogger("qserver.transport.peers")
TIMESTAMP_SKEW_MAX_MS = 300_000
NONCE_CHARACTERS_MAX = 64
NONCES_KEPT_MAX = 100_000


# Only the lower id dials, so a restarted peer waits for the next dial before anything
# reaches it: this ceiling on the redial backoff bounds how long a restarted replica waits to
# start catching up (with 2 s it waited 0.3 - 1.4 s of a 10k-message catch-up). A dial to a
# peer that is down is one refused connect, or one connect timeout where the network drops it.
RECONNECT_DELAY_MAX_S = 0.25


CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
Socket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


@dataclass(eq=False)
class _Peer:
    peer_id: str
    url: str
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    queued_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)   # set when the queue may be non-empty
    link: _Link | None = None
    dialer: asyncio.Task[None] | None = None
    removed: bool = False
    refusal: str | None = None      # why the last link attempt failed on versions (None: it did not)
    went_away: bool = False         # its last link ended with its GOING_AWAY close (it stopped)


@dataclass(eq=False)
class _Link:
    peer: _Peer
    ws: Socket
    keys: LinkKeys
    version: int            # the protocol version negotiated for this link (docs/PROTOCOL.md, "Versions and negotiation")
    other: Side             # what the peer named about itself (release None: 0.1.0 or older)
    writer: asyncio.Task[None] | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class PeerTransport:
    """The real transport: aiohttp WebSockets, dialed by the lower id, accepted at `handle`."""

    def __init__(self, node_id: str, cluster_secret: bytes, peers: dict[str, str], *,
                 on_message: OnMessage, on_link_change: OnLinkChange = ignore_link_change,
                 send_queue_bytes_max: int = 8 << 20, frame_bytes_max: int = 1 << 20,
                 reconnect_delay_initial_s: float = 0.05, reconnect_delay_max_s: float = RECONNECT_DELAY_MAX_S,
                 heartbeat_s: float = 2.0, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 close_timeout_s: float = CLOSE_TIMEOUT_S, rng: random.Random | None = None,
                 listening: bool = True, ssl_context: ssl.SSLContext | None = None,
                 purpose: str = "replication") -> None:
        """`peers`: id -> URL to dial, or "" for a peer that does not listen (it dials this
        node). `listening`: false for a node that accepts no links (it dials every peer).
        `ssl_context`: how to check the certificates of peers dialed over https:// URLs.
        `purpose`: what the links carry (PURPOSES); every handshake is bound to it, so a link
        made for one purpose cannot be replayed as the other."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}")
        self.purpose = purpose
        self._mine = own_side(purpose)     # this side's versions (a test may offer others)
        # Why a peer that negotiated a version may still not link (None: it may): the node refuses
        # releases too old for the cluster's feature level (wire/versions.py peer_too_old).
        self.admits: Callable[[Side], str | None] = lambda side: None
        _check_limits(cluster_secret, send_queue_bytes_max, frame_bytes_max, reconnect_delay_initial_s,
                      reconnect_delay_max_s, heartbeat_s)
        self.node_id = node_id
        self._listening = listening
        self._secret = cluster_secret
        self._on_message = on_message
        self._on_link_change = on_link_change
        self._send_queue_bytes_max = send_queue_bytes_max
        self._frame_bytes_max = frame_bytes_max
        self._delay_initial_s = reconnect_delay_initial_s
        self._delay_max_s = reconnect_delay_max_s
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        self._close_timeout_s = close_timeout_s
        # A lone message may exceed frame_bytes_max but never the queue bound, so a frame
        # from a peer with the same configuration always fits.
        self._receive_bytes_max = max(frame_bytes_max, send_queue_bytes_max) + FRAME_OVERHEAD_BYTES + ITEM_OVERHEAD_BYTES
        self._rng = rng or random.Random()
        self._peers: dict[str, _Peer] = {}
        self._nonces: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._ssl_context = ssl_context
        self._started = False
        self._stopping = False
        # Counters for /metrics.
        self.frames_sent = 0
        self.frames_received = 0
        self.bad_frames = 0
        self.links_dialed = 0
        self.links_accepted = 0
        self.refused = collections.Counter[str]()
        self.responders_refused = 0      # dialed peers that failed the challenge (a fake responder)
        self.set_peers(peers)

    # --- the surface ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._stopping:
            raise RuntimeError("a stopped transport does not start again; make a new one")
        if self._started:
            return
        self._started = True
        # No pool limit: one connection per dialed peer, and the peers are the bound.
        connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl_context if self._ssl_context is not None else True)
        self._session = signed_session(connector)
        for peer in self._peers.values():
            self._start_dialer(peer)

    async def stop(self) -> None:
        """Close every link and end every task; unsent messages are dropped with the transport,
        which is not started again (a restarted node makes a new one)."""
        self._stopping = True
        dialers = [peer.dialer for peer in self._peers.values() if peer.dialer is not None]
        for task in dialers:
            task.cancel()
        await asyncio.gather(*dialers, return_exceptions=True)
        accepted = [peer.link for peer in self._peers.values() if peer.link is not None]
        for link in accepted:
            self._close_soon(link, WSCloseCode.GOING_AWAY, b"E_SHUTTING_DOWN")
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(self._wait_finished(link) for link in accepted))
        if self._session is not None:
            await self._session.close()
            self._session = None

    def send(self, peer_id: str, message: bytes) -> bool:
        peer = self._peers.get(peer_id)
        if peer is None or peer.queued_bytes + len(message) > self._send_queue_bytes_max:
            return False
        peer.queue.append(message)
        peer.queued_bytes += len(message)
        peer.wake.set()
        return True

    def is_up(self, peer_id: str) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.link is not None

    def went_away(self, peer_id: str) -> bool:
        """Whether the peer's last link ended with the peer saying it goes away (GOING_AWAY)."""
        peer = self._peers.get(peer_id)
        return peer is not None and peer.went_away

    def version(self, peer_id: str) -> int | None:
        """The protocol version negotiated with the peer's current link (None while it is down):
        what an encoder of this purpose's messages writes to it."""
        peer = self._peers.get(peer_id)
        return None if peer is None or peer.link is None else peer.link.version

    def link_versions(self) -> dict[str, dict[str, Any]]:
        """Per peer: whether its link is up, the negotiated version, the peer's release (None:
        it named none, 0.1.0 or older), and the last refusal on versions (/healthz `links`)."""
        table: dict[str, dict[str, Any]] = {}
        for peer_id, peer in sorted(self._peers.items()):
            link = peer.link
            table[peer_id] = {"up": link is not None, "version": None if link is None else link.version,
                              "release": None if link is None else link.other.release,
                              "refused": peer.refusal}
        return table

    def pending_bytes(self, peer_id: str) -> int:
        """Bytes accepted by `send` and not yet written to a socket."""
        peer = self._peers.get(peer_id)
        return 0 if peer is None else peer.queued_bytes

    def set_peers(self, peers: dict[str, str]) -> None:
        """Add and remove peers; a removed peer's link closes and its queue is dropped. An
        entry for this node itself is ignored, so callers may pass the whole node table."""
        wanted = {peer_id: url for peer_id, url in peers.items() if peer_id != self.node_id}
        for peer_id in [peer_id for peer_id in self._peers if peer_id not in wanted]:
            self._remove_peer(self._peers.pop(peer_id))
        for peer_id, url in wanted.items():
            peer = self._peers.get(peer_id)
            if peer is not None:
                peer.url = url   # used from the next dial on; a live link stays
                continue
            peer = self._peers[peer_id] = _Peer(peer_id, url)
            if self._started and not self._stopping:
                self._start_dialer(peer)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/peer: authenticate the dialer, upgrade, then serve the link until it ends."""
        ws = web.WebSocketResponse(heartbeat=self._heartbeat_s, max_msg_size=self._receive_bytes_max,
                                   compress=False, timeout=self._close_timeout_s)
        try:
            peer = self._authenticate(request.headers)
            if not ws.can_prepare(request).ok:
                raise QueueError(e.E_BAD_REQUEST, "a peer link is a WebSocket upgrade")
            other = peer_side(self.purpose, request.headers)
            version = negotiate(self.purpose, self._mine, other)
            too_old = self.admits(other)
            if too_old is not None:
                raise QueueError(e.E_VERSION_MISMATCH, too_old)
        except QueueError as error:
            self.refused[error.code] += 1
            if error.code == e.E_VERSION_MISMATCH.code:
                self._note_refusal(peer, error.message, "refused a peer link from")
            else:
                log.warning("refused a peer link from %s: %s", request.headers.get(HEADER_FROM, "?")[:64], error)
            refusal = error_response(error)
            # The refusal names this side's range too, so the dialer can say why (a refused
            # upgrade's body does not reach an aiohttp dialer).
            refusal.headers.update(peer_answer(self._mine, None))
            return refusal
        peer.refusal = None
        ws.headers.update(peer_answer(self._mine, version))
        await ws.prepare(request)
        if self._stopping or peer.removed:
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"E_UNAVAILABLE")
            return ws
        keys = await self._challenge(peer, ws, request.headers[HEADER_NONCE])
        if keys is None:
            return ws
        self.links_accepted += 1
        await self._run_link(peer, ws, keys, version, other)
        return ws

    async def _challenge(self, peer: _Peer, ws: web.WebSocketResponse, dialer_nonce: str) -> LinkKeys | None:
        """The responder's half: send the hello, and take the dialer's proof over both nonces
        before anything is delivered or sent (a replayed upgrade cannot answer a fresh nonce)."""
        hello, keys = responder_hello(self._secret, self.purpose, peer.peer_id, self.node_id, dialer_nonce)
        try:
            await ws.send_bytes(hello)
            async with asyncio.timeout(self._connect_timeout_s):
                answer = await ws.receive()
        except (TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError) as error:
            log.info("peer %s did not answer the challenge: %r", peer.peer_id, error)
            answer = None
        if answer is not None and answer.type is WSMsgType.BINARY and check_dialer_answer(
                self._secret, self.purpose, peer.peer_id, self.node_id, dialer_nonce, hello, answer.data):
            return keys
        self.refused[e.E_UNAUTHENTICATED.code] += 1
        log.warning("refused a peer link from %s: it did not prove the cluster secret on this link's challenge",
                    peer.peer_id)
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"E_UNAUTHENTICATED")
        return None

    # --- accepting ---------------------------------------------------------------------------
    def _authenticate(self, headers: Mapping[str, str]) -> _Peer:
        if self._stopping:
            raise QueueError(e.E_SHUTTING_DOWN, "the node is stopping")
        protocol = headers.get(HEADER_PROTOCOL)
        if protocol is not None and protocol != PEER_PROTOCOL:
            raise QueueError(e.E_BAD_REQUEST, f"peer protocol {protocol[:20]!r} is refused: this node speaks peer "
                                              f"protocol {PEER_PROTOCOL}, {PEER_PROTOCOL_NAME}; upgrade the dialing node")
        from_id, to_id, stamp, nonce, signature, purpose = (headers.get(name, "") for name in (
            HEADER_FROM, HEADER_TO, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_AUTH, HEADER_PURPOSE))
        if not (protocol and from_id and to_id and stamp and nonce and signature and purpose):
            raise QueueError(e.E_UNAUTHENTICATED, "a peer link needs the X-Peer-* headers")
        if purpose != self.purpose:
            raise QueueError(e.E_UNAUTHENTICATED, f"this port serves {self.purpose} links, not {purpose[:20]!r}")
        if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 20 or len(nonce) > NONCE_CHARACTERS_MAX:
            raise QueueError(e.E_UNAUTHENTICATED, "malformed X-Peer-* headers")
        if to_id != self.node_id:
            raise QueueError(e.E_UNAUTHENTICATED, f"this node is {self.node_id}, not {to_id[:64]}")
        peer = self._peers.get(from_id)
        if peer is None:
            raise QueueError(e.E_UNAUTHENTICATED, f"{from_id[:64]} is not a peer of {self.node_id}")
        now_ms = int(time.time() * 1000)
        if abs(now_ms - int(stamp)) > TIMESTAMP_SKEW_MAX_MS:
            raise QueueError(e.E_STALE_REQUEST, "the peer timestamp is outside the accepted window")
        expected = peer_signature(self._secret, from_id, to_id, int(stamp), nonce, purpose)
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            raise QueueError(e.E_UNAUTHENTICATED, "bad peer signature (is the cluster secret the same?)")
        self._remember_nonce(f"{from_id}:{nonce}", now_ms)
        if self._dials(peer):
            raise QueueError(e.E_BAD_REQUEST, f"{self.node_id} dials {from_id}, not the reverse")
        return peer

    def _remember_nonce(self, key: str, now_ms: int) -> None:
        """Refuse a replayed upgrade; a nonce older than the clock window cannot pass anyway."""
        horizon_ms = now_ms - 2 * TIMESTAMP_SKEW_MAX_MS
        nonces = self._nonces
        while nonces and (next(iter(nonces.values())) < horizon_ms or len(nonces) >= NONCES_KEPT_MAX):
            nonces.popitem(last=False)
        if key in nonces:
            raise QueueError(e.E_REPLAYED_REQUEST, "this peer nonce was already used")
        nonces[key] = now_ms

    # --- dialing -------------------------------------------------------------------------------
    def _dials(self, peer: _Peer) -> bool:
        """Exactly one link per pair: the lower id dials, unless one of the two does not listen."""
        if not peer.url:
            return False
        return not self._listening or self.node_id < peer.peer_id

    def _start_dialer(self, peer: _Peer) -> None:
        if self._dials(peer) and peer.dialer is None:
            peer.dialer = asyncio.get_running_loop().create_task(self._dial_forever(peer))
            peer.dialer.add_done_callback(self._dialer_ended)

    @staticmethod
    def _dialer_ended(task: asyncio.Task[None]) -> None:
        # Only cancellation ends a dialer; anything else is a bug (often a callback that
        # raised) and would leave that peer without a link for good: the node stops and its
        # supervisor starts it again.
        if not task.cancelled() and task.exception() is not None:
            stop_process("a peer dialer died", task.exception())

    async def _dial_forever(self, peer: _Peer) -> None:
        delay_s = self._delay_initial_s
        while not peer.removed:
            dialed = await self._dial_once(peer)
            if dialed is not None:
                peer.refusal = None
                self.links_dialed += 1
                opened_s = time.monotonic()
                await self._run_link(peer, *dialed)
                # A link that lived long resets the backoff; one that keeps breaking at once
                # (a peer that refuses our frames) must not become a tight redial loop.
                if time.monotonic() - opened_s >= self._delay_max_s:
                    delay_s = self._delay_initial_s
            await asyncio.sleep(delay_s * self._rng.uniform(0.5, 1.0))
            delay_s = min(delay_s * 2, self._delay_max_s)

    async def _dial_once(self, peer: _Peer) -> tuple[aiohttp.ClientWebSocketResponse, LinkKeys, int, Side] | None:
        if self._session is None:
            raise RuntimeError("the transport is not started")
        # The signed headers and this side's versions (a 0.1.0 responder ignores the latter).
        headers = auth_headers(self._secret, self.node_id, peer.peer_id, purpose=self.purpose)
        headers.update(peer_offer(self._mine))
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                ws = await self._session.ws_connect(
                    dial_url(peer.url), headers=headers, heartbeat=self._heartbeat_s, compress=0,
                    max_msg_size=self._receive_bytes_max, timeout=aiohttp.ClientWSTimeout(ws_close=self._close_timeout_s))
        except aiohttp.WSServerHandshakeError as error:
            code = error.headers.get("X-Error-Code", "?") if error.headers else "?"
            if code == e.E_VERSION_MISMATCH.code and error.headers:
                self._refused_on_versions(peer, error.headers)
            else:
                log.warning("peer %s at %s refused the link: HTTP %s %s", peer.peer_id, peer.url, error.status, code)
            return None
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            log.debug("cannot reach peer %s at %s: %r", peer.peer_id, peer.url, error)
            return None
        try:
            answer = getattr(ws, "_response", None)     # the 101 answer (aiohttp keeps no public handle)
            version, other = dialer_outcome(self.purpose, answer.headers if answer is not None else {}, self._mine)
            too_old = self.admits(other)
            if too_old is not None:
                raise QueueError(e.E_VERSION_MISMATCH, too_old)
        except QueueError as error:
            self._note_refusal(peer, error.message, "the link was closed to")
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=error.code.encode())
            return None
        try:
            keys = await dial_handshake(ws, self._secret, self.purpose, self.node_id, peer.peer_id,
                                        headers[HEADER_NONCE], self._connect_timeout_s)
        except FrameError as error:
            # Whoever answered there does not hold the cluster secret (or serves the other
            # purpose): it gets nothing beyond the upgrade request.
            self.responders_refused += 1
            log.warning("peer %s at %s failed the challenge, closing: %s", peer.peer_id, peer.url, error)
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as error:
            log.info("handshake with peer %s at %s broke: %r", peer.peer_id, peer.url, error)
        else:
            return ws, keys, version, other
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"E_UNAUTHENTICATED")
        return None

    def _refused_on_versions(self, peer: _Peer, answer: Mapping[str, str]) -> None:
        """The responder shares no version with this side: say so once per change (the dialer
        keeps redialing, so an operator who upgrades the other side sees the link come up)."""
        try:
            negotiate(self.purpose, self._mine, peer_side(self.purpose, answer))
            refusal = f"the peer refused this side's {self.purpose} versions {self._mine.protocol.render()}"
        except QueueError as error:
            refusal = error.message
        self._note_refusal(peer, refusal, "the link was refused by")

    @staticmethod
    def _note_refusal(peer: _Peer, refusal: str, what: str) -> None:
        """Keep a refusal on versions for /healthz, and log it once per change: the dialer
        redials several times a second, and an operator watches for the link to come up."""
        if refusal != peer.refusal:
            log.warning("%s peer %s: %s", what, peer.peer_id, refusal)
        peer.refusal = refusal

    # --- one link ------------------------------------------------------------------------------
    async def _run_link(self, peer: _Peer, ws: Socket, keys: LinkKeys, version: int, other: Side) -> None:
        link = _Link(peer, ws, keys, version, other)
        self._attach(link)
        try:
            await self._read(link)
        finally:
            await self._detach(link)

    def _attach(self, link: _Link) -> None:
        """Make `link` the peer's link; a newer link always replaces an older one."""
        peer = link.peer
        older, peer.link = peer.link, link
        if older is not None:
            if older.writer is not None:
                older.writer.cancel()
            self._close_soon(older, WSCloseCode.OK, b"superseded")
            self._on_link_change(peer.peer_id, False)
        link.writer = asyncio.get_running_loop().create_task(self._write(link))
        self._on_link_change(peer.peer_id, True)

    async def _detach(self, link: _Link) -> None:
        peer = link.peer
        current = peer.link is link
        if current:
            peer.link = None
        if link.writer is not None:
            link.writer.cancel()
        # The peer closed the link saying it goes away (its orderly stop, or this node removed it),
        # not a break that a redial may mend: its masters need not wait out the replica lag bound
        # before recording it out of sync (replication/master.py link_down). 0.1.0 closes so too.
        peer.went_away = not self._stopping and link.ws.close_code == WSCloseCode.GOING_AWAY
        try:
            if current:   # before the close handshake, which may wait on a dead socket
                self._on_link_change(peer.peer_id, False)
        finally:
            try:
                if link.writer is not None:
                    _log_failure(await asyncio.gather(link.writer, return_exceptions=True), peer.peer_id)
                await link.ws.close()
            finally:
                link.finished.set()

    async def _read(self, link: _Link) -> None:
        try:
            await self._read_frames(link)
        except (aiohttp.ClientError, OSError) as error:
            # The socket broke under the reader: aiohttp answers a ping with a pong from inside
            # receive(), which raises on a transport already closing (a peer paused or cut off
            # and back). The link ends like any other; the dialer dials again.
            log.info("link to peer %s broke: %r", link.peer.peer_id, error)

    async def _read_frames(self, link: _Link) -> None:
        async for frame in link.ws:
            if frame.type is WSMsgType.BINARY and self._deliver(link, frame.data):
                continue
            if frame.type is WSMsgType.ERROR:   # heartbeat timeout, oversized frame, reset
                log.info("link to peer %s failed: %r", link.peer.peer_id, frame.data)
                return
            if frame.type is not WSMsgType.BINARY:
                self._count_bad_frame(link, f"a {frame.type.name} frame")
            await link.ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"E_BAD_FRAME")
            return

    def _count_bad_frame(self, link: _Link, reason: str) -> None:
        # Bad input from a peer is counted and costs only its link; the peer redials.
        self.bad_frames += 1
        log.warning("bad frame from peer %s, closing the link: %s", link.peer.peer_id, reason)

    def _deliver(self, link: _Link, data: bytes) -> bool:
        try:
            messages = decode_frame(link.keys.open(data))
        except FrameError as error:
            self._count_bad_frame(link, str(error))
            return False
        self.frames_received += 1
        if link.peer.link is not link:
            return True   # a newer link replaced this one; these may be lost (module docstring)
        on_message, peer_id = self._on_message, link.peer.peer_id
        try:
            for message in messages:
                on_message(peer_id, message)
        except RefusedMessage as error:
            self._count_bad_frame(link, f"a message refused: {error}")
            return False
        return True

    async def _write(self, link: _Link) -> None:
        """Drain the peer's queue into frames; owns every write of data to this socket."""
        peer = link.peer
        try:
            while True:
                while not peer.queue:
                    peer.wake.clear()
                    await peer.wake.wait()
                frame = link.keys.seal(encode_frame(self._take_batch(peer)))
                await link.ws.send_bytes(frame)
                self.frames_sent += 1
        except (ConnectionError, RuntimeError) as error:
            # The batch just taken is lost with the socket (module docstring); the reader
            # sees the closed socket too and ends the link.
            log.info("write to peer %s failed: %r", peer.peer_id, error)
            self._close_soon(link, WSCloseCode.INTERNAL_ERROR, b"")

    def _take_batch(self, peer: _Peer) -> list[bytes]:
        queue = peer.queue
        batch: list[bytes] = []
        frame_bytes = FRAME_OVERHEAD_BYTES
        taken_bytes = 0
        while queue:
            message_bytes = len(queue[0])
            if batch and frame_bytes + message_bytes + ITEM_OVERHEAD_BYTES > self._frame_bytes_max:
                break
            batch.append(queue.popleft())
            frame_bytes += message_bytes + ITEM_OVERHEAD_BYTES
            taken_bytes += message_bytes
        peer.queued_bytes -= taken_bytes
        return batch

    # --- closing -------------------------------------------------------------------------------
    def _remove_peer(self, peer: _Peer) -> None:
        peer.removed = True
        peer.queue.clear()
        peer.queued_bytes = 0
        if peer.dialer is not None:
            peer.dialer.cancel()   # its link ends with it
            self._track(peer.dialer)
        elif peer.link is not None:
            self._close_soon(peer.link, WSCloseCode.GOING_AWAY, b"removed")

    def _close_soon(self, link: _Link, code: int, message: bytes) -> None:
        """Close from outside the link's own task; its reader then ends the link."""
        self._track(asyncio.get_running_loop().create_task(link.ws.close(code=code, message=message)))

    def _track(self, task: asyncio.Task[Any]) -> None:
        """Keep a fire-and-forget task until it ends, so stop() can wait for it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)

    async def _wait_finished(self, link: _Link) -> None:
        # The link's own task (an aiohttp handler) ends it; bounded, as the close itself is.
        try:
            async with asyncio.timeout(self._close_timeout_s * 2):
                await link.finished.wait()
        except TimeoutError:
            log.warning("link to peer %s did not end in time", link.peer.peer_id)


def _log_failure(results: Iterable[object], peer_id: str) -> None:
    for result in results:
        if isinstance(result, Exception):
            log.error("a task of the link to peer %s failed", peer_id, exc_info=result)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a fire-and-forget task's outcome as seen; closing a dead socket may fail."""
    if not task.cancelled():
        task.exception()


def _check_limits(secret: bytes, send_queue_bytes_max: int, frame_bytes_max: int, delay_initial_s: float,
                  delay_max_s: float, heartbeat_s: float) -> None:
    if not secret:
        raise ValueError("the cluster secret is empty")
    if frame_bytes_max <= FRAME_OVERHEAD_BYTES + ITEM_OVERHEAD_BYTES or send_queue_bytes_max <= 0:
        raise ValueError("frame_bytes_max and send_queue_bytes_max must leave room for a message")
    if not 0 < delay_initial_s <= delay_max_s:
        raise ValueError("reconnect delays must satisfy 0 < initial <= max")
    if heartbeat_s <= 0:
        raise ValueError("heartbeat_s must be positive")
