"""The error envelope of DESIGN.md 4.4 as an aiohttp response, for every HTTP surface."""
from __future__ import annotations

from aiohttp import web

from client.errors import QueueError


def error_response(error: QueueError) -> web.Response:
    # The code also travels as a header: a refused WebSocket upgrade hides its body from clients.
    return web.json_response(error.envelope(), status=error.http_status, headers={"X-Error-Code": error.code})
