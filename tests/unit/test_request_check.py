"""``services.request.check``: the resolver's rules that hold whatever the device class, for a
caller that does not know the classes (the CLI). It must never refuse what ``resolve`` would
accept with some class, and what it accepts ``resolve`` may refuse only for the class itself.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.config import DeviceClass
from services.request import WIRE_NAMES, Ask, RequestError, check, resolve

CLASSES = {
    "default": DeviceClass(),
    "paired": DeviceClass(pairing="per-gpu", scope="numa", policy="required"),
    "shared": DeviceClass(sharing="hami", preemption="lower-priority"),
}

asks = st.builds(
    Ask,
    gpus=st.integers(-1, 4),
    rdma=st.integers(0, 4),
    device_class=st.sampled_from(["default", "paired", "shared", "nope"]),
    scope=st.sampled_from([None, "pcie-switch", "numa", "rack"]),
    policy=st.sampled_from([None, "required", "maybe"]),
    pairing=st.sampled_from([None, "per-gpu", "shared", "both"]),
    preemption=st.sampled_from([None, "never", "always"]),
    gpu_memory_mib=st.sampled_from([None, 0, 1024]),
    gpu_cores_percent=st.sampled_from([None, 30, 101]),
    mig_profile=st.sampled_from([None, "1g.10gb", "huge"]),
)


@settings(max_examples=400, deadline=None)
@given(asks)
def test_check_is_resolve_without_the_class(ask: Ask) -> None:
    try:
        check(ask)
    except RequestError as refused:
        # Refused whatever the class: every class refuses it (for the same field, unless the
        # class's own rule, not sharing, comes first).
        for name in CLASSES:
            with pytest.raises(RequestError) as caught:
                resolve(ask._replace(device_class=name), classes=CLASSES)
            assert caught.value.field in (refused.field, "gpu_memory_mib", "gpu_cores_percent")
        return
    # Accepted: some class accepts it too (one that shares, when it asks shares).
    accepted = []
    for name in CLASSES:
        try:
            resolve(ask._replace(device_class=name), classes=CLASSES)
        except RequestError as exc:
            assert exc.field in ("gpu_memory_mib", "gpu_cores_percent"), exc  # the class shares not
        else:
            accepted.append(name)
    assert "shared" in accepted


def test_check_names_the_field_as_the_caller_writes_it() -> None:
    names = {**WIRE_NAMES, "pairing": "--pairing", "gpus": "--gpus", "rdma": "--rdma"}
    with pytest.raises(
        RequestError, match=r"^--pairing: per-gpu .* as many --rdma as --gpus \(asked 1 and 2\)"
    ):
        check(Ask(gpus=2, rdma=1, device_class="any", pairing="per-gpu"), names=names)
    # The class is not judged: an unknown one, or shares of a class that may not share.
    check(Ask(gpus=1, rdma=0, device_class="nosuch", gpu_memory_mib=4096))
