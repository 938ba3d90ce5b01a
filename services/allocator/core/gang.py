"""Whole jobs: ``N`` identical pods placed all-or-nothing across nodes (the pure decision).

:func:`place_job` decides where every pod of a :class:`~schemas.messages.JobRequest` goes, or
says why the job cannot be placed now; it holds nothing. The caller holds pod ``i``'s devices
under ``job.pod_id(i)`` (``JOB/i``) with :meth:`Cluster.hold` — in the service, through the
atomic multi-node commit — so that no device of a job is held unless all are.

Order of placements (smaller is better), the issue's "fabric tier, then alignment, then
fragmentation":

1. the NVLink domain, when the job asks for one: every pod in one multi-node NVLink domain
   (``NodeTopology.nvlink_domain``: same cluster UUID and clique id). ``required`` considers
   only placements inside one domain; ``preferred`` tries those first and falls back;
2. the highest *fabric level* spanned: one node (0) < one block of the finest tier (1, e.g.
   one ``leaf``) < one block of the next tier (2, ``spine``) < ... < the whole cluster. A node's
   block at tier ``t`` is its label ``tandem.io/fabric-<t>`` (a node without it belongs to no
   block of that tier; it can still be used at a coarser one). ``fabric="leaf"`` with
   ``fabric_policy="required"`` never spans above one leaf; ``preferred`` (or no ``fabric``)
   takes the finest level that can hold the job;
3. alignment: the sum over the pods of each pod's in-node alignment quality
   (:attr:`.search.Choice.key`: requested scope met, pairs within each scope level, finer
   first, NVLink fit), compared as a vector, lexicographically. The full quality, not the
   cross-node part ``Cluster.decide`` compares nodes by (which leaves out pairs finer than
   requested): for a job the fabric block is already chosen, and only the full quality is
   monotone along a node's pods, which exactness needs (below);
4. fragmentation: the sum of the pods' in-node fragmentation (whole switches, NUMA nodes,
   NVLink partitions broken; for a GPU-only or NIC-only pod, first the other kind left free
   on its node), then the fabric block's spare room (``binpack``: the block
   the job fills best, so that free leaves stay whole for the next large job; ``spread``: the
   emptiest block), then the fullest nodes (``binpack``) or the emptiest (``spread``).

How it is exact and fast. Several pods may share a node; a node's pods are placed one after
another, each by the exact in-node search on what the earlier ones left
(:meth:`Cluster.evaluate_free`, the cached search ``decide`` uses), so a node offers a *chain*
of pod placements. A later pod of a chain never aligns better than an earlier one (its devices
were free when the earlier one was chosen, and the in-node search minimises the full quality
first — the cross-node part alone would not do: a first pod may trade NVLink fit for finer
pairs and a second get the NVLink fit back), so the ``N`` best pods of a fabric block — under
a prefix constraint per node — are simply the ``N`` smallest chain items: a sorted merge, with
no search over assignments. Sums of vectors keep the lexicographic order (swapping a chosen
item for a worse one can only make the sum worse), so that choice minimises 3. exactly; the
property tests compare it with an exhaustive search over every distribution of the pods across
nodes. Chains depend only on (hardware, free mask), so identical nodes share one chain, and a
block's items are merged per distinct chain with a multiplicity: a decision costs one pass
over the nodes plus a sort of (distinct chains x pods per node) items per candidate block,
milliseconds at 2,000 nodes (``bench/gang.py``).

What "exact" means here: the optimum over distributions of pods across nodes, with each
node's pods placed in sequence by the in-node search. Two pods on one node are not searched
jointly (a joint search could, rarely, fit one more pod on an awkward node).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from schemas.messages import JobRequest
from schemas.topology import SCOPE_NAMES

from .cluster import Cluster
from .errors import InvalidRequest
from .model import Shape
from .placement import Placement, Unschedulable
from .request import Spec
from .search import Choice, Refusal

__all__ = [
    "DEFAULT_TIERS",
    "FABRIC_LABEL_PREFIX",
    "JobPlacement",
    "JobUnschedulable",
    "fabric_label",
    "fabric_span",
    "place_job",
]

FABRIC_LABEL_PREFIX = "tandem.io/fabric-"
DEFAULT_TIERS: tuple[str, ...] = ("leaf", "spine")


def fabric_label(tier: str) -> str:
    """The node label naming a node's block at ``tier``: ``tandem.io/fabric-<tier>``."""
    return FABRIC_LABEL_PREFIX + tier


