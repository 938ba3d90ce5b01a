"""Pure parts of verified cleanup: one reason per device, and the retry back-off."""

from __future__ import annotations

import pytest

from services.nodeagent.cleanup import RETRY_MAX_S, problems_by_device, retry_delay


def test_each_device_gets_its_own_problem_not_the_first_one() -> None:
    problems = [
        "gpu1: compute processes [31337] still running",
        "gpu2: cannot list compute processes: GPU is lost",
        "mlx5_3: netdev ens1f0v1 is not back in the host namespace",
        "mlx5_3: mtu is 9000, expected 1500 after restore",
    ]
    assert problems_by_device(problems, ["gpu1", "gpu2", "gpu3", "mlx5_3"]) == {
        "gpu1": "compute processes [31337] still running",
        "gpu2": "cannot list compute processes: GPU is lost",
        "mlx5_3": "netdev ens1f0v1 is not back in the host namespace; "
        "mtu is 9000, expected 1500 after restore",
    }


def test_a_problem_naming_no_device_of_the_assignment_concerns_them_all() -> None:
    reasons = problems_by_device(
        ["cleanup raised: state file unwritable", "gpu0: compute processes [7] still running"],
        ["gpu0", "mlx5_1"],
    )
    assert reasons == {
        "gpu0": "compute processes [7] still running; cleanup raised: state file unwritable",
        "mlx5_1": "cleanup raised: state file unwritable",
    }
    assert problems_by_device([], ["gpu0"]) == {}


@pytest.mark.parametrize(
    ("attempt", "delay"), [(1, 1.0), (2, 2.0), (3, 4.0), (9, 256.0), (10, RETRY_MAX_S), (10_000, RETRY_MAX_S)]
)
def test_retry_delay_doubles_from_one_second_up_to_five_minutes(attempt: int, delay: float) -> None:
    assert retry_delay(attempt) == delay
    assert RETRY_MAX_S == 300.0


def test_retry_delay_is_configurable() -> None:
    assert [retry_delay(a, first=0.1, cap=0.5) for a in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]
