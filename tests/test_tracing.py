"""Trace context through the queue (issue 36, item 3; docs/TRACING.md): the client library's
producer and consumer spans with OpenTelemetry's SDK and its in-memory exporter in this process,
across one real 3-node cluster (a plain queue, a forward, a macro queue, the sync client), the
node's own spans written by its "jsonl" exporter, and a process without OpenTelemetry, where
nothing of it is imported and no header is added. One cluster for the whole file."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from client import AsyncClient, Client
from client import tracing as client_tracing
from qserver import tracing as node_tracing
from qserver.config import load_config
from qserver.dev.devcluster import LocalCluster, free_port
from tests.test_surveillance import until

PLACEMENT = {"traced": ["n1", "n2"], "fsrc": ["n2", "n3"], "fdst": ["n3", "n1"], "ma": ["n1", "n2"],
             "mb": ["n2", "n3"], "plain": ["n1", "n3"]}
SPANS_FILE = "spans.jsonl"
EXPORTER = InMemorySpanExporter()


def _provider() -> TracerProvider:
    """The process's SDK provider with the in-memory exporter (another test file may have set
    the global provider first: then the exporter is added to it)."""
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        current = trace.get_tracer_provider()
    assert isinstance(current, TracerProvider)
    if not getattr(current, "_qcluster_test_exporter", False):
        current.add_span_processor(SimpleSpanProcessor(EXPORTER))
        current._qcluster_test_exporter = True  # type: ignore[attr-defined]
    return current


TRACER = _provider().get_tracer("tests.test_tracing")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("tracing"), 3, PLACEMENT,
                        {"tracing_exporter": '"jsonl"', "tracing_path": f'"{SPANS_FILE}"'})
    try:
        made.start_all()
        made.wait_ready()
        yield made
    finally:
        made.kill_all()
    assert made.problems() == []


def spans(name: str) -> list[Any]:
    return [span for span in EXPORTER.get_finished_spans() if span.name == name]


def node_spans(cluster: LocalCluster, trace_id: str) -> list[dict[str, Any]]:
    found = []
    for node in cluster.ids:
        path = cluster.root / node / SPANS_FILE
        if path.exists():
            found += [span for line in path.read_text().splitlines() if line
                      for span in [json.loads(line)] if span["trace_id"] == trace_id]
    return found


def _hex(number: int, width: int) -> str:
    return f"{number:0{width}x}"


# --- pure parts -------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_traceparent_parsing_takes_only_sampled_well_formed_contexts() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert node_tracing.parse_traceparent(good) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    for bad in (None, "", good[:-1], good.replace("-01", "-00"), "ff" + good[2:], good.upper(),
                "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
                good + "-extra"):
        assert node_tracing.parse_traceparent(bad) is None, bad
    # A later version may carry more fields after the flags.
    assert node_tracing.parse_traceparent("01" + good[2:] + "-more") is not None


@pytest.mark.timeout(10)
def test_the_tracing_table_configures_the_node_and_bad_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "n1.toml"
    path.write_text('[node]\nnode_id = "n1"\n[tracing]\nexporter = "jsonl"\npath = "s.jsonl"\n')
    config = load_config(path)
    assert (config.tracing_exporter, config.tracing_path) == ("jsonl", "s.jsonl")
    assert load_config(None).tracing_exporter == ""
    for text, message in (('[tracing]\nexporter = "zipkin"\n', "tracing exporter must be"),
                          ('[tracing]\nexporter = "jsonl"\n', "needs a path"),
                          ('[tracing]\nsampler = "all"\n', r"unknown \[tracing\] key")):
        path.write_text('[node]\nnode_id = "n1"\n' + text)
        with pytest.raises(ValueError, match=message):
            load_config(path)


@pytest.mark.timeout(10)
def test_otlp_without_the_exporter_package_refuses_to_start_saying_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                   "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, module, None)        # None in sys.modules: ImportError
    with pytest.raises(node_tracing.TracingUnavailable, match="pip install opentelemetry-exporter-otlp"):
        node_tracing.node_tracing("otlp", node_id="n1")


@pytest.mark.timeout(60)
def test_a_node_configured_for_otlp_without_the_packages_refuses_to_start(tmp_path: Path) -> None:
    """A real `qserver run` (OpenTelemetry's OTLP exporter hidden from it) ends at once with the
    message, not later on the first traced message."""
    repository = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(tmp_path / "n1"),
                    "--credentials", str(tmp_path / "admin.json")], check=True, capture_output=True, cwd=repository)
    config = tmp_path / "n1.toml"
    config.write_text(f'[node]\nnode_id = "n1"\ndata_dir = "{tmp_path / "n1"}"\nport = {free_port()}\n'
                      '[tracing]\nexporter = "otlp"\nendpoint = "http://127.0.0.1:9/v1/traces"\n')
    script = textwrap.dedent(f"""
        import runpy, sys

        class Hidden:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("opentelemetry.exporter"):
                    raise ImportError("hidden in this test")
                return None

        sys.meta_path.insert(0, Hidden())
        sys.argv = ["qserver", "run", "--config", {str(config)!r}]
        runpy.run_module("qserver", run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40, cwd=repository)
    assert done.returncode != 0 and "pip install opentelemetry-exporter-otlp" in done.stderr, done.stderr[-2000:]
    assert "qserver n1 ready" not in done.stdout


@pytest.mark.timeout(10)
def test_node_spans_go_through_the_sdk_as_the_otlp_exporter_would_send_them() -> None:
    """The "otlp" exporter's path with the SDK's in-memory exporter in its place: parent, links,
    kind, times and attributes survive the conversion."""
    memory = InMemorySpanExporter()
    tracing = node_tracing.NodeTracing(node_tracing.SdkExporter(memory, {"service.name": "qserver"}, batched=False),
                                       "n7")
    parent = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    other = ("11111111111111111111111111111111", "2222222222222222", 1)
    tracing.emit("commit", "INTERNAL", parent, 1_000, 5_000, {"qcluster.batch.operations": 3}, [parent, other])
    [span] = memory.get_finished_spans()
    assert (span.name, span.kind, span.start_time, span.end_time) == ("commit", SpanKind.INTERNAL, 1_000, 5_000)
    assert _hex(span.context.trace_id, 32) == parent[0] and _hex(span.parent.span_id, 16) == parent[1]
    assert [_hex(link.context.span_id, 16) for link in span.links] == [parent[1], other[1]]
    assert span.attributes["qcluster.node"] == "n7" and span.resource.attributes["service.name"] == "qserver"


@pytest.mark.timeout(10)
def test_trace_context_never_pushes_headers_past_their_limits() -> None:
    context = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert client_tracing._fits({"a": "b"}, context)
    assert not client_tracing._fits({f"h{i}": "v" for i in range(16)}, context)       # 16 names already
    assert not client_tracing._fits({"big": "x" * 4_050}, context)                    # 4,096 characters
    assert client_tracing._fits({"x-sequence": "1", **{f"h{i}": "v" for i in range(15)}}, context)


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_tracestate_travels_with_the_traceparent_and_the_consumer_reads_both() -> None:
    parent = trace.SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                               trace_flags=trace.TraceFlags(1), trace_state=trace.TraceState([("vendor", "v1")]))
    sent: list[dict[str, str] | None] = []

    async def send(headers: dict[str, str] | None) -> int:
        sent.append(headers)
        return 7
    with trace.use_span(trace.NonRecordingSpan(parent)):
        assert client_tracing.wants_publish({"a": "b"}) and not client_tracing.wants_publish({"traceparent": "x"})
        assert await client_tracing.publish("q", {"a": "b"}, None, send) == 7
    [headers] = sent
    assert headers is not None and headers["a"] == "b" and headers["tracestate"] == "vendor=v1"
    assert headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    context = client_tracing.context_of(headers)
    carried = trace.get_current_span(context).get_span_context()
    assert carried.trace_state.get("vendor") == "v1" and carried.trace_id == parent.trace_id


