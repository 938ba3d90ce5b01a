"""End to end with the real node agent service and the real VF applier (issue 4, last point).

The skeleton's flow — allocator and inventory over a real nats-server, the lead's
``NodeAgent`` — with :class:`~services.nodeagent.netns.VfApplier` in place of the simulated
applier, so an assignment moves a real netdev (a veth end standing in for a VF) into a real
pod network namespace, and a release brings it back and verifies it before ``cleaned`` and
``freed``. GPUs stay simulated (no GPU here): the node's hardware is a topology whose VFs name
the veth netdevs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from schemas import codec, subjects
from schemas.messages import AllocationRequest, Applied, Assignment, Cleaned, Freed, NetworkSpec, PodRef
from schemas.topology import Gpu, Nic, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket, VirtualFunction
from services.client import TandemClient
from services.nodeagent.backends.simulated import SimulatedBackend
from services.nodeagent.netns import NamedNetnsResolver, VfApplier
from services.nodeagent.service import NodeAgent
from services.nodeagent.state import StateFile
from tests.conftest import BusFactory, make_settings
from tests.netns.conftest import Lab, Vf, addrs_in, link_in, sh
from tools.localstack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.netns]
NODE = "vf-node-0"


def topology(vfs: list[Vf]) -> NodeTopology:
    nic = Nic(
        name="mlx5_0",
        pci_bus_id="0000:3b:00.0",
        link_type="ethernet",
        speed_gbps=400,
        vfs=[VirtualFunction(index=i, name=f"mlx5_{i + 1}", netdev=vf.name) for i, vf in enumerate(vfs)],
    )
    gpus = [Gpu(index=i, uuid=f"GPU-e2e-{i}", pci_bus_id=f"0000:3{c}:00.0") for i, c in ((0, "c"), (1, "d"))]
    switch = PcieSwitch(id="sw0", gpus=gpus, nics=[nic])
    return NodeTopology(
        name=NODE,
        sockets=[
            Socket(id=0, numa_nodes=[NumaNode(id=0, roots=[PcieRoot(id="pci0000:3a", switches=[switch])])])
        ],
    )


@pytest.fixture
async def system(
    nats_url: str, clean_jetstream: None, lab: Lab
) -> AsyncIterator[tuple[LocalStack, TandemClient, VfApplier, list[Vf]]]:
    settings = make_settings(
        nats_url,
        "test",
        heartbeat_interval=0.2,
        node_lost_after=2.0,
        device_classes={"default": {}, "vf": {"nic_function": "vf"}},
    )
    stack = LocalStack(settings, fleet=[], retry_interval=0.3)
    await stack.start()
    vfs = [lab.vf("0"), lab.vf("1")]
    applier = VfApplier(
        StateFile(lab.tmp / "agent-state.json"), resolver=NamedNetnsResolver(template="{uid}")
    )
    await applier.load()
    agent = NodeAgent(
        await stack._bus("nodeagent", node_name=NODE),
        node=NODE,
        backend=SimulatedBackend(topology(vfs), node=NODE),
        applier=applier,
        heartbeat_interval=0.2,
    )
    await agent.start()
    stack.agents[NODE] = agent
    await stack.wait_ready()
    client = await TandemClient(stack.buses[0]).start()
    yield stack, client, applier, vfs
    await client.close()
    await stack.stop()
    await applier.close()


def request(pod_ns: str, n: int) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"{pod_ns}.1",
        pod=PodRef("ml", f"trainer-{pod_ns}", pod_ns),  # the pod UID names its netns here
        gpus=n,
        rdma=n,
        device_class="vf",
        network=NetworkSpec(ifname_prefix="net", mtu=9000, addresses=[f"10.88.{i}.2/24" for i in range(n)]),
    )


async def test_assign_apply_release_cleanup_free_with_real_netns(
    system: tuple[LocalStack, TandemClient, VfApplier, list[Vf]], lab: Lab, bus_factory: BusFactory
) -> None:
    _, client, applier, vfs = system
    observer = await bus_factory("observer")
    applied = await observer.nc.subscribe(subjects.node_applied(NODE))
    cleaned = await observer.nc.subscribe(subjects.node_cleaned(NODE))
    pod = lab.netns()

    req = request(pod, 2)
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment) and sorted(n.name for n in a.nics) == ["mlx5_1", "mlx5_2"]
    ap = codec.NODE_EVENT.decode((await applied.next_msg(timeout=10)).data)
    assert isinstance(ap, Applied) and ap.ok, ap
    by_ifname = {n.ifname: n for n in a.nics}
    assert sorted(by_ifname) == ["net1", "net2"]
    for ifname, nic in by_ifname.items():
        in_pod = link_in(pod, ifname)
        assert in_pod is not None and in_pod["mtu"] == 9000 and "UP" in in_pod["flags"]  # type: ignore[operator]
        assert addrs_in(pod, ifname) == nic.addresses
        assert link_in(None, nic.netdev or "") is None

    await client.release(req.request_id, node=NODE)
    cl = codec.NODE_EVENT.decode((await cleaned.next_msg(timeout=10)).data)
    assert isinstance(cl, Cleaned) and cl.ok and cl.problems == [], cl
    freed = await client.wait_for(req.request_id, (Freed,))
    assert isinstance(freed, Freed)
    for vf in vfs:
        home = link_in(None, vf.name)
        assert home is not None and (home["address"], home["mtu"]) == (vf.mac, 1500)
    assert applier.state.records == {} and applier.state.owners == {}
    await applied.unsubscribe()
    await cleaned.unsubscribe()


async def test_unverifiable_cleanup_is_reported_and_never_freed(
    system: tuple[LocalStack, TandemClient, VfApplier, list[Vf]], lab: Lab, bus_factory: BusFactory
) -> None:
    _, client, _, _ = system
    observer = await bus_factory("observer")
    applied = await observer.nc.subscribe(subjects.node_applied(NODE))
    cleaned = await observer.nc.subscribe(subjects.node_cleaned(NODE))
    health = await observer.nc.subscribe(subjects.node_health(NODE))
    pod = lab.netns()
    req = request(pod, 1)
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment)
    ap = codec.NODE_EVENT.decode((await applied.next_msg(timeout=10)).data)
    assert isinstance(ap, Applied) and ap.ok, ap

    lab.namespaces.remove(pod)
    sh(f"ip netns del {pod}")  # the pod died and its veth with it: the VF cannot be verified home
    await asyncio.sleep(0.2)
    await client.release(req.request_id, node=NODE)
    cl = codec.NODE_EVENT.decode((await cleaned.next_msg(timeout=10)).data)
    assert isinstance(cl, Cleaned) and not cl.ok
    (problem,) = cl.problems
    dev = a.nics[0].name
    assert problem.startswith(f"{dev}: netdev {a.nics[0].netdev} is not back in the host namespace")
    ev = codec.NODE_EVENT.decode((await health.next_msg(timeout=10)).data)
    assert ev.device == dev and not ev.healthy and "cleanup failed" in ev.reason  # type: ignore[union-attr]
    await asyncio.sleep(1.0)
    held = (await client.allocations([NODE]))[0]
    assert req.request_id in held.allocations, "devices of an unverified cleanup must stay held"
    lab.links.remove(a.nics[0].netdev or "")  # destroyed with the namespace
    for sub in (applied, cleaned, health):
        await sub.unsubscribe()


async def test_assignment_before_the_pod_sandbox_exists_is_retried(
    system: tuple[LocalStack, TandemClient, VfApplier, list[Vf]], lab: Lab, bus_factory: BusFactory
) -> None:
    """The allocator decides before kubelet creates the pod's network namespace: the agent
    redelivers the assignment until the namespace exists, then applies once, ok."""
    _, client, _, _ = system
    observer = await bus_factory("observer")
    applied = await observer.nc.subscribe(subjects.node_applied(NODE))
    pod = f"tp{lab.tag}late"
    req = request(pod, 1)
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment)
    with pytest.raises(TimeoutError):
        await applied.next_msg(timeout=1.0)  # no failed Applied while the sandbox is missing
    assert lab.netns("late") == pod
    ap = codec.NODE_EVENT.decode((await applied.next_msg(timeout=10)).data)
    assert isinstance(ap, Applied) and ap.ok, ap
    assert link_in(pod, "net1") is not None
    await client.release(req.request_id, node=NODE)
    assert isinstance(await client.wait_for(req.request_id, (Freed,)), Freed)
    await applied.unsubscribe()
