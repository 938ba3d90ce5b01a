"""MIG instances in topology files: the documented example loads, and a file that puts
instances on a GPU not in MIG mode, repeats a MIG UUID or names a malformed profile is refused
with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.topology import TopologyFileError, load_topology

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mig" / "dgx-h100-mig.yaml"


def test_the_documented_mig_node_loads() -> None:
    topo = load_topology(str(EXAMPLE))
    mig = {g.index: [m.profile for m in g.mig_instances] for g in topo.gpus() if g.mig_mode}
    assert mig == {
        0: ["1g.10gb"] * 7,
        1: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
        2: ["1g.10gb"] * 7,
        3: ["3g.40gb", "3g.40gb"],
    }
    ids = [d for g in topo.gpus() for d, _ in g.mig_ids()]
    assert ids[:2] == ["gpu0-mig7-0", "gpu0-mig8-0"] and len(set(ids)) == 20


def _write(tmp_path: Path, edit: str) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    gpus = doc["sockets"][0]["numa_nodes"][0]["roots"][0]["switches"][0]["gpus"]
    if edit == "no-mode":
        gpus[0]["mig_mode"] = False
    elif edit == "dup-uuid":
        gpus[1]["mig_instances"][0]["uuid"] = gpus[0]["mig_instances"][0]["uuid"]
    elif edit == "bad-profile":
        gpus[0]["mig_instances"][0]["profile"] = "tiny"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ("no-mode", "gpu0 lists MIG instances but mig_mode is false"),
        ("dup-uuid", "MIG UUID 'MIG-"),
        ("bad-profile", "mig_instances[0].profile"),
    ],
)
def test_bad_mig_topologies_are_refused(tmp_path: Path, edit: str, why: str) -> None:
    with pytest.raises(TopologyFileError, match=None) as err:
        load_topology(str(_write(tmp_path, edit)))
    assert why in str(err.value)
