"""A node's devices as DRA ResourceSlices (``resource.k8s.io/v1``): pure, no I/O.

One pool per node, named after the node, driver ``tandem.io``. What each device says:

* **GPU** (``gpu<index>``, not in MIG mode): the standard ``resource.kubernetes.io/pcieRoot``
  and ``resource.kubernetes.io/pciBusID`` where the topology knows the bus, and Tandem's own
  attributes in the driver's domain — ``type`` (``gpu``), ``index``, ``uuid``, ``model``,
  ``pcieSwitch``, ``numaNode``, ``socket``, ``nvlinkPartition`` and, on an NVLink fabric,
  ``nvlinkDomain`` (cluster UUID and clique). Capacity ``memory`` (MiB) and ``cores``
  (percent) are *consumable* (``allowMultipleAllocations``): a claim of a sharing class takes
  a part, a claim of a whole-GPU class the whole (no request policy, so a request that names
  no capacity consumes all of it).
* **MIG instance** (``gpu<i>-mig<gi>-<ci>``) of a GPU in MIG mode, whose parent is then not
  offered whole: ``type`` ``mig``, ``profile``, ``parentIndex``, ``parentUUID``, ``uuid``,
  the parent's place, capacity ``memory``. Tandem does not create or destroy MIG instances
  (the node's layout is read, docs/sharing.md "MIG"), so the instances are plain devices: a
  partitionable device (shared counters, beta in 1.36) describes instances a driver may still
  create, which is not what a fixed layout is.
* **RDMA NIC** (its RDMA name as a DNS label: ``mlx5_0`` → ``mlx5-0``; the original in
  ``rdmaDevice``): ``type`` ``nic``, ``function`` ``pf``, ``linkType``, ``speedGbps``,
  ``netdev``, the same place attributes; each virtual function is a device of its own
  (``function`` ``vf``, ``pf`` naming its parent's device).

Health is written as **taints** (``NoSchedule``, so pods already running are not evicted by
the slice): ``tandem.io/unhealthy``, ``tandem.io/cordoned``, ``tandem.io/port-down``. A
device that recovers loses its taint at the next publish — unlike a driver that keeps XID
taints until it restarts.

Slices hold at most 128 devices, 64 when any of them carries a taint (the API's limits);
every slice of the pool carries the pool's generation and slice count, so a reader never
mixes two versions of a pool. :func:`device_names` maps Tandem's device ids to the names the
slices use, and :func:`tandem_ids` maps them back (claims' allocation results name devices
by slice name).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from schemas.messages import DeviceHealth
from schemas.topology import DeviceLocation, Gpu, Nic, NodeTopology, locate

DRIVER = "tandem.io"
STANDARD = "resource.kubernetes.io"
API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_STRING = 64  # an attribute's string value (DeviceAttributeMaxValueLength)

TAINT_UNHEALTHY = f"{DRIVER}/unhealthy"
TAINT_CORDONED = f"{DRIVER}/cordoned"
TAINT_PORT_DOWN = f"{DRIVER}/port-down"

Obj = dict[str, Any]
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_BDF = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class SliceError(ValueError):
    """The node's devices cannot be written as ResourceSlices (the message names the device)."""


def device_names(topology: NodeTopology) -> dict[str, str]:
    """Tandem device id → DRA device name (a DNS label), for every device the slices list.

    Ids that are DNS labels already (``gpu0``, ``gpu0-mig1-0``) keep their name; others are
    lower-cased with runs of other characters turned into ``-``. Two ids that would collide
    are refused with both named: a device name must say which device it is."""
    out: dict[str, str] = {}
    taken: dict[str, str] = {}
    for dev_id in _device_ids(topology):
        name = _NOT_LABEL.sub("-", dev_id.lower()).strip("-")[:63].strip("-")
        if not name:
            raise SliceError(f"{topology.name}: device id {dev_id!r} has no character a DRA name can use")
        if name in taken:
            raise SliceError(
                f"{topology.name}: device ids {taken[name]!r} and {dev_id!r} would both be named {name!r}"
            )
        taken[name] = dev_id
        out[dev_id] = name
    return out


