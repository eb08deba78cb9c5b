"""The cluster feature level (issue 34, item 3): `ClusterMap.feature_level`, raised by the map
command `SetFeatureLevel` through `POST /v1/cluster/finalize` (`qctl cluster finalize`) once every
node supports the new level, refused with E_NODES_BEHIND naming the nodes that lag before that,
and the gate (E_FEATURE_DISABLED) on what needs a higher level (docs/OPERATIONS.md, "The cluster
feature level").

The map's side is pure and checked on maps, against release 0.1.0's own code where it matters (its
`replication/` and `wire/` taken from the release commit of releases.toml with `git archive`): a
map at level 1 encodes byte for byte as 0.1.0's encoder does. The rest runs on real processes:
a cluster of this release, and one with a node of release 0.1.0 (its `git worktree`).
"""
from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest

from client import AsyncClient, Client, QueueError, qctl
from client.credentials import Credentials, load_credentials, save_credentials
from qserver.api.upgrade_routes import finalizable_to, finalize_level, lags, versions_of
from qserver.dev.devcluster import REPOSITORY, LocalCluster
from replication.cluster_map import (
    ClusterMap,
    CommandError,
    SetFeatureLevel,
    decode_command,
    decode_map,
    encode_command,
    encode_map,
)
from replication.invariants import InvariantViolation
from tests import upgrade_support
from wire import versions

# Builds the same map under whichever `replication` package is first on the path: this
# checkout's here, release 0.1.0's in a subprocess. Every kind of entry 0.1.0 encodes.
BUILD_MAP = """
from replication.cluster_map import (AddNode, ChangePair, ClusterMap, CreateMacro, CreateQueue, PutChannel,
                                     PutClient, PutForward, PutMacroMember, PutRecipient, SetAlternatives)
def build():
    cluster = ClusterMap()
    for node in ("n1", "n2", "n3"):
        cluster.apply(AddNode(node, "http://127.0.0.1:7" + node[1:] + "01", True, int(node[1:]) * 11))
    cluster.apply(CreateQueue("orders", {"strength": "full", "type": "queued_ack"}, "n1", "n2", 1))
    cluster.apply(CreateQueue("events", {"strength": "producer"}, "n2", "n3", 2))
    cluster.apply(ChangePair("orders", (1, "n1", "n2", True), (2, "n2", "n1", True), "handoff"))
    cluster.apply(PutClient("c1", {"name": "worker", "public_key": "k", "grants": [{"pattern": "*", "privileges": ["get"]}]}))
    cluster.apply(PutClient("c2", {"name": "gone"}))
    cluster.apply(PutClient("c2", None))
    cluster.apply(CreateMacro("all", "round_robin", "prioritized"))
    cluster.apply(PutMacroMember("all", "orders", 3, 2))
    cluster.apply(PutChannel("prices", "latest", 1.5, "n3", "n1", 3))
    cluster.apply(PutRecipient("r1", "orders", "ok", 1000, "", "c1"))
    cluster.apply(SetAlternatives("r1", ("r2",), ("events",), "c1"))
    cluster.apply(PutForward("fw", "orders", "events", (), "c1", "sealed", 2000, "t"))
    return cluster
"""


def build_map() -> ClusterMap:
    scope: dict[str, Any] = {}
    exec(BUILD_MAP, scope)      # noqa: S102 (our own constant, run under two releases)
    cluster: ClusterMap = scope["build"]()
    return cluster


def previous_commit() -> str:
    """Release 0.1.0's commit: the release of feature level 1 only, whose map these tests read."""
    return str(next(r["commit"] for r in upgrade_support.releases() if r["version"] == "0.1.0"))


@pytest.fixture(scope="module")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.1.0's `replication/` and `wire/` (enough for its map and codec), unpacked."""
    commit = previous_commit()
    reason = upgrade_support.skip_reason(commit)
    if reason:
        pytest.skip(reason)
    where = tmp_path_factory.mktemp("release-0.1.0")
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", commit, "replication", "wire"],
                             check=True, capture_output=True, timeout=60).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    return where


