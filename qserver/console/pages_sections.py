"""The console's other sections (docs/CONSOLE.md): macro queues, channels, forwards, recipients,
clients and grants (admin only), and the live feed of cluster events.

Every page reads through `view.client`, the client library in the signed-in client's name, so
it shows what that client may see and nothing more: the node filters lists by its grants, and a
call it may not make (the clients list without `admin` on `*`, a channel's subscriptions without
`get`) is refused where it lands; the page says so in words (`E_FORBIDDEN: ...`). Lists come a
page at a time from the node (at most SECTION_ROWS_MAX rows each); per-row calls (a forward's
figures, a durable channel's subscriptions) are bounded by ROW_CALLS_MAX and run together.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

from aiohttp import web

from qserver.console.frame import PREFIX, ConsoleRoutes, View
from wire.errors import QueueError

SECTION_ROWS_MAX = 1000      # rows a section shows (one page of the node's listing)
ROW_CALLS_MAX = 50           # per-row calls one page makes (figures of forwards, durable subscriptions)
EVENTS_SHOWN = 200           # the newest events the feed page shows
ACHIEVED_WINDOW_S = 120.0    # a forward's achieved rate: from its stored count at the last look within this
T = TypeVar("T")


def moment(ms: int) -> str:
    """A wall-clock time in UTC, to the millisecond (the node's clock)."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


async def _page(view: View, path: str) -> dict[str, Any]:
    """The first page of a listing (GET /v1/macros, /v1/channels, /v1/recipients): `next` says
    whether more follow."""
    answer = await view.client.http.request("GET", path, query=[("limit", str(SECTION_ROWS_MAX))])
    return dict(answer.json())


async def _or_error(call: Awaitable[T]) -> T | str:
    """The call's answer, or its refusal in words (shown in the row instead)."""
    try:
        return await call
    except QueueError as error:
        return f"{error.code}: {error.message}"


async def macros_page(view: View) -> web.StreamResponse:
    answer = await _page(view, "/v1/macros")
    return view.render("macros.html", macros=answer.get("macros", []), more=answer.get("next") is not None)


async def channels_page(view: View) -> web.StreamResponse:
    answer = await _page(view, "/v1/channels")
    channels: list[dict[str, Any]] = answer.get("channels", [])
    durable = [channel for channel in channels if channel.get("class") == "durable"][:ROW_CALLS_MAX]
    found = await asyncio.gather(*(_or_error(view.client.subscriptions(c["name"])) for c in durable))
    subscriptions = {channel["name"]: listed for channel, listed in zip(durable, found, strict=True)}
    return view.render("channels.html", channels=channels, subscriptions=subscriptions,
                       more=answer.get("next") is not None)


class Achieved:
    """Each forward's stored count at the console's last look, for its achieved rate."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, int]] = {}

    def rate(self, name: str, stored: Any) -> float | None:
        if not isinstance(stored, int):
            return None
        now = time.monotonic()
        before = self.seen.get(name)
        self.seen[name] = (now, stored)
        if len(self.seen) > ROW_CALLS_MAX * 4:
            self.seen.pop(next(iter(self.seen)))
        if before is None or not 0 < now - before[0] <= ACHIEVED_WINDOW_S or stored < before[1]:
            return None
        return (stored - before[1]) / (now - before[0])


ACHIEVED = Achieved()


async def forwards_page(view: View) -> web.StreamResponse:
    forwards = (await view.client.forwards())[:SECTION_ROWS_MAX]
    shown = forwards[:ROW_CALLS_MAX]
    figures = await asyncio.gather(*(_or_error(view.client.forward_stats(f["name"])) for f in shown))
    stats: dict[str, Any] = {}
    for forward, figure in zip(shown, figures, strict=True):
        if isinstance(figure, dict):
            figure = {**figure, "achieved": ACHIEVED.rate(forward["name"], figure.get("stored"))}
        stats[forward["name"]] = figure
    return view.render("forwards.html", forwards=forwards, stats=stats)


async def recipients_page(view: View) -> web.StreamResponse:
    answer = await _page(view, "/v1/recipients")
    recipients = [{**r, "since": moment(r["since_ms"]) if r.get("since_ms") else ""} for r in answer.get("recipients", [])]
    return view.render("recipients.html", recipients=recipients,
                       more=answer.get("next") is not None)


async def clients_page(view: View) -> web.StreamResponse:
    # Asked of the node even without `admin` on `*`: its refusal, in words, is the page's answer.
    try:
        clients = await view.client.list_clients()
    except QueueError as error:
        return view.render("clients.html", clients=[], refused=f"{error.code}: {error.message}", status=200)
    return view.render("clients.html", clients=clients, refused=None)


async def events_page(view: View) -> web.StreamResponse:
    answer = await view.client.events(0, 1000)
    events = [{**event, "when": moment(event["at_ms"])} for event in reversed(answer["events"])][:EVENTS_SHOWN]
    return view.render("events.html", events=events, feed=answer)


def add_routes(routes: ConsoleRoutes) -> None:
    routes.page(PREFIX + "/macros", macros_page)
    routes.page(PREFIX + "/channels", channels_page)
    routes.page(PREFIX + "/forwards", forwards_page)
    routes.page(PREFIX + "/recipients", recipients_page)
    routes.page(PREFIX + "/clients", clients_page)
    routes.page(PREFIX + "/events", events_page)
