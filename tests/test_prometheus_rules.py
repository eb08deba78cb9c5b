"""The alert rules and dashboards of deploy/ against real nodes and a real Prometheus
(docs/OPERATIONS.md, "Monitoring").

One 3-node cluster: `orders` mastered by n1 with its replica on n2, messages in it and its
dead-letter queue, a push subscription. Checked: `promtool check rules` passes; every metric a
dashboard or rule names is one the nodes export (with samples); the new series carry their
`role`; Debian's Prometheus scraping the nodes evaluates every dashboard expression and, once n2
(the replica's node) stops, fires the node-down and replica-out-of-sync alerts, seen through its
own HTTP API. /usr/bin/prometheus and /usr/bin/promtool come with `./scripts/test`.
"""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from qserver.dev.devcluster import free_port

pytestmark = pytest.mark.asyncio

REPOSITORY = Path(__file__).resolve().parent.parent
RULES = REPOSITORY / "deploy" / "prometheus" / "rules.yml"
DASHBOARDS = sorted((REPOSITORY / "deploy" / "grafana").glob("*.json"))
PLACEMENT = {"orders": ["n1", "n2"]}
# Series Prometheus makes itself for every target, not the nodes.
PROMETHEUS_OWN = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def tool(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not Path(path).exists():
        pytest.fail(f"{name} is missing: ./scripts/test installs Debian's prometheus package (it brings {name})")
    return path


def metric_names(text: str) -> set[str]:
    """qserver_* names a rule file or a dashboard mentions (expressions and texts alike)."""
    return set(re.findall(r"\bqserver_[a-z0-9_]+", text))


def dashboard_expressions() -> list[str]:
    return [target["expr"] for path in DASHBOARDS for panel in json.loads(path.read_text())["panels"]
            for target in panel.get("targets", [])]


def sampled_names(metrics: str) -> set[str]:
    """Names of the samples in a Prometheus text exposition, each also under its histogram family."""
    names: set[str] = set()
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            names.add(name)
            names.update(name[:-len(suffix)] for suffix in HISTOGRAM_SUFFIXES if name.endswith(suffix))
    return names


def fetch(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=5, context=context) as answer:
        return str(answer.read().decode())


def api(port: int, path: str, **query: str) -> Any:
    answer = json.loads(fetch(f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(query)}"))
    assert answer["status"] == "success", answer
    return answer["data"]


@pytest.mark.timeout(30)
async def test_promtool_checks_the_rules() -> None:
    checked = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                             timeout=20)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


@pytest.mark.timeout(240)
async def test_the_rules_and_dashboards_against_a_cluster_and_prometheus(qcluster_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prometheus_bin = tool("prometheus")
    cluster = qcluster_factory(3, PLACEMENT)
    context = cluster.ssl_context
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("orders", max_deliveries=1)
        await client.enqueue_many("orders", [f"o{i}".encode() for i in range(5)])
        # One message runs out of deliveries (its lease lapses): it goes to orders.dlq.
        leased = await client.receive("orders", visibility_timeout_s=0.3)
        assert leased
        deadline = time.monotonic() + 20
        while (await client.queue_stats("orders.dlq"))["depth"] < 1:
            assert time.monotonic() < deadline, "the lapsed message never reached the dead-letter queue"
            await asyncio.sleep(0.2)
        async with client.consume("orders", prefetch=1):
            await asyncio.sleep(1.2)        # the oldest message is over a second old
            stats = await client.queue_stats("orders")
            texts = {node: fetch(url + "/metrics", context) for node, url in cluster.urls.items()}
    # The queue's statistics carry the new fields.
    assert stats["oldest_message_age_s"] >= 1.0 and stats["consumers"] == 1, stats
    master, replica = texts["n1"], texts["n2"]
    assert 'qserver_queue_consumers{queue="orders",role="master"} 1' in master
    assert 'qserver_queue_depth{queue="orders",role="master"} ' in master
    assert 'qserver_queue_depth{queue="orders",role="replica"} ' in replica
    assert 'qserver_queue_depth{queue="orders.dlq",role="master"} 1' in master     # on the same pair
    assert 'qserver_queue_depth{queue="orders.dlq",role="replica"} ' in replica
    assert 'qserver_replica_in_sync{queue="orders",role="master"} 1' in master
    assert 'qserver_replica_lag_operations{queue="orders",role="replica"} ' in replica
    assert 'qserver_queue_depth{queue="orders"' not in texts["n3"], "n3 holds no member of orders"
    age = float(re.search(r'qserver_queue_oldest_message_age_seconds\{queue="orders",role="master"\} (\S+)',
                          master).group(1))  # type: ignore[union-attr]
    assert age >= 1.0, master
    assert "qserver_node_lease_valid 1" in master and "qserver_node_lease_lapses_total 0" in master

    # Every name a rule or a dashboard uses is one the nodes export, with samples.
    exported = set().union(*(sampled_names(text) for text in texts.values()))
    named = metric_names(RULES.read_text()) | set().union(*(metric_names(p.read_text()) for p in DASHBOARDS))
    assert len(DASHBOARDS) == 3 and len(named) > 20
    assert not named - exported, f"named in deploy/ but exported by no node: {sorted(named - exported)}"

    # Prometheus itself: a copy of the rules whose `for:` durations are a second or two, so
    # that the alerts fire inside the test (the shipped durations wait minutes; what is under
    # test is the expressions and that they fire, not how long they wait).
    rules = re.sub(r"(?m)^(\s+)for: \S+", r"\1for: 2s", RULES.read_text())
    assert rules.count("for: 2s") == len(re.findall(r"(?m)^\s+for: ", RULES.read_text())) == 10
    (tmp_path / "rules.yml").write_text(rules)
    targets = {node: url.split("://", 1)[1] for node, url in cluster.urls.items()}
    tls = "\n    scheme: https\n    tls_config: {insecure_skip_verify: true}" if cluster.tls else ""
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 900ms}\n"
        "rule_files: [rules.yml]\n"
        f"scrape_configs:\n  - job_name: qserver{tls}\n"
        f"    static_configs: [{{targets: {json.dumps(sorted(targets.values()))}}}]\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prometheus = subprocess.Popen(
        [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:         # every node scraped as up
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                up = api(port, "/api/v1/query", query='up{job="qserver"} == 1')["result"]
                if len(up) == 3:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped the three nodes"
            await asyncio.sleep(0.5)
        # Every dashboard expression is valid PromQL and, for the queue, finds series.
        for expr in dashboard_expressions():
            query = expr.replace("$instance", ".*").replace("$queue", "orders")
            api(port, "/api/v1/query", query=query)
        assert api(port, "/api/v1/query", query='qserver_queue_oldest_message_age_seconds{queue="orders"}')["result"]
        firing_before = {alert["labels"]["alertname"] for alert in api(port, "/api/v1/alerts")["alerts"]
                         if alert["state"] == "firing"}
        assert not firing_before & {"QserverNodeDown", "QserverReplicaOutOfSync"}, firing_before

        cluster.stop("n2")          # the node of orders' replica
        # A write that needs the replica: the master records it out of sync before answering
        # (docs/ARCHITECTURE.md, Guarantee 8). An orderly stop records it at once when its
        # notice arrives; with a write this does not depend on that notice.
        async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
            await client.enqueue("orders", b"after n2 stopped")
        wanted = {("QserverNodeDown", "instance", targets["n2"]), ("QserverReplicaOutOfSync", "queue", "orders")}
        deadline = time.monotonic() + 60
        while True:
            alerts = api(port, "/api/v1/alerts")["alerts"]
            firing = {(a["labels"]["alertname"], key, a["labels"].get(key)) for a in alerts if a["state"] == "firing"
                      for key in ("instance", "queue")}
            if wanted <= firing:
                break
            assert time.monotonic() < deadline, f"not firing after 60 s: {sorted(wanted - firing)}; alerts: {alerts}"
            await asyncio.sleep(0.5)
        fired = [a for a in alerts if a["labels"]["alertname"] == "QserverReplicaOutOfSync"]
        assert fired[0]["labels"]["severity"] == "warning" and "OPERATIONS.md" in fired[0]["annotations"]["description"]
    finally:
        prometheus.send_signal(signal.SIGTERM)
        try:
            prometheus.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait(timeout=10)
        log.close()
