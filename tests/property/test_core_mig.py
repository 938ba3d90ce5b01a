"""Property tests of MIG instances in the allocator core.

Random small fleets where some GPUs are in MIG mode with random instances of mixed profiles,
and random traces mixing MIG, whole-GPU and share requests, holds, releases and health
changes. Checked against a ledger kept by the test and an exhaustive reference:

* an instance is never held by two requests, never handed out while its GPU or itself is
  unavailable, and is of the requested profile on a GPU in MIG mode of the request's class;
* a GPU in MIG mode is never given whole nor shared; NICs stay exclusive;
* alignment is exact: the chosen node's in-node quality equals the exhaustive optimum over
  every set of its free instances of the profile and every NIC set and pairing
  (``bench.exhaustive.best`` on a topology the test builds, each free instance a GPU at its
  parent's place), and no other node's optimum is better on the cross-node key; a refusal
  only when no node has any placement;
* binpack puts a one-instance request on a GPU that already has an instance in use whenever
  one has a free instance of the profile anywhere; spread opens a fresh GPU whenever it can.
"""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.exhaustive import best, effective_free
from bench.randtopo import CLASSES, HOSTNAME, random_request, random_topology
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import Gpu, MigInstance, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable
from services.allocator.core.search import cross_key

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")
MIG_CLASSES = {**CLASSES, "share": DeviceClass(sharing="hami", max_shares_per_gpu=3)}


def mig_topology(rng: random.Random, name: str) -> NodeTopology:
    """A random small node with some GPUs in MIG mode (0-4 instances each, mixed profiles)."""
    topo = random_topology(rng, max_gpus=4, max_nics=4)
    topo.name = name
    for g in topo.gpus():
        if rng.random() < 0.6:
            g.mig_mode = True
            g.mig_instances = [
                MigInstance(
                    profile=rng.choice(PROFILES),
                    uuid=f"MIG-{name}-{g.index}-{k}",
                    gpu_instance_id=k + 1,
                )
                for k in range(rng.randint(0, 4))
            ]
    return topo.validate()


def mig_request(rng: random.Random, rid: str, *, simple: bool = False) -> AllocationRequest:
    g = 1 if simple else rng.choice((1, 1, 2, 3))
    r = 0 if simple else rng.choice((0, 0, 1, g))
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=g,
        rdma=r,
        scope=None if simple else rng.choice((None, "pcie-switch", "pcie-root", "numa", "node")),
        policy=None if simple else rng.choice((None, "required", "preferred")),
        device_class="default" if simple else rng.choice(("default", "default", "ib", "big")),
        node_selector={} if simple else rng.choice(({}, {}, {"pool": "a"}, {HOSTNAME: "n1"})),
        mig_profile=rng.choice(PROFILES),
    )


class Ledger:
    """What the test handed out, independent of the core."""

    def __init__(self, topos: dict[str, NodeTopology]) -> None:
        self.topos = topos
        self.held: dict[str, dict[str, str]] = {n: {} for n in topos}  # device id -> request
        self.live: dict[str, tuple[str, list[str]]] = {}
        self.unavailable: dict[str, set[str]] = {n: set() for n in topos}
        self.instances = {
            n: {dev: (g, m) for g in t.gpus() for dev, m in g.mig_ids()} for n, t in topos.items()
        }
        self.mig_gpus = {n: {g.id for g in t.gpus() if g.mig_mode} for n, t in topos.items()}

    def free_instances(self, node: str, profile: str, dc: DeviceClass) -> list[tuple[str, Gpu]]:
        models = [m.lower() for m in dc.gpu_models]
        out = []
        for dev, (g, m) in self.instances[node].items():
            if m.profile != profile or dev in self.held[node]:
                continue
            if g.id in self.unavailable[node] or dev in self.unavailable[node]:
                continue
            if models and not any(x in g.model.lower() for x in models):
                continue
            if g.memory_mib < dc.gpu_min_memory_mib:
                continue
            out.append((dev, g))
        return out

    def add(self, p: Placement, req: AllocationRequest) -> None:
        """Record a placement, checking it. Shares may stack on a GPU (tests/property/
        test_core_shares.py checks how far); they are kept out of ``held``."""
        node = p.node
        shared = set(p.shares())
        for dev in p.devices():
            assert dev not in self.held[node], f"{dev} on {node} held twice"
            assert dev not in self.unavailable[node], f"{dev} on {node} is unavailable"
        if req.mig_profile is not None:
            assert len(p.gpus) == req.gpus
            for g in p.gpus:
                assert g.mig is not None and g.mig.profile == req.mig_profile
                parent, inst = self.instances[node][g.mig.device]
                assert parent.index == g.index and inst.uuid == g.mig.uuid
                assert parent.id not in self.unavailable[node]
        else:
            for g in p.gpus:
                assert g.mig is None
                assert g.device_id not in self.mig_gpus[node], f"MIG-mode {g.device_id} given whole or shared"
        devs = [d for d in p.devices() if d not in shared]
        for dev in devs:
            self.held[node][dev] = req.request_id
        self.live[req.request_id] = (node, devs)

    def remove(self, rid: str) -> str:
        node, devs = self.live.pop(rid)
        for dev in devs:
            del self.held[node][dev]
        return node


