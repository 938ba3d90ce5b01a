"""Property tests of whole-job placement (core.gang) against an exhaustive search.

Random small clusters (bench.randtopo: random trees, holds, unavailable devices) get random
fabric labels (two tiers, some nodes unlabelled) and random NVLink domains; random jobs (1-4
pods, random per-pod template, fabric tier and policy, NVLink domain policy) are placed and
held one after another. What must hold: a job is placed whole or not at all; no device is
handed out twice or while unavailable; a required scope and a required fabric tier are
honoured; and the chosen placement reaches the optimum of an exhaustive search over every
distribution of the pods across nodes: (NVLink domain, fabric level spanned, alignment sum).
Each node's pods are placed in sequence by the in-node search (what "exact" means in
core.gang); that search has its own exhaustive property tests.
"""

from __future__ import annotations

import itertools
import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import exhaustive
from bench.randtopo import CLASSES, random_cluster
from schemas.messages import JobRequest
from schemas.topology import NvlinkDomain
from services.allocator.core import Cluster
from services.allocator.core.gang import JobPlacement, JobUnschedulable, fabric_label, place_job
from services.allocator.core.search import Choice

from .test_core_properties import check_placement

SETTINGS = settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TIERS = ("leaf", "spine")


def labelled_cluster(seed: int, n_nodes: int) -> tuple[Cluster, dict[str, object], dict[str, set[str]]]:
    cluster, topos, blocked = random_cluster(seed, n_nodes)
    rng = random.Random(seed ^ 0x5EED)
    for name in cluster.nodes():
        labels = cluster.labels(name)
        spine = rng.choice("ab")
        if rng.random() < 0.85:
            labels[fabric_label("leaf")] = f"{spine}{rng.randrange(2)}"
        if rng.random() < 0.9:
            labels[fabric_label("spine")] = spine
        topo = cluster.topology(name)
        if rng.random() < 0.6:
            topo = msgspec.structs.replace(
                topo, nvlink_domain=NvlinkDomain(cluster_uuid="u", clique_id=rng.randrange(2))
            )
        cluster.set_node(name, topo, labels=labels, unavailable=cluster.unavailable_devices(name))
    return cluster, topos, blocked  # type: ignore[return-value]


def random_job(rng: random.Random, jid: str) -> JobRequest:
    # Small pods, so that jobs often need several nodes (what the fabric order is about).
    g = rng.choice((0, 1, 1, 1, 2, 2, 3))
    r = g if g and rng.random() < 0.5 else rng.randint(0 if g else 1, 2)
    return JobRequest(
        job_id=jid,
        pods=rng.choice((1, 2, 2, 3, 3, 4, 4, 5)),
        gpus=g,
        rdma=r,
        scope=rng.choice((None, "pcie-switch", "pcie-root", "numa", "node")),
        policy=rng.choice((None, "required", "preferred")),
        device_class=rng.choice(("default", "default", "default", *CLASSES)),
        node_selector=rng.choice(({}, {}, {}, {"pool": "a"})),
        fabric=rng.choice((None, "leaf", "spine")),
        fabric_policy=rng.choice(("required", "preferred")),
        nvlink_domain=rng.choice((None, None, "required", "preferred")),
    )


def chains(cluster: Cluster, job: JobRequest) -> dict[str, list[Choice]]:
    """Each node's pods in sequence, as core.gang defines them (selector applied)."""
    spec = cluster.normalise(job.template())
    out: dict[str, list[Choice]] = {}
    for name, labels, _topo, shape, mask in cluster.job_nodes():
        if not all(labels.get(k) == v for k, v in job.node_selector.items()):
            continue
        seq: list[Choice] = []
        free = mask
        while len(seq) < job.pods:
            res = cluster.evaluate_free(spec, shape, free)
            if not isinstance(res, Choice):
                break
            seq.append(res)
            taken = sum(1 << s for s in (*res.gpus, *res.nics))
            free = shape.effective_free(((1 << shape.n_slots) - 1) & ~(free & ~taken))
        out[name] = seq
    return out


def level_of(cluster: Cluster, used: list[str]) -> int:
    if len(used) == 1:
        return 0
    for i, tier in enumerate(TIERS, start=1):
        values = {cluster.labels(n).get(fabric_label(tier)) for n in used}
        if len(values) == 1 and None not in values:
            return i
    return len(TIERS) + 1


def reference(cluster: Cluster, job: JobRequest) -> tuple[int, int, tuple[int, ...]] | None:
    """(outside one NVLink domain, level, alignment sum) over every distribution of the pods."""
    per = chains(cluster, job)
    names = [n for n, seq in per.items() if seq]
    cap = len(TIERS) + 1
    if job.fabric is not None and job.fabric_policy == "required":
        cap = TIERS.index(job.fabric) + 1
    best: tuple[int, int, tuple[int, ...]] | None = None
    for counts in itertools.product(*(range(len(per[n]) + 1) for n in names)):
        if sum(counts) != job.pods:
            continue
        used = [n for n, k in zip(names, counts, strict=True) if k]
        level = level_of(cluster, used)
        if level > cap:
            continue
        domains = {cluster.topology(n).nvlink_domain for n in used}
        one_domain = len(domains) == 1 and None not in domains
        if job.nvlink_domain == "required" and not one_domain:
            continue
        outside = 0 if one_domain or job.nvlink_domain is None else 1
        items = [c.key for n, k in zip(names, counts, strict=True) for c in per[n][:k]]
        align = tuple(sum(col) for col in zip(*items, strict=True))
        key = (outside, level, align)
        if best is None or key < best:
            best = key
    return best


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), jseed=st.integers(0, 2**32 - 1), n_nodes=st.integers(1, 5))
def test_jobs_whole_or_nothing_and_exhaustive_optimum(seed: int, jseed: int, n_nodes: int) -> None:
    cluster, topos, blocked = labelled_cluster(seed, n_nodes)
    rng = random.Random(jseed)
    for k in range(3):
        job = random_job(rng, f"j{k}")
        spec = cluster.normalise(job.template())
        ref = reference(cluster, job)
        got = place_job(cluster, job, tiers=TIERS)
        if ref is None:
            assert isinstance(got, JobUnschedulable), (
                f"placed {got} where the exhaustive search found nothing"
            )
            assert got.reason.startswith(f"{job.pods} pod")
            continue
        assert isinstance(got, JobPlacement), f"refused ({got.reason}) where {ref} exists"
        assert len(got.pods) == job.pods
        outside = 0 if got.nvlink_domain is not None or job.nvlink_domain is None else 1
        assert (outside, got.level, got.alignment) == ref
        assert got.level == level_of(cluster, got.nodes())
        if job.fabric is not None and job.fabric_policy == "required":
            assert got.level <= TIERS.index(job.fabric) + 1
        if job.nvlink_domain == "required":
            assert len({cluster.topology(n).nvlink_domain for n in got.nodes()}) == 1
        seen: set[tuple[str, str]] = set()
        for p in got.pods:
            req = msgspec.structs.replace(job.template(), request_id=f"{job.job_id}-x")
            check_placement(p, cluster, topos, blocked, req)  # type: ignore[arg-type]
            for d in p.devices():
                assert (p.node, d) not in seen, f"{d} on {p.node} handed to two pods of one job"
                seen.add((p.node, d))
            assert len(p.gpus) == spec.gpus and len(p.nics) == spec.rdma
        for node, pid, devs in got.holds(job):
            cluster.hold(node, pid, devs)
            blocked[node] |= set(devs)
        for node in got.nodes():
            assert exhaustive.effective_free(topos[node], blocked[node]) >= set(cluster.free_devices(node))
