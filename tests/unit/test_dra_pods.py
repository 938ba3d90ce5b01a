"""A pod asking through DRA ResourceClaims (services.admission.drapods): the webhook's verdict,
the bridge's one request for the pod's claims, and what it writes on claims and pod. The running
path against the real control plane: tests/cluster/test_dra_bridge.py."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from schemas.config import DeviceClass
from schemas.messages import AssignedGpu, AssignedNic, Assignment, PodRef
from services.admission import drapods, names, podrules
from services.admission.draclaims import PARAMETERS_API, PARAMETERS_KIND, Claim
from services.admission.errors import InvalidClaim
from services.admission.webhook import Webhook, parse_review
from services.nodeagent.dra.slices import device_names
from services.topology import load_topology
from services.topology.files import builtin_names

CLASSES = {"default": DeviceClass()}


def spec(gpus: int = 2, nics: int = 2, **devices: Any) -> dict[str, Any]:
    params = {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, "scope": "pcie-switch"}
    return {
        "devices": {
            "requests": [
                {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": gpus}},
                {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": nics}},
            ],
            "config": [{"opaque": {"driver": "tandem.io", "parameters": params}}],
            **devices,
        }
    }


def pod(
    *claims: dict[str, Any], statuses: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "trainer", "namespace": "team", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"resourceClaims": list(claims), "containers": [{"name": "main"}], **extra},
    }
    if statuses is not None:
        body["status"] = {"resourceClaimStatuses": statuses}
    return body


def claim_obj(name: str, body: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"c-{name}", "resourceVersion": "3", **meta},
        "spec": body,
    }


def test_the_bridge_names_devices_as_the_node_agents_slices_do() -> None:
    for topology in builtin_names():
        topo = load_topology(topology)
        assert {dev: drapods.device_name(dev) for dev in device_names(topo)} == device_names(topo), topology


def test_a_pods_claims_are_found_by_name_or_through_the_claim_made_from_its_template() -> None:
    view = podrules.read_pod(
        pod(
            {"name": "shared", "resourceClaimName": "team-pool"},
            {"name": "own", "resourceClaimTemplateName": "pairs"},
            {"name": "later", "resourceClaimTemplateName": "pairs"},
            statuses=[{"name": "own", "resourceClaimName": "trainer-own-x7"}],
        )
    )
    assert drapods.claim_refs(view) == [
        drapods.ClaimRef("shared", "team-pool", None),
        drapods.ClaimRef("own", "trainer-own-x7", "pairs"),
        drapods.ClaimRef("later", None, "pairs"),
    ]
    assert drapods.asks_claims(view)


def test_the_webhook_gates_a_pod_whose_template_asks_tandems_classes() -> None:
    view = podrules.read_pod(pod({"name": "devices", "resourceClaimTemplateName": "pairs"}))
    verdict = drapods.admit(
        view,
        specs={("template", "pairs"): spec()},
        device_classes=CLASSES,
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
    )
    assert verdict is not None and verdict.allowed
    ops = {(op["op"], op["path"]): op["value"] for op in verdict.patch}
    assert ops[("add", "/spec/schedulingGates")] == [{"name": names.GATE}]
    assert ops[("add", "/metadata/labels")] == {names.MANAGED: "true"}
    assert names.TRACEPARENT in ops[("add", "/metadata/annotations")]


def test_the_webhook_leaves_a_pod_alone_when_no_claim_is_tandems() -> None:
    other = {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
    view = podrules.read_pod(pod({"name": "devices", "resourceClaimName": "theirs"}))
    assert (
        drapods.admit(view, specs={("claim", "theirs"): other}, device_classes=CLASSES, traceparent=None)
        is None
    )


def test_a_pod_asking_extended_resources_and_another_drivers_claims_is_judged_as_before() -> None:
    limits = {"resources": {"limits": {names.RESOURCE_GPU: "1"}}}
    view = podrules.read_pod(
        pod({"name": "devices", "resourceClaimName": "soon"}, containers=[{"name": "main", **limits}])
    )
    assert (
        drapods.admit(view, specs={("claim", "soon"): None}, device_classes=CLASSES, traceparent=None) is None
    )
    assert not drapods.asks_claims(view)


def test_a_claim_that_does_not_exist_yet_gates_the_pod_with_a_warning() -> None:
    view = podrules.read_pod(pod({"name": "devices", "resourceClaimName": "soon"}))
    verdict = drapods.admit(view, specs={("claim", "soon"): None}, device_classes=CLASSES, traceparent=None)
    assert verdict is not None and verdict.allowed and verdict.patch
    assert "does not exist yet" in verdict.warnings[0]


@pytest.mark.parametrize(
    ("body", "extra", "expected"),
    [
        (
            spec(constraints=[{"matchAttribute": "tandem.io/pcieSwitch"}]),
            {},
            "ResourceClaimTemplate team/pairs spec.devices.constraints: Tandem pairs each GPU",
        ),
        (
            spec(),
            {"_policy": "sometimes"},
            "the AllocationParameters of ResourceClaimTemplate team/pairs: policy: 'sometimes'",
        ),
        (spec(), {"nodeName": "gpu-0"}, "spec.nodeName is already set to 'gpu-0'"),
        (
            spec(),
            {"containers": [{"name": "main", "resources": {"limits": {names.RESOURCE_GPU: "1"}}}]},
            "both as resources",
        ),
    ],
)
def test_the_webhook_refuses_what_tandem_would_not_honour_naming_it(
    body: dict[str, Any], extra: dict[str, Any], expected: str
) -> None:
    policy = extra.pop("_policy", None)
    if policy is not None:
        body["devices"]["config"][0]["opaque"]["parameters"]["policy"] = policy
    view = podrules.read_pod(pod({"name": "devices", "resourceClaimTemplateName": "pairs"}, **extra))
    verdict = drapods.admit(
        view, specs={("template", "pairs"): body}, device_classes=CLASSES, traceparent=None
    )
    assert verdict is not None and not verdict.allowed and verdict.code == 403
    assert expected in verdict.message, verdict.message
    assert verdict.message.startswith("tandem: pod trainer: ")


def test_a_pod_that_uses_a_device_claim_cannot_ask_through_resource_claims_too() -> None:
    body = pod({"name": "devices", "resourceClaimTemplateName": "pairs"})
    body["metadata"]["annotations"] = {names.CLAIM: "reserved"}
    verdict = drapods.admit(
        podrules.read_pod(body),
        specs={("template", "pairs"): spec()},
        device_classes=CLASSES,
        traceparent=None,
    )
    assert verdict is not None and not verdict.allowed and verdict.code == 403
    assert "uses DeviceClaim 'reserved' (tandem.io/claim)" in verdict.message, verdict.message
    # Another driver's claims beside a DeviceClaim are not Tandem's to judge here.
    other = drapods.admit(
        podrules.read_pod(body),
        specs={
            ("template", "pairs"): {
                "devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "other"}}]}
            }
        },
        device_classes=CLASSES,
        traceparent=None,
    )
    assert other is None


def test_the_webhook_reads_the_templates_before_its_verdict() -> None:
    class Reader:
        def __init__(self) -> None:
            self.read: list[str] = []

        async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
            raise AssertionError("no claim is named")

        async def get_resource_claim_template(self, namespace: str, name: str) -> dict[str, Any]:
            self.read.append(f"{namespace}/{name}")
            return {"metadata": {"name": name}, "spec": {"spec": spec()}}

    reader = Reader()
    hook = Webhook(device_classes=CLASSES, claims=reader)
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "team",
            "object": pod({"name": "devices", "resourceClaimTemplateName": "pairs"}),
        },
    }
    body = json.dumps(review).encode()
    specs = asyncio.run(hook.claim_specs(parse_review(body)))
    status, doc = hook.answer(body, specs=specs)
    assert reader.read == ["team/pairs"]
    assert status == 200 and doc["response"]["allowed"]
    patch = json.loads(base64.b64decode(doc["response"]["patch"]))
    assert {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": names.GATE}]} in patch


def test_the_pods_request_covers_its_claims_and_is_pinned_to_a_shared_claims_node() -> None:
    view = podrules.read_pod(pod(nodeSelector={"pool": "a"}))
    claims = [Claim("team", "b-claim", "c-b", spec(1, 1)), Claim("team", "a-claim", "c-a", spec(1, 1))]
    made = drapods.pod_request(view, claims, device_classes=CLASSES, pin="gpu-3")
    assert made is not None
    req, devices = made
    assert (req.request_id, req.gpus, req.rdma, req.scope) == ("u-1.1", 2, 2, "pcie-switch")
    assert req.node_selector == {"pool": "a", drapods.HOSTNAME_LABEL: "gpu-3"}
    assert [s.claim for s in devices.slots] == ["a-claim", "a-claim", "b-claim", "b-claim"]


def test_a_request_the_device_class_refuses_names_the_claims_parameters() -> None:
    body = spec()
    body["devices"]["config"][0]["opaque"]["parameters"]["deviceClass"] = "fast"
    with pytest.raises(InvalidClaim, match="AllocationParameters of ResourceClaim team/c: deviceClass"):
        drapods.pod_request(
            podrules.read_pod(pod()), [Claim("team", "c", "u", body)], device_classes=CLASSES, pin=None
        )


def test_holding_a_claim_keeps_other_finalizers_and_letting_it_go_takes_only_tandems() -> None:
    obj = claim_obj("c", spec(), finalizers=["example.com/keep"], annotations={"team": "a"})
    obj["status"] = {"reservedFor": [{"resource": "pods", "name": "x", "uid": "1"}]}
    held = drapods.held(obj, request_id="u-1.1", pod="trainer")
    assert held["metadata"]["finalizers"] == ["example.com/keep", names.DRA_FINALIZER]
    assert held["metadata"]["annotations"] == {
        "team": "a",
        names.DRA_REQUEST: "u-1.1",
        names.DRA_POD: "trainer",
    }
    assert held["metadata"]["resourceVersion"] == "3" and held["spec"] == obj["spec"] and "status" not in held
    assert obj["metadata"]["finalizers"] == ["example.com/keep"]  # the cached object is not changed
    assert drapods.held_by(held) == "u-1.1"
    assert drapods.held_by(claim_obj("c", spec(), annotations={names.DRA_REQUEST: "u-1.1"})) is None
    freed = drapods.let_go(held)["metadata"]
    assert (freed["finalizers"], freed["annotations"]) == (["example.com/keep"], {"team": "a"})
    assert drapods.held_by(drapods.let_go(held)) is None


def test_the_gate_goes_with_the_assignment_recorded_and_no_node_affinity() -> None:
    raw = pod(schedulingGates=[{"name": "other"}, {"name": names.GATE}])
    a = Assignment(
        request_id="u-1.1",
        pod=PodRef(namespace="team", name="trainer", uid="u-1"),
        node="gpu-1",
        gpus=[AssignedGpu(index=0, uuid="GPU-0")],
        nics=[AssignedNic(name="mlx5_0", pf="mlx5_0")],
    )
    patch = drapods.ungate_patch(raw, a)
    assert patch["spec"] == {"schedulingGates": [{"name": "other"}]}
    assert patch["metadata"]["resourceVersion"] == "7"
    assert json.loads(patch["metadata"]["annotations"][names.ASSIGNMENT])["node"] == "gpu-1"
    assert drapods.device_names(a) == {"gpu0": "gpu0", "mlx5_0": "mlx5-0"}


def test_a_claims_node_is_read_from_its_allocation() -> None:
    allocated = claim_obj("c", spec())
    allocated["status"] = {
        "allocation": {
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-2"]}]}
                ]
            }
        }
    }
    assert drapods.allocated_node(allocated) == "gpu-2" and drapods.is_allocated(allocated)
    assert drapods.allocated_node(claim_obj("c", spec())) is None


def _claim(rv: str, *, held_by: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ml", "name": "p0-devices-x", "uid": "c1", "resourceVersion": rv}
    if held_by is not None:
        meta["finalizers"] = [names.DRA_FINALIZER]
        meta["annotations"] = {names.DRA_REQUEST: held_by}
    return {"metadata": meta, "spec": {"devices": {"requests": []}}}


def test_a_claim_event_older_than_the_bridges_own_write_does_not_undo_its_mark() -> None:
    # The watch can deliver the claim as the controller made it (no mark) after the bridge's
    # own write (finalizer + request) was cached; the request must still hold the claim, or
    # its assignment would find "claims gone" and release the devices it was just given.
    from services.admission.drabridge import DraBridge

    async def no_event(*_: Any, **__: Any) -> None:
        return None

    bridge = DraBridge(kube=None, bus=None, device_classes={}, record_event=no_event)  # type: ignore[arg-type]

    async def run() -> None:
        await bridge.on_claim_event("MODIFIED", _claim("20", held_by="pod-1.1"))
        await bridge.on_claim_event("ADDED", _claim("12", held_by=None))
        assert bridge.holds("pod-1.1")
        await bridge.on_claim_event("MODIFIED", _claim("25", held_by=None))  # newer: taken
        assert not bridge.holds("pod-1.1")

    asyncio.run(run())
