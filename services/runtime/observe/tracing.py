"""Tracing: one OpenTelemetry tracer provider per process, W3C trace context on NATS headers.

Every publish injects ``traceparent`` into the message headers and every handler extracts it,
so one allocation is one trace across admission, allocator and node agent. Export is OTLP/HTTP
when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. Jaeger's :4318); tests
install an in-memory exporter through :func:`setup_tracing`'s ``exporter`` argument. A command
a person waits on exports through :class:`CommandExport` instead (:func:`setup_command_tracing`),
which never makes the command wait for a collector.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
# One provider per (service, instance) that asked for its own tracer: spans carry the
# service.name of the component that made them even when several run in one process
# (`tandem up`, the demo, tests). They share the process provider's span processors.
_service_providers: dict[tuple[str, str], TracerProvider] = {}
_processors: list[SpanProcessor] = []
# A command's exporter (its imports) is made while the command runs; a busy machine can take a
# few tenths of a second. Its end waits for that at most this long, then for the collector.
MAKE_EXPORTER_S = 2.0


def setup_tracing(
    service: str,
    *,
    otlp_endpoint: str | None = None,
    exporter: SpanExporter | None = None,
) -> TracerProvider:
    """Install (once) and return the process's tracer provider; add exporters as configured."""
    global _provider
    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service}))
        trace.set_tracer_provider(_provider)
    if otlp_endpoint:
        _add(BatchSpanProcessor(_otlp_exporter(otlp_endpoint)))
    if exporter is not None:
        _add(SimpleSpanProcessor(exporter))
    return _provider


def setup_command_tracing(
    service: str, *, otlp_endpoint: str, export_timeout: float, connect_timeout: float
) -> None:
    """Tracing for a command a person waits on (the CLI's submit and release): its spans go to
    ``otlp_endpoint`` as each ends, from a thread of its own (:class:`CommandExport`), each
    export at most ``export_timeout`` seconds, retries included; :func:`shutdown_tracing` then
    waits for them at most its own bound. A collector that is down or slow loses the command's
    spans, silently: the exporter's warnings are not the command's output. One that refuses a
    connection, or takes none within ``connect_timeout``, costs not even the exporter's
    imports (most of what exporting costs a command)."""
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    setup_tracing(service)

    def make() -> SpanExporter | None:
        if not _takes_connections(otlp_endpoint, timeout=connect_timeout):
            return None
        return _otlp_exporter(otlp_endpoint, timeout=export_timeout)

    _add(CommandExport(make))


def _takes_connections(endpoint: str, *, timeout: float) -> bool:
    try:
        parts = urllib.parse.urlsplit(endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname or "", port), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def exporting() -> bool:
    """Whether this process exports its spans: a span it makes can be another's parent only
    then (else the trace in the collector has a missing parent)."""
    return bool(_processors)


def _otlp_exporter(endpoint: str, *, timeout: float | None = None) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = endpoint.rstrip("/")
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout)


def _add(processor: SpanProcessor) -> None:
    assert _provider is not None
    _processors.append(processor)
    _provider.add_span_processor(processor)
    for provider in _service_providers.values():
        provider.add_span_processor(processor)


