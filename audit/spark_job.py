"""The PySpark job: the pure checkers, distributed by queue.

Every check is per journal or per queue group:

  1. each journal's start (its lowest sequence number) comes from the Parquet footers'
     statistics, or, where the files cannot say, from a native aggregate;
  2. one shuffle brings every record of a queue group together (all members, all
     incarnations, the dead-letter queue, and the group's history entries, read from the
     history file and shaped as records) into a Python worker (`mapInArrow`: Arrow batches,
     no pandas) that groups them and calls `check_group` per group, and reports the runs of
     consecutive sequence numbers it saw per journal;
  3. the driver merges each journal's runs with `check_journal_runs` (exact: every record
     passed through one partition) and assembles the report with `assemble_report`, exactly
     as the pure-Python path does.

Groups are spread over partitions; one group is checked by one worker, so the largest queue's
records must fit one worker's memory (about 1 GB per 2 million records).

`local[*]` by default; `--master spark://host:7077`, `yarn` or `k8s://...` run it on a
cluster unchanged (the audit, replication and wire packages are shipped to the executors as a zip;
executors need Python 3.11+ with msgpack and pyarrow).
"""
from __future__ import annotations

import functools
import gc
import importlib
import json
import os
import struct
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from audit.checks.group import check_group
from audit.checks.history import HISTORY_OP
from audit.checks.journals import check_journal_runs, sequence_runs
from audit.checks.report import assemble_report
from audit.checks.units import group_of
from audit.checks.violations import DEFAULT_SETTINGS, AuditSettings
from qserver.storage.journal_export import INT_COLUMNS
from replication.journal import RECORD_COLUMNS, JournalRecord
from replication.options import DEAD_LETTER_SUFFIX

Progress = Callable[[str], None]
REPOSITORY = Path(__file__).resolve().parent.parent
HISTORY_SCHEMA = ("queue string, status string, id long, dedupe_id string, payload_crc32 long, at_ms long, "
                  "client string, op string")
LOG4J_PROPERTIES = Path(__file__).resolve().parent / "log4j2.properties"
RESULT_DDL = "kind string, result string"
RESULT_SCHEMA = pa.schema([("kind", pa.string()), ("result", pa.string())])
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
    # The audit's JVM work is short: the C1 compiler alone warms up sooner (measured about a
    # quarter faster end to end on 1M records, local[2]), and the parallel collector suits a batch job.
    java_options = f"-Dlog4j2.configurationFile=file:{LOG4J_PROPERTIES} -XX:TieredStopAtLevel=1 -XX:+UseParallelGC"
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
    if local:
        # The workers' daemon imports pyspark from the installed package (cached bytecode), not
        # from pyspark.zip (compiled from source in every run): audit/spark_daemon.py. Local
        # only: the workers find the audit package where the driver's code finds it.
        builder = builder.config("spark.python.daemon.module", "audit.spark_daemon")
    if partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(partitions))
    elif local:
        # A few partitions per core, so that queues of uneven size still spread evenly.
        cores = master[6:-1] if master.startswith("local[") else "1"
        count = os.cpu_count() or 2 if cores in ("*", "") else int(cores.split(",")[0])
        builder = builder.config("spark.sql.shuffle.partitions", str(4 * count))
        # The scan too: by default Spark packs the files into one split per core by size, which
        # for the exporter's segments (250,000 records, then a short last one per journal) gave
        # one task 3 times the rows of the other (2.0 s against 1.1 s on 1M records).
        builder = builder.config("spark.sql.files.minPartitionNum", str(4 * count))
    if driver_host is not None:
        builder = (builder.config("spark.driver.host", driver_host)
                   .config("spark.driver.bindAddress", driver_host))
    # pyspark imports pyspark.testing.utils (pandas with it: about 0.25 s) at its first call into
    # the JVM, which comes after waiting for the JVM to start: importing it meanwhile, on a thread,
    # takes that off the path (the import lock makes the later import wait for this one).
    threading.Thread(target=_import_quietly, args=("pyspark.testing.utils",), name="qaudit-preload",
                     daemon=True).start()
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    if not local:
        session.sparkContext.addPyFile(str(_code_zip()))
        if partitions is None:       # Spark's default of 200 costs more in task overhead than it spreads
            session.conf.set("spark.sql.shuffle.partitions", str(4 * max(2, session.sparkContext.defaultParallelism)))
    return session


