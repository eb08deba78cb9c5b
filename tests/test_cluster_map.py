"""The cluster map's cost per command (issue 31, item 3): one command costs what it changes,
not the size of the map. `MapIndex` (the queues each node masters and replicates, the names in
order, ...) is kept by `apply` beside the dicts; these tests check that it always equals the
index rebuilt from the dicts, that the decisions read from it equal the plain walks they
replace, and that applying a command or placing a queue on a large map walks no queue."""
from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from replication import cluster_map as cm
from replication.cluster_map import (
    AddNode,
    ChangePair,
    ChangePairs,
    ClusterMap,
    CreateMacro,
    CreateQueue,
    DeleteChannel,
    DeleteForward,
    DeleteMacro,
    DeleteQueue,
    MapIndex,
    NodeState,
    PutChannel,
    PutClient,
    PutForward,
    PutMacroMember,
    PutRecipient,
    RemoveMacroMember,
    RemoveRecipient,
    SetNodeState,
    astuple,
    choose_pair,
    decode_map,
    encode_command,
    encode_map,
    plan_failover,
    plan_member_moves,
    plan_replacements,
)

NODES = ["n1", "n2", "n3", "n4", "n5"]


# --- the walks the index replaced: the reference the decisions must equal ---------------------------
def walked_counts(cluster: ClusterMap) -> tuple[dict[str, int], dict[str, int]]:
    masters = {node: 0 for node in cluster.live_nodes()}
    members = dict(masters)
    for entry in cluster.queues.values():
        if entry.master in masters:
            masters[entry.master] += 1
        for member in (entry.master, entry.replica):
            if member in members:
                members[member] += 1
    return masters, members


def walked_failover(cluster: ClusterMap, lapsed: set[str]) -> tuple[list[bytes], list[str]]:
    changes, stuck = [], []
    for name, entry in sorted(cluster.queues.items()):
        if entry.master not in lapsed:
            continue
        replica = cluster.nodes.get(entry.replica)
        if not entry.in_sync or entry.replica in lapsed or replica is None \
                or replica.state not in (NodeState.UP, NodeState.DRAINING):
            stuck.append(name)
            continue
        changes.append(encode_command(ChangePair(name, astuple(entry.pair),
                                                 (entry.epoch + 1, entry.replica, entry.master, False), "failover")))
    return changes, stuck


def walked_replacements(cluster: ClusterMap, gone: set[str]) -> list[bytes]:
    changes = []
    members = walked_counts(cluster)[1]
    for name, entry in sorted(cluster.queues.items()):
        if entry.replica not in gone or entry.master in gone:
            continue
        candidates = [n for n in cluster.live_nodes() if n not in (entry.master, entry.replica)]
        if candidates:
            target = min(candidates, key=lambda n: (members[n], n))
            members[target] += 1
            changes.append(encode_command(ChangePair(name, astuple(entry.pair),
                                                     (entry.epoch + 1, entry.master, target, False), "move")))
    return changes


def walked_member_moves(cluster: ClusterMap) -> list[bytes]:
    masters, members = walked_counts(cluster)
    changes: list[bytes] = []
    moved: set[str] = set()
    while members:
        low = min(members, key=lambda n: (members[n], n))
        candidates = [entry for name, entry in cluster.queues.items()
                      if name not in moved and entry.in_sync and entry.master in members
                      and entry.replica in members and low not in (entry.master, entry.replica)
                      and members[entry.replica] - members[low] >= 2]
        if not candidates:
            return changes
        entry = min(candidates, key=lambda e: (int(e.options.get("min_in_sync", 1)) >= 2, -masters[e.master],
                                               -members[e.replica], e.name))
        members[entry.replica] -= 1
        members[low] += 1
        moved.add(entry.name)
        changes.append(encode_command(ChangePair(entry.name, astuple(entry.pair),
                                                 (entry.epoch + 1, entry.master, low, False), "move")))
    return changes


