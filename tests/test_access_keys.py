"""Per-client access keys, the SQS gateway's credentials (issue 36, item 1 "Auth";
docs/PROTOCOL.md, "Access keys").

Units: the sealing of secrets the map keeps (qserver/sealing.py), the forwards' sealed format
unchanged by it, NodeServices.access_key over a registry (found, cached, revoked, removed),
and the records the routes show. Then one real 3-node cluster: keys made at one node are
listed, and open, at every node; revoked and removed at once everywhere; at most 4; admin only;
qctl with --json; the secret on no node's disk (Raft log, snapshots, LMDB, logs) and in no
GET /v1/clients. And a node alone: its keys open after a restart.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import stat
from io import StringIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials
from client.http import HttpClient
from client.qctl import main as qctl_main
from qserver import sealing, services
from qserver.api.client_routes import shown
from qserver.dev.devcluster import LocalCluster
from qserver.features.forwards.forwarder import open_secret, seal_secret
from qserver.sealing import (
    SealingError,
    lone_node_secret,
    new_access_key,
    open_access_key,
    open_sealed,
    seal,
    seal_access_key,
)
from qserver.services import NodeServices
from qserver.storage.lmdb_store import read_clients
from tests.test_surveillance import until
from wire.errors import E_NOT_FOUND, E_UNKNOWN_CLIENT
from wire.signing import Signer, new_private_key

KEY_ID = re.compile(r"AKQC[A-Z2-7]{16}")


# --- sealing --------------------------------------------------------------------------------------
def test_a_sealed_text_opens_only_with_its_secret_purpose_and_binding() -> None:
    stored = seal(b"secret-1", "access key", "c-1\x1fAKQC", b"the plaintext")
    assert stored.startswith("sealed1:") and b"the plaintext" not in stored.encode()
    assert open_sealed(b"secret-1", "access key", "c-1\x1fAKQC", stored) == b"the plaintext"
    assert seal(b"secret-1", "access key", "c-1\x1fAKQC", b"the plaintext") != stored      # a nonce each time
    for secret, purpose, binding in ((b"secret-2", "access key", "c-1\x1fAKQC"),
                                     (b"secret-1", "forward credentials", "c-1\x1fAKQC"),
                                     (b"secret-1", "access key", "c-2\x1fAKQC")):
        with pytest.raises(SealingError):
            open_sealed(secret, purpose, binding, stored)
    raw = bytearray(base64.b64decode(stored[len("sealed1:"):]))
    raw[-1] ^= 1
    for damaged in ("sealed1:" + base64.b64encode(bytes(raw)).decode(), "sealed1:!!", "sealed1:AAAA", "plain"):
        with pytest.raises(SealingError):
            open_sealed(b"secret-1", "access key", "c-1\x1fAKQC", damaged)
    with pytest.raises(SealingError):
        seal(b"", "access key", "x", b"no secret, no sealing")


def _old_seal_secret(cluster_secret: bytes, name: str, client_id: str, private_key: str, ca: str = "") -> str:
    """forwarder.py's seal_secret as it was before qserver/sealing.py (release 0.2.0)."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"qcluster forward credentials v1").derive(
        cluster_secret)
    nonce = os.urandom(12)
    document = json.dumps({"private_key": private_key, "ca": ca}).encode()
    sealed = AESGCM(key).encrypt(nonce, document, f"{name}\x1f{client_id}".encode())
    return "sealed1:" + base64.b64encode(nonce + sealed).decode()


def _old_open_secret(cluster_secret: bytes, name: str, client_id: str, stored: str) -> tuple[str, str]:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"qcluster forward credentials v1").derive(
        cluster_secret)
    raw = base64.b64decode(stored[len("sealed1:"):])
    document = json.loads(AESGCM(key).decrypt(raw[:12], raw[12:], f"{name}\x1f{client_id}".encode()))
    return str(document["private_key"]), str(document.get("ca") or "")


