"""The one request resolver (services/request): defaults, rules and field names, and the
promise it exists for — what admission accepts, the allocator does not reject for a rule.

The agreement is checked by generating asks (valid and not) and sending each through the
pod webhook's rules (``admission.podrules.resolve`` on a pod with those resources and
annotations) and through the core (``normalise`` of the request the bridge would publish):
both accept or both refuse, and accepted ones resolve to the same scope, policy and pairing.
Before the resolver they differed, e.g. a class whose default pairing is ``per-gpu`` made the
webhook refuse a pod with unequal counts that the allocator placed with ``shared`` pairing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from services.admission import names, podrules
from services.admission.errors import PolicyError
from services.allocator.core import InvalidRequest
from services.allocator.core.request import normalise
from services.request import WIRE_NAMES, Ask, RequestError, resolve
from tests.unit.test_admission_helpers import deployment_pod

CLASSES = {
    "default": DeviceClass(),
    "paired": DeviceClass(pairing="per-gpu", scope="numa", policy="required"),
    "shared": DeviceClass(sharing="hami", preemption="lower-priority"),
}


def test_the_class_fills_what_the_ask_left_out() -> None:
    r = resolve(Ask(gpus=2, rdma=2, device_class="paired"), classes=CLASSES)
    assert (r.scope, r.policy, r.pairing, r.preemption) == ("numa", "required", "per-gpu", "never")
    r = resolve(Ask(gpus=1, rdma=0, device_class="shared", gpu_memory_mib=1024), classes=CLASSES)
    assert (r.scope, r.policy, r.pairing, r.preemption) == (
        "pcie-switch",
        "preferred",
        "shared",
        "lower-priority",
    )
    assert r.shared and r.dc is CLASSES["shared"]
    # What the ask says wins over the class.
    r = resolve(Ask(gpus=2, rdma=2, device_class="paired", scope="node", pairing="shared"), classes=CLASSES)
    assert (r.scope, r.pairing) == ("node", "shared")


def test_a_class_default_of_per_gpu_applies_only_where_it_can() -> None:
    """Unequal counts cannot pair per GPU: the class's default gives way to the counts'
    pairing, where an explicit per-gpu is an error naming the field."""
    assert resolve(Ask(gpus=4, rdma=2, device_class="paired"), classes=CLASSES).pairing == "shared"
    with pytest.raises(RequestError, match="pairing: per-gpu gives every GPU its own NIC") as caught:
        resolve(Ask(gpus=4, rdma=2, device_class="default", pairing="per-gpu"), classes=CLASSES)
    assert caught.value.field == "pairing"


@pytest.mark.parametrize(
    ("ask", "field", "text"),
    [
        (Ask(gpus=0, rdma=0, device_class="default"), "gpus", "GPUS and RDMA are both 0"),
        (Ask(gpus=-1, rdma=0, device_class="default"), "gpus", "GPUS: -1 is negative"),
        (Ask(gpus=1, rdma=0, device_class="h100"), "device_class", "CLASS: unknown device class 'h100'"),
        (Ask(gpus=1, rdma=0, device_class="default", scope="rack"), "scope", "SCOPE: 'rack' is not one of"),
        (Ask(gpus=1, rdma=0, device_class="default", policy="maybe"), "policy", "POLICY: 'maybe'"),
        (Ask(gpus=1, rdma=0, device_class="default", preemption="x"), "preemption", "PREEMPTION: 'x'"),
        (
            Ask(gpus=1, rdma=0, device_class="default", gpu_memory_mib=10),
            "gpu_memory_mib",
            "MEMORY: device class 'default' does not allow GPU shares",
        ),
        (Ask(gpus=0, rdma=1, device_class="shared", gpu_cores_percent=10), "gpus", "CORES sizes a share"),
        (
            Ask(gpus=1, rdma=0, device_class="shared", gpu_cores_percent=101),
            "gpu_cores_percent",
            "CORES: 101",
        ),
        (
            Ask(gpus=1, rdma=0, device_class="shared", gpu_memory_mib=10, mig_profile="1g.10gb"),
            "mig_profile",
            "MIG and MEMORY: a MIG instance is not shared",
        ),
        (
            Ask(gpus=1, rdma=0, device_class="default", mig_profile="1g"),
            "mig_profile",
            "MIG: '1g' is not a MIG",
        ),
        (Ask(gpus=0, rdma=1, device_class="default", mig_profile="1g.10gb"), "gpus", "ask it in GPUS"),
    ],
)
def test_an_error_names_the_field_in_the_callers_words(ask: Ask, field: str, text: str) -> None:
    words: Any = {
        "gpus": "GPUS",
        "rdma": "RDMA",
        "device_class": "CLASS",
        "scope": "SCOPE",
        "policy": "POLICY",
        "pairing": "PAIRING",
        "preemption": "PREEMPTION",
        "gpu_memory_mib": "MEMORY",
        "gpu_cores_percent": "CORES",
        "mig_profile": "MIG",
    }
    with pytest.raises(RequestError) as caught:
        resolve(ask, classes=CLASSES, names=words)
    assert caught.value.field == field and text in str(caught.value), str(caught.value)
    assert set(words) == set(WIRE_NAMES)  # every field has a name


asks = st.builds(
    Ask,
    gpus=st.integers(0, 4),
    rdma=st.integers(0, 4),
    device_class=st.sampled_from(["default", "paired", "shared", "nope"]),
    scope=st.sampled_from([None, "pcie-switch", "numa", "node", "rack"]),
    policy=st.sampled_from([None, "required", "preferred", "maybe"]),
    pairing=st.sampled_from([None, "per-gpu", "shared", "both"]),
    preemption=st.sampled_from([None, "never", "lower-priority", "always"]),
    gpu_memory_mib=st.sampled_from([None, 1024]),
    gpu_cores_percent=st.sampled_from([None, 30]),
    mig_profile=st.sampled_from([None, "1g.10gb"]),
)


@given(asks)
@settings(max_examples=300, deadline=None)
def test_resolving_a_resolved_request_changes_nothing(ask: Ask) -> None:
    try:
        r = resolve(ask, classes=CLASSES)
    except RequestError:
        return
    again = Ask(
        gpus=r.gpus,
        rdma=r.rdma,
        device_class=r.device_class,
        scope=r.scope,
        policy=r.policy,
        pairing=r.pairing,
        preemption=r.preemption,
        gpu_memory_mib=r.gpu_memory_mib,
        gpu_cores_percent=r.gpu_cores_percent,
        mig_profile=r.mig_profile,
    )
    assert resolve(again, classes=CLASSES) == r


def _pod_of(ask: Ask) -> dict[str, Any]:
    """A persisted pod asking what ``ask`` asks, the way a pod author writes it."""
    shares = ask.gpu_memory_mib is not None or ask.gpu_cores_percent is not None
    pod = deployment_pod(gpu=None, rdma=str(ask.rdma) if ask.rdma else None)
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    if ask.gpus:
        key = (
            names.RESOURCE_MIG
            if ask.mig_profile
            else names.RESOURCE_GPU_SHARE
            if shares
            else names.RESOURCE_GPU
        )
        limits[key] = str(ask.gpus)
    ann = {names.DEVICE_CLASS: ask.device_class}
    for key, value in (
        (names.SCOPE, ask.scope),
        (names.POLICY, ask.policy),
        (names.PAIRING, ask.pairing),
        (names.PREEMPTION, ask.preemption),
        (names.GPU_MEMORY_MIB, ask.gpu_memory_mib),
        (names.GPU_CORES_PERCENT, ask.gpu_cores_percent),
        (names.MIG_PROFILE, ask.mig_profile),
    ):
        if value is not None:
            ann[key] = str(value)
    pod = copy.deepcopy(pod)
    pod["metadata"].update(name="p", uid="u-1", annotations=ann)
    return pod


@given(asks)
@settings(max_examples=400, deadline=None)
def test_what_admission_accepts_the_allocator_accepts_alike(ask: Ask) -> None:
    view = podrules.read_pod(_pod_of(ask))
    try:
        req = podrules.allocation_request(view, device_classes=CLASSES)
    except PolicyError:
        admitted = None
    else:
        admitted = req
    # The allocator's view of the same ask, as the CLI or a client would send it unresolved.
    raw = AllocationRequest(
        request_id="u-1.1",
        pod=PodRef("ml", "p", "u-1"),
        gpus=ask.gpus,
        rdma=ask.rdma,
        device_class=ask.device_class,
        scope=ask.scope,  # type: ignore[arg-type]
        policy=ask.policy,  # type: ignore[arg-type]
        pairing=ask.pairing,  # type: ignore[arg-type]
        preemption=ask.preemption,  # type: ignore[arg-type]
        gpu_memory_mib=ask.gpu_memory_mib,
        gpu_cores_percent=ask.gpu_cores_percent,
        mig_profile=ask.mig_profile,
    )
    try:
        spec = normalise(raw, CLASSES)
    except InvalidRequest:
        spec = None
    if ask.gpus == 0 and ask.rdma == 0:
        return  # not a Tandem pod at all for the webhook (None), an error for the allocator
    assert (admitted is None) == (spec is None), (ask, admitted, spec)
    if admitted is not None and spec is not None:
        assert normalise(admitted, CLASSES) == spec  # what the bridge publishes decides alike
        assert (admitted.scope, admitted.policy, admitted.pairing) == (
            spec.scope.wire,
            "required" if spec.required else "preferred",
            spec.pairing,
        )
