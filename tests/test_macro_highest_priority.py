"""The macro consumer policy `highest_priority` (issue 34): the highest-priority ready message of
any member, the oldest first among equals, across members on different masters; a value release
0.1.0 refuses, so a node proposes it only at cluster feature level 2 (wire/versions.py).

Pure units of the choice (client/macro_decide.py), the receive loop against in-memory members
(what it leases, what it delivers when a member fails), the answer of a 0.1.0 node, and real
3-node clusters: the receive order over members mastered on n1 and n2, acks, the gate at level
1 (E_FEATURE_DISABLED, nothing created) and, once the cluster is finalized, the whole path."""
from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, Client
from client.macro import CONSUMER_POLICIES, MacroQueue, cluster_too_old
from client.macro_decide import Head, Pick, chronological_order, highest_priority_order, highest_priority_pick
from qserver.dev.devcluster import LocalCluster
from qserver.features.macro.api import require_macro_features
from replication.cluster_map import (
    ClusterMap,
    ConsumerPolicy,
    CreateMacro,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
    macro_policy_problem,
)
from tests import upgrade_support
from tests.support import RawApi, error_code, raw_session
from tests.test_client_integration import run_qctl
from wire.errors import E_FEATURE_DISABLED, E_INVALID_OPTION, E_UNAVAILABLE, QueueError

REPOSITORY = Path(__file__).resolve().parent.parent
RELEASE_0_1_0 = next(r["commit"] for r in upgrade_support.releases() if r["version"] == "0.1.0")   # knows no highest_priority
# a on n1, b on n2: the two members' masters on different nodes.
PLACEMENT = {"a": ["n1", "n2"], "b": ["n2", "n3"]}


# --- the choice (pure) -------------------------------------------------------------------------
def _head(priority: int, enqueued_ms: int, message_id: int = 1) -> Head:
    return Head(priority, enqueued_ms, message_id)


def test_the_highest_priority_head_of_any_member_comes_first_then_the_oldest() -> None:
    members = ["a", "b", "c"]
    heads = {"a": _head(4, 100), "b": _head(9, 300), "c": _head(7, 50)}
    assert highest_priority_order(members, heads) == ["b", "c", "a"]
    # equal priorities: the oldest enqueue first, whatever the member order or message ids
    heads = {"a": _head(5, 300, 1), "b": _head(5, 100, 40), "c": _head(5, 200, 2)}
    assert highest_priority_order(members, heads) == ["b", "c", "a"]
    # equal in both: member order
    assert highest_priority_order(["c", "a", "b"], {"a": _head(5, 100), "b": _head(5, 100), "c": _head(5, 100)}) \
        == ["c", "a", "b"]
    # chronological looks at age alone
    assert chronological_order(members, {"a": _head(9, 300), "b": _head(0, 100), "c": None}) == ["b", "a"]


def test_empty_and_unknown_members_are_left_out_and_a_lone_member_gives_the_whole_batch() -> None:
    members = ["a", "b", "c"]
    assert highest_priority_order(members, {"a": None, "b": None}) == []
    assert highest_priority_pick(members, {"a": None, "b": None, "c": None}, 10) is None
    assert highest_priority_pick(members, {"a": _head(1, 5)}, 0) is None
    # another member has a ready message: one lease at a time (its head may outrank a's next)
    assert highest_priority_pick(members, {"a": _head(3, 10), "b": _head(1, 5), "c": None}, 10) == Pick("a", 1)
    # a alone holds ready messages: its own order is the macro queue's, so all that is wanted
    assert highest_priority_pick(members, {"a": _head(3, 10), "b": None, "c": None}, 10) == Pick("a", 10)
    assert Head.of(None) is None and Head.of({}) is None
    assert Head.of({"id": 7, "priority": 9, "enqueued_ms": 123}) == Head(9, 123, 7)


def test_the_map_knows_the_policy_and_keeps_it_through_encoding() -> None:
    assert "highest_priority" in CONSUMER_POLICIES
    assert tuple(p.value for p in ConsumerPolicy) == CONSUMER_POLICIES
    assert macro_policy_problem("round_robin", "highest_priority", "response_time") == ""
    assert "is not one of" in macro_policy_problem("round_robin", "highest", "response_time")
    command = CreateMacro("m", "all", "highest_priority")
    assert decode_command(encode_command(command)) == command
    cluster = ClusterMap()
    refused = cluster.apply(command)[0]        # below its level every copy of the map refuses it alike
    assert not refused.applied and "feature level 2" in refused.reason and "m" not in cluster.macros
    cluster.feature_level = 2
    assert cluster.apply(command)[0].reason == "created"
    assert decode_map(encode_map(cluster)).macros["m"].consumer == "highest_priority"


