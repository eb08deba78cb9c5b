"""REST routes of queues as a whole: create, list, describe, delete, purge and redrive
(docs/PROTOCOL.md, "REST"); a `producer` pair's purge and redrive run on each member.
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from qserver.api.auth import PASSED_ON_BY
from qserver.api.http_common import (
    NODE,
    PLACEMENT,
    call,
    in_engine,
    json_body,
    number_param,
    page_of,
    page_params,
    pass_on_to,
    principal,
    propose,
    queue_name,
)
from qserver.api.node_routes import cluster_client_counts
from qserver.core import commands as c
from qserver.core import view_scan
from qserver.services import SERVICES, NodeServices
from replication.cluster_map import CHANNEL_PREFIX, SetQueueOptions
from replication.options import (
    DEAD_LETTER_SUFFIX,
    LEVEL3_OPTIONS,
    OptionError,
    changed_options,
    is_valid_queue_name,
    options_from_json,
    parse_changes,
    parse_options,
)
from replication.queue_health import health_json
from wire import errors as e
from wire import versions
from wire.errors import QueueError

QUEUES_PAGE_DEFAULT, QUEUES_PAGE_MAX = 100, 1000       # GET /v1/queues
# The redrive (qserver/features/redrive.py: services, queue, limit, client -> its answer), given
# to the application by qserver/node.py: the API room imports no feature (tests/test_layers.py).
REDRIVE: web.AppKey[Callable[[NodeServices, str, int | None, str], Awaitable[dict[str, Any]]]] = \
    web.AppKey("redrive")


async def put_queue(request: web.Request) -> web.Response:
    name = queue_name(request, "admin")
    try:
        options, placement = parse_options(await json_body(request))
    except OptionError as error:
        raise QueueError(e.E_INVALID_OPTION, str(error)) from None
    engine = request.app[NODE].engine
    if any(options.get(option) for option in LEVEL3_OPTIONS):
        # A map entry naming them is one release 0.2.0 cannot read (wire/versions.py FEATURES).
        versions.require_feature(feature_level(engine), "queue_delay_and_wait")
    chosen = request.headers.get(PLACEMENT, "").split(",")
    if PASSED_ON_BY in request.headers and len(chosen) == 2:
        placement.setdefault("master", chosen[0])
        placement.setdefault("replica", chosen[1])
    result = await call(engine, lambda r: c.CreateQueue(name, options, placement, r))
    return web.json_response(result, status=201 if result["created"] else 200)


def feature_level(engine: Any) -> int:
    """The map's feature level; outside a cluster, this release's highest (nothing to keep compatible with)."""
    coordinator = engine.coordinator
    return versions.FEATURE_LEVEL if coordinator is None else coordinator.membership.cluster_map.feature_level


async def patch_queue(request: web.Request) -> web.Response:
    """PATCH /v1/queues/{q}: change options of an existing queue (docs/PROTOCOL.md, "Changing a
    queue's options"); the queue's options after the change. In a cluster a map command
    (SetQueueOptions) that every member's core takes from the map (qserver/cluster/pairs.py,
    reconcile), answered once this node's map applied it; on a lone node the core's record,
    answered once it is durable."""
    name = queue_name(request, "admin")
    if name.endswith(DEAD_LETTER_SUFFIX) or name.startswith(CHANNEL_PREFIX):
        raise QueueError(e.E_RESERVED_NAME, f"{name}: a dead-letter queue's or a channel's options follow its owner's")
    try:
        changes = parse_changes(await json_body(request))
    except OptionError as error:
        raise QueueError(e.E_INVALID_OPTION, str(error)) from None
    engine = request.app[NODE].engine
    coordinator = engine.coordinator
    if coordinator is None:
        return web.json_response(await in_engine(engine, lambda finish: _change_lone(engine, name, changes, finish)))
    versions.require_feature(coordinator.membership.cluster_map.feature_level, "queue_options_change")
    entry = coordinator.membership.cluster_map.queues.get(name)
    if entry is None:
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    before = options_from_json(entry.options).to_json(every=True)
    try:
        changed_options(entry.options, changes)       # refused here with its reason, before any proposal
    except OptionError as error:
        raise QueueError(e.E_INVALID_OPTION, str(error)) from None
    outcome = await propose(request, SetQueueOptions(name, entry.incarnation, changes))
    entry = coordinator.membership.cluster_map.queues.get(name)      # a snapshot may have replaced the map
    if not outcome.applied or entry is None:
        kind = e.E_UNKNOWN_QUEUE if entry is None or "incarnation" in outcome.reason else e.E_INVALID_OPTION
        raise QueueError(kind, f"queue {name}: {outcome.reason}")
    return web.json_response(_answer(name, before, options_from_json(entry.options).to_json(every=True)))


def _answer(name: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """PATCH's answer: every option after the change, and the names whose value it changed."""
    return {"name": name, "options": after, "changed": sorted(key for key in after if before.get(key) != after[key])}


