"""The error envelope (docs/PROTOCOL.md, "Errors") as an aiohttp response, for every HTTP surface,
including what aiohttp refuses itself before any handler runs."""
from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from wire.errors import E_BAD_REQUEST, E_INTERNAL, QueueError

REASON_CHARS_MAX = 200
log = logging.getLogger("qserver.http")


def error_response(error: QueueError) -> web.Response:
    # The code also travels as a header: a refused WebSocket upgrade hides its body from clients.
    return web.json_response(error.envelope(), status=error.http_status, headers={"X-Error-Code": error.code})


class _EnvelopeRequestHandler(RequestHandler):
    """aiohttp answers a request it cannot parse (a request line or a header over its limits,
    a malformed request) or a handler that crashed in plain text; this one answers with the
    envelope: E_BAD_REQUEST for the client's mistakes, E_INTERNAL for the server's."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> StreamResponse:
        if status < 500 or isinstance(exc, ConnectionResetError):
            # A malformed request is bad input and a client that hung up (a node paused past its
            # clients' patience answers them late) is an operating event: one line each, not
            # the traceback aiohttp logs at ERROR, which any client could flood the log with.
            log.info("refused a request from %s: %s", request.remote, message or exc or status)
            if request.writer.output_size > 0:
                raise ConnectionError("an answer had begun; the connection is dropped")
        else:
            super().handle_error(request, status, exc, message)   # logs it; raises if an answer already began
        reason = message or (str(exc) if exc is not None else "") or HTTPStatus(status).phrase
        error = QueueError(E_INTERNAL if status >= 500 else E_BAD_REQUEST, reason[:REASON_CHARS_MAX])
        response = error_response(error)
        response.force_close()
        return response


class _EnvelopeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _EnvelopeRequestHandler(self, loop=self._loop, **self._kwargs)


class EnvelopeAppRunner(web.AppRunner):
    """An AppRunner whose connections answer aiohttp's own refusals with the envelope. aiohttp
    has no public hook for them: the server it builds gets our request handler class (pinned
    by tests/test_bad_input.py, which fails if an aiohttp upgrade changes this)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer
        return server
