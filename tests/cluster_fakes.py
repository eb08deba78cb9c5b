"""Small fakes of what the pair driver and the coordinator need from the node's core (the ports
of qserver/core/ports.py) and from the membership layer, for tests whose subject is one of them.

Each fake does the least its port promises and records what it was told, so a test builds a real
`PairDriver` or `Coordinator` without an engine.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qserver.cluster.coordinator import Coordinator
from qserver.cluster.membership import Done, OnApplied
from qserver.cluster.pairs import PairDriver
from qserver.cluster.view import ClusterView
from qserver.config import NodeConfig
from qserver.core.commands import Command
from qserver.storage.batch import SealedBatch
from replication.cluster_map import ClusterMap, QueueEntry
from replication.cluster_map import Command as MapCommand
from replication.master import MasterRole, ReplicationLimits
from replication.messages import Message, RelayRequest, decode_message
from replication.oplog import LogEntry
from replication.queue_core import QueueCore
from replication.replica import ReplicaRole, SnapshotInstall
from replication.snapshot import InstalledState, SnapshotView


class FakeCore:
    """The core's side of every port: a registry of cores, an open batch, a clock, and a record
    of the events the pairs told it."""

    self_checks = True

    def __init__(self, clock_ms: Callable[[], int] = lambda: 0) -> None:
        self.clock_ms = clock_ms
        self.cores: dict[str, QueueCore] = {}
        self.clients: dict[str, dict[str, Any]] = {}
        self.batch = SealedBatch()
        self.invoked: list[Callable[[int], None]] = []
        self.resubmitted: list[Command] = []
        self.served: list[str] = []          # listeners_may_see_more
        self.roles_changed: list[str] = []
        self.marks: list[tuple[str, str, int, str]] = []

    # Staging
    def stage_applied(self, core: QueueCore, applied: list[LogEntry]) -> None:
        for entry in applied:
            self.batch.operations.extend(entry.ops)
            self.batch.oplog_rows.append(entry.row(core.queue_id))

    def touch(self, core: QueueCore) -> None:
        pass

    def stage_snapshot_rows(self, core: QueueCore, rows: list[Any], on_stored: Callable[[], None]) -> None:
        self.batch.on_commit.append(on_stored)

    def stage_snapshot_install(self, core: QueueCore, install: SnapshotInstall, received: InstalledState,
                               on_installed: Callable[[], None]) -> None:
        self.batch.on_commit.append(on_installed)

    def staged(self) -> SealedBatch:
        return self.batch

    def journal_mark(self, core: QueueCore, role: str, index: int, reason: str) -> None:
        self.marks.append((core.name, role, index, reason))

    def discard_uncommitted(self, core: QueueCore, order: int) -> bool:
        return core.discard_after(order) is not None

    def outcomes_unknown(self, queue: str, after_order: int) -> None:
        pass

    # Instances
    def hold_replica_instance(self, name: str, incarnation: int, record_json: dict[str, Any]) -> None:
        pass

    def drop_replica_instance(self, name: str, incarnation: int) -> None:
        pass

    def reset_replica_instance(self, role: ReplicaRole, record_json: dict[str, Any]) -> None:
        pass

    def create_master_instance(self, entry: QueueEntry) -> None:
        pass

    def drop_instance(self, core: QueueCore) -> None:
        self.cores.pop(core.name, None)

    # Scheduler
    def invoke(self, action: Callable[[int], None]) -> None:
        self.invoked.append(action)

    def resubmit(self, command: Command) -> None:
        self.resubmitted.append(command)

    def monotonic_ms(self) -> int:
        return self.clock_ms()

    def random_bits(self, bits: int) -> int:
        return 1

    # PairEvents
    def listeners_may_see_more(self, name: str) -> None:
        self.served.append(name)

    def role_changed(self, name: str) -> None:
        self.roles_changed.append(name)

    def master_left(self, core: QueueCore, new_master: str) -> None:
        pass

    def run_relayed(self, role: MasterRole, request: RelayRequest) -> None:
        pass

    def store_client(self, client_id: str, record: dict[str, Any] | None) -> None:
        if record is None:
            self.clients.pop(client_id, None)
        else:
            self.clients[client_id] = record


class FakeStorage:
    """An empty op log and no snapshots."""

    storage_id = 1

    def read(self, queue_id: int, after_order: int, limit: int, bytes_max: int = 1 << 62) -> list[tuple[int, int, bytes]]:
        return []

    def digest_at(self, queue_id: int, order: int) -> bytes | None:
        return None

    def last(self, queue_id: int) -> tuple[int, bytes]:
        return 0, bytes(16)

    def first(self, queue_id: int) -> int:
        return 0

    def open_snapshot(self, name: str, queue_id: int, *, consumption: bool, after_index: int,
                      dead_letter: tuple[str, int] | None) -> SnapshotView | None:
        return None


class FakeMembership:
    """The membership layer as a map that changes only when the test applies commands to it;
    proposals are recorded, and decided by the test (or never)."""

    def __init__(self, cluster_map: ClusterMap | None = None, *, leader: str | None = None) -> None:
        self.cluster_map = cluster_map if cluster_map is not None else ClusterMap()
        self.on_applied: OnApplied = lambda command, outcomes: None
        self.leader = leader
        self.proposed: list[tuple[MapCommand, Done]] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def propose(self, command: MapCommand, done: Done) -> None:
        self.proposed.append((command, done))

    def is_leader(self) -> bool:
        return False

    def leader_id(self) -> str | None:
        return self.leader

    def term(self) -> int:
        return 1

    def version_when_applied(self) -> int:
        return self.cluster_map.version

    def status(self) -> dict[str, Any]:
        return {}


def pair_driver(node_id: str, core: FakeCore, membership: FakeMembership | None = None,
                sent: list[tuple[str, Message]] | None = None) -> PairDriver:
    """A pair driver of node `node_id` on the fakes; what it sends goes to `sent`, decoded."""
    config = NodeConfig(node_id=node_id)
    driver = PairDriver(ClusterView(node_id, {}, membership), ReplicationLimits(), config=config,
                        storage=FakeStorage(), staging=core, instances=core, scheduler=core, events=core)
    if sent is not None:
        def send(peer: str, data: bytes) -> bool:
            sent.append((peer, decode_message(data)))
            return True
        driver.send = send
    return driver


def coordinator(driver: PairDriver, core: FakeCore, membership: FakeMembership, **settings: Any) -> Coordinator:
    """A coordinator beside `driver` (of the same node), `settings` overriding NodeConfig's."""
    config = NodeConfig(node_id=driver.node_id, **settings)
    made = Coordinator(driver, membership, config=config, storage_id=FakeStorage.storage_id, scheduler=core,
                       instances=core)
    driver.coordinator = made
    return made
