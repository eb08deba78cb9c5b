"""Definitions export and import (docs/OPERATIONS.md, "Definitions: export and import"): the
document and its checks as pure units (replication/definitions.py), then the routes, the client
and qctl on two real 3-node clusters side by side: export from one, import into the other, the
same again changes nothing, a bad document changes nothing, a conflict is reported and left,
and a client without the admin grant on `*` is refused."""
from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from client import AsyncClient, Client, QueueError
from client.credentials import Credentials, load_credentials
from client.qctl import main as qctl
from qserver.api.definitions_routes import CA_CHARS_MAX, CHECKS, _same_client
from qserver.dev.devcluster import LocalCluster
from qserver.features.forwards import api as forwards_api
from replication.cluster_map import (
    AddNode,
    ClusterMap,
    CreateMacro,
    CreateQueue,
    PutChannel,
    PutClient,
    PutForward,
    PutMacroMember,
    PutRecipient,
    SetAlternatives,
)
from replication.definitions import CONFLICT, CREATE, FORWARD_URLS_MAX, UNCHANGED, export_definitions, plan_import
from replication.options import QueueOptions, Strength
from wire.signing import new_private_key, private_key_to_text, public_key_text

ADMIN_GRANTS = [{"pattern": "*", "privileges": ["admin", "delete", "get", "post"]}]
KEY = public_key_text(new_private_key())


def a_map() -> tuple[ClusterMap, dict[str, dict[str, Any]]]:
    """A map holding one of everything, and its client registry."""
    cluster = ClusterMap()
    for node in ("n1", "n2", "n3"):
        cluster.apply(AddNode(node, f"http://{node}"))
    full = QueueOptions(strength=Strength.FULL).to_json()
    for number, (name, options) in enumerate([("orders", {**full, "max_depth": 5000}), ("archive", full),
                                              ("jobs-a", QueueOptions().to_json()), ("jobs-b", QueueOptions().to_json()),
                                              ("alt-q", full)], 1):
        cluster.apply(CreateQueue(name, options, "n1", "n2", number))
    cluster.apply(PutChannel("prices", "acked", 2.0, "n2", "n3", 99))
    cluster.apply(CreateMacro("jobs", "round_robin", "prioritized"))
    cluster.apply(PutMacroMember("jobs", "jobs-a", 5, 1))
    cluster.apply(PutMacroMember("jobs", "jobs-b", 0, 2))
    cluster.apply(SetAlternatives("billing-a", ("billing-b",), ("alt-q",), "admin"))
    cluster.apply(PutForward("keep", "orders", "archive", (), "", "", 1, "t"))
    record = {"id": "c-1", "name": "worker", "public_key": KEY, "grants": [{"pattern": "jobs*", "privileges": ["get"]}],
              "created_ms": 1}
    cluster.apply(PutClient("c-1", record))
    return cluster, {"c-1": record}


# --- the document and its checks, pure ---------------------------------------------------------
def test_an_export_holds_definitions_without_placement_secrets_or_channel_queues() -> None:
    cluster, clients = a_map()
    document = export_definitions(cluster, clients, release="9.9.9", now_ms=7)
    assert (document["format"], document["release"], document["exported_ms"]) == (1, "9.9.9", 7)
    assert [q["name"] for q in document["queues"]] == ["alt-q", "archive", "jobs-a", "jobs-b", "orders"]
    assert document["queues"][4]["options"]["max_depth"] == 5000 and "master" not in document["queues"][4]
    assert document["channels"] == [{"name": "prices", "class": "acked", "resend_interval_s": 2.0}]
    assert document["macros"][0]["members"] == [{"queue": "jobs-a", "priority": 5, "weight": 1},
                                                {"queue": "jobs-b", "priority": 0, "weight": 2}]
    assert document["recipients"] == [{"name": "billing-a", "alternatives": [{"name": "billing-b", "queue": "alt-q"}]}]
    assert document["forwards"] == [{"name": "keep", "source": "orders", "destination": "archive", "urls": [],
                                     "client_id": ""}]
    assert document["clients"] == [{"name": "worker", "public_key": KEY,
                                    "grants": [{"pattern": "jobs*", "privileges": ["get"]}]}]
    assert "secret" not in json.dumps(document) and "private_key" not in json.dumps(document)