def fabric_span(labels: Sequence[Mapping[str, str]], tiers: Sequence[str]) -> tuple[int, str, str]:
    """The fabric level a set of nodes spans, given their labels: ``(level, tier name,
    block)`` with the same meaning as :class:`JobPlacement`'s ``level`` / ``tier`` / ``block``
    (for reports on placements made some other way, such as pod by pod)."""
    if len(labels) <= 1:
        return 0, "node", ""
    for i, tier in enumerate(tiers, start=1):
        key = fabric_label(tier)
        values = {lab.get(key) for lab in labels}
        if len(values) == 1:
            (v,) = values
            if v is not None:
                return i, tier, v
    return len(tiers) + 1, "cluster", ""


@dataclass(slots=True)
class JobPlacement:
    """Where every pod of a job goes. ``pods[i]`` is pod ``i`` (hold it as ``JOB/i``).

    ``tier`` is the highest level spanned: ``"node"`` (all pods on one node), a tier name
    (all within one block of it, ``block`` names which) or ``"cluster"``; ``level`` the same
    as a number (0 node, 1 the finest tier, ..., ``len(tiers) + 1`` cluster). ``alignment``
    is the sum of the pods' in-node quality vectors (``Choice.key``, smaller is better); ``met`` says
    whether every pod's requested scope is met. ``nvlink_domain`` is the domain key when all
    pods are in one NVLink domain. ``candidates`` counts the nodes able to take a pod."""

    job_id: str
    pods: tuple[Placement, ...]
    tier: str
    level: int
    block: str
    alignment: tuple[int, ...]
    met: bool
    nvlink_domain: str | None = None
    candidates: int = 0

    def nodes(self) -> list[str]:
        """The distinct nodes used, in pod order."""
        return list(dict.fromkeys(p.node for p in self.pods))

    def holds(self, job: JobRequest) -> list[tuple[str, str, list[str]]]:
        """``(node, pod id, devices)`` for every pod: what the caller holds."""
        return [(p.node, job.pod_id(i), p.devices()) for i, p in enumerate(self.pods)]


@dataclass(slots=True)
class JobUnschedulable:
    """The job cannot be placed whole now. ``reason`` aggregates why, for people:
    ``capacity`` is how many of its pods the eligible nodes could take in all; ``best`` the
    most one block at the finest allowed level could take."""

    job_id: str
    reason: str
    capacity: int = 0
    best: int = 0
    pod: Unschedulable | None = field(default=None)


# --------------------------------------------------------------------------------------------
# per-node chains


@dataclass(slots=True)
class _Chain:
    """The pods one (hardware, free mask) can take, in sequence: ``choices[j]`` is pod
    ``j`` on what pods ``0..j-1`` left; ``order[j]`` its merge key (see :func:`_chain`)."""

    id: int
    choices: list[Choice]
    order: list[tuple[tuple[int, ...], tuple[int, ...]]]
    fullness: int  # binpack: free GPUs (fuller first); spread: minus free GPUs
    refusal: Refusal | None = None  # why not even one pod (no choices)


@dataclass(slots=True)
class _Row:
    name: str
    order: int  # registration order: the last tie-break
    labels: Mapping[str, str]
    blocks: tuple[str | None, ...]  # the node's block per tier (None: not labelled)
    domain: str | None
    chain: _Chain


# Per cluster: (nodes_version, tiers, name -> (order, labels, blocks, domain)). Rebuilt only
# when nodes change (Cluster.nodes_version), so a decision does not read every node's labels.
_NodeFacts = tuple[int, Mapping[str, str], tuple[str | None, ...], str | None]
_INDEX: weakref.WeakKeyDictionary[Cluster, tuple[int, tuple[str, ...], dict[str, _NodeFacts]]] = (
    weakref.WeakKeyDictionary()
)


