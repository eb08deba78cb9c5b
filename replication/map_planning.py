"""Pure decisions the membership leader and the nodes make from the cluster map, proposed
as commands: placement of a new queue, the failover plan for nodes whose lease lapsed, the
moves that replace a long-lost replica or spread members, and the handoffs that spread masters.

Apart from `replication/cluster_map.py` because they only read the map (through its
`MapIndex` and counts) and never change it: what the map is and what to do about it are
separate concerns. The map is imported for its type only, so the map module can re-export these.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from replication.map_commands import ChangePair
from replication.map_entries import NodeState, QueueEntry, Reason, astuple

if TYPE_CHECKING:
    from replication.cluster_map import ClusterMap


def choose_pair(cluster: ClusterMap, preferred: tuple[str | None, str | None] = (None, None)) -> tuple[str, str] | None:
    """Master and replica for a new queue: two different live nodes; the master where fewest
    masters are, the replica where fewest members are (ties by id). None: fewer than two."""
    live = cluster.live_nodes()
    want_master, want_replica = preferred
    if len(live) < 2 or (want_master and want_master not in live) or (want_replica and want_replica not in live):
        return None
    masters, members = cluster.masters_per_node(), cluster.members_per_node()
    master = want_master or min((n for n in live if n != want_replica), key=lambda n: (masters[n], members[n], n))
    replica = want_replica or min((n for n in live if n != master), key=lambda n: (members[n], masters[n], n))
    return (master, replica) if master != replica else None


def plan_failover(cluster: ClusterMap, lapsed: set[str]) -> tuple[list[ChangePair], list[str]]:
    """Promote the in-sync replica of every queue mastered by a node whose lease lapsed (epoch+1).
    The old master stays in the pair as the replica and rejoins by state transfer; the
    replica it gets is recorded out of sync until then. Returns the changes and the queues that
    stay unavailable (replica out of sync or itself lapsed: they wait for a member to come back,
    or for an operator's `qctl promote --unclean`)."""
    changes, stuck = [], []
    for name in cluster.index.holding(lapsed, replicas=False):      # what the lapsed nodes master, by name
        entry = cluster.queues[name]
        replica_node = cluster.nodes.get(entry.replica)
        if not entry.in_sync or entry.replica in lapsed or replica_node is None \
                or replica_node.state not in (NodeState.UP, NodeState.DRAINING):
            stuck.append(name)
            continue
        changes.append(ChangePair(name, astuple(entry.pair),
                                  (entry.epoch + 1, entry.replica, entry.master, False), Reason.FAILOVER.value))
    return changes, stuck


def plan_replacements(cluster: ClusterMap, gone: set[str]) -> list[ChangePair]:
    """A node down longer than `replica_replace_after_s` (or draining) loses its replicas: each
    is re-created on another live node (a move; the new one is out of sync until transferred)."""
    changes: list[ChangePair] = []
    if not gone:
        return changes
    members = cluster.members_per_node()
    live = cluster.live_nodes()
    for name in cluster.index.holding(gone, masters=False):         # the replicas on gone nodes, by name
        entry = cluster.queues[name]
        if entry.master in gone:
            continue
        candidates = [n for n in live if n not in (entry.master, entry.replica)]
        if not candidates:
            continue
        target = min(candidates, key=lambda n: (members[n], n))
        members[target] += 1
        changes.append(ChangePair(name, astuple(entry.pair), (entry.epoch + 1, entry.master, target, False),
                                  Reason.MOVE.value))
    return changes


def plan_member_moves(cluster: ClusterMap) -> list[ChangePair]:
    """Replicas to move onto up nodes that hold fewer members than others. Handoffs alone
    cannot reach a node that holds no member (one back from a drain, a new one), so the
    members spread first: from the node with most to the one with fewest while they differ
    by two or more. A queue whose master's node masters most goes first, so the handoffs
    that follow can relieve that node; a `min_in_sync` 2 queue goes last (it refuses writes
    until its new replica is in sync). Only in-sync pairs move; each new replica is out of
    sync until its state transfer ends."""
    members, masters = cluster.members_per_node(), cluster.masters_per_node()
    changes: list[ChangePair] = []

    def last_of_pair(entry: QueueEntry) -> tuple[bool, str]:
        return int(entry.options.get("min_in_sync", 1)) >= 2, entry.name

    # Each move takes the first queue by (min_in_sync 2 last, its master's masters most, its
    # replica's members most, name). Within one (master, replica) pair only the first and last
    # of these differ, so each pair offers its queues in that order (a stack, best on top), and
    # a move looks at one queue per pair, not at the whole map.
    by_pair: dict[tuple[str, str], list[QueueEntry]] = {}
    for entry in cluster.queues.values():
        if entry.in_sync and entry.master in members and entry.replica in members:
            by_pair.setdefault((entry.master, entry.replica), []).append(entry)
    for stack in by_pair.values():
        stack.sort(key=last_of_pair, reverse=True)
    while members:
        low = min(members, key=lambda n: (members[n], n))
        best: tuple[tuple[bool, int, int, str], list[QueueEntry]] | None = None
        for (master, replica), stack in by_pair.items():
            if not stack or low in (master, replica) or members[replica] - members[low] < 2:
                continue
            in_sync_two, name = last_of_pair(stack[-1])
            key = (in_sync_two, -masters[master], -members[replica], name)
            if best is None or key < best[0]:
                best = (key, stack)
        if best is None:
            return changes
        entry = best[1].pop()
        members[entry.replica] -= 1
        members[low] += 1
        changes.append(ChangePair(entry.name, astuple(entry.pair), (entry.epoch + 1, entry.master, low, False),
                                  Reason.MOVE.value))
    return changes


def plan_rebalance(cluster: ClusterMap) -> list[str]:
    """Queues whose master should hand off to its replica so that masters spread evenly:
    from the node with most masters to its replica while that lowers the spread."""
    masters = cluster.masters_per_node()
    chosen: list[str] = []
    for name, entry in sorted(cluster.queues.items()):
        if entry.master not in masters or entry.replica not in masters or not entry.in_sync:
            continue
        if masters[entry.master] - masters[entry.replica] >= 2:
            masters[entry.master] -= 1
            masters[entry.replica] += 1
            chosen.append(name)
    return chosen
