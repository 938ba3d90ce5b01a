"""``tandem_nodeagent_devices``: one set of series per agent running in the process, none for an
agent that has not discovered its devices yet, gone once the agent stops (untracked)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from schemas.messages import DeviceHealth
from services.nodeagent.metrics import AgentDevices
from services.runtime.observe.metrics import device_states
from services.topology import load_topology


def _scrape(collector: AgentDevices) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_each_tracked_agent_has_its_series_until_untracked() -> None:
    topo = load_topology("dgx-h100")
    health = {"gpu3": DeviceHealth(healthy=False, reason="xid 79"), "gpu2": DeviceHealth(cordoned=True)}
    devices = AgentDevices()

    def counts() -> dict[tuple[str, str], int]:
        return device_states(topo, health, None)

    devices.track("a", counts)
    devices.track("b", lambda: None)  # not discovered yet
    text = _scrape(devices)
    assert 'tandem_nodeagent_devices{kind="gpu",node="a",state="unhealthy"} 1.0' in text
    assert 'tandem_nodeagent_devices{kind="gpu",node="a",state="cordoned"} 1.0' in text
    assert 'tandem_nodeagent_devices{kind="gpu",node="a",state="free"} 6.0' in text
    assert 'node="b"' not in text
    devices.untrack("a", lambda: None)  # another agent's: a's own stays
    assert 'node="a"' in _scrape(devices)
    devices.untrack("a", counts)
    assert 'node="a"' not in _scrape(devices)