# --- random command streams -----------------------------------------------------------------------
def random_command(rng: random.Random, cluster: ClusterMap) -> Any:
    queue = rng.choice([f"q{i}" for i in range(10)] + ["channel:c1"])
    entry = cluster.queues.get(queue)
    roll = rng.random()
    if roll < 0.05:
        return AddNode(rng.choice(NODES), "http://x", True, rng.choice([0, 1, 2]))
    if roll < 0.10:
        return SetNodeState(rng.choice(NODES), rng.choice(["up", "draining", "down", "removed"]),
                            rng.choice([None, "up", "down"]))
    if roll < 0.32:
        master, replica = rng.sample(NODES, 2)
        return CreateQueue(queue, {"type": rng.choice(["a", "b"]), "min_in_sync": rng.choice([1, 2]),
                                   "strength": rng.choice(["full", "producer"])}, master, replica, rng.randint(1, 2))
    if roll < 0.40:
        return DeleteQueue(queue, entry.incarnation if entry is not None and rng.random() < 0.8 else 3)
    if roll < 0.60:
        if entry is not None and rng.random() < 0.8:       # mostly against the pair as it is
            epoch, master, replica, in_sync = astuple(entry.pair)
            other = rng.choice([n for n in NODES if n not in (master, replica)])
            new = rng.choice([(epoch + 1, replica, master, False, "handoff"), (epoch + 1, master, other, False, "move"),
                              (epoch + 1, replica, other, False, "failover"), (epoch, master, replica, not in_sync,
                                                                                 "in_sync")])
            change = ChangePair(queue, (epoch, master, replica, in_sync), new[:4], new[4])  # type: ignore[arg-type]
        else:
            epoch = rng.randint(1, 3)
            (master, replica), (new_master, new_replica) = rng.sample(NODES, 2), rng.sample(NODES, 2)
            change = ChangePair(queue, (epoch, master, replica, rng.random() < 0.5),
                                (epoch + rng.randint(0, 1), new_master, new_replica, rng.random() < 0.5),
                                rng.choice(["handoff", "failover", "unclean", "in_sync", "move", "restarted_master"]))
        return change if rng.random() < 0.6 else ChangePairs((change, change))
    if roll < 0.68:
        return PutRecipient(rng.choice(["r1", "r2"]), queue, rng.choice(["ok", "fault", "defunct"]), 1, "")
    if roll < 0.70:
        return RemoveRecipient(rng.choice(["r1", "r2"]))
    if roll < 0.75:
        return CreateMacro(rng.choice(["m1", "m2"]), "round_robin", "prioritized")
    if roll < 0.82:
        return PutMacroMember(rng.choice(["m1", "m2"]), queue, rng.randint(0, 9), 1)
    if roll < 0.85:
        return RemoveMacroMember(rng.choice(["m1", "m2"]), queue)
    if roll < 0.87:
        return DeleteMacro(rng.choice(["m1", "m2"]))
    if roll < 0.91:
        return PutForward(rng.choice(["f1", "f2"]), queue, "elsewhere", (), "", "", 0, "")
    if roll < 0.93:
        return DeleteForward(rng.choice(["f1", "f2"]))
    if roll < 0.97:
        master, replica = rng.sample(NODES, 2)
        return PutChannel("c1", "latest", 0.0, master, replica, rng.randint(1, 2))
    return DeleteChannel("c1")


def started_map() -> ClusterMap:
    cluster = ClusterMap()
    for node in NODES:
        cluster.apply(AddNode(node, f"http://{node}"))
    return cluster


@pytest.mark.parametrize("seed", range(12))
def test_the_index_follows_every_command_and_the_decisions_equal_the_walks(seed: int) -> None:
    rng = random.Random(seed)
    cluster = started_map()
    for _ in range(250):
        cluster.apply(random_command(rng, cluster))
        assert cluster.index == MapIndex.rebuilt(cluster)
        masters, members = walked_counts(cluster)
        assert (cluster.masters_per_node(), cluster.members_per_node()) == (masters, members)
        for nodes in (set(), {"n1"}, {"n2", "n4"}, {"n9"}):
            changes, stuck = plan_failover(cluster, nodes)
            assert ([encode_command(c) for c in changes], stuck) == walked_failover(cluster, nodes)
            assert [encode_command(c) for c in plan_replacements(cluster, nodes)] == walked_replacements(cluster, nodes)
        assert [encode_command(c) for c in plan_member_moves(cluster)] == walked_member_moves(cluster)
    decoded = decode_map(encode_map(cluster))
    assert decoded == cluster and decoded.index == cluster.index and encode_map(decoded) == encode_map(cluster)
    assert cluster.copy().index == cluster.index


def test_a_new_node_gets_the_same_moves_as_the_walk_chose() -> None:
    rng = random.Random(7)
    cluster = ClusterMap()
    for node in NODES[:4]:
        cluster.apply(AddNode(node, f"http://{node}"))
    for number in range(300):
        master, replica = rng.sample(NODES[:4], 2)
        cluster.apply(CreateQueue(f"q{number:03d}", {"min_in_sync": rng.choice([1, 1, 2])}, master, replica, 1))
    cluster.apply(AddNode("n5", "http://n5"))
    moves = [encode_command(c) for c in plan_member_moves(cluster)]
    assert len(moves) > 100 and moves == walked_member_moves(cluster)


