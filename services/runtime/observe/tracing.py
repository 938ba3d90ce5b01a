"""Tracing: one OpenTelemetry tracer provider per process, W3C trace context on NATS headers.

Every publish injects ``traceparent`` into the message headers and every handler extracts it,
so one allocation is one trace across admission, allocator and node agent. Export is OTLP/HTTP
when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. Jaeger's :4318); tests
install an in-memory exporter through :func:`setup_tracing`'s ``exporter`` argument.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
# One provider per (service, instance) that asked for its own tracer: spans carry the
# service.name of the component that made them even when several run in one process
# (`tandem up`, the demo, tests). They share the process provider's span processors.
_service_providers: dict[tuple[str, str], TracerProvider] = {}
_processors: list[SpanProcessor] = []


def setup_tracing(
    service: str,
    *,
    otlp_endpoint: str | None = None,
    exporter: SpanExporter | None = None,
    export_timeout: float | None = None,
) -> TracerProvider:
    """Install (once) and return the process's tracer provider; add exporters as configured.
    ``export_timeout``: seconds one OTLP export may take, retries included (the exporter's
    default, 10 s, is for services; a command must not wait that long for a collector)."""
    global _provider
    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service}))
        trace.set_tracer_provider(_provider)
    added: list[SpanProcessor] = []
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        added.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=export_timeout)))
    if exporter is not None:
        added.append(SimpleSpanProcessor(exporter))
    for processor in added:
        _processors.append(processor)
        _provider.add_span_processor(processor)
        for provider in _service_providers.values():
            provider.add_span_processor(processor)
    return _provider


def shutdown_tracing(*, timeout_s: float = 30.0) -> None:
    """Export what is buffered, waiting at most ``timeout_s``."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=int(timeout_s * 1000))


class _WhenExported(trace.Tracer):
    """A tracer that records spans only while something exports them.

    With no exporter (the chart's default: ``otlp.endpoint`` empty) every span was still built,
    timed, given its attributes and dropped, a measurable share of the allocator's CPU
    (docs/benchmarks.md, "Measurements behind the code"). Then a span with a parent is the
    API's no-op span, which is the parent's context itself: nothing is recorded, and the
    ``traceparent`` a service passes on (and the ``trace_id`` its log lines carry) is the one
    it received, so logs still join up by trace id and a trace still joins up across the
    components that do export. A span without a
    parent (the CLI's submit, the demo's pod) is still made: it is what gives the request its
    trace id. Chosen per span, not once, because the module-level tracers are made at import,
    before :func:`setup_tracing` (or a test) adds an exporter."""

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
