"""Channels (seed 002) in the REST API: their definitions (create, characterize, set the resend
interval, typeof, delete, list) and publishing one message. Subscribing is a stream: it is on
the WebSocket (docs/PROTOCOL.md, "Channels"), where the client library does it."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from qserver.api.http_common import (
    ENGINE_ANSWER_GRACE_S,
    NAMES_PAGE_DEFAULT,
    NAMES_PAGE_MAX,
    PASSED_ON_BY,
    call,
    json_body,
    page_of,
    page_params,
    principal,
    propose,
)
from qserver.core import commands as c
from qserver.features.channels import transport
from qserver.features.channels.hub import ChannelHub
from qserver.services import SERVICES
from replication.cluster_map import (
    CHANNEL_RESEND_MAX_S,
    DeleteChannel,
    DeliveryClass,
    PutChannel,
    SetChannelAttributes,
    channel_queue,
    choose_pair,
)
from replication.map_channels import ATTRIBUTES, attributes_problem, normalized
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError
from wire.message_input import check_dedupe_id

TYPEOF_AT_MASTER_S = 1.0      # how long typeof waits for the channel's master before answering itself
HUB: web.AppKey[ChannelHub] = web.AppKey("channel_hub", ChannelHub)     # this node's channel hub


def channel_name(request: web.Request, privilege: str) -> str:
    name = request.match_info["c"]
    if not is_valid_queue_name(name) or name.endswith(DEAD_LETTER_SUFFIX):
        raise QueueError(e.E_INVALID_NAME, "channel names are queue names (1-196 of A-Z a-z 0-9 . _ : -, starting "
                                           "alphanumeric)")
    principal(request).require(privilege, name)
    return name


def describe(request: web.Request, name: str) -> dict[str, Any]:
    cluster = request.app[SERVICES].require_cluster_map()
    entry = cluster.channels.get(name)
    if entry is None:
        raise QueueError(e.E_UNKNOWN_CHANNEL, f"no channel named {name!r}")
    described = entry.to_json()
    pair = cluster.queues.get(channel_queue(name))
    if pair is not None:
        described.update({"master": pair.master, "replica": pair.replica, "epoch": pair.epoch})
    hub = request.app[HUB]
    described["subscribers_here"] = len(hub.subscribers.get(name, ()))
    if pair is not None and pair.master == request.app[SERVICES].node_id:
        # How its next publish travels, and who publishes: only its master knows (typeof).
        described["mechanism"] = hub.mechanisms.current(name).value
        described["advertisers"] = hub.publishers.count(name)
        described["leader"] = hub.leader_client(name)
    return described


async def put_channel(request: web.Request) -> web.Response:
    """Create a channel, or characterize it: its delivery class and resend interval (from the
    next publish on)."""
    name = channel_name(request, "admin")
    services = request.app[SERVICES]
    cluster = services.require_cluster_map()
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) - {"class", "resend_interval_s", *ATTRIBUTES}:
        raise QueueError(e.E_INVALID_OPTION, 'the body is {"class": "latest"|"acked"|"durable", '
                                             f'"resend_interval_s": seconds, and attributes {", ".join(ATTRIBUTES)}}}')
    attributes = {key: value for key, value in body.items() if key in ATTRIBUTES}
    if attributes:
        problem = attributes_problem(attributes)
        if problem is not None:
            raise QueueError(e.E_INVALID_OPTION, problem)
        services.require_feature("channel_attributes")
    existing = cluster.channels.get(name)
    delivery_class = body.get("class", existing.delivery_class if existing else DeliveryClass.LATEST.value)
    resend = body.get("resend_interval_s", existing.resend_interval_s if existing else 0.0)
    if delivery_class not in set(DeliveryClass) or type(resend) not in (int, float) \
            or not 0 <= resend <= CHANNEL_RESEND_MAX_S:
        raise QueueError(e.E_INVALID_OPTION, f"class is latest, acked or durable, resend_interval_s "
                                             f"0-{CHANNEL_RESEND_MAX_S}")
    if existing is None and channel_queue(name) in cluster.queues:
        raise QueueError(e.E_RESERVED_NAME, f"{channel_queue(name)} exists")
    pair = choose_pair(cluster) if existing is None else ("", "")
    if pair is None:
        raise QueueError(e.E_QUEUE_UNAVAILABLE, f"no two live nodes for channel {name}")
    incarnation = services.random_bits(62) | 1
    command = PutChannel(name, str(delivery_class), float(resend), pair[0], pair[1], incarnation)
    outcome = await propose(request, command)
    if not outcome.applied:
        raise QueueError(e.E_INVALID_OPTION, f"channel {name}: {outcome.reason}")
    if attributes:
        # A second map command (tag 23, level 3): the attributes given replace those of an
        # existing channel one by one; the others keep their values.
        current = cluster.channels[name].attributes
        wanted = normalized({**current, **attributes})
        if wanted != current:
            changed = await propose(request, SetChannelAttributes(name, wanted))
            if not changed.applied:
                raise QueueError(e.E_INVALID_OPTION, f"channel {name}: {changed.reason}")
    return web.json_response(describe(request, name), status=201 if outcome.reason == "created" else 200)


async def list_channels(request: web.Request) -> web.Response:
    """The channels the caller may see, by name, a page at a time (`limit`, `after`, `next`
    as GET /v1/queues); only the page's channels are described."""
    who = principal(request)
    limit, after = page_params(request, NAMES_PAGE_DEFAULT, NAMES_PAGE_MAX)
    names, cursor = page_of(sorted(request.app[SERVICES].require_cluster_map().channels), after, limit,
                            who.may_see)
    return web.json_response({"channels": [describe(request, name) for name in names], "next": cursor})


