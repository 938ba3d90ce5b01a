"""The callout trusts a token only for its own audience, whatever ``authenticated`` says.

An authenticator that ignores audiences (a webhook token authenticator, an old API server)
answers ``authenticated: true`` for a token meant for someone else and lists no audience (or
another one); the callout must refuse it. The real API server's answer for a wrong audience
(``authenticated: false``) is checked in tests/cluster/test_install.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.authcallout.service import Denied, Reviewer

ACCOUNT = "system:serviceaccount:tandem:tandem-allocator"


class Answer:
    """The one KubeApi call the reviewer makes, answering with a fixed TokenReview status."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.asked: list[list[str]] = []

    async def review_token(self, token: str, *, audiences: list[str]) -> dict[str, Any]:
        self.asked.append(audiences)
        return {"status": self.status}


def reviewer(kube: Answer) -> Reviewer:
    return Reviewer(
        kube,  # type: ignore[arg-type]
        namespace="tandem",
        identities={"tandem-allocator": "allocator"},
        audiences=["tandem-nats"],
    )


@pytest.mark.parametrize("granted", [None, [], ["https://kubernetes.default.svc"]])
async def test_an_authenticated_token_of_another_audience_is_refused(granted: list[str] | None) -> None:
    status: dict[str, Any] = {"authenticated": True, "user": {"username": ACCOUNT}}
    if granted is not None:
        status["audiences"] = granted
    kube = Answer(status)
    with pytest.raises(Denied, match="not issued for audience tandem-nats"):
        await reviewer(kube).identify("a-token")
    assert kube.asked == [["tandem-nats"]]


async def test_a_token_for_our_audience_is_accepted() -> None:
    kube = Answer({"authenticated": True, "user": {"username": ACCOUNT}, "audiences": ["tandem-nats"]})
    identity = await reviewer(kube).identify("a-token")
    assert identity.role == "allocator"