def _import_quietly(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception:   # whoever needs it imports it again and sees the error
        pass


def stop_session(spark: Any) -> None:
    """`spark.stop()`, without waiting for pyspark's accumulator server to shut down: its
    handler looks at the shutdown flag only between one-second polls of the JVM's connection,
    so `SparkContext.stop` spent most of a second (0.9 s measured) waiting after the JVM side had
    stopped. The server is shut down on a daemon thread instead, done within a second if the
    process lives on, and nothing to wait for if it exits (qaudit's case)."""
    context = spark.sparkContext
    server = getattr(context, "_accumulatorServer", None)
    if server is not None:
        context._accumulatorServer = None
        threading.Thread(target=server.shutdown, name="qaudit-accumulator-shutdown", daemon=True).start()
    spark.stop()


def _code_zip() -> Path:
    """The audit's and the checks' packages (pure Python) for executors on other machines: the
    checks read the journal format and queue names from replication/, which reads wire/."""
    target = Path(tempfile.mkdtemp(prefix="qaudit-")) / "qaudit-code.zip"
    with zipfile.ZipFile(target, "w") as archive:
        for package in ("audit", "replication", "wire"):
            for path in sorted((REPOSITORY / package).rglob("*.py")):
                archive.write(path, path.relative_to(REPOSITORY).as_posix())
    return target


# --- partition functions (run in the Python workers) ----------------------------------------
def group_partition(settings: AuditSettings, starts: Mapping[tuple[str, str], int | None],
                    batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A partition's records (and history rows), in any order -> one JSON result per queue
    group, then the runs of consecutive sequence numbers per journal that this partition saw
    (every record passes through exactly one partition, so the driver's merge of all runs is
    exact). Grouping here rather than sorting in Spark saves the JVM a sort of every row.

    The cyclic garbage collector is off meanwhile: a partition builds hundreds of thousands of
    record tuples (no reference cycles), and the collector's passes over them cost several
    times the building itself (1M records: 2.5 s with it, 0.45 s without)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield from _group_partition(settings, starts, batches)
    finally:
        if collecting:
            gc.enable()


_make_record = functools.partial(tuple.__new__, JournalRecord)   # JournalRecord._make without its Python frame
_QUEUE = RECORD_COLUMNS.index("queue")


def _group_partition(settings: AuditSettings, starts: Mapping[tuple[str, str], int | None],
                     batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    by_queue: dict[str, list[JournalRecord]] = {}
    sequences: dict[tuple[str, str], list[int]] = {}
    for batch in batches:
        columns = [batch.column(name).to_pylist() for name in RECORD_COLUMNS]
        for queue, record in zip(columns[_QUEUE], map(_make_record, zip(*columns, strict=True)), strict=True):
            found = by_queue.get(queue)
            if found is None:
                found = by_queue[queue] = []
            found.append(record)
            if record.op != HISTORY_OP:
                journal = (record.node, record.journal_id)
                numbers = sequences.get(journal)
                if numbers is None:
                    numbers = sequences[journal] = []
                numbers.append(record.sequence)
    groups: dict[str, list[JournalRecord]] = {}
    for queue, queue_records in by_queue.items():
        found = groups.get(group_of(queue))
        if found is None:
            groups[group_of(queue)] = queue_records
        else:
            found += queue_records
    del by_queue
    for group in sorted(groups):
        yield _result_batch("group", check_group(group, groups.pop(group), settings, starts))
    runs = [[node, journal_id, [value for run in sequence_runs(sorted(numbers)) for value in run]]
            for (node, journal_id), numbers in sorted(sequences.items())]
    if runs:
        yield _result_batch("runs", runs)


def warm_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Nothing to compute: a Python worker that ran this has started and imported the audit's
    code (unpickling this function imported this module), and waits for the per-queue pass."""
    for _ in batches:
        pass
    return iter(())


def _result_batch(kind: str, result: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([_one_string(kind), _one_string(json.dumps(result))], schema=RESULT_SCHEMA)


def _one_string(text: str) -> pa.Array:
    """A string array of one value, made from its buffers: `pa.array` (and `from_pydict`) on
    Python objects imports pandas to rule out pandas objects, which cost each worker about
    0.5 s at its first result."""
    data = text.encode()
    return pa.StringArray.from_buffers(1, pa.py_buffer(struct.pack("=2i", 0, len(data))), pa.py_buffer(data))


# --- the job ----------------------------------------------------------------------------------
def audit_spark(spark: Any, journals: list[str], history_path: str | None = None,
                settings: AuditSettings = DEFAULT_SETTINGS, progress: Progress = _quiet) -> dict[str, Any]:
    from pyspark.sql import functions as F

    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    warm_up = _start_python_workers(spark)
    progress(f"reading journals from {len(journals)} path(s)")
    records = (spark.read.schema(SPARK_SCHEMA_DDL).option("recursiveFileLookup", "true")
               .option("pathGlobFilter", "*.parquet").parquet(*journals))
    # Where each journal starts (a journal that starts at sequence 1 is complete): from the
    # files' footers when they can say (local files, one journal each, with statistics: the
    # exporter's), else a native aggregate (a whole Spark job: about 4 s of 20 on 1M records).
    starts = footer_starts(journals)
    if starts is None:
        starts = {(row.node, row.journal_id): row.first for row in
                  records.groupBy("node", "journal_id").agg(F.min("sequence").alias("first")).collect()}
    progress(f"{len(starts)} journals; checking queues in {partitions} partitions")
    rows = records
    if history_path:
        rows = rows.unionByName(_history_rows(spark, history_path))
    # Partitioned by each record's group (audit/checks/units.py group_of, in Spark), which is not shipped:
    # the workers group by queue and merge each queue with its dead-letter queue.
    queue = F.col("queue")
    group = F.when(queue.endswith(DEAD_LETTER_SUFFIX),
                   F.expr(f"substring(queue, 1, char_length(queue) - {len(DEAD_LETTER_SUFFIX)})")).otherwise(queue)
    grouped = (rows.repartition(partitions, group)
               .mapInArrow(functools.partial(group_partition, settings, starts), RESULT_DDL))
    group_results: list[dict[str, Any]] = []
    runs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for row in grouped.collect():
        if row.kind == "group":
            group_results.append(json.loads(row.result))
            continue
        for node, journal_id, flat in json.loads(row.result):
            runs.setdefault((node, journal_id), []).extend(zip(flat[0::2], flat[1::2], strict=True))
    warm_up.join()
    journal_results = [check_journal_runs(node, journal_id, journal_runs, settings)
                       for (node, journal_id), journal_runs in sorted(runs.items())]
    progress(f"{len(group_results)} queues checked; assembling the report")
    return assemble_report(journal_results, group_results, settings)


def _start_python_workers(spark: Any) -> threading.Thread:
    """A one-row-per-core job on a thread of its own, so that the Python workers start (the
    daemon, then each worker's imports: about a second, which the first tasks of the per-queue
    pass used to wait for) while the driver lists the files and plans the audit's job, when the
    cores are otherwise idle. The workers stay up for the audit's job (spark.python.worker.reuse)."""
    count = max(1, spark.sparkContext.defaultParallelism)

    def run() -> None:
        try:
            spark.range(0, count, 1, count).mapInArrow(warm_partition, "id long").collect()
        except Exception:   # only a head start: the audit's own job starts whatever is not up
            pass
    thread = threading.Thread(target=run, name="qaudit-warm-up", daemon=True)
    thread.start()
    return thread


def footer_starts(journals: list[str]) -> dict[tuple[str, str], int] | None:
    """Each journal's lowest sequence from the Parquet footers' column statistics, or None
    when some file cannot say (not a local path, no statistics, or rows of several
    journals in one file)."""
    import pyarrow.parquet as pq

    starts: dict[tuple[str, str], int] = {}
    for journal in journals:
        if "://" in journal:
            return None
        root = Path(journal)
        paths = [root] if root.is_file() else [path for path in sorted(root.rglob("*.parquet"))
                                                 if not any(part[0] in "._" for part in path.relative_to(root).parts)]
        for path in paths:                    # the files Spark reads (it skips hidden ones)
            try:
                metadata = pq.ParquetFile(path).metadata
            except (OSError, pa.ArrowException):
                return None
            if metadata.num_rows == 0:
                continue
            bounds = {}
            for name in ("node", "journal_id", "sequence"):
                if name not in metadata.schema.names:
                    return None
                column = metadata.schema.names.index(name)
                lows, highs = [], []
                for group in range(metadata.num_row_groups):
                    stats = metadata.row_group(group).column(column).statistics
                    if stats is None or not stats.has_min_max or stats.null_count:
                        return None
                    lows.append(stats.min)
                    highs.append(stats.max)
                bounds[name] = (min(lows), max(highs))
            (node, last_node), (journal_id, last_id) = bounds["node"], bounds["journal_id"]
            if node != last_node or journal_id != last_id:
                return None
            key = (node, journal_id)
            starts[key] = min(bounds["sequence"][0], starts.get(key, bounds["sequence"][0]))
    return starts


def _history_rows(spark: Any, history_path: str) -> Any:
    """History entries shaped as records (audit/checks/history.py history_as_record, in Spark)."""
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
