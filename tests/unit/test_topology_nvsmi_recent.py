"""The ``nvidia-smi topo -m`` importer on recent layouts: Grace-era captures (GB200: NUMA
Affinity lists such as ``0,3-9,11-17``, a numeric ``GPU NUMA ID``, NICs ``SYS`` to every GPU,
``NV18``, NIC pairs that are two ports of one card) and the tab-separated format with empty
cells. The captures and their sources are listed in ``test_topology_matrices/recent/README.md``.

Expected values are read off the raw text in this file by a reader independent of the importer
(regular expressions and tab splits), never typed in by hand."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from schemas.topology import Scope, locate
from services.topology import (
    decode_topology,
    dump_topology,
    import_nvidia_smi,
    load_topology,
    matrix_relations,
    parse_matrix,
    relations,
    tree_relation,
)
from services.topology.nvsmi import ImportResult
from tools.cli.main import main

RECENT = Path(__file__).parent / "test_topology_matrices" / "recent"
CAPTURES = sorted(RECENT.glob("*.txt"))
GB200_ALL_SYS = RECENT / "30_gb200-4gpu_8nic_all-sys_numa-lists.txt"
GB200_TRAY = RECENT / "31_gb200-nvl72-tray_6nic_container-ansi.txt"
RTX4090 = RECENT / "32_go-gpuallocator-17_8xRTX4090_2nic_gpu-numa-id.txt"


def _import(path: Path) -> ImportResult:
    return import_nvidia_smi(path.read_text(), name="node-a", source=path)


def _body(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("#"))


def _rows(path: Path) -> dict[str, str]:
    """Raw row lines by label (GPU#, NIC#), ANSI codes removed."""
    out: dict[str, str] = {}
    for raw in _body(path).splitlines():
        m = re.match(r"^(GPU\d+|NIC\d+)[\t ]", raw)
        if m:
            out[m.group(1)] = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    return out


def _expand(ids: str) -> set[int]:
    out: set[int] = set()
    for a, b in re.findall(r"(\d+)(?:-(\d+))?", ids):
        out.update(range(int(a), int(b or a) + 1))
    return out


def test_every_capture_names_its_source_and_is_listed_in_the_readme() -> None:
    assert len(CAPTURES) >= 3
    readme = (RECENT / "README.md").read_text()
    for path in CAPTURES:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# source: "), path.name
        assert path.name in readme, path.name


@pytest.mark.parametrize("path", CAPTURES, ids=[p.name[:2] for p in CAPTURES])
def test_capture_imports_every_device_and_round_trips(path: Path) -> None:
    result = _import(path)
    topo = result.topology
    rows = _rows(path)
    gpus = sorted(int(k[3:]) for k in rows if k.startswith("GPU"))
    nics = [k for k in rows if k.startswith("NIC")]
    assert sorted(g.index for g in topo.gpus()) == gpus
    assert len(topo.nics()) == len(nics)
    for fmt in ("yaml", "json"):
        assert decode_topology(dump_topology(topo, fmt=fmt), fmt=fmt) == topo
    # Every pair the tree answers differently from the matrix is reported, never silent.
    want = matrix_relations(result.matrix)
    got = relations(topo)
    reported = {frozenset((m.a, m.b)) for m in result.mismatches}
    by_name = {d.name: d.label for d in result.matrix.devices}
    for pair, scope in want.items():
        if got[pair] != scope:
            assert frozenset(by_name[n] for n in pair) in reported, pair


@pytest.mark.parametrize("path", [GB200_ALL_SYS, GB200_TRAY])
def test_grace_captures_reproduce_every_relation(path: Path) -> None:
    result = _import(path)
    assert relations(result.topology) == matrix_relations(result.matrix)
    assert result.mismatches == []


def test_numa_ids_come_from_the_affinity_lists_and_gpu_numa_id_column() -> None:
    result = _import(GB200_ALL_SYS)
    locs = {loc.device.id: loc for loc in locate(result.topology)}
    for label, raw in _rows(GB200_ALL_SYS).items():
        if not label.startswith("GPU"):
            continue
        *_, cpus, numa_list, gpu_numa = raw.split()
        assert "," in numa_list and "-" in numa_list  # the Grace list-and-range form
        gpu = f"gpu{label[3:]}"
        assert locs[gpu].numa == min(_expand(numa_list))
        assert result.matrix.numa_affinity_ids[label] == tuple(sorted(_expand(numa_list)))
        assert result.matrix.gpu_numa_id[label] == int(gpu_numa)
        assert result.matrix.cpu_affinity[label] == cpus
        assert any(f"{gpu} memory is NUMA node {gpu_numa}" in n for n in result.notes)
    # GPUs on one Grace CPU share its NUMA node; the two CPUs are two sockets.
    gpu_numa_nodes = {locs[f"gpu{i}"].numa for i in range(4)}
    assert len(gpu_numa_nodes) == 2
    assert len({locs[f"gpu{i}"].socket for i in range(4)}) == 2


def test_nics_all_sys_to_the_gpus_sit_at_node_scope() -> None:
    result = _import(GB200_ALL_SYS)
    topo, matrix = result.topology, result.matrix
    every = tree_relation(topo)
    locs = {loc.device.id: loc for loc in locate(topo)}
    gpu_sockets = {locs[g.id].socket for g in topo.gpus()}
    all_sys = [n for n in matrix.nics if all(matrix.cells[(g.label, n.label)] == "SYS" for g in matrix.gpus)]
    assert len(all_sys) == len(matrix.nics)  # this capture: every NIC
    for nic in all_sys:
        assert all(every[(g.id, nic.name)] is Scope.NODE for g in topo.gpus())
        assert locs[nic.name].socket not in gpu_sockets  # shares nothing with a GPU but the node
        assert locs[nic.name].numa not in matrix.mentioned_numa_ids()  # no real NUMA id reused
        assert any(nic.name in n and "node scope" in n for n in result.notes)


def test_two_port_nics_share_a_switch_and_single_ports_do_not() -> None:
    result = _import(GB200_ALL_SYS)
    matrix = result.matrix
    locs = {loc.device.id: loc for loc in locate(result.topology)}
    pix = {
        frozenset((a.name, b.name))
        for a in matrix.nics
        for b in matrix.nics
        if a != b and matrix.cells[(a.label, b.label)] == "PIX"
    }
    assert pix  # NIC2/NIC3 and NIC6/NIC7 on this tray
    for pair in pix:
        a, b = sorted(pair)
        assert locs[a].switch is not None and locs[a].key(Scope.PCIE_SWITCH) == locs[b].key(Scope.PCIE_SWITCH)
    singles = {n.name for n in matrix.nics} - {n for p in pix for n in p}
    assert singles and all(locs[n].switch is None for n in singles)
    assert [n.name for n in result.topology.nics()] == sorted(
        (m.group(2) for m in re.finditer(r"(NIC\d+): (\S+)", _body(GB200_ALL_SYS))),
        key=lambda s: int(s.split("_")[1]),
    )


def test_nv18_everywhere_is_one_nvlink_domain() -> None:
    topo = _import(GB200_ALL_SYS).topology
    rows = _rows(GB200_ALL_SYS)
    gpus = sorted(int(k[3:]) for k in rows if k.startswith("GPU"))
    assert all(rows[f"GPU{i}"].split()[1 + j] == "NV18" for i in gpus for j in gpus if i != j)
    assert topo.nvlink_partitions == [gpus]
    assert all(g.nvlink_peers == [i for i in gpus if i != g.index] for g in topo.gpus())


def test_container_capture_bytes_and_empty_cpu_affinity_cells() -> None:
    text = GB200_TRAY.read_text()
    published = re.search(r"body sha256 ([0-9a-f]{64})", text)
    assert published is not None
    assert hashlib.sha256(_body(GB200_TRAY).encode()).hexdigest() == published.group(1)
    matrix = parse_matrix(text)
    n = len(matrix.devices)
    rows = _rows(GB200_TRAY)
    for label, raw in rows.items():
        if not label.startswith("GPU"):
            continue
        values = raw.split("\t")[n + 1 :]
        cpus, numa = values[0].strip(), values[1].strip()
        assert matrix.cpu_affinity.get(label) == (cpus or None), label
        assert matrix.numa_affinity[label] == int(numa), label
    assert any(not raw.split("\t")[n + 1].strip() for raw in rows.values() if raw.startswith("GPU"))
    assert matrix.gpu_numa_id == {}  # N/A on every row


def test_sys_between_same_numa_gpus_is_reported_not_hidden() -> None:
    # A real RTX 4090 box prints SYS between GPUs that report the same NUMA Affinity. The
    # importer trusts the affinity column; every pair that costs is a reported mismatch.
    result = _import(RTX4090)
    matrix = result.matrix
    assert result.mismatches
    locs = {loc.device.id: loc for loc in locate(result.topology)}
    name = {d.label: d.name for d in matrix.devices}
    for m in result.mismatches:
        assert m.cell == "SYS" and m.tree is Scope.NUMA
        assert locs[name[m.a]].numa == locs[name[m.b]].numa
        assert locs[name[m.a]].numa in set(matrix.numa_affinity.values())
    assert [n.name for n in result.topology.nics()] == ["NIC0", "NIC1"]  # no NIC Legend


@pytest.mark.parametrize("path", CAPTURES, ids=[p.name[:2] for p in CAPTURES])
def test_cli_imports_each_capture(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "node.yaml"
    assert main(["topology", "import", "--nvidia-smi", str(path), "--name", "gb-1", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    topo = load_topology(out)
    assert len(topo.gpus()) == len(parse_matrix(path.read_text()).gpus)
