"""The joint in-node search: the best GPUs *and* NICs on one node, exactly.

Quality order (a tuple, smaller is better; :class:`Choice` ``key`` then ``frag``):

1. the required scope is met (every pair within it; for ``shared`` pairing also every NIC
   within it of some GPU);
2. pairs at each scope level, finer first: compared as cumulative counts
   ``(pairs within pcie-switch, within pcie-root, within numa, within socket)``, each larger
   is better (for ``shared`` pairing the NIC-to-nearest-GPU counts follow);
3. the GPU set lies inside one NVLink partition or domain (0) or not (1); which partition —
   the tightest, or one already broken — is a fragmentation question (4.), so a request is
   not sent to an empty node just to get a tighter NVLink pair;
4. fragmentation: the whole-free units the placement breaks, as
   ``(sum of sizes of NVLink partitions broken, sockets, NUMA nodes, PCIe roots, PCIe
   switches broken)``, each fewer is better.

Why it can be exact without trying every pairing: scope levels nest (a switch lies in one
root, a root in one NUMA node, ...), so for a GPU set G and a NIC count ``n_u`` in each unit
``u``, the most pairs that can lie within level ``k`` is ``sum(min(g_u, n_u) for u at k)``,
and bottom-up greedy matching reaches that maximum at every level at once. With the free
NICs ``a_u`` the best G can get is ``sum(min(g_u, a_u))`` per level, so for ``per-gpu``
pairing the search scores every GPU subset cheaply, keeps the best, and only for those
enumerates the NIC choices that keep the best pair counts (``n_u >= min(g_u, a_u)`` in every
unit) to minimise fragmentation. NICs with the same location (same switch, or directly on the
same root) are interchangeable for every criterion, so NIC choices are count vectors over
location classes, not subsets. ``shared`` pairing scores every (GPU subset, NIC vector).

Property tests check the result against a plain exhaustive search over all device subsets
and all matchings.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from schemas.topology import SCOPE_NAMES, Scope

from .model import LEVELS, ClassView, Shape, bits
from .request import Spec

__all__ = [
    "Choice",
    "Refusal",
    "capacity_cost",
    "cross_bound",
    "cross_key",
    "evaluate",
    "fresh_cost",
    "one_sided_waste",
    "precheck",
]


@dataclass(frozen=True, slots=True)
class Choice:
    """The best placement on one (shape, free mask) for one request key, slot-level."""

    key: tuple[int, ...]
    frag: tuple[int, ...]
    gpus: tuple[int, ...]
    nics: tuple[int, ...]
    pairs: tuple[tuple[int, int, int], ...]  # (gpu slot, nic slot, scope)
    scope: int
    met: bool
    cross: tuple[int, ...]  # what nodes are compared on: (*cross_key, one_sided_waste)


def cross_key(key: tuple[int, ...], scope: int) -> tuple[int, ...]:
    """The alignment part nodes are compared on: scope met, pairs within the requested scope
    and each coarser one, NVLink fit. Alignment *finer* than asked only orders placements
    within a node, so a request is not sent to an empty node just for finer pairs."""
    return (key[0], *key[1 + scope : 5], *key[5 + scope : 9], key[9])


def cross_bound(spec: Spec) -> tuple[int, ...]:
    """A lower bound of :attr:`Choice.cross` for any node, without searching."""
    s = int(spec.scope)
    both = spec.gpus > 0 and spec.rdma > 0
    c = -spec.gpus if both else 0
    d = -spec.rdma if both and not spec.per_gpu else 0
    return (0, *([c] * (4 - s)), *([d] * (4 - s)), 0, 0)


def fresh_cost(shape: Shape, free: int, spec: Spec) -> int:
    """With ``binpack``, opening a fresh node (every GPU and NIC free) for a ``preferred``
    request costs its GPU count: such a request goes to a used node if one can take it, even
    with worse alignment, so whole servers stay available for the large jobs that need them.
    A ``required`` request is never placed below its scope, so for it the cost is 0."""
    whole = shape.gpu_all | shape.pf_all
    if spec.required or free & whole != whole:
        return 0
    return shape.n_gpus


def _pow2_floor(n: int) -> int:
    return 0 if n <= 0 else 1 << (n.bit_length() - 1)


def capacity_cost(shape: Shape, free: int, choice: Choice) -> int:
    """What a placement costs the node's capacity for large aligned jobs, buddy-style.

    A node's aligned capacity is :meth:`Shape.aligned_free` (the most GPU/NIC pairs it could
    still put on shared PCIe switches), rounded down to a power of two: the largest of the
    1 / 2 / 4 / 8 ... GPU + NIC jobs it could still take fully aligned. The cost is how much
    that drops: a 1+1 job that turns a node able to take 8+8 into one able to take 4+4 costs 4,
    one that takes a pair from a node with 3 or 5-7 aligned pairs left costs 0 (it uses a
    partial unit). Used by the binpack order under reserve pressure (see :mod:`.cluster`)."""
    taken = 0
    for s in (*choice.gpus, *choice.nics):
        taken |= 1 << s
    # A VF taken makes its PF unusable as a whole NIC (effective_free applies that rule).
    after = shape.effective_free(~(free & ~taken) & ((1 << shape.n_slots) - 1))
    return _pow2_floor(shape.aligned_free(free)) - _pow2_floor(shape.aligned_free(after))


def one_sided_waste(shape: Shape, free: int, g: int, r: int) -> int:
    """A GPU-only request prefers nodes with fewer free NICs, a NIC-only one nodes with fewer
    free GPUs: the other kind stays where requests needing both can pair it."""
    if r == 0:
        return (free & shape.pf_all).bit_count()
    if g == 0:
        return (free & shape.gpu_all).bit_count()
    return 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a node cannot take the request; ``text`` is aggregated over nodes by equality."""

    code: str  # "gpus" | "nics" | "scope" | "selector"
    text: str