def test_a_document_plans_creates_into_an_empty_map_and_nothing_into_its_own() -> None:
    cluster, clients = a_map()
    document = export_definitions(cluster, clients, release="x", now_ms=0)
    empty = ClusterMap()
    steps, problems = plan_import(document, empty, {}, CHECKS)
    assert problems == []
    assert {step.action for step in steps} == {CREATE}
    assert [(step.kind, step.name, step.member) for step in steps] == [
        ("queue", "alt-q", ""), ("queue", "archive", ""), ("queue", "jobs-a", ""), ("queue", "jobs-b", ""),
        ("queue", "orders", ""), ("channel", "prices", ""), ("macro", "jobs", ""), ("macro_member", "jobs", "jobs-a"),
        ("macro_member", "jobs", "jobs-b"), ("recipient", "billing-a", ""), ("forward", "keep", ""),
        ("client", "worker", "")]
    assert steps[4].body["max_depth"] == 5000 and steps[4].body["strength"] == "full"
    assert steps[9].body == {"alternatives": ["billing-b=alt-q"]}
    again, problems = plan_import(document, cluster, clients, CHECKS)
    assert problems == [] and {step.action for step in again} == {UNCHANGED}


def test_what_exists_otherwise_is_a_conflict_and_is_not_planned_for_change() -> None:
    cluster, clients = a_map()
    document = export_definitions(cluster, clients, release="x", now_ms=0)
    document["queues"][4]["options"]["max_depth"] = 10
    document["channels"][0]["class"] = "latest"
    document["macros"][0]["members"][1]["weight"] = 3
    document["macros"][0]["members"].append({"queue": "alt-q", "priority": 1, "weight": 1})
    document["recipients"][0]["alternatives"][0]["queue"] = "orders"
    document["forwards"][0]["destination"] = "alt-q"
    document["clients"][0]["grants"] = ADMIN_GRANTS
    steps, problems = plan_import(document, cluster, clients, CHECKS)
    assert problems == []
    actions = {(step.kind, step.name, step.member): step.action for step in steps}
    assert actions[("queue", "orders", "")] == CONFLICT and "max_depth" in steps[4].detail
    assert actions[("channel", "prices", "")] == CONFLICT
    assert actions[("macro_member", "jobs", "jobs-b")] == CONFLICT
    assert actions[("macro_member", "jobs", "alt-q")] == CREATE     # a member the macro lacks is added
    assert actions[("recipient", "billing-a", "")] == CONFLICT
    assert actions[("forward", "keep", "")] == CONFLICT
    assert actions[("client", "worker", "")] == CONFLICT


def test_every_problem_is_listed_and_nothing_is_planned() -> None:
    cluster, clients = a_map()
    document: dict[str, Any] = {
        "format": 1, "colour": "blue",
        "queues": [{"name": "new", "options": {"strength": "strong"}}, {"name": "x.dlq"},
                   {"name": "channel:prices"}, {"name": "placed", "options": {"master": "n1"}}, {"name": "p"},
                   {"name": "p"}],
        "macros": [{"name": "m", "members": [{"queue": "nowhere"}]},
                   {"name": "mixed", "members": [{"queue": "jobs-a"}, {"queue": "tw"}]}],
        "recipients": [{"name": "r", "alternatives": [{"name": "s", "queue": "nowhere"}]},
                       {"name": "u", "alternatives": [{"name": "v"}]}],
        "forwards": [{"name": "f", "source": "jobs-a", "destination": "archive"},
                     {"name": "g", "source": "alt-q", "destination": "d", "urls": ["https://elsewhere:1"]}],
        "clients": [{"name": "bob", "public_key": "not a key", "grants": []},
                    {"name": "eve", "public_key": KEY, "private_key": "k"},
                    {"name": "mal", "public_key": KEY, "grants": [{"pattern": "*", "privileges": ["root"]}]}],
    }
    document["queues"].append({"name": "tw", "options": {"type": "two_way"}})
    steps, problems = plan_import(document, cluster, clients, CHECKS)
    assert steps == []
    text = "\n".join(problems)
    for expected in ("unknown keys colour", "queues[0] new: strength must be one of", "queues[1] x.dlq: names ending",
                     "queues[2] channel:prices: a channel's queue", "queues[3] placed: placement (master)",
                     "queues[5] p: p is named twice", "macros[0] m members[0]: no queue 'nowhere'",
                     "macros[1] mixed: its members are of types", "recipients[0] r alternatives[0]: no queue",
                     "recipients[1] u alternatives[0]: name the queue of v", "forwards[0] f: its source jobs-a is not",
                     "forwards[1] g: a forward to another cluster needs the private key", "--forward-credentials g=FILE",
                     "clients[0] bob: public_key must be", "clients[1] eve: unknown keys private_key",
                     "clients[2] mal: privileges are some of"):
        assert expected in text, (expected, problems)
    assert len(problems) == 15
    malformed: Any
    for malformed in ([], {"format": 2}, {"format": 1, "queues": {}}, {"format": 1, "queues": ["orders"]}):
        steps, problems = plan_import(malformed, cluster, clients, CHECKS)
        assert steps == [] and len(problems) == 1, (malformed, problems)


