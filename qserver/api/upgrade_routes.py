"""REST routes of upgrades: which release every node runs (GET /v1/cluster/versions) and the
cluster feature level's raise (POST /v1/cluster/finalize): docs/PROTOCOL.md, "Versions and the
feature level", and docs/OPERATIONS.md, "The cluster feature level".

The feature level lives in the replicated map (`ClusterMap.feature_level`, raised by the
`SetFeatureLevel` command). A node learns what every other node runs from its /healthz (its
`release` and `feature_levels`); a node that names none runs release 0.1.0, which supports
level 1 only, and a node that does not answer may run anything: both hold a finalize back.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from qserver.api.http_common import NODE, coordinator_of, json_body, principal, propose
from qserver.metrics import render_family
from qserver.storage.rows import SCHEMA_VERSION
from replication.cluster_map import ClusterMap, NodeState, SetFeatureLevel
from wire import errors as e
from wire import versions
from wire.errors import QueueError

HEALTH_TIMEOUT_S = 2.0              # a node that does not answer its /healthz within this lags
HEALTH_BYTES_MAX = 1 << 20          # what this node reads of another node's /healthz answer
SILENT_RELEASE = "0.1.0"            # what a node whose /healthz names no release runs (wire/versions.py SILENT_PEER)


def own_versions(node: Any) -> dict[str, Any]:
    """What this node's /healthz says of its own versions."""
    return {"reachable": True, "release": versions.RELEASE, "storage_layout": SCHEMA_VERSION,
            "protocols": {"client": versions.CLIENT_PROTOCOL.render(),
                          "replication": versions.REPLICATION_PROTOCOL.render(),
                          "membership": versions.MEMBERSHIP_PROTOCOL.render()},
            "feature_levels": [versions.OLDEST_FEATURE_LEVEL, versions.FEATURE_LEVEL]}


def versions_of(health: Any) -> dict[str, Any]:
    """What a node's /healthz answer says of its versions. One that names no feature levels is
    a release from before they existed (0.1.0): it runs at level 1 only and speaks SILENT_PEER's
    protocols. Anything else unreadable counts as unreachable: it may run anything."""
    if not isinstance(health, dict):
        return {"reachable": False, "error": "its /healthz answer is not a JSON object"}
    levels = health.get("feature_levels")
    if levels is None:
        return {"reachable": True, "release": str(health.get("release") or SILENT_RELEASE)[:40],
                "storage_layout": health.get("storage_layout"),
                "protocols": {link: speaks.render() for link, speaks in versions.SILENT_PEER.items()},
                "feature_levels": [versions.OLDEST_FEATURE_LEVEL, versions.OLDEST_FEATURE_LEVEL]}
    if not (isinstance(levels, list) and len(levels) == 2 and all(type(level) is int for level in levels)
            and isinstance(health.get("release"), str)):
        return {"reachable": False, "error": "its /healthz answer names feature levels this release cannot read"}
    protocols = health.get("protocols")
    return {"reachable": True, "release": health["release"][:40], "storage_layout": health.get("storage_layout"),
            "protocols": protocols if isinstance(protocols, dict) else None, "feature_levels": levels}