# --- a real cluster ---------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_producer_and_consumer_spans_make_one_trace_across_the_cluster(cluster: LocalCluster) -> None:
    EXPORTER.clear()
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as producer, \
            AsyncClient(cluster.urls["n2"], cluster.credentials_path) as consumer:
        await producer.create_queue("traced", strength="full")
        with TRACER.start_as_current_span("checkout") as root:
            message_id = await producer.enqueue("traced", b"order-1", headers={"k": "v"})
        [publish] = spans("traced publish")
        assert publish.kind == SpanKind.PRODUCER and publish.parent.span_id == root.get_span_context().span_id
        assert dict(publish.attributes) == {
            "messaging.system": "qcluster", "messaging.destination.name": "traced", "messaging.operation.type": "send",
            "messaging.operation.name": "publish", "messaging.operation": "publish",
            "messaging.message.id": str(message_id)}
        [message] = await consumer.receive("traced", wait_s=10.0)
        assert message.headers["k"] == "v"
        version, trace_id, span_id, flags = message.headers["traceparent"].split("-")
        assert (version, trace_id, span_id) == ("00", _hex(publish.context.trace_id, 32),
                                                _hex(publish.context.span_id, 16)) and int(flags, 16) & 1
        [received] = spans("traced receive")
        assert received.kind == SpanKind.CONSUMER
        assert received.context.trace_id == root.get_span_context().trace_id          # one trace
        assert received.parent.span_id == publish.context.span_id
        assert [link.context.span_id for link in received.links] == [publish.context.span_id]
        assert received.attributes["messaging.message.id"] == str(message_id)
        assert received.attributes["messaging.operation.type"] == "receive"
        assert received.attributes["messaging.destination.name"] == "traced"
        # A handler's own span, child of the producer's context.
        with TRACER.start_as_current_span("handle", context=message.trace_context) as handled:
            assert handled.get_span_context().trace_id == root.get_span_context().trace_id
        await message.ack()

        # A batch: one producer span, every message carries its context; the consume iterator
        # makes one consumer span per message, linked to it.
        EXPORTER.clear()
        with TRACER.start_as_current_span("bulk"):
            ids = await producer.enqueue_many("traced", [b"a", b"b", b"c"])
        [batch] = spans("traced publish")
        assert batch.attributes["messaging.batch.message_count"] == 3
        async with consumer.consume("traced", prefetch=10) as stream:
            taken = [await stream.__anext__() for _ in ids]
        assert sorted(m.id for m in taken) == sorted(ids)
        for m in taken:
            await m.ack()
        pushed = spans("traced receive")
        assert len(pushed) == 3 and all(s.parent.span_id == batch.context.span_id for s in pushed)

        # No span current: nothing added, no span; a traceparent the caller set is kept as it is.
        EXPORTER.clear()
        plain_id = await producer.enqueue("traced", b"untraced")
        own = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        with TRACER.start_as_current_span("own"):
            await producer.enqueue("traced", b"own", headers={"traceparent": own})
        got = await consumer.receive("traced", 2, wait_s=10.0)
        assert {m.id: m.headers.get("traceparent") for m in got}[plain_id] is None
        assert [m.headers["traceparent"] for m in got if m.id != plain_id] == [own]
        assert spans("traced publish") == []
        for m in got:
            await m.ack()

    # The sync client carries the caller's span into its loop thread.
    EXPORTER.clear()
    def sync_round() -> Any:
        with Client(cluster.urls["n1"], cluster.credentials_path) as client, \
                TRACER.start_as_current_span("sync") as span:
            client.enqueue("traced", b"sync")
            [got] = client.receive("traced", wait_s=10.0)
            got.ack()
            return span.get_span_context().trace_id, got
    trace_id, got = await asyncio.to_thread(sync_round)
    assert got.headers["traceparent"].split("-")[1] == _hex(trace_id, 32)
    assert {s.context.trace_id for s in spans("traced publish") + spans("traced receive")} == {trace_id}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_trace_goes_on_through_a_forward_and_a_macro_queue(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.urls["n1"], cluster.credentials_path) as client:
        await client.create_queue("fdst", strength="full")
        await client.create_queue("fsrc", strength="full")
        await client.create_forward("tf", "fsrc", "fdst")
        EXPORTER.clear()
        with TRACER.start_as_current_span("forwarded") as root:
            await client.enqueue("fsrc", b"via forward")
        [publish] = spans("fsrc publish")

        async def arrived() -> list[Any]:
            return await client.receive("fdst", wait_s=1.0)
        [message] = await until(arrived, "the forwarded message", timeout_s=30.0)
        assert message.headers["traceparent"].split("-")[2] == _hex(publish.context.span_id, 16)
        await message.ack()
        [received] = spans("fdst receive")
        assert received.context.trace_id == root.get_span_context().trace_id
        assert received.parent.span_id == publish.context.span_id
        await client.delete_forward("tf")

        for member in ("ma", "mb"):
            await client.create_queue(member, strength="full")
        await client.create_macro("tm", producer="round_robin", consumer="prioritized")
        await client.add_macro_member("tm", "ma", priority=5)
        await client.add_macro_member("tm", "mb", priority=1)
        EXPORTER.clear()
        with TRACER.start_as_current_span("macro") as root:
            first = await client.enqueue("tm", b"m1")
            second = await client.enqueue("tm", b"m2")
        made = spans("tm publish")                 # one per enqueue, none for the member calls
        assert len(made) == 2 and not spans("ma publish") and not spans("mb publish")
        assert {span.attributes["qcluster.macro.member"] for span in made} == {first.queue, second.queue} == {"ma", "mb"}
        got = [m for _ in range(2) for m in await client.receive("tm", wait_s=10.0)]
        assert sorted(m.queue for m in got) == ["ma", "mb"]
        for m in got:
            await m.ack()
        consumed = spans("ma receive") + spans("mb receive")
        assert len(consumed) == 2 and {s.context.trace_id for s in consumed} == {root.get_span_context().trace_id}
        assert {s.parent.span_id for s in consumed} == {s.context.span_id for s in made}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_nodes_write_enqueue_commit_and_replicate_spans_in_the_producers_trace(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.urls["n3"], cluster.credentials_path) as client:
        await client.create_queue("plain", strength="full")         # master n1, replica n3
        EXPORTER.clear()
        with TRACER.start_as_current_span("traced write"):
            message_id = await client.enqueue("plain", b"x")
        [publish] = spans("plain publish")
        trace_id, producer = _hex(publish.context.trace_id, 32), _hex(publish.context.span_id, 16)

        def complete() -> list[dict[str, Any]] | None:
            found = node_spans(cluster, trace_id)
            names = {(span["name"], span["resource"]["service.instance.id"], span["status"]) for span in found}
            wanted = {("commit", "n1", "OK"), ("commit", "n3", "OK"), ("plain replicate", "n1", "OK")}
            answered = any(name == "plain enqueue" and status == "OK" for name, _, status in names)
            return found if wanted <= names and answered else None

        async def written() -> list[dict[str, Any]] | None:
            return complete()
        try:
            found = await until(written, "the nodes' spans", timeout_s=10.0)
        except AssertionError:
            raise AssertionError(f"the nodes' spans of trace {trace_id}: {node_spans(cluster, trace_id)}") from None
        by_name = {(span["name"], span["resource"]["service.instance.id"]): span for span in found}
        # Made where the request arrived: the master, or a member that relayed it there.
        [enqueue] = [span for span in found if span["name"] == "plain enqueue" and span["status"] == "OK"]
        assert enqueue["kind"] == "SERVER" and enqueue["parent_span_id"] == producer
        assert enqueue["attributes"]["messaging.message.id"] == str(message_id)
        assert enqueue["start_time_unix_nano"] <= enqueue["end_time_unix_nano"]
        for key in (("commit", "n1"), ("commit", "n3"), ("plain replicate", "n1")):
            span = by_name[key]
            assert span["parent_span_id"] == producer and {"trace_id": trace_id, "span_id": producer} in span["links"]
        assert by_name[("commit", "n3")]["attributes"]["qcluster.role"] == "replica"
        assert by_name[("plain replicate", "n1")]["attributes"]["qcluster.replica"] == "n3"
        # An untraced message makes no span on any node (once what is written late is in:
        # the jsonl exporter writes within 0.2 s, and a relayed request's other span may follow).
        await asyncio.sleep(0.5)
        before = sum(len((cluster.root / node / SPANS_FILE).read_text().splitlines()) for node in cluster.ids)
        await client.enqueue("plain", b"untraced")
        await asyncio.sleep(0.5)
        after = sum(len((cluster.root / node / SPANS_FILE).read_text().splitlines()) for node in cluster.ids)
        assert after == before
        for m in await client.receive("plain", 2, wait_s=5.0):
            await m.ack()


