"""``tandem plan``: what-if placement, offline, with the real allocator core.

Builds a :class:`~services.allocator.core.Cluster` from topology files, replays a JSON-lines
file of ``alloc`` / ``free`` requests against it in order, and writes one JSON line per input
line (format in ``docs/plan.md``). Nothing is contacted: no NATS, no Kubernetes.

Inputs:

* ``--cluster FILE`` (YAML or JSON): a list of ``{topology, count, prefix, labels,
  unavailable}`` entries, or a mapping with such a list under ``nodes``. ``topology`` is a
  built-in name (``tandem topology list``), a topology file, or an ``nvidia-smi topo -m`` text
  file (``.txt``, imported on the fly); relative paths are relative to the cluster file.
* ``--nodes FILE...``: individual topology files (node name = the topology's ``name``).
* ``--requests FILE`` (``-`` for stdin): ``{"kind":"alloc","id":"p1","gpus":4,"rdma":4,...}``,
  ``{"kind":"job","id":"j1","pods":8,...}`` (a whole job, :mod:`tools.cli.plan_jobs`) or
  ``{"kind":"free","id":"p1"}`` per line; blank lines and ``#`` comments are skipped.
  Claims, reservations and the planner's clock (``claim`` / ``tick`` lines, ``"claim"`` on an
  ``alloc``) are :mod:`tools.cli.plan_claims`'s.

Every request line is resolved by the one request resolver (:mod:`services.request`) with the
replay's device classes (``--classes FILE``, else the built-in ones) before the core decides it,
as the webhook and the claim bridge resolve theirs: the class's defaults are filled in and a
line that breaks a rule stops the replay with the line and the field (:func:`resolved`).

An ``alloc`` that finds no room and may preempt (its ``preemption``, or its class's, is
``lower-priority``) evicts the allocations ``Cluster.preempt`` (:mod:`services.allocator.core.preempt`) names:
a ``preempted`` line for each, then the request's own line.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import msgspec
import yaml

from schemas.config import DeviceClass, default_device_classes
from schemas.messages import AllocationRequest, AssignedGpu
from schemas.topology import SCOPES, NodeTopology, NvlinkDomain
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable, preempt
from services.allocator.core.gang import DEFAULT_TIERS
from services.request import RequestError, resolve
from services.topology import TopologyFileError, import_nvidia_smi, load_topology
from tools.cli.errors import CliError
from tools.cli.plan_claims import ClaimBook
from tools.cli.plan_jobs import JobBook, JobMode

__all__ = ["resolved", "run", "run_plan"]

_ALLOC_KEYS = {
    "kind",
    "id",
    "gpus",
    "rdma",
    "scope",
    "policy",
    "pairing",
    "device_class",
    "priority",
    "node_selector",
    "preemption",
    "gpu_memory_mib",
    "gpu_cores_percent",
    "mig_profile",
}
_FREE_KEYS = {"kind", "id"}


def run(args: argparse.Namespace) -> int:
    classes = _load_classes(args.classes) if args.classes else default_device_classes()
    cluster = Cluster(node_policy=args.policy, device_classes=classes)
    if args.cluster is not None:
        _load_cluster_file(cluster, args.cluster)
    else:
        _load_node_files(cluster, args.nodes)
    if args.requests == "-":
        lines: IO[str] = sys.stdin
        name = "<stdin>"
        return _emit(cluster, lines, name, args)
    path = Path(args.requests)
    try:
        with path.open() as fh:
            return _emit(cluster, fh, str(path), args)
    except BrokenPipeError:
        raise  # the reader of our output left (`| head`): not the input file's fault
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _emit(cluster: Cluster, lines: IO[str], name: str, args: argparse.Namespace) -> int:
    if args.output is None:
        run_plan(cluster, lines, source=name, out=sys.stdout, summary=args.summary, **_job_args(args))
        return 0
    try:
        with args.output.open("w") as out:
            run_plan(cluster, lines, source=name, out=out, summary=args.summary, **_job_args(args))
    except OSError as exc:
        raise CliError(f"{args.output}: cannot write: {exc.strerror or exc}") from exc
    return 0


def _job_args(args: argparse.Namespace) -> dict[str, Any]:
    tiers = (
        tuple(t for t in (args.fabric_tiers or "").split(",") if t) if args.fabric_tiers is not None else None
    )
    return {"tiers": DEFAULT_TIERS if tiers is None else tiers, "jobs": args.jobs}


# ---------------------------------------------------------------------------------------------
# the replay


def run_plan(
    cluster: Cluster,
    lines: IO[str] | list[str],
    *,
    source: str,
    out: IO[str],
    summary: bool,
    tiers: tuple[str, ...] = DEFAULT_TIERS,
    jobs: JobMode = "gang",
) -> None:
    """Replay ``lines`` against ``cluster``, writing one JSON line per request line (a job
    line: one per pod, then the job's). ``tiers``: the fabric tiers, finest first; ``jobs``:
    how job lines are placed (see :mod:`tools.cli.plan_jobs`)."""
    enc = msgspec.json.Encoder()
    replay = _Replay(cluster, tiers=tiers, jobs=jobs)
    for lineno, obj in _records(lines, source):
        for line in replay.line(obj, where=f"{source}:{lineno}"):
            out.write(enc.encode(line).decode() + "\n")
    if summary:
        out.write(enc.encode(replay.summary()).decode() + "\n")


class _Replay:
    """One replay: what each ``alloc`` holds and where, who preempted whom, the counters of the
    summary, and the books of claims (:mod:`.plan_claims`) and jobs (:mod:`.plan_jobs`)."""

    def __init__(self, cluster: Cluster, *, tiers: tuple[str, ...], jobs: JobMode) -> None:
        self.cluster = cluster
        self.live: dict[str, str] = {}  # request id -> node
        self.preempted: dict[str, str] = {}  # victim id -> the request that preempted it
        self.counts = {"assigned": 0, "unschedulable": 0, "freed": 0, "preempted": 0}
        self.alignment = dict.fromkeys(SCOPES, 0)
        self.placement_scopes = dict.fromkeys(SCOPES, 0)
        self.busy = 0.0  # seconds spent deciding and holding (not parsing/printing)
        self.decisions = 0
        self.jobs = JobBook(cluster, tiers=tiers, mode=jobs)
        self.claims = ClaimBook(
            cluster,
            alloc_keys=_ALLOC_KEYS,
            make_request=self.request,
            make_line=_line,
            no_extra=_no_extra,
            is_live=self.live.__contains__,
            gpu_line=_gpu,
        )

    def request(self, obj: dict[str, Any], where: str) -> AllocationRequest:
        """The line's request, resolved with the replay's device classes (module docstring)."""
        return resolved(_request(obj, where), classes=self.cluster.device_classes, where=where)

    def line(self, obj: dict[str, Any], *, where: str) -> Iterator[dict[str, Any]]:
        """The output lines of one input line, in order."""
        if self.claims.wants(obj):
            yield from self.claims.handle(obj, where=where)
            return
        kind = obj.get("kind")
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise CliError(f"{where}: 'id' must be a non-empty string")
        if kind == "free":
            _no_extra(obj, _FREE_KEYS, where)
            freed = self.jobs.free(rid) if rid in self.jobs.live else None
            yield freed if freed is not None else self.free(rid)
        elif kind == "job":
            yield from self.jobs.place(obj, where)
        elif kind == "alloc":
            _no_extra(obj, _ALLOC_KEYS, where)
            if rid in self.live or self.claims.holds(rid) or rid in self.jobs.live:
                raise CliError(f"{where}: id {rid!r} is already allocated (free it first)")
            yield from self.alloc(rid, self.request(obj, where), where=where)
        else:
            raise CliError(
                f'{where}: \'kind\' must be "alloc", "job", "free", "claim" or "tick", got {kind!r}'
            )

    def free(self, rid: str) -> dict[str, Any]:
        node = self.live.pop(rid, None)
        if node is not None:
            self.cluster.release(node, rid)
        self.counts["freed"] += 1 if node is not None else 0
        why = f"was preempted by {self.preempted[rid]}" if rid in self.preempted else "was not allocated"
        return _line(rid, "freed", node=node, reason="" if node else why)

    def alloc(self, rid: str, req: AllocationRequest, *, where: str) -> Iterator[dict[str, Any]]:
        """Decide and hold; when it may preempt and nothing has room, a ``preempted`` line for
        each victim first (docs/plan.md)."""
        t0 = time.perf_counter()
        try:
            result = self.cluster.decide(req)
            plan = _preemption(self.cluster, result)
        except InvalidRequest as exc:
            raise CliError(f"{where}: {exc}") from None
        if plan is not None:
            yield from self._evict(plan, rid=rid, req=req)
            result = plan.placement
        if isinstance(result, Placement):
            self.cluster.hold(
                result.node,
                rid,
                result.devices(),
                priority=req.priority,
                preemptible=True,
                shares=result.shares(),
            )
            self.preempted.pop(rid, None)
        self.busy += time.perf_counter() - t0
        self.decisions += 1
        if not isinstance(result, Placement):
            self.counts["unschedulable"] += 1
            yield _line(rid, "unschedulable", reason=result.reason)
            return
        self.live[rid] = result.node
        self.counts["assigned"] += 1
        for pair in result.pairs:
            self.alignment[pair.scope] += 1
        self.placement_scopes[result.scope] += 1
        yield _line(
            rid,
            "assigned",
            node=result.node,
            gpus=[_gpu(g) for g in result.gpus],
            nics=[{"name": n.name} for n in result.nics],
            pairs=[{"gpu": p.gpu, "nic": p.nic, "scope": p.scope} for p in result.pairs],
        )

    def _evict(
        self, plan: preempt.Preemption, *, rid: str, req: AllocationRequest
    ) -> Iterator[dict[str, Any]]:
        """Release the plan's victims, a line each (before the preemptor's)."""
        topo = self.cluster.topology(plan.node)
        for victim in plan.victims:
            devs = set(victim.devices)
            self.cluster.release(plan.node, victim.request_id)
            self.live.pop(victim.request_id, None)
            self.preempted[victim.request_id] = rid
            self.counts["preempted"] += 1
            yield _line(
                victim.request_id,
                "preempted",
                node=plan.node,
                gpus=[{"index": g.index, "uuid": g.uuid} for g in topo.gpus() if g.id in devs],
                nics=[{"name": d} for d in victim.devices if not d.startswith("gpu")],
                reason=f"evicted for {rid} (priority {req.priority} > {victim.priority})",
                by=rid,
            )

    def summary(self) -> dict[str, Any]:
        totals = self.cluster.totals()
        doc: dict[str, Any] = {
            **self.counts,
            "nodes": len(self.cluster.nodes()),
            "gpus_used": totals["gpus"] - totals["free_gpus"],
            "gpus_total": totals["gpus"],
            "alignment": self.alignment,
            "placement_scope": self.placement_scopes,
            "decisions": self.decisions,
            "decisions_per_s": round(self.decisions / self.busy) if self.busy > 0 else None,
        }
        if any(self.claims.summary().values()):
            doc["claims"] = self.claims.summary()
        if self.jobs.seen:
            doc["jobs"] = self.jobs.summary()
        return {"summary": doc}


def resolved(req: AllocationRequest, *, classes: Mapping[str, DeviceClass], where: str) -> AllocationRequest:
    """``req`` with its device class's defaults filled in (scope, policy, pairing, preemption)
    by the one request resolver (:mod:`services.request`), or :class:`CliError` naming the line
    and the field as the line spells it (the wire's names)."""
    try:
        r = resolve(req, classes=classes)
    except RequestError as exc:
        raise CliError(f"{where}: {exc}") from None
    return msgspec.structs.replace(
        req, scope=r.scope, policy=r.policy, pairing=r.pairing, preemption=r.preemption
    )


def _preemption(cluster: Cluster, result: Placement | Unschedulable) -> preempt.Preemption | None:
    """The preemption plan for a request that may preempt and found no room (docs/plan.md):
    the core's step after the failed decision, on the request as that decision resolved it."""
    if isinstance(result, Placement):
        return None
    return cluster.preempt(result.spec)  # None: it may not preempt, or nothing helps


def _line(
    rid: str,
    status: str,
    *,
    node: str | None = None,
    gpus: list[dict[str, Any]] | None = None,
    nics: list[dict[str, Any]] | None = None,
    pairs: list[dict[str, Any]] | None = None,
    reason: str = "",
    by: str | None = None,
) -> dict[str, Any]:
    head: dict[str, Any] = {"id": rid, "status": status}
    if by is not None:
        head["by"] = by  # only on "preempted" lines: the request that evicted this one
    return {
        **head,
        "node": node,
        "gpus": gpus or [],
        "nics": nics or [],
        "pairs": pairs or [],
        "reason": reason,
    }


def _gpu(g: AssignedGpu) -> dict[str, Any]:
    """A GPU of an assigned line; a share also carries its ``memory_mib`` / ``cores_percent``,
    a MIG instance ``mig``: its profile, ``MIG-`` UUID and device id."""
    out: dict[str, Any] = {"index": g.index, "uuid": g.uuid}
    if g.shared:
        out["memory_mib"] = g.memory_mib or 0
        out["cores_percent"] = g.cores_percent or 0
    if g.mig is not None:
        out["mig"] = {"profile": g.mig.profile, "uuid": g.mig.uuid, "device": g.mig.device}
    return out


def _records(lines: IO[str] | list[str], source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    dec = msgspec.json.Decoder()
    numbered = enumerate(lines, 1)
    while True:
        try:
            lineno, raw = next(numbered)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise CliError(f"{source}: not UTF-8 text", hint="the requests file is JSON lines") from None
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = dec.decode(text)
        except msgspec.DecodeError as exc:
            raise CliError(f"{source}:{lineno}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise CliError(f"{source}:{lineno}: expected a JSON object")
        yield lineno, obj


def _no_extra(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise CliError(f"{where}: unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(allowed))}")


def _request(obj: dict[str, Any], where: str) -> AllocationRequest:
    rid = obj["id"]
    data = {
        "request_id": rid,
        "pod": {"namespace": "plan", "name": rid, "uid": rid},
        "gpus": obj.get("gpus", 0),
        "rdma": obj.get("rdma", 0),
        "created_at": 0.0,
    }
    for key in (
        "preemption",
        "scope",
        "policy",
        "pairing",
        "device_class",
        "priority",
        "node_selector",
        "gpu_memory_mib",
        "gpu_cores_percent",
        "mig_profile",
    ):
        if key in obj:
            data[key] = obj[key]
    try:
        return msgspec.convert(data, AllocationRequest)
    except msgspec.ValidationError as exc:
        msg = str(exc).replace("`$.request_id`", "`$.id`")
        raise CliError(f"{where}: {msg}") from None


# ---------------------------------------------------------------------------------------------
# cluster inputs


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    topology: str
    count: int = 1
    prefix: str | None = None
    labels: dict[str, str] = {}
    unavailable: list[str] = []
    # Every node of the entry in this multi-node NVLink domain (over the topology's own).
    nvlink_domain: NvlinkDomain | None = None


def _read_structured(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text", hint="give a YAML or JSON file") from None
    try:
        return yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not YAML/JSON: {exc}") from None


def load_topology_source(source: str, *, base: Path | None = None) -> NodeTopology:
    """A built-in name, a topology file, or an ``nvidia-smi topo -m`` ``.txt`` file."""
    path = Path(source)
    if base is not None and not path.is_absolute() and (base / path).exists():
        path = base / path
    try:
        if path.suffix.lower() == ".txt":
            try:
                text = path.read_text(errors="replace")
            except OSError as exc:
                raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from exc
            name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in path.stem).strip("-.")[:64]
            return import_nvidia_smi(text, name=name or "node", source=path).topology
        return load_topology(str(path) if path.exists() else source)
    except TopologyFileError as exc:
        raise CliError(str(exc)) from None


def _load_cluster_file(cluster: Cluster, path: Path) -> None:
    data = _read_structured(path)
    if isinstance(data, dict) and "nodes" in data:
        data = data["nodes"]
    try:
        entries = msgspec.convert(data, list[_Entry])
    except msgspec.ValidationError as exc:
        raise CliError(f"{path}: {exc} (expected a list of {{topology, count, prefix}})") from None
    if not entries:
        raise CliError(f"{path}: no entries")
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.count < 0:
            raise CliError(f"{path}: entry {i}: count must be >= 0")
        topo = load_topology_source(entry.topology, base=path.parent)
        if entry.nvlink_domain is not None:
            topo = msgspec.structs.replace(topo, nvlink_domain=entry.nvlink_domain)
        prefix = entry.prefix if entry.prefix is not None else f"{topo.name}-"
        width = len(str(max(entry.count - 1, 0)))
        for n in range(entry.count):
            name = f"{prefix}{n:0{width}d}"
            if name in seen:
                raise CliError(
                    f"{path}: entry {i}: node name {name!r} repeats; give entries distinct prefixes"
                )
            seen.add(name)
            cluster.set_node(name, topo, labels=entry.labels, unavailable=entry.unavailable)


def _load_node_files(cluster: Cluster, paths: list[Path]) -> None:
    seen: dict[str, int] = {}
    for path in paths:
        topo = load_topology_source(str(path))
        name = topo.name
        if name in seen:
            seen[name] += 1
            name = f"{name}-{seen[topo.name]}"
        else:
            seen[name] = 0
        cluster.set_node(name, topo)


def _load_classes(path: Path) -> dict[str, DeviceClass]:
    data = _read_structured(path)
    try:
        classes = msgspec.convert(data, dict[str, DeviceClass])
    except msgspec.ValidationError as exc:
        raise CliError(f"{path}: {exc}") from None
    return classes
