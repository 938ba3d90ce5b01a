"""The Kubernetes adapter: the one place Tandem talks to the Kubernetes API.

``client`` is the thin, project-owned wrapper (:class:`~services.kube.client.KubeApi`, plain JSON
dicts in and out, only the calls Tandem makes); ``leader`` elects one replica with a
``coordination.k8s.io`` Lease; ``relist`` runs the list-then-watch loop of a cache of
objects; ``resources`` names the custom resources Tandem defines.
The admission service (webhook, bridges), the auth callout (TokenReview) and, later, the DRA
driver use it; it imports only the kit below it (docs/architecture.md, "Layers").

Errors (``services.kube.errors``)::

    KubeError            the API answered with an error status (status, reason kept)
    ├── NotFound         404: the object does not exist (any more)
    └── Conflict         409: exists already, or its resourceVersion moved on
"""
