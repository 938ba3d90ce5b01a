"""An agent SIGKILLed between steps, then restarted: recovery from the state file finishes or
undoes the work, checked against the real namespaces."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.nodeagent.netns import NamedNetnsResolver, VfApplier
from services.nodeagent.state import StateFile
from tests.netns.conftest import Lab, addrs_in, assignment, link_in

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def crash(lab: Lab, state: Path, raw: bytes, mode: str, step: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.netns.crash_agent",
            str(state),
            "/var/run/netns",
            raw.decode(),
            mode,
            step,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, f"agent was meant to die at {step}: {proc.stdout}{proc.stderr}"


async def restarted(lab: Lab, state: Path) -> VfApplier:
    return VfApplier(StateFile(state), resolver=NamedNetnsResolver(template="{uid}"))


@pytest.mark.parametrize("step", ["recorded", "moved", "configured"])
async def test_killed_during_apply_then_finished(lab: Lab, step: str) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-c1", pod, [("mlx5_3", vf, "net0")])
    state = lab.tmp / "state.json"
    crash(lab, state, msgspec.json.encode(a), "apply", step)
    assert json.loads(state.read_text())["records"]["req-c1"]["phase"] == "applying"

    applier = await restarted(lab, state)
    report = await applier.recover(allocated={"req-c1"})
    assert [(act.action, problems) for act, problems in report] == [("apply", [])]
    in_pod = link_in(pod, "net0")
    assert in_pod is not None and in_pod["address"] == "02:aa:00:00:00:01" and in_pod["mtu"] == 9000
    assert addrs_in(pod, "net0") == ["10.77.0.2/24"]
    assert json.loads(state.read_text())["records"]["req-c1"]["phase"] == "applied"
    assert await applier.cleanup(a) == []
    assert link_in(None, vf.name)["address"] == vf.mac  # type: ignore[index]


@pytest.mark.parametrize("step", ["recorded", "moved", "configured"])
async def test_killed_during_apply_released_meanwhile_then_undone(lab: Lab, step: str) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-c2", pod, [("mlx5_3", vf, "net0")])
    state = lab.tmp / "state.json"
    crash(lab, state, msgspec.json.encode(a), "apply", step)

    applier = await restarted(lab, state)
    report = await applier.recover(allocated=set())  # the allocator no longer holds it
    assert [(act.action, act.reason, problems) for act, problems in report] == [
        ("cleanup", "no longer allocated to this node", [])
    ]
    home = link_in(None, vf.name)
    assert home is not None and (home["address"], home["mtu"]) == (vf.mac, 1500)
    assert link_in(pod, "net0") is None and link_in(pod, vf.name) is None
    assert json.loads(state.read_text())["records"] == {}


@pytest.mark.parametrize("step", ["cleaning", "returned"])
async def test_killed_during_cleanup_then_finished(lab: Lab, step: str) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-c3", pod, [("mlx5_3", vf, "net0")])
    state = lab.tmp / "state.json"
    crash(lab, state, msgspec.json.encode(a), "cleanup", step)
    assert json.loads(state.read_text())["records"]["req-c3"]["phase"] == "cleaning"

    applier = await restarted(lab, state)
    report = await applier.recover(allocated={"req-c3"})  # still allocated: freed only after cleaned
    assert [(act.action, act.reason, problems) for act, problems in report] == [
        ("cleanup", "cleanup was in progress", [])
    ]
    home = link_in(None, vf.name)
    assert home is not None and (home["address"], home["mtu"]) == (vf.mac, 1500)
    saved = json.loads(state.read_text())
    assert saved["records"] == {} and saved["owners"] == {} and "req-c3" in saved["released"]


async def test_restart_with_nothing_half_done_keeps_applied_work(lab: Lab) -> None:
    pod = lab.netns()
    vf = lab.vf()
    a = assignment("req-c4", pod, [("mlx5_3", vf, "net0")])
    state = lab.tmp / "state.json"
    first = VfApplier(StateFile(state), resolver=NamedNetnsResolver(template="{uid}"))
    await first.load()
    await first.apply(a)
    applier = await restarted(lab, state)
    report = await applier.recover(allocated=None)  # allocator records unreadable: keep
    assert [(act.action, problems) for act, problems in report] == [("keep", [])]
    assert link_in(pod, "net0") is not None
    assert await applier.cleanup(a) == []
