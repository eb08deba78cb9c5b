"""Request signing shared by the client (signs) and the server (verifies).

Every HTTP request, and the WebSocket upgrade request, carries four headers:

    X-Client-Id   the registered client's id
    X-Timestamp   milliseconds since the Unix epoch on the client's clock
    X-Nonce       16 random bytes, hex; the server refuses a nonce it has already seen
    X-Signature   "QS2:" + base64 Ed25519 signature over the canonical string below

The canonical string (scheme QS2, docs/PROTOCOL.md "Signing") binds the client, the node
addressed (its audience: the request's `Host`, as host:port), method, path, query, time,
nonce, every request header that changes what the node does (SIGNED_REQUEST_HEADERS, in that
order, absent = empty) and the body:

    "QS2\\n" CLIENT_ID "\\n" AUDIENCE "\\n" METHOD "\\n" PATH "\\n" SORTED_QUERY "\\n" TIMESTAMP "\\n"
    NONCE "\\n" X-PRIORITY "\\n" X-DEDUPE-ID "\\n" X-HEADERS "\\n" SHA256_HEX(BODY)

SORTED_QUERY is the query's key=value pairs, percent-encoded, sorted, joined with "&". The
audience is what keeps a captured request from running once more at another node (each node
keeps its own nonces): a node takes only requests addressed to one of its own addresses.
The text is encoded as UTF-8 with surrogate escapes: exactly the bytes a header carried.
"""
from __future__ import annotations

import base64
import hashlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import quote

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from yarl import URL

SIGNATURE_VERSION = "QS2"
SIGNATURE_PREFIX = SIGNATURE_VERSION + ":"      # X-Signature of a client: "QS2:" + base64
HEADER_CLIENT = "X-Client-Id"
HEADER_TIMESTAMP = "X-Timestamp"
HEADER_NONCE = "X-Nonce"
HEADER_SIGNATURE = "X-Signature"
SIGNED_HEADERS = (HEADER_CLIENT, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)
# The request headers the HTTP API reads that change what a request does (qserver/api/message_routes.py,
# qserver/features/channels/api.py): covered by the signature, in this order, absent = empty.
SIGNED_REQUEST_HEADERS = ("X-Priority", "X-Dedupe-Id", "X-Headers")
SECURE_SCHEMES = frozenset({"https", "wss"})


def canonical_query(pairs: Iterable[tuple[str, str]]) -> str:
    return "&".join(sorted(f"{quote(k, safe='', errors='surrogateescape')}="
                           f"{quote(v, safe='', errors='surrogateescape')}" for k, v in pairs))


def audience_of(address: str, *, secure: bool = False) -> str:
    """The audience of a request: `host:port`, lowercase, the port always written (the
    scheme's default when the address has none), an IPv6 host in brackets. `address` is a URL
    (http, https, ws, wss: its scheme says the default port) or a `Host` header's value
    (`secure`: the request came over TLS)."""
    text = address.strip()
    if "://" in text:
        try:
            url = URL(text)
            host = (url.raw_host or "").lower()
            port = url.explicit_port or (443 if url.scheme in SECURE_SCHEMES else 80)
        except ValueError:           # no URL (a `Host` header is anything a client sends)
            return text.lower()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    text = text.lower()
    if text.startswith("["):
        end = text.find("]")
        if end != -1 and text[end + 1:end + 2] == ":":
            return text
        return text + (":443" if secure else ":80")
    if ":" in text:
        return text
    return text + (":443" if secure else ":80")


def _header(headers: Mapping[str, str] | None, name: str) -> str:
    """A header's value, "" when absent; names are case-insensitive (a plain dict too)."""
    if not headers:
        return ""
    value = headers.get(name)
    if value is None and not hasattr(headers, "getall"):       # a plain dict: any spelling
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value or ""


def header_values(headers: Mapping[str, str] | None, names: Sequence[str] = SIGNED_REQUEST_HEADERS) -> list[str]:
    return [_header(headers, name) for name in names]


def canonical_text(version: str, fields: Sequence[str], method: str, path: str, query: Iterable[tuple[str, str]],
                   timestamp_ms: int, nonce: str, values: Sequence[str], body: bytes) -> bytes:
    """The lines every scheme signs: its version and identity fields, then the request."""
    body_hash = hashlib.sha256(body).hexdigest()
    text = "\n".join((version, *fields, method.upper(), path, canonical_query(query), str(timestamp_ms), nonce,
                      *values, body_hash))
    return text.encode("utf-8", "surrogateescape")


def canonical_string(method: str, path: str, query: Iterable[tuple[str, str]], timestamp_ms: int, nonce: str,
                     body: bytes, *, client_id: str, audience: str, headers: Mapping[str, str] | None = None) -> bytes:
    """The QS2 canonical string (see the module); `audience` as audience_of gives it."""
    return canonical_text(SIGNATURE_VERSION, (client_id, audience), method, path, query, timestamp_ms, nonce,
                          header_values(headers), body)


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_to_text(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(raw).decode()


def private_key_from_text(text: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(base64.b64decode(text))


def public_key_text(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def public_key_from_text(text: str) -> Ed25519PublicKey:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


class Signer:
    """Signs requests for one client id with its private key."""

    def __init__(self, client_id: str, private_key: Ed25519PrivateKey) -> None:
        self.client_id = client_id
        self._key = private_key

    def headers(self, method: str, path: str, query: Mapping[str, str] | Iterable[tuple[str, str]],
                body: bytes = b"", *, audience: str, headers: Mapping[str, str] | None = None,
                timestamp_ms: int | None = None) -> dict[str, str]:
        """The signing headers of one request. `audience`: the URL the request goes to (or the
        `Host` it is sent with); `headers`: the other headers it is sent with, of which those
        in SIGNED_REQUEST_HEADERS are signed (send them unchanged)."""
        pairs = list(query.items()) if isinstance(query, Mapping) else list(query)
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        nonce = os.urandom(16).hex()
        message = canonical_string(method, path, pairs, stamp, nonce, body, client_id=self.client_id,
                                   audience=audience_of(audience), headers=headers)
        return {HEADER_CLIENT: self.client_id, HEADER_TIMESTAMP: str(stamp), HEADER_NONCE: nonce,
                HEADER_SIGNATURE: self.signature(message)}

    def signature(self, message: bytes) -> str:
        return SIGNATURE_PREFIX + base64.b64encode(self._key.sign(message)).decode()


def verify(public_key: Ed25519PublicKey, signature_b64: str, message: bytes) -> bool:
    """`signature_b64`: the base64 after the scheme's prefix."""
    try:
        public_key.verify(base64.b64decode(signature_b64, validate=True), message)
        return True
    except (InvalidSignature, ValueError):
        return False
