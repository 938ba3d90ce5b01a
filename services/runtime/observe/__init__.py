"""Seeing what a service does: logs, traces, metrics and the port that serves them.

* :mod:`.logging` — structlog JSON lines carrying the ``trace_id``;
* :mod:`.tracing` — W3C trace context on NATS headers, the OTLP exporter, no span built when
  nothing exports;
* :mod:`.metrics` — the metrics every service shares and what one service's ``/metrics`` shows;
* :mod:`.opsserver` — the ops HTTP server: ``/healthz``, ``/readyz``, ``/metrics``;
* :mod:`.looplag` — event-loop lag and garbage-collection pauses.

These modules import nothing else of the kit: NATS reports into them (reconnects, consumer
lag: :mod:`services.runtime.nats.consumerlag`), never the other way round.
"""