def test_forward_credentials_keep_their_format_both_ways() -> None:
    """Maps written before qserver/sealing.py hold forwards' credentials the old code sealed:
    they open, and what the new code seals the old code (a 0.2.0 node) opens."""
    old = _old_seal_secret(b"cluster-secret", "f1", "c-1", "PRIVATE", "CA-PEM")
    assert open_secret(b"cluster-secret", "f1", "c-1", old) == ("PRIVATE", "CA-PEM")
    new = seal_secret(b"cluster-secret", "f1", "c-1", "PRIVATE", "CA-PEM")
    assert new.startswith("sealed1:")
    assert _old_open_secret(b"cluster-secret", "f1", "c-1", new) == ("PRIVATE", "CA-PEM")
    assert seal_secret(b"", "f1", "c-1", "PRIVATE") == "PRIVATE"       # outside a cluster: as given


def test_a_lone_nodes_secret_persists_owner_only(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    first = lone_node_secret(fresh)
    assert len(first) == 64 and lone_node_secret(fresh) == first
    path = fresh / sealing.SEALING_SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in fresh.iterdir()) == [sealing.SEALING_SECRET_FILE]
    initialised = tmp_path / "initialised"
    initialised.mkdir()
    (initialised / "cluster.secret").write_text("ab" * 32 + "\n")     # `qserver init` wrote one: that one
    assert lone_node_secret(initialised) == ("ab" * 32).encode()


def test_access_key_shapes() -> None:
    key_ids, secrets = zip(*(new_access_key() for _ in range(50)), strict=True)
    assert all(KEY_ID.fullmatch(key_id) for key_id in key_ids) and len(set(key_ids)) == 50
    assert all(len(secret) == 40 and re.fullmatch(r"[A-Za-z0-9+/]{40}", secret) for secret in secrets)
    assert sealing.is_access_key_id(key_ids[0]) and not sealing.is_access_key_id("AKIA" + key_ids[0][4:])


# --- NodeServices.access_key over a registry ------------------------------------------------------
def _services(clients: dict[str, dict[str, Any]], secret: bytes = b"cluster-secret") -> NodeServices:
    engine: Any = SimpleNamespace(clients=clients)
    config: Any = SimpleNamespace(node_id="n1", own_url="http://n1")
    return NodeServices(engine, None, config, cluster_secret=secret, auth_enabled=True,  # type: ignore[arg-type]
                        pass_on=None)  # type: ignore[arg-type]


def _record(client_id: str, secret: bytes, keys: dict[str, str]) -> dict[str, Any]:
    return {"id": client_id, "name": client_id, "public_key": "pk", "grants": [],
            "access_keys": {key_id: {"sealed": seal_access_key(secret, client_id, key_id, text), "created_ms": 1}
                            for key_id, text in keys.items()}}


def test_access_key_answers_from_the_live_registry_and_caches_the_opened_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    (k1, s1), (k2, s2), (k3, _) = new_access_key(), new_access_key(), new_access_key()
    clients = {"c-a": _record("c-a", b"cluster-secret", {k1: s1}),
               "c-b": _record("c-b", b"cluster-secret", {k2: s2}),
               "c-plain": {"id": "c-plain", "name": "plain", "grants": []}}
    node = _services(clients)
    assert node.sealing_secret == b"cluster-secret"
    opened: list[str] = []

    def counting(secret: bytes, client_id: str, key_id: str, stored: str) -> bytes:
        opened.append(key_id)
        return open_access_key(secret, client_id, key_id, stored)
    monkeypatch.setattr(services, "open_access_key", counting)
    assert node.access_key(k1) == ("c-a", s1.encode("ascii"))
    assert node.access_key(k1) == ("c-a", s1.encode("ascii")) and opened == [k1]     # cached: no AES
    assert node.access_key(k2) == ("c-b", s2.encode("ascii"))
    assert node.access_key(k3) is None and node.access_key("not a key") is None
    # Revoked: the record no longer holds it (the map applied the change); at once, cache or not.
    clients["c-a"] = {**clients["c-a"], "access_keys": {}}
    assert node.access_key(k1) is None
    # The same key id sealed anew (a record replaced): opened again, not the cached secret.
    clients["c-b"] = _record("c-b", b"cluster-secret", {k2: "another-secret-of-forty-characters-000000"})
    assert node.access_key(k2) == ("c-b", b"another-secret-of-forty-characters-000000")
    del clients["c-b"]                                   # the client removed
    assert node.access_key(k2) is None
    # A record sealed under another secret, or a sealed text copied to another client: no key.
    clients["c-c"] = _record("c-c", b"other-secret", {k3: s1})
    assert node.access_key(k3) is None
    moved = _record("c-a", b"cluster-secret", {k3: s1})["access_keys"]
    clients["c-c"] = {"id": "c-c", "access_keys": moved}
    assert node.access_key(k3) is None
    clients["c-d"] = {"id": "c-d", "access_keys": {k3: "not a dict"}}
    assert node.access_key(k3) is None


