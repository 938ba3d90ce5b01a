"""The services as the chart runs them: ``python -m services.<x>`` processes with a config
file, probes and metrics on the ops port, and a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.text()


async def wait_ready(url: str, proc: asyncio.subprocess.Process, *, timeout: float = 20) -> None:
    async def poll() -> None:
        while True:
            assert proc.returncode is None, "service exited early"
            try:
                if (await get(url))[0] == 200:
                    return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)

    await asyncio.wait_for(poll(), timeout)


async def test_allocator_and_inventory_processes_probe_scrape_and_stop(
    nats_url: str, clean_jetstream: None, tmp_path: Path
) -> None:
    procs = []
    ports = {}
    for service in ("inventory", "allocator"):
        ports[service] = free_port()
        cfg = tmp_path / f"{service}.yaml"
        cfg.write_text(f"nats_url: {nats_url}\nops_port: {ports[service]}\nlog_level: warning\n")
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                f"services.{service}",
                "--config",
                str(cfg),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        )
    try:
        for service, proc in zip(ports, procs, strict=True):
            base = f"http://127.0.0.1:{ports[service]}"
            await wait_ready(f"{base}/readyz", proc)
            assert (await get(f"{base}/healthz"))[0] == 200
        status, text = await get(f"http://127.0.0.1:{ports['allocator']}/metrics")
        assert status == 200 and "tandem_allocator_decision_seconds_bucket" in text
        assert "tandem_inventory_nodes" in (await get(f"http://127.0.0.1:{ports['inventory']}/metrics"))[1]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(p.wait(), 20) for p in procs]
    assert codes == [0, 0]


async def test_bad_config_file_fails_at_start_with_its_path(tmp_path: Path) -> None:
    cfg = tmp_path / "allocator.yaml"
    cfg.write_text("node_lost_after: [1, 2]\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.allocator",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert str(cfg) in err.decode() and "node_lost_after" in err.decode()
    assert "Traceback" not in err.decode()
