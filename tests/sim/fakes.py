"""Fakes of the cluster side as the core sees it (qserver/core/replication_port.py), for tests
of the engine's own parts without a pair driver or a coordinator: a test sets what it needs
(`clustered`, the roles, the lease) and the rest does nothing."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qserver.core import commands as c
from replication.cluster_map import ClusterMap, Outcome, QueueEntry
from replication.cluster_map import Command as MapCommand
from replication.master import MasterRole
from replication.messages import RelayRequest
from replication.operations import Operation
from replication.queue_core import QueueCore
from replication.replica import ReplicaRole


class FakeView:
    """An empty map: no queue has an entry."""

    def __init__(self) -> None:
        self._map = ClusterMap()

    @property
    def cluster_map(self) -> ClusterMap:
        return self._map

    def entry(self, queue: str) -> QueueEntry | None:
        return None


class FakePairs:
    """No roles unless a test puts them in `masters`/`replicas`; nothing held, nothing sent."""

    def __init__(self, *, clustered: bool = False) -> None:
        self.masters: dict[str, MasterRole] = {}
        self.replicas: dict[str, ReplicaRole] = {}
        self.clustered = clustered
        self._view = FakeView()
        self.decided: list[Operation] = []

    @property
    def view(self) -> FakeView:
        return self._view

    def attach(self, core: QueueCore, *, created: bool = False) -> None: ...
    def detach(self, name: str) -> None: ...
    def reload(self, name: str, core: QueueCore | None, reached: set[int], mono_ms: int) -> None: ...
    def announce(self, core: QueueCore) -> None: ...

    def describe(self, name: str) -> dict[str, Any]:
        return {}

    def masters_hint(self, name: str) -> str:
        return "?"

    def restarting(self, name: str) -> bool:
        return False

    def refuse_if_not_master(self, name: str) -> None: ...
    def admit(self, name: str, *, write: bool) -> MasterRole | None:
        return self.masters.get(name)

    def refuse_relay_when_full(self, name: str) -> None: ...
    def relay(self, name: str, request: list[Any], answer: Any) -> None: ...

    def note_decided(self, core: QueueCore, ops: list[Operation]) -> int:
        self.decided.extend(ops)
        return self.replicated_order(core, ops)

    def replicated_order(self, core: QueueCore, ops: list[Operation]) -> int:
        return 0

    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *, write: bool = False) -> bool:
        return False

    def answer_point(self, name: str) -> tuple[int | None, bool]:
        return None, True

    def release_committed(self, name: str | None = None) -> None: ...
    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
                      mono_ms: int, touched: dict[str, QueueCore]) -> None: ...
    def after_commit(self, operations: list[Operation], mono_ms: int, touched: dict[str, QueueCore],
                     installed: list[tuple[int, int]] | None = None) -> None: ...

    def log_floors(self) -> dict[int, int]:
        return {}

    def commit_points_to_record(self) -> list[QueueCore]:
        return []

    def storage_full_changed(self, full: bool, mono_ms: int) -> None: ...
    def on_peer_message(self, peer: str, data: bytes, mono_ms: int) -> None: ...
    def on_link_change(self, peer: str, up: bool, mono_ms: int, *, going_away: bool = False) -> None: ...
    def map_applied(self, command: MapCommand, outcomes: list[Outcome]) -> None: ...
    def tick(self, mono_ms: int) -> None: ...


class FakeLease:
    """The node's lease, held or not as the test says (at any time)."""

    def __init__(self, held: bool) -> None:
        self.held = held

    def valid(self, now_ms: int) -> bool:
        return self.held


class FakeGate:
    """A coordinator whose lease a test turns on and off; no handoff, no proposal."""

    def __init__(self, *, lease: bool = True) -> None:
        self.lease = FakeLease(lease)
        self.handoffs: dict[str, Any] = {}

    def lease_valid(self) -> bool:
        return self.lease.held

    def parks(self, queue: str) -> bool:
        return False

    def park(self, queue: str, command: Any) -> None: ...
    def propose_checked(self, command: MapCommand, finish: Callable[[Any], None],
                        result: Callable[[list[Outcome]], Any]) -> None: ...
    def tick(self, mono: int) -> None: ...


class FakeRelay:
    def relay(self, queue: str, command: c.Command) -> None: ...
    def run_relayed(self, role: MasterRole, request: RelayRequest, step: Callable[[c.Command], None]) -> None: ...