def test_a_lone_node_seals_with_its_own_secret() -> None:
    key_id, secret = new_access_key()
    node = _services({"c-a": _record("c-a", b"lone", {key_id: secret})}, secret=b"")
    assert node.access_key(key_id) is None            # no sealing secret given: nothing opens
    node = NodeServices(node._engine, None, node.config, cluster_secret=b"", auth_enabled=True,  # type: ignore[arg-type]
                        pass_on=None, sealing_secret=b"lone")  # type: ignore[arg-type]
    assert node.sealing_secret == b"lone" and node.access_key(key_id) == ("c-a", secret.encode())


def test_a_shown_record_lists_key_ids_not_sealed_secrets() -> None:
    key_id, secret = new_access_key()
    record = _record("c-a", b"s", {key_id: secret})
    listed = shown(record)
    assert listed["access_keys"] == [{"access_key_id": key_id, "created_ms": 1}]
    assert "sealed" not in json.dumps(listed) and record["access_keys"][key_id]["sealed"]     # the record untouched
    assert shown({"id": "c-b", "grants": []}) == {"id": "c-b", "grants": []}


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_a_node_without_the_routes_is_reported_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of release 0.2.0 has no access-key routes: its E_NOT_FOUND ("no such route")
    reaches the caller as E_FEATURE_DISABLED saying the node is too old; other errors pass."""
    http = HttpClient("http://127.0.0.1:9", Signer("c-1", new_private_key()))
    answers: list[QueueError] = [QueueError(E_NOT_FOUND, "no such route")] * 3 + [QueueError(E_UNKNOWN_CLIENT, "no")]

    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise answers.pop(0)
    monkeypatch.setattr(http, "_json", refused)
    for call in (http.create_access_key("c-2"), http.list_access_keys("c-2"), http.revoke_access_key("c-2", "AKQC")):
        with pytest.raises(QueueError) as too_old:
            await call
        assert too_old.value.code == "E_FEATURE_DISABLED" and "too old for access keys" in too_old.value.message
    with pytest.raises(QueueError) as unknown:
        await http.list_access_keys("c-2")
    assert unknown.value.code == "E_UNKNOWN_CLIENT"
    await http.close()


# --- a real cluster ------------------------------------------------------------------------------
async def _qctl(cluster: LocalCluster, *argv: str) -> tuple[int, Any, str]:
    out, err = StringIO(), StringIO()
    code = await asyncio.to_thread(qctl_main, ["--json", "--credentials", str(cluster.credentials_path), *argv],
                                   stdout=out, stderr=err)
    return code, json.loads(out.getvalue()) if out.getvalue().strip() else None, err.getvalue()


def _opened_at(cluster: LocalCluster, node: str, key_id: str) -> tuple[str, bytes] | None:
    """NodeServices.access_key over the registry `node` keeps on disk, with its cluster secret."""
    registry = read_clients(cluster.root / node / "lmdb")
    secret = (cluster.root / node / "cluster.secret").read_text().strip().encode()
    return _services(registry, secret).access_key(key_id)


async def _opens_at(cluster: LocalCluster, node: str, key_id: str, expected: tuple[str, bytes] | None) -> None:
    """`node`'s registry on disk answers `expected` for the key, once its next commit wrote
    what its memory already holds (the routes answer from memory)."""
    async def check() -> bool:
        return _opened_at(cluster, node, key_id) == expected
    await until(check, f"{key_id} to open as {expected and expected[0]} at {node}")


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_access_keys_across_a_cluster(qcluster_factory: Any, tmp_path: Path) -> None:
    # The map is snapshotted every 5 commands, so a snapshot too is on the disks scanned at the end.
    cluster: LocalCluster = qcluster_factory(3, None, {"membership_compact_every": 5})
    ca_file = load_credentials(cluster.credentials_path).ca_file
    admins = {node: AsyncClient(cluster.urls[node], cluster.credentials_path) for node in cluster.ids}
    secrets: list[str] = []
    try:
        admin = admins["n1"]
        worker = await admin.register_client("worker", [{"pattern": "jobs", "privileges": ["post", "get"]}])
        plain = await admin.register_client("plain", [{"pattern": "*", "privileges": ["post", "get", "delete"]}])
        worker_id = worker["id"]

        made = await admin.create_access_key(worker_id)
        assert set(made) == {"client", "access_key_id", "secret_access_key", "created_ms"}
        assert made["client"] == worker_id and KEY_ID.fullmatch(made["access_key_id"])
        assert len(made["secret_access_key"]) == 40
        key_id = made["access_key_id"]
        secrets.append(made["secret_access_key"])
        for node in cluster.ids:                    # listed at every node, as the map reaches it
            await until(lambda n=node: _has_key(admins[n], worker_id, key_id), f"the key listed at {node}")
            await _opens_at(cluster, node, key_id, (worker_id, made["secret_access_key"].encode()))

        # Every record shown lists ids, never a sealed text or the secret.
        for node in cluster.ids:
            listed = json.dumps(await admins[node].list_clients())
            assert key_id in listed and "sealed" not in listed and made["secret_access_key"] not in listed
        granted = await admin.set_grants(worker_id, [{"pattern": "jobs", "privileges": ["post"]}])
        assert [k["access_key_id"] for k in granted["access_keys"]] == [key_id] and "sealed" not in json.dumps(granted)
        await _opens_at(cluster, "n1", key_id, (worker_id, made["secret_access_key"].encode()))     # grants kept it

        # Four made at once through three nodes: each change is made at the membership leader, one
        # at a time, so none overwrites another's record (every key made is kept).
        burst = await admin.register_client("burst", [{"pattern": "jobs", "privileges": ["get"]}])
        made_at_once = await asyncio.gather(*(admins[node].create_access_key(burst["id"])
                                              for node in ("n1", "n2", "n3", "n2")))
        secrets += [answer["secret_access_key"] for answer in made_at_once]
        wanted = sorted(answer["access_key_id"] for answer in made_at_once)
        for node in cluster.ids:
            async def all_listed(n: str = node) -> bool:
                return sorted(k["access_key_id"] for k in await admins[n].list_access_keys(burst["id"])) == wanted
            await until(all_listed, f"the four keys listed at {node}")

        # At most four; made at other nodes too.
        for node in ("n2", "n3", "n2"):
            secrets.append((await admins[node].create_access_key(worker_id))["secret_access_key"])
        with pytest.raises(QueueError) as refused:
            await admins["n3"].create_access_key(worker_id)
        assert refused.value.code == "E_INVALID_OPTION"
        assert len(await admin.list_access_keys(worker_id)) == 4

        # Admin only; unknown client; unknown key.
        plain_client = AsyncClient(cluster.urls["n2"], Credentials(plain["id"], plain["private_key"],
                                                                   cluster.urls["n2"], ca_file))
        async with plain_client:
            for call in (plain_client.create_access_key(worker_id), plain_client.list_access_keys(worker_id),
                         plain_client.revoke_access_key(worker_id, key_id)):
                with pytest.raises(QueueError) as forbidden:
                    await call
                assert forbidden.value.code == "E_FORBIDDEN"
        for call in (admin.create_access_key("c-000000000000"), admin.list_access_keys("c-000000000000")):
            with pytest.raises(QueueError) as unknown:
                await call
            assert unknown.value.code == "E_UNKNOWN_CLIENT"
        with pytest.raises(QueueError) as unknown:
            await admin.revoke_access_key(worker_id, "AKQCAAAAAAAAAAAAAAAA")
        assert unknown.value.code == "E_UNKNOWN_ACCESS_KEY"

        # Revoked at n2: gone at every node.
        assert (await admins["n2"].revoke_access_key(worker_id, key_id))["revoked"] == key_id
        for node in cluster.ids:
            await until(lambda n=node: _lacks_key(admins[n], worker_id, key_id), f"the key gone at {node}")
            await _opens_at(cluster, node, key_id, None)

        # qctl: the client by name or id, --json, --out.
        code, document, _ = await _qctl(cluster, "client", "access-key", "revoke", "worker",
                                        (await admin.list_access_keys(worker_id))[0]["access_key_id"])
        assert code == 0 and document["client"] == worker_id
        code, document, _ = await _qctl(cluster, "client", "access-key", "create", "worker")
        assert code == 0 and document["client"] == worker_id and document["name"] == "worker"
        assert document["endpoint_url"] == cluster.urls["n1"] + "/sqs"
        secrets.append(document["secret_access_key"])
        qctl_key = document["access_key_id"]
        out = tmp_path / "worker.env"
        code, document, _ = await _qctl(cluster, "clients", "access-key", "create", worker_id, "--out", str(out))
        assert code == 0 and "secret_access_key" not in document and document["file"] == str(out)
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        written = dict(line.removeprefix("export ").split("=", 1) for line in out.read_text().splitlines()
                       if line.startswith("export "))
        assert written["AWS_ACCESS_KEY_ID"] == document["access_key_id"]
        assert written["AWS_ENDPOINT_URL_SQS"] == cluster.urls["n1"] + "/sqs"
        await _opens_at(cluster, "n1", document["access_key_id"], (worker_id, written["AWS_SECRET_ACCESS_KEY"].encode()))
        secrets.append(written["AWS_SECRET_ACCESS_KEY"])
        code, document, _ = await _qctl(cluster, "client", "access-key", "list", "worker")
        assert code == 0 and qctl_key in [k["access_key_id"] for k in document["access_keys"]]
        assert len(document["access_keys"]) == 4
        code, document, err = await _qctl(cluster, "client", "access-key", "list", "nobody")
        assert code == 1 and document["error"]["code"] == "E_UNKNOWN_CLIENT" and "nobody" in err

        # Removing the client removes its keys, at every node.
        await admin.remove_client(worker_id)
        for node in cluster.ids:
            await until(lambda n=node: _client_gone(admins[n], worker_id), f"the client gone at {node}")
            await _opens_at(cluster, node, qctl_key, None)
        with pytest.raises(QueueError) as unknown:
            await admins["n3"].list_access_keys(worker_id)
        assert unknown.value.code == "E_UNKNOWN_CLIENT"
    finally:
        for client in admins.values():
            await client.close()
    # No secret anywhere on disk: Raft log and snapshots, LMDB, the nodes' logs.
    assert len(secrets) == 10
    for path in cluster.root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert [s for s in secrets if s.encode() in data] == [], f"a secret in plaintext in {path}"


async def _has_key(client: AsyncClient, client_id: str, key_id: str) -> bool:
    return key_id in [k["access_key_id"] for k in await client.list_access_keys(client_id)]


async def _lacks_key(client: AsyncClient, client_id: str, key_id: str) -> bool:
    return not await _has_key(client, client_id, key_id)


async def _client_gone(client: AsyncClient, client_id: str) -> bool:
    return client_id not in [c["id"] for c in await client.list_clients()]


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_lone_nodes_keys_open_after_a_restart(qnode: Any) -> None:
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        worker = await admin.register_client("worker", [{"pattern": "jobs", "privileges": ["post"]}])
        made = await admin.create_access_key(worker["id"])
    await asyncio.to_thread(qnode.restart)
    async with AsyncClient(qnode.url, qnode.credentials_path) as admin:
        assert [k["access_key_id"] for k in await admin.list_access_keys(worker["id"])] == [made["access_key_id"]]
        assert "sealed" not in json.dumps(await admin.list_clients())
    registry = read_clients(qnode.data_dir / "lmdb")
    node = _services(registry, secret=b"")
    node = NodeServices(node._engine, None, node.config, cluster_secret=b"", auth_enabled=True,  # type: ignore[arg-type]
                        pass_on=None, sealing_secret=lone_node_secret(qnode.data_dir))  # type: ignore[arg-type]
    assert node.access_key(made["access_key_id"]) == (worker["id"], made["secret_access_key"].encode())
    assert made["secret_access_key"].encode() not in b"".join(
        path.read_bytes() for path in qnode.data_dir.rglob("*") if path.is_file())
