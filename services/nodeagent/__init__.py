"""The node agent: discovers devices, tracks health, applies assignments and cleans up.

Layers: ``backends`` discover devices (simulated from a topology file; NVML + sysfs on real
nodes) behind :class:`~services.nodeagent.backends.base.DiscoveryBackend`; ``health`` is the
pure health/cordon state machine; appliers hand devices to pods behind
:class:`~services.nodeagent.backends.base.Applier`; ``service`` wires them to NATS.
"""
