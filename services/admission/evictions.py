"""The bridge's part of priority preemption: evict the victims' pods through the Eviction API.

The allocator publishes a :class:`~schemas.messages.PreemptionPlan` on ``tandem.alloc.preempt``
(durable consumer ``CONSUMER_BRIDGE_PREEMPT``) when a request of higher priority needs the
devices of running allocations (services/allocator/evictionplans.py). For each victim the bridge:

* checks that the preemptor's pod still exists (same uid): if it is gone, nobody needs the
  room any more and nothing is evicted (its own release drops the allocator's reservation);
* evicts the victim's pod with ``POST /api/v1/namespaces/NS/pods/NAME/eviction`` (a
  ``policy/v1`` Eviction with a uid precondition, so a pod recreated under the same name is
  not evicted). The API server applies PodDisruptionBudgets: an eviction they forbid now is
  answered ``429 TooManyRequests``. Evicted, the pod is deleted and the bridge's pod watch
  releases its allocation the normal way (release → verified cleanup → freed); the allocator
  then places the preemptor on the devices it kept for it. The victim gets an Event
  ``Preempted`` naming the preemptor;
* a victim whose pod is already gone (or another pod by that name) gets its allocation
  released directly, in case its pod's deletion was missed;
* a victim whose pod is already terminating or finished is left to the pod watch;
* a victim whose devices DRA ResourceClaims hold (docs/dra.md) is every pod using those claims
  (reserved for them, or naming them while alive): its devices come back only once no pod uses
  the claims, so each of those pods is evicted, and nothing is released directly — the claims'
  own path releases it (a claim made from a template is deleted with its pod, a shared claim is
  deallocated after its last pod).

Victims a PodDisruptionBudget protects are tried again with back-off (the plan is redelivered:
``eviction_backoff`` doubling per delivery, at most 60 s), and the preemptor's pod gets a
Warning Event ``PreemptionBlocked`` that says which pod and why (throttled and counted like the
bridge's other Events). Every step is idempotent: a redelivered plan finds the evicted pods
gone and releases nothing twice (stable release message ids).
"""

from __future__ import annotations

from typing import Protocol

from schemas.messages import PodRef, PreemptionPlan, Victim
from services.admission import metrics, names, podrules
from services.kube.client import KubeApi
from services.kube.errors import Conflict, KubeError, NotFound
from services.runtime.nats.bus import Delivery, Retry
from services.runtime.observe.logging import get_logger

__all__ = ["MAX_BACKOFF_S", "Evictor", "evict_victims"]

log = get_logger(__name__)

MAX_BACKOFF_S = 60.0
TOO_MANY_REQUESTS = 429  # the Eviction API's answer when a PodDisruptionBudget forbids it


class Evictor(Protocol):
    """What evicting needs of the pod bridge (:class:`services.admission.bridge.Bridge`):
    its Kubernetes client, its back-off, its Events and its releases — not the bridge."""

    kube: KubeApi
    eviction_backoff: float

    async def record_event(self, pod: podrules.PodView, *, reason: str, message: str) -> None: ...

    async def publish_release(
        self, rid: str, ref: PodRef, *, node: str | None, reason: str, traceparent: str | None
    ) -> None: ...

    def claim_consumers(self, request_id: str) -> list[PodRef] | None:
        """The pods using the DRA claims ``request_id`` holds; None when it holds none."""
        ...


async def evict_victims(bridge: Evictor, plan: PreemptionPlan, delivery: Delivery) -> None:
    """Evict ``plan``'s victims (module docstring); raises Retry while a PDB blocks one."""
    preemptor = await _live_pod(bridge, plan.pod.namespace, plan.pod.name, plan.pod.uid)
    if preemptor is None:
        log.info("preemption_dropped", request_id=plan.request_id, why="preemptor pod gone")
        return
    blocked: list[tuple[PodRef, str]] = []
    for victim in plan.victims:
        consumers = bridge.claim_consumers(victim.request_id)
        for ref in [victim.pod] if consumers is None else consumers:
            why = await _evict(bridge, plan, victim, ref, release_if_gone=consumers is None)
            if why is not None:
                blocked.append((ref, why))
    if not blocked:
        return
    text = "; ".join(f"{ref.namespace}/{ref.name}: {why}" for ref, why in blocked)
    message = (
        f"preempting {len(plan.victims)} pod(s) of lower priority on {plan.node}; eviction blocked "
        f"by a PodDisruptionBudget for {text}; retrying"
    )
    await bridge.record_event(preemptor, reason=names.EVENT_REASON_PREEMPTION_BLOCKED, message=message)
    delay = min(MAX_BACKOFF_S, bridge.eviction_backoff * 2 ** max(0, delivery.num_delivered - 1))
    raise Retry(f"preemption for {plan.request_id}: {text}", delay=delay)


async def _evict(
    bridge: Evictor, plan: PreemptionPlan, victim: Victim, ref: PodRef, *, release_if_gone: bool
) -> str | None:
    """Evict one pod of a victim; the reason when a PodDisruptionBudget blocks it, else None."""
    pod = await _live_pod(bridge, ref.namespace, ref.name, ref.uid)
    if pod is None and not release_if_gone:
        return None  # gone already: the claims it used go back once no pod uses them
    if pod is None:
        # Gone already (or another pod by that name): make sure its devices come back.
        metrics.BRIDGE_EVICTIONS.labels("gone").inc()
        await bridge.publish_release(
            victim.request_id,
            ref,
            node=victim.node,
            reason=f"preempted by {plan.request_id}; pod already gone",
            traceparent=None,
        )
        return None
    if pod.terminal or pod.metadata.deletionTimestamp:
        return None  # on its way out: the pod watch releases it
    try:
        await bridge.kube.evict_pod(ref.namespace, ref.name, uid=ref.uid)
    except (NotFound, Conflict):
        return None  # deleted or replaced meanwhile: the pod watch or resync releases it
    except KubeError as exc:
        if exc.status == TOO_MANY_REQUESTS:
            metrics.BRIDGE_EVICTIONS.labels("blocked").inc()
            log.info("eviction_blocked", request_id=plan.request_id, victim=victim.request_id, why=str(exc))
            return str(exc)
        raise
    metrics.BRIDGE_EVICTIONS.labels("evicted").inc()
    log.info("pod_evicted", request_id=plan.request_id, victim=victim.request_id, pod=ref.name)
    await bridge.record_event(
        pod,
        reason=names.EVENT_REASON_PREEMPTED,
        message=(
            f"evicted by Tandem for pod {plan.pod.namespace}/{plan.pod.name} of priority {plan.priority} "
            f"(this pod's priority: {victim.priority}) on {victim.node}"
        ),
    )
    return None


async def _live_pod(bridge: Evictor, namespace: str, name: str, uid: str) -> podrules.PodView | None:
    try:
        raw = await bridge.kube.get_pod(namespace, name)
    except NotFound:
        return None
    pod = podrules.read_pod(raw)
    return pod if not uid or pod.metadata.uid == uid else None
