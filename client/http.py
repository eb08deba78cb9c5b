"""Signed REST calls to a node: the admin API and the simple (one message per request) ops.

`qctl` and the admin half of `AsyncClient` use this module; the WebSocket in `client/aio.py`
is the fast path for messages. Every request is signed over exactly the bytes sent: the
path is percent-encoded once here and handed to aiohttp as already encoded, so the server
sees the same path string that was signed (docs/PROTOCOL.md, "Signing").

Foreign exceptions are translated in one place (`_send`): a non-2xx answer becomes the
server's `QueueError`, a connection failure becomes `E_UNAVAILABLE` and a timeout
`E_TIMEOUT`, with `outcome_unknown` set when the request may have reached the server and
the call is not idempotent.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from client import browse
from client.macro import cluster_too_old
from wire.console_link import signin_link
from wire.errors import (
    E_FEATURE_DISABLED,
    E_FORBIDDEN,
    E_INTERNAL,
    E_METHOD_NOT_ALLOWED,
    E_NOT_FOUND,
    E_QUEUE_UNAVAILABLE,
    E_TIMEOUT,
    E_UNAUTHENTICATED,
    E_UNAVAILABLE,
    E_VERSION_MISMATCH,
    QueueError,
)
from wire.http_session import signed_session
from wire.protocol import DeliveredMessage
from wire.signing import Signer
from wire.version_headers import CLIENT_HEADER, NODE_HEADER, client_header, explain_older_node, parse_side

REQUEST_TIMEOUT_S = 30.0
MOVE_WAIT_S = 30.0          # beyond the request timeout: the server's wait for a moved master's state transfer
REBALANCE_WAIT_S = 20.0     # likewise for the replicas a rebalance moves
DEFINITIONS_WAIT_S, DEFINITIONS_WAIT_PER_ITEM_S = 30.0, 0.2     # an import creates its items at the node
MAINTENANCE_WAIT_MARGIN_S = 15.0   # beyond a maintenance drain's own timeout: its last handoffs
TLS_CLOSE_GRACE_S = 0.1   # see HttpClient.close
ERROR_BODY_BYTES_MAX = 64 * 1024

Grant = Mapping[str, Any]
Query = Sequence[tuple[str, str]]
PAGE_SIZE_MAX = 1000        # the most a listing gives per page (docs/PROTOCOL.md, "limit")


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def error_from_status(status: int, body: bytes = b"", *, outcome_unknown: bool = False) -> QueueError:
    """The QueueError for a non-2xx answer: the server's envelope when there is one, else a
    code chosen by status (a proxy or a half-started server may answer without one)."""
    try:
        document = json.loads(body[:ERROR_BODY_BYTES_MAX]) if body else None
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        return QueueError.from_envelope(document, status)
    by_status = {401: E_UNAUTHENTICATED, 403: E_FORBIDDEN, 404: E_NOT_FOUND,
                 502: E_UNAVAILABLE, 503: E_UNAVAILABLE, 504: E_TIMEOUT}
    kind = by_status.get(status, E_INTERNAL)
    return QueueError(kind, f"HTTP {status} without an error envelope",
                      outcome_unknown=outcome_unknown and kind.retriable)


def query_number(value: float) -> str:
    """A number as a query value: integers without a fraction, so `wait_s=1` not `1.0`."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _segment(text: str | int) -> str:
    return quote(str(text), safe="")


def _page_query(limit: int, after: str | None) -> list[tuple[str, str]]:
    return [("limit", str(limit))] + ([("after", after)] if after else [])


def queue_path(queue: str, *rest: str | int) -> str:
    return "/v1/queues/" + "/".join([_segment(queue), *(_segment(part) for part in rest)])


def channel_path(name: str, *rest: str | int) -> str:
    return "/v1/channels/" + "/".join([_segment(name), *(_segment(part) for part in rest)])


def macro_path(name: str, *rest: str | int) -> str:
    return "/v1/macros/" + "/".join([_segment(name), *(_segment(part) for part in rest)])


