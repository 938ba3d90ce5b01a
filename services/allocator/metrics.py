"""Prometheus metrics of the allocator (served by ``services.runtime.ops`` on ``/metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("tandem_allocator_decisions_total", "Allocation decisions by outcome", ["outcome"])
DECISION_SECONDS = Histogram(
    "tandem_allocator_decision_seconds",
    "Time the core takes to decide one request",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1),
)
REQUEST_TO_ASSIGNMENT_SECONDS = Histogram(
    "tandem_allocator_request_to_assignment_seconds",
    "From the request's creation to its committed assignment (includes time spent pending)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 120, 600),
)
PAIRS = Counter("tandem_allocator_pairs_total", "GPU/NIC pairs assigned, by alignment scope", ["scope"])
COMMIT_CONFLICTS = Counter(
    "tandem_allocator_commit_conflicts_total", "Commits that lost the compare-and-set race and re-decided"
)
PENDING = Gauge("tandem_allocator_pending_requests", "Requests waiting for capacity")
DEVICES = Gauge("tandem_cluster_devices", "Devices in the allocator's view (ready nodes)", ["kind", "state"])
NODES = Gauge("tandem_allocator_nodes", "Nodes in the allocator's view by status", ["status"])
