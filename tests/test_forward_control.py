"""Each forward's own fill bands, weights and fill unit (issue 37 item 12; seed 003 figure 6),
on real processes: two forwards into one root, their sources equally full, get different
rates from their different bands and weights; a change through qctl turns the split around;
a fill in bytes tells a few large messages from many small ones; malformed controls answer
E_* codes and change nothing."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import LocalCluster
from tests.support import RawApi, error_code, raw_session
from tests.test_client_integration import run_qctl
from tests.test_surveillance import until
from wire.errors import QueueError

RATE = 40.0


async def _at_level_3(cluster: LocalCluster, client: AsyncClient) -> None:
    """A new cluster runs at feature level 1: a forward's own control is refused until every
    node runs 0.3.0 and the cluster is finalized (0.2.0 could not decode it)."""
    with pytest.raises(QueueError) as disabled:
        await client.create_forward("early", "mq1", "root", control={"weights": [1, 2]})
    assert disabled.value.code == "E_FEATURE_DISABLED"
    assert await client.forwards() == []
    await client.finalize_cluster()

    async def everywhere() -> bool | None:
        levels = [await asyncio.to_thread(cluster.health, node) for node in cluster.urls]
        return all(level.get("feature_level") == 3 for level in levels) or None
    await until(everywhere, "feature level 3 on every node")


async def _stats(client: AsyncClient, name: str) -> dict[str, Any] | None:
    """The forwarder's figures once its session is open and its fill measured."""
    try:
        stats = await client.forward_stats(name)
    except QueueError as error:
        if error.code != "E_UNKNOWN_FORWARD":
            raise
        return None
    return stats if stats.get("state") == "open" and stats.get("fill") and stats.get("rate") is not None else None


