"""qaudit end to end: the journals of a real 3-node run (both strengths, priorities, releases,
dead letters, a handoff and a failover with the old master's return) audit clean on both paths;
planted faults are each caught and named; the Spark job, on local[*] and on a real standalone
Spark cluster, gives the pure-Python path's answers on the same data.

One real run and one SparkSession serve the whole module (both are slow to start)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pyarrow.parquet as pq
import pytest

from audit.checks import violations
from audit.checks.group import check_group
from audit.checks.history import HistoryEnqueue
from audit.checks.units import group_of
from audit.cli import main as qaudit_main
from audit.inputs import read_history, read_records
from audit.local import audit_paths, audit_records
from client import AsyncClient, QueueError
from client.credentials import load_credentials
from qserver.dev.devcluster import REPOSITORY, LocalCluster, free_port
from qserver.storage.journal_export import columns_table, export_environment
from replication.journal import RECORD_COLUMNS, JournalRecord
from tests.conftest import fail_on_unexpected_ends
from tests.support import RawApi, raw_session
from tests.test_failover import wait_for

pytest.importorskip("pyspark")
PLACEMENT = {"orders": ["n1", "n2"], "ledger": ["n2", "n3"]}


@dataclass
class RealRun:
    journals: Path                # exported Parquet segments of every node
    history: Path                 # the client-side enqueue outcomes
    records: list[JournalRecord]
    entries: list[HistoryEnqueue]


class History:
    """What the producers saw: one line per enqueue (docs/AUDIT.md, "History file")."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self.count = 0

    async def enqueue(self, client: AsyncClient, queue: str, payloads: list[bytes], priority: int = 4) -> list[int]:
        dedupe_ids = [f"h-{queue}-{self.count + n}" for n in range(len(payloads))]
        self.count += len(payloads)
        try:
            ids = await client.enqueue_many(queue, payloads, priority, dedupe_ids=dedupe_ids)
        except QueueError as error:
            status = "unknown" if error.outcome_unknown else "fail"
            self.lines += [{"queue": queue, "status": status, "dedupe_id": d} for d in dedupe_ids]
            raise
        self.lines += [{"queue": queue, "status": "ok", "id": i, "dedupe_id": d, "payload_crc32": zlib.crc32(p)}
                       for i, d, p in zip(ids, dedupe_ids, payloads, strict=True)]
        return ids

    async def enqueue_raw(self, api: RawApi, queue: str, payload: bytes) -> int:
        """One enqueue through signed HTTP (no client-side routing), recorded like the others."""
        dedupe_id = f"h-{queue}-{self.count}"
        self.count += 1
        status, body, _ = await api.request("POST", f"/v1/queues/{queue}/messages", payload,
                                            headers={"X-Dedupe-Id": dedupe_id})
        if status != 201:
            unknown = isinstance(body, dict) and body.get("error", {}).get("outcome_unknown", False)
            self.lines.append({"queue": queue, "status": "unknown" if unknown else "fail", "dedupe_id": dedupe_id})
            raise QueueError(body["error"]["code"] if isinstance(body, dict) else "E_INTERNAL", str(body))
        self.lines.append({"queue": queue, "status": "ok", "id": body["id"], "dedupe_id": dedupe_id,
                           "payload_crc32": zlib.crc32(payload)})
        return int(body["id"])


