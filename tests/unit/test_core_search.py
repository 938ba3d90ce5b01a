"""The in-node search on whole 16-GPU servers: the large requests a subset enumeration could
not decide in time (an 8 + 8 on a free 16 + 16 server took ~30 s), with their optimum worked
out by hand. Speed is measured in ``bench/run.py``; these check the answer."""

from __future__ import annotations

from bench.fleet import sixteen_gpu
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement


def req(rid: str, gpus: int, rdma: int, **kw: object) -> AllocationRequest:
    return AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=gpus, rdma=rdma, **kw)  # type: ignore[arg-type]


def placed(result: object) -> Placement:
    assert isinstance(result, Placement), getattr(result, "reason", result)
    return result


def test_eight_plus_eight_on_a_free_16_plus_16_server_fills_one_socket() -> None:
    c = Cluster()
    c.set_node("hgx2", sixteen_gpu(2))
    p = placed(c.decide(req("a", 8, 8)))
    # Every pair on its switch; one socket's 4 switches, 2 roots and NUMA node broken, and the
    # one 16-GPU NVLink domain (nvb 16); GPUs 0-7 win the tie with GPUs 8-15.
    assert p.quality == (0, -8, -8, -8, -8, 0, 0, 0, 0, 0, 16, 1, 1, 2, 4)
    assert [g.index for g in p.gpus] == list(range(8))
    assert [n.name for n in p.nics] == [f"mlx5_{i}" for i in range(8)]
    assert {x.scope for x in p.pairs} == {"pcie-switch"}
    c.hold("hgx2", "a", p.devices())
    q = placed(c.decide(req("b", 8, 8, policy="required")))
    assert [g.index for g in q.gpus] == list(range(8, 16)) and q.met
    c.hold("hgx2", "b", q.devices())
    assert not c.free_devices("hgx2")


def test_eight_plus_eight_on_a_16_plus_8_server_takes_one_gpu_per_switch() -> None:
    c = Cluster()
    c.set_node("dgx2", sixteen_gpu(1))
    p = placed(c.decide(req("a", 8, 8, policy="required")))
    # Only one NIC per switch: eight switch pairs need all eight switches.
    assert p.quality == (0, -8, -8, -8, -8, 0, 0, 0, 0, 0, 16, 2, 2, 4, 8)
    assert [g.index for g in p.gpus] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert {x.scope for x in p.pairs} == {"pcie-switch"}
    # The other eight GPUs have no NIC left: a second 8 + 8 cannot be placed at all, and a
    # shared 8 + 4 neither; the other eight GPUs alone can.
    c.hold("dgx2", "a", p.devices())
    refused = c.decide(req("b", 8, 8))
    assert not isinstance(refused, Placement)
    assert refused.counts == {"fewer than 8 free NICs": 1}
    g8 = placed(c.decide(req("c", 8, 0)))
    assert [g.index for g in g8.gpus] == [1, 3, 5, 7, 9, 11, 13, 15]


def test_sixteen_plus_sixteen_and_shared_requests_on_a_whole_server() -> None:
    c = Cluster()
    c.set_node("hgx2", sixteen_gpu(2))
    whole = placed(c.decide(req("w", 16, 16, policy="required")))
    assert len(whole.gpus) == 16 and {x.scope for x in whole.pairs} == {"pcie-switch"}
    shared = placed(c.decide(req("s", 8, 4, scope="pcie-switch", policy="required")))
    # 8 GPUs on 4 switches with one of each switch's two NICs: every GPU has its NIC on its
    # switch and every NIC a GPU there.
    assert shared.quality[:9] == (0, -8, -8, -8, -8, -4, -4, -4, -4)
    assert len({x.nic for x in shared.pairs}) == 4
    assert {x.scope for x in shared.pairs} == {"pcie-switch"}
