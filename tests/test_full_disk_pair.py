"""A full disk under a queue pair, for real: one node's LMDB directory on a size-limited tmpfs.

A full disk is an operating error, not a broken invariant: the node never exits, its roles do
not start over and over, producers are told E_STORAGE_FULL at once (nothing stored), every
acknowledged message can still be received, and writes resume once there is room (a filler
file on the small disk is deleted). The master's disk full refuses enqueues; the replica's
disk full makes its master record it out of sync and go on alone (min_in_sync 1); with
`disk_reserve_bytes` the node stops before its disk is full, so acknowledgements and the
membership layer's writes still go through; a Raft write that finds the disk full waits and is
stored once there is room. Role restarts are counted by the nodes themselves
(`qserver_replication_role_starts_total`, `qserver_replica_opens_total`,
`qserver_commits_abandoned_total` in /metrics).

Mounting needs root on Linux: where it is impossible, the tests skip and say why.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, QueueError
from qserver.dev.devcluster import LocalCluster

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(150)]
MIB = 1 << 20
PAYLOAD_BYTES = 100_000
CALL_S_MAX = 5.0            # an answer, even a refusal, comes well before commit_wait_max_s (10 s)
# Node leases with room for a loaded machine: a lease lapsed behind a stalled loop would fail the
# queue over, a role change these tests would count as a restart.
SETTINGS: dict[str, object] = {"lease_ms": 3000, "lease_renew_interval_ms": 500, "lease_margin_ms": 1000}


class SmallDisk:
    """A tmpfs of `size_bytes` mounted over a node's LMDB directory (what `qserver init` put
    there is copied onto it), and a filler file taking part of it: deleting it makes room."""

    def __init__(self, directory: Path, size_bytes: int) -> None:
        self.directory = directory
        self.size_bytes = size_bytes
        self.filler = directory / "filler"
        self.mounted = False

    def mount(self) -> None:
        if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a size-limited tmpfs needs root on Linux (and mount(8))")
        saved = self.directory.with_name(self.directory.name + ".saved")
        self.directory.rename(saved)
        self.directory.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.directory)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            self.directory.rmdir()
            saved.rename(self.directory)
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
        self.mounted = True
        for path in saved.iterdir():
            shutil.copy2(path, self.directory / path.name)
        shutil.rmtree(saved)

    def fill(self, size_bytes: int) -> None:
        with open(self.filler, "ab") as filler:
            filler.write(b"\xa5" * size_bytes)

    def fill_to_the_end(self) -> None:
        """Take every byte left (the last write ends short, with ENOSPC)."""
        with open(self.filler, "ab", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\xa5" * (64 << 10))

    def make_room(self) -> None:
        self.filler.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        stat = os.statvfs(self.directory)
        return stat.f_bavail * stat.f_frsize

    def unmount(self) -> None:
        if self.mounted and subprocess.run(["umount", str(self.directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
        self.mounted = False


@contextlib.asynccontextmanager
async def cluster_with_small_disk(root: Path, node: str, size_bytes: int, placement: dict[str, list[str]],
                                  settings: dict[str, object]) -> AsyncIterator[tuple[LocalCluster, SmallDisk]]:
    """A three-node cluster whose node `node` keeps its LMDB environment on a small disk; every
    node stopped and the disk unmounted afterwards."""
    cluster = await asyncio.to_thread(LocalCluster, root, 3, placement, settings)
    disk = SmallDisk(root / node / "lmdb", size_bytes)
    try:
        disk.mount()
        await asyncio.to_thread(cluster.start_all)
        yield cluster, disk
    finally:
        for name in list(cluster.processes):
            await asyncio.to_thread(cluster.kill, name)
        disk.unmount()


async def metrics(cluster: LocalCluster, node: str) -> dict[str, float]:
    """The node's /metrics as {"name{labels}": value}."""
    def read() -> str:
        with urllib.request.urlopen(cluster.urls[node] + "/metrics", timeout=5) as answer:
            return str(answer.read().decode())
    values = {}
    for line in (await asyncio.to_thread(read)).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def restarts(cluster: LocalCluster, node: str) -> dict[str, float]:
    """What shows a flapping role: roles taken up, Opens sent, batches lost."""
    found = await metrics(cluster, node)
    return {"master roles": found['qserver_replication_role_starts_total{role="master"}'],
            "replica roles": found['qserver_replication_role_starts_total{role="replica"}'],
            "opens": found["qserver_replica_opens_total"], "lost batches": found["qserver_commits_abandoned_total"]}


