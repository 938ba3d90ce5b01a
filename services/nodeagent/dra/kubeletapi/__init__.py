"""Generated kubelet APIs a DRA driver serves (Kubernetes 1.36): the DRA plugin ``v1``
(``dra.proto``), resource health ``v1alpha1`` (``health.proto``) and plugin registration
(``pluginregistration.proto``); vendored from k8s.io/kubelet v0.36.3, do not edit the
_pb2 files."""
