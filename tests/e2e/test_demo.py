"""`make demo`'s command as a user runs it, with its traces exported over OTLP/HTTP.

An embedded OTLP receiver (oteltap) stands in for Jaeger's :4318 endpoint; the demo runs as
a real subprocess with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, exactly as an operator would.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
from pathlib import Path

from oteltap import OtelTapHttpProtobufReceiver, OtelTapHttpProtobufReceiverSettings

TANDEM = str(Path(sys.executable).parent / "tandem")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_demo_exits_zero_and_exports_one_trace_per_allocation() -> None:
    port = free_port()
    settings = OtelTapHttpProtobufReceiverSettings(http_port=port)
    async with OtelTapHttpProtobufReceiver(settings) as receiver:
        spans: list[object] = []

        async def collect() -> None:
            async for span in receiver.stream_traces():
                spans.append(span)

        collector = asyncio.create_task(collect())
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        proc = await asyncio.create_subprocess_exec(
            TANDEM, "demo", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
        )
        out_bytes, _ = await asyncio.wait_for(proc.communicate(), 90)
        out = out_bytes.decode()
        assert proc.returncode == 0, out
        await asyncio.sleep(1.0)  # the receiver polls its native queue
        collector.cancel()

    assert "pod" in out and "alignment" in out and "pcie-switch" in out
    assert re.search(r"\d+ assignments: p50 [\d.]+ ms, p99 [\d.]+ ms", out)
    # Step 4: a priority preemption, its victim evicted and the urgent job placed.
    assert re.search(r"llm-pretrain-2 \(priority 0\) preempted on \S+: evicted, cleaned, freed", out), out
    assert "urgent-train takes the board" in out
    match = re.search(r"trace_id ([0-9a-f]{32})", out)
    assert match, out
    trace_id = bytes.fromhex(match.group(1))
    names = {s.name for s in spans if s.trace_id == trace_id}  # type: ignore[attr-defined]
    assert {
        "allocator.decide",
        "allocator.commit",
        "nodeagent.apply",
        "nodeagent.cleanup",
        "allocator.free",
    } <= names, names
    decide = next(s for s in spans if s.trace_id == trace_id and s.name == "allocator.decide")  # type: ignore[attr-defined]
    attrs = {a.key for a in decide.attributes}  # type: ignore[attr-defined]
    assert {"k8s.pod.uid", "k8s.pod.name", "k8s.namespace.name", "tandem.candidates", "tandem.scope"} <= attrs
