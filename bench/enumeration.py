"""The in-node search the core used before its tree search: every GPU subset, then NIC vectors.

This is ``services/allocator/core/search.py``'s ``evaluate`` as of commit ``01c3a38``, kept as
a second reference. It is exact (property-tested against :mod:`bench.exhaustive` for as long
as it was the core's search) and much faster than the exhaustive search, because it scores a
GPU subset by the pair counts its free NICs allow (nested units: ``sum(min(g_u, a_u))`` per
level) and treats NICs at one location as interchangeable; but it enumerates every GPU subset,
so an 8 + 8 request on a free 16-GPU + 16-NIC server takes tens of seconds. The property tests
on 16-GPU nodes compare the core against it where it finishes quickly, and against the
exhaustive search where few devices are free. It returns the same :class:`Choice`, including
the exact devices: both searches break ties towards the lowest GPU slots, then towards NICs at
the first location classes.
"""

from __future__ import annotations

from itertools import combinations

from schemas.topology import Scope
from services.allocator.core.model import LEVELS, Shape, bits
from services.allocator.core.request import Spec
from services.allocator.core.search import (
    _NOUN,
    _PLURAL,
    Choice,
    Refusal,
    _nic_classes,
    _pairs,
    _span,
    cross_key,
    one_sided_waste,
    precheck,
)

__all__ = ["evaluate"]


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
