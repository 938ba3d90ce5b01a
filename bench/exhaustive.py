"""Reference search: every GPU subset x every NIC subset x every pairing, scored directly.

Written from the definitions in ``services/allocator/core/search.py``'s docstring, not from its
code: pair scopes come from :func:`schemas.topology.scope_between`, per-gpu pairings are tried
as every permutation, and fragmentation is counted from the topology tree. It is exponential
and only meant for small nodes (the property tests and ``bench.run``'s optimality check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations, permutations

from schemas.config import DeviceClass
from schemas.topology import DeviceLocation, Gpu, Nic, NodeTopology, Scope, locate, scope_between
from services.allocator.core import Spec, nvlink_partitions

Key = tuple[int, ...]


def effective_free(topo: NodeTopology, blocked: set[str]) -> set[str]:
    """Free device ids: a blocked PF blocks its VFs; a blocked VF makes its PF unusable."""
    free: set[str] = set()
    for loc in locate(topo):
        d = loc.device
        if isinstance(d, Gpu):
            if d.id not in blocked:
                free.add(d.id)
            continue
        vf_names = {vf.name for vf in d.vfs}
        pf_blocked = d.name in blocked
        if not pf_blocked and not (vf_names & blocked):
            free.add(d.name)
        if not pf_blocked:
            free |= vf_names - blocked
    return free


def _gpu_ok(g: Gpu, dc: DeviceClass) -> bool:
    if dc.gpu_models and not any(m.lower() in g.model.lower() for m in dc.gpu_models):
        return False
    return g.memory_mib >= dc.gpu_min_memory_mib


def _nic_candidates(nic: Nic, dc: DeviceClass) -> list[str]:
    if dc.nic_link_type is not None and nic.link_type != dc.nic_link_type:
        return []
    if nic.speed_gbps < dc.nic_min_speed_gbps:
        return []
    vfs = [vf.name for vf in nic.vfs]
    if dc.nic_function == "pf":
        return [nic.name]
    if dc.nic_function == "vf":
        return vfs
    return vfs if vfs else [nic.name]  # "any": by VF when split, whole otherwise


def best(topo: NodeTopology, free: set[str], spec: Spec) -> tuple[Key, list[str], list[str]] | None:
    """The minimal quality key (with one placement reaching it), or None when nothing fits.

    Every GPU subset x every NIC subset; the key's terms in order: scope unmet, GPUs then NICs
    paired within each scope level (more is better), NVLink domain split, whole free NVLink
    domains touched, whole free sockets / NUMA nodes / roots / switches broken into.
    """
    where, gpus, nics = _candidates(topo, free, spec.dc)
    whole = _whole_units(where, free)
    index_of, parts, whole_parts = _nvlink_parts(topo, free)
    g, r = spec.gpus, spec.rdma

    def sc(a: str, b: str) -> int:
        return int(scope_between(where[a], where[b]))

    result: tuple[Key, list[str], list[str]] | None = None
    for G in combinations(gpus, g):
        gi = {index_of[x] for x in G}
        nv = 1 if g > 1 and not any(gi <= p for p in parts) else 0
        nvb = sum(len(p) for p in whole_parts if gi & p)
        for N in combinations(nics, r):
            c, d, unmet = _paired(G, N, spec, sc=sc)
            if unmet and spec.required:
                continue
            chosen = set(G) | set(N)
            broken = [sum(1 for lvl, m in whole if lvl == k and m & chosen) for k in range(4)]
            key = (
                unmet,
                -c[0],
                -c[1],
                -c[2],
                -c[3],
                -d[0],
                -d[1],
                -d[2],
                -d[3],
                nv,
                nvb,
                broken[3],
                broken[2],
                broken[1],
                broken[0],
            )
            if result is None or key < result[0]:
                result = (key, list(G), list(N))
    return result


def _candidates(
    topo: NodeTopology, free: set[str], dc: DeviceClass
) -> tuple[dict[str, DeviceLocation], list[str], list[str]]:
    """Where every device id (GPU, PF, VF) sits, and the free GPUs and NIC ids the class allows."""
    where: dict[str, DeviceLocation] = {}
    gpus: list[str] = []
    nics: list[str] = []
    for loc in locate(topo):
        d = loc.device
        where[d.id] = loc
        if isinstance(d, Gpu):
            if d.id in free and _gpu_ok(d, dc):
                gpus.append(d.id)
        else:
            for name in _nic_candidates(d, dc):
                where[name] = loc
                if name in free:
                    nics.append(name)
            for vf in d.vfs:
                where[vf.name] = loc
    return where, gpus, nics


def _whole_units(where: dict[str, DeviceLocation], free: set[str]) -> list[tuple[int, set[str]]]:
    """The wholly free units for fragmentation, by level (0 switch, 1 root, 2 NUMA, 3 socket):
    every device id (GPU, PF, VF) under each switch/root/NUMA/socket."""
    by_key: dict[tuple[object, ...], set[str]] = {}
    for name, loc in where.items():
        for level, key in (
            (0, loc.key(Scope.PCIE_SWITCH)),
            (1, loc.key(Scope.PCIE_ROOT)),
            (2, loc.key(Scope.NUMA)),
            (3, loc.key(Scope.SOCKET)),
        ):
            if key is not None:
                by_key.setdefault((level, *key), set()).add(name)
    units: list[tuple[int, set[str]]] = [(k[0], members) for k, members in by_key.items()]  # type: ignore[misc]
    return [(lvl, m) for lvl, m in units if m <= free]


def _nvlink_parts(
    topo: NodeTopology, free: set[str]
) -> tuple[dict[str, int], list[set[int]], list[set[int]]]:
    """GPU index by id, the NVLink domains of more than one GPU, and those wholly free."""
    index_of = {f"gpu{g.index}": g.index for g in topo.gpus()}
    present = set(index_of.values())
    parts = [set(p) & present for p in nvlink_partitions(topo)]
    parts = [p for p in parts if len(p) > 1]
    whole_parts = [p for p in parts if all(f"gpu{i}" in free for i in p)]
    return index_of, parts, whole_parts


def _paired(
    G: tuple[str, ...], N: tuple[str, ...], spec: Spec, *, sc: Callable[[str, str], int]
) -> tuple[list[int], list[int], int]:
    """GPUs (``c``) and NICs (``d``) paired within each scope level, cumulative, and whether the
    class's scope is unmet (1/0). Per-gpu: the best one-to-one pairing over every permutation
    (``d`` stays 0); shared: each device's nearest partner on the other side."""
    c = [0, 0, 0, 0]
    d = [0, 0, 0, 0]
    g, S = len(G), int(spec.scope)
    if not (G and N):
        return c, d, 0
    if spec.per_gpu:
        best_c = None
        for perm in permutations(N):
            scopes = [sc(a, b) for a, b in zip(G, perm, strict=True)]
            cum = tuple(sum(1 for s in scopes if s <= k) for k in range(4))
            if best_c is None or cum > best_c:
                best_c = cum
        assert best_c is not None
        c = list(best_c)
        return c, d, 1 if S < 4 and c[S] < g else 0
    gn = [min(sc(a, b) for b in N) for a in G]
    ng = [min(sc(a, b) for a in G) for b in N]
    c = [sum(1 for s in gn if s <= k) for k in range(4)]
    d = [sum(1 for s in ng if s <= k) for k in range(4)]
    return c, d, 1 if S < 4 and (c[S] < g or d[S] < len(N)) else 0


