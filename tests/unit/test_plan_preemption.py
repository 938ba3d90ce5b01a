"""``tandem plan`` with priorities and preemption: the ``preempted`` line contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_preempted_lines_before_the_preemptor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("- {topology: dgx-h100, count: 2, prefix: h-}\n")
    reqs = tmp_path / "reqs.jsonl"
    lines = [
        {"kind": "alloc", "id": "a", "gpus": 8, "priority": 0},
        {"kind": "alloc", "id": "b", "gpus": 4, "priority": 3},
        {"kind": "alloc", "id": "c", "gpus": 4, "priority": 1},
        # No room; may not preempt: stays unschedulable.
        {"kind": "alloc", "id": "d", "gpus": 2, "priority": 9},
        # Priority 5 may preempt: one victim is enough (a, b or c), and of those the lowest
        # priority goes: a (0), although c (1) holds fewer GPUs.
        {"kind": "alloc", "id": "e", "gpus": 2, "rdma": 2, "priority": 5, "preemption": "lower-priority"},
        # Priority 1 cannot evict b (3) nor c (1, equal): unschedulable.
        {"kind": "alloc", "id": "f", "gpus": 8, "priority": 1, "preemption": "lower-priority"},
        {"kind": "free", "id": "a"},
    ]
    reqs.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = run(capsys, "--cluster", str(cluster), "--requests", str(reqs), "--summary")
    assert code == 0, err
    statuses = [(x["id"], x["status"]) for x in out[:-1]]
    assert statuses == [
        ("a", "assigned"),
        ("b", "assigned"),
        ("c", "assigned"),
        ("d", "unschedulable"),
        ("a", "preempted"),
        ("e", "assigned"),
        ("f", "unschedulable"),
        ("a", "freed"),
    ]
    victim = out[4]
    assert list(victim)[:3] == ["id", "status", "by"] and victim["by"] == "e"
    assert victim["node"] == out[0]["node"] and len(victim["gpus"]) == 8  # type: ignore[arg-type]
    assert "priority 5 > 0" in victim["reason"]  # type: ignore[operator]
    assert out[5]["node"] == out[0]["node"]
    assert [p["scope"] for p in out[5]["pairs"]] == ["pcie-switch", "pcie-switch"]  # type: ignore[union-attr]
    assert out[7]["node"] is None and out[7]["reason"] == "was preempted by e"
    assert out[-1]["summary"]["preempted"] == 1  # type: ignore[index]


def test_class_allows_preemption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    classes = tmp_path / "classes.yaml"
    classes.write_text("default: {}\nurgent: {preemption: lower-priority}\n")
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(
        '{"kind":"alloc","id":"a","gpus":8}\n'
        '{"kind":"alloc","id":"u","gpus":1,"priority":2,"device_class":"urgent"}\n'
        '{"kind":"alloc","id":"n","gpus":8,"priority":3,"device_class":"urgent","preemption":"never"}\n'
    )
    code, out, err = run(capsys, "--nodes", "dgx-h100", "--classes", str(classes), "--requests", str(reqs))
    assert code == 0, err
    assert [(x["id"], x["status"]) for x in out] == [
        ("a", "assigned"),
        ("a", "preempted"),
        ("u", "assigned"),
        ("n", "unschedulable"),
    ]


def test_bad_preemption_value_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"kind":"alloc","id":"a","gpus":1,"preemption":"always"}\n')
    code = main(["plan", "--nodes", "dgx-h100", "--requests", str(reqs)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{reqs}:1" in err and "preemption" in err
