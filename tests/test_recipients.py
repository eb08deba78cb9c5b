"""Recipients and their alternatives in the cluster map (issue 15, items 5-7's directory and
states; seed 001): set through the API and qctl, the same at every node, refused when
malformed. What fault surveillance does with them: tests/test_surveillance.py."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient
from client.errors import QueueError
from replication.cluster_map import (
    AddNode,
    ClusterMap,
    CreateQueue,
    DeleteQueue,
    PutRecipient,
    SetAlternatives,
    decode_map,
    encode_map,
)
from tests.test_client_integration import run_qctl


def test_the_map_keeps_a_chain_in_order_and_an_empty_one_clears_it() -> None:
    cluster = ClusterMap()
    cluster.apply(SetAlternatives("billing", ("billing-b", "billing-c")))
    assert decode_map(encode_map(cluster)).alternatives == {"billing": ("billing-b", "billing-c")}
    assert cluster.to_json()["alternatives"] == {"billing": ["billing-b", "billing-c"]}
    cluster.apply(SetAlternatives("billing", ()))
    assert cluster.alternatives == {}


def test_a_recipient_receives_from_one_queue_and_its_state_changes_are_kept_in_snapshots() -> None:
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}", True, node))
    cluster.apply(CreateQueue("billing", {"strength": "full"}, "n1", "n2", 7))
    [registered] = cluster.apply(PutRecipient("billing-a", "billing", "ok", 1_000, "subscribed"))
    assert registered.applied
    [faulted] = cluster.apply(PutRecipient("billing-a", "billing", "fault", 2_000, "took no message"))
    assert faulted.applied and not cluster.apply(PutRecipient("billing-a", "billing", "fault", 3_000))[0].applied
    assert not cluster.apply(PutRecipient("billing-a", "other", "ok", 3_000))[0].applied      # one queue
    assert not cluster.apply(PutRecipient("billing-a", "billing", "asleep", 3_000))[0].applied
    copy = decode_map(encode_map(cluster))
    assert copy.recipients["billing-a"].to_json() == {"name": "billing-a", "queue": "billing", "state": "fault",
                                                      "since_ms": 2_000, "reason": "took no message"}
    cluster.apply(DeleteQueue("billing", 7))
    assert cluster.recipients == {}                            # gone with its queue


@pytest.mark.asyncio
async def test_alternatives_are_set_once_and_read_at_every_node(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as other:
        assert await admin.set_alternatives("billing", ["billing-b", "billing-c"]) == {
            "recipient": "billing", "alternatives": ["billing-b", "billing-c"]}
        assert await admin.alternatives("billing") == ["billing-b", "billing-c"]
        deadline = time.monotonic() + 5           # the map reaches the other nodes a moment later
        while await other.alternatives("billing") != ["billing-b", "billing-c"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await other.cluster())["alternatives"] == {"billing": ["billing-b", "billing-c"]}
        for chain in (["billing"], ["x", "x"], ["bad name"], [f"r{n}" for n in range(17)]):
            with pytest.raises(QueueError) as refused:
                await admin.set_alternatives("billing", chain)
            assert refused.value.code in ("E_INVALID_OPTION", "E_INVALID_NAME")
        assert await other.alternatives("billing") == ["billing-b", "billing-c"]     # unchanged


def test_qctl_sets_lists_and_clears_alternatives(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    code, document, _ = run_qctl(cluster, "recipient", "alternatives", "mail", "--set", "mail-2", "mail-3")
    assert code == 0 and document["alternatives"] == ["mail-2", "mail-3"]
    code, listed, _ = run_qctl(cluster, "recipient", "list")
    assert code == 0 and [c["recipient"] for c in listed["recipients"]] == ["mail"]
    assert run_qctl(cluster, "recipient", "alternatives", "mail", "--clear")[1]["alternatives"] == []
    assert run_qctl(cluster, "recipient", "alternatives", "mail")[1]["alternatives"] == []