def shutdown_tracing(*, timeout_s: float = 30.0) -> None:
    """Export what is buffered, waiting at most ``timeout_s`` (a :class:`CommandExport`'s spans:
    at most that long for the export in flight)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=int(timeout_s * 1000))


class CommandExport(SpanProcessor):
    """Export each span as it ends, from a daemon thread; wait for it only when asked, and at
    most as long as asked.

    For a command a person waits on. The SDK's ``BatchSpanProcessor`` exports when flushed on
    the flushing thread (it ignores the flush's timeout, so the exporter's own one, retries
    included, is what the command waits), and at exit its shutdown joins its worker, however
    long that worker waits on a collector that does not answer. Here the export runs while
    the command still waits for its answer (the exporter is made, and its modules imported,
    at start, before the first span ends); :meth:`force_flush` waits for the collector at most
    the time given (for the exporter to be made, this process's own work, at most
    :data:`MAKE_EXPORTER_S`), and :meth:`shutdown` (at exit) waits for nothing: a thread still
    waiting on the collector ends with the process. ``make_exporter`` returning None (no
    collector to export to) drops the spans."""

    def __init__(self, make_exporter: Callable[[], SpanExporter | None]) -> None:
        self._make_exporter = make_exporter
        self._made = threading.Event()
        self._queue: queue.SimpleQueue[ReadableSpan | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._unsent = 0
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        threading.Thread(target=self._run, name="tandem-span-export", daemon=True).start()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            if self._closed:
                return
            self._unsent += 1
            self._idle.clear()
        self._queue.put(span)

    def _run(self) -> None:
        try:  # None, or an endpoint it cannot use: the spans are dropped, the command goes on
            exporter: SpanExporter | None = self._make_exporter()
        except Exception:
            exporter = None
        self._made.set()
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            spans = [s for s in batch if s is not None]
            if spans and exporter is not None:
                with contextlib.suppress(Exception):
                    exporter.export(spans)
            with self._lock:
                self._unsent -= len(spans)
                if self._unsent == 0:
                    self._idle.set()
            if None in batch:
                return

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._made.wait(MAKE_EXPORTER_S)
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)


class _WhenExported(trace.Tracer):
    """A tracer that records spans only while something exports them.

    With no exporter (the chart's default: ``otlp.endpoint`` empty) every span was still built,
    timed, given its attributes and dropped, a measurable share of the allocator's CPU
    (docs/benchmarks.md, "Measurements behind the code"). Then a span with a parent is the
    API's no-op span, which is the parent's context itself: nothing is recorded, and the
    ``traceparent`` a service passes on (and the ``trace_id`` its log lines carry) is the one
    it received, so logs still join up by trace id and a trace still joins up across the
    components that do export. A span without a parent (the allocator's first decision about
    a request that came without a trace, the bridge's for a pod without one, the demo's pod)
    is still made: it is what gives the request its trace id. (The CLI, at the edge, makes no
    span it does not export, :meth:`services.client.TandemClient.submit`: it would be the
    missing parent of the whole trace in a collector the services export to.) Chosen per
    span, not once, because the module-level tracers are made at import, before
    :func:`setup_tracing` (or a test) adds an exporter."""

    def __init__(self, recording: trace.Tracer) -> None:
        self._recording = recording
        self._noop = trace.NoOpTracer()

    def _for(self, context: otel_context.Context | None) -> trace.Tracer:
        if _processors or not trace.get_current_span(context).get_span_context().is_valid:
            return self._recording
        return self._noop

    def start_span(
        self, name: str, context: otel_context.Context | None = None, *args: Any, **kwargs: Any
    ) -> trace.Span:
        return self._for(context).start_span(name, context, *args, **kwargs)

    def start_as_current_span(
        self, name: str, context: otel_context.Context | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        return self._for(context).start_as_current_span(name, context, *args, **kwargs)


def tracer(
    name: str, *, service: str | None = None, instance: str = "", attributes: Mapping[str, str] | None = None
) -> trace.Tracer:
    """A tracer; with ``service``, one whose spans say that ``service.name`` (and
    ``service.instance.id`` = ``instance``, plus ``attributes`` such as ``k8s.node.name``).
    Its spans are recorded only while an exporter is installed (:class:`_WhenExported`)."""
    if service is None:
        return _WhenExported(trace.get_tracer(name))
    key = (service, instance)
    provider = _service_providers.get(key)
    if provider is None:
        resource: dict[str, str] = {"service.name": service, **(attributes or {})}
        if instance:
            resource["service.instance.id"] = instance
        provider = TracerProvider(resource=Resource.create(resource))
        for processor in _processors:
            provider.add_span_processor(processor)
        _service_providers[key] = provider
    return _WhenExported(provider.get_tracer(name))


def messaging(subject: str, operation: str) -> dict[str, str]:
    """The OpenTelemetry messaging attributes of a span that publishes (``operation``
    "publish") or processes ("process") a message on ``subject``."""
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
    }


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's W3C trace context (added to ``headers``)."""
    out = dict(headers or {})
    _propagator.inject(out)
    return out


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a received message's headers carry (empty context when none)."""
    return _propagator.extract(dict(headers or {}))


@contextmanager
def within(context: otel_context.Context | None) -> Iterator[None]:
    """``context`` current for the block: what is published there joins its trace even when
    the span that made the context has ended (an event announced after its decision)."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    return extract({"traceparent": traceparent} if traceparent else None)


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def current_traceparent() -> str | None:
    return inject().get("traceparent")


def traceparent_of(context: otel_context.Context | None) -> str:
    """The W3C ``traceparent`` of the span in ``context`` ("" when it holds none)."""
    if context is None:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier.get("traceparent", "")
