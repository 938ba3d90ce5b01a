"""The device kinds, one plugin each (the interface: :mod:`.base`).

* :mod:`.whole` — whole GPUs and exclusive NICs (the main group index, the exact search);
* :mod:`.shares` — GPU shares (the share index, best-fit and fresh-GPU tiers);
* :mod:`.stack` — the stacking view of share requests (shares on already shared GPUs);
* :mod:`.mig` — existing MIG instances (an index of its own).

Adding a device kind: a plugin here implementing :class:`.base.DeviceKind` (it keeps an index
of its own and decides alone, like MIG) or :class:`.base.IndexedKind` (decided through a
group index by the framework's heaps), added to ``Cluster._alone`` or ``Cluster._indexed``
before the kinds whose requests it narrows; what it keeps of nodes and holds it keeps itself,
through the registry's hooks it overrides (:class:`.base.Hooks`), so nothing else of the
registry changes (docs/architecture.md, "Where to change what").
"""

from .base import Best, DeviceKind, IndexedKind
from .mig import MigInstances
from .shares import Shares
from .stack import Stacking
from .whole import WholeGpus

__all__ = ["Best", "DeviceKind", "IndexedKind", "MigInstances", "Shares", "Stacking", "WholeGpus"]
