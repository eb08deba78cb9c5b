"""The console's frame: sign-in, sessions, the CSRF check, the confirmation step of actions,
rendering and the headers every console answer carries (docs/CONSOLE.md).

Pages register through ConsoleRoutes (`page` for a GET that renders, `action` for a POST that
changes something). A page handler gets a View: the signed-in client's library instance (every
call in that client's name, with its grants: qserver/api/auth.py, delegated signatures), its
current grants to decide what to offer, and `render`. An action runs only with the session's
CSRF token and after the visitor confirmed it on a page of its own (for a purge, by typing the
queue's name); its result, or its `E_*` error in words, is shown on the page it returns to.
"""
from __future__ import annotations

import collections
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from client.aio import AsyncClient
from qserver.console.sessions import SESSION_IDLE_MS, Session, Sessions
from qserver.core.grants import grants_allow
from qserver.features.delegated import DelegatedClients
from qserver.metrics import render_family
from wire import errors as e
from wire import versions
from wire.console_link import SIGNIN_PATH
from wire.errors import QueueError

log = logging.getLogger("qserver.console")
PREFIX = "/console"
COOKIE = "qconsole"
STATIC = Path(__file__).parent / "static"
CLIENTS_MAX = 64                     # signed-in clients with a client library instance here (LRU)
FORM_BYTES_MAX = 256 * 1024          # a form (a test message's payload included)
# No script, style, image or frame from anywhere but this node; no inline script at all (the
# JavaScript is in static/), so a payload shown on a page can never run (it is escaped too).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",       # a sign-in link's query never leaves in a Referer
    "Cache-Control": "no-store",
}
# The sections in the navigation bar: (path, title, needs admin on `*`).
NAVIGATION = [("/console/cluster", "Cluster", False), ("/console/queues", "Queues", False),
              ("/console/macros", "Macros", False), ("/console/channels", "Channels", False),
              ("/console/forwards", "Forwards", False), ("/console/recipients", "Recipients", False),
              ("/console/clients", "Clients", True), ("/console/events", "Events", False)]

PageHandler = Callable[["View"], Awaitable[web.StreamResponse]]
# An action: given the view and the form, do it; answer the text shown as its result.
ActionHandler = Callable[["View", Mapping[str, str]], Awaitable[str]]
Describe = Callable[["View", Mapping[str, str]], str]


