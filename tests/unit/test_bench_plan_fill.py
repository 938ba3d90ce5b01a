"""The `tandem plan` fill benchmark (bench/plan_fill.py): its trace holds the offered load at
the fill, and its reading of `tandem plan`'s output counts only the measured requests."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fleet import MIX
from bench.plan_fill import cluster_entries, measure, trace


def test_the_cluster_file_has_the_bench_fleet_proportions() -> None:
    entries, gpus = cluster_entries(MIX, 20)
    assert [(e["topology"], e["count"]) for e in entries] == [
        ("dgx-h100", 8),
        ("dgx-a100", 6),
        ("pcie-4gpu-2nic", 3),
        ("gpu-only-8", 3),
    ]
    assert gpus == 8 * 8 + 6 * 8 + 3 * 4 + 3 * 8


def test_the_trace_fills_then_holds_the_offered_gpus_at_the_fill() -> None:
    lines = trace(400, 0.9, decisions=300, seed=3)
    asked: dict[str, int] = {}
    offered = 0
    measured = 0
    for line in lines:
        if line["kind"] == "free":
            offered -= asked.pop(line["id"])
            continue
        if line["id"].startswith("m-"):
            measured += 1
            # Before each measured request the offered GPUs are back at the fill or below.
            assert offered <= 0.9 * 400, (line, offered)
        else:
            assert measured == 0, "fill requests come first"
        asked[line["id"]] = line["gpus"]
        offered += line["gpus"]
    assert measured == 300
    assert offered > 0.9 * 400 - 8  # and never far below it: frees stop at the fill


def test_only_measured_requests_are_counted(tmp_path: Path) -> None:
    def out(rid: str, status: str, *scopes: str, gpus: int = 0) -> str:
        pairs = [{"gpu": i, "nic": f"mlx5_{i}", "scope": s} for i, s in enumerate(scopes)]
        doc = {"id": rid, "status": status, "gpus": [{"index": i} for i in range(gpus)], "pairs": pairs}
        return json.dumps(doc)

    text = [
        out("f-1", "assigned", "pcie-root", gpus=2),  # filling: not counted, but held
        out("m-2", "assigned", "pcie-switch", "pcie-switch", gpus=2),
        out("m-3", "assigned", "pcie-switch", "numa", gpus=2),
        out("m-4", "assigned", gpus=4),  # GPUs only: no pairs
        out("f-1", "freed"),
        out("m-5", "unschedulable"),
        json.dumps({"summary": {}}),
    ]
    path = tmp_path / "plan.out"
    path.write_text("\n".join(text) + "\n")
    got = measure(path, total_gpus=10)
    assert (got["measured"], got["placed"], got["refused"], got["pods_with_nics"]) == (4, 3, 1, 2)
    assert (got["pods_at_switch_pct"], got["pairs_at_switch_pct"]) == (50.0, 75.0)
    # GPUs held when each measured request was answered: 4, 6, 10, 8 of 10.
    assert got["gpus_held_pct"] == 70.0
