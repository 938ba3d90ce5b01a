"""Property tests of priority preemption (services/allocator/core/preempt.py).

Random small clusters (one or two random nodes) whose devices are mostly held by allocations of
random priorities, some of them protected (claims), and the GPUs left held in part as shares
(one to three share holds per GPU); a random request for whole GPUs of priority ``P`` that may
preempt. The reference is an exhaustive search written from the order's definition, not from
the code: every set of eligible holds over the whole cluster, by increasing size, each tried by
the plain exhaustive in-node search (``bench.exhaustive``) on every node with those holds'
devices given back. What must hold:

* no plan exactly when no set of eligible holds makes room;
* never a victim of priority >= ``P``, never a protected one, all on the plan's node;
* the fewest victims, then the lowest priorities (highest first), then the best in-node
  quality any such minimal set offers on any node;
* the placement is valid once the victims are gone (free devices only, the required scope
  met) and the cluster, with the victims released, agrees that the request now fits.
"""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench import exhaustive
from bench.randtopo import CLASSES, HOSTNAME, all_device_ids, random_request, random_topology
from schemas.messages import AllocationRequest
from schemas.topology import NodeTopology
from services.allocator.core import Cluster, Placement, preempt

Hold = tuple[str, str, int, bool, frozenset[str]]  # node, request id, priority, preemptible, devices


def _cluster(
    seed: int, n_nodes: int
) -> tuple[Cluster, dict[str, NodeTopology], dict[str, set[str]], list[Hold]]:
    rng = random.Random(seed)
    cluster = Cluster(node_policy=rng.choice(("binpack", "spread")), device_classes=CLASSES)
    topos: dict[str, NodeTopology] = {}
    bad: dict[str, set[str]] = {}
    holds: list[Hold] = []
    for i in range(n_nodes):
        name = f"n{i}"
        topo = random_topology(rng, max_gpus=4, max_nics=3)
        ids = all_device_ids(topo)
        bad[name] = {d for d in ids if rng.random() < 0.05}
        cluster.set_node(name, topo, labels={"pool": rng.choice("ab"), HOSTNAME: name}, unavailable=bad[name])
        topos[name] = topo
        owners: dict[int, set[str]] = {}
        n_holds = rng.randint(1, 4)
        for d in ids:
            if rng.random() < 0.8:
                owners.setdefault(rng.randrange(n_holds), set()).add(d)
        for h, devs in sorted(owners.items()):
            prio = rng.randint(0, 3)
            protected = rng.random() < 0.2
            cluster.hold(name, f"{name}h{h}", devs, priority=prio, preemptible=not protected)
            holds.append((name, f"{name}h{h}", prio, not protected, frozenset(devs)))
        # GPU shares on some of the GPUs left: one to three holds per GPU, the odd one with a
        # NIC of its own; to a whole-GPU preemptor the GPU is free only with all of them gone.
        taken = set().union(*owners.values()) if owners else set()
        nics = [n.name for n in topo.nics() if n.name not in taken]
        for gpu in [g.id for g in topo.gpus() if g.id not in taken]:
            if rng.random() < 0.5:
                continue
            for k in range(rng.randint(1, 3)):
                devs = {gpu}
                if nics and rng.random() < 0.2:
                    devs.add(nics.pop())
                prio = rng.randint(0, 3)
                protected = rng.random() < 0.2
                rid = f"{name}{gpu}s{k}"
                cluster.hold(
                    name, rid, devs, priority=prio, preemptible=not protected, shares={gpu: (1024, 10)}
                )
                holds.append((name, rid, prio, not protected, frozenset(devs)))
    return cluster, topos, bad, holds


def _blocked(name: str, bad: dict[str, set[str]], holds: list[Hold], gone: set[str]) -> set[str]:
    out = set(bad[name])
    for node, rid, _, _, devs in holds:
        if node == name and rid not in gone:
            out |= devs
    return out


def _preemptor(rng: random.Random, rid: str, topos: dict[str, NodeTopology]) -> AllocationRequest:
    base = random_request(rng)
    return AllocationRequest(
        request_id=rid,
        pod=base.pod,
        gpus=base.gpus,
        rdma=base.rdma,
        scope=base.scope,
        policy=base.policy,
        pairing=base.pairing,
        device_class=base.device_class,
        node_selector={k: v for k, v in base.node_selector.items() if k != HOSTNAME or v in topos},
        priority=rng.randint(1, 5),
        preemption="lower-priority",
    )


