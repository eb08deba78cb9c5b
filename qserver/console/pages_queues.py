"""The console's queues pages (docs/CONSOLE.md, "Queues" and "A queue and its messages"): the
queues a client may see, a page of 50 at a time, paged and filtered on the node (GET /v1/queues
with `match`, `after`, `before`); a queue with its options, its pair, its dead-letter queue and
its messages browsed without taking them (peek); one message's payload as text, JSON or hex.

Every figure comes through the client library in the signed-in client's name. A page of queues
costs one listing at each node (each describes the members it holds of the same 50 names; the
master's figures win), never every queue's statistics."""
from __future__ import annotations

import asyncio
import base64
import datetime
import json
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from client.http import HttpClient
from qserver.console.frame import PREFIX, ConsoleRoutes, View
from qserver.console.sampling import FETCH_TIMEOUT_S, rate, rates_of, sampler_of, sparkline
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError

QUEUES_PER_PAGE = 50
MESSAGES_PER_PAGE = 50
MATCH_MAX = 200
PAYLOAD_SHOWN_MAX = 1024 * 1024        # a message page shows at most this much of a payload
VIEWS = ("text", "json", "hex")
PLACEMENT_KEYS = ("name", "master", "replica", "epoch", "in_sync", "options", "last_reason")


def node_http(view: View, url: str) -> HttpClient:
    """The REST client of another node, in the signed-in client's name (the client library's
    own connection to that node: client/router.py)."""
    return view.client.node_http(url)


async def bounded(call: Any) -> Any:
    """A call to another node, or None when it fails or does not answer in time (its queues
    are then shown with what this node knows)."""
    try:
        async with asyncio.timeout(FETCH_TIMEOUT_S):
            return await call
    except (QueueError, TimeoutError, OSError):
        return None


def queue_link(name: str) -> str:
    return f"{PREFIX}/queues/{quote(name, safe='')}"


# --- the queues ------------------------------------------------------------------------------
def queue_row(listed: dict[str, Any], view: View) -> dict[str, Any]:
    sampler = sampler_of(view.console)
    held = "total_enqueued" in listed
    if held:
        sampler.record_queue(listed["name"], listed["total_enqueued"], listed.get("total_acked", 0))
    enqueued, acked = sampler.queue_series(listed["name"])
    return {**listed, "held": held, "lag": listed.get("replica_lag"),
            "oldest_age_s": listed.get("oldest_message_age_s"),
            "enqueue_rate": rate(enqueued), "ack_rate": rate(acked),
            "spark": sparkline(rates_of(enqueued)[-30:]), "link": queue_link(listed["name"])}


def merge_pages(mine: list[dict[str, Any]], others: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """This node's page, each queue's figures taken from its master's node where that node
    answered the same page (else from the replica's, else the map's placement alone)."""
    best: dict[str, dict[str, Any]] = {}
    for answer in [{"queues": mine}] + [a for a in others if a is not None]:
        for listed in answer.get("queues", []):
            name = listed.get("name")
            if not listed.get("held_here"):
                continue
            is_master = listed.get("master_status") == "master"
            if name not in best or is_master:
                best[name] = listed
    rows = []
    for listed in mine:
        # The placement is the local map's (the same at every node): the statistics the best member's.
        row: dict[str, Any] = dict(best.get(listed["name"]) or {})
        row.update({k: listed[k] for k in PLACEMENT_KEYS if k in listed})
        rows.append(row)
    return rows


async def queues_page(view: View) -> web.StreamResponse:
    query = view.request.rel_url.query
    match = query.get("q", "").strip()[:MATCH_MAX]
    after, before = query.get("after", ""), query.get("before", "")
    if (after and not is_valid_queue_name(after)) or (before and not is_valid_queue_name(before)):
        raise QueueError(e.E_INVALID_OPTION, "after and before are queue names (the pager's links)")
    def listing(http: HttpClient) -> Any:
        return http.queue_page_around(QUEUES_PER_PAGE, after or None, before=before or None, match=match)
    # The same page from every other node at once (their URLs as last read: NODE_URLS_TTL_S);
    # a node that masters one of the page's queues and was not asked is asked then.
    here = view.node.config.node_id
    cache = sampler_of(view.console)
    known = {node: url for node, url in cache.member_urls().items() if node != here}
    page, *answers = await asyncio.gather(listing(view.client.http),
                                          *(bounded(listing(node_http(view, url))) for url in known.values()))
    mine: list[dict[str, Any]] = page.get("queues", [])
    others: list[dict[str, Any] | None] = list(answers)
    unasked = {q.get("master") for q in mine} - set(known) - {None, here}
    if unasked:
        placement = await view.client.http.cluster(queues=[mine[0]["name"]])
        urls = {n["id"]: n["url"] for n in placement.get("nodes", []) if n.get("url")}
        cache.remember_member_urls(urls)
        others += await asyncio.gather(*(bounded(listing(node_http(view, urls[node])))
                                         for node in unasked if node in urls))
    rows = [queue_row(listed, view) for listed in merge_pages(mine, others)]

    def link(**params: str) -> str:
        return f"{PREFIX}/queues?" + urlencode({k: v for k, v in {"q": match, **params}.items() if v})
    return view.render("queues.html", queues=rows, match=match,
                       next_link=link(after=page["next"]) if page.get("next") else None,
                       previous_link=link(before=page["previous"]) if page.get("previous") else None,
                       per_page=QUEUES_PER_PAGE)


# --- a queue --------------------------------------------------------------------------------
async def queue_figures(view: View, name: str) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, str]]:
    """The map's entry of the queue (its pair) and the statistics of its master (or, when the
    master does not answer, of its replica), with the nodes' URLs."""
    placement = await view.client.http.cluster(queues=[name])
    entry = placement.get("queues", {}).get(name.removesuffix(DEAD_LETTER_SUFFIX)) or {}
    urls = {n["id"]: n["url"] for n in placement.get("nodes", []) if n.get("url")}
    stats = None
    for member in (entry.get("master"), entry.get("replica")):
        if member in urls:
            stats = await bounded(node_http(view, urls[member]).queue_stats(name))
            if stats is not None:
                break
    if stats is None and not entry:          # a node alone, or a map that does not list it
        stats = await view.client.queue_stats(name)
    return entry, stats, urls


