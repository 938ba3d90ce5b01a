"""Services during a NATS outage, as processes against a real nats-server that is stopped
under them (issue 27, items 2 and 4).

* Stopped (SIGTERM) while NATS is away, every service exits 0 within the grace period with
  one line saying the drain was skipped, never with a traceback: Kubernetes deletes and rolls
  pods during outages too.
* With NATS half-up (the server process frozen: connections open, nothing answered) the drain
  is cut short at its bound instead of waiting on the server.
* A service's own stop (the auth callout's, the inventory's) goes through on a connection
  already closed.
* The inventory's liveness task rides an outage out: no ``task_failed``, one warning when it
  begins and one info when it ends, the outage in its readiness meanwhile, and the node
  transitions it decided written once NATS takes them. ``Bus.publish_retry_for`` is cut to
  1 s so that a KV write gives up (what it did after 30 s in the issue) within seconds.

A service's log goes to a file, not a pipe: during an outage it warns at every reconnect
attempt, and a pipe nobody reads fills and blocks it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import structlog

from schemas import codec, subjects
from schemas.messages import NodeInventory
from schemas.topology import NodeTopology, Socket
from services.authcallout import natsjwt
from services.authcallout.service import AuthCallout, Reviewer
from services.inventory.service import Inventory
from services.kube.client import KubeClient
from services.runtime.nats.bus import PUBLISH_ATTEMPT_TIMEOUT_S, Bus
from services.runtime.process.embedded import EmbeddedNats, free_ports
from tests.conftest import make_settings
from tests.waiting import wait_until, wait_until_sync

pytestmark = pytest.mark.integration

# Kubernetes' default terminationGracePeriodSeconds (the chart sets none for the services):
# SIGKILL follows SIGTERM after this long.
GRACE_S = 30.0
# Probes go straight to 127.0.0.1, never through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# A kubeconfig for the auth callout's start (KubeClient.connect); no review is asked for here,
# so the API server it names is never contacted.
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: none, user: {}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    ops: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def readyz(self) -> int | None:
        """The status /readyz answers, None while nothing answers."""
        try:
            with _DIRECT.open(f"http://127.0.0.1:{self.ops}/readyz", timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    def wait_readyz(self, status: int, *, timeout: float = 30.0, what: str) -> None:
        def answered() -> bool:
            assert self.proc.poll() is None, f"the service exited early:\n{self.output()[-3000:]}"
            return self.readyz() == status

        wait_until_sync(answered, timeout=timeout, what=what, details=lambda: self.output()[-3000:])


@contextmanager
def service(name: str, tmp_path: Path, env: dict[str, str]) -> Iterator[Running]:
    """``python -m services.<name>`` with ``env`` on top of the environment; killed on the
    way out if the test left it running."""
    (ops,) = free_ports(1)
    log = tmp_path / f"{name}.log"
    full = {
        **os.environ,
        "TANDEM_OPS_PORT": str(ops),
        "TANDEM_OPS_HOST": "127.0.0.1",
        "TANDEM_LOG_LEVEL": "info",
        **env,
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"], env=full, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield Running(proc, ops, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_within_grace(running: Running) -> tuple[int, float]:
    """SIGTERM; its exit code and how long it took (a failure if past the grace period)."""
    started = time.monotonic()
    running.proc.send_signal(signal.SIGTERM)
    try:
        rc = running.proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {GRACE_S}s after SIGTERM:\n{running.output()[-3000:]}")
    return rc, time.monotonic() - started


def assert_clean_stop(running: Running, *, event: str) -> None:
    rc, took = stop_within_grace(running)
    out = running.output()
    assert rc == 0, f"exit code {rc} after SIGTERM:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert out.count(event) == 1, f"expected one {event} line:\n{out[-3000:]}"
    assert took < GRACE_S / 2, f"took {took:.1f}s to stop"


@pytest.mark.parametrize("name", ["allocator", "inventory"])
def test_sigterm_during_a_nats_outage_exits_0_without_a_traceback(name: str, tmp_path: Path) -> None:
    with EmbeddedNats() as nats_server, service(name, tmp_path, {"TANDEM_NATS_URL": nats_server.url}) as svc:
        svc.wait_readyz(200, what=f"the {name} to be ready")
        nats_server.stop()
        svc.wait_readyz(503, what=f"the {name} to see NATS gone")
        assert_clean_stop(svc, event="nats_drain_skipped")


def test_sigterm_to_the_auth_callout_during_a_nats_outage_exits_0(tmp_path: Path) -> None:
    # The server as `tandem nats-config --auth-callout` writes it; the callout connects with its
    # own nkey (the one user the server does not hand to the callout).
    conf = tmp_path / "nats"
    cmd = [sys.executable, "-m", "tools.cli.main", "nats-config", "--auth-callout", str(conf)]
    subprocess.run(cmd, check=True, timeout=60)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    with EmbeddedNats(config_file=str(conf / "server.conf")) as nats_server:
        env = {
            "TANDEM_NATS_URL": nats_server.url,
            "TANDEM_NATS_NKEY_SEED": str(conf / "auth.nk"),
            "TANDEM_AUTH_ISSUER_SEED_FILE": str(conf / "issuer.nk"),
            "KUBECONFIG": str(kubeconfig),
        }
        with service("authcallout", tmp_path, env) as callout:
            callout.wait_readyz(200, what="the auth callout to be ready")
            nats_server.stop()
            callout.wait_readyz(503, what="the auth callout to see NATS gone")
            assert_clean_stop(callout, event="nats_drain_skipped")


def test_sigterm_with_nats_half_up_cuts_the_drain_short(tmp_path: Path) -> None:
    # SIGSTOP: the server's sockets stay open, so the client still counts itself connected,
    # but nothing is answered — the drain's PING/PONG would wait on it.
    with (
        EmbeddedNats() as nats_server,
        service("allocator", tmp_path, {"TANDEM_NATS_URL": nats_server.url}) as svc,
    ):
        svc.wait_readyz(200, what="the allocator to be ready")
        assert nats_server.pid is not None
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            rc, took = stop_within_grace(svc)
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        out = svc.output()
        assert rc == 0, f"exit code {rc} after SIGTERM:\n{out[-3000:]}"
        assert "Traceback" not in out, out[-3000:]
        assert out.count("nats_drain_cut_short") == 1, out[-3000:]
        assert took < GRACE_S / 2, f"took {took:.1f}s to stop"


async def test_a_services_own_stop_goes_through_on_a_closed_connection() -> None:
    # As when the connection closed for good: lifecycle then stops the service, which must
    # not raise nats-py's ConnectionClosedError (a traceback instead of the clean exit 1).
    with EmbeddedNats() as nats_server:
        nc = await nats.connect(nats_server.url)
        reviewer = Reviewer(
            KubeClient.for_host("http://127.0.0.1:9"), namespace="tandem", identities={}, audiences=["x"]
        )
        issuer = natsjwt.keypair(natsjwt.new_seed())
        callout = AuthCallout(nc, issuer=issuer, account="TANDEM", reviewer=reviewer)
        await callout.start()
        bus = await Bus.open(make_settings(nats_server.url, "inventory"))
        inventory = Inventory(bus)
        await inventory.start()
        await nc.close()
        await bus.nc.close()
        await callout.stop()
        await inventory.stop()
        await bus.close()


NODE = "outage-0"
LOST_AFTER = 0.5


def _events(logs: list[dict[str, object]], *names: str) -> list[dict[str, object]]:
    return [e for e in logs if e.get("event") in names]


def _errors(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in logs if e.get("log_level") in ("error", "critical")]


class _Rig:
    """A private nats-server (restartable on its port and store), an inventory and a node that
    registered and then fell silent (it sends no heartbeat)."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = str(tmp_path / "jetstream")
        self.server = EmbeddedNats(store_dir=self.store).start()
        self.port = self.server.port

    async def start(self) -> None:
        self.bus = await Bus.open(make_settings(self.server.url, "inventory"))
        self.bus.publish_retry_for = 1.0
        self.inventory = Inventory(self.bus, lost_after=LOST_AFTER)
        await self.inventory.start()
        self.agent = await Bus.open(make_settings(self.server.url, "nodeagent"), provision_streams=False)
        topology = NodeTopology(name=NODE, sockets=[Socket(id=0)])
        await self.agent.publish(
            subjects.node_inventory(NODE), NodeInventory(node=NODE, topology=topology, generation=1)
        )
        await wait_until(lambda: self.inventory.status.get(NODE) == "ready", what="the node registered")

    def restart_server(self) -> None:
        self.server = EmbeddedNats(port=self.port, store_dir=self.store).start()

    async def recorded_status(self) -> str | None:
        try:
            entry = await (await self.agent.kv(subjects.KV_NODES)).get(subjects.kv_key(NODE))
        except Exception:  # not answered yet (the agent's connection is still coming back)
            return None
        return codec.NODE_RECORD.decode(entry.value or b"").status

    def silent_for(self) -> float:
        return self.inventory.clock() - self.inventory.last_seen[NODE]

    async def close(self) -> None:
        await self.inventory.stop()
        await self.bus.close()
        await self.agent.close()
        self.server.stop()


