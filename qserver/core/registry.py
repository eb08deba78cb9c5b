"""The registry of the node's queue cores: loading them from storage, creating and removing
them, the instances the cluster side asks for (a master's, a replica's, one reset after its
history parted from its master's), dead-letter queues linked to their queues, and the
registered clients; `describe` for the stats a queue reports.

Separate from the engine's task and the commit pipeline: it decides which cores exist, not
what they do with a command, and it is what the cluster side sees of them (`Instances`,
qserver/core/ports.py). A core it makes or removes is written with the open batch.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qserver.config import NodeConfig
from qserver.core.deadlines import DueQueues
from qserver.storage.lmdb_store import Storage
from replication.cluster_map import QueueEntry
from replication.options import DEAD_LETTER_SUFFIX, QueueOptions, QueueState, dead_letter_name, options_from_json
from replication.queue_core import QueueCore, QueueRecord
from wire.errors import E_MACRO_QUEUE, E_NOT_MASTER, E_UNKNOWN_QUEUE, QueueError

if TYPE_CHECKING:
    from qserver.core.listeners import Listeners
    from qserver.core.pipeline import CommitPipeline
    from qserver.core.replication_port import Pairs
    from replication.replica import ReplicaRole


class QueueRegistry:
    pairs: Pairs                     # given by Engine.connect

    def __init__(self, config: NodeConfig, storage: Storage, rng: random.Random, *, clock_ms: Callable[[], int],
                 monotonic_ms: Callable[[], int], pipeline: CommitPipeline, listeners: Listeners,
                 due: DueQueues) -> None:
        self.config = config
        self.storage = storage
        self._rng = rng
        self.clock_ms = clock_ms
        self.monotonic_ms = monotonic_ms
        self.pipeline = pipeline
        self.listeners = listeners
        self._due = due
        self.cores: dict[str, QueueCore] = {}
        self.clients: dict[str, dict[str, Any]] = {}
        self.on_clients_changed: Callable[[], None] = lambda: None
        # Creators of a queue this node masters, answered once the map's copy here made it.
        self.created_waiting: dict[str, list[tuple[Any, int]]] = {}
        self._next_queue_id = storage.next_queue_id()

    def load(self) -> None:
        """Rebuild cores from storage: queue records and leases only, never the messages."""
        self.cores = {}
        for record in self.storage.load_queue_records():
            self.cores[record.name] = self._new_core(record, self.storage.load_leases(record.queue_id))
        for name, core in self.cores.items():
            if not name.endswith(DEAD_LETTER_SUFFIX):
                core.dead_letter_core = self.cores.get(dead_letter_name(name))
        self.pairs.masters.clear()
        self.pairs.replicas.clear()
        for core in self.cores.values():
            self.pairs.attach(core)
        self._due.changed.update(self.cores)
        self.storage.end_read()
        self.clients = self.storage.load_clients()
        self._next_queue_id = self.storage.next_queue_id()

    def reload(self, names: set[str], reached: set[int]) -> None:
        """After a batch could not be stored: rebuild the queues `names` from storage (records
        and leases, as at a start, with their dead-letter partners), and give each its role
        again (Pairs.reload); `reached`: queue ids whose op log, snapshot or suffix the
        lost batch wrote."""
        self._due.changed.update(names)
        stored = {record.name: record for record in self.storage.load_queue_records() if record.name in names}
        for name in names:
            old = self.cores.pop(name, None)
            record = stored.get(name)
            if record is not None:
                self.cores[name] = self._new_core(record, self.storage.load_leases(record.queue_id))
            elif old is not None:
                self.listeners.drop_queue_listeners(name)         # created in the lost batch: never stored
        for name in names:
            core = self.cores.get(name)
            if core is not None and not name.endswith(DEAD_LETTER_SUFFIX):
                core.dead_letter_core = self.cores.get(dead_letter_name(name))
        mono_ms = self.monotonic_ms()
        for name in sorted(names):           # a queue before its dead-letter queue
            self.pairs.reload(name, self.cores.get(name), reached, mono_ms)
        self.pairs.release_committed()
        self.storage.end_read()
        self.clients = self.storage.load_clients()
        self._next_queue_id = self.storage.next_queue_id()

    def core(self, name: str) -> QueueCore:
        """The queue's core here, or the error that says where it is (or that it is none)."""
        core = self.cores.get(name)
        if core is None:
            raise self.missing(name)
        return core

    def missing(self, name: str) -> QueueError:
        """Why this node holds no core of queue `name`: another node holds it, it is a macro
        queue, or there is none."""
        pairs = self.pairs
        entry = pairs.view.entry(name)
        if entry is not None and entry.master != self.config.node_id:
            return QueueError(E_NOT_MASTER, f"queue {name} is held by {pairs.masters_hint(name)}")
        if pairs.clustered and name in pairs.view.cluster_map.macros:
            return QueueError(E_MACRO_QUEUE, f"{name} is a macro queue: its policies run in the client library, "
                                             "which sends each message to a member")
        return QueueError(E_UNKNOWN_QUEUE, f"no queue named {name!r}")

    # --- making and removing cores ---------------------------------------------------------
    def _new_core(self, record: QueueRecord, leases: list[Any]) -> QueueCore:
        return QueueCore(record, self.storage, self._rng, lease_clock=self.monotonic_ms, leases=leases,
                         dedupe_window_ms=int(self.config.dedupe_window_s * 1000))

    def create_core(self, name: str, options: QueueOptions, now_ms: int, dead_letter_of: str | None,
                    incarnation: int = 0, epoch: int = 1) -> QueueCore:
        record = QueueRecord(self._next_queue_id, name, options, now_ms, dead_letter_of=dead_letter_of,
                             incarnation=incarnation, epoch=epoch)
        self._next_queue_id += 1
        sealed = self.pipeline.open.sealed
        sealed.next_queue_id = self._next_queue_id
        core = self._new_core(record, [])
        core.transition(QueueState.CONFIGURING)
        core.transition(QueueState.CONFIGURED)
        core.transition(QueueState.OPENING)
        core.transition(QueueState.OPEN)
        self.cores[name] = core
        sealed.epochs[name] = record.epoch
        self.pipeline.touch(core)
        return core

    def create_queue(self, name: str, options: QueueOptions, now_ms: int) -> QueueCore:
        """A queue outside a cluster, with its dead-letter queue if its options ask for one."""
        core = self.create_core(name, options, now_ms, dead_letter_of=None)
        if options.dead_letter:
            core.dead_letter_core = self.create_core(dead_letter_name(name), dead_letter_options(options), now_ms,
                                                     dead_letter_of=name)
        return core

    def remove_core(self, core: QueueCore, *, keep_role: bool = False) -> None:
        del self.cores[core.name]
        open_batch = self.pipeline.open
        open_batch.touched.pop(core.name, None)
        self._due.changed.add(core.name)
        open_batch.sealed.deleted_queues.append((core.name, core.queue_id))
        self.listeners.drop_queue_listeners(core.name)
        if not keep_role:
            self.pairs.detach(core.name)

    def drop_instance(self, core: QueueCore) -> None:
        """The map no longer lists this node for the queue (deleted, or moved away)."""
        if self.cores.get(core.name) is not core:
            return
        if core.record.state is QueueState.OPEN:
            core.transition(QueueState.CLOSING)
            core.transition(QueueState.CLOSED)
        self.remove_core(core)

    # --- instances the cluster side asks for -----------------------------------------------
    def hold_replica_instance(self, name: str, incarnation: int, record_json: dict[str, Any]) -> None:
        core = self.cores.get(name)
        if core is not None and (core.record.incarnation or core.queue_id) == incarnation:
            return
        if core is not None:
            self.remove_core(core)
        options = QueueRecord.from_json(record_json).options
        dead_letter = name.endswith(DEAD_LETTER_SUFFIX)
        created = self.create_core(name, options, record_json.get("created_ms", self.clock_ms()),
                                   dead_letter_of=record_json.get("dead_letter_of") if dead_letter else None,
                                   incarnation=incarnation)
        if not dead_letter and self.cores.get(dead_letter_name(name)) is not None:
            created.dead_letter_core = self.cores[dead_letter_name(name)]
        if dead_letter and record_json.get("dead_letter_of") in self.cores:
            self.cores[record_json["dead_letter_of"]].dead_letter_core = created
        self.pairs.attach(created, created=True)

    def drop_replica_instance(self, name: str, incarnation: int) -> None:
        core = self.cores.get(name)
        if core is not None and (core.record.incarnation or core.queue_id) == incarnation \
                and name in self.pairs.replicas:
            self.remove_core(core)

    def reset_replica_instance(self, role: ReplicaRole, record_json: dict[str, Any]) -> None:
        """Histories differ: drop this instance's contents and start again from empty."""
        old = role.core
        dead_letter = old.dead_letter_core
        # What it applied into the open batch goes with it (the master sends it again): written
        # after the instance is gone, its journal records named no queue, and the audit found
        # an index gap (a chaos run, seed 41, when a dead-letter queue asked for a snapshot of
        # both while its queue was following).
        self.pipeline.unstage(old.queue_id)
        self.remove_core(old, keep_role=True)
        # The same epoch as the instance it replaces: its journal records and its durable
        # epoch must not go back to the default (a node never accepts an older epoch).
        fresh = self.create_core(old.name, old.options, old.record.created_ms,
                                 dead_letter_of=old.record.dead_letter_of, incarnation=role.incarnation,
                                 epoch=old.record.epoch)
        fresh.dead_letter_core = dead_letter
        role.core = fresh
        fresh.visible_upto = role.visible_order

    def create_master_instance(self, entry: QueueEntry) -> None:
        """The map names this node master of a queue it does not hold: create its instance
        (and dead-letter queue) with the map's incarnation; the replica learns of it once it
        is durable here."""
        now_ms = self.clock_ms()
        options = options_from_json(entry.options)
        core = self.create_core(entry.name, options, now_ms, dead_letter_of=None, incarnation=entry.incarnation,
                                epoch=entry.epoch)
        created = [core]
        if options.dead_letter:
            dead = self.create_core(dead_letter_name(entry.name), dead_letter_options(options), now_ms,
                                    dead_letter_of=entry.name, incarnation=entry.incarnation + 1, epoch=entry.epoch)
            core.dead_letter_core = dead
            created.append(dead)
        for queue in created:
            self.pairs.attach(queue, created=True)
            self.pipeline.open.after_commit.append(functools.partial(self.pairs.announce, queue))
        self.answer_created(entry.name)

    def answer_created(self, name: str) -> None:
        """Creators wait for the local copy of the map to have made the instance."""
        core = self.cores.get(name)
        if core is None:
            return
        for replier, request_id in self.created_waiting.pop(name, []):
            self.pipeline.open.replies.append((replier, request_id, {"created": True, **self.describe(core)}))

    def recreate_lost_masters(self) -> None:
        """Instances the map gives this node as master that a lost batch was creating."""
        if not self.pairs.clustered:
            return
        for name, entry in self.pairs.view.cluster_map.queues.items():
            if entry.master == self.config.node_id and name not in self.cores:
                self.create_master_instance(entry)

    # --- clients ---------------------------------------------------------------------------
    def store_client(self, client_id: str, record: dict[str, Any] | None) -> None:
        """Put (or, with None, remove) a client record here; idempotent."""
        sealed = self.pipeline.open.sealed
        if record is None:
            if self.clients.pop(client_id, None) is None:
                return
            sealed.client_deletes.append(client_id)
        else:
            if self.clients.get(client_id) == record:
                return
            self.clients[client_id] = record
            sealed.client_puts[client_id] = record
        self.pipeline.open.after_commit.append(self.on_clients_changed)

    # --- views -----------------------------------------------------------------------------
    def describe(self, core: QueueCore) -> dict[str, Any]:
        """Seed 004 QueueStats for one queue (replication fields filled by later releases)."""
        record = core.record
        replication = self.pairs.describe(core.name)
        return {**{
            "name": record.name, "incarnation": record.incarnation or record.queue_id, "state": record.state.value,
            "options": record.options.to_json(every=True), "epoch": record.epoch,
            "master": self.config.node_id, "replica": None, "replication_state": "unreplicated",
            "master_status": "local",
            "depth": core.depth, "in_flight": core.in_flight, "ready": record.ready_count,
            "delayed": record.delayed_count,
            "total_enqueued": record.total_enqueued, "total_acked": record.total_acked,
            "total_dead_lettered": record.total_dead_lettered, "total_purged": record.total_purged,
            "total_expired": record.total_expired,
            "total_redelivered": record.total_redelivered,
            "highest_depth": record.highest_depth, "configured_depth": record.options.max_depth,
            "overflows": core.overflows,
            "average_service_ms": (record.service_ms_total / record.service_count) if record.service_count else 0.0,
            "next_index": record.next_index, "dead_letter_of": record.dead_letter_of,
            # Added in 0.3.0 (docs/OPERATIONS.md, "Monitoring"): what an operator alerts on.
            "oldest_message_age_s": self.oldest_ages_s([core]).get(core.name, 0.0),
            "consumers": self.consumers(core.name),
        }, **replication}

    def oldest_ages_s(self, cores: list[QueueCore]) -> dict[str, float]:
        """Seconds since each queue's oldest message still held was enqueued (SQS's
        ApproximateAgeOfOldestMessage), 0 for a queue that holds none: one storage seek per
        queue (Storage.oldest_enqueued_ms). Enqueue times are the master's wall clock: a
        replica's clock behind it reads 0, never less."""
        now_ms = self.clock_ms()
        enqueued = self.storage.oldest_enqueued_ms([core.queue_id for core in cores])
        return {core.name: max(0, now_ms - enqueued[core.queue_id]) / 1000 if core.queue_id in enqueued else 0.0
                for core in cores}

    def consumers(self, name: str) -> int:
        """Push subscriptions open on the queue at this node (WebSocket `subscribe`, a
        recipient's too); receives waiting for a message and channel subscribers are not counted."""
        return len(self.listeners.subscriptions.get(name, ()))


def dead_letter_options(options: QueueOptions) -> QueueOptions:
    return QueueOptions(max_depth=2**40, dead_letter=False, strength=options.strength)
