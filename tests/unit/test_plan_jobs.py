"""``tandem plan`` job lines: whole jobs, their fabric tier, freeing a job, and the baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli.main import main

CLUSTER = """
- topology: dgx-h100
  count: 3
  prefix: a-
  labels: {tandem.io/fabric-leaf: l1, tandem.io/fabric-spine: s1}
- topology: dgx-h100
  count: 2
  prefix: b-
  labels: {tandem.io/fabric-leaf: l2, tandem.io/fabric-spine: s1}
  nvlink_domain: {cluster_uuid: nvl72-a, clique_id: 1}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def files(tmp_path: Path, *lines: str) -> tuple[str, str]:
    (tmp_path / "c.yaml").write_text(CLUSTER)
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "c.yaml"), str(tmp_path / "r.jsonl")


def test_job_lines_one_per_pod_then_the_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c, r = files(
        tmp_path,
        '{"kind":"job","id":"train","pods":3,"gpus":8,"rdma":8,"scope":"pcie-switch","policy":"required",'
        '"fabric":"leaf","fabric_policy":"required"}',
        '{"kind":"job","id":"big","pods":3,"gpus":8,"rdma":8,"fabric":"leaf","fabric_policy":"required"}',
        '{"kind":"job","id":"nvl","pods":2,"gpus":8,"rdma":8,"nvlink_domain":"required"}',
        '{"kind":"free","id":"train"}',
        '{"kind":"job","id":"big","pods":3,"gpus":8,"rdma":8,"fabric":"leaf","fabric_policy":"required"}',
    )
    code, lines, _ = run(capsys, "--cluster", c, "--requests", r, "--summary")
    assert code == 0
    pods, job = lines[:3], lines[3]
    assert [p["id"] for p in pods] == ["train/0", "train/1", "train/2"]
    assert {p["node"] for p in pods} == {"a-0", "a-1", "a-2"} and all(p["status"] == "assigned" for p in pods)
    assert job["id"] == "train" and job["status"] == "assigned"
    assert job["job"] == {
        "pods": 3,
        "placed": 3,
        "nodes": ["a-0", "a-1", "a-2"],
        "tier": "leaf",
        "level": 1,
        "block": "l1",
    }
    big = lines[4]
    assert big["status"] == "unschedulable" and big["job"]["placed"] == 0  # type: ignore[index]
    assert big["reason"] == (
        "3 pods of 8+8 (pcie-switch preferred): the cluster can take only 2 "
        "(no pod fits on the other nodes: 3 nodes: fewer than 8 free GPUs)"
    )
    nvl = lines[7]
    assert nvl["id"] == "nvl" and nvl["job"]["nodes"] == ["b-0", "b-1"]  # type: ignore[index]
    freed = lines[8]
    assert freed["status"] == "freed" and freed["job"]["nodes"] == ["a-0", "a-1", "a-2"]  # type: ignore[index]
    assert lines[12]["status"] == "assigned" and lines[12]["job"]["block"] == "l1"  # type: ignore[index]
    jobs = lines[-1]["summary"]["jobs"]  # type: ignore[index]
    assert (
        jobs["placed"] == 3 and jobs["unschedulable"] == 1 and jobs["freed"] == 1 and jobs["idle_gpus"] == 0
    )
    assert jobs["tier"] == {"node": 0, "leaf": 3, "spine": 0, "cluster": 0}


def test_per_pod_baseline_holds_gpus_idle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c, r = files(
        tmp_path,
        '{"kind":"job","id":"a","pods":4,"gpus":8,"rdma":8}',
        '{"kind":"job","id":"b","pods":4,"gpus":8,"rdma":8}',
    )
    code, lines, _ = run(capsys, "--cluster", c, "--requests", r, "--summary", "--jobs", "per-pod")
    assert code == 0
    jobs = lines[-1]["summary"]["jobs"]  # type: ignore[index]
    assert (
        jobs["placed"] == 1 and jobs["partial"] == 1 and jobs["idle_gpus"] == 8 and jobs["mode"] == "per-pod"
    )
    code, lines, _ = run(capsys, "--cluster", c, "--requests", r, "--summary")
    jobs = lines[-1]["summary"]["jobs"]  # type: ignore[index]
    assert (
        jobs["placed"] == 1 and jobs["partial"] == 0 and jobs["unschedulable"] == 1 and jobs["idle_gpus"] == 0
    )


def test_job_line_errors_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c, r = files(tmp_path, '{"kind":"job","id":"x","pods":2,"gpus":1,"fabric":"rack"}')
    code, _, err = run(capsys, "--cluster", c, "--requests", r)
    assert code == 2 and "r.jsonl:1: job x: unknown fabric tier 'rack' (tiers: leaf, spine)" in err
    c, r = files(tmp_path, '{"kind":"job","id":"x","pods":0,"gpus":1}')
    code, _, err = run(capsys, "--cluster", c, "--requests", r)
    assert code == 2 and "r.jsonl:1:" in err and "pods" in err
    code, _, err = run(capsys, "--cluster", c, "--requests", r, "--fabric-tiers", "rack,row")
    assert code == 2


def test_per_pod_job_waits_holding_its_pods_and_resumes() -> None:
    from schemas.messages import AllocationRequest, PodRef
    from services.allocator.core import Cluster, Placement
    from services.topology import load_topology
    from tools.cli.plan_jobs import JobBook

    c = Cluster()
    for i in range(3):
        c.set_node(f"n{i}", load_topology("dgx-h100"))
    blocker = c.decide(AllocationRequest(request_id="x", pod=PodRef("ns", "x"), gpus=8, rdma=8))
    assert isinstance(blocker, Placement)
    c.hold(blocker.node, "x", blocker.devices())
    book = JobBook(c, tiers=("leaf",), mode="per-pod")
    lines = book.place({"kind": "job", "id": "j", "pods": 3, "gpus": 8, "rdma": 8}, "t")
    assert lines[-1]["status"] == "partial" and book.idle == {"j": 16} and "j" in book.waiting
    assert book.resume("j") == "partial"
    c.release(blocker.node, "x")
    assert book.resume("j") == "assigned"
    assert book.idle == {} and [pid for _, pid in book.live["j"]] == ["j/0", "j/1", "j/2"]
    assert book.summary()["placed"] == 1 and book.summary()["idle_gpus_peak"] == 16
    assert book.free("j") is not None and c.totals()["free_gpus"] == 24
