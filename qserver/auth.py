"""Client authentication and grants (DESIGN.md 4.5, seed 000).

Registered clients are stored with their Ed25519 public key only. Every request is verified
against the canonical string of client/signing.py; timestamps outside the skew window and
nonces already seen inside it are refused, so a captured request cannot be replayed. Grants
are shell-style queue-name patterns, each with a set of privileges.

Across a restart: an orderly stop saves the nonces of the window (`save_nonces`) and the next
start loads them; after a crash nothing was saved, so the node refuses every request signed
before it started (`not_before_ms`): what it may have seen before the crash cannot pass
again, and a client signs a new request (a client whose clock runs behind the node's by d is
refused for d after such a restart).
"""
from __future__ import annotations

import collections
import fnmatch
import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from client.errors import (
    E_FORBIDDEN,
    E_INVALID_OPTION,
    E_OVERLOADED,
    E_REPLAYED_REQUEST,
    E_STALE_REQUEST,
    E_UNAUTHENTICATED,
    QueueError,
)
from client.signing import (
    HEADER_CLIENT,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    canonical_string,
    public_key_from_text,
    verify,
)

DELEGATED_PREFIX = "node:"      # X-Signature of a node acting for a client (see delegated_signature)
CLUSTER_CLIENT = "@cluster"     # the client id of a node acting for the cluster itself (never a client's)


def delegated_signature(secret: bytes, message: bytes) -> str:
    """A node serving a client's call on a macro queue makes the member calls in that client's
    name (qserver/macro_service.py): it signs them with the cluster secret, which every node
    holds and no client does. Such a call has exactly the client's grants."""
    return DELEGATED_PREFIX + hmac.new(secret, b"QD1\n" + message, hashlib.sha256).hexdigest()


PRIVILEGES = frozenset({"post", "get", "delete", "admin"})
ADMIN_GRANTS = [{"pattern": "*", "privileges": sorted(PRIVILEGES)}]
NONCES_KEPT_MAX = 2_000_000
GRANTS_MAX = 100


