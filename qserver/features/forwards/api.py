"""Forwards (seed 003 store-and-forward: qserver/features/forwards/forwarder.py, qserver/features/forwards/root.py) in the
REST API. A forward lives in the cluster map (`PutForward`, `DeleteForward`), so the master of
its source queue, wherever that is, runs it; its figures are that master's (other nodes pass
the request on)."""
from __future__ import annotations

import os
import ssl
import time

from aiohttp import web

from qserver.api.http_common import PASSED_ON_BY, json_body, path_name, principal, propose
from qserver.features.forwards.decide import ControlProblem, checked_control, merged_control
from qserver.features.forwards.forwarder import Forwarders, seal_secret
from qserver.services import SERVICES, NodeServices
from replication.cluster_map import DeleteForward, PutForward, SetForwardControl
from replication.options import is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError
from wire.signing import private_key_from_text

FORWARDERS: web.AppKey[Forwarders] = web.AppKey("forwarders", Forwarders)     # this node's forwarders
URLS_MAX = 16
CA_CHARS_MAX = 64 * 1024


def _checked_ca(ca: object) -> str:
    """The other cluster's CA certificate(s), PEM: what the forward's TLS checks that cluster's
    nodes against ("": this cluster's CA, as before)."""
    if ca in ("", None):
        return ""
    if not isinstance(ca, str) or len(ca) > CA_CHARS_MAX:
        raise QueueError(e.E_INVALID_OPTION, f"credentials.ca is a PEM certificate of at most {CA_CHARS_MAX} characters")
    try:
        ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca)
    except (ssl.SSLError, ValueError):
        raise QueueError(e.E_INVALID_OPTION, "credentials.ca is not a PEM certificate") from None
    return ca


def forward_name(request: web.Request) -> str:
    return path_name(request, "f", "forward")


def _control(services: NodeServices, raw: object) -> dict[str, object]:
    """A forward's own bands, weights and fill unit (decide.py checked_control), refused with
    E_INVALID_OPTION when malformed and E_FEATURE_DISABLED below feature level 3 (0.2.0 nodes
    could not decode the map entry)."""
    try:
        control = checked_control(raw)
    except ControlProblem as problem:
        raise QueueError(e.E_INVALID_OPTION, str(problem)) from None
    if control:
        services.require_feature("forward_control")
    return control


async def create_forward(request: web.Request) -> web.Response:
    """{"name", "source", "destination", "urls": [...], "credentials": {"client_id",
    "private_key", "ca"?}}: forward `source` (a `full` queue here) into `destination` of the
    cluster at `urls` signed with those credentials, checking its nodes' TLS certificates
    against `ca` (PEM; none: this cluster's CA) (no urls: a queue of this cluster, sent by the
    cluster itself). Admin only: the credentials act in another cluster. "control" (optional):
    its own bands, weights and fill unit (docs/PROTOCOL.md "Forwards", "A forward's own bands
    and weights")."""
    principal(request).require("admin", "*")
    body = await json_body(request)
    if not isinstance(body, dict):
        raise QueueError(e.E_INVALID_OPTION, "the body is a JSON object")
    control = _control(request.app[SERVICES], body.get("control"))
    for field in ("name", "source", "destination"):
        if not isinstance(body.get(field), str) or not is_valid_queue_name(body[field]):
            raise QueueError(e.E_INVALID_OPTION, f"{field} must be a valid name")
    name, source, destination = str(body["name"]), str(body["source"]), str(body["destination"])
    urls = body.get("urls") or []
    if not isinstance(urls, list) or len(urls) > URLS_MAX or not all(
            isinstance(url, str) and url.startswith(("http://", "https://")) for url in urls):
        raise QueueError(e.E_INVALID_OPTION, f"urls is a list of at most {URLS_MAX} http(s) URLs of the "
                                             "destination's cluster")
    client_id, secret = "", ""
    if urls:
        credentials = body.get("credentials")
        if not isinstance(credentials, dict) or not isinstance(credentials.get("client_id"), str) \
                or not isinstance(credentials.get("private_key"), str):
            raise QueueError(e.E_INVALID_OPTION, 'a forward to another cluster needs "credentials": '
                                                 '{"client_id", "private_key"} registered there')
        try:
            private_key_from_text(credentials["private_key"])
        except Exception:   # the key parser raises several unrelated types for garbage
            raise QueueError(e.E_INVALID_OPTION, "credentials.private_key is not a private key") from None
        client_id = credentials["client_id"]
        ca = _checked_ca(credentials.get("ca", ""))
        # Sealed with the cluster secret: the map's log, snapshots and LMDB files, on every node,
        # hold it encrypted (docs/PROTOCOL.md "Forwards").
        secret = seal_secret(request.app[SERVICES].cluster_secret, name, client_id, credentials["private_key"], ca)
    elif source == destination:
        raise QueueError(e.E_INVALID_OPTION, "a forward into its own source")
    outcome = await propose(request, PutForward(name, source, destination, tuple(u.rstrip("/") for u in urls),
                                                client_id, secret, int(time.time() * 1000), os.urandom(8).hex(),
                                                control))
    if not outcome.applied:
        if outcome.reason.startswith("no queue"):
            raise QueueError(e.E_UNKNOWN_QUEUE, outcome.reason)
        raise QueueError(e.E_FORWARD_REFUSED, outcome.reason)
    entry = request.app[SERVICES].require_cluster_map().forwards.get(name)
    return web.json_response(entry.to_json() if entry is not None else {"name": name}, status=201)


