"""What the image test needs from the machine: podman & co., a Debian base image, the image.

No registry is reachable from the CI machines, so the base the Dockerfile builds on is
bootstrapped here with ``mmdebstrap`` from the Debian mirror the machine's apt already uses
(read from ``/etc/apt/sources.list*``, never written into the repository) and imported into
podman as ``localhost/tandem-base:<suite>``; podman's store keeps it between runs. The same
Dockerfile that users build on ``python:3.11-slim`` is then built with
``--build-arg BASE=localhost/tandem-base:<suite>`` through ``make image``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = Path(__file__).with_name("containers.conf")
# command -> Debian package; catatonit is the init `podman run --init` starts.
TOOLS = {tool: tool for tool in ("podman", "buildah", "mmdebstrap", "runc", "catatonit")}
BASE_REPOSITORY = "localhost/tandem-base"
IMAGE_REPOSITORY = "localhost/tandem"
BUILD_CACHE = "localhost/tandem-build-cache:latest"
BUILD_STAGE_LABEL = "org.tandem-project.stage=build"  # set in the Dockerfile's build stage
# What the Dockerfile needs from a base: python3 with venv, CA certificates, useradd (passwd).
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates", "passwd"]
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class HostError(RuntimeError):
    """The machine cannot provide what the image test needs; the message says what and why."""


def podman_env() -> dict[str, str]:
    """The environment every podman/buildah call runs with (our containers.conf, not /etc's)."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def run(cmd: list[str], *, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        out = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise HostError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out}")
    return proc


def ensure_tools() -> list[str]:
    """Install the missing container tools with apt-get; return what was installed."""
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if not missing:
        return []
    if shutil.which("apt-get") is None:
        raise HostError(f"missing {', '.join(missing)} and no apt-get to install them with")
    run(["apt-get", "update", "-qq"])
    env_cmd = ["env", "DEBIAN_FRONTEND=noninteractive"]
    run([*env_cmd, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing])
    still = [tool for tool in TOOLS if shutil.which(tool) is None]
    if still:
        raise HostError(f"apt-get installed {missing} but {still} are still not on PATH")
    return missing


@dataclass(frozen=True)
class Mirror:
    uri: str
    suite: str


def os_codename(os_release: Path = Path("/etc/os-release")) -> str:
    for line in os_release.read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"')
    raise HostError(f"{os_release}: no VERSION_CODENAME; cannot tell which Debian suite to bootstrap")


def apt_mirror(*, suite: str, etc_apt: Path = Path("/etc/apt")) -> Mirror:
    """The Debian archive apt uses for ``suite`` (deb822 ``*.sources`` or one-line ``*.list``)."""
    files = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                lines = [line for line in stanza.splitlines() if ":" in line and not line.startswith("#")]
                fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
                if (
                    "deb" in fields.get("types", "").split()
                    and suite in fields.get("suites", "").split()
                    and fields.get("enabled", "yes").lower() != "no"
                ):
                    return Mirror(uri=fields["uris"].split()[0], suite=suite)
        elif path.suffix == ".list":
            for line in text.splitlines():
                parts = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                    return Mirror(uri=parts[1], suite=suite)
    raise HostError(
        f"no 'deb' source for suite {suite!r} in {etc_apt}/sources.list*: cannot bootstrap a base"
    )


def image_exists(ref: str) -> bool:
    return run(["podman", "image", "exists", ref], check=False).returncode == 0


def ensure_base() -> tuple[str, float | None]:
    """The local Debian base image; bootstrapped and imported only when podman lacks it.

    Returns its reference and the seconds the bootstrap took (None when it was cached).
    """
    suite = os_codename()
    ref = f"{BASE_REPOSITORY}:{suite}"
    if image_exists(ref):
        return ref, None
    mirror = apt_mirror(suite=suite)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-base-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                suite,
                str(tarball),
                f"deb {mirror.uri} {suite} main",
            ],
            timeout=900,
        )
        run(["podman", "import", "--change", "CMD=/bin/bash", str(tarball), ref])
    return ref, time.monotonic() - started


def build_image(*, base: str, version: str) -> tuple[str, float]:
    """``make image`` with podman on ``base``; returns the image reference and build seconds."""
    flags = ["--network", "host"]
    if HOST_CA_BUNDLE.is_file():  # pip trusts the host's CAs; a read-only mount keeps it out of the image
        flags += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    ref = f"{IMAGE_REPOSITORY}:{version}"
    previous = image_id(ref)
    started = time.monotonic()
    proc = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "image",
            "BUILDER=podman",
            f"BASE={base}",
            f"IMAGE={IMAGE_REPOSITORY}",
            f"IMAGE_BUILD_FLAGS={' '.join(flags)}",
        ],
        cwd=ROOT,
        env=podman_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise HostError(f"make image failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    seconds = time.monotonic() - started
    if previous and previous != image_id(ref):
        remove_if_unused(previous)  # the last build's image, untagged by this one
    keep_build_cache(base=base, flags=flags)
    return ref, seconds


def keep_build_cache(*, base: str, flags: list[str]) -> None:
    """Keep this build's cached build-stage layers and drop those of earlier builds.

    Every source change leaves the previous build stage (~200 MB) behind as untagged layers.
    Tagging the current stage (a fully cached rebuild, about a second) keeps it out of the
    prune, which then removes only stale layers carrying the Dockerfile's build-stage label.
    """
    run(
        [
            "podman", "build", "--target", "build", "--tag", BUILD_CACHE,
            "--build-arg", f"BASE={base}", *flags, str(ROOT),
        ]
    )  # fmt: skip
    run(["podman", "image", "prune", "--force", "--filter", f"label={BUILD_STAGE_LABEL}"])


def image_id(ref: str) -> str | None:
    proc = run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def image_size(ref: str) -> int:
    return int(run(["podman", "image", "inspect", "--format", "{{.Size}}", ref]).stdout.strip())


def remove_if_unused(image: str) -> None:
    """Remove an image this test built before; podman refuses while a container uses it."""
    run(["podman", "image", "rm", image], check=False)