def validate_grants(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or len(raw) > GRANTS_MAX:
        raise QueueError(E_INVALID_OPTION, f"grants must be a list of at most {GRANTS_MAX}")
    grants = []
    for grant in raw:
        if not isinstance(grant, dict) or set(grant) != {"pattern", "privileges"}:
            raise QueueError(E_INVALID_OPTION, 'a grant is {"pattern": ..., "privileges": [...]}')
        pattern, privileges = grant["pattern"], grant["privileges"]
        if not isinstance(pattern, str) or not 0 < len(pattern) <= 200:
            raise QueueError(E_INVALID_OPTION, "a grant pattern is a non-empty string")
        if not isinstance(privileges, list) or not privileges or not set(privileges) <= PRIVILEGES:
            raise QueueError(E_INVALID_OPTION, f"privileges are some of {', '.join(sorted(PRIVILEGES))}")
        grants.append({"pattern": pattern, "privileges": sorted(set(privileges))})
    return grants


@dataclass
class Principal:
    """An authenticated client, with its grants resolved per queue name on first use."""
    client_id: str
    grants: list[dict[str, Any]]
    _cache: dict[tuple[str, str], bool] = field(default_factory=dict)

    def allows(self, privilege: str, queue: str) -> bool:
        key = (privilege, queue)
        allowed = self._cache.get(key)
        if allowed is None:
            allowed = any(privilege in g["privileges"] and fnmatch.fnmatchcase(queue, g["pattern"])
                          for g in self.grants)
            if len(self._cache) < 10_000:
                self._cache[key] = allowed
        return allowed

    def require(self, privilege: str, queue: str = "*") -> None:
        if not self.allows(privilege, queue):
            raise QueueError(E_FORBIDDEN, f"client {self.client_id} may not {privilege} on {queue}")

    def may_see(self, queue: str) -> bool:
        return any(fnmatch.fnmatchcase(queue, g["pattern"]) for g in self.grants)

    def releases_refused_ack(self, queue: str) -> bool:
        """Whether an ack (or reply) refused here for want of `delete` releases the message's
        lease (docs/PROTOCOL.md, "Grants"): a client with `get` leased it, and may release it;
        left alone, the message would stay invisible to every consumer for its whole lease."""
        return not self.allows("delete", queue) and self.allows("get", queue)


def refused_ack_text(principal: Principal, queue: str, message_id: int, release_error: QueueError | None) -> str:
    """E_FORBIDDEN's message for an ack or reply refused for want of `delete` from a client
    that may `get`, saying what became of the message: released (`release_error` None), or
    not, and why."""
    refused = f"client {principal.client_id} may not delete on {queue}"
    if release_error is None:
        return (f"{refused}: message {message_id} was released instead (its lease ended), ready for delivery again "
                "(or dead-lettered if that was its last delivery)")
    return f"{refused}; releasing message {message_id} failed too ({release_error.code}: {release_error.message})"


ANONYMOUS_ADMIN = Principal("anonymous", ADMIN_GRANTS)   # when auth is switched off


class Authenticator:
    def __init__(self, clients: dict[str, dict[str, Any]], *, skew_max_s: float, enabled: bool = True,
                 not_before_ms: int = 0) -> None:
        self._clients = clients            # the engine's live registry (client id -> record)
        self._skew_max_ms = int(skew_max_s * 1000)
        self.not_before_ms = not_before_ms  # requests signed earlier are refused (see the module)
        self.enabled = enabled
        self._keys: dict[str, tuple[str, Ed25519PublicKey]] = {}
        self.cluster_secret = b""         # set in a cluster: accepts delegated signatures
        self._nonces: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.failures = collections.Counter[str]()

    def authenticate(self, method: str, path: str, query: Iterable[tuple[str, str]],
                     headers: Any, body: bytes) -> Principal:
        if not self.enabled:
            return ANONYMOUS_ADMIN
        try:
            return self._authenticate(method, path, query, headers, body)
        except QueueError as error:
            self.failures[error.code] += 1
            raise

    def _authenticate(self, method: str, path: str, query: Iterable[tuple[str, str]],
                      headers: Any, body: bytes) -> Principal:
        client_id = headers.get(HEADER_CLIENT)
        stamp, nonce, signature = headers.get(HEADER_TIMESTAMP), headers.get(HEADER_NONCE), headers.get(HEADER_SIGNATURE)
        if not (client_id and stamp and nonce and signature):
            raise QueueError(E_UNAUTHENTICATED, "the request is not signed (X-Client-Id, X-Timestamp, X-Nonce, X-Signature)")
        if not (stamp.isascii() and stamp.isdigit()) or len(nonce) > 64:
            raise QueueError(E_UNAUTHENTICATED, "malformed signing headers")
        timestamp_ms = int(stamp)
        now_ms = int(time.time() * 1000)
        if abs(now_ms - timestamp_ms) > self._skew_max_ms:
            raise QueueError(E_STALE_REQUEST, "the request timestamp is outside the accepted window")
        if timestamp_ms < self.not_before_ms:
            raise QueueError(E_STALE_REQUEST, "the request was signed before this node restarted: sign it again")
        # The cluster acting for itself (fault surveillance moving a recipient's messages to its
        # alternatives, which an administrator chose): only a node, holding the secret, signs so.
        record = self._clients.get(client_id) if client_id != CLUSTER_CLIENT else \
            {"grants": ADMIN_GRANTS} if signature.startswith(DELEGATED_PREFIX) else None
        if record is None:
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        message = canonical_string(method, path, query, timestamp_ms, nonce, body)
        if signature.startswith(DELEGATED_PREFIX):
            if not self.cluster_secret or not hmac.compare_digest(signature.encode(), delegated_signature(
                    self.cluster_secret, message).encode()):
                raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        elif not verify(self._public_key(client_id, record), signature, message):
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        self._remember_nonce(client_id + ":" + nonce, now_ms)
        return Principal(client_id, record["grants"])

    def _public_key(self, client_id: str, record: dict[str, Any]) -> Ed25519PublicKey:
        cached = self._keys.get(client_id)
        if cached is None or cached[0] != record["public_key"]:
            cached = (record["public_key"], public_key_from_text(record["public_key"]))
            self._keys[client_id] = cached
        return cached[1]

    def save_nonces(self, path: Path) -> None:
        """At an orderly stop: the nonces still inside the window, for the next start."""
        horizon = int(time.time() * 1000) - 2 * self._skew_max_ms
        kept = {nonce: seen_ms for nonce, seen_ms in self._nonces.items() if seen_ms >= horizon}
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(kept))
        os.replace(temporary, path)

    def load_nonces(self, path: Path) -> bool:
        """At start: the nonces an orderly stop saved (the file is used once: a crash after this
        start must not find it again). False when there was none (a first start or a crash)."""
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        path.unlink(missing_ok=True)
        if not isinstance(saved, dict):
            return False
        horizon = int(time.time() * 1000) - 2 * self._skew_max_ms
        for nonce, seen_ms in sorted(saved.items(), key=lambda item: item[1]):
            if isinstance(seen_ms, int) and seen_ms >= horizon and len(self._nonces) < NONCES_KEPT_MAX:
                self._nonces[str(nonce)] = seen_ms
        return True

    def _remember_nonce(self, nonce: str, now_ms: int) -> None:
        """Refuse a nonce seen within the skew window; older ones cannot pass the clock check."""
        nonces = self._nonces
        horizon = now_ms - 2 * self._skew_max_ms
        while nonces:
            _, seen_ms = next(iter(nonces.items()))
            if seen_ms >= horizon:
                break
            nonces.popitem(last=False)
        if nonce in nonces:
            raise QueueError(E_REPLAYED_REQUEST, "this request was already received")
        if len(nonces) >= NONCES_KEPT_MAX:
            raise QueueError(E_OVERLOADED, "too many signed requests in the replay window")
        nonces[nonce] = now_ms
