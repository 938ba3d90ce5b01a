"""`tandem plan` resolves every request line with the one request resolver (services/request):
a rule broken stops the replay naming the line and the field, for alloc, claim and job lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.cli.main import main


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            '{"kind":"alloc","id":"a","gpus":2,"rdma":1,"pairing":"per-gpu"}',
            "r.jsonl:1: pairing: per-gpu gives every GPU its own NIC, so it needs as many rdma as gpus",
        ),
        ('{"kind":"alloc","id":"a","gpus":0}', "r.jsonl:1: gpus and rdma are both 0"),
        (
            '{"kind":"claim","id":"c","gpus":1,"device_class":"x"}',
            "r.jsonl:1: device_class: unknown device class",
        ),
        (
            '{"kind":"job","id":"j","pods":2,"gpus":1,"device_class":"x"}',
            "r.jsonl:1: job j: device_class: unknown device class 'x'",
        ),
    ],
)
def test_a_rule_broken_names_the_line_and_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, said: str
) -> None:
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(line + "\n")
    assert main(["plan", "--nodes", "dgx-h100", "--requests", str(reqs)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
