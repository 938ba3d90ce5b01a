"""One property over everything issue 12 adds, replayed together by ``tandem plan``.

The other property tests check one mechanism each (shares in ``test_core_shares``, MIG in
``test_core_mig``, the preemption search against an exhaustive one in
``test_core_preemption``, claims in ``test_claims_plan``). Here random traces mix them on a
small fleet whose last GPU on each node is in MIG mode — whole-GPU pods of several priorities
(some allowed to preempt), pods asking a *share* of each GPU, pods asking MIG instances of a
profile, claims (some shareable, some reservations that expire), pods on claims, frees and
clock ticks — and
the real core decides every line through the planner (``tools/cli/plan.py``), as the
allocator would. Read back from the output alone, what must hold after every line:

* a GPU is never both held whole and shared, and its shares never add up to more than its
  memory, 100 % of its compute, or the class's ``max_shares_per_gpu``;
* a GPU in MIG mode is never given whole or shared, only its instances, each to one holder
  at a time, of the profile asked;
* no NIC is held twice; a claim's devices go to no one but the pods that use the claim;
* a ``preempted`` victim was allocated, is not a claim (claims are never preemption victims),
  has a priority strictly below its preemptor's, and the preemptor was allowed to preempt;
* the preemptor is then placed (the planner applies the eviction at once).
"""

from __future__ import annotations

import io
import json
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.config import DeviceClass
from schemas.topology import MigInstance, NodeTopology, locate
from services.allocator.core import Cluster
from services.topology import load_topology
from tools.cli.plan import run_plan

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOPOLOGY = "pcie-4gpu-2nic"
NODES = 2
MAX_SHARES = 3
CLASSES = {
    "default": DeviceClass(),
    "shared": DeviceClass(sharing="hami", max_shares_per_gpu=MAX_SHARES),
}


MIG_GPU = 3  # in MIG mode on every node: 2 x 1g.10gb and 1 x 2g.20gb
MIG_INSTANCES = [
    MigInstance(profile="1g.10gb", uuid="MIG-aaaa0001", gpu_instance_id=1, memory_mib=9856),
    MigInstance(profile="1g.10gb", uuid="MIG-aaaa0002", gpu_instance_id=2, memory_mib=9856),
    MigInstance(profile="2g.20gb", uuid="MIG-aaaa0003", gpu_instance_id=3, memory_mib=19968),
]


def topology() -> NodeTopology:
    """The built-in 4-GPU PCIe server with its last GPU partitioned into MIG instances."""
    topo = load_topology(TOPOLOGY)
    for sock in topo.sockets:
        for numa in sock.numa_nodes:
            for root in numa.roots:
                for holder in [root, *root.switches]:
                    holder.gpus = [
                        msgspec.structs.replace(g, mig_mode=True, mig_instances=list(MIG_INSTANCES))
                        if g.index == MIG_GPU
                        else g
                        for g in holder.gpus
                    ]
    return topo


@st.composite
def traces(draw: st.DrawFn) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    claims: list[str] = []
    ids: list[str] = []
    for n in range(draw(st.integers(1, 40))):
        op = draw(
            st.sampled_from(
                ["whole", "whole", "share", "share", "mig", "claim", "use", "free", "free", "tick"]
            )
        )
        line: dict[str, Any]
        if op == "whole":
            gpus = draw(st.integers(1, 4))
            line = {"kind": "alloc", "id": f"w{n}", "gpus": gpus, "rdma": draw(st.integers(0, 2))}
            line["pairing"] = "shared"
            line["priority"] = draw(st.integers(0, 3))
            if draw(st.booleans()):
                line["preemption"] = "lower-priority"
        elif op == "share":
            line = {
                "kind": "alloc",
                "id": f"s{n}",
                "gpus": draw(st.integers(1, 2)),
                "rdma": 0,
                "device_class": "shared",
                "priority": draw(st.integers(0, 3)),
            }
            memory = draw(st.sampled_from([None, 4096, 8192, 16384]))
            cores = draw(st.sampled_from([None, 10, 25, 50]))
            if memory is None and cores is None:
                cores = 25
            if memory is not None:
                line["gpu_memory_mib"] = memory
            if cores is not None:
                line["gpu_cores_percent"] = cores
        elif op == "mig":
            line = {
                "kind": "alloc",
                "id": f"m{n}",
                "gpus": draw(st.integers(1, 2)),
                "rdma": draw(st.integers(0, 1)),
                "pairing": "shared",
                "mig_profile": draw(st.sampled_from(["1g.10gb", "2g.20gb"])),
                "priority": draw(st.integers(0, 3)),
            }
        elif op == "claim":
            gpus = draw(st.integers(1, 2))
            line = {"kind": "claim", "id": f"c{n}", "gpus": gpus, "rdma": draw(st.integers(0, 1))}
            line["pairing"] = "shared"
            line["shareable"] = draw(st.booleans())
            if draw(st.booleans()):
                line["expires_after"] = draw(st.integers(1, 50))
            claims.append(line["id"])
        elif op == "use" and claims:
            line = {"kind": "alloc", "id": f"u{n}", "claim": draw(st.sampled_from(claims))}
        elif op == "free" and ids:
            line = {"kind": "free", "id": draw(st.sampled_from(ids))}
        else:
            line = {"kind": "tick", "seconds": draw(st.integers(0, 30))}
        if line["kind"] in ("alloc", "claim"):
            ids.append(line["id"])
        lines.append(line)
    return lines


