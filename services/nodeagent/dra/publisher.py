"""Keep a node's ResourceSlices in the API equal to its devices (the I/O beside :mod:`.slices`).

:class:`SlicePublisher` owns the pool ``<node>`` of driver ``tandem.io``. Each
:meth:`~SlicePublisher.publish` builds the slices the node's devices call for and writes only
what differs from what the API holds:

* at the first call it lists the slices the API already has for the node (a restarted agent
  finds its own), so a restart with unchanged devices writes nothing, and the pool's
  generation continues from the highest one found — readers trust the newest generation, and
  a generation that went back would make them ignore the agent's slices;
* when the devices changed (health, hot-plug, MIG layout) the generation grows by one and
  every slice of the pool is written with it (created, or replaced at the resourceVersion it
  was read at), then slices the pool no longer needs are deleted;
* a 409 (someone else wrote a slice, or the list was stale) is answered by listing again and
  writing once more; any other API error is raised for the caller to retry later, with the
  publisher's view dropped so the next call starts from the API's truth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

from schemas.messages import DeviceHealth
from schemas.topology import NodeTopology
from services.kube.errors import Conflict, NotFound
from services.kube.quantity import quantity
from services.nodeagent.dra.slices import DRIVER, resource_slices

Obj = dict[str, Any]


class SliceApi(Protocol):
    """The calls the publisher makes (``services.kube.client.KubeClient`` has them)."""

    async def list_resource_slices(self, *, node: str, driver: str) -> list[Obj]: ...

    async def create_resource_slice(self, body: Obj) -> Obj: ...

    async def replace_resource_slice(self, name: str, body: Obj) -> Obj: ...

    async def delete_resource_slice(self, name: str) -> None: ...

    async def close(self) -> None: ...


class SlicePublisher:
    def __init__(self, api: SliceApi, *, node: str) -> None:
        self.api = api
        self.node = node
        self.generation = 0
        self._held: dict[str, Obj] | None = None  # name -> slice as the API last returned it
        self.writes = 0  # slices created, replaced or deleted (tests and the metric read it)

    async def publish(self, topology: NodeTopology, health: Mapping[str, DeviceHealth]) -> bool:
        """Bring the API's slices of this node to ``topology`` + ``health``; True if it wrote."""
        try:
            try:
                return await self._publish(topology, health)
            except Conflict:
                self._held = None  # a stale view: read the API again and write once more
                return await self._publish(topology, health)
        except BaseException:
            self._held = None
            raise

    async def _publish(self, topology: NodeTopology, health: Mapping[str, DeviceHealth]) -> bool:
        if self._held is None:
            found = await self.api.list_resource_slices(node=self.node, driver=DRIVER)
            self._held = {s["metadata"]["name"]: s for s in found}
            gens = [int(s["spec"]["pool"].get("generation", 0)) for s in found]
            self.generation = max([self.generation, *gens])
        want = resource_slices(topology, node=self.node, generation=self.generation, health=health)
        if self._same(want):
            return False
        # Taken only once written: a write refused half-way leaves the API's generation, which
        # the next call reads back, so no generation is skipped.
        generation = self.generation + 1
        for body in want:
            body["spec"]["pool"]["generation"] = generation
        held = self._held
        for body in want:
            name = body["metadata"]["name"]
            if name in held:
                body["metadata"]["resourceVersion"] = held[name]["metadata"]["resourceVersion"]
                held[name] = await self.api.replace_resource_slice(name, body)
            else:
                held[name] = await self.api.create_resource_slice(body)
            self.writes += 1
        for name in sorted(set(held) - {b["metadata"]["name"] for b in want}):
            with contextlib.suppress(NotFound):  # gone already: what was wanted
                await self.api.delete_resource_slice(name)
            del held[name]
            self.writes += 1
        self.generation = generation
        return True

    def _same(self, want: list[Obj]) -> bool:
        """Whether the API already holds ``want`` (the devices of each slice, the slice count)."""
        held = self._held or {}
        if set(held) != {b["metadata"]["name"] for b in want}:
            return False
        for body in want:
            have = held[body["metadata"]["name"]]["spec"]
            spec = body["spec"]
            if have["pool"].get("resourceSliceCount") != spec["pool"]["resourceSliceCount"]:
                return False
            if comparable_devices(have.get("devices") or []) != comparable_devices(spec["devices"]):
                return False
        return True


def comparable_devices(devices: list[Obj]) -> list[Obj]:
    """Devices as the builder writes them: the server adds a taint's ``timeAdded`` and writes
    quantities canonically (``81920Mi`` → ``80Gi``), which must not count as a change."""
    out = []
    for d in devices:
        d = dict(d)
        if "taints" in d:
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]
        if "capacity" in d:
            d["capacity"] = {k: _number(v["value"]) for k, v in d["capacity"].items()}
        out.append(d)
    return out


def _number(value: str) -> int | str:
    """A quantity as a number when it is one Tandem writes, else as written."""
    size = quantity(value)
    return value if size is None else size
