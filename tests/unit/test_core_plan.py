"""``tandem plan`` end to end through the CLI entry point, on built-ins and imported matrices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli.main import main

# The real `nvidia-smi topo -m` matrices (copied into the repository by the topology tests).
SHARED = Path(__file__).resolve().parent / "test_topology_matrices"
KEYS = ["id", "status", "node", "gpus", "nics", "pairs", "reason"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_plan_on_builtins_with_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = write(
        tmp_path,
        "cluster.yaml",
        "- {topology: dgx-h100, count: 2, prefix: h100-}\n"
        "- {topology: pcie-4gpu-2nic, count: 1, prefix: pcie-, labels: {pool: infer}}\n",
    )
    reqs = write(
        tmp_path,
        "reqs.jsonl",
        "\n".join(
            [
                '{"kind":"alloc","id":"p1","gpus":4,"rdma":4,"scope":"pcie-switch","policy":"required"}',
                '{"kind":"alloc","id":"p2","gpus":8,"rdma":8}',
                '{"kind":"alloc","id":"p3","gpus":8,"rdma":8,"policy":"required"}',
                '{"kind":"alloc","id":"p4","gpus":2,"rdma":1,"node_selector":{"pool":"infer"}}',
                '{"kind":"free","id":"p2"}',
                '{"kind":"alloc","id":"p3","gpus":8,"rdma":8,"policy":"required"}',
            ]
        ),
    )
    code, lines, _ = run(capsys, "--cluster", str(cluster), "--requests", str(reqs), "--summary")
    assert code == 0
    assert len(lines) == 7
    for line in lines[:6]:
        assert list(line) == KEYS
    p1, p2, p3, p4, free, again, summary = lines
    assert p1["status"] == "assigned" and p1["node"] in ("h100-0", "h100-1")
    assert [p["scope"] for p in p1["pairs"]] == ["pcie-switch"] * 4  # type: ignore[union-attr]
    assert set(p1["gpus"][0]) == {"index", "uuid"} and set(p1["nics"][0]) == {"name"}  # type: ignore[index]
    assert p2["status"] == "assigned" and p2["node"] != p1["node"]
    assert p3["status"] == "unschedulable"
    assert p3["reason"] == "no node can take 8 GPUs + 8 NICs: 3 nodes: fewer than 8 free GPUs"
    assert p4["node"] == "pcie-0" and len(p4["pairs"]) == 2  # type: ignore[arg-type]
    assert (free["status"], free["node"], free["reason"]) == ("freed", p2["node"], "")
    assert again["status"] == "assigned" and again["node"] == p2["node"]
    s = summary["summary"]
    assert s["assigned"] == 4 and s["unschedulable"] == 1 and s["freed"] == 1  # type: ignore[index]
    assert s["alignment"] == {"pcie-switch": 22, "pcie-root": 0, "numa": 0, "socket": 0, "node": 0}  # type: ignore[index]
    assert s["decisions"] == 5 and s["decisions_per_s"] > 0  # type: ignore[index]


def test_plan_on_imported_real_matrices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrices = sorted(SHARED.glob("*.txt"))
    assert len(matrices) >= 10
    reqs = write(tmp_path, "r.jsonl", '{"kind":"alloc","id":"a","gpus":1,"rdma":1}\n')
    for matrix in matrices:
        code, lines, err = run(capsys, "--nodes", str(matrix), "--requests", str(reqs))
        assert code == 0, err
        (line,) = lines
        if "gpu-only" in matrix.name:
            assert line["status"] == "unschedulable" and "fewer than 1 free NICs" in str(line["reason"])
        else:
            assert line["status"] == "assigned", (matrix.name, line)
    # The 8x H200 box has one PIX NIC per GPU: four per-gpu pairs all land on PCIe switches.
    h200 = SHARED / "10_glm52_8xH200_10nic_3pix-per-gpu3.txt"
    req4 = write(tmp_path, "r4.jsonl", '{"kind":"alloc","id":"a","gpus":4,"rdma":4,"policy":"required"}\n')
    code, (line,), _ = run(capsys, "--nodes", str(h200), "--requests", str(req4))
    assert {p["scope"] for p in line["pairs"]} == {"pcie-switch"}  # type: ignore[union-attr]
    # A cluster file can name a matrix too (imported on the fly), with a count.
    cluster = write(tmp_path, "c.yaml", f"- {{topology: {h200}, count: 3, prefix: h200-}}\n")
    code, lines, _ = run(capsys, "--cluster", str(cluster), "--requests", str(req4), "--summary")
    assert lines[0]["node"].startswith("h200-") and lines[1]["summary"]["nodes"] == 3  # type: ignore[union-attr,index]


def test_plan_input_errors_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = write(tmp_path, "c.yaml", "- {topology: dgx-h100}\n")
    cases = [
        ('{"kind":"alloc","id":"a","gpus":1}\nnot json\n', "r.jsonl:2: not JSON"),
        ('{"kind":"alloc","id":"a","gpus":1,"gpu":2}\n', "r.jsonl:1: unknown field(s) gpu"),
        ('{"kind":"alloc","id":"a","gpus":1}\n{"kind":"alloc","id":"a","gpus":1}\n', "already allocated"),
        ('{"kind":"grab","id":"a"}\n', "'kind' must be"),
        ('{"kind":"alloc","id":"a","gpus":1,"device_class":"x"}\n', "unknown device class 'x'"),
        ('{"kind":"alloc","id":"a","gpus":-1}\n', "r.jsonl:1: Expected `int` >= 0 - at `$.gpus`"),
    ]
    for text, message in cases:
        reqs = write(tmp_path, "r.jsonl", text)
        assert main(["plan", "--cluster", str(cluster), "--requests", str(reqs)]) == 2
        assert message in capsys.readouterr().err
    bad_cluster = write(tmp_path, "bad.yaml", "- {topology: no-such-box}\n")
    reqs = write(tmp_path, "r.jsonl", "")
    assert main(["plan", "--cluster", str(bad_cluster), "--requests", str(reqs)]) == 2
    assert "no built-in topology 'no-such-box'" in capsys.readouterr().err
