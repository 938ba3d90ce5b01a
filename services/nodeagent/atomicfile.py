"""Files that readers outside the agent pick up (CDI specs): written whole or not at all.

A container runtime may read the CDI directory at any moment, so a spec is written to a hidden
file beside it, flushed to disk, and renamed over the old one (a rename is atomic within one
file system): a reader sees the old spec or the new one, never half of either.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (its directory made if missing). Blocking: call it from a
    thread when on the event loop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
