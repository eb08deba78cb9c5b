"""Failover, handoff and node operations on real processes: three `qserver` nodes with the
Raft membership layer, the real client library, kill -9 and SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from typing import Any

import pytest

from client import AsyncClient, QueueError
from qserver.dev.devcluster import LocalCluster
from tests.test_pairs import wait_converged

pytestmark = pytest.mark.asyncio


async def map_of(cluster: LocalCluster, node: str) -> dict[str, Any]:
    async with AsyncClient(cluster.urls[node], cluster.credentials_path) as client:
        return await client.cluster()


async def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def drain(client: AsyncClient, queue: str) -> list[int]:
    seen: list[int] = []
    while True:
        messages = await client.receive(queue, max_messages=500, wait_s=0.5)
        if not messages:
            return seen
        seen.extend(m.id for m in messages)
        await asyncio.gather(*(m.ack() for m in messages))


async def test_killing_the_master_under_load_loses_no_acknowledged_message_and_each_epoch_has_one_master(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    acknowledged: set[int] = set()
    observed: dict[int, set[str]] = {}
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        stop = asyncio.Event()

        async def produce(worker: int) -> None:
            sequence = 0
            while not stop.is_set():
                sequence += 1
                try:
                    acknowledged.add(await client.enqueue("orders", b"x" * 64, dedupe_id=f"w{worker}-{sequence}"))
                except QueueError:
                    sequence -= 1          # retried with the same dedupe id: stored once
                    await asyncio.sleep(0.02)

        async def watch_masters() -> None:
            while not stop.is_set():
                for node in list(cluster.processes):   # a kill may change it while we await
                    try:
                        for entry in (await map_of(cluster, node))["queues"].values():
                            observed.setdefault(entry["epoch"], set()).add(entry["master"])
                    except QueueError:
                        pass
                await asyncio.sleep(0.1)
        tasks = [asyncio.create_task(produce(w)) for w in range(8)] + [asyncio.create_task(watch_masters())]
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.kill, "n1")
        before = len(acknowledged)

        async def resumed() -> bool:
            return len(acknowledged) > before + 50
        await wait_for(resumed, 10.0, "writes on the new master")
        failover_s = time.monotonic() - killed_at
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.start, "n1")          # it rejoins as the replica
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
        entry = (await map_of(cluster, "n3"))["queues"]["orders"]
        assert entry["master"] == "n2" and entry["replica"] == "n1" and entry["epoch"] == 2, entry
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as new_master, \
                AsyncClient(cluster.urls["n1"], cluster.credentials_path) as old_master:
            await wait_converged(new_master, old_master, "orders")
            delivered = await drain(new_master, "orders")
        assert acknowledged <= set(delivered), f"lost: {sorted(acknowledged - set(delivered))[:10]}"
        assert len(delivered) == len(set(delivered))
        assert all(len(masters) == 1 for masters in observed.values()), observed
        assert failover_s < 10.0


async def test_a_handoff_asked_by_the_master_swaps_the_pair_without_losing_a_write(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        acknowledged = set(await client.enqueue_many("orders", [b"before"] * 100))
        stop = asyncio.Event()

        async def produce() -> None:
            while not stop.is_set():
                try:
                    acknowledged.update(await client.enqueue_many("orders", [b"during"] * 10))
                except QueueError:
                    await asyncio.sleep(0.01)
        producer = asyncio.create_task(produce())
        await asyncio.sleep(0.3)
        answer = await client.handoff("orders")
        assert answer["master"] == "n2" and answer["replica"] == "n1" and answer["epoch"] == 2, answer
        await asyncio.sleep(0.3)
        stop.set()
        await producer
        async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as new_master:
            await wait_converged(new_master, client, "orders")
            assert set(await drain(new_master, "orders")) == acknowledged


async def test_a_consumer_follows_its_queue_through_handoffs_and_never_sees_not_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """issue 13: the demo's consume loop saw E_NOT_MASTER once per handoff."""
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        await client.refresh_placement()
        acknowledged: set[int] = set()
        consumed: set[int] = set()
        stop = asyncio.Event()

        async def produce() -> None:
            while not stop.is_set():
                try:
                    acknowledged.update(await client.enqueue_many("orders", [b"m"] * 10))
                except QueueError:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.01)

        async def consume() -> None:
            async with client.consume("orders", prefetch=50) as messages:
                async for message in messages:       # any E_NOT_MASTER would end this task
                    consumed.add(message.id)
                    with contextlib.suppress(QueueError):
                        await message.ack()
        producer, consumer = asyncio.create_task(produce()), asyncio.create_task(consume())
        for expected in ("n2", "n1", "n2"):
            await asyncio.sleep(0.5)
            assert (await client.handoff("orders"))["master"] == expected
        await asyncio.sleep(0.5)
        stop.set()
        await producer

        async def settled() -> bool:
            return acknowledged <= consumed or consumer.done()
        await wait_for(settled, 10.0, "every acknowledged message consumed")
        assert not consumer.done(), consumer.exception()
        consumer.cancel()
        assert acknowledged <= consumed