def instance_topology(topo: NodeTopology, free: list[tuple[str, Gpu]]) -> tuple[NodeTopology, dict[str, str]]:
    """The reference's view: each free instance a GPU at its parent's place (no NVLink)."""
    by_parent: dict[int, list[str]] = {}
    for dev, g in free:
        by_parent.setdefault(g.index, []).append(dev)
    names: dict[str, str] = {}

    def swap(gpus: list[Gpu]) -> list[Gpu]:
        out = []
        for g in gpus:
            for dev in by_parent.get(g.index, []):
                v = Gpu(index=len(names), uuid=dev, model=g.model, memory_mib=g.memory_mib)
                names[v.id] = dev
                out.append(v)
        return out

    sockets = [
        Socket(
            id=s.id,
            numa_nodes=[
                NumaNode(
                    id=n.id,
                    roots=[
                        PcieRoot(
                            id=r.id,
                            gpus=swap(r.gpus),
                            nics=r.nics,
                            switches=[
                                PcieSwitch(id=w.id, gpus=swap(w.gpus), nics=w.nics) for w in r.switches
                            ],
                        )
                        for r in n.roots
                    ],
                )
                for n in s.numa_nodes
            ],
        )
        for s in topo.sockets
    ]
    return NodeTopology(name=topo.name, sockets=sockets), names


def reference(cluster: Cluster, ledger: Ledger, node: str, req: AllocationRequest) -> tuple[int, ...] | None:
    """The exhaustive optimum's alignment key (quality without fragmentation) on ``node``."""
    spec = cluster.normalise(req)
    assert req.mig_profile is not None
    if not all(cluster.labels(node).get(k) == v for k, v in spec.selector):
        return None
    free = ledger.free_instances(node, req.mig_profile, spec.dc)
    vt, _names = instance_topology(ledger.topos[node], free)
    blocked = set(ledger.held[node]) | ledger.unavailable[node]
    nics = {d for d in effective_free(ledger.topos[node], blocked) if not d.startswith("gpu")}
    free_ids = {g.id for g in vt.gpus()} | nics
    got = best(vt, free_ids, spec)
    return None if got is None else got[0][:10]


def _fleet(seed: int, n: int, policy: str) -> tuple[Cluster, dict[str, NodeTopology]]:
    rng = random.Random(seed)
    cluster = Cluster(node_policy=policy, device_classes=MIG_CLASSES, pinned_max=rng.choice((0, 32)))
    topos: dict[str, NodeTopology] = {}
    shared_layout = rng.getrandbits(32)
    for i in range(n):
        name = f"n{i}"
        # Half the nodes share one layout (hardware and instances; their UUIDs differ by node),
        # so that the index's groups of alike nodes are exercised too.
        layout = shared_layout if rng.random() < 0.5 else rng.getrandbits(32)
        topo = mig_topology(random.Random(layout), name)
        cluster.set_node(name, topo, labels={"pool": rng.choice("ab"), HOSTNAME: name})
        topos[name] = topo
    return cluster, topos


def _share(rng: random.Random, rid: str) -> AllocationRequest:
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=1,
        device_class="share",
        gpu_memory_mib=rng.choice((1024, 20480)),
        gpu_cores_percent=rng.choice((None, 30)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["binpack", "spread"]))
