"""State file atomicity and the pure recovery / resolver decisions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from schemas.messages import Assignment, PodRef
from services.nodeagent.netns import PodCgroupResolver, pod_cgroup_matches
from services.nodeagent.reconcile import Action, reconcile
from services.nodeagent.state import AgentState, Record, StateError, StateFile


def rec(rid: str, phase: str, netns: str = "/ns/x") -> Record:
    a = Assignment(request_id=rid, pod=PodRef(namespace="ml", name=rid, uid=rid), node="n", gpus=[])
    return Record(assignment=a, phase=phase, netns=netns)  # type: ignore[arg-type]


def test_state_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "sub" / "state.json")
    assert sf.load() == AgentState()
    st = AgentState(records={"r1": rec("r1", "applied")}, owners={"mlx5_3": "r1"})
    sf.save(st)
    assert sf.load() == st
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["state.json"]  # no temp left behind
    inode = os.stat(sf.path).st_ino
    sf.save(AgentState())
    assert os.stat(sf.path).st_ino != inode  # replaced by rename, never rewritten in place


def test_corrupt_state_file_names_the_path(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    p.write_text('{"records": {"r1": 17}}')
    with pytest.raises(StateError, match=rf"{p}: state file is not valid .*records"):
        StateFile(p).load()


def test_released_tombstones_are_bounded() -> None:
    st = AgentState()
    for i in range(5):
        st.remember_released(f"r{i}", now=float(i), keep=3)
    assert sorted(st.released) == ["r2", "r3", "r4"]


def test_reconcile_table() -> None:
    st = AgentState(
        records={
            "cleaning": rec("cleaning", "cleaning"),
            "gone-released": rec("gone-released", "applied"),
            "half-alive": rec("half-alive", "applying", "/ns/alive"),
            "half-dead": rec("half-dead", "applying", "/ns/dead"),
            "ok": rec("ok", "applied", "/ns/alive"),
            "ok-dead": rec("ok-dead", "applied", "/ns/dead"),
        }
    )
    alive = {"/ns/alive"}
    allocated = {"cleaning", "half-alive", "half-dead", "ok", "ok-dead"}
    got = reconcile(st, allocated=allocated, netns_exists=lambda p: p in alive)
    assert got == [
        Action("cleaning", "cleanup", "cleanup was in progress"),
        Action("gone-released", "cleanup", "no longer allocated to this node"),
        Action("half-alive", "apply", "apply was in progress; pod namespace exists"),
        Action("half-dead", "cleanup", "apply was in progress; pod namespace is gone"),
        Action("ok", "keep", "applied"),
        Action("ok-dead", "keep", "applied; pod namespace gone, awaiting release"),
    ]
    unknown = reconcile(st, allocated=None, netns_exists=lambda p: p in alive)
    assert [a.action for a in unknown] == ["cleanup", "keep", "apply", "cleanup", "keep", "keep"]


def test_pod_cgroup_matching() -> None:
    uid = "3f2a9c1e-1b2c-4d5e-8f90-0123456789ab"
    cgroupfs = f"0::/kubepods/burstable/pod{uid}/0a1b2c3d4e\n"
    systemd = (
        "0::/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice/cri-containerd-9f.scope\n"
    )
    assert pod_cgroup_matches(cgroupfs, uid)
    assert pod_cgroup_matches(systemd, uid)
    assert not pod_cgroup_matches(cgroupfs, uid[:-1] + "c")
    assert not pod_cgroup_matches("0::/system.slice/sshd.service\n", uid)
    assert not pod_cgroup_matches(cgroupfs, "")


async def test_pod_cgroup_resolver_scans_proc(tmp_path: Path) -> None:
    uid = "3f2a9c1e-1b2c-4d5e-8f90-0123456789ab"
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "cgroup").write_text("0::/init.scope\n")
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(f"0::/kubepods/pod{uid}/abc\n")
    (tmp_path / "self").mkdir()
    a = Assignment(request_id="r", pod=PodRef(namespace="ml", name="p", uid=uid), node="n", gpus=[])
    assert await PodCgroupResolver(tmp_path).resolve(a) == str(tmp_path / "4242" / "ns" / "net")