def _check(
    cluster: Cluster,
    topos: dict[str, NodeTopology],
    bad: dict[str, set[str]],
    holds: list[Hold],
    req: AllocationRequest,
) -> preempt.Preemption | None:
    """Plan for ``req`` and check the plan against the exhaustive reference (module docstring);
    the plan, or None when none is needed or possible."""
    prio = req.priority
    decided = cluster.decide(req)
    if isinstance(decided, Placement):
        event("fits without preemption")
        return None  # fits without evicting anyone: preemption is not asked
    # The step after the failed decision works on the request as that decision resolved it.
    spec = decided.spec
    assert spec.preempt_below == prio
    assert spec == cluster.normalise(req)
    matching = [
        name for name in topos if all(cluster.labels(name).get(k) == v for k, v in req.node_selector.items())
    ]
    eligible = [h for h in holds if h[2] < prio and h[3]]

    # The reference: every set of eligible holds (whole cluster) by increasing size.
    best: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    for size in range(1, len(eligible) + 1):
        for victims in combinations(eligible, size):
            gone = {v[1] for v in victims}
            prios = tuple(sorted((v[2] for v in victims), reverse=True))
            for name in matching:
                free = exhaustive.effective_free(topos[name], _blocked(name, bad, holds, gone))
                ref = exhaustive.best(topos[name], free, spec)
                if ref is not None:
                    key = (size, prios, ref[0])
                    if best is None or key < best:
                        best = key
        if best is not None:
            break

    got = preempt.plan(cluster, spec)
    event("no plan" if best is None else f"plan evicting {best[0]}")
    if best is None:
        assert got is None, f"planned {got} where no set of eligible holds makes room"
        return None
    assert got is not None, f"no plan, but evicting a set of {best[0]} makes room ({best})"
    by_id = {h[1]: h for h in holds}
    for v in got.victims:
        node, _, p, preemptible, devs = by_id[v.request_id]
        assert p < prio, f"evicted {v.request_id} of priority {p} for a request of priority {prio}"
        assert preemptible, f"evicted protected {v.request_id}"
        assert node == got.node
        assert v.priority == p and set(v.devices) == devs
    prios = tuple(sorted((v.priority for v in got.victims), reverse=True))
    assert (len(got.victims), prios, got.placement.quality) == best
    if any("s" in v.request_id.removeprefix(got.node) for v in got.victims):
        event("a share evicted")

    # The placement is valid once the victims are gone.
    gone = {v.request_id for v in got.victims}
    free = exhaustive.effective_free(topos[got.node], _blocked(got.node, bad, holds, gone))
    devs = got.placement.devices()
    assert set(devs) <= free and len(devs) == len(set(devs)) == spec.gpus + spec.rdma
    return got


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rseed=st.integers(0, 2**32 - 1), n=st.integers(1, 2))
def test_preemption_is_minimal_and_valid(seed: int, rseed: int, n: int) -> None:
    cluster, topos, bad, holds = _cluster(seed, n)
    req = _preemptor(random.Random(rseed), "hi", topos)
    got = _check(cluster, topos, bad, holds, req)
    if got is not None:
        # The cluster, with the victims released, agrees that the request now fits.
        for v in got.victims:
            cluster.release(got.node, v.request_id)
        assert isinstance(cluster.decide(req), Placement)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rseed=st.integers(0, 2**32 - 1), n=st.integers(1, 2))
def test_plans_in_a_row_stay_exact(seed: int, rseed: int, n: int) -> None:
    """Several plans on one cluster, each applied (victims released, the preemptor held
    preemptible at its priority) and the odd allocation freed in between: the cluster's
    lazily kept groups and the per-view cache must never serve a stale answer."""
    cluster, topos, bad, holds = _cluster(seed, n)
    rng = random.Random(rseed)
    for i in range(4):
        req = _preemptor(rng, f"hi{i}", topos)
        got = _check(cluster, topos, bad, holds, req)
        if got is not None:
            gone = {v.request_id for v in got.victims}
            for rid in gone:
                cluster.release(got.node, rid)
            holds[:] = [h for h in holds if h[1] not in gone]
            devs = frozenset(got.placement.devices())
            cluster.hold(got.node, req.request_id, devs, priority=req.priority, preemptible=True)
            holds.append((got.node, req.request_id, req.priority, True, devs))
        if holds and rng.random() < 0.3:
            node, rid, *_ = holds.pop(rng.randrange(len(holds)))
            cluster.release(node, rid)
