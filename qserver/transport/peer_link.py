"""The wire of one peer link (docs/PROTOCOL.md, "Peer links"): what a dialer signs its upgrade
with, the challenge-response after it, the per-link keys, and the frames with their MAC.

Peer protocol 2: the upgrade request carries the headers
of `auth_headers`, bound to the link's purpose (replication or membership: each port serves one)
and both ids. That alone is replayable, so it only keeps strangers from holding a socket open: the
link is a challenge-response after it. The responder's first message is its fresh nonce and its
proof over both nonces; the dialer checks it (a responder without the cluster secret gets nothing
beyond the upgrade request) and answers with its own proof over both nonces, which the responder
checks before it delivers or sends anything. Both derive a per-link key from the secret, the
purpose, both ids and both nonces (`LinkKeys`); every later binary message is msgpack
`[PEER_FRAME_VERSION, [message, ...]]` (bin items) followed by a 32-byte HMAC-SHA256 tag over the
direction, a per-direction frame counter and the frame, so a frame altered, dropped, replayed or
reflected fails its tag and ends the link.

Beside the signed headers, the upgrade and its 101 answer carry each side's protocol range and
release, and the responder's choice (wire/version_headers.py; docs/PROTOCOL.md, "Versions and
negotiation"); qserver/transport/peers.py negotiates and keeps them per link.

Separate from the links' lifecycle (qserver/transport/peers.py) so that the protocol of a link
can be read, and tested (tests/test_security_peers.py), on its own; it also holds what both
transports offer the layers above (OnMessage, OnLinkChange, RefusedMessage).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from collections.abc import Callable

import aiohttp
import msgpack
from aiohttp import WSMsgType
from yarl import URL

PEER_PATH = "/v1/peer"


# Protocol 1 ("QP1") was a dialer-only HMAC over the ids, a timestamp and a nonce: it named no
# purpose, authenticated no responder and left frames unprotected (issue 32, item 6). A dialer
# still speaking it is refused with a message naming protocol 2.
PEER_PROTOCOL = "2"


PEER_PROTOCOL_NAME = "QP2 (challenge-response bound to the link's purpose, both ids and both nonces; MAC on every frame)"
PEER_FRAME_VERSION = 1
SIGNATURE_PREFIX = "QP2"
PURPOSES = ("replication", "membership")
HEADER_PURPOSE = "X-Peer-Purpose"
HEADER_FROM = "X-Peer-From"
HEADER_TO = "X-Peer-To"
HEADER_TIMESTAMP = "X-Peer-Timestamp"
HEADER_NONCE = "X-Peer-Nonce"
HEADER_PROTOCOL = "X-Peer-Protocol"
HEADER_AUTH = "X-Peer-Auth"
NONCE_BYTES = 16
TAG_BYTES = 32          # HMAC-SHA256


# Upper bounds of msgpack's headers: a bin32 item, and the frame's array and version (and its MAC).
ITEM_OVERHEAD_BYTES = 5


FRAME_OVERHEAD_BYTES = 16 + 32
OnMessage = Callable[[str, bytes], None]
OnLinkChange = Callable[[str, bool], None]


def ignore_link_change(peer_id: str, up: bool) -> None:
    """The default: a caller that does not care about link state."""


def peer_signature(secret: bytes, from_id: str, to_id: str, timestamp_ms: int, nonce: str,
                   purpose: str = "replication") -> str:
    """The upgrade request's HMAC: it filters strangers before any upgrade, nothing more (it is
    replayable within the clock window at a node that forgot the nonce): the link itself is
    authenticated by the challenge-response that follows."""
    text = f"{SIGNATURE_PREFIX}\nupgrade\n{purpose}\n{from_id}\n{to_id}\n{timestamp_ms}\n{nonce}"
    return hmac.new(secret, text.encode("utf-8", "replace"), hashlib.sha256).hexdigest()


def auth_headers(secret: bytes, from_id: str, to_id: str, *, purpose: str = "replication",
                 timestamp_ms: int | None = None, nonce: str | None = None) -> dict[str, str]:
    """The headers a dialer signs its upgrade request with; X-Peer-Nonce is its fresh challenge."""
    stamp_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce_text = os.urandom(NONCE_BYTES).hex() if nonce is None else nonce
    return {HEADER_FROM: from_id, HEADER_TO: to_id, HEADER_TIMESTAMP: str(stamp_ms), HEADER_NONCE: nonce_text,
            HEADER_PROTOCOL: PEER_PROTOCOL, HEADER_PURPOSE: purpose,
            HEADER_AUTH: peer_signature(secret, from_id, to_id, stamp_ms, nonce_text, purpose)}


def _handshake_mac(secret: bytes, role: str, purpose: str, dialer: str, responder: str,
                   dialer_nonce: str, responder_nonce: bytes) -> bytes:
    """What `role` (responder, dialer, or key) computes over the link's purpose, both ids and both
    nonces: a proof that answers the other side's fresh nonce, so it cannot be replayed to
    another link, port or node."""
    text = f"{SIGNATURE_PREFIX}\n{role}\n{purpose}\n{dialer}\n{responder}\n{dialer_nonce}\n".encode("utf-8", "replace")
    return hmac.digest(secret, text + responder_nonce, "sha256")


class LinkKeys:
    """One link's frame protection: a key derived from the handshake, a MAC per frame over
    (direction, per-direction counter, frame bytes). The counters are implicit (each side counts
    what it sent and received), so a frame replayed, dropped, reordered or reflected back to its
    sender fails its tag. One HMAC per frame, and frames are batches."""

    def __init__(self, key: bytes, *, dialer: bool) -> None:
        outgoing, incoming = (b"dialer>responder", b"responder>dialer")[::1 if dialer else -1]
        self._send = hmac.new(key, outgoing, hashlib.sha256)
        self._receive = hmac.new(key, incoming, hashlib.sha256)
        self.sent = 0
        self.received = 0

    @classmethod
    def derive(cls, secret: bytes, purpose: str, dialer_id: str, responder_id: str, dialer_nonce: str,
               responder_nonce: bytes, *, dialer: bool) -> LinkKeys:
        key = _handshake_mac(secret, "key", purpose, dialer_id, responder_id, dialer_nonce, responder_nonce)
        return cls(key, dialer=dialer)

    def _tag(self, base: hmac.HMAC, counter: int, frame: bytes | memoryview) -> bytes:
        mac = base.copy()
        mac.update(counter.to_bytes(8, "big"))
        mac.update(frame)
        return mac.digest()

    def seal(self, frame: bytes) -> bytes:
        self.sent += 1
        return frame + self._tag(self._send, self.sent, frame)

    def open(self, data: bytes) -> memoryview:
        """The frame inside `data`, or FrameError: a bad tag (altered, replayed, out of order)."""
        if len(data) < TAG_BYTES:
            raise FrameError("a frame is shorter than its MAC")
        view = memoryview(data)
        frame, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        if not hmac.compare_digest(self._tag(self._receive, self.received + 1, frame), tag):
            raise FrameError(f"bad MAC on frame {self.received + 1} (altered, replayed or out of order)")
        self.received += 1
        return frame


def responder_hello(secret: bytes, purpose: str, dialer_id: str, responder_id: str,
                    dialer_nonce: str) -> tuple[bytes, LinkKeys]:
    """The responder's first message (its fresh nonce and its proof) and its link keys."""
    nonce = os.urandom(NONCE_BYTES)
    proof = _handshake_mac(secret, "responder", purpose, dialer_id, responder_id, dialer_nonce, nonce)
    keys = LinkKeys.derive(secret, purpose, dialer_id, responder_id, dialer_nonce, nonce, dialer=False)
    return nonce + proof, keys


