"""The one door through which the features (qserver/features/) reach the node (docs/ARCHITECTURE.md).

Channels, macro queues, recipient surveillance, store-and-forward and redrive are built on the
node's ordinary machinery: engine commands, the queue cores this node masters, the replicated
cluster map, the subscriptions of its connections and a few storage reads. `NodeServices`
offers exactly those, named for what they mean, and is the only module that knows where each
lives today (the engine, its pairs, its coordinator, the storage). The features are typed
against it, so mypy sees every use, and the core and cluster rooms may change their insides
without a feature noticing: this module is the one place to follow them.

What a feature needs of another feature (the channel hub, the forwarders, the macro service's
clients) is handed to it at construction by qserver/node.py, not reached through here.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from qserver.core import commands as c
from qserver.core.ports import Redirect
from qserver.sealing import SealingError, is_access_key_id, open_access_key
from wire import errors as e
from wire import versions
from wire.errors import QueueError

if TYPE_CHECKING:
    from qserver.config import NodeConfig
    from qserver.core.engine import Engine
    from qserver.core.listeners import Subscription as Subscription
    from qserver.storage.lmdb_store import Storage
    from replication.cluster_map import ClusterMap, Command, Outcome, QueueEntry
    from replication.queue_core import QueueCore

__all__ = ["SERVICES", "NodeServices", "PassOn", "Redirect"]

# Pass an HTTP request on to another node (qserver/api/http_common.py, pass_on_to): its answer.
PassOn = Callable[[web.Request, str], Awaitable[web.Response]]
# finish(result) or finish(QueueError), on the engine's task (qserver/cluster/coordinator.py).
Finish = Callable[[Any], None]
ACCESS_KEYS_CACHED_MAX = 1_024   # opened access key secrets kept (access_key): a request then costs no AES
log = logging.getLogger("qserver.services")


class NodeServices:
    """What the features may do with the node. Constructed by qserver/node.py."""

    def __init__(self, engine: Engine, storage: Storage, config: NodeConfig, *, cluster_secret: bytes,
                 auth_enabled: bool, pass_on: PassOn, sealing_secret: bytes = b"") -> None:
        self._engine = engine
        self._storage = storage
        self.config = config
        self.node_id = config.node_id
        self.url = config.own_url
        # The secret every member of the cluster holds ("" outside a cluster): it signs the
        # node's calls in a client's name and seals forwards' credentials (docs/SECURITY.md).
        self.cluster_secret = cluster_secret
        self.auth_enabled = auth_enabled
        self._pass_on = pass_on
        # What seals the secrets the map keeps (qserver/sealing.py): the cluster secret in a
        # cluster, a lone node's own (qserver/sealing.py lone_node_secret, given by node.py) otherwise.
        self.sealing_secret: bytes = cluster_secret or sealing_secret
        # key id -> (client id, sealed text, secret): valid while the record still holds that text.
        self._access_keys: OrderedDict[str, tuple[str, str, bytes]] = OrderedDict()
        self._unopened: set[tuple[str, str]] = set()     # (key id, sealed text) warned about once

    # --- engine commands ----------------------------------------------------------------------
    def submit(self, command: c.Command) -> None:
        """Hand a command to the engine; its replier is answered once it is decided (and,
        for a write, committed)."""
        self._engine.submit(command)

    async def call(self, command_factory: Callable[[c.FutureReplier], c.Command]) -> Any:
        """Submit one command and wait for its answer (raises its QueueError)."""
        return await self._engine.call(command_factory)

    def invoke(self, action: Callable[[int], None]) -> None:
        """Run action(now_ms) on the engine's task."""
        self._engine.invoke(action)

    def random_bits(self, bits: int) -> int:
        return self._engine.random_bits(bits)

    # --- the queues held here ------------------------------------------------------------------
    def held_core(self, queue: str) -> QueueCore | None:
        """The core of a queue this node holds a member of (master or replica)."""
        return self._engine.cores.get(queue)

    def is_master(self, queue: str) -> bool:
        """This node masters the queue (its replication role here is the master's)."""
        return queue in self._engine.pairs.masters

    def master_core(self, queue: str) -> QueueCore | None:
        """The core of a queue this node masters, None when it does not."""
        core = self._engine.cores.get(queue)
        return core if core is not None and queue in self._engine.pairs.masters else None

    # --- the cluster map ------------------------------------------------------------------------
    @property
    def clustered(self) -> bool:
        """This node is a member of a cluster (it follows a replicated map)."""
        return self._engine.coordinator is not None

    @property
    def cluster_map(self) -> ClusterMap | None:
        """This node's copy of the replicated map (read only), None outside a cluster."""
        coordinator = self._engine.coordinator
        return None if coordinator is None else coordinator.membership.cluster_map

    def require_cluster_map(self) -> ClusterMap:
        """The map, or E_INVALID_OPTION for a request only a cluster answers."""
        cluster = self.cluster_map
        if cluster is None:
            raise QueueError(e.E_INVALID_OPTION, "this node is not part of a cluster")
        return cluster

    @property
    def feature_level(self) -> int:
        """The cluster feature level as this node's map has it (wire/versions.py); outside a
        cluster, this release's highest (no other node to keep compatible with)."""
        cluster = self.cluster_map
        return versions.FEATURE_LEVEL if cluster is None else cluster.feature_level

    def require_feature(self, feature: str) -> None:
        """E_FEATURE_DISABLED unless the cluster's feature level reaches `feature`'s
        (wire/versions.py FEATURES): call it before proposing what needs that level."""
        versions.require_feature(self.feature_level, feature)

    def entry(self, queue: str) -> QueueEntry | None:
        """The queue's pair as this node's map has it (a dead-letter queue's is its queue's)."""
        return self._engine.pairs.view.entry(queue)

    def propose(self, command: Command, finish: Finish, result: Callable[[list[Outcome]], Any]) -> None:
        """Propose a map command (from any task): finish(result(outcomes)) on the engine's task
        once applied, or finish(QueueError) when refused or unanswered. Only in a cluster."""
        engine = self._engine

        def on_engine_task(now_ms: int) -> None:
            coordinator = engine.coordinator
            assert coordinator is not None, "map commands are proposed only in a cluster"
            coordinator.propose_checked(command, finish, result)
        engine.invoke(on_engine_task)

    async def pass_on(self, request: web.Request, node: str) -> web.Response:
        """Pass an HTTP request on to node `node` (its master, say), once: its answer."""
        return await self._pass_on(request, node)

    # --- subscriptions of this node's connections -------------------------------------------------
    def recipient_subscriptions(self, queue: str, recipient: str) -> list[Subscription]:
        return self._engine.recipient_subscriptions(queue, recipient)

    def recipients_here(self) -> dict[tuple[str, str], list[Subscription]]:
        """(queue, recipient) -> its subscriptions on this node."""
        return self._engine.recipients_here()

    def end_subscription(self, subscription: Subscription, error: QueueError) -> None:
        """Stop pushing to a subscription: its client is told `error`."""
        self._engine.end_subscription(subscription, error)

    def serve_soon(self, queue: str) -> None:
        """The engine looks at the queue's waiting receives and subscriptions again (one of them
        may take messages now)."""
        engine = self._engine
        engine.invoke(lambda now_ms: engine.serve_soon(queue))

    def journal_event(self, core: QueueCore, op: str, subject: str, detail: str) -> None:
        """A journal record of an event about the queue that is no operation on it
        (docs/AUDIT.md), written with the engine's next commit."""
        engine = self._engine
        engine.invoke(lambda now_ms: engine.journal_event(core, op, subject, detail))

    def client_record(self, client_id: str) -> dict[str, Any] | None:
        """The registry's record of a client (its key and grants), None when unknown."""
        return self._engine.clients.get(client_id)

    def access_key(self, key_id: str) -> tuple[str, bytes] | None:
        """(owning client id, secret access key as ASCII bytes) of an access key
        (docs/PROTOCOL.md "Access keys"), from the client records the map holds; None when no
        such key, the key is revoked or its client removed. A revocation is seen at once: the
        cached secret counts only while the client's record holds the same sealed text."""
        if not is_access_key_id(key_id):
            return None
        clients = self._engine.clients
        cached = self._access_keys.get(key_id)
        if cached is not None:
            client_id, sealed, secret = cached
            if _sealed_key(clients.get(client_id), key_id) == sealed:
                self._access_keys.move_to_end(key_id)
                return client_id, secret
            del self._access_keys[key_id]
        for client_id, record in clients.items():
            stored = _sealed_key(record, key_id)
            if stored is None:
                continue
            try:
                secret = open_access_key(self.sealing_secret, client_id, key_id, stored)
            except SealingError:
                # Sealed under another secret (a lone node's key, the node since made part of
                # another cluster) or damaged: the key does not work here. Said once per sealed
                # text, not at every request that names it; the text itself is never logged.
                if (key_id, stored) not in self._unopened and len(self._unopened) < ACCESS_KEYS_CACHED_MAX:
                    self._unopened.add((key_id, stored))
                    log.warning("access key %s of client %s does not open with this node's sealing secret",
                                key_id, client_id)
                return None
            self._access_keys[key_id] = (client_id, stored, secret)
            while len(self._access_keys) > ACCESS_KEYS_CACHED_MAX:
                self._access_keys.popitem(last=False)
            return client_id, secret
        return None

    # --- configuration --------------------------------------------------------------------------
    def tls_ca_file(self) -> str:
        """The CA this node checks TLS peers against ("" without TLS)."""
        tls = self.config.tls_files()
        return tls[2] if tls else ""

    # --- storage reads (committed rows, a read transaction of their own) -----------------------
    def messages_after(self, queue_id: int, after: int, most: int) -> list[tuple[int, bytes]]:
        """(id, payload) of the queue's stored messages with id > after, lowest first."""
        with self._storage.reads() as storage:
            return storage.messages_after(queue_id, after, most)

    def ready_counts(self, queue_id: int, priority: int, afters: list[int], most: int) -> list[int]:
        """For each of `afters`: how many ready messages of that priority have a greater id
        (at most `most`), counted from the ready index without reading payloads, in one read."""
        with self._storage.reads() as storage:
            return [len(storage.ready_page(queue_id, priority, after, 2**63, most)) for after in afters]

    def payloads(self, queue_id: int, ids: list[int]) -> list[tuple[int, bytes | None]]:
        """(id, payload) of those messages, None for one no longer stored."""
        with self._storage.reads() as storage:
            return [(index, storage.read_client_payload(queue_id, index)) for index in ids]

    def newest_message(self, queue_id: int) -> tuple[int, bytes] | None:
        """(id, payload) of the queue's stored message with the highest id."""
        with self._storage.reads() as storage:
            return storage.newest_message(queue_id)

    def enqueued_ms(self, queue_id: int, message_id: int) -> int | None:
        """When a stored message was enqueued (the master's wall clock), None if not stored."""
        with self._storage.reads() as storage:
            return storage.enqueued_ms(queue_id, message_id)

    def producer(self, queue_id: int, message_id: int) -> str | None:
        """The client that enqueued a stored message, None if not stored."""
        with self._storage.reads() as storage:
            return storage.producer(queue_id, message_id)


def _sealed_key(record: dict[str, Any] | None, key_id: str) -> str | None:
    """The sealed secret of access key `key_id` in a client record, None when it holds none."""
    keys = record.get("access_keys") if isinstance(record, dict) else None
    entry = keys.get(key_id) if isinstance(keys, dict) else None
    sealed = entry.get("sealed") if isinstance(entry, dict) else None
    return sealed if isinstance(sealed, str) else None


SERVICES: web.AppKey[NodeServices] = web.AppKey("services", NodeServices)
