"""``tandem gpu-check``: JSON report with (fake) NVML; one clear error without the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pynvml
import pytest

from tests import fake_pynvml
from tests.sysfs_tree import hgx_8gpu
from tools.cli import gpu_cmd
from tools.cli.errors import CliError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gpu_cmd.register(p.add_subparsers())
    return p.parse_args(["gpu-check", *argv])


def test_gpu_check_without_nvml_names_library_and_options(tmp_path: Path) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present; `make gpu-check` is the real check here")
    args = parse("--sysfs-root", str(tmp_path), "--node", "n1")
    with pytest.raises(CliError) as err:
        args.func(args)
    msg = str(err.value)
    assert msg.startswith("NVML backend unavailable: NVML Shared Library Not Found")
    assert "libnvidia-ml.so.1" in msg and "'host'" in msg and "'sysfs'" in msg and "'simulated'" in msg


def test_gpu_check_prints_inventory_and_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = fake_pynvml.hgx_gpus()
    gpus[2].processes = [777]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.build(gpus))
    tree = hgx_8gpu(tmp_path)
    (tree.root / "class/infiniband/mlx5_5/ports/1/state").write_text("1: DOWN\n")
    args = parse("--sysfs-root", str(tree.root), "--node", "hgx-1", "--watch", "0.3")
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "host" and report["node"] == "hgx-1"
    assert len(report["topology"]["sockets"]) == 2
    assert report["processes"]["gpu2"] == [777]
    assert report["health"]["mlx5_5"]["healthy"] is False
    assert report["health"]["mlx5_5"]["reason"] == "port down"
    assert report["health"]["gpu0"] == {}  # healthy, nothing to say (omit_defaults)