def alive(cluster: LocalCluster) -> None:
    for node, process in cluster.processes.items():
        assert process.poll() is None, f"{node} exited with {process.returncode}: see {cluster.root / (node + '.log')}"


def payload(number: int) -> bytes:
    return bytes([number % 251]) * PAYLOAD_BYTES


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    """check() again every 0.1 s until it returns something true (its value), or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last: {value!r})")
        await asyncio.sleep(0.1)


async def timed_enqueue(client: AsyncClient, queue: str, body: bytes) -> int:
    started = time.monotonic()
    try:
        return await client.enqueue(queue, body)
    finally:
        took = time.monotonic() - started
        assert took < CALL_S_MAX, f"an enqueue took {took:.1f} s: it waited for a commit that did not come"


async def fill_until_refused(client: AsyncClient, queue: str, acked: dict[int, bytes], limit: int) -> QueueError:
    for number in range(limit):
        body = payload(number)
        try:
            acked[await timed_enqueue(client, queue, body)] = body
        except QueueError as error:
            return error
    raise AssertionError(f"{limit} messages of {PAYLOAD_BYTES} bytes were all taken: the disk never filled")


async def converged(client: AsyncClient, queue: str) -> dict[str, Any] | None:
    stats = await client.queue_stats(queue)
    settled = stats["replication_state"] == "in_sync" and stats["replica_progress"] == "caught_up" \
        and stats["last_order"] == stats["commit_order"] == stats["replica_durable_order"]
    return stats if settled else None


async def sees_everything(member: AsyncClient, queue: str, last_id: int) -> bool:
    """The member's consumers may see every message up to `last_id` (its commit point)."""
    return int((await member.queue_stats(queue))["commit_order"]) >= last_id


async def receive_all(client: AsyncClient, queue: str) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    while messages := await client.receive(queue, max_messages=50, wait_s=1.0):
        got.update((message.id, message.payload) for message in messages)
        await asyncio.gather(*(message.ack() for message in messages))
    return got


async def enqueue_when_there_is_room(client: AsyncClient, queue: str, acked: dict[int, bytes]) -> None:
    async def attempt() -> bool:
        try:
            acked[await timed_enqueue(client, queue, b"room again")] = b"room again"
        except QueueError as error:
            assert error.code == "E_STORAGE_FULL", error
            return False
        return True
    await until(attempt, 20, "an enqueue taken once the filler was deleted")


# --- the master's disk ---------------------------------------------------------------------------
@pytest.mark.parametrize("strength", ["producer", "full"])
async def test_a_master_whose_disk_fills_refuses_enqueues_at_once_loses_nothing_and_takes_them_again_once_there_is_room(
        tmp_path: Path, strength: str) -> None:
    async with cluster_with_small_disk(tmp_path / "cluster", "n1", 24 * MIB, {"orders": ["n1", "n2"]},
                                       {**SETTINGS, "disk_reserve_bytes": 0}) as (cluster, disk):
        disk.fill(6 * MIB)
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
            await client.create_queue("orders", strength=strength)
            acked: dict[int, bytes] = {}
            refused = await fill_until_refused(client, "orders", acked, 400)
            # Not E_TIMEOUT: the write that found no room is refused, and so is the next one,
            # before anything is decided (the replica gets nothing this member cannot store).
            assert refused.code == "E_STORAGE_FULL", refused
            assert len(acked) > 20
            with pytest.raises(QueueError) as small:
                await timed_enqueue(client, "orders", b"small")
            assert small.value.code == "E_STORAGE_FULL" and not small.value.outcome_unknown
            assert (await metrics(cluster, "n1"))["qserver_storage_full"] == 1
            # The replica may hold the message whose batch was lost here: it opens again and the
            # digests decide (a snapshot). After that, nothing starts over.
            await asyncio.sleep(4)
            settled = await restarts(cluster, "n1"), await restarts(cluster, "n2")
            await asyncio.sleep(3)
            later = await restarts(cluster, "n1"), await restarts(cluster, "n2")
            assert settled[0]["master roles"] <= 3 and settled[0]["lost batches"] <= 2, settled
            assert settled[1]["replica roles"] <= 2 and settled[1]["opens"] <= 8, settled
            assert later[0]["master roles"] == settled[0]["master roles"] and later[0]["lost batches"] <= 2, later
            assert later[1]["replica roles"] == 2 and later[1]["opens"] - settled[1]["opens"] <= 3, later
            alive(cluster)

            disk.make_room()
            await enqueue_when_there_is_room(client, "orders", acked)
            await until(lambda: converged(client, "orders"), 30, "the pair in sync again")
            got = await receive_all(client, "orders")
            assert set(acked) <= set(got) and all(got[id_] == body for id_, body in acked.items())
            after = await restarts(cluster, "n1"), await restarts(cluster, "n2")
            assert after[0]["master roles"] <= 3 and after[1]["replica roles"] <= 2 and after[1]["opens"] <= 8, after
            alive(cluster)


