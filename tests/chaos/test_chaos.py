"""The chaos suite (issue 9): SIGKILLs under load, invariants read from KV after each round.

The bounded run here is what ``make test`` runs: four rounds of ``tandem chaos`` — a
three-server JetStream cluster, inventory and two allocator replicas as processes, a fleet
process of 24 nodes, 120 requests a round — with the seed chosen so that its four rounds kill
an allocator replica, the leader of ``KV_tandem-allocs``, the fleet and the inventory. It
must report no violation and must have killed exactly what its schedule drew. ``make soak``
runs the same for 30 minutes (``docs/reliability.md``).

The checker and the schedule are tested on their own below: each invariant the runner relies
on must be seen to fire on a state that breaks it, or a clean run would prove nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from schemas import codec, subjects
from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    Assignment,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from services.runtime.nats.bus import Bus
from tests.conftest import BusFactory
from tools.chaos import checker
from tools.chaos.victims import COMPONENTS, KINDS, NATS_LEADERS, Schedule

TANDEM = str(Path(sys.executable).parent / "tandem")
# Rounds: allocator-1, the leader of KV_tandem-allocs, the fleet, the inventory.
CI_SEED = 2
CI_ROUNDS = 4


def chaos(*args: str, timeout: float) -> tuple[int, str, str]:
    proc = subprocess.run(
        [TANDEM, "chaos", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_bounded_chaos_run_kills_what_it_planned_and_violates_nothing() -> None:
    planned = Schedule(CI_SEED, replicas=2, servers=3)
    kinds = [planned.next().kind for _ in range(CI_ROUNDS)]
    assert {k.split("-")[0] for k in kinds} == set(COMPONENTS)  # the precondition of CI_SEED
    assert any(k in NATS_LEADERS for k in kinds)

    code, out, err = chaos("--rounds", str(CI_ROUNDS), "--seed", str(CI_SEED), "--json", timeout=180)
    assert code == 0, err[-4000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    report: dict[str, Any] = json.loads(lines[0])
    assert report["violations"] == 0 and report["violation_details"] == [], err[-4000:]
    assert (report["rounds"], report["seed"], report["nats_servers"], report["replicas"]) == (
        CI_ROUNDS,
        CI_SEED,
        3,
        2,
    )
    # Every round killed the kind its schedule drew, a real process, and brought it back.
    log = report["round_log"]
    assert [r["kind"] for r in log] == [r["planned"] for r in log] == kinds
    assert all(r["pid"] and r["victim"] and r["back_s"] is not None for r in log), log
    assert report["kills"] == {k: kinds.count(k) for k in set(kinds)}
    # A load really ran: requests placed in every round, and everything was checked.
    assert report["requests"] == 120 * CI_ROUNDS
    assert all(r["placed"] > 0 for r in log), log
    assert report["invariant_checks"] == 2 * CI_ROUNDS + 1
    assert report["records_checked"] >= report["requests"]


def test_bad_input_is_one_line() -> None:
    code, out, err = chaos("--rounds", "2", "--kill", "allocator,kubelet", timeout=30)
    assert (code, out, err.strip()) == (
        2,
        "",
        "tandem: --kill takes some of allocator, inventory, fleet, nats",
    )
    code, out, err = chaos("--rounds", "0", timeout=30)
    assert (code, out, err.strip()) == (2, "", "tandem: --rounds must be at least 1, got 0")


# -- the schedule ----------------------------------------------------------------------------------


def test_schedule_is_seeded_and_deals_every_component_once_a_cycle() -> None:
    def draw(seed: int, n: int) -> list[tuple[str, int | None, float, float]]:
        s = Schedule(seed, replicas=2, servers=3)
        return [(p.kind, p.index, p.at, p.down_s) for p in (s.next() for _ in range(n))]

    assert draw(5, 40) == draw(5, 40)
    assert draw(5, 40) != draw(6, 40)
    plans = draw(5, 400)
    for cycle in range(0, 400, len(COMPONENTS)):
        dealt = [kind.split("-")[0] for kind, *_ in plans[cycle : cycle + len(COMPONENTS)]]
        assert sorted(dealt) == sorted(COMPONENTS)
    seen = {kind for kind, *_ in plans}
    assert seen == set(KINDS)  # every NATS target, the leaders most of the time
    nats = [kind for kind, *_ in plans if kind.startswith("nats")]
    assert sum(k in NATS_LEADERS for k in nats) > len(nats) / 2
    assert {index for kind, index, *_ in plans if kind == "allocator"} == {0, 1}
    assert all(0.2 <= at <= 0.6 and 0.5 <= down <= 4.0 for _, _, at, down in plans)


# -- the checker ---------------------------------------------------------------------------------------


def _req(rid: str) -> AllocationRequest:
    return AllocationRequest(request_id=rid, pod=PodRef("ns", rid, rid), gpus=1)


def _record(rid: str, state: str, node: str | None = None, reason: str = "") -> RequestRecord:
    return RequestRecord(request=_req(rid), state=state, node=node, reason=reason)


def _alloc(rid: str, node: str, gpu: int, state: str = "assigned") -> AllocRecord:
    assignment = Assignment(
        request_id=rid,
        pod=PodRef("ns", rid, rid),
        node=node,
        gpus=[AssignedGpu(index=gpu, uuid=f"GPU-{gpu}")],
    )
    return AllocRecord(assignment=assignment, state=state)


def _checks(problems: list[checker.Problem]) -> set[tuple[str, str]]:
    return {(p.check, p.subject) for p in problems}


def test_a_consistent_state_has_no_problem() -> None:
    state = checker.KvState(
        allocs={
            "n1": NodeAllocations(
                node="n1", allocations={"a": _alloc("a", "n1", 0), "b": _alloc("b", "n1", 1)}
            ),
            "n2": NodeAllocations(node="n2"),
        },
        requests={
            "a": _record("a", "assigned", "n1"),
            "b": _record("b", "assigned", "n1"),
            "c": _record("c", "pending", reason="no node can take 1 GPUs"),
            "d": _record("d", "freed", "n2"),
            "e": _record("e", "cancelled"),
        },
    )
    assert checker.safety(state) == []
    assert checker.settling(state, drained=False) == []
    # The same state is not drained: the held ones leak, the live ones are not finished.
    assert _checks(checker.settling(state, drained=True)) == {
        ("leaked", "a"),
        ("leaked", "b"),
        ("not-finished", "a"),
        ("not-finished", "b"),
        ("not-finished", "c"),
    }


def test_safety_finds_double_held_devices_and_double_placements() -> None:
    state = checker.KvState(
        allocs={
            "n1": NodeAllocations(
                node="n1", allocations={"a": _alloc("a", "n1", 0), "b": _alloc("b", "n1", 0)}
            ),
            "n2": NodeAllocations(node="n2", allocations={"a": _alloc("a", "n2", 3)}),
            "n3": None,
        },
        requests={"a": _record("a", "assigned", "n1"), "b": _record("b", "assigned", "n1")},
        undecodable_requests={"z"},
    )
    assert _checks(checker.safety(state)) == {
        ("double-held", "n1"),
        ("double-placed", "a"),
        ("undecodable", "n3"),
        ("undecodable", "z"),
    }


def test_settling_finds_every_half_done_state() -> None:
    state = checker.KvState(
        allocs={
            "n1": NodeAllocations(
                node="n1",
                allocations={
                    "held-pending": _alloc("held-pending", "n1", 0),
                    "held-freed": _alloc("held-freed", "n1", 1),
                    "releasing": _alloc("releasing", "n1", 2, state="releasing"),
                    "other-node": _alloc("other-node", "n1", 3),
                },
            ),
        },
        requests={
            "lost": None,
            "deciding": _record("deciding", "deciding"),
            "stuck": _record("stuck", "releasing", "n1", reason="GPU busy"),
            "claim": _record("claim", "assigned", "n2"),
            "mute": _record("mute", "pending"),
            "held-pending": _record("held-pending", "pending", reason="no room"),
            "held-freed": _record("held-freed", "freed", "n1"),
            "releasing": _record("releasing", "assigned", "n1"),
            "other-node": _record("other-node", "assigned", "n2"),
        },
    )
    assert _checks(checker.settling(state, drained=False)) == {
        ("lost", "lost"),
        ("stuck-deciding", "deciding"),
        ("stuck-releasing", "stuck"),
        ("assigned-not-held", "claim"),
        ("pending-without-reason", "mute"),
        ("pending-but-held", "held-pending"),
        ("held-not-assigned", "held-pending"),
        ("finished-but-held", "held-freed"),
        ("held-not-assigned", "held-freed"),
        ("alloc-stuck-releasing", "releasing"),
        ("assigned-not-held", "other-node"),
        ("held-not-assigned", "other-node"),
    }


@pytest.mark.integration
async def test_checker_reads_the_truth_from_kv(bus_factory: BusFactory) -> None:
    """Against a real server: a record written into KV is what the checker judges, and a
    request the harness submitted but KV never heard of is lost."""
    bus: Bus = await bus_factory("allocator")
    allocs = await bus.kv(subjects.KV_ALLOCS)
    requests = await bus.kv(subjects.KV_REQUESTS)
    await allocs.put("n1", codec.encode(NodeAllocations(node="n1", allocations={"a": _alloc("a", "n1", 0)})))
    await requests.put("a", codec.encode(_record("a", "assigned", "n1")))
    await requests.put("b", codec.encode(_record("b", "deciding")))
    state = await checker.read(bus.js, ["a", "b", "never-written"])
    assert set(state.allocs) == {"n1"} and state.requests["never-written"] is None
    assert _checks(checker.settling(state, drained=False)) == {
        ("stuck-deciding", "b"),
        ("lost", "never-written"),
    }
    everything = await checker.read_all(bus.js)
    assert set(everything.requests) == {"a", "b"}
    assert _checks(checker.settling(everything, drained=True)) == {
        ("stuck-deciding", "b"),
        ("not-finished", "a"),
        ("not-finished", "b"),
        ("leaked", "a"),
    }
