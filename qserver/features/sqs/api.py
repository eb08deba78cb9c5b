"""The SQS-compatible endpoint at `/sqs/` (docs/SQS.md): every node serves it on its own port.

A request is authenticated here with AWS Signature Version 4 against the access key's secret
(`NodeServices.access_key`), not by the node's signed-request middleware (qserver/api/http_api.py
skips `/sqs`), then made as the key's client through a delegated client library instance, so it
has exactly that client's grants and reaches the queue's master from any node.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from aiohttp import web

from client.aio import AsyncClient
from qserver.features.delegated import DelegatedClients
from qserver.features.sqs import codec, sigv4
from qserver.features.sqs.actions import Actions, Caller
from qserver.features.sqs.errors import (
    ACCESS_DENIED,
    INTERNAL_ERROR,
    INVALID_ACTION,
    INVALID_CLIENT_TOKEN_ID,
    REQUEST_TOO_LARGE,
    SIGNATURE_DOES_NOT_MATCH,
    SIGV4_KINDS,
    SqsError,
    from_queue_error,
)
from qserver.metrics import render_family
from wire.errors import QueueError
from wire.signing import audience_of

if TYPE_CHECKING:
    from qserver.services import NodeServices

log = logging.getLogger("qserver.sqs")
PREFIX = "/sqs"
REQUEST_BYTES_MAX = 1 << 20      # SQS's 256 KiB message, ten of a batch's attributes and the encoding: 1 MiB
CLIENTS_MAX = 64                 # access keys' clients with a client library instance here (LRU)
SQS_APP_KEY: web.AppKey[SqsGateway] = web.AppKey("sqs_gateway")


def is_sqs_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class SqsGateway:
    def __init__(self, services: NodeServices, delegation_secret: Callable[[], bytes],
                 audiences: Callable[[], frozenset[str]] = frozenset) -> None:
        self._services = services
        # This node's own addresses (host:port, qserver/api/auth.py bind): a request signed for
        # another node's Host is refused here, as our own signatures are (docs/SECURITY.md).
        self._audiences = audiences
        self.clients = DelegatedClients(services.url, services.tls_ca_file, delegation_secret, CLIENTS_MAX)
        self.actions = Actions(services.url, lambda: services.cluster_map)
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()   # (action, outcome)
        self.clock: Callable[[], float] = time.time
        self._request_prefix = uuid.uuid4().hex[:12]
        self._request_numbers = itertools.count(1)
        self._placed: weakref.WeakSet[AsyncClient] = weakref.WeakSet()     # clients that read the map once

    def authenticate(self, request: sigv4.Request, host: str = "", secure: bool = False) -> tuple[str, str]:
        """(client id, region) of a correctly signed request, or SqsError. `host`: the signed
        Host header, which must name this node: a request captured at one node holds only there."""
        try:
            claim = sigv4.parse(request)
            audiences = self._audiences()
            if audiences and audience_of(host, secure=secure) not in audiences:
                raise SqsError(SIGNATURE_DOES_NOT_MATCH, f"the request is signed for host {host[:100]!r}, not for "
                                                         "this node: a signature holds only at the node it names")
            found = self._services.access_key(claim.key_id)
            if found is None:
                raise SqsError(INVALID_CLIENT_TOKEN_ID, "The security token included in the request is invalid.")
            client_id, secret = found
            sigv4.verify(request, claim, secret, self.clock())
        except sigv4.SigV4Error as error:
            raise SqsError(SIGV4_KINDS.get(error.code, ACCESS_DENIED), error.message) from None
        return client_id, claim.region

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = f"{self._request_prefix}-{next(self._request_numbers):012x}"     # unique, and no uuid4's cost
        action, json_protocol = "", request.headers.get("X-Amz-Target", "").startswith(codec.TARGET_PREFIX)
        try:
            if request.content_length is not None and request.content_length > REQUEST_BYTES_MAX:
                raise SqsError(REQUEST_TOO_LARGE, f"the request is over {REQUEST_BYTES_MAX} bytes")
            body = await _bounded_body(request)
            raw_path, _, raw_query = request.raw_path.partition("?")
            signed = sigv4.Request.of(request.method, raw_path, raw_query, request.headers.items(), body)
            if json_protocol:        # named before the check, for the metrics of refused calls
                action = request.headers["X-Amz-Target"][len(codec.TARGET_PREFIX):][:64]
            # Who it is first: nothing of an unauthenticated request is read further.
            client_id, region = self.authenticate(signed, request.headers.get("Host", ""), request.secure)
            if json_protocol:
                action, params = codec.json_request(request.headers["X-Amz-Target"], body)
            else:
                pairs = parse_qsl(raw_query, keep_blank_values=True)
                if request.method == "POST":
                    pairs += parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True)
                action, params = codec.query_request(pairs)
                if "QueueUrl" not in params and request.match_info.get("queue"):
                    params["QueueUrl"] = f"{PREFIX}/{request.match_info['account']}/{request.match_info['queue']}"
            handler = self.actions.handler(action)
            if handler is None:
                raise SqsError(INVALID_ACTION, f"The action {action[:80] or '(none)'} is not valid for this "
                                               "endpoint (docs/SQS.md lists what qcluster serves).")
            caller = Caller(client_id, await self._client(client_id), region,
                            lambda url: self.clients.client_for(client_id, url))
            try:
                result = await handler(caller, params)
            except QueueError as error:
                raise from_queue_error(error) from None
        except SqsError as error:
            # Only known actions label the metrics: a caller must not grow their families at will.
            self.calls[(action if self.actions.handler(action) else "unknown", error.kind.code)] += 1
            return _error_response(error, json_protocol, request_id)
        except Exception:   # never a traceback to the SDK: a 500 it retries, the log has it
            log.exception("SQS %s failed", action)
            self.calls[(action if self.actions.handler(action) else "unknown", INTERNAL_ERROR.code)] += 1
            return _error_response(SqsError(INTERNAL_ERROR, "an unexpected error", "E_INTERNAL"), json_protocol,
                                   request_id)
        self.calls[(action, "ok")] += 1
        headers = {"x-amzn-RequestId": request_id}
        if json_protocol:
            return web.json_response(result, content_type=codec.JSON_CONTENT_TYPE, headers=headers)
        return web.Response(text=codec.xml_answer(action, result, request_id), content_type="text/xml",
                            headers=headers)

    async def _client(self, client_id: str) -> AsyncClient:
        client = self.clients.client_for(client_id)
        if client not in self._placed:
            # Before its first reading of the map a client sends everything to its home node,
            # and under `producer` a replica there would lease its own copies: read it first,
            # so receives (and the receipt handles naming their node) go to the master.
            with contextlib.suppress(QueueError):
                await client.refresh_placement()
            self._placed.add(client)
        return client

    def render_metrics(self) -> list[str]:
        calls = [({"action": action, "outcome": outcome}, count)
                 for (action, outcome), count in sorted(self.calls.items())]
        return (render_family("qserver_sqs_calls_total", "counter",
                              "SQS calls this node answered, by action and outcome (ok or SQS's error code)", calls)
                + render_family("qserver_sqs_stale_deletes_total", "counter",
                                "DeleteMessage calls with an ended lease's receipt handle, answered with success "
                                "as SQS does (the message stays)", [({}, self.actions.stale_deletes)])
                + render_family("qserver_sqs_delegating_clients", "gauge",
                                "access keys' clients with a client library instance here (SQS gateway)",
                                [({}, len(self.clients))]))

    async def close(self) -> None:
        await self.clients.close()


async def _bounded_body(request: web.Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > REQUEST_BYTES_MAX:
            raise SqsError(REQUEST_TOO_LARGE, f"the request is over {REQUEST_BYTES_MAX} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(error: SqsError, json_protocol: bool, request_id: str) -> web.Response:
    headers = {"x-amzn-RequestId": request_id}
    if json_protocol:
        body, extra = codec.json_error(error)
        return web.json_response(body, status=error.kind.status, content_type=codec.JSON_CONTENT_TYPE,
                                 headers={**headers, **extra})
    return web.Response(text=codec.xml_error(error, request_id), status=error.kind.status, content_type="text/xml",
                        headers=headers)


def add_routes(app: web.Application, gateway: SqsGateway) -> None:
    app[SQS_APP_KEY] = gateway
    for path in (PREFIX, PREFIX + "/", PREFIX + "/{account:[0-9]{12}}/{queue}"):
        app.router.add_route("POST", path, gateway.handle)
        app.router.add_route("GET", path, gateway.handle)
