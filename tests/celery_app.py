"""The Celery app of tests/test_celery.py (and of its worker process, `celery -A tests.celery_app`).

Broker and results both go through the cluster: `qcluster://` for tasks and `rpc://` for
results, which Celery sends as messages through the broker's transport to a reply queue per
producer. The worker reads its settings from the environment the test gives it:
QCLUSTER_BROKER_URL, QSERVER_CREDENTIALS (the usual credentials lookup, client/credentials.py),
QCLUSTER_VISIBILITY_S and QCLUSTER_RECORD, a file each task appends a line to when it runs,
so the test counts runs without trusting the results path it also tests.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

app = Celery("qcluster_tests", broker=os.environ.get("QCLUSTER_BROKER_URL", "qcluster://"), backend="rpc://")
app.conf.update(
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("QCLUSTER_VISIBILITY_S", "30")),
        "wait_time_seconds": 1.0,
        "queue_name_prefix": os.environ.get("QCLUSTER_QUEUE_PREFIX", ""),
    },
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=2,
    # Celery 6's default: a lost connection cancels acks_late tasks under way (they are
    # delivered again), rather than running on with acks that cannot reach the broker.
    worker_cancel_long_running_tasks_on_connection_loss=True,
)


def record(line: str) -> None:
    """One line per run, appended and flushed before the task returns (O_APPEND: whole lines)."""
    path = os.environ.get("QCLUSTER_RECORD")
    if path:
        with Path(path).open("a") as handle:
            handle.write(line + "\n")


@app.task
def add(x: int, y: int) -> int:
    record(f"add {x} {y}")
    return x + y


@app.task(bind=True, max_retries=5)
def flaky(self: Any, key: str) -> int:
    """Raises self.retry twice, then succeeds: three runs, one result."""
    record(f"flaky {key} {self.request.retries}")
    if self.request.retries < 2:
        raise self.retry(countdown=0.2)
    return int(self.request.retries)


@app.task(acks_late=True)
def long_task(key: str, seconds: float) -> str:
    """Acked only when it ends (acks_late): its lease must outlive the visibility timeout."""
    record(f"long-start {key}")
    time.sleep(seconds)
    record(f"long-end {key}")
    return key


@app.task(ignore_result=True)
def numbered(run: str, n: int, seconds: float = 0.0) -> None:
    record(f"numbered {run} {n}")
    if seconds:
        time.sleep(seconds)
