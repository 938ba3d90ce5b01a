"""The small kit every service shares: settings, NATS connect + provisioning, consumers with a
dead-letter path, W3C trace propagation, structlog logging, guarded tasks and shutdown.

Error tree::

    RuntimeKitError
    ├── SettingsError        a config file or environment value is invalid (names the path)
    └── EmbeddedServerError  the embedded nats-server did not start
"""

from services.runtime.errors import EmbeddedServerError, RuntimeKitError, SettingsError

__all__ = ["EmbeddedServerError", "RuntimeKitError", "SettingsError"]
