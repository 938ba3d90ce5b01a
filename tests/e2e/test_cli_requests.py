"""`tandem requests`, `--pod`, the waiting `release`, `submit --wait`, never-fits, `-o json|yaml`,
`status --watch` and `--version`, each run as a user runs them: a subprocess against `tandem up`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any
from xml.etree import ElementTree

import pytest
import yaml

from tests.e2e.test_cli_up import TANDEM, start_up
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """Two nodes of 4 GPUs and 2 NICs each (box-0, box-1)."""
    with start_up("pcie-4gpu-2nic:2:box") as nats_url:
        yield nats_url


def tandem(url: str, *args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_NATS_URL"}
    out = subprocess.run([TANDEM, *args, "--nats", url], capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in out.stderr, out.stderr
    if check is not None:
        assert out.returncode == check, (out.returncode, out.stdout, out.stderr)
    return out


def spawn(url: str, *args: str) -> subprocess.Popen[str]:
    """``tandem ARGS --nats URL`` running on, its output read as it comes (waits, watches).

    Ctrl-C reaches it as at a terminal: SIGINT back to its default disposition in the child,
    since a suite started in the background (``make test &`` from a script) runs with SIGINT
    ignored, which children inherit and with which Python never raises KeyboardInterrupt."""
    return subprocess.Popen(
        [TANDEM, *args, "--nats", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def requests_json(url: str, *filters: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(tandem(url, "requests", *filters, "-o", "json").stdout)
    return rows


def by_pod(rows: list[dict[str, Any]], pod: str) -> dict[str, Any]:
    found = [r for r in rows if r["pod"] == pod]
    assert len(found) == 1, rows
    return found[0]


def test_requests_pod_release_and_formats(url: str) -> None:
    placed = tandem(url, "submit", "--pod", "team-a/trainer", "--gpus", "2", "--rdma", "2")
    rid = placed.stdout.split()[1]
    assert placed.stdout.splitlines()[1].startswith("assigned: node box-")
    # A request no node could ever hold: said at once, apart from "busy now".
    huge = tandem(url, "submit", "--pod", "team-b/huge", "--gpus", "16", check=1)
    assert "\npending: no node can take 16 GPUs" in huge.stdout
    assert "unschedulable: no node of this cluster could ever hold it" in huge.stdout
    assert "fewer than 16 GPUs" in huge.stdout
    rejected = tandem(
        url, "submit", "--pod", "team-b/odd", "--gpus", "1", "--device-class", "nosuch", check=1
    )
    assert "\nrejected: " in rejected.stdout and "unknown device class 'nosuch'" in rejected.stdout

    rows = requests_json(url)
    mine = by_pod(rows, "team-a/trainer")
    assert mine["request_id"] == rid and mine["state"] in ("assigned", "applied")
    assert mine["node"].startswith("box-") and len(mine["devices"]) == 4 and mine["trace_id"]
    assert by_pod(rows, "team-b/huge")["state"] == "pending"
    assert by_pod(rows, "team-b/odd")["state"] == "rejected"
    # Filters, the alias and the other formats agree with the JSON.
    assert [r["pod"] for r in requests_json(url, "--state", "pending")] == ["team-b/huge"]
    assert {r["pod"] for r in requests_json(url, "--namespace", "team-b")} == {"team-b/huge", "team-b/odd"}
    assert [r["pod"] for r in requests_json(url, "--node", mine["node"])] == ["team-a/trainer"]
    alias = json.loads(tandem(url, "get", "requests", "-o", "json").stdout)
    assert [(r["request_id"], r["state"], r["devices"]) for r in alias] == [
        (r["request_id"], r["state"], r["devices"]) for r in rows
    ]  # (ages move between two calls)
    as_yaml = yaml.safe_load(tandem(url, "get", "requests", "-o", "yaml").stdout)
    assert {r["request_id"]: r["state"] for r in as_yaml} == {r["request_id"]: r["state"] for r in rows}
    table = tandem(url, "requests").stdout.splitlines()
    assert table[0].split() == ["request", "pod", "state", "node", "devices", "age", "reason"]
    assert any(line.startswith(rid) and "team-a/trainer" in line for line in table)
    wide = tandem(url, "requests", "-o", "wide").stdout
    assert "trace" in wide.splitlines()[0] and mine["trace_id"] in wide

    # --pod works wherever a request id does.
    explained = tandem(url, "explain", "--pod", "team-a/trainer")
    assert explained.stdout.startswith(f"request  {rid}  pod team-a/trainer")
    doc = json.loads(tandem(url, "explain", "--pod", "team-a/trainer", "-o", "json").stdout)
    assert doc["request_id"] == rid and doc["assignment"]["node"] == mine["node"]

    # A wrong --node is an error and releases nothing.
    other = "box-1" if mine["node"] == "box-0" else "box-0"
    wrong = tandem(url, "release", "--pod", "team-a/trainer", "--node", other, check=2)
    assert f"is on node {mine['node']}, not {other}" in wrong.stderr
    assert by_pod(requests_json(url), "team-a/trainer")["state"] in ("assigned", "applied")
    # The release right after it is not swallowed, and waits for the verified cleanup.
    released = tandem(url, "release", "--pod", "team-a/trainer")
    lines = released.stdout.splitlines()
    assert lines[0] == f"release of {rid} sent to node {mine['node']}"
    assert lines[1].startswith(f"cleanup verified on {mine['node']}: ")
    assert lines[2].startswith(f"freed on {mine['node']}: ")
    assert set(lines[2].split(": ", 1)[1].split(", ")) == set(mine["devices"])
    assert by_pod(requests_json(url), "team-a/trainer")["state"] == "freed"
    again = tandem(url, "release", rid)
    assert "is freed already" in again.stdout

    # Releasing a pending request cancels it (and waits for that too).
    cancelled = tandem(url, "release", "--pod", "team-b/huge")
    assert "cancelled:" in cancelled.stdout
    assert by_pod(requests_json(url), "team-b/huge")["state"] == "cancelled"


def test_submit_asks_shares_and_mig_instances_and_says_why_not(url: str) -> None:
    # The fleet's class hands out whole GPUs only and no GPU is in MIG mode: each request is
    # refused with the reason a pod author needs, and a malformed profile never leaves the CLI.
    share = tandem(url, "submit", "--pod", "team-c/infer", "--gpus", "1", "--gpu-memory-mib", "4096", check=1)
    assert "\nrejected: " in share.stdout and "shar" in share.stdout
    mig = tandem(url, "submit", "--pod", "team-c/mig", "--gpus", "1", "--mig-profile", "1g.10gb", check=1)
    assert "MIG instance 1g.10gb" in mig.stdout
    assert "unschedulable: no node of this cluster could ever hold it" in mig.stdout
    bad = tandem(url, "submit", "--gpus", "1", "--mig-profile", "huge", check=2)
    assert "invalid request" in bad.stderr and "mig_profile" in bad.stderr
    tandem(url, "release", "--pod", "team-c/mig")


def test_submit_wait_shows_progress_until_assigned(url: str) -> None:
    fill = [tandem(url, "submit", "--pod", f"fill/f{i}", "--gpus", "4") for i in range(2)]
    assert all("assigned: node box-" in f.stdout for f in fill)
    waiter = spawn(url, "submit", "--pod", "wait/w", "--gpus", "3", "--wait", "--timeout", "40")
    assert waiter.stdout is not None
    assert waiter.stdout.readline().startswith("request ")
    pending = waiter.stdout.readline()
    assert pending.startswith("pending: no node can take 3 GPUs"), pending
    tandem(url, "release", "--pod", "fill/f0")
    out, err = waiter.communicate(timeout=40)
    assert waiter.returncode == 0, (out, err)
    assert "assigned: node box-" in out and ", trace " in out
    # Placed now: the reason it waited for is gone from its record, and its age counts from
    # the submit, not from the last write.
    explained = tandem(url, "explain", "--pod", "wait/w").stdout
    assert "\nasks     3 GPUs + 0 NICs, class default, the class's scope, the class's policy\n" in explained
    state = r"\nstate    assigned on box-\d \(submitted \d+s ago, last update \d+s ago\)\n"
    assert re.search(state, explained), explained
    assert "\nreason" not in explained, explained
    tandem(url, "release", "--pod", "fill/f1")
    tandem(url, "release", "--pod", "wait/w")


def test_ctrl_c_while_waiting_stops_the_command_not_the_request(url: str) -> None:
    fill = tandem(url, "submit", "--pod", "fill/g0", "--gpus", "4", "--rdma", "2")
    fill2 = tandem(url, "submit", "--pod", "fill/g1", "--gpus", "4", "--rdma", "2")
    assert "assigned" in fill.stdout and "assigned" in fill2.stdout
    waiter = spawn(url, "submit", "--pod", "wait/c", "--gpus", "1", "--wait")
    assert waiter.stdout is not None
    rid = waiter.stdout.readline().split()[1]
    assert waiter.stdout.readline().startswith("pending: "), "the request did not wait"
    waiter.send_signal(signal.SIGINT)
    _, err = waiter.communicate(timeout=20)
    assert waiter.returncode == 130, err
    assert err == (
        f"tandem: interrupted; request {rid} goes on without this command "
        f"(`tandem explain {rid}` follows it, `tandem release {rid}` withdraws it)\n"
    )
    assert "\nstate    pending (submitted " in tandem(url, "explain", rid).stdout
    for pod in ("fill/g0", "fill/g1", "wait/c"):
        tandem(url, "release", "--pod", pod)


def test_read_commands_speak_json_and_yaml(url: str) -> None:
    status = json.loads(tandem(url, "status", "-o", "json").stdout)
    assert sorted(n["node"] for n in status["nodes"]) == ["box-0", "box-1"]
    assert all(n["gpus"] == 4 and n["nics"] == 2 for n in status["nodes"])
    devices = yaml.safe_load(tandem(url, "device", "list", "box-1", "-o", "yaml").stdout)
    assert [d["device"] for d in devices] == ["gpu0", "gpu1", "gpu2", "gpu3", "mlx5_0", "mlx5_1"]
    cordon = tandem(url, "device", "cordon", "box-1", "gpu3", "--reason", "fan noise")
    assert "cordoned" in cordon.stdout
    devices = json.loads(tandem(url, "device", "list", "box-1", "-o", "json").stdout)
    gpu3 = next(d for d in devices if d["device"] == "gpu3")
    assert gpu3["cordoned"] is True and gpu3["reason"] == "fan noise"
    tandem(url, "device", "uncordon", "box-1", "gpu3")
    # A healthy device recovered: nothing to say why, and no empty "()".
    assert tandem(url, "device", "recover", "box-1", "gpu2").stdout == "box-1/gpu2: healthy\n"
    topo = json.loads(
        subprocess.run(
            [TANDEM, "topology", "show", "dgx-h100", "-o", "json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert topo["name"] == "dgx-h100"
    assert json.loads(tandem(url, "dlq", "-o", "json").stdout) == []


def test_status_watch_prints_until_ctrl_c(url: str) -> None:
    watch = spawn(url, "status", "--watch", "--interval", "0.2", "-o", "json")
    assert watch.stdout is not None
    docs = [json.loads(watch.stdout.readline()) for _ in range(3)]
    assert all(len(d["nodes"]) == 2 for d in docs)
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=20)
    assert watch.returncode == 130 and err == ""  # Ctrl-C's code, as the README says


def test_version() -> None:
    out = subprocess.run([TANDEM, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("tandem 0.") and out.stderr == ""


def test_topology_show_live_draws_each_devices_state(url: str) -> None:
    placed = tandem(url, "submit", "--pod", "team-t/live", "--gpus", "1")
    node = re.search(r"assigned: node (\S+),", placed.stdout)
    assert node, placed.stdout
    tandem(url, "device", "cordon", node.group(1), "gpu3", "--reason", "fan noise")
    tree = tandem(url, "topology", "show", node.group(1), "--live").stdout
    assert re.search(r"GPU gpu\d .*\[used by team-t/live\]", tree), tree
    assert re.search(r"GPU gpu3 .*\[.*cordoned.*fan noise.*\]", tree), tree
    assert "[free]" in tree
    svg = tandem(url, "topology", "show", node.group(1), "--live", "--format", "svg").stdout
    root = ElementTree.fromstring(svg)  # well-formed SVG
    ns = "{http://www.w3.org/2000/svg}"
    boxes = {g.get("data-device"): g for g in root.iter(f"{ns}g") if g.get("class") == "device"}
    assert {"gpu0", "gpu1", "gpu2", "gpu3"} <= set(boxes)
    fills = {d: g.find(f"{ns}rect").get("fill") for d, g in boxes.items()}  # type: ignore[union-attr]
    assert fills["gpu3"] != fills[next(d for d in boxes if d.startswith("gpu") and d != "gpu3")]
    dot = tandem(url, "topology", "show", node.group(1), "--live", "--format", "dot").stdout
    assert dot.startswith("digraph") and "used by team-t/live" in dot
    missing = tandem(url, "topology", "show", "no-such-node", "--live", check=1)
    assert "no node 'no-such-node' is known" in missing.stderr
    tandem(url, "device", "uncordon", node.group(1), "gpu3")
    tandem(url, "release", "--pod", "team-t/live")


def test_one_pod_one_live_request_unless_asked(url: str) -> None:
    first = tandem(url, "submit", "--pod", "team/big3", "--gpus", "2")
    rid = first.stdout.split()[1]
    assert "assigned: node box-" in first.stdout
    again = tandem(url, "submit", "--pod", "team/big3", "--gpus", "2", check=1)
    assert again.stdout == ""
    assert again.stderr.startswith(f"tandem: pod team/big3 already has request {rid} (assigned on box-")
    assert "`tandem release --pod team/big3` first, or --new" in again.stderr
    second = tandem(url, "submit", "--pod", "team/big3", "--gpus", "1", "--new")
    rid2 = second.stdout.split()[1]
    explained = tandem(url, "explain", "--pod", "team/big3")
    assert explained.stdout.startswith(f"request  {rid2}  pod team/big3")
    assert explained.stderr == (
        f"note: pod team/big3 has 2 live requests; the newest is shown, the others: {rid}\n"
    )
    tandem(url, "release", rid2)
    tandem(url, "release", rid)
    # Released: the pod may ask again.
    third = tandem(url, "submit", "--pod", "team/big3", "--gpus", "2")
    tandem(url, "release", third.stdout.split()[1])


def test_submit_wait_follows_a_preemption_until_assigned(url: str) -> None:
    """`tandem up` plays the bridge's eviction; the CLI waits past its first-answer limit and
    prints each step: preempting, the victim released, assigned."""
    low = [tandem(url, "submit", "--pod", f"low/l{i}", "--gpus", "4") for i in range(2)]
    victims = {line.split()[1] for line in (p.stdout.splitlines()[0] for p in low)}
    urgent = tandem(
        url, "submit", "--pod", "urgent/u3", "--gpus", "4", "--priority", "50",
        "--preemption", "lower-priority", "--wait", "--timeout", "40",
    )  # fmt: skip
    lines = urgent.stdout.splitlines()
    assert lines[0].startswith("request "), lines
    preempting = re.fullmatch(
        r"preempting: evicting 1 allocation of lower priority on (box-\d): (\S+) \(pod low/l\d, priority 0\)",
        lines[1],
    )
    assert preempting, lines
    node, victim = preempting.groups()
    assert victim in victims
    assert lines[2] == f"victim released: {victim} freed on {node}", lines
    assert lines[3].startswith(f"assigned: node {node}, "), lines
    # Without --wait: said at once (exit 1), and it goes on to be placed.
    second = tandem(
        url, "submit", "--pod", "urgent/u4", "--gpus", "4", "--priority", "50",
        "--preemption", "lower-priority", check=1,
    )  # fmt: skip
    assert second.stdout.splitlines()[1].startswith("preempting: evicting 1 allocation"), second.stdout
    assert "`tandem submit --wait` waits" in second.stdout
    rid = second.stdout.split()[1]
    wait_until_sync(
        lambda: "state    assigned" in tandem(url, "explain", rid).stdout,
        timeout=30,
        what=f"{rid} assigned once its victim was evicted",
        details=lambda: tandem(url, "explain", rid).stdout,
    )
    for pod in ("urgent/u3", "urgent/u4"):
        tandem(url, "release", "--pod", pod)


@pytest.mark.parametrize("collector", ["a closed port", "a server that never answers"])
def test_an_unreachable_collector_neither_slows_nor_clutters_a_command(url: str, collector: str) -> None:
    """The same submit with and without OTEL_EXPORTER_OTLP_ENDPOINT pointing at a collector
    that cannot take its spans, in one run: no exporter retry lines, its trace id printed, and
    well within 3 s more (it was ~8 s; the command now waits at most CLI_FLUSH_S for it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_NATS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT")}

    def submit(pod: str, extra: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
        t0 = time.monotonic()
        out = subprocess.run(
            [TANDEM, "submit", "--pod", pod, "--gpus", "1", "--nats", url],
            capture_output=True, text=True, timeout=60, env={**env, **extra},
        )  # fmt: skip
        return time.monotonic() - t0, out

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if collector == "a server that never answers":
            s.listen()  # connections complete (the kernel's backlog), requests get no answer
        port = s.getsockname()[1]  # a closed port: nothing listens once the socket is closed
        if collector == "a closed port":
            s.close()
        plain_s, plain = submit("otel/plain", {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
        dead_s, dead = submit("otel/dead", {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert plain.returncode == 0 and dead.returncode == 0, (plain, dead)
    assert dead.stderr == "", dead.stderr  # no "Transient error ... retrying" lines
    assert re.search(r", trace [0-9a-f]{32}\nassigned: node box-\d, .*, trace [0-9a-f]{32}", dead.stdout)
    assert dead_s - plain_s < 3.0, (plain_s, dead_s)
    for pod in ("otel/plain", "otel/dead"):
        tandem(url, "release", "--pod", pod)
