"""Spans are recorded only while an exporter is installed (services.runtime.observe.tracing._WhenExported).

With tracing off, a span under a received context must pass that context on unchanged (the
next component's spans, and every log line's trace id, stay in the request's trace), and a
span without a parent must still start a trace; once an exporter is installed, even a tracer
made before it records."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.runtime.observe import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _made_before_export() -> tuple[tracing.trace.Tracer, InMemorySpanExporter, SimpleSpanProcessor]:
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    return tracing._WhenExported(provider.get_tracer("test")), exporter, processor


def test_without_an_exporter_a_child_span_passes_the_received_context_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "_processors", [])
    tracer, exporter, _ = _made_before_export()
    received = tracing.context_from_traceparent(PARENT)
    with tracer.start_as_current_span("allocator.decide", context=received) as span:
        span.set_attributes({"tandem.request_id": "r1"})  # accepted, and dropped
        assert not span.is_recording()
        assert tracing.current_traceparent() == PARENT
        assert tracing.current_trace_id() == "0af7651916cd43dd8448eb211c80319c"
    assert exporter.get_finished_spans() == ()


def test_without_an_exporter_a_span_without_parent_still_starts_a_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "_processors", [])
    tracer, _, _ = _made_before_export()
    with tracer.start_as_current_span("client.submit"):
        trace_id = tracing.current_trace_id()
        sent = tracing.current_traceparent()
    assert trace_id is not None and len(trace_id) == 32
    assert sent is not None and sent.split("-")[1] == trace_id


def test_a_tracer_made_before_the_exporter_records_once_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracer, exporter, processor = _made_before_export()
    monkeypatch.setattr(tracing, "_processors", [processor])
    with tracer.start_as_current_span("allocator.decide", context=tracing.context_from_traceparent(PARENT)):
        child = tracing.current_traceparent()
    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["allocator.decide"]
    parent = spans[0].parent
    assert parent is not None and format(parent.span_id, "016x") == "b7ad6b7169203331"
    assert child is not None and child != PARENT and child.split("-")[1] == PARENT.split("-")[1]
    span = tracer.start_span("plain", tracing.context_from_traceparent(PARENT))
    span.end()
    assert [s.name for s in exporter.get_finished_spans()][-1] == "plain"
