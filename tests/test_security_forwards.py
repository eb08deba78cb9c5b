"""Attack tests (issue 32, item 12 and the forwards' Low findings): forward sessions at the root
and a forward's credentials, against real nodes on loopback through the real client library.

The honest forwarder in these tests is a real forward whose destination is reached by URL with
the credentials of a client registered for it ("honest", `post` on the root queue), as a forward
from another cluster would be; the attacker ("mallory") is another client with `post` there."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, load_credentials
from qserver.dev.devcluster import LocalCluster
from qserver.features.forwards import root as forward_root
from qserver.features.forwards.forwarder import SEALED_PREFIX, open_secret, seal_secret
from replication.cluster_map import ForwardEntry, PutForward
from wire.message_input import HEADERS_CHARS_MAX, HEADERS_MAX
from wire.signing import new_private_key, private_key_to_text, public_key_text

COMPACT_EVERY = 10          # map commands between two snapshots of the map (the default is 1,000)


async def _client_with_own_key(admin: AsyncClient, name: str, queue: str) -> tuple[str, str]:
    """A client with `post` on `queue` whose private key the cluster never saw: (id, key)."""
    key = new_private_key()
    record = await admin.register_client(name, [{"pattern": queue, "privileges": ["post"]}],
                                         public_key=public_key_text(key))
    return str(record["id"]), private_key_to_text(key)


def _as(cluster: LocalCluster, node: str, client_id: str, key: str) -> AsyncClient:
    ca_file = load_credentials(cluster.credentials_path).ca_file
    return AsyncClient(cluster.urls[node], Credentials(client_id, key, cluster.urls[node], ca_file))


async def _until(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _drain(client: AsyncClient, queue: str, into: list[Any], want: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(into) < want and time.monotonic() < deadline:
        for message in await client.receive(queue, 100, wait_s=0.5):
            into.append(message)
            await message.ack()
    assert len(into) >= want, f"{len(into)} of {want} arrived"


async def _stats(client: AsyncClient, name: str) -> dict[str, Any] | None:
    try:
        stats = await client.forward_stats(name)
    except QueueError as error:
        if error.code != "E_UNKNOWN_FORWARD":
            raise
        return None
    return stats if stats.get("state") == "open" else None


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_another_post_client_cannot_replace_close_outweigh_or_crowd_out_a_forward_session(
        qcluster_factory: Any) -> None:
    """Issue 32, item 12. Forward sessions at the root needed only `post`, and were keyed by the
    forward id alone, which is public (`GET /v1/forwards`, the root's stats, the `x-sequence-key`
    of every forwarded message). Mallory, with `post` on the root queue: opens a session under the
    honest forward's id (it replaced the honest one, whose next keepalive was refused), numbers a
    message far ahead in the honest stream through it, and closes its socket (which dropped the
    session it had taken over); claims weight 100 with 10 bands (rate taken from the others);
    opens sessions until refused (all 256 of the queue's slots); opens one under a 1 MB name
    (kept, logged and put into /metrics). Now: its session under that id is its own and goes
    with its socket, a weight beyond the bands and a bad name are refused, it holds at most
    SESSIONS_PER_CLIENT_MAX sessions, and the honest forward keeps its one session and delivers
    every message once."""
    cluster: LocalCluster = qcluster_factory(2, {"collect": ["n1", "n2"], "outbox": ["n2", "n1"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("collect", strength="full", forward_rate=1_000.0, forward_interval_s=0.5)
        await admin.create_queue("outbox", strength="full", max_depth=1_000)
        honest_id, honest_key = await _client_with_own_key(admin, "honest", "collect")
        mallory_id, mallory_key = await _client_with_own_key(admin, "mallory", "collect")
        await admin.create_forward("fwd", "outbox", "collect", urls=[cluster.urls["n1"], cluster.urls["n2"]],
                                   credentials={"client_id": honest_id, "private_key": honest_key})
        forward_id = next(f["id"] for f in await admin.forwards() if f["name"] == "fwd")
        sent = [b"m%03d" % i for i in range(120)]
        await admin.enqueue_many("outbox", sent[:60])
        received: list[Any] = []
        await _drain(admin, "collect", received, 60)
        stream = received[0].headers["x-sequence-key"]           # public: on every forwarded message
        assert stream.startswith(forward_id + "@")
        assert (await _until(lambda: _stats(admin, "fwd"), "the honest session"))["sessions"] == 1

        # Replace and close: a session under the honest forward's id, a number far ahead in
        # its stream, then the socket closed.
        async with _as(cluster, "n1", mallory_id, mallory_key) as mallory:
            await mallory.forward_session("collect", forward_id, 0, open=True)
            far = 999_999_999_999                 # its floor too: every lower number "settled"
            await mallory.forward_data("collect", forward_id, stream, 0, far, [(b"poison", 4, far, 0, None)])
            await asyncio.sleep(2.5)              # the honest keepalives go on meanwhile
        await asyncio.sleep(1.0)

        async with _as(cluster, "n1", mallory_id, mallory_key) as mallory:
            # Outweigh: a weight beyond the queue's bands (10: weights 0..9).
            for weight in (100, 10):
                with pytest.raises(QueueError) as heavy:
                    await mallory.forward_session("collect", "mallory-heavy", weight, open=True)
                assert heavy.value.code == "E_INVALID_OPTION", weight
            # Names: checked like queue names (a forward's name and its token).
            with pytest.raises(QueueError):       # E_INVALID_NAME (or a frame limit's refusal)
                await mallory.forward_session("collect", "x" * 1_000_000, 0, open=True)
            for name in ("y" * 300, "bad name", "-dash", forward_id + "/x"):
                with pytest.raises(QueueError) as bad_name:
                    await mallory.forward_session("collect", name, 0, open=True)
                assert bad_name.value.code == "E_INVALID_NAME", (name[:10], bad_name.value)
            # Crowd out: sessions until refused.
            opened = 0
            with pytest.raises(QueueError) as crowded:
                for number in range(forward_root.SESSIONS_MAX):
                    await mallory.forward_session("collect", f"mallory-{number}", 0, open=True)
                    opened += 1
            assert crowded.value.code == "E_OVERLOADED" and opened == forward_root.SESSIONS_PER_CLIENT_MAX
            async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as at_root:
                sessions = (await at_root.queue_stats("collect"))["forward_sessions"]
            assert [s["client"] for s in sessions if s["forward"] == forward_id] == [honest_id]
            assert max(len(s["forward"]) for s in sessions) < 300
            assert sum(1 for s in sessions if s["client"] == mallory_id) == forward_root.SESSIONS_PER_CLIENT_MAX

            # The honest forward goes on, in the one session it opened, and loses nothing.
            await admin.enqueue_many("outbox", sent[60:])
            await _drain(admin, "collect", received, len(sent) + 1)
        payloads = sorted(m.payload for m in received)
        assert payloads == sorted([*sent, b"poison"]), "each honest message once (and mallory's own)"
        stats = await _until(lambda: _stats(admin, "fwd"), "the honest session")
        assert stats["sessions"] == 1 and stats["stored"] == len(sent), stats


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_message_with_the_most_headers_a_source_takes_is_forwarded(qcluster_factory: Any) -> None:
    """Issue 32, Low: "forwarded messages with many headers are always refused". The root adds
    the stream's three `x-sequence-*` headers to the message's own, and the sum was checked
    against the 16-header (and 4,096-character) limit: a message the source accepted with 14
    or more headers was refused at the destination for good (E_INVALID_OPTION), given back to
    the source and dead-lettered there. Now the stream's headers count apart."""
    cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("dst", strength="full")
        await admin.create_queue("src", strength="full")
        await admin.create_forward("many", "src", "dst")
        value_chars = HEADERS_CHARS_MAX // HEADERS_MAX - 8
        full = {f"h-{n:05d}": chr(ord("a") + n) * value_chars for n in range(HEADERS_MAX)}
        assert sum(len(k) + len(v) for k, v in full.items()) <= HEADERS_CHARS_MAX
        await admin.enqueue("src", b"crowded", headers=full)
        await admin.enqueue("src", b"plain")
        received: list[Any] = []
        await _drain(admin, "dst", received, 2, timeout_s=20.0)
        crowded = next(m for m in received if m.payload == b"crowded")
        assert {k: v for k, v in crowded.headers.items() if k in full} == full
        assert crowded.headers["x-sequence"]
        assert (await admin.forward_stats("many"))["refused"] == 0


@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_another_clusters_key_for_a_forward_is_nowhere_on_disk_in_plaintext(qcluster_factory: Any) -> None:
    """Issue 32, Low: the private key of a forward's client in another cluster sat in plaintext
    in every node's Raft log, map snapshots and LMDB files (and in the map objects' repr). An
    attacker reading a node's data directory (or a log of a repr) got a client of the other
    cluster. Now it is sealed with the cluster secret (AES-GCM, HKDF): the forward still works,
    and no file of any node, after a compaction, holds the key."""
    cluster: LocalCluster = qcluster_factory(2, {"collect": ["n1", "n2"], "outbox": ["n2", "n1"]},
                                             {"membership_compact_every": COMPACT_EVERY})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("collect", strength="full")
        await admin.create_queue("outbox", strength="full")
        client_id, key = await _client_with_own_key(admin, "remote-writer", "collect")
        await admin.create_forward("keyed", "outbox", "collect", urls=[cluster.urls["n1"]],
                                   credentials={"client_id": client_id, "private_key": key})
        for number in range(2 * COMPACT_EVERY):          # the map is snapshotted, the log compacted
            await admin.register_client(f"filler-{number}", [{"pattern": "other", "privileges": ["get"]}])
        await admin.enqueue_many("outbox", [b"a", b"b", b"c"])
        received: list[Any] = []
        await _drain(admin, "collect", received, 3)      # the sealed key still signs at the destination
        assert sorted(m.payload for m in received) == [b"a", b"b", b"c"]
        assert key not in repr(await admin.forwards())
    needle = key.encode()
    for node in cluster.ids:
        found = [str(path) for path in Path(cluster.root / node).rglob("*")
                 if path.is_file() and needle in path.read_bytes()]
        assert found == [], f"{node} keeps the other cluster's key in plaintext in {found}"


def test_sealed_credentials_open_only_with_the_cluster_secret_and_show_in_no_repr() -> None:
    """Issue 32, Low (the parts inside one process): the sealed form opens with the cluster
    secret and the forward it was made for, not with another secret nor for another forward;
    an entry made before sealing (a plain key) is read as it is; and neither the map's entry nor
    its command shows the secret in a repr (which logs and tracebacks print)."""
    secret, key, ca = b"cluster-secret-1", "KEYTEXT", "-----BEGIN CERTIFICATE-----\n..."
    sealed = seal_secret(secret, "f1", "c-1", key, ca)
    assert sealed.startswith(SEALED_PREFIX) and key not in sealed
    assert open_secret(secret, "f1", "c-1", sealed) == (key, ca)
    for other_secret, name in ((b"cluster-secret-2", "f1"), (secret, "f2")):
        with pytest.raises(Exception):        # noqa: B017  (cryptography's InvalidTag)
            open_secret(other_secret, name, "c-1", sealed)
    assert open_secret(secret, "f1", "c-1", "OLD-PLAIN-KEY") == ("OLD-PLAIN-KEY", "")
    assert "KEYTEXT" not in repr(ForwardEntry("f1", "s", "d", ("http://x",), "c-1", "KEYTEXT"))
    assert "KEYTEXT" not in repr(PutForward("f1", "s", "d", ("http://x",), "c-1", "KEYTEXT", 1, "t"))


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_forward_checks_the_other_clusters_certificates_against_that_clusters_ca(
        qcluster_factory: Any, tmp_path: Path) -> None:
    """Issue 32, Low: a cross-cluster forward checked the remote nodes' TLS certificates against
    this cluster's CA (or none), so a forward to a cluster with its own CA could not work, or
    trusted whatever this cluster's CA signed. Now the forward carries that cluster's CA
    (`credentials.ca`, PEM; `ca_file` in a credentials file), sealed with its key, and its TLS
    uses it; something that is not a certificate is refused."""
    from qserver.transport.tls import make_tls_files
    other_ca = Path(make_tls_files(tmp_path / "other", "other-ca")["tls_ca_file"]).read_text()
    cluster: LocalCluster = qcluster_factory(2, {"collect": ["n1", "n2"], "outbox": ["n2", "n1"]})
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as admin:
        await admin.create_queue("collect", strength="full")
        await admin.create_queue("outbox", strength="full")
        client_id, key = await _client_with_own_key(admin, "remote-writer", "collect")
        with pytest.raises(QueueError) as bad:
            await admin.create_forward("bad-ca", "outbox", "collect", urls=["https://127.0.0.1:9"],
                                       credentials={"client_id": client_id, "private_key": key, "ca": "not a cert"})
        assert bad.value.code == "E_INVALID_OPTION"
        await admin.create_forward("own-ca", "outbox", "collect", urls=["https://127.0.0.1:9"],
                                   credentials={"client_id": client_id, "private_key": key, "ca": other_ca})
        # The forwarder (on outbox's master, n2) writes that CA beside its data and uses it.
        written = cluster.root / "n2" / "forward-ca"
        await _until(lambda: _async(lambda: written.is_dir() and any(written.iterdir())), "the forward's CA file")
        [path] = list(written.iterdir())
        assert path.read_text() == other_ca and path.name.startswith("own-ca.")


async def _async(check: Any) -> Any:
    return check()
