"""Typed errors of the Kubernetes adapter (tree drawn in ``services.kube``)."""

from __future__ import annotations


class KubeError(Exception):
    """The Kubernetes API answered with an error status (``status``/``reason`` kept)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class NotFound(KubeError):
    """404: the object does not exist (any more)."""


class Conflict(KubeError):
    """409: the object exists already, or its resourceVersion moved on (optimistic lock lost)."""
