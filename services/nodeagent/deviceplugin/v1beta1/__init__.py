"""Generated kubelet device-plugin API v1beta1 (from api.proto; do not edit the _pb2 files)."""
