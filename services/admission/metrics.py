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
for _outcome in REVIEW_OUTCOMES:
    REVIEWS.labels(_outcome)  # every outcome shown from 0
for _result in BIND_RESULTS:
    BRIDGE_BINDS.labels(_result)
