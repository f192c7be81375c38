"""``autotp.to_dot(plan)`` / ``autotp.to_svg(plan, path)``: the plan as a Graphviz drawing.

Modules are nested clusters (``subgraph cluster_...``), nodes are filled with the colour of
their output placement, edges coloured by the placement of the tensor they carry, and every
collective the rewrite inserts is a red hexagon with its bytes and predicted time. With
``fold=True`` a run of identical layers is drawn once (its first layer, labelled with the
count); ``max_depth`` draws modules deeper than that many name segments as one box each.
SVG needs Graphviz's ``dot`` program; the DOT text does not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import defaultdict

from autotp.adapters.torchao import part_label
from autotp.base.units import format_bytes, format_seconds
from autotp.passes.resharding import route_label
from autotp.planning.blocks import block_runs, node_module
from autotp.planning.decisions import NodeDecision
from autotp.planning.plan import Plan

__all__ = ["GraphvizNotFoundError", "placement_colours", "to_dot", "to_svg"]

_SPLIT = [("#1971c2", "#e7f0fb"), ("#2f9e44", "#e9f6ec"), ("#9c36b5", "#f5e9f8"), ("#c2255c", "#fbe8ef"),
          ("#0c8599", "#e3f5f7"), ("#5c940d", "#eef6e3")]


class GraphvizNotFoundError(RuntimeError):
    """Graphviz's ``dot`` program is not on ``PATH``."""


def placement_colours(placement: str) -> tuple[str, str]:
    """(line colour, fill colour) of a placement text: grey R, orange P, one hue per split dim."""
    if placement == "P":
        return "#e8590c", "#fff1e6"
    if placement.startswith("S("):
        dim = int(placement[2:placement.index(")")])
        return _SPLIT[abs(dim) % len(_SPLIT)]
    return "#8c959f", "#f3f4f6"


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _short_op(op: str) -> str:
    parts = op.split(".")
    return parts[1] if op.startswith("aten.") and len(parts) >= 2 else op


class _Drawing:
    """Collects node statements per cluster path, then writes nested clusters."""

    def __init__(self) -> None:
        self.statements: dict[str, list[str]] = defaultdict(list)
        self.labels: dict[str, str] = {}

    def add(self, cluster: str, statement: str) -> None:
        self.statements[cluster].append(statement)
        parts = cluster.split(".") if cluster else []
        for i in range(len(parts)):
            self.statements.setdefault(".".join(parts[:i]), [])

    def write(self, out: list[str]) -> None:
        children: dict[str, list[str]] = defaultdict(list)
        for path in sorted(self.statements):
            if path:
                parent = path.rsplit(".", 1)[0] if "." in path else ""
                children[parent].append(path)

        def emit(path: str, indent: str) -> None:
            for statement in self.statements.get(path, []):
                out.append(f"{indent}{statement}")
            for child in children.get(path, []):
                cid = "cluster_" + "".join(c if c.isalnum() else "_" for c in child)
                label = self.labels.get(child, child.rsplit(".", 1)[-1])
                out.append(f"{indent}subgraph {cid} {{")
                out.append(f'{indent}  label={_q(label)}; style="rounded,filled"; fillcolor="#f6f8fa"; color="#c3ccd5"; '
                           'fontname="Helvetica"; fontsize=11; labeljust="l";')
                emit(child, indent + "  ")
                out.append(f"{indent}}}")

        emit("", "  ")


