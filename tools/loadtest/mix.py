"""What the harness simulates: the fleet's composition and the stream of requests (pure).

Both the harness and the fleet process call :func:`fleet_plan` with the same node count, so
they agree on every node's name and hardware without talking. The proportions follow the
core benchmark (``bench/fleet.py``): 40 % ``dgx-h100`` (8 GPUs, 8 NICs, one per PCIe
switch), 30 % ``dgx-a100`` (8 GPUs, 10 NICs), 15 % ``pcie-4gpu-2nic`` (4 GPUs, 2 NICs with
SR-IOV VFs), 15 % ``gpu-only-8`` (8 GPUs, no NIC). Each node's GPUs get their own UUIDs, as
real nodes would report them. Besides the built-in kinds, :data:`REAL_KINDS` names real
servers: ``nvidia-smi topo -m`` captures (``tests/unit/test_topology_matrices``, the copies of
``../shared/topologies``) read with the project's importer, so a plan may mix them in
(:func:`parse_mix` reads a mix written ``KIND=SHARE,...``).

:class:`RequestStream` is a seeded stream of :class:`~schemas.messages.AllocationRequest`
with the benchmark's workload: 1 / 2 / 4 / 8 GPUs (30 / 20 / 25 / 25 %); 70 % ask one NIC per
GPU, 20 % no NIC (GPU-only), the rest half as many NICs as GPUs (shared); 20 % make a scope
*required* (half ``pcie-switch``, half ``numa``), and a share ``pinned`` name one node with the
``kubernetes.io/hostname`` selector, as pods pinned to a node do. With ``shares`` > 0, that
share of the requests asks a *share* of one GPU instead (class :data:`SHARED_CLASS`, one of
:data:`SHARE_SIZES`, a NIC in 30 %), as the core's share benchmark does (``bench/shares.py``);
a share weighs its compute percent / 100 of a GPU in the fleet's utilisation (:func:`weight`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import msgspec

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import NodeTopology, ScopeName
from services.topology import import_nvidia_smi, load_topology

# (built-in topology, share of the fleet)
FLEET_MIX: tuple[tuple[str, float], ...] = (
    ("dgx-h100", 0.40),
    ("dgx-a100", 0.30),
    ("pcie-4gpu-2nic", 0.15),
    ("gpu-only-8", 0.15),
)
# Real servers: a kind → its capture and GPU model (the matrix names no model). Each one's
# layout: ``h200-10nic`` 8 switches of 1 GPU + 1 NIC (one with 3 NICs); ``a100-10nic`` and
# ``nv18-13nic`` 4 switches of 2 GPUs + 2 NICs and one of NICs alone; ``a800-4nic-asym``
# 4 NICs for 8 GPUs, on 3 switches.
CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "unit" / "test_topology_matrices"
REAL_KINDS: dict[str, tuple[str, str]] = {
    "h200-10nic": ("10_glm52_8xH200_10nic_3pix-per-gpu3.txt", "NVIDIA H200"),
    "a100-10nic": ("09_oyanghd_8xA100-SXM-40G_10nic.txt", "NVIDIA A100-SXM4-40GB"),
    "nv18-13nic": ("03_penny-blog_8xNV18_13nic_ib-eth.txt", "NVIDIA H100 80GB HBM3"),
    "a800-4nic-asym": ("22_llm-action_8xA800_4nic-asym.txt", "NVIDIA A800-SXM4-80GB"),
}
_KINDS = frozenset(kind for kind, _ in FLEET_MIX) | frozenset(REAL_KINDS)
KINDS = tuple(sorted(_KINDS))  # every kind a plan may name
# The Kubernetes well-known label every node carries (the allocator labels nodes with it).
HOSTNAME_LABEL = "kubernetes.io/hostname"
NAMESPACE = "loadtest"
REQUIRED_SCOPES: tuple[ScopeName, ...] = ("pcie-switch", "numa")
# The device class of share requests, as the harness configures the allocators with it.
SHARED_CLASS = "loadtest-shared"
SHARED_DEVICE_CLASS = DeviceClass(sharing="hami", max_shares_per_gpu=8)
# (memory MiB, compute percent) of a share: a handful of presets, as sharing setups offer.
SHARE_SIZES: tuple[tuple[int, int], ...] = ((4096, 10), (8192, 25), (10240, 25), (20480, 50))
UNITS_PER_GPU = 100  # the driver counts the fleet in hundredths of a GPU (see weight)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    kind: str  # built-in topology name


def fleet_plan(n: int, mix: tuple[tuple[str, float], ...] = FLEET_MIX) -> list[NodeSpec]:
    """``n`` nodes named ``<kind>-<i:05d>`` in the ``mix`` proportions (the last kind takes the
    rounding rest), kinds interleaved so that any prefix of the list is a mixed fleet too."""
    counts: list[int] = []
    left = n
    for pos, (_, share) in enumerate(mix):
        count = left if pos == len(mix) - 1 else min(left, round(n * share))
        counts.append(count)
        left -= count
    # Interleave by share: node j of a kind sits at position (j + 0.5) / count of the run.
    keyed = [
        ((j + 0.5) / count, pos, NodeSpec(f"{kind}-{j:05d}", kind))
        for pos, ((kind, _), count) in enumerate(zip(mix, counts, strict=True))
        for j in range(count)
    ]
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [spec for _, _, spec in keyed]


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """A mix written ``KIND=SHARE,KIND=SHARE`` (shares > 0, normalised to sum 1); ValueError
    naming the part that is wrong."""
    out: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        kind, sep, share = part.partition("=")
        if not sep or kind not in _KINDS:
            raise ValueError(f"mix entry {part!r}: want KIND=SHARE with KIND one of {', '.join(KINDS)}")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"mix entry {part!r}: share {share!r} is not a number") from None
        if not value > 0:
            raise ValueError(f"mix entry {part!r}: share must be above 0")
        out.append((kind, value))
    total = sum(v for _, v in out)
    return tuple((kind, v / total) for kind, v in out)


@functools.cache
def kind_topology(kind: str) -> NodeTopology:
    """A built-in topology by name, or a real server's capture (:data:`REAL_KINDS`)."""
    if kind in REAL_KINDS:
        file, model = REAL_KINDS[kind]
        return import_nvidia_smi((CAPTURES / file).read_text(), name=kind, gpu_model=model).topology
    return load_topology(kind)