async def test_a_replica_asked_handoff_is_refused_when_the_master_does_not_accept_them_and_accepted_otherwise(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"strict": ["n1", "n2"], "open": ["n2", "n3"]})
    # n1 refuses handoffs its replicas ask for; n2 accepts them.
    config = cluster.root / "n1.toml"
    config.write_text(config.read_text().replace("[node]\n", "[node]\naccept_replica_handoffs = false\n"))
    await asyncio.to_thread(cluster.kill, "n1")
    await asyncio.to_thread(cluster.start, "n1")
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("strict")
        await client.create_queue("open")
        await client.enqueue("strict", b"a")
        await client.enqueue("open", b"b")
        with pytest.raises(QueueError) as refused:
            await client.handoff("strict", initiator="replica")
        assert refused.value.code == "E_HANDOFF_REFUSED" and "accept_replica_handoffs" in refused.value.message
        accepted = await client.handoff("open", initiator="replica")
        assert accepted["master"] == "n3" and accepted["replica"] == "n2"
        entries = (await map_of(cluster, "n1"))["queues"]
        assert entries["strict"]["master"] == "n1" and entries["strict"]["epoch"] == 1


async def test_when_master_and_replica_ask_a_handoff_at_once_never_both_succeed(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """docs/ARCHITECTURE.md, "Queue pairs": the master's request wins whenever it reaches the master before the
    swap commits; the replica's is then refused. Each round the replica's request leaves first
    and the master's follows 0-8 ms later, so that the replica's often reaches the master
    first (before, both were then answered 200 for the one swap). Two successes are two swaps."""
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    clients = {node: AsyncClient(cluster.urls[node], cluster.credentials_path) for node in ("n1", "n2")}
    try:
        await clients["n1"].create_queue("orders", strength="full")
        await clients["n1"].enqueue("orders", b"x")
        epoch, master, replica = 1, "n1", "n2"
        for delay_ms in (0, 1, 2, 4, 8) * 2:
            await wait_for(functools.partial(_in_sync, cluster, epoch), 5.0, "the pair in sync")

            async def master_asks(delay_s: float = delay_ms / 1000, node: str = master) -> Any:
                await asyncio.sleep(delay_s)
                return await clients[node].handoff("orders", initiator="master")
            by_replica, by_master = await asyncio.gather(clients[replica].handoff("orders", initiator="replica"),
                                                         master_asks(), return_exceptions=True)
            succeeded = [answer for answer in (by_master, by_replica) if isinstance(answer, dict)]
            # Both may succeed only as two swaps one after the other: the master's request came
            # after the replica's swap committed and was passed on to the new master.
            assert succeeded and len({answer["epoch"] for answer in succeeded}) == len(succeeded), \
                (delay_ms, by_master, by_replica)
            last = max(succeeded, key=lambda answer: answer["epoch"])
            assert last["epoch"] == epoch + len(succeeded)
            epoch, master, replica = last["epoch"], last["master"], last["replica"]
    finally:
        for client in clients.values():
            await client.close()


async def _in_sync(cluster: LocalCluster, epoch: int) -> bool:
    entry = (await map_of(cluster, "n3"))["queues"]["orders"]
    return bool(entry["epoch"] == epoch and entry["in_sync"])


async def test_every_node_lists_the_clusters_queues_from_the_map_a_page_at_a_time(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """issue 13: GET /v1/queues on a node listed only the queues it held a member of."""
    cluster = qcluster_factory(3, {"a": ["n1", "n2"], "b": ["n2", "n3"], "c": ["n3", "n1"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        for name in ("a", "b", "c"):
            await client.create_queue(name, strength="full")
        await client.enqueue("a", b"x")
        for node in cluster.ids:
            async with AsyncClient(cluster.urls[node], cluster.credentials_path) as at_node:
                async def listed() -> list[dict[str, Any]] | None:
                    queues = await at_node.list_queues()
                    return queues if len(queues) == 3 and all(q["in_sync"] for q in queues) else None
                queues = await wait_for(listed, 5.0, f"{node} to list every queue in sync")
                assert [(q["name"], q["master"], q["replica"], q["epoch"]) for q in queues] == \
                    [("a", "n1", "n2", 1), ("b", "n2", "n3", 1), ("c", "n3", "n1", 1)]
                assert [q["held_here"] for q in queues] == [node in pair for pair in (("n1", "n2"), ("n2", "n3"),
                                                                                      ("n3", "n1"))]
                first = await at_node.http._json("GET", "/v1/queues", query=[("limit", "2")])
                assert [q["name"] for q in first["queues"]] == ["a", "b"] and first["next"] == "b"
                rest = await at_node.http._json("GET", "/v1/queues", query=[("limit", "2"), ("after", "b")])
                assert [q["name"] for q in rest["queues"]] == ["c"] and rest["next"] is None
        assert (await client.http.list_queues(page_size=1))[0]["depth"] == 1       # n1 masters a
        # issue 31: counts instead of every queue (qctl status on a large map), and the other
        # listings that grow with the map are paged as the queues are.
        summary = await client.http.cluster_summary()
        assert "queues" not in summary and summary["counts"]["queues"] == 3 and summary["out_of_sync"] == []
        assert {n["id"]: (n["masters"], n["replicas"]) for n in summary["nodes"]} == \
            {"n1": (1, 1), "n2": (1, 1), "n3": (1, 1)}
        for name in ("m2", "m3", "m1"):
            await client.create_macro(name)
        first = await client.http._json("GET", "/v1/macros", query=[("limit", "2")])
        assert [m["name"] for m in first["macros"]] == ["m1", "m2"] and first["next"] == "m2"
        assert [m["name"] for m in await client.http.list_macros(page_size=1)] == ["m1", "m2", "m3"]
        for name in ("c2", "c1"):
            await client.create_channel(name)
        assert [c["name"] for c in await client.http.list_channels(page_size=1)] == ["c1", "c2"]
        assert [q["name"] for q in await client.list_queues()] == ["a", "b", "c", "channel:c1", "channel:c2"]
        await client.set_alternatives("r2", ["r1=a"])
        await client.set_alternatives("r1", ["r3=b"])
        assert [r["recipient"] for r in await client.http.recipients(page_size=1)] == ["r1", "r2"]
        # The entries a client following its queues reads, at the cost of the names asked
        # about (a dead-letter queue's name gives its queue's entry; a macro's name, the macro).
        scoped = await client.http.cluster(["b", "a.dlq", "m1", "nothing-of-that-name"])
        assert sorted(scoped["queues"]) == ["a", "b"] and list(scoped["macros"]) == ["m1"]
        assert (scoped["queues"]["b"]["master"], scoped["queues"]["b"]["replica"]) == ("n2", "n3")
        assert {n["id"] for n in scoped["nodes"]} == {"n1", "n2", "n3"} and scoped["version"] > 0
        for path, query in (("/v1/channels", [("limit", "1001")]), ("/v1/macros", [("limit", "0")]),
                            ("/v1/recipients", [("after", "not a name")]), ("/v1/queues", [("limit", "two")]),
                            ("/v1/cluster", [("summary", "yes")]), ("/v1/cluster", [("queue", "not a name")]),
                            ("/v1/cluster", [("queue", f"q{number}") for number in range(101)])):
            with pytest.raises(QueueError) as refused:
                await client.http._json("GET", path, query=query)
            assert refused.value.code == "E_INVALID_OPTION", path


async def test_a_forward_to_a_paused_master_and_an_answer_held_without_a_lease_end_at_the_nodes_deadline(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """commit_wait_max_s (0.4 s here): a replica's RelayRequest its master does not answer, and an
    answer a master holds for a commit point it cannot reach (no lease: both other nodes
    paused), end with an outcome-unknown E_TIMEOUT from the node, before any failover and long
    before the client's own deadline (30 s)."""
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]}, {"commit_wait_max_s": 0.4})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as at_master, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as at_replica:
        await at_master.create_queue("orders", strength="full")
        await at_master.enqueue("orders", b"first")
        await wait_for(functools.partial(_in_sync_named, cluster, "orders"), 5.0, "the replica in sync")
        for paused, client, expected in ((["n1"], at_replica, "did not answer a forwarded request"),
                                         (["n2", "n3"], at_master, "not committed within")):
            for node in paused:
                cluster.processes[node].send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(QueueError) as caught:
                    await client.http.enqueue_http("orders", b"waits")
                elapsed = time.monotonic() - started
            finally:
                for node in paused:
                    cluster.processes[node].send_signal(signal.SIGCONT)
            assert caught.value.code == "E_TIMEOUT" and caught.value.outcome_unknown, caught.value
            assert expected in caught.value.message and 0.3 < elapsed < 0.8, (caught.value, elapsed)
            await wait_for(functools.partial(_in_sync_named, cluster, "orders"), 10.0, "the pair back in sync")


async def _in_sync_named(cluster: LocalCluster, name: str) -> bool:
    entry = (await map_of(cluster, "n3"))["queues"].get(name)
    return bool(entry and entry["in_sync"] and entry["master"] == "n1")


async def test_draining_a_node_moves_everything_off_it_and_then_it_can_be_removed(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"a": ["n1", "n2"], "b": ["n2", "n1"], "c": ["n3", "n1"]})
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        acknowledged: dict[str, set[int]] = {}
        for name in ("a", "b", "c"):
            await client.create_queue(name, strength="full")
            acknowledged[name] = set(await client.enqueue_many(name, [name.encode()] * 200))
        with pytest.raises(QueueError) as busy:
            await client.remove_node("n1")
        assert "drain it first" in busy.value.message
        await client.drain_node("n1")

        async def off_n1() -> bool:
            queues = (await map_of(cluster, "n2"))["queues"]
            return all("n1" not in (e["master"], e["replica"]) and e["in_sync"] for e in queues.values())
        try:
            await wait_for(off_n1, 30.0, "every member off n1 and in sync again")
        except AssertionError:
            raise AssertionError((await map_of(cluster, "n2"))["queues"]) from None
        await client.remove_node("n1")
        nodes = {n["id"]: n["state"] for n in (await map_of(cluster, "n2"))["nodes"]}
        assert nodes["n1"] == "removed"

        async def out_of_the_membership_layer() -> bool:    # its Raft member goes too
            members = [(await map_of(cluster, node))["membership"] for node in ("n2", "n3")]
            return all(m["voters"] == ["n2", "n3"] and not m["learners"] for m in members)
        await wait_for(out_of_the_membership_layer, 10.0, "n1 removed from the Raft configuration")
        await asyncio.to_thread(cluster.kill, "n1")
        # The two voters left commit map changes on their own: a new queue, then a handoff.
        await client.create_queue("d", strength="full")
        handed = await client.handoff("c")
        assert (handed["master"], handed["replica"]) == ("n2", "n3"), handed
        for name in ("a", "b", "c"):
            assert set(await drain(client, name)) == acknowledged[name], name


async def test_sigterm_hands_off_every_master_on_the_node_first(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        acknowledged = set(await client.enqueue_many("orders", [b"x"] * 50))
        await asyncio.to_thread(cluster.stop, "n1")

        async def handed_off() -> dict[str, Any] | None:      # n3's copy of the map follows soon
            entry: dict[str, Any] = (await map_of(cluster, "n3"))["queues"]["orders"]
            return entry if entry["epoch"] == 2 else None
        entry = await wait_for(handed_off, 2.0, "n3's map to show the handoff")
        assert entry["master"] == "n2" and entry["last_reason"] == "handoff", entry
        assert set(await drain(client, "orders")) == acknowledged


async def test_the_last_node_of_a_stopping_cluster_does_not_wait_to_hand_off_to_nodes_already_gone(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Its replica's node and the third are gone: no membership majority is left to record
    them down, so its map still shows the replica in sync; it must stop at once, not after
    shutdown_handoff_timeout_s (10 s)."""
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        await client.enqueue_many("orders", [b"x"] * 20)
    for node in ("n3", "n2"):
        await asyncio.to_thread(cluster.stop, node)
    started = time.monotonic()
    assert await asyncio.to_thread(cluster.stop, "n1") == 0
    assert time.monotonic() - started < 3.0


async def test_qctl_shows_the_cluster_map_and_hands_a_queue_off(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    import io

    from client import qctl
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        code = qctl.main(["--credentials", str(cluster.credentials_path), *argv], stdout=out, stderr=out)
        return code, out.getvalue()
    code, text = await asyncio.to_thread(run, "status")
    assert code == 0 and "membership leader: n" in text and "orders" in text and "IN_SYNC" in text, text
    code, text = await asyncio.to_thread(run, "--json", "handoff", "orders")
    assert code == 0 and '"master": "n2"' in text, text
    code, text = await asyncio.to_thread(run, "promote", "orders", "--unclean")
    assert code == 1 and "E_INVALID_OPTION" in text and "in sync" in text, text



async def test_a_client_registered_at_one_node_is_known_to_every_node_and_its_removal_too(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    from client.credentials import Credentials
    cluster = qcluster_factory(3, {"billing": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("billing")
        record = await admin.register_client("biller", [{"pattern": "billing", "privileges": ["post", "get"]}])
        credentials = Credentials(record["id"], record["private_key"], cluster.urls["n3"])

        async def accepted_at_n3() -> bool:
            try:
                async with AsyncClient(cluster.urls["n3"], credentials) as biller:
                    return await biller.enqueue("billing", b"invoice") > 0
            except QueueError as error:
                if error.code != "E_UNAUTHENTICATED":
                    raise
                return False
        await wait_for(accepted_at_n3, 5.0, "n3 to know the new client")
        await admin.remove_client(record["id"])

        async def refused_at_n2() -> bool:
            try:
                async with AsyncClient(cluster.urls["n2"], Credentials(record["id"], record["private_key"],
                                                                        cluster.urls["n2"])) as biller:
                    await biller.enqueue("billing", b"late")
                return False
            except QueueError as error:
                return error.code == "E_UNAUTHENTICATED"
        await wait_for(refused_at_n2, 5.0, "n2 to forget the removed client")


async def test_a_replica_node_down_longer_than_replica_replace_after_s_is_replaced_on_another_node(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]}, {"replica_replace_after_s": 1.0})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        acknowledged = set(await client.enqueue_many("orders", [b"x"] * 100))
        await asyncio.to_thread(cluster.kill, "n2")
        acknowledged |= set(await client.enqueue_many("orders", [b"y"] * 100))

        async def replaced() -> bool:
            entry = (await map_of(cluster, "n1"))["queues"]["orders"]
            return entry["replica"] == "n3" and entry["in_sync"] and entry["master"] == "n1"
        await wait_for(replaced, 20.0, "the replica re-created on n3 and in sync")
        async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as newcomer:
            await wait_converged(client, newcomer, "orders")
        assert set(await drain(client, "orders")) == acknowledged


async def test_with_its_replica_out_of_sync_a_lost_master_leaves_the_queue_unavailable_until_an_unclean_promotion(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]}, {"replica_lag_max_ms": 300})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        await client.enqueue_many("orders", [b"both"] * 10)
        await asyncio.to_thread(cluster.kill, "n2")
        await client.enqueue_many("orders", [b"master only"] * 10)   # recorded out of sync first

        async def out_of_sync() -> bool:
            return not (await map_of(cluster, "n3"))["queues"]["orders"]["in_sync"]
        await wait_for(out_of_sync, 10.0, "the replica recorded out of sync")
        await asyncio.to_thread(cluster.kill, "n1")
        await asyncio.to_thread(cluster.start, "n2")
        await asyncio.sleep(2.5)              # well past lease + margin: no failover happens
        entry = (await map_of(cluster, "n3"))["queues"]["orders"]
        assert entry["master"] == "n1" and entry["epoch"] == 1, entry
        with pytest.raises(QueueError) as unavailable:
            await client.http.enqueue_http("orders", b"refused")
        assert unavailable.value.retriable, unavailable.value
        promoted = await client.promote("orders", unclean=True)
        assert promoted["master"] == "n2" and promoted["unclean"], (promoted, await map_of(cluster, "n3"))

        async def recorded() -> dict[str, Any] | None:
            entry = (await map_of(cluster, "n3"))["queues"]["orders"]
            return entry if entry["unclean_promotions"] == 1 else None
        entry = await wait_for(recorded, 5.0, "the unclean promotion in the map")
        assert entry["master"] == "n2" and entry["last_reason"] == "unclean"
        await client.refresh_placement()
        assert await client.enqueue("orders", b"after") > 0


async def test_a_node_beyond_the_voters_follows_the_map_holds_members_and_takes_over_as_master(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(4, {"north": ["n4", "n1"], "south": ["n1", "n4"]}, voters=3)
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as client:
        for name in ("north", "south"):
            await client.create_queue(name, strength="full")
        acknowledged = {name: set(await client.enqueue_many(name, [name.encode()] * 50)) for name in ("north", "south")}
        nodes = {n["id"]: n for n in (await map_of(cluster, "n4"))["nodes"]}
        assert nodes["n4"]["voter"] is False and nodes["n1"]["voter"] is True
        # n1 is a voter and south's master: two voters remain, south fails over to n4
        await asyncio.to_thread(cluster.kill, "n1")

        async def failed_over() -> bool:
            return (await map_of(cluster, "n4"))["queues"]["south"]["master"] == "n4"
        await wait_for(failed_over, 10.0, "south to fail over to the non-voter n4")
        acknowledged["south"] |= set(await client.enqueue_many("south", [b"after"] * 10))
        for name in ("north", "south"):
            assert set(await drain(client, name)) == acknowledged[name], name


async def test_enqueues_unanswered_by_a_paused_master_are_acknowledged_by_the_promoted_replica_within_a_second(
        qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    """A client at the third node knows the map, so its enqueues are watched: those sent to a
    master that then pauses (SIGSTOP: no answer, no broken socket) are asked again at the
    replica once the map names it master, with the same dedupe ids, and each is stored once."""
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"]})
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("orders", strength="full")
        await client.refresh_placement()
        await client.enqueue("orders", b"before")
        await wait_for(functools.partial(_in_sync_named, cluster, "orders"), 5.0, "the replica in sync")
        cluster.processes["n1"].send_signal(signal.SIGSTOP)
        try:
            paused_at = time.monotonic()
            calls = [asyncio.ensure_future(client.enqueue("orders", b"%d" % n, dedupe_id=f"during-{n}"))
                     for n in range(20)]
            promoted = await wait_for(functools.partial(_master_named, cluster, "orders", "n2"), 10.0,
                                      "the replica promoted")
            assert promoted
            promoted_at = time.monotonic()
            ids = await asyncio.wait_for(asyncio.gather(*calls), 5.0)
            answered_after_s = time.monotonic() - promoted_at
        finally:
            cluster.processes["n1"].send_signal(signal.SIGCONT)
        assert answered_after_s < 1.5, f"answered {answered_after_s:.2f} s after the promotion " \
                                       f"({promoted_at - paused_at:.2f} s after the pause)"
        assert len(set(ids)) == 20
        again = await client.enqueue_many("orders", [b"x"] * 20, dedupe_ids=[f"during-{n}" for n in range(20)])
        assert sorted(again) == sorted(ids)                       # stored once each


async def _master_named(cluster: LocalCluster, name: str, master: str) -> bool:
    entry = (await map_of(cluster, "n3"))["queues"].get(name)
    return bool(entry and entry["master"] == master)
