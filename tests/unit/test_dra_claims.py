"""A pod's ResourceClaims read as one Tandem request, and Tandem's assignment written back as
each claim's allocation (services.admission.draclaims). The real API server and scheduler
taking such an allocation: tests/cluster/test_dra_allocation.py."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from schemas.config import DeviceClass
from schemas.messages import AssignedGpu, AssignedNic, Assignment, Pair, PodRef
from services.admission.draclaims import (
    PARAMETERS_API,
    PARAMETERS_KIND,
    Claim,
    allocations,
    field_names,
    is_tandems,
    pod_devices,
)
from services.admission.errors import InvalidClaim
from services.nodeagent.dra.slices import device_names
from services.request import RequestError, resolve
from services.topology import load_topology

AT = datetime.datetime(2026, 12, 3, 19, 0, tzinfo=datetime.UTC)


def req(name: str, cls: str, count: int = 1, **exact: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, "count": count, **exact}}


def params(**values: str) -> dict[str, Any]:
    return {
        "opaque": {
            "driver": "tandem.io",
            "parameters": {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, **values},
        }
    }


def claim(
    name: str, *requests: dict[str, Any], config: list[dict[str, Any]] | None = None, **devices: Any
) -> Claim:
    spec = {"devices": {"requests": list(requests), "config": config or [], **devices}}
    return Claim("team", name, f"uid-{name}", spec)


def test_the_claims_of_a_pod_are_one_request_with_the_parameters_of_their_configuration() -> None:
    gpus = claim(
        "gpus", req("gpus", "gpu.tandem.io", 4), config=[params(scope="pcie-switch", policy="required")]
    )
    nics = claim("nics", req("nics", "nic.tandem.io", 4))
    other = Claim("team", "fpga", "uid-fpga", {"devices": {"requests": [req("f", "fpga.example.com")]}})
    assert is_tandems(gpus.spec) and is_tandems(nics.spec) and not is_tandems(other.spec)
    got = pod_devices([gpus, nics, other], default_class="default")
    assert got is not None
    assert got.ask.gpus == 4 and got.ask.rdma == 4 and got.ask.device_class == "default"
    assert (got.ask.scope, got.ask.policy, got.ask.pairing) == ("pcie-switch", "required", None)
    assert [(s.claim, s.request, s.kind, s.number) for s in got.slots] == [
        ("gpus", "gpus", "gpu", 4),
        ("nics", "nics", "nic", 4),
    ]
    assert pod_devices([other], default_class="default") is None


def test_a_gpu_share_and_a_mig_profile_come_from_capacity_and_parameters() -> None:
    share = claim("s", req("g", "gpu.tandem.io", 2, capacity={"requests": {"memory": "20Gi", "cores": "30"}}))
    got = pod_devices([share], default_class="shared")
    assert got is not None and (got.ask.gpu_memory_mib, got.ask.gpu_cores_percent) == (20480, 30)
    classes = {"shared": DeviceClass(sharing="hami")}
    assert resolve(got.ask, classes=classes).shared
    mig = claim("m", req("m", "mig.tandem.io", 2), config=[params(migProfile="1g.10gb")])
    got = pod_devices([mig], default_class="default")
    assert got is not None and got.ask.mig_profile == "1g.10gb" and got.ask.gpus == 2


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        (
            [claim("c", req("g", "gpu.tandem.io"), constraints=[{"matchAttribute": "tandem.io/pcieSwitch"}])],
            "ResourceClaim team/c spec.devices.constraints: Tandem pairs each GPU with a NIC by its own",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io", selectors=[{"cel": {"expression": "true"}}]))],
            "spec.devices.requests[0].exactly.selectors: Tandem does not evaluate CEL selectors",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io", allocationMode="All"))],
            "requests[0].exactly.allocationMode: Tandem's classes are asked by count",
        ),
        (
            [
                claim(
                    "c", {"name": "g", "firstAvailable": [{"name": "a", "deviceClassName": "gpu.tandem.io"}]}
                )
            ],
            "spec.devices.requests[0]: Tandem's classes take an exact request",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io"), req("f", "fpga.example.com"))],
            "requests[1].exactly.deviceClassName: 'fpga.example.com' is not one of Tandem's classes",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io", 0))],
            "requests[0].exactly.count: 0 is not a count of 1 or more",
        ),
        (
            [claim("c", req("n", "nic.tandem.io", capacity={"requests": {"memory": "1Gi"}}))],
            "capacity.requests.memory: only a GPU request (gpu.tandem.io) asks capacity",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io", capacity={"requests": {"memory": "1.5Gi"}}))],
            "'1.5Gi' is not a memory size in whole MiB",
        ),
        (
            [claim("c", req("g", "gpu.tandem.io"), config=[params(speed="fast")])],
            "opaque.parameters.speed: unknown parameter (known: deviceClass, scope",
        ),
        (
            [
                claim(
                    "c",
                    req("g", "gpu.tandem.io"),
                    config=[{"opaque": {"driver": "tandem.io", "parameters": {}}}],
                )
            ],
            "Tandem's configuration is kind AllocationParameters",
        ),
        (
            [
                claim("a", req("g", "gpu.tandem.io"), config=[params(scope="numa")]),
                claim("b", req("n", "nic.tandem.io"), config=[params(scope="pcie-switch")]),
            ],
            "ResourceClaim team/b spec.devices.config: scope: 'pcie-switch' differs from 'numa'",
        ),
        ([claim("c", req("m", "mig.tandem.io"))], "a request of mig.tandem.io needs migProfile"),
        (
            [
                claim(
                    "c",
                    req("g", "gpu.tandem.io"),
                    req("m", "mig.tandem.io"),
                    config=[params(migProfile="1g.10gb")],
                )
            ],
            "ResourceClaims c: a pod asks whole GPUs (or shares of them) or MIG instances, not both",
        ),
    ],
)
def test_what_tandem_would_not_honour_is_refused_naming_the_claim_and_field(
    claims: list[Claim], message: str
) -> None:
    with pytest.raises(
        InvalidClaim,
        match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        pod_devices(claims, default_class="default")


def test_the_resolvers_errors_name_the_claims_parameters() -> None:
    bad = [claim("c", req("g", "gpu.tandem.io"), config=[params(scope="rack")])]
    got = pod_devices(bad, default_class="default")
    assert got is not None
    with pytest.raises(
        RequestError, match=r"the AllocationParameters of ResourceClaim team/c: scope: 'rack'"
    ):
        resolve(got.ask, classes={"default": DeviceClass()}, names=field_names(bad))


def test_each_claim_gets_its_gpus_and_the_nics_paired_with_them() -> None:
    a = claim("a", req("g", "gpu.tandem.io"), req("n", "nic.tandem.io"), config=[params(scope="pcie-switch")])
    b = claim("b", req("g", "gpu.tandem.io"), req("n", "nic.tandem.io"))
    devices = pod_devices([a, b], default_class="default")
    assert devices is not None
    assignment = Assignment(
        request_id="uid-pod.1",
        pod=PodRef(namespace="team", name="p"),
        node="gpu-3",
        gpus=[AssignedGpu(index=0, uuid="GPU-0"), AssignedGpu(index=1, uuid="GPU-1")],
        nics=[AssignedNic(name="mlx5_0", pf="mlx5_0"), AssignedNic(name="mlx5_1", pf="mlx5_1")],
        pairs=[
            Pair(gpu=0, nic="mlx5_1", scope="pcie-switch"),
            Pair(gpu=1, nic="mlx5_0", scope="pcie-switch"),
        ],
    )
    names = device_names(load_topology("dgx-h100"))
    out = allocations(devices, assignment, names=names, at=AT)
    assert {c: [(r["request"], r["device"]) for r in v["devices"]["results"]] for c, v in out.items()} == {
        "a": [("g", "gpu0"), ("n", "mlx5-1")],
        "b": [("g", "gpu1"), ("n", "mlx5-0")],
    }
    for alloc in out.values():
        assert all(r["driver"] == "tandem.io" and r["pool"] == "gpu-3" for r in alloc["devices"]["results"])
        assert all("shareID" not in r for r in alloc["devices"]["results"])  # whole GPUs: exclusive
        term = alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]
        assert term == {"key": "metadata.name", "operator": "In", "values": ["gpu-3"]}
        assert alloc["allocationTimestamp"] == "2026-12-03T19:00:00Z"
        (cfg,) = alloc["devices"]["config"]
        assert cfg["opaque"]["parameters"] == {
            "apiVersion": PARAMETERS_API,
            "kind": PARAMETERS_KIND,
            "scope": "pcie-switch",
        }


def test_a_share_is_written_with_its_share_id_and_consumed_capacity() -> None:
    c = claim("s", req("g", "gpu.tandem.io", capacity={"requests": {"memory": "10Gi"}}))
    devices = pod_devices([c], default_class="shared")
    assert devices is not None
    assignment = Assignment(
        request_id="uid-pod.1",
        pod=PodRef(namespace="team", name="p"),
        node="gpu-3",
        gpus=[AssignedGpu(index=5, uuid="GPU-5", memory_mib=10240)],
    )
    (result,) = allocations(devices, assignment, names=device_names(load_topology("dgx-h100")), at=AT)["s"][
        "devices"
    ]["results"]
    assert result["device"] == "gpu5" and result["consumedCapacity"] == {"memory": "10240Mi"}
    again = allocations(devices, assignment, names=device_names(load_topology("dgx-h100")), at=AT)
    assert again["s"]["devices"]["results"][0]["shareID"] == result["shareID"]  # stable: rewrites are no-ops