class Console:
    """What the console keeps at one node: its sessions and its templates."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.sessions = Sessions()
        self.templates = Environment(loader=PackageLoader("qserver.console", "templates"),
                                     autoescape=select_autoescape(default=True, default_for_string=True),
                                     undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.signins: collections.Counter[str] = collections.Counter()     # "ok" or an E_* code
        self._clients = DelegatedClients(lambda: node.url, lambda: node.services.tls_ca_file(),
                                         lambda: node.auth.cluster_secret, CLIENTS_MAX)

    def client_for(self, session: Session) -> AsyncClient:
        """The client library instance that calls in the session's client's name (delegated,
        with the secret of the cluster, or of this node alone: qserver/api/auth.py)."""
        return self._clients.client_for(session.client_id)

    def render_metrics(self) -> list[str]:
        return (render_family("qserver_console_sessions", "gauge", "console sessions open at this node",
                              [({}, len(self.sessions))])
                + render_family("qserver_console_signins_total", "counter",
                                "console sign-in links taken (ok) or refused (by error code)",
                                [({"outcome": outcome}, count) for outcome, count in sorted(self.signins.items())]))

    async def close(self) -> None:
        await self._clients.close()

    def secure(self, request: web.Request) -> bool:
        return request.secure or self.node.tls is not None

    def render(self, template: str, status: int = 200, **context: Any) -> web.Response:
        context.setdefault("session", None)
        context.setdefault("notices", [])
        text = self.templates.get_template(template).render(
            node_id=self.node.config.node_id, release=versions.RELEASE, navigation=NAVIGATION, **context)
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


CONSOLE_KEY = web.AppKey("console", Console)


@dataclass(eq=False)
class View:
    """One console request of a signed-in visitor."""
    request: web.Request
    console: Console
    session: Session

    @property
    def client(self) -> AsyncClient:
        return self.console.client_for(self.session)

    @property
    def client_id(self) -> str:
        return self.session.client_id

    @property
    def node(self) -> Any:
        return self.console.node

    def allows(self, privilege: str, queue: str = "*") -> bool:
        """Whether the client's grants, as this node knows them now, allow `privilege` on
        `queue`: what a page offers. The call itself is checked where it lands."""
        grants = self.node.auth.grants_of(self.client_id)
        return grants is not None and grants_allow(grants, privilege, queue)

    @property
    def is_admin(self) -> bool:
        return self.allows("admin", "*")

    def render(self, template: str, status: int = 200, **context: Any) -> web.Response:
        return self.console.render(template, status, session=self.session, view=self,
                                   notices=self.session.take_notices(), path=self.request.path, **context)


def console_path(text: str | None, default: str) -> str:
    """A place inside the console to go back to (never another site's address)."""
    if text and text.startswith(PREFIX + "/") and "//" not in text and "\\" not in text:
        return text
    return default


def redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def signin_redirect(request: web.Request) -> web.Response:
    return redirect(SIGNIN_PATH + "?" + urlencode({"next": request.path_qs}))


class ConsoleRoutes:
    def __init__(self, app: web.Application, console: Console) -> None:
        self.app, self.console = app, console

    def _view(self, request: web.Request) -> View | None:
        session = self.console.sessions.find(request.cookies.get(COOKIE))
        if session is None:
            return None
        if self.console.node.auth.grants_of(session.client_id) is None:     # removed since: signed out
            self.console.sessions.close(session.session_id)
            return None
        return View(request, self.console, session)

    def page(self, path: str, handler: PageHandler) -> None:
        async def serve(request: web.Request) -> web.StreamResponse:
            view = self._view(request)
            if view is None:
                return signin_redirect(request)
            try:
                return await handler(view)
            except QueueError as error:
                return self._refused(view, error)
        self.app.router.add_get(path, serve)

    def action(self, path: str, handler: ActionHandler, describe: Describe, *, back: str = PREFIX + "/queues",
               typed: Callable[[View, Mapping[str, str]], str] | None = None) -> None:
        """A POST that changes something. `describe` says in words what it will do (shown on the
        confirmation page); `typed`: what the visitor must type to confirm (a queue's name before
        a purge); `back`: where to return when the form names no place."""
        async def serve(request: web.Request) -> web.StreamResponse:
            view = self._view(request)
            if view is None:
                return signin_redirect(request)
            form = await read_form(request)
            if not hmac.compare_digest(form.get("csrf", "").encode(), view.session.csrf.encode()) \
                    or not same_origin(request):
                return view.render("error.html", status=403, code=e.E_FORBIDDEN.code,
                                   message="this form did not come from a console page of this session "
                                           "(missing or wrong CSRF token): reload the page and try again")
            to = console_path(form.get("back"), back)
            must_type = typed(view, form) if typed is not None else None
            if form.get("confirmed") != "yes" or (must_type is not None and form.get("typed") != must_type):
                retyped = form.get("confirmed") == "yes"       # confirmed but typed something else
                fields = {k: v for k, v in form.items() if k not in ("csrf", "confirmed", "typed")}
                return view.render("confirm.html", status=400 if retyped else 200, action=request.path,
                                   description=describe(view, form), fields=fields, must_type=must_type,
                                   mistyped=retyped, back=to)
            try:
                result = await handler(view, form)
            except QueueError as error:
                view.session.notify("error", f"{error.code}: {error.message}")
                if error.code == e.E_UNAUTHENTICATED.code:
                    self.console.sessions.close(view.session.session_id)
                    return signin_redirect(request)
            else:
                view.session.notify("ok", result)
            return redirect(to)
        self.app.router.add_post(path, serve)

    def _refused(self, view: View, error: QueueError) -> web.Response:
        if error.code == e.E_UNAUTHENTICATED.code:       # the client is no longer registered
            self.console.sessions.close(view.session.session_id)
            return signin_redirect(view.request)
        return view.render("error.html", status=error.http_status, code=error.code, message=error.message)


async def read_form(request: web.Request) -> dict[str, str]:
    if request.content_length is not None and request.content_length > FORM_BYTES_MAX:
        raise web.HTTPRequestEntityTooLarge(max_size=FORM_BYTES_MAX, actual_size=request.content_length)
    data = await request.post()
    return {key: value for key, value in data.items() if isinstance(value, str)}


def same_origin(request: web.Request) -> bool:
    """A browser names the page a POST came from: it must be this node (a missing Origin is a
    client that sends none, which the CSRF token alone covers)."""
    origin = request.headers.get("Origin")
    if origin == "null":
        # Under our `Referrer-Policy: no-referrer` a browser sends `Origin: null` even for a form
        # of this very page (the Fetch standard serializes the origin so); `Sec-Fetch-Site`,
        # which no page's script can set, still says whether it came from this node.
        return request.headers.get("Sec-Fetch-Site") == "same-origin"
    if origin is None:
        return True
    host = request.headers.get("Host", "")
    return origin.split("://", 1)[-1] == host


# --- signing in and out -----------------------------------------------------------------------------
async def signin(request: web.Request) -> web.StreamResponse:
    console = request.app[CONSOLE_KEY]
    query = request.rel_url.query
    if "s" not in query:
        return console.render("signin.html", error=None, next=console_path(query.get("next"), PREFIX + "/"))
    node = console.node
    try:
        principal = node.auth.take_signin_link(query.get("client", ""), request.host, query.get("t", ""),
                                               query.get("n", ""), query.get("s", ""))
    except QueueError as error:
        console.signins[error.code] += 1
        return console.render("signin.html", status=error.http_status, error=error, next=PREFIX + "/")
    console.signins["ok"] += 1
    session = console.sessions.open(principal.client_id)
    log.info("console: client %s signed in", principal.client_id)
    response = redirect(PREFIX + "/")
    response.set_cookie(COOKIE, session.session_id, path=PREFIX, httponly=True, samesite="Strict",
                        secure=console.secure(request), max_age=SESSION_IDLE_MS // 1000)
    return response


async def signout(request: web.Request) -> web.StreamResponse:
    console = request.app[CONSOLE_KEY]
    session = console.sessions.find(request.cookies.get(COOKIE))
    form = await read_form(request)
    if session is not None and hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
        console.sessions.close(session.session_id)
    response = redirect(SIGNIN_PATH)
    response.del_cookie(COOKIE, path=PREFIX)
    return response


async def home(request: web.Request) -> web.StreamResponse:
    return redirect(PREFIX + "/cluster")


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    if request.path == PREFIX or request.path.startswith(PREFIX + "/"):
        response.headers.update(SECURITY_HEADERS)
