"""The admission service process: webhook (every replica) + bridge (the elected leader only).

The webhook is stateless, so every replica serves it (the chart runs two for availability); the
bridge must act once per event, so with ``--leader-elect`` only the Lease holder runs it. Both
share one process so one Deployment, one ServiceAccount and one set of probes cover the edge.

Options are process wiring (ports, certificate files, lease name); everything shared with the
other services (NATS, OTLP, device classes) comes from :class:`Settings` (``TANDEM_CONFIG`` file
and ``TANDEM_*`` environment).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from services.admission.args import add_arguments
from services.admission.bridge import Bridge
from services.admission.webhook import CertReloader, RunningServer, Webhook, start_server
from services.kube.client import KubeClient
from services.kube.leader import LeaderElector
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.observe.metrics import service_registry
from services.runtime.observe.opsserver import OpsServer
from services.runtime.process import lifecycle
from services.runtime.process.tasks import Supervisor
from services.runtime.settings import Settings, load_settings

log = get_logger(__name__)

SERVICE = "admission"
__all__ = ["add_arguments", "run", "serve"]


async def serve(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> None:
    sup = Supervisor(SERVICE)
    server: RunningServer | None = None
    kube: KubeClient | None = None
    bus: Bus | None = None
    ops: OpsServer | None = None
    started = asyncio.Event()

    def ready() -> bool:
        return started.is_set() and (bus is None or bus.nc.is_connected)

    try:
        if settings.ops_port:
            ops = await OpsServer(
                port=settings.ops_port, ready=ready, registry=service_registry(SERVICE, ready=ready)
            ).start()
        if args.bridge or (args.webhook and settings.dra_claims):
            kube = await KubeClient.connect(kubeconfig=args.kubeconfig)
        if args.webhook:
            reloader = await asyncio.to_thread(CertReloader, cert_file=args.tls_cert, key_file=args.tls_key)
            # With DRA on, the webhook reads a pod's ResourceClaims and their templates.
            server = await start_server(
                Webhook(device_classes=settings.device_classes, claims=kube if settings.dra_claims else None),
                host=args.listen,
                port=args.port,
                ssl_context=reloader.context,
            )
            sup.spawn("cert-reload", lambda: reloader.watch(stop))
            log.info("webhook_listening", port=server.port)
        if args.bridge and kube is not None:
            bus = await Bus.open(settings)
            kube_, bus_ = kube, bus

            async def lead(until: asyncio.Event) -> None:
                bridge = Bridge(
                    kube=kube_,
                    bus=bus_,
                    device_classes=settings.device_classes,
                    event_interval=args.event_interval,
                    dra_kube=kube_ if settings.dra_claims else None,
                )
                await bridge.run(until)

            if args.leader_elect:
                elector = LeaderElector(
                    kube, namespace=args.lease_namespace, name=args.lease_name, identity=settings.instance
                )
                sup.spawn("leader", lambda: elector.run(lead, stop))
            else:
                sup.spawn("bridge", lambda: lead(stop))
        started.set()
        await stop.wait()
    finally:
        await sup.aclose()
        if ops is not None:
            await ops.stop()
        if server is not None:
            await server.close()
        if bus is not None:
            await bus.close()
        if kube is not None:
            await kube.close()


def run(args: argparse.Namespace, **overrides: Any) -> int:
    settings = load_settings(SERVICE, config=args.config, **overrides)
    lifecycle.run(lambda stop: serve(settings, args, stop), settings)
    return 0
