"""The node agent's ResourceSlice task: publish when the devices change, retry while the API
server is away.

The agent calls :meth:`SliceSync.changed` whenever what it knows of its devices changes (a
(re)discovery, a health or cordon change); the task then reads the agent's current view and
hands it to the :class:`~.publisher.SlicePublisher`, which writes only what differs. Changes
that arrive while a publish is under way fold into the next one, so a burst of health events
costs one write. An API error is logged and the publish retried after 1 s, doubling up to
30 s: the agent's NATS work (heartbeats, applies, cleanups) never waits for the Kubernetes
API, and slices catch up once it answers again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import aiohttp

from schemas.messages import DeviceHealth
from schemas.topology import NodeTopology
from services.kube.client import KubeClient
from services.kube.errors import KubeError
from services.nodeagent.dra.publisher import SliceApi, SlicePublisher
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0

View = Callable[[], tuple[NodeTopology | None, Mapping[str, DeviceHealth]]]


async def slice_api(*, enabled: bool) -> KubeClient | None:
    """The Kubernetes client the slices are written with (in-cluster: the agent pod's service
    account), or None when DRA is off (setting ``dra_slices``)."""
    return await KubeClient.connect() if enabled else None


class SliceSync:
    def __init__(
        self,
        api: SliceApi,
        *,
        node: str,
        view: View,
        retry_first: float = RETRY_FIRST_S,
        retry_max: float = RETRY_MAX_S,
    ) -> None:
        self.publisher = SlicePublisher(api, node=node)
        self.view = view
        self.retry_first = retry_first
        self.retry_max = retry_max
        self.failures = 0  # publishes refused or unreachable in a row (tests and /readyz read it)
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The agent's devices (or their health) changed: publish at the next turn."""
        self._changed.set()

    async def run(self) -> None:
        """Publish on every change until cancelled (a supervised task of the agent)."""
        delay = self.retry_first
        while True:
            await self._changed.wait()
            self._changed.clear()
            topology, health = self.view()
            if topology is None:
                continue
            try:
                await self.publisher.publish(topology, health)
            except (KubeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                self.failures += 1
                log.warning("resource_slices_not_published", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)
                self._changed.set()
                continue
            self.failures = 0
            delay = self.retry_first