def _fabric_index(cluster: Cluster, tiers: tuple[str, ...]) -> dict[str, _NodeFacts]:
    cached = _INDEX.get(cluster)
    if cached is not None and cached[0] == cluster.nodes_version and cached[1] == tiers:
        return cached[2]
    keys = [fabric_label(t) for t in tiers]
    index: dict[str, _NodeFacts] = {}
    for i, (name, labels, topo, _shape, _mask) in enumerate(cluster.job_nodes()):
        dom = topo.nvlink_domain
        index[name] = (i, labels, tuple(labels.get(k) for k in keys), None if dom is None else dom.key)
    _INDEX[cluster] = (cluster.nodes_version, tiers, index)
    return index


def _chain(
    cluster: Cluster, spec: Spec, shape: Shape, mask: int, *, limit: int, cid: int, spread: bool
) -> _Chain:
    choices: list[Choice] = []
    order: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    full = (1 << shape.n_slots) - 1
    free = mask
    while len(choices) < limit:
        res = cluster.evaluate_free(spec, shape, free)
        if isinstance(res, Refusal):
            if not choices:
                return _Chain(cid, choices, order, 0, res)
            break
        key = (res.key, (res.cross[-1], *res.frag))  # cross[-1]: the one-sided waste
        # The merge key must not decrease along a chain (a node's pods are taken in order).
        # Alignment never does (see the module docstring); fragmentation may, so the key is
        # the running maximum, which leaves the alignment part as it is.
        if order and key < order[-1]:
            key = order[-1]
        choices.append(res)
        order.append(key)
        taken = 0
        for s in (*res.gpus, *res.nics):
            taken |= 1 << s
        free = shape.effective_free(full & ~(free & ~taken))
    free_g = (mask & shape.gpu_all).bit_count()
    return _Chain(cid, choices, order, -free_g if spread else free_g)


# --------------------------------------------------------------------------------------------
# the decision


def place_job(
    cluster: Cluster, job: JobRequest, *, tiers: Sequence[str] = DEFAULT_TIERS
) -> JobPlacement | JobUnschedulable:
    """The best placement of every pod of ``job`` (see the module docstring); holds nothing.

    ``tiers``: the fabric tiers, finest first (allocator config ``fabric_tiers``). Raises
    :class:`InvalidRequest` for a job that can never be placed as written (unknown device
    class, scope or fabric tier)."""
    tiers = tuple(tiers)
    if len(set(tiers)) != len(tiers) or not all(tiers):
        raise InvalidRequest(f"fabric tiers must be distinct non-empty names, got {list(tiers)}")
    spec = cluster.normalise(job.template())
    if job.pods < 1:
        raise InvalidRequest(f"job {job.job_id}: pods must be at least 1, got {job.pods}")
    top = len(tiers) + 1
    cap = top
    if job.fabric is not None:
        if job.fabric not in tiers:
            raise InvalidRequest(
                f"job {job.job_id}: unknown fabric tier {job.fabric!r} (tiers: {', '.join(tiers) or 'none'})"
            )
        if job.fabric_policy == "required":
            cap = tiers.index(job.fabric) + 1

    rows, refused = _rows(cluster, spec, job, tiers, spread=cluster.node_policy == "spread")
    if job.nvlink_domain is not None:
        in_domain = [r for r in rows if r.domain is not None]
        res = _search(cluster, job, spec, in_domain, tiers, cap=cap, by_domain=True)
        if isinstance(res, JobPlacement):
            return res
        if job.nvlink_domain == "required":
            if not in_domain and rows:
                res.reason = f"{_what(job, spec)}: no node that can take a pod is in an NVLink domain"
                return res
            return _explain(cluster, job, spec, res, refused)
    res = _search(cluster, job, spec, rows, tiers, cap=cap, by_domain=False)
    return res if isinstance(res, JobPlacement) else _explain(cluster, job, spec, res, refused)