# ---------------------------------------------------------------------------------------------
# The node order's reserve rule, from its definition (services/allocator/core/cluster.py)


def aligned_free(topo: NodeTopology, free: set[str]) -> int:
    """GPU/NIC pairs that could still share a PCIe switch: per switch, min(free GPUs, free PFs)."""
    gpus: dict[tuple[object, ...], int] = {}
    pfs: dict[tuple[object, ...], int] = {}
    for loc in locate(topo):
        key = loc.key(Scope.PCIE_SWITCH)
        if key is None or loc.device.id not in free:
            continue
        side = gpus if isinstance(loc.device, Gpu) else pfs
        side[key] = side.get(key, 0) + 1
    return sum(min(n, pfs.get(k, 0)) for k, n in gpus.items())


def all_devices(topo: NodeTopology) -> set[str]:
    out = {g.id for g in topo.gpus()}
    for nic in topo.nics():
        out.add(nic.name)
        out.update(vf.name for vf in nic.vfs)
    return out


def under_pressure(topos: dict[str, NodeTopology], free: dict[str, set[str]], reserve: float) -> bool:
    """Fewer nodes than ``ceil(reserve x capable)`` can host the largest aligned job ``K``,
    where ``K`` is the largest whole-node aligned capacity that at least ``1 / reserve`` nodes
    have (so that the reserve is at least one node)."""
    if reserve <= 0:
        return False
    caps = [aligned_free(t, all_devices(t)) for t in topos.values()]
    for k in sorted({c for c in caps if c > 0}, reverse=True):
        able = sum(1 for c in caps if c >= k)
        if able * reserve >= 1.0 - 1e-9:
            target = math.ceil(able * reserve - 1e-9)
            have = sum(1 for name, t in topos.items() if aligned_free(t, free[name]) >= k)
            return have < target
    return False


def capacity_cost(topo: NodeTopology, free: set[str], taken: set[str]) -> int:
    """How far the largest fully aligned job the node could take (a power of two) drops."""
    vf_parent = {vf.name: nic.name for nic in topo.nics() for vf in nic.vfs}
    after = free - taken - {vf_parent[d] for d in taken if d in vf_parent}

    def pow2(n: int) -> int:
        return 0 if n <= 0 else 1 << (n.bit_length() - 1)

    return pow2(aligned_free(topo, free)) - pow2(aligned_free(topo, after))
