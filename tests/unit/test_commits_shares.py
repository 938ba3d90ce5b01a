"""The commit of a GPU share checks the node's record as it is then (services/allocator/commits.py).

Two replicas may each decide a share on one GPU from the same view; the second commit is
re-applied to the record the first one wrote, and must be refused there when the GPU has no
room left: the core's own rules (``core.shares.fit_mask``) — memory, 100 % of compute, the
class's share count — counted over every share the record holds on the GPU."""

from __future__ import annotations

import re

import msgspec
import pytest

from schemas.messages import AllocRecord, AssignedGpu, Assignment, NodeAllocations, PodRef
from services.allocator import commits
from services.runtime.kv.records import Conflict

ROOM = commits.ShareRoom(memory_mib={"gpu0": 80_000, "gpu1": 80_000}, max_shares=3)


def share(rid: str, gpu: int, mem: int | None, cores: int | None = None) -> AllocRecord:
    gpus = [AssignedGpu(index=gpu, uuid=f"GPU-{gpu}", memory_mib=mem, cores_percent=cores)]
    return AllocRecord(assignment=Assignment(request_id=rid, pod=PodRef("ml", rid), node="n1", gpus=gpus))


def whole(rid: str, gpu: int) -> AllocRecord:
    gpus = [AssignedGpu(index=gpu, uuid=f"GPU-{gpu}")]
    return AllocRecord(assignment=Assignment(request_id=rid, pod=PodRef("ml", rid), node="n1", gpus=gpus))


def record(**allocs: AllocRecord) -> NodeAllocations:
    return NodeAllocations(node="n1", allocations=allocs)


def add(base: NodeAllocations | None, rid: str, rec: AllocRecord) -> NodeAllocations | None:
    return commits.add_allocation("n1", rid, rec, share_room=ROOM)(base)


def test_a_share_goes_where_the_record_leaves_room() -> None:
    got = add(record(a=share("a", 0, 40_000, 50)), "b", share("b", 0, 40_000, 50))
    assert got is not None and set(got.allocations) == {"a", "b"}
    assert add(None, "c", share("c", 1, 80_000)) is not None  # a fresh GPU takes a share of all of it


@pytest.mark.parametrize(
    ("held", "mine", "why"),
    [
        ({"a": share("a", 0, 50_000)}, share("b", 0, 40_000), "gpu0 has 30000 MiB left, not 40000"),
        ({"a": share("a", 0, 0, 70)}, share("b", 0, None, 40), "gpu0 has 30 % compute left, not 40"),
        (
            {r: share(r, 0, 1_000) for r in ("a", "b", "c")},
            share("d", 0, 1_000),
            "gpu0 holds 3 shares already (at most 3)",
        ),
    ],
)
def test_a_share_the_gpu_has_no_room_for_is_refused(
    held: dict[str, AllocRecord], mine: AllocRecord, why: str
) -> None:
    with pytest.raises(Conflict, match=re.escape(why)):
        add(record(**held), mine.assignment.request_id, mine)


def test_shares_on_other_gpus_do_not_count_and_whole_gpus_still_clash() -> None:
    assert add(record(a=share("a", 1, 80_000)), "b", share("b", 0, 80_000)) is not None
    with pytest.raises(Conflict, match="gpu0 held by another allocation"):
        add(record(a=whole("a", 0)), "b", share("b", 0, 1_000))


def test_a_share_without_the_gpus_room_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="needs the GPUs' room"):
        commits.add_allocation("n1", "b", share("b", 0, 1_000))(None)


def test_a_share_never_joins_shares_of_the_other_mode() -> None:
    """HAMi-core and MPS limit a GPU's shares in different ways and the node agent runs one
    per GPU: a commit that would mix them on one GPU is refused, on another GPU it goes."""

    def moded(rid: str, gpu: int, sharing: str) -> AllocRecord:
        rec = share(rid, gpu, 1_000)
        return AllocRecord(assignment=msgspec.structs.replace(rec.assignment, sharing=sharing))

    held = record(a=moded("a", 0, "hami"))
    with pytest.raises(Conflict, match="gpu0 held by another allocation"):
        add(held, "b", moded("b", 0, "mps"))
    assert add(held, "b", moded("b", 1, "mps")) is not None
    assert add(held, "b", moded("b", 0, "hami")) is not None
