"""Random node topologies and cluster states for property tests and the optimality benchmark.

Kept small on purpose (the reference search is exponential): a few GPUs and NICs, spread over
1-2 sockets, 1-2 NUMA nodes each, PCIe roots with or without switches, optional SR-IOV VFs,
NVLink peers and partitions, mixed GPU models and NIC link types.
"""

from __future__ import annotations

import random

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import (
    Gpu,
    Nic,
    NodeTopology,
    NumaNode,
    PcieRoot,
    PcieSwitch,
    Socket,
    VirtualFunction,
)
from services.allocator.core import Cluster

MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S")


def random_topology(
    rng: random.Random, *, max_gpus: int = 6, max_nics: int = 5, vfs: bool = True
) -> NodeTopology:
    make = _Devices(rng, model=rng.choice(MODELS), max_gpus=max_gpus, max_nics=max_nics, vfs=vfs)
    sockets = []
    root_n = 0
    for s in range(rng.randint(1, 2)):
        numas = []
        for n in range(rng.randint(1, 2)):
            roots = []
            for _ in range(rng.randint(1, 2)):
                roots.append(_random_root(rng, make, root_n=root_n))
                root_n += 1
            numas.append(NumaNode(id=s * 2 + n, roots=roots))
        sockets.append(Socket(id=s, numa_nodes=numas))
    topo = NodeTopology(name="rand", sockets=sockets)
    _random_nvlink(rng, topo, n=make.gpu_count)
    return topo.validate()


class _Devices:
    """GPUs and NICs for :func:`random_topology`, numbered in order, up to the maximum counts.

    The random draws happen in the order the tree asks for devices, so a seed keeps giving the
    same topology (the property tests' examples are reproducible by seed)."""

    def __init__(self, rng: random.Random, *, model: str, max_gpus: int, max_nics: int, vfs: bool) -> None:
        self.rng = rng
        self.model = model
        self.max_gpus = max_gpus
        self.max_nics = max_nics
        self.vfs = vfs
        self.gpu_count = 0
        self.nic_count = 0

    def gpus(self, n: int) -> list[Gpu]:
        rng = self.rng
        out = []
        for _ in range(n):
            if self.gpu_count >= self.max_gpus:
                break
            i = self.gpu_count
            self.gpu_count += 1
            m = self.model if rng.random() < 0.8 else rng.choice(MODELS)
            out.append(Gpu(index=i, uuid=f"GPU-{i:04d}", model=m, memory_mib=rng.choice((40960, 81920))))
        return out

    def nics(self, n: int) -> list[Nic]:
        rng = self.rng
        out = []
        for _ in range(n):
            if self.nic_count >= self.max_nics:
                break
            i = self.nic_count
            self.nic_count += 1
            vf_list = []
            if self.vfs and rng.random() < 0.35:
                vf_list = [
                    VirtualFunction(index=k, name=f"mlx5_{100 + i * 4 + k}") for k in range(rng.randint(1, 2))
                ]
            out.append(
                Nic(
                    name=f"mlx5_{i}",
                    link_type=rng.choice(("infiniband", "infiniband", "ethernet")),
                    speed_gbps=rng.choice((100, 200, 400)),
                    vfs=vf_list,
                )
            )
        return out


def _random_root(rng: random.Random, make: _Devices, *, root_n: int) -> PcieRoot:
    """A PCIe root with 0-2 switches, each with a few devices, and a few devices of its own."""
    sws = [
        PcieSwitch(
            id=f"sw{root_n}{w}",
            gpus=make.gpus(rng.choice((0, 1, 1, 2))),
            nics=make.nics(rng.choice((0, 1, 1, 2))),
        )
        for w in range(rng.choice((0, 1, 2, 2)))
    ]
    return PcieRoot(
        id=f"r{root_n}",
        switches=sws,
        gpus=make.gpus(rng.choice((0, 0, 1))),
        nics=make.nics(rng.choice((0, 0, 1))),
    )


