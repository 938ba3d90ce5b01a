"""Property tests of the share-request indexes (``services/allocator/core/sharefit.py`` and the
two tiers of ``Cluster._decide_share_tiers``) against a brute-force choice over every node.

A share request without a node selector is decided without a signature per share size: one-GPU
shares without NICs by the best-fit index of shared GPUs, one-GPU shares with NICs (binpack) by
the per-GPU stacking index, other shares by the fresh-GPU tier (the whole-GPU index) and the
stacking tier (nodes with a shared GPU the share fits on). Each decision here is compared with
the brute force: the exact in-node search of the share (``evaluate_shared``) on *every* node
and the cluster's node order, minimum over all nodes. The decision must be no worse in the
node order, and for one-GPU shares without NICs exactly as good, with the stacked GPU the
best fit (binpack) or worst fit (spread) over every shared GPU of the cluster that the share
fits on. (Why "no worse" and not "equal" with NICs or several GPUs: the in-node search ranks a
node's placements by the full quality key, finer pairs first, and its optimum need not have
the best *cross-node* part; the fresh-GPU tier searches a node's fresh GPUs alone and can find
a placement there that the node order ranks higher. Both are valid placements; the tiers
never return a worse one.) Random
small fleets (mixed GPU memory sizes, NIC kinds, unhealthy devices) and random traces of
whole and share requests, holds and releases.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.randtopo import random_request
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, InvalidRequest, Placement
from services.allocator.core.request import Spec
from services.allocator.core.search import Choice, cross_key, one_sided_waste
from services.allocator.core.shares import evaluate_shared, fit_terms, gpu_use
from tests.property.test_core_shares import _fleet

Order = tuple[tuple[int, ...], ...]


def _share(rng: random.Random, rid: str) -> AllocationRequest:
    g = 1 if rng.random() < 0.6 else 2
    r = rng.choice((0, 0, 1, g)) if g > 1 else rng.choice((0, 1))
    mem = rng.choice((None, 4096, 10240, 20480, 40960, 61440))
    cores = rng.choice((None, 10, 25, 50, 100)) if mem is not None else rng.choice((10, 30, 50))
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=g,
        rdma=r,
        scope=rng.choice((None, "pcie-switch", "numa")),
        policy=rng.choice((None, "required", "preferred")),
        device_class=rng.choice(("share", "share", "share-mps")),
        gpu_memory_mib=mem,
        gpu_cores_percent=cores,
    )


def _brute(cluster: Cluster, spec: Spec) -> tuple[Order, str] | None:
    """The best node by the exact in-node share search on every node and the node order."""
    best: tuple[Order, str] | None = None
    for name in cluster.nodes():
        node = cluster._nodes[name]
        res = evaluate_shared(node.shape, node.mask, spec, node_policy=cluster.node_policy)
        if not isinstance(res, Choice):
            continue
        order = cluster._order(spec, (node.hw, node.mask), res, pressure=False)
        if best is None or order < best[0]:
            best = (order, name)
    return best


def _order_of(cluster: Cluster, spec: Spec, got: Placement) -> Order:
    """The node order of a decided placement, from the placement and the state before it."""
    node = cluster._nodes[got.node]
    shape = node.shape
    use = gpu_use(shape, node.mask)
    slots = [shape.slot_of[f"gpu{g.index}"] for g in got.gpus]
    nics = [shape.slot_of[n.name] for n in got.nics]
    opened = sum(1 for s in slots if s not in use)
    key, frag = got.quality[:10], got.quality[10:]
    fit = (0, 0, 0)
    binpack = cluster.node_policy == "binpack"
    if spec.gpus == 1 and opened == 0 and (spec.rdma == 0 or binpack):
        fit = fit_terms(shape, use[slots[0]], slots[0], spec, node_policy=cluster.node_policy)
    low = node.mask & ((1 << shape.n_slots) - 1)
    cross = (
        *cross_key(key, int(spec.scope)),
        opened if binpack else -opened,
        *fit,
        one_sided_waste(shape, low, spec.gpus, spec.rdma),
    )
    choice = Choice(
        key=key, frag=frag, gpus=tuple(slots), nics=tuple(nics), pairs=(), scope=0, met=True, cross=cross
    )
    return cluster._order(spec, (node.hw, node.mask), choice, pressure=False)


def _best_fit(cluster: Cluster, spec: Spec) -> tuple[int, int, int] | None:
    """Brute force over every shared GPU: the best (binpack) or worst (spread) fit's point."""
    points = []
    for name in cluster.nodes():
        node = cluster._nodes[name]
        shape = node.shape
        ok = shape.view(spec.device_class, spec.dc).gpu_ok
        for s, (mem, cores, count) in gpu_use(shape, node.mask, sharing=spec.dc.sharing).items():
            if not ok >> s & 1 or count >= spec.dc.max_shares_per_gpu:
                continue
            left = (shape.gpu_memory[s] - mem, 100 - cores, -count)
            if left[0] >= spec.memory_mib and left[1] >= spec.cores_percent:
                points.append(left)
    if not points:
        return None
    return min(points) if cluster.node_policy == "binpack" else max(points)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["binpack", "spread"]))
def test_share_decisions_equal_the_brute_force_best_over_all_nodes(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    cluster, topos = _fleet(seed, rng.randint(1, 5), policy)
    live: dict[str, str] = {}
    for step in range(50):
        roll = rng.random()
        if live and roll < 0.25:
            rid = rng.choice(sorted(live))
            cluster.release(live.pop(rid), rid)
            continue
        if roll < 0.3:
            node = rng.choice(sorted(topos))
            ids = cluster.free_devices(node) or ["gpu0"]
            cluster.set_unavailable(node, cluster.unavailable_devices(node) | {rng.choice(ids)})
            continue
        rid = f"r{step}"
        req = _share(rng, rid) if rng.random() < 0.7 else random_request(rng, rid)
        if req.node_selector:
            req = AllocationRequest(
                request_id=rid, pod=req.pod, gpus=req.gpus, rdma=req.rdma, device_class=req.device_class
            )
        try:
            spec = cluster.normalise(req)
        except InvalidRequest:
            continue
        brute = _brute(cluster, spec) if spec.shared else None
        fit = _best_fit(cluster, spec) if spec.shared else None
        got = cluster.decide(req)
        if spec.shared:
            if not isinstance(got, Placement):
                assert brute is None, f"refused, but {brute[1]} can take the share"
            else:
                assert brute is not None, "placed, but no node can take the share"
                order = _order_of(cluster, spec, got)
                assert order <= brute[0], (order, brute)
                if spec.gpus == 1 and spec.rdma == 0:
                    assert order == brute[0], (order, brute)
                node = cluster._nodes[got.node]
                use = gpu_use(node.shape, node.mask)
                slot = node.shape.slot_of[got.devices()[0]]
                if spec.gpus == 1 and spec.rdma == 0:
                    if slot in use:
                        # Stacked: the best (binpack) or worst (spread) fit of the whole cluster.
                        mem, cores, count = use[slot]
                        assert (node.shape.gpu_memory[slot] - mem, 100 - cores, -count) == fit
                    elif policy == "binpack":
                        assert fit is None, "binpack opened a fresh GPU while a shared one fits"
        if isinstance(got, Placement):
            cluster.hold(got.node, rid, got.devices(), shares=got.shares(), sharing=got.sharing)
            live[rid] = got.node