def test_a_forward_to_another_cluster_takes_its_credentials_at_import_and_only_when_created() -> None:
    cluster, clients = a_map()
    item = {"name": "out", "source": "alt-q", "destination": "inbox", "urls": ["https://b:1/"], "client_id": "c-9"}
    key = private_key_to_text(new_private_key())
    steps, problems = plan_import({"format": 1, "forwards": [{**item, "credentials": {
        "client_id": "c-9", "private_key": key}}]}, cluster, clients, CHECKS)
    assert problems == [] and steps[0].body["credentials"] == {"client_id": "c-9", "private_key": key}
    assert steps[0].body["urls"] == ["https://b:1"]
    _, problems = plan_import({"format": 1, "forwards": [{**item, "credentials": {
        "client_id": "c-8", "private_key": "garbage", "ca": "x"}}]}, cluster, clients, CHECKS)
    assert problems == ["forwards[0] out: the credentials are of client c-8, the forward names c-9"]
    cluster.apply(PutForward("out", "alt-q", "inbox", ("https://b:1",), "c-9", "sealed", 1, "t"))
    steps, problems = plan_import({"format": 1, "forwards": [item]}, cluster, clients, CHECKS)
    assert problems == [] and steps[0].action == UNCHANGED     # it exists: no key needed


def test_a_forwards_own_bands_and_weights_travel_in_the_document() -> None:
    """A forward's control (issue 37 item 12) is exported, compared and passed to the create
    route, which checks its fields and the feature level; a control that is no object is refused."""
    cluster, clients = a_map()
    control = {"bands": [0.5, 0.9], "weights": [1, 2, 6], "fill_unit": "messages"}
    cluster.feature_level = 3
    cluster.apply(PutForward("graded", "alt-q", "archive", (), "", "", 1, "t", control))
    document = export_definitions(cluster, clients, release="9.9.9", now_ms=7)
    assert [f.get("control") for f in document["forwards"]] == [control, None]
    steps, problems = plan_import(document, cluster, clients, CHECKS)
    assert problems == [] and {s.name: s.action for s in steps if s.kind == "forward"} == {"graded": UNCHANGED,
                                                                                          "keep": UNCHANGED}
    other = {**document["forwards"][0], "control": {**control, "weights": [1, 1, 1]}}
    steps, problems = plan_import({"format": 1, "forwards": [other]}, cluster, clients, CHECKS)
    assert problems == [] and steps[0].action == CONFLICT
    bare, _ = a_map()
    steps, problems = plan_import({"format": 1, "forwards": [document["forwards"][0]]}, bare, clients, CHECKS)
    assert problems == [] and steps[0].action == CREATE and steps[0].body["control"] == control
    _, problems = plan_import({"format": 1, "forwards": [{**other, "control": [1]}]}, bare, clients, CHECKS)
    assert len(problems) == 1 and "control is" in problems[0]


def test_a_chain_says_whom_it_rebinds_and_a_gated_policy_waits_for_the_feature_level() -> None:
    cluster, clients = a_map()
    cluster.apply(PutRecipient("billing-c", "jobs-a", "ok", 0, owner="c-1"))
    steps, problems = plan_import({"format": 1, "recipients": [
        {"name": "billing-x", "alternatives": [{"name": "billing-c", "queue": "alt-q"}]}]}, cluster, clients, CHECKS)
    assert problems == [] and steps[0].action == CREATE
    assert steps[0].detail == "rebinds billing-c (bound to jobs-a by subscribing)"
    assert getattr(cluster, "feature_level", 1) == 1
    _, problems = plan_import({"format": 1, "macros": [{"name": "hp", "consumer": "highest_priority"}]}, cluster,
                              clients, CHECKS)
    assert len(problems) == 1 and problems[0].startswith("macros[0] hp: "), problems