# --- one command on a large map walks no queue -----------------------------------------------------
class NoWalk(dict):  # type: ignore[type-arg]
    """The map's queues, refusing any walk over them; reads by name are counted."""
    reads = 0

    def _walk(self, *args: Any) -> Any:
        raise AssertionError("walked every queue of the map")

    __iter__ = keys = values = items = _walk  # type: ignore[assignment]

    def __getitem__(self, name: str) -> Any:
        NoWalk.reads += 1
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        NoWalk.reads += 1
        return super().get(name, default)


def large_map(queues: int) -> ClusterMap:
    cluster = started_map()
    for number in range(queues):
        pair = choose_pair(cluster)
        assert pair is not None
        cluster.apply(CreateQueue(f"q{number:05d}", {"strength": "full", "dead_letter": True}, *pair, number + 1))
    return cluster


def test_one_command_on_a_large_map_reads_only_what_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = large_map(3000)
    before = cluster.members_per_node()
    cluster.queues = NoWalk(cluster.queues)

    def no_copy(*args: Any) -> Any:
        raise AssertionError("copied the map")
    monkeypatch.setattr(cm.copy, "deepcopy", no_copy)
    NoWalk.reads = 0
    pair = choose_pair(cluster)                           # placement: from the index's counts
    assert pair is not None and NoWalk.reads == 0
    assert cluster.apply(CreateQueue("new", {"strength": "full"}, *pair, 99_999))[0].applied
    entry = cluster.queues["q01234"]
    handoff = ChangePair(entry.name, astuple(entry.pair), (entry.epoch + 1, entry.replica, entry.master, False),
                         "handoff")
    assert cluster.apply(handoff)[0].applied
    assert cluster.apply(PutRecipient("worker", "new", "fault", 5, "idle"))[0].applied
    assert cluster.apply(DeleteQueue("new", 99_999))[0].applied and "worker" not in cluster.recipients
    assert not cluster.apply(SetNodeState("n3", "removed"))[0].applied        # it holds members
    assert plan_failover(cluster, set()) == ([], []) and plan_replacements(cluster, set()) == []
    assert NoWalk.reads <= 10
    assert cluster.members_per_node() == before and cluster.summary()["counts"]["out_of_sync"] == 1
    assert cluster.queue_names()[:2] == ["q00000", "q00001"] and len(cluster.queue_names()) == 3000


def test_a_failover_plan_reads_the_lapsed_nodes_queues_only() -> None:
    cluster = large_map(1000)
    mastered = {name for name, entry in dict.items(cluster.queues) if entry.master == "n2"}
    cluster.queues = NoWalk(cluster.queues)
    NoWalk.reads = 0
    changes, stuck = plan_failover(cluster, {"n2"})
    assert {change.name for change in changes} == mastered and stuck == []
    assert NoWalk.reads == len(mastered)


def test_a_removed_client_is_remembered_in_the_map_and_its_snapshots() -> None:
    """A node that catches up by a snapshot learns which clients were removed while it was
    away (issue 32: a revoked key kept working on a node that missed the removal)."""
    cluster = ClusterMap()
    record = {"id": "c-1", "name": "app", "public_key": "k", "grants": [], "created_ms": 0}
    cluster.apply(PutClient("c-1", record))
    cluster.apply(PutClient("c-2", {**record, "id": "c-2", "name": "other"}))
    cluster.apply(PutClient("c-1", None))
    assert cluster.clients.keys() == {"c-2"} and cluster.revoked_clients == {"c-1": 3}
    cluster.apply(PutClient("c-9", None))              # never existed: nothing to remember
    decoded = decode_map(encode_map(cluster))
    assert decoded.revoked_clients == {"c-1": 3} and decoded == cluster
    old_layout = msgpack.unpackb(encode_map(cluster), raw=False)[:9]     # a snapshot from before
    assert decode_map(msgpack.packb(old_layout, use_bin_type=True)).revoked_clients == {}


def test_the_map_remembers_a_bounded_number_of_removed_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cm, "REVOKED_CLIENTS_MAX", 3)
    cluster = ClusterMap()
    for number in range(5):
        cluster.apply(PutClient(f"c-{number}", {"id": f"c-{number}"}))
        cluster.apply(PutClient(f"c-{number}", None))
    assert list(cluster.revoked_clients) == ["c-2", "c-3", "c-4"], "the oldest are forgotten first"
