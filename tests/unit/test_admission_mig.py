"""MIG pods at the Kubernetes edge: ``tandem.io/mig`` plus ``tandem.io/mig-profile`` become a
MIG request (``mig_profile``, ``gpus`` = the instance count); every wrong combination is
refused with a message naming the resource or annotation."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.config import DeviceClass
from services.admission import names, podrules
from services.admission.errors import PolicyError
from tests.unit.test_admission_helpers import deployment_pod
from tests.unit.test_admission_podrules import persisted

CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami")}


def mig_pod(
    count: Any = "1", *, annotations: dict[str, str], gpu: Any = None, rdma: Any = None
) -> dict[str, Any]:
    pod = deployment_pod(gpu=gpu, rdma=rdma, annotations=annotations)
    pod["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_MIG] = count
    return pod


def test_a_mig_pod_becomes_a_mig_request() -> None:
    pod = persisted(mig_pod("2", annotations={names.MIG_PROFILE: " 1g.10gb "}, rdma="2"))
    req = podrules.allocation_request(podrules.read_pod(pod), device_classes=CLASSES)
    assert req is not None
    assert (req.gpus, req.rdma, req.mig_profile, req.pairing) == (2, 2, "1g.10gb", "per-gpu")
    assert req.gpu_memory_mib is None and req.gpu_cores_percent is None
    # The webhook writes the normalised profile back, like the other annotations.
    verdict = podrules.admit(pod, operation="CREATE", device_classes=CLASSES)
    assert verdict.allowed and verdict.request is not None
    assert verdict.request.annotations()[names.MIG_PROFILE] == "1g.10gb"


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (
            mig_pod(annotations={}),
            r"tandem\.io/mig needs the instances' profile: set annotation tandem\.io/mig-profile",
        ),
        (
            mig_pod(annotations={names.MIG_PROFILE: "1x.10gb"}),
            r"annotation tandem\.io/mig-profile: '1x\.10gb' is not a MIG profile",
        ),
        (
            mig_pod(annotations={names.MIG_PROFILE: "1g.10gb"}, gpu="1"),
            "either MIG instances, whole GPUs or shares",
        ),
        (
            deployment_pod(gpu="1", rdma=None, annotations={names.MIG_PROFILE: "1g.10gb"}),
            r"chooses MIG instances, but the pod asks no tandem\.io/mig",
        ),
        (
            mig_pod(annotations={names.MIG_PROFILE: "1g.10gb", names.GPU_MEMORY_MIB: "1024"}),
            r"sizes shares of GPUs, but the pod asks no tandem\.io/gpu-share",
        ),
        (mig_pod("0.5", annotations={names.MIG_PROFILE: "1g.10gb"}), "not a whole number"),
    ],
)
def test_wrong_mig_pods_are_refused_with_the_reason(pod: dict[str, Any], why: str) -> None:
    with pytest.raises(PolicyError, match=why):
        podrules.resolve(podrules.read_pod(pod), device_classes=CLASSES)
    verdict = podrules.admit(pod, operation="CREATE", device_classes=CLASSES)
    assert not verdict.allowed and verdict.code == 403