def test_the_gate_refuses_below_level_2_and_passes_at_it() -> None:
    @dataclass
    class Finalized:
        feature_level: int

    with pytest.raises(QueueError) as refused:
        require_macro_features(ClusterMap(), "highest_priority")     # a map that never recorded a level: 1
    assert refused.value.kind is E_FEATURE_DISABLED and "macro_highest_priority" in refused.value.message
    require_macro_features(ClusterMap(), "chronological")              # the policies of 0.1.0 need nothing
    require_macro_features(Finalized(2), "highest_priority")           # type: ignore[arg-type]
    with pytest.raises(QueueError):
        require_macro_features(Finalized(1), "highest_priority")       # type: ignore[arg-type]


def _release_0_1_0_refusal() -> str:
    """What release 0.1.0's own code says of `highest_priority` (its replication/map_entries.py
    from the repository's history, imported on its own: it imports only the standard library)."""
    why = upgrade_support.skip_reason(RELEASE_0_1_0)
    if why is not None:
        pytest.skip(why)
    found = subprocess.run(["git", "-C", str(REPOSITORY), "show", f"{RELEASE_0_1_0}:replication/map_entries.py"],
                           capture_output=True, text=True, check=True)
    spec = importlib.util.spec_from_loader("map_entries_0_1_0", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the class is made
    try:
        exec(compile(found.stdout, "map_entries_0_1_0", "exec"), module.__dict__)
        problem: str = module.macro_policy_problem("round_robin", "highest_priority", "response_time")
    finally:
        del sys.modules[spec.name]
    return problem


def test_a_client_told_off_by_a_0_1_0_node_says_the_cluster_is_too_old() -> None:
    problem = _release_0_1_0_refusal()
    assert problem                          # 0.1.0 refuses the value ...
    answered = QueueError(E_INVALID_OPTION, problem)     # ... as put_macro answers it (400 E_INVALID_OPTION)
    too_old = cluster_too_old(answered, "highest_priority")
    assert too_old is not None and too_old.kind is E_FEATURE_DISABLED
    assert "too old" in too_old.message and "qctl cluster finalize" in too_old.message
    # anything else stays as it was
    assert cluster_too_old(answered, "chronological") is None
    assert cluster_too_old(QueueError(E_INVALID_OPTION, "'sometimes' is not one of all, round_robin"),
                           "highest_priority") is None
    assert cluster_too_old(QueueError(E_UNAVAILABLE, problem), "highest_priority") is None


# --- the receive loop against in-memory members ----------------------------------------------
@dataclass
class _Message:
    queue: str
    payload: bytes
    priority: int


@dataclass
class _Members:
    """Members as in-memory queues: a head answer and a lease, counted."""
    ready: dict[str, list[tuple[int, int, int, bytes]]]     # queue -> (priority, enqueued_ms, id, payload)
    leases: list[tuple[str, int]] = field(default_factory=list)
    failing: set[str] = field(default_factory=set)
    stolen: set[str] = field(default_factory=set)           # the next lease there finds nothing

    def _ordered(self, queue: str) -> list[tuple[int, int, int, bytes]]:
        return sorted(self.ready[queue], key=lambda m: (-m[0], m[2]))

    async def head(self, queue: str, wait_s: float) -> dict[str, Any] | None:
        if queue in self.failing:
            raise QueueError(E_UNAVAILABLE, f"{queue} cannot be reached")
        ordered = self._ordered(queue)
        return {"priority": ordered[0][0], "enqueued_ms": ordered[0][1], "id": ordered[0][2]} if ordered else None

    async def receive(self, queue: str, max_messages: int = 1, wait_s: float = 0.0,
                      visibility_timeout_s: float | None = None) -> list[_Message]:
        if queue in self.failing:
            raise QueueError(E_UNAVAILABLE, f"{queue} cannot be reached")
        self.leases.append((queue, max_messages))
        if queue in self.stolen:
            self.stolen.discard(queue)
            return []
        taken = self._ordered(queue)[:max_messages]
        for message in taken:
            self.ready[queue].remove(message)
        return [_Message(queue, payload, priority) for priority, _, _, payload in taken]

    async def refresh_placement(self, queue: str | None = None) -> None:
        return None

    def http_for(self, queue: str) -> _Members:
        return self


def _macro(members: _Members) -> MacroQueue:
    definition = {"name": "m", "producer": "round_robin", "consumer": "highest_priority",
                  "members": [{"queue": queue} for queue in members.ready]}
    return MacroQueue(members, definition, members)  # type: ignore[arg-type]


def test_a_batch_follows_priority_then_age_across_members_and_leases_only_what_it_delivers() -> None:
    members = _Members({
        "a": [(4, 10, 1, b"a4-10"), (9, 40, 2, b"a9-40"), (4, 60, 3, b"a4-60")],
        "b": [(9, 20, 1, b"b9-20"), (4, 30, 2, b"b4-30"), (0, 5, 3, b"b0-5")],
        "c": [],
    })
    received = asyncio.run(_macro(members).receive(10, 0.0, None))
    assert [m.payload for m in received] == [b"b9-20", b"a9-40", b"a4-10", b"b4-30", b"a4-60", b"b0-5"]
    # one lease per message while two members had some; the last member alone: the rest at once
    assert members.leases == [("b", 1), ("a", 1), ("a", 1), ("b", 1), ("a", 1), ("b", 5)]
    assert not members.ready["a"] and not members.ready["b"]


def test_a_failing_member_is_passed_over_and_what_was_leased_is_delivered() -> None:
    members = _Members({"a": [(9, 10, 1, b"a9"), (1, 20, 2, b"a1")], "b": [(5, 15, 1, b"b5")]})
    macro = _macro(members)
    members.stolen.add("a")          # another consumer takes a's head between the look and the lease
    first = asyncio.run(macro.receive(3, 0.0, None))
    # a sits the batch out after the empty answer; b's message comes, and the batch ends there
    assert [m.payload for m in first] == [b"b5"]
    assert [m.payload for m in asyncio.run(macro.receive(3, 0.0, None))] == [b"a9", b"a1"]
    members.ready["a"] += [(7, 30, 3, b"a7")]
    members.ready["b"] += [(8, 31, 2, b"b8")]
    members.failing.add("b")         # b fails at its head: a's messages still come
    assert [m.payload for m in asyncio.run(macro.receive(5, 0.0, None))] == [b"a7"]
    members.failing.update({"a", "b"})
    with pytest.raises(QueueError) as failed:        # nothing can serve: the error, not an empty wait
        asyncio.run(macro.receive(1, 0.2, None))
    assert failed.value.kind is E_UNAVAILABLE
    with pytest.raises(QueueError) as bad:
        asyncio.run(macro.receive(0, 0.0, None))
    assert bad.value.kind is E_INVALID_OPTION


# --- real clusters ---------------------------------------------------------------------------
# (priority, member): enqueued in this order, a few ms apart, so ages differ across masters too
MIXED = [(4, "a"), (9, "b"), (4, "b"), (9, "a"), (0, "a"), (7, "b"), (4, "a"), (9, "b"), (7, "a")]


def _expected_order() -> list[bytes]:
    numbered = [(priority, number, f"{queue}{number}p{priority}".encode()) for number, (priority, queue)
                in enumerate(MIXED)]
    return [payload for _, _, payload in sorted(numbered, key=lambda m: (-m[0], m[1]))]


async def _fill(client: AsyncClient) -> None:
    for number, (priority, queue) in enumerate(MIXED):
        await client.enqueue(queue, f"{queue}{number}p{priority}".encode(), priority=priority)
        await asyncio.sleep(0.004)        # distinct enqueue times (ms) on the two masters


def _sync_create(cluster: Any) -> str:
    """The sync client's create of a `highest_priority` macro queue: the code it raises."""
    with Client(cluster.urls["n2"], cluster.credentials_path) as client:
        try:
            client.create_macro("hp", "round_robin", "highest_priority")
        except QueueError as error:
            return error.code
    return "created"


@pytest.mark.asyncio
async def test_a_cluster_of_release_0_1_0_is_named_too_old_and_keeps_nothing(tmp_path: Path) -> None:
    """Three nodes of release 0.1.0 (its `git worktree`, run with this interpreter) answer this
    client's create with E_INVALID_OPTION; the client says the cluster is too old for the policy."""
    why = upgrade_support.skip_reason(RELEASE_0_1_0)
    if why is not None:
        pytest.skip(why)
    with upgrade_support.release_tree(RELEASE_0_1_0, tmp_path / "tree-0.1.0") as tree:
        cluster = LocalCluster(tmp_path / "old", 3, {}, code=tree, tls=False)
        try:
            cluster.start_all()
            async with raw_session() as session, session.get(cluster.urls["n1"] + "/healthz") as answer:
                assert "release" not in await answer.json()         # 0.1.0 names none
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
                with pytest.raises(QueueError) as refused:
                    await client.create_macro("hp", "round_robin", "highest_priority")
                assert refused.value.kind is E_FEATURE_DISABLED, refused.value
                assert "too old" in refused.value.message and "is not one of" in refused.value.message
                created = await client.create_macro("plain", "round_robin", "chronological")   # 0.1.0's own
                assert created["consumer"] == "chronological"
                assert [m["name"] for m in await client.list_macros()] == ["plain"]
            code, document, _ = await asyncio.to_thread(run_qctl, cluster, "macro", "create", "hp",
                                                        "--consumer", "highest_priority")
            assert code == 1 and document["error"]["code"] == "E_FEATURE_DISABLED", document
        finally:
            cluster.kill_all()


@pytest.mark.asyncio
async def test_highest_priority_across_two_masters_gated_by_the_feature_level(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        for queue in PLACEMENT:
            await client.create_queue(queue, strength="full")
        described = {q["name"]: q["master"] for q in await client.list_queues()}
        assert (described["a"], described["b"]) == ("n1", "n2")

        # Level 1 (a map that never recorded one): refused by every door, nothing created.
        with pytest.raises(QueueError) as refused:
            await client.create_macro("hp", "round_robin", "highest_priority")
        assert refused.value.kind is E_FEATURE_DISABLED, refused.value
        code, document, _ = await asyncio.to_thread(run_qctl, cluster, "macro", "create", "hp",
                                                    "--consumer", "highest_priority")
        assert code == 1 and document["error"]["code"] == "E_FEATURE_DISABLED", document
        assert await asyncio.to_thread(_sync_create, cluster) == "E_FEATURE_DISABLED"
        async with raw_session() as session:
            api = RawApi.for_credentials(session, cluster.credentials_path)
            status, body, _ = await api.request("PUT", "/v1/macros/hp", {"consumer": "highest_priority"})
            assert (status, error_code(body)) == (409, "E_FEATURE_DISABLED"), body
        assert await client.list_macros() == []
        with pytest.raises(QueueError) as unknown:
            await client.describe_macro("hp")
        assert unknown.value.code == "E_UNKNOWN_MACRO"

        # The policy itself, on real members: the client's macro queue over a (n1) and b (n2).
        macro = MacroQueue(client, {"name": "hp", "producer": "round_robin", "consumer": "highest_priority",
                                    "members": [{"queue": "a"}, {"queue": "b"}]}, client._router)
        await _fill(client)
        got = []
        for _ in MIXED:
            [message] = await macro.receive(1, 1.0, None)
            assert message.deliveries == 1                   # nothing was leased and given back
            got.append(message.payload)
            await message.ack()
        assert got == _expected_order()
        await _fill(client)
        batch = await macro.receive(100, 1.0, None)          # one batch: the same order
        assert [m.payload for m in batch] == _expected_order()
        await asyncio.gather(*(m.ack() for m in batch))
        assert await macro.receive(10, 0.2, None) == []
        for queue in PLACEMENT:
            stats = await client.queue_stats(queue)
            assert (stats["depth"], stats["in_flight"]) == (0, 0), stats

        # After the finalize: accepted, in the map, and the path through the macro's name.
        await client.finalize_cluster()
        created = await client.create_macro("hp", "round_robin", "highest_priority")
        assert created["consumer"] == "highest_priority"
        for queue in PLACEMENT:
            await client.add_macro_member("hp", queue)
        await _fill(client)
        got = []
        for _ in range(3):                  # REST on the macro's name: the node runs the policy
            found = await client.http.receive_from("hp", wait_s=1.0)
            assert found is not None
            queue, message = found
            got.append(message.payload)
            await client.http.ack_http(queue, message.message_id, message.receipt)
        started = time.monotonic()
        async with client.consume("hp", prefetch=1) as messages:
            async for message in messages:
                got.append(message.payload)
                await message.ack()
                if len(got) == len(MIXED) or time.monotonic() - started > 20:
                    break
        assert got == _expected_order()
        for queue in PLACEMENT:
            assert (await client.queue_stats(queue))["depth"] == 0
