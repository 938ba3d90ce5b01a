"""Topology files: the built-ins load and have the layout they promise; bad files fail with
an error naming the file and the field path."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.topology import NodeTopology, Scope, locate, scope_between
from services.topology import (
    TopologyFileError,
    builtin_names,
    builtin_path,
    decode_topology,
    dump_topology,
    load_topology,
    relations,
)

BUILTINS = {"dgx-h100", "dgx-a100", "pcie-4gpu-2nic", "gpu-only-8"}


def test_builtin_names_lists_the_shipped_files() -> None:
    assert set(builtin_names()) == BUILTINS
    for name in builtin_names():
        assert builtin_path(name).is_file()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_builtin_loads_validates_and_round_trips(name: str, tmp_path: Path) -> None:
    topo = load_topology(name)
    assert topo.name == name
    assert topo.validate() is topo
    for g in topo.gpus():
        assert g.uuid.startswith("GPU-") and len(g.uuid) == 40
        assert g.pci_bus_id and g.memory_mib > 0 and g.model.startswith("NVIDIA ")
    for n in topo.nics():
        assert n.pci_bus_id and n.netdev and n.speed_gbps > 0
    # YAML and JSON dumps decode to the identical tree, also via a file on disk.
    for fmt in ("yaml", "json"):
        text = dump_topology(topo, fmt=fmt)
        assert decode_topology(text, fmt=fmt) == topo
        path = tmp_path / f"{name}.{fmt}"
        path.write_text(text)
        assert load_topology(path) == topo
        assert load_topology(str(path)) == topo


def test_dgx_h100_layout() -> None:
    topo = load_topology("dgx-h100")
    gpus, nics = topo.gpus(), topo.nics()
    assert len(gpus) == 8 and len(nics) == 8
    assert all(g.model == "NVIDIA H100 80GB HBM3" for g in gpus)
    assert all(n.link_type == "infiniband" and n.speed_gbps == 400 for n in nics)
    assert [s.id for s in topo.sockets] == [0, 1]
    assert [[nn.id for nn in s.numa_nodes] for s in topo.sockets] == [[0], [1]]
    switches = [sw for s in topo.sockets for nn in s.numa_nodes for r in nn.roots for sw in r.switches]
    assert len(switches) == 4
    assert all(len(sw.gpus) == 2 and len(sw.nics) == 2 for sw in switches)
    # NVSwitch: every GPU is an NVLink peer of every other.
    for g in gpus:
        assert sorted(g.nvlink_peers) == [i for i in range(8) if i != g.index]
    assert topo.nvlink_partitions == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        list(range(8)),
    ]
    # Every GPU has exactly two NICs on its own switch, two more on its NUMA node, four across.
    rel = relations(topo)
    for g in gpus:
        mine = sorted(rel[(g.id, n.id)] for n in nics)
        assert mine == [Scope.PCIE_SWITCH] * 2 + [Scope.NUMA] * 2 + [Scope.NODE] * 4


def test_dgx_a100_layout() -> None:
    topo = load_topology("dgx-a100")
    assert len(topo.gpus()) == 8
    assert [[nn.id for nn in s.numa_nodes] for s in topo.sockets] == [[0, 1], [2, 3]]
    locs = {loc.device.id: loc for loc in locate(topo)}
    # GPU0 and GPU2 are on different NUMA nodes of the same socket.
    assert scope_between(locs["gpu0"], locs["gpu2"]) is Scope.SOCKET
    assert scope_between(locs["gpu0"], locs["mlx5_0"]) is Scope.PCIE_SWITCH
    storage = [n for n in topo.nics() if n.link_type == "ethernet"]
    assert [n.name for n in storage] == ["mlx5_4", "mlx5_5"]
    assert all(len(n.vfs) == 4 for n in storage)
    assert all(locs[n.name].switch is None for n in storage)  # root-level (PHB)
    ib = [n for n in topo.nics() if n.link_type == "infiniband"]
    assert len(ib) == 8 and all(locs[n.name].switch is not None for n in ib)


def test_pcie_4gpu_2nic_has_one_switch_aligned_and_one_root_aligned_side() -> None:
    topo = load_topology("pcie-4gpu-2nic")
    assert len(topo.gpus()) == 4 and len(topo.nics()) == 2
    assert all(not g.nvlink_peers for g in topo.gpus())
    assert sum(len(n.vfs) for n in topo.nics()) == 8
    assert all(n.link_type == "ethernet" and n.speed_gbps == 100 for n in topo.nics())
    rel = relations(topo)
    assert rel[("gpu0", "mlx5_0")] is Scope.PCIE_SWITCH
    assert rel[("gpu1", "mlx5_0")] is Scope.PCIE_SWITCH
    assert rel[("gpu2", "mlx5_1")] is Scope.PCIE_ROOT
    assert rel[("gpu3", "mlx5_1")] is Scope.PCIE_ROOT
    assert rel[("gpu0", "mlx5_1")] is Scope.NODE


def test_gpu_only_8_has_no_nics() -> None:
    topo = load_topology("gpu-only-8")
    assert len(topo.gpus()) == 8 and topo.nics() == []
    assert all(len(g.nvlink_peers) == 7 for g in topo.gpus())


def test_unknown_builtin_names_the_choices() -> None:
    with pytest.raises(TopologyFileError, match=r"no built-in topology 'dgx-z9'.*dgx-h100"):
        load_topology("dgx-z9")
    with pytest.raises(TopologyFileError):
        builtin_path("../files")


# ------------------------------------------------------------------ bad files

GOOD = """\
name: test-node
sockets:
- id: 0
  numa_nodes:
  - id: 0
    roots:
    - id: r0
      switches:
      - id: s0
        gpus:
        - {index: 0, uuid: GPU-a}
        - {index: 1, uuid: GPU-b, nvlink_peers: [0]}
        nics:
        - {name: mlx5_0, vfs: [{index: 0, name: mlx5_2}]}
    - id: r1
      gpus:
      - {index: 2, uuid: GPU-c}
