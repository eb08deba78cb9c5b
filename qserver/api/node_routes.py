"""One node's statistics in one call (issue 37 item 3): `GET /v1/node` (`qctl node stats`), and
the clients of a queue counted over the whole cluster (`GET /v1/node/clients?queue=`, what a
queue's master asks every other node when it describes the queue).

Any authenticated client may read a node's statistics, as it may read `GET /v1/cluster`; the
queue names listed are only those the caller's grants let it see, and at most NAMES_MAX.
"""
from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

import aiohttp
import yarl
from aiohttp import web

from qserver.api.auth import pass_on_headers
from qserver.api.http_common import NODE, principal
from replication.options import is_valid_queue_name
from wire import errors as e
from wire import versions
from wire.errors import QueueError

NAMES_MAX = 100              # queue names listed per role in GET /v1/node (the counts are whole)
RATE_WINDOW_S = 10.0         # rates are over the samples of the last this many seconds
SAMPLES_MAX = 64             # samples kept (one each LOOK_INTERVAL_S: more than the window needs)
PEER_COUNT_TIMEOUT_S = 0.5   # a peer that does not answer in this time is named, not waited for
# A peer that did not answer is not asked again for this long (it is named missing): a dashboard
# or a test polling a queue's statistics must not wait PEER_COUNT_TIMEOUT_S at every call while a
# killed node is still "up" in the map (until its lease lapses).
PEER_COUNT_SILENT_S = 3.0


class NodeRates:
    """Enqueues and acks per second over the last RATE_WINDOW_S, from the totals of the queues
    mastered here (each message counted once, by its master): sampled by the node's health
    watch (qserver/cluster/queue_health.py) every second."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=SAMPLES_MAX)

    def _totals(self) -> tuple[int, int]:
        pairs = self.engine.pairs
        enqueued = acked = 0
        for name, core in self.engine.cores.items():
            if pairs.clustered and name not in pairs.masters:
                continue
            enqueued += core.record.total_enqueued
            acked += core.record.total_acked
        return enqueued, acked

    def sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, *self._totals()))
        while self._samples and self._samples[0][0] < now - RATE_WINDOW_S - 1:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        now = time.monotonic()
        recent = [s for s in self._samples if s[0] >= now - RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return {"enqueued_per_s": 0.0, "acked_per_s": 0.0, "window_s": 0.0}
        first, last = recent[0], recent[-1]
        span = last[0] - first[0]
        return {"enqueued_per_s": round(max(0, last[1] - first[1]) / span, 3),
                "acked_per_s": round(max(0, last[2] - first[2]) / span, 3), "window_s": round(span, 3)}


def _names(names: list[str], who: Any) -> dict[str, Any]:
    seen = sorted(name for name in names if who.may_see(name))
    return {"count": len(names), "names": seen[:NAMES_MAX], "names_truncated": len(seen) > NAMES_MAX}


def _storage(node: Any) -> dict[str, Any]:
    storage, engine = node.storage, node.engine
    try:
        file_bytes: int | None = os.path.getsize(storage.path / "data.mdb")
    except OSError:
        file_bytes = None
    space = engine.space
    return {"file_bytes": file_bytes, "map_bytes": storage.map_size(), "map_size_max_bytes": storage.map_size_max_bytes,
            "used_bytes": None if space is None else space.used_bytes,
            "disk_free_bytes": None if space is None else space.disk_free_bytes,
            "map_free_bytes": None if space is None else space.map_free_bytes,
            "full": engine.storage_full}


def node_stats_of(node: Any, who: Any) -> dict[str, Any]:
    engine = node.engine
    pairs = engine.pairs
    if pairs.clustered:
        mastered, replicated = list(pairs.masters), list(pairs.replicas)
    else:
        mastered, replicated = list(engine.cores), []
    connections = list(node.connections)
    coordinator = engine.coordinator
    lease: dict[str, Any] = {"held": True, "remaining_ms": None}        # a node alone needs none
    membership: dict[str, Any] = {}
    cluster_map: dict[str, Any] = {}
    if coordinator is not None:
        remaining = coordinator.lease.valid_until_ms - coordinator.monotonic_ms()
        lease = {"held": coordinator.lease_valid(), "remaining_ms": max(0, remaining), "lapses": coordinator.lease_lapses}
        membership = coordinator.membership.status()
        known = coordinator.membership.cluster_map
        cluster_map = {"version": known.version, "feature_level": known.feature_level, "queues": len(known.queues),
                       "nodes": len(known.nodes), "raft_log_entries": max(0, membership.get("last_index", 0)
                                                                          - membership.get("snapshot_index", 0))}
    failed = node.queue_health.health.failures
    return {
        "node": node.config.node_id, "url": node.url, "release": versions.RELEASE,
        "feature_level": cluster_map.get("feature_level", versions.FEATURE_LEVEL),
        "uptime_s": round(time.time() - node.started_s, 3),
        "queues": {"mastered": _names(mastered, who), "replicated": _names(replicated, who),
                   "failed": _names(sorted(failed), who)},
        "clients": {"connections": len(connections),
                    "distinct_clients": len({conn.principal.client_id for conn in connections}),
                    "producing": sum(1 for conn in connections if conn.queues_produced),
                    "consuming": sum(1 for conn in connections if conn.queues_consumed)},
        "rates": node.rates.rates(),
        "storage": _storage(node),
        "map": cluster_map,
        "loop_lag": {"recent_max_s": round(node.loop_lag.recent_max_s(), 6), "max_s": round(node.loop_lag.max_ever_s, 6),
                     "window_s": node.loop_lag.WINDOW_S},
        "lease": lease,
        "membership": membership,
        "inbox_commands": engine.pending_commands(),
    }


async def node_stats(request: web.Request) -> web.Response:
    """GET /v1/node: this node's statistics (docs/PROTOCOL.md, "GET /v1/node")."""
    who = principal(request)
    unknown = set(request.rel_url.query)
    if unknown:
        raise QueueError(e.E_INVALID_OPTION, f"GET /v1/node takes no parameters (got {', '.join(sorted(unknown))})")
    return web.json_response(node_stats_of(request.app[NODE], who))


