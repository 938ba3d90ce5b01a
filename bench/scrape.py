"""``python -m bench.scrape``: what one Prometheus scrape of the allocator costs its event loop.

The allocator's gauges (:class:`services.allocator.metrics.AllocatorState`) are computed at
scrape time on the allocator's own event loop, so a scrape is time no decision runs. This
builds the allocator's real read model and core with ``--nodes`` nodes of ``dgx-h100`` (one
GPU held on every tenth), registers the collector as ``python -m services.allocator`` does and
times the whole ``/metrics`` body (:func:`services.runtime.observe.metrics.exposition`, what
the ops server serves): the first scrape, a scrape with nothing changed, and a scrape after
``--changed`` nodes' allocation records changed (a hold added or released on each), the median
of ``--runs`` each. Decision work done by the read model itself when a record arrives is not
timed: only the scrape.

One JSON line per node count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from schemas.messages import AllocRecord, AssignedGpu, Assignment, NodeAllocations, NodeRecord, PodRef
from services.allocator.core import Cluster
from services.allocator.metrics import AllocatorState
from services.allocator.readmodel import ReadModel
from services.runtime.observe.metrics import exposition
from services.topology import load_topology


def _held(node: str, rid: str) -> NodeAllocations:
    assignment = Assignment(
        request_id=rid, pod=PodRef("bench", rid), node=node, gpus=[AssignedGpu(index=0, uuid=f"{node}-0")]
    )
    return NodeAllocations(node=node, allocations={rid: AllocRecord(assignment=assignment)})


def measure(nodes: int, *, changed: int, runs: int, node_metrics_max: int) -> dict[str, object]:
    topology = load_topology("dgx-h100")
    model = ReadModel(Cluster())
    allocs: dict[str, tuple[NodeAllocations | None, int]] = {}
    names = [f"node-{i:05d}" for i in range(nodes)]
    for name in names:
        model.on_node_record(name, NodeRecord(node=name, topology=topology))
    for i, name in enumerate(names[::10]):
        allocs[name] = (_held(name, f"r{i}"), 1)
        model.on_allocs(name, allocs[name][0], 1)
    view = SimpleNamespace(model=model, allocs=allocs, book=SimpleNamespace(pending={}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AllocatorState(view, node_metrics_max=node_metrics_max))  # type: ignore[arg-type]

    def scrape() -> tuple[float, int]:
        began = time.perf_counter()
        body = exposition(registry)
        return (time.perf_counter() - began) * 1000, len(body)

    first_ms, size = scrape()
    steady = [scrape()[0] for _ in range(runs)]
    after: list[float] = []
    for run in range(runs):
        for name in names[run % 7 :: max(1, nodes // changed)][:changed]:
            record = None if name in allocs and allocs[name][0] is not None else _held(name, f"c{run}-{name}")
            allocs[name] = (record, 1)
            model.on_allocs(name, record, 1)
        after.append(scrape()[0])
    return {
        "nodes": nodes,
        "node_metrics_max": node_metrics_max,
        "body_bytes": size,
        "first_ms": round(first_ms, 2),
        "unchanged_ms": round(statistics.median(steady), 3),
        "changed_nodes": changed,
        "changed_ms": round(statistics.median(after), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--changed", type=int, default=100, help="nodes changed between scrapes")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--node-metrics-max", type=int, default=1000)
    args = parser.parse_args()
    for n in args.nodes:
        figures = measure(n, changed=args.changed, runs=args.runs, node_metrics_max=args.node_metrics_max)
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
