"""Kubernetes quantities as whole numbers (services.kube.quantity)."""

from __future__ import annotations

import pytest

from services.kube.quantity import quantity


@pytest.mark.parametrize(
    ("value", "number"),
    [("100", 100), ("81920Mi", 81920 * 2**20), ("80Gi", 80 * 2**30), ("20G", 20 * 10**9), ("512Ki", 2**19)],
)
def test_whole_quantities_read_as_numbers(value: str, number: int) -> None:
    assert quantity(value) == number


@pytest.mark.parametrize("value", ["1.5Gi", "20Xi", "Gi", "-1", "1e3", ""])
def test_anything_else_is_none(value: str) -> None:
    assert quantity(value) is None


def test_the_servers_canonical_form_equals_the_written_one() -> None:
    assert quantity("81920Mi") == quantity("80Gi")