def local_client_counts(node: Any, queue: str) -> dict[str, Any]:
    """The clients of `queue` on this node's sockets: producers, consumers (WebSocket), the
    distinct client ids among them, and the push subscriptions open here."""
    connections = [conn for conn in node.connections if queue in conn.queues_produced or queue in conn.queues_consumed]
    return {"producer_clients": sum(1 for conn in connections if queue in conn.queues_produced),
            "consumer_clients": sum(1 for conn in connections if queue in conn.queues_consumed),
            "client_ids": sorted({conn.principal.client_id for conn in connections})}


async def node_clients(request: web.Request) -> web.Response:
    """GET /v1/node/clients?queue=NAME: the queue's clients on this node's sockets."""
    queue = request.rel_url.query.get("queue", "")
    if not is_valid_queue_name(queue):
        raise QueueError(e.E_INVALID_NAME, "queue= names a queue")
    if not principal(request).may_see(queue):
        raise QueueError(e.E_FORBIDDEN, f"no grant covers {queue}")
    counts = local_client_counts(request.app[NODE], queue)
    counts["client_ids"] = counts["client_ids"][:NAMES_MAX]
    return web.json_response({"node": request.app[NODE].config.node_id, **counts})


class PeerCounts:
    """Asks the other nodes for their sockets' counts, remembering which peer fell silent when."""

    def __init__(self) -> None:
        self._silent_since: dict[str, float] = {}      # peer -> monotonic s of its last silence

    async def of(self, node: Any, peer: str, client_id: str, queue: str) -> dict[str, Any] | None:
        silent = self._silent_since.get(peer)
        if silent is not None and time.monotonic() - silent < PEER_COUNT_SILENT_S:
            return None
        counts = await _peer_counts(node, peer, client_id, queue)
        if counts is None:
            self._silent_since[peer] = time.monotonic()
        else:
            self._silent_since.pop(peer, None)
        return counts


PEER_COUNTS = web.AppKey("peer_counts", PeerCounts)


async def _peer_counts(node: Any, peer: str, client_id: str, queue: str) -> dict[str, Any] | None:
    path, query = "/v1/node/clients", [("queue", queue)]
    headers = pass_on_headers(node.auth.cluster_secret, node.config.node_id, peer, client_id, "GET", path, query, {}, b"")
    url = yarl.URL(node.engine.pairs.view.url(peer)).with_path(path).with_query(query)
    try:
        async with node.http_session().get(url, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=PEER_COUNT_TIMEOUT_S)) as answer:
            if answer.status != 200:
                return None
            found = await answer.json()
        return found if isinstance(found, dict) else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def cluster_client_counts(request: web.Request, queue: str) -> dict[str, Any]:
    """The queue's clients over the whole cluster: this node's sockets and every other node's
    that is up, asked at once in the caller's name and waited for at most PEER_COUNT_TIMEOUT_S
    (one that did not is not asked again for PEER_COUNT_SILENT_S);
    `client_counts_missing` names the nodes that did not answer (their clients are not counted)."""
    node = request.app[NODE]
    mine = local_client_counts(node, queue)
    membership = node.engine.pairs.view.membership
    peers: list[str] = []
    if membership is not None and node.auth.cluster_secret:
        peers = sorted(entry.node_id for entry in membership.cluster_map.nodes.values()
                       if entry.node_id != node.config.node_id and entry.state.value in ("up", "draining"))
    client_id = principal(request).client_id
    asked = request.app[PEER_COUNTS]
    found = await asyncio.gather(*(asked.of(node, peer, client_id, queue) for peer in peers))
    producers, consumers, ids = mine["producer_clients"], mine["consumer_clients"], set(mine["client_ids"])
    missing = []
    for peer, counts in zip(peers, found, strict=True):
        if counts is None:
            missing.append(peer)
            continue
        producers += int(counts.get("producer_clients", 0))
        consumers += int(counts.get("consumer_clients", 0))
        ids.update(str(i) for i in counts.get("client_ids", []))
    return {"producer_clients": producers, "consumer_clients": consumers, "remote_clients": len(ids),
            "client_counts_nodes": [node.config.node_id, *(p for p in peers if p not in missing)],
            "client_counts_missing": missing}


def add_routes(app: web.Application) -> None:
    app[PEER_COUNTS] = PeerCounts()
    app.router.add_get("/v1/node", node_stats)
    app.router.add_get("/v1/node/clients", node_clients)
