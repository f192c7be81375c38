"""What a compiled model's call costs beyond its rank-local graph's call, measured on a compiled model.

A :class:`~autotp.runtime.execution.module.TensorParallelModule` call flattens and checks its inputs, gathers this rank's
weights and buffers and builds its outputs around the call of its graph. Back to back that is a few microseconds;
after a wait (every timed call of the calibration and of a model that serves requests starts after one) its code
and data are cold, and on this project's 2-core VM the call of a small model measured 0.05-0.22 ms more than its
graph's. The calibration's own graphs are called bare, so the profile's fitted per-call term does not hold it:
:func:`measure_model_call_s` measures it on a small model compiled here, and the profile prices it once per call
(``Hardware.model_call_s``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from autotp.calibration.graphs import common_start, local_stand_ins, ranks_share_a_clock, work_clock
from autotp.driver import compile_group
from autotp.planning.options import plan_options
from autotp.runtime.execution.options import runtime_options

__all__ = ["MIN_RUNS", "measure_model_call_s"]

_VOCAB, _HIDDEN, _TOKENS = 256, 64, 16


class _SmallLM(torch.nn.Module):
    """A language model's outline at a size whose graph runs in a fraction of a millisecond: an embedding,
    a norm, an MLP block and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(_VOCAB, _HIDDEN)
        self.norm = torch.nn.LayerNorm(_HIDDEN)
        self.up = torch.nn.Linear(_HIDDEN, 4 * _HIDDEN)
        self.down = torch.nn.Linear(4 * _HIDDEN, _HIDDEN)
        self.head = torch.nn.Linear(_HIDDEN, _VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(x)


MIN_RUNS = 31
"""Runs :func:`measure_model_call_s` takes at least: its difference is small beside the spread of one call under
load, and a median over few runs can fall to 0."""


def measure_model_call_s(runs: int, warmup: int = 20, share_a_clock: bool | None = None) -> float:
    """Work seconds a compiled model's call adds to its graph's call: a small language model compiled over the
    current process group (its plan the default one, its collectives replaced by local stand-ins:
    :func:`~autotp.calibration.graphs.local_stand_ins`), and per run its call and its graph's call with the same
    inputs, each after an untimed call of itself and a common start of every rank
    (:func:`~autotp.calibration.graphs.common_start`, as every call of the calibration is timed); the median over
    ``runs`` of the difference of the two on the work clock, at least 0. Without a process group: 0.0
    (compiling needs one).

    Call it on every rank of the current process group at once. The difference is taken per run, not between
    two medians: it is a tenth of either call or less, and the load moves between runs. At least
    :data:`MIN_RUNS` runs: over 12, on a loaded 2-core CI machine, the median difference came out at 0 twice."""
    if not dist.is_initialized():
        return 0.0
    runs = max(runs, MIN_RUNS)
    if share_a_clock is None:
        share_a_clock = ranks_share_a_clock()
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same weights and inputs on every rank, as compile requires
        model = _SmallLM().eval()
        ids = torch.randint(0, _VOCAB, (1, _TOKENS))
    # what autotp.compile(model, example_inputs=(ids,)) does, from the runtime's side of the front door
    compiled = compile_group(model, example_inputs=(ids,), example_kwargs=None, world_size=None, group=None, plan=None,
                             checkpoint=None, max_cache_len=None, options=plan_options(), runtime=runtime_options(None))
    # its collectives replaced by local stand-ins (the graph's compute form): their waits would only add noise
    graph = compiled.graph_module = local_stand_ins(compiled.graph_module) or compiled.graph_module
    values = compiled.graph_inputs(ids)
    clock = work_clock()

    def work_after_start_s(call: Callable[[], object]) -> float:
        call()
        common_start(share_a_clock)
        start = clock()
        call()
        return clock() - start

    extras = []
    with torch.no_grad():
        for _ in range(warmup):
            compiled(ids), graph(*values)
        for _ in range(runs):
            extras.append(work_after_start_s(lambda: compiled(ids)) - work_after_start_s(lambda: graph(*values)))
    return max(0.0, statistics.median(extras))
