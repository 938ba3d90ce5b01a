"""``tandem plan`` job lines: whole jobs placed all-or-nothing, or as the baselines do it.

A ``{"kind":"job",...}`` line asks for ``pods`` identical pods (format in ``docs/plan.md``).
How a job is placed is the ``--jobs`` mode:

* ``gang`` (default, what Tandem does): :func:`services.allocator.core.gang.place_job` —
  every pod or none, in the finest fabric block that can take the job;
* ``gang-no-fabric``: the same all-or-nothing placement blind to the fabric (no tiers), the
  baseline of a gang scheduler that does not know the network;
* ``per-pod``: each pod decided alone with ``Cluster.decide`` and held at once, as pods are
  placed today; when a later pod cannot be placed, the earlier ones stay held (their pods
  wait for the rest of the job), and their GPUs count as *idle*: held by a job that cannot
  run.

The job's own line follows its pod lines (``id`` = ``JOB/INDEX``); a ``free`` of the job id
releases every pod held. The summary's ``jobs`` section counts jobs placed, partially placed
and refused, the fabric tier each placed job spans, pair alignment of the job pods, GPUs held
idle by partial placements (now, and at the peak), and the decision time per job.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from schemas.config import DeviceClass
from schemas.messages import JobRequest
from schemas.topology import SCOPES
from services.allocator.core import Cluster, InvalidRequest, Placement
from services.allocator.core.gang import JobPlacement, fabric_span, place_job
from services.request import RequestError, resolve
from tools.cli.errors import CliError

__all__ = ["JOB_KEYS", "JobBook", "JobMode"]

JobMode = Literal["gang", "gang-no-fabric", "per-pod"]
JOB_KEYS = {
    "kind",
    "id",
    "pods",
    "gpus",
    "rdma",
    "scope",
    "policy",
    "pairing",
    "device_class",
    "priority",
    "node_selector",
    "fabric",
    "fabric_policy",
    "nvlink_domain",
}


class JobBook:
    """The jobs of one replay: what each holds, and the counters of the summary."""

    def __init__(self, cluster: Cluster, *, tiers: Sequence[str], mode: JobMode) -> None:
        self.cluster = cluster
        self.tiers = tuple(tiers)
        self.mode = mode
        self.live: dict[str, list[tuple[str, str]]] = {}  # job id -> [(node, pod id)]
        self.idle: dict[str, int] = {}  # partially placed job -> GPUs it holds
        self.counts = {"placed": 0, "partial": 0, "unschedulable": 0, "freed": 0, "pods_placed": 0}
        self.tier = dict.fromkeys(("node", *self.tiers, "cluster"), 0)
        self.alignment = dict.fromkeys(SCOPES, 0)
        self.idle_peak = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the same, as this thread's CPU time
        self.seen = False
        self.waiting: dict[str, JobRequest] = {}  # per-pod jobs placed in part (see resume)

    def place(self, obj: dict[str, Any], where: str) -> list[dict[str, Any]]:
        """Decide one job line; hold what is placed; return the output lines."""
        self.seen = True
        jid = obj["id"]
        if jid in self.live:
            raise CliError(f"{where}: job {jid!r} is already placed (free it first)")
        job = _job(obj, where, classes=self.cluster.device_classes)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if self.mode == "per-pod":
                pods, reason = self._per_pod(job, [])
                res: JobPlacement | None = None
            else:
                if self.mode == "gang":
                    out = place_job(self.cluster, job, tiers=self.tiers)
                else:  # blind to the fabric: no tiers, and the job's tier is not asked
                    out = place_job(self.cluster, msgspec.structs.replace(job, fabric=None), tiers=())
                if isinstance(out, JobPlacement):
                    res, pods, reason = out, list(out.pods), ""
                    for node, pid, devs in out.holds(job):
                        self.cluster.hold(node, pid, devs)
                else:
                    res, pods, reason = None, [], out.reason
        except InvalidRequest as exc:
            raise CliError(f"{where}: {exc}") from None
        self.times.append(time.perf_counter() - t0)
        self.cpu_times.append(time.thread_time() - c0)
        lines = [_pod_line(job.pod_id(i), p) for i, p in enumerate(pods)]
        if pods:
            self.live[jid] = [(p.node, job.pod_id(i)) for i, p in enumerate(pods)]
        info, status = self._account(job, pods, [], res)
        lines.append(
            {
                "id": jid,
                "status": status,
                "node": None,
                "gpus": [],
                "nics": [],
                "pairs": [],
                "reason": reason,
                "job": info,
            }
        )
        return lines

    def _account(
        self, job: JobRequest, new: list[Placement], old: list[tuple[str, str]], res: JobPlacement | None
    ) -> tuple[dict[str, Any], str]:
        """Count a job's new pods and its status; ``old``: pods it already held (resume)."""
        for p in new:
            for pair in p.pairs:
                self.alignment[pair.scope] += 1
        nodes = list(dict.fromkeys([*(n for n, _ in old), *(p.node for p in new)]))
        placed = len(old) + len(new)
        info: dict[str, Any] = {"pods": job.pods, "placed": placed, "nodes": nodes}
        self.idle.pop(job.job_id, None)
        self.waiting.pop(job.job_id, None)
        if placed == job.pods:
            status = "assigned"
            self.counts["placed"] += 1
            self.counts["pods_placed"] += placed
            if res is not None and self.mode == "gang":
                level, tier, block = res.level, res.tier, res.block
            else:
                level, tier, block = fabric_span([self.cluster.labels(n) for n in nodes], self.tiers)
            self.tier[tier] += 1
            info.update(tier=tier, level=level, block=block)
        elif placed:
            status = "partial"
            if not old:
                self.counts["partial"] += 1
            self.waiting[job.job_id] = job
            self.idle[job.job_id] = placed * job.gpus
            self.idle_peak = max(self.idle_peak, sum(self.idle.values()))
        else:
            status = "unschedulable"
            self.counts["unschedulable"] += 1
        return info, status

    def resume(self, jid: str) -> str:
        """Place the missing pods of a job the ``per-pod`` mode placed in part (its pods wait
        and retry, holding what they have, as pods do today); returns the job's status. The
        benchmark's retry (``bench.gang``); a trace replay never retries."""
        job = self.waiting[jid]
        held = self.live[jid]
        t0, c0 = time.perf_counter(), time.thread_time()
        pods, _ = self._per_pod(job, held)
        self.times.append(time.perf_counter() - t0)
        self.cpu_times.append(time.thread_time() - c0)
        base = len(held)
        held.extend([(p.node, job.pod_id(base + i)) for i, p in enumerate(pods)])
        return self._account(job, pods, held[: len(held) - len(pods)], None)[1]

    def _per_pod(self, job: JobRequest, held: list[tuple[str, str]]) -> tuple[list[Placement], str]:
        """The baseline: each pod alone, held at once; stops at the first pod that waits."""
        template = job.template()
        pods: list[Placement] = []
        for i in range(len(held), job.pods):
            res = self.cluster.decide(template)
            if not isinstance(res, Placement):
                return pods, f"pod {i} of {job.pods} waits: {res.reason}"
            self.cluster.hold(res.node, job.pod_id(i), res.devices())
            pods.append(res)
        return pods, ""

    def free(self, jid: str) -> dict[str, Any] | None:
        """Release every pod of job ``jid``; None when ``jid`` is not a live job."""
        held = self.live.pop(jid, None)
        if held is None:
            return None
        for node, pid in held:
            self.cluster.release(node, pid)
        self.idle.pop(jid, None)
        self.waiting.pop(jid, None)
        self.counts["freed"] += 1
        nodes = list(dict.fromkeys(n for n, _ in held))
        return {
            "id": jid,
            "status": "freed",
            "node": None,
            "gpus": [],
            "nics": [],
            "pairs": [],
            "reason": "",
            "job": {"pods": len(held), "nodes": nodes},
        }

    def summary(self) -> dict[str, Any]:
        times = sorted(self.times)

        def pct(q: float) -> float | None:
            return round(times[min(len(times) - 1, int(q * len(times)))] * 1e3, 3) if times else None

        return {
            **self.counts,
            "mode": self.mode,
            "tier": self.tier,
            "alignment": self.alignment,
            "idle_gpus": sum(self.idle.values()),
            "idle_gpus_peak": self.idle_peak,
            "decision_ms": {"p50": pct(0.5), "p99": pct(0.99)},
        }


