"""``python -m bench.cli_startup`` (``make bench-cli``): how long ``tandem`` commands take, as a
user waits for them — wall clock of a fresh process, from exec to exit.

Measured: ``tandem --help``, ``tandem --version``, a usage error, ``tandem topology list``
(no NATS, no Kubernetes), and the commands that read a running system (``status``,
``requests``, ``explain``, ``device list``) against a ``tandem up`` this script starts with
two simulated nodes and one placed request. Each command runs ``--runs`` times after one
warm-up run (the page cache holds the modules, as on any machine where tandem was used
before); the table gives the median and the slowest run, and ``python -c pass`` as the floor
of the interpreter itself. The target of issue 11 is ``tandem --help`` and any command that
does not need Kubernetes under 0.5 s.

One JSON line of the figures goes to stdout after the table (``--json``: only the line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TANDEM = str(Path(sys.executable).parent / "tandem")
TARGET_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time(argv: list[str], runs: int, env: dict[str, str]) -> list[float]:
    subprocess.run(argv, capture_output=True, env=env, timeout=60)  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, env=env, timeout=60)
        times.append(time.perf_counter() - t0)
    return times


def _start_up(log: tempfile._TemporaryFileWrapper[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    up = subprocess.Popen(
        [TANDEM, "up", "--port", str(port), "--node", "pcie-4gpu-2nic:2:box"], stdout=log, stderr=log
    )
    deadline = time.monotonic() + 60
    while True:
        log.seek(0)
        if "Tandem is up" in log.read():
            return up, f"nats://127.0.0.1:{port}"
        if time.monotonic() > deadline or up.poll() is not None:
            raise SystemExit("tandem up did not come up")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_NATS_URL"}
    commands: dict[str, list[str]] = {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        "tandem --help": [TANDEM, "--help"],
        "tandem --version": [TANDEM, "--version"],
        "tandem submit (usage error)": [TANDEM, "submit"],
        "tandem topology list": [TANDEM, "topology", "list"],
    }
    with tempfile.NamedTemporaryFile("w+") as log:
        up, url = _start_up(log)
        try:
            submit = subprocess.run(
                [TANDEM, "submit", "--pod", "bench/p", "--gpus", "2", "--nats", url],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            rid = submit.stdout.split()[1]
            for name, rest in {
                "tandem status": ["status"],
                "tandem requests": ["requests"],
                "tandem explain ID": ["explain", rid],
                "tandem device list": ["device", "list"],
            }.items():
                commands[name] = [TANDEM, *rest, "--nats", url]
            results = {name: _time(argv, args.runs, env) for name, argv in commands.items()}
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(30)
    rows = {
        name: {"median_s": round(statistics.median(t), 3), "max_s": round(max(t), 3)}
        for name, t in results.items()
    }
    if not args.json:
        print("| command | median | slowest |")
        print("|---|---|---|")
        for name, r in rows.items():
            print(f"| `{name}` | {r['median_s']:.3f} s | {r['max_s']:.3f} s |")
    line = {
        "bench": "cli_startup",
        "runs": args.runs,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "target_s": TARGET_S,
        "help_under_target": rows["tandem --help"]["median_s"] < TARGET_S,
        "commands": rows,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
