"""The node's own spans (docs/TRACING.md), made only when `[tracing] exporter` is configured.

Three spans, each only for messages that carry a sampled W3C `traceparent` (the producer's
sampling decides; an untraced message costs nothing here):
- `<queue> enqueue` (SERVER): an enqueue request from its arrival to its answer (durable where
  the queue's strength says), a child of the message's context; one per request (an
  `enqueue_many` is one request), made where the request arrived (qserver/api/ws_api.py,
  message_routes.py);
- `commit` (INTERNAL): one group commit of a batch that holds traced messages, from the batch's
  seal to its fsync done, on every node that commits it (master and replica);
- `<queue> replicate` (INTERNAL): on a master, from the batch's Append leaving for the replica
  to the queue's commit point passing the batch's traced messages (both members durable).
A batch holds many producers' messages, so `commit` and `replicate` are per batch, not per
message: each is a child of the first traced message's context in it and links to every traced
message's context (up to LINKS_MAX), as OpenTelemetry does for batches.

Exporters: `jsonl` writes each finished span as one JSON line to a file (no package needed: the
spans are built here, ids drawn at random as W3C trace context says); `otlp` hands them to
OpenTelemetry's SDK and its OTLP exporter (opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http or -grpc), and a node configured so without them refuses
to start, saying what to install. Not configured, the node's hot path is unchanged but for one
attribute test per enqueue request and two per batch (at its seal and at its commit).

A server leaf: the api and core rooms use it; it imports no other room.
"""
from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from replication.operations import Enqueued

log = logging.getLogger("qserver.tracing")
TRACEPARENT = "traceparent"
EXPORTERS = ("", "jsonl", "otlp")
LINKS_MAX = 64                   # links per batch span (the SDK's default limit is 128)
FLUSH_INTERVAL_S = 0.2           # the jsonl exporter writes what it holds at most this late
_HEX = frozenset("0123456789abcdef")


class TracingUnavailable(SystemExit):
    """`exporter = "otlp"` configured without OpenTelemetry's SDK and OTLP exporter installed."""


def parse_traceparent(value: str | None) -> tuple[str, str, int] | None:
    """(trace id, span id, flags) of a sampled W3C traceparent "00-<32 hex>-<16 hex>-<2 hex>";
    None for anything else (absent, malformed, all-zero ids, not sampled)."""
    if value is None or len(value) < 55 or value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    version, trace_id, span_id, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if version == "ff" or (version == "00" and len(value) != 55) or not set(value[:2] + trace_id + span_id + flags) <= _HEX:
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16 or not int(flags, 16) & 1:
        return None
    return trace_id, span_id, int(flags, 16)


def traced_context(headers: Mapping[str, str] | None) -> tuple[str, str, int] | None:
    return parse_traceparent(headers.get(TRACEPARENT)) if headers else None


class JsonlExporter:
    """Finished spans as JSON lines appended to `path`, written on a short timer and at close."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lines: list[str] = []
        self._timer: Any = None

    def export(self, span: dict[str, Any]) -> None:
        self._lines.append(json.dumps(span, separators=(",", ":")))
        if self._timer is None:
            try:
                import asyncio
                self._timer = asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, self.flush)
            except RuntimeError:        # no loop (a unit test): at once
                self.flush()

    def flush(self) -> None:
        self._timer = None
        if self._lines and not self._file.closed:
            lines, self._lines = self._lines, []
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.flush()
        self._file.close()


class SdkExporter:
    """Spans made through OpenTelemetry's SDK (its own provider, never the process's global
    one) and handed to `exporter` (OTLP, or a test's in-memory exporter) in batches."""

    def __init__(self, exporter: Any, resource: Mapping[str, str], *, batched: bool = True) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        self._trace = trace
        self._provider = TracerProvider(resource=Resource.create(dict(resource)))
        self._provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("qserver")

    def _context(self, trace_id: str, span_id: str, flags: int) -> Any:
        trace = self._trace
        return trace.SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                                 trace_flags=trace.TraceFlags(flags))

    def export(self, span: dict[str, Any]) -> None:
        trace = self._trace
        parent = None
        if span["parent_span_id"]:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(
                self._context(span["trace_id"], span["parent_span_id"], 1)))
        made = self._tracer.start_span(
            span["name"], context=parent, kind=getattr(trace.SpanKind, span["kind"]), attributes=span["attributes"],
            links=[trace.Link(self._context(link["trace_id"], link["span_id"], 1)) for link in span["links"]],
            start_time=span["start_time_unix_nano"])
        if span["status"] == "ERROR":
            made.set_status(trace.Status(trace.StatusCode.ERROR))
        made.end(end_time=span["end_time_unix_nano"])

    def flush(self) -> None:
        self._provider.force_flush()

    def close(self) -> None:
        self._provider.shutdown()


