"""Typed errors of the runtime kit (tree drawn in ``services.runtime``)."""

from __future__ import annotations


class RuntimeKitError(Exception):
    """Base of every error the runtime kit raises."""


class SettingsError(RuntimeKitError):
    """Invalid configuration; the message names the file or variable and the bad field."""


class EmbeddedServerError(RuntimeKitError):
    """The embedded nats-server failed to start or report its port."""
