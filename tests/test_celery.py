"""Celery on the cluster through the kombu transport (client/kombu_transport.py, docs/CELERY.md).

One real 3-node cluster and one real Celery worker process (`celery -A tests.celery_app worker
--pool=solo`) for the whole file; this process is the producer, with results through the cluster
(`rpc://`). In order: results, priorities through kombu itself, retries, a task that outlives
its visibility timeout, the `qcluster://` scheme in a fresh interpreter, and last (it kills a
node) the master of the task queue killed with kill -9 while ~200 tasks run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from client import Client
from client.credentials import Credentials, save_credentials
from client.kombu_link import LINK_THREAD_NAME, ClusterChannelError, node_urls
from client.kombu_transport import Transport
from qserver.dev.devcluster import REPOSITORY, LocalCluster, free_port
from tests.conftest import fail_on_unexpected_ends

VISIBILITY_S = 3.0         # the worker's leases: the long task (8 s) must be kept alive past it
WORKER_READY_S = 60.0


@dataclass
class Worker:
    cluster: LocalCluster
    broker_url: str
    record: Path
    log: Path
    process: subprocess.Popen[bytes]

    def lines(self) -> list[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []

    def wait_lines(self, predicate, timeout_s: float, what: str) -> list[str]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.lines()
            if predicate(lines):
                return lines
            if self.process.poll() is not None:
                raise AssertionError(f"the worker exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; worker log:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.05)


def broker_url(cluster: LocalCluster) -> str:
    return "qcluster://" + ",".join(url.split("://", 1)[1] for url in cluster.urls.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("celery") / "cluster", 3)
    local.start_all()
    try:
        yield local
    finally:
        local.kill_all()
    fail_on_unexpected_ends(local.problems())


@pytest.fixture(scope="module")
def worker(cluster: LocalCluster) -> Iterator[Worker]:
    root = cluster.root
    record, log = root / "runs.txt", root / "worker.log"
    url = broker_url(cluster)
    environment = {**os.environ, "QCLUSTER_BROKER_URL": url, "QSERVER_CREDENTIALS": str(cluster.credentials_path),
                   "QCLUSTER_RECORD": str(record), "QCLUSTER_VISIBILITY_S": str(VISIBILITY_S),
                   "PYTHONPATH": str(REPOSITORY)}
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "--pool=solo", "--loglevel=INFO",
             "--hostname", "qcluster-test@%h"],
            cwd=REPOSITORY, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    running = Worker(cluster, url, record, log, process)
    try:
        deadline = time.monotonic() + WORKER_READY_S
        while b" ready." not in log.read_bytes():
            assert process.poll() is None, f"the worker exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the worker did not start:\n{log.read_text()[-4000:]}"
            time.sleep(0.1)
        # This process is the producer: the same app, its broker the cluster, its credentials
        # given as a transport option (the worker finds its own through QSERVER_CREDENTIALS).
        from tests.celery_app import app
        app.conf.broker_url = url
        app.conf.broker_transport_options = {"credentials": str(cluster.credentials_path), "wait_time_seconds": 1.0,
                                             "visibility_timeout": 30.0}
        yield running
    finally:
        with_group_stopped(process)
        from tests.celery_app import app as producer_app
        close_app(producer_app)
        # Every connection this process opened is closed: a link left open keeps its loop
        # thread reconnecting to a cluster that is gone (and, in the suite, drew on the global
        # random module while later tests' hypothesis strategies ran).
        lingering = [thread.name for thread in threading.enumerate() if thread.name == LINK_THREAD_NAME]
        assert not lingering, f"{len(lingering)} kombu links of this process were never closed"
    problems = [line for line in log.read_text().splitlines() if "Traceback" in line or "CRITICAL" in line]
    assert not problems, log.read_text()[-6000:]


def close_app(app: Any) -> None:
    """Close what a Celery app of this process holds open: Celery's own `close()` only drops
    its producer pool, which leaves the pool's connections and the `rpc://` backend's consumer
    connection (each a client-library link on a loop thread of its own) open."""
    if app.conf.result_backend and app.conf.result_backend.startswith("rpc"):
        consumer = app.backend.result_consumer
        if consumer._connection is not None:       # started: it waited for a result
            consumer.stop()
    app.pool.force_close_all()
    app.close()


def with_group_stopped(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker (a warm shutdown), then SIGKILL its group if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.mark.timeout(60)
def test_results_come_back_through_the_cluster(worker: Worker) -> None:
    from tests.celery_app import add
    assert add.delay(2, 3).get(timeout=30) == 5
    results = [add.delay(n, n) for n in range(20)]
    assert [result.get(timeout=30) for result in results] == [2 * n for n in range(20)]
    assert sum(line.startswith("add ") for line in worker.lines()) == 21
    with Client(worker.cluster.urls["n3"], worker.cluster.credentials_path) as client:
        queues = {entry["name"]: entry for entry in client.list_queues()}
    assert "celery" in queues                                  # made by the first declare
    replies = [name for name in queues if len(name) == 36 and name.count("-") == 4]
    assert replies, f"no rpc reply queue among {sorted(queues)}"     # Celery's app.thread_oid, a uuid


@pytest.mark.timeout(60)
def test_priorities_sizes_and_purge_through_kombu(worker: Worker) -> None:
    """kombu alone (no worker on this queue): 9 is the highest priority, as ours and AMQP's;
    the queue is the cluster's `kombu.prio-test` (the queue_name_prefix option)."""
    from kombu import Connection, Producer, Queue
    queue = Queue("prio-test", routing_key="prio-test")
    options = {"credentials": str(worker.cluster.credentials_path), "queue_name_prefix": "kombu."}
    with Connection(worker.broker_url, transport_options=options) as connection:
        channel = connection.channel()
        bound = queue(channel)
        bound.declare()
        producer = Producer(channel)
        for priority in (0, 9, 5, 9):
            producer.publish({"priority": priority}, routing_key="prio-test", priority=priority, declare=[queue])
        assert channel._size("prio-test") == 4
        with Client(worker.cluster.urls["n3"], worker.cluster.credentials_path) as client:
            assert client.queue_stats("kombu.prio-test")["ready"] == 4
        got = []
        for _ in range(3):
            message = bound.get(no_ack=False)
            got.append(message.payload["priority"])
            message.ack()
        assert got == [9, 9, 5]
        message = bound.get(no_ack=False)
        assert message.payload == {"priority": 0} and not message.delivery_info["redelivered"]
        message.requeue()                                      # released: ready again at once
        again = bound.get(no_ack=False)
        assert again.payload == {"priority": 0} and again.delivery_info["redelivered"]
        again.reject()                                         # without requeue: gone
        producer.publish({"left": 1}, routing_key="prio-test")
        assert bound.purge() == 1 and bound.get() is None
        bound.delete()
    with Client(worker.cluster.urls["n3"], worker.cluster.credentials_path) as client:
        assert "kombu.prio-test" not in {entry["name"] for entry in client.list_queues()}


