"""The node's side of client version negotiation (docs/PROTOCOL.md, "Versions and negotiation"):
every answer names this node's release, client-protocol range and the cluster feature level
(`X-Qcluster-Node`), and a request whose `X-Qcluster-Client` shares no version with this node
is refused with E_VERSION_MISMATCH before anything runs. A request without the header (a client
of release 0.1.0) is served as before. The header format is wire/version_headers.py's.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.api.http_common import NODE
from wire import versions
from wire.version_headers import CLIENT_HEADER, NODE_HEADER, check_client, node_header


def check_client_versions(request: web.Request) -> None:
    """E_VERSION_MISMATCH (or E_BAD_REQUEST for a malformed header) before the request runs."""
    check_client(request.headers.get(CLIENT_HEADER))


def cluster_feature_level(node: Any) -> int:
    """The feature level as this node's map has it (qserver/services.py `feature_level`: outside
    a cluster, this release's highest)."""
    services = getattr(node, "services", None)
    level = getattr(services, "feature_level", None)
    return int(level) if level is not None else versions.OLDEST_FEATURE_LEVEL


async def add_node_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer of this app, errors and WebSocket upgrades included."""
    node = request.app.get(NODE)
    level = versions.OLDEST_FEATURE_LEVEL if node is None else cluster_feature_level(node)
    response.headers[NODE_HEADER] = node_header(level)


def install(app: web.Application) -> None:
    app.on_response_prepare.append(add_node_header)
