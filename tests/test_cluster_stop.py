"""Stopping a whole local cluster (qserver/dev/devcluster.py `stop_all`, which the demo uses).

SIGTERM makes a node hand its masters off before it stops. Stopped one at a time with the
membership leader last, each handoff goes to a node still running and the leader is there to
commit it. Stopped in the order of their ids, the leader (n1, which founded the cluster) went
first, and the next node's handoffs waited 5 s for a swap nobody committed.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient

# Every node masters a queue replicated on each other node: whichever node stops second has a
# master whose replica is still running.
PLACEMENT = {"q12": ["n1", "n2"], "q13": ["n1", "n3"], "q21": ["n2", "n1"],
             "q23": ["n2", "n3"], "q31": ["n3", "n1"], "q32": ["n3", "n2"]}
STOP_ALL_MAX_S = 4.0        # a handoff nobody commits ends after 5 s


async def fill(cluster: Any) -> None:
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        for name in PLACEMENT:
            await client.create_queue(name, strength="full")
            await client.enqueue_many(name, [b"x"] * 100)


def test_a_whole_cluster_stop_takes_the_membership_leader_last_and_every_handoff_commits_at_once(
        qcluster_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QSERVER_TEST_LOG_LEVEL", "INFO")     # the handoffs' outcomes are logged at INFO
    cluster = qcluster_factory(3, PLACEMENT)
    asyncio.run(fill(cluster))
    leader = cluster.membership_leader()
    order = cluster.stop_order()
    assert leader is not None and order[-1] == leader and sorted(order) == ["n1", "n2", "n3"]
    started = time.monotonic()
    cluster.stop_all()
    assert time.monotonic() - started < STOP_ALL_MAX_S
    assert not cluster.processes
    logs = "".join((cluster.root / f"{node}.log").read_text() for node in cluster.ids)
    assert "did not commit the swap" not in logs and "did not catch up in time" not in logs
    assert "(handoff)" in logs           # the first two nodes did hand their masters off
