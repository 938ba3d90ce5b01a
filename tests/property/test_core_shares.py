"""Property tests of fractional GPUs (shares) in the allocator core.

Random small fleets and random traces mixing whole-GPU and share requests, holds and
releases, health changes. Checked against an independent ledger of what was handed out:

* never more than 100 % of a GPU's memory or compute handed out, never more shares on a GPU
  than the class that placed the share allows;
* never a GPU both whole and shared (a whole request never gets a shared GPU, a share never
  lands on a GPU held whole), never an unavailable device, NICs stay exclusive;
* the core's own view (``gpu_shares``, ``free_devices``) agrees with the ledger, and a cluster
  rebuilt from the holds reaches an equally good decision (holds / releases consistent);
* whole-GPU decisions are exactly as good as on a cluster where each shared GPU is simply
  held whole (whole-GPU optimality unchanged: the existing exhaustive property tests in
  test_core_properties.py run the same search);
* binpack puts a one-GPU share on an already-shared GPU whenever one fits anywhere; spread
  opens a fresh GPU whenever one fits anywhere.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.randtopo import CLASSES, HOSTNAME, all_device_ids, random_request, random_topology
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import NodeTopology
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable

SHARE_CLASSES = {
    **CLASSES,
    "share": DeviceClass(sharing="hami", max_shares_per_gpu=3),
    "share-mps": DeviceClass(sharing="mps", max_shares_per_gpu=8, gpu_models=["h100", "a100"]),
}


def share_request(rng: random.Random, rid: str, *, one_gpu_only: bool = False) -> AllocationRequest:
    g = 1 if one_gpu_only or rng.random() < 0.7 else rng.randint(2, 3)
    r = 0 if one_gpu_only else rng.choice((0, 0, 1, g))
    mem = rng.choice((None, 4096, 10240, 20480, 40960))
    cores = rng.choice((None, 10, 25, 50, 100)) if mem is not None else rng.choice((10, 30, 50))
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=g,
        rdma=r,
        scope=rng.choice((None, "pcie-switch", "numa", "node")),
        policy=rng.choice((None, "required", "preferred")),
        device_class=rng.choice(("share", "share", "share-mps")),
        node_selector=rng.choice(({}, {}, {"pool": "a"}, {HOSTNAME: "n1"})),
        gpu_memory_mib=mem,
        gpu_cores_percent=cores,
    )


class Ledger:
    """What the test handed out, independent of the core."""

    def __init__(self, topos: dict[str, NodeTopology]) -> None:
        self.topos = topos
        self.memory = {n: {g.id: g.memory_mib for g in t.gpus()} for n, t in topos.items()}
        self.whole: dict[str, dict[str, str]] = {n: {} for n in topos}  # device -> request
        self.shares: dict[str, dict[str, dict[str, tuple[int, int]]]] = {n: {} for n in topos}
        self.live: dict[str, tuple[str, list[str], dict[str, tuple[int, int]]]] = {}
        self.mode: dict[str, str] = {}  # request -> the sharing mode of its shares
        self.unavailable: dict[str, set[str]] = {n: set() for n in topos}

    def share_use(self, node: str) -> dict[str, tuple[int, int, int]]:
        out: dict[str, list[int]] = {}
        for per in self.shares[node].values():
            for dev, (m, c) in per.items():
                u = out.setdefault(dev, [0, 0, 0])
                u[0] += m
                u[1] += c
                u[2] += 1
        return {d: (u[0], u[1], u[2]) for d, u in out.items()}

    def gpu_modes(self, node: str) -> dict[str, set[str]]:
        """Each shared GPU of ``node``: the sharing modes of its shares (one, if all is well)."""
        out: dict[str, set[str]] = {}
        for rid, per in self.shares[node].items():
            for dev in per:
                out.setdefault(dev, set()).add(self.mode[rid])
        return out

    def add(self, p: Placement, req: AllocationRequest, cluster: Cluster) -> None:
        node = p.node
        shares = p.shares()
        spec = cluster.normalise(req)
        use = self.share_use(node)
        modes = self.gpu_modes(node)
        for dev in p.devices():
            assert dev not in self.whole[node], f"{dev} on {node} already held whole"
            # One sharing mode per GPU: the node agent runs HAMi-core or MPS on it, not both.
            assert modes.get(dev, {p.sharing}) == {p.sharing}, f"{dev} on {node} shared in two modes"
            assert dev not in self.unavailable[node], f"{dev} on {node} is unavailable"
            if dev in shares:
                m, c = shares[dev]
                um, uc, n = use.get(dev, (0, 0, 0))
                assert um + m <= self.memory[node][dev], f"{dev} memory over 100 %"
                assert uc + c <= 100, f"{dev} compute over 100 %"
                assert n < spec.dc.max_shares_per_gpu, f"{dev} has too many shares"
            else:
                assert dev not in use, f"{dev} on {node} is shared, handed out whole"
        for dev in p.devices():
            if dev not in shares:
                self.whole[node][dev] = req.request_id
        if shares:
            self.shares[node][req.request_id] = shares
            self.mode[req.request_id] = p.sharing
        self.live[req.request_id] = (node, p.devices(), shares)

    def remove(self, rid: str) -> tuple[str, list[str]]:
        node, devs, _shares = self.live.pop(rid)
        for dev in devs:
            if self.whole[node].get(dev) == rid:
                del self.whole[node][dev]
        self.shares[node].pop(rid, None)
        self.mode.pop(rid, None)
        return node, devs

    def check_core(self, cluster: Cluster) -> None:
        for node in self.topos:
            use = self.share_use(node)
            for dev, (m, c, _n) in use.items():
                assert m <= self.memory[node][dev] and c <= 100
                assert dev not in self.whole[node], f"{dev} both whole and shared"
            bad = self.unavailable[node] | set(cluster.unavailable_devices(node))
            shareable = {d: u for d, u in use.items() if d not in bad}
            assert cluster.gpu_shares(node) == shareable
            free = set(cluster.free_devices(node))
            assert not free & set(use), "a shared GPU is in the whole-free set"
            assert not free & set(self.whole[node])


def _fleet(seed: int, n: int, policy: str) -> tuple[Cluster, dict[str, NodeTopology]]:
    rng = random.Random(seed)
    cluster = Cluster(node_policy=policy, device_classes=SHARE_CLASSES, pinned_max=rng.choice((0, 32)))
    topos: dict[str, NodeTopology] = {}
    same = random_topology(rng)
    for i in range(n):
        topo = same if rng.random() < 0.5 else random_topology(rng)
        name = f"n{i}"
        cluster.set_node(name, topo, labels={"pool": rng.choice("ab"), HOSTNAME: name})
        topos[name] = topo
    return cluster, topos


def _rebuilt(
    cluster: Cluster, topos: dict[str, NodeTopology], *, shares_whole: bool, modes: dict[str, str]
) -> Cluster:
    """The same state in a new cluster; ``shares_whole``: every shared GPU held whole instead;
    ``modes``: each share hold's sharing mode (the ledger's)."""
    fresh = Cluster(
        node_policy=cluster.node_policy, device_classes=SHARE_CLASSES, pinned_max=cluster.pinned_max
    )
    for name, topo in topos.items():
        fresh.set_node(name, topo, labels=cluster.labels(name), unavailable=cluster.unavailable_devices(name))
        shares = cluster.shares(name)
        for rid, devs in cluster.holds(name).items():
            fresh.hold(
                name,
                rid,
                devs,
                shares=None if shares_whole else shares.get(rid),
                sharing=modes.get(rid, "hami"),
            )
    return fresh


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["binpack", "spread"]))
def test_shares_never_overcommit_and_index_stays_consistent(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    cluster, topos = _fleet(seed, rng.randint(1, 4), policy)
    ledger = Ledger(topos)
    for step in range(40):
        roll = rng.random()
        if ledger.live and roll < 0.3:
            rid = rng.choice(sorted(ledger.live))
            node, _devs = ledger.remove(rid)
            cluster.release(node, rid)
            ledger.check_core(cluster)
            continue
        if roll < 0.35:
            node = rng.choice(sorted(topos))
            ids = all_device_ids(topos[node])
            if not ids:
                continue
            bad = cluster.unavailable_devices(node) | {rng.choice(ids)}
            cluster.set_unavailable(node, bad)
            ledger.unavailable[node] |= bad
            ledger.check_core(cluster)
            continue
        rid = f"r{step}"
        req = share_request(rng, rid) if rng.random() < 0.6 else random_request(rng, rid)
        try:
            got = cluster.decide(req)
        except InvalidRequest:
            continue
        again = _rebuilt(cluster, topos, shares_whole=False, modes=ledger.mode).decide(req)
        assert type(got) is type(again)
        if isinstance(got, Placement):
            assert isinstance(again, Placement)
            assert got.quality == again.quality
            if not req.shared:
                # Whole-GPU decisions: as good as if every shared GPU were held whole.
                ref = _rebuilt(cluster, topos, shares_whole=True, modes=ledger.mode).decide(req)
                assert isinstance(ref, Placement)
                assert ref.quality == got.quality
                assert not got.shares()
            else:
                assert len(got.shares()) == req.gpus
                assert all(g.memory_mib == req.gpu_memory_mib for g in got.gpus)
                assert all(g.cores_percent == req.gpu_cores_percent for g in got.gpus)
            ledger.add(got, req, cluster)
            cluster.hold(got.node, rid, got.devices(), shares=got.shares(), sharing=got.sharing)
            ledger.check_core(cluster)
        else:
            assert isinstance(again, Unschedulable)
            assert got.counts == again.counts


def _fits(ledger: Ledger, cluster: Cluster, req: AllocationRequest) -> tuple[bool, bool]:
    """(a shared GPU anywhere fits the share, a fresh GPU anywhere fits it) for a 1-GPU,
    no-NIC share request without a selector."""
    spec = cluster.normalise(req)
    models = [m.lower() for m in spec.dc.gpu_models]
    shared_fits = fresh_fits = False
    for node, topo in ledger.topos.items():
        use = cluster.gpu_shares(node)
        modes = ledger.gpu_modes(node)
        free = set(cluster.free_devices(node))
        for g in topo.gpus():
            if models and not any(m in g.model.lower() for m in models):
                continue
            if g.id in use and modes.get(g.id) != {spec.dc.sharing}:
                continue  # shared in the other mode: no share of this class goes there
            if g.id in use:
                m, c, n = use[g.id]
                if (
                    n < spec.dc.max_shares_per_gpu
                    and g.memory_mib - m >= spec.memory_mib
                    and 100 - c >= spec.cores_percent
                ):
                    shared_fits = True
            elif g.id in free and g.memory_mib >= spec.memory_mib:
                fresh_fits = True
    return shared_fits, fresh_fits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["binpack", "spread"]))
def test_binpack_fills_shared_gpus_and_spread_opens_fresh_ones(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    cluster, topos = _fleet(seed, rng.randint(1, 4), policy)
    ledger = Ledger(topos)
    for step in range(30):
        if ledger.live and rng.random() < 0.25:
            rid = rng.choice(sorted(ledger.live))
            node, _devs = ledger.remove(rid)
            cluster.release(node, rid)
            continue
        rid = f"r{step}"
        req = share_request(rng, rid, one_gpu_only=True)
        req = AllocationRequest(
            request_id=rid,
            pod=req.pod,
            gpus=1,
            device_class=req.device_class,
            gpu_memory_mib=req.gpu_memory_mib,
            gpu_cores_percent=req.gpu_cores_percent,
        )
        shared_fits, fresh_fits = _fits(ledger, cluster, req)
        got = cluster.decide(req)
        if not isinstance(got, Placement):
            assert not shared_fits and not fresh_fits
            continue
        gpu = got.devices()[0]
        was_shared = gpu in cluster.gpu_shares(got.node)
        if policy == "binpack" and shared_fits:
            assert was_shared, "binpack opened a fresh GPU while a shared one could take the share"
        if policy == "spread" and fresh_fits:
            assert not was_shared, "spread stacked a share while a fresh GPU could take it"
        ledger.add(got, req, cluster)
        cluster.hold(got.node, rid, got.devices(), shares=got.shares(), sharing=got.sharing)
        ledger.check_core(cluster)


def test_a_class_without_sharing_refuses_shares_with_a_clear_message() -> None:
    cluster = Cluster(device_classes=SHARE_CLASSES)
    req = AllocationRequest(request_id="r", pod=PodRef("ns", "p"), gpus=1, gpu_memory_mib=1024)
    try:
        cluster.decide(req)
    except InvalidRequest as exc:
        assert "'default' does not allow GPU shares" in str(exc)
    else:
        raise AssertionError("a share request against a class without sharing was accepted")


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("nics", [0, 1])
def test_a_gpu_takes_shares_of_one_mode_only(pinned: bool, nics: int) -> None:
    """A HAMi share on a GPU; a binpack decision for an MPS share would stack on it (best
    fit), but the node agent runs HAMi-core or an MPS daemon per GPU, not both: the MPS share
    opens another GPU, and later shares of each mode go only where their mode is. Through
    every path a share is decided by: the class's fit index (one GPU, no NIC, no selector),
    the stacking index (one GPU with a NIC), and the share index (pinned to the node)."""
    from services.topology import load_topology

    classes = {
        "default": DeviceClass(),
        "hami": DeviceClass(sharing="hami", max_shares_per_gpu=8),
        "mps": DeviceClass(sharing="mps", max_shares_per_gpu=8),
    }
    cluster = Cluster(device_classes=classes)
    cluster.set_node("n0", load_topology("dgx-h100"), labels={HOSTNAME: "n0"})
    selector = {HOSTNAME: "n0"} if pinned else {}

    def ask(rid: str, device_class: str) -> AllocationRequest:
        return AllocationRequest(
            request_id=rid,
            pod=PodRef("ns", rid),
            gpus=1,
            rdma=nics,
            device_class=device_class,
            gpu_memory_mib=1024,
            node_selector=selector,
        )

    first = cluster.decide(ask("h1", "hami"))
    assert isinstance(first, Placement) and first.sharing == "hami"
    cluster.hold("n0", "h1", first.devices(), shares=first.shares(), sharing=first.sharing)
    (hami_gpu,) = first.shares()
    mps = cluster.decide(ask("m1", "mps"))
    assert isinstance(mps, Placement) and mps.sharing == "mps"
    assert hami_gpu not in mps.shares(), "an MPS share stacked on a GPU with a HAMi share"
    cluster.hold("n0", "m1", mps.devices(), shares=mps.shares(), sharing=mps.sharing)
    (mps_gpu,) = mps.shares()
    again = cluster.decide(ask("h2", "hami"))
    more = cluster.decide(ask("m2", "mps"))
    assert isinstance(again, Placement) and isinstance(more, Placement)
    assert mps_gpu not in again.shares() and hami_gpu not in more.shares()
    if not nics:
        # Binpack stacks on a GPU of the share's own mode (with a NIC, the NIC the first share
        # took may make a fresh GPU the better-aligned choice).
        assert list(again.shares()) == [hami_gpu] and list(more.shares()) == [mps_gpu]
