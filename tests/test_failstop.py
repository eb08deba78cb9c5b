"""Fail-stop (issue 13, item 1): a node that finds its memory and its storage apart stops its
process with a non-zero code instead of answering from memory; /healthz says 503 whenever the
engine does not serve.

The broken invariant is made for real: a message's ready row is deleted from the node's LMDB
by another process while the node holds the message as ready in memory, so the commit of its
lease finds no ready row (Storage._apply_leased)."""
from __future__ import annotations

import asyncio
import signal
import struct
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
from aiohttp.test_utils import TestClient, TestServer

from client import Client as SyncClient
from client import QueueError
from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.failstop import EXIT_BROKEN_INVARIANT
from qserver.node import Node
from replication.invariants import InvariantViolation
from tests.conftest import QNode

READY_KEY = struct.Struct(">QBQ")        # storage's ready rows: queue id, priority, index


def delete_ready_rows(env: lmdb.Environment) -> int:
    """Remove every ready row behind the node's back."""
    ready = env.open_db(b"ready", create=False)
    with env.begin(write=True, db=ready) as txn:
        keys = [bytes(key) for key, _ in txn.cursor()]
        for key in keys:
            txn.delete(key)
    return len(keys)


def test_a_node_whose_storage_disagrees_with_its_memory_exits_with_code_70_and_restarts_clean(qnode: QNode) -> None:
    with SyncClient(qnode.url, qnode.credentials_path) as client:
        client.create_queue("jobs")
        client.enqueue("jobs", b"first")
    qnode.expect_exit()                           # this process fail-stops; the next one must not
    env = lmdb.open(str(qnode.data_dir / "lmdb"), max_dbs=32, lock=True)   # LMDB's lock: a second writer
    try:
        assert delete_ready_rows(env) == 1
    finally:
        env.close()
    with SyncClient(qnode.url, qnode.credentials_path, request_timeout_s=5) as client, pytest.raises(QueueError):
        client.receive("jobs", wait_s=0)          # the lease's commit breaks the invariant
    assert qnode.process is not None
    assert qnode.process.wait(timeout=10) == EXIT_BROKEN_INVARIANT
    log = qnode.log_path.read_text()
    assert "stopping the node" in log and "was not ready" in log
    qnode.process = None
    qnode.start()                                  # what a supervisor does: recovery from storage
    with SyncClient(qnode.url, qnode.credentials_path) as client:
        assert "jobs" in [queue["name"] for queue in client.list_queues()]
        client.enqueue("jobs", b"second")
        assert [m.payload for m in client.receive("jobs", wait_s=0)] == [b"second"]


async def _in_process_node(tmp_path: Path, failures: list[tuple[str, BaseException | None]]) -> tuple[Node, TestClient]:
    node = Node(NodeConfig(data_dir=str(tmp_path), auth_enabled=False),
                on_fatal=lambda reason, error: failures.append((reason, error)))
    await node.start()
    client = TestClient(TestServer(node.application()))
    await client.start_server()
    return node, client


@pytest.mark.asyncio
async def test_healthz_answers_503_once_the_engine_failed_and_commands_are_refused(tmp_path: Path) -> None:
    failures: list[tuple[str, BaseException | None]] = []
    node, http = await _in_process_node(tmp_path, failures)
    try:
        answer = await http.get("/healthz")
        assert answer.status == 200 and (await answer.json())["status"] == "ok"
        engine = node.engine
        await engine.call(lambda r: c.CreateQueue("jobs", {}, {}, r))
        await engine.call(lambda r: c.Enqueue("jobs", b"x", 4, None, "test", r))
        delete_ready_rows(node.storage.env)
        with pytest.raises(asyncio.TimeoutError):           # never answered: the engine stopped
            await asyncio.wait_for(engine.call(lambda r: c.Receive("jobs", 1, 0, None, "test", r)), 0.5)
        for _ in range(100):
            if failures:
                break
            await asyncio.sleep(0.01)
        assert len(failures) == 1 and isinstance(failures[0][1], InvariantViolation), failures
        assert not engine.serving
        answer = await http.get("/healthz")
        assert answer.status == 503 and (await answer.json())["status"] == "failed"
        refused: Any = None
        try:
            await engine.call(lambda r: c.Enqueue("jobs", b"y", 4, None, "test", r))
        except Exception as error:
            refused = error
        assert getattr(refused, "code", None) == "E_INTERNAL"
    finally:
        await http.close()
        node.storage.close()


@pytest.mark.asyncio
async def test_an_invariant_raised_in_a_commits_completion_stops_the_engine_instead_of_being_logged(
        tmp_path: Path) -> None:
    """The loop logs and forgets an exception raised in a future's done-callback: the commit
    path's must reach on_fatal."""
    failures: list[tuple[str, BaseException | None]] = []
    node, http = await _in_process_node(tmp_path, failures)
    try:
        engine = node.engine
        await engine.call(lambda r: c.CreateQueue("jobs", {}, {}, r))

        def broken_after_commit(*args: Any, **kwargs: Any) -> None:
            raise InvariantViolation("the pair's durable order went backwards")
        engine.pairs.after_commit = broken_after_commit            # type: ignore[method-assign]
        engine.submit(c.Enqueue("jobs", b"x", 4, None, "test", c.FutureReplier()))
        deadline = time.monotonic() + 2
        while not failures and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert failures and "commit" in failures[0][0] and isinstance(failures[0][1], InvariantViolation)
        assert (await http.get("/healthz")).status == 503
    finally:
        await http.close()
        node.storage.close()


def test_the_local_cluster_runner_starts_a_node_again_that_exited_by_itself(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    cluster.expect_exit("n3")                                  # killed behind the cluster's back
    cluster.processes["n3"].send_signal(signal.SIGKILL)       # as if it had failed stop
    cluster.processes["n3"].wait(timeout=10)
    assert cluster.restart_exited() == ["n3 exited with code -9: started again"]
    cluster.wait_ready(["n3"])
    assert cluster.health("n3")["status"] == "ok" and cluster.restart_exited() == []
