"""The node agent's ResourceSlice task (services.nodeagent.dra.sync) against an in-memory
stand-in for the Kubernetes API: a burst of changes costs one write, an unreachable API is
retried with back-off until it answers, and the agent's view is read at publish time. The
real API server's side is tests/cluster/test_dra_slices.py and test_dra_rbac.py."""

from __future__ import annotations

import asyncio
from typing import Any

from schemas.messages import DeviceHealth
from services.kube.errors import KubeError
from services.nodeagent.dra.sync import SliceSync
from services.topology import load_topology
from tests.waiting import wait_until

Obj = dict[str, Any]


class MemorySlices:
    """The four ResourceSlice calls over a dict; ``down`` calls fail like an absent API server."""

    def __init__(self) -> None:
        self.slices: dict[str, Obj] = {}
        self.down = 0
        self.calls = 0
        self._rv = 0

    def _answer(self, body: Obj) -> Obj:
        self.calls += 1
        if self.down:
            self.down -= 1
            raise KubeError("Kubernetes API 503: unavailable", status=503)
        self._rv += 1
        stored = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self._rv)}}
        self.slices[body["metadata"]["name"]] = stored
        return stored

    async def list_resource_slices(self, *, node: str, driver: str) -> list[Obj]:
        self.calls += 1
        if self.down:
            self.down -= 1
            raise KubeError("Kubernetes API 503: unavailable", status=503)
        return [s for s in self.slices.values() if s["spec"]["nodeName"] == node]

    async def create_resource_slice(self, body: Obj) -> Obj:
        return self._answer(body)

    async def replace_resource_slice(self, name: str, body: Obj) -> Obj:
        return self._answer(body)

    async def delete_resource_slice(self, name: str) -> None:
        self.slices.pop(name, None)

    async def close(self) -> None:
        pass


async def test_a_burst_of_changes_is_one_write_and_an_absent_api_is_retried_until_it_answers() -> None:
    api = MemorySlices()
    topo = load_topology("dgx-h100")
    health: dict[str, DeviceHealth] = {}
    sync = SliceSync(api, node="n1", view=lambda: (topo, health), retry_first=0.01, retry_max=0.04)
    task = asyncio.create_task(sync.run())
    try:
        api.down = 3  # the API server is away for the first three calls
        sync.changed()
        await wait_until(lambda: "n1-tandem.io-0" in api.slices, timeout=5)
        assert sync.failures == 0 and api.calls == 3 + 2  # three refused, then list + create
        assert api.slices["n1-tandem.io-0"]["spec"]["pool"]["generation"] == 1

        for i in range(5):  # five health events before the task runs again
            health[f"gpu{i}"] = DeviceHealth(healthy=False, reason="xid 79")
            sync.changed()
        await wait_until(lambda: api.slices["n1-tandem.io-0"]["spec"]["pool"]["generation"] == 2, timeout=5)
        devices = {d["name"]: d for d in api.slices["n1-tandem.io-0"]["spec"]["devices"]}
        assert all("taints" in devices[f"gpu{i}"] for i in range(5))
        assert api.calls == 5 + 1  # one replace for the five changes
    finally:
        task.cancel()
