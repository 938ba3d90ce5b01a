"""A command's spans are exported without making it wait (services.runtime.observe.tracing.CommandExport).

Each span goes to the exporter from a thread of its own as it ends; a flush waits for the
collector only as long as it is told, and shutting down (at exit) waits for nothing, however
long the exporter is stuck: the SDK's BatchSpanProcessor, flushed, exported on the caller's
thread for as long as the exporter took, retries included."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.runtime.observe import tracing
from services.runtime.observe.tracing import CommandExport


class Stuck(SpanExporter):
    """A collector that does not answer until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.got: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.got.extend(s.name for s in spans)
        self.started.set()
        self.release.wait(60)
        return SpanExportResult.SUCCESS


def _provider(processor: CommandExport) -> TracerProvider:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider


def test_spans_are_exported_from_another_thread_and_a_flush_waits_for_them() -> None:
    exporter = InMemorySpanExporter()
    threads: list[str] = []

    def make() -> InMemorySpanExporter:
        threads.append(threading.current_thread().name)
        return exporter

    processor = CommandExport(make)
    tracer = _provider(processor).get_tracer("test")
    with tracer.start_as_current_span("client.submit"):
        pass
    with tracer.start_as_current_span("client.release"):
        pass
    assert processor.force_flush(30_000) is True
    assert [s.name for s in exporter.get_finished_spans()] == ["client.submit", "client.release"]
    assert threads == ["tandem-span-export"]


def test_a_collector_that_does_not_answer_holds_neither_the_flush_nor_the_exit() -> None:
    stuck = Stuck()
    processor = CommandExport(lambda: stuck)
    provider = _provider(processor)
    with provider.get_tracer("test").start_as_current_span("client.submit"):
        pass
    assert provider.force_flush(10) is False  # given up on; the span is in flight, not lost here
    assert stuck.started.wait(60)
    provider.shutdown()  # returns while the export is still stuck (a test timeout otherwise)
    assert stuck.got == ["client.submit"] and not stuck.release.is_set()
    with provider.get_tracer("test").start_as_current_span("after.shutdown"):
        pass
    stuck.release.set()
    assert processor.force_flush(30_000) is True
    assert stuck.got == ["client.submit"]  # nothing is taken after shutdown


def test_an_exporter_that_cannot_be_made_drops_the_spans_and_flushes() -> None:
    def broken() -> SpanExporter:
        raise ValueError("bad endpoint")

    processor = CommandExport(broken)
    with _provider(processor).get_tracer("test").start_as_current_span("client.submit"):
        pass
    assert processor.force_flush(30_000) is True


def test_an_exporter_is_made_only_for_a_collector_that_takes_connections() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert tracing._takes_connections(f"http://127.0.0.1:{port}", timeout=5) is True
    assert tracing._takes_connections(f"http://127.0.0.1:{port}", timeout=5) is False  # closed now
    assert tracing._takes_connections("http://127.0.0.1:99999", timeout=5) is False


def test_no_exporter_to_make_drops_the_spans_and_flushes() -> None:
    processor = CommandExport(lambda: None)
    with _provider(processor).get_tracer("test").start_as_current_span("client.submit"):
        pass
    assert processor.force_flush(30_000) is True
