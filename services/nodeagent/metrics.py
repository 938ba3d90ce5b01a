"""Node agent histograms kept out of :mod:`.service` (its counters live there)."""

from __future__ import annotations

from prometheus_client import Histogram

SUBMIT_TO_APPLIED_SECONDS = Histogram(
    "tandem_nodeagent_submit_to_applied_seconds",
    "From the request's creation (the assignment's requested_at) to its devices applied on the node",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300, 1800),
)