def _change_lone(engine: Any, name: str, changes: dict[str, Any], finish: Callable[[Any], None]) -> None:
    """On the engine's task: a lone node's queue takes the options in its record, written with
    the open batch (what a restart loads); answered after that batch commits."""
    core = engine.cores.get(name)
    if core is None:
        finish(QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}"))
        return
    try:
        options = options_from_json(changed_options(core.options.to_json(), changes))
    except OptionError as error:
        finish(QueueError(e.E_INVALID_OPTION, str(error)))
        return
    answer = _answer(name, core.options.to_json(every=True), options.to_json(every=True))
    if options == core.options:
        finish(answer)
        return
    core.record.options = options
    engine.pipeline.touch(core)
    engine.pipeline.open.after_commit.append(lambda: finish(answer))


def shown_options(stored: dict[str, Any]) -> dict[str, Any]:
    """A map entry's options as an answer shows them: every one, the LEVEL3_OPTIONS it does not store at 0."""
    return {**dict.fromkeys(sorted(LEVEL3_OPTIONS), 0.0), "views": {}, **stored}


def receive_wait_s(engine: Any, name: str) -> float:
    """How long a receive that names no wait waits on queue `name`: its option receive_wait_s
    (0 when the map's entry or the core here does not set it; a dead-letter queue has its own,
    0, not its queue's, whose map entry it shares)."""
    if name.endswith(DEAD_LETTER_SUFFIX):
        return 0.0
    entry = engine.pairs.view.entry(name)
    if entry is not None:
        return float(entry.options.get("receive_wait_s", 0.0))
    core = engine.cores.get(name)
    return core.options.receive_wait_s if core is not None else 0.0


async def empty_queue_name(request: web.Request) -> web.Response:
    raise QueueError(e.E_INVALID_NAME, "the queue name is empty")


async def list_queues(request: web.Request) -> web.Response:
    """Every queue the caller may see, by name, a page at a time (`limit`, `after`: the last
    name of the previous page; `next` names this page's last when more follow). In a cluster
    the list is the map's, the same at every node: each queue with its master, replica, epoch
    and in-sync state, and the statistics of the members this node holds (`held_here`: the
    master's numbers are authoritative; a replica's follow them). Only the page's queues are
    described: the map keeps its names sorted (ClusterMap.queue_names)."""
    engine = request.app[NODE].engine
    who = principal(request)
    limit, after = page_params(request, QUEUES_PAGE_DEFAULT, QUEUES_PAGE_MAX)
    coordinator = engine.coordinator
    cluster_map = coordinator.membership.cluster_map if coordinator is not None else None
    entries = cluster_map.queues if cluster_map is not None else {}
    names = cluster_map.queue_names() if cluster_map is not None else sorted(engine.cores)
    match, before = request.rel_url.query.get("match", ""), request.rel_url.query.get("before", "")
    if len(match) > QUEUE_MATCH_MAX or (before and not is_valid_queue_name(before)):
        raise QueueError(e.E_INVALID_OPTION, f"match is at most {QUEUE_MATCH_MAX} characters; before is a name")
    if match or before or "previous" in request.rel_url.query:
        # The console's filter and its previous page (docs/PROTOCOL.md, "GET /v1/queues"); a
        # listing without them answers as it always did.
        def visible(name: str) -> bool:
            return match in name and who.may_see(name)
        chosen, cursor, previous = page_around(names, after, before, limit, visible)
        return web.json_response({"queues": [_listed(engine, entries, name) for name in chosen], "next": cursor,
                                  "previous": previous, "match": match})
    chosen, cursor = page_of(names, after, limit, who.may_see)
    page: list[dict[str, Any]] = []
    for name in chosen:
        core = engine.cores.get(name)
        listed = engine.describe(core) if core is not None else {"name": name}
        entry = entries.get(name)
        if entry is not None:            # the map's placement wins over what this node describes
            listed.update({"options": listed.get("options", shown_options(entry.options)), "master": entry.master,
                           "replica": entry.replica, "epoch": entry.epoch, "in_sync": entry.in_sync,
                           "incarnation": entry.incarnation, "last_reason": entry.last_reason,
                           "held_here": core is not None})
            if "failed_reason" not in listed:      # not its master here: the map's record (queue_health.py)
                listed.update(health_json(cluster_map, name))
        page.append(listed)
    return web.json_response({"queues": page, "next": cursor})


QUEUE_MATCH_MAX = 200      # GET /v1/queues?match=: a part of a name


