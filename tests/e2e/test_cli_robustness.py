"""The CLI never answers with a traceback: every bad input, and every server state a user can
reach, ends in one line ``tandem: <what> (<what to do>)`` and a documented exit code (1 the
command did not succeed, 2 bad usage or input). Each case runs ``tandem`` as a subprocess,
against a running system (``tandem up``), a NATS server without Tandem's streams, or nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.runtime.process.embedded import EmbeddedNats
from tests.e2e.test_cli_up import TANDEM, free_port, start_up

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def system() -> Iterator[str]:
    """A running system with two 4-GPU nodes (box-0, box-1); its NATS URL."""
    with start_up("pcie-4gpu-2nic:2:box") as url:
        yield url


@pytest.fixture(scope="module")
def bare() -> Iterator[str]:
    """A NATS server with JetStream but none of Tandem's streams or buckets."""
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("inputs")
    binary = d / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 8)
    cluster = d / "cluster.yaml"
    cluster.write_text("- topology: dgx-h100\n")
    return {"binary": str(binary), "cluster": str(cluster), "missing": str(d / "missing.txt")}


def run(*args: str, env_url: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_NATS_URL"}
    if env_url is not None:
        env["TANDEM_NATS_URL"] = env_url
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    where = f"rc={out.returncode} stdout={out.stdout!r} stderr={out.stderr!r}"
    assert "Traceback" not in out.stderr + out.stdout, where
    assert out.returncode == code, where
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: "), where
    assert needle in lines[0], where


# (arguments, exit code, what the line must say); "{...}" are filled from the fixtures.
USAGE_CASES = [
    ([], 2, "required: COMMAND"),
    (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
    (["explain", ""], 2, "'' is not a request id"),
    (["explain"], 2, "name the request"),
    (["explain", "x.1", "--pod", "a/b"], 2, "not both"),
    (["explain", "a b"], 2, "is not a request id"),
    (["release", "--pod", "noslash"], 2, "is not NAMESPACE/NAME"),
    (["release", "--pod", "a/b/c"], 2, "is not NAMESPACE/NAME"),
    (["device", "fail", "box-0"], 2, "needs NODE and DEVICE"),
    (["device", "list", "box-0", "gpu0"], 2, "at most a NODE"),
    (["device", "explode", "box-0", "gpu0"], 2, "invalid choice: 'explode'"),
    (["up", "--node", "nosuch"], 2, "no built-in topology 'nosuch'"),
    (["up", "--node", "dgx-h100:abc"], 2, "COUNT must be a whole number"),
    (["up", "--node", "dgx-h100:0"], 2, "COUNT must be a whole number >= 1"),
    (["up", "--node", "dgx-h100:2:BAD_"], 2, "not valid Kubernetes node names"),
    (["up", "--node", "{binary}"], 2, "--node"),
    (["up", "--port", "99999"], 2, "a TCP port is 1-65535"),
    (["up", "--allocators", "0"], 2, "must be at least 1"),
    (["plan", "--cluster", "{cluster}", "--requests", "{binary}"], 2, "not UTF-8 text"),
    (["plan", "--cluster", "{binary}", "--requests", "{binary}"], 2, "not UTF-8 text"),
    (["plan", "--cluster", "{cluster}", "--requests", "{missing}"], 2, "cannot read"),
    (["topology", "show", "{binary}"], 2, "not valid YAML"),
    (["topology", "show", "nosuch"], 2, "nosuch"),
    (["topology", "import", "--nvidia-smi", "{missing}"], 2, "cannot read"),
    (["status", "--nats", "nats://127.0.0.1:99999"], 2, "Port out of range"),
    (["status", "--nats", "foo://127.0.0.1:4222"], 2, "scheme must be one of"),
    (["status", "--nats", " , "], 2, "no NATS URL"),
    (["status", "--interval", "0"], 2, "positive number of seconds"),
    (["status", "--interval", "soon"], 2, "not a number of seconds"),
    (["submit", "--gpus", "-1"], 2, "--gpus: must not be negative"),
    (["submit", "--gpus", "two"], 2, "not a whole number"),
    (["submit", "--gpus", "1", "--timeout", "-3"], 2, "positive number of seconds"),
    (["requests", "--state", "bogus"], 2, "invalid choice: 'bogus'"),
    (["requests", "--state", "applied"], 2, "invalid choice: 'applied'"),  # never written
    (["requests", "-o", "xml"], 2, "invalid choice: 'xml'"),
    (["dlq", "--limit", "0"], 2, "must be at least 1"),
]


@pytest.mark.parametrize(("args", "code", "needle"), USAGE_CASES, ids=lambda v: repr(v)[:40])
def test_bad_usage_is_one_line(args: list[str], code: int, needle: str, files: dict[str, str]) -> None:
    filled = [a.format(**files) for a in args]
    assert_one_line(run(*filled), code, needle.format(**files))


# Against the running system: well-formed commands that cannot succeed (exit 1) and inputs
# only the system can tell are wrong.
SYSTEM_CASES = [
    (["release", "nosuch.1"], 1, "no request 'nosuch.1' is known"),
    (["explain", "nosuch.1"], 1, "no request 'nosuch.1' is known"),
    (["explain", "--pod", "nobody/here"], 1, "no request of pod nobody/here"),
    (["release", "--pod", "nobody/here"], 1, "no request of pod nobody/here"),
    (["device", "fail", "NOSUCHNODE", "gpu0"], 1, "no node 'NOSUCHNODE' is known"),
    (["device", "fail", "a.*", "gpu0"], 1, "no node 'a.*' is known"),
    (["device", "cordon", "box-0", "gpu99"], 1, "node box-0 has no device 'gpu99'"),
    (["device", "list", "nosuch"], 1, "no node 'nosuch' is known"),
    (["submit", "--gpus", "65"], 2, "invalid request"),
    (["submit", "--gpus", "1", "--mtu", "5"], 2, "invalid request"),
    (["submit", "--gpus", "1", "--pod", "noslash"], 2, "is not NAMESPACE/NAME"),
    (["submit", "--gpus", "1", "--pod", "Team/trainer-1"], 2, "'Team' is not a Kubernetes namespace name"),
    (["submit", "--gpus", "1", "--pod", "team/Trainer_1"], 2, "'Trainer_1' is not a Kubernetes pod name"),
    (["release", "--pod", "team/-x"], 2, "'-x' is not a Kubernetes pod name"),
    (["requests", "--node", "nosuch-9"], 1, "no node 'nosuch-9' is known"),
]


@pytest.mark.parametrize(("args", "code", "needle"), SYSTEM_CASES, ids=lambda v: repr(v)[:40])
def test_system_answers_are_one_line(args: list[str], code: int, needle: str, system: str) -> None:
    assert_one_line(run(*args, "--nats", system), code, needle)


BARE_CASES = [
    ["status"],
    ["status", "-o", "json"],
    ["requests"],
    ["explain", "x.1"],
    ["explain", "--pod", "a/b"],
    ["release", "x.1"],
    ["dlq"],
    ["device", "list"],
    ["device", "fail", "n1", "gpu0"],
    ["submit", "--gpus", "1"],
]


@pytest.mark.parametrize("args", BARE_CASES, ids=lambda v: " ".join(v))
def test_a_nats_without_tandem_is_named_at_once(args: list[str], bare: str) -> None:
    t0 = time.monotonic()
    out = run(*args, env_url=bare)  # the URL from the environment, as users set it
    assert_one_line(out, 1, "has no Tandem streams or buckets")
    assert time.monotonic() - t0 < 10, "the CLI waited instead of failing at once (submit hung 32 s)"


def test_nothing_listening_is_one_line() -> None:
    out = run("requests", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert_one_line(out, 1, "connection refused")


def test_a_closed_pipe_ends_quietly(system: str) -> None:
    """`tandem status --devices | head -1`: the reader goes away; no BrokenPipeError."""
    proc = subprocess.Popen(
        [TANDEM, "status", "--devices", "--nats", system],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read()
    assert proc.wait(30) == 141, err  # as `yes | head` reports: 128 + SIGPIPE
    assert err == ""


def test_an_unwritable_directory_is_a_failure_not_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run("schema", "export", str(blocker / "dir"))
    assert_one_line(out, 1, str(blocker))


def test_plan_into_a_closed_pipe_blames_no_input_file(tmp_path: Path) -> None:
    """`tandem plan … | head -1`: the reader leaves after one line; that is not a fault of
    the requests file (it was reported as `cannot read: Broken pipe`, exit 2)."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("- {topology: dgx-h100, count: 4, prefix: h}\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "".join(json.dumps({"kind": "alloc", "id": f"r{i}", "gpus": 1}) + "\n" for i in range(5000))
    )
    proc = subprocess.Popen(
        [TANDEM, "plan", "--cluster", str(cluster), "--requests", str(requests)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())["id"] == "r0"
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(60) == 141, err
    assert err == ""
