"""The console's routes at one node (docs/CONSOLE.md): the frame (frame.py: sign-in, sessions,
CSRF, confirmation, rendering) and every page module, each adding its routes."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.console import pages_actions, pages_cluster, pages_queues, pages_sections
from qserver.console.frame import (
    CONSOLE_KEY,
    PREFIX,
    STATIC,
    Console,
    ConsoleRoutes,
    home,
    security_headers,
    signin,
    signout,
)
from wire.console_link import SIGNIN_PATH

PAGE_MODULES = (pages_cluster, pages_actions, pages_queues, pages_sections)


def install(app: web.Application, node: Any) -> Console:
    """Add the console's routes to a node's application."""
    console = Console(node)
    app[CONSOLE_KEY] = console
    routes = ConsoleRoutes(app, console)
    app.router.add_get(PREFIX, home)
    app.router.add_get(PREFIX + "/", home)
    app.router.add_get(SIGNIN_PATH, signin)
    app.router.add_post(PREFIX + "/signout", signout)
    app.router.add_static(PREFIX + "/static/", STATIC, show_index=False, follow_symlinks=False)
    app.on_response_prepare.append(security_headers)
    for module in PAGE_MODULES:
        module.add_routes(routes)
    return console
