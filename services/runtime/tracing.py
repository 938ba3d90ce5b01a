"""Tracing: one OpenTelemetry tracer provider per process, W3C trace context on NATS headers.

Every publish injects ``traceparent`` into the message headers and every handler extracts it,
so one allocation is one trace across admission, allocator and node agent. Export is OTLP/HTTP
when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. Jaeger's :4318); tests
install an in-memory exporter through :func:`setup_tracing`'s ``exporter`` argument.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


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
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if exporter is not None:
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    return _provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's W3C trace context (added to ``headers``)."""
    out = dict(headers or {})
    _propagator.inject(out)
    return out


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a received message's headers carry (empty context when none)."""
    return _propagator.extract(dict(headers or {}))


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    return extract({"traceparent": traceparent} if traceparent else None)


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def current_traceparent() -> str | None:
    return inject().get("traceparent")
