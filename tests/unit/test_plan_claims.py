"""``tandem plan`` with claims, reservations and the planner's clock, through the CLI entry
point, on the documented example (docs/examples/plan-claims.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main

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
            "unknown field(s) scope; allowed: claim, gpus",
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
