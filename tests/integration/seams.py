"""Fault seams the integration tests install on an allocator from outside.

The allocator's constructors carry no test hooks: a test that needs a replica to stop at a
given point wraps that stage of its placement pipeline (:class:`services.allocator.placer.Placer`)
on the instance, for this test only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from schemas.messages import AllocationRequest
from services.allocator.core import Placement
from services.allocator.placer import Attempt, Committed
from services.allocator.service import Allocator

BeforeCommit = Callable[[AllocationRequest, Placement], Awaitable[None]]


def before_commit(monkeypatch: pytest.MonkeyPatch, allocator: Allocator, hook: BeforeCommit) -> None:
    """Await ``hook(request, placement)`` at the start of every commit stage of ``allocator``
    (decided, devices held tentatively, request claimed; the node record not written yet): two
    replicas held there both commit on the view they decided on."""
    real = allocator.placer.commit

    async def commit(attempt: Attempt) -> Committed:
        await hook(attempt.request, attempt.placement)
        return await real(attempt)

    monkeypatch.setattr(allocator.placer, "commit", commit)
