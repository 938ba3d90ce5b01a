"""Prometheus metrics of the Kubernetes edge: the webhook's reviews and the pod bridge."""

from __future__ import annotations

from prometheus_client import Counter

REVIEW_OUTCOMES = ("ignored", "mutated", "denied", "bad_request")
REVIEWS = Counter(
    "tandem_admission_reviews_total",
    "AdmissionReviews answered: ignored (no Tandem resources), mutated, denied, bad_request",
    ["outcome"],
)
BIND_RESULTS = ("bound", "pod_gone")
BRIDGE_BINDS = Counter(
    "tandem_bridge_binds_total",
    "Assignments the bridge applied to their pod (bound) or released because the pod was gone",
    ["result"],
)
BRIDGE_REQUESTS = Counter("tandem_bridge_requests_total", "Allocation requests published for pods")
BRIDGE_RELEASES = Counter(
    "tandem_bridge_releases_total", "Releases published for pods deleted, finished or gone"
)
EVICTION_RESULTS = ("evicted", "blocked", "gone")
BRIDGE_EVICTIONS = Counter(
    "tandem_bridge_evictions_total",
    "Victim pods of a preemption: evicted through the Eviction API, blocked by a "
    "PodDisruptionBudget (429, retried), or already gone",
    ["result"],
)
for _outcome in REVIEW_OUTCOMES:
    REVIEWS.labels(_outcome)  # every outcome shown from 0
for _result in BIND_RESULTS:
    BRIDGE_BINDS.labels(_result)
for _result in EVICTION_RESULTS:
    BRIDGE_EVICTIONS.labels(_result)
