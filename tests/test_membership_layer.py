"""The membership layer's node side: the codec of its frames and values, its durable state in
LMDB (qserver/storage/raft_store.py), the snapshot encoding of the cluster map, and the driver
(qserver/cluster/membership.py) on a virtual loop. The core itself
is tests/test_raft.py and tests/test_raft_simulation.py; real clusters run it in every
real-process test (tests/test_failover.py, tests/test_pairs.py, ...)."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.cluster.membership import RaftMembership, raft_limits, tick_ms
from qserver.storage.lmdb_store import Storage
from qserver.storage.raft_store import MemoryRaftStore, RaftStorage, RaftStore, storage_id_bytes
from qserver.transport.memory_peers import MemoryPeerNetwork
from replication.cluster_map import (
    AddNode,
    ChangePair,
    ClusterMap,
    CreateQueue,
    NodeState,
    PutClient,
    SetNodeState,
    decode_map,
    encode_map,
)
from replication.messages import MessageError
from replication.raft import PersistedState, Ready, bootstrap_state
from replication.raft_codec import (
    JoinRequest,
    ProposeRequest,
    ProposeResponse,
    decode_entry,
    decode_frame,
    decode_hard_state,
    decode_snapshot,
    encode_entry,
    encode_frame,
    encode_hard_state,
    encode_snapshot,
)
from replication.raft_messages import (
    PROTOCOL_VERSION,
    AppendRequest,
    AppendResponse,
    Configuration,
    Entry,
    EntryKind,
    HardState,
    Member,
    PreVoteRequest,
    PreVoteResponse,
    Snapshot,
    SnapshotRequest,
    VoteRequest,
    VoteResponse,
)
from tests.sim.virtual_loop import DelayedExecutor, InlineExecutor, VirtualTimeLoop

names = st.sampled_from(["n1", "n2", "n3", "n4", "n5"])
disks = st.binary(min_size=8, max_size=8)
counts = st.integers(min_value=0, max_value=2**40)


@st.composite
def configurations(draw: st.DrawFn) -> Configuration:
    nodes = draw(st.lists(names, unique=True, max_size=5))
    split = draw(st.integers(min_value=0, max_value=len(nodes)))
    members = [Member(node, draw(disks)) for node in nodes]
    return Configuration(frozenset(members[:split]), frozenset(members[split:]))


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    kind = draw(st.sampled_from(list(EntryKind)))
    if kind is EntryKind.CONFIGURATION:
        return Entry(draw(counts), draw(counts), kind, configuration=draw(configurations()))
    return Entry(draw(counts), draw(counts), kind, draw(st.binary(max_size=64)) if kind is EntryKind.COMMAND else b"")


snapshots = st.builds(Snapshot, counts, counts, configurations(), st.binary(max_size=64))
head = (counts, names, names, disks)
frames = st.one_of(
    st.builds(PreVoteRequest, *head, counts, counts), st.builds(PreVoteResponse, *head, st.booleans()),
    st.builds(VoteRequest, *head, counts, counts), st.builds(VoteResponse, *head, st.booleans()),
    st.builds(AppendRequest, *head, counts, counts, st.lists(entries(), max_size=4).map(tuple), counts),
    st.builds(AppendResponse, *head, st.booleans(), counts, counts, counts, counts),
    st.builds(SnapshotRequest, *head, snapshots),
    st.builds(JoinRequest, names, disks, st.booleans()),
    st.builds(ProposeRequest, names, counts, st.binary(max_size=64)),
    st.builds(ProposeResponse, names, counts, counts, counts, st.text(max_size=20)),
)


@settings(max_examples=300, deadline=None)
@given(frames)
def test_every_membership_frame_decodes_to_what_was_encoded(frame: object) -> None:
    assert decode_frame(encode_frame(frame)) == frame  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(entries(), snapshots, st.builds(HardState, counts, st.none() | names, counts))
def test_what_the_disk_holds_decodes_to_what_was_written(entry: Entry, snapshot: Snapshot, hard: HardState) -> None:
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_snapshot(encode_snapshot(snapshot)) == snapshot
    assert decode_hard_state(encode_hard_state(hard)) == hard


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb([]), msgpack.packb([PROTOCOL_VERSION + 1, 1, 1, "a", "b", b"d", 0, 0]),
    msgpack.packb([PROTOCOL_VERSION, 99]), msgpack.packb([PROTOCOL_VERSION, 1, -1, "a", "b", b"d", 0, 0]),
    msgpack.packb([PROTOCOL_VERSION, 1, 1, "a", "b", "not bytes", 0, 0]),
    msgpack.packb([PROTOCOL_VERSION, 5, 1, "a", "b", b"d", 0, 0, [[1, 1, 7, b"", None]], 0]),   # unknown entry kind
    msgpack.packb([PROTOCOL_VERSION, 5, 1, "a", "b", b"d", 0, 0, [[1, 1, 1, b"", None]], 0]),   # configuration missing
    msgpack.packb([PROTOCOL_VERSION, 7, 1, "a", "b", b"d", [1, 1, [[["n1", b"x"]], [["n1", b"y"]]], b""]]),  # twice
    msgpack.packb([PROTOCOL_VERSION, 20, "n2", b"disk"]),
    msgpack.packb([PROTOCOL_VERSION, 2, 1, "a", "b", b"d", 1]),            # granted must be a bool
])
def test_a_malformed_membership_frame_is_refused_with_a_message_error(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode_frame(data)


# --- the durable state ------------------------------------------------------------------------
def configuration(*nodes: str) -> Configuration:
    return Configuration(frozenset(Member(node, storage_id_bytes(i)) for i, node in enumerate(nodes, 1)))


def ready(**fields: object) -> Ready:
    values: dict[str, object] = {"hard_state": None, "install_snapshot": None, "compaction": None,
                                 "truncate_from": None, "entries": (), "messages": (), "committed_entries": ()}
    values.update(fields)
    return Ready(**values)  # type: ignore[arg-type]


def command(index: int, term: int) -> Entry:
    return Entry(index, term, EntryKind.COMMAND, f"c{index}".encode())


@pytest.fixture(params=["lmdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> RaftStorage:
    """The same contract for the node's store and its in-memory twin (the simulation's)."""
    if request.param == "memory":
        return MemoryRaftStore()
    return RaftStore(Storage(tmp_path / "lmdb", node_id="n1"))


def test_the_founding_node_starts_from_a_configuration_of_itself_alone(store: RaftStorage) -> None:
    assert store.is_empty()
    store.bootstrap("n1", 7)
    assert not store.is_empty()
    assert store.load() == bootstrap_state(Configuration(frozenset({Member("n1", storage_id_bytes(7))})))
    with pytest.raises(RuntimeError):
        store.bootstrap("n1", 7)           # never twice: a second founding would split the cluster


def test_the_store_keeps_entries_truncates_a_suffix_with_its_replacement_and_compacts_below_a_snapshot(
        store: RaftStorage) -> None:
    store.bootstrap("n1", 1)
    store.persist(ready(hard_state=HardState(2, "n1", 1), entries=tuple(command(i, 2) for i in range(2, 8))))
    assert [e.index for e in store.load().entries] == list(range(1, 8))
    # A new leader's entries replace 5..7 in the same transaction.
    store.persist(ready(truncate_from=5, entries=(command(5, 3), command(6, 3)), hard_state=HardState(3, None, 4)))
    loaded = store.load()
    assert [(e.index, e.term) for e in loaded.entries] == [(1, 1), (2, 2), (3, 2), (4, 2), (5, 3), (6, 3)]
    assert loaded.hard_state == HardState(3, None, 4)
    snapshot = Snapshot(4, 2, configuration("n1"), encode_map(ClusterMap(version=3)))
    store.persist(ready(compaction=snapshot))
    loaded = store.load()
    assert loaded.snapshot == snapshot and [e.index for e in loaded.entries] == [5, 6]


def test_an_installed_snapshot_replaces_the_whole_log(store: RaftStorage) -> None:
    store.bootstrap("n1", 1)
    store.persist(ready(entries=tuple(command(i, 1) for i in range(2, 5))))
    snapshot = Snapshot(40, 6, configuration("n1", "n2", "n3"), b"map")
    store.persist(ready(install_snapshot=snapshot, hard_state=HardState(6, None, 40)))
    assert store.load() == PersistedState(HardState(6, None, 40), snapshot, ())


def test_the_cluster_map_survives_its_snapshot_encoding() -> None:
    cluster = ClusterMap()
    for command_ in (AddNode("n1", "http://a", True, 5), AddNode("n2", "http://b", False, 6),
                     CreateQueue("orders", {"strength": "full"}, "n1", "n2", 1),
                     ChangePair("orders", (1, "n1", "n2", True), (2, "n2", "n1", True), "handoff"),
                     PutClient("svc", {"grants": ["produce:*"]})):
        cluster.apply(command_)
    assert decode_map(encode_map(cluster)) == cluster
    assert decode_map(b"") == ClusterMap()


# --- the driver (qserver/cluster/membership.py) on a virtual loop ------------------------------------------
class DriverCluster:
    """Three `RaftMembership` drivers over an in-memory network on a virtual-time loop, n1 the
    founder, n2 and n3 joining: the node side without engines, deterministic."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop
        self.network = MemoryPeerNetwork()
        self.disks: dict[str, Executor] = {}   # each Ready durable at once unless a test swaps one
        self.members: dict[str, RaftMembership] = {}
        self.transports: dict[str, Any] = {}
        for number, node_id in enumerate(("n1", "n2", "n3"), start=1):
            store = MemoryRaftStore()
            if node_id == "n1":
                store.bootstrap(node_id, number)
            self.disks[node_id] = InlineExecutor()
            member = RaftMembership(node_id, number, store, voters={"n1", "n2", "n3"}, send=self._sender(node_id),
                                    writer=functools.partial(self.disks.__getitem__, node_id), loop=loop,
                                    limits=raft_limits((200, 400), 50),
                                    tick_s=tick_ms(50) / 1000, seed=number)
            self.members[node_id] = member
            self.transports[node_id] = self.network.transport(node_id, member.on_frame)

    def _sender(self, node_id: str) -> Callable[[str, bytes], bool]:
        return lambda peer, data: self.transports[node_id].send(peer, data)

    async def start(self) -> None:
        for node_id, member in self.members.items():
            member.start()
            await self.transports[node_id].start()

    async def until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = self.loop.time() + timeout_s
        while not predicate():
            assert self.loop.time() < deadline, f"timed out waiting for {what}: {self.status()}"
            await asyncio.sleep(0.01)

    def status(self) -> dict[str, dict[str, Any]]:
        return {node_id: member.status() for node_id, member in self.members.items()}

    def leader(self) -> str | None:
        leaders = [node_id for node_id, member in self.members.items() if member.is_leader()]
        return leaders[0] if len(leaders) == 1 else None

    async def propose(self, via: str, command: Any) -> Any:
        done: asyncio.Future[Any] = self.loop.create_future()

        def finish(outcomes: Any) -> None:
            if not done.done():
                done.set_result(outcomes)
        self.members[via].propose(command, finish)
        return await done

    async def stop(self) -> None:
        for node_id, member in self.members.items():
            member.stop()
            await self.transports[node_id].stop()


