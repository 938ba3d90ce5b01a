"""Markdown tables of ``python -m bench.run``'s results (``bench/results.json``).

Kept apart from the runs so a reader of the figures finds each column's source in one place:
one function per part of the report (speed, quality, optimality and 16-GPU servers), each
reading only the keys its part of :mod:`bench.run` writes.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}, Python {platform.python_version()}, {platform.system()}"


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']}", ""]
    lines += _speed(results["speed"])
    for key, title in (
        ("quality", "built-in fleet"),
        ("quality_real", "fleet with two imported real servers (H200 10-NIC, A800 4-NIC asymmetric)"),
    ):
        lines += _quality(results[key], title=title, nodes=results["quality_nodes"])
    lines += _optimality(results["optimality"])
    lines += _big_nodes(results["big_nodes"])
    return "\n".join(lines)


def _speed(speed: list[dict[str, Any]]) -> list[str]:
    lines = ["### Speed (Tandem core)", ""]
    lines += [
        "| config | nodes | gc.freeze | target util | util | decisions | decisions/s | p50 µs | p99 µs "
        "| max µs | CPU: decisions/s | CPU p99 µs | refused | pinned (placed) | pinned p50 / p99 µs "
        "| groups | peak RSS MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in speed:
        for r in s["runs"]:
            pinned = f"{r['pinned']:,} ({r['pinned_placed']:,})" if r["pinned"] else "-"
            pinned_us = f"{r['pinned_p50_us']} / {r['pinned_p99_us']}" if r["pinned"] else "-"
            lines.append(
                f"| {s['config']} | {s['nodes']:,} | {'yes' if s['gc_freeze'] else 'no'} "
                f"| {r['target_util']:.0%} | {r['util']:.1%} | {r['decisions']:,} "
                f"| {r['decisions_per_s']:,} | {r['p50_us']} | {r['p99_us']} | {r['max_us']} "
                f"| {r['cpu_decisions_per_s']:,} | {r['cpu_p99_us']} "
                f"| {r['refused']:,} | {pinned} | {pinned_us} | {r['groups']} | {s['peak_rss_mb']} |"
            )
    lines += [
        "",
        "Build: "
        + "; ".join(
            f"{s['nodes']:,} nodes: fleet decode {s['fleet_decode_s']} s (RSS {s['rss_after_fleet_mb']} MB), "
            f"cluster build {s['build_s']} s"
            for s in speed
            if s["gc_freeze"] and s["config"] == "plain"
        ),
        "",
        "Index and cache sizes at the end of each 85 % run (`Cluster.cache_stats()`): "
        + "; ".join(
            f"{s['config']} {s['nodes']:,}: "
            + ", ".join(f"{k} {v:,}" for k, v in s["runs"][-1]["caches"].items() if k != "nodes")
            for s in speed
            if s["gc_freeze"]
        ),
        "",
    ]
    return lines


def _quality(rows: list[dict[str, Any]], *, title: str, nodes: int) -> list[str]:
    lines = [f"### Quality ({nodes:,} nodes, {title}; same churn and requests)", ""]
    lines += [
        "| allocator | target util | placed | refused | fragmentation refusals | pairs pcie-switch "
        "| pcie-root | numa | socket | node | all pairs on switch | required met "
        "| 8+8 nodes | 4+4 nodes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sh = r["pair_share_pct"]
        lines.append(
            f"| {r['allocator']} | {r['target_util']:.0%} | {r['placed']} | {r['refused']} "
            f"| {r['frag_refused']} ({r['frag_refused_pct']}%) | {sh['pcie-switch']}% "
            f"| {sh['pcie-root']}% | {sh['numa']}% | {sh['socket']}% | {sh['node']}% "
            f"| {r['all_switch_pct']}% | {r['required_met']}/{r['required']} "
            f"| {r['cap_8x8']} | {r['cap_4x4']} |"
        )
    lines.append("")
    return lines


def _optimality(o: dict[str, Any]) -> list[str]:
    return [
        "### Optimality (random small clusters vs exhaustive search)",
        "",
        f"{o['equal']}/{o['cases']} decisions equal to the exhaustive search ({o['equal_pct']}%): "
        f"{o['placed']} placements, {o['refused']} refusals.",
        "",
    ]


def _big_nodes(big: list[dict[str, Any]]) -> list[str]:
    lines = [
        "### 16-GPU servers (uncached decisions, one server, fresh index per decision)",
        "",
        "| server | decisions | placed | p50 µs | p99 µs | max µs | CPU p99 / max µs "
        "| costliest request (CPU p99 µs) | equal to the previous search |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for b in big:
        worst = max(b["cpu_p99_us_by_request"].items(), key=lambda kv: kv[1])
        lines.append(
            f"| {b['server']} | {b['samples']:,} | {b['placed']:,} | {b['p50_us']} | {b['p99_us']} "
            f"| {b['max_us']} | {b['cpu_p99_us']} / {b['cpu_max_us']} | {worst[0]} ({worst[1]}) "
            f"| {b['equal']}/{b['checked']} |"
        )
    return lines
