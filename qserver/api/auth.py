"""Client authentication and grants (docs/PROTOCOL.md, "Signing" and "Grants").

Registered clients are stored with their Ed25519 public key only. Every request is verified
against the QS2 canonical string of wire/signing.py, which names the node addressed (its
audience: this node takes only requests whose `Host` is one of its own addresses) and every
header that changes what the request does; timestamps outside the skew window and nonces
already seen inside it are refused, so a captured request cannot run again, here or at another
node. Grants are shell-style queue-name patterns, each with a set of privileges; the
cluster-wide privileges (clients, nodes, the journal) need a grant whose pattern is exactly
`*`.

Three schemes, told apart by X-Signature's prefix: `QS2:` a client's Ed25519 signature; `QD2:`
a node acting in a client's name (delegated_signature, macro queues over REST and the cluster
itself); `QR1:` a node passing on a request it authenticated to the node that serves it
(pass_on_signature): the envelope names both nodes and the principal, which the receiving node
looks up in its own registry. Only a request passed on may carry the server-control headers
(PASS_ON_CONTROL_HEADERS); qserver/api/http_api.py refuses them from anyone else.

Nonces are kept per client (and per passing node), each table bounded: a client that fills
its own gets E_OVERLOADED, the others are not affected. Across a restart: an orderly stop
saves the nonces of the window (`save_nonces`) and the next start loads them; after a crash
nothing was saved, so the node refuses every request signed before it started
(`not_before_ms`): what it may have seen before the crash cannot pass again, and a client
signs a new request (a client whose clock runs behind the node's by d is refused for d after
such a restart).
"""
from __future__ import annotations

import collections
import fnmatch
import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qserver.core.grants import CLUSTER_CLIENT, grants_allow
from wire.console_link import LINK_VALID_MS, signin_message
from wire.errors import (
    E_BAD_REQUEST,
    E_FORBIDDEN,
    E_INVALID_OPTION,
    E_OVERLOADED,
    E_REPLAYED_REQUEST,
    E_STALE_REQUEST,
    E_UNAUTHENTICATED,
    QueueError,
)
from wire.signing import (
    HEADER_CLIENT,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    SIGNATURE_PREFIX,
    SIGNATURE_VERSION,
    SIGNED_HEADERS,
    SIGNED_REQUEST_HEADERS,
    Signer,
    audience_of,
    canonical_string,
    canonical_text,
    header_values,
    public_key_from_text,
    verify,
)

DELEGATED_VERSION = "QD2"
DELEGATED_PREFIX = DELEGATED_VERSION + ":"   # X-Signature of a node acting for a client (see delegated_signature)
PASS_ON_VERSION = "QR1"
PASS_ON_PREFIX = PASS_ON_VERSION + ":"           # X-Signature of a node passing a request on (see pass_on_signature)
PASSED_ON_BY = "X-Forwarded-By"     # the node passing a request on (the header keeps its wire name)
PASS_ON_TO = "X-Relay-To"             # the node it is passed on to
# Headers only a node passing a request on sets (qserver/api/http_common.py): signed in its envelope,
# honoured only on a request passed on, refused from a client.
PASS_ON_CONTROL_HEADERS = ("X-Placement", "X-Own-Copy", "X-Map-Version")
SERVER_CONTROL_HEADERS = (PASSED_ON_BY, PASS_ON_TO, *PASS_ON_CONTROL_HEADERS)
PASS_ON_SIGNED_HEADERS = SIGNED_REQUEST_HEADERS + PASS_ON_CONTROL_HEADERS
CLIENT_ID_CHARS_MAX = 128
TIMESTAMP_DIGITS_MAX = 16
NONCE_CHARS_MAX = 64
SIGNATURE_CHARS_MAX = 256
SCHEME_TEXT = (f"requests are signed with scheme {SIGNATURE_VERSION}: X-Signature: {SIGNATURE_PREFIX}<base64 "
               "Ed25519 signature over the QS2 canonical string, which names the node addressed and the headers "
               "X-Priority, X-Dedupe-Id, X-Headers> (docs/PROTOCOL.md, \"Signing\"); a client signing with an "
               "older scheme (QS1) must be upgraded")


