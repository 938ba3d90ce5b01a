"""VF hand-off with real namespaces: apply, cleanup, repeats, vanished namespaces, locking."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.nodeagent.backends.base import ApplyError
from services.nodeagent.netns import NamedNetnsResolver, NetnsNotReady, VfApplier
from services.nodeagent.state import StateFile
from tests.netns.conftest import Lab, addrs_in, assignment, link_in, sh

pytestmark = pytest.mark.netns


async def make_applier(lab: Lab, *, name: str = "state.json") -> VfApplier:
    applier = VfApplier(StateFile(lab.tmp / name), resolver=NamedNetnsResolver(template="{uid}"))
    await applier.load()
    return applier


async def test_apply_then_cleanup_restores_everything(lab: Lab) -> None:
    pod = lab.netns()
    vf0, vf1 = lab.vf("0"), lab.vf("1", mtu=4000, up=False)
    a = assignment("req-1", pod, [("mlx5_3", vf0, "net0"), ("mlx5_4", vf1, "net1")])
    applier = await make_applier(lab)
    await applier.apply(a)

    assert link_in(None, vf0.name) is None and link_in(None, vf1.name) is None
    in_pod = link_in(pod, "net0")
    assert in_pod is not None
    assert (in_pod["address"], in_pod["mtu"], "UP" in in_pod["flags"]) == ("02:aa:00:00:00:01", 9000, True)  # type: ignore[operator]
    assert addrs_in(pod, "net0") == ["10.77.0.2/24"]
    assert addrs_in(pod, "net1") == ["10.77.1.2/24"]
    saved = json.loads((lab.tmp / "state.json").read_text())
    assert saved["records"]["req-1"]["phase"] == "applied"
    assert saved["records"]["req-1"]["nics"]["mlx5_3"]["orig_mac"] == vf0.mac
    assert saved["owners"] == {"mlx5_3": "req-1", "mlx5_4": "req-1"}

    assert await applier.cleanup(a) == []
    home0, home1 = link_in(None, vf0.name), link_in(None, vf1.name)
    assert home0 is not None and home1 is not None
    assert (home0["address"], home0["mtu"], "UP" in home0["flags"]) == (vf0.mac, 1500, True)  # type: ignore[operator]
    assert (home1["address"], home1["mtu"], "UP" in home1["flags"]) == (vf1.mac, 4000, False)  # type: ignore[operator]
    assert link_in(pod, "net0") is None
    saved = json.loads((lab.tmp / "state.json").read_text())
    assert (saved["records"], saved["owners"], list(saved["released"])) == ({}, {}, ["req-1"])
    with pytest.raises(ApplyError, match="req-1: already released"):
        await applier.apply(a)  # a late redelivery of the assignment
    assert link_in(None, vf0.name) is not None


async def test_repeated_apply_and_repeated_cleanup_are_idempotent(lab: Lab) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-2", pod, [("mlx5_3", vf, "net0")])
    applier = await make_applier(lab)
    await applier.apply(a)
    ifindex = link_in(pod, "net0")["ifindex"]  # type: ignore[index]
    await applier.apply(a)  # redelivered assignment
    await asyncio.gather(applier.apply(a), applier.apply(a))  # concurrent redeliveries
    assert link_in(pod, "net0")["ifindex"] == ifindex  # type: ignore[index]
    assert addrs_in(pod, "net0") == ["10.77.0.2/24"]

    results = await asyncio.gather(applier.cleanup(a), applier.cleanup(a))
    assert results == [[], []]
    assert await applier.cleanup(a) == []  # and once more, later
    assert link_in(None, vf.name)["address"] == vf.mac  # type: ignore[index]


async def test_cleanup_after_namespace_deleted_with_kernel_refund(lab: Lab) -> None:
    """A physical VF returns to the host namespace when its namespace dies; a veth would be
    destroyed, so the kernel's refund is played by hand: a process keeps the namespace alive
    after ``ip netns del`` and the device is moved home from there, keeping its pod name."""
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-3", pod, [("mlx5_3", vf, "net0")])
    applier = await make_applier(lab)
    await applier.apply(a)
    holder = await asyncio.create_subprocess_exec("ip", "netns", "exec", pod, "sleep", "30")
    await asyncio.sleep(0.2)
    sh(f"ip netns del {pod}")
    sh(f"nsenter --net=/proc/{holder.pid}/ns/net ip link set net0 netns {__import__('os').getpid()}")
    holder.kill()
    await holder.wait()
    lab.links.append("net0")  # in case the test fails before cleanup renames it

    assert link_in(None, "net0") is not None  # home, under its pod name, pod MAC/MTU
    assert await applier.cleanup(a) == []
    home = link_in(None, vf.name)
    assert home is not None and (home["address"], home["mtu"]) == (vf.mac, 1500)
    assert link_in(None, "net0") is None


async def test_cleanup_after_namespace_deleted_and_device_destroyed_is_a_problem(lab: Lab) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-4", pod, [("mlx5_3", vf, "net0")])
    applier = await make_applier(lab)
    await applier.apply(a)
    sh(f"ip netns del {pod}")  # the veth dies with its namespace
    await asyncio.sleep(0.2)
    problems = await applier.cleanup(a)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"mlx5_3: netdev {vf.name} is not back in the host namespace (pod namespace "
    )
    assert "is gone" in problems[0]
    # not forgotten: the record stays so the device stays held and the next try reports again
    saved = json.loads((lab.tmp / "state.json").read_text())
    assert saved["records"]["req-4"]["phase"] == "cleaning" and saved["owners"] == {"mlx5_3": "req-4"}
    with pytest.raises(ApplyError, match="req-4: released; its cleanup has not completed"):
        await applier.apply(a)  # a redelivered assignment must not overwrite the original state
    assert (
        json.loads((lab.tmp / "state.json").read_text())["records"]["req-4"]["nics"]["mlx5_3"]["orig_mac"]
        == vf.mac
    )
    assert (await applier.cleanup(a))[0].startswith("mlx5_3: netdev")  # and the retry reports again


async def test_stale_delete_never_touches_a_reassigned_device(lab: Lab) -> None:
    pod_a, pod_b = lab.netns("a"), lab.netns("b")
    vf = lab.vf()
    a = assignment("req-a", pod_a, [("mlx5_3", vf, "net0")])
    b = assignment("req-b", pod_b, [("mlx5_3", vf, "rdma0")])
    applier = await make_applier(lab)
    await applier.apply(a)
    with pytest.raises(ApplyError, match="mlx5_3: still held by req-a"):
        await applier.apply(b)
    assert await applier.cleanup(a) == []
    await applier.apply(b)
    assert await applier.cleanup(a) == []  # the old release, redelivered late
    in_b = link_in(pod_b, "rdma0")
    assert in_b is not None and "UP" in in_b["flags"]  # type: ignore[operator]
    assert addrs_in(pod_b, "rdma0") == ["10.77.0.2/24"]
    assert await applier.cleanup(b) == []
    assert link_in(None, vf.name) is not None


async def test_per_device_lock_serialises_apply_and_cleanup(lab: Lab) -> None:
    """An assignment and its release racing (a very short-lived pod): the device lock makes the
    cleanup wait for the move-and-configure to finish, so it finds the VF and brings it home."""
    pod = lab.netns()
    vf0, vf1 = lab.vf("0"), lab.vf("1")
    a = assignment("req-a", pod, [("mlx5_3", vf0, "net0"), ("mlx5_4", vf1, "net1")])
    applier = await make_applier(lab)
    assert await asyncio.gather(applier.apply(a), applier.cleanup(a)) == [None, []]
    for vf in (vf0, vf1):
        home = link_in(None, vf.name)
        assert home is not None and (home["address"], home["mtu"]) == (vf.mac, 1500)
    assert link_in(pod, "net0") is None and applier.state.records == {} and applier.state.owners == {}


async def test_missing_pod_namespace_is_not_ready(lab: Lab) -> None:
    vf = lab.vf()
    a = assignment("req-5", f"tpmissing{lab.tag}", [("mlx5_3", vf, "net0")])
    applier = VfApplier(
        StateFile(lab.tmp / "s.json"), resolver=NamedNetnsResolver(template="{uid}", wait=0.3)
    )
    await applier.load()
    with pytest.raises(
        NetnsNotReady, match=f"network namespace /var/run/netns/tpmissing{lab.tag} does not exist"
    ):
        await applier.apply(a)
    assert link_in(None, vf.name) is not None
    assert not (lab.tmp / "s.json").exists() or "req-5" not in (lab.tmp / "s.json").read_text()


async def test_unknown_netdev_is_an_apply_error(lab: Lab) -> None:
    pod = lab.netns()
    vf = lab.vf()
    vf.name = f"nx{lab.tag}"  # no such device
    a = assignment("req-6", pod, [("mlx5_3", vf, "net0")])
    applier = await make_applier(lab)
    with pytest.raises(ApplyError, match=f"mlx5_3: netdev nx{lab.tag} is not in the host namespace"):
        await applier.apply(a)


async def test_pf_netdev_stays_in_the_host_unless_configured(lab: Lab) -> None:
    """A whole PF assigned for shared RDMA keeps its netdev (often the host's link) at home."""
    pod = lab.netns()
    pf = lab.vf("p")
    a = assignment("req-pf", pod, [("mlx5_0", pf, "net0")])
    a.nics[0].vf = None  # a physical function, not a VF
    applier = await make_applier(lab)
    await applier.apply(a)
    assert link_in(None, pf.name) is not None and link_in(pod, "net0") is None
    assert await applier.cleanup(a) == []
    mover = VfApplier(
        StateFile(lab.tmp / "pf.json"), resolver=NamedNetnsResolver(template="{uid}"), move_pfs=True
    )
    await mover.load()
    await mover.apply(a)
    assert link_in(pod, "net0") is not None
    assert await mover.cleanup(a) == []
    assert link_in(None, pf.name) is not None