async def list_forwards(request: web.Request) -> web.Response:
    cluster = request.app[SERVICES].require_cluster_map()
    out = []
    for entry in sorted(cluster.forwards.values(), key=lambda f: f.name):
        source = cluster.queues.get(entry.source)
        out.append({**entry.to_json(), "runs_on": source.master if source is not None else None})
    return web.json_response({"forwards": out})


async def forward_stats(request: web.Request) -> web.StreamResponse:
    """The forwarder's figures, from the master of its source (where it runs)."""
    name = forward_name(request)
    services = request.app[SERVICES]
    cluster = services.require_cluster_map()
    entry = cluster.forwards.get(name)
    if entry is None and PASSED_ON_BY in request.headers:
        # Passed on by a node that knows the forward: this one (its source's master) has not
        # applied that map change yet, and will start it once it has.
        return web.json_response({"name": name, "node": services.node_id, "state": "starting",
                                  "error": "this node has not applied the forward yet"})
    if entry is None:
        raise QueueError(e.E_UNKNOWN_FORWARD, f"no forward {name}")
    stats = request.app[FORWARDERS].stats(name)
    if stats is not None:
        return web.json_response(stats)
    source = cluster.queues.get(entry.source)
    if source is not None and source.master != services.node_id and PASSED_ON_BY not in request.headers:
        return await services.pass_on(request, source.master)
    return web.json_response({**entry.to_json(), "node": services.node_id, "state": "not running",
                              "error": "its source's master has not started it (yet)"})


async def change_forward(request: web.Request) -> web.Response:
    """{"control": {field: value or null}}: change a forward's own bands, weights and fill unit
    (a null field goes back to the default; new bands without weights drop the old weights).
    Admin only. The forwarder reports its weight by the new control from its next report."""
    principal(request).require("admin", "*")
    name = forward_name(request)
    services = request.app[SERVICES]
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("control"), dict) or set(body) - {"control"}:
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"control": {"bands", "weights", "fill_unit", "fill_bytes"}}')
    entry = services.require_cluster_map().forwards.get(name)
    if entry is None:
        raise QueueError(e.E_UNKNOWN_FORWARD, f"no forward {name}")
    control = _control(services, merged_control(dict(entry.control), body["control"]))
    services.require_feature("forward_control")
    outcome = await propose(request, SetForwardControl(name, entry.created_ms, control))
    if not outcome.applied and outcome.reason != "unchanged":
        if outcome.reason == "no such forward":
            raise QueueError(e.E_UNKNOWN_FORWARD, f"no forward {name}")
        raise QueueError(e.E_FORWARD_REFUSED, outcome.reason)
    changed = services.require_cluster_map().forwards.get(name)
    return web.json_response(changed.to_json() if changed is not None else {"name": name})


async def delete_forward(request: web.Request) -> web.Response:
    principal(request).require("admin", "*")
    name = forward_name(request)
    outcome = await propose(request, DeleteForward(name))
    if not outcome.applied:
        raise QueueError(e.E_UNKNOWN_FORWARD, f"no forward {name}")
    return web.json_response({"name": name, "deleted": True})


def add_routes(app: web.Application, forwarders: Forwarders) -> None:
    app[FORWARDERS] = forwarders
    r = app.router
    r.add_post("/v1/forwards", create_forward)
    r.add_get("/v1/forwards", list_forwards)
    r.add_get("/v1/forwards/{f}", forward_stats)
    r.add_patch("/v1/forwards/{f}", change_forward)
    r.add_delete("/v1/forwards/{f}", delete_forward)
