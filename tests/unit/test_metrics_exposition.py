"""What a service's /metrics exposes: no ``_created`` series (a counter's creation time, read
by nothing) beside the counters the alerts and dashboard use."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.runtime.nats.bus import DEAD_LETTERS
from services.runtime.observe.metrics import RECONNECTS, service_registry


def test_counters_export_their_totals_and_no_created_series() -> None:
    RECONNECTS.labels("allocator").inc()
    DEAD_LETTERS.labels("allocator", "undecodable").inc()
    text = generate_latest(service_registry("allocator", ready=lambda: True)).decode()
    assert 'tandem_nats_reconnects_total{service="allocator"}' in text
    assert 'tandem_dead_letters_total{service="allocator",why="undecodable"}' in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line]
