"""Request signing shared by the client (signs) and the server (verifies).

Every HTTP request, and the WebSocket upgrade request, carries four headers:

    X-Client-Id   the registered client's id
    X-Timestamp   milliseconds since the Unix epoch on the client's clock
    X-Nonce       16 random bytes, hex; the server refuses a nonce it has already seen
    X-Signature   base64 Ed25519 signature over the canonical string below

The canonical string binds method, path, query, time, nonce and body (seed 000 signs the
request with the client's key; we add the body hash so a body cannot be swapped in flight):

    "QS1\\n" METHOD "\\n" PATH "\\n" SORTED_QUERY "\\n" TIMESTAMP "\\n" NONCE "\\n" SHA256_HEX(BODY)

SORTED_QUERY is the query's key=value pairs, percent-encoded, sorted, joined with "&".
"""
from __future__ import annotations

import base64
import hashlib
import os
import time
from collections.abc import Iterable, Mapping
from urllib.parse import quote

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

SIGNATURE_VERSION = "QS1"
HEADER_CLIENT = "X-Client-Id"
HEADER_TIMESTAMP = "X-Timestamp"
HEADER_NONCE = "X-Nonce"
HEADER_SIGNATURE = "X-Signature"
SIGNED_HEADERS = (HEADER_CLIENT, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)


def canonical_query(pairs: Iterable[tuple[str, str]]) -> str:
    return "&".join(sorted(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs))


def canonical_string(method: str, path: str, query: Iterable[tuple[str, str]],
                     timestamp_ms: int, nonce: str, body: bytes) -> bytes:
    body_hash = hashlib.sha256(body).hexdigest()
    text = "\n".join((SIGNATURE_VERSION, method.upper(), path, canonical_query(query),
                      str(timestamp_ms), nonce, body_hash))
    return text.encode()


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
                body: bytes = b"", *, timestamp_ms: int | None = None) -> dict[str, str]:
        pairs = list(query.items()) if isinstance(query, Mapping) else list(query)
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        nonce = os.urandom(16).hex()
        signature = self.signature(canonical_string(method, path, pairs, stamp, nonce, body))
        return {HEADER_CLIENT: self.client_id, HEADER_TIMESTAMP: str(stamp), HEADER_NONCE: nonce,
                HEADER_SIGNATURE: signature}

    def signature(self, message: bytes) -> str:
        return base64.b64encode(self._key.sign(message)).decode()


def verify(public_key: Ed25519PublicKey, signature_b64: str, message: bytes) -> bool:
    try:
        public_key.verify(base64.b64decode(signature_b64, validate=True), message)
        return True
    except (InvalidSignature, ValueError):
        return False