def tandem_ids(topology: NodeTopology) -> dict[str, str]:
    """DRA device name → Tandem device id (the inverse of :func:`device_names`)."""
    return {name: dev_id for dev_id, name in device_names(topology).items()}


def resource_slices(
    topology: NodeTopology,
    *,
    node: str,
    generation: int,
    health: Mapping[str, DeviceHealth] | None = None,
) -> list[Obj]:
    """The ResourceSlice objects (plain JSON, as the API takes them) of ``node``'s pool.

    ``generation`` must grow whenever the content changes (the publisher keeps it); slices
    are named ``<node>-tandem.io-<n>``, so a publisher updates them in place."""
    names = device_names(topology)
    devices = list(_devices(topology, names, health or {}))
    limit = MAX_DEVICES_WITH_TAINTS if any("taints" in d for d in devices) else MAX_DEVICES
    chunks = [devices[i : i + limit] for i in range(0, len(devices), limit)] or [[]]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name(node, i), "labels": {f"{DRIVER}/node": node}},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        }
        for i, chunk in enumerate(chunks)
    ]


def slice_name(node: str, index: int) -> str:
    """The name of slice ``index`` of ``node``'s pool (a DNS subdomain, as node names are)."""
    return f"{node}-{DRIVER}-{index}"


# -- devices -------------------------------------------------------------------------------------


def _device_ids(topology: NodeTopology) -> Iterator[str]:
    for loc in locate(topology):
        dev = loc.device
        if isinstance(dev, Gpu):
            if dev.mig_mode:
                yield from (dev_id for dev_id, _ in dev.mig_ids())
            else:
                yield dev.id
        else:
            yield dev.id
            yield from (vf.name for vf in dev.vfs)


def _devices(
    topology: NodeTopology, names: Mapping[str, str], health: Mapping[str, DeviceHealth]
) -> Iterator[Obj]:
    for loc in locate(topology):
        place = _place(topology, loc)
        dev = loc.device
        if isinstance(dev, Gpu):
            yield from _gpu_devices(dev, place, names, health)
        else:
            yield from _nic_devices(dev, place, names, health)


def _gpu_devices(
    gpu: Gpu, place: dict[str, Obj], names: Mapping[str, str], health: Mapping[str, DeviceHealth]
) -> Iterator[Obj]:
    if not gpu.mig_mode:
        attrs = {"type": _s("gpu"), "index": _i(gpu.index), "uuid": _s(gpu.uuid), "model": _s(gpu.model)}
        attrs |= _bus(gpu.pci_bus_id) | place
        capacity = {"cores": {"value": "100"}}
        if gpu.memory_mib:
            capacity["memory"] = {"value": f"{gpu.memory_mib}Mi"}
        yield _device(
            names[gpu.id],
            attrs,
            capacity,
            taints=_taints(health.get(gpu.id)),
            shared=True,
        )
        return
    for dev_id, inst in gpu.mig_ids():
        attrs = {
            "type": _s("mig"),
            "profile": _s(inst.profile),
            "uuid": _s(inst.uuid),
            "parentIndex": _i(gpu.index),
            "parentUUID": _s(gpu.uuid),
            "model": _s(gpu.model),
        }
        attrs |= _bus(gpu.pci_bus_id) | place
        capacity = {"memory": {"value": f"{inst.memory_mib}Mi"}} if inst.memory_mib else {}
        # A MIG instance is as healthy as itself and its GPU.
        taints = _taints(health.get(dev_id)) + _taints(health.get(gpu.id))
        yield _device(names[dev_id], attrs, capacity, taints=_dedupe(taints))


