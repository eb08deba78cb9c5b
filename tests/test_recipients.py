"""Recipients and their alternatives in the cluster map (issue 15, items 5-7's directory and
states; seed 001): set through the API and qctl, the same at every node, refused when
malformed. What fault surveillance does with them: tests/test_surveillance.py."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient, Client
from client.qctl_features import _recipient_text
from replication.cluster_map import (
    RECIPIENTS_PER_CLIENT_MAX,
    AddNode,
    ClusterMap,
    CreateQueue,
    DeleteQueue,
    NoteRecipient,
    PutRecipient,
    RemoveRecipient,
    SetAlternatives,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from tests.test_client_integration import run_qctl
from wire.errors import QueueError


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
    [registered] = cluster.apply(PutRecipient("billing-a", "billing", "ok", 1_000, "subscribed", "c-1"))
    assert registered.applied
    [faulted] = cluster.apply(PutRecipient("billing-a", "billing", "fault", 2_000, "took no message"))
    assert faulted.applied and not cluster.apply(PutRecipient("billing-a", "billing", "fault", 3_000))[0].applied
    assert not cluster.apply(PutRecipient("billing-a", "other", "ok", 3_000))[0].applied      # one queue
    assert not cluster.apply(PutRecipient("billing-a", "billing", "asleep", 3_000))[0].applied
    copy = decode_map(encode_map(cluster))
    assert copy.recipients["billing-a"].to_json() == {"name": "billing-a", "queue": "billing", "state": "fault",
                                                      "since_ms": 2_000, "reason": "took no message", "owner": "c-1"}
    cluster.apply(DeleteQueue("billing", 7))
    assert cluster.recipients == {}                            # gone with its queue


def billing_map() -> ClusterMap:
    cluster = ClusterMap()
    for storage_id, node in enumerate(("n1", "n2"), 1):
        cluster.apply(AddNode(node, f"http://{node}", True, storage_id))
    cluster.apply(CreateQueue("invoices", {"strength": "full"}, "n1", "n2", 7))
    return cluster


def test_removing_a_recipient_forgets_its_state_and_its_chain_and_an_unknown_name_is_refused() -> None:
    cluster = billing_map()
    cluster.apply(PutRecipient("billing-a", "invoices", "fault", 1_000, "took no message for 5 s while 4 waited"))
    cluster.apply(SetAlternatives("billing-a", ("billing-b",)))
    cluster.apply(SetAlternatives("billing-c", ("billing-a",)))
    for command in (RemoveRecipient("billing-a"), NoteRecipient("billing-a", "invoices", "fault", 1_000, "why")):
        assert decode_command(encode_command(command)) == command
    assert {RemoveRecipient.TAG, NoteRecipient.TAG} == {18, 19}             # new tags, none reused

    [removed] = cluster.apply(RemoveRecipient("billing-a"))
    assert removed.applied and "billing-a" not in cluster.recipients and "billing-a" not in cluster.alternatives
    assert cluster.alternatives["billing-c"] == ("billing-a",)                # another's chain keeps the name
    assert not cluster.apply(RemoveRecipient("billing-a"))[0].applied        # unknown now
    [chain_only] = cluster.apply(RemoveRecipient("billing-c"))               # a chain alone is a recipient too
    assert chain_only.applied and cluster.alternatives == {}
    assert decode_map(encode_map(cluster)).recipients == {}


def test_a_note_restates_the_reason_of_the_current_spell_only() -> None:
    cluster = billing_map()
    cluster.apply(PutRecipient("billing-a", "invoices", "fault", 1_000, "took no message for 5 s while 4 waited"))
    restated = "took no message for 5 s; nothing waits for it now"
    assert not cluster.apply(NoteRecipient("billing-a", "invoices", "fault", 999, restated))[0].applied  # older spell
    assert not cluster.apply(NoteRecipient("billing-a", "invoices", "ok", 1_000, restated))[0].applied
    [noted] = cluster.apply(NoteRecipient("billing-a", "invoices", "fault", 1_000, restated))
    assert noted.applied
    assert cluster.recipients["billing-a"].to_json() == {"name": "billing-a", "queue": "invoices", "state": "fault",
                                                         "since_ms": 1_000, "reason": restated, "owner": ""}
    assert not cluster.apply(NoteRecipient("billing-a", "invoices", "fault", 1_000, restated))[0].applied


def test_recipient_list_marks_an_alternative_that_consumes_the_same_queue() -> None:
    listed: list[dict[str, Any]] = [{"recipient": "billing-a", "queue": "invoices", "state": "ok", "reason": "subscribed",
               "alternatives": ["billing-b", "billing-c"]},
              {"recipient": "billing-b", "queue": "invoices", "state": "ok", "reason": "subscribed",
               "alternatives": []},
              {"recipient": "billing-c", "queue": "invoices-c", "state": "ok", "reason": "subscribed",
               "alternatives": []}]
    queues = {r["recipient"]: r["queue"] for r in listed}
    assert _recipient_text(listed[0], queues) == \
        "billing-a: ok on invoices, alternatives billing-b (same queue: never used) -> billing-c"


@pytest.mark.asyncio
async def test_alternatives_are_set_once_and_read_at_every_node(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin, \
            AsyncClient(cluster.urls["n3"], cluster.credentials_path) as other:
        assert await admin.set_alternatives("billing", ["billing-b=invoices-b", "billing-c=invoices-c"]) == {
            "recipient": "billing", "alternatives": ["billing-b", "billing-c"], "queues": ["invoices-b", "invoices-c"]}
        assert await admin.alternatives("billing") == ["billing-b", "billing-c"]
        deadline = time.monotonic() + 5           # the map reaches the other nodes a moment later
        while await other.alternatives("billing") != ["billing-b", "billing-c"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await other.cluster())["alternatives"] == {"billing": ["billing-b", "billing-c"]}
        for chain in (["billing=q"], ["x=q", "x=q"], ["bad name=q"], ["never-subscribed"],
                      [f"r{n}=q" for n in range(17)]):
            with pytest.raises(QueueError) as refused:
                await admin.set_alternatives("billing", chain)
            assert refused.value.code in ("E_INVALID_OPTION", "E_INVALID_NAME")
        assert await other.alternatives("billing") == ["billing-b", "billing-c"]     # unchanged


def test_qctl_sets_lists_and_clears_alternatives(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    code, document, _ = run_qctl(cluster, "recipient", "alternatives", "mail", "--set", "mail-2=q2", "mail-3=q3")
    assert code == 0 and document["alternatives"] == ["mail-2", "mail-3"]
    code, listed, _ = run_qctl(cluster, "recipient", "list")
    assert code == 0 and [c["recipient"] for c in listed["recipients"]] == ["mail"]
    assert run_qctl(cluster, "recipient", "alternatives", "mail", "--clear")[1]["alternatives"] == []
    assert run_qctl(cluster, "recipient", "alternatives", "mail")[1]["alternatives"] == []


def test_qctl_removes_a_recipient_everywhere_and_refuses_an_unknown_one(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(3)
    assert run_qctl(cluster, "recipient", "alternatives", "mail", "--set", "mail-2=q2")[0] == 0
    assert run_qctl(cluster, "recipient", "alternatives", "mail-3", "--set", "mail=q")[0] == 0
    code, answer, _ = run_qctl(cluster, "recipient", "remove", "mail")
    assert code == 0 and answer == {"recipient": "mail", "removed": True, "named_by": ["mail-3"]}
    with Client(cluster.urls["n3"], cluster.credentials_path) as other:
        deadline = time.monotonic() + 5           # the map reaches the other nodes a moment later
        while "mail" in [r["recipient"] for r in other.recipients()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r["recipient"] for r in other.recipients()] == ["mail-3"]
        with pytest.raises(QueueError) as refused:
            other.remove_recipient("mail")
        assert refused.value.code == "E_UNKNOWN_RECIPIENT"
    code, error, _ = run_qctl(cluster, "recipient", "remove", "never-seen")
    assert code == 1 and error["error"]["code"] == "E_UNKNOWN_RECIPIENT"


def test_an_administrators_chain_binds_its_alternatives_and_a_client_binds_a_bounded_number_of_names() -> None:
    """Issue 32, item 1, in the map: a name a client bound first on a queue of its own is bound
    again to the queue an administrator's chain names; a new subscriber under a chained name must
    use that queue; one client binds at most RECIPIENTS_PER_CLIENT_MAX names."""
    cluster = ClusterMap()
    for node in ("n1", "n2"):
        cluster.apply(AddNode(node, f"http://{node}", True, node))
    for number, queue in enumerate(("billing", "billing-b", "squat", "other")):
        cluster.apply(CreateQueue(queue, {"strength": "full"}, "n1", "n2", number + 1))
    assert cluster.apply(PutRecipient("billing-b", "squat", "ok", 1, "subscribed", "c-squatter"))[0].applied
    assert cluster.apply(SetAlternatives("billing-a", ("billing-b",), ("billing-b",), "c-admin"))[0].applied
    assert "billing-b" not in cluster.recipients and cluster.chain_binding("billing-b") == "billing-b"
    assert not cluster.apply(PutRecipient("billing-b", "squat", "ok", 2, "subscribed", "c-squatter"))[0].applied
    assert cluster.apply(PutRecipient("billing-b", "billing-b", "ok", 3, "subscribed", "c-b"))[0].applied
    assert cluster.recipients["billing-b"].owner == ""          # the chain bound it, not the subscriber
    copy = decode_map(encode_map(cluster))
    assert copy.alternative_queues == {"billing-a": ("billing-b",)} and copy.alternatives_set_by == {
        "billing-a": "c-admin"}
    for number in range(RECIPIENTS_PER_CLIENT_MAX):
        assert cluster.apply(PutRecipient(f"r{number}", "other", "ok", 4, "subscribed", "c-greedy"))[0].applied
    [refused] = cluster.apply(PutRecipient("one-more", "other", "ok", 4, "subscribed", "c-greedy"))
    assert not refused.applied and "bound 100" in refused.reason
    assert cluster.apply(PutRecipient("one-more", "other", "ok", 4, "subscribed", "c-modest"))[0].applied
