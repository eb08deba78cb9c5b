"""Trace context through the queue (docs/TRACING.md): W3C `traceparent`/`tracestate` in a
message's headers, a PRODUCER span around an enqueue and a CONSUMER span for each message
received that carries a producer's context.

Optional: OpenTelemetry's API (`pip install qcluster[tracing]`). This module imports nothing of
it on its own: a span can be current only in a process that imported `opentelemetry.trace`,
so until the application has, every check here is one look in `sys.modules` (`api()`), no
header is added and no span made. Once it has, an enqueue made while a valid span is current
gets a producer span "<queue> publish", child of that span, whose context goes into the
message's headers (never over a `traceparent` the caller set: then the caller's context is
carried and no span is made). A message received (`receive`, `consume`, a macro queue's
member) with a `traceparent` gets a consumer span "<queue> receive", child of the producer's
context, so the trace goes on through the queue, and linked to it as the messaging
conventions say (and linked to the receiving application's current span, if any).
`context_of(headers)` / `Message.trace_context` hand a handler the producer's context to
start its own child span.

Attributes follow OpenTelemetry's messaging conventions: messaging.system "qcluster",
messaging.destination.name, messaging.operation.type ("send" for the producer since the
conventions of 1.26, which called it "publish"; "receive"), the older messaging.operation
too, messaging.message.id once known, messaging.batch.message_count for `enqueue_many`.
"""
from __future__ import annotations

import contextvars
import importlib
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from wire.message_input import HEADERS_CHARS_MAX, HEADERS_MAX, STREAM_HEADERS

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SYSTEM = "qcluster"
TRACER_NAME = "qcluster.client"
_T = TypeVar("_T")

_trace: Any = None          # opentelemetry.trace, once the application imported it
_propagator: Any = None     # the W3C trace-context propagator, made with it
# Set while an enqueue's producer span is open: the calls it makes (a macro queue's member
# enqueues, the enqueue that carries the headers) make no span of their own.
_publishing: contextvars.ContextVar[bool] = contextvars.ContextVar("qcluster_publishing", default=False)


def api() -> Any:
    """`opentelemetry.trace` when the application has imported it, else None: one dict
    lookup, the whole cost of tracing on the hot path of a process without OpenTelemetry."""
    global _trace, _propagator
    if _trace is not None:
        return _trace
    found = sys.modules.get("opentelemetry.trace")
    if found is None or not hasattr(found, "get_current_span"):    # absent, or still being imported
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    _propagator = TraceContextTextMapPropagator()
    _trace = found
    return found


def _tracer() -> Any:
    return _trace.get_tracer(TRACER_NAME)


def wants_publish(headers: Mapping[str, str] | None) -> bool:
    """Whether an enqueue should be traced: OpenTelemetry in use, a valid span current, no
    producer span of ours open already, and no traceparent set by the caller."""
    trace = api()
    if trace is None or _publishing.get() or (headers and TRACEPARENT in headers):
        return False
    return bool(trace.get_current_span().get_span_context().is_valid)


def _fits(headers: Mapping[str, str], extra: Mapping[str, str]) -> bool:
    """Whether `extra` still fits the message limits (wire/message_input.py) beside `headers`:
    trace context is an ordinary header, and it must not turn a valid enqueue into a refused one."""
    counted = [name for name in headers if name not in STREAM_HEADERS]
    chars = sum(len(name) + len(headers[name]) for name in counted)
    chars += sum(len(name) + len(value) for name, value in extra.items())
    return len(counted) + len(extra) <= HEADERS_MAX and chars <= HEADERS_CHARS_MAX


def _attributes(queue: str, operation_type: str, operation: str) -> dict[str, Any]:
    return {"messaging.system": SYSTEM, "messaging.destination.name": queue,
            "messaging.operation.type": operation_type, "messaging.operation.name": operation,
            "messaging.operation": operation}


async def publish(queue: str, headers: Mapping[str, str] | None, count: int | None,
                  send: Callable[[dict[str, str] | None], Awaitable[_T]]) -> _T:
    """`send(headers)` inside a PRODUCER span "<queue> publish" whose context the headers
    carry. `count`: the messages of an `enqueue_many` (None: one message)."""
    trace = _trace
    attributes = _attributes(queue, "send", "publish")
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    with _tracer().start_as_current_span(f"{queue} publish", kind=trace.SpanKind.PRODUCER,
                                         attributes=attributes) as span:
        carried = dict(headers or {})
        made = span.get_span_context()          # W3C trace context of this producer span
        context = {TRACEPARENT: f"00-{made.trace_id:032x}-{made.span_id:016x}-{int(made.trace_flags):02x}"}
        if made.trace_state:
            context[TRACESTATE] = made.trace_state.to_header()
        if _fits(carried, context):
            carried.update(context)
        else:
            span.set_attribute("qcluster.trace_context_carried", False)
        token = _publishing.set(True)
        try:
            result = await send(carried or None)
        except Exception as error:
            code = getattr(error, "code", None)
            span.set_attribute("error.type", code if isinstance(code, str) else type(error).__qualname__)
            raise
        finally:
            _publishing.reset(token)
        if isinstance(result, int):
            span.set_attribute("messaging.message.id", str(result))
            member = getattr(result, "queue", None)        # a macro queue's MacroEnqueued
            if isinstance(member, str):
                span.set_attribute("qcluster.macro.member", member)
        elif isinstance(result, list) and result and isinstance(result[0], int):
            span.set_attribute("qcluster.message_ids", [str(one) for one in result[:100]])
        return result


def received(queue: str, messages: Iterable[Any], started_ns: int | None = None) -> None:
    """A CONSUMER span "<queue> receive" for each of `messages` (client/consumer.py Message)
    that carries a producer's context: its child and linked to it, from `started_ns` (the
    receive call's start; None: now) to now. Call only after `api()` returned the module."""
    trace = _trace
    tracer = None
    receiver = trace.get_current_span().get_span_context()
    for message in messages:
        headers = message.headers
        if TRACEPARENT not in headers:
            continue
        context = _propagator.extract(headers)
        producer = trace.get_current_span(context).get_span_context()
        if not producer.is_valid:
            continue
        links = [trace.Link(producer)]
        if receiver.is_valid:
            links.append(trace.Link(receiver, {"qcluster.link": "receiver"}))
        attributes = _attributes(queue, "receive", "receive")
        attributes["messaging.message.id"] = str(message.id)
        attributes["qcluster.deliveries"] = message.deliveries
        tracer = tracer or _tracer()
        span = tracer.start_span(f"{queue} receive", context=context, kind=trace.SpanKind.CONSUMER, links=links,
                                 attributes=attributes, start_time=started_ns)
        span.end()


def context_of(headers: Mapping[str, str]) -> Any:
    """The producer's trace context in a message's headers, as an OpenTelemetry `Context` a
    handler starts its own span in (`tracer.start_as_current_span("work", context=...)`);
    None without a valid traceparent or without OpenTelemetry installed (asked for here, it
    is imported if it is installed)."""
    if TRACEPARENT not in headers:
        return None
    if api() is None:
        try:
            importlib.import_module("opentelemetry.trace")
        except ImportError:
            return None
        if api() is None:
            return None
    context = _propagator.extract(headers)
    return context if _trace.get_current_span(context).get_span_context().is_valid else None
