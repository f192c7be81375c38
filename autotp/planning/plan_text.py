"""``print(plan)``: the plan's own text form, a compact per-layer report that fits a 100-column terminal.

It lives with the plan (planning never imports a report) and reads only the :class:`Plan`; the
reports of :mod:`autotp.inspect` share its :func:`format_seconds` and :func:`format_bytes`.

Layout::

    header       world size, hardware, predicted time (compute + communication), memory per rank
    blocks       one row per layer (identical consecutive layers folded: ``model.layers.1-79  x79``)
                 with its weights' placements, collectives, compute, communication and weight
                 bytes per rank -- each figure *per block*, the ``x`` column says how many
    weights      the placement of every weight of each distinct block, by relative name
    collectives  the collectives of each distinct block: kind, tensor, placements, bytes, time
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from autotp.adapters.torchao import weight_of
from autotp.passes.resharding import is_collective_step, route_label, step_label
from autotp.planning.blocks import Block, BlockRun, block_runs, parameter_bytes_per_rank, placement_counts

if TYPE_CHECKING:
    from autotp.planning.plan import CollectiveDecision, Plan

__all__ = ["WIDTH", "format_bytes", "format_seconds", "plan_summary"]

WIDTH = 100
"""Columns the report fits in."""


def format_seconds(seconds: float, *, signed: bool = False) -> str:
    """``1.234 ms`` / ``12.3 us`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    value = abs(seconds)
    if value >= 1.0:
        return f"{sign}{value:.3f} s"
    if value >= 1e-3:
        return f"{sign}{value * 1e3:.3f} ms"
    return f"{sign}{value * 1e6:.1f} us"


def format_bytes(nbytes: float, *, signed: bool = False) -> str:
    """``1.50 MiB`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if nbytes >= 0 else "-") if signed else ("-" if nbytes < 0 else "")
    value = abs(nbytes)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"


def _short_kinds(collectives: list[CollectiveDecision]) -> str:
    counts: Counter[str] = Counter()
    for c in collectives:
        for step in c.steps:
            if is_collective_step(step):
                counts[step_label(step, short=True)] += 1
    return " ".join(f"{k}*{n}" if n > 1 else k for k, n in sorted(counts.items())) or "-"


def _clip(text: str, width: int) -> str:
    """Shorten from the middle: ``model.lay…mlp.up_proj``."""
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2):]


def _time(seconds: float) -> str:
    return format_seconds(seconds) if seconds else "-"


def _block_row(plan: Plan, run: BlockRun) -> str:
    block = run.first
    weights = block.weights(plan)
    nbytes = sum(parameter_bytes_per_rank(w, plan.world_size) for w in weights)
    placements = placement_counts(weights) or "-"
    placements = placements if len(placements) <= 18 else placements[:17] + "…"
    return (f"{_clip(run.label, 28):<28} {run.count:>3}  {placements:<18} "
            f"{_clip(_short_kinds(block.collectives), 13):<13} {_time(block.compute_s):>10} {_time(block.comm_s):>10} "
            f"{format_bytes(nbytes) if weights else '-':>10}")


