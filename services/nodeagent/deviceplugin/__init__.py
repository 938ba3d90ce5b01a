"""The kubelet device plugin for ``tandem.io/gpu`` and ``tandem.io/rdma``.

``logic`` holds the pure decisions; ``server`` the gRPC servers, kubelet registration and
re-registration; ``v1beta1`` the generated API (from ``v1beta1/api.proto``).
"""
