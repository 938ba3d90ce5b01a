"""`tandem up` in one process and the other commands driving it from others, as a user would."""

from __future__ import annotations

import contextlib
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
def start_up(*fleet: str) -> Iterator[str]:
    """``tandem up`` with ``fleet`` (``--node`` specs) in a process of its own; yields its NATS
    URL and stops it with Ctrl-C (SIGINT) afterwards, which must exit 0. Its output goes to a
    file: a pipe nobody reads would fill up and stall it."""
    port = free_port()
    nodes = [a for spec in fleet for a in ("--node", spec)]
    with tempfile.TemporaryFile("w+") as log:
        up = subprocess.Popen(
            [TANDEM, "up", "--port", str(port), *nodes], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                log.seek(0)
                if "Tandem is up" in log.read():
                    break
                assert time.monotonic() < deadline and up.poll() is None, "tandem up did not come up"
                time.sleep(0.1)
            yield f"nats://127.0.0.1:{port}"
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


def test_commands_without_a_running_system_fail_with_one_line() -> None:
    out = tandem("status", url=f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert out.stderr.startswith("tandem: cannot reach NATS") and "Traceback" not in out.stderr
