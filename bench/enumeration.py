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

from collections.abc import Iterable
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


Key = tuple[int, ...]
Found = tuple[Key, Key, tuple[int, ...], tuple[int, ...]]
"""The best so far: its key, its fragmentation, its GPU slots and its NIC count vector."""


def evaluate(shape: Shape, free: int, spec: Spec) -> Choice | Refusal:
    """The best placement of ``spec`` on a node of ``shape`` with free slots ``free``."""
    refusal = precheck(shape, free, spec)
    if refusal is not None:
        return refusal
    search = _Search(shape, free, spec)
    found = search.per_gpu() if spec.per_gpu and spec.gpus > 0 else search.shared()
    if isinstance(found, Refusal):
        return found
    return search.choice(found)


def _mask(slots: Iterable[int]) -> int:
    m = 0
    for s in slots:
        m |= 1 << s
    return m


class _Search:
    """One request on one node: the free devices grouped as the search needs them."""

    def __init__(self, shape: Shape, free: int, spec: Spec) -> None:
        self.shape, self.free, self.spec = shape, free, spec
        view = shape.view(spec.device_class, spec.dc)
        self.g, self.r = spec.gpus, spec.rdma
        self.gslots = bits(free & view.gpu_ok)
        self.groups = _nic_classes(shape, free, view)
        self.locs = locs = sorted(self.groups)
        self.caps = caps = tuple(len(self.groups[loc]) for loc in locs)
        # Units and their NIC capacity; classes per unit (to get n_u from a count vector).
        self.unit_classes: dict[int, list[int]] = {}
        self.avail: dict[int, int] = {}
        for ci, loc in enumerate(locs):
            for u in loc:
                if u >= 0:
                    self.unit_classes.setdefault(u, []).append(ci)
                    self.avail[u] = self.avail.get(u, 0) + caps[ci]
        self.level = shape.unit_level
        self.S = int(spec.scope)
        self.gloc = shape.gpu_loc
        self.whole_by_level: list[list[int]] = [[] for _ in range(LEVELS)]
        for u, m in enumerate(shape.unit_mask):
            if m & ~free == 0:
                self.whole_by_level[self.level[u]].append(m)
        self.whole_parts = [(m, size) for m, size in shape.partitions if m & ~free == 0]
        self.vectors = _vectors(caps, self.r)

    def nv_key(self, gm: int) -> int:
        if self.g <= 1:
            return 0
        for m, _size in self.shape.partitions:
            if gm & m == gm:
                return 0
        return 1

    def frag(self, chosen: int) -> tuple[int, int, int, int, int]:
        nv = 0
        for m, size in self.whole_parts:
            if m & chosen:
                nv += size
        whole = self.whole_by_level
        sw = sum(1 for m in whole[0] if m & chosen)
        rt = sum(1 for m in whole[1] if m & chosen)
        nu = sum(1 for m in whole[2] if m & chosen)
        so = sum(1 for m in whole[3] if m & chosen)
        return (nv, so, nu, rt, sw)

    def nic_slots(self, vec: tuple[int, ...]) -> tuple[int, ...]:
        out: list[int] = []
        for ci, n in enumerate(vec):
            if n:
                out.extend(self.groups[self.locs[ci]][:n])
        return tuple(out)

    def gpu_counts(self, G: tuple[int, ...]) -> dict[int, int]:
        cnt: dict[int, int] = {}
        for s in G:
            for u in self.gloc[s]:
                if u >= 0:
                    cnt[u] = cnt.get(u, 0) + 1
        return cnt

    def n_counts(self, vec: tuple[int, ...]) -> dict[int, int]:
        cnt: dict[int, int] = {}
        for ci, n in enumerate(vec):
            if n:
                for u in self.locs[ci]:
                    if u >= 0:
                        cnt[u] = cnt.get(u, 0) + n
        return cnt

    def per_gpu(self) -> Found | Refusal:
        """Score every GPU subset by its best reachable pair counts, then refine the winners."""
        best_key, scored, best_scope_pairs = self._score_gpu_subsets()
        if best_key is None:
            return Refusal(
                "scope", f"{self.g} GPUs free but only {best_scope_pairs} NICs {_PLURAL[Scope(self.S)]}"
            )
        found: Found | None = None
        for G, cnt in scored:
            need = [(u, min(gu, self.avail.get(u, 0))) for u, gu in cnt.items()]
            need = [(u, m) for u, m in need if m > 0]
            gm = _mask(G)
            for vec in self.vectors:
                if any(sum(vec[ci] for ci in self.unit_classes[u]) < m for u, m in need):
                    continue
                f = self.frag(gm | _mask(self.nic_slots(vec)))
                if found is None or f < found[1]:
                    found = (best_key, f, G, vec)
        assert found is not None  # the greedy bound is always reachable
        return found

    def _score_gpu_subsets(self) -> tuple[Key | None, list[tuple[tuple[int, ...], dict[int, int]]], int]:
        """The best per-gpu key, the GPU subsets reaching it (with their unit counts), and the
        most pairs within the scope any subset reaches (for the refusal text)."""
        g, S, level, spec = self.g, self.S, self.level, self.spec
        best_key: Key | None = None
        scored: list[tuple[tuple[int, ...], dict[int, int]]] = []
        best_scope_pairs = -1
        for G in combinations(self.gslots, g):
            cnt = self.gpu_counts(G)
            c = [0, 0, 0, 0]
            for u, gu in cnt.items():
                au = self.avail.get(u, 0)
                c[level[u]] += gu if gu < au else au
            within = c[S] if S < LEVELS else g
            if within > best_scope_pairs:
                best_scope_pairs = within
            unmet = 1 if within < g else 0
            if unmet and spec.required:
                continue
            key = (unmet, -c[0], -c[1], -c[2], -c[3], 0, 0, 0, 0, self.nv_key(_mask(G)))
            if best_key is None or key < best_key:
                best_key, scored = key, [(G, cnt)]
            elif key == best_key:
                scored.append((G, cnt))
        return best_key, scored, best_scope_pairs

    def shared(self) -> Found | Refusal:
        """Shared pairing (or GPU-only / NIC-only): every GPU subset x every NIC vector."""
        best: Found | None = None
        for G in combinations(self.gslots, self.g):
            gcnt = self.gpu_counts(G)
            gm = _mask(G)
            nv = self.nv_key(gm)
            for vec in self.vectors:
                key = self._shared_key(gcnt, vec, nv=nv)
                if key is None or (best is not None and key > best[0]):
                    continue
                f = self.frag(gm | _mask(self.nic_slots(vec)))
                if best is None or key < best[0] or f < best[1]:
                    best = (key, f, G, vec)
        if best is None:
            noun = _NOUN[Scope(self.S)]
            why = f"{self.g} GPUs and {self.r} NICs free but not within one {noun} of each other"
            return Refusal("scope", why)
        return best

    def _shared_key(self, gcnt: dict[int, int], vec: tuple[int, ...], *, nv: int) -> Key | None:
        """The key of GPUs (unit counts ``gcnt``) with NIC vector ``vec``; None when the scope is
        unmet and the class requires it."""
        g, r, S, level = self.g, self.r, self.S, self.level
        c = [0, 0, 0, 0]
        d = [0, 0, 0, 0]
        unmet = 0
        if g and r:
            ncnt = self.n_counts(vec)
            for u, gu in gcnt.items():
                if ncnt.get(u):
                    c[level[u]] += gu
            for u, nu in ncnt.items():
                if gcnt.get(u):
                    d[level[u]] += nu
            if S < LEVELS and (c[S] < g or d[S] < r):
                unmet = 1
        if unmet and self.spec.required:
            return None
        return (unmet, -c[0], -c[1], -c[2], -c[3], -d[0], -d[1], -d[2], -d[3], nv)

    def choice(self, found: Found) -> Choice:
        key, frag, gpus, vec = found
        shape = self.shape
        nics = self.nic_slots(vec)
        pairs = _pairs(shape, gpus, nics, per_gpu=self.spec.per_gpu)
        scope = max(p[2] for p in pairs) if pairs else _span(shape, gpus + nics)
        return Choice(
            key=key,
            frag=frag,
            gpus=gpus,
            nics=nics,
            pairs=pairs,
            scope=scope,
            met=key[0] == 0,
            cross=(*cross_key(key, self.S), one_sided_waste(shape, self.free, self.g, self.r)),
        )
