"""The console's cluster page: the nodes as the cluster map has them, and the membership leader
(docs/CONSOLE.md, "Cluster")."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.console.frame import PREFIX, ConsoleRoutes, View


async def cluster_page(view: View) -> web.StreamResponse:
    cluster: dict[str, Any] = await view.client.http.cluster(queues=())
    return view.render("cluster.html", cluster=cluster)


def add_routes(routes: ConsoleRoutes) -> None:
    routes.page(PREFIX + "/cluster", cluster_page)
