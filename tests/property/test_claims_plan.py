"""Property test of claims and reservations, replayed by ``tandem plan`` with the real core.

Random traces of claims (some shareable, some expiring), pods on claims, plain pods, frees and
clock ticks over a small fleet. Read back from the output alone, what must hold at every line:

* a claim's devices are never given to anyone else while the claim exists (no plain pod and no
  other claim gets any of them);
* a pod that uses a claim gets exactly the claim's node and devices, and a claim that is not
  shareable serves at most one pod at a time;
* a reservation never expires while a pod uses it, nor before its deadline; once expired or
  freed, its devices may be handed out again.

The second test runs the same checks with claims and plain pods that may ask MIG instances
(``mig_profile``) on the documented MIG node beside a plain one; a MIG instance is a device of
its own there.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.config import default_device_classes
from services.allocator.core import Cluster
from services.topology import load_topology
from tools.cli.plan import run_plan

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Dev = tuple[str, str, str]  # (node, "gpu"/"nic", id)


MIG_NODE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mig" / "dgx-h100-mig.yaml"


@st.composite
def traces(draw: st.DrawFn, *, mig: bool = False) -> list[dict[str, Any]]:
    """``mig``: claims and plain pods may ask MIG instances (``mig_profile``) too."""
    lines: list[dict[str, Any]] = []
    claims: list[str] = []
    ids: list[str] = []
    for n in range(draw(st.integers(1, 30))):
        op = draw(st.sampled_from(["claim", "claim", "use", "use", "alloc", "free", "tick"]))
        if op == "claim":
            gpus = draw(st.integers(0, 4))
            line: dict[str, Any] = {
                "kind": "claim",
                "id": f"c{n}",
                "gpus": gpus,
                "rdma": draw(st.integers(int(gpus == 0), 2)),
            }
            if draw(st.booleans()):
                line["expires_after"] = draw(st.integers(1, 50))
            _maybe_mig(draw, line, mig=mig)
            line["shareable"] = draw(st.booleans())
            line["pairing"] = "shared"
            claims.append(line["id"])
        elif op == "use" and claims:
            line = {"kind": "alloc", "id": f"u{n}", "claim": draw(st.sampled_from(claims))}
        elif op == "alloc":
            gpus = draw(st.integers(0, 4))
            line = {
                "kind": "alloc",
                "id": f"p{n}",
                "gpus": gpus,
                "rdma": draw(st.integers(int(gpus == 0), 2)),
                "pairing": "shared",
            }
            _maybe_mig(draw, line, mig=mig)
        elif op == "free" and ids:
            line = {"kind": "free", "id": draw(st.sampled_from(ids))}
        else:
            line = {"kind": "tick", "seconds": draw(st.integers(0, 30))}
        if "id" in line and line["kind"] != "free":
            ids.append(line["id"])
        lines.append(line)
    return lines


def _maybe_mig(draw: st.DrawFn, line: dict[str, Any], *, mig: bool) -> None:
    profile = draw(st.sampled_from([None, "1g.10gb", "3g.40gb"])) if mig else None
    if profile is not None:
        line["mig_profile"] = profile
        line["gpus"] = max(line["gpus"], 1)


def devices(line: dict[str, Any]) -> set[Dev]:
    """A line's devices; a MIG instance is its own device (``gpu1-mig9-0``), not its GPU."""
    node = line["node"]
    return {(node, "gpu", g["mig"]["device"] if "mig" in g else str(g["index"])) for g in line["gpus"]} | {
        (node, "nic", n["name"]) for n in line["nics"]
    }


@SETTINGS
@given(trace=traces())
def test_a_claims_devices_are_never_given_to_anyone_else(trace: list[dict[str, Any]]) -> None:
    cluster = Cluster(node_policy="binpack", device_classes=default_device_classes())
    topo = load_topology("pcie-4gpu-2nic")
    for i in range(2):
        cluster.set_node(f"n{i}", topo)
    check(cluster, trace)


@settings(SETTINGS, max_examples=150)
@given(trace=traces(mig=True))
def test_a_mig_claims_instances_are_never_given_to_anyone_else(trace: list[dict[str, Any]]) -> None:
    """The same, with claims and pods asking MIG instances on the documented MIG node (GPUs 0-3
    in MIG mode) beside a plain node: a claimed instance goes to no one else, and a pod on a
    MIG claim gets exactly its instances."""
    cluster = Cluster(node_policy="binpack", device_classes=default_device_classes())
    cluster.set_node("mig", load_topology(str(MIG_NODE)))
    cluster.set_node("plain", load_topology("pcie-4gpu-2nic"))
    check(cluster, trace)


def check(cluster: Cluster, trace: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    run_plan(cluster, [json.dumps(x) for x in trace], source="trace", out=out, summary=False)
    uses = {x["id"]: x["claim"] for x in trace if x.get("kind") == "alloc" and "claim" in x}
    spec = {x["id"]: x for x in trace if x.get("kind") == "claim"}

    held_by_claims: dict[str, set[Dev]] = {}
    claim_users: dict[str, set[str]] = {}
    deadline: dict[str, float] = {}
    plain: dict[str, set[Dev]] = {}
    clock = 0.0
    pos = 0  # next input line not yet matched to an output line
    for raw in out.getvalue().splitlines():
        line = json.loads(raw)
        rid, status = line["id"], line["status"]
        if status == "expired":
            assert rid in held_by_claims and not claim_users[rid], "expired while in use"
            # Printed by a free (input already matched) or by a tick still ahead: the clock at
            # that tick is past the deadline.
            while deadline[rid] > clock and pos < len(trace) and trace[pos]["kind"] == "tick":
                clock += trace[pos]["seconds"]
                pos += 1
            assert deadline[rid] <= clock, "expired before its deadline"
            del held_by_claims[rid]
            continue
        while trace[pos]["kind"] == "tick":
            clock += trace[pos]["seconds"]
            pos += 1
        x = trace[pos]
        pos += 1
        assert x["id"] == rid
        if status == "claimed":
            devs = devices(line)
            for other in [*held_by_claims.values(), *plain.values()]:
                assert not devs & other, f"claim {rid} got devices someone holds: {devs & other}"
            held_by_claims[rid], claim_users[rid] = devs, set()
            if "expires_after" in spec[rid]:
                deadline[rid] = clock + spec[rid]["expires_after"]
        elif status == "assigned" and rid in uses:
            cid = uses[rid]
            assert cid in held_by_claims, "a pod got a claim that does not exist"
            assert devices(line) == held_by_claims[cid], "a pod on a claim got other devices"
            assert spec[cid]["shareable"] or not claim_users[cid], "a non-shareable claim served two pods"
            claim_users[cid].add(rid)
        elif status == "assigned":
            devs = devices(line)
            for cid, held in held_by_claims.items():
                assert not devs & held, f"plain pod {rid} got devices of claim {cid}: {devs & held}"
            plain[rid] = devs
        elif status == "freed":
            if rid in held_by_claims:
                del held_by_claims[rid]
                for users in claim_users.values():
                    users.discard(rid)
            elif rid in uses:
                claim_users.get(uses[rid], set()).discard(rid)
            else:
                plain.pop(rid, None)
        else:
            assert status == "unschedulable"
