"""Shares, DeviceClaims, reservations and whole jobs tried on one machine, as docs/sharing.md
shows them: the real `tandem` against a plain `tandem up` (its default fleet and classes).

The docs' "Trying it on one machine" block is run line by line, so the page and the commands
cannot drift apart; the other tests check each path the block only shows: share sizes where a
GPU has several holders, a claim's record and release, a reservation released at its deadline,
a job placed whole, waited for, explained and released or cancelled, and `tandem up --config`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_cli_requests import spawn, tandem
from tests.e2e.test_cli_up import TANDEM, start_up
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sharing.md"
CLASSES_LINE = (
    "  device classes: default (whole GPUs), shared (GPU shares: hami, at most 4 a GPU), "
    "shared-mps (GPU shares: mps, at most 2 a GPU)  (the classes of docs/sharing.md; "
    "TANDEM_CONFIG or --config FILE names others)"
)


@pytest.fixture(scope="module")
def up() -> Iterator[tuple[str, list[str]]]:
    """A plain `tandem up` (no flags): its NATS URL and what it printed at start."""
    printed: list[str] = []
    with start_up(printed=printed) as nats_url:
        yield nats_url, printed


@pytest.fixture(scope="module")
def url(up: tuple[str, list[str]]) -> str:
    return up[0]


def docs_commands() -> list[str]:
    """The `$ tandem ...` lines of docs/sharing.md, "Trying it on one machine" (not `up`)."""
    section = DOCS.read_text().split("## Trying it on one machine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console\n", 1)[1].split("```", 1)[0]
    lines = [line[2:].split("  #")[0].strip() for line in block.splitlines() if line.startswith("$ tandem ")]
    return [line for line in lines if line != "tandem up"]


def status(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(tandem(url, "status", "-o", "json").stdout)
    return doc


def claim_of(url: str, name: str) -> dict[str, Any] | None:
    found = [c for c in status(url)["claims"] if f"{c['namespace']}/{c['name']}" == name]
    return found[-1] if found else None


def test_every_command_of_the_docs_runs_on_a_plain_up() -> None:
    commands = docs_commands()
    assert (
        len(commands) >= 15 and any("--claim" in c for c in commands) and any("--job" in c for c in commands)
    )
    printed: list[str] = []
    with start_up(printed=printed) as nats_url:
        assert CLASSES_LINE in printed, printed
        said = {}
        for command in commands:
            out = tandem(nats_url, *shlex.split(command)[1:])
            said[command] = out.stdout
    # What the page shows, said by the commands it shows.
    shares = next(v for k, v in said.items() if k.startswith("tandem device list"))
    assert re.search(
        r"gpu\d +gpu +shared by infer/a \(20480 MiB, 25 %\), infer/b \(10240 MiB, 50 %\)", shares
    )
    assert "shared by infer/mps (50 %)" in shares
    explained = next(v for k, v in said.items() if k.startswith("tandem explain --pod infer/b"))
    assert "asks     1 GPU share (10240 MiB, 50 % of each GPU) + 0 NICs, class shared" in explained
    reservation = next(v for k, v in said.items() if "--expires-after 1h" in k)
    assert "(claim ml/night-reservation, a reservation until " in reservation
    job = next(v for k, v in said.items() if k.startswith("tandem submit --job"))
    assert re.search(r"^assigned: 2 pods on ", job, re.M), job
    released = next(v for k, v in said.items() if k.startswith("tandem release --job"))
    assert re.search(r"^job allreduce\.[0-9a-f]{8} released: 2 pods freed$", released, re.M), released


def test_up_says_which_classes_it_serves(up: tuple[str, list[str]]) -> None:
    assert CLASSES_LINE in up[1], up[1]


def test_share_sizes_in_submit_device_list_and_explain(url: str) -> None:
    a = tandem(url, "submit", "--pod", "share/a", "--gpus", "1", "--device-class", "shared",
               "--gpu-memory-mib", "30720", "--gpu-cores-percent", "20")  # fmt: skip
    b = tandem(url, "submit", "--pod", "share/b", "--gpus", "1", "--device-class", "shared",
               "--gpu-memory-mib", "8192")  # fmt: skip
    where = [re.search(r"^share/\w +(\S+) +(\d+) \((.*?)\)", out.stdout, re.M) for out in (a, b)]
    assert where[0] and where[0].group(3) == "30720 MiB, 20 %", a.stdout
    assert where[1] and where[1].group(3) == "8192 MiB", b.stdout
    node, gpu = where[0].group(1), f"gpu{where[0].group(2)}"
    assert (where[1].group(1), f"gpu{where[1].group(2)}") == (node, gpu)  # binpack: one GPU, two holders
    table = tandem(url, "device", "list", node).stdout
    assert re.search(
        rf"^{node} +{gpu} +gpu +shared by share/a \(30720 MiB, 20 %\), share/b \(8192 MiB\)$", table, re.M
    )
    devices = json.loads(tandem(url, "device", "list", node, "-o", "json").stdout)
    shared = next(d for d in devices if d["device"] == gpu)
    assert shared["state"] == "shared"
    assert [(h["pod"], h["memory_mib"], h["cores_percent"]) for h in shared["holders"]] == [
        ("share/a", 30720, 20),
        ("share/b", 8192, 0),
    ]
    explained = tandem(url, "explain", "--pod", "share/a").stdout
    assert "\nasks     1 GPU share (30720 MiB, 20 % of each GPU) + 0 NICs, class shared," in explained
    assert re.search(rf"share/a +{node} +{gpu[3:]} \(30720 MiB, 20 %\)", explained), explained
    for pod in ("share/a", "share/b"):
        tandem(url, "release", "--pod", pod)


def test_a_claim_is_held_explained_and_released(url: str) -> None:
    held = tandem(url, "submit", "--claim", "team-c/held", "--gpus", "2", "--rdma", "2", "--wait")
    lines = held.stdout.splitlines()
    rid = re.fullmatch(r"request (claim-[0-9a-f-]{36}) \(claim team-c/held\), trace [0-9a-f]{32}", lines[0])
    assert rid, lines
    node = re.match(r"assigned: node (\S+), ", lines[1])
    assert node, lines
    assert (
        lines[-1] == "held by claim team-c/held until it is released (`tandem release --claim team-c/held`)"
    )
    again = tandem(url, "submit", "--claim", "team-c/held", "--gpus", "2", check=1)
    assert again.stderr.startswith(
        f"tandem: claim team-c/held already has request {rid.group(1)} (assigned on "
    )
    # tandem up keeps the claim's record, as the bridge does in a cluster.
    record = wait_until_sync(
        lambda: (c := claim_of(url, "team-c/held")) and c["phase"] == "Allocated" and c,
        timeout=20, what="the claim's record Allocated", details=lambda: status(url)["claims"],
    )  # fmt: skip
    assert record["node"] == node.group(1) and len(record["devices"]) == 4
    explained = tandem(url, "explain", "--claim", "team-c/held").stdout
    assert explained.startswith(f"request  {rid.group(1)}  claim team-c/held\n")
    assert "\nclaim    held until released; one pod at a time; phase Allocated, pods -\n" in explained
    rows = json.loads(tandem(url, "requests", "-o", "json").stdout)
    assert next(r for r in rows if r["request_id"] == rid.group(1))["claim"]["name"] == "held"
    released = tandem(url, "release", "--claim", "team-c/held").stdout.splitlines()
    assert released[0] == f"release of {rid.group(1)} sent to node {node.group(1)}"
    assert released[-1].startswith(f"freed on {node.group(1)}: gpu")
    wait_until_sync(
        lambda: (c := claim_of(url, "team-c/held")) and (c["phase"], c["reason"]) == ("Released", "released"),
        timeout=20, what="the claim's record Released", details=lambda: status(url)["claims"],
    )  # fmt: skip


def test_a_reservation_is_released_at_its_deadline(url: str) -> None:
    passed = tandem(url, "submit", "--claim", "team-r/late", "--gpus", "1", "--expires-at",
                    "2020-01-01T00:00:00Z", check=2)  # fmt: skip
    assert passed.stderr == "tandem: --expires-at: 2020-01-01T00:00:00Z has passed already\n"
    night = tandem(url, "submit", "--claim", "team-r/night", "--gpus", "4", "--rdma", "4",
                   "--expires-after", "3s", "-o", "json")  # fmt: skip
    doc = json.loads(night.stdout)
    assert doc["state"] == "assigned" and doc["claim"] == "team-r/night" and doc["expires_at"]
    record = wait_until_sync(
        lambda: (c := claim_of(url, "team-r/night")) and c["phase"] == "Released" and c,
        timeout=30, what="the reservation released at its deadline", details=lambda: status(url)["claims"],
    )  # fmt: skip
    assert record["reason"] == "reservation expired" and not record.get("devices")
    wait_until_sync(
        lambda: tandem(url, "explain", doc["request_id"]).stdout.count("state    freed") == 1,
        timeout=30, what="its devices freed after the node's cleanup",
    )  # fmt: skip
    assert "is freed already" in tandem(url, "release", "--claim", "team-r/night").stdout


def test_a_whole_job_is_placed_waited_for_explained_and_released(url: str) -> None:
    placed = json.loads(
        tandem(
            url, "submit", "--job", "team-j/ddp", "--pods", "2", "--gpus", "8", "--rdma", "8", "-o", "json"
        ).stdout
    )
    jid = placed["job_id"]
    assert re.fullmatch(r"ddp\.[0-9a-f]{8}", jid) and placed["state"] == "assigned"
    pods = {a["request_id"]: (a["pod"]["name"], a["node"]) for a in placed["assignments"]}
    assert sorted(pods) == [f"{jid}/0", f"{jid}/1"]
    assert {name for name, _ in pods.values()} == {"ddp-0", "ddp-1"}
    assert len({node for _, node in pods.values()}) == 2  # 8+8 each: two nodes, committed together
    again = tandem(url, "submit", "--job", "team-j/ddp", "--pods", "2", "--gpus", "8", check=1)
    assert again.stderr.startswith(f"tandem: job team-j/ddp already has job {jid} (committed)")
    explained = tandem(url, "explain", "--job", "team-j/ddp").stdout
    assert explained.startswith(f"job      {jid}  job team-j/ddp\n")
    assert "\nasks     2 pods x (8 GPUs + 8 NICs), class default," in explained
    assert "\nstate    committed on " in explained and "team-j/ddp-1" in explained
    pod0 = tandem(url, "explain", f"{jid}/0").stdout
    assert f"\njob      {jid} (`tandem explain {jid}` shows the whole job)\n" in pod0
    table = tandem(url, "requests", "-n", "team-j").stdout
    assert len(re.findall(rf"^{re.escape(jid)}/\d .* job {re.escape(jid)} of 2 pods$", table, re.M)) == 2, (
        table
    )

    # Two 8+8 nodes are left: a job of three waits, and is placed once ddp is released.
    never = tandem(url, "submit", "--job", "team-j/huge", "--pods", "40", "--gpus", "8", check=1)
    assert "unschedulable: no node of this cluster could ever hold it" in never.stdout
    cancelled = tandem(url, "release", "--job", "team-j/huge").stdout
    assert re.search(r"^cancelled: job huge\.[0-9a-f]{8} was not placed; nothing was held$", cancelled, re.M)
    waiter = spawn(url, "submit", "--job", "team-j/wide", "--pods", "3", "--gpus", "8", "--rdma", "8",
                   "--wait", "--timeout", "60")  # fmt: skip
    assert waiter.stdout is not None
    assert waiter.stdout.readline().startswith("job wide.")
    pending = waiter.stdout.readline()
    assert pending.startswith("pending: 3 pods of 8+8"), pending
    released = tandem(url, "release", jid).stdout.splitlines()
    assert released[0].startswith(f"release of job {jid} sent (2 pods on ")
    assert released[-1] == f"job {jid} released: 2 pods freed"
    assert sum(line.startswith("cleanup verified on ") for line in released) == 2
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, (out, err)
    assert re.search(r"^assigned: 3 pods on ", out, re.M), out
    assert "is released already" in tandem(url, "release", "--job", "team-j/ddp").stdout
    assert tandem(url, "release", "--job", "team-j/wide").stdout.endswith("released: 3 pods freed\n")


def test_wrong_combinations_are_one_line_and_exit_2(url: str) -> None:
    for args, said in [
        (["submit", "--job", "t/j", "--gpus", "1"], "--job needs --pods N"),
        (["submit", "--pods", "2", "--gpus", "1"], "--pods goes with --job NAMESPACE/NAME"),
        (
            ["submit", "--claim", "t/c", "--gpus", "1", "--preemption", "lower-priority"],
            "a claim does not evict",
        ),
        (["submit", "--job", "t/j", "--pods", "2", "--gpus", "1", "--gpu-memory-mib", "5"], "whole GPUs"),
        (
            ["submit", "--pod", "t/p", "--gpus", "1", "--expires-after", "1h"],
            "--expires-after goes with --claim",
        ),
        (["submit", "--claim", "t/c", "--gpus", "1", "--expires-after", "5x"], "'5x' is not a duration"),
        (["submit", "--claim", "t/c", "--job", "t/j", "--gpus", "1"], "not allowed with argument"),
        (["release", "--pod", "t/p", "--job", "t/j"], "give one of an id, --pod, --claim or --job"),
    ]:
        out = tandem(url, *args, check=2)
        assert said in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr)
    missing = tandem(url, "explain", "--job", "t/none", check=1)
    assert missing.stderr.startswith("tandem: no job t/none is known")


def test_up_config_names_other_classes(tmp_path: Path) -> None:
    config = tmp_path / "classes.yaml"
    config.write_text("device_classes:\n  default: {}\n  inference: {sharing: hami}\n")
    printed: list[str] = []
    with start_up("pcie-4gpu-2nic:1:box", args=("--config", str(config)), printed=printed) as nats_url:
        assert (
            "  device classes: default (whole GPUs), inference (GPU shares: hami, at most 8 a GPU)  "
            "(from the configuration)"
        ) in printed, printed
        gone = tandem(
            nats_url, "submit", "--gpus", "1", "--device-class", "shared", "--gpu-memory-mib", "1", check=1
        )
        assert "\nrejected: " in gone.stdout
        assert "unknown device class 'shared' (known: default, inference)" in gone.stdout
        ok = tandem(
            nats_url, "submit", "--gpus", "1", "--device-class", "inference", "--gpu-memory-mib", "512"
        )
        assert "(512 MiB)" in ok.stdout
    bad = subprocess.run(
        [TANDEM, "up", "--port", "0", "--config", str(tmp_path / "none.yaml")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "cannot read config file" in bad.stderr and "check --config" in bad.stderr
