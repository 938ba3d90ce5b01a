"""The real control plane for ``make cluster-test`` (marker ``cluster``; not in ``make test``).

One control plane per session (:mod:`.controlplane`); the programs come from
:mod:`.build`, built from their pinned Go modules on first use and cached. Each test works in
namespaces of its own, so tests stay independent while the start-up is paid once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.runtime.process.jaeger import Jaeger
from tests.cluster.build import build_all
from tests.cluster.controlplane import CONTROL_PLANE, ControlPlane
from tests.cluster.release import Release, running_release

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.cluster)
            # A pod's life through real controllers takes seconds, back-offs more: not the
            # unit tests' 120 s.
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(300))


@pytest.fixture(scope="session")
def cluster_bins() -> dict[str, Path]:
    """The control plane's programs (``make cluster-bins`` has usually built them already)."""
    return build_all(CONTROL_PLANE, log=True)


@pytest.fixture(scope="session")
def jaeger_bin() -> Path:
    return build_all(["jaeger"], log=True)["jaeger"]


@pytest.fixture(scope="session")
def control_plane(
    tmp_path_factory: pytest.TempPathFactory, cluster_bins: dict[str, Path]
) -> Iterator[ControlPlane]:
    if os.geteuid() != 0:
        pytest.skip("the cluster tests need root: the pod network is a network namespace with a veth pair")
    cp = ControlPlane(tmp_path_factory.mktemp("cluster"), cluster_bins)
    with cp:
        yield cp


@pytest.fixture(scope="session")
def jaeger(control_plane: ControlPlane, jaeger_bin: Path) -> Iterator[Jaeger]:
    """The real Jaeger all-in-one, on the cluster's address so that every pod reaches it."""
    with Jaeger(str(jaeger_bin), host=control_plane.host) as j:
        yield j


# The chart with a plain NATS (no TLS, no auth callout) and traces to Jaeger: the pods' path
# through Kubernetes. The secure default is installed and checked on its own (test_install.py).
PLAIN_NATS = {
    "nats": {"bundled": False, "auth": {"mode": "none"}, "tls": {"enabled": False}},
    "nodeagent": {"backend": "simulated", "topologyFile": "dgx-h100"},
    "dra": {"enabled": True},
}


@pytest.fixture(scope="session")
def release(
    control_plane: ControlPlane, jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """Tandem installed with the Helm SDK, every replica of every component running."""
    with running_release(control_plane, tmp_path_factory.mktemp("release"), PLAIN_NATS, jaeger=jaeger) as rel:
        yield rel
