"""Traces in the real Jaeger (issue "Meet the real platform", item 6).

Every component of the installed release exports OTLP/HTTP to a Jaeger all-in-one built from
its Go module (``otlp.endpoint`` in the chart's values, nothing else). Jaeger's own query API
must then show each pod's life as **one trace**: the webhook's admission, the bridge's request,
bind and release, the allocator's decision, commit and free, the node agent's apply and
cleanup, each span parented inside the trace (no orphans) and carrying the ``service.name`` of
the process that made it. Also for a pod that had to wait for room.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from services.admission import names
from tests.cluster.release import Release, eventually
from tests.cluster.test_pod_life import fill_every_node, make_namespace, pod_of, training_pod

LIFE = {
    "admission.admit": "admission",
    "bridge.request": "admission",
    "allocator.decide": "allocator",
    "allocator.commit": "allocator",
    "bridge.bind": "admission",
    "nodeagent.apply": "nodeagent",
    "bridge.release": "admission",
    "nodeagent.cleanup": "nodeagent",
    "allocator.free": "allocator",
}


def trace_id_of(pod: dict[str, Any]) -> str:
    # W3C traceparent: version-traceid-spanid-flags
    return str(pod["metadata"]["annotations"][names.TRACEPARENT].split("-")[1])


def spans_by_name(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for span in trace["spans"]:
        out.setdefault(span["operationName"], []).append(span)
    return out


def orphans(trace: dict[str, Any]) -> list[str]:
    """Spans whose parent is not in the trace (``name: parent id``)."""
    ids = {s["spanID"] for s in trace["spans"]}
    return [
        f"{span['operationName']}: parent {r['spanID']}"
        for span in trace["spans"]
        for r in span.get("references", [])
        if r["refType"] == "CHILD_OF" and r["spanID"] not in ids
    ]


def assert_one_whole_trace(trace: dict[str, Any]) -> None:
    """Every span's parent is in the trace, but the root's; one root: ``admission.admit``."""
    assert not orphans(trace), f"not in the trace (orphans): {orphans(trace)}"
    roots = [
        s["operationName"]
        for s in trace["spans"]
        if not any(r["refType"] == "CHILD_OF" for r in s.get("references", []))
    ]
    assert roots == ["admission.admit"], roots


def service_of(trace: dict[str, Any], span: dict[str, Any]) -> str:
    return str(trace["processes"][span["processID"]]["serviceName"])


def full_trace(release: Release, trace_id: str, expected: dict[str, str]) -> dict[str, Any]:
    assert release.jaeger is not None

    def complete() -> dict[str, Any] | None:
        trace = release.jaeger.trace(trace_id) if release.jaeger else None
        if trace and set(expected) <= set(spans_by_name(trace)) and not orphans(trace):
            return trace
        return None

    # The services export in batches (BatchSpanProcessor, 5 s), Jaeger batches 200 ms: a span
    # can arrive before its parent (the allocator's commit, parent of the node agent's apply,
    # may be in the allocator's next batch), so the trace is read until it is whole; a parent
    # that never arrives fails the wait, naming the spans it left orphaned.
    return dict(eventually(complete, timeout=60, what=f"trace {trace_id} whole, with {sorted(expected)}"))


def test_a_pods_life_is_one_trace_in_jaeger(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    created = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("traced", gpus=1, nics=1))
    eventually(lambda: pod_of(cp, ns, "traced")["status"].get("phase") == "Running", what="traced running")
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/traced")
    eventually(
        lambda: [r for r in release.requests_of(ns, "traced") if r.state == "freed"], what="traced freed"
    )

    trace = full_trace(release, trace_id_of(created), LIFE)
    assert_one_whole_trace(trace)
    spans = spans_by_name(trace)
    for name, service in LIFE.items():
        assert {service_of(trace, s) for s in spans[name]} == {service}, name
    (admit,) = spans["admission.admit"]
    tags = {t["key"]: t["value"] for t in admit["tags"]}
    assert tags.get("k8s.namespace.name") == ns
    # With two replicas a decision may be handed to the replica owning the node (a decide span
    # naming the replica, the owner's its child): the one that placed the pod names the node.
    decide = next(s for s in spans["allocator.decide"] if any(t["key"] == "k8s.node.name" for t in s["tags"]))
    assert "pcie-switch" in json.dumps(decide["tags"])  # the scope the decision reached


def test_a_pod_that_waited_is_still_one_trace(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    fill_every_node(release, ns)
    created = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("patient", gpus=2, nics=2))
    eventually(
        lambda: any(r.state == "pending" for r in release.requests_of(ns, "patient")), what="patient pending"
    )
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/fill-0")
    eventually(lambda: pod_of(cp, ns, "patient")["status"].get("phase") == "Running", what="patient running")

    expected = {k: v for k, v in LIFE.items() if k in ("admission.admit", "bridge.request", "bridge.bind")}
    expected |= {"allocator.decide": "allocator", "nodeagent.apply": "nodeagent"}
    trace = full_trace(release, trace_id_of(created), expected)
    assert_one_whole_trace(trace)
    decisions = spans_by_name(trace)["allocator.decide"]
    # At least one decision that could not place it (ERROR) before the one that did.
    errors = Counter(any(t["key"] == "error" and t["value"] is True for t in s["tags"]) for s in decisions)
    assert errors[True] >= 1 and errors[False] >= 1, [s["tags"] for s in decisions]
    release.empty_namespace(ns)
