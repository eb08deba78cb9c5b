"""Recipients (seed 001, fault surveillance: qserver/features/surveillance/watch.py) in the REST API: their
states, the ordered chain of alternative recipients that take over a recipient's messages
while it is in the fault state, and removing a recipient. All live in the cluster map
(`PutRecipient`, `SetAlternatives`, `RemoveRecipient`), so every node follows the same ones."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from qserver.api.http_common import (
    NAMES_PAGE_DEFAULT,
    NAMES_PAGE_MAX,
    json_body,
    page_of,
    page_params,
    path_name,
    principal,
    propose,
)
from qserver.services import SERVICES
from replication.cluster_map import ALTERNATIVES_MAX, RemoveRecipient, SetAlternatives
from replication.options import is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError


def recipient_name(request: web.Request) -> str:
    return path_name(request, "r", "recipient")


async def put_alternatives(request: web.Request) -> web.Response:
    """Set (or with an empty list, clear) a recipient's chain of alternatives (admin)."""
    caller = principal(request)
    caller.require("admin", "*")
    name = recipient_name(request)
    body = await json_body(request)
    items = body.get("alternatives") if isinstance(body, dict) else None
    if not isinstance(items, list) or len(items) > ALTERNATIVES_MAX or not all(
            isinstance(item, str) for item in items):
        raise QueueError(e.E_INVALID_OPTION, f'the body is {{"alternatives": ["recipient=queue", ...]}}, at most '
                                             f'{ALTERNATIVES_MAX}')
    cluster = request.app[SERVICES].require_cluster_map()
    chain, queues = [], []
    for item in items:
        other, _, queue = item.partition("=")
        if not queue:       # a recipient bound already: the queue it receives from now
            entry = cluster.recipients.get(other)
            queue = entry.queue if entry is not None else cluster.chain_binding(other) or ""
            if not queue:
                raise QueueError(e.E_INVALID_OPTION, f"name the queue of alternative {other}, which has not "
                                                     f"subscribed yet: {other}=QUEUE")
        if not (is_valid_queue_name(other) and is_valid_queue_name(queue)):
            raise QueueError(e.E_INVALID_OPTION, f"{item!r} is not recipient=queue of valid names")
        chain.append(other)
        queues.append(queue)
    if name in chain or len(set(chain)) != len(chain):
        raise QueueError(e.E_INVALID_OPTION, "a chain names each alternative once, and not the recipient itself")
    await propose(request, SetAlternatives(name, tuple(chain), tuple(queues), caller.client_id))
    return web.json_response({"recipient": name, "alternatives": chain, "queues": queues})


async def get_alternatives(request: web.Request) -> web.Response:
    principal(request).require("admin", "*")
    name = recipient_name(request)
    cluster = request.app[SERVICES].require_cluster_map()
    return web.json_response({"recipient": name, "alternatives": list(cluster.alternatives.get(name, ())),
                              "queues": list(cluster.alternative_queues.get(name, ()))})


async def list_recipients(request: web.Request) -> web.Response:
    """Every recipient the map knows: its queue, state (ok, fault, defunct), since when and
    why (fault surveillance, qserver/features/surveillance/watch.py), and its chain of alternatives; a chain
    may name recipients that never subscribed yet. A page at a time (`limit`, `after`, `next`
    as GET /v1/queues)."""
    limit, after = page_params(request, NAMES_PAGE_DEFAULT, NAMES_PAGE_MAX)
    caller = principal(request)
    cluster = request.app[SERVICES].require_cluster_map()
    chains: dict[str, Any] = cluster.alternatives

    def visible(name: str) -> bool:     # an administrator sees all; a client, the recipients of its queues
        entry = cluster.recipients.get(name)
        return caller.allows("admin", "*") or (entry is not None and caller.may_see(entry.queue))
    out = []
    names, cursor = page_of(sorted(set(chains) | set(cluster.recipients)), after, limit, visible)
    for name in names:
        entry = cluster.recipients.get(name)
        known = entry.to_json() if entry is not None else {"name": name, "queue": None, "state": None}
        out.append({**known, "recipient": name, "alternatives": list(chains.get(name, ())),
                    "alternative_queues": list(cluster.alternative_queues.get(name, ()))})
    return web.json_response({"recipients": out, "next": cursor})


async def remove_recipient(request: web.Request) -> web.Response:
    """Forget a recipient (admin): its state and its chain of alternatives, at every node (a map
    command). The master of its queue stops failing its messages over and gives back to the
    queue what its mover holds; the chains of other recipients that name it are left as they
    are (`named_by`): they may name recipients that never subscribed yet."""
    principal(request).require("admin", "*")
    name = recipient_name(request)
    outcome = await propose(request, RemoveRecipient(name))
    if not outcome.applied:
        raise QueueError(e.E_UNKNOWN_RECIPIENT, f"no recipient {name}: it never subscribed and has no "
                                                "alternatives, or was removed")
    chains: dict[str, Any] = request.app[SERVICES].require_cluster_map().alternatives
    named_by = sorted(other for other, chain in chains.items() if name in chain)
    return web.json_response({"recipient": name, "removed": True, "named_by": named_by})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/recipients", list_recipients)
    r.add_get("/v1/recipients/{r}/alternatives", get_alternatives)
    r.add_put("/v1/recipients/{r}/alternatives", put_alternatives)
    r.add_delete("/v1/recipients/{r}", remove_recipient)
