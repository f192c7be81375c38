"""How fast a rank computes while some, not all, ranks of its machine compute: ``Hardware.busy_compute_scale``.

The calibration's compute rates are measured with every rank of a machine busy at once, which is how ranks
run when each of them computes at the same moment (tensor parallelism, data-parallel replicas). A pipeline
that carries one request runs one stage at a time while the other stages wait in a receive: on a machine
with fewer cores than ranks, the busy ranks then get more of a core each. This measures that on the
machine's own ranks: for each count ``k`` of busy ranks, ranks ``0..k-1`` of the group run the same fixed
compute (a transformer-like MLP block, linear, SiLU, linear, repeated for tens of milliseconds, as long as a
small model's forward) from one moment, while the others wait at the next barrier; the wall time of the
slowest busy rank, median over repeats, over the same with every rank busy. The counts are interleaved
within each repeat, so a change of load on the machine during the measurement moves them alike.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["measure_busy_scale"]

_HIDDEN, _INTERMEDIATE, _TOKENS = 512, 1376, 32
_TARGET_S = 0.03  # one busy rank's compute per timed call, about a small model's forward


def _block_call(calls: int, weights: tuple[torch.Tensor, ...], x: torch.Tensor) -> None:
    up, down = weights
    with torch.no_grad():
        for _ in range(calls):
            torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, up)), down)


def measure_busy_scale(world_size: int, repeats: int, group: dist.ProcessGroup | None = None
                       ) -> tuple[tuple[int, float], ...]:
    """``(k, relative time)`` for ``k = 1..world_size`` busy ranks of ``group`` (None: the default group), each
    the slowest busy rank's wall time over that with all ``world_size`` ranks busy (module docstring). Call on
    every rank of the group, the ranks of one machine; ``()`` for a group of one."""
    if world_size < 2:
        return ()
    rank = dist.get_rank(group)
    generator = torch.Generator().manual_seed(0)
    weights = (torch.randn(_INTERMEDIATE, _HIDDEN, generator=generator),
               torch.randn(_HIDDEN, _INTERMEDIATE, generator=generator))
    x = torch.randn(_TOKENS, _HIDDEN, generator=generator)
    _block_call(2, weights, x)
    # the number of calls: rank 0's probe, run alone, so every count times the same work
    probe = torch.zeros(1, dtype=torch.float64)
    dist.barrier(group=group)
    if rank == 0:
        start = time.perf_counter()
        _block_call(4, weights, x)
        probe[0] = (time.perf_counter() - start) / 4
    dist.broadcast(probe, group=group, group_src=0)
    calls = max(1, round(_TARGET_S / max(float(probe.item()), 1e-6)))
    counts = list(range(1, world_size + 1))
    times: dict[int, list[float]] = {k: [] for k in counts}
    for repeat in range(max(3, repeats)):
        order = counts if repeat % 2 == 0 else counts[::-1]
        for k in order:
            dist.barrier(group=group)
            seconds = 0.0
            if rank < k:
                start = time.perf_counter()
                _block_call(calls, weights, x)
                seconds = time.perf_counter() - start
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            times[k].append(float(slowest.item()))
    medians = {k: statistics.median(values) for k, values in times.items()}
    return tuple((k, medians[k] / medians[world_size]) for k in counts)
