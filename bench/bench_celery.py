"""Celery tasks per second through the cluster (the qcluster:// kombu transport) against Celery on
Redis, in the same run, with the same task, worker and settings (run by hand, not in CI).

    .venv/bin/python bench/bench_celery.py [--tasks 1000] [--pool threads] [--concurrency 4]

Starts a 3-node cluster (qserver/dev/devcluster.py) and Debian's redis-server on free loopback
ports (redis as the peers harness runs it: append-only file, fsync every second; install it with
`apt-get install -y redis-server`), then for each broker one Celery worker process
(`celery -A bench.bench_celery worker`) and this process as the producer. The task is a no-op
that returns None, with its result sent back through the same broker (`rpc://`), so each task is
two messages each way: the task and its result. Two figures per broker:
- publish: `apply_async` from one thread, back to back (each is one durable enqueue here; one
  Redis LPUSH there);
- end to end: from the first publish to the last result received, tasks in flight without limit.
Durability differs and is part of the figure: an enqueue here is fsync'd on both members of the
queue's pair before it is acknowledged (docs/ARCHITECTURE.md, Guarantee 1); Redis acknowledges
from memory and writes its append-only file once a second. Prints a table and appends each run
to bench/results-celery-<date>.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))

from celery import Celery  # noqa: E402


def make_app(broker: str, credentials: str | None = None, *, worker: bool = False) -> Celery:
    app = Celery("bench_celery", broker=broker, backend="rpc://")
    options: dict[str, Any] = {"wait_time_seconds": 1.0}
    if credentials:
        options["credentials"] = credentials
    app.conf.update(broker_transport_options=options if broker.startswith("qcluster") else {},
                    task_serializer="json", result_serializer="json", accept_content=["json"],
                    worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)

    if worker:      # the producer sends by name (one task of one name per process, as Celery wants)
        @app.task(name="bench.noop")
        def noop() -> None:
            return None
    return app


if __name__ != "__main__":
    # The worker's app (`celery -A bench.bench_celery worker`): its broker from the environment.
    app = make_app(os.environ.get("BENCH_CELERY_BROKER", "memory://"), os.environ.get("QSERVER_CREDENTIALS"),
                   worker=True)


def free_port() -> int:
    from qserver.dev.devcluster import free_port as pick
    return pick()


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is missing: apt-get install -y redis-server")
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory), "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec", "--daemonize", "no"],
        stdout=(directory / "redis.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() \
            != "PONG":
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"redis did not start: {(directory / 'redis.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return process, f"redis://127.0.0.1:{port}/0"


def start_worker(broker: str, credentials: str | None, log: Path, pool: str,
                 concurrency: int) -> subprocess.Popen[bytes]:
    environment = {**os.environ, "BENCH_CELERY_BROKER": broker, "PYTHONPATH": str(REPOSITORY)}
    if credentials:
        environment["QSERVER_CREDENTIALS"] = credentials
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.bench_celery", "worker", f"--pool={pool}",
         f"--concurrency={concurrency}", "--loglevel=WARNING", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-n", f"bench-{os.getpid()}@%h"],
        cwd=REPOSITORY, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def measure(name: str, broker: str, credentials: str | None, tasks: int, pool: str, concurrency: int,
            root: Path) -> dict[str, Any]:
    producer = make_app(broker, credentials)

    def noop_delay() -> Any:
        return producer.send_task("bench.noop")
    worker = start_worker(broker, credentials, root / f"worker-{name}.log", pool, concurrency)
    try:
        # Warm up: the worker is up when a task comes back; queues and reply queue exist.
        for result in [noop_delay() for _ in range(20)]:
            result.get(timeout=120)
        started = time.perf_counter()
        published = [noop_delay() for _ in range(tasks)]
        publish_s = time.perf_counter() - started
        for result in published:
            result.get(timeout=300)
        publish_and_run_s = time.perf_counter() - started
        started = time.perf_counter()
        results = [noop_delay() for _ in range(tasks)]
        for result in results:
            result.get(timeout=300)
        end_to_end_s = time.perf_counter() - started
    finally:
        stop(worker)
        producer.close()
    return {"broker": name, "tasks": tasks, "pool": pool, "concurrency": concurrency,
            "publish_per_s": round(tasks / publish_s, 1), "end_to_end_per_s": round(tasks / end_to_end_s, 1),
            "first_round_per_s": round(tasks / publish_and_run_s, 1)}


def main() -> None:
    parse = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parse.add_argument("--tasks", type=int, default=1000)
    parse.add_argument("--pool", default="threads", choices=("threads", "solo", "prefork"))
    parse.add_argument("--concurrency", type=int, default=4)
    parse.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    arguments = parse.parse_args()
    from qserver.dev.devcluster import LocalCluster
    root = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    cluster = LocalCluster(root / "cluster", 3)
    redis, redis_url = start_redis(root / "redis")
    runs = []
    try:
        cluster.start_all()
        credentials = str(cluster.credentials_path)
        qcluster_url = "qcluster://" + ",".join(url.split("://", 1)[1] for url in cluster.urls.values())
        runs.append(measure("qcluster", qcluster_url, credentials, arguments.tasks, arguments.pool,
                            arguments.concurrency, root))
        runs.append(measure("redis", redis_url, None, arguments.tasks, arguments.pool, arguments.concurrency, root))
    finally:
        cluster.kill_all()
        stop(redis)
        if not arguments.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'broker':<10} {'publish/s':>10} {'end-to-end/s':>13}   ({arguments.tasks} no-op tasks with results "
          f"through rpc://, worker --pool={arguments.pool} -c {arguments.concurrency})")
    for run in runs:
        print(f"{run['broker']:<10} {run['publish_per_s']:>10} {run['end_to_end_per_s']:>13}")
    out = REPOSITORY / "bench" / f"results-celery-{datetime.date.today():%Y%m%d}.jsonl"
    with out.open("a") as handle:
        for run in runs:
            handle.write(json.dumps({**run, "at": datetime.datetime.now(datetime.UTC).isoformat()}) + "\n")


if __name__ == "__main__":
    main()
