"""A node's devices as DRA ResourceSlices (services.nodeagent.dra.slices): names, attributes,
health taints, MIG, limits. The real API server's validation of the same objects is in
tests/cluster/test_dra_slices.py."""

from __future__ import annotations

import re

import msgspec
import pytest

from schemas.messages import DeviceHealth
from schemas.topology import MigInstance, NodeTopology
from services.nodeagent.dra.slices import (
    DRIVER,
    TAINT_CORDONED,
    TAINT_PORT_DOWN,
    TAINT_UNHEALTHY,
    SliceError,
    device_names,
    resource_slices,
    tandem_ids,
)
from services.topology import builtin_names, load_topology

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def _attr(device: dict, name: str) -> object:
    """The value of one attribute (None when the device does not have it)."""
    if name not in device["attributes"]:
        return None
    (value,) = device["attributes"][name].values()
    return value


@pytest.mark.parametrize("name", builtin_names())
def test_every_device_of_a_builtin_is_listed_once_with_a_valid_name_and_attributes(name: str) -> None:
    topo = load_topology(name)
    slices = resource_slices(topo, node="n1", generation=3)
    devices = _devices(slices)
    expected = len(topo.gpus()) + sum(1 + len(n.vfs) for n in topo.nics())
    assert len(devices) == expected
    for s in slices:
        assert s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == "n1"
        assert s["spec"]["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": len(slices)}
    for dev_name, dev in devices.items():
        assert DNS_LABEL.match(dev_name) and len(dev_name) <= 63, dev_name
        assert len(dev["attributes"]) + len(dev.get("capacity", {})) <= 32
        for attr, value in dev["attributes"].items():
            short = attr.split("/")[-1]
            assert C_IDENT.match(short) and len(short) <= 32, attr
            assert len(value) == 1
            (v,) = value.values()
            assert not isinstance(v, str) or len(v) <= 64
    # the map back: every listed name is a Tandem device id
    assert set(tandem_ids(topo)) == set(devices)


def test_a_gpu_and_the_nic_on_its_pcie_switch_share_the_switch_and_the_standard_root() -> None:
    topo = load_topology("dgx-h100")
    devices = _devices(resource_slices(topo, node="n1", generation=1))
    gpu0 = devices["gpu0"]
    assert _attr(gpu0, "type") == "gpu" and _attr(gpu0, "index") == 0
    nic = next(
        d
        for d in devices.values()
        if _attr(d, "type") == "nic" and _attr(d, "pcieSwitch") == _attr(gpu0, "pcieSwitch")
    )
    assert _attr(nic, "resource.kubernetes.io/pcieRoot") == _attr(gpu0, "resource.kubernetes.io/pcieRoot")
    assert _attr(nic, "resource.kubernetes.io/pcieRoot").startswith("pci")
    assert _attr(nic, "function") == "pf" and _attr(nic, "rdmaDevice").startswith("mlx5_")
    # GPU memory and compute are consumable capacity: shares take a part, a whole GPU all of it
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["capacity"]["cores"] == {"value": "100"}
    assert gpu0["capacity"]["memory"]["value"].endswith("Mi")


def test_rdma_names_become_dns_labels_and_map_back() -> None:
    topo = load_topology("dgx-a100")
    names = device_names(topo)
    assert names["mlx5_0"] == "mlx5-0"
    assert tandem_ids(topo)["mlx5-0"] == "mlx5_0"
    devices = _devices(resource_slices(topo, node="n1", generation=1))
    vfs = [d for d in devices.values() if _attr(d, "function") == "vf"]
    assert vfs and all(_attr(v, "pf") in devices for v in vfs)


def test_ids_that_would_share_a_name_are_refused_naming_both() -> None:
    topo = load_topology("dgx-h100")
    doc = msgspec.to_builtins(topo)
    nics = doc["sockets"][0]["numa_nodes"][0]["roots"][0]["switches"][0]["nics"]
    nics.append({**nics[0], "name": nics[0]["name"].replace("_", "-"), "pci_bus_id": None})
    bad = msgspec.convert(doc, NodeTopology)
    with pytest.raises(SliceError, match=r"'mlx5_0' and 'mlx5-0' would both be named 'mlx5-0'"):
        device_names(bad)


