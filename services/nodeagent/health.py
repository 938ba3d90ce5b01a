"""Per-device health and cordon state, with recovery. Pure: the service feeds it events and
the clock, and publishes what it returns.

A device failed by an event stays out of service until it has been clean for
``clean_period`` seconds or an operator uncordons/recovers it; a cordon is an operator's
decision and only an uncordon lifts it. Each device is tracked on its own, so one failure never
takes the node's other devices out.

"Clean for the clean period" means no new failure was *reported*; a backend reports a lasting
condition (a GPU lost, a port down) once, not for ever. So a device whose clean period is over
is looked at again first (:func:`recover_due` with the backend's probe): it returns to service
only if nothing is wrong with it now, else it is failed again with what the probe found and its
clean period starts over.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from schemas.messages import DeviceHealth

# Looks at one device now: the reason it is still unusable, or None.
Probe = Callable[[str], Awaitable[str | None]]


class HealthTracker:
    def __init__(self, devices: list[str], *, clean_period: float = 60.0) -> None:
        self.clean_period = clean_period
        self.state: dict[str, DeviceHealth] = {d: DeviceHealth() for d in devices}

    def ensure(self, devices: list[str]) -> None:
        """Track newly discovered devices; forget removed ones."""
        for d in devices:
            self.state.setdefault(d, DeviceHealth())
        for d in set(self.state) - set(devices):
            del self.state[d]

    def _set(self, device: str, new: DeviceHealth) -> DeviceHealth | None:
        old = self.state.get(device)
        if old is None:
            raise KeyError(f"unknown device {device!r}")
        if (old.healthy, old.cordoned, old.reason) == (new.healthy, new.cordoned, new.reason):
            return None
        self.state[device] = new
        return new

    def fail(self, device: str, reason: str, *, now: float) -> DeviceHealth | None:
        """Mark unhealthy (``since`` restarts the clean period on every new failure)."""
        old = self.state[device]
        new = DeviceHealth(healthy=False, cordoned=old.cordoned, reason=reason, since=now)
        if not old.healthy:
            self.state[device] = new  # a repeated failure restarts the clean period
            return new if old.reason != reason else None
        return self._set(device, new)

    def recover(self, device: str, *, now: float, reason: str = "recovered") -> DeviceHealth | None:
        old = self.state[device]
        if old.healthy:
            return None
        return self._set(device, DeviceHealth(healthy=True, cordoned=old.cordoned, reason=reason, since=now))

    def cordon(self, device: str, reason: str, *, now: float) -> DeviceHealth | None:
        old = self.state[device]
        return self._set(device, DeviceHealth(healthy=old.healthy, cordoned=True, reason=reason, since=now))

    def uncordon(self, device: str, *, now: float) -> DeviceHealth | None:
        """Lift a cordon; an operator's uncordon also returns a failed device to service."""
        return self._set(device, DeviceHealth(healthy=True, cordoned=False, reason="uncordoned", since=now))

    def due(self, *, now: float) -> list[str]:
        """Failed devices whose clean period is over (to be probed, then recovered)."""
        return [d for d, h in self.state.items() if not h.healthy and now - h.since >= self.clean_period]

    def tick(self, *, now: float) -> dict[str, DeviceHealth]:
        """Recover devices that stayed clean for the clean period, unprobed; return what
        changed. The agent uses :func:`recover_due`, which probes first."""
        changed: dict[str, DeviceHealth] = {}
        for device in self.due(now=now):
            new = self.recover(device, now=now, reason=f"clean for {self.clean_period:g}s")
            if new is not None:
                changed[device] = new
        return changed


async def recover_due(tracker: HealthTracker, *, probe: Probe, now: float) -> dict[str, DeviceHealth]:
    """Probe each device whose clean period is over: recover it when the probe finds nothing
    wrong, else fail it again with the probe's reason (its clean period starts over). Returns
    the devices whose published state changed."""
    changed: dict[str, DeviceHealth] = {}
    for device in tracker.due(now=now):
        reason = await probe(device)
        if device not in tracker.state:  # forgotten by a rescan while probing
            continue
        if reason:
            new = tracker.fail(device, reason, now=now)
        else:
            new = tracker.recover(device, now=now, reason=f"clean for {tracker.clean_period:g}s")
        if new is not None:
            changed[device] = new
    return changed
