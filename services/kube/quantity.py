"""Kubernetes resource quantities (``80Gi``, ``512Mi``, ``20G``, ``100``) as whole numbers: pure.

The API server writes quantities canonically (a slice's ``81920Mi`` comes back as ``80Gi``),
and a claim's capacity request may be written either way, so Tandem compares and reads them
as numbers. Whole-number quantities with a binary or decimal suffix only: Tandem's quantities
(MiB of GPU memory, percent of compute) have no fractions or exponents.
"""

from __future__ import annotations

# Suffix -> multiplier (Kubernetes' binary and decimal suffixes).
_FACTORS = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
}


def quantity(value: str) -> int | None:
    """``value`` as a whole number (``"80Gi"`` -> 85899345920), or None when it is not a
    whole-number quantity with one of the suffixes above."""
    number = value.rstrip("KMGTPEikmgtpe")
    factor = _FACTORS.get(value[len(number) :])
    if not number.isdigit() or factor is None:
        return None
    return int(number) * factor