def _listed(engine: Any, entries: Any, name: str) -> dict[str, Any]:
    """One queue of a listing: this node's description (when it holds a member) with the map's placement."""
    core = engine.cores.get(name)
    listed: dict[str, Any] = engine.describe(core) if core is not None else {"name": name}
    entry = entries.get(name)
    if entry is not None:
        listed.update({"options": listed.get("options", shown_options(entry.options)), "master": entry.master,
                       "replica": entry.replica, "epoch": entry.epoch, "in_sync": entry.in_sync,
                       "incarnation": entry.incarnation, "last_reason": entry.last_reason,
                       "held_here": core is not None})
        if "failed_reason" not in listed:          # not its master here: the map's record (queue_health.py)
            listed.update(health_json(engine.coordinator.membership.cluster_map, name))
    return listed


def page_around(names: list[str], after: str, before: str, limit: int,
                visible: Callable[[str], bool]) -> tuple[list[str], str | None, str | None]:
    """A page of visible names: the first `limit` after `after`, or (with `before`) the last
    `limit` before `before`; with the cursor of the page that follows (this page's last name,
    None when no visible name follows) and of the page that precedes (this page's first name,
    None when no visible name precedes it). The cost is the page's and the names passed over."""
    if before:
        page: list[str] = []
        position = bisect.bisect_left(names, before) - 1
        while position >= 0 and len(page) < limit:
            if visible(names[position]):
                page.append(names[position])
            position -= 1
        page.reverse()
        earlier = any(visible(names[p]) for p in range(position, -1, -1))
        later = any(visible(names[p]) for p in range(bisect.bisect_left(names, before), len(names)))
        return page, (page[-1] if page and later else None), (page[0] if page and earlier else None)
    page, cursor = page_of(names, after, limit, visible)
    start = bisect.bisect_left(names, page[0]) if page else 0
    earlier = any(visible(names[p]) for p in range(start - 1, -1, -1))
    return page, cursor, (page[0] if page and earlier else None)


async def get_queue(request: web.Request) -> web.Response:
    name = request.match_info["q"]
    if not is_valid_queue_name(name):
        raise QueueError(e.E_INVALID_NAME, "invalid queue name")
    if not principal(request).may_see(name):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {name}")
    engine = request.app[NODE].engine
    core = engine.cores.get(name)
    if core is None:
        engine.pairs.refuse_if_not_master(name)    # in a cluster, another node may hold it
        raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue named {name!r}")
    stats = engine.describe(core)
    stats.update(await cluster_client_counts(request, name))    # every node's clients of it (node_routes.py)
    if core.options.views:       # virtual queues: each view's depth, counted within a bound (view_scan.py)
        stats["views"] = view_scan.view_depths(engine.registry.storage, core)
    sessions = request.app[NODE].forward_root.sessions_of(name)
    if sessions:                  # the root of forwards (seed 003): their sessions here
        stats["forward_sessions"] = sessions
    return web.json_response(stats)


async def delete_queue(request: web.Request) -> web.Response:
    name = queue_name(request, "admin")
    return web.json_response(await call(request.app[NODE].engine, lambda r: c.DeleteQueue(name, r)))


OWN_COPY = "X-Own-Copy"     # set by a member passing a `producer` purge or redrive on to the other


async def purge(request: web.Request) -> web.Response:
    """Take every message the queue holds now (ready or leased) out of it, for good. Under
    `full` the master decides and the purge is replicated; under `producer`, see on_each_member."""
    name = queue_name(request, "admin")
    node = request.app[NODE]
    result = await call(node.engine, lambda r: c.Purge(name, r))
    return await on_each_member(request, name, result, "purged")


async def redrive(request: web.Request) -> web.Response:
    """Move the queue's dead letters (up to `limit`) back into it (qserver/features/redrive.py)."""
    name = queue_name(request, "admin")
    limit = int(number_param(request, "limit", 0, 1, 10_000_000)) or None
    result = await request.app[REDRIVE](request.app[SERVICES], name, limit, principal(request).client_id)
    return await on_each_member(request, name, result, "redriven")


async def on_each_member(request: web.Request, name: str, result: dict[str, Any], count: str) -> web.Response:
    """Under `producer` each member holds its own copy of the messages and of their
    consumption (dead letters included): the member that ran an operator's purge or redrive
    passes it on to the other, which runs it on its own copy; `members` says what each did,
    or why not (a member that is down keeps its copy, as it keeps messages acked at the other)."""
    node = request.app[NODE]
    core = node.engine.cores.get(name)
    entry = node.engine.pairs.view.entry(name)
    if core is None or entry is None or core.options.strength.value != "producer" or OWN_COPY in request.headers:
        return web.json_response(result)
    me = node.config.node_id
    other = entry.replica if entry.master == me else entry.master
    members: dict[str, Any] = {me: result[count]}
    if other:
        answer = await pass_on_to(request, node, other, extra={OWN_COPY: "1"})
        try:
            document = json.loads(answer.body)       # type: ignore[arg-type]
            members[other] = document[count] if answer.status == 200 else document["error"]["code"]
        except (ValueError, KeyError, TypeError):
            members[other] = e.E_INTERNAL.code
    return web.json_response({**result, "members": members})