async def _until(step: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await step()
        except QueueError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def _scenario(cluster: LocalCluster, history: History) -> None:
    signer = load_credentials(cluster.credentials_path).signer()
    async with raw_session() as session, AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        api = {node: RawApi(session, url, signer) for node, url in cluster.urls.items()}
        await client.create_queue("orders", strength="producer")
        await client.create_queue("ledger", strength="full", max_deliveries=2)
        # Both replicas follow from the start: one that joins late (its node applies the map
        # after the master has run alone) takes a snapshot and journals no release or ack
        # from before it, which the per-journal assertions below count on.
        for queue, (master, _) in PLACEMENT.items():
            await _replica_caught_up(api[master], queue)
        await history.enqueue(client, "orders", [f"o{i}".encode() for i in range(40)], priority=3)
        await history.enqueue(client, "orders", [f"urgent{i}".encode() for i in range(5)], priority=8)
        await history.enqueue(client, "ledger", [f"l{i}".encode() for i in range(40)], priority=6)
        taken = await client.receive("ledger", max_messages=10, wait_s=2)
        for message in taken[:7]:
            await message.ack()
        for message in taken[7:]:
            await message.release()
        [poison] = await client.receive("ledger", max_messages=1, wait_s=2)
        await poison.release()                    # its second delivery: dead-lettered
        for _ in range(50):             # a handoff may be refused while the replica catches up: ask again
            status, answer, _ = await api["n2"].request("POST", "/v1/queues/ledger/handoff", {"initiator": "master"})
            if status == 200:
                break
            await asyncio.sleep(0.2)
        assert status == 200 and answer["master"] == "n3", answer
        await history.enqueue(client, "ledger", [f"after-handoff{i}".encode() for i in range(10)])
        for message in await client.receive("ledger", max_messages=5, wait_s=2):
            await message.ack()
        [dead] = await _until(lambda: client.receive("ledger.dlq", max_messages=5, wait_s=1))
        await dead.ack()
        await asyncio.to_thread(cluster.kill, "n1")         # master of orders: n2 is promoted
        await _until(lambda: history.enqueue_raw(api["n2"], "orders", b"after-failover"))
    async with AsyncClient(cluster.urls["n2"], cluster.credentials_path) as promoted:
        for message in await promoted.receive("orders", max_messages=20, wait_s=2):
            await message.ack()
        await asyncio.to_thread(cluster.start, "n1")        # the old master returns as replica
        await history.enqueue(promoted, "orders", [f"after-return{i}".encode() for i in range(5)])
        await _converged(promoted, "orders")


async def _replica_caught_up(master: RawApi, queue: str) -> None:
    """The master holds its replica in sync and caught up with the stream (after the
    snapshot a new member of a queue with a dead-letter queue starts from)."""
    async def caught_up() -> bool:
        status, stats, _ = await master.request("GET", f"/v1/queues/{queue}")
        return status == 200 and stats.get("replication_state") == "in_sync" \
            and stats.get("replica_progress") == "caught_up"
    await wait_for(caught_up, 30, f"{queue}: the replica to catch up")


async def _converged(client: AsyncClient, queue: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await client.queue_stats(queue)
        if stats.get("replication_state") == "in_sync" and stats.get("last_order") == stats.get("commit_order"):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{queue} did not converge: {stats}")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRun]:
    root = tmp_path_factory.mktemp("audit-cluster")
    cluster = LocalCluster(root / "cluster", 3, PLACEMENT)
    history = History()
    try:
        cluster.start_all()
        asyncio.run(_scenario(cluster, history))
    finally:
        cluster.kill_all()
    fail_on_unexpected_ends(cluster.problems())
    journals = root / "journals"
    for node in cluster.ids:
        export_environment(root / "cluster" / node / "lmdb", str(journals))
    history_path = root / "history.jsonl"
    history_path.write_text("".join(json.dumps(line) + "\n" for line in history.lines))
    yield RealRun(journals, history_path, read_records([str(journals)]), read_history(history_path))


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from audit.spark_job import spark_session, stop_session
    session = spark_session("local[2]")
    yield session
    stop_session(session)
    assert session.sparkContext._jsc is None          # the JVM side is stopped


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """A report as JSON, without how and when it was made."""
    return {key: value for key, value in json.loads(json.dumps(report)).items() if key != "inputs"}


def test_journals_of_a_real_cluster_with_a_handoff_and_a_failover_audit_clean(real_run: RealRun) -> None:
    report = audit_paths([str(real_run.journals)], str(real_run.history))
    assert report["verdict"] == "clean", json.dumps(report["violations"][:5], indent=1)
    assert report["totals"]["journals"] == 3 and report["totals"]["violations"] == 0
    total = report["total_queue"]
    assert total["lost"] == total["unexpected"] == total["duplicated"] == 0
    assert report["history"]["ok"] == 101                             # 45 + 40 + 10 + 1 + 5
    finals = {(q["queue"], q.get("final_master")): q["counts"] for i in report["incarnations"] for q in i["queues"]}
    assert total["enqueued"] == 101 + report["history"]["recovered"], json.dumps(
        {"finals": {f"{queue}@{master}": counts for (queue, master), counts in finals.items()},
         "epochs": {i["queue"]: i["epochs"] for i in report["incarnations"]}}, default=str)[:4000]
    assert total["dead_lettered"] == 1
    reasons = {incarnation["queue"]: [e["reason"] for e in incarnation["epochs"]]
               for incarnation in report["incarnations"]}
    assert "handoff" in reasons["ledger"] and "failover" in reasons["orders"], reasons
    ledger = next(q for i in report["incarnations"] for q in i["queues"] if q["queue"] == "ledger")
    assert ledger["strength"] == "full" and ledger["final_master"] == "n3"
    assert ledger["counts"]["redelivered_release"] >= 3


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str                             # the violation the audit must name
    plant: Callable[[list[JournalRecord], list[HistoryEnqueue]], tuple[list[JournalRecord], list[HistoryEnqueue]]]


def _checksummed(record: JournalRecord) -> JournalRecord:
    """A record as a node would have written it (a valid checksum for what it says)."""
    body = msgpack.packb(list(record[2:16]), use_bin_type=True)
    return record._replace(record_crc32=zlib.crc32(body))


def _replica_ledger(records: list[JournalRecord], op: str = "enqueue") -> list[JournalRecord]:
    return [r for r in records if r.queue == "ledger" and r.role == "replica" and r.op == op and r.index > 1]


def _drop_record(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    victim = _replica_ledger(records)[5]
    return [r for r in records if r is not victim], history


def _reorder_pair(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    first, second = _replica_ledger(records)[10:12]       # consecutive: applied the other way round
    swapped = {id(first): first._replace(sequence=second.sequence), id(second): second._replace(sequence=first.sequence)}
    return [swapped.get(id(r), r) for r in records], history


def _second_master(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    victim = _replica_ledger(records)[3]
    return [_checksummed(r._replace(role="master")) if r is victim else r for r in records], history


def _payload_mismatch(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    victim = _replica_ledger(records)[7]
    return [_checksummed(r._replace(payload_crc32=r.payload_crc32 ^ 1)) if r is victim else r for r in records], history


def _acknowledged_missing(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    gone = next(h for h in history if h.queue == "orders" and h.status == "ok")
    return [r for r in records if not (r.queue == "orders" and r.dedupe_id == gone.dedupe_id)], history


def _corrupt_record(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    victim = _replica_ledger(records)[2]
    return [r._replace(at_ms=r.at_ms + 1) if r is victim else r for r in records], history


def _acked_twice(records: list[JournalRecord], history: list[HistoryEnqueue]) -> tuple[list[JournalRecord], list[HistoryEnqueue]]:
    ack = next(r for r in records if r.queue == "orders" and r.op == "ack" and r.role == "master")
    last = max(r.sequence for r in records if (r.node, r.journal_id) == (ack.node, ack.journal_id))
    return [*records, _checksummed(ack._replace(sequence=last + 1))], history


FAULTS = [Fault("dropped record", violations.INDEX_GAP, _drop_record),
          Fault("reordered pair", violations.INDEX_OUT_OF_ORDER, _reorder_pair),
          Fault("second master in one epoch", violations.TWO_MASTERS, _second_master),
          Fault("payload checksum mismatch", violations.PAYLOAD_MISMATCH, _payload_mismatch),
          Fault("acknowledged enqueue missing", violations.ACKNOWLEDGED_MISSING, _acknowledged_missing),
          Fault("record checksum broken", violations.RECORD_CHECKSUM, _corrupt_record),
          Fault("message acknowledged twice", violations.DUPLICATED, _acked_twice)]


@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
def test_each_planted_fault_is_caught_and_named(real_run: RealRun, fault: Fault) -> None:
    records, history = fault.plant(list(real_run.records), list(real_run.entries))
    report = audit_records(records, history)
    assert report["verdict"] == "violations"
    assert fault.kind in report["violation_counts"], report["violation_counts"]
    named = [v for v in report["violations"] if v["kind"] == fault.kind]
    assert named and all(v["detail"] for v in named)


def test_a_dropped_record_also_shows_as_a_gap_in_its_journals_sequence_numbers(real_run: RealRun) -> None:
    records, history = _drop_record(list(real_run.records), list(real_run.entries))
    report = audit_records(records, history)
    assert report["violation_counts"].get(violations.SEQUENCE_GAP) == 1


def _write_journals(records: list[JournalRecord], directory: Path, *, statistics: bool = True) -> None:
    """Records as exported Parquet files, one per node, as the exporter writes them (with
    the column statistics in their footers, unless told otherwise)."""
    for node in sorted({r.node for r in records}):
        rows = sorted((r for r in records if r.node == node), key=lambda r: r.sequence)
        (directory / node).mkdir(parents=True)
        columns = {name: [r[position] for r in rows] for position, name in enumerate(RECORD_COLUMNS)}
        pq.write_table(columns_table(columns), directory / node / f"journal-{node}.parquet",
                       write_statistics=statistics)


def _write_history(entries: list[HistoryEnqueue], path: Path) -> None:
    path.write_text("".join(json.dumps({"queue": e.queue, "status": e.status, "id": e.message_id,
                                        "dedupe_id": e.dedupe_id, "payload_crc32": e.payload_crc32}) + "\n"
                            for e in entries))


def test_spark_gives_the_pure_paths_answers_on_the_real_journals(real_run: RealRun, spark: Any) -> None:
    from audit.spark_job import audit_spark
    expected = audit_paths([str(real_run.journals)], str(real_run.history))
    assert comparable(audit_spark(spark, [str(real_run.journals)], str(real_run.history))) == comparable(expected)


def test_spark_names_every_planted_fault_as_the_pure_path_does(real_run: RealRun, spark: Any, tmp_path: Path) -> None:
    from audit.spark_job import audit_spark
    records, history = list(real_run.records), list(real_run.entries)
    for fault in FAULTS:
        records, history = fault.plant(records, history)
    _write_journals(records, tmp_path / "journals")
    _write_history(history, tmp_path / "history.jsonl")
    expected = audit_paths([str(tmp_path / "journals")], str(tmp_path / "history.jsonl"))
    found = audit_spark(spark, [str(tmp_path / "journals")], str(tmp_path / "history.jsonl"))
    assert comparable(found) == comparable(expected)
    assert {fault.kind for fault in FAULTS} <= set(found["violation_counts"])


def test_journal_starts_come_from_the_footers_and_from_spark_when_the_files_cannot_say(
        real_run: RealRun, spark: Any, tmp_path: Path) -> None:
    from audit.spark_job import audit_spark, footer_starts
    lowest: dict[tuple[str, str], int] = {}
    for record in real_run.records:
        key = (record.node, record.journal_id)
        lowest[key] = min(record.sequence, lowest.get(key, record.sequence))
    assert footer_starts([str(real_run.journals)]) == lowest
    _write_journals(list(real_run.records), tmp_path, statistics=False)
    assert footer_starts([str(tmp_path)]) is None
    expected = audit_paths([str(real_run.journals)], str(real_run.history))
    assert comparable(audit_spark(spark, [str(tmp_path)], str(real_run.history))) == comparable(expected)


def test_a_partition_gives_check_groups_answers_and_leaves_the_collector_on(real_run: RealRun) -> None:
    import gc

    import pyarrow as pa

    from audit.spark_job import group_partition
    records = list(real_run.records)
    table = pa.table({name: [getattr(r, name) for r in records] for name in RECORD_COLUMNS})
    starts = {(r.node, r.journal_id): 1 for r in records}
    results = [(batch.column("kind")[0].as_py(), json.loads(batch.column("result")[0].as_py()))
               for batch in group_partition(violations.DEFAULT_SETTINGS, starts, iter(table.to_batches(max_chunksize=97)))]
    assert gc.isenabled()
    by_group: dict[str, list[JournalRecord]] = {}
    for record in records:
        by_group.setdefault(group_of(record.queue), []).append(record)
    expected = [json.loads(json.dumps(check_group(group, by_group[group], violations.DEFAULT_SETTINGS, starts)))
                for group in sorted(by_group)]
    assert [result for kind, result in results if kind == "group"] == expected
    assert [kind for kind, _ in results] == ["group"] * len(by_group) + ["runs"]


def test_the_workers_daemon_takes_pyspark_from_the_installed_package(tmp_path: Path) -> None:
    from audit.spark_daemon import prefer_installed_pyspark
    package = tmp_path / "site-packages" / "pyspark"
    (package / "python" / "lib").mkdir(parents=True)
    for name in ("__init__.py", "daemon.py"):
        (package / name).write_text("")
    installed = str(package / "python" / "lib" / "pyspark.zip")
    elsewhere = str(tmp_path / "spark-home" / "python" / "lib" / "pyspark.zip")   # not a pip package: kept
    py4j = str(package / "python" / "lib" / "py4j-0.10.9.9-src.zip")
    assert prefer_installed_pyspark(["", installed, py4j, "/usr/lib/python3.11"]) == [
        "", str(tmp_path / "site-packages"), py4j, "/usr/lib/python3.11"]
    assert prefer_installed_pyspark([elsewhere, py4j]) == [elsewhere, py4j]


def test_qaudit_writes_the_report_and_page_and_exits_non_zero_on_a_violation(real_run: RealRun, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    clean = qaudit_main(["--journals", str(real_run.journals), "--history", str(real_run.history), "--engine", "python",
                         "--out", str(tmp_path / "clean"), "--quiet"])
    assert clean == 0 and "verdict: CLEAN" in capsys.readouterr().out
    page = (tmp_path / "clean" / "report.html").read_text()
    assert "CLEAN" in page and "<svg" in page and "handoff" in page and "failover" in page
    records, history = _payload_mismatch(list(real_run.records), list(real_run.entries))
    _write_journals(records, tmp_path / "faulty")
    failed = qaudit_main(["--journals", str(tmp_path / "faulty"), "--engine", "python", "--out", str(tmp_path / "bad"),
                         "--quiet"])
    assert failed == 1
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert report["violation_counts"] == {violations.PAYLOAD_MISMATCH: 1}
    assert violations.PAYLOAD_MISMATCH in (tmp_path / "bad" / "report.html").read_text()


# --- a real standalone Spark cluster ------------------------------------------------------------
class StandaloneSpark:
    """A Spark master and one worker on 127.0.0.1, started through pyspark's bin/spark-class
    (the pip package has no sbin scripts)."""

    def __init__(self, work: Path) -> None:
        import pyspark
        self.home = Path(pyspark.__file__).resolve().parent
        self.work = work
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        # The daemons and the launcher JVM that spark-class runs first start on C1 alone (about
        # 20 s to an alive worker becomes 6-10 s here; audit/spark_job.py gives the job's own JVMs
        # the same flag). The job itself runs as a user would run it.
        daemon_java_options = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
        self.env = {**os.environ, "SPARK_HOME": str(self.home), "SPARK_LOCAL_IP": "127.0.0.1",
                    "SPARK_LOG_DIR": str(work), "PYSPARK_PYTHON": sys.executable,
                    "SPARK_DAEMON_JAVA_OPTS": daemon_java_options, "SPARK_LAUNCHER_OPTS": daemon_java_options}
        self.processes: list[subprocess.Popen[bytes]] = []

    def _start(self, name: str, *arguments: str) -> None:
        log = open(self.work / f"{name}.log", "wb")   # noqa: SIM115 - closed with the process
        self.processes.append(subprocess.Popen([str(self.home / "bin" / "spark-class"), *arguments], stdout=log,
                                               stderr=subprocess.STDOUT, env=self.env, cwd=self.work))
        log.close()

    def start(self, timeout_s: float = 60.0) -> None:
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        self._start("worker", "org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1",
                    "--cores", "2", "--memory", "1g", "--webui-port", str(free_port()),
                    "--work-dir", str(self.work / "work"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as answer:
                    if json.load(answer).get("aliveworkers", 0) >= 1:
                        return
            except OSError:
                pass
            if any(process.poll() is not None for process in self.processes):
                break
            time.sleep(0.5)
        raise RuntimeError("the standalone Spark cluster did not come up: "
                           + (self.work / "master.log").read_text()[-2000:] + (self.work / "worker.log").read_text()[-2000:])

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)


def test_the_same_job_runs_on_a_standalone_spark_cluster(real_run: RealRun, tmp_path: Path) -> None:
    cluster = StandaloneSpark(tmp_path)
    try:
        cluster.start()
        out = tmp_path / "report"
        answer = subprocess.run([sys.executable, "-m", "audit.cli", "--journals", str(real_run.journals),
                                 "--history", str(real_run.history), "--master", cluster.url, "--out", str(out)],
                                cwd=REPOSITORY, capture_output=True, text=True, timeout=240)
    finally:
        cluster.stop()
    assert answer.returncode == 0, answer.stdout + answer.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["inputs"]["master"] == cluster.url
    assert comparable(report) == comparable(audit_paths([str(real_run.journals)], str(real_run.history)))
    assert "queues checked" in answer.stderr          # progress while it ran
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
