"""The cluster event feed (qserver/cluster/events.py, GET /v1/events; docs/PROTOCOL.md, "Events").

Unit: the events a map command makes, the ring's paging and its filter. Integration, on one real
3-node cluster: a long poll returns when an event arrives; a queue created and deleted; a handoff
gives a "handoff" event at every node; a client sees only its queues' events (and the cluster's);
bad parameters are E_INVALID_OPTION; a kill -9 of a master gives a "failover" event (and n1's
"node_down") at the surviving nodes; `qctl events` prints the feed, `--follow` as it comes.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials
from client.qctl import main as qctl_main
from qserver.cluster.events import EventFeed, events_of
from replication.cluster_map import ChangePair, ChangePairs, CreateQueue, Outcome, PutRecipient, Reason, SetNodeState
from tests.test_pairs import wait_converged
from wire.errors import E_NOT_FOUND
from wire.version_headers import explain_older_node

REPOSITORY = Path(__file__).resolve().parent.parent


# --- unit ---------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_map_commands_make_events_only_when_applied() -> None:
    swap = ChangePair("orders", (3, "n1", "n2", True), (4, "n2", "n1", True), Reason.HANDOFF.value)
    lost = ChangePair("billing", (1, "n1", "n3", True), (2, "n3", "n1", False), Reason.FAILOVER.value)
    found = events_of(ChangePairs((swap, lost)), [Outcome("orders", True, "handoff"), Outcome("billing", True)])
    assert [(kind, queue, node) for kind, _, queue, node, _ in found] == [("handoff", "orders", "n2"),
                                                                          ("failover", "billing", "n3")]
    assert found[1][4]["previous_master"] == "n1" and found[1][4]["epoch"] == 2
    assert events_of(swap, [Outcome("orders", False, "expected ...")]) == []          # refused: nothing happened
    assert events_of(SetNodeState("n1", "down", "up"), [Outcome("n1", True)])[0][0] == "node_down"
    assert events_of(SetNodeState("n1", "up", "down"), [Outcome("n1", True)])[0][0] == "node_up"
    assert events_of(CreateQueue("q", {}, "n1", "n2", 1), [Outcome("q", True)])[0][:3] == (
        "queue_created", "queue q created: master n1, replica n2", "q")
    state = events_of(PutRecipient("r1", "q", "fault", 5, "no progress"), [Outcome("r1", True, "fault")])
    assert state[0][0] == "recipient_state" and state[0][2] == "q" and state[0][4]["state"] == "fault"


@pytest.mark.timeout(10)
def test_the_ring_keeps_the_last_events_and_pages_past_what_a_reader_may_not_see() -> None:
    feed = EventFeed("n1", kept=5, clock_ms=lambda: 1000)
    for index in range(8):
        feed.note("queue_created", f"q{index}", queue="mine" if index % 2 else "theirs")
    assert feed.first_seq == 4 and [e.seq for e in feed.ring] == [4, 5, 6, 7, 8]

    def mine(event: Any) -> bool:
        return event.queue == "mine"
    found, next_after = feed.since(0, 10, mine)
    assert [e.seq for e in found] == [4, 6, 8] and next_after == 8
    found, next_after = feed.since(4, 1, mine)
    assert [e.seq for e in found] == [6] and next_after == 6
    found, next_after = feed.since(6, 10, lambda event: False)
    assert found == [] and next_after == 8          # what it may not see is passed over
    found, _ = feed.since(99, 10, mine)              # beyond the newest: the node restarted
    assert [e.seq for e in found] == [4, 6, 8]
    assert 'qserver_events_total{kind="queue_created"} 8' in "\n".join(feed.render_metrics())


@pytest.mark.timeout(10)
def test_a_node_of_0_2_0_is_said_to_be_too_old_for_the_feed() -> None:
    """Release 0.2.0 has no GET /v1/events: its 404 reaches the caller as a node too old."""
    said = explain_older_node(QueueError(E_NOT_FOUND, "no route GET /v1/events"), "0.2.0", "GET /v1/events")
    assert said.code == "E_NOT_FOUND" and "runs qserver 0.2.0, which does not support GET /v1/events" in said.message


# --- one real 3-node cluster ----------------------------------------------------------------------
async def events_at(client: AsyncClient, after: int = 0) -> list[dict[str, Any]]:
    return list((await client.events(after, 1000))["events"])


async def until_event(client: AsyncClient, kind: str, queue: str | None, timeout_s: float,
                      node: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        for event in await events_at(client):
            if event["kind"] == kind and (queue is None or event.get("queue") == queue) \
                    and (node is None or event.get("node") == node):
                return event
        if time.monotonic() > deadline:
            raise AssertionError(f"no {kind} event of {queue} within {timeout_s} s: {await events_at(client)}")
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_feed_of_a_real_cluster(qcluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"], "billing": ["n1", "n3"], "secret": ["n2", "n3"],
                                   "temp": ["n2", "n3"]})
    clients = {node: AsyncClient(cluster.urls[node], cluster.credentials_path) for node in ("n1", "n2", "n3")}
    n1, n2, n3 = clients["n1"], clients["n2"], clients["n3"]
    try:
        # Bad parameters: E_INVALID_OPTION, at the server (the client passes them as given).
        for query in ({"limit": 0}, {"limit": 1001}, {"wait_s": 20.5}, {"after": -1}):
            with pytest.raises(QueueError) as refused:
                await n2.events(**query)
            assert refused.value.code == "E_INVALID_OPTION", (query, refused.value)
        answer = await n2.events()
        assert answer["node"] == "n2" and isinstance(answer["next_after"], int) and answer["started_ms"] > 0
        assert any(event["kind"] == "leader" for event in answer["events"])

        # A long poll returns when an event arrives, not before.
        poll = asyncio.ensure_future(n2.events(answer["next_after"], 100, 15.0))
        await asyncio.sleep(0.5)
        assert not poll.done()
        started = time.monotonic()
        await n1.create_queue("temp")
        woken = await asyncio.wait_for(poll, 10.0)
        assert time.monotonic() - started < 5.0
        assert [(e["kind"], e["queue"]) for e in woken["events"]][:1] == [("queue_created", "temp")]
        assert woken["events"][0]["master"] == "n2" and woken["events"][0]["seq"] > answer["next_after"]
        await n1.delete_queue("temp")
        deleted = await until_event(n3, "queue_deleted", "temp", 10.0)
        assert deleted["text"] == "queue temp deleted"

        # A handoff: a "handoff" event at every node.
        for name in ("orders", "billing", "secret"):
            await n1.create_queue(name, strength="full")
            await n1.enqueue(name, b"x")
        await wait_converged(n1, n2, "orders")        # a handoff waits for a replica in sync
        await n1.handoff("orders")
        for client in (n1, n2, n3):
            handoff = await until_event(client, "handoff", "orders", 10.0)
            assert handoff["node"] == "n2" and handoff["previous_master"] == "n1" and "n1 -> n2" in handoff["text"]

        # A client sees the events of its queues and the cluster's, never another queue's.
        record = await n1.register_client("watcher", [{"pattern": "orders*", "privileges": ["get"]}])
        watcher_credentials = Credentials(record["id"], record["private_key"], cluster.urls["n3"])

        async def seen_by_watcher() -> list[dict[str, Any]] | None:
            try:       # n3 knows the new client once it applied its registration (a map command)
                async with AsyncClient(cluster.urls["n3"], watcher_credentials) as watcher:
                    return await events_at(watcher)
            except QueueError as error:
                if error.code != "E_UNAUTHENTICATED":
                    raise
                await asyncio.sleep(0.1)
                return None
        seen = None
        for _ in range(100):
            seen = await seen_by_watcher()
            if seen is not None:
                break
        assert seen is not None, "n3 never knew the watcher"
        assert any(e["kind"] == "handoff" and e["queue"] == "orders" for e in seen)
        assert any(e["kind"] == "leader" for e in seen)
        assert {e.get("queue") for e in seen} <= {None, "orders"}, seen
        assert any(e.get("queue") == "secret" for e in await events_at(n3))

        # qctl events: the feed for people and, with --json, the answer.
        out = io.StringIO()
        assert await asyncio.to_thread(qctl_main, ["--json", "--credentials", str(cluster.credentials_path), "--url",
                                                   cluster.urls["n3"], "events", "--limit", "1000"], stdout=out) == 0
        printed = json.loads(out.getvalue())
        assert any(e["kind"] == "handoff" for e in printed["events"]) and printed["node"] == "n3"
        out = io.StringIO()
        assert await asyncio.to_thread(qctl_main, ["--credentials", str(cluster.credentials_path), "--url",
                                                   cluster.urls["n3"], "events", "--limit", "1000"], stdout=out) == 0
        assert "handoff of orders: master n1 -> n2" in out.getvalue()

        # qctl events --follow prints each event as it comes (one JSON document a line).
        newest = (await n2.events(0, 1000))["next_after"]
        follower = subprocess.Popen([sys.executable, "-m", "client.qctl", "--credentials", str(cluster.credentials_path),
                                     "--url", cluster.urls["n2"], "events", "--follow", "--json", "--after", str(newest)],
                                    cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
        try:
            await asyncio.sleep(1.5)                 # qctl started and waits in its long poll
            await n1.create_queue("later")
            followed: list[tuple[str, str | None]] = []
            while ("queue_created", "later") not in followed:     # (in-sync flips may come first)
                line = await asyncio.wait_for(asyncio.to_thread(follower.stdout.readline), 20.0)  # type: ignore[union-attr]
                event = json.loads(line)
                followed.append((event["kind"], event.get("queue")))
                assert len(followed) < 20, followed
        finally:
            follower.send_signal(signal.SIGINT)        # Ctrl-C: how a follow ends
            try:
                follower.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.communicate(timeout=10)

        # kill -9 of billing's master: a failover at the surviving nodes, and n1 goes down.
        await wait_converged(n1, n3, "billing")
        await n1.close()
        await asyncio.to_thread(cluster.kill, "n1")
        for client in (n2, n3):
            failover = await until_event(client, "failover", "billing", 20.0)
            assert failover["node"] == "n3" and failover["previous_master"] == "n1" and not failover["unclean"]
        # (A new membership leader may mark a live node down for a moment too: it cannot know
        # what its predecessor granted; n1 stays down.)
        down = await until_event(n2, "node_down", None, 20.0, node="n1")
        assert down["text"] == "node n1 is down"
        metrics = await _metrics(cluster.urls["n3"])
        assert 'qserver_events_total{kind="failover"}' in metrics and "qserver_events_kept" in metrics

        # n1 back: its feed starts afresh; the map commands its log replays at the start (the
        # queues' creation, the handoff) are not news, what it sees from now on is.
        await asyncio.to_thread(cluster.start, "n1")
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as back:
            await until_event(back, "leader", None, 20.0)
            replayed = [e for e in await events_at(back) if e["kind"] in ("queue_created", "handoff")]
            assert replayed == [], replayed
            await back.create_queue("after-restart")
            assert (await until_event(back, "queue_created", "after-restart", 10.0))["seq"] > 1
    finally:
        for client in clients.values():
            await client.close()


async def _metrics(url: str) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as answer:
        return await answer.text()
