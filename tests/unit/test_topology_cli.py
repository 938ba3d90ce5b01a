"""``tandem topology``: import → validate round trip and the user-facing errors, through the
real entry point ``tools.cli.main.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.topology import decode_topology, load_topology, matrix_relations, parse_matrix, relations
from tools.cli.main import main

HERE = Path(__file__).parent / "test_topology_matrices"
MATRICES = sorted(HERE.glob("*.txt"))


@pytest.mark.parametrize("matrix", MATRICES, ids=[m.name[:2] for m in MATRICES])
def test_import_then_validate_every_matrix(
    matrix: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "node.yaml"
    assert (
        main(["topology", "import", "--nvidia-smi", str(matrix), "--name", "gpu-node-1", "-o", str(out)]) == 0
    )
    assert f"wrote {out}" in capsys.readouterr().err
    assert main(["topology", "validate", str(out)]) == 0
    assert "ok: gpu-node-1" in capsys.readouterr().out
    topo = load_topology(out)
    assert topo.name == "gpu-node-1"
    assert relations(topo) == matrix_relations(parse_matrix(matrix.read_text()))


def test_import_json_to_stdout_with_options(capsys: pytest.CaptureFixture[str]) -> None:
    matrix = HERE / "09_oyanghd_8xA100-SXM-40G_10nic.txt"
    code = main(
        ["topology", "import", "--nvidia-smi", str(matrix), "--format", "json", "--sockets", "2",
         "--gpu-model", "NVIDIA A100-SXM4-40GB"]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["name"] == "09_oyanghd_8xA100-SXM-40G_10nic"  # from the file name
    topo = decode_topology(captured.out, fmt="json")
    assert len(topo.sockets) == 2 and {g.model for g in topo.gpus()} == {"NVIDIA A100-SXM4-40GB"}
    assert "note: mlx5_8, mlx5_9: no NUMA information" in captured.err


def test_list_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "list"]) == 0
    listing = capsys.readouterr().out
    for name in ("dgx-h100", "dgx-a100", "pcie-4gpu-2nic", "gpu-only-8"):
        assert name in listing
    assert main(["topology", "show", "dgx-h100"]) == 0
    tree = capsys.readouterr().out
    assert "PCIe switch 0000:16:00.0" in tree and "NIC mlx5_0  ibp26s0  infiniband 400G" in tree
    assert tree.count("GPU gpu") == 8 and "NVLink peers 7" in tree
    assert main(["topology", "show", "pcie-4gpu-2nic"]) == 0
    assert "4 VFs (mlx5_2, mlx5_3, mlx5_4, mlx5_5)" in capsys.readouterr().out


def test_user_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsockets:\n- id: zero\n")
    assert main(["topology", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: {bad}: invalid topology") and "`$.sockets[0].id`" in err

    garbage = tmp_path / "garbage.txt"
    garbage.write_text("\tGPU0\tNIC0\nGPU0\t X \tPIX\nNIC0\tPIX\n")
    assert main(["topology", "import", "--nvidia-smi", str(garbage)]) == 2
    assert f"tandem: {garbage}:3: row NIC0 has 1 relation cells" in capsys.readouterr().err

    assert main(["topology", "import", "--nvidia-smi", str(tmp_path / "none.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["topology", "show", "no-such-topology"]) == 2
    assert "built-ins are" in capsys.readouterr().err

    matrix = str(HERE / "18_aws-g6e.12xlarge_4xL40S_gpu-only.txt")
    assert main(["topology", "import", "--nvidia-smi", matrix, "--name", "bad name"]) == 2
    assert "- at `$.name`" in capsys.readouterr().err
    assert main(["topology", "import", "--nvidia-smi", matrix, "--sockets", "0"]) == 2
    assert "--sockets must be at least 1" in capsys.readouterr().err


def test_strict_refuses_a_contradictory_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / "odd.txt"
    odd.write_text("\tGPU0\tNIC0\tNIC1\nGPU0\t X \tPIX\tSYS\nNIC0\tPIX\t X \tPIX\nNIC1\tSYS\tPIX\t X \n")
    assert main(["topology", "import", "--nvidia-smi", str(odd), "-o", str(tmp_path / "odd.yaml")]) == 0
    assert "warning:" in capsys.readouterr().err and (tmp_path / "odd.yaml").is_file()
    assert main(["topology", "import", "--nvidia-smi", str(odd), "--strict"]) == 2
    assert "cannot be represented by a tree" in capsys.readouterr().err