# --- the replica's disk --------------------------------------------------------------------------
async def test_a_replica_whose_disk_fills_is_recorded_out_of_sync_at_once_and_catches_up_once_there_is_room(
        tmp_path: Path) -> None:
    async with cluster_with_small_disk(tmp_path / "cluster", "n2", 24 * MIB, {"orders": ["n1", "n2"]},
                                       {**SETTINGS, "disk_reserve_bytes": 0}) as (cluster, disk):
        disk.fill(8 * MIB)
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as master, \
                AsyncClient(cluster.urls["n2"], cluster.credentials_path) as replica:
            await master.create_queue("orders")
            acked: dict[int, bytes] = {}
            # Every enqueue is answered in time (min_in_sync 1: the master goes on alone once
            # the replica says it is full), none with E_TIMEOUT.
            for number in range(400):
                body = payload(number)
                acked[await timed_enqueue(master, "orders", body)] = body
                if (await master.queue_stats("orders"))["replication_state"] == "out_of_sync":
                    break
            else:
                raise AssertionError("the replica's disk never filled")
            for number in range(5):
                acked[await timed_enqueue(master, "orders", payload(number))] = payload(number)
            assert (await master.cluster())["queues"]["orders"]["in_sync"] is False
            assert (await metrics(cluster, "n2"))["qserver_storage_full"] == 1
            full = await restarts(cluster, "n2")
            await asyncio.sleep(3)
            assert await restarts(cluster, "n2") == full, "the full replica started over while nothing changed"
            assert full["replica roles"] <= 4 and full["lost batches"] <= 2 and full["opens"] <= 6, full
            alive(cluster)

            disk.make_room()
            stats = await until(lambda: converged(master, "orders"), 30, "the replica back in sync")
            assert stats["last_order"] == max(acked)
            assert (await master.cluster())["queues"]["orders"]["in_sync"] is True
            # Under `producer` each member serves its own consumers: both hold every message.
            await until(lambda: sees_everything(replica, "orders", max(acked)), 10, "the replica's commit point")
            for member in (master, replica):
                got = await receive_all(member, "orders")
                assert set(acked) <= set(got) and all(got[id_] == body for id_, body in acked.items()), member.url
            after = await restarts(cluster, "n2")
            assert after["replica roles"] <= 4 and after["opens"] <= 10, after
            alive(cluster)


# --- the free-disk reserve -----------------------------------------------------------------------
async def test_a_node_keeps_its_disk_reserve_free_for_acknowledgements_and_membership_writes(tmp_path: Path) -> None:
    reserve = 8 * MIB
    async with cluster_with_small_disk(tmp_path / "cluster", "n1", 40 * MIB, {"orders": ["n1", "n2"]},
                                       {**SETTINGS, "disk_reserve_bytes": reserve}) as (cluster, disk):
        disk.fill(10 * MIB)
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
            await client.create_queue("orders")
            acked: dict[int, bytes] = {}
            refused = await fill_until_refused(client, "orders", acked, 400)
            assert refused.code == "E_STORAGE_FULL" and not refused.outcome_unknown, refused
            # Refused before the disk filled (a check every 0.1 s may let a few messages past
            # the line), and without a write failing: nothing was lost, no role started over.
            assert disk.free_bytes() > reserve // 2, disk.free_bytes()
            found = await restarts(cluster, "n1")
            assert found == {"master roles": 2, "replica roles": 0, "opens": 0, "lost batches": 0}, found
            # Acknowledgements use the reserve.
            taken = await client.receive("orders", max_messages=5, wait_s=1)
            assert len(taken) == 5
            await asyncio.gather(*(message.ack() for message in taken))
            for message in taken:
                assert acked.pop(message.id) == message.payload
            # So do the membership layer's writes: a queue created elsewhere is in this node's map.
            await client.create_queue("elsewhere", master="n2", replica="n3")
            await until(lambda: in_map(cluster, "n1", "elsewhere"), 10, "the new queue in n1's map")
            assert (await metrics(cluster, "n1"))["qserver_membership_persists_refused_total"] == 0

            disk.make_room()
            await enqueue_when_there_is_room(client, "orders", acked)
            await until(lambda: converged(client, "orders"), 30, "the pair in sync")
            got = await receive_all(client, "orders")
            assert set(acked) <= set(got) and all(got[id_] == body for id_, body in acked.items())
            assert (await restarts(cluster, "n1"))["lost batches"] == 0
            alive(cluster)


