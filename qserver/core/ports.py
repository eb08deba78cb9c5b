"""The doors between the node's core and the cluster side (docs/ARCHITECTURE.md).

The core (qserver/core/) owns the queue cores, the open batch and the engine's task; the cluster
side (qserver/cluster/: the pair driver, the coordinator) drives the replication roles and the
map. The cluster side needs a few things from the core, and only these: they are written here as
small `typing.Protocol`s, grouped by concern, so that `PairDriver` and `Coordinator` take what
they use and nothing else, and a test hands them a small fake instead of a whole engine.

The core implements them structurally (no base class, no registration). The core never imports
qserver/cluster/ (tests/test_layers.py): what the two sides share at run time lives here
(`OUTCOME_UNKNOWN`, `Redirect`) or in replication/.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from wire.errors import E_NOT_MASTER, QueueError

if TYPE_CHECKING:
    from qserver.core.commands import Command
    from qserver.storage.batch import SealedBatch
    from replication.cluster_map import QueueEntry
    from replication.master import MasterRole
    from replication.messages import RelayRequest
    from replication.oplog import LogEntry
    from replication.queue_core import QueueCore
    from replication.replica import ReplicaRole, SnapshotInstall
    from replication.snapshot import InstalledState

# In place of a held answer's required order: the node stopped mastering the queue before the
# operation committed, so its outcome is unknown (`Staging.outcomes_unknown` marks them, the
# pair driver's `hold` refuses them).
OUTCOME_UNKNOWN = -1


class Redirect(QueueError):
    """E_NOT_MASTER naming the node that must handle the request (e.g. a new queue's master)."""

    def __init__(self, node: str, message: str, placement: tuple[str, str] | None = None) -> None:
        super().__init__(E_NOT_MASTER, message)
        self.node = node
        self.placement = placement      # a new queue's chosen (master, replica), passed along


class Staging(Protocol):
    """The open batch: what a role persists goes into it, and is durable with its group commit
    (persist, then send, then answer: docs/PROTOCOL.md)."""

    def stage_applied(self, core: QueueCore, applied: list[LogEntry]) -> None:
        """Log entries a replica applied: their operations and op-log rows."""
        ...

    def touch(self, core: QueueCore) -> None:
        """The queue's record changed (its epoch): written with the batch."""
        ...

    def stage_snapshot_rows(self, core: QueueCore, rows: list[Any], on_stored: Callable[[], None]) -> None:
        ...

    def stage_snapshot_install(self, core: QueueCore, install: SnapshotInstall, received: InstalledState,
                               on_installed: Callable[[], None]) -> None:
        ...

    def staged(self) -> SealedBatch:
        """The batch being filled: operations decided and not yet streamed or committed."""
        ...

    def journal_mark(self, core: QueueCore, role: str, index: int, reason: str) -> None:
        """A journal record of a member taking a role in an epoch (docs/AUDIT.md)."""
        ...

    def discard_uncommitted(self, core: QueueCore, order: int) -> bool:
        """Drop the core's suffix past `order` from memory, the open batch and storage; False
        when the core cannot."""
        ...

    def outcomes_unknown(self, queue: str, after_order: int) -> None:
        """Answers the batches in flight owe past `after_order` get OUTCOME_UNKNOWN."""
        ...


class Instances(Protocol):
    """The registry of the node's queue cores. The cluster side reads it and asks for changes;
    only the core adds or removes a core."""

    @property
    def cores(self) -> Mapping[str, QueueCore]:
        ...

    def hold_replica_instance(self, name: str, incarnation: int, record_json: dict[str, Any]) -> None:
        """A master announced the queue (Create): hold a core of that incarnation."""
        ...

    def drop_replica_instance(self, name: str, incarnation: int) -> None:
        ...

    def reset_replica_instance(self, role: ReplicaRole, record_json: dict[str, Any]) -> None:
        """Histories differ: the role's core starts again from empty (`role.core` is replaced)."""
        ...

    def create_master_instance(self, entry: QueueEntry) -> None:
        """The map names this node master of a queue it does not hold."""
        ...

    def drop_instance(self, core: QueueCore) -> None:
        """The map no longer lists this node for the queue (deleted, or moved away)."""
        ...


class Scheduler(Protocol):
    """The core's task, its clock and its randomness: callbacks from other tasks (the membership
    layer's decisions) come back through `invoke`; every deadline is on `monotonic_ms`."""

    @property
    def self_checks(self) -> bool:
        """A simulation's switch: check the bookkeeping of what changed after each turn."""
        ...

    def invoke(self, action: Callable[[int], None]) -> None:
        """Run action(now_ms) on the core's task."""
        ...

    def resubmit(self, command: Command) -> None:
        """Step a parked command again, ahead of the inbox."""
        ...

    def monotonic_ms(self) -> int:
        ...

    def random_bits(self, bits: int) -> int:
        ...


class PairEvents(Protocol):
    """What the pair driver tells the core about its queues, and the client registry it keeps
    in step with the map."""

    @property
    def clients(self) -> Mapping[str, dict[str, Any]]:
        ...

    def listeners_may_see_more(self, name: str) -> None:
        """The queue's commit point may have moved: its waiting receives and subscriptions are
        looked at again."""
        ...

    def role_changed(self, name: str) -> None:
        """The queue got a role, lost it, or its role changed: who decides its timed steps may
        have changed."""
        ...

    def master_left(self, core: QueueCore, new_master: str) -> None:
        ...

    def run_relayed(self, role: MasterRole, request: RelayRequest) -> None:
        """At the master: run a request its replica relayed from a client of its own."""
        ...

    def store_client(self, client_id: str, record: dict[str, Any] | None) -> None:
        """Put (or, with None, remove) a client record here; idempotent."""
        ...
