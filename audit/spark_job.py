"""The PySpark job: the pure checkers, distributed by queue.

Every check is per journal or per queue group, so the job is two passes:

  1. per input split (map only, no shuffle): the runs of consecutive sequence numbers of
     each journal (three narrow columns travel); the driver hands each journal's runs to
     `check_journal_runs`;
  2. per queue group: every record of the group (all members, all incarnations, the
     dead-letter queue, and the group's history entries read from the history file and shaped
     as records), sorted by journal and sequence, to `check_group`.

Both run in Python workers through `mapInArrow` (Arrow batches, no pandas) and return one
JSON result per journal or group; the driver assembles the report with `assemble_report`,
exactly as the pure-Python path does. Groups are spread over partitions; one group is
checked by one worker, so the largest queue's records must fit one worker's memory
(about 1 GB per 2 million records).

`local[*]` by default; `--master spark://host:7077`, `yarn` or `k8s://...` run it on a
cluster unchanged (the audit and replication packages are shipped to the executors as a zip;
executors need Python 3.11+ with msgpack and pyarrow).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from qserver.journal_export import INT_COLUMNS
from replication.audit_checks import (
    DEFAULT_SETTINGS,
    HISTORY_OP,
    RECORD_COLUMNS,
    AuditSettings,
    JournalRecord,
    assemble_report,
    check_group,
    check_journal_runs,
    sequence_runs,
)

Progress = Callable[[str], None]
REPOSITORY = Path(__file__).resolve().parent.parent
HISTORY_SCHEMA = ("queue string, status string, id long, dedupe_id string, payload_crc32 long, at_ms long, "
                  "client string, op string")
LOG4J_PROPERTIES = Path(__file__).resolve().parent / "log4j2.properties"
RUNS_DDL = "node string, journal_id string, runs array<long>"
RUNS_SCHEMA = pa.schema([("node", pa.string()), ("journal_id", pa.string()), ("runs", pa.list_(pa.int64()))])
SPARK_SCHEMA_DDL = ", ".join(f"{name} {'binary' if name == 'extra' else 'bigint' if name in INT_COLUMNS else 'string'}"
                             for name in RECORD_COLUMNS)


def _quiet(_: str) -> None:
    pass


def spark_session(master: str = "local[*]", *, partitions: int | None = None, driver_memory: str = "2g",
                  ui: bool = False, driver_host: str | None = None) -> Any:
    """A SparkSession for the audit; loopback-only when the master is local or on loopback."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master.startswith("local")
    if driver_host is None and (local or "://127." in master or "://localhost" in master):
        driver_host = "127.0.0.1"
    java_options = f"-Dlog4j2.configurationFile=file:{LOG4J_PROPERTIES}"
    builder = (SparkSession.builder.appName("qaudit").master(master)
               .config("spark.ui.enabled", "true" if ui else "false")
               .config("spark.ui.showConsoleProgress", "true")
               .config("spark.driver.memory", driver_memory)
               .config("spark.driver.extraJavaOptions", java_options)
               .config("spark.executor.extraJavaOptions", java_options)
               .config("spark.pyspark.python", sys.executable)
               .config("spark.pyspark.driver.python", sys.executable)
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", "50000")
               .config("spark.sql.session.timeZone", "UTC"))
    if partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(partitions))
    elif local:
        # A few partitions per core, so that queues of uneven size still spread evenly.
        cores = master[6:-1] if master.startswith("local[") else "1"
        count = os.cpu_count() or 2 if cores in ("*", "") else int(cores.split(",")[0])
        builder = builder.config("spark.sql.shuffle.partitions", str(4 * count))
    if driver_host is not None:
        builder = (builder.config("spark.driver.host", driver_host)
                   .config("spark.driver.bindAddress", driver_host))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    if not local:
        session.sparkContext.addPyFile(str(_code_zip()))
        if partitions is None:       # Spark's default of 200 costs more in task overhead than it spreads
            session.conf.set("spark.sql.shuffle.partitions", str(4 * max(2, session.sparkContext.defaultParallelism)))
    return session


def _code_zip() -> Path:
    """The audit and replication packages (pure Python) for executors on other machines."""
    target = Path(tempfile.mkdtemp(prefix="qaudit-")) / "qaudit-code.zip"
    with zipfile.ZipFile(target, "w") as archive:
        for package in ("audit", "replication"):
            for path in sorted((REPOSITORY / package).glob("*.py")):
                archive.write(path, f"{package}/{path.name}")
    return target


