"""API coordinates of the Kubernetes resources Tandem defines (constants only, so that code
naming them — the webhook's names, the CLI — does not load the Kubernetes client)."""

from __future__ import annotations

# The DeviceClaim custom resource (deploy/helm/tandem/crds/deviceclaims.yaml).
CLAIM_GROUP = "tandem.io"
CLAIM_VERSION = "v1alpha1"
CLAIM_PLURAL = "deviceclaims"
CLAIM_KIND = "DeviceClaim"

# DRA's ResourceSlices (group, version, plural), written by the node agent for its own node.
RESOURCE_SLICES = ("resource.k8s.io", "v1", "resourceslices")
# DRA's ResourceClaims (group, version, plural): the node agent reads the ones kubelet asks it to
# prepare.
RESOURCE_CLAIMS = ("resource.k8s.io", "v1", "resourceclaims")
# ResourceClaimTemplates: the webhook reads a pod's templates (services.admission.webhook).
RESOURCE_CLAIM_TEMPLATES = ("resource.k8s.io", "v1", "resourceclaimtemplates")