def otlp_exporter(endpoint: str) -> Any:
    """The SDK's OTLP exporter (HTTP, else gRPC), or TracingUnavailable saying what to install."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TracingUnavailable("qserver: refusing to start: [tracing] exporter = \"otlp\" needs OpenTelemetry's SDK "
                                 "and OTLP exporter: pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "
                                 "(or set exporter = \"jsonl\", which needs nothing)") from None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
        except ImportError:
            raise TracingUnavailable("qserver: refusing to start: [tracing] exporter = \"otlp\" needs an OTLP exporter: "
                                     "pip install opentelemetry-exporter-otlp-proto-http (or -grpc)") from None
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


class NodeTracing:
    """What the node's rooms call to make spans; `node_tracing` builds it from the config."""

    def __init__(self, exporter: Any, node_id: str, service_name: str = "qserver") -> None:
        self.exporter = exporter
        self.node_id = node_id
        self.resource = {"service.name": service_name, "service.instance.id": node_id}
        self._random = random.Random()
        self.spans = 0

    def emit(self, name: str, kind: str, parent: tuple[str, str, int] | None, start_ns: int, end_ns: int,
             attributes: dict[str, Any], links: Iterable[tuple[str, str, int]] = (), *, error: bool = False) -> None:
        """Export one finished span (the SDK's exporter draws its own ids)."""
        span_id = f"{self._random.getrandbits(64) or 1:016x}"
        trace_id = parent[0] if parent is not None else f"{self._random.getrandbits(128) or 1:032x}"
        attributes["qcluster.node"] = self.node_id
        self.exporter.export({
            "name": name, "kind": kind, "trace_id": trace_id, "span_id": span_id,
            "parent_span_id": parent[1] if parent is not None else None,
            "start_time_unix_nano": start_ns, "end_time_unix_nano": max(end_ns, start_ns),
            "attributes": attributes, "links": [{"trace_id": t, "span_id": s} for t, s, _ in links],
            "status": "ERROR" if error else "OK", "resource": self.resource})
        self.spans += 1

    # --- enqueue: a request from arrival to answer ----------------------------------------------
    def replier(self, replier: Any, queue: str, headers: Mapping[str, str] | None, count: int = 1) -> Any:
        """`replier` (qserver/core/commands.py Replier), or one that also ends an enqueue span
        when the request carries a sampled traceparent."""
        parent = traced_context(headers)
        return replier if parent is None else TracedReplier(self, replier, queue, parent, count)

    def enqueued(self, queue: str, parent: tuple[str, str, int], started_ns: int, result: Any, count: int,
                 error: Any = None) -> None:
        attributes: dict[str, Any] = {"messaging.system": "qcluster", "messaging.destination.name": queue,
                                      "messaging.operation.type": "send", "messaging.batch.message_count": count}
        if error is not None:
            attributes["error.type"] = getattr(error, "code", type(error).__name__)
        elif isinstance(result, (list, tuple)) and result and type(result[0]) is int and count == 1:
            attributes["messaging.message.id"] = str(result[0])
        self.emit(f"{queue} enqueue", "SERVER", parent, started_ns, time.time_ns(), attributes, error=error is not None)

    # --- commit and replicate: per batch ----------------------------------------------------------
    def sealed(self, operations: list[Any], touched: Mapping[str, Any]) -> BatchTrace | None:
        """The traced messages of a batch being sealed (None: no span for it); `touched`: its
        queues' cores by name. Called once per batch, only when tracing is configured."""
        found: dict[int, list[tuple[tuple[str, str, int], int]]] = {}
        for op in operations:
            if type(op) is Enqueued and op.headers:
                context = traced_context(op.headers)
                if context is not None:
                    found.setdefault(op.queue_id, []).append((context, op.index))
        if not found:
            return None
        names = {core.queue_id: name for name, core in touched.items()}
        return BatchTrace(self, {names.get(queue_id, str(queue_id)): traced for queue_id, traced in found.items()},
                          len(operations))


