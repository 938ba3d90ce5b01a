"""Settings, loaded in one place: defaults ← optional config file ← ``TANDEM_*`` environment
(← a caller's explicit overrides; a caller may also bring defaults of its own).

The config file (YAML or JSON; ``TANDEM_CONFIG`` or ``--config``) holds the same keys as
:class:`Settings`. Everything is validated by msgspec, so a bad file fails at start with the
path and the offending field (``/etc/tandem.yaml: Expected `float`, got `str` - at
`$.heartbeat_interval```) instead of surfacing later. This module is the only place that reads
``os.environ`` (enforced by ruff's banned-api rule).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from schemas import limits
from schemas.config import DeviceClass, default_device_classes
from services.runtime.errors import SettingsError

ENV_PREFIX = "TANDEM_"


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    # Credentials, each a path to a file (a mounted Secret; never a secret in this config):
    # a decentralized-auth ``.creds`` file (JWT + nkey seed), or an nkey seed, or a user name
    # with a password file. At most one of the three.
    nats_creds: str | None = None
    # A Kubernetes service-account token (projected, audience ``tandem-nats``), re-read at every
    # (re)connect because the kubelet rotates it; the NATS auth callout turns it into this
    # component's permissions (services.authcallout).
    nats_token_file: str | None = None
    nats_nkey_seed: str | None = None
    nats_user: str | None = None
    nats_password_file: str | None = None
    # The auth callout's own settings (python -m services.authcallout): its issuer nkey seed,
    # the account its users join, the namespace and service-account → role map it accepts,
    # the token audience, and the longest a user JWT lives.
    auth_issuer_seed_file: str | None = None
    auth_account: str = "TANDEM"
    auth_namespace: str = "tandem"
    auth_identities: dict[str, str] = msgspec.field(
        default_factory=lambda: {
            "tandem-allocator": "allocator",
            "tandem-inventory": "inventory",
            "tandem-admission": "admission",
            "tandem-nodeagent": "nodeagent",
            # Operators: ``kubectl create token tandem-cli --audience tandem-nats``.
            "tandem-cli": "cli",
        }
    )
    auth_audience: str = "tandem-nats"
    auth_user_ttl: float = 3600.0
    # Seconds a token the API server accepted is taken without asking again (0: always ask).
    auth_review_cache_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    # TLS: the CA bundle that signs the server's certificate (None: the system's), and a
    # client certificate and key for servers that verify clients. ``tls://`` URLs, or any of
    # these set, turn TLS on.
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    # Seconds between the client's pings; two unanswered and the connection is taken for dead
    # and another server tried. None: 2 s, and 30 s for a node agent (thousands of them).
    # nats-py's own 120 s left a service on a server cut off the network for up to 6 minutes.
    nats_ping_interval: Annotated[float, msgspec.Meta(gt=0)] | None = None
    service: str = "tandem"
    instance: str = msgspec.field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    node_name: str = msgspec.field(default_factory=socket.gethostname)
    log_level: str = "info"
    ops_port: int | None = None  # /healthz, /readyz, /metrics (services.runtime.observe.opsserver)
    # The address the ops port binds: every interface by default (a pod's own network); a
    # host-network pod (the node agent) binds its node's address, where kubelet probes it,
    # rather than every interface of the host.
    ops_host: str = "0.0.0.0"
    log_json: bool = True
    # OTEL_EXPORTER_OTLP_ENDPOINT; set empty it is "" (no export, said so), not None (unset:
    # a CLI command then exports where the running `tandem up` does, tools.cli.localtraces).
    otlp_endpoint: str | None = None
    heartbeat_interval: float = 2.0
    node_lost_after: float = 8.0
    ack_wait: float = 30.0
    # Seconds a finished request's record (freed, cancelled, rejected) is kept (KV per-message
    # TTL): long enough to look it up after the pod is gone, short enough that the bucket
    # does not grow with history.
    finished_request_ttl: float = 7 * 24 * 3600.0
    # Seconds after which a replica's claim of a request, or its half-done job commit, is
    # taken for abandoned (the replica died) and taken over.
    claim_timeout: float = 30.0
    stream_replicas: int = 1
    backend: str = "simulated"
    topology_file: str | None = None
    health_clean_period: float = 60.0
    # DRA (docs/dra.md): the node agent publishes its node's devices as ResourceSlices through
    # the Kubernetes API (its pod's service account; chart value dra.enabled).
    dra_slices: bool = False
    # The admission service gates pods whose ResourceClaims ask Tandem's classes and allocates
    # those claims (services.admission.drabridge; chart value dra.enabled).
    dra_claims: bool = False
    # The node agent serves kubelet's DRA plugin API for driver tandem.io (needs dra_slices;
    # chart value dra.enabled): sockets and CDI dir as services.nodeagent.dra.plugin.PluginPaths,
    # validated at start.
    dra_plugin: bool = False
    dra_plugin_paths: dict[str, Any] = {}
    # Options of the real-node ("host") agent: sysfs root, plugin dir, netns resolver, XID
    # ignore list... validated by services.nodeagent.host_agent.HostAgentConfig at start.
    host_agent: dict[str, Any] = {}
    state_dir: str = "/var/lib/tandem"
    node_policy: str = "binpack"
    device_classes: dict[str, DeviceClass] = msgspec.field(default_factory=default_device_classes)
    # The allocator exports tandem_node_devices (8 series per node) while it knows at most this
    # many nodes, the cluster totals always: a scrape renders every series on the event loop,
    # between decisions (docs/benchmarks.md, "Measurements behind the code").
    node_metrics_max: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # The inter-node fabric's tiers, finest first: a node's block at tier T is its label
    # tandem.io/fabric-T (services.allocator.core.gang). TANDEM_FABRIC_TIERS="[leaf, spine, pod]".
    fabric_tiers: Annotated[
        list[Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")]],
        msgspec.Meta(max_length=limits.MAX_FABRIC_TIERS),
    ] = msgspec.field(default_factory=lambda: ["leaf", "spine"])


# Environment variables that are not TANDEM_* but are standard for their tool.
_STANDARD_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT": "otlp_endpoint", "NODE_NAME": "node_name"}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read config file: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) if path.suffix in {".yaml", ".yml"} else msgspec.json.decode(text)
    except (yaml.YAMLError, msgspec.DecodeError) as exc:
        raise SettingsError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _env_values(environ: dict[str, str]) -> dict[str, Any]:
    fields = {f.name: f for f in msgspec.structs.fields(Settings)}
    out: dict[str, Any] = {}
    for key, value in environ.items():
        name = _STANDARD_ENV.get(key)
        if name is None and key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
        if name is None or name not in fields or name == "config":
            continue
        # Environment values are strings; let YAML turn "2.5"/"true" into typed scalars.
        out[name] = yaml.safe_load(value) if value else ("" if name == "otlp_endpoint" else None)
    return out


def load_settings(
    service: str,
    *,
    config: str | Path | None = None,
    environ: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    **overrides: Any,
) -> Settings:
    """Build :class:`Settings` for ``service``; raise :class:`SettingsError` naming the source.

    ``defaults``: values that replace :class:`Settings`' own defaults for this caller (the
    config file and the environment still override them), e.g. the device classes ``tandem
    up`` serves when its configuration names none."""
    env = dict(os.environ) if environ is None else environ
    merged: dict[str, Any] = {"service": service, **(defaults or {})}
    source = "defaults"
    path = config or env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        merged.update(_read_file(Path(path)))
        source = str(path)
    env_values = _env_values(env)
    merged.update(env_values)
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        where = source if not env_values else f"{source} / TANDEM_* environment"
        raise SettingsError(f"{where}: {exc}") from exc
