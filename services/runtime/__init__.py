"""The small kit every service shares, split by job (docs/architecture.md, "Layers"):

* :mod:`.nats` — NATS behind one ``Bus``: connect, provisioning, traced publishes with
  retries, durable consumers, dead letters;
* :mod:`.kv` — state in JetStream KV: the compare-and-set record store, watches, whole reads;
* :mod:`.observe` — logs, traces, metrics and the ops port;
* :mod:`.process` — a service's main and shutdown, supervised tasks, embedded servers;
* :mod:`.settings` and :mod:`.errors`, at the root because every part reads them.

Error tree::

    RuntimeKitError
    ├── SettingsError        a config file or environment value is invalid (names the path)
    └── EmbeddedServerError  the embedded nats-server did not start
"""

from services.runtime.errors import EmbeddedServerError, RuntimeKitError, SettingsError

__all__ = ["EmbeddedServerError", "RuntimeKitError", "SettingsError"]
