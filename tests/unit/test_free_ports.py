"""services.runtime.process.embedded.free_ports: ports for processes started next, out of the way of
outgoing connections (below the kernel's ephemeral range), free, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from services.runtime.process import embedded


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low = embedded._ephemeral_low()
    ports = embedded.free_ports(50) + embedded.free_ports(50)
    assert len(set(ports)) == 100  # never twice, within a call or across calls
    assert all(10_000 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free: a child can bind it


def test_a_port_a_listener_holds_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Ten candidates from the held one on; two asked for, 100 times: never the held one.
        monkeypatch.setattr(embedded, "_LOWEST_PORT", taken)
        monkeypatch.setattr(embedded, "_ephemeral_low", lambda: taken + 10)
        for _ in range(100):
            embedded._HANDED_OUT.difference_update(range(taken, taken + 10))
            assert taken not in embedded.free_ports(2)
