"""The NUMA Affinity list parser (``0,3-9,11-17`` on Grace systems): any well-formed list
parses to the ids it names; anything else fails with an error naming the row and the column,
also when it arrives inside a whole matrix."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import NvsmiFormatError, parse_matrix
from services.topology.nvsmi import MAX_NUMA_ID, parse_id_list

RANGE = st.tuples(st.integers(0, MAX_NUMA_ID), st.integers(0, 40)).map(
    lambda t: (t[0], min(t[0] + t[1], MAX_NUMA_ID))
)
ITEMS = st.lists(RANGE, min_size=1, max_size=8)


def _text(items: list[tuple[int, int]]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in items)


@given(ITEMS)
@settings(max_examples=300, deadline=None)
def test_well_formed_lists_parse_to_the_ids_they_name(items: list[tuple[int, int]]) -> None:
    want = sorted({i for a, b in items for i in range(a, b + 1)})
    assert list(parse_id_list(_text(items), column="NUMA Affinity", row="GPU0")) == want


def _reference(value: str) -> list[int] | None:
    """What a list means, by an independent rule; None when it is not a list."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", value):
        return None
    out: set[int] = set()
    for item in value.split(","):
        a, _, b = item.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi > MAX_NUMA_ID:
            return None
        out.update(range(lo, hi + 1))
    return sorted(out)


@given(st.text(alphabet="0123456789,- x", max_size=12))
@settings(max_examples=500, deadline=None)
def test_any_text_parses_as_the_reference_says_or_names_row_and_column(value: str) -> None:
    want = _reference(value)
    if want is None:
        with pytest.raises(NvsmiFormatError) as info:
            parse_id_list(value, column="NUMA Affinity", row="GPU3", source="n.txt", line=5)
        assert str(info.value).startswith("n.txt:5: row GPU3, column NUMA Affinity:")
        assert info.value.line == 5
    else:
        assert list(parse_id_list(value, column="NUMA Affinity", row="GPU3")) == want


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0,,3", "empty item"),
        ("9-3", "range 9-3 runs backwards"),
        ("0,3-9,", "empty item"),
        ("0x3", "item '0x3' is neither a number nor a range"),
        ("1-99999", f"id 99999 is above {MAX_NUMA_ID}"),
        ("-1", "item '-1' is neither a number nor a range"),
    ],
)
def test_bad_lists_in_a_matrix_name_file_line_row_and_column(value: str, why: str) -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
        "GPU0     X      NV18    0-71    0,3-9,11-17     2\n"
        f"GPU1    NV18     X      72-143  {value}     10\n"
    )
    with pytest.raises(NvsmiFormatError) as info:
        parse_matrix(text, source="gb.txt")
    message = str(info.value)
    assert message.startswith("gb.txt:3: row GPU1, column NUMA Affinity:")
    assert why in message


@pytest.mark.parametrize("value", ["two", "-2", "99999"])
def test_bad_gpu_numa_id_names_row_and_column(value: str) -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
        f"GPU0     X      NV18    0-71    0,3-9,11-17     {value}\n"
        "GPU1    NV18     X      72-143  1,19-25,27-33     10\n"
    )
    with pytest.raises(NvsmiFormatError, match=r"^gb\.txt:2: row GPU0, column GPU NUMA ID: ") as info:
        parse_matrix(text, source="gb.txt")
    assert repr(value) in str(info.value)
