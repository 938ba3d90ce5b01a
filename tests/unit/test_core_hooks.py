"""The registry knows no device kind: what a kind keeps of nodes and holds it keeps itself,
told through the hooks of services/allocator/core/plugins/base.py (worked cases; the property
tests check the decisions)."""

from __future__ import annotations

from pathlib import Path

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement
from services.allocator.core.plugins.base import Hooks, overriding
from services.topology import load_topology

MIG_TOPOLOGY = Path(__file__).resolve().parents[2] / "docs/examples/mig/dgx-h100-mig.yaml"


class _Keeps(Hooks):
    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: list[str] = []

    def hold_removed(self, name: str, request_id: str) -> None:
        self.seen.append(request_id)


class _Plain(Hooks):
    __slots__ = ()


def test_only_the_hooks_a_kind_overrides_are_called_per_hold() -> None:
    keeps, plain = _Keeps(), _Plain()
    bound = overriding([plain, keeps], "hold_removed")
    assert bound == (keeps.hold_removed,)
    assert overriding([plain, keeps], "hold_set") == ()
    bound[0]("n0", "r1")
    assert keeps.seen == ["r1"]


def test_a_hold_of_a_mig_instance_is_never_a_victim() -> None:
    cluster = Cluster()
    cluster.set_node("m0", load_topology(str(MIG_TOPOLOGY)))
    instance = cluster.mig_instances("m0")["1g.10gb"][0]
    cluster.hold("m0", "mig", [instance], priority=0, preemptible=True)
    whole = next(d for d in cluster.free_devices("m0") if d.startswith("gpu"))
    cluster.hold("m0", "whole", [whole], priority=0, preemptible=True)
    assert set(cluster.preemptible()["m0"]) == {"whole"}
    # The MIG kind followed the hold: the instance is no longer free.
    assert instance not in cluster.mig_instances("m0")["1g.10gb"]
    cluster.release("m0", "mig")
    assert instance in cluster.mig_instances("m0")["1g.10gb"]


def test_the_share_kind_keeps_share_holds_and_builds_its_index_on_the_first() -> None:
    cluster = Cluster(device_classes={"default": DeviceClass(), "share": DeviceClass(sharing="hami")})
    cluster.set_node("n0", load_topology("dgx-h100"))
    whole = cluster.decide(AllocationRequest(request_id="w", pod=PodRef("ns", "w"), gpus=1))
    assert isinstance(whole, Placement)
    cluster.hold("n0", "w", whole.devices())
    assert cluster.cache_stats()["share_groups"] == 0  # no share yet: no share index
    cluster.hold("n0", "s", ["gpu7"], shares={"gpu7": (8192, 25)}, sharing="hami")
    assert cluster.cache_stats()["share_groups"] == 1
    assert cluster.shares("n0") == {"s": {"gpu7": (8192, 25)}}
    assert cluster.gpu_shares("n0")["gpu7"][2] == 1  # one share on it, from the group mask
    cluster.release("n0", "s")
    assert cluster.shares("n0") == {}
    assert "gpu7" in cluster.free_devices("n0")
