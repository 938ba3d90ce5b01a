"""One request, one trace, across separate processes: CLI → allocator → node agent and back.

Inventory, allocator and a simulated node agent run as the chart runs them (``python -m
services.<x>``), each exporting over OTLP/HTTP to a real receiver (tests/otlp.py); the CLI runs
as a user runs it. A request submitted from the CLI is first pending (its node is full), is
placed after a retry, then released: every span about it — each retry of the decision, the
commit, the apply, the release, the cleanup and the free — is in the one trace the CLI started,
with its parent in that trace, the right kind, its own service's ``service.name`` and the
messaging attributes; the pending decision says ERROR with its reason.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.process.embedded import EmbeddedNats
from tests.otlp import ReceivedSpan, otlp_receiver
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TANDEM = str(Path(sys.executable).parent / "tandem")
PRODUCER, CONSUMER = 4, 5  # opentelemetry.proto Span.SpanKind
ERROR = 2


async def tandem(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = await asyncio.create_subprocess_exec(
        TANDEM, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess(list(args), proc.returncode or 0, out.decode(), err.decode())


async def test_a_request_pending_then_placed_then_released_is_one_trace(tmp_path: Path) -> None:
    with EmbeddedNats() as server:
        async with otlp_receiver() as receiver:
            env = {
                **os.environ,
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                "TANDEM_NATS_URL": server.url,
                "TANDEM_LOG_LEVEL": "warning",
            }
            configs = {
                "inventory": "",
                "allocator": "",
                "nodeagent": "backend: simulated\ntopology_file: pcie-4gpu-2nic\nnode_name: box-0\n"
                f"state_dir: {tmp_path}\nheartbeat_interval: 0.5\n",
            }
            procs = []
            for service, extra in configs.items():
                cfg = tmp_path / f"{service}.yaml"
                cfg.write_text(extra)
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, "-m", f"services.{service}", "--config", str(cfg), env=env
                    )
                )
            try:
                trace_id = await _run_the_request(env)
            finally:
                for p in procs:
                    p.send_signal(signal.SIGTERM)
                codes = [await asyncio.wait_for(p.wait(), 30) for p in procs]
            assert codes == [0, 0, 0]
            # Each process flushed its spans on the way out; the receiver has taken them.
            await wait_until(
                lambda: (
                    {"allocator.free", "nodeagent.cleanup", "client.release"}
                    <= {s.name for s in receiver.trace(trace_id)}
                ),
                what="the trace's last spans",
            )
            trace = receiver.trace(trace_id)
    _check_one_trace(trace)


async def _run_the_request(env: dict[str, str]) -> str:
    # Wait for the node, then fill it so that the next request must wait.
    async def node_up() -> bool:
        return "box-0" in (await tandem("status", env=env)).stdout

    await wait_until(node_up, timeout=30, poll=0.3, what="node box-0")
    blocker = await tandem("submit", "--pod", "t/blocker", "--gpus", "4", env=env)
    assert blocker.returncode == 0, blocker.stdout + blocker.stderr
    blocker_id = re.search(r"request (\S+) \(pod t/blocker\)", blocker.stdout)
    assert blocker_id
    waiter = await tandem("submit", "--pod", "t/waiter", "--gpus", "2", env=env)
    assert waiter.returncode == 1 and "pending:" in waiter.stdout, waiter.stdout + waiter.stderr
    found = re.search(r"request (\S+) \(pod t/waiter\), trace ([0-9a-f]{32})", waiter.stdout)
    assert found, waiter.stdout
    waiter_id, trace_id = found.groups()
    released = await tandem("release", blocker_id.group(1), env=env)
    assert released.returncode == 0, released.stdout + released.stderr

    async def waiter_placed() -> bool:  # by a retry of the allocator's pending loop
        listed = await tandem("requests", "--namespace", "t", env=env)
        row = next((ln for ln in listed.stdout.splitlines() if "t/waiter" in ln), "")
        return re.search(r"\b(assigned|applied)\b", row) is not None

    await wait_until(waiter_placed, timeout=60, poll=0.5, what="the waiter placed")
    done = await tandem("release", waiter_id, env=env)
    assert done.returncode == 0 and "freed on box-0" in done.stdout, done.stdout + done.stderr
    return trace_id


def _check_one_trace(trace: list[ReceivedSpan]) -> None:
    names = [s.name for s in trace]
    for expected in (
        "client.submit",
        "allocator.decide",
        "allocator.commit",
        "nodeagent.apply",
        "client.release",
        "allocator.release",
        "nodeagent.cleanup",
        "allocator.free",
    ):
        assert expected in names, (expected, sorted(names))
    decides = [s for s in trace if s.name == "allocator.decide"]
    assert len(decides) >= 2, "the pending decision and the placing retry are both in the trace"
    assert any(d.status_code == ERROR and "no node can take" in d.status_message for d in decides)
    assert any(d.attributes.get("tandem.retry") is True for d in decides)

    ids = {s.span_id for s in trace}
    roots = [s for s in trace if not s.parent_span_id]
    assert [r.name for r in roots] == ["client.submit"]
    orphans = [s.name for s in trace if s.parent_span_id and s.parent_span_id not in ids]
    assert orphans == []

    service_of = {"client": "cli", "allocator": "allocator", "nodeagent": "nodeagent"}
    for s in trace:
        assert s.resource.get("service.name") == service_of[s.name.split(".")[0]], (s.name, s.resource)
        if s.name.startswith("nodeagent."):
            assert s.resource.get("k8s.node.name") == "box-0"
    kinds = {
        "client.submit": PRODUCER,
        "client.release": PRODUCER,
        "allocator.decide": CONSUMER,
        "allocator.release": CONSUMER,
        "allocator.free": CONSUMER,
        "nodeagent.apply": CONSUMER,
        "nodeagent.cleanup": CONSUMER,
        "allocator.commit": PRODUCER,
    }
    for s in trace:
        assert s.kind == kinds[s.name], (s.name, s.kind)
        assert s.attributes.get("messaging.system") == "nats", s.name
        assert str(s.attributes.get("messaging.destination.name", "")).startswith("tandem."), s.name
