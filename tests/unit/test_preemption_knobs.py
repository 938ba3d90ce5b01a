"""Where a request says it may preempt: the ``tandem.io/preemption`` pod annotation (validated,
defaulted from the device class, carried into the allocation request by
services/admission/podrules.py) and ``tandem submit --preemption``."""

from __future__ import annotations

import pytest

from schemas.config import DeviceClass
from services.admission import names, podrules
from services.admission.errors import PolicyError
from tests.unit.test_admission_helpers import deployment_pod

CLASSES = {"default": DeviceClass(), "urgent": DeviceClass(preemption="lower-priority")}


def persisted(**kw: object) -> podrules.PodView:
    raw = deployment_pod(**kw)  # type: ignore[arg-type]
    raw["metadata"].update(name="trainer-0", uid="uid-1")
    return podrules.read_pod(raw)


def test_default_is_never_and_not_written() -> None:
    pod = persisted()
    req = podrules.resolve(pod, device_classes=CLASSES)
    assert req is not None and req.preemption == "never"
    assert names.PREEMPTION not in req.annotations()
    alloc = podrules.allocation_request(pod, device_classes=CLASSES)
    assert alloc is not None and alloc.preemption == "never"


def test_annotation_and_class_default() -> None:
    pod = persisted(annotations={names.PREEMPTION: "lower-priority", names.PRIORITY: "7"})
    alloc = podrules.allocation_request(pod, device_classes=CLASSES)
    assert alloc is not None and (alloc.preemption, alloc.priority) == ("lower-priority", 7)
    req = podrules.resolve(persisted(annotations={names.DEVICE_CLASS: "urgent"}), device_classes=CLASSES)
    assert req is not None and req.annotations()[names.PREEMPTION] == "lower-priority"
    # The pod's own annotation overrides its class.
    own = persisted(annotations={names.DEVICE_CLASS: "urgent", names.PREEMPTION: "never"})
    req = podrules.resolve(own, device_classes=CLASSES)
    assert req is not None and req.preemption == "never"


def test_bad_value_names_the_annotation() -> None:
    with pytest.raises(PolicyError, match=r"annotation tandem\.io/preemption: 'always' is not one of never"):
        podrules.resolve(persisted(annotations={names.PREEMPTION: "always"}), device_classes=CLASSES)


def test_cli_submit_carries_preemption() -> None:
    from tools.cli.main import build_parser
    from tools.cli.workloads import new_request

    args = build_parser().parse_args(
        ["submit", "--gpus", "2", "--priority", "9", "--preemption", "lower-priority"]
    )
    req = new_request(args)
    assert (req.priority, req.preemption) == (9, "lower-priority")
    assert new_request(build_parser().parse_args(["submit", "--gpus", "2"])).preemption is None
