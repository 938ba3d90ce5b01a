"""A Jaeger all-in-one on this machine: in-memory storage, OTLP/HTTP in, the query API and UI out.

Used by the cluster tests (tests/cluster) and by ``tandem up --jaeger``. The ``jaeger`` binary is
Jaeger v2 (``github.com/jaegertracing/jaeger/cmd/jaeger``) built from its Go module by
``make jaeger`` (tests/cluster/build.py); nothing is downloaded. The configuration written here
keeps only what a local run needs and binds every listener to one address of ours, with ports
chosen by :func:`~services.runtime.process.embedded.free_ports` (Jaeger's own defaults are fixed ports
on ``localhost``, which clash between runs).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from services.runtime.errors import EmbeddedServerError
from services.runtime.process.embedded import free_ports, terminate

# Health checks and queries go straight to our address, never through an http_proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
CACHE_GLOB = ".cache/cluster/jaeger-*/jaeger"


def find_jaeger(explicit: str | None = None, *, root: Path | None = None) -> str:
    """The ``jaeger`` binary: ``explicit``, else one built into the checkout's cache by
    ``make jaeger``, else one on ``PATH``."""
    if explicit:
        if not Path(explicit).is_file():
            raise EmbeddedServerError(f"jaeger binary {explicit} does not exist")
        return explicit
    base = root or Path(__file__).resolve().parents[3]  # the checkout: services/runtime/process/
    built = sorted(base.glob(CACHE_GLOB), key=lambda p: p.stat().st_mtime)
    if built:
        return str(built[-1])
    found = shutil.which("jaeger")
    if found:
        return found
    raise EmbeddedServerError(
        "no jaeger binary: run `make jaeger` in the checkout (builds Jaeger v2 from its Go module), "
        "or give its path"
    )


def config_yaml(*, host: str, otlp_port: int, query_port: int, grpc_port: int, health_port: int) -> str:
    """Jaeger v2's collector configuration: OTLP/HTTP → batch → memory; query HTTP and gRPC."""
    return f"""\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics: {{level: none}}
    logs: {{level: warn}}
extensions:
  healthcheckv2:
    use_v2: true
    http: {{endpoint: "{host}:{health_port}"}}
  jaeger_storage:
    backends:
      memstore: {{memory: {{max_traces: 100000}}}}
  jaeger_query:
    storage: {{traces: memstore}}
    http: {{endpoint: "{host}:{query_port}"}}
    grpc: {{endpoint: "{host}:{grpc_port}"}}
receivers:
  otlp:
    protocols:
      http: {{endpoint: "{host}:{otlp_port}"}}
processors:
  batch: {{timeout: 200ms}}
exporters:
  jaeger_storage_exporter: {{trace_storage: memstore}}
"""


class Jaeger:
    """``with Jaeger(binary, host=...) as j:`` — ``j.otlp_endpoint`` in, ``j.ui_url`` out."""

    def __init__(self, binary: str, *, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> None:
        self.binary = binary
        self.host = host
        self.startup_timeout = startup_timeout
        self.otlp_port, self.query_port, self.grpc_port, self.health_port = free_ports(4)
        self._dir = tempfile.mkdtemp(prefix="tandem-jaeger-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def otlp_endpoint(self) -> str:
        return f"http://{self.host}:{self.otlp_port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.query_port}"

    @property
    def log(self) -> Path:
        return Path(self._dir) / "jaeger.log"

    def start(self) -> Jaeger:
        config = Path(self._dir) / "config.yaml"
        config.write_text(
            config_yaml(
                host=self.host,
                otlp_port=self.otlp_port,
                query_port=self.query_port,
                grpc_port=self.grpc_port,
                health_port=self.health_port,
            )
        )
        with self.log.open("wb") as out:
            self._proc = subprocess.Popen(
                [self.binary, "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + self.startup_timeout
        while not self._healthy():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.stop()
                raise EmbeddedServerError(f"jaeger did not become ready:\n{tail}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with _DIRECT.open(f"http://{self.host}:{self.health_port}/status", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def query(self, path: str, **params: str) -> Any:
        """GET the query service's HTTP API (``/api/traces/<id>``, ``/api/services``...)."""
        url = f"{self.ui_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with _DIRECT.open(url, timeout=10) as resp:
            return json.loads(resp.read())

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One trace as Jaeger stores it (spans, processes), or None while it has none."""
        try:
            data = self.query(f"/api/traces/{trace_id}").get("data") or []
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return dict(data[0]) if data else None

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Jaeger:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