@pytest.mark.timeout(60)
def test_a_task_that_retries_twice_then_succeeds(worker: Worker) -> None:
    from tests.celery_app import flaky
    assert flaky.delay("r1").get(timeout=30) == 2
    assert [line for line in worker.lines() if line.startswith("flaky r1 ")] == \
        ["flaky r1 0", "flaky r1 1", "flaky r1 2"]


@pytest.mark.timeout(60)
def test_a_task_outliving_the_visibility_timeout_runs_once(worker: Worker) -> None:
    """acks_late, 8 s against leases of 3 s: the transport keeps the lease alive, so no other
    delivery of the message starts while it runs, or after it acked."""
    from tests.celery_app import long_task
    assert long_task.delay("L1", 8.0).get(timeout=40) == "L1"
    time.sleep(VISIBILITY_S + 1)              # a lease left to run out would come back by now
    lines = worker.lines()
    assert lines.count("long-start L1") == 1 and lines.count("long-end L1") == 1, lines


@pytest.mark.timeout(60)
def test_qcluster_urls_work_in_a_fresh_interpreter(worker: Worker, tmp_path: Path) -> None:
    """The installed package alone makes `qcluster://` known to kombu: nothing of ours and no
    kombu is imported before `Celery(broker=...)`, and the first node of the URL that answers
    is used (the first one named here is a port nobody listens on)."""
    dead = f"127.0.0.1:{free_port()}"
    alive = worker.cluster.urls["n2"].split("://", 1)[1]
    script = (
        "import sys\n"
        "assert not {'client', 'kombu', 'celery'} & set(sys.modules), sorted(sys.modules)\n"
        "from celery import Celery\n"
        f"app = Celery(broker='qcluster://{dead},{alive}')\n"
        "with app.connection_for_write() as connection:\n"
        "    connection.connect()\n"
        "    print(type(connection.transport).__module__, connection.transport.link.url)\n")
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    environment["QSERVER_CREDENTIALS"] = str(worker.cluster.credentials_path)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, (
        f"{done.stderr}\n(is the package installed? `pip install -e .` puts qcluster-kombu.pth in site-packages)")
    assert done.stdout.split() == ["client.kombu_transport", f"http://{alive}"]


