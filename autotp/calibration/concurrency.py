"""How fast a rank computes while some, not all, ranks near it compute: ``Hardware.busy_compute_scale`` and
``Hardware.idle_neighbours_scale``.

The calibration's compute rates are measured with every rank of a machine busy at once, which is how ranks
run when each of them computes at the same moment (tensor parallelism, data-parallel replicas). A pipeline
that carries one request runs one stage at a time while the other stages wait in a receive: on a machine
with fewer cores than ranks, the busy ranks then get more of a core each; and where several machines (each a
set of cores) share one memory domain (the cache and memory of one kernel: the hosts of a cluster built on
one machine), a machine computes faster while its neighbours are idle. Both are measured on the ranks
themselves: in a *pattern* some ranks of a group run the same fixed compute (a transformer-like MLP block,
linear, SiLU, linear, repeated for tens of milliseconds, as long as a small model's forward) from one moment,
while the others wait at the next barrier; each busy rank's wall time, median over repeats. The patterns are
interleaved within each repeat, so a change of load on the machine during the measurement moves them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["measure_busy_scale", "measure_idle_neighbours_scale"]

_HIDDEN, _INTERMEDIATE, _TOKENS = 512, 1376, 32
_TARGET_S = 0.03  # one busy rank's compute per timed call, about a small model's forward


def _block_call(calls: int, weights: tuple[torch.Tensor, ...], x: torch.Tensor) -> None:
    up, down = weights
    with torch.no_grad():
        for _ in range(calls):
            torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, up)), down)


def _timed_patterns(patterns: Sequence[frozenset[int]], repeats: int, group: dist.ProcessGroup | None
                    ) -> list[list[list[float]]]:
    """For each pattern (the ranks of ``group`` busy in it), each repeat's wall seconds of every rank of the group
    (0.0 for the waiting ranks), the same on every rank: ``[pattern][repeat][rank]``. Call on every rank."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(0)
    weights = (torch.randn(_INTERMEDIATE, _HIDDEN, generator=generator),
               torch.randn(_HIDDEN, _INTERMEDIATE, generator=generator))
    x = torch.randn(_TOKENS, _HIDDEN, generator=generator)
    _block_call(2, weights, x)
    # the number of calls: rank 0's probe, run alone, so every pattern times the same work
    probe = torch.zeros(1, dtype=torch.float64)
    dist.barrier(group=group)
    if rank == 0:
        start = time.perf_counter()
        _block_call(4, weights, x)
        probe[0] = (time.perf_counter() - start) / 4
    dist.broadcast(probe, group=group, group_src=0)
    calls = max(1, round(_TARGET_S / max(float(probe.item()), 1e-6)))
    times: list[list[list[float]]] = [[] for _ in patterns]
    indices = list(range(len(patterns)))
    for repeat in range(max(3, repeats)):
        for index in indices if repeat % 2 == 0 else indices[::-1]:
            dist.barrier(group=group)
            seconds = torch.zeros(size, dtype=torch.float64)
            if rank in patterns[index]:
                start = time.perf_counter()
                _block_call(calls, weights, x)
                seconds[rank] = time.perf_counter() - start
            dist.all_reduce(seconds, group=group)  # every rank's time, each written by its own rank
            times[index].append(seconds.tolist())
    return times


def _slowest_median(times: list[list[float]], ranks: Sequence[int]) -> float:
    """The median over repeats of the slowest of ``ranks`` in each."""
    return statistics.median(max(row[r] for r in ranks) for row in times)


def measure_busy_scale(world_size: int, repeats: int, group: dist.ProcessGroup | None = None
                       ) -> tuple[tuple[int, float], ...]:
    """``(k, relative time)`` for ``k = 1..world_size`` busy ranks of ``group`` (None: the default group), ranks
    ``0..k-1``, each the slowest busy rank's wall time over that with all ``world_size`` ranks busy (module
    docstring). Call on every rank of the group, the ranks of one machine; ``()`` for a group of one."""
    if world_size < 2:
        return ()
    counts = list(range(1, world_size + 1))
    times = _timed_patterns([frozenset(range(k)) for k in counts], repeats, group)
    medians = [_slowest_median(rows, range(k)) for k, rows in zip(counts, times)]
    return tuple((k, median / medians[-1]) for k, median in zip(counts, medians))


def measure_idle_neighbours_scale(machines: Sequence[Sequence[int]], repeats: int,
                                  group: dist.ProcessGroup | None = None) -> tuple[tuple[int, float], ...]:
    """``(k, relative time)`` for ``k = 1..`` the ranks of the smallest machine: the first ``k`` ranks of one
    machine busy while the other machines of the memory domain are idle, over the same ``k`` busy on every
    machine at once (each machine's slowest busy rank; the mean over the machines, each measured alone in
    turn). ``machines``: the ranks of ``group`` (the whole memory domain) of each machine. Call on every rank of
    the group; ``()`` for a domain of one machine."""
    if len(machines) < 2:
        return ()
    counts = list(range(1, min(len(ranks) for ranks in machines) + 1))
    patterns: list[frozenset[int]] = []
    for k in counts:
        patterns.append(frozenset(r for ranks in machines for r in ranks[:k]))  # every machine at once
        patterns.extend(frozenset(ranks[:k]) for ranks in machines)  # each machine alone
    times = _timed_patterns(patterns, repeats, group)
    scale = []
    stride = 1 + len(machines)
    for index, k in enumerate(counts):
        every = times[index * stride]
        alone = times[index * stride + 1:(index + 1) * stride]
        ratios = [_slowest_median(rows, ranks[:k]) / _slowest_median(every, ranks[:k])
                  for rows, ranks in zip(alone, machines)]
        scale.append((k, statistics.fmean(ratios)))
    return tuple(scale)