_PLURAL = {
    Scope.PCIE_SWITCH: "under their PCIe switches",
    Scope.PCIE_ROOT: "on their PCIe root complexes",
    Scope.NUMA: "on their NUMA nodes",
    Scope.SOCKET: "on their CPU sockets",
}
_NOUN = {
    Scope.PCIE_SWITCH: "PCIe switch",
    Scope.PCIE_ROOT: "PCIe root complex",
    Scope.NUMA: "NUMA node",
    Scope.SOCKET: "CPU socket",
}

_vector_cache: dict[tuple[tuple[int, ...], int], list[tuple[int, ...]]] = {}


def _vectors(caps: tuple[int, ...], r: int) -> list[tuple[int, ...]]:
    """All count vectors ``v`` with ``0 <= v[i] <= caps[i]`` and ``sum(v) == r``, in a fixed order."""
    key = (caps, r)
    got = _vector_cache.get(key)
    if got is not None:
        return got
    out: list[tuple[int, ...]] = []
    n = len(caps)
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + caps[i]
    cur = [0] * n

    def rec(i: int, left: int) -> None:
        if left == 0:
            out.append(tuple(cur))
            return
        if i == n or suffix[i] < left:
            return
        # Larger counts first: concentrating NICs tends to be the better (less fragmenting)
        # choice, so ties resolve towards it.
        for take in range(min(caps[i], left), -1, -1):
            cur[i] = take
            rec(i + 1, left - take)
        cur[i] = 0

    rec(0, r)
    if len(_vector_cache) > 4096:
        _vector_cache.clear()
    _vector_cache[key] = out
    return out


