"""``tandem plan`` with claims, reservations and the planner's clock, through the CLI entry
point, on the documented example (docs/examples/plan-claims.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
KEYS = ["id", "status", "node", "gpus", "nics", "pairs", "reason"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_the_documented_claims_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = run(
        capsys,
        "--cluster",
        str(EXAMPLES / "plan-cluster.yaml"),
        "--requests",
        str(EXAMPLES / "plan-claims.jsonl"),
        "--summary",
    )
    assert code == 0, err
    *decisions, summary = lines
    for line in decisions:
        assert list(line) == KEYS
    got = [(d["id"], d["status"]) for d in decisions]
    assert got == [
        ("night-reservation", "claimed"),
        ("team-a", "claimed"),
        ("notebook-1", "assigned"),
        ("notebook-2", "assigned"),
        ("trainer", "unschedulable"),
        ("wrong-size", "unschedulable"),
        ("night-reservation", "expired"),
        ("trainer", "assigned"),
        ("notebook-1", "freed"),
        ("team-a", "freed"),
    ]
    night, team, nb1, nb2, _, wrong, expired, trainer, freed_nb, freed_team = decisions
    assert len(night["gpus"]) == 8 and {p["scope"] for p in night["pairs"]} == {"pcie-switch"}  # type: ignore[union-attr,arg-type]
    # Pods on the shareable claim get exactly its devices.
    for nb in (nb1, nb2):
        assert (nb["node"], nb["gpus"], nb["nics"]) == (team["node"], team["gpus"], team["nics"])
    assert "claim 'team-a' holds 2 + 2" in str(wrong["reason"])
    assert expired["reason"] == "reservation expired at t=3600s with no pod using it"
    # The expired reservation's devices went to the request that could not be placed before.
    assert trainer["node"] == night["node"] and trainer["gpus"] == night["gpus"]
    assert freed_nb["reason"] == "devices stay with claim 'team-a'"
    assert freed_team["reason"] == "claim released; 1 pod was using it"
    assert summary["summary"]["claims"] == {  # type: ignore[index]
        "claimed": 2,
        "expired": 1,
        "released": 1,
        "pods_on_claims": 2,
    }


def test_a_reservation_in_use_expires_when_its_last_pod_is_freed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(
        "\n".join(
            [
                '{"kind":"claim","id":"r","gpus":2,"rdma":2,"expires_after":10}',
                '{"kind":"alloc","id":"p","claim":"r"}',
                '{"kind":"tick","seconds":20}',
                '{"kind":"free","id":"p"}',
                '{"kind":"alloc","id":"late","claim":"r"}',
            ]
        )
    )
    code, lines, err = run(capsys, "--nodes", "pcie-4gpu-2nic", "--requests", str(reqs))
    assert code == 0, err
    assert [(d["id"], d["status"]) for d in lines] == [
        ("r", "claimed"),
        ("p", "assigned"),
        ("p", "freed"),
        ("r", "expired"),
        ("late", "unschedulable"),
    ]
    assert "claim 'r' does not exist" in str(lines[-1]["reason"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"kind":"tick","seconds":-1}', "trace:1: 'seconds' must be a number >= 0, got -1"),
        ('{"kind":"tick","seconds":5,"id":"x"}', "trace:1: unknown field(s) id; allowed: kind, seconds"),
        (
            '{"kind":"claim","id":"c","gpus":1,"expires_after":0}',
            "'expires_after' must be a number of seconds > 0",
        ),
        ('{"kind":"claim","id":"c","gpus":1,"shareable":"yes"}', "'shareable' must be true or false"),
        ('{"kind":"claim","id":"c","gpus":1,"colour":"red"}', "unknown field(s) colour"),
        (
            '{"kind":"alloc","id":"p","claim":"c","scope":"numa"}',
            "unknown field(s) scope; allowed: claim, gpu_cores_percent, gpu_memory_mib, gpus, id, kind, "
            "mig_profile, rdma",
        ),
        ('{"kind":"lease","id":"p"}', '\'kind\' must be "alloc", "job", "free", "claim" or "tick"'),
    ],
)
def test_bad_claim_lines_stop_with_the_line_and_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    reqs = tmp_path / "trace"
    reqs.write_text(line + "\n")
    code = main(["plan", "--nodes", "pcie-4gpu-2nic", "--requests", str(reqs)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_the_claims_benchmark_runs_and_counts_what_it_did() -> None:
    """A smoke run of ``make bench-claims`` on a tiny fleet (no timing is asserted)."""
    from bench.claims import run as bench_run

    doc = bench_run(40, 400, 3)
    assert (
        doc["nodes"] == 40
        and doc["decisions"] == doc["latency_us"]["claim"]["n"] + doc["latency_us"]["plain"]["n"]
    )
    assert doc["outcomes"]["claimed"] > 0 and doc["outcomes"]["expired"] > 0
    assert doc["latency_us"]["pod_on_claim"]["n"] > 0


MIG = EXAMPLES / "mig"


def test_the_documented_mig_claims_example(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/examples/mig/claims.jsonl: a claim of MIG instances, its pods, a pod asking another
    profile, a MIG reservation that expires and gives its instances back."""
    code, lines, err = run(
        capsys,
        "--cluster",
        str(MIG / "cluster.yaml"),
        "--requests",
        str(MIG / "claims.jsonl"),
        "--summary",
    )
    assert code == 0, err
    *decisions, summary = lines
    assert [(d["id"], d["status"]) for d in decisions] == [
        ("infer-pool", "claimed"),
        ("infer-1", "assigned"),
        ("infer-2", "assigned"),
        ("wrong-profile", "unschedulable"),
        ("night", "claimed"),
        ("big", "assigned"),
        ("big-2", "unschedulable"),
        ("night", "expired"),
        ("big-3", "assigned"),
    ]
    pool, p1, p2, wrong, night, big, big2, _expired, big3 = decisions

    def instances(line: dict[str, object]) -> list[str]:
        return [g["mig"]["device"] for g in line["gpus"]]  # type: ignore[attr-defined,index]

    # The claim holds two 1g.10gb instances (named with their MIG- UUIDs) and a NIC of their GPU.
    assert pool["node"] == "mig-0" and len(instances(pool)) == 2
    assert {g["mig"]["profile"] for g in pool["gpus"]} == {"1g.10gb"}  # type: ignore[index,union-attr]
    assert all(g["mig"]["uuid"].startswith("MIG-") for g in pool["gpus"])  # type: ignore[index,union-attr]
    assert {p["scope"] for p in pool["pairs"]} == {"pcie-switch"}  # type: ignore[union-attr]
    # Its pods get exactly its instances and NIC.
    for pod in (p1, p2):
        assert (pod["node"], pod["gpus"], pod["nics"]) == (pool["node"], pool["gpus"], pool["nics"])
    assert wrong["reason"] == (
        "asks mig_profile '3g.40gb', but claim 'infer-pool' holds mig_profile '1g.10gb'; a pod using "
        "a claim asks for exactly its kind of GPU"
    )
    # The claimed instances go to no one else: the reservation and the plain request share out
    # the three 3g.40gb instances, and a fourth finds none until the reservation expires.
    taken = instances(night) + instances(big)
    assert len(set(taken)) == 3 and not set(taken) & set(instances(pool))
    assert "no free MIG instance 3g.40gb" in str(big2["reason"])
    assert instances(big3)[0] in instances(night)
    assert summary["summary"]["claims"] == {  # type: ignore[index]
        "claimed": 2,
        "expired": 1,
        "released": 0,
        "pods_on_claims": 2,
    }


