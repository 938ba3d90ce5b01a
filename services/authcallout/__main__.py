"""``python -m services.authcallout``: answer NATS auth callout requests (see service.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import nkeys

from services.authcallout import natsjwt
from services.authcallout.service import AuthCallout, Reviewer
from services.kube.client import KubeClient
from services.runtime.errors import SettingsError
from services.runtime.nats.bus import Bus
from services.runtime.process.lifecycle import service_main
from services.runtime.settings import Settings


def _issuer(settings: Settings) -> nkeys.KeyPair:
    if not settings.auth_issuer_seed_file:
        raise SettingsError("auth_issuer_seed_file: the callout's issuer nkey seed file is required")
    try:
        return natsjwt.keypair(Path(settings.auth_issuer_seed_file).read_bytes())
    except OSError as exc:
        raise SettingsError(
            f"auth_issuer_seed_file: cannot read {settings.auth_issuer_seed_file}: {exc}"
        ) from exc
    except natsjwt.JwtError as exc:
        raise SettingsError(f"auth_issuer_seed_file: {settings.auth_issuer_seed_file}: {exc}") from exc


async def build(bus: Bus, settings: Settings) -> AuthCallout:
    issuer = _issuer(settings)  # read once at start, before anything waits
    kube = await KubeClient.connect()
    reviewer = Reviewer(
        kube,
        namespace=settings.auth_namespace,
        identities=settings.auth_identities,
        audiences=[settings.auth_audience],
        remember_s=settings.auth_review_cache_s,
    )
    return AuthCallout(
        bus.nc,
        issuer=issuer,
        account=settings.auth_account,
        reviewer=reviewer,
        user_ttl=settings.auth_user_ttl,
    )


if __name__ == "__main__":
    sys.exit(service_main("authcallout", build, provision_streams=False))