async def peek(view: View, name: str, after: int) -> dict[str, Any]:
    """A page of the queue's messages in delivery order, without taking them (issue 35 item 1)."""
    return dict(await view.client.peek(name, after=after, limit=MESSAGES_PER_PAGE, preview=True))


def shown_time(ms: Any) -> str:
    """An enqueue time (ms since the epoch) in UTC, to the millisecond."""
    if not isinstance(ms, int | float) or ms <= 0:
        return "-"
    moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{int(ms) % 1000:03d} UTC"


def message_row(message: dict[str, Any], name: str) -> dict[str, Any]:
    payload = payload_bytes(message)
    return {**message, "preview": payload.decode("utf-8", "replace")[:120],
            "enqueued_at": shown_time(message.get("enqueued_at_ms")),
            "link": f"{queue_link(name)}/messages/{message.get('id')}"}


def payload_bytes(message: dict[str, Any]) -> bytes:
    payload = message.get("payload")
    if isinstance(payload, bytes | bytearray):
        return bytes(payload)
    if "payload_b64" in message:
        return base64.b64decode(message["payload_b64"])
    return str(payload or "").encode()


async def queue_page(view: View) -> web.StreamResponse:
    name = view.request.match_info["q"]
    if not is_valid_queue_name(name):
        raise QueueError(e.E_INVALID_NAME, "invalid queue name")
    raw_after = view.request.rel_url.query.get("after", "0")
    if not (raw_after.isascii() and raw_after.isdigit() and len(raw_after) < 20):
        raise QueueError(e.E_INVALID_OPTION, "after is a message id (the pager's link)")
    entry, stats, urls = await queue_figures(view, name)
    dead_letter: dict[str, Any] | None = None
    if not name.endswith(DEAD_LETTER_SUFFIX) and (stats or {}).get("options", {}).get("dead_letter", True):
        dlq_name = name + DEAD_LETTER_SUFFIX
        dead_letter = {"name": dlq_name, "link": queue_link(dlq_name), "depth": None}
        if entry.get("master") in urls:
            dlq = await bounded(node_http(view, urls[entry["master"]]).queue_stats(dlq_name))
            dead_letter["depth"] = (dlq or {}).get("depth")
    browsed: dict[str, Any] = {"messages": [], "next_after": None, "served_by": None}
    browse_error = None
    try:
        browsed = await peek(view, name, int(raw_after))
    except QueueError as error:
        browse_error = f"{error.code}: {error.message}"
    messages = [message_row(m, name) for m in browsed.get("messages", [])]
    next_after = browsed.get("next_after")
    return view.render("queue.html", name=name, entry=entry, stats=stats or {}, dead_letter=dead_letter,
                       messages=messages, served_by=browsed.get("served_by"), browse_error=browse_error,
                       next_link=f"{queue_link(name)}?after={next_after}" if next_after else None,
                       first_link=queue_link(name) if raw_after != "0" else None,
                       queue=name, back=view.request.path_qs, queue_link=queue_link(name),
                       options=(stats or entry).get("options") or {})


# --- one message -----------------------------------------------------------------------------
def shown_payload(payload: bytes, how: str) -> tuple[str, str | None]:
    """The payload as text, pretty JSON or hex (and why not JSON, when it does not parse)."""
    payload = payload[:PAYLOAD_SHOWN_MAX]
    if how == "hex":
        lines = []
        for offset in range(0, len(payload), 16):
            chunk = payload[offset:offset + 16]
            text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
            lines.append(f"{offset:08x}  {chunk.hex(' '):<47}  {text}")
        return "\n".join(lines), None
    text = payload.decode("utf-8", "replace")
    if how == "json":
        try:
            return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=False), None
        except ValueError as error:
            return text, f"not JSON ({error}): shown as text"
    return text, None


async def message_page(view: View) -> web.StreamResponse:
    name, raw_id = view.request.match_info["q"], view.request.match_info["id"]
    if not is_valid_queue_name(name):
        raise QueueError(e.E_INVALID_NAME, "invalid queue name")
    if not (raw_id.isascii() and raw_id.isdigit() and len(raw_id) < 20):
        raise QueueError(e.E_INVALID_OPTION, "a message id is a number")
    how = view.request.rel_url.query.get("view", "text")
    if how not in VIEWS:
        raise QueueError(e.E_INVALID_OPTION, "view is text, json or hex")
    message = await view.client.read_message(name, int(raw_id))
    payload = payload_bytes(message)
    shown, note = shown_payload(payload, how)
    headers = message.get("headers") or {}
    return view.render("message.html", name=name, message=message, shown=shown, note=note, how=how,
                       enqueued_at=shown_time(message.get("enqueued_at_ms")),
                       views=VIEWS, size=message.get("size", len(payload)), headers=headers,
                       cut=len(payload) > PAYLOAD_SHOWN_MAX, queue_link=queue_link(name),
                       self_link=f"{queue_link(name)}/messages/{raw_id}")


def add_routes(routes: ConsoleRoutes) -> None:
    routes.page(PREFIX + "/queues", queues_page)
    routes.page(PREFIX + "/queues/{q}", queue_page)
    routes.page(PREFIX + "/queues/{q}/messages/{id}", message_page)


