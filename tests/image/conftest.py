"""Session fixtures of the image test: tools installed, base bootstrapped (cached), image built."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass

import pytest

from tests.image import host

VERSION = tomllib.loads((host.ROOT / "pyproject.toml").read_text())["project"]["version"]


@dataclass(frozen=True)
class BuiltImage:
    ref: str
    base: str
    size: int  # bytes, as podman reports it (uncompressed)
    base_size: int
    build_seconds: float
    bootstrap_seconds: float | None  # None: the base came from podman's store


@pytest.fixture(scope="session")
def container_host() -> list[str]:
    """podman & co. on PATH (installed with apt-get when missing); returns what was installed."""
    if os.geteuid() != 0:
        pytest.skip(
            "the image test runs podman as root and installs podman, buildah, mmdebstrap and runc "
            "with apt-get when they are missing; run it as root (make image-test)"
        )
    return host.ensure_tools()


@pytest.fixture(scope="session")
def built_image(container_host: list[str]) -> BuiltImage:
    base, bootstrap = host.ensure_base()
    ref, seconds = host.build_image(base=base, version=VERSION)
    image = BuiltImage(
        ref=ref,
        base=base,
        size=host.image_size(ref),
        base_size=host.image_size(base),
        build_seconds=seconds,
        bootstrap_seconds=bootstrap,
    )
    layers = image.size - image.base_size
    print(
        f"\nimage-test: {ref} on {base}: {image.size / 1e6:.0f} MB "
        f"(base {image.base_size / 1e6:.0f} MB, Tandem layers {layers / 1e6:.0f} MB); "
        f"build {seconds:.0f} s; base "
        + ("cached" if bootstrap is None else f"bootstrapped and imported in {bootstrap:.0f} s")
        + (f"; installed {', '.join(container_host)}" if container_host else "")
    )
    return image