def delegated_signature(secret: bytes, message: bytes) -> str:
    """A node serving a client's call on a macro queue makes the member calls in that client's
    name (qserver/features/macro/service.py): it signs them with the cluster secret, which every node
    holds and no client does. Such a call has exactly the client's grants. `message` is the
    QS2 canonical string, so the signature names the client and the node addressed."""
    return DELEGATED_PREFIX + hmac.new(secret, DELEGATED_VERSION.encode() + b"\n" + message,
                                       hashlib.sha256).hexdigest()


class DelegatedSigner(Signer):
    """Signs as client `client_id` with the cluster secret (`QD2:`, delegated_signature): over
    the QS2 canonical string, so the signature names the client and the node it is sent to and
    holds nowhere else (docs/PROTOCOL.md, "Signing"). Macro queues, definitions import and the
    console call in a client's name with it."""

    def __init__(self, client_id: str, secret: bytes) -> None:
        self.client_id = client_id
        self._secret = secret

    def signature(self, message: bytes) -> str:
        return delegated_signature(self._secret, message)


def pass_on_message(from_id: str, to_id: str, client_id: str, method: str, path: str,
                  query: Iterable[tuple[str, str]], timestamp_ms: int, nonce: str,
                  headers: Mapping[str, str] | None, body: bytes) -> bytes:
    return canonical_text(PASS_ON_VERSION, (from_id, to_id, client_id), method, path, query, timestamp_ms, nonce,
                          header_values(headers, PASS_ON_SIGNED_HEADERS), body)


def pass_on_signature(secret: bytes, message: bytes) -> str:
    """The envelope of a request a node passes on (docs/PROTOCOL.md, "Signing"): HMAC-SHA256
    with the cluster secret over pass_on_message, which names the passing node, the node it goes
    to, the principal the passing node authenticated, the request, a fresh timestamp and nonce."""
    return PASS_ON_PREFIX + hmac.new(secret, message, hashlib.sha256).hexdigest()


def pass_on_headers(secret: bytes, from_id: str, to_id: str, client_id: str, method: str, path: str,
                  query: Iterable[tuple[str, str]], headers: Mapping[str, str], body: bytes) -> dict[str, str]:
    """The headers that make a request node-authenticated, to add to `headers` (whose
    X-Priority, X-Dedupe-Id, X-Headers and PASS_ON_CONTROL_HEADERS it signs)."""
    stamp = int(time.time() * 1000)
    nonce = os.urandom(16).hex()
    message = pass_on_message(from_id, to_id, client_id, method, path, query, stamp, nonce, headers, body)
    return {HEADER_CLIENT: client_id, HEADER_TIMESTAMP: str(stamp), HEADER_NONCE: nonce, PASSED_ON_BY: from_id,
            PASS_ON_TO: to_id, HEADER_SIGNATURE: pass_on_signature(secret, message)}


