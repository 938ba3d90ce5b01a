"""The services in-process around one simulated DGX H100 (or ``nodes`` of them), and a client: the stack the
preemption and sharing flow tests start (``tools.localstack``, a real nats-server)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from schemas.config import DeviceClass
from services.client import TandemClient
from tests.conftest import make_settings
from tools.localstack import FleetEntry, LocalStack


@contextlib.asynccontextmanager
async def one_dgx(
    nats_url: str, *, allocators: int = 1, classes: dict[str, DeviceClass] | None = None, nodes: int = 1
) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    extra = {} if classes is None else {"device_classes": classes}
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=1.0, **extra)
    st = LocalStack(
        settings, fleet=[FleetEntry("dgx-h100", nodes, "h100")], allocators=allocators, retry_interval=0.3
    )
    await st.start()
    await st.wait_ready()
    client = await TandemClient(st.buses[0]).start()
    try:
        yield st, client
    finally:
        await client.close()
        await st.stop()
