"""``autotp demo --mesh dp2,pp2,tp2``: the demo over a data x pipeline x tensor parallel mesh.

Spawns one local gloo process per mesh position (the product of the sizes), builds the demo's small
Llama in each, runs ``autotp.compile_mesh(model, init_device_mesh("cpu", sizes, mesh_dim_names=
names), ...)`` (stages cut evenly, each stage's tensor-parallel plan solved on its tp group), and
checks the whole batch's logits on every rank against the single-process model. Prints the mesh,
each stage's layers, microbatches and schedule, and every rank's coordinate and parameter bytes.
Exit codes as ``autotp demo``: 1 if the logits differ by more than the tolerance, 2 if a rank failed.

Importing this module imports no torch (``--mesh`` is checked when the command line is parsed).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["mesh_spec", "run_mesh_demo"]

_DIMS = ("dp", "pp", "tp")


def mesh_spec(text: str) -> tuple[tuple[str, int], ...]:
    """``--mesh``: comma-separated ``NAMEsize`` items from dp/pp/tp, e.g. ``dp2,pp2,tp2`` or ``pp2,tp2``."""
    dims: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        name, size = item[:2], item[2:]
        if name not in _DIMS or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh item {item!r} is not a dim name from {', '.join(_DIMS)} followed by a size >= 1; "
                "e.g. --mesh dp2,pp2,tp2")
        if name in dict(dims):
            raise argparse.ArgumentTypeError(f"--mesh names {name} twice in {text!r}; give each dim once")
        dims.append((name, int(size)))
    return tuple(dims)


def _mesh_rank(rank: int, world_size: int, init_method: str, dims: tuple[tuple[str, int], ...], layers: int,
               seq_len: int, seed: int, hardware: str, results: Any) -> None:
    """One rank of the mesh demo (the target of ``torch.multiprocessing.spawn``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.cli.demo_ranks import DEMO_BATCH, DEMO_VOCAB, build_demo_llama, joined_group, say

    with joined_group(rank, world_size, init_method):
        sizes = dict(dims)
        batch = DEMO_BATCH * sizes.get("dp", 1)  # DEMO_BATCH rows per data-parallel replica
        say(rank, f"process group up: gloo, {world_size} ranks; mesh {', '.join(f'{n}={s}' for n, s in dims)}")
        model = build_demo_llama(layers, seq_len, seed)
        ids = torch.randint(0, DEMO_VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            reference = model(ids, use_cache=False).logits  # (batch, seq, vocab), single process
        mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        say(rank, f"compiling with autotp.compile_mesh(model, mesh, hardware={hardware!r}) on a batch of {batch}...")
        part = autotp.compile_mesh(model, mesh, example_inputs=(ids,), example_kwargs={"use_cache": False},
                                   options=autotp.PlanOptions(hardware=hardware))
        with torch.no_grad():
            logits = part(ids, use_cache=False).logits
        diff = torch.tensor([(logits - reference).abs().max().item()], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        rows: list[Any] = [None] * world_size
        dist.all_gather_object(rows, (dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or ())),
                                      part.parameter_bytes()))
        if rank == 0:
            plan = part.plan
            lines = ["", f"mesh {plan.mesh}: {plan.mesh.pp} stage(s), {plan.microbatches} microbatch(es), "
                         f"schedule {plan.schedule}"]
            for index, stage in enumerate(plan.stages):
                where = f" (begins at {stage.begins_at})" if stage.begins_at else ""
                lines.append(f"  stage {index}: layer blocks [{stage.first_block}, {stage.stop_block}){where}")
            original = sum(p.numel() * p.element_size() for p in model.parameters())
            for r, (coordinate, nbytes) in enumerate(rows):
                place = ", ".join(f"{n}={c}" for n, c in coordinate.items())
                lines.append(f"  rank {r} ({place}): {nbytes / 2**20:.2f} MiB of parameters "
                             f"({nbytes / original:.1%} of the original)")
            lines.append(f"max abs diff of the whole batch's logits vs single process: {diff.item():.3e}")
            print("\n".join(lines), flush=True)
            results.put(float(diff.item()))


def run_mesh_demo(dims: tuple[tuple[str, int], ...], *, layers: int, seq_len: int, seed: int, hardware: str,
                  tolerance: float, init_method: str) -> int:
    """Spawn one process per mesh position, wait, return the exit code."""
    from autotp.cli.demo_ranks import spawn_ranks

    world_size = math.prod(size for _, size in dims)
    print(f"spawning {world_size} gloo processes for the mesh {','.join(f'{n}{s}' for n, s in dims)}...", flush=True)
    code, diff = spawn_ranks(_mesh_rank, (world_size, init_method, dims, layers, seq_len, seed, hardware),
                             world_size, "autotp demo --mesh")
    if code:
        return code
    verdict = "OK" if diff <= tolerance else "FAILED"
    print(f"tolerance {tolerance:.0e}: {verdict}", flush=True)
    return 0 if diff <= tolerance else 1