def dialer_answer(secret: bytes, purpose: str, dialer_id: str, responder_id: str, dialer_nonce: str,
                  hello: bytes) -> tuple[bytes, LinkKeys]:
    """Check the responder's hello (FrameError: it does not hold the cluster secret, or answers
    another challenge); the dialer's proof to send back and its link keys."""
    if len(hello) != NONCE_BYTES + TAG_BYTES:
        raise FrameError("the responder's hello is not a nonce and a proof")
    nonce, proof = hello[:NONCE_BYTES], hello[NONCE_BYTES:]
    expected = _handshake_mac(secret, "responder", purpose, dialer_id, responder_id, dialer_nonce, nonce)
    if not hmac.compare_digest(expected, proof):
        raise FrameError("the responder's proof does not verify (not a node of this cluster, or another purpose)")
    answer = _handshake_mac(secret, "dialer", purpose, dialer_id, responder_id, dialer_nonce, nonce)
    return answer, LinkKeys.derive(secret, purpose, dialer_id, responder_id, dialer_nonce, nonce, dialer=True)


def check_dialer_answer(secret: bytes, purpose: str, dialer_id: str, responder_id: str, dialer_nonce: str,
                        hello: bytes, answer: bytes) -> bool:
    expected = _handshake_mac(secret, "dialer", purpose, dialer_id, responder_id, dialer_nonce, hello[:NONCE_BYTES])
    return hmac.compare_digest(expected, answer)


async def dial_handshake(ws: aiohttp.ClientWebSocketResponse, secret: bytes, purpose: str, dialer_id: str,
                         responder_id: str, dialer_nonce: str, timeout_s: float) -> LinkKeys:
    """The dialer's half after the upgrade: check the responder's hello, send the proof.
    FrameError when the responder fails (the caller closes the socket; nothing else was sent)."""
    async with asyncio.timeout(timeout_s):
        hello = await ws.receive()
    if hello.type is not WSMsgType.BINARY:
        raise FrameError(f"the responder sent a {hello.type.name} message, not its hello")
    answer, keys = dialer_answer(secret, purpose, dialer_id, responder_id, dialer_nonce, hello.data)
    await ws.send_bytes(answer)
    return keys


def dial_url(base_url: str) -> str:
    """A peer's base URL gets the peer path; a URL that already has a path is used as is."""
    trimmed = base_url.rstrip("/")
    return trimmed + PEER_PATH if URL(trimmed).path in ("", "/") else base_url


class FrameError(ValueError):
    """A peer sent a frame that is not msgpack `[PEER_FRAME_VERSION, [bin, ...]]`."""


class RefusedMessage(ValueError):
    """Raised by `on_message`: an authenticated peer sent a message that is bad input for the
    layer above. The transport counts the frame as bad and drops the link (never the node)."""


def encode_frame(messages: list[bytes]) -> bytes:
    return msgpack.packb([PEER_FRAME_VERSION, messages], use_bin_type=True)


def decode_frame(data: bytes | memoryview) -> list[bytes]:
    try:
        frame = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"not msgpack: {type(error).__name__}") from None
    if type(frame) is not list or len(frame) != 2:
        raise FrameError("a frame is a two-item array")
    version, messages = frame
    if type(version) is not int or version != PEER_FRAME_VERSION:
        raise FrameError(f"frame version {version!r} is not {PEER_FRAME_VERSION}")
    if type(messages) is not list or any(type(message) is not bytes for message in messages):
        raise FrameError("a frame carries an array of bin messages")
    return messages
