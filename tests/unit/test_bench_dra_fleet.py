"""The fleet of ``make bench-dra`` (bench/dra.py) and the mix it is planned from
(tools/loadtest/mix.py): real servers' captures as kinds, a mix read from text the same way by
the bench and the simulated fleet, and the bench's reading of each node's slices (aligned
pairs, free physical NICs, a claim's alignment)."""

from __future__ import annotations

import pytest

from bench.dra import MIX, Fleet
from tools.loadtest.fleet import main as fleet_main
from tools.loadtest.mix import REAL_KINDS, fleet_plan, kind_topology, node_topology, parse_mix


def test_a_mix_is_read_from_text_and_normalised() -> None:
    assert parse_mix("dgx-h100=3,h200-10nic=1") == (("dgx-h100", 0.75), ("h200-10nic", 0.25))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("dgx-h100", "want KIND=SHARE"),
        ("dgx-h999=1", "want KIND=SHARE"),
        ("dgx-h100=lots", "'lots' is not a number"),
        ("dgx-h100=0", "must be above 0"),
    ],
)
def test_a_wrong_mix_entry_is_named(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        parse_mix(text)
    assert text in str(info.value)


def test_the_fleet_process_refuses_a_wrong_mix_with_the_entry_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        fleet_main(["--nodes", "3", "--mix", "dgx-h100=1,nope=1"])
    assert info.value.code == 2
    assert "--mix: mix entry 'nope=1'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(REAL_KINDS))
def test_a_real_server_kind_is_its_imported_capture(kind: str) -> None:
    topo = kind_topology(kind)
    assert len(topo.gpus()) == 8
    # Each node of the kind gets GPU UUIDs of its own, as real nodes report them.
    a, b = (node_topology(spec) for spec in fleet_plan(2, mix=((kind, 1.0),)))
    assert {g.uuid for g in a.gpus()}.isdisjoint(g.uuid for g in b.gpus())


def test_every_kind_of_the_bench_mix_has_a_nic_for_each_gpu_under_its_switch() -> None:
    plan = fleet_plan(20, mix=parse_mix(MIX))
    fleet = Fleet(plan)
    assert set(fleet.kinds()) == {"dgx-h100", "dgx-a100", "h200-10nic", "a100-10nic", "nv18-13nic"}
    assert fleet.gpus == 8 * 20
    assert all(fleet.pairs[spec.name] == 8 for spec in plan)


def test_the_asymmetric_server_has_as_many_aligned_pairs_as_its_switches_allow() -> None:
    (spec,) = fleet_plan(1, mix=(("a800-4nic-asym", 1.0),))
    # Its 4 NICs sit on 3 switches with 1 GPU each: 3 GPUs can have a NIC of their switch.
    assert Fleet([spec]).pairs[spec.name] == 3


def test_virtual_functions_are_not_counted_as_free_nics() -> None:
    (spec,) = fleet_plan(1, mix=(("dgx-a100", 1.0),))
    fleet = Fleet([spec])
    free = fleet.free(set())[spec.name]
    assert (free["gpu"], free["nic"]) == (8, 10)
    assert free["nic-vf"] > 0


def test_a_claim_is_aligned_only_when_each_gpu_has_a_nic_of_its_switch() -> None:
    (spec,) = fleet_plan(1, mix=(("dgx-h100", 1.0),))
    fleet = Fleet([spec])
    by_switch: dict[str, dict[str, list[str]]] = {}
    for (_, name), (kind, switch) in fleet.devices.items():
        by_switch.setdefault(switch, {}).setdefault(kind, []).append(name)
    (s0, s1, *_) = sorted(by_switch)

    def results(*names: str) -> list[dict[str, str]]:
        return [{"device": n} for n in names]

    gpu0, nic0, nic1 = by_switch[s0]["gpu"][0], by_switch[s0]["nic"][0], by_switch[s1]["nic"][0]
    assert fleet.aligned(spec.name, results(gpu0, nic0))
    assert not fleet.aligned(spec.name, results(gpu0, nic1))
    # Two GPUs of one switch need two NICs of that switch, not one.
    gpu1 = by_switch[s0]["gpu"][1]
    assert not fleet.aligned(spec.name, results(gpu0, gpu1, nic0, nic1))
    assert fleet.aligned(spec.name, results(gpu0, gpu1, *by_switch[s0]["nic"]))
