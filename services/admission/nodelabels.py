"""Fabric labels from Kubernetes Node objects into KV ``tandem-node-labels``.

Where a node sits in the inter-node network is cluster knowledge, kept where operators keep
such things: as labels on the Node (``tandem.io/fabric-leaf: leaf-3``, ``tandem.io/fabric-spine:
spine-1``; the tiers are the allocator's ``fabric_tiers``), often set by a discovery job or by
hand. The node agent cannot see them (a Node's labels are not in the downward API, and a GET
per node every few seconds would cost the API server thousands of requests at scale), so the
pod bridge — already the one component with API access — watches Nodes once (list, then
watch from the list's version) and mirrors the labels with the prefixes below into one KV
record per node (:class:`~schemas.messages.NodeLabels`). The allocator watches the bucket and
adds the labels to the node's own (:mod:`services.allocator.readmodel`). A record is written only
when a node's mirrored labels change, and removed when the node is deleted or loses them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.messages import NodeLabels
from services.kube.client import KubeApi
from services.kube.errors import KubeError
from services.runtime.kv.watch import read_bucket
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

# Labels mirrored: the fabric blocks (services.allocator.core.gang.FABRIC_LABEL_PREFIX).
MIRRORED_PREFIXES = ("tandem.io/fabric-",)


def mirrored(node: dict[str, Any], *, prefixes: Iterable[str] = MIRRORED_PREFIXES) -> dict[str, str]:
    """The labels of a Node object that the allocator places by."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    wanted = tuple(prefixes)
    return {k: str(v) for k, v in labels.items() if isinstance(k, str) and k.startswith(wanted)}


class NodeLabelMirror:
    def __init__(
        self, *, kube: KubeApi, bus: Bus, watch_timeout: int = 300, relist_backoff: float = 1.0
    ) -> None:
        self.kube = kube
        self.bus = bus
        self.watch_timeout = watch_timeout
        self.relist_backoff = relist_backoff
        self.written: dict[str, dict[str, str]] = {}  # node → labels as the bucket holds them

    async def run(self, stop: asyncio.Event) -> None:
        """List + sync, then watch; on any watch end, again (like the bridge's pod watch)."""
        while not stop.is_set():
            try:
                await self._load()
                nodes, version = await self.kube.list_nodes()
                await self.sync(nodes)
                async for kind, obj in self.kube.watch_nodes(
                    resource_version=version, timeout_s=self.watch_timeout
                ):
                    await self.on_node(kind, obj)
            except KubeError as exc:
                log.warning("node_watch_restart", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.relist_backoff)

    async def _load(self) -> None:
        records = await read_bucket(self.bus.js, subjects.KV_NODE_LABELS, codec.NODE_LABELS)
        self.written = {r.node: dict(r.labels) for r in records.values()}

    async def sync(self, nodes: list[dict[str, Any]]) -> None:
        """Make the bucket match a full list of Nodes."""
        seen = set()
        for obj in nodes:
            name = (obj.get("metadata") or {}).get("name")
            if isinstance(name, str) and name:
                seen.add(name)
                await self._put(name, mirrored(obj))
        for name in [n for n in self.written if n not in seen]:
            await self._put(name, {})

    async def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            return
        await self._put(name, {} if kind == "DELETED" else mirrored(obj))

    async def _put(self, node: str, labels: dict[str, str]) -> None:
        if self.written.get(node, {}) == labels:
            return
        kv = await self.bus.kv(subjects.KV_NODE_LABELS)
        key = subjects.kv_key(node)
        if labels:
            await kv.put(key, codec.encode(NodeLabels(node=node, labels=labels)))
            self.written[node] = labels
        else:
            with contextlib.suppress(KeyNotFoundError):
                await kv.delete(key)
            self.written.pop(node, None)
        log.info("node_labels_mirrored", node=node, labels=labels)
