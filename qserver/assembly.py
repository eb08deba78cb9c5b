"""Assembling a node's engine with its cluster side: the one place that makes the pair driver
and the coordinator and connects them to the core (docs/ARCHITECTURE.md).

The core (qserver/core/) never imports qserver/cluster/: the pair driver and the coordinator
reach the core through qserver/core/ports.py (the pipeline is their `Staging`, the registry
their `Instances`, the engine their `Scheduler` and `PairEvents`), and the core reaches them
through qserver/core/replication_port.py. `build_engine` is what a node (qserver/node.py) and
the engine simulation (tests/sim/engine_cluster.py) call instead of `Engine(...)`.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from qserver.cluster.coordinator import Coordinator
from qserver.cluster.events import EventFeed
from qserver.cluster.membership import Membership, OnApplied
from qserver.cluster.pairs import PairDriver
from qserver.cluster.relay import RelayReplier, answer_from_master, command_from_relay, relayed_request
from qserver.cluster.view import ClusterView
from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.engine import Engine, wall_ms
from qserver.storage.lmdb_store import Storage
from replication.cluster_map import Outcome
from replication.master import MasterRole, ReplicationLimits
from replication.messages import RelayRequest
from wire.errors import E_BAD_REQUEST, QueueError


def build_engine(config: NodeConfig, storage: Storage, *, rng: random.Random | None = None,
                 clock_ms: Callable[[], int] = wall_ms, writer: Executor | None = None,
                 membership: Membership | None = None, monotonic_ms: Callable[[], int] | None = None,
                 on_fatal: Callable[[str, BaseException | None], None] | None = None,
                 events: EventFeed | None = None) -> Engine[PairDriver, Coordinator]:
    """An engine with its pair driver (every node has one; outside a cluster, `membership`
    None, it holds no role) and, in a cluster, its coordinator; the arguments are Engine's.
    `events`: the node's event feed, told of every map command after the engine is."""
    engine: Engine[PairDriver, Coordinator] = Engine(config, storage, rng=rng, clock_ms=clock_ms, writer=writer, monotonic_ms=monotonic_ms,
                    on_fatal=on_fatal)
    pairs = PairDriver(ClusterView(config.node_id, config.cluster_nodes, membership), replication_limits(config),
                       config=config, storage=storage, staging=engine.pipeline, instances=engine.registry,
                       scheduler=engine, events=engine)
    coordinator: Coordinator | None = None
    if membership is not None:
        coordinator = pairs.coordinator = Coordinator(pairs, membership, config=config, storage_id=storage.storage_id,
                                                      scheduler=engine, instances=engine.registry)
        membership.on_applied = lambda command, outcomes: engine.invoke(
            lambda now_ms: pairs.map_applied(command, outcomes))
        if events is not None:
            membership.on_applied = chained(membership.on_applied, events.on_applied)
    engine.connect(pairs, coordinator, PairRelay(pairs))
    return engine


def chained(first: OnApplied, then: OnApplied) -> OnApplied:
    """`first` exactly as before, then `then` (the event feed: it only reads, and a failure of
    it must never stop the membership layer applying the map)."""
    def both(command: Any, outcomes: list[Outcome]) -> None:
        first(command, outcomes)
        try:
            then(command, outcomes)
        except Exception:
            logging.getLogger("qserver.cluster.events").exception("the event feed failed on %r", command)
    return both


def replication_limits(config: NodeConfig) -> ReplicationLimits:
    return ReplicationLimits(replica_lag_max=config.replica_lag_max, replica_lag_max_ms=config.replica_lag_max_ms,
                             log_retain_max_bytes=config.log_retain_max_bytes,
                             snapshot_chunk_bytes_max=config.snapshot_chunk_bytes_max,
                             snapshot_chunks_in_flight_max=config.snapshot_chunks_in_flight_max,
                             sync_view_max_ms=int(config.sync_view_max_s * 1000))


class PairRelay:
    """The core's `Relay` (qserver/core/replication_port.py) over the pair driver and the
    request translations of qserver/cluster/relay.py."""

    def __init__(self, pairs: PairDriver) -> None:
        self.pairs = pairs

    def relay(self, queue: str, command: c.Command) -> None:
        self.pairs.relay(queue, relayed_request(command), answer_from_master(command))

    def run_relayed(self, role: MasterRole, request: RelayRequest, step: Callable[[c.Command], None]) -> None:
        replier: Any = RelayReplier(self.pairs, role, request)
        try:
            step(command_from_relay(request, replier))
        except (QueueError, ValueError, TypeError) as error:
            replier.fail(0, error if isinstance(error, QueueError) else QueueError(E_BAD_REQUEST, str(error)))
