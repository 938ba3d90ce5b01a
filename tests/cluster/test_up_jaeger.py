"""``tandem up --jaeger``: a user trying Tandem on one machine sees traces in the real Jaeger.

The command starts Jaeger (the binary `make jaeger` builds) beside NATS and the services, prints
the UI address and where the traces go, and leaves that for the CLI (tools/cli/localtraces.py);
a request submitted from the CLI, with no variable set, is then one trace in Jaeger's query
API, with the CLI's, the allocator's and the node agent's spans. Ctrl-C stops Jaeger too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from services.runtime.process.embedded import free_ports
from tests.cluster.release import eventually

TANDEM = str(Path(sys.executable).parent / "tandem")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get_json(url: str) -> object:
    with _DIRECT.open(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_up_with_jaeger_shows_a_submitted_request_as_one_trace(jaeger_bin: Path) -> None:
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory() as tmp:
        env["TMPDIR"] = tmp  # where `tandem up` leaves its record for the CLI
        up = subprocess.Popen(
            [TANDEM, "up", "--port", str(port), "--ops-port", "0", "--node", "dgx-h100:1:box",
             "--jaeger", str(jaeger_bin)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:

            def printed() -> str:
                log.seek(0)
                text = log.read()
                assert up.poll() is None, text
                return text if "Tandem is up" in text and "export TANDEM_NATS_URL" in text else ""

            text = eventually(printed, timeout=60, what="tandem up ready")
            ui = re.search(r"Jaeger UI and query API: (http://127\.0\.0\.1:\d+)", text)
            # ... and the CLI learns where without a variable:
            otlp = re.search(r"exported to (http://127\.0\.0\.1:\d+) \(OTLP/HTTP\); `tandem submit`", text)
            assert ui and otlp, text
            sub = subprocess.run(
                [TANDEM, "submit", "--pod", "team/traced", "--gpus", "2", "--rdma", "2",
                 "--nats", f"nats://127.0.0.1:{port}"],
                capture_output=True, text=True, timeout=60, env=env,
            )  # fmt: skip
            assert sub.returncode == 0, sub.stderr
            found = re.search(r"trace ([0-9a-f]{32})", sub.stdout)
            assert found, sub.stdout
            trace_id = found.group(1)

            def trace() -> dict[str, object] | None:
                with contextlib.suppress(urllib.error.HTTPError):
                    data = get_json(f"{ui.group(1)}/api/traces/{trace_id}")["data"]  # type: ignore[index]
                    t = data[0] if data else None
                    if t and {"allocator", "nodeagent"} <= {
                        p["serviceName"] for p in t["processes"].values()
                    }:
                        return dict(t)
                return None

            t = eventually(trace, timeout=60, what=f"trace {trace_id} in Jaeger")
            names = {s["operationName"] for s in t["spans"]}  # type: ignore[attr-defined]
            assert {"client.submit", "allocator.decide", "allocator.commit", "nodeagent.apply"} <= names
        finally:
            up.send_signal(signal.SIGINT)
            rc = up.wait(30)
        log.seek(0)
        assert rc == 0, log.read()[-2000:]
    with contextlib.suppress(urllib.error.URLError, OSError):
        get_json(f"{ui.group(1)}/api/services")
        raise AssertionError("Jaeger still answers after tandem up stopped")
