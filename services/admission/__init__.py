"""The Kubernetes edge: a mutating admission webhook and the pod bridge.

* :mod:`.podrules` — pure decisions: read a pod, validate its Tandem request, compute the
  admission JSONPatch and the allocation request. No I/O.
* :mod:`.podwrites` — pure: what the bridge writes back (the bind patch, the assignment
  annotation, the Events on the pod). No I/O.
* :mod:`.webhook` — aiohttp over TLS serving ``admission.k8s.io/v1`` AdmissionReview; adds the
  scheduling gate, the managed label, the device class defaults and the ``tandem.io/traceparent``
  that starts the allocation's trace (span ``admission.admit``). It never publishes: in
  mutating admission a pod from ``generateName`` has no name or UID yet, and the create can
  still fail later.
* the Kubernetes API is reached through the adapter :mod:`services.kube` (client, Lease-based
  leader election so only one bridge replica acts, the errors ``KubeError``/``NotFound``/``Conflict``).
* :mod:`.bridge` — turns persisted gated pods into ``alloc.request``, applies ``assigned`` back
  onto the pod (node affinity, assignment annotation, gate removed), records ``failed`` as one
  updated Event, publishes ``alloc.release`` when a pod is deleted or finishes, and resyncs
  pods against the request records at start.
* :mod:`.jobwatch` — pure: the pods of one job (Tandem's label, LeaderWorkerSet, JobSet) gathered
  until all exist, then one job request; :mod:`.evictions` evicts preemption's victims.
* :mod:`.draclaims`, :mod:`.drapods` — pure DRA rules: a pod's ResourceClaims as one request,
  the webhook's verdict, the allocation written; :mod:`.drabridge` applies them (docs/dra.md).
* :mod:`.drajobs` — pure: a job whose pods ask through claims, made of each pod's claims and
  released per pod by its job record; :mod:`.drajobbridge` applies it for the DRA bridge.
* :mod:`.claims` — pure rules for ``DeviceClaim``\\ s (spec, request, expiry, who may use one,
  the status written); :mod:`.claimbridge` applies them (claims watch, pods that use a claim).

Error tree::

    AdmissionError
    ├── InvalidPod     the object is not a readable pod (names the JSON path)
    ├── PolicyError    the Tandem request is invalid (message for the pod author)
    ├── InvalidClaim   a DeviceClaim's spec is invalid (names the claim and the field)
    ├── ReviewError    the body is not an AdmissionReview v1 request (400)
    │   └── BodyTooLarge   over the size limit (413)

(The Kubernetes API's own errors are ``services.kube.errors``.)
"""

from services.admission.errors import (
    AdmissionError,
    BodyTooLarge,
    InvalidClaim,
    InvalidPod,
    PolicyError,
    ReviewError,
)

__all__ = [
    "AdmissionError",
    "BodyTooLarge",
    "InvalidClaim",
    "InvalidPod",
    "PolicyError",
    "ReviewError",
]