class Holding:
    """What one allocation (a pod or a claim) holds, from its output line."""

    def __init__(self, line: dict[str, Any]) -> None:
        node = line["node"]
        gpus = [g for g in line["gpus"] if "mig" not in g]
        self.whole = {(node, g["index"]) for g in gpus if "memory_mib" not in g and "cores_percent" not in g}
        self.shares = {
            (node, g["index"]): (g.get("memory_mib", 0), g.get("cores_percent", 0))
            for g in gpus
            if "memory_mib" in g or "cores_percent" in g
        }
        self.mig = {
            (node, g["mig"]["uuid"]): (g["index"], g["mig"]["profile"]) for g in line["gpus"] if "mig" in g
        }
        self.nics = {(node, n["name"]) for n in line["nics"]}
        self.devices = (
            {(node, "gpu", g["index"]) for g in gpus}
            | {(node, "mig", uuid) for (_, uuid) in self.mig}
            | {(node, "nic", n["name"]) for n in line["nics"]}
        )


def _gpu_memory() -> dict[int, int]:
    topo = load_topology(TOPOLOGY)
    return {loc.device.index: loc.device.memory_mib for loc in locate(topo) if hasattr(loc.device, "uuid")}


def _check_fits(held: dict[str, Holding], memory: dict[int, int]) -> None:
    whole: set[tuple[str, int]] = set()
    nics: set[tuple[str, str]] = set()
    instances: set[tuple[str, str]] = set()
    used: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rid, h in held.items():
        assert not h.whole & whole, f"{rid}: GPU {h.whole & whole} held whole twice"
        assert not h.nics & nics, f"{rid}: NIC {h.nics & nics} held twice"
        assert not set(h.mig) & instances, f"{rid}: MIG instance {set(h.mig) & instances} held twice"
        assert all(gpu != MIG_GPU for _, gpu in h.whole), f"{rid}: a MIG-mode GPU given whole"
        assert all(gpu != MIG_GPU for _, gpu in h.shares), f"{rid}: a MIG-mode GPU shared"
        whole |= h.whole
        nics |= h.nics
        instances |= set(h.mig)
        for gpu, share in h.shares.items():
            used.setdefault(gpu, []).append(share)
    for gpu, shares in used.items():
        assert gpu not in whole, f"GPU {gpu} is held whole and shared"
        assert len(shares) <= MAX_SHARES, f"GPU {gpu}: {len(shares)} shares"
        assert sum(m for m, _ in shares) <= memory[gpu[1]], f"GPU {gpu}: memory overcommitted {shares}"
        assert sum(c for _, c in shares) <= 100, f"GPU {gpu}: compute overcommitted {shares}"


@SETTINGS
@given(trace=traces())
def test_shares_claims_and_preemption_together_keep_every_invariant(trace: list[dict[str, Any]]) -> None:
    cluster = Cluster(node_policy="binpack", device_classes=dict(CLASSES))
    topo = topology()
    for i in range(NODES):
        cluster.set_node(f"n{i}", topo)
    out = io.StringIO()
    run_plan(cluster, [json.dumps(x) for x in trace], source="trace", out=out, summary=False)
    spec = {x["id"]: x for x in trace if x["kind"] in ("alloc", "claim")}
    memory = _gpu_memory()

    held: dict[str, Holding] = {}  # pods and claims holding devices of their own
    claims: dict[str, Holding] = {}  # the claims among them
    users: dict[str, str] = {}  # pod on a claim -> the claim
    evicted_for: dict[str, set[str]] = {}  # preemptor -> its victims, before its own line
    for raw in out.getvalue().splitlines():
        line = json.loads(raw)
        rid, status = line["id"], line["status"]
        if status == "preempted":
            by = line["by"]
            assert rid in held and rid not in claims, f"{by} evicted {rid}, which is not a pod's allocation"
            assert spec[rid].get("priority", 0) < spec[by].get("priority", 0), (
                f"{by} (priority {spec[by].get('priority', 0)}) evicted {rid} "
                f"(priority {spec[rid].get('priority', 0)})"
            )
            assert spec[by].get("preemption") == "lower-priority", f"{by} may not preempt"
            del held[rid]
            evicted_for.setdefault(by, set()).add(rid)
            continue
        if rid in evicted_for:
            assert status == "assigned", f"{rid} evicted {sorted(evicted_for[rid])} but was not placed"
            del evicted_for[rid]
        if status in ("assigned", "claimed") and rid in spec and "claim" in spec[rid]:
            cid = spec[rid]["claim"]
            assert cid in claims, f"{rid} was given claim {cid}, which holds nothing"
            assert Holding(line).devices == claims[cid].devices, f"{rid} got other devices than claim {cid}"
            users[rid] = cid
        elif status in ("assigned", "claimed"):
            mine = Holding(line)
            profile = spec[rid].get("mig_profile")
            if profile is not None:
                assert len(mine.mig) == spec[rid]["gpus"] and not mine.whole and not mine.shares, line
                assert all(gpu == MIG_GPU and p == profile for gpu, p in mine.mig.values()), line
            else:
                assert not mine.mig, f"{rid} asked no MIG profile but got instances: {line}"
            for cid, claim in claims.items():
                assert not mine.devices & claim.devices, f"{rid} got devices of claim {cid}"
            held[rid] = mine
            if status == "claimed":
                claims[rid] = mine
            _check_fits(held, memory)
        elif status in ("freed", "expired"):
            if rid in users:
                del users[rid]
            elif rid in held:
                del held[rid]
                if claims.pop(rid, None) is not None:
                    for pod in [p for p, c in users.items() if c == rid]:
                        del users[pod]
    assert not evicted_for, f"preemptors never placed: {evicted_for}"