async def get_channel(request: web.Request) -> web.Response:
    """typeof: the channel's class and resend interval, and where it is served."""
    name = request.match_info["c"]
    if not principal(request).may_see(name):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {name}")
    services = request.app[SERVICES]
    entry = services.entry(channel_queue(name))
    if entry is not None and entry.master != services.node_id and PASSED_ON_BY not in request.headers \
            and name in services.require_cluster_map().channels:
        # Its master answers: only it knows the subscribers that decide how the next publish
        # travels ("mechanism"). Unreachable or slow, this node answers without it.
        with contextlib.suppress(QueueError, TimeoutError):
            answer = await asyncio.wait_for(services.pass_on(request, entry.master), TYPEOF_AT_MASTER_S)
            if answer.status < 500:
                return answer
    return web.json_response(describe(request, name))


async def delete_channel(request: web.Request) -> web.Response:
    name = channel_name(request, "admin")
    if not (await propose(request, DeleteChannel(name))).applied:
        raise QueueError(e.E_UNKNOWN_CHANNEL, f"no channel named {name!r}")
    return web.json_response({"channel": name, "deleted": True})


async def publish(request: web.Request) -> web.Response:
    """One message (the request itself says the caller publishes: no advertisement needed),
    answered once committed, and sent to every subscriber at the channel's master."""
    name = channel_name(request, "post")
    services, hub = request.app[SERVICES], request.app[HUB]
    hub.entry(name)
    dedupe_id = request.headers.get("X-Dedupe-Id")
    check_dedupe_id(dedupe_id)
    entry = services.entry(channel_queue(name))
    if entry is not None and entry.master != services.node_id and PASSED_ON_BY not in request.headers:
        return await services.pass_on(request, entry.master)
    payload = await request.read()
    client = principal(request).client_id
    hub.check_rest_publisher(name, client)
    mechanism = hub.mechanisms.current(name).value
    replier = c.FutureReplier()
    command = hub.mechanisms.route(replier, name, payload, dedupe_id, client, 0)
    if command is not None:
        services.submit(command)
    try:                          # a relay waits for its subscriber's receipt, then perhaps for storing
        message_id, epoch = await asyncio.wait_for(replier.future, transport.RELAY_ACK_S + ENGINE_ANSWER_GRACE_S)
    except TimeoutError:
        raise QueueError(e.E_TIMEOUT, "the node did not answer in time", outcome_unknown=True) from None
    return web.json_response({"channel": name, "id": message_id, "epoch": epoch, "mechanism": mechanism}, status=201)


async def fetch_message(request: web.Request) -> web.Response:
    """A staged message's payload by the id its reference named (either member of the channel's
    pair answers: the payload is stored on both)."""
    name = channel_name(request, "get")
    raw = request.match_info["id"]
    if not (raw.isascii() and raw.isdigit() and 0 < int(raw) < 2**63):
        raise QueueError(e.E_INVALID_OPTION, "a message id is a positive integer")
    payload = request.app[HUB].mechanisms.fetch(principal(request), name, int(raw))
    return web.Response(body=payload, content_type="application/octet-stream")


async def _at_master(request: web.Request, name: str) -> web.Response | None:
    """The channel's master answers about its durable subscriptions: a proxied answer from it,
    or None when this node is the master."""
    services = request.app[SERVICES]
    request.app[HUB].entry(name)
    entry = services.entry(channel_queue(name))
    if entry is not None and entry.master != services.node_id and PASSED_ON_BY not in request.headers:
        return await services.pass_on(request, entry.master)
    return None


async def list_subscriptions(request: web.Request) -> web.Response:
    """A durable channel's subscriptions, as its master holds them."""
    name = channel_name(request, "get")
    proxied = await _at_master(request, name)
    if proxied is not None:
        return proxied
    return web.json_response({"channel": name, "subscriptions": request.app[HUB].durable_subscriptions(name)})


async def drop_subscription(request: web.Request) -> web.Response:
    """End a durable subscription for good (a replicated step on the channel's queue)."""
    name = channel_name(request, "admin")
    subscription = request.match_info["s"]
    if not is_valid_queue_name(subscription):
        raise QueueError(e.E_INVALID_NAME, "a durable subscription's name is a queue name")
    proxied = await _at_master(request, name)
    if proxied is not None:
        return proxied
    hub = request.app[HUB]
    client = principal(request).client_id
    answer = await call(request.app[SERVICES], lambda replier: hub.drop_subscription_command(
        name, subscription, client, replier), may_have_applied=True)
    return web.json_response(answer)


def add_routes(app: web.Application, hub: ChannelHub) -> None:
    app[HUB] = hub
    r = app.router
    r.add_get("/v1/channels", list_channels)
    r.add_put("/v1/channels/{c}", put_channel)
    r.add_get("/v1/channels/{c}", get_channel)
    r.add_delete("/v1/channels/{c}", delete_channel)
    r.add_post("/v1/channels/{c}/messages", publish)
    r.add_get("/v1/channels/{c}/messages/{id}", fetch_message)
    r.add_get("/v1/channels/{c}/subscriptions", list_subscriptions)
    r.add_delete("/v1/channels/{c}/subscriptions/{s}", drop_subscription)
