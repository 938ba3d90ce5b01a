"""NATS JWTs as the auth callout signs and reads them (the server's side is tested for real in
tests/integration/test_auth_callout.py)."""

from __future__ import annotations

import base64
import json

import pytest

from services.authcallout import natsjwt
from services.authcallout.service import token_expiry


def test_a_signed_jwt_decodes_to_its_claims_with_issuer_and_jti() -> None:
    signer = natsjwt.keypair(natsjwt.new_seed())
    token = natsjwt.encode({"sub": "UABC", "nats": {"type": "user", "version": 2}}, signer)
    claims = natsjwt.decode(token)
    assert claims["iss"] == signer.public_key.decode() and claims["iss"].startswith("A")
    assert claims["sub"] == "UABC" and claims["nats"]["type"] == "user"
    assert len(claims["jti"]) == 52  # base32 of a 32-byte SHA-512/256, unpadded


def test_a_tampered_jwt_is_refused() -> None:
    signer = natsjwt.keypair(natsjwt.new_seed())
    head, body, sig = natsjwt.encode({"sub": "UABC", "nats": {"type": "user"}}, signer).split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["nats"]["type"] = "operator"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    with pytest.raises(natsjwt.JwtError, match="bad signature"):
        natsjwt.decode(f"{head}.{forged}.{sig}")
    with pytest.raises(natsjwt.JwtError):
        natsjwt.decode("not.a-jwt")
    with pytest.raises(natsjwt.JwtError, match="nkey seed"):
        natsjwt.keypair(b"SAnot-a-seed")


def test_user_claims_carry_the_roles_permissions_and_an_expiry() -> None:
    claims = natsjwt.user_claims(
        user_nkey="UABC",
        name="nodeagent-gpu-a",
        account="TANDEM",
        publish=["tandem.node.gpu-a.>"],
        subscribe=["_INBOX_nodeagent-gpu-a.>"],
        allow_responses=True,
        expires_in=60,
    )
    assert claims["aud"] == "TANDEM" and claims["nats"]["pub"]["allow"] == ["tandem.node.gpu-a.>"]
    assert claims["nats"]["resp"] == {"max": 1, "ttl": 0} and claims["exp"] > 0


def test_token_expiry_reads_the_exp_claim() -> None:
    body = base64.urlsafe_b64encode(json.dumps({"exp": 1234}).encode()).rstrip(b"=").decode()
    assert token_expiry(f"h.{body}.s") == 1234.0
    assert token_expiry("garbage") is None
