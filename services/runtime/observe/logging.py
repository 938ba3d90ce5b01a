"""structlog configuration: JSON lines (or console for humans) carrying ``trace_id``."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from services.runtime.observe.tracing import current_trace_id


def _add_trace_id(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    trace_id = current_trace_id()
    if trace_id and "trace_id" not in event:
        event["trace_id"] = trace_id
    return event


class _Stderr:
    """``sys.stderr`` looked up at each write, not when logging is set up: the CLI sets up
    logging in-process, and under pytest the stderr of that moment is a capture file that is
    closed after the test (later log lines would raise "I/O operation on closed file")."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup_logging(*, level: str = "info", json: bool = True, service: str | None = None) -> None:
    """Configure structlog for the process; safe to call more than once."""
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_id,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
