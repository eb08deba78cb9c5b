"""What the core needs from the cluster side: the doors the other way round from
qserver/core/ports.py (docs/ARCHITECTURE.md, "Rooms").

The engine routes a client's queue operation by the queue's role in its pair, holds answers
until the pair's commit point passes them, streams each batch to replicas before its own fsync
and hears of the commit after it (docs/PROTOCOL.md, "Replication messages"); the coordinator
parks commands during a handoff, proposes map commands and holds the node's lease
(docs/RAFT.md). The core knows those objects only through the protocols below, so no module of
qserver/core/ imports qserver/cluster/ (tests/test_layers.py): qserver/assembly.py hands it
the pair driver, the coordinator and the relay.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from qserver.core.commands import Command
    from replication.cluster_map import ClusterMap, Outcome, QueueEntry
    from replication.cluster_map import Command as MapCommand
    from replication.master import MasterRole
    from replication.messages import RelayRequest
    from replication.operations import Operation
    from replication.queue_core import QueueCore
    from replication.replica import ReplicaRole


class MapView(Protocol):
    """This node's copy of the cluster map (an empty map outside a cluster)."""

    @property
    def cluster_map(self) -> ClusterMap:
        ...

    def entry(self, queue: str) -> QueueEntry | None:
        """The map's entry of the queue (a dead-letter queue's is its queue's)."""
        ...


class Pairs(Protocol):
    """The queue pairs: each queue's role on this node, the answers held for the pair's commit
    point, the batch streamed to the replicas (qserver/cluster/pairs.py implements it)."""

    masters: dict[str, MasterRole]
    replicas: dict[str, ReplicaRole]

    @property
    def clustered(self) -> bool:
        ...

    @property
    def view(self) -> MapView:
        ...

    # Roles of the cores the registry holds.
    def attach(self, core: QueueCore, *, created: bool = False) -> None: ...
    def detach(self, name: str) -> None: ...
    def reload(self, name: str, core: QueueCore | None, reached: set[int], mono_ms: int) -> None: ...
    def announce(self, core: QueueCore) -> None: ...
    def describe(self, name: str) -> dict[str, Any]: ...
    def masters_hint(self, name: str) -> str: ...
    def restarting(self, name: str) -> bool: ...

    # Routing a client's operation.
    def refuse_if_not_master(self, name: str) -> None: ...

    def admit(self, name: str, *, write: bool) -> MasterRole | None:
        """A client's operation of queue `name` at a node that is not its replica: the master
        role that takes it, or None (no role here: the node steps it on its own, or the
        instance is being created). Raises where the queue is mastered elsewhere, or its master
        here may not take it now (restarted in its role; for a write or any `full` operation:
        fenced by a newer epoch, its replica out of sync under min_in_sync 2, the node's lease
        lapsed). One call for the checks of a command."""
        ...

    def refuse_relay_when_full(self, name: str) -> None: ...
    def relay(self, name: str, request: list[Any], answer: Any) -> None: ...

    # What the engine decided, and the commit points its answers wait for.
    def note_decided(self, core: QueueCore, ops: list[Operation]) -> int:
        """The core decided `ops`: the ordering index a client answer about them waits for."""
        ...

    def replicated_order(self, core: QueueCore, ops: list[Operation]) -> int: ...
    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *,
             write: bool = False) -> bool: ...
    def answer_point(self, name: str) -> tuple[int | None, bool]:
        """The queue's commit point here (None: no role of it) and whether its answers may go
        out now (a master without its lease, or restarted in its role, holds them)."""
        ...

    def release_committed(self, name: str | None = None) -> None: ...

    # Around each group commit.
    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
                      mono_ms: int, touched: dict[str, QueueCore]) -> None: ...
    def after_commit(self, operations: list[Operation], mono_ms: int, touched: dict[str, QueueCore],
                     installed: list[tuple[int, int]] | None = None) -> None: ...
    def log_floors(self) -> dict[int, int]: ...
    def commit_points_to_record(self) -> list[QueueCore]: ...
    def storage_full_changed(self, full: bool, mono_ms: int) -> None: ...

    # The engine's turn: peers, links, the map, time.
    def on_peer_message(self, peer: str, data: bytes, mono_ms: int) -> None: ...
    def on_link_change(self, peer: str, up: bool, mono_ms: int, *, going_away: bool = False) -> None: ...
    def map_applied(self, command: MapCommand, outcomes: list[Outcome]) -> None: ...
    def tick(self, mono_ms: int) -> None: ...


class LeaseCheck(Protocol):
    """The node's lease from the membership layer (replication/leases.py, docs/RAFT.md)."""

    def valid(self, now_ms: int) -> bool:
        """Whether it holds at `now_ms` on the core's monotonic clock."""
        ...


class HandoffGate(Protocol):
    """The coordinator: the node's lease, handoffs under way (their queues' commands wait),
    and map commands proposed through the membership layer (qserver/cluster/coordinator.py)."""

    @property
    def lease(self) -> LeaseCheck:
        ...

    @property
    def handoffs(self) -> Mapping[str, Any]:
        """The handoffs under way, by queue (empty nearly always: `parks` need not be asked)."""
        ...

    def parks(self, queue: str) -> bool: ...
    def park(self, queue: str, command: Any) -> None: ...
    def propose_checked(self, command: MapCommand, finish: Callable[[Any], None],
                        result: Callable[[list[Outcome]], Any]) -> None: ...
    def tick(self, mono: int) -> None: ...


class Relay(Protocol):
    """Requests between the members of a pair (qserver/cluster/relay.py): a replica relays a
    client's operation to its master, and the master runs one relayed to it."""

    def relay(self, queue: str, command: Command) -> None:
        """At the replica: send the command to the queue's master; its client is answered
        with the master's answer."""
        ...

    def run_relayed(self, role: MasterRole, request: RelayRequest, step: Callable[[Command], None]) -> None:
        """At the master: the command of a relayed request, answered to the replica, given to
        `step` (a request that makes no command is answered with its error)."""
        ...

