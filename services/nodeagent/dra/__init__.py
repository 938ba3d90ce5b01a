"""Tandem as a DRA driver on the node (``resource.k8s.io/v1``): the node's devices as
ResourceSlices (:mod:`.slices`, pure). The design of the whole DRA path — claims allocated
jointly by Tandem, the kubelet plugin — is in docs/dra.md."""
