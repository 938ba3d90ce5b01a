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
and bottom-up greedy matching reaches that maximum at every level at once. For ``shared``
pairing the counts are ``g_u`` summed over the units at ``k`` that have a NIC chosen (and
``n_u`` over those with a GPU).

Why it need not try every GPU subset either (it did until 16-GPU servers made that take
tens of seconds): every criterion but NVLink is a sum over the units of the PCIe tree of a
function of ``(g_u, n_u)``, the devices taken under ``u``. So the search is a dynamic program
over the tree: devices at one location (same switch, or directly on the same root) are
interchangeable, so a leaf is a count; a unit's table maps ``(a GPUs, b NICs)`` taken below
it to the best score, built by min-plus merging its children's tables and adding its own
terms. The quality tuple is packed into one integer whose fields cannot carry into each other
(see :class:`_Search`), and lexicographic order is compatible with addition, so keeping the
best score per state is exact. The cost is about (tree size) x (g + 1)^2 x (r + 1)^2 integer
additions, a millisecond or so on a 16-GPU + 16-NIC server.

NVLink is not a tree sum and is handled around the dynamic program: "inside one partition"
by one run per inclusion-maximal partition (and one over all GPUs, scored as outside), and
"whole partitions broken" as a tree term wherever a partition's GPUs are exactly one unit's
or one leaf's (NVSwitch domains, Hopper pairs and quads, bridge pairs on one switch). Only
partitions that cut across the PCIe tree (bridges between switches) are enumerated: unions of
them in increasing size, each a run with the GPUs outside dropped, cut short as soon as no
larger union can win and skipping unions whose pair counts cannot reach the best.

"Required scope met" comes first but is not a sum; the search first runs with the pairs
within the scope as a leading field (which finds a placement that meets the scope whenever
one exists) and, only if none does and the request is ``preferred``, again without it.

Ties break towards the lowest GPU slots, then towards NICs at the first location classes,
exactly as the subset enumeration did (kept in ``bench/enumeration.py``). Property tests
check the result against a plain exhaustive search over all device subsets and all matchings
(``bench/exhaustive.py``), on small nodes and on 16-GPU servers with few devices free, and
against the subset enumeration on 16-GPU servers with more free.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if spec.shared:
        # A share request's cross key has the GPUs-opened term and the three fit terms before
        # the waste (see .shares); -gpus is below any opened term, so zeros bound the rest.
        return (0, *([c] * (4 - s)), *([d] * (4 - s)), 0, -spec.gpus, 0, 0, 0, 0)
    return (0, *([c] * (4 - s)), *([d] * (4 - s)), 0, 0)


def fresh_cost(shape: Shape, free: int, spec: Spec) -> int:
    """With ``binpack``, opening a fresh node (every GPU and NIC free) for a ``preferred``
    request costs its GPU count: such a request goes to a used node if one can take it as well
    aligned (with ``node_order: used-first``, even worse aligned), so whole servers stay
    available for the large jobs that need them (:mod:`.scores`).
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
    partial unit). Used by the binpack order under reserve pressure (see :mod:`.scores`)."""
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


# ---------------------------------------------------------------------------------------------
# The exact search (see the module docstring): dynamic programming over the unit tree

# A plan says which devices a table entry stands for, as a tree of picks built while merging:
# (0, GPU slots of a type, count) / (1, NIC class, count) at the leaves, (plan, plan) above.
Plan = tuple[object, ...] | None
# A table: (a GPUs, b NICs) taken in a subtree -> (score, plan) of the best way to take them.
Table = dict[tuple[int, int], tuple[int, Plan]]
# A GPU leaf type: location (unit per level) and membership in the partitions that cut across
# the PCIe tree. GPUs of one type are interchangeable, so a leaf is a count.
LeafKey = tuple[tuple[int, int, int, int], int]
# A GPU leaf: its type, its slots, and the sizes of the whole partitions that are exactly it.
Leaf = tuple[LeafKey, list[int], int]