PRIVILEGES = frozenset({"post", "get", "delete", "admin"})
ADMIN_GRANTS = [{"pattern": "*", "privileges": sorted(PRIVILEGES)}]
# Nonces kept: per client (its requests inside the window: 250,000 is over 800 signed REST
# requests a second for the whole window), per passing node, and in all; past the whole bound
# a client holding more than its fair share is refused (E_OVERLOADED), the others go on.
NONCES_PER_CLIENT_MAX = 250_000
NONCES_PER_PASSING_NODE_MAX = 2_000_000
NONCES_KEPT_MAX = 4_000_000
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
    passed_on_by: str | None = None       # the node that passed the request on (its envelope's sender), if any

    def allows(self, privilege: str, queue: str) -> bool:
        key = (privilege, queue)
        allowed = self._cache.get(key)
        if allowed is None:
            allowed = grants_allow(self.grants, privilege, queue)
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
                 not_before_ms: int = 0, node_id: str = "", audiences: Iterable[str] = ()) -> None:
        self._clients = clients            # the engine's live registry (client id -> record)
        self._skew_max_ms = int(skew_max_s * 1000)
        self.not_before_ms = not_before_ms  # requests signed earlier are refused (see the module)
        self.enabled = enabled
        self._keys: dict[str, tuple[str, Ed25519PublicKey]] = {}
        self.cluster_secret = b""         # set in a cluster: accepts delegated requests and requests passed on
        self.node_id = node_id            # this node: requests passed on must name it
        self.audiences = frozenset(audiences)   # this node's own addresses (audience_of): see bind
        # Per client (and "passed-on:<node>"): nonce -> the ms until which it must be kept.
        self._nonces: dict[str, collections.OrderedDict[str, int]] = {}
        self._nonces_total = 0
        self._next_sweep_ms = 0
        self.failures = collections.Counter[str]()

    def bind(self, node_id: str, audiences: Iterable[str]) -> None:
        """This node's id and the addresses it answers at (host:port, audience_of): a request
        addressed to another is refused, one passed on must name `node_id`."""
        self.node_id = node_id
        self.audiences = frozenset(audience_of(a) for a in audiences)

    def authenticate(self, method: str, path: str, query: Iterable[tuple[str, str]],
                     headers: Any, body: bytes, *, secure: bool = False) -> Principal:
        """The principal of a request (`secure`: it came over TLS, for the default port of a
        `Host` without one)."""
        if not self.enabled:
            passed_on_by = headers.get(PASSED_ON_BY)
            return ANONYMOUS_ADMIN if passed_on_by is None else Principal("anonymous", ADMIN_GRANTS,
                                                                        passed_on_by=passed_on_by)
        try:
            return self._authenticate(method, path, list(query), headers, body, secure)
        except QueueError as error:
            self.failures[error.code] += 1
            raise

    def _authenticate(self, method: str, path: str, query: list[tuple[str, str]],
                      headers: Any, body: bytes, secure: bool) -> Principal:
        client_id = headers.get(HEADER_CLIENT)
        stamp, nonce, signature = headers.get(HEADER_TIMESTAMP), headers.get(HEADER_NONCE), headers.get(HEADER_SIGNATURE)
        if not (client_id and stamp and nonce and signature):
            raise QueueError(E_UNAUTHENTICATED, "the request is not signed (X-Client-Id, X-Timestamp, X-Nonce, "
                                                "X-Signature): " + SCHEME_TEXT)
        if len(client_id) > CLIENT_ID_CHARS_MAX or not (stamp.isascii() and stamp.isdigit()) \
                or len(stamp) > TIMESTAMP_DIGITS_MAX or len(nonce) > NONCE_CHARS_MAX \
                or len(signature) > SIGNATURE_CHARS_MAX:
            raise QueueError(E_UNAUTHENTICATED, "malformed signing headers (X-Client-Id up to 128 characters, "
                                                "X-Timestamp digits, X-Nonce up to 64, X-Signature up to 256)")
        scheme = signature[:4]
        if scheme not in (SIGNATURE_PREFIX, DELEGATED_PREFIX, PASS_ON_PREFIX):
            raise QueueError(E_UNAUTHENTICATED, "this request is signed with another scheme: " + SCHEME_TEXT)
        getall = getattr(headers, "getall", None)
        if getall is not None:
            for name in (*SIGNED_HEADERS, *SIGNED_REQUEST_HEADERS, *SERVER_CONTROL_HEADERS, "Host"):
                if len(getall(name, ())) > 1:
                    raise QueueError(E_BAD_REQUEST, f"the header {name} is sent more than once")
        timestamp_ms = int(stamp)
        now_ms = int(time.time() * 1000)
        if abs(now_ms - timestamp_ms) > self._skew_max_ms:
            raise QueueError(E_STALE_REQUEST, "the request timestamp is outside the accepted window")
        if timestamp_ms < self.not_before_ms:
            raise QueueError(E_STALE_REQUEST, "the request was signed before this node restarted: sign it again")
        if scheme == PASS_ON_PREFIX:
            return self._passed_on(client_id, method, path, query, timestamp_ms, nonce, signature, headers, body,
                                 now_ms)
        host = headers.get("Host") or ""
        audience = audience_of(host, secure=secure)
        if audience not in self.audiences:
            raise QueueError(E_UNAUTHENTICATED, f"the request is addressed to {host[:100]!r}, not to this node "
                                                f"({self.node_id}): a signature holds only at the node it names "
                                                "(docs/PROTOCOL.md, \"Signing\")")
        # The cluster acting for itself (fault surveillance moving a recipient's messages to its
        # alternatives, which an administrator chose): only a node, holding the secret, signs so.
        delegated = scheme == DELEGATED_PREFIX
        record = self._clients.get(client_id) if client_id != CLUSTER_CLIENT else \
            {"grants": ADMIN_GRANTS} if delegated else None
        if record is None:
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        message = canonical_string(method, path, query, timestamp_ms, nonce, body, client_id=client_id,
                                   audience=audience, headers=headers)
        if delegated:
            if not self.cluster_secret or not hmac.compare_digest(
                    signature.encode("utf-8", "surrogateescape"),
                    delegated_signature(self.cluster_secret, message).encode()):
                raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        elif not verify(self._public_key(client_id, record), signature[len(SIGNATURE_PREFIX):], message):
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        self._remember_nonce(client_id, nonce, timestamp_ms, now_ms, NONCES_PER_CLIENT_MAX)
        return Principal(client_id, record["grants"])

    def _passed_on(self, client_id: str, method: str, path: str, query: list[tuple[str, str]], timestamp_ms: int,
                 nonce: str, signature: str, headers: Any, body: bytes, now_ms: int) -> Principal:
        """A request another node authenticated and passes on (pass_on_signature): the envelope
        must name this node, and the principal is looked up in this node's own registry (a
        client removed here is refused here, whatever the passing node still knows)."""
        from_id, to_id = headers.get(PASSED_ON_BY) or "", headers.get(PASS_ON_TO) or ""
        if not self.cluster_secret or not from_id or len(from_id) > CLIENT_ID_CHARS_MAX:
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        if to_id != self.node_id:
            raise QueueError(E_UNAUTHENTICATED, f"a request passed on to node {to_id[:100]!r} reached "
                                                f"{self.node_id}: a request passed on holds only at the node it names")
        expected = pass_on_signature(self.cluster_secret, pass_on_message(
            from_id, to_id, client_id, method, path, query, timestamp_ms, nonce, headers, body))
        if not hmac.compare_digest(signature.encode("utf-8", "surrogateescape"), expected.encode()):
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        record = {"grants": ADMIN_GRANTS} if client_id == CLUSTER_CLIENT else self._clients.get(client_id)
        if record is None:
            raise QueueError(E_UNAUTHENTICATED, f"client {client_id} is not registered at this node (removed?)")
        self._remember_nonce("passed-on:" + from_id, nonce, timestamp_ms, now_ms, NONCES_PER_PASSING_NODE_MAX)
        return Principal(client_id, record["grants"], passed_on_by=from_id)

    def take_signin_link(self, client_id: str, audience: str, stamp: str, nonce: str, signature: str) -> Principal:
        """The principal of a console sign-in link (wire/console_link.py): signed by the client's
        own key for this node's `audience`, within LINK_VALID_MS of its timestamp, and taken once
        (its nonce is remembered like a request's). E_UNAUTHENTICATED, E_STALE_REQUEST or
        E_REPLAYED_REQUEST otherwise."""
        if not (client_id and stamp and nonce and signature) or len(client_id) > CLIENT_ID_CHARS_MAX \
                or not (stamp.isascii() and stamp.isdigit()) or len(stamp) > TIMESTAMP_DIGITS_MAX \
                or len(nonce) > NONCE_CHARS_MAX or len(signature) > SIGNATURE_CHARS_MAX:
            raise QueueError(E_UNAUTHENTICATED, "not a sign-in link: `qctl console` prints one")
        timestamp_ms, now_ms = int(stamp), int(time.time() * 1000)
        if not -self._skew_max_ms <= now_ms - timestamp_ms <= LINK_VALID_MS:
            raise QueueError(E_STALE_REQUEST, "the sign-in link has expired (a link holds for a minute): "
                                              "run `qctl console` again")
        if timestamp_ms < self.not_before_ms:
            raise QueueError(E_STALE_REQUEST, "the sign-in link was minted before this node restarted: "
                                              "run `qctl console` again")
        if audience_of(audience) not in self.audiences:
            raise QueueError(E_UNAUTHENTICATED, f"the sign-in link names {audience[:100]!r}, not this node "
                                                f"({self.node_id})")
        record = self._clients.get(client_id) if client_id != CLUSTER_CLIENT else None
        if record is None or not signature.startswith(SIGNATURE_PREFIX) or not verify(
                self._public_key(client_id, record), signature[len(SIGNATURE_PREFIX):],
                signin_message(client_id, audience, timestamp_ms, nonce)):
            raise QueueError(E_UNAUTHENTICATED, "unknown client or bad signature")
        self._remember_nonce("signin:" + client_id, nonce, timestamp_ms, now_ms, NONCES_PER_CLIENT_MAX)
        return Principal(client_id, record["grants"])

    def grants_of(self, client_id: str) -> list[dict[str, Any]] | None:
        """A registered client's grants as this node knows them now (None: not registered)."""
        record = self._clients.get(client_id)
        return None if record is None else record["grants"]

    def _public_key(self, client_id: str, record: dict[str, Any]) -> Ed25519PublicKey:
        cached = self._keys.get(client_id)
        if cached is None or cached[0] != record["public_key"]:
            cached = (record["public_key"], public_key_from_text(record["public_key"]))
            self._keys[client_id] = cached
        return cached[1]

    def save_nonces(self, path: Path) -> None:
        """At an orderly stop: the nonces still inside the window, for the next start."""
        now_ms = int(time.time() * 1000)
        kept = {owner: {nonce: until_ms for nonce, until_ms in table.items() if until_ms >= now_ms}
                for owner, table in self._nonces.items()}
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"version": 2, "nonces": {k: v for k, v in kept.items() if v}}))
        os.replace(temporary, path)

    def load_nonces(self, path: Path) -> bool:
        """At start: the nonces an orderly stop saved (the file is used once: a crash after this
        start must not find it again). False when there was none (a first start or a crash),
        or it was written by an older release (its nonces are not per client)."""
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        path.unlink(missing_ok=True)
        if not isinstance(saved, dict) or saved.get("version") != 2 or not isinstance(saved.get("nonces"), dict):
            return False
        now_ms = int(time.time() * 1000)
        for owner, table in saved["nonces"].items():
            if not isinstance(table, dict):
                continue
            kept = self._nonces.setdefault(str(owner), collections.OrderedDict())
            for nonce, until_ms in sorted(table.items(), key=lambda item: item[1] if isinstance(item[1], int) else 0):
                if isinstance(until_ms, int) and until_ms >= now_ms and len(kept) < NONCES_PER_PASSING_NODE_MAX:
                    kept[str(nonce)] = until_ms
                    self._nonces_total += 1
        return True

    def nonces_kept(self, owner: str) -> int:
        table = self._nonces.get(owner)
        return 0 if table is None else len(table)

    def _remember_nonce(self, owner: str, nonce: str, timestamp_ms: int, now_ms: int, bound: int) -> None:
        """Refuse a nonce `owner` used within the window. Each is kept until its request's
        timestamp leaves the window (past that the clock check refuses it), in a table per
        owner: a client's timestamps come from one clock, so its table is in order of expiry
        (near enough: an entry kept a little longer than needed is harmless)."""
        if now_ms >= self._next_sweep_ms:
            self._sweep(now_ms)
        table = self._nonces.get(owner)
        if table is None:
            table = self._nonces[owner] = collections.OrderedDict()
        self._expire(table, now_ms)
        if nonce in table:
            raise QueueError(E_REPLAYED_REQUEST, "this request was already received")
        if len(table) >= bound:
            raise QueueError(E_OVERLOADED, f"client {owner} has {len(table)} signed requests in the replay window, "
                                           "the most one client may have: retry in a while")
        if self._nonces_total >= NONCES_KEPT_MAX and len(table) * len(self._nonces) >= self._nonces_total:
            raise QueueError(E_OVERLOADED, "too many signed requests in the replay window: retry in a while")
        table[nonce] = timestamp_ms + self._skew_max_ms
        self._nonces_total += 1

    def _expire(self, table: collections.OrderedDict[str, int], now_ms: int) -> None:
        while table:
            _, until_ms = next(iter(table.items()))
            if until_ms >= now_ms:
                break
            table.popitem(last=False)
            self._nonces_total -= 1

    def _sweep(self, now_ms: int) -> None:
        """Once a second: what every table holds past its time goes (a client that stopped
        signing keeps nothing), and empty tables with it."""
        self._next_sweep_ms = now_ms + 1000
        for owner in list(self._nonces):
            table = self._nonces[owner]
            self._expire(table, now_ms)
            if not table:
                del self._nonces[owner]
