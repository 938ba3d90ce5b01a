"""Property tests of the in-node search on 16-GPU servers (HGX-2 / DGX-2 class, 16-GPU PCIe boxes).

Random 16-GPU topologies with 16 or 8 NICs (``bench.randtopo.big_topology``): switches with
1-4 GPUs and 0-4 NICs, devices on roots, SR-IOV VFs, NVLink as one NVSwitch domain, bridge
pairs that may cross switches, a 2/4/8/16 partition table, or none. Two references:

* the plain exhaustive search (``bench.exhaustive``), when few devices are free (it tries
  every GPU subset x NIC subset x pairing);
* the subset enumeration the core used before (``bench.enumeration``), with more devices
  free and larger requests: it is exact but exponential in the free GPUs, so here about a
  third of the devices are held. It must return the very same choice, devices included.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench import enumeration, exhaustive
from bench.randtopo import CLASSES, all_device_ids, big_topology
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement, Unschedulable
from services.allocator.core.model import compile_shape, shape_signature
from services.allocator.core.search import Choice, Refusal, evaluate

SCOPES = ["pcie-switch", "pcie-root", "numa", "socket", "node"]
# The other classes filter devices out; the default class is what most requests use.
DEVICE_CLASSES = ["default", "default", "default", *sorted(CLASSES)]


def _request(g: int, r: int, scope: str, required: bool, cls: str, shared: bool) -> AllocationRequest:
    return AllocationRequest(
        request_id="big",
        pod=PodRef("ns", "big"),
        gpus=g,
        rdma=r,
        scope=scope,  # type: ignore[arg-type]
        policy="required" if required else "preferred",
        pairing="shared" if shared or g != r else None,
        device_class=cls,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    g=st.integers(0, 4),
    r=st.integers(0, 4),
    scope=st.sampled_from(SCOPES),
    required=st.booleans(),
    shared=st.booleans(),
    device_class=st.sampled_from(DEVICE_CLASSES),
    free_gpus=st.integers(1, 8),
    free_nics=st.integers(1, 7),
)
def test_16_gpu_node_equals_exhaustive(
    seed: int,
    g: int,
    r: int,
    scope: str,
    required: bool,
    shared: bool,
    device_class: str,
    free_gpus: int,
    free_nics: int,
) -> None:
    """Few devices free on a 16-GPU server: the core's quality tuple is the exhaustive optimum."""
    if g == 0 and r == 0:
        r = 1
    rng = random.Random(seed)
    topo = big_topology(rng, nics=rng.choice((8, 16)))
    gpus = [x.id for x in topo.gpus()]
    pfs = [x.name for x in topo.nics()]
    nics = pfs if rng.random() < 0.7 else [x for x in all_device_ids(topo) if x not in gpus]
    keep = set(rng.sample(gpus, free_gpus)) | set(rng.sample(nics, min(free_nics, len(nics))))
    blocked = {d for d in all_device_ids(topo) if d not in keep}
    cluster = Cluster(device_classes=CLASSES)
    cluster.set_node("n", topo)
    cluster.hold("n", "other", blocked)
    req = _request(g, r, scope, required, device_class, shared)
    spec = cluster.normalise(req)
    ref = exhaustive.best(topo, exhaustive.effective_free(topo, blocked), spec)
    got = cluster.decide(req)
    if ref is None:
        assert isinstance(got, Unschedulable), f"placed {got} where the exhaustive search found nothing"
        event(f"refused: {got.reasons[0].code}")
        return
    event("placed")
    assert isinstance(got, Placement), got.reason
    assert got.quality == ref[0], f"core {got.quality} vs exhaustive {ref[0]} ({ref[1]}, {ref[2]})"
    assert set(got.devices()).isdisjoint(blocked)
    assert len(got.gpus) == g and len(got.nics) == r


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    g=st.integers(0, 8),
    r=st.integers(0, 8),
    scope=st.sampled_from(SCOPES),
    required=st.booleans(),
    shared=st.booleans(),
    device_class=st.sampled_from(DEVICE_CLASSES),
    held=st.floats(0.3, 0.6),
)
def test_16_gpu_node_equals_previous_search(
    seed: int,
    g: int,
    r: int,
    scope: str,
    required: bool,
    shared: bool,
    device_class: str,
    held: float,
) -> None:
    """More devices free and requests up to 8 + 8: the same choice as the subset enumeration
    (quality, devices, pairs), or the same refusal."""
    if g == 0 and r == 0:
        g = 1
    rng = random.Random(seed)
    topo = big_topology(rng, nics=rng.choice((8, 16)))
    shape = compile_shape(topo, shape_id=0, signature=shape_signature(topo))
    blocked = 0
    for s in range(shape.n_slots):
        if rng.random() < held:
            blocked |= 1 << s
    free = shape.effective_free(blocked)
    cluster = Cluster(device_classes=CLASSES)
    spec = cluster.normalise(_request(g, r, scope, required, device_class, shared))
    got = evaluate(shape, free, spec)
    ref = enumeration.evaluate(shape, free, spec)
    if isinstance(ref, Refusal):
        assert isinstance(got, Refusal)
        assert (got.code, got.text) == (ref.code, ref.text)
        event(f"refused: {got.code}")
        return
    event("placed")
    assert isinstance(got, Choice), got
    assert (got.key, got.frag) == (ref.key, ref.frag)
    assert (got.gpus, got.nics, got.pairs) == (ref.gpus, ref.nics, ref.pairs)
    assert (got.scope, got.met, got.cross) == (ref.scope, ref.met, ref.cross)