def test_a_client_registered_meanwhile_with_the_same_key_and_grants_is_unchanged() -> None:
    """The route refused the name (E_CLIENT_EXISTS) after the check passed: the registry tells
    a registration of the same client (unchanged) from another (conflict)."""
    _, clients = a_map()
    node = SimpleNamespace(engine=SimpleNamespace(clients=clients))
    body = {"name": "worker", "public_key": KEY, "grants": [{"pattern": "jobs*", "privileges": ["get", "get"]}]}
    assert _same_client(node, body)
    assert not _same_client(node, {**body, "grants": ADMIN_GRANTS})
    assert not _same_client(node, {**body, "public_key": public_key_text(new_private_key())})
    assert not _same_client(node, {**body, "name": "other"})


def test_the_document_checks_match_the_routes_limits() -> None:
    assert FORWARD_URLS_MAX == forwards_api.URLS_MAX and CA_CHARS_MAX == forwards_api.CA_CHARS_MAX


# --- two real clusters --------------------------------------------------------------------------
def run_qctl(cluster: LocalCluster, *argv: str) -> tuple[int, Any, str]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl(["--credentials", str(cluster.credentials_path), "--json", *argv], stdout=out, stderr=err)
    return code, json.loads(out.getvalue()) if out.getvalue() else None, err.getvalue()


def import_with_the_sync_client(cluster: LocalCluster, document: dict[str, Any]) -> dict[str, Any]:
    with Client(cluster.urls["n3"], cluster.credentials_path) as client:
        return client.import_definitions(document)


def comparable(document: dict[str, Any]) -> dict[str, Any]:
    """What two clusters' exports share: not the times, versions or each cluster's own admin."""
    kept = {key: value for key, value in document.items() if key not in ("exported_ms", "map_version", "release")}
    kept["clients"] = [client for client in document["clients"] if client["name"] != "admin"]
    return kept