# --- partition functions (run in the Python workers) ----------------------------------------
def runs_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """(node, journal_id, sequence) of one input split, in file order -> runs of consecutive
    sequence numbers per journal (a handful per file, as exported files are in order)."""
    runs: dict[tuple[str, str], list[int]] = {}
    current: tuple[str, str] | None = None
    sequences: list[int] = []
    for batch in batches:
        nodes, journals, numbers = (batch.column(name).to_pylist() for name in ("node", "journal_id", "sequence"))
        for node, journal_id, sequence in zip(nodes, journals, numbers, strict=True):
            if (node, journal_id) != current:
                if current is not None:
                    runs.setdefault(current, []).extend(value for run in sequence_runs(sequences) for value in run)
                current, sequences = (node, journal_id), []
            sequences.append(sequence)
    if current is not None:
        runs.setdefault(current, []).extend(value for run in sequence_runs(sequences) for value in run)
    yield pa.RecordBatch.from_pydict({"node": [key[0] for key in runs], "journal_id": [key[1] for key in runs],
                                      "runs": list(runs.values())}, schema=RUNS_SCHEMA)


def group_partition(settings: AuditSettings, starts: dict[tuple[str, str], int | None],
                    batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Batches of records (and history rows) sorted by group -> one JSON result per group."""
    schema = pa.schema([("result", pa.string())])
    current: str | None = None
    records: list[JournalRecord] = []
    for batch in batches:
        groups = batch.column("group").to_pylist()
        columns = [batch.column(name).to_pylist() for name in RECORD_COLUMNS]
        for group, record in zip(groups, map(JournalRecord._make, zip(*columns, strict=True)), strict=True):
            if group != current:
                if current is not None:
                    yield pa.RecordBatch.from_pydict(
                        {"result": [json.dumps(check_group(current, records, settings, starts))]}, schema=schema)
                current, records = group, []
            records.append(record)
    if current is not None:
        yield pa.RecordBatch.from_pydict({"result": [json.dumps(check_group(current, records, settings, starts))]},
                                         schema=schema)


# --- the job ----------------------------------------------------------------------------------
def audit_spark(spark: Any, journals: list[str], history_path: str | None = None,
                settings: AuditSettings = DEFAULT_SETTINGS, progress: Progress = _quiet) -> dict[str, Any]:
    from pyspark.sql import functions as F

    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    progress(f"reading journals from {len(journals)} path(s)")
    records = (spark.read.schema(SPARK_SCHEMA_DDL).option("recursiveFileLookup", "true")
               .option("pathGlobFilter", "*.parquet").parquet(*journals))
    progress("checking journal sequence numbers")
    journal_results = _journal_results(records, settings)
    starts = {(j["node"], j["journal_id"]): j["first_sequence"] for j in journal_results}
    progress(f"{sum(j['records'] for j in journal_results)} records in {len(journal_results)} journals; "
             f"checking queues in {partitions} partitions")
    rows = records
    if history_path:
        rows = rows.unionByName(_history_rows(spark, history_path))
    grouped = (rows.withColumn("group", F.regexp_replace(F.col("queue"), r"\.dlq$", ""))
               .repartition(partitions, "group")
               .sortWithinPartitions("group", "node", "journal_id", "sequence")
               .mapInArrow(functools.partial(group_partition, settings, starts), "result string"))
    group_results = [json.loads(row.result) for row in grouped.collect()]
    progress(f"{len(group_results)} queues checked; assembling the report")
    return assemble_report(journal_results, group_results, settings)


def _journal_results(records: Any, settings: AuditSettings) -> list[dict[str, Any]]:
    """Per journal, `check_journal_runs` over the runs every input split found: a map-only
    pass over three narrow columns, no shuffle."""
    runs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    rows = records.select("node", "journal_id", "sequence").mapInArrow(runs_partition, RUNS_DDL).collect()
    for row in rows:
        flat = row.runs
        runs.setdefault((row.node, row.journal_id), []).extend(zip(flat[0::2], flat[1::2], strict=True))
    return [check_journal_runs(node, journal_id, journal_runs, settings)
            for (node, journal_id), journal_runs in sorted(runs.items())]


def _history_rows(spark: Any, history_path: str) -> Any:
    """History entries shaped as records (audit_checks.history_as_record, in Spark)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, LongType

    entries = (spark.read.schema(HISTORY_SCHEMA).option("mode", "FAILFAST").json(history_path)
               .where(F.col("op").isNull() | (F.col("op") == "enqueue")))
    zero = F.lit(0).cast(LongType())
    return entries.select(
        F.lit("").alias("journal_id"), zero.alias("sequence"), F.coalesce("at_ms", zero).alias("at_ms"),
        F.coalesce("queue", F.lit("")).alias("queue"), zero.alias("queue_id"), zero.alias("epoch"),
        zero.alias("index"), F.lit(HISTORY_OP).alias("op"), F.col("id").alias("message_id"), "dedupe_id",
        zero.alias("priority"), zero.alias("payload_size"),
        F.coalesce("payload_crc32", F.lit(-1).cast(LongType())).alias("payload_crc32"),
        F.col("status").alias("role"), F.lit("").alias("node"), "client",
        F.lit(None).cast(LongType()).alias("record_crc32"), F.lit(None).cast(BinaryType()).alias("extra"))