async def test_inventory_liveness_rides_out_a_nats_outage(tmp_path: Path) -> None:
    rig = _Rig(tmp_path)
    try:
        with structlog.testing.capture_logs() as logs:
            await rig.start()
            rig.server.stop()
            # The node's silence, as the inventory sees it, outlasts lost_after and one KV
            # write's retries: what took the task down before (task_failed, then restarted).
            gave_up_by = LOST_AFTER + PUBLISH_ATTEMPT_TIMEOUT_S + rig.bus.publish_retry_for + 1.0
            await wait_until(
                lambda: _events(logs, "task_failed") or rig.silent_for() > gave_up_by,
                timeout=30,
                what="the liveness task through an outage longer than a write's retries",
            )
            assert not _errors(logs), _errors(logs)
            assert len(_events(logs, "liveness_outage")) == 1, _events(logs, "liveness_outage")
            assert "NATS unreachable" in (rig.inventory.unready() or "")
            # Heartbeats cannot reach an inventory cut off from NATS: nobody is judged meanwhile.
            assert rig.inventory.status[NODE] == "ready"

            rig.restart_server()
            await wait_until(
                lambda: rig.inventory.unready() is None, timeout=30, what="the inventory ready again"
            )
            assert len(_events(logs, "liveness_recovered")) == 1
            # The node is still silent: after a full grace period from the reconnect, it is lost.
            await wait_until(
                lambda: _recorded_is(rig, "lost"), timeout=30, what="the silent node recorded lost"
            )
        assert not _errors(logs), _errors(logs)
        assert len(_events(logs, "liveness_outage")) == 1
    finally:
        await rig.close()