async def _health_of(node: Any, url: str) -> dict[str, Any]:
    """Another node's versions, from its /healthz (which answers 503 with the same document
    while the node does not serve: its release is known all the same)."""
    try:
        async with node.http_session().get(url.rstrip("/") + "/healthz",
                                           timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as answer:
            body = await answer.content.read(HEALTH_BYTES_MAX)
        return versions_of(json.loads(body))
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        return {"reachable": False, "error": f"no answer from {url} ({type(error).__name__})"}
    except ValueError:
        return {"reachable": False, "error": "its /healthz answer is not JSON"}


async def nodes_versions(node: Any, cluster: ClusterMap) -> list[dict[str, Any]]:
    """Every node of the map but those removed for good, with what it runs, asked at once."""
    entries = sorted((entry for entry in cluster.nodes.values() if entry.state is not NodeState.REMOVED),
                     key=lambda entry: entry.node_id)

    async def one(entry: Any) -> dict[str, Any]:
        found = own_versions(node) if entry.node_id == node.config.node_id else await _health_of(node, entry.url)
        return {"id": entry.node_id, "url": entry.url, "state": entry.state.value, **found}
    return list(await asyncio.gather(*(one(entry) for entry in entries)))


def lags(found: dict[str, Any], level: int) -> str | None:
    """Why a node holds a raise to `level` back, None when it does not."""
    if not found.get("reachable"):
        return f"{found['id']} did not answer ({found.get('error', 'unreachable')})"
    low, high = found["feature_levels"]
    if high < level:
        return f"{found['id']} runs {found['release']} (feature levels {low}-{high})"
    return None


def finalizable_to(nodes: list[dict[str, Any]]) -> int | None:
    """The highest level every node supports (None while a node does not answer)."""
    if not nodes or not all(found.get("reachable") for found in nodes):
        return None
    return min(int(found["feature_levels"][1]) for found in nodes)


async def cluster_versions(request: web.Request) -> web.Response:
    """GET /v1/cluster/versions: every node's release, storage layout, protocols and feature
    levels, with the map's feature level (`qctl cluster versions`, `qctl status`)."""
    principal(request)
    node = request.app[NODE]
    coordinator = node.engine.coordinator
    if coordinator is None:          # a node outside a cluster: nothing to be compatible with
        mine = {"id": node.config.node_id, "url": node.url, "state": "up", **own_versions(node)}
        return web.json_response({"node": node.config.node_id, "feature_level": versions.FEATURE_LEVEL,
                                  "finalizable_to": versions.FEATURE_LEVEL, "nodes": [mine]})
    cluster = coordinator.membership.cluster_map
    nodes = await nodes_versions(node, cluster)
    return web.json_response({"node": node.config.node_id, "feature_level": cluster.feature_level,
                              "finalizable_to": finalizable_to(nodes), "nodes": nodes})


def finalize_level(body: Any) -> int:
    """The level a finalize asks for: `{"level": N}`, or this release's highest when absent."""
    if not isinstance(body, dict) or set(body) - {"level"}:
        raise QueueError(e.E_INVALID_OPTION, 'the body is empty or {"level": N}')
    level = body.get("level", versions.FEATURE_LEVEL)
    if type(level) is not int or not versions.OLDEST_FEATURE_LEVEL <= level <= versions.FEATURE_LEVEL:
        raise QueueError(e.E_INVALID_OPTION, f"this node (release {versions.RELEASE}) runs at feature levels "
                                             f"{versions.OLDEST_FEATURE_LEVEL}-{versions.FEATURE_LEVEL}, not {level!r}"[:200])
    return level


async def finalize(request: web.Request) -> web.Response:
    """POST /v1/cluster/finalize: raise the cluster feature level once every node supports it;
    E_NODES_BEHIND naming the nodes that lag before that. At the level already: nothing is
    proposed, and the answer says so."""
    principal(request).require("admin", "*")
    level = finalize_level(await json_body(request))
    node = request.app[NODE]
    coordinator = coordinator_of(request)
    cluster = coordinator.membership.cluster_map
    previous = cluster.feature_level
    if level < previous:
        raise QueueError(e.E_INVALID_OPTION, f"the cluster runs at feature level {previous}: a feature level never "
                                             "goes down (docs/OPERATIONS.md, \"The cluster feature level\")")
    nodes = await nodes_versions(node, cluster)
    releases = {found["id"]: found.get("release") for found in nodes}
    if level == previous:
        return web.json_response({"level": previous, "previous": previous, "changed": False, "releases": releases})
    behind = [why for found in nodes if (why := lags(found, level)) is not None]
    if behind:
        raise QueueError(e.E_NODES_BEHIND, f"feature level {level} needs release "
                                           f"{versions.FEATURE_LEVEL_RELEASES.get(level, '?')} or later on every node: "
                                           + "; ".join(behind) + ". Upgrade or start them (a node gone for good: drain "
                                           "and remove it), then finalize again")
    outcome = await propose(request, SetFeatureLevel(level))
    # Applied here before the answer (propose waits for it); not applied: another finalize
    # raised the level first. Either way this node's map has the level now (a snapshot may
    # have replaced the map object meanwhile: read it again).
    return web.json_response({"level": coordinator.membership.cluster_map.feature_level, "previous": previous,
                              "changed": bool(outcome.applied), "releases": releases})


def feature_level_metrics(node: Any) -> list[str]:
    """The gauges of the feature level: the cluster's (the map's) and this release's highest."""
    coordinator = node.engine.coordinator
    level = versions.FEATURE_LEVEL if coordinator is None else coordinator.membership.cluster_map.feature_level
    return (render_family("qserver_cluster_feature_level", "gauge",
                          "the cluster feature level in the replicated map (qctl cluster finalize raises it)",
                          [({}, level)])
            + render_family("qserver_release_feature_level_max", "gauge",
                            "the highest cluster feature level this node's release runs at", [({}, versions.FEATURE_LEVEL)]))
