"""The open batch: what one turn of the engine decided, waiting to be committed together (group
commit), with the answers and pushes released once it is durable.

Its own module because three parts of the core fill it (the command steps, the listeners
serving waiting receives and subscriptions, the staging of what replicas apply) and one
commits it (qserver/core/pipeline.py); none of them needs the others to know its shape.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qserver.storage.lmdb_store import SealedBatch
from replication.operations import Leased

if TYPE_CHECKING:
    from qserver.core.listeners import Subscription
    from replication.queue_core import QueueCore


@dataclass
class OpenBatch:
    sealed: SealedBatch = field(default_factory=SealedBatch)
    # (replier, request_id, result) answered after commit; results of receives are built
    # from ("messages", first payload position, leased ops).
    replies: list[tuple[Any, int, Any]] = field(default_factory=list)
    pushes: list[tuple[Subscription, int, list[Leased]]] = field(default_factory=list)
    touched: dict[str, QueueCore] = field(default_factory=dict)
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    # Answers about replicated operations also wait for the queue's commit point:
    # position in replies / pushes -> (queue name, ordering index required).
    holds: dict[int, tuple[str, int]] = field(default_factory=dict)
    push_holds: dict[int, tuple[str, int]] = field(default_factory=dict)
    write_holds: set[int] = field(default_factory=set)     # positions in replies of enqueues' answers

    def empty(self) -> bool:
        s = self.sealed
        return not (s.operations or self.replies or self.pushes or s.queue_records or s.deleted_queues
                    or s.truncations or s.client_puts or s.client_deletes or s.housekeeping_ms is not None
                    or self.after_commit or s.snapshot_rows or s.snapshot_installs)


class Messages:
    """Marks a reply result to be built from leased operations once payloads are read."""
    __slots__ = ("first", "leased")

    def __init__(self, first: int, leased: list[Leased]) -> None:
        self.first = first
        self.leased = leased
