"""What the bridge writes on a pod and about it (pure: no HTTP, no NATS, no Kubernetes client).

The webhook's rules (:mod:`.podrules`) decide what a pod asks; once the allocator has chosen
its devices, the bridge writes the outcome back with the pieces built here:

* the **binding**: one JSON merge patch that sets the ``tandem.io/assignment`` annotation,
  removes Tandem's scheduling gate and narrows the pod's required node affinity to the chosen
  node (:func:`bind_patch`); the annotation is also how the bridge later knows a pod is bound
  (:func:`is_bound`) and which node's agent must clean up after it (:func:`release_node`);
* the **Events** on the pod (``kubectl describe pod``): one Event per pod and reason, whose
  count and ``lastTimestamp`` move on repeats instead of a stream of new objects
  (:func:`event_name`, :func:`event_due`, :func:`flush_due`, :func:`event_body`,
  :func:`event_update`).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import codec
from schemas.messages import AssignedGpu, AssignedNic, Assignment, Pair
from schemas.topology import ScopeName
from services.admission import names
from services.admission.podrules import PodView, read_pod

# ---------------------------------------------------------------------------------------------
# the binding: assignment annotation and node affinity


class AssignmentAnnotation(msgspec.Struct, kw_only=True):
    """What ``tandem.io/assignment`` holds: the devices chosen, for humans and the CLI.

    Every field is always written (no omitted defaults), so a reader never has to know them.
    """

    request_id: str
    node: str
    gpus: list[AssignedGpu]
    nics: list[AssignedNic] = []
    pairs: list[Pair] = []
    scope: ScopeName = "node"


def assignment_annotation(a: Assignment) -> str:
    ann = AssignmentAnnotation(
        request_id=a.request_id, node=a.node, gpus=a.gpus, nics=a.nics, pairs=a.pairs, scope=a.scope
    )
    return codec.to_json(ann).decode()


def read_assignment_annotation(pod: PodView) -> AssignmentAnnotation | None:
    raw = pod.annotations.get(names.ASSIGNMENT)
    if not raw:
        return None
    try:
        return codec.from_json(raw, AssignmentAnnotation)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def is_bound(pod: PodView, request_id: str) -> bool:
    """Whether the assignment for ``request_id`` is already applied (annotation set, gate gone)."""
    ann = read_assignment_annotation(pod)
    return ann is not None and ann.request_id == request_id and names.GATE not in pod.gates


NODE_NAME_FIELD = "metadata.name"


def _with_node(terms: list[dict[str, Any]], node: str) -> list[dict[str, Any]]:
    """Narrow every required node-selector term to ``node``.

    Terms are ORed, so the node requirement is ANDed into each; on a gated pod Kubernetes allows
    adding requirements to existing terms (never loosening them), and allows setting terms when
    there are none. ``matchFields metadata.name`` names the node itself, whatever its labels.
    """
    req = {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}
    if not terms:
        return [{"matchFields": [req]}]
    out = []
    for term in terms:
        t = dict(term)
        fields = [f for f in t.get("matchFields") or [] if f != req]
        t["matchFields"] = [*fields, req]
        out.append(t)
    return out


def bind_patch(raw_pod: dict[str, Any], assignment: Assignment) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) that binds a gated pod to its assignment.

    Merge patch replaces lists whole, so the gate list and the node-selector terms are computed
    here in full. ``metadata.resourceVersion`` in the patch makes the API server reject it with
    409 if the pod changed since it was read (another gate removed, affinity edited): the
    bridge then re-reads and recomputes instead of overwriting someone else's change.
    """
    pod = read_pod(raw_pod)
    spec = raw_pod.get("spec") or {}
    affinity = spec.get("affinity") or {}
    node_aff = affinity.get("nodeAffinity") or {}
    required = node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = list(required.get("nodeSelectorTerms") or [])
    gates = [{"name": g} for g in pod.gates if g != names.GATE]
    metadata: dict[str, Any] = {"annotations": {names.ASSIGNMENT: assignment_annotation(assignment)}}
    if pod.metadata.resourceVersion:
        metadata["resourceVersion"] = pod.metadata.resourceVersion
    return {
        "metadata": metadata,
        "spec": {
            "schedulingGates": gates or None,
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": _with_node(terms, assignment.node)
                    }
                }
            },
        },
    }


def release_node(pod: PodView) -> str | None:
    """The node whose agent must clean up: the assignment's, else where the pod ran."""
    ann = read_assignment_annotation(pod)
    if ann is not None:
        return ann.node
    return pod.spec.nodeName or None


# ---------------------------------------------------------------------------------------------
# Events on the pod


def event_name(pod_name: str, uid: str) -> str:
    """One Event object per pod and request, so repeats update it instead of adding more."""
    digest = hashlib.sha256(uid.encode()).hexdigest()[:10]
    return f"{pod_name[:200]}.tandem-{digest}"


@dataclass(slots=True)
class EventState:
    """What the bridge last wrote for one Event (kept in memory, rebuilt from the API)."""

    count: int = 0
    written_count: int = 0
    message: str = ""
    written_at: float = 0.0


def event_due(state: EventState, *, message: str, now: float, min_interval: float) -> bool:
    """Record one more occurrence; return whether to write the Event now.

    A new or changed message is written at once; a repeat of the same message only after
    ``min_interval`` (its count accumulates meanwhile), so a pod that stays pending while the
    allocator retries gets one Event whose count and lastTimestamp move, not a stream of writes.
    """
    state.count += 1
    changed = message != state.message
    state.message = message
    return state.written_count == 0 or changed or now - state.written_at >= min_interval


def flush_due(state: EventState, *, now: float, min_interval: float) -> bool:
    """Whether occurrences held back by :func:`event_due` should be written now."""
    return (
        state.written_count > 0
        and state.count > state.written_count
        and now - state.written_at >= min_interval
    )


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(
    pod: PodView,
    *,
    name: str,
    reason: str,
    message: str,
    count: int,
    now: float,
    instance: str,
    involved: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A core/v1 Event on the pod (``kubectl describe pod`` shows it), or on ``involved``
    (another object of the pod's namespace, such as its ResourceClaim)."""
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": pod.metadata.namespace or ""},
        "involvedObject": involved
        or {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.metadata.name or "",
            "namespace": pod.metadata.namespace or "",
            "uid": pod.metadata.uid or "",
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning",
        "count": count,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "source": {"component": names.EVENT_COMPONENT},
        "reportingComponent": f"{names.PREFIX}bridge",
        "reportingInstance": instance[:128],
    }


def event_update(*, message: str, count: int, now: float) -> dict[str, Any]:
    """Merge patch that moves an existing Event on: new count, lastTimestamp and message."""
    return {"count": count, "lastTimestamp": rfc3339(now), "message": message[:1024]}
