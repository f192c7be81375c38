"""Text of a :class:`~autotp.planning.mesh_plan.ParallelPlan`: the mesh chosen, its stages, and the
factorizations the search considered: the plan's own text form (``print(plan)``, ``candidates_table()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotp.planning.mesh_plan import ParallelPlan

__all__ = ["candidates_table", "parallel_plan_text"]

_GIB = 2**30


def _blocks_label(plan: ParallelPlan, first: int, stop: int) -> str:
    names = plan.layer_blocks
    if stop <= first:
        return "the whole model (no layer blocks)"
    if not names:
        return f"blocks {first}-{stop - 1}"
    if stop - first == 1:
        return names[first]
    return f"{names[first]}-{names[stop - 1].rsplit('.', 1)[-1]}"


def parallel_plan_text(plan: ParallelPlan) -> str:
    """What ``print(parallel_plan)`` shows."""
    p = plan.predicted
    lines = [f"ParallelPlan: {plan.mesh} = {plan.mesh.world_size} x {plan.hardware or '?'}, "
             f"objective {plan.objective}, {plan.microbatches} microbatch(es), schedule {plan.schedule}"]
    last = len(plan.stages) - 1
    for k, stage in enumerate(plan.stages):
        extra = [what for what, yes in (("+ modules before the first layer", k == 0),
                                        ("+ modules after the last layer", k == last)) if yes]
        lines.append(f"  stage {k}: {_blocks_label(plan, stage.first_block, stage.stop_block)} "
                     f"{' '.join(extra)}".rstrip()
                     + f"  ({stage.predicted_s * 1e3:.3f} ms per microbatch, "
                       f"{stage.memory_bytes_per_device / _GIB:.1f} GiB per device)")
    if plan.tp_summary:
        lines.append(f"  tensor-parallel plan of every layer over tp={plan.mesh.tp}: {plan.tp_summary}")
    if p:
        lines.append(f"  predicted: latency {p.get('latency_s', 0.0) * 1e3:.3f} ms at batch 1; "
                     f"throughput {p.get('throughput_per_s', 0.0):.2f} requests/s at batch "
                     f"{int(p.get('throughput_batch', 0))}; memory {p.get('memory_bytes_per_device', 0.0) / _GIB:.1f} "
                     f"GiB per device")
    return "\n".join(lines)


def _cell(row: dict[str, Any], key: str, scale: float, fmt: str) -> str:
    value = row.get(key)
    width = int(fmt.split(".")[0])
    return format(value * scale, fmt) if value is not None else "-".rjust(width)


def candidates_table(plan: ParallelPlan) -> str:
    """Every factorization considered: dp, pp, tp, microbatches, latency, throughput, memory; the
    chosen one marked ``*``, and why the runner-up lost."""
    header = (f"  {'dp':>3} {'pp':>3} {'tp':>3} {'micro':>5} {'latency ms':>11} {'throughput/s':>13} "
              f"{'GiB/device':>10}  note")
    memory_key = "latency_memory_bytes" if plan.objective == "latency" else "memory_bytes_per_device"
    lines = [f"factorizations of {plan.mesh.world_size} devices considered (objective {plan.objective}; throughput "
             f"at batch {int(plan.predicted.get('throughput_batch', 0))} with 'micro' microbatches per replica; "
             f"memory for the {plan.objective} run):", header]
    runner_up = None
    for row in plan.candidates:
        mesh = row["mesh"]
        mark = "*" if row.get("chosen") else " "
        note = row.get("note", "") or ("chosen" if row.get("chosen") else "runner-up" if row.get("runner_up") else "")
        if row.get("runner_up"):
            runner_up = row
        lines.append(f"{mark} {mesh.dp:>3} {mesh.pp:>3} {mesh.tp:>3} {row.get('microbatches', '-')!s:>5} "
                     f"{_cell(row, 'latency_s', 1e3, '11.3f')} {_cell(row, 'throughput_per_s', 1, '13.2f')} "
                     f"{_cell(row, memory_key, 1 / _GIB, '10.1f')}  {note}")
    if runner_up is not None:
        lines.append(f"runner-up {runner_up['mesh']} lost: {runner_up['why_lost']}")
    return "\n".join(lines)