def _random_nvlink(rng: random.Random, topo: NodeTopology, *, n: int) -> None:
    """NVLink on ``n`` GPUs: none, all-to-all, or pairs; sometimes explicit partitions."""
    mode = rng.choice(("none", "all", "pairs"))
    peers: dict[int, list[int]] = {i: [] for i in range(n)}
    if mode == "all":
        peers = {i: [j for j in range(n) if j != i] for i in range(n)}
    elif mode == "pairs":
        for i in range(0, n - 1, 2):
            peers[i].append(i + 1)
            peers[i + 1].append(i)
    for loc_gpu in topo.gpus():
        loc_gpu.nvlink_peers = peers[loc_gpu.index]
    if n >= 4 and rng.random() < 0.3:
        topo.nvlink_partitions = [[0, 1], [2, 3], list(range(n))]


def big_topology(rng: random.Random, *, gpus: int = 16, nics: int = 16, vfs: bool = True) -> NodeTopology:
    """A 16-GPU class server (HGX-2 / DGX-2, 16-GPU PCIe boxes): ``gpus`` GPUs and ``nics``
    NICs spread at random over 2 sockets, 1-2 NUMA nodes each, 1-2 PCIe roots per NUMA node
    and 1-4 switches per root (most devices under a switch, some directly on a root); NVLink
    one NVSwitch domain, bridge pairs (half the time across switches), a 2 / 4 / 8 / 16
    partition table, or none. Too big for :func:`bench.exhaustive.best` unless most devices
    are held."""
    # Holders: (socket, NUMA, root, switch or -1 for the root itself).
    holders: list[tuple[int, int, int, int]] = []
    for s in range(2):
        for n in range(rng.randint(1, 2)):
            for r in range(rng.randint(1, 2)):
                holders.append((s, n, r, -1))
                holders.extend((s, n, r, w) for w in range(rng.randint(1, 4)))
    switches = [h for h in holders if h[3] >= 0]

    def place() -> tuple[int, int, int, int]:
        return rng.choice(holders) if rng.random() < 0.15 else rng.choice(switches)

    # Devices are numbered in tree order, as discovery numbers them.
    gpu_at = sorted(place() for _ in range(gpus))
    nic_at = sorted(place() for _ in range(nics))
    model = rng.choice(MODELS)
    made: dict[tuple[int, int, int, int], tuple[list[Gpu], list[Nic]]] = {h: ([], []) for h in holders}
    for i, h in enumerate(gpu_at):
        m = model if rng.random() < 0.9 else rng.choice(MODELS)
        mem = rng.choice((40960, 81920))
        made[h][0].append(Gpu(index=i, uuid=f"GPU-{i:04d}", model=m, memory_mib=mem))
    for i, h in enumerate(nic_at):
        vf_list = []
        if vfs and rng.random() < 0.2:
            count = rng.randint(1, 2)
            vf_list = [VirtualFunction(index=k, name=f"mlx5_{100 + i * 4 + k}") for k in range(count)]
        link = rng.choice(("infiniband", "infiniband", "ethernet"))
        speed = rng.choice((100, 200, 400))
        made[h][1].append(Nic(name=f"mlx5_{i}", link_type=link, speed_gbps=speed, vfs=vf_list))
    sockets: dict[int, dict[int, dict[int, PcieRoot]]] = {}
    for s, n, r, w in holders:
        g_list, n_list = made[(s, n, r, w)]
        roots = sockets.setdefault(s, {}).setdefault(n, {})
        if w < 0:
            roots[r] = PcieRoot(id=f"r{s}{n}{r}", gpus=g_list, nics=n_list)
        else:
            roots[r].switches.append(PcieSwitch(id=f"sw{s}{n}{r}{w}", gpus=g_list, nics=n_list))
    socket_list = [
        Socket(id=s, numa_nodes=[NumaNode(id=s * 2 + n, roots=list(r.values())) for n, r in numas.items()])
        for s, numas in sockets.items()
    ]
    topo = NodeTopology(name="big", sockets=socket_list)
    mode = rng.choice(("nvswitch", "pairs", "table", "none"))
    peers: dict[int, list[int]] = {i: [] for i in range(gpus)}
    if mode == "nvswitch":
        peers = {i: [j for j in range(gpus) if j != i] for i in range(gpus)}
    elif mode == "pairs":
        order = list(range(gpus))
        if rng.random() < 0.5:
            rng.shuffle(order)  # bridges that cross switches
        for k in range(0, gpus - 1, 2):
            peers[order[k]].append(order[k + 1])
            peers[order[k + 1]].append(order[k])
    for gpu in topo.gpus():
        gpu.nvlink_peers = peers[gpu.index]
    if mode == "table":
        size = 2
        while size <= gpus:
            topo.nvlink_partitions += [list(range(k, min(k + size, gpus))) for k in range(0, gpus, size)]
            size *= 2
    return topo.validate()


