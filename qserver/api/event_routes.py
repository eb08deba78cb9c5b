"""GET /v1/events: the cluster event feed of the node asked (qserver/cluster/events.py;
docs/PROTOCOL.md, "Events").

Filtered by the caller's grants as GET /v1/cluster is: an event about a queue (a handoff, a
failover, a recipient's state) goes to a client whose grants name that queue (any privilege);
an event about the cluster alone (a node down or up, the membership leader, the feature level)
to every authenticated client, as the map's nodes and leader are.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.api.http_common import NODE, number_param, principal
from qserver.cluster.events import EVENTS_KEPT, Event
from wire import errors as e
from wire.errors import QueueError

EVENTS_LIMIT_MAX = EVENTS_KEPT
EVENTS_LIMIT_DEFAULT = 100
EVENTS_WAIT_MAX_S = 20.0


def _count(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.rel_url.query.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit() and low <= int(raw) <= high):
        raise QueueError(e.E_INVALID_OPTION, f"{name} must be an integer between {low} and {high}")
    return int(raw)


async def events(request: web.Request) -> web.Response:
    """`?after=SEQ&limit=N&wait_s=S`: the events after SEQ this client may see, waiting up to S
    seconds (at most 20) for one when there is none yet."""
    node = request.app[NODE]
    who = principal(request)
    after = _count(request, "after", 0, 0, 2**63 - 1)
    limit = _count(request, "limit", EVENTS_LIMIT_DEFAULT, 1, EVENTS_LIMIT_MAX)
    wait_s = number_param(request, "wait_s", 0.0, 0.0, EVENTS_WAIT_MAX_S)

    def visible(event: Event) -> bool:
        return event.queue is None or who.may_see(event.queue)
    feed = node.events
    found, next_after = await feed.wait_for(after, limit, visible, wait_s)
    answer: dict[str, Any] = {"events": [event.to_json() for event in found], "next_after": next_after,
                              "node": node.config.node_id, "started_ms": feed.started_ms,
                              "first_seq": feed.first_seq}
    return web.json_response(answer)
