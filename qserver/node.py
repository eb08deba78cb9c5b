"""One node: storage, engine, authentication and the aiohttp application around them."""
from __future__ import annotations

import asyncio
import fcntl
import functools
import gc
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web

from qserver.api.auth import CLUSTER_CLIENT, Authenticator
from qserver.api.completion_waits import CompletionWaits
from qserver.api.http_api import NODE, add_routes, errors_and_auth
from qserver.api.http_common import pass_on_to
from qserver.api.node_routes import NodeRates
from qserver.api.queue_routes import REDRIVE
from qserver.api.ws_api import ClientConnection, websocket
from qserver.assembly import build_engine
from qserver.cluster.events import EventFeed
from qserver.cluster.membership import RaftMembership, raft_limits, tick_ms
from qserver.cluster.queue_health import QueueHealthWatch
from qserver.config import NodeConfig
from qserver.console.app import install as install_console
from qserver.console.frame import Console
from qserver.core import commands as c
from qserver.core.failstop import loop_exception_handler, stop_process
from qserver.features.channels import api as channel_api
from qserver.features.channels.hub import ChannelHub
from qserver.features.forwards import api as forward_api
from qserver.features.forwards.forwarder import Forwarders
from qserver.features.forwards.root import ForwardRoot
from qserver.features.macro import api as macro_api
from qserver.features.macro.service import MacroService
from qserver.features.redrive import redrive
from qserver.features.sqs import api as sqs_api
from qserver.features.surveillance import api as recipient_api
from qserver.features.surveillance.watch import RecipientWatch
from qserver.http_errors import EnvelopeAppRunner
from qserver.metrics import COLLECTOR_PAUSES, LoopLag, render_family
from qserver.sealing import lone_node_secret
from qserver.services import SERVICES, NodeServices
from qserver.storage.journal_export import (
    ExportSettings,
    JournalExporter,
    JournalSource,
    exit_with_parent,
    export_in_process,
)
from qserver.storage.lmdb_store import Storage
from qserver.storage.raft_store import RaftStore
from qserver.tracing import node_tracing
from qserver.transport.peer_link import PEER_PATH
from qserver.transport.peers import PeerTransport
from qserver.transport.tls import client_context, server_context
from wire import errors as e
from wire.errors import QueueError
from wire.http_session import signed_session
from wire.version_headers import Side
from wire.versions import peer_too_old

log = logging.getLogger("qserver")
GIL_SWITCH_INTERVAL_S = 0.0002
GC_THRESHOLDS = (50_000, 20, 10)   # young, middle, old (see run; bench/RESULTS.md, issue 11)


