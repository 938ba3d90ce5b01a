"""A node's topology as a picture for reports and tickets: Graphviz DOT, or SVG drawn here.

Both draw :func:`.render.tree_of` — sockets, NUMA nodes, PCIe roots and switches, and the
devices under them — with each device coloured by its state when ``states`` is given (device id
→ text such as ``free``, ``used by team/trainer``, ``unhealthy (XID 79)``, ``cordoned``; the
colour is taken from the text's first word). DOT is for users who have Graphviz (``dot -Tpng``);
the SVG needs nothing: a tidy top-down tree (leaves left to right, each parent centred over its
children), one box per element. Pure: tree in, text out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from xml.sax.saxutils import escape

from schemas.topology import NodeTopology
from services.topology.render import TreeNode, summary, tree_of

__all__ = ["render_as", "render_dot", "render_svg"]

# Fill colours by state (first word of the state text); structure boxes are grey.
COLOURS = {"free": "#d8f0d2", "used": "#cfe0fb", "unhealthy": "#f8cccc", "cordoned": "#fde3bd"}
STRUCTURE = "#eeeeee"
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN, CHAR_W = 230, 46, 14, 34, 16, 6.2


def _colour(state: str | None) -> str:
    if state is None:
        return STRUCTURE
    word = state.split()[0].rstrip(",") if state.strip() else "free"
    if "unhealthy" in state:
        word = "unhealthy"
    elif "cordoned" in state and word == "free":
        word = "cordoned"
    return COLOURS.get(word, "#ffffff")


def _state(item: TreeNode, states: Mapping[str, str] | None) -> str | None:
    if not item.device:
        return None
    return states.get(item.device, "free") if states is not None else ""


def render_dot(topo: NodeTopology, *, states: Mapping[str, str] | None = None) -> str:
    lines = [
        f"digraph {_dot_id(topo.name)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        f'  label="{_dot_escape(topo.name + ": " + summary(topo))}"; labelloc=t;',
    ]
    counter = iter(range(1_000_000))

    def walk(item: TreeNode, parent: str | None) -> None:
        name = f"n{next(counter)}"
        state = _state(item, states)
        label = item.label if not state else f"{item.label}\\n{state}"
        lines.append(f'  {name} [label="{_dot_escape(label)}", fillcolor="{_colour(state)}"];')
        if parent is not None:
            lines.append(f"  {parent} -> {name};")
        for child in item.children:
            walk(child, name)

    for top in tree_of(topo):
        walk(top, None)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_id(name: str) -> str:
    return '"' + _dot_escape(name) + '"'


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class _Placed:
    item: TreeNode
    x: float
    y: float
    state: str | None


def _layout(
    roots: list[TreeNode], states: Mapping[str, str] | None
) -> tuple[list[_Placed], list[tuple[int, int]]]:
    """Boxes (top-left corners) and edges (parent index, child index) of a tidy tree."""
    placed: list[_Placed] = []
    edges: list[tuple[int, int]] = []
    next_leaf_x = [float(MARGIN)]

    def place(item: TreeNode, depth: int) -> int:
        index = len(placed)
        placed.append(_Placed(item, 0.0, MARGIN + 30 + depth * (BOX_H + GAP_Y), _state(item, states)))
        kids = [place(child, depth + 1) for child in item.children]
        for k in kids:
            edges.append((index, k))
        if kids:
            placed[index].x = (placed[kids[0]].x + placed[kids[-1]].x) / 2
        else:
            placed[index].x = next_leaf_x[0]
            next_leaf_x[0] += BOX_W + GAP_X
        return index

    for root in roots:
        place(root, 0)
    return placed, edges


def _fit(text: str) -> str:
    limit = int((BOX_W - 12) / CHAR_W)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_svg(topo: NodeTopology, *, states: Mapping[str, str] | None = None) -> str:
    placed, edges = _layout(tree_of(topo), states)
    width = max((p.x for p in placed), default=0) + BOX_W + MARGIN
    height = max((p.y for p in placed), default=0) + BOX_H + MARGIN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f"<title>{escape(topo.name)}</title>",
        f'<text x="{MARGIN}" y="{MARGIN + 12}" font-size="13" font-weight="bold">'
        f"{escape(topo.name + ': ' + summary(topo))}</text>",
    ]
    for parent, child in edges:
        a, b = placed[parent], placed[child]
        out.append(
            f'<line x1="{a.x + BOX_W / 2:.1f}" y1="{a.y + BOX_H:.1f}" x2="{b.x + BOX_W / 2:.1f}" '
            f'y2="{b.y:.1f}" stroke="#888"/>'
        )
    for p in placed:
        head, _, rest = p.item.label.partition("  ")
        second = p.state if p.state else rest
        out.append(
            f'<g class="{"device" if p.item.device else "group"}"'
            + (f' data-device="{escape(p.item.device)}"' if p.item.device else "")
            + ">"
        )
        out.append(
            f'<rect x="{p.x:.1f}" y="{p.y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="6" '
            f'fill="{_colour(p.state)}" stroke="#666"/>'
        )
        out.append(
            f'<text x="{p.x + 6:.1f}" y="{p.y + 17:.1f}" font-weight="bold">{escape(_fit(head))}</text>'
        )
        if second:
            out.append(f'<text x="{p.x + 6:.1f}" y="{p.y + 35:.1f}">{escape(_fit(second))}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_as(topo: NodeTopology, fmt: str, *, states: Mapping[str, str] | None = None) -> str:
    """``topo`` as ``fmt`` (tree, json, yaml, dot, svg); ``states``: each device's state now
    (``tandem topology show``, with ``--live`` the states)."""
    from services.topology.files import dump_topology
    from services.topology.render import render_tree

    if fmt == "tree":
        return render_tree(topo, states=states)
    if fmt == "dot":
        return render_dot(topo, states=states)
    if fmt == "svg":
        return render_svg(topo, states=states)
    return dump_topology(topo, fmt="json" if fmt == "json" else "yaml")
