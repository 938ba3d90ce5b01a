"""The API server's TokenReview for the tokens a test hands out: the one Kubernetes boundary the
auth callout talks to. The fake lives with the load harness, whose production profile serves it
to its own callout (:mod:`tools.loadtest.tokenreview`); the tests use the same one."""

from __future__ import annotations

from tools.loadtest.tokenreview import TokenReviews, token_review_server

__all__ = ["TokenReviews", "token_review_server"]
