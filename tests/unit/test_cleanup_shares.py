"""Cleanup verification of shared GPUs (and MIG instances), with the fake ``pynvml``.

A share leaving a GPU whose other shares are still in use cannot require the GPU to be empty
(their processes run there); it must still answer. The last share is checked like a whole GPU.
"""

from __future__ import annotations

from services.nodeagent.cleanup import gpu_problems, mig_problems
from tests.fake_pynvml import hgx_gpus
from tests.unit.test_nvml import open_backend


async def test_a_busy_shared_gpu_must_answer_not_be_empty() -> None:
    gpus = hgx_gpus()
    gpus[1].processes = [4242]  # another share's server on GPU 1
    gpus[2].processes = [4343]
    gpus[3].lost = True
    backend, _ = await open_backend(gpus)
    try:
        # GPU 1 still has other shares: its processes are theirs. GPU 2 is the last share's:
        # a process left there is a problem. A lost GPU is a problem, busy or not.
        assert await gpu_problems(backend, [1, 2, 3], busy=frozenset({1, 3})) == [
            "gpu2: compute processes [4343] still running",
            "gpu3: cannot list compute processes: GPU is lost",
        ]
        assert await gpu_problems(backend, [1]) == ["gpu1: compute processes [4242] still running"]
    finally:
        await backend.close()


def test_parent_gpu_problems_are_named_by_the_mig_instances() -> None:
    problems = [
        "gpu1: compute processes [4242] still running",
        "gpu3: cannot list compute processes: GPU is lost",
        "mlx5_0: netdev not back",
    ]
    # GPU 1 holds two instances of the assignment; GPU 3 is a whole GPU of it.
    assert mig_problems(problems, {1: ["gpu1-mig9-0", "gpu1-mig10-0"]}) == [
        "gpu1-mig9-0: compute processes [4242] still running",
        "gpu1-mig10-0: compute processes [4242] still running",
        "gpu3: cannot list compute processes: GPU is lost",
        "mlx5_0: netdev not back",
    ]
    assert mig_problems(problems, {}) == problems