def _pod_line(rid: str, p: Placement) -> dict[str, Any]:
    return {
        "id": rid,
        "status": "assigned",
        "node": p.node,
        "gpus": [{"index": g.index, "uuid": g.uuid} for g in p.gpus],
        "nics": [{"name": n.name} for n in p.nics],
        "pairs": [{"gpu": x.gpu, "nic": x.nic, "scope": x.scope} for x in p.pairs],
        "reason": "",
    }


def _job(obj: dict[str, Any], where: str, *, classes: Mapping[str, DeviceClass]) -> JobRequest:
    extra = sorted(set(obj) - JOB_KEYS)
    if extra:
        raise CliError(
            f"{where}: unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(JOB_KEYS))}"
        )
    data = {k: v for k, v in obj.items() if k not in ("kind", "id")}
    data.update(job_id=obj["id"], namespace="plan", created_at=0.0)
    data.setdefault("pods", 1)
    data.setdefault("gpus", 0)
    try:
        job = msgspec.convert(data, JobRequest)
    except msgspec.ValidationError as exc:
        msg = str(exc).replace("`$.job_id`", "`$.id`")
        raise CliError(f"{where}: {msg}") from None
    # Each pod's ask resolved as an alloc line's is (services.request): the class's defaults
    # filled in, a rule broken named by the line and the field.
    try:
        r = resolve(job.template(), classes=classes)
    except RequestError as exc:
        raise CliError(f"{where}: job {job.job_id}: {exc}") from None
    return msgspec.structs.replace(job, scope=r.scope, policy=r.policy, pairing=r.pairing)
