"""Watches survive the real server (issue "Meet the real platform", item 5).

The bridge lists and then watches pods; whenever a watch ends (the server's timeout, a
restart, 410 Gone for a resourceVersion the server no longer has) it lists again and resyncs.
Here the API server is really restarted and etcd's history really compacted, with a pod
waiting for room across both; afterwards the waiting pod is placed once room appears and a new
pod is placed, each with exactly one request. A pod deleted while its request is in flight
ends with nothing held.
"""

from __future__ import annotations

import asyncio
import json

from services.admission import names
from services.kube.client import KubeClient
from services.kube.errors import KubeError
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually
from tests.cluster.test_pod_life import fill_every_node, make_namespace, pod_of, training_pod


def running(cp: ControlPlane, ns: str, name: str) -> dict[str, object] | None:
    pod = pod_of(cp, ns, name)
    return pod if pod["status"].get("phase") == "Running" else None


def test_a_restart_and_a_compaction_lose_nothing_and_do_nothing_twice(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    fill_every_node(release, ns)
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("waiter", gpus=4, nics=4))
    eventually(
        lambda: any(r.state == "pending" for r in release.requests_of(ns, "waiter")), what="waiter pending"
    )
    before = cp.request("GET", f"/api/v1/pods?labelSelector={names.MANAGED_SELECTOR}")["metadata"][
        "resourceVersion"
    ]

    cp.restart_apiserver()
    cp.compact_etcd()

    # The real server answers a watch from before the restart with 410 Gone, which the
    # client surfaces as an error the bridge's loop answers by listing again.
    async def watch_from_before() -> KubeError:
        kube = await KubeClient.connect(kubeconfig=str(cp.admin_kubeconfig))
        try:
            async for _ in kube.watch_pods(
                label_selector=names.MANAGED_SELECTOR, resource_version="1", timeout_s=5
            ):
                pass
        except KubeError as exc:
            return exc
        finally:
            await kube.close()
        raise AssertionError("a watch from a compacted resourceVersion was not refused")

    gone = asyncio.run(watch_from_before())
    assert gone.status == 410, gone
    assert before  # the list before the restart had a version; the bridge's is as old

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/fill-0")
    waiter = eventually(lambda: running(cp, ns, "waiter"), timeout=90, what="waiter placed after the restart")
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("after", gpus=1, nics=1))
    after = eventually(lambda: running(cp, ns, "after"), what="a new pod placed after the restart")
    for pod in (waiter, after):
        name = pod["metadata"]["name"]  # type: ignore[index]
        records = release.requests_of(ns, name)
        assert [r.state for r in records] == ["assigned"], (name, records)
        annotation = json.loads(pod["metadata"]["annotations"][names.ASSIGNMENT])  # type: ignore[index]
        assert annotation["request_id"] == records[0].request.request_id
        assert pod["spec"]["nodeName"] == records[0].node  # type: ignore[index]
    release.empty_namespace(ns)


def test_a_pod_deleted_while_its_request_is_in_flight_holds_nothing(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    for i in range(5):
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod(f"brief-{i}", gpus=2, nics=2))
        # Deleted the moment its request exists: pending, deciding, or just assigned.
        eventually(lambda i=i: release.requests_of(ns, f"brief-{i}"), what=f"brief-{i} requested")
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/brief-{i}?gracePeriodSeconds=0")
    eventually(lambda: not release.live_requests_in(ns), timeout=90, what="nothing held for the deleted pods")
    for i in range(5):
        (record,) = release.requests_of(ns, f"brief-{i}")
        assert record.state in ("freed", "cancelled"), record
    eventually(
        lambda: not cp.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"],
        what="the pods gone from the API",
    )