def _pair_scope(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> int:
    for k in range(LEVELS):
        if a[k] >= 0 and a[k] == b[k]:
            return k
    return LEVELS


def _span(shape: Shape, slots: tuple[int, ...]) -> int:
    locs = [shape.loc_of(s) for s in slots]
    for k in range(LEVELS):
        first = locs[0][k]
        if first >= 0 and all(loc[k] == first for loc in locs):
            return k
    return LEVELS


def _nic_classes(shape: Shape, free: int, view: ClassView) -> dict[tuple[int, int, int, int], list[int]]:
    """Free NIC candidates grouped by location, each group in preference order."""
    cand = free & view.nic_ok
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for s in bits(cand):
        groups.setdefault(shape.nics[s - shape.n_gpus].loc, []).append(s)
    if shape.vf_all & cand:
        # Prefer VFs of NICs already split (PF not free) so whole NICs stay whole.
        parent = shape.vf_parent

        def pref(slot: int) -> tuple[int, int]:
            pf = parent.get(slot, slot)
            return ((free >> pf) & 1, slot)

        for lst in groups.values():
            lst.sort(key=pref)
    return groups


def precheck(shape: Shape, free: int, spec: Spec) -> Refusal | None:
    """The cheap part of :func:`evaluate`: enough free GPUs and NICs of the class? (popcounts)"""
    view = shape.view(spec.device_class, spec.dc)
    g, r = spec.gpus, spec.rdma
    cls = f" of class {spec.device_class!r}"
    if (free & view.gpu_ok).bit_count() < g:
        any_free = (free & shape.gpu_all).bit_count()
        suffix = cls if view.filters_gpus and any_free >= g else ""
        return Refusal("gpus", f"fewer than {g} free GPUs{suffix}")
    if (free & view.nic_ok).bit_count() < r:
        kind = {"pf": "NICs", "vf": "NIC VFs", "any": "NICs or VFs"}[view.nic_mode]
        return Refusal("nics", f"fewer than {r} free {kind}{cls if view.filters_nics else ''}")
    return None


def evaluate(shape: Shape, free: int, spec: Spec) -> Choice | Refusal:
    """The best placement of ``spec`` on a node of ``shape`` with free slots ``free``."""
    refusal = precheck(shape, free, spec)
    if refusal is not None:
        return refusal
    view = shape.view(spec.device_class, spec.dc)
    g, r = spec.gpus, spec.rdma
    gslots = bits(free & view.gpu_ok)
    groups = _nic_classes(shape, free, view)
    locs = sorted(groups)
    caps = tuple(len(groups[loc]) for loc in locs)

    # Units and their NIC capacity; classes per unit (to get n_u from a count vector).
    unit_classes: dict[int, list[int]] = {}
    avail: dict[int, int] = {}
    for ci, loc in enumerate(locs):
        for u in loc:
            if u >= 0:
                unit_classes.setdefault(u, []).append(ci)
                avail[u] = avail.get(u, 0) + caps[ci]
    level = shape.unit_level
    S = int(spec.scope)
    gloc = shape.gpu_loc

    whole_by_level: list[list[int]] = [[] for _ in range(LEVELS)]
    for u, m in enumerate(shape.unit_mask):
        if m & ~free == 0:
            whole_by_level[level[u]].append(m)
    whole_parts = [(m, size) for m, size in shape.partitions if m & ~free == 0]

    def nv_key(gm: int) -> int:
        if g <= 1:
            return 0
        for m, _size in shape.partitions:
            if gm & m == gm:
                return 0
        return 1

    def frag(chosen: int) -> tuple[int, int, int, int, int]:
        nv = 0
        for m, size in whole_parts:
            if m & chosen:
                nv += size
        sw = sum(1 for m in whole_by_level[0] if m & chosen)
        rt = sum(1 for m in whole_by_level[1] if m & chosen)
        nu = sum(1 for m in whole_by_level[2] if m & chosen)
        so = sum(1 for m in whole_by_level[3] if m & chosen)
        return (nv, so, nu, rt, sw)

    def nic_slots(vec: tuple[int, ...]) -> tuple[int, ...]:
        out: list[int] = []
        for ci, n in enumerate(vec):
            if n:
                out.extend(groups[locs[ci]][:n])
        return tuple(out)

    def gpu_counts(G: tuple[int, ...]) -> dict[int, int]:
        cnt: dict[int, int] = {}
        for s in G:
            for u in gloc[s]:
                if u >= 0:
                    cnt[u] = cnt.get(u, 0) + 1
        return cnt

    def n_counts(vec: tuple[int, ...]) -> dict[int, int]:
        cnt: dict[int, int] = {}
        for ci, n in enumerate(vec):
            if n:
                for u in locs[ci]:
                    if u >= 0:
                        cnt[u] = cnt.get(u, 0) + n
        return cnt

    vectors = _vectors(caps, r)
    best_key: tuple[int, ...] | None = None
    best_frag: tuple[int, ...] = ()
    best_g: tuple[int, ...] = ()
    best_v: tuple[int, ...] = ()
    best_scope_pairs = -1  # for the refusal text: most pairs within the scope anywhere

    if spec.per_gpu and g > 0:
        # Score every GPU subset by its best reachable pair counts, then refine the winners.
        scored: list[tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]] = []
        for G in combinations(gslots, g):
            cnt = gpu_counts(G)
            c = [0, 0, 0, 0]
            for u, gu in cnt.items():
                au = avail.get(u, 0)
                c[level[u]] += gu if gu < au else au
            within = c[S] if S < LEVELS else g
            if within > best_scope_pairs:
                best_scope_pairs = within
            unmet = 1 if within < g else 0
            if unmet and spec.required:
                continue
            gm = 0
            for s in G:
                gm |= 1 << s
            key = (unmet, -c[0], -c[1], -c[2], -c[3], 0, 0, 0, 0, nv_key(gm))
            if best_key is None or key < best_key:
                best_key, scored = key, [(G, key, cnt)]
            elif key == best_key:
                scored.append((G, key, cnt))
        if best_key is None:
            return Refusal("scope", f"{g} GPUs free but only {best_scope_pairs} NICs {_PLURAL[Scope(S)]}")
        found = False
        for G, _key, cnt in scored:
            need = [(u, min(gu, avail.get(u, 0))) for u, gu in cnt.items()]
            need = [(u, m) for u, m in need if m > 0]
            gm = 0
            for s in G:
                gm |= 1 << s
            for vec in vectors:
                ok = True
                for u, m in need:
                    if sum(vec[ci] for ci in unit_classes[u]) < m:
                        ok = False
                        break
                if not ok:
                    continue
                chosen = gm
                for s in nic_slots(vec):
                    chosen |= 1 << s
                f = frag(chosen)
                if not found or f < best_frag:
                    found, best_frag, best_g, best_v = True, f, G, vec
        assert found  # the greedy bound is always reachable
    else:
        # shared pairing (or GPU-only / NIC-only): every GPU subset x every NIC vector.
        any_met = False
        for G in combinations(gslots, g):
            gcnt = gpu_counts(G)
            gm = 0
            for s in G:
                gm |= 1 << s
            nv = nv_key(gm)
            for vec in vectors:
                c = [0, 0, 0, 0]
                d = [0, 0, 0, 0]
                unmet = 0
                if g and r:
                    ncnt = n_counts(vec)
                    for u, gu in gcnt.items():
                        if ncnt.get(u):
                            c[level[u]] += gu
                    for u, nu in ncnt.items():
                        if gcnt.get(u):
                            d[level[u]] += nu
                    if S < LEVELS and (c[S] < g or d[S] < r):
                        unmet = 1
                if unmet and spec.required:
                    continue
                any_met = any_met or not unmet
                key = (unmet, -c[0], -c[1], -c[2], -c[3], -d[0], -d[1], -d[2], -d[3], nv)
                if best_key is not None and key > best_key:
                    continue
                chosen = gm
                for s in nic_slots(vec):
                    chosen |= 1 << s
                f = frag(chosen)
                if best_key is None or key < best_key or f < best_frag:
                    best_key, best_frag, best_g, best_v = key, f, G, vec
        if best_key is None:
            return Refusal(
                "scope",
                f"{g} GPUs and {r} NICs free but not within one {_NOUN[Scope(S)]} of each other",
            )
    assert best_key is not None
    nics = nic_slots(best_v)
    pairs = _pairs(shape, best_g, nics, per_gpu=spec.per_gpu)
    scope = max(p[2] for p in pairs) if pairs else _span(shape, best_g + nics)
    return Choice(
        key=best_key,
        frag=best_frag,
        gpus=best_g,
        nics=nics,
        pairs=pairs,
        scope=scope,
        met=best_key[0] == 0,
        cross=(*cross_key(best_key, S), one_sided_waste(shape, free, g, r)),
    )


def _pairs(
    shape: Shape, gpus: tuple[int, ...], nics: tuple[int, ...], *, per_gpu: bool
) -> tuple[tuple[int, int, int], ...]:
    """GPU/NIC pairs: bottom-up greedy matching (per-gpu) or each GPU's nearest NIC (shared)."""
    if not gpus or not nics:
        return ()
    out: list[tuple[int, int, int]] = []
    if per_gpu:
        ug, un = list(gpus), list(nics)
        for k in range(LEVELS):
            for gs in list(ug):
                u = shape.gpu_loc[gs][k]
                if u < 0:
                    continue
                for ns in un:
                    if shape.loc_of(ns)[k] == u:
                        out.append((gs, ns, k))
                        ug.remove(gs)
                        un.remove(ns)
                        break
        out.extend((gs, ns, LEVELS) for gs, ns in zip(ug, un, strict=True))
    else:
        for gs in gpus:
            best = min(nics, key=lambda ns: _pair_scope(shape.gpu_loc[gs], shape.loc_of(ns)))
            out.append((gs, best, _pair_scope(shape.gpu_loc[gs], shape.loc_of(best))))
    out.sort()
    return tuple(out)


def scope_name(level: int) -> str:
    return SCOPE_NAMES[Scope(level)]