class HttpClient:
    """Signed REST calls to one node. Share an aiohttp session by passing `session`;
    otherwise one is created on first use and closed by `close()`."""

    def __init__(self, url: str, signer: Signer, *, session: aiohttp.ClientSession | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, ca_file: str = "") -> None:
        """`ca_file`: the CA the node's TLS certificate must be signed by (an https:// URL)."""
        base = URL(url)
        self.url = str(base.with_path("").with_query(None)).rstrip("/")
        self._path_prefix = base.raw_path.rstrip("/")
        self._signer = signer
        self._session = session
        self._owns_session = session is None
        self._request_timeout_s = request_timeout_s
        self.ca_file = ca_file
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        # What the node named in its last answer (X-Qcluster-Node; docs/PROTOCOL.md, "Versions
        # and negotiation"): None while none was seen, or when the node named none (0.1.0 or older).
        self.server_release: str | None = None
        self.cluster_feature_level: int | None = None
        self.server_answered = False

    def note_node(self, headers: Mapping[str, str]) -> None:
        """Record the release and feature level an answer of the node named (or that it named none)."""
        try:
            node = parse_side(headers.get(NODE_HEADER))
        except ValueError:
            return      # a malformed header says nothing reliable; keep what was known
        self.server_release, self.cluster_feature_level = node.release, node.feature_level
        self.server_answered = True

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            if self.url.startswith("https://"):
                # aiohttp closes a TLS connection with a shutdown the loop finishes later: give
                # it those turns, or a loop that ends at once leaves the sockets open.
                await asyncio.sleep(TLS_CLOSE_GRACE_S)
        self._session = None

    def console_link(self) -> str:
        """A one-time link that signs this client in to the node's web console, holding for a
        minute (wire/console_link.py; docs/CONSOLE.md, "Signing in"). Minted here with the
        client's own key: nothing is sent."""
        return signin_link(self.url + self._path_prefix, self._signer)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- the one place that talks to aiohttp ------------------------------------------------
    async def request(self, method: str, path: str, *, query: Query = (), body: bytes = b"",
                      headers: Mapping[str, str] | None = None, idempotent: bool = True,
                      wait_s: float = 0.0) -> Response:
        """Send one signed request; 2xx answers come back, everything else raises QueueError.

        `path` is already percent-encoded (see `queue_path`); `wait_s` extends the timeout of
        long polls so a server-side wait is not mistaken for a dead server.
        """
        full_path = self._path_prefix + path
        query_text = "&".join(f"{_segment(k)}={_segment(v)}" for k, v in query)
        target = URL(self.url + full_path + ("?" + query_text if query_text else ""), encoded=True)
        # Signed for this node (its URL: the Host aiohttp sends), with the headers that change
        # what the request does (wire/signing.py, QS2).
        signed = self._signer.headers(method, full_path, list(query), body, audience=self.url, headers=headers)
        all_headers = {**(headers or {}), **signed, CLIENT_HEADER: client_header()}   # unsigned; 0.1.0 ignores it
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s + wait_s)
        session = self.session()
        try:
            async with session.request(method, target, data=body or None, headers=all_headers,
                                       timeout=timeout, allow_redirects=False) as answer:
                data = await answer.read()
                status, answer_headers = answer.status, answer.headers
        except aiohttp.ClientConnectorError as exc:  # nothing was sent, so nothing happened
            raise QueueError(E_UNAVAILABLE, f"cannot reach {self.url}: {exc}") from None
        except TimeoutError:  # before OSError: TimeoutError is one
            raise QueueError(E_TIMEOUT, f"{method} {full_path}: no answer in time",
                             outcome_unknown=not idempotent) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise QueueError(E_UNAVAILABLE, f"{method} {full_path}: {exc or type(exc).__name__}",
                             outcome_unknown=not idempotent) from None
        self.note_node(answer_headers)
        if not 200 <= status < 300:
            # Something this node's release lacks (a route, an option) says so, same code.
            raise explain_older_node(error_from_status(status, data, outcome_unknown=not idempotent),
                                     self.server_release, f"{method} {path}")
        return Response(status, answer_headers, data)

    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session (created on first use, inside the running loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = signed_session(connector)
            self._owns_session = True
        return self._session

    async def _json(self, method: str, path: str, *, document: Any = None, query: Query = (),
                    idempotent: bool = True, wait_s: float = 0.0) -> Any:
        body = b"" if document is None else json.dumps(document).encode()
        headers = {"Content-Type": "application/json"} if document is not None else None
        answer = await self.request(method, path, query=query, body=body, headers=headers,
                                    idempotent=idempotent, wait_s=wait_s)
        try:
            return answer.json()
        except ValueError:
            raise QueueError(E_INTERNAL, f"{method} {path}: the answer is not JSON") from None

    # --- queues -----------------------------------------------------------------------------
    async def create_queue(self, name: str, **options: Any) -> dict[str, Any]:
        """Create or open a queue; options left as None are not sent (server defaults).

        A create the cluster cannot place now (E_QUEUE_UNAVAILABLE: fewer than two live
        nodes, e.g. a node's lease renewing after a stall, or the same create under way) is
        asked again until the request timeout: creating is idempotent (the same options
        open the queue the first attempt made)."""
        chosen = {key: value for key, value in options.items() if value is not None}
        deadline = time.monotonic() + self._request_timeout_s
        pause_s = 0.05
        while True:
            try:
                return dict(await self._json("PUT", queue_path(name), document=chosen))
            except QueueError as error:
                if error.kind is not E_QUEUE_UNAVAILABLE or time.monotonic() + pause_s > deadline:
                    raise
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, 1.0)

    async def delete_queue(self, name: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", queue_path(name), idempotent=False))

    async def set_queue_options(self, name: str, **options: Any) -> dict[str, Any]:
        """PATCH /v1/queues/{q}: change the named options of an existing queue (admin grant;
        docs/PROTOCOL.md, "Changing a queue's options"); the queue's options after the change.
        Setting the same values again changes nothing, so the call is idempotent. A node of
        release 0.2.0 or older has no such method: E_FEATURE_DISABLED says the node is too old."""
        try:
            return dict(await self._json("PATCH", queue_path(name), document=dict(options)))
        except QueueError as error:
            if error.code != E_METHOD_NOT_ALLOWED.code:
                raise
            raise QueueError(E_FEATURE_DISABLED, f"the node at {self.url} (release {self.server_release or 'unknown'}) "
                                                 "is too old to change a queue's options (release 0.3.0 can): "
                                                 f"{error.message}") from None

    async def purge(self, name: str) -> dict[str, Any]:
        """Take every message the queue holds now out of it (admin grant; see docs/PROTOCOL.md)."""
        return dict(await self._json("POST", queue_path(name, "purge"), idempotent=False))

    async def redrive(self, name: str, limit: int | None = None) -> dict[str, Any]:
        """Move the queue's dead letters back into it (admin grant; see docs/PROTOCOL.md)."""
        query = [] if limit is None else [("limit", str(limit))]
        return dict(await self._json("POST", queue_path(name, "redrive"), query=query, idempotent=False))

    async def list_queues(self, *, page_size: int = PAGE_SIZE_MAX) -> list[dict[str, Any]]:
        """Every queue visible to this client (the cluster's, from any node), page after page."""
        return await self._every_page("/v1/queues", "queues", page_size)

    async def queue_page(self, limit: int = PAGE_SIZE_MAX, after: str | None = None) -> dict[str, Any]:
        """One page of GET /v1/queues: `{"queues": [...], "next": name or None}`; pass `next`
        as `after` for the page that follows."""
        return dict(await self._json("GET", "/v1/queues", query=_page_query(limit, after)))

    async def queue_page_around(self, limit: int = PAGE_SIZE_MAX, after: str | None = None, *,
                                before: str | None = None, match: str = "") -> dict[str, Any]:
        """One page of GET /v1/queues with a filter and both cursors: the queues whose name
        contains `match`, the first `limit` after `after` (or the last before `before`);
        `{"queues", "next", "previous"}` (`previous`: pass it as `before` for the page before).
        A node of release 0.2.0 or older ignores these and answers no `previous`: E_VERSION_MISMATCH
        says the node is too old rather than showing an unfiltered page."""
        query = _page_query(limit, after) + [("previous", "1")] + ([("before", before)] if before else []) \
            + ([("match", match)] if match else [])
        answer = dict(await self._json("GET", "/v1/queues", query=query))
        if "previous" not in answer:
            raise QueueError(E_VERSION_MISMATCH, f"the node at {self.url} (release {self.server_release or 'unknown'}) "
                                                  "is too old to filter queues or page backwards (release 0.3.0 can)")
        return answer

    async def _every_page(self, path: str, key: str, page_size: int) -> list[dict[str, Any]]:
        """A listing's items, page after page (`limit`, `after` = the previous page's `next`).
        A node from before paging answers one page holding everything, without `next`."""
        items: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            answer = await self._json("GET", path, query=_page_query(page_size, after))
            if not isinstance(answer, dict):
                return items + list(answer or [])
            items += answer.get(key, [])
            after = answer.get("next")
            if not after:
                return items

    async def queue_stats(self, name: str) -> dict[str, Any]:
        return dict(await self._json("GET", queue_path(name)))

    # --- macro queues (seed 004; the policies run in client/macro.py) -----------------------------
    async def create_macro(self, name: str, producer: str = "round_robin", consumer: str = "prioritized",
                           fastest_by: str = "response_time") -> dict[str, Any]:
        """Define a macro queue (admin); the same definition again is a no-op. A consumer policy
        the answering node's release predates raises E_FEATURE_DISABLED (client/macro.py)."""
        document = {"producer": producer, "consumer": consumer, "fastest_by": fastest_by}
        try:
            return dict(await self._json("PUT", macro_path(name), document=document))
        except QueueError as error:
            too_old = cluster_too_old(error, consumer)
            if too_old is None:
                raise
            raise too_old from error

    async def delete_macro(self, name: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", macro_path(name), idempotent=False))

    async def list_macros(self, *, page_size: int = PAGE_SIZE_MAX) -> list[dict[str, Any]]:
        return await self._every_page("/v1/macros", "macros", page_size)

    async def macro(self, name: str) -> dict[str, Any]:
        """A macro queue's definition, each member with its pair."""
        return dict(await self._json("GET", macro_path(name)))

    async def add_macro_member(self, name: str, queue: str, priority: int = 0, weight: int = 1) -> dict[str, Any]:
        """Add a member queue (or set its priority, 0-9, and weight, 1-100)."""
        return dict(await self._json("PUT", macro_path(name, "members", queue),
                                     document={"priority": priority, "weight": weight}))

    async def remove_macro_member(self, name: str, queue: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", macro_path(name, "members", queue)))

    # --- channels (seed 002; subscribing and publishing are on the WebSocket: client/channels.py) ---
    async def put_channel(self, name: str, delivery_class: str | None = None,
                          resend_interval_s: float | None = None, **attributes: Any) -> dict[str, Any]:
        """Create a channel, or change what is named (admin): its class, resend interval and
        attributes (size_bytes, per_second, loss_tolerant, skip_last_value)."""
        document = {key: value for key, value in (("class", delivery_class), ("resend_interval_s", resend_interval_s),
                                                  *attributes.items()) if value is not None}
        return dict(await self._json("PUT", channel_path(name), document=document))

    async def channel(self, name: str) -> dict[str, Any]:
        return dict(await self._json("GET", channel_path(name)))

    async def list_channels(self, *, page_size: int = PAGE_SIZE_MAX) -> list[dict[str, Any]]:
        return await self._every_page("/v1/channels", "channels", page_size)

    async def delete_channel(self, name: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", channel_path(name), idempotent=False))

    async def subscriptions(self, name: str) -> list[dict[str, Any]]:
        return list((await self._json("GET", channel_path(name, "subscriptions")))["subscriptions"])

    async def drop_subscription(self, name: str, subscription: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", channel_path(name, "subscriptions", subscription), idempotent=False))

    async def publish_http(self, name: str, payload: bytes, dedupe_id: str | None = None) -> dict[str, Any]:
        """Publish one message: `{"channel", "id", "epoch"}` once it is committed."""
        answer = await self.request("POST", channel_path(name, "messages"), body=payload, idempotent=False,
                                    headers={"X-Dedupe-Id": dedupe_id or uuid.uuid4().hex,
                                             "Content-Type": "application/octet-stream"})
        return dict(answer.json())

    # --- alternative recipients (seed 001) ------------------------------------------------------
    async def set_alternatives(self, recipient: str, alternatives: Sequence[str]) -> dict[str, Any]:
        """The ordered chain of recipients that take over while `recipient` is in fault (admin);
        an empty one clears it."""
        path = "/v1/recipients/" + _segment(recipient) + "/alternatives"
        return dict(await self._json("PUT", path, document={"alternatives": list(alternatives)}))

    async def alternatives(self, recipient: str) -> list[str]:
        path = "/v1/recipients/" + _segment(recipient) + "/alternatives"
        return list((await self._json("GET", path))["alternatives"])

    async def recipients(self, *, page_size: int = PAGE_SIZE_MAX) -> list[dict[str, Any]]:
        """Every recipient: `name`, `queue`, `state` (ok, fault, defunct), `since_ms`, `reason`,
        `alternatives`."""
        return await self._every_page("/v1/recipients", "recipients", page_size)

    async def remove_recipient(self, recipient: str) -> dict[str, Any]:
        """Forget a recipient (admin): `{"recipient", "removed", "named_by"}` (the recipients whose
        chains still name it); E_UNKNOWN_RECIPIENT when the map does not know it."""
        return dict(await self._json("DELETE", "/v1/recipients/" + _segment(recipient), idempotent=False))

    # --- forwards (seed 003 store-and-forward) ------------------------------------------------
    async def create_forward(self, name: str, source: str, destination: str, *, urls: Sequence[str] = (),
                             credentials: Mapping[str, str] | None = None,
                             control: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Forward `source` (a `full` queue of this cluster) into `destination`, a queue of the
        cluster at `urls` signed there with `credentials` ({"client_id", "private_key"}, and that
        cluster's CA as "ca" (PEM) or "ca_file", which the forward's TLS checks its nodes
        against), or of this cluster when no urls are given (admin)."""
        document: dict[str, Any] = {"name": name, "source": source, "destination": destination, "urls": list(urls)}
        if control:         # its own bands, weights, fill unit (docs/PROTOCOL.md "Forwards"; feature level 3)
            document["control"] = dict(control)
        if credentials is not None:
            document["credentials"] = {"client_id": credentials["client_id"],
                                       "private_key": credentials["private_key"]}
            ca = credentials.get("ca") or ""
            if not ca and credentials.get("ca_file"):
                with open(credentials["ca_file"], encoding="utf-8") as ca_pem:
                    ca = ca_pem.read()
            if ca:
                document["credentials"]["ca"] = ca
        return dict(await self._json("POST", "/v1/forwards", document=document, idempotent=False))

    async def forwards(self) -> list[dict[str, Any]]:
        """Every forward: name, source, destination, urls, client_id, and the node it runs on."""
        return list((await self._json("GET", "/v1/forwards"))["forwards"])

    async def forward_stats(self, name: str) -> dict[str, Any]:
        """A forwarder's figures from where it runs: state, rate, weight, sent, stored, the
        source's depth and overflows, the recent rate trace."""
        return dict(await self._json("GET", "/v1/forwards/" + _segment(name)))

    async def delete_forward(self, name: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", "/v1/forwards/" + _segment(name), idempotent=False))

    async def change_forward(self, name: str, control: Mapping[str, Any]) -> dict[str, Any]:
        """Change a forward's own bands, weights, fill unit (a field given as None goes back to
        the default); its entry as the map now has it (admin; feature level 3)."""
        return dict(await self._json("PATCH", "/v1/forwards/" + _segment(name), document={"control": dict(control)}))

    # --- messages ---------------------------------------------------------------------------
    async def enqueue_http(self, queue: str, payload: bytes, priority: int = 4,
                           dedupe_id: str | None = None, *, ttl_s: float | None = None,
                           delay_s: float | None = None, headers: Mapping[str, str] | None = None) -> int:
        """Enqueue one message; returns its id (once durable; on a `one_way` queue, 202 before
        it is). A dedupe id is always sent so a caller that retries after `outcome_unknown` can
        pass the same one and not store twice. `ttl_s`: the message's time to live; `delay_s`:
        its delivery delay; `headers`: a small map of names to strings delivered with it."""
        answer = await self.enqueue_answer(queue, payload, priority, dedupe_id, ttl_s=ttl_s, delay_s=delay_s,
                                           headers=headers)
        return int(answer["id"])

    async def enqueue_answer(self, queue: str, payload: bytes, priority: int = 4,
                             dedupe_id: str | None = None, *, ttl_s: float | None = None,
                             delay_s: float | None = None, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """As `enqueue_http`, the whole answer: `{"id", "epoch"}`, or on a macro queue `{"id",
        "queue", "copies", "macro"}` (the member it landed in, and under `all` every copy)."""
        fields = {"X-Priority": str(priority), "X-Dedupe-Id": dedupe_id or uuid.uuid4().hex,
                  "Content-Type": "application/octet-stream"}
        if headers:
            fields["X-Headers"] = json.dumps(dict(headers), ensure_ascii=True)
        query = [(name, query_number(value)) for name, value in (("ttl_s", ttl_s), ("delay_s", delay_s))
                 if value is not None]
        answer = await self.request("POST", queue_path(queue, "messages"), body=payload, query=query,
                                    headers=fields, idempotent=False)
        return dict(answer.json())

    async def receive_http(self, queue: str, wait_s: float = 0.0,
                           visibility_timeout_s: float | None = None) -> DeliveredMessage | None:
        """Lease the next message, or None when none arrived within `wait_s`."""
        found = await self.receive_from(queue, wait_s, visibility_timeout_s)
        return None if found is None else found[1]

    async def receive_from(self, queue: str, wait_s: float = 0.0, visibility_timeout_s: float | None = None
                           ) -> tuple[str, DeliveredMessage] | None:
        """As `receive_http`, with the queue the message is in: on a macro queue, the member its
        consumer policy chose (ack, release and extend it there)."""
        query = [("wait_s", query_number(wait_s))]
        if visibility_timeout_s is not None:
            query.append(("visibility_timeout_s", query_number(visibility_timeout_s)))
        answer = await self.request("POST", queue_path(queue, "receive"), query=query,
                                    idempotent=False, wait_s=wait_s)
        if answer.status == 204:
            return None
        headers = answer.headers
        try:
            named = headers.get("X-Headers")
            return headers.get("X-Queue", queue), DeliveredMessage(
                int(headers["X-Message-Id"]), headers["X-Receipt"], int(headers.get("X-Priority", "4")),
                int(headers.get("X-Deliveries", "1")), answer.body, None if named is None else dict(json.loads(named)))
        except (KeyError, ValueError, TypeError):
            raise QueueError(E_INTERNAL, "a receive answer lacks its message headers") from None

    async def ack_http(self, queue: str, message_id: int, receipt: str) -> None:
        await self.request("DELETE", queue_path(queue, "messages", message_id),
                           query=[("receipt", receipt)], idempotent=False)

    async def release_http(self, queue: str, message_id: int, receipt: str) -> None:
        await self.request("POST", queue_path(queue, "messages", message_id, "release"),
                           query=[("receipt", receipt)], idempotent=False)

    async def extend_http(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        await self.request("POST", queue_path(queue, "messages", message_id, "extend"),
                           query=[("receipt", receipt), ("visibility_timeout_s", f"{visibility_timeout_s:g}")],
                           idempotent=True)

    async def head(self, queue: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The message a receive would lease next, leased by no one: `{"id", "priority",
        "enqueued_ms"}`, or None when none came within `wait_s`."""
        answer = await self.request("GET", queue_path(queue, "head"), query=[("wait_s", query_number(wait_s))],
                                    wait_s=wait_s)
        return None if answer.status == 204 else dict(answer.json())

    async def peek(self, queue: str, after: int = 0, limit: int = 100, preview: bool = False) -> dict[str, Any]:
        """GET /v1/queues/{q}/messages: a page of the queue's messages in delivery order, taking
        none (client/browse.py says the shape; payloads as bytes)."""
        query = [("after", str(after)), ("limit", str(limit))] + ([("preview", "1")] if preview else [])
        return browse.page_from(await self._browsing(queue_path(queue, "messages"), query))

    async def read_message(self, queue: str, message_id: int) -> dict[str, Any]:
        """GET /v1/queues/{q}/messages/{id}: one message by id, without taking it."""
        return browse.read_from(await self._browsing(queue_path(queue, "messages", message_id), []))

    async def _browsing(self, path: str, query: list[tuple[str, str]]) -> Any:
        try:
            return await self._json("GET", path, query=query)
        except QueueError as error:
            too_old = browse.node_too_old(error, f"the node at {self.url}")
            if too_old is not None:
                raise too_old from None
            raise

    async def reply(self, queue: str, message_id: int, receipt: str, body: bytes) -> None:
        await self.request("POST", queue_path(queue, "messages", message_id, "reply"),
                           query=[("receipt", receipt)], body=body, idempotent=False,
                           headers={"Content-Type": "application/octet-stream"})

    async def message_status(self, queue: str, message_id: int, wait_s: float = 0.0,
                             until: str | None = None) -> dict[str, Any]:
        """The producer's view of a message; with `until`, wait up to `wait_s` for that state."""
        query = [("wait_s", query_number(wait_s))]
        if until is not None:
            query.append(("until", until))
        path = queue_path(queue, "messages", message_id, "status")
        return dict(await self._json("GET", path, query=query, wait_s=wait_s))

    # --- clients and cluster ------------------------------------------------------------------
    async def register_client(self, name: str, grants: Iterable[Grant],
                              public_key: str | None = None) -> dict[str, Any]:
        """Register a client; without `public_key` the server generates the key pair and
        returns the private key once, in this answer."""
        document: dict[str, Any] = {"name": name, "grants": [dict(g) for g in grants]}
        if public_key is not None:
            document["public_key"] = public_key
        return dict(await self._json("POST", "/v1/clients", document=document, idempotent=False))

    async def list_clients(self) -> list[dict[str, Any]]:
        answer = await self._json("GET", "/v1/clients")
        return list(answer.get("clients", [])) if isinstance(answer, dict) else list(answer or [])

    async def remove_client(self, client_id: str) -> dict[str, Any]:
        answer = await self._json("DELETE", "/v1/clients/" + _segment(client_id), idempotent=False)
        return dict(answer or {})

    async def set_grants(self, client_id: str, grants: Iterable[Grant]) -> dict[str, Any]:
        path = "/v1/clients/" + _segment(client_id) + "/grants"
        answer = await self._json("PUT", path, document={"grants": [dict(g) for g in grants]})
        return dict(answer or {})

    # --- access keys (docs/PROTOCOL.md, "Access keys"): the SQS gateway's credentials ---------------
    async def create_access_key(self, client_id: str) -> dict[str, Any]:
        """A new access key of the client (admin grant): `{"client", "access_key_id",
        "secret_access_key", "created_ms"}`, the only answer that holds the secret."""
        path = "/v1/clients/" + _segment(client_id) + "/access-keys"
        return dict(await self._access_keys_call("POST", path, idempotent=False))

    async def list_access_keys(self, client_id: str) -> list[dict[str, Any]]:
        """The client's access keys: `[{"access_key_id", "created_ms"}]` (never a secret)."""
        answer = await self._access_keys_call("GET", "/v1/clients/" + _segment(client_id) + "/access-keys")
        return list(answer.get("access_keys", []))

    async def revoke_access_key(self, client_id: str, key_id: str) -> dict[str, Any]:
        """Drop an access key at once, on every node: `{"client", "revoked"}`."""
        path = "/v1/clients/" + _segment(client_id) + "/access-keys/" + _segment(key_id)
        return dict(await self._access_keys_call("DELETE", path, idempotent=False))

    async def _access_keys_call(self, method: str, path: str, *, idempotent: bool = True) -> dict[str, Any]:
        try:
            return dict(await self._json(method, path, idempotent=idempotent) or {})
        except QueueError as error:
            if error.code != E_NOT_FOUND.code:      # a node of release 0.2.0 or older has no such route
                raise
            raise QueueError(E_FEATURE_DISABLED, f"the node at {self.url} (release {self.server_release or 'unknown'}) "
                                                 "is too old for access keys (release 0.3.0 has them): "
                                                 f"{error.message}") from None

    async def cluster(self, queues: Iterable[str] | None = None) -> dict[str, Any]:
        """The cluster map as the node knows it; with `queues`, only those queues' entries (and
        the nodes), at the cost of the names asked about, not of the map."""
        query = [("queue", name) for name in queues] if queues is not None else []
        return dict(await self._json("GET", "/v1/cluster", query=query))

    async def cluster_summary(self) -> dict[str, Any]:
        """GET /v1/cluster?summary=1: the nodes (each with the queues it masters and
        replicates), the map's counts and the first out-of-sync queues, not every entry."""
        return dict(await self._json("GET", "/v1/cluster", query=[("summary", "1")]))

    async def events(self, after: int = 0, limit: int = 100, wait_s: float = 0.0) -> dict[str, Any]:
        """GET /v1/events: this node's cluster events after `after` that this client may see,
        waiting up to `wait_s` (<= 20) for one (docs/PROTOCOL.md, "Events")."""
        query = [("after", str(after)), ("limit", str(limit)), ("wait_s", query_number(wait_s))]
        return dict(await self._json("GET", "/v1/events", query=query, wait_s=wait_s))

    # --- cluster operations (docs/PROTOCOL.md, REST) -------------------------------------------------------
    async def handoff(self, queue: str, initiator: str = "master") -> dict[str, Any]:
        """Swap the queue's master and replica, asked by the given member (seed 004 FIG. 23-25)."""
        return dict(await self._json("POST", queue_path(queue) + "/handoff", document={"initiator": initiator},
                                     idempotent=False))

    async def promote(self, queue: str, *, unclean: bool = False) -> dict[str, Any]:
        return dict(await self._json("POST", queue_path(queue) + "/promote", document={"unclean": unclean},
                                     idempotent=False))

    async def move_queue(self, queue: str, member: str, to: str) -> dict[str, Any]:
        """Put the queue's `member` ("master" or "replica") on node `to`. A master's move waits
        on the server for the new member's state transfer (30 s at most) and two handoffs."""
        return dict(await self._json("POST", queue_path(queue) + "/move", document={"member": member, "to": to},
                                     idempotent=False, wait_s=MOVE_WAIT_S))

    async def rebalance(self) -> dict[str, Any]:
        """Move replicas onto nodes that hold fewer members, wait (20 s at most) until they are
        in sync, then start the handoffs that spread masters evenly."""
        return dict(await self._json("POST", "/v1/cluster/rebalance", idempotent=False, wait_s=REBALANCE_WAIT_S))

    async def add_node(self, node_id: str, url: str) -> dict[str, Any]:
        return dict(await self._json("POST", "/v1/cluster/nodes", document={"id": node_id, "url": url}))

    async def drain_node(self, node_id: str) -> dict[str, Any]:
        return dict(await self._json("POST", "/v1/cluster/nodes/" + _segment(node_id) + "/drain"))

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        """A draining node serves again (draining -> up); `rebalance` then brings it members."""
        return dict(await self._json("POST", "/v1/cluster/nodes/" + _segment(node_id) + "/undrain"))

    async def drain_node_for_maintenance(self, node_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The maintenance drain (docs/OPERATIONS.md, "Rolling upgrade"): the node's masters hand
        off to their in-sync replicas, its replicas stay; answers once it masters none, with each
        handoff and its write pause. E_DRAIN_REFUSED (naming the queues) when that or stopping
        the node would leave a queue without an in-sync copy; E_TIMEOUT after `timeout_s`."""
        try:
            return dict(await self._json("POST", "/v1/cluster/nodes/" + _segment(node_id) + "/maintenance",
                                         document={"timeout_s": timeout_s}, idempotent=False,
                                         wait_s=timeout_s + MAINTENANCE_WAIT_MARGIN_S))
        except QueueError as error:
            if error.code != E_NOT_FOUND.code:
                raise
        # A node of release 0.1.0 has no such route: the same drain by per-queue handoffs.
        from client.maintenance import drain_by_handoffs
        return await drain_by_handoffs(self, node_id, timeout_s)

    async def undrain_node_from_maintenance(self, node_id: str) -> dict[str, Any]:
        """The node is out of maintenance (a node the map holds draining is set up as well)."""
        try:
            return dict(await self._json("DELETE", "/v1/cluster/nodes/" + _segment(node_id) + "/maintenance"))
        except QueueError as error:
            if error.code != E_NOT_FOUND.code:
                raise
        # A node of release 0.1.0: no node holds a mark (client/maintenance.py); a decommissioning
        # drain is undone as `undrain_node` does.
        from client.maintenance import undrain_without_marks
        return await undrain_without_marks(self, node_id)

    async def remove_node(self, node_id: str) -> dict[str, Any]:
        return dict(await self._json("DELETE", "/v1/cluster/nodes/" + _segment(node_id), idempotent=False))

    async def export_journal(self) -> dict[str, Any]:
        """Write this node's journal to Parquet now (sealed segments and the tail)."""
        return dict(await self._json("POST", "/v1/journal/export"))

    # --- versions and the cluster feature level (docs/OPERATIONS.md, "The cluster feature level") ---
    async def cluster_versions(self) -> dict[str, Any]:
        """Every node's release, storage layout, protocols and feature levels, and the map's
        feature level: `{"feature_level", "finalizable_to", "nodes": [...]}`."""
        return dict(await self._json("GET", "/v1/cluster/versions"))

    async def finalize_cluster(self, level: int | None = None) -> dict[str, Any]:
        """Raise the cluster feature level (default: the highest the node's release runs at)
        once every node supports it: `{"level", "previous", "changed", "releases"}`;
        E_NODES_BEHIND naming the nodes that lag before that. Idempotent. (A node of release
        0.1.0 has no such route: the error says the node is too old.)"""
        document = {} if level is None else {"level": level}
        return dict(await self._json("POST", "/v1/cluster/finalize", document=document))

    # --- definitions (docs/OPERATIONS.md, "Definitions: export and import") ----------------------
    async def export_definitions(self) -> dict[str, Any]:
        """GET /v1/definitions: the queues, channels, macro queues, recipients' chains, forwards
        and clients the cluster defines, as one document (admin on `*`)."""
        return dict(await self._json("GET", "/v1/definitions"))

    async def import_definitions(self, document: Mapping[str, Any], *, dry_run: bool = False,
                                 forward_credentials: Mapping[str, Mapping[str, str]] | None = None
                                 ) -> dict[str, Any]:
        """POST /v1/definitions: checks the whole document (E_INVALID_DEFINITIONS, every problem
        in the message, nothing changed), then creates what is missing: `{"dry_run", "results":
        [{"kind", "name", "status", "detail"?}], "counts"}`. `forward_credentials`: per forward
        to another cluster that is to be created, its client there ({"client_id",
        "private_key"}, and "ca" (PEM) or "ca_file"): no export holds a private key."""
        sent = dict(document)
        if forward_credentials:
            forwards = []
            for item in sent.get("forwards") or []:
                given = forward_credentials.get(item.get("name", "")) if isinstance(item, dict) else None
                if given is not None:
                    credentials = {"client_id": given["client_id"], "private_key": given["private_key"]}
                    ca = given.get("ca") or ""
                    if not ca and given.get("ca_file"):
                        with open(given["ca_file"], encoding="utf-8") as ca_pem:
                            ca = ca_pem.read()
                    if ca:
                        credentials["ca"] = ca
                    item = {**item, "credentials": credentials}
                forwards.append(item)
            sent["forwards"] = forwards
        items = sum(len(section) for section in sent.values() if isinstance(section, list))
        # Each item is a map command at the node (a few at once): the answer may take a while.
        return dict(await self._json("POST", "/v1/definitions", document=sent,
                                     query=[("dry_run", "1")] if dry_run else [], idempotent=False,
                                     wait_s=DEFINITIONS_WAIT_S + DEFINITIONS_WAIT_PER_ITEM_S * items))
