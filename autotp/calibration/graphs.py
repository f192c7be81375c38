"""Measuring on this machine what the cost model fits: single ops timed on the work clock, and
rank-local graphs run on every rank of a process group at once.

The samples go to the fits of :mod:`autotp.cost_model.graph_calibration` (the host and collective
terms, the GEMM curve) and :mod:`autotp.cost_model.calibrate` (the profile); the formulas and the
fits import nothing of this module, which runs graphs on process groups (the shared-memory
all-reduce and the inference pass of :mod:`autotp.runtime.collectives.shared_memory`) and so sits above the stages.

- single ops: :func:`work_clock`, :func:`median_work_s`, :func:`measure_gemm_samples`,
  :func:`measure_op_fixed_s`, :func:`measure_element_rates`, :func:`measure_first_call_s`, and the copy bandwidth
  by working set (:func:`measure_copy_curve`, :func:`measure_cold_call_s`; the curve is priced by
  :mod:`autotp.cost_model.bandwidth`);
- calls on every rank: :func:`ranks_share_a_clock`, :func:`common_start`, :func:`group_call_s`;
- graphs: :func:`block_graph` (the op mixes of :data:`~autotp.cost_model.graph_calibration.GRAPH_FAMILIES`),
  :func:`local_stand_ins` (a graph's compute form), :func:`time_in_turn`, :func:`graph_samples`,
  :func:`measure_graphs`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autotp.cost_model.bandwidth import at_working_set
from autotp.cost_model.compute import (
    aten_flops,
    aten_memory_bytes,
    compute_time_s,
    first_call_key,
    fixed_costs,
    gemm_dims,
    launches_no_kernel,
    op_family,
    op_name,
    rated_elements,
)
from autotp.cost_model.graph_calibration import (
    COLD_WEIGHT_BYTES,
    GemmSample,
    GraphSample,
    GraphShape,
    device_only,
)
from autotp.cost_model.hardware import Hardware
from autotp.passes.small_collectives import inference_collective_kind
from autotp.runtime.collectives.hosts import host_identity, local_host
from autotp.runtime.collectives.inference_collectives import inference_all_reduces

__all__ = [
    "COLD_SLOT_BYTES",
    "COMMON_START_LEAD_S",
    "block_graph",
    "common_start",
    "fair_core_share",
    "graph_sample",
    "graph_samples",
    "group_call_s",
    "local_stand_ins",
    "measure_cold_call_s",
    "measure_copy_curve",
    "measure_element_rates",
    "measure_first_call_s",
    "measure_gemm_samples",
    "measure_graphs",
    "measure_op_fixed_s",
    "median_work_s",
    "ranks_share_a_clock",
    "roofline_of_call_s",
    "split_attention_cost",
    "time_in_turn",
    "work_clock",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ------------------------------------------------------------------------------ single ops

def work_clock() -> Callable[[], float]:
    """The clock that times this process's own work: the calling thread's CPU time when torch runs
    one thread (a rank descheduled by other processes then loses no time: the op's cost, not the
    machine's load, is measured; :func:`graph_sample` measures the share of a core a rank gets
    separately), else the wall clock (CPU time of one thread would miss torch's other threads)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def median_work_s(run: Callable[[], Any], min_time_s: float, repeats: int) -> float:
    """Median seconds of work per call of ``run`` (:func:`work_clock`), each timed repeat looping
    for at least ``min_time_s``.

    In a process group of more than one rank it times in step: call it on every rank at once. The ranks agree
    on one number of calls per repeat (the most any rank needs) and start every repeat at one moment
    (:func:`common_start`), so that each rank times the op while the others run it too, as a plan's ranks run
    their kernels. Why: timed on its own, a rank may run part of its loop beside an idle core, and the cores
    share the memory behind them: on this project's 2-core VM a copy over 32 MiB took 1.5-1.9x as long with both
    cores copying as with one (over 8 MiB 1.0-1.2x, a linear 1.0x; ``benchmarks/core_contention.py``)."""
    clock = work_clock()
    run()
    start = clock()
    run()
    calls = max(1, math.ceil(min_time_s / max(clock() - start, 1e-9)))
    in_step = dist.is_initialized() and dist.get_world_size() > 1
    if in_step:
        agreed = torch.tensor([calls], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        calls = int(agreed)
        share_a_clock = ranks_share_a_clock()
    samples = []
    for _ in range(repeats):
        if in_step:
            common_start(share_a_clock)
        start = clock()
        for _ in range(calls):
            run()
        samples.append((clock() - start) / calls)
    return statistics.median(samples)


def _linear_on_next(x: torch.Tensor, weights: Iterator[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    return aten.linear.default(x, next(weights), bias)


def measure_gemm_samples(width: int, tokens: Sequence[int], min_time_s: float, repeats: int) -> list[GemmSample]:
    """``aten.linear`` of ``(m, width) @ (width, width)^T + bias`` for each ``m`` in ``tokens``
    (float32), each call on the next of enough distinct weights that none is in cache
    (:data:`COLD_WEIGHT_BYTES`)."""
    generator = torch.Generator().manual_seed(0)
    copies = max(1, COLD_WEIGHT_BYTES // (width * width * 4))
    weights = torch.full((copies, width, width), 1.0 / width).unbind(0)  # values do not change a GEMM's time
    bias = torch.randn(width, generator=generator)
    samples = []
    for m in tokens:
        x = torch.randn(m, width, generator=generator)
        seconds = median_work_s(functools.partial(_linear_on_next, x, itertools.cycle(weights), bias), min_time_s,
                                repeats)
        samples.append(GemmSample(m, width, width, seconds))
    return samples


_TRANSCENDENTAL = (aten.exp.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.gelu.default)
"""The ops whose median rate is ``Hardware.transcendental_element_s`` (an op without a rate of its own)."""

_RATED_TRANSCENDENTAL = (*_TRANSCENDENTAL, aten.erf.default, aten.log.default, aten.sin.default, aten.cos.default,
                         aten.rsqrt.default, aten.sqrt.default)
"""The ops ``autotp calibrate`` times one by one (``Hardware.op_element_s``)."""


def roofline_of_call_s(op: Any, args: Sequence[Any], kwargs: dict[str, Any], result: torch.Tensor,
                       hardware: Hardware) -> float:
    """The roofline seconds ``hardware`` prices one call of ``op`` at (its FLOPs, bytes, GEMM shape and
    rated elements; no op family's fixed cost), from its real arguments and result."""
    flops = aten_flops(op, args, kwargs, result)
    dims = gemm_dims(op, args, kwargs) if flops else None
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    elements = rated_elements(op, args, kwargs, result.numel(), first.numel() if first is not None else None)
    return compute_time_s(flops, aten_memory_bytes(op, args, kwargs, result), result.dtype, hardware,
                          gemm_min_dim=min(dims) if dims else None, rated_elements=elements,
                          rated_op=op_name(op))


def _op_family_instances() -> dict[str, tuple[Any, tuple]]:
    """One small call per :data:`~autotp.cost_model.hardware.OP_FAMILIES` entry, as an exported graph calls it:
    ``(op, args)`` (attention: one block of queries of one head, with the boolean mask a Hugging Face graph
    passes)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 8, 8, 8, generator=generator)
    ones, zeros = torch.ones(8), torch.zeros(8)
    return {
        "convolution": (aten.conv2d.default, (images, torch.randn(8, 8, 3, 3, generator=generator), None, [1, 1],
                                              [1, 1], [1, 1], 1)),
        "pooling": (aten.max_pool2d.default, (images, [2, 2], [2, 2])),
        "batch_norm": (aten.batch_norm.default, (images, ones, zeros, zeros, ones, False, 0.1, 1e-5, True)),
        "attention": _attention_instance(1),
    }


ATTENTION_BLOCKS_TIMED = 16
"""Heads of the attention instance :func:`measure_op_fixed_s` times beside the one-head one: one block of queries
each, so that the cost per block stands apart from the cost per call."""


def _attention_instance(heads: int, value_size: int = 16) -> tuple[Any, tuple]:
    """``scaled_dot_product_attention`` of four queries of 16 per head over four keys, with a causal boolean mask:
    one block of queries per head in PyTorch's CPU flash kernel, or its math kernel where the values' head size
    differs from the queries' (as DeepSeek's latent attention's does; :func:`~autotp.cost_model.compute.attention_runs_math`).
    Not keys of one head under queries of several: torch 2.13 runs those in the math kernel, 2.14 in the flash one."""
    generator = torch.Generator().manual_seed(3)
    query, key = (torch.randn(1, heads, 4, 16, generator=generator) for _ in range(2))
    value = torch.randn(1, heads, 4, value_size, generator=generator)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    return aten.scaled_dot_product_attention.default, (query, key, value, mask)


def _first_call_instances() -> dict[str, list[tuple[Any, tuple]]]:
    """Per :data:`~autotp.cost_model.hardware.FIRST_CALL_KINDS` entry, the small calls
    :func:`measure_first_call_s` times: for ``"kernel"`` ops of no family that transformer graphs run, for each
    family its instance of :func:`_op_family_instances`."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 16, 128, generator=generator)
    weight = torch.randn(128, 128, generator=generator)
    ones, zeros = torch.ones(128), torch.zeros(128)
    table = torch.randn(1000, 128, generator=generator)
    ids = torch.randint(0, 1000, (2, 16), generator=generator)
    kernels = [(aten.add.Tensor, (hidden, hidden)), (aten.mul.Tensor, (hidden, hidden)), (aten.relu.default, (hidden,)),
               (aten.gelu.default, (hidden,)), (aten.silu.default, (hidden,)), (aten.mean.dim, (hidden, [-1], True)),
               (aten.layer_norm.default, (hidden, [128], ones, zeros, 1e-5)), (aten.linear.default, (hidden, weight)),
               (aten.embedding.default, (table, ids)), (aten._softmax.default, (hidden, -1, False)),
               (aten.cat.default, ([hidden, hidden], -1)), (aten.clone.default, (hidden.transpose(1, 2),))]
    return {"kernel": kernels, **{family: [call] for family, call in _op_family_instances().items()}}


def measure_first_call_s(runs: int, share_a_clock: bool | None = None) -> tuple[tuple[str, float], ...]:
    """``(kind, seconds)`` per :data:`~autotp.cost_model.hardware.FIRST_CALL_KINDS` entry: what a call of a
    kernel costs, in work seconds, right after a common start of every rank (:func:`common_start`, as
    :func:`time_in_turn` starts every timed call) beyond a call of it back to back; the median over ``runs`` of
    each, for ``"kernel"`` the median over its ops (:func:`_first_call_instances`), at least 0. Before the
    timed call a tiny copy of one element runs, so that what is timed is the kernel's own first call, not the
    first op's dispatch after the wait (which the graph's call pays once, ``Hardware.graph_launch_s``).

    Call it on every rank of the current process group at once (or without one). Why: a graph's call finds
    the code and state of every kernel cold after its ranks met and waited, and the first call of each kernel
    pays for it (on this project's 2-core VM a CNN's first oneDNN convolution 59 us, each other kernel's first
    call 3-27 us, later calls 0-7); priced as a fitted cost per call, small graphs came out 20-50% low."""
    clock = work_clock()
    if share_a_clock is None:
        share_a_clock = ranks_share_a_clock()
    primer = torch.zeros(1)
    measured = []
    with torch.no_grad():
        for kind, calls in _first_call_instances().items():
            extras = []
            for op, args in calls:
                cold, warm = [], []
                for _ in range(runs):
                    op(*args)
                    start = clock()
                    op(*args)
                    warm.append(clock() - start)
                    common_start(share_a_clock)
                    primer.clone()
                    start = clock()
                    op(*args)
                    cold.append(clock() - start)
                extras.append(statistics.median(cold) - statistics.median(warm))
            measured.append((kind, max(0.0, statistics.median(extras))))
    return tuple(measured)


def measure_op_fixed_s(hardware: Hardware, min_time_s: float, repeats: int) -> tuple[tuple[str, float], ...]:
    """``(name, seconds)`` per :data:`~autotp.cost_model.hardware.OP_FIXED_COSTS` entry: what a small call costs
    in a tight loop (:func:`median_work_s`) beyond its roofline on ``hardware``, less what an add of its first
    input costs beyond its own (a plain kernel's fixed cost, which the fitted dispatch prices); at least 0.
    A family's instance (:func:`_op_family_instances`) prices the family; attention is timed at one block of
    queries and at :data:`ATTENTION_BLOCKS_TIMED` (one per head): the difference per block is ``"attention"``,
    the rest of the one-block call ``"attention_call"``; a call with one head of keys for four of queries, which
    PyTorch runs in its math kernel, is ``"attention_math"``.

    Why: some library kernels set up a primitive or a plan on every call, whatever their size; on this project's
    2-core VM a convolution of 8 channels on 8 x 8 took 41 us in a loop where an add of the same tensor took 1.5 us,
    and a CNN was predicted 51-67% low without it; an attention of (2, 8, 16, 32), 16 blocks, took 89 us where
    sixteen calls of one block's cost would have priced 210."""

    def excess_s(op: Any, args: tuple) -> float:
        """The call's seconds beyond its roofline and beyond an add of its first input's (the plain kernel's)."""
        excess = []
        for call, call_args in ((op, args), (aten.add.Tensor, (args[0], args[0]))):
            result = call(*call_args)
            result = result[0] if isinstance(result, tuple) else result
            excess.append(median_work_s(functools.partial(call, *call_args), min_time_s, repeats)
                          - roofline_of_call_s(call, call_args, {}, result, hardware))
        return excess[0] - excess[1]

    fixed = {family: excess_s(op, args) for family, (op, args) in _op_family_instances().items()
             if family != "attention"}  # timed below, at one block and at many
    # one block and many in turn, medians of each: a slow stretch of the machine falls on both, not on one
    one_block, many_blocks = [], []
    for _ in range(ATTENTION_ROUNDS):
        one_block.append(excess_s(*_attention_instance(1)))
        many_blocks.append(excess_s(*_attention_instance(ATTENTION_BLOCKS_TIMED)))
    per_block, per_call = split_attention_cost(statistics.median(one_block), statistics.median(many_blocks),
                                               ATTENTION_BLOCKS_TIMED)
    fixed.update(attention=per_block, attention_call=per_call, attention_math=excess_s(*_attention_instance(4, value_size=8)))
    return tuple((name, max(0.0, seconds)) for name, seconds in fixed.items())


ATTENTION_ROUNDS = 3
"""Rounds in which :func:`measure_op_fixed_s` times attention at one block and at many, in turn."""


def split_attention_cost(one_block_s: float, blocks_s: float, blocks: int) -> tuple[float, float]:
    """``(per block, per call)`` of an attention that cost ``one_block_s`` at one block of queries and ``blocks_s``
    at ``blocks`` (beyond their rooflines): per block the difference over the blocks added, per call the rest of
    the one-block call. Each lies in ``[0, one_block_s]`` and they sum to it (``one_block_s`` at least 0): a
    many-block timing that a slow stretch of the machine lengthened (on a loaded 2-core VM, 337 us per block
    against a one-block call of less) cannot price a block above a whole call, nor a call below nothing."""
    if blocks < 2:
        raise ValueError(f"need at least 2 blocks to tell a block from a call, got {blocks}")
    whole = max(0.0, one_block_s)
    per_block = min(whole, max(0.0, (blocks_s - one_block_s) / (blocks - 1)))
    return per_block, whole - per_block


def _pooling_instances(numel: int) -> tuple[tuple[Any, tuple], ...]:
    """One call per pooling op ``autotp calibrate`` rates, on about ``numel`` normal values in 1, 2 and 3
    spatial dims: windows of 2 with a stride of 2, an adaptive pool to one output per channel."""
    generator = torch.Generator().manual_seed(1)
    side = max(2, 2 * round(math.sqrt(numel / 64) / 2))
    depth = max(2, 2 * round((numel / 16) ** (1 / 3) / 2))
    x1 = torch.randn(4, 16, max(2, numel // 64), generator=generator)
    x2 = torch.randn(4, 16, side, side, generator=generator)
    x3 = torch.randn(2, 8, depth, depth, depth, generator=generator)
    return ((aten.max_pool1d.default, (x1, [2], [2])), (aten.max_pool2d.default, (x2, [2, 2], [2, 2])),
            (aten.max_pool2d_with_indices.default, (x2, [2, 2], [2, 2])),
            (aten.max_pool3d.default, (x3, [2, 2, 2], [2, 2, 2])), (aten.avg_pool1d.default, (x1, [2], [2])),
            (aten.avg_pool2d.default, (x2, [2, 2], [2, 2])), (aten.avg_pool3d.default, (x3, [2, 2, 2], [2, 2, 2])),
            (aten.adaptive_avg_pool1d.default, (x1, [1])), (aten.adaptive_avg_pool2d.default, (x2, [1, 1])),
            (aten.adaptive_avg_pool3d.default, (x3, [1, 1, 1])), (aten.adaptive_max_pool2d.default, (x2, [1, 1])))


def measure_element_rates(numel: int, min_time_s: float, repeats: int
                          ) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Seconds per element on about ``numel`` float32 values: the median of exp, tanh, sigmoid, silu and gelu
    (what a transcendental op without a rate of its own is priced at), and each op's own rate, by name
    (:func:`op_name`): the ops of :data:`_RATED_TRANSCENDENTAL` per output element, on values in [0.5, 1.5)
    (where every one of them is defined: log, rsqrt and sqrt of a negative number take a slower path), and the
    pooling ops per element of their windows (:func:`~autotp.cost_model.compute.rated_elements`), on normal
    values: a max compares with a branch per element, so its rate is measured on data too large for the branch
    predictor to learn (on this project's 2-core VM, a max pool of 2 x 64 x 8 x 8 took 25 us called on the same
    values and 46 on fresh ones)."""
    x = torch.rand(numel, generator=torch.Generator().manual_seed(0)) + 0.5
    rates = [(op_name(op), median_work_s(functools.partial(op, x), min_time_s, repeats) / numel)
             for op in _RATED_TRANSCENDENTAL]
    names = {op_name(op) for op in _TRANSCENDENTAL}
    median = statistics.median(rate for name, rate in rates if name in names)
    for op, args in _pooling_instances(numel):
        result = op(*args)
        out = result[0] if isinstance(result, tuple) else result
        elements = rated_elements(op, args, {}, out.numel(), args[0].numel())
        rates.append((op_name(op), median_work_s(functools.partial(op, *args), min_time_s, repeats) / elements))
    return median, tuple(rates)


# ------------------------------------------------------------------------------ calls on every rank

def ranks_share_a_clock() -> bool:
    """Whether every rank of the current process group runs under one kernel (the same host and boot), so
    that their ``time.perf_counter()`` readings (``CLOCK_MONOTONIC`` on Linux) are on one time line; True
    without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, host_identity())
    return all(identity == identities[0] for identity in identities)


COMMON_START_LEAD_S = 3e-3
"""How far ahead of now rank 0 names the moment every rank starts a timed call (:func:`common_start`): longer
than gloo takes to deliver the broadcast to a rank that was asleep in the barrier before it (up to 0.8 ms)."""
_SPIN_S = 5e-4  # the last stretch before the common moment is spun, not slept: a sleep overshoots by ~0.1 ms


def common_start(share_a_clock: bool) -> float:
    """Wait for every rank of the current process group, then until one moment on every rank, and return it (this
    rank's ``time.perf_counter()``; without a process group, now).

    After a barrier rank 0 names a moment :data:`COMMON_START_LEAD_S` ahead and broadcasts it; each rank sleeps
    until just before it and spins to it. Ranks that do not share a clock (:func:`ranks_share_a_clock`) leave the
    barrier and return their own now.

    Why: a barrier alone releases the ranks up to 0.8 ms apart (gloo wakes a rank asleep in its TCP wait late;
    measured at tp 2 on two idle cores), and where ranks outnumber cores, a rank that waits for a core leaves the
    barrier only once it has one, so timed from its own start it never counts that wait. Released at one moment,
    every rank is ready together, and the call's time on the group (:func:`group_call_s`) counts what the ranks
    really share: cores, and each other's pace in the collectives."""
    if not dist.is_initialized():
        return time.perf_counter()
    dist.barrier()
    if not share_a_clock:
        return time.perf_counter()
    moment = torch.tensor([time.perf_counter() + COMMON_START_LEAD_S if dist.get_rank() == 0 else 0.0],
                          dtype=torch.float64)
    dist.broadcast(moment, src=0)
    start = float(moment)
    asleep = start - _SPIN_S - time.perf_counter()
    if asleep > 0:
        time.sleep(asleep)
    while time.perf_counter() < start:
        pass
    return start


def group_call_s(starts: Sequence[float], ends: Sequence[float], *, share_a_clock: bool) -> list[float]:
    """Per run, the seconds of one call on the current process group, from this rank's ``time.perf_counter()``
    readings at the start and end of each run's call (call it on every rank, with the same number of runs;
    without a process group, this rank's own times).

    On one clock (:func:`ranks_share_a_clock`; the starts from :func:`common_start`, one moment on every rank):
    from the first start to the last end, the time the group takes to have the call's result on every rank,
    whether or not its ranks meet in collectives. On separate clocks: the slowest rank's own time."""
    if len(starts) != len(ends):
        raise ValueError(f"need one end per start, got {len(starts)} starts and {len(ends)} ends")
    if not dist.is_initialized():
        return [end - start for start, end in zip(starts, ends)]
    if not share_a_clock:
        own = torch.tensor([end - start for start, end in zip(starts, ends)], dtype=torch.float64)
        dist.all_reduce(own, op=dist.ReduceOp.MAX)
        return own.tolist()
    first = torch.tensor([-start for start in starts], dtype=torch.float64)
    last = torch.tensor(list(ends), dtype=torch.float64)
    both = torch.stack([first, last])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return (both[1] + both[0]).tolist()


# ------------------------------------------------------------------------------ graphs


def block_graph(shape: GraphShape, world_size: int, group_name: str | None) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    """A rank-local graph of ``shape.layers`` blocks of ``shape.family`` split over ``world_size``
    ranks (heads and MLP columns split, an all-reduce after the output and down projections when
    ``world_size > 1``), built from the ATen ops the rewrite emits; and an input for it."""
    heads = max(1, shape.heads // world_size)
    head_dim = max(2, shape.hidden // shape.heads // 2 * 2)  # even: rotary halves it
    local = heads * head_dim  # (tokens, local) after a column-split projection
    tokens, hidden, gpt = shape.tokens, shape.hidden, shape.family == "gpt"
    biased = shape.family != "llama"
    generator = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")  # (1, tokens, hidden)
    counter = iter(range(10**6))

    def parameter(*size: int) -> torch.fx.Node:
        name = f"p{next(counter)}"
        root.register_buffer(name, torch.randn(*size, generator=generator) / math.sqrt(size[-1]))
        return graph.get_attr(name)

    def call(op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return graph.call_function(op, args, kwargs)

    def norm(value: torch.fx.Node) -> torch.fx.Node:
        if gpt:
            return call(aten.layer_norm.default, value, [hidden], parameter(hidden), parameter(hidden), 1e-5)
        squared = call(aten.pow.Tensor_Scalar, value, 2)
        mean = call(aten.mean.dim, squared, [-1], True)
        inverse = call(aten.rsqrt.default, call(aten.add.Tensor, mean, 1e-6))
        return call(aten.mul.Tensor, call(aten.mul.Tensor, value, inverse), parameter(hidden))

    def linear(value: torch.fx.Node, out_features: int, in_features: int) -> torch.fx.Node:
        bias = (parameter(out_features),) if biased else ()
        return call(aten.linear.default, value, parameter(out_features, in_features), *bias)

    def all_reduce(value: torch.fx.Node) -> torch.fx.Node:
        if world_size == 1 or not shape.collectives:
            return value
        return call(c10d.wait_tensor.default, call(c10d.all_reduce.default, value, "sum", group_name))

    def heads_first(value: torch.fx.Node) -> torch.fx.Node:  # (1, tokens, local) -> (1, heads, tokens, head_dim)
        return call(aten.transpose.int, call(aten.view.default, value, [1, tokens, heads, head_dim]), 1, 2)

    def rotary(value: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node) -> torch.fx.Node:
        half = head_dim // 2
        first = call(aten.slice.Tensor, value, 3, 0, half)
        second = call(aten.slice.Tensor, value, 3, half, head_dim)
        rotated = call(aten.cat.default, [call(aten.neg.default, second), first], -1)
        return call(aten.add.Tensor, call(aten.mul.Tensor, value, cos), call(aten.mul.Tensor, rotated, sin))

    if shape.layers == 0:  # the call of a graph and little else: pins the per-call term of the fit
        graph.output(norm(x))
        return torch.fx.GraphModule(root, graph), torch.randn(1, tokens, hidden, generator=generator)
    if shape.family == "mlp":
        for _ in range(shape.layers):
            x = all_reduce(linear(call(aten.gelu.default, linear(x, 4 * local, hidden)), hidden, 4 * local))
        graph.output(x)
        return torch.fx.GraphModule(root, graph), torch.randn(1, tokens, hidden, generator=generator)
    # the prologue: positions, a causal mask from them, a position-embedding lookup, casts
    positions = call(aten.arange.start, 0, tokens, device=torch.device("cpu"), pin_memory=False)
    rows = call(aten.unsqueeze.default, positions, 1)
    columns = call(aten.unsqueeze.default, positions, 0)
    mask = call(aten.view.default, call(aten.le.Tensor, columns, rows), [1, 1, tokens, tokens])
    table = parameter(max(tokens, 64), hidden)
    looked_up = call(aten.embedding.default, table, call(aten.unsqueeze.default, positions, 0))
    x = call(aten.add.Tensor, x, call(aten._to_copy.default, looked_up, dtype=torch.float32))
    angles = call(aten.mul.Tensor, call(aten._to_copy.default, rows, dtype=torch.float32), parameter(head_dim))
    cos, sin = call(aten.cos.default, angles), call(aten.sin.default, angles)

    for _ in range(shape.layers):
        normed = norm(x)
        q, k, v = (heads_first(linear(normed, local, hidden)) for _ in range(3))
        if gpt:
            attention = call(aten.scaled_dot_product_attention.default, q, k, v, mask)
        else:
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            attention = call(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True)
        merged = call(aten.view.default, call(aten.clone.default, call(aten.transpose.int, attention, 1, 2)),
                      [1, tokens, local])
        x = call(aten.add.Tensor, x, all_reduce(linear(merged, hidden, local)))
        normed = norm(x)
        if gpt:
            inner = call(aten.gelu.default, linear(normed, 4 * local, hidden))
            down = linear(inner, hidden, 4 * local)
        else:
            gate = call(aten.silu.default, linear(normed, 2 * local, hidden))
            down = linear(call(aten.mul.Tensor, gate, linear(normed, 2 * local, hidden)), hidden, 2 * local)
        x = call(aten.add.Tensor, x, all_reduce(down))
    graph.output(norm(x))
    example = torch.randn(1, tokens, hidden, generator=generator)
    return torch.fx.GraphModule(root, graph), example


def _inference_kind(target: Any) -> str | None:
    """The kind of one of the runtime's inference collectives (one-shot or shared-memory all-reduce,
    shared-memory all-gather: :mod:`autotp.passes.small_collectives`), else None."""
    return inference_collective_kind(target)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph once, pricing each node's kernel on a profile with no host terms."""

    def __init__(self, module: torch.fx.GraphModule, hardware: Hardware) -> None:
        super().__init__(module)
        self.hardware = device_only(hardware)
        self.kernel_nodes = self.view_nodes = 0
        self.device_s = 0.0
        self.kernel_s: list[float] = []
        self.collectives: list[tuple[str, int, int]] = []
        self.called: set[str] = set()  # first_call_key of every kernel run so far

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        if node.op != "call_function":
            return result
        if node.target is c10d.wait_tensor.default:
            return result
        if node.target is c10d.all_reduce.default or _inference_kind(node.target) == "all_reduce":
            self.collectives.append(("all_reduce", result.numel() * result.element_size(), dist.get_world_size()))
            return result
        if launches_no_kernel(node.target):
            self.view_nodes += 1
            return result
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        self.kernel_nodes += 1
        seconds = roofline_of_call_s(node.target, args, kwargs, result, self.hardware)
        family = op_family(node.target)
        # an op's fixed costs are priced as measured (attention per block of queries and per call)
        self.device_s += seconds + self.hardware.fixed_costs_s(fixed_costs(node.target, args, kwargs, result.dtype))
        key = first_call_key(node.target)
        if key not in self.called:  # its first call in this call of the graph, priced as the cost pass prices it
            self.called.add(key)
            self.device_s += self.hardware.first_call_cost_s(family)
        self.kernel_s.append(seconds)
        return result


def _same(tensor: torch.Tensor, *_: Any) -> torch.Tensor:
    """Stand-in of a collective whose output has its input's shape (all-reduce, all-to-all of even
    splits, broadcast) and of ``wait_tensor``: the input itself."""
    return tensor


def _gathered(tensor: torch.Tensor, group_size: int, *_: Any) -> torch.Tensor:
    """Stand-in of ``all_gather_into_tensor``: ``group_size`` copies along dim 0 (the output's shape)."""
    return tensor.repeat(group_size, *[1] * (tensor.dim() - 1))


def _scattered(tensor: torch.Tensor, op: str, group_size: int, *_: Any) -> torch.Tensor:
    """Stand-in of ``reduce_scatter_tensor``: this rank's block of dim 0 (the output's shape)."""
    return tensor.narrow(0, 0, tensor.shape[0] // group_size)


def _stand_in_of(target: Any) -> Callable[..., torch.Tensor] | None:
    """The local stand-in of a collective op of a rank-local graph, or None for any other op."""
    if target is c10d.all_gather_into_tensor.default:
        return _gathered
    if target is c10d.reduce_scatter_tensor.default:
        return _scattered
    if target in (c10d.all_reduce.default, c10d.all_to_all_single.default, c10d.broadcast.default,
                  c10d.wait_tensor.default) or _inference_kind(target) == "all_reduce":
        return _same
    if _inference_kind(target) == "all_gather":  # the shared-memory or watched all-gather: its group's size
        size = getattr(target, "world_size", None) or dist.get_world_size(target.group)
        return lambda tensor: _gathered(tensor, size)
    return None


def local_stand_ins(module: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``module`` whose collectives (and their waits) are local stand-ins of their outputs'
    shapes, or None when it has none: the graph's *compute*, as the cost model prices it.

    The copy shares ``module``'s parameters and buffers and is compiled once, so that timing it in
    turn with ``module`` recompiles neither (a freshly generated ``forward`` runs 5-20% slower on
    its first calls). The values are wrong wherever a collective would have combined ranks; the
    shapes, and so the kernels and their times, are those of the real graph.
    """
    if not any(node.op == "call_function" and _stand_in_of(node.target) is not None for node in module.graph.nodes):
        return None
    graph = torch.fx.Graph()
    graph._codegen = module.graph._codegen  # the same calling convention (flat inputs, pytree outputs)
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        stand_in = _stand_in_of(node.target) if node.op == "call_function" else None
        if stand_in is not None:
            node.target = stand_in
    return torch.fx.GraphModule(module, graph)


def graph_sample(module: torch.fx.GraphModule, example: torch.Tensor, hardware: Hardware, runs: int,
                 warmup: int = 3) -> GraphSample:
    """:func:`graph_samples` of one graph."""
    return graph_samples([(module, example, hardware)], runs, warmup)[0]


def graph_samples(graphs: Sequence[tuple[torch.fx.GraphModule, torch.Tensor, Hardware]], runs: int,
                  warmup: int = 3) -> tuple[GraphSample, ...]:
    """Time each ``module(example)`` ``runs`` times, and in turn with it its compute form
    (:func:`local_stand_ins`) when it has collectives (:func:`time_in_turn`: each call after one
    untimed call of itself, from a start common to every rank to the last rank's end); and count what
    the cost model sees in each, its kernels priced on its own ``hardware``.

    Each graph is timed on its own, as a model runs the same graph call after call (and as the
    accuracy benchmark times one): graphs that took turns within every run measured twice the wait
    (a 3-block GPT graph with 6 all-reduces at tp 2 on two cores: 0.64-0.79 ms taking turns with
    the eight other quick-calibration graphs, 0.31-0.38 ms alone, 0.23-0.45 ms in the benchmark's
    harness, while its compute form measured the same either way), although each call came after an
    untimed call of itself.
    :func:`fit_host_terms` weighs the graphs robustly, so a change of load during one graph's runs
    does not set the terms."""
    samples = []
    share_a_clock = ranks_share_a_clock()  # a property of the group: asked once, not per graph
    with torch.no_grad():
        for module, example, hardware in graphs:
            recorder = _Recorder(module, hardware)
            recorder.run(example)
            compute_module = local_stand_ins(module)
            forms = [module] if compute_module is None else [module, compute_module]
            timed = time_in_turn([functools.partial(form, example) for form in forms], runs, warmup,
                                 share_a_clock=share_a_clock)
            # the share as the benchmark measures a forward: median work over the median of the group's
            # wall times (a sum over runs would let one run paused for a whole time slice under
            # load set the share of every graph; fit_host_terms weighs the graphs by their time, so the
            # longest, most like a forward, count most, and fair_core_share bounds the short ones)
            (seconds, work_s), (compute_s, compute_work_s) = timed[0], timed[-1]
            share = compute_work_s / compute_s if compute_s > 0 else 1.0
            samples.append(GraphSample(recorder.kernel_nodes, recorder.view_nodes, recorder.device_s,
                                       tuple(recorder.collectives), seconds, work_s, min(share, fair_core_share()),
                                       compute_s, compute_work_s, kernel_s=tuple(recorder.kernel_s)))
    return tuple(samples)


def time_in_turn(calls: Sequence[Callable[[], Any]], runs: int, warmup: int = 3, *,
                 share_a_clock: bool | None = None) -> list[tuple[float, float]]:
    """Per call: the median over ``runs`` of its seconds on the group (:func:`group_call_s`: from the moment
    every rank started it, :func:`common_start`, to the moment the last rank finished it) and the median of
    this rank's work per call (:func:`work_clock`). ``share_a_clock``: :func:`ranks_share_a_clock`'s answer
    when the caller has it (None: asked here).

    Call it on every rank of the current process group at once (or without one). The calls take turns
    within every run, so a change of load hits all of them alike (a graph's real and compute form,
    three plans of one model). Each timed call comes after one untimed call of itself, then a common start:
    timed in steady state, its caches holding its own tensors as they do call after call, and not right
    after another call's collectives (a rank that slept in them gave its core away, and the compute
    that follows waits to get it back: at tp 2 on a busy two-core machine, a compute form timed right
    after its real form got half a core, one timed after itself 0.9-0.97; that wait is caused by the
    collectives, so it belongs to what they add, not to the compute).

    A call whose ranks never meet counts to its slowest rank's end from the common start, as one with
    collectives does: four ranks on two cores each take the half core they share (timed on its own clock, a
    rank that waited for a core before it left the barrier did not count the wait, and the MLP unsplit at tp 4
    measured 0.58-0.92 ms against 1.7 ms of the four ranks' work on two cores)."""
    clock = work_clock()
    if share_a_clock is None:
        share_a_clock = ranks_share_a_clock()
    starts: list[list[float]] = [[] for _ in calls]
    ends: list[list[float]] = [[] for _ in calls]
    work: list[list[float]] = [[] for _ in calls]
    with torch.no_grad():
        for call in calls:
            for _ in range(warmup):
                call()
        for _ in range(runs):
            for index, call in enumerate(calls):
                call()
                start = common_start(share_a_clock)
                start_work = clock()
                call()
                work[index].append(clock() - start_work)
                ends[index].append(time.perf_counter())
                starts[index].append(start)
    return [(statistics.median(group_call_s(starts[index], ends[index], share_a_clock=share_a_clock)),
             statistics.median(work[index])) for index in range(len(calls))]


_GRAPH_TIMEOUT_S = 300.0  # how long a rank waits for the others in a calibration graph's all-reduce


def fair_core_share(cores: int | None = None, ranks: int | None = None, threads: int | None = None) -> float:
    """The most of a core one rank can get while every rank computes: the cores over the threads of all ranks
    (``min(1, cores / (ranks * threads))``; 1/2 for four single-thread ranks on two cores). Each argument left out
    is this process's: the cores it may run on, its group's size, torch's threads.

    A physical bound on :attr:`GraphSample.core_share`: the slowest of N ranks that start
    together cannot finish before their work together has run on the cores, so its own work over
    its wall time is at most this. A short graph that one rank happens to run within one time
    slice, before the others get the core, would otherwise measure more (up to 1) and price the
    forward, which is paused, as if it were not.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks is None:
        ranks = dist.get_world_size() if dist.is_initialized() else 1
    if threads is None:
        threads = torch.get_num_threads()
    return min(1.0, cores / (ranks * threads))


def measure_graphs(shapes: Sequence[GraphShape], hardware: Hardware, runs: int) -> tuple[GraphSample, ...]:
    """One :class:`GraphSample` per shape, on every rank of the current process group (or alone)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    group_name = dist.group.WORLD.group_name if dist.is_initialized() and dist.group.WORLD is not None else None
    graphs, whole = [], []
    for shape in shapes:
        module, example = block_graph(shape, world_size, group_name)
        # as autotp.compile runs an inference graph: through shared memory on one host, else one-shot (tp > 2);
        # the calibration's ranks are processes it spawned on this machine: one host
        module = inference_all_reduces(module, None, world_size, host=local_host(), timeout_s=_GRAPH_TIMEOUT_S)
        # its kernels priced at the bandwidth of its own working set (weights and input), as the cost pass does
        weights = sum(t.numel() * t.element_size() for t in module.buffers())
        graphs.append((module, example, at_working_set(hardware, weights + example.numel() * example.element_size())))
        # the cost pass sizes a model's graph with its tensors held whole: its weights on every rank together
        whole.append(weights * world_size + example.numel() * example.element_size())
    return tuple(dataclasses.replace(sample, working_set_bytes=size)
                 for sample, size in zip(graph_samples(graphs, runs), whole))


def measure_copy_curve(working_sets: Sequence[int], min_time_s: float, repeats: int) -> tuple[tuple[int, float], ...]:
    """``(working_set_bytes, bytes_per_s)`` of ``dst.copy_(src)`` with ``src`` and ``dst`` of half the
    working set each (float32), per size: ``2 * nbytes / time`` as the roofline counts a copy's
    bytes. Timed on the work clock (:func:`median_work_s`); call it on every
    rank at once so that the ranks share the cache as a running plan's do."""
    curve = []
    for working_set in working_sets:
        numel = max(1, working_set // 2 // 4)
        src = torch.ones(numel)
        dst = torch.empty_like(src)
        seconds = median_work_s(functools.partial(dst.copy_, src), min_time_s, repeats)
        curve.append((2 * numel * 4, 2 * numel * 4 / seconds))
    return tuple(curve)


GEMV_COLUMNS, GEMV_ROWS = 512, 1376
"""The matrices :func:`measure_gemv_curve` multiplies: a transformer's projections at hidden 512 (the up
projection's shape), as a decode step's linears at one token stream them."""


def measure_gemv_curve(working_sets: Sequence[int], min_time_s: float, repeats: int) -> tuple[tuple[int, float], ...]:
    """``(working_set_bytes, bytes_per_s)`` of matrix-vector products (``aten.linear`` of one row) over float32
    matrices of :data:`GEMV_ROWS` x :data:`GEMV_COLUMNS` (the last one shorter) that fill the working set, one
    after another: the matrices' bytes over the time, per size. Timed on the work clock in step
    (:func:`median_work_s`), as :func:`measure_copy_curve`: call it on every rank at once."""
    curve = []
    vector = torch.ones(1, GEMV_COLUMNS)
    for working_set in working_sets:
        rows = max(1, working_set // 4 // GEMV_COLUMNS)
        matrices = torch.ones(rows, GEMV_COLUMNS).split(GEMV_ROWS)

        def multiply(matrices: Sequence[torch.Tensor] = matrices) -> None:
            for matrix in matrices:
                torch.nn.functional.linear(vector, matrix)

        seconds = median_work_s(multiply, min_time_s, repeats)
        curve.append((working_set, rows * GEMV_COLUMNS * 4 / seconds))
    return tuple(curve)


COLD_SLOT_BYTES = (4 * 2**10, 24 * 2**10, 96 * 2**10)
"""Slot sizes :func:`measure_cold_call_s` times: a decode step's all-reduces (a few rows of hidden
size) up to a short prefill's."""


def measure_cold_call_s(world_size: int, flush_bytes: int, repeats: int) -> float:
    """Seconds a shared-memory collective's local work pays per call when its slots are out of cache,
    over what it pays with them cached: copy a slot's bytes in and add ``world_size`` (>= 2) slots, timed
    right after a copy of ``flush_bytes`` (as a decode step's weights and cache stream between two
    collectives) and again at once (warm). Median over ``repeats`` and :data:`COLD_SLOT_BYTES` (the
    extra barely grows with the size: misses of the slots' pages and lines, not bandwidth); at least 0.
    Call it on every rank at once, as the ranks of a running plan stream together."""
    numel = max(1, flush_bytes // 2 // 4)
    src, dst = torch.ones(numel), torch.empty(numel)
    extra = []
    for nbytes in COLD_SLOT_BYTES:
        count = nbytes // 4
        piece, slots = torch.zeros(count), torch.zeros(world_size, count)
        for _ in range(repeats):
            dst.copy_(src)  # the working set pushes the slots out
            piece.fill_(1.0)  # the collective's input was just computed: in cache
            times = []
            for _ in range(2):  # cold, then warm
                started = time.perf_counter()
                slots[0].copy_(piece)
                total = slots[0] + slots[1]
                for row in range(2, world_size):
                    total.add_(slots[row])
                times.append(time.perf_counter() - started)
            extra.append(times[0] - times[1])
    return max(0.0, statistics.median(extra))
