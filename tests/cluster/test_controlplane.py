"""The control plane itself: the pinned release answers, kwok plays a node with extended
resources, and the real scheduler places a pod by them (and refuses one that does not fit, with
the scheduler's own reason). The resource is not Tandem's: Tandem's webhook and policies, when a
release is installed, would (rightly) take a pod asking for tandem.io/* devices in hand."""

from __future__ import annotations

import uuid
from typing import Any

from tests.cluster.build import KUBERNETES_VERSION
from tests.cluster.controlplane import ControlPlane, node_body
from tests.cluster.release import eventually

WIDGET = "example.com/widget"  # an extended resource as any device plugin advertises one


def test_the_pinned_release_answers(control_plane: ControlPlane) -> None:
    assert control_plane.request("GET", "/version")["gitVersion"] == KUBERNETES_VERSION
    # A non-JSON endpoint as the admin (what bench-kube --profile reads /debug/pprof with).
    assert control_plane.get_raw("/readyz") == b"ok"


def test_the_scheduler_places_by_extended_resources_on_a_kwok_node(control_plane: ControlPlane) -> None:
    cp = control_plane
    node = f"smoke-{uuid.uuid4().hex[:6]}"
    cp.request(
        "POST", "/api/v1/nodes", node_body(node, gpus=0, nics=0, labels={"smoke": node}, extra={WIDGET: "8"})
    )
    ready = eventually(
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in cp.request("GET", f"/api/v1/nodes/{node}").get("status", {}).get("conditions", [])
        ),
        what="kwok node Ready",
    )
    assert ready

    def pod(name: str, gpus: int) -> dict[str, Any]:
        limits = {WIDGET: str(gpus)}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeSelector": {"smoke": node},
                "containers": [{"name": "c", "image": "busybox", "resources": {"limits": limits}}],
            },
        }

    cp.request("POST", "/api/v1/namespaces/default/pods", pod(f"{node}-fits", 8))
    cp.request("POST", "/api/v1/namespaces/default/pods", pod(f"{node}-too-big", 9))
    placed = eventually(
        lambda: (
            (p := cp.request("GET", f"/api/v1/namespaces/default/pods/{node}-fits"))["status"].get("phase")
            == "Running"
            and p
        ),
        what="pod running",
    )
    assert placed["spec"]["nodeName"] == node
    assert placed["status"]["podIP"]

    def unschedulable() -> str:
        status = cp.request("GET", f"/api/v1/namespaces/default/pods/{node}-too-big")["status"]
        for c in status.get("conditions", []):
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return str(c.get("message", ""))
        return ""

    message = eventually(unschedulable, what="too-big pod unschedulable")
    assert f"Insufficient {WIDGET}" in message
    for name in (f"{node}-fits", f"{node}-too-big"):
        cp.request("DELETE", f"/api/v1/namespaces/default/pods/{name}")
    cp.request("DELETE", f"/api/v1/nodes/{node}")