def to_dot(plan: Plan, *, fold: bool = True, max_depth: int | None = None) -> str:
    """The DOT text (see module doc)."""
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0 (module name segments), got {max_depth}")
    by_name = {n.name: n for n in plan.nodes}
    # fold: every node of a repeated layer maps to the node at the same position in the run's first layer
    shown_as: dict[str, str] = {}
    run_of: dict[str, int] = {}
    drawing = _Drawing()
    for r, run in enumerate(block_runs(plan.nodes, plan.collectives, fold=fold)):
        for member in run.blocks:
            for node, first in zip(member.nodes, run.first.nodes):
                shown_as[node.name] = first.name
                run_of[node.name] = r
        if run.count > 1:
            drawing.labels[run.first.name] = (f"{run.first.name.rsplit('.', 1)[-1]}  (x{run.count} identical: "
                                              f"{run.label}; first shown)")

    def cluster_of(module: str) -> tuple[str, str | None]:
        """(cluster path, collapsed-box id or None) of a module under ``max_depth``."""
        parts = module.split(".") if module else []
        if max_depth is not None and len(parts) > max_depth:
            box = ".".join(parts[: max_depth + 1])
            return ".".join(parts[:max_depth]), "m_" + "".join(c if c.isalnum() else "_" for c in box)
        return module, None

    readers: dict[str, int] = defaultdict(int)
    for n in plan.nodes:
        for p in n.input_nodes:
            readers[p] += 1
    node_id: dict[str, str] = {}
    boxes: dict[str, list[NodeDecision]] = defaultdict(list)
    box_cluster: dict[str, str] = {}
    for n in plan.nodes:
        if shown_as.get(n.name, n.name) != n.name:
            continue
        if n.op == "placeholder" and not readers[n.name]:
            continue
        cluster, box = cluster_of(node_module(n))
        if box is not None:
            boxes[box].append(n)
            box_cluster[box] = cluster
            node_id[n.name] = box
            continue
        node_id[n.name] = "n_" + n.name
        line, fill = placement_colours(n.output)
        if n.op == "placeholder":
            quantized = part_label(n.target) if n.target else None  # a quantized weight's part: weight (scale)
            name = quantized.rsplit(".", 1)[-1] if quantized else n.target.rsplit(".", 1)[-1] if n.target else n.name
            shape = "x".join(str(d) for d in n.shape)
            label = f"{name}\n{shape}  {n.output}"
            drawing.add(cluster, f'{node_id[n.name]} [label={_q(label)}, shape=box, style="rounded,filled", '
                                 f'fillcolor="{fill}", color="{line}", penwidth=1.6];')
        else:
            strategy = f"({', '.join(n.inputs)}) -> {n.output}" if n.inputs else n.output
            label = f"{_short_op(n.op)}  [{n.name}]\n{strategy}" + (f"\n{format_seconds(n.compute_s)}" if n.compute_s else "")
            extra = ', fontcolor="#cf222e"' if n.fallback else ""
            drawing.add(cluster, f'{node_id[n.name]} [label={_q(label)}, shape=box, style="filled", fillcolor="{fill}", '
                                 f'color="{line}", penwidth=1.4{extra}];')
    for box, members in boxes.items():
        last = members[-1]
        line, fill = placement_colours(last.output)
        ops = sum(1 for m in members if m.op not in ("placeholder", "output"))
        module = node_module(members[0]).split(".")[: (max_depth or 0) + 1]
        label = f"{'.'.join(module)}\n{ops} ops -> {last.output}"
        drawing.add(box_cluster[box], f'{box} [label={_q(label)}, shape=box3d, style="filled", fillcolor="{fill}", '
                                      f'color="{line}"];')

    collective_for: dict[tuple[str, str, str], str] = {}
    for i, c in enumerate(plan.collectives):
        if shown_as.get(c.producer, c.producer) != c.producer or c.producer not in node_id:
            continue
        cid = f"c_{i}"
        kind = route_label(c.steps)
        label = f"{kind} {c.src}->{c.dst}\n{format_bytes(c.nbytes)}, {format_seconds(c.time_s)}"
        cluster, _ = cluster_of(c.module)
        drawing.add(cluster, f'{cid} [label={_q(label)}, shape=hexagon, style="filled", fillcolor="#fff5f5", '
                             'color="#c92a2a", fontcolor="#a61e1e", penwidth=1.6];')
        for consumer in c.consumers:
            collective_for[c.producer, c.dst, consumer] = cid
        drawing.add("", f'{node_id[c.producer]} -> {cid} [color="{placement_colours(c.src)[0]}", penwidth=2];')

    edges: dict[tuple[str, str], str] = {}
    for n in plan.nodes:
        if n.name not in node_id or shown_as.get(n.name, n.name) != n.name:
            continue
        for producer, placement in zip(n.input_nodes, n.inputs):
            shown = shown_as.get(producer, producer)
            if shown != producer and run_of.get(producer) == run_of.get(n.name):
                continue  # from the previous identical layer: drawn once as the run
            source = collective_for.get((producer, placement, n.name)) or node_id.get(shown)
            if source is None or source == node_id[n.name]:
                continue
            colour_of = placement if source.startswith("c_") else by_name[producer].output
            edges.setdefault((source, node_id[n.name]), colour_of)
    for (source, target), placement in edges.items():
        line, _ = placement_colours(placement)
        width = 1.0 if placement == "R" else 2.0
        drawing.add("", f'{source} -> {target} [color="{line}", penwidth={width}];')

    title = (f"autotp plan: tp={plan.world_size} on {plan.hardware}; predicted {format_seconds(plan.predicted_time_s)} "
             f"(compute {format_seconds(plan.predicted_compute_s)}, communication {format_seconds(plan.predicted_comm_s)}); "
             f"weights {format_bytes(plan.parameter_bytes_per_rank)} per rank")
    out = [
        "digraph autotp_plan {",
        (f'  graph [label={_q(title)}, labelloc="t", fontname="Helvetica", fontsize=12, rankdir=TB, nodesep=0.25, '
        'ranksep=0.35, compound=true];'),
        '  node [fontname="Helvetica", fontsize=10, margin="0.08,0.04"];',
        '  edge [arrowsize=0.6];',
    ]
    drawing.write(out)
    out.append("}")
    return "\n".join(out) + "\n"


def to_svg(plan: Plan, path: str | os.PathLike | None = None, *, fold: bool = True,
           max_depth: int | None = None, timeout_s: float = 120.0) -> str:
    """The SVG text of :func:`to_dot` rendered by ``dot -Tsvg``; also written to ``path`` when given."""
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizNotFoundError(
            "autotp.to_svg(plan) needs Graphviz's `dot` program, which is not on PATH. Install Graphviz "
            "(apt-get install graphviz / brew install graphviz / conda install graphviz), or use "
            "autotp.to_dot(plan) for the DOT text or autotp.to_html(plan, path) for a drawing that needs nothing "
            "installed."
        )
    proc = subprocess.run([dot, "-Tsvg"], input=to_dot(plan, fold=fold, max_depth=max_depth), capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"Graphviz dot failed (exit {proc.returncode}): {proc.stderr.strip()[:2000]}")
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(proc.stdout)
    return proc.stdout
