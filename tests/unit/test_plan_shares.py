"""``tandem plan`` on the documented shares example (docs/examples/shares, docs/sharing.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "shares"


def test_documented_shares_example(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            "--cluster",
            str(EXAMPLE / "cluster.yaml"),
            "--classes",
            str(EXAMPLE / "classes.yaml"),
            "--requests",
            str(EXAMPLE / "trace.jsonl"),
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    lines = {(d["id"], d["status"]): d for d in map(json.loads, out.splitlines())}

    def gpus(rid: str) -> list[tuple[str, int, int | None, int | None]]:
        d = lines[(rid, "assigned")]
        return [(d["node"], g["index"], g.get("memory_mib"), g.get("cores_percent")) for g in d["gpus"]]

    # Whole GPUs carry no share fields; shares carry memory_mib and cores_percent.
    assert set(lines[("train", "assigned")]["gpus"][0]) == {"index", "uuid"}
    # binpack: three shares fill GPU 4 (100 % of its compute) before GPU 5 is opened.
    assert gpus("infer-a") == [("h100-0", 4, 20480, 25)]
    assert gpus("infer-b") == [("h100-0", 4, 20480, 25)]
    assert gpus("infer-c") == [("h100-0", 4, 30720, 50)]
    assert gpus("infer-d") == [("h100-0", 5, 20480, 10)]
    # A share with a NIC: its own NIC, on the GPU's PCIe switch.
    rdma = lines[("infer-rdma", "assigned")]
    assert gpus("infer-rdma") == [("h100-0", 5, 10240, 20)]
    assert rdma["pairs"] == [{"gpu": 5, "nic": rdma["nics"][0]["name"], "scope": "pcie-switch"}]
    # shared-mps allows 2 shares per GPU, so GPU 5 (2 shares) is full for it.
    assert gpus("mps-1") == [("h100-0", 6, 0, 50), ("h100-0", 7, 0, 50)]
    # Its shares freed, GPU 4 is whole again; shared GPUs are never given whole.
    assert gpus("whole") == [("h100-0", 4, None, None)]
    assert [n for n, *_ in gpus("whole-2")] == ["h100-1", "h100-1"]


def test_plan_refuses_a_share_against_a_class_without_sharing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"kind":"alloc","id":"s","gpus":1,"gpu_memory_mib":1024}\n')
    code = main(["plan", "--cluster", str(EXAMPLE / "cluster.yaml"), "--requests", str(reqs)])
    _, err = capsys.readouterr()
    assert code == 2
    assert "r.jsonl:1" in err and "does not allow GPU shares" in err