async def test_inventory_keeps_writing_a_decided_loss_while_nats_does_not_answer(tmp_path: Path) -> None:
    rig = _Rig(tmp_path)
    try:
        with structlog.testing.capture_logs() as logs:
            await rig.start()
            # Half-up: the connection stays open, so the inventory judges the silent node
            # lost, and every write of that times out.
            assert rig.server.pid is not None
            os.kill(rig.server.pid, signal.SIGSTOP)
            try:
                await wait_until(
                    lambda: _events(logs, "task_failed", "liveness_outage"),
                    timeout=30,
                    what="the failed write reported",
                )
                assert not _events(logs, "task_failed"), _events(logs, "task_failed")
                assert "cannot be written" in (rig.inventory.unready() or "")
                # Retried, with one warning for the whole outage.
                await wait_until(
                    lambda: _events(logs, "liveness_retry"),
                    timeout=30,
                    what="the write tried again",
                )
                assert len(_events(logs, "liveness_outage")) == 1
                assert rig.inventory.unwritten == {NODE: "lost"}
            finally:
                os.kill(rig.server.pid, signal.SIGCONT)
            await wait_until(lambda: _recorded_is(rig, "lost"), timeout=30, what="the loss written")
            await wait_until(
                lambda: rig.inventory.unready() is None, timeout=30, what="the inventory ready again"
            )
            assert rig.inventory.unwritten == {}
            # Its heartbeats resume: back, and written at once.
            await rig.agent.nc.publish(subjects.node_heartbeat(NODE), b"")
            await wait_until(lambda: _recorded_is(rig, "ready"), timeout=30, what="the node back")
        assert not _errors(logs), _errors(logs)
        assert len(_events(logs, "liveness_recovered")) == 1
    finally:
        await rig.close()


async def _recorded_is(rig: _Rig, status: str) -> bool:
    return await rig.recorded_status() == status
