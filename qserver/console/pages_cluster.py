"""The console's cluster page (docs/CONSOLE.md, "Cluster"): every node of the map with its state,
release, membership role, term, commit index and lease from its own `/healthz` (read now, all
nodes at once, each within HEALTH_TIMEOUT_S: a node that does not answer is shown down, never an
error page), the membership leader, and per-node rates, loop lag and disk from the readings of
`/metrics` the console's sampler keeps (qserver/console/sampling.py)."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from qserver.console.frame import PREFIX, ConsoleRoutes, View
from qserver.console.sampling import rate, sampler_of, sparkline, stop_sampler

HEALTH_TIMEOUT_S = 1.0      # a node whose /healthz takes longer is shown down: the page does not wait


async def healthz(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """A node's /healthz (503 answers included: they say why the node does not serve), or None."""
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S), session.get(url.rstrip("/") + "/healthz") as answer:
            document = await answer.json(content_type=None)
            return document if isinstance(document, dict) else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


def node_row(node: dict[str, Any], health: dict[str, Any] | None, view: View) -> dict[str, Any]:
    membership = (health or {}).get("membership") or {}
    raft = membership.get("raft") or {}
    points = sampler_of(view.console).node_points(node["id"])
    last = points[-1] if points else None
    enqueues = [(p.at, p.enqueued) for p in points]
    role = raft.get("role")
    if role == "follower" and (node.get("voter") is False or node["id"] in raft.get("learners", ())):
        role = "learner"        # a follower that does not vote (yet): docs/RAFT.md
    used = None if last is None else last.used_bytes
    return {"id": node["id"], "url": node.get("url", ""), "map_state": node.get("state", "?"),
            "voter": node.get("voter"), "masters": node.get("masters"), "replicas": node.get("replicas"),
            "up": health is not None and health.get("status") == "ok",
            "status": "down" if health is None else health.get("status", "?"),
            "release": (health or {}).get("release"), "role": role, "term": raft.get("term"),
            "commit_index": raft.get("commit_index"), "lease_valid": membership.get("lease_valid"),
            "queues": (health or {}).get("queues"),
            "enqueue_rate": rate(enqueues), "ack_rate": rate((p.at, p.acked) for p in points),
            "loop_lag_ms": None if last is None or last.loop_lag_s is None else last.loop_lag_s * 1000,
            "disk_free_bytes": None if last is None else last.disk_free_bytes, "storage_used_bytes": used,
            "spark": sparkline([max(0.0, b[1] - a[1]) / (b[0] - a[0])
                                for a, b in zip(enqueues, enqueues[1:], strict=False) if b[0] > a[0]][-30:])}


async def cluster_page(view: View) -> web.StreamResponse:
    # The summary: the nodes and the map's counts at the cost of the nodes, not of the map
    # (a whole map of 10,000 queues is megabytes).
    summary: dict[str, Any] = await view.client.http.cluster_summary()
    nodes = summary.get("nodes", [])
    session = view.node.http_session()
    urls = {node["id"]: node.get("url", "") for node in nodes}
    sampler = sampler_of(view.console)
    sampler.want_nodes(session, urls)
    sampler.remember_member_urls(urls)
    healths = await asyncio.gather(*(healthz(session, url) for url in urls.values()))
    rows = [node_row(node, health, view) for node, health in zip(nodes, healths, strict=True)]
    return view.render("cluster.html", summary=summary, nodes=rows, leader=summary.get("leader"),
                       term=summary.get("term"), counts=summary.get("counts", {}),
                       out_of_sync=summary.get("out_of_sync", []))


def add_routes(routes: ConsoleRoutes) -> None:
    routes.page(PREFIX + "/cluster", cluster_page)
    console = routes.console

    async def stop(app: web.Application) -> None:     # the node stops: so does the sampler's task
        await stop_sampler(console)
    routes.app.on_cleanup.append(stop)