def test_mig_instances_exclusive_mig_gpus_never_whole_and_alignment_exact(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    cluster, topos = _fleet(seed, rng.randint(1, 4), policy)
    ledger = Ledger(topos)
    for step in range(40):
        roll = rng.random()
        if ledger.live and roll < 0.25:
            rid = rng.choice(sorted(ledger.live))
            node = ledger.remove(rid)
            cluster.release(node, rid)
            continue
        if roll < 0.32:
            # Health: a GPU (and with it its instances) or one instance out of service.
            node = rng.choice(sorted(topos))
            ids = [g.id for g in topos[node].gpus()] + list(ledger.instances[node])
            if ids:
                bad = cluster.unavailable_devices(node) | {rng.choice(ids)}
                cluster.set_unavailable(node, bad)
                ledger.unavailable[node] |= bad
            continue
        rid = f"r{step}"
        kind = rng.random()
        req = (
            mig_request(rng, rid)
            if kind < 0.6
            else _share(rng, rid)
            if kind < 0.7
            else random_request(rng, rid)
        )
        try:
            got = cluster.decide(req)
        except InvalidRequest:
            assert req.mig_profile is None
            continue
        if req.mig_profile is not None:
            refs = {n: reference(cluster, ledger, n, req) for n in topos}
            S = int(cluster.normalise(req).scope)
            if isinstance(got, Unschedulable):
                assert all(r is None for r in refs.values()), f"refused, but the reference places it: {refs}"
                continue
            ref = refs[got.node]
            assert ref is not None
            assert got.quality[:10] == ref, (got.quality, ref)
            best_cross = min(cross_key(r, S) for r in refs.values() if r is not None)
            assert cross_key(got.quality[:10], S) == best_cross
        if isinstance(got, Placement):
            ledger.add(got, req)
            cluster.hold(
                got.node,
                rid,
                got.devices(),
                shares=got.shares(),
                sharing=got.sharing,
                preemptible=True,
            )
        # The core's view agrees with the ledger: no MIG-mode GPU is ever free whole, and the
        # free instances are exactly those the ledger says.
        for node in topos:
            free = set(cluster.free_devices(node))
            assert not free & ledger.mig_gpus[node]
            assert not cluster.gpu_shares(node).keys() & ledger.mig_gpus[node]
            want: dict[str, list[str]] = {}
            for dev, (g, m) in ledger.instances[node].items():
                if dev not in ledger.held[node] and not {g.id, dev} & ledger.unavailable[node]:
                    want.setdefault(m.profile, []).append(dev)
            assert {p: sorted(d) for p, d in cluster.mig_instances(node).items()} == {
                p: sorted(d) for p, d in want.items()
            }
            # A MIG hold is never a preemption victim (evicting one frees no whole GPU).
            for rid_v, (devs, _prio) in cluster.preemptible().get(node, {}).items():
                assert not any("-mig" in d for d in devs), rid_v


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["binpack", "spread"]))
def test_binpack_fills_used_mig_gpus_and_spread_opens_fresh_ones(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    cluster, topos = _fleet(seed, rng.randint(1, 4), policy)
    ledger = Ledger(topos)
    for step in range(30):
        if ledger.live and rng.random() < 0.25:
            rid = rng.choice(sorted(ledger.live))
            cluster.release(ledger.remove(rid), rid)
            continue
        rid = f"r{step}"
        req = mig_request(rng, rid, simple=True)
        assert req.mig_profile is not None
        used_fits = fresh_fits = False
        for node in topos:
            used = {g.index for dev, (g, _m) in ledger.instances[node].items() if dev in ledger.held[node]}
            for _dev, g in ledger.free_instances(node, req.mig_profile, DeviceClass()):
                if g.index in used:
                    used_fits = True
                else:
                    fresh_fits = True
        got = cluster.decide(req)
        if not isinstance(got, Placement):
            assert not used_fits and not fresh_fits
            continue
        gpu = got.gpus[0].index
        was_used = any(
            g.index == gpu and dev in ledger.held[got.node]
            for dev, (g, _m) in ledger.instances[got.node].items()
        )
        if policy == "binpack" and used_fits:
            assert was_used, "binpack opened a fresh GPU while a used one had a free instance"
        if policy == "spread" and fresh_fits:
            assert not was_used, "spread stacked an instance while a fresh GPU had one"
        ledger.add(got, req)
        cluster.hold(got.node, rid, got.devices())


def test_mig_request_errors_name_the_field() -> None:
    cluster = Cluster(device_classes=MIG_CLASSES)
    both = AllocationRequest(
        request_id="r", pod=PodRef("ns", "p"), gpus=1, mig_profile="1g.10gb", gpu_memory_mib=1024
    )
    try:
        cluster.decide(both)
    except InvalidRequest as exc:
        assert "mig_profile and gpu_memory_mib: a MIG instance is not shared" in str(exc)
    else:
        raise AssertionError("a MIG request with a share was accepted")
    none = AllocationRequest(request_id="r", pod=PodRef("ns", "p"), gpus=0, rdma=1, mig_profile="1g.10gb")
    try:
        cluster.decide(none)
    except InvalidRequest as exc:
        assert "mig_profile '1g.10gb' needs at least one instance: ask it in gpus" in str(exc)
    else:
        raise AssertionError("a MIG request without GPUs was accepted")


def test_fit_count_and_preemption_for_mig_requests() -> None:
    from services.topology import load_topology

    topo = load_topology(str(Path(__file__).resolve().parents[2] / "docs/examples/mig/dgx-h100-mig.yaml"))
    cluster = Cluster()
    for i in range(3):
        cluster.set_node(f"m{i}", topo, labels={HOSTNAME: f"m{i}"})
    three = AllocationRequest(request_id="r", pod=PodRef("ns", "p"), gpus=2, mig_profile="3g.40gb")
    assert cluster.fit_count(three) == 3
    pinned = AllocationRequest(
        request_id="r", pod=PodRef("ns", "p"), gpus=2, mig_profile="3g.40gb", node_selector={HOSTNAME: "m1"}
    )
    assert cluster.fit_count(pinned) == 1
    cluster.hold("m0", "x", ["gpu3-mig1-0"])  # m0 keeps GPU 1's 3g.40gb and GPU 3's other one
    cluster.hold("m2", "y", ["gpu3-mig1-0", "gpu3-mig2-0"])  # m2 keeps only GPU 1's
    assert cluster.fit_count(three) == 2
    # A MIG request never preempts: no preemptible hold holds an instance.
    urgent = AllocationRequest(
        request_id="u", pod=PodRef("ns", "u"), gpus=1, mig_profile="1g.10gb", preemption="lower-priority"
    )
    assert cluster.normalise(urgent).preempt_below is None
