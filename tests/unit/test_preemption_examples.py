"""The documented preemption examples (docs/examples/preemption-*) do what docs/sharing.md says."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from schemas.config import DeviceClass
from services.admission import podrules
from tools.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_planner_example(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            "--cluster",
            str(EXAMPLES / "preemption-cluster.yaml"),
            "--requests",
            str(EXAMPLES / "preemption-requests.jsonl"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(x["id"], x["status"], x.get("by")) for x in lines] == [
        ("train-a", "assigned", None),
        ("train-b", "assigned", None),
        ("train-a", "preempted", "urgent"),
        ("urgent", "assigned", None),
        ("peer", "unschedulable", None),
        ("train-a", "freed", None),
        ("urgent", "freed", None),
        ("peer-again", "assigned", None),
    ]
    assert {p["scope"] for p in lines[3]["pairs"]} == {"pcie-switch"}


def test_pod_examples_are_valid_and_admitted() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "preemption-pods.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "PodDisruptionBudget", "Pod"]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    pod = docs[2]
    pod["metadata"]["uid"] = "uid-urgent"
    req = podrules.allocation_request(podrules.read_pod(pod), device_classes={"default": DeviceClass()})
    assert req is not None
    assert (req.priority, req.preemption, req.gpus, req.rdma) == (100, "lower-priority", 4, 4)