def run_old(old_code: Path, script: str) -> str:
    """Run `script` with release 0.1.0's packages first on the path; its stdout."""
    done = subprocess.run([sys.executable, "-c", script], cwd=old_code, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(old_code), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- the map: pure ------------------------------------------------------------------------------
def test_a_map_at_level_1_encodes_byte_for_byte_as_release_0_1_0s(old_code: Path) -> None:
    cluster = build_map()
    assert cluster.feature_level == versions.OLDEST_FEATURE_LEVEL == 1
    script = BUILD_MAP + "\nfrom replication.cluster_map import encode_map\nprint(encode_map(build()).hex())\n"
    old_bytes = bytes.fromhex(run_old(old_code, script).strip())
    assert encode_map(cluster) == old_bytes
    assert decode_map(old_bytes) == cluster and decode_map(old_bytes).feature_level == 1


def test_release_0_1_0_decodes_a_map_at_level_2_and_cannot_decode_the_raise_itself(old_code: Path) -> None:
    """Why finalize waits for every node: 0.1.0 reads a raised map's snapshot (ignoring the
    level), but skips the SetFeatureLevel entry it cannot decode, so its map would differ."""
    cluster = build_map()
    cluster.apply(SetFeatureLevel(2))
    raised = encode_map(cluster)
    script = ("import sys\nfrom replication.cluster_map import CommandError, decode_command, decode_map, encode_map\n"
              f"cluster = decode_map(bytes.fromhex({raised.hex()!r}))\n"
              "print(sorted(cluster.queues), sorted(cluster.macros), cluster.version)\n"
              "try:\n"
              f"    decode_command(bytes.fromhex({encode_command(SetFeatureLevel(2)).hex()!r}))\n"
              "    print('decoded')\n"
              "except CommandError:\n"
              "    print('refused')\n")
    lines = run_old(old_code, script).splitlines()
    assert lines == [f"{sorted(cluster.queues)} {sorted(cluster.macros)} {cluster.version}", "refused"]


def test_the_level_survives_a_snapshot_and_never_goes_down() -> None:
    cluster = build_map()
    before = cluster.version
    raised = cluster.apply(SetFeatureLevel(2))
    assert raised[0].applied and cluster.feature_level == 2 and cluster.version == before + 1
    restored = decode_map(encode_map(cluster))
    assert restored == cluster and restored.feature_level == 2 and restored.index == cluster.index
    assert msgpack.unpackb(encode_map(cluster), raw=False)[-1] == 2       # the twelfth row, only above level 1
    assert len(msgpack.unpackb(encode_map(build_map()), raw=False)) == 11
    for again in (2, 1):
        outcome = restored.apply(SetFeatureLevel(again))[0]
        assert not outcome.applied and "already" in outcome.reason and restored.feature_level == 2
    assert restored.to_json()["feature_level"] == 2 and restored.summary()["feature_level"] == 2


def test_a_level_above_this_release_stops_the_node_and_a_malformed_one_is_bad_bytes() -> None:
    above = versions.FEATURE_LEVEL + 1
    cluster = build_map()
    with pytest.raises(InvariantViolation, match=f"feature level {above}, above {versions.FEATURE_LEVEL}"):
        cluster.apply(SetFeatureLevel(above))
    rows = msgpack.unpackb(encode_map(build_map()), raw=False)
    with pytest.raises(InvariantViolation, match="cannot follow the cluster"):
        decode_map(msgpack.packb([*rows, above], use_bin_type=True))
    for bad in (0, "2", True, None):
        with pytest.raises(CommandError):
            decode_map(msgpack.packb([*rows, bad], use_bin_type=True))
        with pytest.raises(CommandError):
            decode_command(msgpack.packb([SetFeatureLevel.TAG, bad], use_bin_type=True))
    with pytest.raises(CommandError):
        decode_command(msgpack.packb([SetFeatureLevel.TAG], use_bin_type=True))
    assert decode_command(encode_command(SetFeatureLevel(2))) == SetFeatureLevel(2)


def test_what_a_nodes_healthz_says_it_runs_and_whether_it_lags() -> None:
    old = {"id": "n3", **versions_of({"status": "ok", "node": "n3", "queues": 2, "membership": {}})}
    assert old["release"] == "0.1.0" and old["feature_levels"] == [1, 1]
    assert lags(old, 2) == "n3 runs 0.1.0 (feature levels 1-1)" and lags(old, 1) is None
    new = {"id": "n1", **versions_of({"release": "0.2.0", "feature_levels": [1, 2], "protocols": {"client": "1-1"}})}
    assert lags(new, 2) is None and finalizable_to([new]) == 2 and finalizable_to([new, old]) == 1
    gone = {"id": "n2", "reachable": False, "error": "no answer from http://x (ClientConnectorError)"}
    assert lags(gone, 2) == "n2 did not answer (no answer from http://x (ClientConnectorError))"
    assert finalizable_to([new, gone]) is None
    assert not versions_of({"release": "9", "feature_levels": [1, "2"]})["reachable"]
    assert not versions_of([1, 2])["reachable"]
    assert finalize_level({}) == versions.FEATURE_LEVEL and finalize_level({"level": 1}) == 1
    for bad in ({"level": versions.FEATURE_LEVEL + 1}, {"level": 0}, {"level": "2"}, {"level": True},
                {"levels": 2}, [2]):
        with pytest.raises(QueueError) as refused:
            finalize_level(bad)
        assert refused.value.code == "E_INVALID_OPTION"


# --- a cluster of this release ------------------------------------------------------------------------
def run_qctl(cluster: LocalCluster, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = qctl.main(["--credentials", str(cluster.credentials_path), *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def metric(cluster: LocalCluster, node: str, name: str) -> float:
    with urllib.request.urlopen(cluster.urls[node] + "/metrics", timeout=5, context=cluster.ssl_context) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in {node}'s /metrics")


def until_level(cluster: LocalCluster, level: int, timeout_s: float = 10.0) -> None:
    """Every running node's map (its /healthz) is at `level`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {node: cluster.health(node).get("feature_level") for node in cluster.processes}
        if all(value == level for value in found.values()):
            return
        assert time.monotonic() < deadline, f"not every node at feature level {level}: {found}"
        time.sleep(0.05)


async def create_highest_priority_macro(cluster: LocalCluster, name: str) -> dict[str, Any]:
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        return await client.create_macro(name, "round_robin", "highest_priority")


def test_finalize_waits_for_every_node_then_raises_the_level_everywhere_once(qcluster_factory: Any) -> None:
    cluster: LocalCluster = qcluster_factory(3)
    code, out, _ = run_qctl(cluster, "--json", "cluster", "versions")
    listed = json.loads(out)
    assert code == 0 and listed["feature_level"] == 1 and listed["finalizable_to"] == versions.FEATURE_LEVEL
    assert [(n["id"], n["release"], n["feature_levels"]) for n in listed["nodes"]] == [
        (node, versions.RELEASE, [1, versions.FEATURE_LEVEL]) for node in ("n1", "n2", "n3")]
    assert metric(cluster, "n2", "qserver_cluster_feature_level") == 1
    # Below level 2 the gated feature is refused, and nothing is created.
    with pytest.raises(QueueError) as disabled:
        asyncio.run(create_highest_priority_macro(cluster, "hp"))
    assert disabled.value.code == "E_FEATURE_DISABLED"
    with Client(cluster.urls["n1"], cluster.credentials_path) as client:
        assert "hp" not in {m["name"] for m in client.list_macros()}
        # A node that is down lags: refused, naming it, and nothing changes.
        cluster.kill("n3")
        with pytest.raises(QueueError) as behind:
            client.finalize_cluster()
        assert behind.value.code == "E_NODES_BEHIND" and "n3 did not answer" in behind.value.message
        assert "n1" not in behind.value.message and "n2" not in behind.value.message
        assert cluster.health("n1")["feature_level"] == 1
        with pytest.raises(QueueError) as too_high:
            client.finalize_cluster(versions.FEATURE_LEVEL + 1)
        assert too_high.value.code == "E_INVALID_OPTION"
        cluster.start("n3")
        # Only an administrator of every queue finalizes; any client reads the versions.
        reader = client.register_client("reader", [{"pattern": "*", "privileges": ["get"]}])
        reader_credentials = cluster.root / "reader.json"
        save_credentials(reader_credentials, Credentials(reader["id"], reader["private_key"], cluster.urls["n2"],
                                                         load_credentials(cluster.credentials_path).ca_file))
        with Client(cluster.urls["n2"], reader_credentials) as not_admin:
            assert len(not_admin.cluster_versions()["nodes"]) == 3
            with pytest.raises(QueueError) as forbidden:
                not_admin.finalize_cluster()
            assert forbidden.value.code == "E_FORBIDDEN"
        # Every node runs this release: raised, on every node, by one command.
        code, out, err = run_qctl(cluster, "--json", "cluster", "finalize")
        raised = json.loads(out)
        assert code == 0, err
        assert raised == {"level": versions.FEATURE_LEVEL, "previous": 1, "changed": True,
                          "releases": {node: versions.RELEASE for node in ("n1", "n2", "n3")}}
        until_level(cluster, versions.FEATURE_LEVEL)
        version = client.cluster()["version"]
        again = client.finalize_cluster()
        assert again["changed"] is False and again["level"] == versions.FEATURE_LEVEL
        assert client.cluster()["version"] == version          # no command proposed
        with pytest.raises(QueueError) as lower:
            client.finalize_cluster(1)
        assert lower.value.code == "E_INVALID_OPTION" and "never goes down" in lower.value.message
    assert metric(cluster, "n3", "qserver_cluster_feature_level") == versions.FEATURE_LEVEL
    assert asyncio.run(create_highest_priority_macro(cluster, "hp"))["name"] == "hp"
    code, out, _ = run_qctl(cluster, "status")
    assert code == 0 and f"cluster feature level: {versions.FEATURE_LEVEL}" in out
    header = next(line for line in out.splitlines() if line.startswith("NODE"))
    assert header.split()[-1] == "RELEASE" and all(
        line.split()[-1] == versions.RELEASE for line in out.splitlines() if line.split()[:1] in (["n1"], ["n2"], ["n3"])
        and "http" in line)
    code, out, _ = run_qctl(cluster, "cluster", "finalize")
    assert code == 0 and "already" in out
    # The level is in the replicated state: a node started again reads it back.
    cluster.stop("n2")
    cluster.start("n2")
    until_level(cluster, versions.FEATURE_LEVEL)


# --- a cluster with a node of release 0.1.0 ---------------------------------------------------------
@pytest.fixture
def old_tree(tmp_path: Path) -> Any:
    commit = previous_commit()
    reason = upgrade_support.skip_reason(commit)
    if reason:
        pytest.skip(reason)
    with upgrade_support.release_tree(commit, tmp_path / "release-0.1.0") as where:
        yield where


def test_finalize_is_refused_while_a_node_runs_release_0_1_0_and_names_it(tmp_path: Path, old_tree: Path) -> None:
    """Mid-roll: n1 and n2 upgraded (data directories written by 0.1.0), n3 still on 0.1.0."""
    cluster = LocalCluster(tmp_path / "mixed", 3, code=old_tree, tls=False)
    try:
        cluster.start("n1", code=REPOSITORY, wait=False)
        cluster.start("n2", code=REPOSITORY, wait=False)
        cluster.start("n3", wait=False)
        cluster.wait_ready()
        with Client(cluster.urls["n1"], cluster.credentials_path) as client:
            listed = client.cluster_versions()
            assert {n["id"]: n["release"] for n in listed["nodes"]} == {"n1": versions.RELEASE,
                                                                        "n2": versions.RELEASE, "n3": "0.1.0"}
            assert listed["feature_level"] == 1 and listed["finalizable_to"] == 1
            with pytest.raises(QueueError) as behind:
                client.finalize_cluster()
            assert behind.value.code == "E_NODES_BEHIND"
            assert "n3 runs 0.1.0 (feature levels 1-1)" in behind.value.message
            # The gate holds meanwhile: nothing 0.1.0 cannot read reaches the map.
            with pytest.raises(QueueError) as disabled:
                client.create_macro("hp", "round_robin", "highest_priority")
            assert disabled.value.code == "E_FEATURE_DISABLED"
        # `qctl status` names each node's release; asked of the 0.1.0 node, it works without them.
        code, out, err = run_qctl(cluster, "--url", cluster.urls["n1"], "status")
        rows = {line.split()[0]: line.split() for line in out.splitlines() if "http" in line}
        assert code == 0 and rows["n3"][-1] == "0.1.0" and rows["n1"][-1] == versions.RELEASE, out + err
        assert "cluster feature level: 1" in out
        code, out, err = run_qctl(cluster, "--url", cluster.urls["n3"], "status")
        assert code == 0 and "RELEASE" not in out and "n3" in out, out + err
        with Client(cluster.urls["n3"], cluster.credentials_path) as old_node:
            with pytest.raises(QueueError) as no_route:
                old_node.cluster_versions()
            assert no_route.value.code == "E_NOT_FOUND" and "0.1.0" in no_route.value.message
        with Client(cluster.urls["n1"], cluster.credentials_path) as client:
            # n3 upgraded too: now the level goes up, on every node.
            cluster.stop("n3")
            cluster.start("n3", code=REPOSITORY)
            raised = client.finalize_cluster()
            assert raised["changed"] is True and raised["level"] == versions.FEATURE_LEVEL
            assert raised["releases"] == {node: versions.RELEASE for node in ("n1", "n2", "n3")}
        until_level(cluster, versions.FEATURE_LEVEL)
    finally:
        cluster.kill_all()
    problems = cluster.problems()
    assert not problems, problems


def test_a_node_outside_a_cluster_runs_at_its_releases_level_and_has_nothing_to_finalize(qnode: Any) -> None:
    with Client(qnode.url, qnode.credentials_path) as client:
        listed = client.cluster_versions()
        assert listed["feature_level"] == versions.FEATURE_LEVEL and [n["release"] for n in listed["nodes"]] == [
            versions.RELEASE]
        with pytest.raises(QueueError) as refused:
            client.finalize_cluster()
        assert refused.value.code == "E_INVALID_OPTION" and "not part of a cluster" in refused.value.message
