"""A prepared claim as a CDI spec and the CDI device ids kubelet passes to the runtime; pure.

kubelet hands the container runtime the CDI device ids the plugin returns for each device of
a claim (a container gets those of the claim requests it names). What the ids resolve to:

* a GPU or MIG instance → ``nvidia.com/gpu=<uuid>`` (``MIG-<uuid>`` for an instance), the
  names ``nvidia-ctk cdi generate`` writes into the NVIDIA spec on the node (its device nodes
  and hooks), exactly as the device-plugin path answers ``Allocate``;
* an RDMA NIC or VF → ``tandem.io/claim=<claim uid>-<device>`` in the claim's own spec:
  its ``/dev/infiniband/uverbsN`` and ``/dev/infiniband/rdma_cm``;
* the claim's environment → ``tandem.io/claim=<claim uid>``, returned with the claim's first
  device only: ``NVIDIA_VISIBLE_DEVICES`` (the claim's GPUs, never ``all``), a share's limits
  (the device plugin's ``share_envs``) and ``TANDEM_RDMA_DEVICES``. CDI merges environment
  edits by name, the last one winning, so a variable is written once, not per device.

The spec is one file per claim, ``tandem.io-claim_<uid>.json`` (kind ``tandem.io/claim``), so
unprepare removes exactly one file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.nodeagent.deviceplugin.logic import NVIDIA_CDI_KIND, RDMA_CM, share_envs
from services.nodeagent.dra.prepare import Prepared, PrepareError

__all__ = ["CDI_VERSION", "CLAIM_KIND", "ClaimSpec", "claim_spec", "spec_file_name"]

CDI_VERSION = "0.6.0"
CLAIM_KIND = "tandem.io/claim"
Obj = dict[str, Any]


def spec_file_name(claim_uid: str) -> str:
    return f"tandem.io-claim_{claim_uid}.json"


class ClaimSpec:
    """The claim's CDI spec and, per prepared device in order, its CDI device ids."""

    def __init__(self, spec: Obj, ids: list[list[str]]) -> None:
        self.spec = spec
        self.ids = ids


def claim_spec(claim_uid: str, prepared: list[Prepared], *, uverbs: Mapping[str, list[str]]) -> ClaimSpec:
    """``uverbs``: each NIC's verbs device nodes (``SysfsReader.uverbs_of``); a NIC with none
    is refused, as the device plugin refuses it (the RDMA driver is not loaded)."""
    devices: list[Obj] = []
    ids: list[list[str]] = []
    uuids: list[str] = []
    nics: list[str] = []
    env: dict[str, str] = {}
    for p in prepared:
        if p.gpu is not None:
            uuid = p.gpu.mig.uuid if p.gpu.mig is not None else p.gpu.uuid
            uuids.append(uuid)
            ids.append([f"{NVIDIA_CDI_KIND}={uuid}"])
            continue
        name = p.device_id
        nodes = list(uverbs.get(name) or [])
        if not nodes:
            raise PrepareError(f"claim {claim_uid}: {name} has no uverbs device (is the RDMA driver loaded?)")
        nics.append(name)
        cdi_name = f"{claim_uid}-{p.result.device}"
        devices.append(
            {"name": cdi_name, "containerEdits": {"deviceNodes": [{"path": n} for n in [*nodes, RDMA_CM]]}}
        )
        ids.append([f"{CLAIM_KIND}={cdi_name}"])
    if uuids:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
        shares = {
            p.assignment.request_id: p.assignment for p in prepared if p.gpu is not None and p.gpu.shared
        }
        for share in shares.values():
            env.update(share_envs(share, uuids))
    if nics:
        env["TANDEM_RDMA_DEVICES"] = ",".join(nics)
    if env:
        devices.insert(
            0, {"name": claim_uid, "containerEdits": {"env": [f"{k}={v}" for k, v in env.items()]}}
        )
        ids[0].append(f"{CLAIM_KIND}={claim_uid}")
    spec = {"cdiVersion": CDI_VERSION, "kind": CLAIM_KIND, "devices": devices}
    return ClaimSpec(spec, ids)
