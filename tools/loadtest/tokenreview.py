"""The API server's TokenReview (``POST /apis/authentication.k8s.io/v1/tokenreviews``) for the
tokens a run hands out: the one Kubernetes boundary the auth callout talks to, answered with the
API's own JSON as a 1.30+ API server answers for pod-bound service-account tokens (``extra``
names the pod and its node). The production profile of ``tandem loadtest`` serves it to its
callout (a kubeconfig names it); the tests serve it to theirs (``tests/kube_tokens.py``).

Everything else in the callout's path is real: the servers' callout requests, the callout's
review over HTTP, the user JWT it signs with the role's permissions.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from services.authcallout.service import NODE_NAME_EXTRA, POD_NAME_EXTRA


class TokenReviews:
    def __init__(self, *, namespace: str, audience: str, keep_reviews: bool = True) -> None:
        self.namespace = namespace
        self.audience = audience
        self.keep_reviews = keep_reviews  # a run's thousands of node reviews are only counted
        self.tokens: dict[str, dict[str, Any]] = {}  # token → status.user
        self.reviews: list[dict[str, Any]] = []  # every review asked for (keep_reviews)
        self.answered = 0
        self.refused = 0

    def issue(self, account: str, *, node: str | None = None, pod: str | None = None) -> str:
        """A token of ``account``; with ``node``, bound to a pod on that node."""
        token = secrets.token_urlsafe(24)
        extra: dict[str, list[str]] = {}
        if node:
            extra[NODE_NAME_EXTRA] = [node]
            extra[POD_NAME_EXTRA] = [pod or f"{account}-{node}"]
        elif pod:
            extra[POD_NAME_EXTRA] = [pod]
        self.tokens[token] = {"username": f"system:serviceaccount:{self.namespace}:{account}", "extra": extra}
        return token

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.keep_reviews:
            self.reviews.append(body)
        spec = body.get("spec") or {}
        user = self.tokens.get(spec.get("token", ""))
        ok = user is not None and self.audience in (spec.get("audiences") or [])
        status: dict[str, Any] = {"authenticated": ok, "audiences": [self.audience] if ok else []}
        if ok:
            status["user"] = user
            self.answered += 1
        else:
            status["error"] = "[invalid bearer token, token lookup failed]"
            self.refused += 1
        return web.json_response(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec, "status": status}
        )


@asynccontextmanager
async def token_review_server(reviews: TokenReviews) -> AsyncIterator[str]:
    """Serve ``reviews`` on 127.0.0.1; yields the API server URL."""
    app = web.Application()
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", reviews.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
