"""``tandem nats-config --auth-callout DIR --secret NAMESPACE/NAME``, the chart's install hook,
against the kmock API emulator through the real kubernetes-asyncio client.

The hook runs before every install and upgrade, so what matters is what a second run does: the
issuer key and the callout's password in the Secret are never replaced (a new issuer would lock
every client out until NATS and the callout restart), keys missing from it are added.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from services.authcallout import natsjwt
from services.kube.client import KubeClient
from tests.integration.test_bridge import Apiserver
from tools.cli.nats_cmd import store_callout_secret

pytestmark = pytest.mark.integration

NS, NAME = "tandem-system", "tandem-nats-auth"


@pytest.fixture
async def apiserver() -> AsyncIterator[tuple[Any, str]]:
    async with Apiserver() as emu, kmock.Server(emu) as srv:
        emu.resources["v1/secrets"] = {}
        yield emu, str(srv.url).rstrip("/")


def stored(emu: Any) -> dict[str, str]:
    data = dict(emu.objects["v1/secrets", NS, NAME].raw)["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


async def test_first_run_creates_the_secret_and_later_runs_keep_its_keys(
    apiserver: tuple[Any, str], tmp_path: Path
) -> None:
    emu, url = apiserver
    kube = KubeClient.for_host(url)
    try:
        assert await store_callout_secret(kube, tmp_path / "a", namespace=NS, name=NAME) == "created"
        first = stored(emu)
        assert set(first) == {"server.conf", "issuer.nk", "auth.nk"}
        issuer = natsjwt.public_key(first["issuer.nk"].encode())
        auth = natsjwt.public_key(first["auth.nk"].encode())
        assert f"issuer: {issuer}" in first["server.conf"].replace('"', "")
        assert auth in first["server.conf"]  # the callout's user: its public key only
        assert first["auth.nk"].strip() not in first["server.conf"]
        assert first["issuer.nk"].strip() not in first["server.conf"]

        # A later run (upgrade) in a fresh directory: nothing is generated anew.
        assert await store_callout_secret(kube, tmp_path / "b", namespace=NS, name=NAME) == "unchanged"
        assert stored(emu) == first
        assert (tmp_path / "b" / "issuer.nk").read_text() == first["issuer.nk"]
        assert (tmp_path / "b" / "issuer.nk").stat().st_mode & 0o077 == 0

        # A Secret missing the callout's key (edited by hand): the issuer stays, a new key is
        # added and server.conf follows both.
        resp = await emu.patch(
            f"/api/v1/namespaces/{NS}/secrets/{NAME}",
            json={"data": {"auth.nk": None, "server.conf": None}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status == 200, await resp.text()
        outcome = await store_callout_secret(kube, tmp_path / "c", namespace=NS, name=NAME)
        assert outcome == "updated auth.nk, server.conf"
        now = stored(emu)
        assert now["issuer.nk"] == first["issuer.nk"]
        assert now["auth.nk"] != first["auth.nk"]
        assert (
            natsjwt.public_key(now["auth.nk"].encode()) in now["server.conf"] and issuer in now["server.conf"]
        )
    finally:
        await kube.close()


async def test_the_cli_writes_the_secret_through_the_kubeconfig(
    apiserver: tuple[Any, str], tmp_path: Path
) -> None:
    emu, url = apiserver
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
        f"clusters: [{{name: emu, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: emu, user: {}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: emu}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    cmd = [sys.executable, "-m", "tools.cli.main", "nats-config", "--auth-callout", str(tmp_path / "out")]
    proc = await asyncio.create_subprocess_exec(
        *cmd, "--secret", f"{NS}/{NAME}", env={**env, "KUBECONFIG": str(kubeconfig)}, stderr=subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert f"Secret {NS}/{NAME}: created" in err.decode()
    assert stored(emu)["issuer.nk"] == (tmp_path / "out" / "issuer.nk").read_text()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--auth-callout", "DIR", "--secret", "no-slash"], "expected NAMESPACE/NAME"),
        (["--secret", "ns/name"], "--secret needs --auth-callout DIR"),
    ],
)
def test_a_bad_secret_reference_is_a_usage_error(tmp_path: Path, args: list[str], error: str) -> None:
    args = [str(tmp_path / "d") if a == "DIR" else a for a in args]
    cmd = [sys.executable, "-m", "tools.cli.main", "nats-config", *args]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and error in bad.stderr, bad.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was written
