"""Share pods at the Kubernetes edge: ``tandem.io/gpu-share`` plus the size annotations become
a share request; every wrong combination is refused with a message for the pod author."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.config import DeviceClass
from services.admission import names, podrules
from services.admission.errors import PolicyError
from tests.unit.test_admission_helpers import deployment_pod
from tests.unit.test_admission_podrules import persisted

CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami")}


def share_pod(
    shares: Any = "1", *, annotations: dict[str, str], gpu: Any = None, rdma: Any = None
) -> dict[str, Any]:
    pod = deployment_pod(gpu=gpu, rdma=rdma, annotations=annotations)
    pod["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_GPU_SHARE] = shares
    return pod


def test_a_share_pod_becomes_a_share_request() -> None:
    ann = {names.DEVICE_CLASS: "shared", names.GPU_MEMORY_MIB: "20480", names.GPU_CORES_PERCENT: "25"}
    pod = persisted(share_pod("2", annotations=ann, rdma="2"))
    req = podrules.allocation_request(podrules.read_pod(pod), device_classes=CLASSES)
    assert req is not None
    assert (req.gpus, req.rdma, req.gpu_memory_mib, req.gpu_cores_percent) == (2, 2, 20480, 25)
    assert req.device_class == "shared" and req.pairing == "per-gpu"
    # The webhook writes the normalised size back, like the other annotations.
    resolved = podrules.resolve(podrules.read_pod(pod), device_classes=CLASSES)
    assert resolved is not None
    assert resolved.annotations()[names.GPU_MEMORY_MIB] == "20480"
    assert resolved.annotations()[names.GPU_CORES_PERCENT] == "25"


def test_compute_only_share_leaves_memory_out() -> None:
    ann = {names.DEVICE_CLASS: "shared", names.GPU_CORES_PERCENT: "50"}
    req = podrules.allocation_request(
        podrules.read_pod(persisted(share_pod(annotations=ann))), device_classes=CLASSES
    )
    assert req is not None and (req.gpus, req.gpu_memory_mib, req.gpu_cores_percent) == (1, None, 50)
    pod = podrules.read_pod(persisted(share_pod(annotations=ann)))
    resolved = podrules.resolve(pod, device_classes=CLASSES)
    assert resolved is not None and names.GPU_MEMORY_MIB not in resolved.annotations()


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (
            share_pod(annotations={names.GPU_MEMORY_MIB: "1024"}),
            "device class 'default' does not allow GPU shares",
        ),
        (share_pod(annotations={names.DEVICE_CLASS: "shared"}), "needs the share's size"),
        (
            share_pod(annotations={names.DEVICE_CLASS: "shared", names.GPU_CORES_PERCENT: "150"}),
            r"tandem\.io/gpu-cores-percent: '150' is not a whole number in 1\.\.100",
        ),
        (
            share_pod(annotations={names.DEVICE_CLASS: "shared", names.GPU_MEMORY_MIB: "lots"}),
            r"tandem\.io/gpu-memory-mib: 'lots'",
        ),
        (
            share_pod(annotations={names.DEVICE_CLASS: "shared", names.GPU_MEMORY_MIB: "1024"}, gpu="1"),
            "either whole GPUs or shares of GPUs",
        ),
        (
            deployment_pod(gpu="1", rdma=None, annotations={names.GPU_MEMORY_MIB: "1024"}),
            r"sizes shares of GPUs, but the pod asks no tandem\.io/gpu-share",
        ),
        (share_pod("0.5", annotations={names.DEVICE_CLASS: "shared"}), "not a whole number"),
    ],
)
def test_wrong_share_pods_are_refused_with_the_reason(pod: dict[str, Any], why: str) -> None:
    with pytest.raises(PolicyError, match=why):
        podrules.resolve(podrules.read_pod(pod), device_classes=CLASSES)