def _rows(
    cluster: Cluster, spec: Spec, job: JobRequest, tiers: tuple[str, ...], *, spread: bool
) -> tuple[list[_Row], dict[str, int]]:
    """Every node matching the selector that can take at least one pod, with its chain, in
    registration order; and per refusal text the matching nodes that cannot take one. Walks
    the groups of equal nodes: a group that cannot take a pod costs one cached search."""
    index = _fabric_index(cluster, tiers)
    selector = spec.selector
    rows: list[_Row] = []
    refused: dict[str, int] = {}
    for cid, (shape, mask, names) in enumerate(cluster.job_groups()):
        chain = _chain(cluster, spec, shape, mask, limit=job.pods, cid=cid, spread=spread)
        if chain.refusal is not None:
            text = chain.refusal.text
            if selector:
                count = sum(1 for n in names if all(index[n][1].get(k) == v for k, v in selector))
            else:
                count = len(names)
            if count:
                refused[text] = refused.get(text, 0) + count
            continue
        for name in names:
            order, labels, blocks, domain = index[name]
            if selector and not all(labels.get(k) == v for k, v in selector):
                continue
            rows.append(_Row(name, order, labels, blocks, domain, chain))
    rows.sort(key=lambda r: r.order)
    return rows, refused


# (score, (domain, block), pods per node, alignment, met)
_Best = tuple[tuple[object, ...], tuple[str | None, str], list[tuple[_Row, int]], tuple[int, ...], bool]


def _search(
    cluster: Cluster,
    job: JobRequest,
    spec: Spec,
    rows: list[_Row],
    tiers: tuple[str, ...],
    *,
    cap: int,
    by_domain: bool,
) -> JobPlacement | JobUnschedulable:
    n = job.pods
    capacity = sum(len(r.chain.choices) for r in rows)
    names = ("node", *tiers, "cluster")
    best_seen = 0
    best_block = ""
    for level in range(cap + 1):
        blocks: dict[tuple[str | None, str], list[_Row]] = {}
        best: _Best | None = None
        seen = 0
        seen_block = ""
        seen_chains: set[tuple[str | None, int]] = set()
        for r in rows:
            if level == 0:
                # One node: its score depends only on its chain (and domain), so nodes that
                # share both are one candidate (the first registered stands for them).
                if len(r.chain.choices) < n and seen < len(r.chain.choices):
                    seen, seen_block = len(r.chain.choices), r.name
                ck = (r.domain if by_domain else None, r.chain.id)
                if len(r.chain.choices) < n or ck in seen_chains:
                    continue
                seen_chains.add(ck)
                bkey = r.name
            elif level <= len(tiers):
                v = r.blocks[level - 1]
                if v is None:
                    continue
                bkey = v
            else:
                bkey = ""
            dkey = r.domain if by_domain else None
            members = blocks.get((dkey, bkey))
            if members is None:
                members = blocks[(dkey, bkey)] = []
            members.append(r)
        for bk, members in blocks.items():
            room = sum(len(r.chain.choices) for r in members)
            if room < n:
                if room > seen:
                    seen, seen_block = room, bk[1]
                continue
            align, frag, take, met = _fill(members, n)
            spare = room - n if cluster.node_policy == "binpack" else -room
            score = (align, frag, spare)
            if best is None or score < best[0]:
                best = (score, bk, take, align, met)
        if best is not None:
            _score, (dkey, bkey), take, align, met = best
            pods: list[Placement] = []
            for row, k in take:
                for j in range(k):
                    pods.append(
                        cluster.placement_of(row.name, row.chain.choices[j], spec, candidates=len(rows))
                    )
            return JobPlacement(
                job_id=job.job_id,
                pods=tuple(pods),
                tier=names[level],
                level=level,
                block=bkey,
                alignment=align,
                met=met,
                nvlink_domain=dkey,
                candidates=len(rows),
            )
        # The reason reports the coarsest level allowed (the last one tried).
        best_seen, best_block = seen, seen_block
    out = JobUnschedulable(job_id=job.job_id, reason="", capacity=capacity, best=best_seen)
    out.reason = _tier_text(job, names[cap], best_block, best_seen, capacity, by_domain=by_domain)
    return out


