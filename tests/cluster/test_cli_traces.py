"""The CLI's spans with `tandem up --jaeger`, as a user runs them: no variable to export.

`tandem up --jaeger` leaves where it exports for the CLI (tools/cli/localtraces.py), so a
`tandem submit` with no OTEL variable is one trace in the real Jaeger with the allocator's and
the node agent's spans: the CLI's `client.submit` its root, no span's parent missing. A CLI
told not to export (the variable set empty, or `OTEL_SDK_DISABLED=true`) sends no parent of its
own: the allocator's decision is the root of the trace the CLI prints, which has no CLI span
and no missing parent (a CLI span nobody exported used to be every other span's parent). The
record goes when `tandem up` stops. Runs in `make cluster-test`, whose build gives it the real Jaeger.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_cli_up import TANDEM, start_up
from tests.waiting import wait_until_sync

pytestmark = [pytest.mark.timeout(300)]

# Jaeger answers on our own address, never through an http_proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class System:
    url: str  # NATS
    ui: str  # Jaeger's query API
    env: dict[str, str]  # a user's shell: no OTEL_* or TANDEM_* variable, tandem up's TMPDIR


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, jaeger_bin: Path) -> Iterator[System]:
    # The real Jaeger that `make cluster-bins` builds (here, not in `make test`, where a fresh
    # clone has none yet and the test could only skip).
    jaeger = str(jaeger_bin)
    tmp = tmp_path_factory.mktemp("traces")  # where `tandem up` leaves its record (TMPDIR)
    shell = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TANDEM_"))}
    printed: list[str] = []
    with start_up(
        "dgx-h100:2:box", env={"TMPDIR": str(tmp)}, args=("--jaeger", jaeger), printed=printed
    ) as url:
        text = "\n".join(printed)
        ui = re.search(r"Jaeger UI and query API: (http://127\.0\.0\.1:\d+)", text)
        assert ui, text
        assert "`tandem submit` and `release` to this system export there too" in text, text
        assert "export OTEL_EXPORTER_OTLP_ENDPOINT" not in text, text  # nothing for the user to do
        assert [p.name for p in tmp.glob("tandem-*/up-*.json")] == [f"up-{url.rsplit(':', 1)[1]}.json"]
        yield System(url=url, ui=ui.group(1), env={**shell, "TMPDIR": str(tmp)})
    assert list(tmp.glob("tandem-*/up-*.json")) == []  # withdrawn when it stopped


def submit(system: System, pod: str, extra: dict[str, str] | None = None) -> str:
    """`tandem submit` of one placeable pod; its trace id as printed."""
    out = subprocess.run(
        [TANDEM, "submit", "--pod", pod, "--gpus", "2", "--rdma", "2", "--nats", system.url],
        capture_output=True, text=True, timeout=60, env={**system.env, **(extra or {})},
    )  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", (out.stdout, out.stderr)
    found = re.search(rf"\(pod {pod}\), trace ([0-9a-f]{{32}})\nassigned: .*trace (\w+)", out.stdout)
    assert found and found.group(1) == found.group(2), out.stdout
    return found.group(1)


def jaeger_trace(system: System, trace_id: str) -> dict[str, Any]:
    """The trace once Jaeger holds it up to the node agent's apply (the services export in
    batches)."""

    def complete() -> dict[str, Any] | None:
        try:
            with _DIRECT.open(f"{system.ui}/api/traces/{trace_id}", timeout=5) as resp:
                data = json.loads(resp.read())["data"]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        found: dict[str, Any] | None = data[0] if data else None
        names = {s["operationName"] for s in found["spans"]} if found else set()
        return found if {"allocator.commit", "nodeagent.apply"} <= names else None

    return wait_until_sync(complete, timeout=60, what=f"trace {trace_id} in Jaeger")


def shape(trace: dict[str, Any]) -> tuple[list[str], list[str], set[str]]:
    """The trace's roots and the spans whose parent it lacks (by operation name), and the
    services that sent spans."""
    spans = trace["spans"]
    ids = {s["spanID"] for s in spans}
    parents = [
        (s["operationName"], [r["spanID"] for r in s["references"] if r["refType"] == "CHILD_OF"])
        for s in spans
    ]
    roots = [name for name, refs in parents if not refs]
    orphans = [name for name, refs in parents if refs and refs[0] not in ids]
    services = {p["serviceName"] for p in trace["processes"].values()}
    return roots, orphans, services


def test_a_submit_without_the_variable_is_in_the_systems_trace(system: System) -> None:
    trace_id = submit(system, "team/traced")
    roots, orphans, services = shape(jaeger_trace(system, trace_id))
    assert roots == ["client.submit"], roots
    assert orphans == [], orphans
    assert {"cli", "allocator", "nodeagent"} <= services, services


@pytest.mark.parametrize(
    ("pod", "told"),
    [("team/unset", {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}), ("team/off", {"OTEL_SDK_DISABLED": "true"})],
)
def test_a_cli_that_does_not_export_sends_no_parent_of_its_own(
    system: System, pod: str, told: dict[str, str]
) -> None:
    trace_id = submit(system, pod, told)
    roots, orphans, services = shape(jaeger_trace(system, trace_id))
    assert roots == ["allocator.decide"], roots
    assert orphans == [], orphans
    assert "cli" not in services, services
