"""The REST API (aiohttp) at the paths of docs/PROTOCOL.md, "REST": its routes, and the middleware
every request passes (errors_and_auth).

Every handler authenticates (middleware), validates its input into a command, hands it to
the engine and shapes the answer. Foreign exceptions become catalog errors here and only
here; nothing a client sends can reach a core unvalidated. The handlers live by concern:
queue_routes.py (queues as a whole), message_routes.py (a queue's messages),
cluster_routes.py (the map, handoffs, moves, nodes), client_routes.py (clients and grants),
definitions_routes.py (definitions export and import); what they share is http_common.py's.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from aiohttp import web

from qserver.api import client_routes as clients
from qserver.api import cluster_routes as clusters
from qserver.api import definitions_routes as definitions
from qserver.api import drain_routes as drains
from qserver.api import event_routes, node_routes, view_routes
from qserver.api import message_routes as messages
from qserver.api import queue_routes as queues
from qserver.api import upgrade_routes as upgrades
from qserver.api.auth import SERVER_CONTROL_HEADERS
from qserver.api.http_common import MAP_VERSION, NODE, Handler, pass_on_to_master, until_map_version
from qserver.api.versions_header import check_client_versions
from qserver.api.versions_header import install as install_version_header
from qserver.http_errors import error_response
from qserver.storage.rows import SCHEMA_VERSION
from wire import errors as e
from wire import versions
from wire.errors import QueueError
from wire.signing import audience_of

log = logging.getLogger("qserver.http")
UNSIGNED_PATHS = frozenset({"/healthz", "/metrics", "/v1/peer"})   # peers authenticate with the cluster secret


@web.middleware
async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Translate every failure into the error envelope, and authenticate signed routes."""
    node = request.app[NODE]
    try:
        check_client_versions(request)      # a client sharing no protocol version: E_VERSION_MISMATCH
        if node.auth.node_id != node.config.node_id:     # the addresses signatures (and sign-in links) name
            node.auth.bind(node.config.node_id, own_addresses(node.config))
        # The console (qserver/console/) signs its visitors in with a cookie of its own; the
        # SQS endpoint (qserver/features/sqs/) checks AWS Signature Version 4 itself.
        if request.path not in UNSIGNED_PATHS and not is_console_path(request.path) \
                and not is_sqs_path(request.path):
            length = request.content_length
            if length is not None and length > node.config.body_bytes_max:
                raise QueueError(e.E_PAYLOAD_TOO_LARGE, f"body over {node.config.body_bytes_max} bytes")
            body = await request.read()
            raw_path = request.raw_path.split("?", 1)[0]
            who = node.auth.authenticate(request.method, raw_path, request.rel_url.query.items(), request.headers,
                                         body, secure=request.secure)
            request["principal"] = who
            if who.passed_on_by is None:
                refuse_server_control_headers(request)
            else:
                await until_map_version(node, request.headers.get(MAP_VERSION))
        return await handler(request)
    except QueueError as error:
        if error.code == e.E_NOT_MASTER.code and node.engine.pairs.clustered:
            passed_on = await pass_on_to_master(request, node, getattr(error, "node", None),
                                                getattr(error, "placement", None))
            if passed_on is not None:
                return passed_on
        return error_response(error)
    except web.HTTPRequestEntityTooLarge:
        return error_response(QueueError(e.E_PAYLOAD_TOO_LARGE, f"body over {node.config.body_bytes_max} bytes"))
    except web.HTTPMethodNotAllowed:
        return error_response(QueueError(e.E_METHOD_NOT_ALLOWED))
    except web.HTTPNotFound:
        return error_response(QueueError(e.E_NOT_FOUND, f"no route {request.method} {request.path}"))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        raise       # the client hung up before its answer: aiohttp's handler logs one line (http_errors.py)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(QueueError(e.E_INTERNAL))