async def in_map(cluster: LocalCluster, node: str, queue: str) -> bool:
    async with AsyncClient(cluster.urls[node], cluster.credentials_path) as client:
        return queue in (await client.cluster())["queues"]


# --- a Raft write on a full disk -----------------------------------------------------------------
async def test_a_voter_whose_disk_is_full_waits_with_its_raft_write_and_stores_it_once_there_is_room(
        tmp_path: Path) -> None:
    async with cluster_with_small_disk(tmp_path / "cluster", "n3", 16 * MIB, {}, {**SETTINGS, "disk_reserve_bytes": 0}) \
            as (cluster, disk):
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
            leader = (await client.cluster())["leader"]
            if leader == "n3":          # the full voter should not be the one everybody waits for
                pytest.skip("n3 leads the membership layer in this run")  # (rare: n1 founds the cluster)
            disk.fill_to_the_end()
            names = [f"map-change-{number}" for number in range(40)]
            for name in names:          # 40 map entries: the log outgrows the pages LMDB has free
                await client.create_queue(name, master="n1", replica="n2")
            alive(cluster)
            refused = (await metrics(cluster, "n3"))["qserver_membership_persists_refused_total"]
            assert refused > 0, "no Raft write found the disk full: the test did not test it"
            assert not await in_map(cluster, "n3", names[-1])

            disk.make_room()
            await until(lambda: in_map(cluster, "n3", names[-1]), 20, "n3's map with every new queue")
            health = cluster.health("n3")
            assert health.get("status") == "ok", health
            alive(cluster)


async def test_a_raft_write_refused_for_lack_of_room_is_stored_again_and_the_member_goes_on(tmp_path: Path) -> None:
    """The driver's part, in one process: a Raft write that finds the map full grows it; one
    the disk refuses (StorageFull) waits and is written again; the task never ends."""
    from qserver.cluster.membership import RaftMembership, raft_limits, tick_ms
    from qserver.storage.lmdb_store import MapGrowthNeeded, Storage, StorageFull
    from qserver.storage.raft_store import RaftStore
    from replication.cluster_map import PutClient
    from replication.raft import Ready

    storage = Storage(tmp_path / "lmdb", node_id="n1", disk_reserve_bytes=0)

    class RefusingStore(RaftStore):
        refusals: list[Exception] = []

        def persist(self, ready: Ready) -> None:
            if self.refusals:
                raise self.refusals.pop(0)
            super().persist(ready)

    store = RefusingStore(storage)
    store.bootstrap("n1", storage.storage_id)
    grown = threading.Event()
    writer = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    member = RaftMembership("n1", storage.storage_id, store, voters={"n1"}, send=lambda peer, data: False,
                            writer=lambda: writer, loop=loop, limits=raft_limits((200, 400), 50),
                            tick_s=tick_ms(50) / 1000, seed=1, grow_storage=grown.set)
    member.start()
    try:
        deadline = loop.time() + 10
        while not member.is_leader():
            assert loop.time() < deadline, member.status()
            await asyncio.sleep(0.02)
        store.refusals += [MapGrowthNeeded(), StorageFull("the disk is full"), StorageFull("the disk is full")]
        done: asyncio.Future[Any] = loop.create_future()
        member.propose(PutClient("svc", {"grants": ["produce:*"]}), done.set_result)
        outcomes = await asyncio.wait_for(done, 10)
        assert outcomes and outcomes[0].applied and member.cluster_map.clients["svc"] == {"grants": ["produce:*"]}
        assert grown.is_set() and member.persists_refused == 2 and not store.refusals
        assert member._task is not None and not member._task.done()
    finally:
        member.stop()
        writer.shutdown()
    assert RaftStore(storage).load().entries, "the write was stored"
    storage.close()
