"""Fractional GPUs: shares of a GPU's memory and compute, kept in the node's group key.

A request with ``gpu_memory_mib`` and/or ``gpu_cores_percent`` (a :class:`.request.Spec`
with ``shared`` set) asks a *share* of each of its ``gpus`` GPUs. A GPU is then in one of
three states: whole-free, held whole, or shared (one or more shares on it). The rules:

* a GPU with any share is never given whole: it is not in the node's free mask, exactly
  like a held GPU, so whole-GPU requests (and their cached searches) never see it;
* a GPU held whole is never shared: it has no share record, so it is never a share
  candidate; a share goes on a whole-free GPU (which opens it) or on a shared GPU with
  enough memory, compute and share count left;
* NICs stay exclusive: a shared GPU's pod gets its own aligned NIC or VF, paired and scoped
  by the same exact in-node search as whole GPUs (:func:`.search.evaluate`), run on the
  *candidate* mask (whole-free GPUs that are large enough, plus the shared GPUs the share
  fits on, plus the free NICs).

Why in the group key. The cluster index groups nodes by ``(hardware, free mask)`` and caches
one search per (request key, shape, mask) (see :mod:`.cluster`, :mod:`.plugins.shares`). The
share state of a node is packed into the same integer *above* the slot bits: GPU slot ``s``
owns the :data:`FIELD`-bit field at ``n_slots + s * FIELD`` holding its sharing mode (one bit:
MPS or HAMi), used memory (MiB), used compute (percent) and share count; a GPU without shares
has a zero field, so a node without
shares has exactly the mask it had before shares existed. Two nodes with the same shape,
free devices and share usage are then one group, the change log, the signature heaps and the
lazy evaluation work unchanged, and a share decision costs what a whole-GPU decision costs:
O(changes since the signature's last decision), not O(nodes). Whole-GPU searches are cached
on the slot bits only (:func:`slot_bits`), so share usage does not split their cache.

Node and GPU order. Alignment comes first, as for whole GPUs. Then ``binpack`` fills a
shared GPU before opening another, and ``spread`` opens a fresh GPU before stacking on a
shared one: in a node, among placements of the same alignment at the requested scope (the
cross-node part of the quality, :func:`.search.cross_key`; pairs finer than asked do not
outweigh packing), the one on shared (binpack) or fresh (spread) GPUs wins, and across nodes
the number of GPUs the placement opens is a term of the cross-node key right after alignment
(fewer first for binpack, more first for spread). Then come three *fit terms*, for a share on
one GPU that stacks (:func:`fit_terms`): binpack takes the *best fit* of the whole cluster (the
least memory, then compute, left after placing, then the most shares), spread the worst fit;
they are zero for every other placement. Then the one-sided waste and the node policy's own
order. A placement on fresh GPUs only is scored as a whole-GPU search of the fresh GPUs
scores it (shared GPUs are not free for the fragmentation terms), so that the share index
and the fresh-GPU tier of :mod:`.plugins.shares` rank it the same.

How a share request is decided (:mod:`.plugins.shares`, :mod:`.plugins.stack`,
:mod:`.sharefit`): without a node selector, by indexes that keep no state per share size:
one-GPU shares without NICs by the best-fit index of shared GPUs, one-GPU shares with NICs
(binpack) by a per-GPU stacking index, others by the better of a fresh-GPU tier (the whole-GPU
index, one signature for every size) and a stacking tier (this module's search on the nodes
that have a shared GPU the share fits on); with a node selector, or when nothing can take it
(for the reasons), by the share index below.

One mode per GPU: the node agent limits a GPU's shares either through HAMi-core in each
container or through the GPU's MPS daemon, not both, so a share goes only on a fresh GPU or on
a GPU whose shares have its class's mode (:func:`fit_mask`, :func:`gpu_use` with
``sharing``); the allocation commit refuses a mix too (services/allocator/commits.py).

Limits of the model: a share request's memory and compute are per GPU and the same on each of
its GPUs; a request that leaves one out reserves none of it (and gets no limit for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .model import Shape
from .request import Spec
from .search import Choice, Refusal, _span, cross_key, evaluate, one_sided_waste, precheck

__all__ = [
    "FIELD",
    "NO_STACK",
    "GpuUse",
    "evaluate_shared",
    "fit_bound",
    "fit_mask",
    "gpu_use",
    "pack",
    "precheck_shared",
    "share_bound",
    "slot_bits",
    "stacked_choice",
    "stacked_with_nics",
]

FIELD = 48  # bits per GPU: MPS (1), used memory MiB (31), used compute percent (8), share count (8)
_COUNT_BITS = 8
_CORE_BITS = 8
_MEM_BITS = FIELD - 1 - _COUNT_BITS - _CORE_BITS
_MPS_BIT = 1 << (FIELD - 1)
_FIELD_MASK = (1 << FIELD) - 1
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_CORE_MASK = (1 << _CORE_BITS) - 1
_MEM_MAX = (1 << _MEM_BITS) - 1

GpuUse = tuple[int, int, int]  # (used memory MiB, used compute percent, shares)


def slot_bits(shape: Shape, mask: int) -> int:
    """The free-slot part of a group mask (what whole-GPU searches depend on)."""
    return mask & ((1 << shape.n_slots) - 1)


def pack(shape: Shape, use: dict[int, GpuUse], *, mps: int = 0) -> int:
    """The share bits of a node: ``use`` maps GPU slot to its usage (zero usage: no field);
    ``mps``: the slots whose shares are MPS shares (the others' are HAMi's)."""
    out = 0
    base = shape.n_slots
    for s, (mem, cores, count) in use.items():
        if count <= 0:
            continue
        # Clamped: a corrupt record must not spill into the next GPU's field.
        field = (
            (min(mem, _MEM_MAX) << (_CORE_BITS + _COUNT_BITS))
            | (min(cores, _CORE_MASK) << _COUNT_BITS)
            | min(count, _COUNT_MASK)
        )
        if mps >> s & 1:
            field |= _MPS_BIT
        out |= field << (base + s * FIELD)
    return out


def gpu_use(shape: Shape, mask: int, *, sharing: str | None = None) -> dict[int, GpuUse]:
    """The shared GPUs of a group mask and their usage (the inverse of :func:`pack`); with
    ``sharing`` (a class's mode, ``hami`` or ``mps``) only the GPUs whose shares have it."""
    if sharing is None:
        return {s: (m, c, n) for s, m, c, n, _ in _decoded(shape, mask >> shape.n_slots)}
    mps = sharing == "mps"
    return {s: (m, c, n) for s, m, c, n, x in _decoded(shape, mask >> shape.n_slots) if x is mps}


# Decoded share bits, by the bits alone (they do not depend on the shape): every signature
# that meets a group decodes it, so the decode is cached (bounded like the search cache).
_DECODED: dict[int, tuple[tuple[int, int, int, int, bool], ...]] = {}
_DECODED_MAX = 50_000


def _decoded(shape: Shape, hi: int) -> tuple[tuple[int, int, int, int, bool], ...]:
    got = _DECODED.get(hi)
    if got is None:
        out = []
        s = 0
        bits = hi
        while bits:
            field = bits & _FIELD_MASK
            if field:
                out.append(
                    (
                        s,
                        (field >> (_CORE_BITS + _COUNT_BITS)) & _MEM_MAX,
                        (field >> _COUNT_BITS) & _CORE_MASK,
                        field & _COUNT_MASK,
                        bool(field & _MPS_BIT),
                    )
                )
            bits >>= FIELD
            s += 1
        got = tuple(out)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[hi] = got
    return got


def fit_mask(shape: Shape, mask: int, spec: Spec) -> int:
    """GPU slots a share of ``spec`` may go on: shared GPUs of its class's mode with enough
    memory, compute and share count left, and whole-free GPUs with at least the share's
    memory."""
    out = 0
    limit = spec.dc.max_shares_per_gpu
    need_mem = spec.memory_mib
    max_cores = 100 - spec.cores_percent
    memory = shape.gpu_memory
    mps = spec.dc.sharing == "mps"
    for s, mem, cores, count, mode in _decoded(shape, mask >> shape.n_slots):
        if mode is mps and count < limit and memory[s] - mem >= need_mem and cores <= max_cores:
            out |= 1 << s
    free_gpus = mask & shape.gpu_all
    if need_mem and free_gpus:
        for s in range(shape.n_gpus):
            if free_gpus >> s & 1 and memory[s] >= need_mem:
                out |= 1 << s
    else:
        out |= free_gpus
    return out


_FITS_MAX = 65536  # cached candidate pairs per shape


def _candidates(shape: Shape, mask: int, spec: Spec) -> tuple[int, int]:
    """(candidate mask for the search, the shared GPUs among its GPUs), GPUs of the class.

    Cached on the shape by (mask, class, size): every share signature that meets a group asks
    it (the cheap check, then the heap key's bound), and signatures that differ only in GPU
    or NIC count share it."""
    cache = shape.share_fits
    key = (mask, spec.device_class, spec.memory_mib, spec.cores_percent)
    got = cache.get(key)
    if got is None:
        low = mask & ((1 << shape.n_slots) - 1)
        fit = fit_mask(shape, mask, spec) & shape.view(spec.device_class, spec.dc).gpu_ok
        got = ((low & ~shape.gpu_all) | fit, fit & ~low)
        if len(cache) >= _FITS_MAX:
            cache.clear()
        cache[key] = got
    return got


def _what(spec: Spec) -> str:
    parts = []
    if spec.memory_mib:
        parts.append(f"{spec.memory_mib} MiB")
    if spec.cores_percent:
        parts.append(f"{spec.cores_percent} % compute")
    return " and ".join(parts)


_REFUSALS: dict[tuple[int, int, int], Refusal] = {}


def _share_refusal(spec: Spec, res: Refusal) -> Refusal:
    if res.code != "gpus":
        return res
    key = (spec.gpus, spec.memory_mib, spec.cores_percent)
    got = _REFUSALS.get(key)
    if got is None:
        if len(_REFUSALS) >= _DECODED_MAX:
            _REFUSALS.clear()
        got = _REFUSALS[key] = Refusal(
            "gpus", f"fewer than {spec.gpus} GPUs with {_what(spec)} free for a share"
        )
    return got


def share_bound(shape: Shape, mask: int, spec: Spec, *, node_policy: str) -> tuple[int, ...]:
    """A lower bound of a share search's ``Choice.cross`` on this node, from popcounts: the
    pair fields as :func:`.search.cross_bound`, the fewest GPUs the share can open (binpack) or
    the most it can (spread), and the one-sided waste exactly. Tight for GPU-only shares, so
    the index searches few nodes per decision."""
    g, r = spec.gpus, spec.rdma
    lvl = int(spec.scope)
    both = g > 0 and r > 0
    c = -g if both else 0
    d = -r if both and not spec.per_gpu else 0
    cand, shared = _candidates(shape, mask, spec)
    if node_policy == "binpack":
        term = max(0, g - shared.bit_count())
    else:
        term = -min(g, (cand & shape.gpu_all & ~shared).bit_count())
    fit = fit_bound(spec, node_policy=node_policy) if term == 0 else _NO_FIT
    return (0, *([c] * (4 - lvl)), *([d] * (4 - lvl)), 0, term, *fit, one_sided_waste(shape, cand, g, r))


_NO_FIT = (0, 0, 0)  # the fit terms of a placement that stacks nothing (see stacked_choice)


def fit_bound(spec: Spec, *, node_policy: str) -> tuple[int, int, int]:
    """A lower bound of the fit terms of ``Choice.cross`` (see :func:`stacked_choice`)."""
    if spec.gpus != 1 or (spec.rdma and node_policy != "binpack"):
        return _NO_FIT
    if node_policy == "binpack":
        return (0, 0, -255)
    return (-(1 << 40), -100, 0)


def fit_terms(shape: Shape, use: GpuUse, s: int, spec: Spec, *, node_policy: str) -> tuple[int, int, int]:
    """The fit terms of a one-GPU, no-NIC share stacked on shared GPU slot ``s`` with usage
    ``use``: binpack best fit (least memory, then compute, left after placing; then most
    shares), spread worst fit (the opposite)."""
    mem_left = shape.gpu_memory[s] - use[0] - spec.memory_mib
    cores_left = 100 - use[1] - spec.cores_percent
    if node_policy == "binpack":
        return (mem_left, cores_left, -use[2])
    return (-mem_left, -cores_left, use[2])


def stacked_with_nics(
    shape: Shape, mask: int, s: int, spec: Spec, *, search: Callable[[Shape, int], Choice | Refusal]
) -> Choice:
    """A one-GPU share with NICs stacked on shared GPU slot ``s`` (binpack): the exact search
    on the node's free NICs and ``s`` alone (``search``: the cached one), with the fit terms
    in ``cross`` (see :func:`stacked_choice`)."""
    nics = mask & ((1 << shape.n_slots) - 1) & ~shape.gpu_all
    got = search(shape, nics | 1 << s)
    assert isinstance(got, Choice), "a filed GPU has a placement"
    fit = fit_terms(shape, gpu_use(shape, mask)[s], s, spec, node_policy="binpack")
    return replace(got, cross=(*got.cross[:-1], 0, *fit, got.cross[-1]))


def stacked_choice(shape: Shape, mask: int, s: int, spec: Spec, *, node_policy: str) -> Choice:
    """A one-GPU, no-NIC share placed on shared GPU slot ``s`` of a node with group mask
    ``mask``. Such a placement has no pair and no NVLink set (its alignment key is all
    zeros, as for every one-GPU GPU-only placement), opens no GPU and breaks no whole unit
    (the GPU was in use already), so its fragmentation is zero; what orders it against other
    shared GPUs are its fit terms (:func:`fit_terms`), placed in ``cross`` right after the
    opened-GPU term, ahead of the one-sided waste and the node order."""
    key = (0,) * 10
    use = gpu_use(shape, mask)[s]
    return Choice(
        key=key,
        frag=(0, 0, 0, 0, 0),
        gpus=(s,),
        nics=(),
        pairs=(),
        scope=_span(shape, (s,)),
        met=True,
        cross=(
            *cross_key(key, int(spec.scope)),
            0,
            *fit_terms(shape, use, s, spec, node_policy=node_policy),
            one_sided_waste(shape, mask & ((1 << shape.n_slots) - 1), 1, 0),
        ),
    )


NO_STACK = Refusal("stack", "no shared GPU the share fits on")


_SEARCH_SPECS: dict[tuple[object, ...], Spec] = {}


def search_spec(spec: Spec) -> Spec:
    """The whole-GPU request the exact search of share ``spec`` runs as: the same, with the
    share's memory as the class's minimum GPU memory (a view of its own, by name), so that a
    fresh GPU too small for the share is no candidate but still counts as free for the
    fragmentation terms, exactly as in the whole-GPU index's fresh-GPU tier (see
    .plugins.shares.Shares.open_spec)."""
    if spec.memory_mib <= spec.dc.gpu_min_memory_mib:
        return spec
    got = _SEARCH_SPECS.get(spec.key)
    if got is None:
        if len(_SEARCH_SPECS) >= _DECODED_MAX:
            _SEARCH_SPECS.clear()
        got = _SEARCH_SPECS[spec.key] = spec.whole_with_min_memory(spec.memory_mib)
    return got


def precheck_shared(shape: Shape, mask: int, spec: Spec) -> Refusal | None:
    """The cheap check of a share request (popcounts on the candidate mask); for its stacking
    view (``spec.stack``), also that some shared GPU of the node fits the share."""
    cand, shared = _candidates(shape, mask, spec)
    if spec.stack and not shared:
        return NO_STACK
    if not spec.rdma and (cand & shape.gpu_all).bit_count() >= spec.gpus:
        return None  # the candidates are GPUs of the class already; no NIC to check
    res = precheck(shape, cand, spec)
    return None if res is None else _share_refusal(spec, res)


def evaluate_shared(
    shape: Shape,
    mask: int,
    spec: Spec,
    *,
    node_policy: str,
    cache: dict[tuple[object, ...], Choice | Refusal] | None = None,
) -> Choice | Refusal:
    """The best placement of a share request on a node whose group mask is ``mask``.

    The exact search runs on every candidate GPU; then, when some other placement of the
    same alignment quality would open fewer (binpack) or more (spread) fresh GPUs, the
    search runs again on those GPUs only and its result is taken if its quality is equal.
    ``Choice.cross`` gets the opened-GPU term before the one-sided waste (see the module
    docstring). ``cache``: the exact searches by candidate mask, which many share usages and
    every share size have in common (the search depends on the candidates, not the sizes)."""
    sspec = search_spec(spec)
    base = sspec.key[:6]

    def search(free: int) -> Choice | Refusal:
        if cache is None:
            return evaluate(shape, free, sspec)
        key = (base, shape.id, free)
        got = cache.get(key)
        if got is None:
            got = cache[key] = evaluate(shape, free, sspec)
        return got

    cand, shared = _candidates(shape, mask, spec)
    if spec.stack and not shared:
        return NO_STACK
    one = spec.gpus == 1 and spec.rdma == 0
    fresh_gpus = cand & shape.gpu_all & ~shared
    if one and shared and (node_policy == "binpack" or not fresh_gpus):
        # Binpack: the best-fit shared GPU; spread with no fresh GPU left: the worst fit.
        use = gpu_use(shape, mask)
        s = min(
            (s for s in range(shape.n_gpus) if shared >> s & 1),
            key=lambda s: (*fit_terms(shape, use[s], s, spec, node_policy=node_policy), s),
        )
        return stacked_choice(shape, mask, s, spec, node_policy=node_policy)
    # Every fresh GPU stays in the searched mask (the search spec's view leaves out those too
    # small for the share): fragmentation counts them as free, as a whole-GPU search does.
    low = mask & ((1 << shape.n_slots) - 1)
    res = search(low | shared)
    if isinstance(res, Refusal):
        return _share_refusal(spec, res)
    if spec.gpus == 1 and node_policy == "binpack" and shared:
        stacked = _stacked_with_nics(shape, mask, spec, res, cand=cand, shared=shared, search=search)
        if stacked is not None:
            return stacked
    chosen = _mask_of(res.gpus)
    alt_gpus: int | None = None
    if node_policy == "binpack" and shared and chosen & ~shared:
        alt_gpus = shared
    elif node_policy != "binpack" and fresh_gpus and chosen & shared:
        alt_gpus = fresh_gpus
    # Equal alignment at the requested scope (the cross-node part): pairs finer than asked do
    # not outweigh packing, within a node as across nodes.
    scope = int(spec.scope)
    if alt_gpus is not None:
        alt = search(low if alt_gpus == fresh_gpus else (cand & ~shape.gpu_all) | alt_gpus)
        if isinstance(alt, Choice) and cross_key(alt.key, scope) == cross_key(res.key, scope):
            res = alt
            chosen = _mask_of(res.gpus)
    if shared and not chosen & shared and alt_gpus != fresh_gpus:
        # On fresh GPUs only: scored as the fresh-GPU tier scores it (the shared GPUs are not
        # free for the fragmentation terms), so that both paths rank it the same.
        alt = search(low)
        if isinstance(alt, Choice) and cross_key(alt.key, scope) == cross_key(res.key, scope):
            res = alt
            chosen = _mask_of(res.gpus)
    opened = (chosen & ~shared).bit_count()
    term = opened if node_policy == "binpack" else -opened
    return replace(res, cross=(*res.cross[:-1], term, *_NO_FIT, res.cross[-1]))


def _stacked_with_nics(
    shape: Shape,
    mask: int,
    spec: Spec,
    res: Choice,
    *,
    cand: int,
    shared: int,
    search: Callable[[int], Choice | Refusal],
) -> Choice | None:
    """One GPU with NICs, binpack: among the shared GPUs that fit and reach the best
    alignment at the requested scope (``res``'s, the cross-node part: pairs finer than asked do
    not open a fresh GPU), the best fit, then the least fragmentation, the finer pairs (what
    .sharefit.StackIndex orders by across nodes); None when no shared GPU reaches it."""
    use = gpu_use(shape, mask)
    nics = cand & ~shape.gpu_all
    scope = int(spec.scope)
    want = cross_key(res.key, scope)
    best: tuple[tuple[int, ...], Choice, tuple[int, int, int]] | None = None
    for s in range(shape.n_gpus):
        if not shared >> s & 1:
            continue
        alt = search(nics | 1 << s)
        if not isinstance(alt, Choice) or cross_key(alt.key, scope) != want:
            continue
        fit = fit_terms(shape, use[s], s, spec, node_policy="binpack")
        rank = (*fit, *alt.frag, *alt.key, s)
        if best is None or rank < best[0]:
            best = (rank, alt, fit)
    if best is None:
        return None
    alt, fit = best[1], best[2]
    return replace(alt, cross=(*alt.cross[:-1], 0, *fit, alt.cross[-1]))


def _mask_of(slots: tuple[int, ...]) -> int:
    m = 0
    for s in slots:
        m |= 1 << s
    return m