async def _split(client: AsyncClient, weights: dict[str, int]) -> dict[str, dict[str, Any]] | None:
    """Each forward's figures once each reports the weight given and the root's rates follow them."""
    shown = {}
    for name in weights:
        stats = await _stats(client, name)
        if stats is None or stats["weight"] != weights[name]:
            return None
        shown[name] = stats
    total = sum(weights.values())
    if any(abs(shown[name]["rate"] - RATE * weights[name] / total) > 0.01 for name in weights):
        return None
    return shown


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_two_forwards_with_their_own_bands_get_different_rates_from_the_same_fill(
        qcluster_factory: Any, tmp_path: Path) -> None:
    cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("root", strength="full", forward_rate=RATE, forward_interval_s=0.3)
        for name in ("mq1", "mq2"):
            await client.create_queue(name, strength="full", max_depth=1_000)
            await client.enqueue_many(name, [name.encode()] * 600)       # both 60 % full
        await _at_level_3(cluster, client)
        # Figure 6: MQ1 thresholds 0.7 (weights 1, 5): band 0, weight 1; MQ2 thresholds
        # 0.2, 0.4 (weights 1, 2, 3): band 2, weight 3. Rᵢ = R·wᵢ/Σw: 10 and 30.
        made = await client.create_forward("from-mq1", "mq1", "root", control={"bands": [0.7], "weights": [1, 5]})
        assert made["control"] == {"bands": [0.7], "weights": [1, 5]}
        code, shown, err = await asyncio.to_thread(run_qctl, cluster, "forward", "create", "from-mq2", "--source",
                                                   "mq2", "--destination", "root", "--bands", "0.2,0.4",
                                                   "--weights", "1,2,3")
        assert code == 0 and shown["control"] == {"bands": [0.2, 0.4], "weights": [1, 2, 3]}, err
        split = await until(lambda: _split(client, {"from-mq1": 1, "from-mq2": 3}), "rates by the own weights")
        assert split["from-mq1"]["fill"]["band"] == 0 and split["from-mq2"]["fill"]["band"] == 2
        assert split["from-mq1"]["fill"]["unit"] == "messages" and split["from-mq1"]["fill"]["capacity"] == 1_000
        master = (await client.cluster())["queues"]["root"]["master"]
        async with AsyncClient(cluster.urls[master], cluster.credentials_path) as at_root:
            sessions = {s["forward"].split(".")[0]: s for s in (await at_root.queue_stats("root"))["forward_sessions"]}
        assert {name: s["weight"] for name, s in sessions.items()} == {"from-mq1": 1, "from-mq2": 3}
        # A change through qctl: MQ1's upper weight... its band 0 now weighs 9, the split turns.
        code, changed, err = await asyncio.to_thread(run_qctl, cluster, "forward", "set", "from-mq1",
                                                     "--weights", "9,9")
        assert code == 0 and changed["control"] == {"bands": [0.7], "weights": [9, 9]}, err
        await until(lambda: _split(client, {"from-mq1": 9, "from-mq2": 3}), "rates by the changed weights")
        # Back to the root's uniform bands (10): both report their band's number, 5 or so.
        code, changed, err = await asyncio.to_thread(run_qctl, cluster, "forward", "set", "from-mq1", "--bands",
                                                     "default", "--weights", "default")
        assert code == 0 and "control" not in changed, err
        assert "control" not in next(f for f in await client.forwards() if f["name"] == "from-mq1")

        async with raw_session() as session:
            api = RawApi.for_credentials(session, cluster.credentials_path)
            for path, body, code_wanted in (
                    ("/v1/forwards/none", {"control": {"weights": [1]}}, "E_UNKNOWN_FORWARD"),
                    ("/v1/forwards/from-mq2", {"control": {"weights": [1, 2]}}, "E_INVALID_OPTION"),   # 3 bands
                    ("/v1/forwards/from-mq2", {"control": {"bands": [0.5, 0.2]}}, "E_INVALID_OPTION"),
                    ("/v1/forwards/from-mq2", {"control": {"fill_unit": "bytes"}}, "E_INVALID_OPTION"),
                    ("/v1/forwards/from-mq2", {"control": {"colour": 1}}, "E_INVALID_OPTION"),
                    ("/v1/forwards/from-mq2", {"weights": [1, 2, 3]}, "E_INVALID_OPTION"),
                    ("/v1/forwards/from-mq2", b"[1]", "E_INVALID_OPTION")):
                _, answer, _ = await api.request("PATCH", path, body)
                assert error_code(answer) == code_wanted, (path, body, answer)
            _, answer, _ = await api.request("POST", "/v1/forwards", {"name": "f3", "source": "mq1",
                                                                      "destination": "root",
                                                                      "control": {"bands": 100}})
            assert error_code(answer) == "E_INVALID_OPTION"
        assert next(f for f in await client.forwards() if f["name"] == "from-mq2")["control"] == \
            {"bands": [0.2, 0.4], "weights": [1, 2, 3]}
        assert {f["name"] for f in await client.forwards()} == {"from-mq1", "from-mq2"}
        code, _, err = await asyncio.to_thread(run_qctl, cluster, "forward", "set", "from-mq2")
        assert code != 0 and "E_INVALID_OPTION" in err
        # Without the admin grant: refused, nothing changed.
        code, _, err = await asyncio.to_thread(run_qctl, cluster, "clients", "add", "worker", "--grant",
                                               "*:post,get,delete", "--out", str(tmp_path / "worker.json"))
        assert code == 0, err
        async with AsyncClient(credentials=str(tmp_path / "worker.json")) as worker:
            for attempt in (worker.change_forward("from-mq2", {"weights": [9, 9, 9]}),
                            worker.create_forward("f4", "mq1", "root", control={"weights": [1]})):
                with pytest.raises(QueueError) as forbidden:
                    await attempt
                assert forbidden.value.code == "E_FORBIDDEN"
        assert next(f for f in await client.forwards() if f["name"] == "from-mq2")["control"]["weights"] == [1, 2, 3]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_fill_in_bytes_tells_a_few_large_messages_from_many_small(qcluster_factory: Any) -> None:
    """20 messages of 50 kB (1 MB of 2 MB: band 1, weight 9) against 400 of 10 bytes (band 0,
    weight 1): by bytes the few large get 9/10 of the root's rate; by messages (20 or 400 of
    1000) the many small do."""
    cluster: LocalCluster = qcluster_factory(2)
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        # A slow root (1 message/s shared): the sources stay as full as they are while it looks.
        await client.create_queue("root", strength="full", forward_rate=1.0, forward_interval_s=0.3)
        for name in ("large", "small", "mq1"):
            await client.create_queue(name, strength="full", max_depth=1_000)
        await _at_level_3(cluster, client)
        for start in range(0, 20, 4):
            await client.enqueue_many("large", [bytes([65 + start]) * 50_000] * 4)
        await client.enqueue_many("small", [b"s" * 10] * 400)
        by_bytes = {"fill_unit": "bytes", "fill_bytes": 2_000_000, "bands": [0.2], "weights": [1, 9]}
        for name in ("large", "small"):
            await client.create_forward(f"from-{name}", name, "root", control=by_bytes)

        async def measured() -> tuple[dict[str, Any], dict[str, Any]] | None:
            large, small = await _stats(client, "from-large"), await _stats(client, "from-small")
            if large is None or small is None or large["weight"] != 9 or small["weight"] != 1:
                return None
            return large, small
        large, small = await until(measured, "the weights by bytes")
        assert large["fill"]["unit"] == "bytes" and 900_000 <= large["fill"]["amount"] <= 1_000_000
        assert small["fill"]["amount"] <= 4_000 and large["fill"]["capacity"] == 2_000_000
        await until(lambda: _rates_by(client, {"from-large": 0.9, "from-small": 0.1}), "the rates by bytes")
        for name in ("large", "small"):
            await client.change_forward(f"from-{name}", {"fill_unit": "messages", "fill_bytes": None})
        await until(lambda: _rates_by(client, {"from-large": 0.1, "from-small": 0.9}), "the rates by messages")


async def _rates_by(client: AsyncClient, wanted: dict[str, float]) -> bool | None:
    for name, rate in wanted.items():
        stats = await _stats(client, name)
        if stats is None or abs(stats["rate"] - rate) > 0.001:
            return None
    return True
