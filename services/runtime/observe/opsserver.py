"""The operations endpoint of every service: liveness, readiness and Prometheus metrics.

``GET /healthz`` answers 200 while the event loop runs (a wedged loop fails the probe) and the
service is alive (``alive``: e.g. its NATS connection is not closed for good, which no
reconnect can mend — the probe fails so Kubernetes restarts it);
``GET /readyz`` answers 200 once the service has started and its NATS connection is up,
503 otherwise (so Kubernetes stops routing to, and restarts, a service that lost NATS), with
the reason when ``reason`` gives one (e.g. the inventory's node records that cannot be
written during an outage);
``GET /metrics`` is the Prometheus text exposition of the process's registry. Served on
``ops_port`` (the chart's 9090) when it is set.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry

from services.runtime.observe.metrics import exposition


class OpsServer:
    def __init__(
        self,
        *,
        port: int,
        ready: Callable[[], bool],
        alive: Callable[[], bool] = lambda: True,
        reason: Callable[[], str | None] = lambda: None,
        host: str = "0.0.0.0",  # probes and scrapes come from outside the pod
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.port = port
        self.host = host
        self.ready = ready
        self.reason = reason
        self.alive = alive
        self.registry = registry
        self._runner: web.AppRunner | None = None

    async def _healthz(self, _: web.Request) -> web.Response:
        if self.alive():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="dead: NATS connection closed for good\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="ready\n")
        why = self.reason()
        return web.Response(status=503, text=f"not ready: {why}\n" if why else "not ready\n")

    async def _metrics(self, _: web.Request) -> web.Response:
        body = exposition(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> OpsServer:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:  # tests ask for any free port
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
