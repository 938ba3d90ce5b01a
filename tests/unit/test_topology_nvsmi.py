"""The ``nvidia-smi topo -m`` importer against every real matrix we have, plus the formats
and failures it must handle. The key property: the tree it infers gives back the matrix's
own relations (PIX/PXB → pcie-switch, PHB → pcie-root, NODE → numa, SYS → node)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from schemas.topology import Scope, locate
from services.topology import (
    ImportResult,
    NvsmiFormatError,
    TopologyFileError,
    decode_topology,
    dump_topology,
    import_nvidia_smi,
    matrix_relations,
    parse_matrix,
    relations,
    tree_relation,
)

HERE = Path(__file__).parent / "test_topology_matrices"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "topologies"

# file → (GPUs, NICs), read off each capture by hand.
EXPECTED = {
    "01_asus-esc8000a-e12_4xRTX6000Ada_4nic.txt": (4, 4),
    "02_puget-threadripper-wrx90_2xRTX6000Ada_2nic.txt": (2, 2),
    "03_penny-blog_8xNV18_13nic_ib-eth.txt": (8, 13),
    "04_dlperf_8xV100-SXM2-16GB_1nic.txt": (8, 1),
    "05_dlperf-hugectr_8xV100-SXM2-32GB_2nic.txt": (8, 2),
    "09_oyanghd_8xA100-SXM-40G_10nic.txt": (8, 10),
    "10_glm52_8xH200_10nic_3pix-per-gpu3.txt": (8, 10),
    "16_aws-p4d.24xlarge_8xA100_gpu-only.txt": (8, 0),
    "17_aws-p5.48xlarge_8xH100_gpu-only.txt": (8, 0),
    "18_aws-g6e.12xlarge_4xL40S_gpu-only.txt": (4, 0),
    "22_llm-action_8xA800_4nic-asym.txt": (8, 4),
}


def _import(
    name: str, *, node: str = "n1", gpu_model: str = "unknown", sockets: int | None = None
) -> ImportResult:
    path = HERE / name
    return import_nvidia_smi(path.read_text(), name=node, gpu_model=gpu_model, sockets=sockets, source=path)


def test_every_matrix_has_an_expectation() -> None:
    assert sorted(p.name for p in HERE.glob("*.txt")) == sorted(EXPECTED)


@pytest.mark.skipif(not SHARED.is_dir(), reason="no ../shared/topologies next to this clone")
def test_vendored_copies_match_the_shared_directory() -> None:
    for shared in sorted(SHARED.glob("*.txt")):
        mine = HERE / shared.name
        assert mine.is_file(), f"{shared.name} is in {SHARED} but not vendored in {HERE}"
        assert mine.read_bytes() == shared.read_bytes(), shared.name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_import_counts_validity_and_relation_round_trip(name: str) -> None:
    path = HERE / name
    result = import_nvidia_smi(path.read_text(), name="node-a", source=path)
    topo = result.topology
    gpus, nics = EXPECTED[name]
    assert (len(topo.gpus()), len(topo.nics())) == (gpus, nics)
    assert sorted(g.index for g in topo.gpus()) == list(range(gpus))
    # The file the CLI writes decodes and validates to the same tree.
    for fmt in ("yaml", "json"):
        assert decode_topology(dump_topology(topo, fmt=fmt), fmt=fmt) == topo
    # GPU x NIC: the tree reproduces exactly the relations the matrix states.
    want = matrix_relations(result.matrix)
    assert len(want) == gpus * nics
    assert relations(topo) == want
    # And every other pair with a PCIe relation (NIC-NIC, GPU-GPU without NVLink) too.
    assert result.mismatches == []


def _cells(name: str) -> dict[tuple[str, str], Scope]:
    return matrix_relations(parse_matrix((HERE / name).read_text()))


def test_matrix_relations_read_the_cells() -> None:
    # Spot checks against the raw text, independent of the tree.
    rel = _cells("22_llm-action_8xA800_4nic-asym.txt")
    assert rel[("gpu1", "mlx5_0")] is Scope.PCIE_SWITCH  # PIX
    assert rel[("gpu0", "mlx5_0")] is Scope.NUMA  # NODE
    assert rel[("gpu0", "mlx5_2")] is Scope.NODE  # SYS
    assert rel[("gpu7", "mlx5_3")] is Scope.PCIE_SWITCH
    rel = _cells("03_penny-blog_8xNV18_13nic_ib-eth.txt")
    assert rel[("gpu0", "mlx5_ib1")] is Scope.PCIE_SWITCH  # PXB
    assert rel[("gpu4", "mlx5_eth0")] is Scope.NUMA
    rel = _cells("02_puget-threadripper-wrx90_2xRTX6000Ada_2nic.txt")
    assert rel[("gpu0", "mlx5_1")] is Scope.NUMA


def test_phb_puts_devices_on_one_root_without_a_switch() -> None:
    topo = _import("02_puget-threadripper-wrx90_2xRTX6000Ada_2nic.txt").topology
    rel = tree_relation(topo)
    assert rel[("gpu0", "gpu1")] is Scope.PCIE_ROOT  # PHB
    assert rel[("mlx5_0", "mlx5_1")] is Scope.PCIE_SWITCH  # PIX
    locs = {loc.device.id: loc for loc in locate(topo)}
    assert locs["gpu0"].switch is None and locs["gpu0"].root == locs["gpu1"].root


def test_three_nics_on_one_gpus_switch() -> None:
    topo = _import("10_glm52_8xH200_10nic_3pix-per-gpu3.txt").topology
    locs = {loc.device.id: loc for loc in locate(topo)}
    group = {
        d
        for d, loc in locs.items()
        if loc.switch is not None and loc.key(Scope.PCIE_SWITCH) == locs["gpu3"].key(Scope.PCIE_SWITCH)
    }
    assert group == {"gpu3", "mlx5_0", "mlx5_1", "mlx5_2"}
    assert {locs[d].numa for d in ("gpu0", "gpu3", "mlx5_5")} == {0}
    assert {locs[d].numa for d in ("gpu4", "mlx5_6", "mlx5_9")} == {1}


def test_nic_legend_names_and_link_type() -> None:
    topo = _import("03_penny-blog_8xNV18_13nic_ib-eth.txt").topology
    kinds = {n.name: n.link_type for n in topo.nics()}
    assert kinds["mlx5_ib0"] == "infiniband" and kinds["mlx5_eth4"] == "ethernet"
    assert sum(k == "ethernet" for k in kinds.values()) == 5


def test_old_format_mlx_columns_and_cpu_affinity_only() -> None:
    result = _import("04_dlperf_8xV100-SXM2-16GB_1nic.txt")
    topo = result.topology
    assert [n.name for n in topo.nics()] == ["mlx5_0"]
    locs = {loc.device.id: loc for loc in locate(topo)}
    # No NUMA Affinity column: the two CPU affinity sets become NUMA 0 and 1.
    assert [locs[f"gpu{i}"].numa for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert locs["mlx5_0"].numa == 0
    assert any("CPU Affinity" in n for n in result.notes)


def test_nvlink_peers_hybrid_cube_mesh_and_nvswitch() -> None:
    v100 = _import("04_dlperf_8xV100-SXM2-16GB_1nic.txt").topology
    peers = {g.index: g.nvlink_peers for g in v100.gpus()}
    assert peers[0] == [1, 2, 3, 4] and peers[5] == [1, 4, 6, 7]
    assert v100.nvlink_partitions == []  # not all-to-all: derive from peers
    h200 = _import("10_glm52_8xH200_10nic_3pix-per-gpu3.txt").topology
    assert h200.nvlink_partitions == [list(range(8))]
    assert all(len(g.nvlink_peers) == 7 for g in h200.gpus())
    l40s = _import("18_aws-g6e.12xlarge_4xL40S_gpu-only.txt").topology
    assert l40s.nvlink_partitions == [] and all(not g.nvlink_peers for g in l40s.gpus())


def test_numa_affinity_ids_and_nic_only_numa_node() -> None:
    result = _import("09_oyanghd_8xA100-SXM-40G_10nic.txt")
    locs = {loc.device.id: loc for loc in locate(result.topology)}
    assert [locs[f"gpu{i}"].numa for i in range(8)] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert locs["mlx5_0"].numa == 3 and locs["mlx5_6"].numa == 5
    # mlx5_8/9 are SYS to everything else: placed on a NUMA id no GPU uses, and noted.
    assert locs["mlx5_8"].numa == locs["mlx5_9"].numa == 0
    assert any("mlx5_8" in n for n in result.notes)
    # One socket per NUMA node by default; --sockets 2 spreads NUMA ids 0-7 over two.
    assert len(result.topology.sockets) == 5
    two = _import("09_oyanghd_8xA100-SXM-40G_10nic.txt", sockets=2).topology
    assert [[nn.id for nn in s.numa_nodes] for s in two.sockets] == [[0, 1, 3], [5, 7]]
    assert relations(two) == matrix_relations(
        parse_matrix((HERE / "09_oyanghd_8xA100-SXM-40G_10nic.txt").read_text())
    )


def test_uuids_are_deterministic_and_per_node() -> None:
    name = "16_aws-p4d.24xlarge_8xA100_gpu-only.txt"
    a = _import(name, node="p4d-1").topology
    again = _import(name, node="p4d-1").topology
    b = _import(name, node="p4d-2").topology
    ua, ub = [g.uuid for g in a.gpus()], [g.uuid for g in b.gpus()]
    assert ua == [g.uuid for g in again.gpus()]
    assert not set(ua) & set(ub)
    assert all(
        re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", u) for u in ua
    )
    assert len(set(ua)) == 8


def test_gpu_model_option_and_labels() -> None:
    topo = _import("18_aws-g6e.12xlarge_4xL40S_gpu-only.txt", gpu_model="NVIDIA L40S").topology
    assert {g.model for g in topo.gpus()} == {"NVIDIA L40S"}
    assert topo.labels == {"tandem.io/source": "nvidia-smi-topo"}
    assert "aws-g6e" in topo.description


# ------------------------------------------------------------------ formats

SPACES = """\
        GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity
GPU0     X      PHB     PIX     0-7     0
GPU1    PHB      X      PHB     0-7     0
NIC0    PIX     PHB      X

NIC Legend:

  NIC0: mlx5_3
"""


def test_spaces_tabs_and_ansi_parse_alike() -> None:
    spaced = parse_matrix(SPACES)
    tabbed = parse_matrix(
        "\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
        "GPU0\t X \tPHB\tPIX\t0-7\t0\n"
        "GPU1\tPHB\t X \tPHB\t0-7\t0\n"
        "NIC0\tPIX\tPHB\t X \t\t\n\nNIC Legend:\n\n  NIC0: mlx5_3\n"
    )
    assert spaced.cells == tabbed.cells
    assert [d.name for d in spaced.devices] == ["gpu0", "gpu1", "mlx5_3"]
    assert spaced.numa_affinity == {"GPU0": 0, "GPU1": 0}
    topo = import_nvidia_smi(SPACES, name="small").topology
    assert relations(topo) == {("gpu0", "mlx5_3"): Scope.PCIE_SWITCH, ("gpu1", "mlx5_3"): Scope.PCIE_ROOT}


def test_old_soc_spelling_means_sys() -> None:
    text = "\tGPU0\tGPU1\nGPU0\t X \tSOC\nGPU1\tSOC\t X \n"
    topo = import_nvidia_smi(text, name="old").topology
    assert tree_relation(topo)[("gpu0", "gpu1")] is Scope.NODE


def test_nic_without_legend_keeps_its_column_label() -> None:
    result = import_nvidia_smi(SPACES.split("\nNIC Legend")[0], name="nolegend")
    assert [n.name for n in result.topology.nics()] == ["NIC0"]
    assert any("no NIC Legend entry for NIC0" in n for n in result.notes)


# ------------------------------------------------------------------ errors


def _format_error(text: str) -> NvsmiFormatError:
    with pytest.raises(NvsmiFormatError) as info:
        parse_matrix(text, source="node7.txt")
    assert isinstance(info.value, TopologyFileError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("node7.txt")
    return info.value


def test_not_a_matrix() -> None:
    err = _format_error("# source: somewhere\nhello world\n")
    assert "no header line with a GPU0 column" in str(err)
    assert err.line is None


def test_ragged_row_names_its_line() -> None:
    err = _format_error(SPACES.replace("GPU1    PHB      X      PHB", "GPU1    PHB      X"))
    assert err.line == 3 and "node7.txt:3:" in str(err)
    assert "row GPU1 has 2 relation cells; the header has 3" in str(err)


def test_unknown_relation_and_missing_row_and_diagonal() -> None:
    err = _format_error(SPACES.replace("GPU0     X      PHB     PIX", "GPU0     X      PHB     ABC"))
    assert err.line == 2 and "unknown relation 'ABC'" in str(err)
    err = _format_error(SPACES.replace("NIC0    PIX     PHB      X\n", ""))
    assert "no row for NIC0" in str(err)
    err = _format_error(SPACES.replace("GPU1    PHB      X      PHB", "GPU1    PHB     PHB     PHB"))
    assert err.line == 3 and "diagonal" in str(err)


def test_asymmetric_matrix_is_rejected() -> None:
    err = _format_error(SPACES.replace("NIC0    PIX     PHB", "NIC0    PIX     SYS"))
    assert err.line == 4 and "not symmetric" in str(err)


def test_too_many_values_after_the_matrix() -> None:
    err = _format_error(SPACES.replace("0-7     0\nGPU1", "0-7     0     9\nGPU1"))
    assert err.line == 2 and "values after the matrix" in str(err)


# ------------------------------------------------------------------ contradictions

# A tree cannot hold this: GPU0 and NIC1 share a switch with NIC0 (PIX, PIX) but the matrix
# says they are on different NUMA nodes (SYS). No real capture we have does this.
CONTRADICTION = """\
        GPU0    NIC0    NIC1    NUMA Affinity
GPU0     X      PIX     SYS     0
NIC0    PIX      X      PIX
NIC1    SYS     PIX      X
"""


def test_contradiction_trusts_shared_ancestors_and_reports_the_pair() -> None:
    result = import_nvidia_smi(CONTRADICTION, name="odd")
    rel = relations(result.topology)
    assert rel == {("gpu0", "NIC0"): Scope.PCIE_SWITCH, ("gpu0", "NIC1"): Scope.PCIE_SWITCH}
    assert [str(m) for m in result.mismatches] == ["GPU0-NIC1: matrix says SYS, tree gives pcie-switch"]
    assert relations(result.topology) != matrix_relations(result.matrix)


def test_numa_affinity_conflict_is_noted() -> None:
    text = "\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tNODE\t0\nGPU1\tNODE\t X \t1\n"
    result = import_nvidia_smi(text, name="conflict")
    assert [nn.id for s in result.topology.sockets for nn in s.numa_nodes] == [0]
    assert any("report NUMA nodes [0, 1]" in n for n in result.notes)
