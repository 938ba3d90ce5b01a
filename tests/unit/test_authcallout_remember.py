"""The callout remembers a token the API server accepted, for a while, so that a reconnect
storm (a NATS server gone, its clients all coming back at once) is not a storm of TokenReviews:
never past ``remember_s`` nor the token's own expiry, never a refusal, and by the token's hash."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

from services.authcallout.service import Denied, Identity, Reviewer

ACCOUNT = "system:serviceaccount:tandem:tandem-nodeagent"


class Api:
    """The TokenReview boundary: accepts the tokens in ``valid``, counts what it was asked."""

    def __init__(self, valid: set[str]) -> None:
        self.valid = valid
        self.asked = 0

    async def review_token(self, token: str, *, audiences: list[str]) -> dict[str, Any]:
        self.asked += 1
        if token not in self.valid:
            return {"status": {"authenticated": False, "error": "token lookup failed"}}
        extra = {"authentication.kubernetes.io/node-name": ["node-a"]}
        return {
            "status": {
                "authenticated": True,
                "audiences": audiences,
                "user": {"username": ACCOUNT, "extra": extra},
            }
        }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reviewer(api: Api, clock: Clock, *, remember_s: float = 60.0) -> Reviewer:
    return Reviewer(
        api,  # type: ignore[arg-type]
        namespace="tandem",
        identities={"tandem-nodeagent": "nodeagent"},
        audiences=["tandem-nats"],
        remember_s=remember_s,
        clock=clock,
    )


def jwt_expiring_in(seconds: float) -> str:
    body = base64.urlsafe_b64encode(json.dumps({"exp": int(time.time() + seconds)}).encode())
    return f"e30.{body.decode().rstrip('=')}.sig"


async def test_an_accepted_token_is_asked_once_until_its_time_is_up() -> None:
    api, clock = Api({"t1"}), Clock()
    r = reviewer(api, clock)
    assert await r.identify("t1") == Identity("nodeagent", "node-a")
    clock.now += 59
    assert await r.identify("t1") == Identity("nodeagent", "node-a")
    assert api.asked == 1
    clock.now += 2  # 61 s after the review: asked again
    assert await r.identify("t1") == Identity("nodeagent", "node-a")
    assert api.asked == 2
    assert "t1" not in repr(r._known)  # kept by its hash, not the token itself


async def test_a_refusal_is_never_remembered_and_a_revoked_token_is_refused_once_its_time_is_up() -> None:
    api, clock = Api(set()), Clock()
    r = reviewer(api, clock)
    for _ in range(2):
        with pytest.raises(Denied, match="token not accepted"):
            await r.identify("t2")
    assert api.asked == 2
    api.valid.add("t2")
    await r.identify("t2")
    api.valid.clear()  # the pod was deleted: its token is no longer valid
    clock.now += 30
    await r.identify("t2")  # still within the 60 s: the price of remembering
    clock.now += 31
    with pytest.raises(Denied):
        await r.identify("t2")


async def test_never_remembered_past_the_tokens_own_expiry() -> None:
    token = jwt_expiring_in(10)
    api, clock = Api({token}), Clock()
    r = reviewer(api, clock)
    await r.identify(token)
    clock.now += 9
    await r.identify(token)
    assert api.asked == 1
    clock.now += 2  # past the token's exp, though within remember_s
    await r.identify(token)
    assert api.asked == 2


async def test_remember_zero_asks_every_time() -> None:
    api, clock = Api({"t3"}), Clock()
    r = reviewer(api, clock, remember_s=0)
    await r.identify("t3")
    await r.identify("t3")
    assert api.asked == 2
