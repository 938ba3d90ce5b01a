"""NATS auth callout: per-component and per-node identities from Kubernetes (service.py)."""
