"""Node leases from the membership layer (docs/ARCHITECTURE.md, "Membership"), pure.

One lease per node covers every queue it masters. A node renews it by a message to the
membership leader (never a Raft write) and counts it from the moment it *sent* the renewal,
on its own monotonic clock: a grant extends it to sent + lease_ms. The node stops
acknowledging when it runs out.

The leader records, on its own monotonic clock, when it last granted each node. A node is
lapsed once lease_ms + margin_ms have passed since that grant, and, for a newly elected
leader, since its election (it cannot know what its predecessor granted). Only then may a
lapsed master's replica be promoted. Clocks need a bounded drift rate, not synchronisation:
the margin covers the drift over one lease.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeLease:
    """`first_sequence`: where this process's renewal sequences start. A node gives each process
    a random one: a grant the leader queued for a previous process's renewal n, delivered once
    the link is back, must not count for this process's own renewal n, sent later."""
    lease_ms: int
    valid_until_ms: int = 0
    first_sequence: int = 1
    outstanding_max: int = 64
    _sent: dict[int, int] = field(default_factory=dict)     # renewal sequence -> sent at
    _next: int = 0

    def __post_init__(self) -> None:
        self._next = self.first_sequence

    def renewal(self, now_ms: int) -> int:
        sequence = self._next
        self._next += 1
        self._sent[sequence] = now_ms
        while len(self._sent) > self.outstanding_max:
            del self._sent[min(self._sent)]
        return sequence

    def granted(self, sequence: int) -> None:
        sent = self._sent.pop(sequence, None)
        if sent is not None:
            self.valid_until_ms = max(self.valid_until_ms, sent + self.lease_ms)
            for older in [s for s in self._sent if s < sequence]:
                del self._sent[older]

    def valid(self, now_ms: int) -> bool:
        return now_ms < self.valid_until_ms

    def remaining_ms(self, now_ms: int) -> int:
        return max(0, self.valid_until_ms - now_ms)


@dataclass
class LeaseTable:
    """At the membership leader: when each node was last granted its lease."""
    lease_ms: int
    margin_ms: int
    leader_since_ms: int | None = None
    last_grant_ms: dict[str, int] = field(default_factory=dict)
    lapsed_since_ms: dict[str, int] = field(default_factory=dict)

    def became_leader(self, now_ms: int) -> None:
        self.leader_since_ms = now_ms
        self.last_grant_ms.clear()
        self.lapsed_since_ms.clear()

    def stepped_down(self) -> None:
        self.leader_since_ms = None

    def grant(self, node: str, now_ms: int) -> None:
        self.last_grant_ms[node] = now_ms
        self.lapsed_since_ms.pop(node, None)

    def lapsed(self, nodes: list[str], now_ms: int) -> set[str]:
        """Nodes whose lease has certainly run out (empty unless this node leads)."""
        if self.leader_since_ms is None:
            return set()
        limit = self.lease_ms + self.margin_ms
        if now_ms - self.leader_since_ms <= limit:
            return set()
        out = set()
        for node in nodes:
            if now_ms - self.last_grant_ms.get(node, self.leader_since_ms) > limit:
                out.add(node)
                self.lapsed_since_ms.setdefault(node, now_ms)
        return out

    def lapsed_for_ms(self, node: str, now_ms: int) -> int:
        since = self.lapsed_since_ms.get(node)
        return 0 if since is None else now_ms - since