class BatchTrace:
    """One batch's traced messages by queue (context, index), timed from its seal."""

    def __init__(self, tracing: NodeTracing, traced: dict[str, list[tuple[tuple[str, str, int], int]]],
                 operations: int) -> None:
        self.tracing = tracing
        self.traced = traced
        self.operations = operations
        self.started_ns = time.time_ns()

    def _parent_and_links(self, queues: Iterable[str]) -> tuple[tuple[str, str, int], list[tuple[str, str, int]]]:
        contexts = [context for queue in queues for context, _ in self.traced[queue]]
        return contexts[0], contexts[:LINKS_MAX]

    def committed(self, replica_of: Mapping[str, Any], error: BaseException | None = None) -> None:
        parent, links = self._parent_and_links(self.traced)
        roles = {"replica" if queue in replica_of else "master" for queue in self.traced}
        attributes: dict[str, Any] = {
            "qcluster.batch.operations": self.operations, "qcluster.queues": sorted(self.traced),
            "messaging.batch.message_count": sum(len(found) for found in self.traced.values()),
            "qcluster.role": roles.pop() if len(roles) == 1 else "both"}
        if error is not None:
            attributes["error.type"] = type(error).__name__
        self.tracing.emit("commit", "INTERNAL", parent, self.started_ns, time.time_ns(), attributes, links,
                          error=error is not None)

    def replicated(self, queue: str, replica: str) -> None:
        """The queue's commit point passed this batch's traced messages (both members durable)."""
        parent, links = self._parent_and_links([queue])
        self.tracing.emit(f"{queue} replicate", "INTERNAL", parent, self.started_ns, time.time_ns(),
                          {"messaging.destination.name": queue, "qcluster.replica": replica,
                           "messaging.batch.message_count": len(self.traced[queue])}, links)

    def last_index(self, queue: str) -> int:
        return max(index for _, index in self.traced[queue])


class TracedReplier:
    """A Replier that ends the request's enqueue span when it answers."""

    __slots__ = ("count", "inner", "parent", "queue", "started_ns", "tracing")

    def __init__(self, tracing: NodeTracing, inner: Any, queue: str, parent: tuple[str, str, int], count: int) -> None:
        self.tracing, self.inner, self.queue, self.parent, self.count = tracing, inner, queue, parent, count
        self.started_ns = time.time_ns()

    def reply(self, request_id: int, result: Any) -> None:
        self.inner.reply(request_id, result)
        self.tracing.enqueued(self.queue, self.parent, self.started_ns, result, self.count)

    def fail(self, request_id: int, error: Any) -> None:
        self.inner.fail(request_id, error)
        self.tracing.enqueued(self.queue, self.parent, self.started_ns, None, self.count, error)


def node_tracing(exporter: str, *, node_id: str, path: str = "", endpoint: str = "", service_name: str = "qserver",
                 data_dir: str = ".") -> NodeTracing | None:
    """The node's tracing from its configuration (None: not configured). A relative `path` is
    under the node's data directory."""
    if not exporter:
        return None
    if exporter == "jsonl":
        where = Path(path)
        return NodeTracing(JsonlExporter(where if where.is_absolute() else Path(data_dir) / where), node_id,
                           service_name)
    return NodeTracing(SdkExporter(otlp_exporter(endpoint), {"service.name": service_name,
                                                             "service.instance.id": node_id}), node_id, service_name)
