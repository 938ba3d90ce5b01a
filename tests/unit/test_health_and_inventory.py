"""Pure pieces of the node agent and inventory: health state machine, record updates."""

from __future__ import annotations

from schemas.messages import DeviceHealth, HealthEvent, NodeInventory, NodeRecord
from schemas.topology import NodeTopology, Socket
from services.inventory.service import apply_health, apply_inventory, set_status
from services.nodeagent.health import HealthTracker, recover_due

TOPO = NodeTopology(name="n1", sockets=[Socket(id=0)])


def test_failed_device_recovers_after_clean_period_only() -> None:
    h = HealthTracker(["gpu0", "gpu1"], clean_period=10)
    assert h.fail("gpu0", "XID 79", now=100) is not None
    assert h.state["gpu1"].healthy  # one failure never takes other devices out
    assert h.tick(now=105) == {}
    h.fail("gpu0", "XID 79", now=106)  # a repeated failure restarts the clean period
    assert h.tick(now=111) == {}
    changed = h.tick(now=116.5)
    assert list(changed) == ["gpu0"] and changed["gpu0"].healthy


async def test_recovery_probes_first_and_a_device_still_bad_stays_failed() -> None:
    h = HealthTracker(["gpu0", "gpu1", "mlx5_0"], clean_period=10)
    h.fail("gpu0", "GPU is lost", now=100)
    h.fail("gpu1", "XID 48", now=100)
    h.fail("mlx5_0", "port down", now=104)
    still_bad = {"gpu0": "GPU is lost", "mlx5_0": "port init"}
    probed: list[str] = []

    async def probe(device: str) -> str | None:
        probed.append(device)
        return still_bad.get(device)

    assert h.due(now=110) == ["gpu0", "gpu1"]
    changed = await recover_due(h, probe=probe, now=110)
    assert probed == ["gpu0", "gpu1"]  # only devices whose clean period is over are probed
    assert changed == {"gpu1": DeviceHealth(healthy=True, reason="clean for 10s", since=110)}
    assert h.state["gpu0"] == DeviceHealth(healthy=False, reason="GPU is lost", since=110)  # restarted
    # A probe with a different reason is news: published.
    changed = await recover_due(h, probe=probe, now=114)
    assert changed == {"mlx5_0": DeviceHealth(healthy=False, reason="port init", since=114)}
    still_bad.clear()
    assert await recover_due(h, probe=probe, now=119) == {}  # gpu0's new clean period runs to 120
    assert set(await recover_due(h, probe=probe, now=124)) == {"gpu0", "mlx5_0"}
    assert all(s.healthy for s in h.state.values())


def test_cordon_survives_recovery_and_only_uncordon_lifts_it() -> None:
    h = HealthTracker(["mlx5_0"], clean_period=1)
    h.cordon("mlx5_0", "maintenance", now=0)
    h.fail("mlx5_0", "link down", now=1)
    h.tick(now=5)
    assert h.state["mlx5_0"].healthy and h.state["mlx5_0"].cordoned
    h.uncordon("mlx5_0", now=6)
    assert h.state["mlx5_0"] == DeviceHealth(healthy=True, cordoned=False, reason="uncordoned", since=6)


def test_repeated_identical_event_reports_no_change() -> None:
    h = HealthTracker(["gpu0"])
    assert h.fail("gpu0", "XID 48", now=1) is not None
    assert h.fail("gpu0", "XID 48", now=2) is None
    assert h.recover("gpu0", now=3) is not None
    assert h.recover("gpu0", now=4) is None


def test_earlier_inventory_snapshot_never_rolls_a_node_back() -> None:
    new = apply_inventory(None, NodeInventory(node="n1", topology=TOPO, generation=2), seq=20, now=20)
    assert new is not None and new.generation == 2 and new.event_seq == 20
    assert apply_inventory(new, NodeInventory(node="n1", topology=TOPO, generation=1), seq=10, now=21) is None
    assert apply_inventory(new, NodeInventory(node="n1", topology=TOPO, generation=2), seq=20, now=21) is None


def test_snapshot_order_is_the_servers_not_the_senders_clock() -> None:
    """A snapshot dated a year ahead (a wrong clock, or a lie) does not make the snapshots
    that follow it "older": the stream sequence orders them."""
    year = 365 * 24 * 3600.0
    ahead = apply_inventory(
        None, NodeInventory(node="n1", topology=TOPO, generation=1, ts=1e9 + year), seq=5, now=1e9
    )
    assert ahead is not None
    honest = apply_inventory(
        ahead, NodeInventory(node="n1", topology=TOPO, generation=2, ts=1e9), seq=6, now=1e9
    )
    assert honest is not None and honest.generation == 2 and honest.updated_at == 1e9


def test_health_event_updates_one_device_and_ignores_earlier_ones() -> None:
    rec = NodeRecord(node="n1", topology=TOPO, health={"gpu0": DeviceHealth(since=5)}, event_seq=3)
    out = apply_health(
        rec, HealthEvent(node="n1", device="gpu0", healthy=False, reason="XID 79", ts=6), seq=4, now=6
    )
    assert out is not None and out.unavailable() == {"gpu0"} and out.event_seq == 4
    assert apply_health(out, HealthEvent(node="n1", device="gpu0", healthy=True, ts=9), seq=4, now=9) is None
    assert apply_health(out, HealthEvent(node="n1", device="gpu0", healthy=True, ts=9), seq=2, now=9) is None
    assert apply_health(None, HealthEvent(node="n1", device="gpu0", healthy=True, ts=7), seq=9, now=9) is None


def test_status_transitions_written_only_when_they_change() -> None:
    rec = NodeRecord(node="n1", topology=TOPO)
    lost = set_status(rec, "lost", now=1)
    assert lost is not None and lost.status == "lost"
    assert set_status(lost, "lost", now=2) is None
