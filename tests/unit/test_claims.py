"""DeviceClaim rules (services.admission.claims): bad specs name the field; the request a claim
becomes; who may use a claim; when a reservation expires; the CRD agrees with the code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from schemas import codec
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, AssignedGpu, AssignedMig, Assignment, PodRef
from schemas.topology import MIG_PROFILE_PATTERN
from services.admission import claims, names, podrules
from services.admission.claims import ClaimState
from services.admission.errors import InvalidClaim
from tests.celchecks import failing

CLASSES = {
    "default": DeviceClass(),
    "numa": DeviceClass(scope="numa", policy="required", sharing="hami"),
    "shared": DeviceClass(sharing="hami"),
    "vf": DeviceClass(nic_function="vf"),
}
CRD = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem" / "crds" / "deviceclaims.yaml"
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def claim(spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.io/v1alpha1",
        "kind": "DeviceClaim",
        "metadata": {
            "name": "c1",
            "namespace": "ml",
            "uid": "9f1c",
            "creationTimestamp": "2027-01-15T08:00:00Z",
            **meta,
        },
        "spec": spec,
    }


def request(spec: dict[str, Any]) -> Any:
    return claims.claim_request(claims.read_claim(claim(spec)), device_classes=CLASSES)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"gpus": "two"}, "DeviceClaim ml/c1: Expected `int`, got `str` - at `spec.gpus`"),
        ({"gpus": 65}, "DeviceClaim ml/c1: Expected `int` <= 64 - at `spec.gpus`"),
        ({"gpus": 1, "gpu": 1}, "DeviceClaim ml/c1: unknown field `gpu`"),
        ({"gpus": 0, "rdma": 0}, "DeviceClaim ml/c1: spec.gpus and spec.rdma are both 0"),
        (
            {"gpus": 1, "deviceClass": "h100"},
            "spec.deviceClass: unknown device class 'h100' (known: default, numa, shared, vf)",
        ),
        ({"gpus": 1, "rdma": 1, "deviceClass": "vf"}, "class 'vf' hands out NIC VFs, which a claim cannot"),
        ({"gpus": 1, "scope": "rack"}, "spec.scope: 'rack' is not one of pcie-switch, pcie-root, numa"),
        ({"gpus": 1, "policy": "maybe"}, "spec.policy: 'maybe' is not one of required, preferred"),
        (
            {"gpus": 2, "rdma": 1, "pairing": "per-gpu"},
            "spec.pairing: per-gpu gives every GPU its own NIC, so it needs as many spec.rdma as spec.gpus",
        ),
        ({"gpus": 1, "priority": 2_000_000}, "Expected `int` <= 1000000 - at `spec.priority`"),
        (
            {"gpus": 1, "shares": {"gpuCoresPercent": 150}},
            "Expected `int` <= 100 - at `spec.shares.gpuCoresPercent`",
        ),
        ({"gpus": 1, "shares": {}}, "spec.shares: give gpuMemoryMiB and/or gpuCoresPercent"),
        ({"rdma": 1, "shares": {"gpuMemoryMiB": 1024}}, "spec.shares needs spec.gpus > 0"),
        # The class must allow shares: the allocator would refuse them (services.request).
        (
            {"gpus": 1, "shares": {"gpuMemoryMiB": 1024}},
            "spec.shares.gpuMemoryMiB: device class 'default' does not allow GPU shares (sharing: none)",
        ),
        (
            {"gpus": 1, "migProfile": "1g"},
            'DeviceClaim ml/c1: spec.migProfile: \'1g\' is not a MIG profile like "1g.10gb" or "3g.40gb"',
        ),
        (
            {"gpus": 1, "migProfile": 7},
            "DeviceClaim ml/c1: Expected `str | null`, got `int` - at `spec.migProfile`",
        ),
        (
            {"gpus": 1, "migProfile": "1g.10gb", "shares": {"gpuMemoryMiB": 1024}},
            "DeviceClaim ml/c1: spec.migProfile and spec.shares.gpuMemoryMiB: a MIG instance is not shared",
        ),
        (
            {"rdma": 1, "migProfile": "1g.10gb"},
            "DeviceClaim ml/c1: spec.migProfile '1g.10gb' needs at least one instance: ask it in spec.gpus",
        ),
        ({"gpus": 1, "expiresAfter": "soon"}, "spec.expiresAfter: 'soon' is not a duration like 90s"),
        ({"gpus": 1, "expiresAfter": "0s"}, "spec.expiresAfter: '0s' must be more than 0s"),
        ({"gpus": 1, "expiresAt": "tomorrow"}, "spec.expiresAt: 'tomorrow' is not an RFC 3339 time"),
        (
            {"gpus": 1, "expiresAt": "2027-01-15T09:00:00"},
            "spec.expiresAt: '2027-01-15T09:00:00' has no time zone",
        ),
        (
            {"gpus": 1, "expiresAfter": "1h", "expiresAt": "2027-01-15T09:00:00Z"},
            "spec.expiresAfter and spec.expiresAt: set one of them, not both",
        ),
    ],
)
def test_bad_specs_are_refused_naming_the_claim_and_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidClaim) as info:
        request(spec)
    assert message in str(info.value)
    assert "Traceback" not in str(info.value)


def test_metadata_without_a_uid_is_refused() -> None:
    obj = claim({"gpus": 1})
    del obj["metadata"]["uid"]
    with pytest.raises(InvalidClaim, match=r"metadata\.uid are required"):
        claims.read_claim(obj)


def test_a_claim_becomes_a_request_with_class_defaults_marker_and_shares() -> None:
    req = request(
        {
            "deviceClass": "numa",
            "gpus": 2,
            "rdma": 2,
            "priority": 7,
            "shareable": True,
            "expiresAfter": "1h30m",
            "shares": {"gpuMemoryMiB": 20480, "gpuCoresPercent": 50},
        }
    )
    assert req.request_id == "claim-9f1c" and claims.is_claim_request(req.request_id)
    assert req.pod == PodRef(namespace="ml", name="c1", uid="9f1c")
    assert (req.gpus, req.rdma, req.device_class, req.priority) == (2, 2, "numa", 7)
    assert (req.scope, req.policy, req.pairing) == ("numa", "required", "per-gpu")  # from the class
    assert req.claim is not None and req.claim.name == "c1" and req.claim.shareable
    assert req.claim.expires_at == T0 + 5400
    assert (req.gpu_memory_mib, req.gpu_cores_percent) == (20480, 50)
    assert request({"gpus": 1, "expiresAt": "2027-01-15T10:00:00Z"}).claim.expires_at == T0 + 7200
    assert request({"gpus": 1}).claim.expires_at is None
    assert request({"gpus": 1}).mig_profile is None


def test_a_mig_claim_becomes_a_request_for_mig_instances() -> None:
    req = request({"gpus": 2, "rdma": 1, "migProfile": "3g.40gb", "shareable": True})
    assert (req.gpus, req.rdma, req.mig_profile, req.pairing) == (2, 1, "3g.40gb", "shared")
    assert (req.gpu_memory_mib, req.gpu_cores_percent) == (None, None)
    assert req.claim is not None and req.claim.shareable
    # The allocator reads the same request off the wire.
    back = codec.ALLOC_EVENT.decode(codec.encode(req))
    assert isinstance(back, AllocationRequest) and back.mig_profile == "3g.40gb"
    assert request({"gpus": 1, "migProfile": "1g.12gb+me"}).mig_profile == "1g.12gb+me"


def test_durations() -> None:
    assert claims.parse_duration("90s", where="x") == 90
    assert claims.parse_duration("2h", where="x") == 7200
    assert claims.parse_duration("1d2h3m4s", where="x") == 93784
    with pytest.raises(InvalidClaim, match="at most 366d"):
        claims.parse_duration("400d", where="x")


def _state(spec: dict[str, Any], *, assigned: bool = True, users: dict[str, str] | None = None) -> ClaimState:
    view = claims.read_claim(claim(spec))
    state = ClaimState(view=view, request=claims.claim_request(view, device_classes=CLASSES))
    if spec.get("migProfile"):
        mig = AssignedMig(profile=spec["migProfile"], uuid="MIG-0a", device="gpu0-mig9-0")
        gpus = [AssignedGpu(index=0, uuid="GPU-0", mig=mig)]
    else:
        gpus = [AssignedGpu(index=0, uuid="GPU-0")]
    if assigned:
        state.assignment = Assignment(
            request_id=state.request_id,
            pod=state.request.pod,  # type: ignore[union-attr]
            node="n1",
            gpus=gpus,
        )
        state.phase = "Allocated"
    state.users = dict(users or {})
    return state


def test_who_may_use_a_claim() -> None:
    def why(state: ClaimState | None, *, uid: str = "p2", gpus: int = 1, rdma: int = 0) -> str | None:
        return claims.blocking_reason(state, claim="c1", pod_uid=uid, gpus=gpus, rdma=rdma)

    assert why(None) == "DeviceClaim 'c1' does not exist in this namespace; the pod waits for it"
    assert why(_state({"gpus": 1}, assigned=False)) == "DeviceClaim 'c1' is not allocated yet"
    assert why(_state({"gpus": 1})) is None
    assert "used by pod first" in str(why(_state({"gpus": 1}, users={"p1": "first"})))
    assert why(_state({"gpus": 1}, users={"p2": "me"})) is None  # the user itself
    assert why(_state({"gpus": 1, "shareable": True}, users={"p1": "first"})) is None
    assert "holds 1 and 0" in str(why(_state({"gpus": 1}), gpus=2))
    released = _state({"gpus": 1})
    released.released, released.phase, released.reason = True, "Released", "reservation expired"
    assert why(released) == "DeviceClaim 'c1' was released (reservation expired); its devices are gone"


def test_a_pod_on_a_claim_asks_the_claims_kind_of_gpu_device() -> None:
    """Kubelet hands a pod its devices through the resource it asks (tandem.io/mig for MIG
    instances, tandem.io/gpu-share for shares), so a pod asking the claim's counts of another
    kind of device is not bound: it waits, told what to ask."""

    def why(state: ClaimState, **kind: Any) -> str | None:
        return claims.blocking_reason(state, claim="c1", pod_uid="p2", gpus=1, rdma=0, **kind)

    mig = _state({"gpus": 1, "migProfile": "1g.10gb"})
    assert why(mig, mig_profile="1g.10gb") is None
    assert why(mig) == (
        "the pod asks for whole GPUs, but DeviceClaim 'c1' holds MIG instances 1g.10gb; a pod using it "
        "asks for tandem.io/mig with annotation tandem.io/mig-profile: 1g.10gb"
    )
    assert "the pod asks for MIG instances 3g.40gb, but DeviceClaim 'c1' holds MIG instances 1g.10gb" in str(
        why(mig, mig_profile="3g.40gb")
    )
    whole = _state({"gpus": 1})
    assert why(whole) is None
    assert why(whole, mig_profile="1g.10gb") == (
        "the pod asks for MIG instances 1g.10gb, but DeviceClaim 'c1' holds whole GPUs; a pod using it "
        "asks for tandem.io/gpu"
    )
    share = _state({"gpus": 1, "deviceClass": "shared", "shares": {"gpuMemoryMiB": 20480}})
    assert why(share, gpu_memory_mib=20480) is None
    assert why(share) == (
        "the pod asks for whole GPUs, but DeviceClaim 'c1' holds shares of GPUs; a pod using it asks "
        "for tandem.io/gpu-share with annotations tandem.io/gpu-memory-mib: 20480"
    )
    # An RDMA-only claim has no GPU kind to match.
    assert claims.blocking_reason(_state({"rdma": 1}), claim="c1", pod_uid="p", gpus=0, rdma=1) is None


def test_a_reservation_expires_at_its_deadline_only_when_no_pod_uses_it() -> None:
    state = _state({"gpus": 1, "expiresAfter": "10m"})
    assert not claims.expiry_due(state, now=T0 + 599)
    assert claims.expiry_due(state, now=T0 + 600)
    state.users = {"p1": "first"}
    assert not claims.expiry_due(state, now=T0 + 6000)  # in use: released when the pod ends
    state.users = {}
    state.released = True
    assert not claims.expiry_due(state, now=T0 + 6000)  # once
    assert not claims.expiry_due(_state({"gpus": 1}), now=T0 + 10**9)  # no deadline


def test_status_patch_and_record() -> None:
    state = _state({"gpus": 1, "expiresAfter": "1h"}, users={"p1": "first"})
    assert claims.status_patch(state) == {
        "status": {
            "phase": "Allocated",
            "requestId": "claim-9f1c",
            "node": "n1",
            "devices": ["gpu0"],
            "pods": ["first"],
            "reason": "",
            "expiresAt": "2027-01-15T09:00:00Z",
        }
    }
    record = claims.claim_record(state, now=T0)
    assert (record.phase, record.node, record.devices, record.pods) == (
        "Allocated",
        "n1",
        ["gpu0"],
        ["first"],
    )
    state.released, state.phase = True, "Released"
    assert claims.status_patch(state)["status"]["node"] is None  # a released claim holds nothing


# -- the CRD ---------------------------------------------------------------------------------


def test_the_crd_is_a_valid_custom_resource_definition_for_the_names_the_code_uses() -> None:
    crd = yaml.safe_load(CRD.read_text())
    kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
    spec = crd["spec"]
    assert spec["group"] == names.CLAIM_GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == names.CLAIM_KIND and spec["names"]["plural"] == names.CLAIM_PLURAL
    (version,) = spec["versions"]
    assert version["name"] == names.CLAIM_VERSION and version["subresources"] == {"status": {}}


def test_the_crd_schema_and_the_code_know_the_same_spec_fields() -> None:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    fields = {f.encode_name for f in msgspec.structs.fields(claims.ClaimSpec)}
    assert set(schema) == fields
    shares = {f.encode_name for f in msgspec.structs.fields(claims.Shares)}
    assert set(schema["shares"]["properties"]) == shares
    # The same MIG profile pattern as the request's (schemas/topology.py).
    assert schema["migProfile"]["pattern"] == MIG_PROFILE_PATTERN
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status) == set(claims.status_patch(_state({"gpus": 1}))["status"])


def test_the_crd_refuses_bad_mig_claims_with_the_request_rules() -> None:
    """What the API server checks: the pattern (here with jsonschema) and the spec's CEL rules
    (evaluated with cel-python on the spec with the schema's defaults, as the API server does;
    the update-only rule ``self == oldSelf`` aside)."""
    import celpy

    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(claim({"gpus": 2, "migProfile": "1g.10gb"}), schema)
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(claim({"gpus": 2, "migProfile": "10gb"}), schema)
    spec_schema = schema["properties"]["spec"]
    defaults = {k: v["default"] for k, v in spec_schema["properties"].items() if "default" in v}
    env = celpy.Environment()
    rules = [
        (r["message"], env.program(env.compile(r["rule"])))
        for r in spec_schema["x-kubernetes-validations"]
        if "oldSelf" not in r["rule"]
    ]

    def refused(spec: dict[str, Any]) -> list[str]:
        return failing(rules, {"self": celpy.json_to_cel({**defaults, **spec})})

    assert refused({"gpus": 2, "rdma": 1, "migProfile": "1g.10gb"}) == []
    assert refused({"gpus": 1, "shares": {"gpuMemoryMiB": 1024}}) == []
    assert refused({"gpus": 1, "migProfile": "1g.10gb", "shares": {"gpuMemoryMiB": 1024}}) == [
        "spec.migProfile and spec.shares: a claim holds MIG instances or shares of GPUs, not both"
    ]
    assert refused({"rdma": 1, "migProfile": "1g.10gb"}) == [
        "spec.migProfile needs spec.gpus > 0 (the number of MIG instances)"
    ]


# -- the documented examples -------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.parametrize("example", ["deviceclaim.yaml", "reservation.yaml", "deviceclaim-mig.yaml"])
def test_documented_examples_are_valid_claims_and_pods_that_use_them(example: str) -> None:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (claim_doc,) = [d for d in docs if d["kind"] == names.CLAIM_KIND]
    jsonschema.validate(claim_doc, schema)
    view = claims.read_claim({**claim_doc, "metadata": {**claim_doc["metadata"], "uid": "u"}})
    req = claims.claim_request(view, device_classes={"default": DeviceClass()})
    for doc in docs:
        if doc["kind"] == names.CLAIM_KIND:
            continue
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        pod = (
            doc
            if doc["kind"] == "Pod"
            else {"metadata": doc["spec"]["template"]["metadata"], **doc["spec"]["template"]}
        )
        pod = {"apiVersion": "v1", "kind": "Pod", **pod}
        assert pod["metadata"]["annotations"][names.CLAIM] == claim_doc["metadata"]["name"]
        verdict = podrules.admit(pod, operation="CREATE", device_classes={"default": DeviceClass()})
        assert verdict.allowed and verdict.request is not None
        assert (verdict.request.gpus, verdict.request.rdma) == (req.gpus, req.rdma)
        assert verdict.request.mig_profile == req.mig_profile


def test_the_claim_marker_rides_the_wire_and_old_requests_still_decode() -> None:
    req = request(
        {
            "gpus": 2,
            "rdma": 2,
            "deviceClass": "shared",
            "shareable": True,
            "expiresAfter": "1h",
            "shares": {"gpuCoresPercent": 30},
        }
    )
    back = codec.ALLOC_EVENT.decode(codec.encode(req))
    assert back == req and back.claim.expires_at == T0 + 3600 and back.gpu_cores_percent == 30  # type: ignore[union-attr]
    old = AllocationRequest(request_id="u.1", pod=PodRef("ml", "p", "u"), gpus=1)
    assert codec.ALLOC_EVENT.decode(codec.encode(old)).claim is None  # type: ignore[union-attr]
    too_long = codec.to_builtins(req)
    too_long["claim"]["name"] = "x" * 300
    with pytest.raises(msgspec.ValidationError, match=r"\$\.claim\.name"):
        msgspec.convert(too_long, AllocationRequest)


def test_the_finalizer_is_added_and_removed_keeping_everyone_elses() -> None:
    view = claims.read_claim(claim({"gpus": 1}, finalizers=["example.com/keep"], resourceVersion="7"))
    assert claims.finalizer_patch(view, present=True) == {
        "metadata": {"finalizers": ["example.com/keep", names.CLAIM_FINALIZER], "resourceVersion": "7"}
    }
    assert claims.finalizer_patch(view, present=False) is None
    held = claims.read_claim(claim({"gpus": 1}, finalizers=[names.CLAIM_FINALIZER, "example.com/keep"]))
    assert claims.finalizer_patch(held, present=False) == {"metadata": {"finalizers": ["example.com/keep"]}}
    deleting = _state({"gpus": 1})
    deleting.view = claims.read_claim(claim({"gpus": 1}, deletionTimestamp="2027-01-15T09:00:00Z"))
    assert claims.blocking_reason(deleting, claim="c1", pod_uid="p", gpus=1, rdma=0) == (
        "DeviceClaim 'c1' is being deleted; its devices go once its pods end"
    )
