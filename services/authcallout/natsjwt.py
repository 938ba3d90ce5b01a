"""NATS JWTs (v2) as the auth callout exchanges them: decode and verify the server's
authorization request, encode the user and the response the callout signs.

A NATS JWT is ``base64url(header).base64url(claims).base64url(signature)`` without padding,
header ``{"typ": "JWT", "alg": "ed25519-nkey"}``, signed with an nkey (Ed25519, keys written
in NATS' base32 form with a role prefix and a CRC16). The claims carry ``jti`` (the base32
SHA-512/256 of the claims without it), ``iat``, ``iss`` (the signer's public key), ``sub``,
optionally ``aud``, ``exp`` and ``name``, and a ``nats`` object whose ``type`` says what the
JWT is. The layouts follow nats-io/jwt v2 (``UserClaims``, ``AuthorizationRequestClaims``,
``AuthorizationResponseClaims``); the key handling is the ``nkeys`` library's.

Pure: no I/O, so it is tested alone and against a real nats-server by the service's tests.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
REQUEST_TYPE = "authorization_request"
RESPONSE_TYPE = "authorization_response"


class JwtError(ValueError):
    """A JWT or key that cannot be used: what is wrong with it, never the secret itself."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise JwtError(f"not base64url: {exc}") from exc


def new_seed(role: int = nkeys.PREFIX_BYTE_ACCOUNT) -> bytes:
    """A fresh nkey seed (``SA...`` for an account key, the callout's issuer)."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), role)
    return seed


def keypair(seed: bytes) -> nkeys.KeyPair:
    try:
        return nkeys.from_seed(seed.strip())
    except nkeys.NkeysError as exc:
        raise JwtError(f"not an nkey seed ({type(exc).__name__})") from None


def public_key(seed: bytes) -> str:
    return str(keypair(seed).public_key.decode())


def _verify_key(public: str) -> nacl.signing.VerifyKey:
    """The Ed25519 key in an encoded nkey public key (any role), its checksum checked."""
    try:
        raw = base64.b32decode(public + "=" * (-len(public) % 8))
    except (binascii.Error, ValueError) as exc:
        raise JwtError(f"not an nkey public key: {exc}") from exc
    if len(raw) != 35 or int.from_bytes(raw[-2:], "little") != nkeys.crc16(bytearray(raw[:-2])):
        raise JwtError("not an nkey public key (length or checksum)")
    return nacl.signing.VerifyKey(raw[1:33])


def decode(token: str) -> dict[str, Any]:
    """The claims of ``token``, its signature verified against its own ``iss``."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JwtError("a JWT has three parts")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except json.JSONDecodeError as exc:
        raise JwtError(f"not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("alg") != HEADER["alg"]:
        raise JwtError(
            f"unsupported JWT algorithm {header.get('alg') if isinstance(header, dict) else None!r}"
        )
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise JwtError("claims without an issuer")
    try:
        _verify_key(claims["iss"]).verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
    except nacl.exceptions.BadSignatureError:
        raise JwtError("bad signature") from None
    return claims


def encode(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """Sign ``claims`` (``iss``, ``iat`` and ``jti`` are filled in here)."""
    body = {**claims, "iss": signer.public_key.decode(), "iat": int(time.time()), "jti": ""}
    digest = hashlib.new("sha512_256", json.dumps(body, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = signer.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(signature)}"


def user_claims(
    *,
    user_nkey: str,
    name: str,
    account: str,
    publish: list[str],
    subscribe: list[str],
    allow_responses: bool,
    expires_in: float | None,
) -> dict[str, Any]:
    """A user (nats-io/jwt ``UserClaims``) in ``account`` with these permissions; in a server
    configured with accounts (not an operator), the account goes in ``aud``."""
    nats: dict[str, Any] = {
        "pub": {"allow": publish},
        "sub": {"allow": subscribe},
        "subs": -1,
        "data": -1,
        "payload": -1,
        "type": "user",
        "version": 2,
    }
    if allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    claims: dict[str, Any] = {"sub": user_nkey, "name": name, "aud": account, "nats": nats}
    if expires_in is not None:
        claims["exp"] = int(time.time() + expires_in)
    return claims


def response_claims(*, user_nkey: str, server_id: str, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    """The callout's answer (``AuthorizationResponseClaims``): a user JWT, or an error."""
    nats: dict[str, Any] = {"type": RESPONSE_TYPE, "version": 2}
    if user_jwt:
        nats["jwt"] = user_jwt
    if error:
        nats["error"] = error
    return {"sub": user_nkey, "aud": server_id, "nats": nats}