class Node:
    def __init__(self, config: NodeConfig, *, on_fatal: Callable[[str, BaseException | None], None] = stop_process) -> None:
        """`on_fatal`: what a broken invariant does (qserver/core/failstop.py: end the process)."""
        self.config = config
        # TLS (qserver/transport/tls.py): what this node serves with, and how it checks the peers it dials.
        self.tls = config.tls_files()
        self.server_tls = server_context(self.tls[0], self.tls[1]) if self.tls else None
        self.client_tls = client_context(self.tls[2]) if self.tls else None
        self.storage = Storage(Path(config.data_dir) / "lmdb", node_id=config.node_id, map_size_bytes=config.map_size_bytes,
                               map_size_max_bytes=config.map_size_max_bytes, disk_reserve_bytes=config.disk_reserve_bytes,
                               journal_enabled=config.journal_enabled, payload_hold_bytes=config.payload_hold_bytes)
        self.membership, self.membership_peers = self._membership()
        # The cluster event feed (qserver/cluster/events.py): told of every map command applied here.
        self.events = EventFeed(config.node_id, membership=self.membership)
        self.engine = build_engine(config, self.storage, membership=self.membership, on_fatal=on_fatal,
                                   events=self.events)
        # The node's own spans (qserver/tracing.py, docs/TRACING.md): None unless an exporter is
        # configured; "otlp" without OpenTelemetry's SDK stops the start here, saying what to install.
        self.tracing = node_tracing(config.tracing_exporter, node_id=config.node_id, path=config.tracing_path,
                                    endpoint=config.tracing_endpoint, service_name=config.tracing_service_name,
                                    data_dir=config.data_dir)
        self.engine.pipeline.tracing = self.tracing
        self.peers = self._peer_transport()
        for transport in (self.peers, self.membership_peers):
            if transport is not None and self.membership is not None:
                transport.admits = self._admits_peer
        self.auth = Authenticator(self.engine.clients, skew_max_s=config.signature_skew_max_s,
                                  enabled=config.auth_enabled)
        secret = b""
        if len(config.cluster_nodes) >= 2:
            secret = (Path(config.data_dir) / "cluster.secret").read_text().strip().encode()
            self.auth.cluster_secret = secret      # nodes call members in a client's name (macro queues)
        else:
            # A node alone still calls itself in a client's name (its console, a definitions
            # import): with a secret of this process, which no other process holds.
            self.auth.cluster_secret = os.urandom(32)
        # What seals secrets the registry keeps (access keys, qserver/sealing.py): the cluster
        # secret, or a node alone's, kept in its data directory so they open after a restart.
        sealing_secret = secret or lone_node_secret(Path(config.data_dir))
        # The features reach the node through its services only (qserver/services.py).
        self.services = NodeServices(self.engine, self.storage, config, cluster_secret=secret,
                                     auth_enabled=self.auth.enabled, sealing_secret=sealing_secret,
                                     pass_on=lambda request, target: pass_on_to(request, self, target))
        self.macros = MacroService(self.services)
        # The SQS endpoint (docs/SQS.md) calls in its callers' names with the secret delegated calls use here.
        self.sqs = sqs_api.SqsGateway(self.services, lambda: self.auth.cluster_secret, lambda: self.auth.audiences)
        self.console: Console | None = None      # the web console, made with the application
        self.channels = ChannelHub(self.services)
        self.surveillance = RecipientWatch(self.services, self.macros)
        self.forward_root = ForwardRoot(self.services)
        self.forwarders = Forwarders(self.services, self.macros)
        self.connections: set[ClientConnection] = set()
        self.bad_frames = 0
        self.completion_waits = CompletionWaits()     # producers that wait (qserver/api/completion_waits.py)
        self._http_session: aiohttp.ClientSession | None = None
        self.url = config.own_url
        self.engine.on_clients_changed = self._clients_changed
        self.journal = self._journal_exporter()
        self._journal_task: asyncio.Task[None] | None = None
        self.loop_lag = LoopLag()
        self._loop_lag_task: asyncio.Task[None] | None = None
        # Issue 37: the FAILED state of the queues mastered here, and GET /v1/node's rates.
        self.queue_health = QueueHealthWatch(self.engine)
        self.engine.health_fields = self.queue_health.fields
        self.rates = NodeRates(self.engine)
        self.started_s = time.time()
        self._health_task: asyncio.Task[None] | None = None
        self._export_pool: ProcessPoolExecutor | None = None
        self._nonces_path = Path(config.data_dir) / "replay-window.json"

    def _journal_exporter(self) -> JournalExporter | None:
        config = self.config
        if not config.journal_enabled:
            return None
        destination = config.journal_export_destination or str(Path(config.data_dir) / "journal-export")
        return JournalExporter(JournalSource.from_storage(self.storage), ExportSettings(
            destination, segment_records_max=config.journal_segment_records_max,
            segment_age_max_ms=int(config.journal_segment_age_s * 1000),
            retention_ms=int(config.journal_retention_s * 1000)))

    async def export_journal(self, *, force: bool) -> dict[str, Any]:
        """Write the sealed segments (all of the journal when forced) as Parquet files, then
        prune exported records every member of their pair has passed (catch-up reads them)."""
        exporter = self.journal
        if exporter is None:
            raise QueueError(e.E_INVALID_OPTION, "this node keeps no journal (journal_enabled = false)")
        now_ms = int(time.time() * 1000)
        segments, safe = await self._in_export_process(exporter, now_ms, force)
        exporter.forget_exported()       # the export process wrote segments: read them again
        pruned = await asyncio.get_running_loop().run_in_executor(self.engine.writer, exporter.prune, safe, now_ms)
        return {**exporter.status(), "segments_written": [segment.path for segment in segments], "pruned": pruned}

    async def _passed_by_every_member(self) -> dict[int, int]:
        floors: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()
        self.engine.invoke(lambda now: floors.set_result(self.engine.pairs.passed_by_every_member()))
        return await floors

    async def _in_export_process(self, exporter: JournalExporter, now_ms: int, force: bool) -> tuple[list[Any], int]:
        """Export and the prune's scan (up to a million records with msgpack each) run in a
        process of their own: in a thread they held the engine's GIL for a third of its time
        and halved the node's throughput while they ran (bench/RESULTS.md)."""
        floors = await self._passed_by_every_member()
        if self._export_pool is None:
            self._export_pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=exit_with_parent, initargs=(os.getpid(),))
        call = functools.partial(export_in_process, str(self.storage.path), exporter.settings, now_ms, force, floors)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._export_pool, call)
        except BrokenProcessPool:
            self._export_pool = None          # it died (killed?): a new one next time
            raise

    async def _prune_journal(self, exporter: JournalExporter, now_ms: int) -> int:
        """Each step of the prune is its own job of the writer: group commits go between them
        instead of waiting for a prune of a million records to end."""
        _, safe = await self._in_export_process(exporter, now_ms, False)
        loop, deleted = asyncio.get_running_loop(), 0
        while True:
            count, done = await loop.run_in_executor(self.engine.writer, exporter.prune_step, safe, now_ms)
            deleted += count
            if done:
                return deleted

    async def _export_journal_when_due(self) -> None:
        if self.journal is None:
            return                                   # the journal is off: nothing to export
        while True:
            await asyncio.sleep(self.config.journal_export_check_interval_s)
            try:
                now_ms = int(time.time() * 1000)
                if self.journal.due(now_ms):
                    await self.export_journal(force=False)
                elif self.journal.prunable(now_ms):
                    # Everything is exported, and records have passed the retention since: a
                    # node whose traffic stopped still gives their pages back.
                    await self._prune_journal(self.journal, now_ms)
            except Exception:    # a full or unreachable destination: try again later, keep serving
                log.exception("journal export failed")

    def _membership(self) -> tuple[RaftMembership | None, PeerTransport | None]:
        """The membership layer (docs/RAFT.md, "The node's side"): the Raft core on this node's loop, with a peer
        transport of its own on the [cluster.membership] addresses. A node not listed there
        follows the map as a learner: it dials the voters and does not listen."""
        config = self.config
        if len(config.cluster_nodes) < 2:
            return None, None
        secret = (Path(config.data_dir) / "cluster.secret").read_text().strip().encode()
        addresses = config.membership_nodes
        scheme = "https" if self.tls is not None else "http"
        peers = {node: f"{scheme}://{addresses[node]}" if node in addresses else "" for node in config.cluster_nodes}
        membership: RaftMembership | None = None

        def on_frame(peer: str, data: bytes) -> None:
            if membership is not None:
                membership.on_frame(peer, data)
        transport = PeerTransport(config.node_id, secret, peers, on_message=on_frame,
                                  listening=config.node_id in addresses, ssl_context=self.client_tls,
                                  purpose="membership")
        membership = RaftMembership(
            config.node_id, self.storage.storage_id, RaftStore(self.storage), voters=set(addresses),
            send=transport.send, writer=lambda: self.engine.writer, loop=asyncio.get_running_loop(),
            limits=raft_limits(config.election_timeout_ms, config.raft_heartbeat_ms),
            tick_s=tick_ms(config.raft_heartbeat_ms) / 1000, grow_storage=lambda: self.engine.grow_storage(),
            compact_every_entries=config.membership_compact_every, pending_bytes=transport.pending_bytes)
        return membership, transport

    def _admits_peer(self, side: Side) -> str | None:
        """Once the cluster's feature level is raised, a node of an older release may not link
        (on either purpose): it would skip the map commands it cannot read (docs/OPERATIONS.md,
        "The cluster feature level")."""
        assert self.membership is not None
        return peer_too_old(self.membership.cluster_map.feature_level, side.release)

    def membership_application(self) -> web.Application | None:
        """What the membership port serves: the membership transport's links only."""
        if self.membership_peers is None or self.config.node_id not in self.config.membership_nodes:
            return None
        app = web.Application()
        app.router.add_get(PEER_PATH, self.membership_peers.handle)
        return app

    def _peer_transport(self) -> PeerTransport | None:
        """One WebSocket per peer node, authenticated with the cluster secret (docs/PROTOCOL.md, "Peer links")."""
        nodes = self.config.cluster_nodes
        if len(nodes) < 2:
            return None
        secret = (Path(self.config.data_dir) / "cluster.secret").read_text().strip().encode()
        engine = self.engine
        transport = PeerTransport(
            self.config.node_id, secret, {node: url for node, url in nodes.items() if node != self.config.node_id},
            on_message=lambda peer, data: engine.submit(c.PeerMessage(peer, data)),
            on_link_change=lambda peer, up: engine.submit(
                c.LinkChange(peer, up, going_away=not up and transport.went_away(peer))),
            send_queue_bytes_max=self.config.peer_send_queue_bytes_max, ssl_context=self.client_tls)
        engine.pairs.send = transport.send
        engine.pairs.link_up = transport.is_up
        return transport

    async def start(self) -> None:
        if self.membership is not None:
            self.membership.start()
        # Before anything is applied: the map commands of the log replayed now are not news.
        self.events.start()
        await self.engine.start()
        if self.journal is not None:
            self._journal_task = asyncio.get_running_loop().create_task(self._export_journal_when_due())
        self._loop_lag_task = asyncio.get_running_loop().create_task(self.loop_lag.run())
        self._health_task = asyncio.get_running_loop().create_task(self.queue_health.run(self.rates.sample))
        COLLECTOR_PAUSES.install()
        if self.membership is not None:
            self.surveillance.start()
            self.forwarders.start()
        self.auth._clients = self.engine.clients   # the engine rebuilt its registry on load
        if not self.auth.load_nonces(self._nonces_path):
            self.auth.not_before_ms = int(time.time() * 1000)   # after a crash: see qserver/api/auth.py
        if self.peers is not None:
            await self.peers.start()
        if self.membership_peers is not None:
            await self.membership_peers.start()

    async def stop(self) -> None:
        for task in (self._journal_task, self._loop_lag_task, self._health_task):
            if task is not None:
                task.cancel()
        await self.events.stop()
        COLLECTOR_PAUSES.uninstall()
        if self._export_pool is not None:
            self._export_pool.shutdown(wait=False, cancel_futures=True)
        # All at once and bounded: a client that does not answer the close handshake at once
        # (aiohttp waits up to 10 s for it) must not hold the stop, nor the other clients.
        closing = [asyncio.ensure_future(connection.close_with(QueueError(e.E_SHUTTING_DOWN, "the node is stopping")))
                   for connection in list(self.connections)]
        if closing:
            await asyncio.wait(closing, timeout=CONNECTIONS_CLOSE_S)
        await self.macros.close()
        await self.sqs.close()
        if self.console is not None:
            await self.console.close()
        await self.channels.stop()
        await self.surveillance.stop()
        await self.forwarders.stop()
        await self.forward_root.stop()
        if self.peers is not None:
            await self.peers.stop()
        if self.membership_peers is not None:
            await self.membership_peers.stop()
        if self._http_session is not None:
            await self._http_session.close()
        try:
            self.auth.save_nonces(self._nonces_path)    # the HTTP site stopped: no more requests
        except OSError:
            log.exception("could not save the replay window: the next start refuses older requests")
        await self.engine.stop()
        if self.tracing is not None:
            self.tracing.exporter.close()       # what the exporter still holds is written
        if self.membership is not None:
            self.membership.stop()
        self.storage.close()

    async def hand_off_masters(self) -> None:
        """An orderly stop hands off every master on this node first (docs/PROTOCOL.md, "Moves, drains and rebalancing"), within
        `shutdown_handoff_timeout_s`; queues whose replica is not in sync stay (they fail over)."""
        coordinator = self.engine.coordinator
        if coordinator is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_handoff_timeout_s
        for _ in range(3):
            started: asyncio.Future[int] = loop.create_future()

            def start_all(now_ms: int, started: asyncio.Future[int] = started) -> None:
                started.set_result(coordinator.hand_off_all())
            self.engine.invoke(start_all)
            if await started == 0:
                return
            while coordinator.handoffs and loop.time() < deadline:
                await asyncio.sleep(0.02)
            if loop.time() >= deadline:
                log.warning("stopping with %d master(s) not handed off", len(self.engine.pairs.masters))
                return

    def http_session(self) -> aiohttp.ClientSession:
        """For requests this node passes on to a queue's master."""
        if self._http_session is None:
            connector = aiohttp.TCPConnector(ssl=self.client_tls) if self.client_tls is not None else None
            self._http_session = signed_session(connector)
        return self._http_session

    def _clients_changed(self) -> None:
        """Close the sockets of removed clients and of clients that lost a grant."""
        self.auth._clients = self.engine.clients
        for connection in list(self.connections):
            if connection.principal.client_id == CLUSTER_CLIENT:
                continue                     # a node acting for the cluster: no registered client
            record = self.engine.clients.get(connection.principal.client_id)
            if record is None:
                error = QueueError(e.E_UNAUTHENTICATED, "the client was removed")
            elif any(grant not in record["grants"] for grant in connection.principal.grants):
                error = QueueError(e.E_FORBIDDEN, "a grant of this client was revoked")
            else:
                continue
            connection.close_soon(error)      # a task the connection holds until done

    def client_counts(self, queue: str) -> dict[str, int]:
        producers = sum(1 for conn in self.connections if queue in conn.queues_produced)
        consumers = sum(1 for conn in self.connections if queue in conn.queues_consumed)
        return {"producer_clients": producers, "consumer_clients": consumers,
                "remote_clients": len({conn.principal.client_id for conn in self.connections
                                       if queue in conn.queues_produced or queue in conn.queues_consumed})}

    def render_metrics(self) -> str:
        engine = self.engine
        per_queue: dict[str, list[tuple[dict[str, str], float]]] = {
            "depth": [], "in_flight": [], "delayed": [], "enqueued": [], "acked": [], "dead_lettered": [], "purged": [],
            "expired": [], "redelivered": [], "overflows": [], "oldest": [], "consumers": []}
        roles = self._queue_roles()
        oldest = engine.registry.oldest_ages_s(list(engine.cores.values()))
        for name, core in sorted(engine.cores.items()):
            # Every per-queue series says which member this node is (docs/OPERATIONS.md,
            # "Monitoring"): sum(...{role="master"}) counts each queue once.
            labels = {"queue": name, "role": roles[name]}
            record = core.record
            per_queue["oldest"].append((labels, oldest[name]))
            per_queue["consumers"].append((labels, engine.registry.consumers(name)))
            per_queue["depth"].append((labels, core.depth))
            per_queue["in_flight"].append((labels, core.in_flight))
            per_queue["delayed"].append((labels, record.delayed_count))
            per_queue["enqueued"].append((labels, record.total_enqueued))
            per_queue["acked"].append((labels, record.total_acked))
            per_queue["dead_lettered"].append((labels, record.total_dead_lettered))
            per_queue["purged"].append((labels, record.total_purged))
            per_queue["expired"].append((labels, record.total_expired))
            per_queue["redelivered"].append((labels, record.total_redelivered))
            per_queue["overflows"].append((labels, core.overflows))
        lines: list[str] = []
        lines += render_family("qserver_queue_depth", "gauge", "messages held (ready and in flight)", per_queue["depth"])
        lines += render_family("qserver_queue_in_flight", "gauge", "messages leased to consumers", per_queue["in_flight"])
        lines += render_family("qserver_queue_delayed", "gauge", "messages waiting for their delivery delay",
                               per_queue["delayed"])
        for name in ("enqueued", "acked", "dead_lettered", "purged", "expired", "redelivered"):
            lines += render_family(f"qserver_queue_{name}_total", "counter", f"messages {name.replace('_', ' ')}",
                                   per_queue[name])
        lines += render_family("qserver_queue_overflows_total", "counter",
                               "enqueues refused at max_depth (E_QUEUE_FULL), decided here since the node started",
                               per_queue["overflows"])
        lines += render_family("qserver_queue_oldest_message_age_seconds", "gauge",
                               "seconds since the oldest message still held here (ready, leased or delayed) was "
                               "enqueued, 0 when none (a dead-letter queue's: since it was dead-lettered)",
                               per_queue["oldest"])
        lines += render_family("qserver_queue_consumers", "gauge",
                               "push subscriptions open on the queue at this node (WebSocket subscribe, recipients "
                               "included; waiting receives and channel subscribers not)", per_queue["consumers"])
        lines += render_family("qserver_queue_views", "gauge", "virtual queues (views) defined on the queue "
                               "(their depths: GET /v1/queues/{q}, counted within a bound)",
                               [({"queue": name, "role": roles[name]}, len(core.options.views))
                                for name, core in sorted(engine.cores.items()) if core.options.views])
        lines += self.queue_health.render_metrics()
        lines += engine.commit_seconds.render()
        lines += self.loop_lag.render()
        lines += COLLECTOR_PAUSES.render()
        lines += engine.batch_operations.render()
        lines += render_family("qserver_inbox_commands", "gauge", "commands waiting for the engine",
                               [({}, engine.pending_commands())])
        lines += render_family("qserver_websocket_connections", "gauge", "open client WebSockets",
                               [({}, len(self.connections))])
        lines += render_family("qserver_rejected_total", "counter", "requests refused for bad input or auth",
                               [({"code": code}, count) for code, count in sorted(self.auth.failures.items())]
                               + [({"code": "E_BAD_FRAME"}, self.bad_frames)]
                               + [({"code": "E_OVERLOADED"}, engine.rejected["overloaded"])])
        lines += render_family("qserver_storage_map_bytes", "gauge", "LMDB map size", [({}, self.storage.map_size())])
        lines += render_family("qserver_housekeeping_behind", "gauge",
                               "1 while pruning passes run every 50 ms to catch up with expired dedupe ids, statuses or deleted queues",
                               [({}, int(self.storage.housekeeping_behind))])
        lines += self._storage_space_metrics()
        lines += self.macros.render_metrics()
        lines += self.sqs.render_metrics()
        lines += self.channels.render_metrics()
        lines += self.surveillance.render_metrics()
        lines += self.forward_root.render_metrics()
        lines += self.forwarders.render_metrics()
        for name, kind, help_text, value in self.completion_waits.render():
            lines += render_family(name, kind, help_text, [({}, value)])
        lines += self._replication_metrics()
        lines += self.events.render_metrics()
        if self.console is not None:
            lines += self.console.render_metrics()
        if self.membership is not None:
            lines += self.membership.render_metrics()
        coordinator = engine.coordinator
        if coordinator is not None:
            # A node without its lease acknowledges nothing and its masters fail over
            # (docs/ARCHITECTURE.md, "Membership"); loop lag near lease_ms is the usual cause.
            lines += render_family("qserver_node_lease_valid", "gauge",
                                   "1 while this node holds its lease from the membership leader",
                                   [({}, 1.0 if coordinator.lease_valid() else 0.0)])
            lines += render_family("qserver_node_lease_lapses_total", "counter",
                                   "times this node's lease ran out and was granted again",
                                   [({}, coordinator.lease_lapses)])
            lines += render_family("qserver_failovers_proposed_total", "counter",
                                   "failovers this node proposed while it led the membership layer",
                                   [({}, coordinator.failovers)])
        return "\n".join(lines) + "\n"

    def _storage_space_metrics(self) -> list[str]:
        engine = self.engine
        space = engine.space
        lines = render_family("qserver_storage_full", "gauge",
                              "1 while new messages are refused for lack of room (E_STORAGE_FULL) and replicas here "
                              "follow no more", [({}, 1.0 if engine.storage_full is not None else 0.0)])
        if space is not None:
            lines += render_family("qserver_storage_free_bytes", "gauge",
                                   "room left: on the disk (with pages free in the LMDB file) and in the map's limit",
                                   [({"where": "disk"}, space.disk_free_bytes), ({"where": "map"}, space.map_free_bytes)])
            lines += render_family("qserver_storage_used_bytes", "gauge", "the LMDB pages the node's databases use",
                                   [({}, space.used_bytes)])
        return lines + render_family("qserver_commits_abandoned_total", "counter",
                                     "batches that could not be stored (their commands failed, their queues were "
                                     "rebuilt from storage)", [({}, engine.batches_abandoned)])

    def _queue_roles(self) -> dict[str, str]:
        """Each queue instance's role here: "master", "replica", or "none" for an instance the
        map gives this node no role for yet (or any more). A node outside a cluster masters all."""
        pairs = self.engine.pairs
        if not pairs.clustered:
            return {name: "master" for name in self.engine.cores}
        return {name: "master" if name in pairs.masters else "replica" if name in pairs.replicas else "none"
                for name in self.engine.cores}

    def _replication_metrics(self) -> list[str]:
        pairs = self.engine.pairs
        master = {"role": "master"}
        # The master's view (what it sent that the replica does not hold durably), and the
        # replica's own (what its master reported committed that it does not hold durably: it
        # grows while the replica is out of sync or catching up, and is still there to read
        # when its master is gone).
        lag = [({"queue": name, **master}, role.last_order - role.replica_durable)
               for name, role in sorted(pairs.masters.items())]
        lag += [({"queue": name, "role": "replica"}, max(0, role.master_commit_order - role.durable_order))
                for name, role in sorted(pairs.replicas.items())]
        in_sync = [({"queue": name, **master}, 1.0 if role.recorded_in_sync else 0.0)
                   for name, role in sorted(pairs.masters.items())]
        lines = render_family("qserver_replica_lag_operations", "gauge",
                              "replicated operations the replica does not hold durably yet (role=master: sent by "
                              "the master; role=replica: committed by the master, as the replica heard)", lag)
        lines += render_family("qserver_replica_in_sync", "gauge",
                               "1 while the replica is recorded in sync (exported by the master)", in_sync)
        lines += render_family("qserver_oplog_start_order", "gauge",
                               "the op log's first order: records below it were truncated",
                               [({"queue": name, **master}, role.log_start) for name, role in sorted(pairs.masters.items())])
        lines += render_family("qserver_oplog_truncated_records_total", "counter",
                               "op-log records deleted below what every member holds",
                               [({}, self.storage.truncated_records)])
        lines += render_family("qserver_oplog_kept_bytes", "gauge",
                               "op-log records below the floors kept because they hold live messages' payloads",
                               [({}, self.storage.kept_bytes)])
        lines += render_family("qserver_payloads_moved_total", "counter",
                               "payloads moved from a kept op-log record into their message rows (a backlog)",
                               [({}, self.storage.moved_payloads)])
        lines += render_family("qserver_replication_role_starts_total", "counter",
                               "replication roles taken up (a new role object: creation, restart, change of "
                               "role, or rebuilt after a batch could not be stored)",
                               [({"role": role}, pairs.role_starts[role]) for role in ("master", "replica")])
        lines += render_family("qserver_replica_opens_total", "counter",
                               "Opens this node's replicas sent to their masters (each starts a catch-up)",
                               [({}, pairs.opens_sent)])
        lines += render_family("qserver_snapshots_total", "counter", "state transfers by snapshot, by side",
                               [({"side": "sent"}, sum(r.snapshots_sent for r in pairs.masters.values())),
                                ({"side": "installed"}, pairs.snapshots_installed),
                                ({"side": "resumed"}, pairs.snapshots_resumed)])
        lines += render_family("qserver_snapshot_views_open", "gauge",
                               "snapshots being sent, each holding a read transaction (at most SNAPSHOT_VIEWS_MAX)",
                               [({}, self.storage.snapshot_views_open)])
        lines += render_family("qserver_snapshot_views_deferred_total", "counter",
                               "snapshots not started because SNAPSHOT_VIEWS_MAX were open (the replica opens again)",
                               [({}, self.storage.snapshot_views_deferred)])
        if self.peers is not None:
            peers = sorted(self.config.cluster_nodes.keys() - {self.config.node_id})
            lines += render_family("qserver_peer_link_up", "gauge", "1 while the link to a peer is up",
                                   [({"peer": p}, 1.0 if self.peers.is_up(p) else 0.0) for p in peers])
            lines += render_family("qserver_peer_pending_bytes", "gauge", "bytes queued for a peer, not yet sent",
                                   [({"peer": p}, self.peers.pending_bytes(p)) for p in peers])
            lines += render_family("qserver_peer_frames_total", "counter", "peer frames by direction",
                                   [({"direction": "sent"}, self.peers.frames_sent),
                                    ({"direction": "received"}, self.peers.frames_received)])
            # Frames that failed their MAC or shape (each closed its link), and dialed peers that
            # failed the challenge, per link purpose (docs/PROTOCOL.md, "Peer links").
            transports = [("replication", self.peers)] + (
                [("membership", self.membership_peers)] if self.membership_peers is not None else [])
            lines += render_family("qserver_peer_bad_frames_total", "counter", "peer frames refused (bad MAC or shape)",
                                   [({"purpose": purpose}, t.bad_frames) for purpose, t in transports])
            lines += render_family("qserver_peer_responders_refused_total", "counter",
                                   "dialed peers that failed the challenge (no link, nothing sent)",
                                   [({"purpose": purpose}, t.responders_refused) for purpose, t in transports])
            # Per link that is up: the negotiated protocol version, labelled with the peer's
            # release ("unknown": it named none, 0.1.0 or older; docs/PROTOCOL.md, "Versions and negotiation").
            lines += render_family("qserver_peer_link_version", "gauge", "the protocol version negotiated with a peer",
                                   [({"purpose": purpose, "peer": peer, "release": state["release"] or "unknown"},
                                     state["version"])
                                    for purpose, t in transports if hasattr(t, "link_versions")
                                    for peer, state in t.link_versions().items() if state["up"]])
        return lines

    def application(self) -> web.Application:
        app = web.Application(middlewares=[errors_and_auth], client_max_size=self.config.body_bytes_max + 4096)
        app[NODE] = self
        app[SERVICES] = self.services
        app[REDRIVE] = redrive
        add_routes(app)
        macro_api.add_routes(app)
        channel_api.add_routes(app, self.channels)
        recipient_api.add_routes(app)
        forward_api.add_routes(app, self.forwarders)
        sqs_api.add_routes(app, self.sqs)
        app.router.add_get("/v1/ws", websocket)
        self.console = install_console(app, self)
        if self.peers is not None:
            app.router.add_get(PEER_PATH, self.peers.handle)
        return app