def _one_per_weight(items: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A quantized weight's parts (``x.parametrizations.weight.original<i>``) shown as the one weight
    ``x.weight`` with its data's placement and ``q`` (its scales split with it, see passes/quantized.py)."""
    shown: dict[str, str] = {}
    for name, placement in items:
        part = weight_of(name)
        if part is None:
            shown[name] = placement
        elif part[1] == 0:
            shown[part[0]] = f"{placement}q"
    return tuple(shown.items())


def _weights_lines(plan: Plan, runs: list[BlockRun]) -> list[str]:
    """Placement of each weight, once per distinct pattern of relative names and placements."""
    lines = []
    seen: dict[tuple, list[str]] = {}
    patterns: list[tuple[tuple, Block]] = []
    for run in runs:
        weights = run.first.weights(plan)
        if not weights:
            continue
        key = _one_per_weight(tuple((run.first.relative(w.target), w.output) for w in weights))
        if key not in seen:
            seen[key] = []
            patterns.append((key, run.first))
        seen[key].append(run.label)
    for key, _block in patterns:
        where = seen[key]
        title = ", ".join(where) if len(", ".join(where)) <= 60 else f"{where[0]} ... {where[-1]} ({len(where)} rows)"
        if len(key) == 1 and "." not in key[0][0] and len(where) == 1:
            lines.append(f"  {_clip(title + '.' + key[0][0], 80):<80} {key[0][1]}")
            continue
        lines.append(f"  {title}:")
        items = [f"{_clip(name, 36)} {placement}" for name, placement in key]
        width = max(len(i) for i in items) + 2
        per_line = max(1, (WIDTH - 4) // width)
        for i in range(0, len(items), per_line):
            lines.append("    " + "".join(f"{item:<{width}}" for item in items[i:i + per_line]).rstrip())
    return lines


def _collective_lines(runs: list[BlockRun], max_rows: int) -> list[str]:
    """Collectives of each distinct block, under the block's name; modules relative to the block."""
    rows = []
    for run in runs:
        if not run.first.collectives:
            continue
        rows.append(f"  {run.label}" + (f" (each of {run.count})" if run.count > 1 else "") + ":")
        for c in run.first.collectives:
            kinds = route_label([s for s in c.steps if is_collective_step(s)] or c.steps)
            rows.append(f"    {kinds:<16} {_clip(c.producer, 16):<16} {_clip(c.src + '->' + c.dst, 11):<11} "
                        f"{format_bytes(c.nbytes):>10} {format_seconds(c.time_s):>10}  "
                        f"{_clip(run.first.relative(c.module), 26)}")
    if len(rows) > max_rows:
        rows = [*rows[:max_rows], f"  ... {len(rows) - max_rows} more"]
    return rows


def _training_memory_line(plan: Plan) -> str:
    """Training memory per rank: weights, their gradients, optimizer state, saved activations."""
    parts = [plan.parameter_bytes_per_rank, plan.gradient_bytes_per_rank, plan.optimizer_bytes_per_rank,
             plan.activation_bytes_per_rank]
    checkpointed = " (blocks checkpointed: their inputs + one block's, recomputed)" if plan.activation_checkpointing else ""
    return (f"training memory per rank: {format_bytes(sum(parts))} = weights {format_bytes(parts[0])} + gradients "
            f"{format_bytes(parts[1])} + optimizer {format_bytes(parts[2])} + activations {format_bytes(parts[3])}"
            f"{checkpointed}")


def _training_backward_line(plan: Plan) -> str:
    counts = plan.collective_counts(backward=True)
    if not counts:
        return "collectives per backward: none"
    return ("collectives per backward: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
            + f" ({format_seconds(plan.predicted_backward_comm_s)})")


def _inference_difference_lines(plan: Plan, max_rows: int) -> list[str]:
    """How the training plan differs from the inference plan of the same model: one line per parameter."""
    versus = f"; the inference plan's forward: {format_seconds(plan.inference_time_s)}" if plan.inference_time_s else ""
    if not plan.inference_differences:
        return [f"same parameter placements as the inference plan{versus}"]
    lines = [f"differs from the inference plan in {len(plan.inference_differences)} parameter(s){versus}:"]
    for fqn, inference, training in plan.inference_differences[:max_rows]:
        lines.append(f"  {_clip(fqn, 60):<60} inference {inference:<7} training {training}")
    if len(plan.inference_differences) > max_rows:
        lines.append(f"  ... {len(plan.inference_differences) - max_rows} more")
    return lines


def plan_summary(plan: Plan, max_rows: int = 40) -> str:
    """The text report (see module doc); tables are cut after ``max_rows`` rows."""
    budget = f", budget {format_bytes(plan.memory_budget_bytes)}" if plan.memory_budget_bytes else ", no budget"
    share = plan.predicted_comm_s / plan.predicted_time_s if plan.predicted_time_s else 0.0
    counts = plan.collective_counts()
    solved = f", planned in {plan.plan_time_s:.1f} s" if plan.plan_time_s else ""
    kind = "training plan" if plan.training else "plan"
    what = "training step (forward + backward)" if plan.training else "forward"
    lines = [
        (f"autotp {kind}: tp={plan.world_size} on {plan.hardware} ({plan.runtime_mode}, format v{plan.version}, "
         f"graph {plan.fingerprint}{solved})"),
        (f"predicted {what}: {format_seconds(plan.predicted_time_s)} = compute {format_seconds(plan.predicted_compute_s)}"
        f" + communication {format_seconds(plan.predicted_comm_s)} ({share:.0%})"),
        (f"parameters per rank: {format_bytes(plan.parameter_bytes_per_rank)} of {format_bytes(plan.parameter_bytes_total)}"
        f" ({plan.parameter_bytes_per_rank / max(plan.parameter_bytes_total, 1):.1%}){budget}"),
        "collectives per forward: " + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"),
    ]
    if plan.training:
        lines[3:3] = [_training_memory_line(plan)]
        lines += [_training_backward_line(plan), *_inference_difference_lines(plan, max_rows)]
    if plan.fallback_ops:
        lines.append(_clip("ops without a sharding rule (run replicated): " + ", ".join(plan.fallback_ops), WIDTH))
    runs = [r for r in block_runs(plan) if r.first.nodes or r.first.collectives]
    lines += ["", (f"{'block':<28} {'x':>3}  {'weights':<18} {'collectives':<13} {'compute':>10} {'comm':>10} "
                  f"{'weights/rk':>10}")]
    shown = [r for r in runs if r.first.name or r.first.collectives or r.first.compute_s]
    lines += [_block_row(plan, run) for run in shown[:max_rows]]
    if len(shown) > max_rows:
        lines.append(f"... {len(shown) - max_rows} more blocks")
    lines.append("(figures per block; x: blocks alike; *n: n of them; AR all-reduce, AG all-gather, RS reduce-scatter)")
    weight_lines = _weights_lines(plan, runs)
    if weight_lines:
        lines += ["", "weight placements:", *weight_lines[: max_rows * 2]]
        if any(weight_of(fqn) for fqn in plan.parameters):
            lines.append("(q: quantized weight, its scales and zero points split with it; plan.parameters lists them)")
    collective_lines = _collective_lines(runs, max_rows)
    if collective_lines:
        lines += ["", f"    {'collective':<16} {'of tensor':<16} {'placement':<11} {'bytes':>10} {'time':>10}  in module",
                  *collective_lines]
    lines += ["", "autotp.explain(plan, name) says why; autotp.to_html(plan, path) draws it;",
              "autotp.diff(plan, other) compares."]
    return "\n".join(line.rstrip() for line in lines)