@pytest.mark.timeout(90)
def test_without_opentelemetry_nothing_is_imported_and_no_header_added(cluster: LocalCluster) -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys

        class Hidden:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError("opentelemetry is hidden in this test")
                return None

        sys.meta_path.insert(0, Hidden())
        from client import AsyncClient

        async def main():
            async with AsyncClient({cluster.urls["n2"]!r}, {str(cluster.credentials_path)!r}) as client:
                await client.create_queue("bare", strength="full")
                await client.enqueue("bare", b"one", headers={{"a": "b"}})
                await client.enqueue_many("bare", [b"two", b"three"])
                got = await client.receive("bare", 3, wait_s=5.0)
                async with client.consume("bare", prefetch=5) as stream:
                    await client.enqueue("bare", b"four")
                    got.append(await stream.__anext__())
                assert len(got) == 4, got
                assert all("traceparent" not in m.headers for m in got), [m.headers for m in got]
                assert all(m.trace_context is None for m in got)
                for m in got:
                    await m.ack()
            loaded = sorted(n for n in sys.modules if n.split(".")[0] == "opentelemetry")
            assert not loaded, loaded
            print("clean")

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]


@pytest.mark.timeout(30)
def test_the_check_on_the_hot_path_is_one_lookup_while_opentelemetry_is_not_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What an enqueue pays in a process without OpenTelemetry: `api()` finds nothing in
    sys.modules. Bounded loosely (a shared machine): well under a microsecond a call."""
    monkeypatch.setattr(client_tracing, "_trace", None)
    monkeypatch.delitem(sys.modules, "opentelemetry.trace")
    calls = 200_000
    started = time.perf_counter()
    for _ in range(calls):
        client_tracing.api()
    per_call_s = (time.perf_counter() - started) / calls
    assert client_tracing.api() is None and per_call_s < 2e-6, per_call_s
