"""Property tests of the allocator core against the plain exhaustive search (bench.exhaustive).

Random small topologies, random holds and unhealthy devices, random requests (counts, scope,
policy, pairing, device class). What must hold: no used / unavailable device handed out; a
required scope always honoured; ``Unschedulable`` only when no node has a placement meeting the
required scope; the chosen placement as good as the best any node offers (same quality tuple
as the exhaustive search on the chosen node, same scope/pair/NVLink part as the best node);
and the incremental index agrees with a cluster built from scratch after churn.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import exhaustive
from bench.randtopo import CLASSES, all_device_ids, random_cluster, random_request, random_topology
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import Gpu, NodeTopology, Scope, locate, scope_between
from services.allocator.core import Cluster, Placement, Unschedulable
from services.allocator.core.search import cross_key

SETTINGS = settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _loc_map(topo: NodeTopology) -> dict[str, object]:
    out: dict[str, object] = {}
    for loc in locate(topo):
        out[loc.device.id] = loc
        if not isinstance(loc.device, Gpu):
            for vf in loc.device.vfs:
                out[vf.name] = loc
    return out


def check_placement(
    p: Placement,
    cluster: Cluster,
    topos: dict[str, NodeTopology],
    blocked: dict[str, set[str]],
    req: AllocationRequest,
) -> None:
    spec = cluster.normalise(req)
    free = exhaustive.effective_free(topos[p.node], blocked[p.node])
    devs = p.devices()
    assert len(devs) == len(set(devs)) == spec.gpus + spec.rdma
    assert set(devs) <= free, f"handed out a used/unavailable device: {set(devs) - free}"
    assert len(p.gpus) == spec.gpus and len(p.nics) == spec.rdma
    labels = cluster.labels(p.node)
    assert all(labels.get(k) == v for k, v in req.node_selector.items())
    where = _loc_map(topos[p.node])
    if spec.required and spec.gpus and spec.rdma:
        for pair in p.pairs:
            s = scope_between(where[f"gpu{pair.gpu}"], where[pair.nic])  # type: ignore[arg-type]
            assert s <= spec.scope, f"pair {pair} outside required scope {spec.scope.wire}"
            assert Scope.parse(pair.scope) == s
        if not spec.per_gpu:
            for nic in p.nics:
                near = min(scope_between(where[f"gpu{g.index}"], where[nic.name]) for g in p.gpus)  # type: ignore[arg-type]
                assert near <= spec.scope
    if spec.per_gpu:
        assert sorted(x.gpu for x in p.pairs) == sorted(g.index for g in p.gpus)
        assert sorted(x.nic for x in p.pairs) == sorted(n.name for n in p.nics)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rseed=st.integers(0, 2**32 - 1))
def test_single_node_equals_exhaustive(seed: int, rseed: int) -> None:
    cluster, topos, blocked = random_cluster(seed, 1)
    req = random_request(random.Random(rseed))
    spec = cluster.normalise(req)
    labels = cluster.labels("n0")
    ref = None
    if all(labels.get(k) == v for k, v in req.node_selector.items()):
        ref = exhaustive.best(topos["n0"], exhaustive.effective_free(topos["n0"], blocked["n0"]), spec)
    got = cluster.decide(req)
    if ref is None:
        assert isinstance(got, Unschedulable), f"core placed {got} where exhaustive search found nothing"
        assert got.reason
    else:
        assert isinstance(got, Placement), f"core refused ({got.reason}) but exhaustive found {ref}"
        check_placement(got, cluster, topos, blocked, req)
        assert got.quality == ref[0], f"core {got.quality} vs exhaustive {ref[0]} ({ref[1]}, {ref[2]})"


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    rseed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4),
    pinned_max=st.sampled_from([0, None]),
)
def test_cluster_decision_is_best_over_nodes(seed: int, rseed: int, n: int, pinned_max: int | None) -> None:
    """Node selectors (pool, hostname, both) are decided on their few nodes directly by
    default, and through the grouped index with ``pinned_max=0``: both must be the best."""
    cluster, topos, blocked = random_cluster(seed, n, pinned_max=pinned_max)
    req = random_request(random.Random(rseed))
    spec = cluster.normalise(req)
    refs = {}
    for name, topo in topos.items():
        labels = cluster.labels(name)
        if all(labels.get(k) == v for k, v in req.node_selector.items()):
            ref = exhaustive.best(topo, exhaustive.effective_free(topo, blocked[name]), spec)
            if ref is not None:
                refs[name] = ref[0]
    got = cluster.decide(req)
    if not refs:
        assert isinstance(got, Unschedulable)
        assert sum(got.counts.values()) == n  # every node accounted for in the reason
        return
    assert isinstance(got, Placement), f"refused ({got.reason}) though nodes {sorted(refs)} fit"
    check_placement(got, cluster, topos, blocked, req)
    assert got.quality == refs[got.node]

    # Across nodes: (scope met, pairs within the asked scope and coarser, NVLink fit,
    # one-sided waste, fresh-node cost) is the best any node offers; with node order
    # used-first the fresh-node cost comes first.
    policy = cluster.node_policy
    used_first = spec.dc.node_order == "used-first"

    def node_key(name: str, cross: tuple[int, ...]) -> tuple[int, ...]:
        free = exhaustive.effective_free(topos[name], blocked[name])
        gpus = {g.id for g in topos[name].gpus()}
        pfs = {n.name for n in topos[name].nics()}
        fresh = len(gpus) if policy == "binpack" and not spec.required and (gpus | pfs) <= free else 0
        waste = len(pfs & free) if spec.rdma == 0 else len(gpus & free) if spec.gpus == 0 else 0
        return (fresh, *cross, waste) if used_first else (*cross, waste, fresh)

    def ref_key(name: str) -> tuple[int, ...]:
        return node_key(name, cross_key(refs[name], int(spec.scope)))

    got_key = node_key(got.node, cross_key(got.quality, int(spec.scope)))
    assert got_key == min(ref_key(name) for name in refs)
    # candidates: nodes with enough free devices of the class (some may miss the scope).
    assert len(refs) <= got.candidates <= n


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), pinned_max=st.sampled_from([0, None]))
def test_churn_keeps_invariants_and_matches_fresh_index(seed: int, pinned_max: int | None) -> None:
    rng = random.Random(seed)
    cluster, topos, blocked = random_cluster(seed, 4, pinned_max=pinned_max)
    base_blocked = {k: set(v) for k, v in blocked.items()}
    live: dict[str, tuple[str, list[str]]] = {}
    for step in range(30):
        if live and rng.random() < 0.35:
            rid = rng.choice(sorted(live))
            node, devs = live.pop(rid)
            cluster.release(node, rid)
            blocked[node] -= set(devs)
            blocked[node] |= base_blocked[node] & set(devs)
            continue
        if rng.random() < 0.1:
            # Health change on a random node: one more device becomes unavailable.
            node = rng.choice(sorted(topos))
            ids = all_device_ids(topos[node])
            if not ids:
                continue
            dev = rng.choice(ids)
            bad = cluster.unavailable_devices(node) | {dev}
            cluster.set_unavailable(node, bad)
            base_blocked[node].add(dev)
            blocked[node].add(dev)
            continue
        req = random_request(rng, f"c{step}")
        got = cluster.decide(req)
        # A cluster rebuilt from the same state must reach an equally good decision.
        fresh = Cluster(node_policy=cluster.node_policy, device_classes=CLASSES)
        for name, topo in topos.items():
            fresh.set_node(
                name, topo, labels=cluster.labels(name), unavailable=cluster.unavailable_devices(name)
            )
            for rid, devs in cluster.holds(name).items():
                fresh.hold(name, rid, devs)
        again = fresh.decide(req)
        assert type(got) is type(again)
        if isinstance(got, Placement):
            assert isinstance(again, Placement)
            assert got.quality == again.quality
            assert cluster.free_counts(got.node) == fresh.free_counts(again.node)
            check_placement(got, cluster, topos, blocked, req)
            cluster.hold(got.node, req.request_id, got.devices())
            live[req.request_id] = (got.node, got.devices())
            blocked[got.node] |= set(got.devices())
        else:
            assert isinstance(again, Unschedulable)
            assert got.counts == again.counts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    g=st.integers(1, 4),
    r=st.integers(0, 4),
    scope=st.sampled_from(["pcie-switch", "pcie-root", "numa", "socket"]),
    required=st.booleans(),
    device_class=st.sampled_from(sorted(CLASSES)),
)
def test_bigger_nodes_equal_exhaustive(
    seed: int, g: int, r: int, scope: str, required: bool, device_class: str
) -> None:
    """Up to 8 GPUs and 6 NICs (plus VFs) per node, 1-4 GPUs asked: still exact."""
    rng = random.Random(seed)
    topo = random_topology(rng, max_gpus=8, max_nics=6)
    blocked = {d for d in all_device_ids(topo) if rng.random() < 0.15}
    cluster = Cluster(device_classes=CLASSES)
    cluster.set_node("n", topo)
    cluster.hold("n", "other", blocked)
    req = AllocationRequest(
        request_id="big",
        pod=PodRef("ns", "big"),
        gpus=g,
        rdma=r,
        scope=scope,  # type: ignore[arg-type]
        policy="required" if required else "preferred",
        device_class=device_class,
    )
    spec = cluster.normalise(req)
    ref = exhaustive.best(topo, exhaustive.effective_free(topo, blocked), spec)
    got = cluster.decide(req)
    if ref is None:
        assert isinstance(got, Unschedulable)
    else:
        assert isinstance(got, Placement), got.reason
        assert got.quality == ref[0]
        assert set(got.devices()).isdisjoint(blocked)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    rseed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4),
    reserve=st.sampled_from([0.3, 0.5, 1.0]),
)
def test_reserve_pressure_orders_nodes_by_capacity_cost(
    seed: int, rseed: int, n: int, reserve: float
) -> None:
    """With a reserve small clusters can reach: in-node placement stays exact, and when fewer
    nodes than the reserve can take the largest aligned job, binpack orders nodes by capacity
    cost (the drop of the largest fully aligned job the node could take), then alignment, then
    fullness; otherwise by the ordinary key. Checked against the reference definitions in
    bench.exhaustive, with each node's own in-node choice (from a one-node cluster)."""
    cluster, topos, blocked = random_cluster(seed, n, reserve=reserve)
    req = random_request(random.Random(rseed))
    spec = cluster.normalise(req)
    free = {name: exhaustive.effective_free(topo, blocked[name]) for name, topo in topos.items()}
    pressure = cluster.node_policy == "binpack" and exhaustive.under_pressure(topos, free, reserve)
    refs = {}
    for name, topo in topos.items():
        labels = cluster.labels(name)
        if all(labels.get(k) == v for k, v in req.node_selector.items()):
            ref = exhaustive.best(topo, free[name], spec)
            if ref is not None:
                refs[name] = ref[0]
    got = cluster.decide(req)
    if not refs:
        assert isinstance(got, Unschedulable)
        return
    assert isinstance(got, Placement), f"refused ({got.reason}) though nodes {sorted(refs)} fit"
    check_placement(got, cluster, topos, blocked, req)
    assert got.quality == refs[got.node]  # the in-node optimum, pressure or not
    if not pressure:
        return
    s = int(spec.scope)

    def key(name: str, quality: tuple[int, ...], devices: set[str]) -> tuple[int, ...]:
        topo = topos[name]
        gpus = {g.id for g in topo.gpus()}
        pfs = {x.name for x in topo.nics()}
        waste = len(pfs & free[name]) if spec.rdma == 0 else len(gpus & free[name]) if spec.gpus == 0 else 0
        cost = exhaustive.capacity_cost(topo, free[name], devices)
        return (cost, *cross_key(quality, s), waste, len(gpus & free[name]), len(pfs & free[name]))

    keys = {}
    for name in refs:
        one = Cluster(node_policy="binpack", device_classes=CLASSES, reserve=0.0)
        one.set_node(
            name, topos[name], labels=cluster.labels(name), unavailable=cluster.unavailable_devices(name)
        )
        for rid, devs in cluster.holds(name).items():
            one.hold(name, rid, devs)
        mine = one.decide(req)
        assert isinstance(mine, Placement)
        keys[name] = key(name, mine.quality, set(mine.devices()))
    assert key(got.node, got.quality, set(got.devices())) == min(keys.values())
