"""A node agent writes only its own node's ResourceSlices, as the real API server enforces it
(issue "Tandem speaks DRA", item 5: "the node agent's identity may write only its own
ResourceSlices").

The identity is the token the cluster gives a running node agent pod (TokenRequest bound to
the pod, so the API server adds the pod's node as ``authentication.kubernetes.io/node-name``).
RBAC grants ResourceSlices cluster-wide; the chart's ValidatingAdmissionPolicy must then refuse
a slice of another node — created, taken over by an update, or deleted — and a slice of
another driver, while the agent's own node's slices go through.
"""

from __future__ import annotations

import copy
from typing import Any

from services.nodeagent.dra.slices import TAINT_CORDONED, resource_slices
from services.topology import load_topology
from tests.cluster.release import Release, eventually
from tests.cluster.test_rbac import token_of

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _slice(node: str) -> dict[str, Any]:
    """A slice of a pool of its own (the node's agent keeps the pool named after the node)."""
    (body,) = resource_slices(load_topology("dgx-h100"), node=node, generation=1)
    body["metadata"]["name"] = f"{node}-rbac-test"
    body["spec"]["pool"]["name"] = f"{node}-rbac-test"
    return body


def test_a_node_agent_writes_its_own_nodes_slices_and_no_one_elses(release: Release) -> None:
    cp = release.cp
    (agent, other, *_) = release.pods["nodeagent"]
    own_node = agent.pod["spec"]["nodeName"]
    other_node = other.pod["spec"]["nodeName"]
    assert own_node != other_node
    token = token_of(release, "nodeagent")  # the first agent's pod: on own_node

    mine = _slice(own_node)
    status, created = cp.request_as(token, "POST", SLICES, mine)
    assert status == 201, created
    try:
        # Its own slice it may update and delete.
        created["spec"]["pool"]["generation"] = 2
        status, updated = cp.request_as(token, "PUT", f"{SLICES}/{mine['metadata']['name']}", created)
        assert status == 200, updated

        # Another node's slice: not created ...
        status, answer = cp.request_as(token, "POST", SLICES, _slice(other_node))
        assert status in (403, 422), answer
        own_only = f"node agent on {own_node} may write only the ResourceSlices of its own node"
        assert own_only in answer["message"], answer

        # ... not taken over, not moved away from the agent's node, not deleted.
        theirs = cp.request("POST", SLICES, _slice(other_node))  # as the cluster admin
        try:
            for method, body in (("PUT", theirs), ("DELETE", None)):
                status, answer = cp.request_as(token, method, f"{SLICES}/{theirs['metadata']['name']}", body)
                assert status in (403, 422), (method, answer)
                assert "may write only the ResourceSlices of its own node" in answer["message"], answer
            # Moving a slice between nodes the API's own validation refuses first (nodeName is
            # immutable; validation runs before validating admission): refused either way.
            hijack = copy.deepcopy(theirs)
            hijack["spec"]["nodeName"] = own_node
            moved = copy.deepcopy(updated)
            moved["spec"]["nodeName"] = other_node
            for name, body in ((theirs["metadata"]["name"], hijack), (mine["metadata"]["name"], moved)):
                status, answer = cp.request_as(token, "PUT", f"{SLICES}/{name}", body)
                assert status in (403, 422), answer
                assert "field is immutable" in answer["message"] or "of its own node" in answer["message"]
            still = cp.request("GET", f"{SLICES}/{theirs['metadata']['name']}")
            assert still["spec"]["nodeName"] == other_node
        finally:
            cp.request("DELETE", f"{SLICES}/{theirs['metadata']['name']}")

        # Another driver's slice on its own node: refused too.
        foreign = _slice(own_node)
        foreign["metadata"]["name"] = f"{own_node}-gpu.example.com"
        foreign["spec"]["driver"] = "gpu.example.com"
        status, answer = cp.request_as(token, "POST", SLICES, foreign)
        assert status in (403, 422), answer
        assert "only ResourceSlices of driver tandem.io" in answer["message"], answer
    finally:
        status, answer = cp.request_as(token, "DELETE", f"{SLICES}/{mine['metadata']['name']}")
        assert status == 200, answer


def test_running_node_agents_publish_their_nodes_slices_and_taint_a_cordoned_device(release: Release) -> None:
    """The chart's node agents (dra.enabled), each with its own pod's token: every node that
    runs one gets its pool of slices; an operator's cordon (``tandem device cordon``, here the
    same NATS command) taints the device in the slice, and an uncordon takes the taint away."""
    cp = release.cp
    agents = release.pods["nodeagent"]
    nodes = sorted(p.pod["spec"]["nodeName"] for p in agents)

    def pools() -> dict[str, list[dict[str, Any]]]:
        items = cp.request("GET", f"{SLICES}?fieldSelector=spec.driver%3Dtandem.io")["items"]
        out: dict[str, list[dict[str, Any]]] = {}
        for s in items:
            out.setdefault(s["spec"]["nodeName"], []).append(s)
        return out

    eventually(lambda: sorted(pools()) == nodes, what=f"a pool for every agent's node {nodes}")
    node = nodes[0]
    (pool,) = pools()[node]
    assert pool["spec"]["pool"]["name"] == node
    assert {d["name"] for d in pool["spec"]["devices"]} >= {"gpu0", "mlx5-0"}
    generation = pool["spec"]["pool"]["generation"]

    def gpu1_taints() -> list[str]:
        (s,) = pools()[node]
        gpu1 = next(d for d in s["spec"]["devices"] if d["name"] == "gpu1")
        return [t["key"] for t in gpu1.get("taints", [])]

    release.command(node, "gpu1", "cordon", reason="maintenance")
    eventually(lambda: gpu1_taints() == [TAINT_CORDONED], what="gpu1 tainted as cordoned")
    release.command(node, "gpu1", "uncordon")
    eventually(lambda: gpu1_taints() == [], what="gpu1's taint gone")
    assert pools()[node][0]["spec"]["pool"]["generation"] == generation + 2