def test_an_unhealthy_or_cordoned_device_is_tainted_and_untainted_when_it_recovers() -> None:
    topo = load_topology("dgx-h100")
    sick = {"gpu3": DeviceHealth(healthy=False, reason="xid 79: GPU fell off the bus")}
    devices = _devices(resource_slices(topo, node="n1", generation=2, health=sick))
    assert devices["gpu3"]["taints"] == [
        {"key": TAINT_UNHEALTHY, "value": "xid-79-GPU-fell-off-the-bus", "effect": "NoSchedule"}
    ]
    assert "taints" not in devices["gpu2"]
    cordoned = {"mlx5_1": DeviceHealth(cordoned=True)}
    devices = _devices(resource_slices(topo, node="n1", generation=3, health=cordoned))
    assert devices["mlx5-1"]["taints"] == [{"key": TAINT_CORDONED, "effect": "NoSchedule"}]
    recovered = {"gpu3": DeviceHealth(healthy=True)}
    assert all(
        "taints" not in d
        for d in _devices(resource_slices(topo, node="n1", generation=4, health=recovered)).values()
    )


def test_a_vf_carries_its_port_taint() -> None:
    topo = load_topology("pcie-4gpu-2nic")
    doc = msgspec.to_builtins(topo)
    for sock in doc["sockets"]:
        for numa in sock["numa_nodes"]:
            for root in numa["roots"]:
                for holder in [root, *root.get("switches", [])]:
                    for nic in holder.get("nics", []):
                        nic["port_state"] = "down"
    down = msgspec.convert(doc, NodeTopology)
    devices = _devices(resource_slices(down, node="n1", generation=1))
    nics = [d for d in devices.values() if _attr(d, "type") == "nic"]
    assert nics and all(
        d["taints"] == [{"key": TAINT_PORT_DOWN, "value": "down", "effect": "NoSchedule"}] for d in nics
    )


def test_a_gpu_in_mig_mode_is_offered_as_its_instances_only() -> None:
    topo = load_topology("dgx-h100")
    doc = msgspec.to_builtins(topo)
    gpu = doc["sockets"][0]["numa_nodes"][0]["roots"][0]["switches"][0]["gpus"][0]
    gpu["mig_mode"] = True
    gpu["mig_instances"] = [
        msgspec.to_builtins(
            MigInstance(profile="3g.40gb", uuid=f"MIG-{i}", gpu_instance_id=i + 1, memory_mib=40192)
        )
        for i in range(2)
    ]
    mig = msgspec.convert(doc, NodeTopology).validate()
    parent = f"gpu{gpu['index']}"
    health = {parent: DeviceHealth(healthy=False, reason="xid 48")}
    devices = _devices(resource_slices(mig, node="n1", generation=1, health=health))
    assert parent not in devices
    instances = [d for d in devices.values() if _attr(d, "type") == "mig"]
    assert [d["name"] for d in instances] == [f"{parent}-mig1-0", f"{parent}-mig2-0"]
    for d in instances:
        assert _attr(d, "profile") == "3g.40gb" and _attr(d, "parentIndex") == gpu["index"]
        assert d["capacity"] == {"memory": {"value": "40192Mi"}}
        assert d["taints"][0]["key"] == TAINT_UNHEALTHY  # the parent's health covers its instances
        assert "allowMultipleAllocations" not in d


def test_slices_hold_at_most_64_devices_once_any_is_tainted_and_128_otherwise() -> None:
    big = _many_nics(150)
    plain = resource_slices(big, node="n1", generation=1)
    assert [len(s["spec"]["devices"]) for s in plain] == [128, 22 + len(big.gpus())]
    tainted = resource_slices(big, node="n1", generation=1, health={"gpu0": DeviceHealth(healthy=False)})
    assert [len(s["spec"]["devices"]) for s in tainted] == [64, 64, 22 + len(big.gpus())]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in tainted} == {3}
    assert len({s["metadata"]["name"] for s in tainted}) == 3


def _many_nics(count: int) -> NodeTopology:
    doc = msgspec.to_builtins(load_topology("gpu-only-8"))
    root = doc["sockets"][0]["numa_nodes"][0]["roots"][0]
    root["nics"] = [{"name": f"mlx5_{i}"} for i in range(count)]
    return msgspec.convert(doc, NodeTopology).validate()