def all_device_ids(topo: NodeTopology) -> list[str]:
    out: list[str] = []
    for g in topo.gpus():
        out.append(g.id)
    for nic in topo.nics():
        out.append(nic.name)
        out.extend(vf.name for vf in nic.vfs)
    return out


CLASSES = {
    "default": DeviceClass(),
    "ib": DeviceClass(nic_link_type="infiniband", scope="pcie-root"),
    "vf": DeviceClass(nic_function="vf"),
    "any": DeviceClass(nic_function="any", nic_min_speed_gbps=200),
    "big": DeviceClass(gpu_min_memory_mib=81920, gpu_models=["h100", "a100"]),
    # The default node order is alignment-first; this class keeps the other one tested.
    "packed": DeviceClass(node_order="used-first"),
}


HOSTNAME = "kubernetes.io/hostname"


def random_cluster(
    seed: int, n_nodes: int, *, reserve: float | None = None, pinned_max: int | None = None
) -> tuple[Cluster, dict[str, NodeTopology], dict[str, set[str]]]:
    """A cluster of random nodes with random holds and unavailable devices; every node is
    labelled with a pool and, as the allocator service does, its hostname.

    ``reserve`` overrides the core's default reserve share (which needs 50 large servers to
    keep one in reserve, so small random clusters never see reserve pressure otherwise);
    ``pinned_max`` the core's limit for deciding a selector on its nodes directly (0: every
    selector goes through the grouped index, as selectors matching many nodes do)."""
    rng = random.Random(seed)
    policy = rng.choice(("binpack", "spread"))
    kw: dict[str, float | int] = {}
    if reserve is not None:
        kw["reserve"] = reserve
    if pinned_max is not None:
        kw["pinned_max"] = pinned_max
    cluster = Cluster(node_policy=policy, device_classes=CLASSES, **kw)  # type: ignore[arg-type]
    topos: dict[str, NodeTopology] = {}
    blocked: dict[str, set[str]] = {}
    shared = random_topology(rng)
    for i in range(n_nodes):
        # Half the nodes share hardware, so the (shape, mask) cache is exercised.
        topo = shared if rng.random() < 0.5 else random_topology(rng)
        name = f"n{i}"
        ids = all_device_ids(topo)
        bad = {d for d in ids if rng.random() < 0.05}
        cluster.set_node(name, topo, labels={"pool": rng.choice("ab"), HOSTNAME: name}, unavailable=bad)
        held: set[str] = set()
        for h in range(rng.randint(0, 2)):
            devs = {d for d in ids if rng.random() < 0.15}
            cluster.hold(name, f"h{h}", devs)
            held |= devs
        topos[name] = topo
        blocked[name] = bad | held
    return cluster, topos, blocked


def random_request(rng: random.Random, rid: str = "req") -> AllocationRequest:
    g = rng.choice((0, 1, 1, 2, 2, 3, 4))
    r = g if g and rng.random() < 0.5 else rng.randint(0 if g else 1, 4)
    pairing = None if g != r or rng.random() < 0.8 else "shared"
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=g,
        rdma=r,
        scope=rng.choice((None, "pcie-switch", "pcie-root", "numa", "socket", "node")),
        policy=rng.choice((None, "required", "preferred")),
        pairing=pairing,
        device_class=rng.choice(("default", "default", *CLASSES)),
        node_selector=rng.choice(
            ({}, {}, {}, {"pool": "a"}, {HOSTNAME: f"n{rng.randrange(3)}"}, {HOSTNAME: "n1", "pool": "b"})
        ),
    )