@functools.cache
def kind_gpus(kind: str) -> int:
    return len(kind_topology(kind).gpus())


@functools.cache
def _kind_json(kind: str) -> str:
    return msgspec.json.encode(kind_topology(kind)).decode()


def node_topology(spec: NodeSpec) -> NodeTopology:
    """The node's own tree: the kind's topology renamed to the node, GPU UUIDs made unique."""
    suffix = spec.name.rsplit("-", 1)[-1]
    data = _kind_json(spec.kind).replace('"GPU-', f'"GPU-{suffix}-')
    topo = msgspec.json.decode(data, type=NodeTopology)
    return msgspec.structs.replace(topo, name=spec.name)


def fleet_gpus(plan: list[NodeSpec]) -> int:
    return sum(kind_gpus(spec.kind) for spec in plan)


def gpu_memory(node: str, device: str) -> int | None:
    """The memory (MiB) of GPU ``device`` of a simulated node, from the kind its name starts
    with (:func:`fleet_plan`'s names); None for a name or device the plan does not have."""
    kind = node.rsplit("-", 1)[0]
    if kind not in _KINDS:
        return None  # not a node of the plan
    return next((g.memory_mib for g in kind_topology(kind).gpus() if g.id == device), None)


def weight(request: AllocationRequest) -> int:
    """What the request takes from the fleet, in hundredths of a GPU (whole numbers, so that
    the driver's sums come back to exactly 0): a share counts its compute percent."""
    if request.shared:
        return request.gpus * (request.gpu_cores_percent or 0)
    return request.gpus * UNITS_PER_GPU


@dataclass(frozen=True, slots=True)
class Workload:
    sizes: tuple[tuple[int, float], ...] = ((1, 0.30), (2, 0.20), (4, 0.25), (8, 0.25))
    per_gpu: float = 0.70  # rdma == gpus
    gpu_only: float = 0.20  # rdma == 0; the rest asks half as many NICs (shared)
    required: float = 0.20  # policy=required, scope from REQUIRED_SCOPES
    pinned: float = 0.0  # node_selector kubernetes.io/hostname=<a random node>
    shares: float = 0.0  # a share of one GPU (SHARED_CLASS, one of SHARE_SIZES) instead

    def mean_gpus(self) -> float:
        """GPUs a request takes on average (a share its compute percent / 100)."""
        whole = sum(size * share for size, share in self.sizes) / sum(share for _, share in self.sizes)
        shared = sum(cores for _, cores in SHARE_SIZES) / len(SHARE_SIZES) / UNITS_PER_GPU
        return (1 - self.shares) * whole + self.shares * shared

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """GPUs and NICs of the next request (two draws from ``rng``; the core benchmark,
        bench/fleet.py, draws its requests the same way)."""
        gpus = rng.choices([s for s, _ in self.sizes], [p for _, p in self.sizes])[0]
        x = rng.random()
        if x < self.per_gpu:
            return gpus, gpus
        if x < self.per_gpu + self.gpu_only:
            return gpus, 0
        return gpus, max(1, gpus // 2)


class RequestStream:
    """Seeded requests ``<run>-<n>``; ``run`` keeps ids unique across runs on one server."""

    def __init__(self, *, seed: int, run: str, nodes: list[str], workload: Workload = Workload()) -> None:
        self.rng = random.Random(seed)
        self.run = run
        self.nodes = nodes
        self.w = workload
        self.n = 0

    def next(self) -> AllocationRequest:
        rng = self.rng
        self.n += 1
        rid = f"{self.run}-{self.n:07d}"
        if self.w.shares and rng.random() < self.w.shares:
            return _share_request(rid, rng)
        g, r = self.w.draw(rng)
        scope = rng.choice(REQUIRED_SCOPES) if rng.random() < self.w.required else None
        selector = {}
        if self.nodes and rng.random() < self.w.pinned:
            selector = {HOSTNAME_LABEL: rng.choice(self.nodes)}
        return AllocationRequest(
            request_id=rid,
            pod=PodRef(namespace=NAMESPACE, name=rid, uid=rid),
            gpus=g,
            rdma=r,
            scope=scope,
            policy="required" if scope else None,
            node_selector=selector,
        )


def _share_request(rid: str, rng: random.Random) -> AllocationRequest:
    mem, cores = rng.choice(SHARE_SIZES)
    return AllocationRequest(
        request_id=rid,
        pod=PodRef(namespace=NAMESPACE, name=rid, uid=rid),
        gpus=1,
        rdma=1 if rng.random() < 0.3 else 0,
        device_class=SHARED_CLASS,
        gpu_memory_mib=mem,
        gpu_cores_percent=cores,
    )


def probe_request(*, run: str, node: str) -> AllocationRequest:
    """One GPU pinned to ``node``: placed only once the allocator knows that node."""
    rid = f"{run}-probe"
    return AllocationRequest(
        request_id=rid,
        pod=PodRef(namespace=NAMESPACE, name=rid, uid=rid),
        gpus=1,
        node_selector={HOSTNAME_LABEL: node},
    )
