"""The Kubernetes client takes its proxy from the environment once, when it is made, and its
requests neither look the environment up again nor read ``~/.netrc``
(``services.kube.client._environment_once``)."""

from __future__ import annotations

import pytest

from services.kube.client import KubeClient
from tools.loadtest.tokenreview import TokenReviews, token_review_server


async def test_the_proxy_for_the_api_server_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    kube = KubeClient.for_host("https://api.example:6443")
    try:
        assert kube.api_client.rest_client.proxy == "http://proxy.example:3128"
        assert kube.api_client.rest_client.pool_manager.trust_env is False
    finally:
        await kube.close()

    monkeypatch.setenv("NO_PROXY", "api.example")
    kube = KubeClient.for_host("https://api.example:6443")
    try:
        assert kube.api_client.rest_client.proxy is None
    finally:
        await kube.close()


async def test_requests_go_direct_where_no_proxy_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy that is not there: a request sent to it would fail.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    reviews = TokenReviews(namespace="tandem", audience="tandem-nats")
    token = reviews.issue("tandem-allocator")
    async with token_review_server(reviews) as url:
        kube = KubeClient.for_host(url)
        try:
            review = await kube.review_token(token, audiences=["tandem-nats"])
        finally:
            await kube.close()
    assert review["status"]["authenticated"] is True
    assert review["status"]["user"]["username"] == "system:serviceaccount:tandem:tandem-allocator"
