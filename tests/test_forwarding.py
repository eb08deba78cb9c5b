"""Store-and-forward between two clusters with adaptive rate control (issue 16, seed 003), on
real processes: a forward made through qctl moves a `full` queue's messages into a queue of
another cluster, each stored there once across a kill -9 of the source's master (the forwarder
moves with the queue), and the root hands out rates from the forwarders' weights."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any, cast

import pytest

from client import AsyncClient
from qserver.dev.devcluster import LocalCluster
from qserver.features.forwards import root as forward_root
from qserver.features.forwards.forwarder import TokenBucket, weight_of
from qserver.features.forwards.root import compute_rates
from qserver.services import NodeServices
from replication.cluster_map import (
    AddNode,
    ClusterMap,
    CreateQueue,
    DeleteForward,
    DeleteQueue,
    PutForward,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from tests.support import RawApi, error_code, raw_session
from tests.test_client_integration import run_qctl
from tests.test_surveillance import until
from wire.errors import QueueError
from wire.protocol import ForwardSessionOp


async def drain(client: AsyncClient, queue: str, into: list[bytes], want: int, timeout_s: float = 60.0) -> None:
    """Receive and ack from `queue` until `want` messages were taken in all."""
    deadline = time.monotonic() + timeout_s
    while len(into) < want and time.monotonic() < deadline:
        for message in await client.receive(queue, 100, wait_s=0.5):
            into.append(message.payload)
            await message.ack()
    assert len(into) >= want, f"{len(into)} of {want} arrived"


def remote_credentials(cluster: LocalCluster) -> dict[str, str]:
    document = json.loads(cluster.credentials_path.read_text())
    return {"client_id": document["client_id"], "private_key": document["private_key"]}


# --- the pure parts ------------------------------------------------------------------------------
def test_rates_follow_the_paper() -> None:
    """Seed 003 figure 6: Rᵢ = R·wᵢ/Σw; R/n when no weight (and for a session opening, and static)."""
    assert compute_rates(25.0, "adaptive", {"mq1": 2, "mq2": 6, "mq3": 9}) == pytest.approx(
        {"mq1": 25 * 2 / 17, "mq2": 25 * 6 / 17, "mq3": 25 * 9 / 17})
    assert compute_rates(30.0, "adaptive", {"a": 0, "b": 0, "c": 0}) == {"a": 10.0, "b": 10.0, "c": 10.0}
    assert compute_rates(30.0, "adaptive", {"a": 3, "b": 0}, opening="b") == {"b": 15.0}
    assert compute_rates(30.0, "static", {"a": 9, "b": 0, "c": 1}) == {"a": 10.0, "b": 10.0, "c": 10.0}
    assert compute_rates(0.0, "adaptive", {"a": 9}) == {"a": None}
    assert compute_rates(30.0, "adaptive", {}) == {}
    assert [weight_of(depth, 200, 10) for depth in (0, 19, 20, 100, 199, 200)] == [0, 0, 1, 5, 9, 9]


def test_a_forward_lives_in_the_map_from_a_full_source_and_keeps_its_secret() -> None:
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}", True, 1))
    cluster.apply(CreateQueue("sensors", {"strength": "full"}, "n1", "n2", 7))
    cluster.apply(CreateQueue("loose", {"strength": "producer"}, "n1", "n2", 8))
    forward = PutForward("f1", "sensors", "collect", ("http://b1", "http://b2"), "fwd", "KEY", 5, "9f3a")
    assert decode_command(encode_command(forward)) == forward
    assert cluster.apply(forward)[0].applied
    refused = [cluster.apply(PutForward(name, source, "collect", (), "", "", 6))[0]
               for name, source in (("f1", "sensors"), ("f2", "loose"), ("f3", "missing"), ("f4", "sensors"))]
    assert [outcome.applied for outcome in refused] == [False] * 4      # taken, producer, no queue, forwarded
    copy = decode_map(encode_map(cluster))
    assert copy.forwards["f1"].secret == "KEY" and copy.forwards["f1"].urls == ("http://b1", "http://b2")
    assert copy.forwards["f1"].identity == "f1.9f3a"
    assert "KEY" not in str(cluster.to_json())
    cluster.apply(DeleteQueue("sensors", 7))
    assert cluster.forwards == {}                                       # gone with its source
    assert not cluster.apply(DeleteForward("f1"))[0].applied


def test_the_token_bucket_paces_to_its_rate_and_holds_no_long_burst() -> None:
    now = [100.0]
    bucket = TokenBucket(0.0, clock=lambda: now[0])
    assert bucket.take(100) == 0
    bucket.set_rate(50.0)
    now[0] += 10.0                       # idle for long: at most BURST_S (0.1 s) worth, 5 messages
    assert bucket.take(100) == 5 and bucket.take(100) == 0
    assert bucket.wait_s() == pytest.approx(0.02)
    sent = 0
    for _ in range(100):                 # a second at 10 ms steps: the rate, give or take the burst
        now[0] += 0.01
        sent += bucket.take(100)
    assert 49 <= sent <= 51
    bucket.give_back(3)
    assert bucket.take(100) == 3
    bucket.span_s = 0.5                  # a send cycle of 0.5 s: what accrues over it is kept
    now[0] += 0.5
    assert bucket.take(100) == 25
    bucket.set_rate(None)                # no control: as much as asked
    assert bucket.take(100) == 100 and bucket.wait_s() == 0.0


@pytest.mark.asyncio
async def test_a_bucket_waiting_for_a_rate_wakes_when_it_is_given() -> None:
    bucket = TokenBucket(0.0)
    waiting = asyncio.get_running_loop().create_task(bucket.acquire(10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    started = time.monotonic()
    bucket.set_rate(None)
    assert await asyncio.wait_for(waiting, 0.5) == 10 and time.monotonic() - started < 0.05


# --- two clusters ---------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_forward_moves_each_message_once_across_a_kill_of_the_source_master(qcluster_factory: Any) -> None:
    source_cluster: LocalCluster = qcluster_factory(3, {"sensors": ["n1", "n2"]})
    root_cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(source_cluster.urls["n3"], source_cluster.credentials_path) as here, \
            AsyncClient(root_cluster.urls["n1"], root_cluster.credentials_path) as there:
        await there.create_queue("collect", strength="full", forward_rate=400.0, forward_interval_s=0.5)
        await here.create_queue("sensors", strength="full", max_depth=2_000)
        with pytest.raises(QueueError) as refused:        # under `producer` a replica's copy would never go
            await here.create_queue("loose", strength="producer")
            await here.create_forward("bad", "loose", "collect", urls=[root_cluster.urls["n1"]],
                                      credentials=remote_credentials(root_cluster))
        assert refused.value.code == "E_FORWARD_REFUSED"
        # Made through qctl, as an operator would: the other cluster's credentials file (its url
        # names the cluster), and every node of it.
        urls = [arg for node in root_cluster.ids for arg in ("--remote-url", root_cluster.urls[node])]
        code, made, err = await asyncio.to_thread(
            run_qctl, source_cluster, "--url", source_cluster.urls["n3"], "forward", "create", "f1", "--source",
            "sensors", "--destination", "collect", "--remote-credentials", str(root_cluster.credentials_path), *urls)
        assert code == 0 and made["source"] == "sensors" and made["urls"] == list(root_cluster.urls.values()), err
        assert made["client_id"] == remote_credentials(root_cluster)["client_id"]
        assert remote_credentials(root_cluster)["private_key"] not in json.dumps(made)
        sent = [b"s%04d" % i for i in range(400)]
        for i in range(0, 200, 50):
            await here.enqueue_many("sensors", sent[i:i + 50])
        received: list[bytes] = []
        await drain(there, "collect", received, 100)
        stats = await until(lambda: _open_stats(here, "f1"), "the forwarder's session")
        assert stats["node"] == "n1" and stats["rate"] == pytest.approx(400.0) and stats["terms"]["mode"] == "adaptive"
        # kill -9 of the source's master while messages cross: the forwarder restarts on n2
        producing = asyncio.get_running_loop().create_task(_produce(here, sent[200:]))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(source_cluster.kill, "n1")
        await producing
        await drain(there, "collect", received, len(sent), timeout_s=90.0)
        stats = await until(lambda: _open_stats(here, "f1"), "the forwarder on the new master")
        assert stats["node"] == "n2" and stats["sessions"] >= 1
        # What the killed master's forwarder had leased comes back when its lease runs out
        # (10 s) and goes again: the root answers each as a repeat and stores nothing.
        async def source_empty() -> bool:
            return (await here.queue_stats("sensors"))["depth"] == 0
        await until(source_empty, "the source emptied", timeout_s=40.0)
        for message in await there.receive("collect", 100, wait_s=1.0):
            received.append(message.payload)
        assert sorted(received) == sorted(sent), "each message once, none lost"
        listed = await here.forwards()
        assert [(f["name"], f["runs_on"]) for f in listed] == [("f1", "n2")]
        await here.delete_forward("f1")
        assert await here.forwards() == []


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_forwarder_leaves_a_silent_root_and_opens_its_session_at_the_new_master(qcluster_factory: Any) -> None:
    """SIGSTOP of the root's node (the socket stays open, nothing answers): the forwarder's
    keepalive goes unanswered for the hold time, it lets that session go, and opens one at the
    destination's new master once it failed over; every message arrives once."""
    cluster: LocalCluster = qcluster_factory(3, {"src": ["n1", "n3"], "dst": ["n2", "n3"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("dst", strength="full", forward_rate=200.0, forward_interval_s=0.5)
        await client.create_queue("src", strength="full")
        await client.create_forward("watch", "src", "dst")
        sent = [b"w%03d" % i for i in range(120)]
        await client.enqueue_many("src", sent[:60])
        first = await until(lambda: _open_stats(client, "watch"), "the session")
        assert first["terms"]["hold_s"] == pytest.approx(3.0)
        received: list[bytes] = []
        await drain(client, "dst", received, 60)
        cluster.processes["n2"].send_signal(signal.SIGSTOP)
        try:
            await client.enqueue_many("src", sent[60:])

            async def reopened() -> dict[str, Any] | None:
                stats = await _open_stats(client, "watch")
                return stats if stats is not None and stats["sessions"] >= 2 else None
            again = await until(reopened, "a session at the new master", timeout_s=60.0)
            assert again["state"] == "open"
            assert (await client.cluster())["queues"]["dst"]["master"] == "n3"
            await drain(client, "dst", received, len(sent))
        finally:
            cluster.processes["n2"].send_signal(signal.SIGCONT)
        assert sorted(received) == sorted(sent)


class _OneQueueOutsideACluster:
    """What ForwardRoot reads of the node's services (qserver/services.py), for a node outside
    a cluster that holds one queue: it serves that queue's sessions itself."""
    clustered = False
    cluster_map = None

    def __init__(self, queue: str, options: Any) -> None:
        import types
        self._queue, self._core = queue, types.SimpleNamespace(options=options)

    def held_core(self, queue: str) -> Any:
        return self._core if queue == self._queue else None

    def is_master(self, queue: str) -> bool:
        return False


def test_the_root_drops_a_session_it_has_not_heard_from_for_its_hold_time() -> None:
    """The root's side of §3.2: a forwarder silent for the hold time leaves the weight table
    (its share goes to the others); one that keeps alive stays."""
    import types
    now = [1_000.0]
    options = types.SimpleNamespace(forward_rate=30.0, forward_interval_s=2.0, forward_mode="adaptive",
                                    forward_bands=10)
    root = forward_root.ForwardRoot(cast(NodeServices, _OneQueueOutsideACluster("dst", options)),
                                    clock=lambda: now[0])
    sent: list[Any] = []
    def client(client_id: str) -> Any:
        return types.SimpleNamespace(client_id=client_id, allows=lambda privilege, queue: False)
    connection = types.SimpleNamespace(closed=False, emit=sent.append, principal=client("fwd"))
    root._start = lambda: None      # type: ignore[method-assign]   # ticked by hand below
    for name, weight in (("a", 2), ("b", 6)):
        terms = root.session(connection, ForwardSessionOp(1, "dst", name, weight, True))
    assert terms["keepalive_s"] == 1.0 and terms["hold_s"] == 3.0 and terms["rate"] == 15.0
    now[0] += 2.5
    assert root.session(connection, ForwardSessionOp(2, "dst", "b", 6, False)) == 15.0
    root._check("dst")                                      # T passed: rates from the weights
    assert [(r.forward, r.rate) for r in sent] == [("a", 7.5), ("b", 22.5)]
    now[0] += 1.0                                           # a: silent 3.5 s > hold; b: 1 s
    sent.clear()
    root._check("dst")
    assert [s["forward"] for s in root.sessions_of("dst")] == ["b"]
    now[0] += 2.0
    root._check("dst")
    assert [(r.forward, r.rate) for r in sent] == [("b", 30.0)]      # its share is b's now
    with pytest.raises(QueueError) as unknown:
        root.session(connection, ForwardSessionOp(3, "dst", "a", 0, False))
    assert unknown.value.code == "E_UNKNOWN_FORWARD"
    # Bounded: one client holds at most SESSIONS_PER_CLIENT_MAX, the queue SESSIONS_MAX.
    others = [types.SimpleNamespace(closed=False, emit=sent.append, principal=client(f"c{n}")) for n in range(8)]
    for number in range(forward_root.SESSIONS_MAX - 1):
        owner = connection if number < forward_root.SESSIONS_PER_CLIENT_MAX - 1 else \
            others[number // forward_root.SESSIONS_PER_CLIENT_MAX]
        root.session(owner, ForwardSessionOp(4, "dst", f"f{number}", 0, True))
    with pytest.raises(QueueError) as mine_full:
        root.session(connection, ForwardSessionOp(5, "dst", "one-more", 0, True))
    assert mine_full.value.code == "E_OVERLOADED"
    with pytest.raises(QueueError) as full:
        root.session(others[-1], ForwardSessionOp(5, "dst", "one-more", 0, True))
    assert full.value.code == "E_OVERLOADED" and len(root.sessions_of("dst")) == forward_root.SESSIONS_MAX
    assert root.session(connection, ForwardSessionOp(6, "dst", "b", 6, True))["rate"] is not None   # reopening one


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_malformed_forwards_and_session_frames_are_refused_with_codes_and_change_nothing(
        qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("src", strength="full")
        await client.create_queue("dst", strength="full", forward_rate=10.0)
        with pytest.raises(QueueError) as bad_option:
            await client.create_queue("odd", forward_mode="sometimes")
        assert bad_option.value.code == "E_INVALID_OPTION"

        async with raw_session() as session:
            api = RawApi.for_credentials(session, cluster.credentials_path)
            for body, code in (({"name": "f", "source": "src"}, "E_INVALID_OPTION"),
                               ({"name": "f", "source": "src", "destination": "src"}, "E_INVALID_OPTION"),
                               ({"name": "f", "source": "src", "destination": "dst", "urls": ["ftp://x"]},
                                "E_INVALID_OPTION"),
                               ({"name": "f", "source": "src", "destination": "dst", "urls": ["http://127.0.0.1:9"],
                                 "credentials": {"client_id": "a", "private_key": "not a key"}}, "E_INVALID_OPTION"),
                               ({"name": "f", "source": "nowhere", "destination": "dst"}, "E_UNKNOWN_QUEUE"),
                               (b"{not json", "E_BAD_JSON")):
                _, answer, _ = await api.request("POST", "/v1/forwards", body)
                assert error_code(answer) == code, (body, answer)
            _, answer, _ = await api.request("GET", "/v1/forwards/none")
            assert error_code(answer) == "E_UNKNOWN_FORWARD"
            _, answer, _ = await api.request("DELETE", "/v1/forwards/none")
            assert error_code(answer) == "E_UNKNOWN_FORWARD"
        # A data message without a session, and a keepalive of none: E_UNKNOWN_FORWARD.
        await client.enqueue("dst", b"kept")
        with pytest.raises(QueueError) as no_session:
            await client.forward_data("dst", "ghost", "ghost@1", 0, 1, [(b"x", 4, 1, 0, None)])
        assert no_session.value.code == "E_UNKNOWN_FORWARD"
        terms = await client.forward_session("dst", "probe", 0, open=True)
        assert terms["rate"] == pytest.approx(10.0) and terms["mode"] == "adaptive"
        outcomes = await client.forward_data("dst", "probe", "probe@1", 0, 1, [(b"a", 4, 5, 0, None),
                                                                            (b"a", 4, 5, 0, None),
                                                                            (b"b", 4, 3, 0, {"x-sequence-floor": "9"})])
        assert isinstance(outcomes[0], int) and outcomes[1] == outcomes[0]    # the same number: once
        assert isinstance(outcomes[2], int)       # the stream's own floor wins over a header's
        assert await client.forwards() == []
        assert (await client.queue_stats("dst"))["depth"] == 3


async def _open_stats(client: AsyncClient, name: str) -> dict[str, Any] | None:
    """The forwarder's figures once its session is open (a node learns of a new forward when
    the map change reaches it: until then it answers E_UNKNOWN_FORWARD)."""
    try:
        stats = await client.forward_stats(name)
    except QueueError as error:
        if error.code != "E_UNKNOWN_FORWARD":
            raise
        return None
    return stats if stats.get("state") == "open" else None


async def _produce(client: AsyncClient, payloads: list[bytes]) -> None:
    """Enqueue each payload once, retrying a failed call with its dedupe id (a failover)."""
    for i, payload in enumerate(payloads):
        for _ in range(50):
            try:
                await client.enqueue("sensors", payload, dedupe_id=payload.decode())
                break
            except QueueError as error:
                if not (error.retriable or error.outcome_unknown):
                    raise
                await asyncio.sleep(0.2)
        if i % 20 == 0:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_root_gives_the_fuller_source_the_larger_rate(qcluster_factory: Any) -> None:
    """Two forwards into one root at 40 messages/s: a source filled to half its bound gets
    nearly all of it while the other, near empty, gets little (adaptive); a static root
    splits it evenly whatever the fill."""
    cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("root", strength="full", forward_rate=40.0, forward_interval_s=0.3)
        for name in ("busy", "quiet"):
            await client.create_queue(name, strength="full", max_depth=1_000)
        await client.enqueue_many("busy", [b"b"] * 600)
        await client.enqueue_many("quiet", [b"q"] * 20)
        for name in ("busy", "quiet"):
            await client.create_forward(f"from-{name}", name, "root")

        async def adaptive_split() -> Any:
            busy, quiet = await _open_stats(client, "from-busy"), await _open_stats(client, "from-quiet")
            if busy is None or quiet is None or busy.get("rate") is None or quiet.get("rate") is None \
                    or not busy["weight"]:
                return None
            return (busy, quiet) if busy["rate"] > 30.0 and quiet["rate"] < 10.0 else None
        busy, quiet = await until(adaptive_split, "the busy source's larger rate")
        assert busy["weight"] >= 3 and busy["rate"] + quiet["rate"] == pytest.approx(40.0, abs=0.01)
        master = (await client.cluster())["queues"]["root"]["master"]
        async with AsyncClient(cluster.urls[master], cluster.credentials_path) as at_root:
            sessions = {s["forward"]: s for s in (await at_root.queue_stats("root"))["forward_sessions"]}
        assert {name.split(".")[0] for name in sessions} == {"from-busy", "from-quiet"}   # each its id: name.token
        assert sessions[busy["id"]]["received"] > 0
        await client.delete_forward("from-busy")
        await client.delete_forward("from-quiet")
        # The same through qctl, with a static root.
        await client.create_queue("flat", strength="full", forward_rate=40.0, forward_mode="static")
        code, made, err = await asyncio.to_thread(run_qctl, cluster, "forward", "create", "to-flat", "--source",
                                                  "busy", "--destination", "flat")
        assert code == 0 and made["destination"] == "flat", err
        stats = await until(lambda: _open_stats(client, "to-flat"), "the static session")
        assert stats["rate"] == pytest.approx(40.0) and stats["terms"]["mode"] == "static"
        code, shown, err = await asyncio.to_thread(run_qctl, cluster, "forward", "stats", "to-flat")
        assert code == 0 and shown["source"] == "busy" and shown["state"] == "open", err
        await asyncio.sleep(1.0)
        assert (await client.queue_stats("flat"))["total_enqueued"] <= 40 * 3 + 10   # paced, not 500 at once
