"""A service process's life against a real nats-server: it stops on SIGTERM however far it got,
and exits when its NATS connection is closed for good (Kubernetes then restarts it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import pytest

from services.runtime.process.embedded import EmbeddedNats
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.integration

# A service whose start breaks its own connection the way a too-large publish once did: a
# message over the server's max payload makes the server answer -ERR and close it, and nats-py
# does not reconnect after that.
BREAKER = """
import sys
from services.runtime.process.lifecycle import service_main

class Breaker:
    def __init__(self, bus):
        self.bus = bus

    async def start(self):
        await self.bus.nc.publish("tandem.test.big", b"", headers={"X-Big": "x" * 1_200_000})

    async def stop(self):
        pass

async def build(bus, settings):
    return Breaker(bus)

sys.exit(service_main("inventory", build, []))
"""


# A service connected and started that says it cannot do its work (as the inventory does while
# its node records cannot be written): its /readyz must say so, and why.
UNREADY = """
import sys
from services.runtime.process.lifecycle import service_main

class Unready:
    async def start(self):
        pass

    async def stop(self):
        pass

    def unready(self):
        return "node records cannot be written: TimeoutError()"

async def build(bus, settings):
    return Unready()

sys.exit(service_main("inventory", build, []))
"""


def _env(nats_url: str) -> dict[str, str]:
    return {**os.environ, "TANDEM_NATS_URL": nats_url, "TANDEM_LOG_LEVEL": "warning"}


def test_a_service_exits_when_its_connection_is_closed_for_good() -> None:
    with EmbeddedNats() as server:
        done = subprocess.run(
            [sys.executable, "-c", BREAKER],
            env=_env(server.url),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "NATS connection closed for good" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_stops_a_service_still_waiting_for_nats() -> None:
    # Nothing listens on this port: the service keeps trying to connect until told to stop.
    with EmbeddedNats() as server:
        port = server.port
    ops = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.inventory"],
        env={**_env(f"nats://127.0.0.1:{port}"), "TANDEM_OPS_PORT": str(ops)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Its ops port answers while it is still trying to connect (nothing listens on `port`).
        _wait_answering(proc, "127.0.0.1", ops)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


def test_readyz_says_why_a_connected_service_is_not_ready() -> None:
    ops = _free_port()
    with EmbeddedNats() as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", UNREADY],
            env={**_env(server.url), "TANDEM_OPS_PORT": str(ops)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:

            def with_reason() -> str:
                assert proc.poll() is None, "the service exited early"
                answer = _get(f"http://127.0.0.1:{ops}/readyz")
                return answer if "node records" in answer else ""

            body = wait_until_sync(with_reason, what="/readyz to give the reason")
            assert body.startswith("503 not ready: node records cannot be written"), body
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0


def _get(url: str) -> str:
    """``"<status> <body>"``, or ``""`` while nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as resp:
            return f"{resp.status} {resp.read().decode()}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read().decode()}"
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_answering(proc: subprocess.Popen[Any], host: str, port: int, *, timeout: float = 20) -> None:
    """Until the service's ops port answers (it serves while the service connects)."""

    def answering() -> bool:
        assert proc.poll() is None, "the service exited before its ops port answered"
        return _answers(host, port)

    wait_until_sync(answering, timeout=timeout, what="the ops port to answer")


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.")
    except OSError:
        return False


def test_ops_port_binds_only_the_configured_address() -> None:
    # A host-network pod (the node agent) binds its node's address, not every interface.
    with EmbeddedNats() as server:
        port = server.port  # free once the server is gone; nothing connects there
    ops = _free_port()
    env = {**_env(f"nats://127.0.0.1:{port}"), "TANDEM_OPS_PORT": str(ops), "TANDEM_OPS_HOST": "127.0.0.1"}
    cmd = [sys.executable, "-m", "services.inventory"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_answering(proc, "127.0.0.1", ops)
        assert not _answers("127.0.0.2", ops)  # another local address: nothing listens there
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
