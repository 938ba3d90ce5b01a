"""`tandem up` in one process and the other commands driving it from others, as a user would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

TANDEM = str(Path(sys.executable).parent / "tandem")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def start_up(
    *fleet: str,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    printed: list[str] | None = None,
) -> Iterator[str]:
    """``tandem up`` with ``fleet`` (``--node`` specs; none: its default fleet) and ``args`` in
    a process of its own; yields its NATS URL and stops it with Ctrl-C (SIGINT) afterwards,
    which must exit 0. Its output goes to a file: a pipe nobody reads would fill up and stall
    it. ``printed`` gets what it printed up to its last start-up line."""
    nodes = [a for spec in fleet for a in ("--node", spec)]
    with tempfile.TemporaryFile("w+") as log:
        # --port 0: any free port, read back from what `tandem up` prints.
        up = subprocess.Popen(
            [TANDEM, "up", "--port", "0", *nodes, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                log.seek(0)
                text = log.read()
                found = re.search(r"Tandem is up: .* NATS at (nats://127\.0\.0\.1:\d+)\n", text)
                if found and "  export TANDEM_NATS_URL=" in text:
                    break
                assert time.monotonic() < deadline and up.poll() is None, "tandem up did not come up"
                time.sleep(0.1)
            if printed is not None:
                printed.extend(text.splitlines())
            yield found.group(1)
        finally:
            up.send_signal(signal.SIGINT)
            rc = up.wait(30)
        log.seek(0)
        assert rc == 0, log.read()[-2000:]


def tandem(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TANDEM, *args, "--nats", url], capture_output=True, text=True, timeout=30)


def test_up_submit_status_device_release_and_ctrl_c() -> None:
    port = free_port()
    up = subprocess.Popen(
        [TANDEM, "up", "--port", str(port), "--node", "pcie-4gpu-2nic:2:box"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"},
    )
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while "Tandem is up" not in line:
            assert time.monotonic() < deadline and up.poll() is None, "tandem up did not come up"
            line = up.stdout.readline()
        url = f"nats://127.0.0.1:{port}"
        assert url in line
        said = [up.stdout.readline()]
        while not said[-1].startswith("  export TANDEM_NATS_URL"):
            said.append(up.stdout.readline())
        # Whether traces go anywhere is said at start, with the way to see them.
        assert "  traces: not exported (`tandem up --jaeger` starts a local Jaeger; " in "".join(said), said

        sub = tandem("submit", "--pod", "team/trainer", "--gpus", "2", "--rdma", "2", url=url)
        assert sub.returncode == 0, sub.stderr
        rid = re.search(
            r"request (\S+) \(pod team/trainer\), trace ([0-9a-f]{32})\n"
            r"assigned: node (box-\d), .*trace ([0-9a-f]{32})",
            sub.stdout,
        )
        assert rid, sub.stdout
        assert rid.group(2) == rid.group(4)  # one trace: the submit's is the assignment's
        assert "team/trainer" in sub.stdout and "pcie-switch" in sub.stdout

        status = tandem("status", "--devices", url=url)
        assert status.returncode == 0, status.stderr
        assert re.search(rf"{rid.group(3)}\s+ready\s+2/4\s+2/2", status.stdout), status.stdout

        dev = tandem("device", "cordon", "box-0", "gpu3", "--reason", "fan noise", url=url)
        assert dev.returncode == 0 and "cordoned" in dev.stdout and "fan noise" in dev.stdout

        too_big = tandem("submit", "--gpus", "9", url=url)  # more than any node has
        assert too_big.returncode == 1 and "\npending: no node can take 9 GPUs" in too_big.stdout
        assert "unschedulable: no node of this cluster could ever hold it" in too_big.stdout
        pending_id = too_big.stdout.split()[1]
        why = tandem("explain", pending_id, url=url)
        assert why.returncode == 0 and "state    pending" in why.stdout and "9 GPUs" in why.stdout
        assert "reason" in why.stdout

        bad = tandem("submit", "--gpus", "-1", url=url)
        assert bad.returncode == 2 and "--gpus: must not be negative" in bad.stderr

        dlq = tandem("dlq", url=url)  # nothing was undecodable: an empty table, not an error
        assert dlq.returncode == 0 and dlq.stdout.splitlines()[0].split() == [
            "time",
            "(UTC)",
            "service",
            "subject",
            "size",
            "error",
        ]
        assert len(dlq.stdout.splitlines()) == 2

        rel = tandem("release", rid.group(1), url=url)
        assert rel.returncode == 0, rel.stderr
        assert f"freed on {rid.group(3)}: gpu" in rel.stdout, rel.stdout
    finally:
        up.send_signal(signal.SIGINT)
        rc = up.wait(20)
    assert rc == 0


def _processes_naming(text: str) -> list[str]:
    """Command lines of running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile
            cmdline = (entry / "cmdline").read_bytes()
            if text.encode() in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def _up_refused(*args: str, tmp: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``tandem up ARGS`` expected to refuse at start; its temporary files go under ``tmp``
    (TMPDIR), which the caller checks for leftovers."""
    return subprocess.run(
        [TANDEM, "up", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp), **(env or {})},
    )


def test_up_refuses_a_taken_port_and_starts_nothing(tmp_path: Path) -> None:
    """Moving NATS to another port quietly would leave TANDEM_NATS_URL pointed at whatever
    holds the port; `tandem up` says so and stops, leaving nothing behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = _up_refused("--port", str(port), tmp=tmp)
    assert result.returncode == 2, result
    assert f"tandem: --port {port}: 127.0.0.1:{port} is already in use" in result.stderr
    assert "--port 0 for any free one" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp.iterdir()) == []
    assert _processes_naming(str(tmp)) == []


def test_up_with_a_bad_config_names_it_and_leaves_no_nats_server(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_clases: {}\n")
    result = _up_refused("--port", "0", tmp=tmp, env={"TANDEM_CONFIG": str(bad)})
    assert result.returncode == 2, result
    assert "device_clases" in result.stderr and str(bad) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # The NATS server's store would be a directory under TMPDIR, and the server a process
    # naming it: neither is left.
    assert list(tmp.iterdir()) == []
    assert _processes_naming(str(tmp)) == []


def test_commands_without_a_running_system_fail_with_one_line() -> None:
    out = tandem("status", url=f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert out.stderr.startswith("tandem: cannot reach NATS") and "Traceback" not in out.stderr


def test_the_cli_does_not_judge_with_classes_the_system_does_not_share(tmp_path: Path) -> None:
    """`tandem up` serves a `shared` class from its TANDEM_CONFIG; the CLI, without it, must
    not call the request unschedulable for an 'unknown device class' (the allocator knows it,
    and says why it waits)."""
    config = tmp_path / "tandem.yaml"
    config.write_text("device_classes:\n  default: {}\n  shared: {sharing: hami}\n")
    with start_up("pcie-4gpu-2nic:1:box", env={"TANDEM_CONFIG": str(config)}) as url:
        env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_CONFIG", "TANDEM_NATS_URL")}
        out = subprocess.run(
            [TANDEM, "submit", "--pod", "t/s", "--gpus", "1", "--device-class", "shared",
             "--gpu-memory-mib", "900000", "--nats", url],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert "unknown device class" not in out.stdout + out.stderr, out
    lines = out.stdout.splitlines()
    assert lines[1].startswith("pending: ") and "900000" in lines[1], out.stdout
    assert out.returncode == 1, out
