"""A credential says which cluster it belongs to, and a refusal says which file was used
(client/credentials.py), and the demo's rule for the convenience copy (qserver/dev/demo_credentials.py).

Pure tests: no node runs. The demo and `qctl` against real clusters are in tests/test_demo_credentials.py.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from client.credentials import (
    Credentials,
    explain_refusal,
    find_credentials,
    load_credentials,
    save_credentials,
)
from client.qctl import main as qctl
from qserver.dev.demo_credentials import CopyPlan, own_credential, plan_copy
from qserver.dev.devcluster import free_port
from wire.errors import QueueError
from wire.signing import new_private_key, private_key_to_text

OURS = {"http://127.0.0.1:7101", "http://127.0.0.1:7102", "http://127.0.0.1:7103"}


def credential(client_id: str = "admin", url: str = "http://127.0.0.1:7101", cluster: str = "/data/a/n1") -> Credentials:
    return Credentials(client_id, private_key_to_text(new_private_key()), url, cluster=cluster)


# --- the credential names its cluster ----------------------------------------------------------
def test_a_credential_a_node_wrote_names_its_cluster_and_reads_back_the_same(tmp_path: Path) -> None:
    written = credential()
    save_credentials(tmp_path / "c.json", written)
    assert json.loads((tmp_path / "c.json").read_text())["cluster"] == "/data/a/n1"
    assert load_credentials(tmp_path / "c.json") == written


def test_a_credentials_file_from_before_clusters_were_named_still_loads(tmp_path: Path) -> None:
    old = credential(cluster="")
    (tmp_path / "c.json").write_text(json.dumps({"client_id": "admin", "private_key": old.private_key_text,
                                                 "url": old.url}))
    assert load_credentials(tmp_path / "c.json").cluster == ""
    assert "cluster" not in old.to_json()


def test_a_cluster_that_is_not_a_string_is_refused_with_a_clear_code(tmp_path: Path) -> None:
    document = {**credential().to_json(), "cluster": 7}
    (tmp_path / "c.json").write_text(json.dumps(document))
    with pytest.raises(QueueError) as caught:
        load_credentials(tmp_path / "c.json")
    assert caught.value.code == "E_UNAUTHENTICATED" and "cluster" in caught.value.message


def test_find_credentials_names_the_file_load_credentials_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_credentials(tmp_path / ".qserver" / "credentials.json", credential("local"))
    assert find_credentials() == Path(".qserver") / "credentials.json"
    assert load_credentials(find_credentials()).client_id == "local"
    save_credentials(tmp_path / "explicit.json", credential("explicit"))
    assert find_credentials(tmp_path / "explicit.json") == tmp_path / "explicit.json"


# --- a refusal says which file, whose, and the fix ---------------------------------------------------
def test_an_unknown_client_is_explained_with_the_file_its_cluster_and_how_to_get_the_right_one() -> None:
    refused = QueueError("E_UNAUTHENTICATED", "unknown client or bad signature")
    explained = explain_refusal(refused, Path(".qserver/credentials.json"), credential(url="http://127.0.0.1:7501",
                                                                                        cluster="/data/b/n1"),
                                "http://127.0.0.1:7101")
    assert explained.code == "E_UNAUTHENTICATED" and not explained.retriable
    first, detail, fix = explained.message.split("\n")
    assert first == "unknown client or bad signature"
    for named in (".qserver/credentials.json", "'admin'", "/data/b/n1", "http://127.0.0.1:7501",
                  "the cluster at http://127.0.0.1:7101", "another cluster"):
        assert named in detail
    assert "DATA_DIR/admin-credentials.json" in fix and "qserver admin-credential" in fix


def test_an_unknown_client_at_the_credentials_own_url_says_the_cluster_there_is_another() -> None:
    refused = QueueError("E_UNAUTHENTICATED", "unknown client or bad signature")
    explained = explain_refusal(refused, Path("c.json"), credential(), "http://127.0.0.1:7101")
    assert "the cluster at its own URL does not know the credentials file c.json" in explained.message


def test_an_unreachable_url_is_explained_with_the_file_and_a_fix_that_starts_with_starting_it() -> None:
    unreachable = QueueError("E_UNAVAILABLE", "cannot reach http://127.0.0.1:7601: connect call failed")
    explained = explain_refusal(unreachable, Path("c.json"), credential(url="http://127.0.0.1:7601"),
                                "http://127.0.0.1:7601")
    assert explained.code == "E_UNAVAILABLE" and explained.retriable
    first, detail, fix = explained.message.split("\n")
    assert first == unreachable.message
    assert "c.json" in detail and "/data/a/n1" in detail and "no node answers there" in detail
    assert fix.startswith("  fix: start it, or use the credential of the cluster you mean")
    other_url = explain_refusal(unreachable, Path("c.json"), credential(), "http://127.0.0.1:7601")
    assert "no node answers at http://127.0.0.1:7601 (--url)" in other_url.message


@pytest.mark.parametrize("error", [QueueError("E_FORBIDDEN", "client admin may not get on q"),
                                   QueueError("E_UNAVAILABLE", "the link to the master n2 was lost"),
                                   QueueError("E_UNAUTHENTICATED", "the request is not signed"),
                                   QueueError("E_TIMEOUT", "no answer", outcome_unknown=True)])
def test_other_errors_pass_unchanged(error: QueueError) -> None:
    assert explain_refusal(error, Path("c.json"), credential(), "http://127.0.0.1:7101") is error


def test_qctl_names_the_credentials_file_when_no_node_answers_at_its_url(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.json"
    save_credentials(path, credential(url=f"http://127.0.0.1:{free_port()}", cluster="/data/gone/n1"))
    out, err = io.StringIO(), io.StringIO()
    assert qctl(["--credentials", str(path), "--json", "status"], stdout=out, stderr=err) == 1
    envelope = json.loads(out.getvalue())["error"]
    assert envelope["code"] == "E_UNAVAILABLE" and str(path) in envelope["message"]
    assert err.getvalue().startswith("error: E_UNAVAILABLE: cannot reach ")
    assert "/data/gone/n1" in err.getvalue() and "fix: start it" in err.getvalue()


# --- the demo's convenience copy ----------------------------------------------------------------------
def never_asked() -> bool:
    raise AssertionError("the network was probed where the rule needs no probe")


def test_the_demo_takes_an_absent_copy_or_one_of_its_own_credential_without_asking_anyone() -> None:
    own = credential()
    assert plan_copy(own, None, True, OURS, never_asked) == CopyPlan(True)
    assert plan_copy(own, own, True, OURS, never_asked) == CopyPlan(True)


def test_the_demo_replaces_a_file_that_is_not_a_credential_and_says_so() -> None:
    assert plan_copy(credential(), None, False, OURS, never_asked) == CopyPlan(True, "it was not a credentials file")


def test_the_demo_replaces_another_credential_for_its_own_ports_without_asking_anyone() -> None:
    stale = credential(url="http://127.0.0.1:7102", cluster="/data/old/n1")
    plan = plan_copy(credential(), stale, True, OURS, never_asked)
    assert plan.take and "/data/old/n1" in plan.note and "these ports" in plan.note


def test_the_demo_leaves_the_copy_of_another_cluster_that_is_running() -> None:
    running = credential(url="http://127.0.0.1:7501", cluster="/data/b/n1")
    plan = plan_copy(credential(), running, True, OURS, lambda: True)
    assert not plan.take and "/data/b/n1" in plan.note and "a cluster answers there" in plan.note


def test_the_demo_takes_the_copy_of_another_cluster_that_is_not_running_and_says_whose_it_was() -> None:
    gone = credential(url="http://127.0.0.1:7501", cluster="/data/b/n1")
    plan = plan_copy(credential(), gone, True, OURS, lambda: False)
    assert plan.take and "/data/b/n1" in plan.note and "not running" in plan.note


def test_the_demos_own_credential_follows_the_cluster_to_other_ports_and_says_so(tmp_path: Path) -> None:
    save_credentials(tmp_path / "admin-credentials.json", credential(url="http://127.0.0.1:7101"))
    moved = SimpleNamespace(credentials_path=tmp_path / "admin-credentials.json", ids=["n1", "n2", "n3"],
                            root=tmp_path, urls={"n1": "http://127.0.0.1:7301", "n2": "", "n3": ""})
    own, notes = own_credential(moved, None)  # type: ignore[arg-type]
    assert own.url == "http://127.0.0.1:7301" == load_credentials(tmp_path / "admin-credentials.json").url
    assert notes == ["its URL is now http://127.0.0.1:7301 (it was http://127.0.0.1:7101: --base-port changed)"]
    assert own_credential(moved, None) == (own, [])  # type: ignore[arg-type]
