"""``python -m services.admission`` as the chart runs it: a real process with a kubeconfig
pointing at the API emulator, settings from a TANDEM_CONFIG file, TLS files, leader election.

Checks the wiring the unit tests cannot: the webhook answers over HTTPS, the elected bridge
takes the Lease and publishes a gated pod's request, and SIGTERM stops it cleanly and hands
the Lease back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from schemas import codec, subjects
from services.admission import names
from tests.conftest import BusFactory
from tests.integration.test_bridge import Apiserver, create_pod
from tests.unit.test_admission_helpers import deployment_pod, review, write_self_signed

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_admission_process_serves_webhook_and_leads_the_bridge(
    tmp_path: Path, nats_url: str, bus_factory: BusFactory
) -> None:
    allocator = await bus_factory("allocator")  # provisions streams, cleans JetStream
    cert, key = write_self_signed(tmp_path)
    config = tmp_path / "tandem.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "nats_url": nats_url,
                "log_json": True,
                "device_classes": {"default": {}, "h100": {"gpu_models": ["H100"], "scope": "pcie-root"}},
            }
        )
    )
    port = free_port()
    async with Apiserver() as emu, kmock.Server(emu) as srv:
        emu.resources["v1/pods"] = {}
        emu.resources["v1/events"] = {}
        emu.resources["v1/nodes"] = {}
        emu.resources["coordination.k8s.io/v1/leases"] = {}
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": str(srv.url).rstrip("/")}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "emu", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "KUBERNETES_"))}
        env["TANDEM_CONFIG"] = str(config)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.admission",
            "--listen", "127.0.0.1", "--port", str(port),
            "--tls-cert", str(cert), "--tls-key", str(key),
            "--kubeconfig", str(kubeconfig),
            "--leader-elect", "--lease-namespace", "tandem", "--lease-name", "tandem-bridge",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            ctx = ssl.create_default_context(cafile=str(cert))
            body = await _post_when_up(f"https://127.0.0.1:{port}/mutate", review(deployment_pod(
                annotations={names.DEVICE_CLASS: "h100"})), ctx)  # fmt: skip
            assert body["response"]["allowed"] is True  # the class came from the config file

            lease = await _eventually(lambda: _lease(emu))
            assert lease["spec"]["holderIdentity"]
            pod = await create_pod(emu, "proc-0", gpu="1", rdma="1")
            sub = await allocator.js.subscribe(subjects.ALLOC_REQUEST, stream=subjects.ALLOC_STREAM)
            msg = await sub.next_msg(timeout=15)
            req = codec.ALLOC_EVENT.decode(msg.data)
            assert req.pod.uid == pod["metadata"]["uid"]
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 20)
            err = (await proc.stderr.read()).decode() if proc.stderr else ""
        assert rc == 0, err[-3000:]
        events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
        assert "webhook_listening" in events and "leader_elected" in events
        assert not (_lease(emu) or {}).get("spec", {}).get("holderIdentity")  # handed back on stop


def _lease(emu: Any) -> dict[str, Any] | None:
    for (res, ns, name), obj in emu.objects.items():
        if res.plural == "leases" and (ns, name) == ("tandem", "tandem-bridge") and not obj.deleted:
            return dict(obj.raw)
    return None


async def _eventually(fn: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        await asyncio.sleep(0.05)
    pytest.fail("condition not reached")


async def _post_when_up(url: str, payload: dict[str, Any], ctx: ssl.SSLContext) -> Any:
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(url, json=payload, ssl=ctx) as resp:
                    return await resp.json()
            except aiohttp.ClientConnectorError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