def is_console_path(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


def is_sqs_path(path: str) -> bool:
    """The SQS endpoint's paths (docs/SQS.md): they answer errors in SQS's shapes, not ours."""
    return path == "/sqs" or path.startswith("/sqs/")


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", "::", ""})


def own_addresses(config: Any) -> set[str]:
    """The addresses this node answers at, as audiences (wire/signing.py, audience_of): its
    URL (the advertised one, and its entry in [cluster.nodes]), its `client_addresses` and the
    host:port it listens on; listening on loopback or every address, also the loopback names
    with its port. A request signed for any other address is refused here (docs/PROTOCOL.md,
    "Signing")."""
    host, port = config.host, config.port
    addresses = {audience_of(url) for url in (config.own_url, config.url, config.cluster_nodes.get(config.node_id),
                                              *config.client_addresses) if url}
    addresses.add(f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}")
    if host in LOOPBACK_HOSTS:
        addresses.update({f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"})
        if host in ("0.0.0.0", "::", ""):
            addresses.add(f"{socket.gethostname()}:{port}")
    return {audience_of(address) for address in addresses}


def refuse_server_control_headers(request: web.Request) -> None:
    """The headers a node sets when it passes a request on change what the next node does (a
    new queue's placement, a purge of one member's copy only); only a request passed on, whose
    envelope signs them, may carry them (docs/PROTOCOL.md, "Signing")."""
    for name in SERVER_CONTROL_HEADERS:
        if name in request.headers:
            raise QueueError(e.E_BAD_REQUEST, f"{name} is set only by a node passing a request on (node-"
                                              "authenticated); a client may not send it (docs/PROTOCOL.md, "
                                              "\"Signing\")")


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    engine = node.engine
    # A supervisor or load balancer reads the status code: 503 whenever the engine does not
    # take commands (starting, stopping, or failed and about to exit).
    status = "ok" if engine.serving else "failed" if engine.failed is not None else "not_serving"
    answer: dict[str, Any] = {"status": status, "node": node.config.node_id, "queues": len(engine.cores),
                              "release": versions.RELEASE, "storage_layout": SCHEMA_VERSION,
                              "protocols": {"client": versions.CLIENT_PROTOCOL.render(),
                                            "replication": versions.REPLICATION_PROTOCOL.render(),
                                            "membership": versions.MEMBERSHIP_PROTOCOL.render()},
                              "feature_levels": [versions.OLDEST_FEATURE_LEVEL, versions.FEATURE_LEVEL]}
    coordinator = node.engine.coordinator
    if coordinator is not None:      # enough for a supervisor to see the node take part
        answer["membership"] = {"leader": coordinator.membership.leader_id(), "term": coordinator.membership.term(),
                                "nodes": {n: entry.state.value for n, entry
                                          in sorted(coordinator.membership.cluster_map.nodes.items())},
                                "lease_valid": coordinator.lease_valid(), "raft": coordinator.membership.status()}
    # The cluster feature level as this node's map has it (outside a cluster: this release's
    # highest, there is no other node to keep compatible with): docs/OPERATIONS.md.
    answer["feature_level"] = (coordinator.membership.cluster_map.feature_level if coordinator is not None
                               else versions.FEATURE_LEVEL)
    # Per peer and link purpose: the negotiated protocol version and the peer's release
    # (docs/PROTOCOL.md, "Versions and negotiation").
    links = {purpose: transport.link_versions() for purpose, transport
             in (("replication", node.peers), ("membership", getattr(node, "membership_peers", None)))
             if transport is not None and hasattr(transport, "link_versions")}
    if links:
        answer["links"] = links
    return web.json_response(answer, status=200 if status == "ok" else 503)


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE]
    text = node.render_metrics() + "\n".join(upgrades.feature_level_metrics(node)) + "\n"
    return web.Response(text=text, content_type="text/plain")


def add_routes(app: web.Application) -> None:
    install_version_header(app)      # X-Qcluster-Node on every answer
    r = app.router
    r.add_put("/v1/queues/", queues.empty_queue_name)
    r.add_get("/v1/queues", queues.list_queues)
    r.add_put("/v1/queues/{q}", queues.put_queue)
    r.add_patch("/v1/queues/{q}", queues.patch_queue)       # change options (0.3.0, feature level 3)
    r.add_get("/v1/queues/{q}", queues.get_queue)
    r.add_delete("/v1/queues/{q}", queues.delete_queue)
    r.add_post("/v1/queues/{q}/messages", messages.enqueue)
    r.add_post("/v1/queues/{q}/receive", messages.receive)
    r.add_delete("/v1/queues/{q}/messages/{id}", messages.ack)
    r.add_post("/v1/queues/{q}/messages/{id}/release", messages.release)
    r.add_post("/v1/queues/{q}/messages/{id}/extend", messages.extend)
    r.add_post("/v1/queues/{q}/purge", queues.purge)
    r.add_post("/v1/queues/{q}/redrive", queues.redrive)
    r.add_post("/v1/queues/{q}/messages/{id}/reply", messages.reply)
    r.add_get("/v1/queues/{q}/messages/{id}/status", messages.message_status)
    r.add_get("/v1/queues/{q}/messages", messages.peek_messages)       # browse without taking
    r.add_get("/v1/queues/{q}/messages/{id}", messages.read_message)
    view_routes.add_routes(app)      # virtual queues: /v1/queues/{q}/virtual/... (qserver/api/view_routes.py)
    r.add_post("/v1/queues/{q}/handoff", clusters.handoff)
    r.add_post("/v1/queues/{q}/move", clusters.move)
    r.add_post("/v1/queues/{q}/promote", clusters.promote)
    r.add_post("/v1/cluster/rebalance", clusters.rebalance)
    r.add_post("/v1/cluster/nodes", clusters.add_node)
    r.add_post("/v1/cluster/nodes/{id}/drain", clusters.drain_node)
    r.add_post("/v1/cluster/nodes/{id}/undrain", clusters.undrain_node)
    r.add_post("/v1/cluster/nodes/{id}/maintenance", drains.drain_for_maintenance)
    r.add_delete("/v1/cluster/nodes/{id}/maintenance", drains.undrain_from_maintenance)
    r.add_delete("/v1/cluster/nodes/{id}", clusters.remove_node)
    r.add_post("/v1/journal/export", clusters.export_journal)
    r.add_get("/v1/cluster", clusters.cluster)
    r.add_get("/v1/cluster/versions", upgrades.cluster_versions)
    node_routes.add_routes(app)      # GET /v1/node, /v1/node/clients (qserver/api/node_routes.py)
    r.add_post("/v1/cluster/finalize", upgrades.finalize)
    r.add_post("/v1/clients", clients.register_client)
    r.add_get("/v1/clients", clients.list_clients)
    r.add_delete("/v1/clients/{id}", clients.remove_client)
    r.add_put("/v1/clients/{id}/grants", clients.set_grants)
    r.add_post("/v1/clients/{id}/access-keys", clients.create_access_key)
    r.add_get("/v1/clients/{id}/access-keys", clients.list_access_keys)
    r.add_delete("/v1/clients/{id}/access-keys/{key}", clients.revoke_access_key)
    r.add_get("/v1/definitions", definitions.export)
    r.add_post("/v1/definitions", definitions.import_)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/events", event_routes.events)     # the cluster event feed (qserver/api/event_routes.py)