CONNECTIONS_CLOSE_S = 0.5    # how long a stopping node waits for its clients' close handshakes
SHUTDOWN_GRACE_S = 1.0       # what requests still in progress get once a stopping node's engine stopped


async def serve(config: NodeConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run a node until SIGTERM or SIGINT, then stop in order (answers first, then storage)."""
    node = Node(config)
    await node.start()
    # shutdown_timeout: by the time the runner cleans up, the masters are handed off and the engine
    # has stopped, so a request still in progress can only wait for nothing; aiohttp's 60 s default
    # kept a stopping node's clients (long polls, WebSockets closing) stalled for 15 s of a roll.
    runner = EnvelopeAppRunner(node.application(), access_log=None, handle_signals=False,
                               shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True, backlog=1024,
                       ssl_context=node.server_tls)
    await site.start()
    membership_app = node.membership_application()
    membership_runner = None
    if membership_app is not None:
        # Where this node's membership link listens: membership_bind, else its own entry of
        # [cluster.membership] (peers may dial a proxy in front of it).
        host, port = (config.membership_bind or config.membership_nodes[config.node_id]).rsplit(":", 1)
        # The envelope runner here too: a dialer that hung up before its upgrade was answered (a
        # node paused or restarting) is one INFO line, not a traceback (qserver/http_errors.py).
        membership_runner = EnvelopeAppRunner(membership_app, access_log=None, handle_signals=False,
                                              shutdown_timeout=SHUTDOWN_GRACE_S)
        await membership_runner.setup()
        await web.TCPSite(membership_runner, host, int(port), reuse_address=True, ssl_context=node.server_tls).start()
    log.info("node %s serving on %s (data in %s)", config.node_id, node.url, config.data_dir)
    print(f"qserver {config.node_id} ready on {node.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(loop_exception_handler)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("node %s stopping", config.node_id)
    await node.hand_off_masters()
    await site.stop()
    await node.stop()
    await runner.cleanup()
    if membership_runner is not None:
        await membership_runner.cleanup()


class DataDirInUse(Exception):
    """Another process serves this node's data directory."""


def lock_data_dir(data_dir: Path) -> IO[str]:
    """An exclusive lock on the node's data directory, held as long as the returned file is
    open (the process's life; the kernel drops it however the process ends). Two processes
    on one node's data (a second `qserver run`, a supervisor's start while the old process
    still stops) would both vote and append as that node in the membership layer, whose
    safety rests on one: a bench run that leaked such processes broke Raft's log matching
    (a follower found a committed entry of another term) and kept elections going for minutes."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / "qserver.lock", "a+")    # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise DataDirInUse(f"the data directory {data_dir} is in use by another qserver process (pid {holder}); "
                           "stop that one first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def check_plaintext(config: NodeConfig) -> None:
    """A node listening beyond loopback without TLS refuses to start unless the operator says
    `allow_plaintext = true` (docs/PROTOCOL.md, "Peer links"): signed requests can be replayed and
    everything read on the path. Loopback-only nodes (tests, the demo) start as they are."""
    exposed = config.plaintext_exposure()
    if not exposed:
        return
    where = ", ".join(sorted(set(exposed)))
    if not config.allow_plaintext:
        raise SystemExit(
            f"qserver: refusing to start: node {config.node_id} would listen on {where} (beyond loopback) in "
            "plaintext, with no TLS configured. Configure TLS (tls_cert_file, tls_key_file and tls_ca_file, "
            "or `qserver init --tls`), listen on loopback only, or set `allow_plaintext = true` in the "
            "node's [node] configuration to accept plaintext on the network.")
    log.warning("allow_plaintext = true: node %s listens on %s in plaintext, with no TLS; anyone on the path "
                "reads every request and message", config.node_id, where)


def run(config: NodeConfig) -> None:
    check_plaintext(config)
    lock = lock_data_dir(Path(config.data_dir))    # noqa: F841 (held until the process ends)
    # The LMDB writer thread needs the GIL back promptly when its fsync returns; the default
    # 5 ms switch interval would make every group commit wait on the event loop's Python.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Python's cyclic collector at its defaults ran a young collection every 700 allocations
    # and a full one whenever the survivors grew by a quarter: a node allocates a few
    # containers per message, nearly all freed by reference counting, and rows waiting for a
    # commit survived into the old generation again and again (full collections took 1.6 s of
    # a 12 s state transfer on the replica). What start-up built is never garbage: frozen,
    # no collection scans it again. A young collection of 50,000 objects takes ~1 ms.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop
        runner: Any = uvloop.run
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.run
    runner(serve(config))