UUID_PATTERN = "????????-????-????-????-????????????"     # Celery's rpc:// reply queues (docs/CELERY.md, "Grants")


def limited_client(cluster: LocalCluster, name: str, grants: list[dict[str, object]], path: Path) -> Path:
    with Client(cluster.urls["n3"], cluster.credentials_path) as client:
        answer = client.register_client(name, grants)
    save_credentials(path, Credentials(answer["id"], answer["private_key"], cluster.urls["n2"]))
    return path


@pytest.mark.timeout(60)
def test_a_producer_needs_only_the_grants_docs_celery_names(worker: Worker, tmp_path: Path) -> None:
    """`post` on the task queue (made already: no admin needed there) and admin,get,delete on
    its reply queues; without those a publish says which grant is missing."""
    from celery import Celery
    producer = limited_client(worker.cluster, "celery-producer", [
        {"pattern": "celery", "privileges": ["post"]},
        {"pattern": UUID_PATTERN, "privileges": ["admin", "get", "delete"]}], tmp_path / "producer.json")
    app = Celery("limited", broker=worker.broker_url, backend="rpc://")
    app.conf.broker_transport_options = {"credentials": str(producer), "wait_time_seconds": 1.0}
    try:
        assert app.send_task("tests.celery_app.add", (20, 22)).get(timeout=30) == 42
    finally:
        close_app(app)
    bare = limited_client(worker.cluster, "celery-bare", [{"pattern": "celery", "privileges": ["post"]}],
                          tmp_path / "bare.json")
    app = Celery("bare", broker=worker.broker_url, backend="rpc://")
    app.conf.broker_transport_options = {"credentials": str(bare)}
    app.conf.broker_connection_max_retries = 0
    try:
        with pytest.raises(ClusterChannelError) as refused:
            app.send_task("tests.celery_app.add", (1, 1))
        assert refused.value.code == "E_FORBIDDEN" and "grant admin" in str(refused.value)
    finally:
        close_app(app)


def test_broker_urls_name_the_nodes() -> None:
    assert node_urls("qcluster://a:1,b:2,c") == ["http://a:1", "http://b:2", "http://c:7100"]
    assert node_urls("qcluster://a:1/vhost?x=1", tls=True) == ["https://a:1"]
    assert node_urls("qcluster://user:secret@a:1,https://b:9") == ["http://a:1", "https://b:9"]
    assert node_urls("qcluster://") == [] and node_urls(None) == []
    assert Transport.as_uri(None, "qcluster://u:secret@a:1,b:2") == "qcluster://a:1,b:2"  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_killing_the_master_of_the_task_queue_mid_run_loses_no_task(worker: Worker) -> None:
    from tests.celery_app import numbered
    cluster = worker.cluster
    with Client(cluster.urls["n1"], cluster.credentials_path) as client:
        master = client.cluster()["queues"]["celery"]["master"]
    count = 200
    for n in range(count):
        numbered.apply_async(("kill", n, 0.03))
    worker.wait_lines(lambda lines: sum(line.startswith("numbered kill ") for line in lines) >= 40, 60,
                      "40 tasks to run")
    cluster.kill(master)
    ran_before_the_kill = sum(line.startswith("numbered kill ") for line in worker.lines())
    assert ran_before_the_kill < count - 20, "the kill came too late to be mid-run"
    lines = worker.wait_lines(
        lambda lines: {line for line in lines if line.startswith("numbered kill ")} >=
        {f"numbered kill {n}" for n in range(count)}, 90, "every task to run after the kill")
    runs = Counter(int(line.split()[2]) for line in lines if line.startswith("numbered kill "))
    assert set(runs) == set(range(count))
    # At least once: a task whose lease the killed master held may run twice, no more than
    # what the worker had taken ahead of the kill (its prefetch) plus the one running.
    assert sum(runs.values()) - count <= 8, runs
    print(f"killed {master} after {ran_before_the_kill} of {count} tasks; {sum(runs.values()) - count} ran twice")
