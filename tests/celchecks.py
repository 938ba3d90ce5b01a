"""CEL rules of the chart (policies, CRD validations) evaluated in tests with cel-python, as the
API server would: a rule that fails to evaluate fails the test instead of counting as a denial."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def failing(rules: Sequence[tuple[str, Any]], activation: dict[str, Any]) -> list[str]:
    """The messages of ``rules`` (``(message, compiled program)``) that evaluate to false."""
    import celpy

    out = []
    for message, program in rules:
        result = program.evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), result  # not an evaluation error
        if not result:
            out.append(message)
    return out
