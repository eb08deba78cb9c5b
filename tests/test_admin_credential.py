"""`qserver admin-credential`: a new admin credential minted from a node's data directory through
the running cluster (qserver/cli.py), and what it says when it cannot.

Real processes: the mint signs with the cluster secret as the cluster itself, and the
registration goes through the membership layer, so every node knows the new client.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from client.credentials import load_credentials
from qserver.dev.devcluster import REPOSITORY, free_port


def qserver(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qserver", *argv], capture_output=True, text=True,
                          cwd=REPOSITORY, timeout=60)


def qctl(credentials: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.qctl", "--credentials", str(credentials), *argv],
                          capture_output=True, text=True, cwd=REPOSITORY, timeout=60)


def test_an_admin_credential_is_minted_from_a_nodes_data_directory_through_the_running_cluster(
        qcluster_factory: Any, tmp_path: Path) -> None:
    cluster = qcluster_factory(3)
    out = tmp_path / "minted" / "admin.json"
    minted = qserver("admin-credential", "--config", str(cluster.root / "n2.toml"), "--out", str(out),
                     "--name", "rescue")
    assert minted.returncode == 0, minted.stderr
    creds = load_credentials(out)
    assert minted.stdout.startswith(f"registered admin client {creds.client_id} (every privilege on every queue) "
                                    f"through {cluster.urls['n2']}, signed with the cluster secret of ")
    assert f"credentials in {out}" in minted.stdout
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert creds.url == cluster.urls["n2"] and creds.cluster == str((cluster.root / "n2").resolve())
    # Registered in the cluster map: another node knows it, with every privilege.
    listed = qctl(out, "--url", cluster.urls["n3"], "--json", "clients", "list")
    assert listed.returncode == 0, listed.stderr
    rescue = [client for client in json.loads(listed.stdout)["clients"] if client["name"] == "rescue"]
    assert rescue and rescue[0]["id"] == creds.client_id
    assert rescue[0]["grants"] == [{"pattern": "*", "privileges": ["admin", "delete", "get", "post"]}]
    assert qctl(out, "--url", cluster.urls["n1"], "queue", "create", "made-by-rescue").returncode == 0


def test_minting_with_json_prints_one_document_naming_the_file(qcluster_factory: Any, tmp_path: Path) -> None:
    cluster = qcluster_factory(3)
    out = tmp_path / "admin.json"
    minted = qserver("admin-credential", "--data-dir", str(cluster.root / "n1"), "--url", cluster.urls["n1"],
                     "--out", str(out), "--json")
    assert minted.returncode == 0, minted.stderr
    document = json.loads(minted.stdout)
    assert document == {"client_id": load_credentials(out).client_id, "url": cluster.urls["n1"],
                        "cluster": str((cluster.root / "n1").resolve()), "credentials_file": str(out)}


def test_minting_never_overwrites_a_file_which_may_be_a_clusters_only_admin_key(tmp_path: Path) -> None:
    out = tmp_path / "precious.json"
    out.write_text("the only copy")
    refused = qserver("admin-credential", "--data-dir", str(tmp_path), "--out", str(out))
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: E_INVALID_OPTION: {out} exists")
    assert out.read_text() == "the only copy"


def test_minting_from_a_directory_that_holds_no_node_is_refused(tmp_path: Path) -> None:
    refused = qserver("admin-credential", "--data-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "a.json"))
    assert refused.returncode == 1
    assert "E_INVALID_OPTION" in refused.stderr and "no cluster.secret" in refused.stderr
    assert not (tmp_path / "a.json").exists()
    assert qserver("admin-credential", "--out", str(tmp_path / "a.json")).returncode == 2   # neither --config nor --data-dir


def test_minting_when_no_node_answers_says_a_running_node_is_needed(tmp_path: Path) -> None:
    assert qserver("init", "--data-dir", str(tmp_path / "n1"), "--credentials", str(tmp_path / "first.json")
                   ).returncode == 0
    url = f"http://127.0.0.1:{free_port()}"
    refused = qserver("admin-credential", "--data-dir", str(tmp_path / "n1"), "--url", url,
                      "--out", str(tmp_path / "a.json"))
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: E_UNAVAILABLE: cannot reach {url}")
    assert f"no node answers at {url}: a credential is minted through a running node" in refused.stderr
    assert not (tmp_path / "a.json").exists()


def test_a_node_running_alone_refuses_the_cluster_secret_and_the_error_says_what_to_do(
        qnode: Any, tmp_path: Path) -> None:
    refused = qserver("admin-credential", "--data-dir", str(qnode.data_dir), "--url", qnode.url,
                      "--out", str(tmp_path / "a.json"))
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: E_UNAUTHENTICATED: ")
    assert f"qserver init --force --data-dir {qnode.data_dir}" in refused.stderr
    assert not (tmp_path / "a.json").exists()
