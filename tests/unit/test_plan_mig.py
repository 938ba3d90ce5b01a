"""``tandem plan`` on the documented MIG example (docs/examples/mig, docs/sharing.md "MIG")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mig"


def test_documented_mig_example(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["plan", "--cluster", str(EXAMPLE / "cluster.yaml"), "--requests", str(EXAMPLE / "trace.jsonl")]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    lines: dict[tuple[str, str], dict[str, Any]] = {
        (d["id"], d["status"]): d for d in map(json.loads, out.splitlines())
    }

    def migs(rid: str) -> list[tuple[str, int, str, str]]:
        d = lines[(rid, "assigned")]
        return [(d["node"], g["index"], g["mig"]["profile"], g["mig"]["device"]) for g in d["gpus"]]

    # A 1g.10gb instance; binpack puts the second on the same GPU (best fit: GPU 1 has two).
    assert migs("small-a") == [("mig-0", 1, "1g.10gb", "gpu1-mig9-0")]
    assert migs("small-b") == [("mig-0", 1, "1g.10gb", "gpu1-mig10-0")]
    assert lines[("small-a", "assigned")]["gpus"][0]["mig"]["uuid"].startswith("MIG-")
    # Two 3g.40gb instances of GPU 3, each with its own NIC on GPU 3's PCIe switch.
    rdma = lines[("mig-rdma", "assigned")]
    assert migs("mig-rdma") == [
        ("mig-0", 3, "3g.40gb", "gpu3-mig1-0"),
        ("mig-0", 3, "3g.40gb", "gpu3-mig2-0"),
    ]
    assert [p["scope"] for p in rdma["pairs"]] == ["pcie-switch", "pcie-switch"]
    assert sorted(n["name"] for n in rdma["nics"]) == ["mlx5_2", "mlx5_3"]
    # Whole GPUs never come from MIG-mode GPUs: the 4-GPU job gets GPUs 4-7 (binpack, mig-0).
    whole = lines[("whole", "assigned")]
    assert whole["node"] == "mig-0" and [g["index"] for g in whole["gpus"]] == [4, 5, 6, 7]
    assert all("mig" not in g for g in whole["gpus"])
    # The last 3g.40gb; then none is left (Tandem does not repartition) until it is freed.
    assert migs("big") == [("mig-0", 1, "3g.40gb", "gpu1-mig2-0")]
    assert "no free MIG instance 3g.40gb" in lines[("big-2", "unschedulable")]["reason"]
    assert migs("big-3") == migs("big")
    assert "7g.80gb" in lines[("odd", "unschedulable")]["reason"]


def test_plan_refuses_a_bad_profile_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"kind":"alloc","id":"m","gpus":1,"mig_profile":"big"}\n')
    code = main(["plan", "--cluster", str(EXAMPLE / "cluster.yaml"), "--requests", str(reqs)])
    _, err = capsys.readouterr()
    assert code == 2
    assert "r.jsonl:1" in err and "$.mig_profile" in err