def _fill(
    members: list[_Row], n: int
) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[_Row, int]], bool]:
    """The ``n`` best pods of one block: (alignment sum, fragmentation sum, pods per node, all
    scopes met). Chains are merged per distinct chain with the number of nodes sharing it."""
    by_chain: dict[int, list[_Row]] = {}
    chains: dict[int, _Chain] = {}
    for r in members:
        lst = by_chain.get(r.chain.id)
        if lst is None:
            lst = by_chain[r.chain.id] = []
            chains[r.chain.id] = r.chain
        lst.append(r)
    items = []
    for cid, ch in chains.items():
        for j, key in enumerate(ch.order):
            items.append((key, ch.fullness, j, cid))
    items.sort()
    need = n
    taken: dict[int, list[int]] = {}  # chain id -> nodes taking pod j, per j
    align: list[int] | None = None
    frag: list[int] | None = None
    met = True
    for _key, _full, j, cid in items:
        if need == 0:
            break
        ch = chains[cid]
        c = min(len(by_chain[cid]), need)
        need -= c
        taken.setdefault(cid, []).append(c)
        choice = ch.choices[j]
        met = met and choice.met
        if align is None or frag is None:
            align = [c * x for x in choice.key]
            frag = [c * x for x in choice.frag]
        else:
            for i, x in enumerate(choice.key):
                align[i] += c * x
            for i, x in enumerate(choice.frag):
                frag[i] += c * x
    assert need == 0 and align is not None and frag is not None
    take: list[tuple[_Row, int]] = []
    for cid, counts in taken.items():
        # counts[j] nodes of this chain take pod j; the first counts[j] of them (counts never
        # grow along j: pod j of a node is merged only after pod j-1 of every node sharing it).
        for i, row in enumerate(by_chain[cid]):
            k = sum(1 for c in counts if c > i)
            if k:
                take.append((row, k))
    take.sort(key=lambda rk: rk[0].order)
    return tuple(align), tuple(frag), take, met


# --------------------------------------------------------------------------------------------
# reasons


def _what(job: JobRequest, spec: Spec) -> str:
    pol = "required" if spec.required else "preferred"
    pods = f"{job.pods} pod{'s' if job.pods != 1 else ''}"
    return f"{pods} of {spec.gpus}+{spec.rdma} ({SCOPE_NAMES[spec.scope]} {pol})"


def _tier_text(job: JobRequest, tier: str, block: str, best: int, capacity: int, *, by_domain: bool) -> str:
    where = "NVLink domain" if by_domain else "cluster"
    if capacity < job.pods:
        return (
            f"the {where}s can take only {capacity}" if by_domain else f"the cluster can take only {capacity}"
        )
    unit = f"{tier} within one NVLink domain" if by_domain and tier != "cluster" else tier
    if tier == "cluster":
        return f"no NVLink domain can take {job.pods}; at most {best}"
    at = f" (in {tier} {block})" if block else ""
    return f"no {unit} can take {job.pods}; at most {best}{at}; the {where} could take {capacity}"


def _explain(
    cluster: Cluster, job: JobRequest, spec: Spec, res: JobUnschedulable, refused: Mapping[str, int]
) -> JobUnschedulable:
    """Prefix the job's summary; when the cluster cannot take enough pods, say why the other
    nodes cannot take one (the per-node reasons, most common first, as for a pod)."""
    if res.capacity == 0:
        one = cluster.decide(job.template())
        if isinstance(one, Unschedulable):
            res.pod = one
            res.reason = f"{_what(job, spec)}: {one.reason}"
            return res
    if not res.reason.startswith(_what(job, spec)):
        res.reason = f"{_what(job, spec)}: {res.reason}"
    if res.capacity < job.pods and refused:
        items = sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))
        why = "; ".join(f"{n} node{'' if n == 1 else 's'}: {t}" for t, n in items[:4])
        more = f"; {len(items) - 4} more reasons" if len(items) > 4 else ""
        res.reason += f" (no pod fits on the other nodes: {why}{more})"
    return res
