"""A mixed fleet built from the built-in topologies, and a seeded stream of requests.

Every node gets its own decoded :class:`~schemas.topology.NodeTopology` with its own GPU UUIDs
(as the allocator gets them from inventory), so memory figures include per-node topology data.
"""

from __future__ import annotations

import random

import msgspec

from schemas.messages import AllocationRequest, PodRef
from schemas.topology import Gpu, Nic, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket
from tools.loadtest.mix import CAPTURES, REAL_KINDS, Workload, kind_topology  # shared with tandem loadtest

# (built-in topology, share of the fleet)
MIX: tuple[tuple[str, float], ...] = (
    ("dgx-h100", 0.40),
    ("dgx-a100", 0.30),
    ("pcie-4gpu-2nic", 0.15),
    ("gpu-only-8", 0.15),
)

# Real servers too: two `nvidia-smi topo -m` matrices from the repository's test data, as the
# load test's mix names and imports them (tools/loadtest/mix.py, REAL_KINDS).
MATRICES = CAPTURES
REAL: dict[str, tuple[str, str]] = {name: REAL_KINDS[name] for name in ("h200-10nic", "a800-4nic-asym")}
REAL_MIX: tuple[tuple[str, float], ...] = (
    ("dgx-h100", 0.30),
    ("dgx-a100", 0.20),
    ("h200-10nic", 0.10),
    ("a800-4nic-asym", 0.10),
    ("pcie-4gpu-2nic", 0.15),
    ("gpu-only-8", 0.15),
)
MIXES = {"builtin": MIX, "real": REAL_MIX}


def _topology(name: str) -> NodeTopology:
    return kind_topology(name)


V100 = "Tesla V100-SXM3-32GB"


def sixteen_gpu(nics_per_switch: int = 2) -> NodeTopology:
    """A DGX-2 / HGX-2 class server: 16 GPUs on one NVSwitch fabric (one NVLink domain), two
    sockets, each with two PCIe roots of two switches, each switch holding 2 GPUs and
    ``nics_per_switch`` NICs (1: DGX-2's 16 GPUs + 8 NICs; 2: 16 GPUs + 16 NICs)."""
    sockets = []
    gi = ni = 0
    for s in range(2):
        roots = []
        for r in range(2):
            switches = []
            for w in range(2):
                gpus = []
                for _ in range(2):
                    peers = [j for j in range(16) if j != gi]
                    uuid = f"GPU-16-{gi:02d}"
                    gpus.append(Gpu(index=gi, uuid=uuid, model=V100, memory_mib=32768, nvlink_peers=peers))
                    gi += 1
                nics = []
                for _ in range(nics_per_switch):
                    nics.append(Nic(name=f"mlx5_{ni}", speed_gbps=100))
                    ni += 1
                switches.append(PcieSwitch(id=f"sw{s}{r}{w}", gpus=gpus, nics=nics))
            roots.append(PcieRoot(id=f"pci{s}{r}", switches=switches))
        sockets.append(Socket(id=s, numa_nodes=[NumaNode(id=s, roots=roots)]))
    name = f"16gpu-{8 * nics_per_switch}nic"
    return NodeTopology(name=name, sockets=sockets).validate()


def fleet(n: int, mix: tuple[tuple[str, float], ...] = MIX) -> list[tuple[str, NodeTopology]]:
    """``n`` nodes named ``<topology>-<i>`` in the ``mix`` proportions."""
    out: list[tuple[str, NodeTopology]] = []
    left = n
    for pos, (name, share) in enumerate(mix):
        count = left if pos == len(mix) - 1 else round(n * share)
        left -= count
        raw = msgspec.json.encode(_topology(name)).decode()
        for i in range(count):
            node = f"{name}-{i:05d}"
            data = raw.replace('"GPU-', f'"GPU-{i:05d}-')
            out.append((node, msgspec.json.decode(data, type=NodeTopology)))
    return out


HOSTNAME_LABEL = "kubernetes.io/hostname"


DEFAULT_WORKLOAD = Workload()


def requests(
    seed: int, workload: Workload = DEFAULT_WORKLOAD, *, pin_to: list[str] | None = None
) -> RequestStream:
    # The pinning draws from its own generator, so the rest of the stream is the same with or
    # without pinned requests.
    return RequestStream(random.Random(seed), workload, pin_to=pin_to or [], pin_rng=random.Random(-seed - 1))


class RequestStream:
    def __init__(
        self, rng: random.Random, workload: Workload, *, pin_to: list[str], pin_rng: random.Random
    ) -> None:
        if workload.pinned and not pin_to:
            raise ValueError("a workload with pinned requests needs the node names to pin to")
        self.rng = rng
        self.w = workload
        self.n = 0
        self.pin_to = pin_to
        self._pin_rng = pin_rng

    def next(self) -> AllocationRequest:
        rng = self.rng
        self.n += 1
        g, r = self.w.draw(rng)
        rid = f"req-{self.n}"
        policy = "required" if rng.random() < self.w.required else None
        selector = {}
        if self.w.pinned and self._pin_rng.random() < self.w.pinned:
            selector = {HOSTNAME_LABEL: self._pin_rng.choice(self.pin_to)}
        return AllocationRequest(
            request_id=rid,
            pod=PodRef("bench", rid, rid),
            gpus=g,
            rdma=r,
            policy=policy,
            created_at=0.0,
            node_selector=selector,
        )