def test_a_node_removed_from_the_map_leaves_the_raft_configuration_even_when_it_leads() -> None:
    """`qctl nodes remove` of the node that leads: the leader removes its own member and steps
    down once that commits, the other two elect a leader, and the removed node's requests to
    join again are ignored (a removed id is never reused)."""
    loop = VirtualTimeLoop()

    async def main() -> None:
        cluster = DriverCluster(loop)
        await cluster.start()
        try:
            await cluster.until(lambda: all(s.get("voters") == ["n1", "n2", "n3"] for s in cluster.status().values()),
                                10.0, "three voters")
            await cluster.until(lambda: cluster.leader() is not None, 5.0, "a leader")
            leader = cluster.leader()
            assert leader is not None
            for node_id in ("n1", "n2", "n3"):
                await cluster.propose(leader, AddNode(node_id, f"http://{node_id}", True, 0))
            outcomes = await cluster.propose(leader, SetNodeState(leader, NodeState.REMOVED.value))
            assert outcomes[0].applied, outcomes
            rest = sorted({"n1", "n2", "n3"} - {leader})
            await cluster.until(lambda: all(cluster.members[n].status()["voters"] == rest for n in rest),
                                5.0, f"{leader} out of the configuration")
            await cluster.until(lambda: cluster.leader() in rest, 5.0, "a leader among the others")
            for _ in range(200):             # 2 s: many join periods of the removed node
                await asyncio.sleep(0.01)
                for node_id in rest:
                    status = cluster.members[node_id].status()
                    assert status["voters"] == rest and status["learners"] == [], status
            assert await cluster.propose(rest[0], AddNode("n9", "http://n9", False, 0)), "the two commit alone"
        finally:
            await cluster.stop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_leader_whose_disk_or_process_stalls_stops_leading_before_another_can_be_elected() -> None:
    """The leader lease counts the time its core has not seen yet: ticks waiting while a Ready
    is persisted behind a stalled disk, and those a paused process's timer passed over (it
    fires once, late). At every moment at most one node says it leads (`is_leader`, which
    grants node leases and decides failovers), though the stalled leader's core, fed no
    ticks, still counts its lease as held."""
    loop = VirtualTimeLoop()

    async def main() -> None:
        cluster = DriverCluster(loop)
        await cluster.start()

        async def watch(seconds: float) -> None:
            for _ in range(int(seconds / 0.005)):
                await asyncio.sleep(0.005)
                leading = [n for n, member in cluster.members.items() if member.is_leader()]
                assert len(leading) <= 1, f"{leading} lead at once at {loop.time():.3f}: {cluster.status()}"
        try:
            await cluster.until(lambda: all(s.get("voters") == ["n1", "n2", "n3"] for s in cluster.status().values()),
                                10.0, "three voters")
            await cluster.until(lambda: cluster.leader() is not None, 5.0, "a leader")
            stalled = cluster.leader()
            assert stalled is not None
            member = cluster.members[stalled]
            disk = cluster.disks[stalled] = DelayedExecutor(loop, lambda: 0)
            disk.pause()
            member.propose(AddNode("n9", "http://n9", False, 0), lambda outcomes: None)
            await watch(1.0)
            assert cluster.leader() not in (None, stalled), f"the others elected a leader meanwhile: {cluster.status()}"
            core = member._core
            assert core is not None and core.is_leader and core.lease_remaining_ticks > 0, \
                "the stalled core still counts its lease as held: what is_leader must not believe"
            disk.resume()
            await cluster.until(lambda: cluster.leader() not in (None, stalled) and not member.is_leader(),
                                5.0, "the stalled leader steps down")

            # A paused process: its timers stop and fire late when it resumes.
            await cluster.until(lambda: cluster.leader() is not None, 5.0, "a leader")
            paused = cluster.leader()
            assert paused is not None
            member = cluster.members[paused]
            assert member._ticker is not None
            member._ticker.cancel()
            for other in cluster.members:
                if other != paused:
                    cluster.network.partition(paused, other)
            await watch(1.0)
            member._tick()               # the late timer of the resumed process
            assert not member.is_leader()
        finally:
            await cluster.stop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