@pytest.mark.asyncio
async def test_definitions_round_trip_between_two_clusters(qcluster_factory: Any, tmp_path: Path) -> None:
    source: LocalCluster = qcluster_factory(3)
    target: LocalCluster = qcluster_factory(3)
    async with AsyncClient(source.urls["n1"], source.credentials_path) as a, \
            AsyncClient(target.urls["n1"], target.credentials_path) as b:
        # b asks n1, as qctl does (the credentials' url): a node reads its own writes, and an
        # export reads the answering node's map, which another node may apply a moment later.
        await a.create_queue("orders", strength="full", max_depth=5000)
        await a.create_queue("archive", strength="full")
        await a.create_queue("outbox", strength="full")
        for name in ("jobs-a", "jobs-b"):
            await a.create_queue(name)
        await a.create_queue("alt-q", strength="full", fault_interval_s=5.0)
        await a.create_macro("jobs")
        await a.add_macro_member("jobs", "jobs-a", priority=5)
        await a.add_macro_member("jobs", "jobs-b", weight=2)
        await a.create_channel("prices", "acked", 2.0)
        await a.set_alternatives("billing-a", ["billing-b=alt-q"])
        await a.create_forward("keep", "orders", "archive")
        # A forward to another cluster (here: back into the source's own archive, by URL): its
        # credentials are sealed in the map and never exported.
        remote = load_credentials(source.credentials_path)
        await a.create_forward("away", "outbox", "archive", urls=[source.urls["n1"]],
                               credentials={"client_id": remote.client_id, "private_key": remote.private_key_text})
        worker_key = new_private_key()
        await a.register_client("worker", [{"pattern": "jobs*", "privileges": ["get"]}], public_key_text(worker_key))

        # The export through qctl, to a file, as an operator does it.
        exported = tmp_path / "defs.json"
        code, written, err = await asyncio.to_thread(run_qctl, source, "definitions", "export", "--out", str(exported))
        assert code == 0 and written["counts"]["queues"] == 6 and written["counts"]["forwards"] == 2, err
        document = json.loads(exported.read_text())
        assert exported.stat().st_mode & 0o077 == 0
        assert remote.private_key_text not in exported.read_text() and "secret" not in exported.read_text()
        assert [c["name"] for c in document["channels"]] == ["prices"]
        assert "channel:prices" not in [q["name"] for q in document["queues"]]
        assert document == {**await a.export_definitions(), "exported_ms": document["exported_ms"]}

        before = await b.export_definitions()
        # A malformed document and one with a dangling reference: every problem, nothing changed.
        bad = {"format": 1, "queues": [{"name": "q", "options": {"max_depth": -1}}],
               "macros": [{"name": "m", "members": [{"queue": "nowhere"}]}]}
        with pytest.raises(QueueError) as refused:
            await b.import_definitions(bad)
        assert refused.value.code == "E_INVALID_DEFINITIONS"
        assert "queues[0] q: max_depth" in refused.value.message and "no queue 'nowhere'" in refused.value.message
        with pytest.raises(QueueError) as refused:      # the forward to another cluster has no key
            await b.import_definitions(document)
        assert refused.value.code == "E_INVALID_DEFINITIONS" and "--forward-credentials away=FILE" in \
            refused.value.message
        code, answer, err = await asyncio.to_thread(run_qctl, target, "definitions", "import", str(exported))
        assert code == 1 and answer["error"]["code"] == "E_INVALID_DEFINITIONS" and "away" in err
        with pytest.raises(QueueError) as refused:
            await b.http.request("POST", "/v1/definitions", body=b"{not json")
        assert refused.value.code == "E_INVALID_DEFINITIONS"
        assert comparable(await b.export_definitions()) == comparable(before)

        # A dry run says what would be created, and creates nothing.
        credentials = f"away={source.credentials_path}"
        code, answer, err = await asyncio.to_thread(run_qctl, target, "definitions", "import", str(exported),
                                                    "--dry-run", "--forward-credentials", credentials)
        assert code == 0 and answer["dry_run"] is True and answer["counts"]["would_create"] == 14, (answer, err)
        assert comparable(await b.export_definitions()) == comparable(before)

        # The import: each item created, the target's own admin (another key) a conflict left alone.
        code, answer, err = await asyncio.to_thread(run_qctl, target, "definitions", "import", str(exported),
                                                    "--forward-credentials", credentials)
        assert code == 0, (answer, err)
        assert answer["counts"] == {"created": 14, "unchanged": 0, "conflict": 1, "failed": 0}, answer
        assert [r["name"] for r in answer["results"] if r["status"] == CONFLICT] == ["admin"]
        second = await b.export_definitions()
        assert comparable(second) == comparable(document)
        assert {f["name"]: f["client_id"] for f in await b.forwards()} == {"away": remote.client_id, "keep": ""}

        # Again: nothing to create, so no route is called and nothing changes.
        answer = await b.import_definitions(document)
        assert answer["counts"] == {"created": 0, "unchanged": 14, "conflict": 1, "failed": 0}, answer
        assert comparable(await b.export_definitions()) == comparable(second)

        # A conflict is reported and left as it is; what the file adds is created beside it.
        changed = json.loads(json.dumps(document))
        changed["queues"][[q["name"] for q in changed["queues"]].index("orders")]["options"]["max_depth"] = 7
        changed["queues"].append({"name": "extra", "options": {"strength": "producer"}})
        answer = await asyncio.to_thread(import_with_the_sync_client, target, changed)
        statuses = {(r["kind"], r["name"]): (r["status"], r.get("detail", "")) for r in answer["results"]}
        assert statuses[("queue", "orders")][0] == CONFLICT and "max_depth" in statuses[("queue", "orders")][1]
        assert statuses[("queue", "extra")] == ("created", "")
        orders = [q for q in (await b.export_definitions())["queues"] if q["name"] == "orders"]
        assert orders[0]["options"]["max_depth"] == 5000

        # Only an administrator of `*` exports or imports.
        reader = await b.register_client("reader", [{"pattern": "*", "privileges": ["get", "post"]}])
        as_reader = Credentials(str(reader["id"]), str(reader["private_key"]), target.urls["n1"],
                                load_credentials(target.credentials_path).ca_file)
        async with AsyncClient(target.urls["n1"], as_reader) as c:
            for call in (c.export_definitions(), c.import_definitions(changed, dry_run=True)):
                with pytest.raises(QueueError) as refused:
                    await call
                assert refused.value.code == "E_FORBIDDEN"
