"""Pure decisions of the Kubernetes edge: the pod rules and allocation request
(services/admission/podrules.py), the bind patch, release node and Events (podwrites.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest

from schemas.config import DeviceClass
from schemas.messages import AssignedGpu, AssignedNic, Assignment, PodRef
from services.admission import names, podrules, podwrites
from services.admission.errors import InvalidPod, PolicyError
from tests.unit.test_admission_helpers import deployment_pod, merge_patch

CLASSES = {"default": DeviceClass(), "roce": DeviceClass(scope="numa", pairing="shared", policy="required")}


def persisted(
    pod: dict[str, Any], *, name: str = "trainer-0", uid: str = "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b"
) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"].update(name=name, uid=uid, resourceVersion="4711")
    pod["metadata"].setdefault("labels", {})[names.MANAGED] = "true"
    pod["spec"]["schedulingGates"] = [{"name": "example.com/quota"}, {"name": names.GATE}]
    return pod


def assignment(node: str = "n1") -> Assignment:
    return Assignment(
        request_id="6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b.1",
        pod=PodRef("ml", "trainer-0", "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b"),
        node=node,
        gpus=[AssignedGpu(index=3, uuid="GPU-3")],
        nics=[AssignedNic(name="mlx5_3", pf="mlx5_3")],
    )


def test_allocation_request_carries_class_defaults_and_node_selector() -> None:
    pod = persisted(
        deployment_pod(gpu="2", rdma="1", annotations={names.DEVICE_CLASS: "roce", names.PRIORITY: "7"}),
    )
    pod["spec"]["nodeSelector"] = {"pool": "h100"}
    req = podrules.allocation_request(podrules.read_pod(pod), device_classes=CLASSES)
    assert req is not None
    assert req.request_id == "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b.1"
    assert (req.gpus, req.rdma, req.scope, req.policy, req.pairing, req.priority) == (
        2,
        1,
        "numa",
        "required",
        "shared",
        7,
    )
    assert req.device_class == "roce"
    assert req.node_selector == {"pool": "h100"}
    assert req.pod == PodRef("ml", "trainer-0", "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b")


def test_allocation_request_needs_a_persisted_pod() -> None:
    with pytest.raises(InvalidPod, match="no name or uid"):
        podrules.allocation_request(podrules.read_pod(deployment_pod()), device_classes=CLASSES)


def test_annotation_edited_while_gated_is_rejected_by_the_same_rule() -> None:
    pod = persisted(deployment_pod(annotations={names.POLICY: "maybe"}))
    with pytest.raises(PolicyError, match=r"tandem\.io/policy: 'maybe' is not one of required, preferred"):
        podrules.allocation_request(podrules.read_pod(pod), device_classes=CLASSES)


def test_zero_counts_are_not_a_tandem_pod() -> None:
    pod = podrules.read_pod(deployment_pod(gpu="0", rdma="0"))
    assert podrules.resolve(pod, device_classes=CLASSES) is None


def test_bind_patch_removes_only_our_gate_and_pins_the_node() -> None:
    pod = persisted(deployment_pod())
    patch = podwrites.bind_patch(pod, assignment("gpu-7"))
    assert patch["metadata"]["resourceVersion"] == "4711"  # optimistic lock
    assert patch["spec"]["schedulingGates"] == [{"name": "example.com/quota"}]
    bound = merge_patch(pod, patch)
    terms = bound["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}
        ]
    }
    ann = json.loads(bound["metadata"]["annotations"][names.ASSIGNMENT])
    assert ann == {
        "request_id": "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b.1",
        "node": "gpu-7",
        "gpus": [{"index": 3, "uuid": "GPU-3"}],
        "nics": [{"name": "mlx5_3", "pf": "mlx5_3"}],
        "pairs": [],
        "scope": "node",
    }
    kubernetes_validate.validate(bound, kubernetes_validate.latest_version(), strict=True)
    rid = "6c1f0b7e-1d7a-4b8e-a1f2-0c9d8e7f6a5b.1"
    assert podwrites.is_bound(podrules.read_pod(pod), rid) is False
    assert podwrites.is_bound(podrules.read_pod(bound), rid) is True  # our gate gone; others are not ours
    assert podwrites.is_bound(podrules.read_pod(bound), "other.1") is False


def test_bind_patch_narrows_every_existing_required_term() -> None:
    pod = persisted(deployment_pod())
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]}}
            ],
        }
    }
    bound = merge_patch(pod, podwrites.bind_patch(pod, assignment("n1")))
    aff = bound["spec"]["affinity"]["nodeAffinity"]
    terms = aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    pin = {"key": "metadata.name", "operator": "In", "values": ["n1"]}
    assert [t["matchFields"] for t in terms] == [[pin], [pin]]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]  # kept: only narrowed
    assert aff["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1  # untouched
    kubernetes_validate.validate(bound, kubernetes_validate.latest_version(), strict=True)


def test_release_node_prefers_the_assignment_then_the_bound_node() -> None:
    pod = persisted(deployment_pod())
    assert podwrites.release_node(podrules.read_pod(pod)) is None
    pod["spec"]["nodeName"] = "n9"
    assert podwrites.release_node(podrules.read_pod(pod)) == "n9"
    pod["metadata"]["annotations"] = {names.ASSIGNMENT: podwrites.assignment_annotation(assignment("n1"))}
    assert podwrites.release_node(podrules.read_pod(pod)) == "n1"


def test_event_throttle_writes_new_reasons_at_once_and_repeats_after_the_interval() -> None:
    state = podwrites.EventState()
    due = []
    for t, msg in [(0, "a"), (1, "a"), (2, "a"), (3, "b"), (40, "b"), (41, "b")]:
        d = podwrites.event_due(state, message=msg, now=t, min_interval=30)
        if d:
            state.written_count, state.written_at = state.count, t
        due.append(d)
    assert due == [True, False, False, True, True, False]
    assert state.count == 6 and state.written_count == 5


def test_event_body_is_a_valid_core_event() -> None:
    pod = podrules.read_pod(persisted(deployment_pod()))
    name = podwrites.event_name("trainer-0", "uid/AllocationFailed")
    assert name.startswith("trainer-0.tandem-") and name == podwrites.event_name(
        "trainer-0", "uid/AllocationFailed"
    )
    body = podwrites.event_body(
        pod, name=name, reason="AllocationFailed", message="x" * 5000, count=2, now=0, instance="i"
    )
    assert len(body["message"]) == 1024 and body["count"] == 2
    kubernetes_validate.validate(body, kubernetes_validate.latest_version(), strict=True)


def test_flush_catches_up_held_back_counts_after_the_interval() -> None:
    state = podwrites.EventState(count=1, written_count=1, message="a", written_at=0)
    assert podwrites.flush_due(state, now=100, min_interval=30) is False  # nothing held back
    podwrites.event_due(state, message="a", now=1, min_interval=30)  # held back
    assert podwrites.flush_due(state, now=10, min_interval=30) is False
    assert podwrites.flush_due(state, now=31, min_interval=30) is True
