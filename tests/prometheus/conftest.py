"""Prometheus and promtool for these tests: the Debian package, installed by ``make
prometheus`` (apt-get) when missing; skipped only when neither the binaries nor root are here."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART_FILES = ROOT / "deploy" / "helm" / "tandem" / "files"


@dataclass(frozen=True)
class Tools:
    prometheus: str
    promtool: str


def _found() -> Tools | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    return Tools(prometheus, promtool) if prometheus and promtool else None


@pytest.fixture(scope="session")
def prom_tools() -> Tools:
    tools = _found()
    if tools is None:
        if os.geteuid() != 0:
            pytest.skip(
                "prometheus/promtool not installed, and not root to apt-get them: `sudo make prometheus`"
            )
        subprocess.run(["make", "-C", str(ROOT), "prometheus"], check=True, timeout=900)
        tools = _found()
        assert tools is not None, "make prometheus ran but prometheus/promtool are still not on PATH"
    return tools