class _Search:
    """One :func:`evaluate` call: the free devices, the score layout, the tree DP.

    A score is one Python int, smaller is better. From the most significant end: ``lead``
    (pairs within the requested scope: set only while looking for a placement that meets it),
    ``c0..c3`` (pairs within each level) and ``d0..d3`` (shared pairing's NICs near a GPU),
    all as negative counts; then non-negative fields: ``nv`` (the GPU set lies in no NVLink
    partition), ``nvb`` (sizes of whole partitions broken), the whole sockets, NUMA nodes,
    roots and switches broken, and two tie-breaks that make the best placement unique: the
    lowest GPU slots, then the most NICs at the first location classes (what the subset
    enumeration this search replaced returned). Each field is wider than any partial sum it
    can hold, so comparing scores compares the tuples lexicographically and a score adds up
    over the tree: keeping only the best score per (a, b) state is exact."""

    def __init__(self, shape: Shape, free: int, spec: Spec, view: ClassView) -> None:
        self.shape = shape
        self.g = g = spec.gpus
        self.r = r = spec.rdma
        self.S = int(spec.scope)
        self.per_gpu = spec.per_gpu
        self.paired = g > 0 and r > 0
        self.gpus = free & view.gpu_ok
        groups = _nic_classes(shape, free, view)
        self.locs = sorted(groups)
        self.nic_lists = [groups[loc] for loc in self.locs]
        self.whole = [m & ~free == 0 for m in shape.unit_mask]
        self.whole_parts = [(m, size) for m, size in shape.partitions if m & ~free == 0]
        self.unit_nics = [0] * len(shape.unit_level)
        for loc, lst in groups.items():
            for u in loc:
                if u >= 0:
                    self.unit_nics[u] += len(lst)

        # Field widths and shifts, least significant first.
        caps = [min(len(lst), r) for lst in self.nic_lists]
        base = max(caps, default=0) + 1
        k = len(caps)
        ng = shape.n_gpus
        wn = (max(r, 1) * base**k).bit_length() + 1
        wg = ng + max(g, 1).bit_length() + 1
        wu = len(shape.unit_level).bit_length() + 1
        wv = (sum(s for _, s in self.whole_parts) + 1).bit_length() + 1
        wc = (g + r + 1).bit_length() + 1
        self.s_unit = s_unit = wn + wg
        self.wu = wu
        self.unit_w = [1 << (s_unit + lvl * wu) for lvl in range(LEVELS)]
        self.s_nvb = s_unit + LEVELS * wu
        self.nvb_mask = (1 << wv) - 1
        self.nvb_w = 1 << self.s_nvb
        self.s_nv = self.s_nvb + wv
        self.nv_w = 1 << self.s_nv
        self.low = self.s_nvb + wv + 2  # width of the non-negative fields
        self.wc = wc
        self.d_w = [1 << (self.low + (3 - lvl) * wc) for lvl in range(LEVELS)]
        self.c_w = [1 << (self.low + (7 - lvl) * wc) for lvl in range(LEVELS)]
        self.lead_w = 1 << (self.low + 8 * wc)
        self.gpu_w = [((1 << ng) - (1 << (ng - 1 - s))) << wn for s in range(ng)]

        # NIC leaves, fixed for every run: (unit they hang under, table, NIC count).
        self.n_total = sum(len(lst) for lst in self.nic_lists)
        self.nic_leaves: list[tuple[int, Table, int]] = []
        for c, loc in enumerate(self.locs):
            w = base**k - base ** (k - 1 - c)
            table: Table = {(0, 0): (0, None)}
            for y in range(1, caps[c] + 1):
                table[(0, y)] = (y * w, (1, c, y))
            self.nic_leaves.append((loc[0] if loc[0] >= 0 else loc[1], table, len(self.nic_lists[c])))

    # -----------------------------------------------------------------------------------------

    def best(self, *, lead: bool) -> tuple[int, Plan]:
        """The best score and plan over all GPU restrictions that decide NVLink fit.

        A GPU set has ``nv = 0`` when it lies in some partition; every such set lies in an
        inclusion-maximal one, so the search runs once per maximal partition (``nv = 0``) and
        once over all GPUs (scored ``nv = 1``). A set found by the unrestricted run that does
        fit a partition is also found, scored lower, by that partition's run."""
        g = self.g
        every = self.gpus if g else 0  # a NIC-only request touches no GPU (nor partition)
        runs: list[tuple[int, int]] = [(every, 0)]
        if g >= 2:
            maximal = self.shape.maximal_parts
            if not any(every & ~m == 0 for m in maximal):
                runs = [(every, 1)]
                seen = set()
                for m in maximal:
                    part = every & m
                    if part.bit_count() >= g and part not in seen:
                        seen.add(part)
                        runs.append((part, 0))
        best: tuple[int, Plan] | None = None
        for allowed, nv in runs:
            v, plan = self._solve(allowed, lead=lead)
            v += nv * self.nv_w
            if best is None or v < best[0]:
                best = (v, plan)
        assert best is not None
        return best

    def _solve(self, allowed: int, *, lead: bool) -> tuple[int, Plan]:
        """Best score with the GPUs restricted to ``allowed`` (at least ``g`` of them).

        Whole NVLink partitions broken (``nvb``) are a term of the tree where a partition's
        GPUs here are exactly one unit's (touched iff that unit gives a GPU), all of them (a
        constant), or one leaf type's. The others ("irregular": they cut across the PCIe
        tree) are enumerated: for each union ``U`` of irregular partitions, in increasing size,
        the GPUs outside ``U`` are dropped and ``|U|`` is charged; a set that touches fewer
        than ``U`` is also found, charged less, under the smaller union."""
        top, unit_nv, leaves, irregular, sig = self._leaves(allowed)
        constant = top * self.nvb_w if self.g else 0

        full = 0
        for m in sig.values():
            full |= m
        found = self._dp(leaves, unit_nv, lead=lead)
        assert found is not None
        weight = [size for _, size in irregular]

        def charge(union: int) -> int:
            return sum(weight[i] for i in range(len(weight)) if union >> i & 1)

        best = (found[0] + constant + charge(full) * self.nvb_w, found[1])
        if not full:
            return best
        unions = {0}
        for m in set(sig.values()):
            unions |= {x | m for x in unions}
        for union in sorted(unions, key=charge):
            w = charge(union)
            if w + top > (best[0] >> self.s_nvb) & self.nvb_mask:
                break  # charges only grow from here: no later union can beat the best
            if union == full:
                continue
            subset = [leaf for leaf in leaves if sig[leaf[0]] & ~union == 0]
            if sum(len(slots) for _, slots, _ in subset) < self.g:
                continue
            mask = 0
            for _, slots, _ in subset:
                for s in slots:
                    mask |= 1 << s
            if self._pairs_bound(mask, lead=lead) >> self.low > best[0] >> self.low:
                continue  # cannot reach the best pair counts: no need to search
            got = self._dp(subset, unit_nv, lead=lead)
            if got is not None:
                v = got[0] + constant + w * self.nvb_w
                if v < best[0]:
                    best = (v, got[1])
        return best

    def _leaves(
        self, allowed: int
    ) -> tuple[int, dict[int, int], list[Leaf], list[tuple[int, int]], dict[LeafKey, int]]:
        """The GPU leaves of a :meth:`_solve` run and where its whole NVLink partitions are
        charged: ``(size of the partitions that are all the allowed GPUs, per unit the sizes
        of those that are exactly its GPUs, leaves as (type, slots, sizes of those that are
        exactly the leaf's), the irregular ones as (mask, size), per leaf type the irregular
        ones it belongs to)``."""
        shape = self.shape
        unit_gpus: dict[int, int] = {}
        for lvl in range(LEVELS):
            for u in shape.level_units[lvl]:
                m = shape.unit_mask[u] & allowed
                if m and m not in unit_gpus:
                    unit_gpus[m] = u
        top = 0
        unit_nv: dict[int, int] = {}
        loose: list[tuple[int, int]] = []
        for m, size in self.whole_parts:
            e = m & allowed
            if not e:
                continue
            if e == allowed:
                top += size
                continue
            holder = unit_gpus.get(e)
            if holder is not None:
                unit_nv[holder] = unit_nv.get(holder, 0) + size
            else:
                loose.append((e, size))
        # GPU leaf types: location and membership in the loose partitions.
        types: dict[LeafKey, list[int]] = {}
        gloc = shape.gpu_loc
        for s in bits(allowed):
            member = 0
            for i, (e, _) in enumerate(loose):
                if e >> s & 1:
                    member |= 1 << i
            types.setdefault((gloc[s], member), []).append(s)
        by_mask: dict[int, LeafKey] = {}
        for key, slots in types.items():
            m = 0
            for s in slots:
                m |= 1 << s
            by_mask[m] = key
        leaf_nv: dict[LeafKey, int] = {}
        irregular: list[tuple[int, int]] = []
        for e, size in loose:
            one = by_mask.get(e)
            if one is not None:
                leaf_nv[one] = leaf_nv.get(one, 0) + size
            else:
                irregular.append((e, size))
        sig: dict[LeafKey, int] = {}
        for key, slots in types.items():
            m = 0
            for i, (e, _) in enumerate(irregular):
                if e >> slots[0] & 1:
                    m |= 1 << i
            sig[key] = m
        leaves = [(key, slots, leaf_nv.get(key, 0)) for key, slots in types.items()]
        return top, unit_nv, leaves, irregular, sig

    def _pairs_bound(self, allowed: int, *, lead: bool) -> int:
        """A score no placement using only ``allowed`` GPUs can beat in its pair counts: per
        level, pairs within a unit are at most ``min(GPUs, NICs)`` there (``per-gpu``), GPUs
        with a NIC beside them at most the GPUs of units that have NICs (``shared``)."""
        if not self.paired:
            return 0
        shape = self.shape
        g, r = self.g, self.r
        v = 0
        for lvl in range(LEVELS):
            c = d = 0
            for u in shape.level_units[lvl]:
                n = self.unit_nics[u]
                if not n:
                    continue
                a = (shape.unit_mask[u] & allowed).bit_count()
                if self.per_gpu:
                    c += a if a < n else n
                elif a:
                    c += a
                    d += n
            c = min(c, g)
            d = min(d, r) if not self.per_gpu else 0
            v -= c * self.c_w[lvl] + d * self.d_w[lvl]
            if lead and lvl == self.S:
                v -= (c + d) * self.lead_w
        return v

    def _dp(
        self,
        leaves: list[Leaf],
        unit_nv: dict[int, int],
        *,
        lead: bool,
    ) -> tuple[int, Plan] | None:
        """Bottom-up over the units that hold a candidate device: merge the children's tables
        (min-plus over (a, b)), then add the unit's own terms for each state."""
        shape = self.shape
        g, r = self.g, self.r
        parent = shape.unit_parent
        level = shape.unit_level
        at: dict[int, list[tuple[Table, int, int]]] = {}
        gpu_w = self.gpu_w
        for key, slots, nvb in leaves:
            loc = key[0]
            table: Table = {(0, 0): (0, None)}
            v = nvb * self.nvb_w
            cap = min(len(slots), g)
            for x in range(1, cap + 1):
                v += gpu_w[slots[x - 1]]
                table[(x, 0)] = (v, (0, slots, x))
            u = loc[0] if loc[0] >= 0 else loc[1]
            at.setdefault(u, []).append((table, len(slots), 0))
        for u, table, n in self.nic_leaves:
            at.setdefault(u, []).append((table, 0, n))
        self.g_total = sum(len(slots) for _, slots, _ in leaves)
        active: set[int] = set()
        for u in at:
            while u >= 0 and u not in active:
                active.add(u)
                u = parent[u]
        order = sorted(active, key=lambda x: (level[x], x))
        done: dict[int, list[tuple[Table, int, int]]] = {}
        tops: list[tuple[Table, int, int]] = []
        for u in order:
            parts = at.get(u, []) + done.pop(u, [])
            acc = parts[0]
            for part in parts[1:]:
                acc = self._merge(acc, part)
            closed = (self._close(u, acc[0], unit_nv.get(u, 0), lead=lead), acc[1], acc[2])
            p = parent[u]
            if p >= 0:
                done.setdefault(p, []).append(closed)
            else:
                tops.append(closed)
        acc = tops[0]
        for part in tops[1:]:
            acc = self._merge(acc, part)
        return acc[0].get((g, r))

    def _merge(self, x: tuple[Table, int, int], y: tuple[Table, int, int]) -> tuple[Table, int, int]:
        tx, gx, nx = x
        ty, gy, ny = y
        gn, nn = gx + gy, nx + ny
        g, r = self.g, self.r
        # States that cannot be completed by the devices outside are dropped.
        amin = g - (self.g_total - gn)
        bmin = r - (self.n_total - nn)
        out: Table = {}
        items = list(ty.items())
        for (a1, b1), (v1, p1) in tx.items():
            for (a2, b2), (v2, p2) in items:
                a = a1 + a2
                b = b1 + b2
                if a > g or b > r or a < amin or b < bmin:
                    continue
                v = v1 + v2
                cur = out.get((a, b))
                if cur is None or v < cur[0]:
                    out[(a, b)] = (v, p2 if p1 is None else p1 if p2 is None else (p1, p2))
        return out, gn, nn

    def _close(self, u: int, table: Table, nvb: int, *, lead: bool) -> Table:
        """Add unit ``u``'s terms: its pairs (or shared counts), whether a whole unit or a
        unit-aligned NVLink partition is broken."""
        lvl = self.shape.unit_level[u]
        frag = self.unit_w[lvl] if self.whole[u] else 0
        nvw = nvb * self.nvb_w
        lw = self.lead_w if lead and lvl == self.S else 0
        cw = self.c_w[lvl] + lw
        dw = self.d_w[lvl] + lw
        paired, per_gpu = self.paired, self.per_gpu
        out: Table = {}
        for (a, b), (v, p) in table.items():
            if a or b:
                v += frag
                if a:
                    v += nvw
                    if b and paired:
                        if per_gpu:
                            v -= (a if a < b else b) * cw
                        else:
                            v -= a * cw + b * dw
            out[(a, b)] = (v, p)
        return out

    # -----------------------------------------------------------------------------------------

    def decode(self, v: int) -> tuple[list[int], list[int], int, int, list[int]]:
        """(c0..c3, d0..d3, nv, nvb, broken [switch, root, numa, socket]) of a score."""
        umask = (1 << self.wu) - 1
        broken = [(v >> (self.s_unit + lvl * self.wu)) & umask for lvl in range(LEVELS)]
        nvb = (v >> self.s_nvb) & self.nvb_mask
        nv = (v >> self.s_nv) & 3
        hi = v >> self.low
        size = 1 << self.wc
        digits = []
        for _ in range(9):  # d3, d2, d1, d0, c3, c2, c1, c0, lead
            d = hi & (size - 1)
            if d >= size // 2:
                d -= size
            digits.append(d)
            hi = (hi - d) >> self.wc
        d = digits[3::-1]
        c = digits[7:3:-1]
        return c, d, nv, nvb, broken

    def slots(self, plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The GPU and NIC slots a plan stands for (GPUs ascending, NICs by class)."""
        gpus: list[int] = []
        picks: list[tuple[int, int]] = []
        stack: list[Plan] = [plan]
        while stack:
            p = stack.pop()
            if p is None:
                continue
            if len(p) == 2:
                stack.extend(p)  # type: ignore[arg-type]
            elif p[0] == 0:
                gpus.extend(p[1][: p[2]])  # type: ignore[index]
            else:
                picks.append((p[1], p[2]))  # type: ignore[arg-type]
        nics: list[int] = []
        for c, y in sorted(picks):
            nics.extend(self.nic_lists[c][:y])
        return tuple(sorted(gpus)), tuple(nics)


def evaluate(shape: Shape, free: int, spec: Spec) -> Choice | Refusal:
    """The best placement of ``spec`` on a node of ``shape`` with free slots ``free``."""
    refusal = precheck(shape, free, spec)
    if refusal is not None:
        return refusal
    view = shape.view(spec.device_class, spec.dc)
    g, r = spec.gpus, spec.rdma
    S = int(spec.scope)
    search = _Search(shape, free, spec, view)
    scoped = g > 0 and r > 0 and S < LEVELS
    value, plan = search.best(lead=scoped)
    unmet = 0
    if scoped:
        c, d, _nv, _nvb, _broken = search.decode(value)
        if -c[S] < g or (not spec.per_gpu and -d[S] < r):
            if spec.required:
                if spec.per_gpu:
                    return Refusal("scope", f"{g} GPUs free but only {-c[S]} NICs {_PLURAL[Scope(S)]}")
                return Refusal(
                    "scope",
                    f"{g} GPUs and {r} NICs free but not within one {_NOUN[Scope(S)]} of each other",
                )
            unmet = 1
            value, plan = search.best(lead=False)
    c, d, nv, nvb, broken = search.decode(value)
    key = (unmet, *c, *d, nv)
    frag = (nvb, broken[3], broken[2], broken[1], broken[0])
    gpus, nics = search.slots(plan)
    pairs = _pairs(shape, gpus, nics, per_gpu=spec.per_gpu)
    scope = max(p[2] for p in pairs) if pairs else _span(shape, gpus + nics)
    return Choice(
        key=key,
        frag=frag,
        gpus=gpus,
        nics=nics,
        pairs=pairs,
        scope=scope,
        met=unmet == 0,
        cross=(*cross_key(key, S), one_sided_waste(shape, free, g, r)),
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