"""


def _write(tmp_path: Path, text: str, name: str = "node.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path) -> TopologyFileError:
    with pytest.raises(TopologyFileError) as info:
        load_topology(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    return info.value


def test_good_fixture_loads(tmp_path: Path) -> None:
    topo = load_topology(_write(tmp_path, GOOD))
    assert isinstance(topo, NodeTopology)
    assert [g.id for g in topo.gpus()] == ["gpu0", "gpu1", "gpu2"]


def test_missing_field_names_file_and_path(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("{index: 0, uuid: GPU-a}", "{index: 0}")))
    assert "missing required field `uuid`" in str(err)
    assert err.field == "$.sockets[0].numa_nodes[0].roots[0].switches[0].gpus[0]"


def test_wrong_type_names_file_and_path(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("index: 2,", "index: two,")))
    assert "Expected `int`" in str(err)
    assert err.field == "$.sockets[0].numa_nodes[0].roots[1].gpus[0].index"


def test_bad_bus_id_pattern_is_rejected(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("{name: mlx5_0,", "{name: mlx5_0, pci_bus_id: 'zz:1',")))
    assert err.field == "$.sockets[0].numa_nodes[0].roots[0].switches[0].nics[0].pci_bus_id"


def test_duplicate_gpu_index_names_both_places(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("index: 2,", "index: 1,")))
    assert "device id 'gpu1'" in str(err)
    assert err.field == "$.sockets[0].numa_nodes[0].roots[1].gpus[0].index"
    assert "$.sockets[0].numa_nodes[0].roots[0].switches[0].gpus[1].index" in str(err)


def test_duplicate_vf_name_is_a_duplicate_device(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("name: mlx5_2", "name: mlx5_0")))
    assert err.field == "$.sockets[0].numa_nodes[0].roots[0].switches[0].nics[0].vfs[0].name"


def test_duplicate_root_and_numa_ids_are_rejected(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("- id: r1", "- id: r0")))
    assert "PCIe root id 'r0'" in str(err)
    assert err.field == "$.sockets[0].numa_nodes[0].roots[1].id"
    two_numa = GOOD + "- id: 1\n  numa_nodes:\n  - id: 0\n"
    err = _error(_write(tmp_path, two_numa, "numa.yaml"))
    assert err.field == "$.sockets[1].numa_nodes[0].id"


def test_unknown_nvlink_peer_and_partition(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, GOOD.replace("nvlink_peers: [0]", "nvlink_peers: [0, 7]")))
    assert "[7]" in str(err)
    assert err.field == "$.sockets[0].numa_nodes[0].roots[0].switches[0].gpus[1].nvlink_peers"
    err = _error(_write(tmp_path, "nvlink_partitions: [[0, 1], [0, 9]]\n" + GOOD, "p.yaml"))
    assert err.field == "$.nvlink_partitions[1]"


def test_invalid_yaml_and_json_syntax(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: [unclosed\n"))
    assert "not valid YAML" in str(err)
    err = _error(_write(tmp_path, '{"name": "x",', "bad.json"))
    assert "not valid JSON" in str(err)


def test_missing_file(tmp_path: Path) -> None:
    err = _error(tmp_path / "absent.yaml")
    assert "cannot read" in str(err)


def test_yaml_dump_is_readable() -> None:
    text = dump_topology(load_topology("dgx-h100"))
    # Metadata first, tree last; short number lists on one line.
    assert text.index("nvlink_partitions:") < text.index("sockets:")
    assert "nvlink_peers: [1, 2, 3, 4, 5, 6, 7]" in text


def test_the_documented_example_loads(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "topology.md").read_text()
    example = doc.split("### Example\n\n```yaml\n", 1)[1].split("```", 1)[0]
    topo = load_topology(_write(tmp_path, example, "example.yaml"))
    assert topo.name == "gpu-node-7"
    assert relations(topo) == {("gpu0", "mlx5_0"): Scope.PCIE_SWITCH, ("gpu1", "mlx5_0"): Scope.PCIE_SWITCH,
                               ("gpu2", "mlx5_0"): Scope.PCIE_ROOT}  # fmt: skip