def test_a_share_claim_is_held_as_shares_and_its_pods_ask_its_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A claim with gpu_memory_mib holds a share, not the whole GPU: a plain share request fills
    the same GPU (binpack); a pod on the claim asking another size is refused."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(
        "\n".join(
            [
                '{"kind":"claim","id":"c","gpus":1,"gpu_memory_mib":40000,"device_class":"shared"}',
                '{"kind":"alloc","id":"s","gpus":1,"gpu_memory_mib":40000,"device_class":"shared"}',
                '{"kind":"alloc","id":"p","claim":"c","gpu_memory_mib":40000}',
                '{"kind":"alloc","id":"q","claim":"c","gpu_memory_mib":20000}',
            ]
        )
    )
    code, lines, err = run(
        capsys,
        "--nodes",
        "dgx-h100",
        "--classes",
        str(EXAMPLES / "shares" / "classes.yaml"),
        "--requests",
        str(reqs),
    )
    assert code == 0, err
    claim, share, pod, other = lines
    assert claim["status"] == "claimed" and claim["gpus"] == [
        {**claim["gpus"][0], "memory_mib": 40000, "cores_percent": 0}  # type: ignore[index]
    ]
    assert share["status"] == "assigned" and share["gpus"][0]["index"] == claim["gpus"][0]["index"]  # type: ignore[index]
    assert pod["status"] == "assigned" and pod["gpus"] == claim["gpus"]
    assert other["status"] == "unschedulable"
    assert "asks gpu_memory_mib 20000, but claim 'c' holds gpu_memory_mib 40000" in str(other["reason"])


def test_a_claim_line_with_mig_and_shares_stops_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"kind":"claim","id":"c","gpus":1,"mig_profile":"1g.10gb","gpu_memory_mib":1024}\n')
    code = main(["plan", "--cluster", str(MIG / "cluster.yaml"), "--requests", str(reqs)])
    err = capsys.readouterr().err
    assert code == 2 and "r.jsonl:1" in err and "Traceback" not in err
    assert "mig" in err.lower()
