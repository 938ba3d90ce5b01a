"""The periodic reads of a follower of many nodes (the load harness's fleet) are spread over the
interval: each node once per interval, a slice at each check — as N agents started at different
moments would read — not every node in one burst."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from services.nodeagent.follow import resync_slice


@given(
    n=st.integers(min_value=0, max_value=500),
    ticks=st.integers(min_value=1, max_value=60),
    start=st.integers(0, 1000),
)
def test_every_node_once_per_interval_in_slices(n: int, ticks: int, start: int) -> None:
    nodes = [f"node-{i}" for i in range(n)]
    slices = [resync_slice(nodes, tick=t, ticks=ticks) for t in range(start, start + ticks)]
    # Over any `ticks` consecutive checks, each node is read exactly once...
    assert Counter(node for s in slices for node in s) == Counter(nodes)
    # ...and no check reads more than its share.
    assert max(len(s) for s in slices) <= -(-n // ticks)


def test_one_node_is_read_once_per_interval() -> None:
    due = [t for t in range(1, 91) if resync_slice(["box-1"], tick=t, ticks=30)]
    assert due == [30, 60, 90]
