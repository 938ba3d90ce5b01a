"""NATS over TLS with a real nats-server that verifies client certificates.

The services' TLS settings (``nats_tls_ca``, ``nats_tls_cert``, ``nats_tls_key``) against a
server configured as a secure install runs it: server certificate from a private CA, client
certificates required. A client that is not trusted, or does not trust the server, is told so
at once — not left retrying for ever behind a green liveness probe."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import subjects
from services.runtime.errors import SettingsError
from services.runtime.nats.bus import Bus, ConnectError
from services.runtime.process.embedded import EmbeddedNats
from tests.conftest import make_settings
from tests.pki import Authority, Pair

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Authority, Pair, Pair]:
    d = tmp_path_factory.mktemp("pki")
    ca = Authority(d)
    return ca, ca.issue("nats-server", server=True), ca.issue("tandem-inventory", server=False)


@pytest.fixture(scope="module")
def tls_server(
    pki: tuple[Authority, Pair, Pair], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedNats]:
    ca, server, _ = pki
    conf = tmp_path_factory.mktemp("nats-tls") / "tls.conf"
    conf.write_text(
        "tls {\n"
        f'  cert_file: "{server.cert}"\n  key_file: "{server.key}"\n  ca_file: "{ca.ca_file}"\n'
        "  verify: true\n  timeout: 2\n}\n"
    )
    with EmbeddedNats(config_file=str(conf)) as s:
        yield s


def tls_url(server: EmbeddedNats) -> str:
    return f"tls://127.0.0.1:{server.port}"


async def test_a_service_with_the_ca_and_a_client_certificate_connects(
    tls_server: EmbeddedNats, pki: tuple[Authority, Pair, Pair]
) -> None:
    ca, _, client = pki
    settings = make_settings(
        tls_url(tls_server),
        "inventory",
        nats_tls_ca=str(ca.ca_file),
        nats_tls_cert=str(client.cert),
        nats_tls_key=str(client.key),
    )
    bus = await Bus.open(settings)
    try:
        info = await bus.js.stream_info(subjects.NODE_STREAM)
        assert info.config.name == subjects.NODE_STREAM
        assert bus.nc.connected_url is not None and bus.nc.connected_url.scheme == "tls"
    finally:
        await bus.close()


async def test_a_client_without_a_certificate_is_told_so(
    tls_server: EmbeddedNats, pki: tuple[Authority, Pair, Pair]
) -> None:
    ca, _, _ = pki
    settings = make_settings(tls_url(tls_server), "inventory", nats_tls_ca=str(ca.ca_file))
    with pytest.raises(ConnectError, match="client certificate"):
        await Bus.open(settings)


async def test_a_server_the_client_does_not_trust_is_refused_with_the_setting_to_fix(
    tls_server: EmbeddedNats, tmp_path: Path, pki: tuple[Authority, Pair, Pair]
) -> None:
    other = Authority(tmp_path, name="someone-else")
    _, _, client = pki
    settings = make_settings(
        tls_url(tls_server),
        "inventory",
        nats_tls_ca=str(other.ca_file),
        nats_tls_cert=str(client.cert),
        nats_tls_key=str(client.key),
    )
    with pytest.raises(ConnectError, match="nats_tls_ca"):
        await Bus.open(settings)


def test_a_certificate_file_that_cannot_be_read_fails_at_start_naming_the_setting(tmp_path: Path) -> None:
    from services.runtime.nats.auth import tls_context

    settings = make_settings(
        "tls://127.0.0.1:1",
        "inventory",
        nats_tls_cert=str(tmp_path / "nope.pem"),
        nats_tls_key=str(tmp_path / "k"),
    )
    with pytest.raises(SettingsError, match="nats_tls_cert"):
        tls_context(settings)


def test_the_service_process_exits_with_one_line_when_the_server_is_not_trusted(
    tls_server: EmbeddedNats, pki: tuple[Authority, Pair, Pair]
) -> None:
    _, _, client = pki
    env = {
        **os.environ,
        "TANDEM_NATS_URL": tls_url(tls_server),
        "TANDEM_NATS_TLS_CERT": str(client.cert),
        "TANDEM_NATS_TLS_KEY": str(client.key),
        "TANDEM_LOG_LEVEL": "error",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.inventory"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("inventory: NATS at tls://127.0.0.1:") and "nats_tls_ca" in last
    assert "Traceback" not in done.stderr


def test_one_context_for_the_same_files_and_a_new_one_when_a_file_changes(
    pki: tuple[Authority, Pair, Pair],
) -> None:
    from services.runtime.nats.auth import tls_context

    ca, _, client = pki
    settings = make_settings(
        "tls://127.0.0.1:1",
        "nodeagent",
        nats_tls_ca=str(ca.ca_file),
        nats_tls_cert=str(client.cert),
        nats_tls_key=str(client.key),
    )
    first = tls_context(settings)
    assert first is not None and tls_context(settings) is first
    # A rotated certificate (rewritten in place): the next connection reads it again.
    stat = client.cert.stat()
    os.utime(client.cert, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = tls_context(settings)
    assert second is not None and second is not first
