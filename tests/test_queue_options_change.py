"""Changing an existing queue's options, and the options delay_s and receive_wait_s (issue 36).

`PATCH /v1/queues/{q}` names the options to change; in a cluster it is the map command
SetQueueOptions (tag 21), which release 0.2.0 cannot decode, so it waits for cluster feature
level 3, as do delay_s and receive_wait_s set to anything but 0 (names 0.2.0 refuses in a map
entry; an entry without them means 0). Pure units of the command, the map's apply and the
options' validation; one real 3-node cluster (the gate at level 1, then the change on both
members, across a handoff, a node down while it changed, and restarts; the delay and the
receive wait; qctl queue set); one lone node (its own core's record, kept across a kill -9)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import pytest
from aiohttp import web

from client import AsyncClient, Client
from client.http import HttpClient, queue_path
from qserver.api.definitions_routes import CHECKS
from qserver.dev.devcluster import free_port
from qserver.http_errors import error_response
from replication.cluster_map import (
    AddNode,
    ClusterMap,
    CommandError,
    CreateQueue,
    SetFeatureLevel,
    SetQueueOptions,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from replication.definitions import CONFLICT, CREATE, UNCHANGED, export_definitions, plan_import
from replication.options import (
    CHANGEABLE_OPTIONS,
    LEVEL3_OPTIONS,
    OPTION_NAMES,
    OptionError,
    QueueOptions,
    changed_options,
    options_from_json,
    parse_changes,
    parse_options,
)
from tests.test_client_integration import run_qctl
from wire import versions
from wire.errors import (
    E_FEATURE_DISABLED,
    E_INVALID_OPTION,
    E_METHOD_NOT_ALLOWED,
    E_RESERVED_NAME,
    E_UNKNOWN_QUEUE,
    QueueError,
)
from wire.signing import Signer, new_private_key
from wire.version_headers import NODE_HEADER

# Fields of release 0.2.0's QueueOptions (git show <0.2.0>:replication/options.py): what its
# nodes accept in a map entry, a queue record or a snapshot.
OPTIONS_0_2_0 = OPTION_NAMES - LEVEL3_OPTIONS


# --- units: options, the command, the map ----------------------------------------------------------
def test_changes_are_validated_one_by_one_and_only_changeable_names_pass() -> None:
    assert parse_changes({"visibility_timeout_s": 5, "delay_s": 2, "receive_wait_s": 20}) == \
        {"visibility_timeout_s": 5.0, "delay_s": 2.0, "receive_wait_s": 20.0}
    # a defunct interval alone is checked with the queue's fault interval, not here
    assert parse_changes({"defunct_interval_s": 9}) == {"defunct_interval_s": 9.0}
    # an option fixed at creation passes here, validated: refused only when it would change (below)
    assert parse_changes({"strength": "full", "dead_letter": True}) == {"strength": "full", "dead_letter": True}
    for placement in ("master", "replica", "master_required"):
        with pytest.raises(OptionError, match=f"{placement} cannot be changed"):
            parse_changes({placement: "n1", "delay_s": 1})
    for bad, says in (({"delay_s": 901}, "delay_s must be between 0 and 900"), ({"strength": "x"}, "strength must be"),
                      ({"receive_wait_s": 20.5}, "receive_wait_s must be between 0 and 20"),
                      ({"delay_s": True}, "delay_s must be a number"), ({"nope": 1}, "unknown options: nope"),
                      ({}, "at least one"), ([], "JSON object"), ({"max_depth": 0}, "max_depth")):
        with pytest.raises(OptionError, match=says):
            parse_changes(bad)
    assert parse_options({"delay_s": 900, "receive_wait_s": 0})[0] == {"delay_s": 900.0, "receive_wait_s": 0.0}
    assert CHANGEABLE_OPTIONS <= OPTION_NAMES and not {"strength", "type", "min_in_sync", "dead_letter"} \
        & CHANGEABLE_OPTIONS


def test_the_new_options_are_stored_only_when_set_so_0_2_0_reads_the_rest() -> None:
    stored = QueueOptions().to_json()
    assert set(stored) == OPTIONS_0_2_0 and options_from_json(stored) == QueueOptions()
    assert QueueOptions().to_json(every=True)["delay_s"] == 0.0
    slow = QueueOptions(delay_s=3.0)
    assert slow.to_json()["delay_s"] == 3.0 and "receive_wait_s" not in slow.to_json()
    assert options_from_json(slow.to_json()) == slow and slow.delay_ms == 3000
    # a change back to 0 takes the name out of the stored form again
    assert set(changed_options(slow.to_json(), {"delay_s": 0.0})) == OPTIONS_0_2_0
    merged = changed_options(QueueOptions(fault_interval_s=2).to_json(), {"defunct_interval_s": 3.0})
    assert merged["defunct_interval_s"] == 3.0 and merged["fault_interval_s"] == 2.0
    with pytest.raises(OptionError, match="defunct_interval_s needs a fault_interval_s"):
        changed_options(QueueOptions().to_json(), {"defunct_interval_s": 3.0})
    for fixed, value in (("strength", "full"), ("type", "two_way"), ("min_in_sync", 2), ("dead_letter", False)):
        with pytest.raises(OptionError, match=f"{fixed} cannot be changed"):
            changed_options(QueueOptions().to_json(), {fixed: value, "delay_s": 1.0})
    # named with the value the queue has, it is no change (SQS SetQueueAttributes restates a RedrivePolicy)
    same = changed_options(QueueOptions().to_json(), {"strength": "producer", "dead_letter": True, "max_deliveries": 4})
    assert options_from_json(same) == QueueOptions(max_deliveries=4)


def test_the_command_round_trips_and_malformed_rows_are_refused() -> None:
    command = SetQueueOptions("orders", 77, {"visibility_timeout_s": 5.0, "delay_s": 1.5})
    assert SetQueueOptions.TAG == 21 and decode_command(encode_command(command)) == command
    for row in ([21, "orders", "77", {}], [21, "orders", 77, []], [21, 5, 77, {}], [21, "orders", 77]):
        with pytest.raises(CommandError):
            decode_command(msgpack.packb(row, use_bin_type=True))


def _map(level: int) -> ClusterMap:
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}"))
    cluster.apply(CreateQueue("q", QueueOptions().to_json(), "n1", "n2", 41))
    if level > 1:
        cluster.apply(SetFeatureLevel(level))
    return cluster


def test_the_map_changes_an_entry_only_at_level_3_and_only_its_changeable_options() -> None:
    below = _map(2)
    before = dict(below.queues["q"].options)
    [outcome] = below.apply(SetQueueOptions("q", 41, {"visibility_timeout_s": 5.0}))
    assert not outcome.applied and "feature level 3" in outcome.reason and below.queues["q"].options == before
    [outcome] = below.apply(CreateQueue("slow", {**QueueOptions().to_json(), "delay_s": 2.0}, "n1", "n2", 43))
    assert not outcome.applied and "slow" not in below.queues
    # 0 is no value: a create that names it at 0 is what 0.2.0 reads
    [outcome] = below.apply(CreateQueue("zero", {**QueueOptions().to_json(), "delay_s": 0.0}, "n1", "n2", 45))
    assert outcome.applied

    cluster = _map(3)
    [outcome] = cluster.apply(SetQueueOptions("q", 41, {"visibility_timeout_s": 5.0, "delay_s": 2.0}))
    assert outcome.applied and outcome.reason == "changed"
    options = options_from_json(cluster.queues["q"].options)
    assert (options.visibility_timeout_s, options.delay_s, options.strength.value) == (5.0, 2.0, "producer")
    for refused in (SetQueueOptions("q", 40, {"max_deliveries": 3}),            # another incarnation
                    SetQueueOptions("gone", 41, {"max_deliveries": 3}),
                    SetQueueOptions("q", 41, {"strength": "full"}),
                    SetQueueOptions("q", 41, {"max_deliveries": 0}),
                    SetQueueOptions("q", 41, {"defunct_interval_s": 3.0})):     # no fault interval
        [outcome] = cluster.apply(refused)
        assert not outcome.applied, refused
    assert options_from_json(cluster.queues["q"].options) == options
    [again] = cluster.apply(SetQueueOptions("q", 41, {"delay_s": 2.0}))
    assert again.applied and again.reason == "unchanged"
    # a snapshot of the map keeps the change; an entry without the new options stays without
    cluster.apply(CreateQueue("plain", QueueOptions().to_json(), "n2", "n1", 47))
    restored = decode_map(encode_map(cluster))
    assert restored.queues["q"].options == cluster.queues["q"].options and restored.index == cluster.index
    assert set(restored.queues["plain"].options) == OPTIONS_0_2_0
    [outcome] = cluster.apply(CreateQueue("slow", {**QueueOptions().to_json(), "delay_s": 2.0}, "n1", "n2", 49))
    assert outcome.applied


def test_definitions_carry_the_new_options_and_a_different_value_stays_a_conflict() -> None:
    cluster = _map(3)
    cluster.apply(SetQueueOptions("q", 41, {"delay_s": 4.0, "receive_wait_s": 10.0}))
    document = export_definitions(cluster, {}, release="x", now_ms=0)
    [queue] = document["queues"]
    assert (queue["options"]["delay_s"], queue["options"]["receive_wait_s"]) == (4.0, 10.0)
    steps, problems = plan_import(document, ClusterMap(), {}, CHECKS)
    assert problems == [] and steps[0].action == CREATE and steps[0].body["delay_s"] == 4.0
    again, problems = plan_import(document, cluster, {}, CHECKS)
    assert problems == [] and again[0].action == UNCHANGED
    changed = {**document, "queues": [{"name": "q", "options": {**queue["options"], "delay_s": 5.0}}]}
    conflict, problems = plan_import(changed, cluster, {}, CHECKS)
    assert problems == [] and conflict[0].action == CONFLICT and "delay_s" in conflict[0].detail
    # an export without them (0.2.0's, or of a queue that never set them) matches a queue at 0
    plain, problems = plan_import({**document, "queues": [{"name": "q", "options": {"max_deliveries": 10}}]},
                                  _map(3), {}, CHECKS)
    assert problems == [] and plain[0].action == UNCHANGED


def test_the_levels_name_the_release_that_supports_them() -> None:
    assert versions.FEATURE_LEVEL == 3 and versions.FEATURE_LEVEL_RELEASES[3] == "0.3.0"
    assert versions.FEATURES["queue_options_change"] == versions.FEATURES["queue_delay_and_wait"] == 3
    with pytest.raises(QueueError) as refused:
        versions.require_feature(2, "queue_options_change")
    assert refused.value.kind is E_FEATURE_DISABLED and "0.3.0" in refused.value.message


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_node_of_0_2_0_is_reported_too_old_to_change_options() -> None:
    """Release 0.2.0 routes PUT, GET and DELETE on /v1/queues/{q}, not PATCH: its envelope says
    E_METHOD_NOT_ALLOWED, which the client turns into E_FEATURE_DISABLED naming the node's release."""
    async def refuse(request: web.Request) -> web.Response:
        response = error_response(QueueError(E_METHOD_NOT_ALLOWED))
        response.headers[NODE_HEADER] = "0.2.0; protocol=1-1; feature-level=2"
        return response
    app = web.Application()
    app.router.add_route("PATCH", "/v1/queues/{q}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with HttpClient(f"http://127.0.0.1:{port}", Signer("c-1", new_private_key())) as http:
            with pytest.raises(QueueError) as refused:
                await http.set_queue_options("orders", visibility_timeout_s=5)
        assert refused.value.kind is E_FEATURE_DISABLED, refused.value
        assert "too old" in refused.value.message and "0.2.0" in refused.value.message
    finally:
        await runner.cleanup()


# --- a real cluster ---------------------------------------------------------------------------------
PLACEMENT = {"work": ["n1", "n2"], "slow": ["n2", "n3"]}


async def _options_at(cluster: Any, node: str, queue: str) -> dict[str, Any]:
    """The options of the member `node` holds (its own core's), as GET /v1/queues/{q} there describes them."""
    async with AsyncClient(cluster.urls[node], cluster.credentials_path) as client:
        stats = await client.queue_stats(queue)
    assert stats["master_status"] in ("master", "replica"), stats
    return options_from_json(stats["options"]).to_json(every=True)


async def _until_options(cluster: Any, node: str, queue: str, **wanted: Any) -> None:
    deadline = time.monotonic() + 15
    while True:
        options = await _options_at(cluster, node, queue)
        if all(options[name] == value for name, value in wanted.items()):
            return
        assert time.monotonic() < deadline, (node, queue, options, wanted)
        await asyncio.sleep(0.1)


async def _lease_comes_back_after(client: AsyncClient, queue: str, low_s: float, high_s: float) -> None:
    """A message received and left alone is delivered again between low_s and high_s later."""
    await client.enqueue(queue, b"lease")
    [first] = await client.receive(queue, 1, wait_s=5.0)
    started = time.monotonic()
    [again] = await client.receive(queue, 1, wait_s=high_s + 2)
    took = time.monotonic() - started
    assert again.id == first.id and again.deliveries == 2, again
    assert low_s <= took <= high_s, took
    await again.ack()


async def _rest_receive_s(client: AsyncClient, queue: str, query: list[tuple[str, str]]) -> tuple[int, float]:
    started = time.monotonic()
    answer = await client.http.request("POST", queue_path(queue, "receive"), query=query, idempotent=False,
                                       wait_s=25.0)
    return answer.status, time.monotonic() - started


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_options_change_on_a_cluster_gated_by_the_feature_level(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3, PLACEMENT)
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("work", strength="full")
        await client.create_queue("slow")

        # Level 1: refused by every door, nothing changed, nothing created.
        with pytest.raises(QueueError) as refused:
            await client.set_queue_options("work", visibility_timeout_s=1)
        assert refused.value.kind is E_FEATURE_DISABLED and "queue_options_change" in refused.value.message
        with pytest.raises(QueueError) as refused:
            await client.create_queue("delayed", delay_s=2)
        assert refused.value.kind is E_FEATURE_DISABLED and "queue_delay_and_wait" in refused.value.message
        code, document, _ = await asyncio.to_thread(run_qctl, cluster, "queue", "set", "work", "--max-deliveries", "3")
        assert code == 1 and document["error"]["code"] == "E_FEATURE_DISABLED", document
        for node in ("n1", "n2"):
            assert (await _options_at(cluster, node, "work"))["visibility_timeout_s"] == 30.0
        assert "delayed" not in {queue["name"] for queue in await client.list_queues()}

        await client.finalize_cluster()

        # Bad input: a stable code, nothing changed.
        for bad, says in (({"strength": "producer"}, "strength cannot be changed"),
                          ({"delay_s": 901}, "delay_s must be between"), ({"defunct_interval_s": 5}, "fault"),
                          ({"visibility_timeout_s": "soon"}, "must be a number")):
            with pytest.raises(QueueError) as refused:
                await client.set_queue_options("work", **bad)
            assert refused.value.kind is E_INVALID_OPTION and says in refused.value.message, refused.value
        with pytest.raises(QueueError) as refused:
            await client.set_queue_options("nothing-here", max_depth=5)
        assert refused.value.kind is E_UNKNOWN_QUEUE
        with pytest.raises(QueueError) as refused:
            await client.set_queue_options("work.dlq", max_depth=5)
        assert refused.value.kind is E_RESERVED_NAME

        # The visibility timeout of new leases, on the master (n1) and both members' cores.
        changed = await client.set_queue_options("work", visibility_timeout_s=1.0, strength="full", dead_letter=True)
        assert changed["options"]["visibility_timeout_s"] == 1.0 and changed["changed"] == ["visibility_timeout_s"]
        assert changed["options"]["strength"] == "full" and changed["options"]["delay_s"] == 0.0
        for node in ("n1", "n2"):
            await _until_options(cluster, node, "work", visibility_timeout_s=1.0)
        await _lease_comes_back_after(client, "work", 0.7, 4.0)
        # ...and after a handoff: n2 masters it with the same options
        await client.handoff("work")
        deadline = time.monotonic() + 15
        while next(q for q in await client.list_queues() if q["name"] == "work")["master"] != "n2":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await _lease_comes_back_after(client, "work", 0.7, 4.0)

        # delay_s: a message put without a delay waits it; one with its own delay keeps that.
        await client.set_queue_options("slow", delay_s=3.0)
        await _until_options(cluster, "n3", "slow", delay_s=3.0)
        put_at = time.monotonic()
        plain = await client.enqueue("slow", b"plain")
        own = await client.enqueue("slow", b"own", delay_s=0.2)
        [first] = await client.receive("slow", 1, wait_s=2.5)
        assert first.id == own and time.monotonic() - put_at < 2.9, time.monotonic() - put_at
        await first.ack()
        [second] = await client.receive("slow", 1, wait_s=6.0)
        assert second.id == plain and time.monotonic() - put_at >= 2.8, time.monotonic() - put_at
        await second.ack()
        assert (await client.set_queue_options("slow", delay_s=0))["options"]["delay_s"] == 0.0
        quick = await client.enqueue("slow", b"quick")
        [now] = await client.receive("slow", 1, wait_s=1.0)
        assert now.id == quick
        await now.ack()

        # receive_wait_s: a REST receive that names no wait waits it; one that names 0 does not.
        await client.set_queue_options("slow", receive_wait_s=1.5)
        status, took = await _rest_receive_s(client, "slow", [])
        assert status == 204 and 1.3 <= took < 5, took
        status, took = await _rest_receive_s(client, "slow", [("wait_s", "0")])
        assert status == 204 and took < 1.0, took

        # A node down while the options change takes them when it comes back; a restart keeps them.
        cluster.kill("n3")
        await client.close()
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.set_queue_options("slow", max_deliveries=4, message_ttl_s=60)
                break
            except QueueError as error:     # the pair may be between a failover's steps
                assert error.kind.retriable and time.monotonic() < deadline, error
                await asyncio.sleep(0.2)
        cluster.start("n3")
        for node in ("n2", "n3"):
            await _until_options(cluster, node, "slow", max_deliveries=4, message_ttl_s=60.0, delay_s=0.0,
                                 receive_wait_s=1.5)
        cluster.kill("n1")
        cluster.start("n1")
    for node in ("n1", "n2"):
        await _until_options(cluster, node, "work", visibility_timeout_s=1.0)

    # qctl queue set --json
    code, document, _ = await asyncio.to_thread(run_qctl, cluster, "queue", "set", "work", "--max-deliveries", "3",
                                                "--delay-s", "0.5")
    assert code == 0 and document["options"]["max_deliveries"] == 3 and document["options"]["delay_s"] == 0.5, document
    assert document["changed"] == ["delay_s", "max_deliveries"]
    code, document, _ = await asyncio.to_thread(run_qctl, cluster, "queue", "create", "made-slow", "--delay-s", "4",
                                                "--receive-wait-s", "2")
    assert code == 0 and (document["options"]["delay_s"], document["options"]["receive_wait_s"]) == (4.0, 2.0)


# --- a lone node ---------------------------------------------------------------------------------
def _sync_set(node: Any, queue: str, **options: Any) -> list[str]:
    """The synchronous client's call: the names it changed."""
    with Client(node.url, node.credentials_path) as client:
        return list(client.set_queue_options(queue, **options)["changed"])


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_lone_node_changes_its_own_queue_durably(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        await client.create_queue("solo", visibility_timeout_s=10)
        changed = await client.set_queue_options("solo", visibility_timeout_s=1, receive_wait_s=1, delay_s=0.5)
        assert (changed["options"]["visibility_timeout_s"], changed["options"]["receive_wait_s"],
                changed["options"]["delay_s"]) == (1.0, 1.0, 0.5)
        with pytest.raises(QueueError) as refused:
            await client.set_queue_options("solo", type="two_way")
        assert refused.value.kind is E_INVALID_OPTION and "type cannot be changed" in refused.value.message
        with pytest.raises(QueueError) as refused:
            await client.set_queue_options("absent", max_depth=3)
        assert refused.value.kind is E_UNKNOWN_QUEUE
        status, took = await _rest_receive_s(client, "solo", [])
        assert status == 204 and 0.8 <= took < 4, took
        assert await asyncio.to_thread(_sync_set, qnode, "solo", max_depth=500) == ["max_depth"]
    qnode.restart()         # kill -9: the answer came after the record was durable
    async with AsyncClient(qnode.url, qnode.credentials_path) as client:
        options = (await client.queue_stats("solo"))["options"]
        assert (options["visibility_timeout_s"], options["receive_wait_s"], options["delay_s"]) == (1.0, 1.0, 0.5)
        assert options["max_depth"] == 500
        put_at = time.monotonic()
        await client.enqueue("solo", b"x")
        [message] = await client.receive("solo", 1, wait_s=3.0)
        assert time.monotonic() - put_at >= 0.4
        started = time.monotonic()
        [again] = await client.receive("solo", 1, wait_s=4.0)
        assert again.id == message.id and 0.7 <= time.monotonic() - started <= 3.0
        await again.ack()
