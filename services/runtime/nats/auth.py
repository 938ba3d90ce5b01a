"""How a client authenticates to NATS and checks its server: credentials and TLS from
:class:`~services.runtime.settings.Settings`. Kept apart from :mod:`.bus` so that the CLI can
connect with the services' settings without importing the services' runtime (tracing, metrics).
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

from services.runtime.errors import SettingsError
from services.runtime.settings import Settings


def server_list(nats_url: str) -> list[str]:
    """``Settings.nats_url`` as the client's server list: one URL, or several comma-separated
    (``nats://a:4222,nats://b:4222``) for a NATS cluster, so losing one server fails over."""
    servers = [u.strip() for u in nats_url.split(",") if u.strip()]
    if not servers:
        raise SettingsError(f"nats_url: no server URL in {nats_url!r}")
    return servers


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The client's TLS context from the ``nats_tls_*`` settings (None when TLS is off);
    raises SettingsError naming the setting and the file that cannot be used.

    One context for the same files as long as they are unchanged (their modification times
    are part of the key: a rotated certificate makes a new one), shared by the connections
    that ask: making one reads and parses the CA bundle, and the load harness's fleet, a
    connection per simulated node, spent a fifth of its connecting time there. Not to be
    changed by a caller, then."""
    wants = any(u.startswith("tls://") for u in server_list(settings.nats_url))
    if not (wants or settings.nats_tls_ca or settings.nats_tls_cert):
        return None
    files = (settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key)
    return _context(*files, stamps=tuple(_stamp(f) for f in files))


def _stamp(path: str | None) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None  # the context's own load names the file that cannot be used


@functools.lru_cache(maxsize=8)
def _context(
    ca: str | None, cert: str | None, key: str | None, *, stamps: tuple[int | None, ...]
) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(f"nats_tls_ca: cannot use {ca}: {exc}") from exc
    if cert or key:
        if not (cert and key):
            raise SettingsError("nats_tls_cert and nats_tls_key: set both (a client certificate and its key)")
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"nats_tls_cert/nats_tls_key: cannot use {cert} with {key}: {exc}") from exc
    return ctx


def credentials(settings: Settings) -> dict[str, Any]:
    """nats-py's connect options for the configured credentials (files read here, so a bad
    path fails at start naming the setting)."""
    given = [
        n for n in ("nats_creds", "nats_nkey_seed", "nats_user", "nats_token_file") if getattr(settings, n)
    ]
    if len(given) > 1:
        raise SettingsError(f"{' and '.join(given)}: choose one way to authenticate")
    for name in ("nats_creds", "nats_nkey_seed", "nats_password_file", "nats_token_file"):
        path = getattr(settings, name)
        if path and not os.access(path, os.R_OK):
            raise SettingsError(f"{name}: cannot read {path}")
    if settings.nats_creds:
        return {"user_credentials": settings.nats_creds}
    if settings.nats_nkey_seed:
        return {"nkeys_seed": settings.nats_nkey_seed}
    if settings.nats_token_file:
        path = settings.nats_token_file

        def token() -> str:  # read at every connect: the kubelet rotates the file
            with open(path, encoding="utf-8") as f:
                return f.read().strip()

        return {"token": token}
    if settings.nats_user:
        if not settings.nats_password_file:
            raise SettingsError("nats_user: set nats_password_file too (the password's file)")
        with open(settings.nats_password_file, encoding="utf-8") as f:
            password = f.read().strip()
        return {"user": settings.nats_user, "password": password}
    return {}