def _nic_devices(
    nic: Nic, place: dict[str, Obj], names: Mapping[str, str], health: Mapping[str, DeviceHealth]
) -> Iterator[Obj]:
    link = {"linkType": _s(nic.link_type), "speedGbps": _i(nic.speed_gbps)}
    down = [] if nic.port_state == "active" else [_taint(TAINT_PORT_DOWN, nic.port_state)]
    attrs = {"type": _s("nic"), "function": _s("pf"), "rdmaDevice": _s(nic.name)} | link
    if nic.netdev:
        attrs["netdev"] = _s(nic.netdev)
    attrs |= _bus(nic.pci_bus_id) | place
    pf_taints = _taints(health.get(nic.id)) + down
    yield _device(names[nic.id], attrs, {}, taints=pf_taints)
    for vf in nic.vfs:
        vattrs = {"type": _s("nic"), "function": _s("vf"), "rdmaDevice": _s(vf.name), "pf": _s(names[nic.id])}
        vattrs |= link | {"vfIndex": _i(vf.index)}
        if vf.netdev:
            vattrs["netdev"] = _s(vf.netdev)
        vattrs |= _bus(vf.pci_bus_id) | place
        # A VF is no better than its port.
        yield _device(names[vf.name], vattrs, {}, taints=_dedupe(_taints(health.get(vf.name)) + pf_taints))


def _device(
    name: str, attrs: dict[str, Obj], capacity: dict[str, Obj], *, taints: list[Obj], shared: bool = False
) -> Obj:
    out: Obj = {"name": name, "attributes": attrs}
    if capacity:
        out["capacity"] = capacity
    if shared:
        out["allowMultipleAllocations"] = True
    if taints:
        out["taints"] = taints
    return out


def _place(topology: NodeTopology, loc: DeviceLocation) -> dict[str, Obj]:
    """Where the device sits: the attributes a claim's ``matchAttribute`` aligns on."""
    out = {
        f"{STANDARD}/pcieRoot": _s(_pcie_root(loc.root)),
        "numaNode": _i(loc.numa),
        "socket": _i(loc.socket),
    }
    if loc.switch is not None:
        out["pcieSwitch"] = _s(f"{loc.root}/{loc.switch}")
    dev = loc.device
    if isinstance(dev, Gpu):
        for i, part in enumerate(topology.nvlink_partitions):
            if dev.index in part:
                out["nvlinkPartition"] = _i(i)
        if topology.nvlink_domain is not None:
            dom = topology.nvlink_domain
            out["nvlinkDomain"] = _s(f"{dom.cluster_uuid}.{dom.clique_id}")
    return out


def _pcie_root(root: str) -> str:
    """The standard attribute's value: ``pci<domain>:<bus>`` when the topology's root id is one
    (the sysfs name), else the id itself — equal roots still compare equal."""
    return root if re.fullmatch(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}", root) else root.lower()


def _bus(bus_id: str | None) -> dict[str, Obj]:
    """``resource.kubernetes.io/pciBusID`` in extended BDF form (``0000:18:00.0``)."""
    if not bus_id:
        return {}
    m = _BDF.match(bus_id.strip())
    if m is None:
        return {}
    domain = (m.group(1) or "0000")[-4:].lower()
    return {f"{STANDARD}/pciBusID": _s(f"{domain}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}")}


def _taints(h: DeviceHealth | None) -> list[Obj]:
    if h is None:
        return []
    out = []
    if not h.healthy:
        out.append(_taint(TAINT_UNHEALTHY, h.reason))
    if h.cordoned:
        out.append(_taint(TAINT_CORDONED, h.reason))
    return out


def _taint(key: str, reason: str) -> Obj:
    # The value is a label value (63 characters of [-_.A-Za-z0-9]); the full reason stays in
    # Tandem's health records and `tandem device list`.
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:63].strip("-_.")
    return (
        {"key": key, "value": value, "effect": "NoSchedule"}
        if value
        else {"key": key, "effect": "NoSchedule"}
    )


def _dedupe(taints: list[Obj]) -> list[Obj]:
    seen: dict[str, Obj] = {}
    for t in taints:
        seen.setdefault(t["key"], t)
    return list(seen.values())


def _s(value: str) -> Obj:
    return {"string": value[:MAX_STRING]}


def _i(value: int) -> Obj:
    return {"int": value}
