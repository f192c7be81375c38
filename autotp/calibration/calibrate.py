"""Calibration: measure this machine and write a :class:`~autotp.cost_model.Hardware` profile.

``autotp calibrate --world-size N`` (or :func:`calibrate`) spawns N local processes joined by a
gloo process group — the setting autotp's CPU runs use — and measures, on every rank at once
(so that ranks share cores and memory bandwidth as they do when a plan runs):

====================  ==========================================================================
profile field         measurement (median over timed repeats, after warm-up)
====================  ==========================================================================
``peak_tflops``       ``aten.linear`` of a ``(2, n/2, n)`` input and an ``n x n`` weight with bias
                      (the op traced ``nn.Linear`` layers run), ``2 n^3`` FLOPs per call, the best
                      rate over a few sizes ``n`` (the achievable peak), per dtype: float32 always;
                      bfloat16 and float16 unless they run below ``1/MEANINGFUL_SLOWDOWN`` of
                      float32 (CPUs without native support emulate them: then they are left
                      out, and planning a model in those dtypes asks for the figure)
``memory_bandwidth``  ``dst.copy_(src)`` of a large tensor: it reads and writes ``nbytes`` each,
                      so ``2 * nbytes / time`` — the bytes the roofline counts for a copy
``memory_..._curve``  the same copy at working sets from 1 MiB to 256 MiB per rank (L2, last-level
                      cache, DRAM), plus the large copy: the bandwidth a graph gets at its own
                      working set (:mod:`autotp.cost_model.bandwidth`)
``kernel_floor_s``    per op of an FX graph chaining one-element kernel ops (add, exp, mean,
                      softmax, cat, ...): the fallback per-op cost, 0.0 once the host terms
                      below are fitted (the dispatch per kernel node is then this floor, scaled
                      as the graphs say)
``view_op_s``         the same for a chain of views (view, transpose, expand, slice, ...): what an
                      op that launches no kernel costs on a CPU
``intra_node``        gloo ``all_reduce``, ``all_gather`` and ``reduce_scatter`` through the same
                      functional collectives (``torch.ops._c10d_functional``) the rewritten
                      graph issues, at several sizes; ``alpha`` (``latency_s``), the per-call
                      ``base_latency_s`` and the bandwidth ``B`` are fitted to the formulas of
                      :mod:`autotp.cost_model.collectives` by non-negative least squares on relative error
                      (each sample ``t`` weighted ``1/t``, so small messages count as much as
                      large ones)
``gemm_half_...``     ``aten.linear`` at 1 to 256 tokens, each call on another of 64 MiB of weights
                      (read from memory, as a forward reads each weight once): the shape curve of
                      the GEMM rate and the peak it tends to (:func:`autotp.cost_model.graph_calibration.fit_gemm_curve`)
``transcendental_..`` seconds per element of exp, tanh, sigmoid, silu, gelu on a large tensor (their median), and
``op_element_s``      of each of them, erf, log, sin, cos, rsqrt and sqrt by name; and of each pooling op per
                      element of its windows, on values fresh to the branch predictor
``op_fixed_s``        a small convolution, max-pool, batch norm and attention in a tight loop: what each
                      costs beyond its roofline and an add of its input's (a primitive set up per call);
                      attention at one block of queries and at sixteen (per call and per block), and in
                      PyTorch's math kernel
``first_call_s``      twelve small ops and each family's instance, right after every rank met and waited (as
                      every graph is timed) against back to back: what a kernel's first call in a call costs
``model_call_s``      a small model compiled here (:mod:`autotp.calibration.model_call`): its call against its
                      graph's, both after every rank met and waited: what the model's call adds to its graph's
``host_dispatch_s``,  rank-local transformer graphs of several sizes and two op mixes (Llama-like and
``collective_wait_s`` GPT-like blocks after the prologue HF graphs run), with and without all-reduces, and
``core_share``        one wide block (hidden 1024, 64 tokens), run by calling their GraphModule on all ranks
                      from one moment to the last rank's end (:mod:`autotp.calibration.graphs`): their work
                      over what their single ops price scales every single-op price (the dispatch is the
                      tiny-op floor so scaled); a line of their wall time over their work gives the share
                      of a core a rank gets and a loss once per call (``core_share_call_s``), the share up
                      to their longest compute (``core_share_range_s``; beyond, the fair share,
                      ``fair_core_share``); ``runtime_mode`` eager
``busy_compute_..``  a transformer-like MLP block for about 30 ms with 1, 2, ... of the machine's ranks busy at
                      once (the others waiting), over all of them busy: how much faster a stage that runs
                      while other stages wait computes (:mod:`autotp.calibration.concurrency`);
                      ``ranks_per_machine``: the ranks measured together
====================  ==========================================================================

Single ops and graphs are timed on the *work clock* (:func:`~autotp.calibration.graphs.work_clock`: the
thread's CPU time when torch runs one thread per rank), so a rank that another process takes off
its core mid-measurement does not record the pause as the op's cost. In a group of more than one rank
the single ops are timed in step (:func:`~autotp.calibration.graphs.median_work_s`: every rank starts each
timed repeat at one moment and loops as many calls), so that each times its op beside the others' as a plan's
ranks run, never beside a core left idle by a rank that finished first. The share of a core a rank
gets while it computes (other ranks on the same cores, other processes) is measured on its own,
in the graphs' compute forms (collectives replaced by local stand-ins, as the accuracy benchmark
measures a model's compute), and every work term of the profile is divided by it. Collectives
and the graphs' wall times stay on the wall clock (waiting for another rank is real time); the
wait per collective is what a graph's real form takes beyond its measured compute and its link.

The profile describes *one rank of an N-rank job on this machine*: each rank uses
``max(1, cores // N)`` threads (what ``autotp demo`` and the benchmarks use), compute is
measured with all N ranks busy at once, ``memory_gib`` is the host's memory divided by N, and
the links are measured across N processes (across 2 when N is 1, since one process has no
link). No network is measured: ``inter_node`` repeats the loopback link and says so in its
name. Started by a launcher on several nodes, :func:`calibrate_launched` measures on the launcher's ranks
instead: compute per machine, the links inside each host and the network between hosts (``inter_node``),
``devices_per_node`` from the launcher. ``achievable_fraction_*`` stay 1.0: the peaks are already achieved rates (of single ops
in a tight loop, scaled by what the same work cost in the rank-local graphs).

The measuring functions take an initialised process group, so tests run them on a shared pool
of workers (:func:`measure_rank`), and the fit turns the per-rank measurements into
a profile (:func:`autotp.cost_model.calibrate.build_profile`); :func:`calibrate` does both with processes of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autotp.calibration.concurrency import measure_busy_scale
from autotp.calibration.graphs import (
    fair_core_share,
    measure_cold_call_s,
    measure_copy_curve,
    measure_element_rates,
    measure_first_call_s,
    measure_gemm_samples,
    measure_gemv_curve,
    measure_graphs,
    measure_op_fixed_s,
    median_work_s,
)
from autotp.calibration.model_call import measure_model_call_s
from autotp.cost_model.bandwidth import DEFAULT_WORKING_SETS
from autotp.cost_model.calibrate import (
    SEND_KIND,
    SHARED_MEMORY_KIND,
    CollectiveSample,
    RankMeasurements,
    build_profile,
    kernel_profile,
    with_measured_links,
)
from autotp.cost_model.graph_calibration import GRAPH_FAMILIES, GemmSample, GraphSample, GraphShape
from autotp.cost_model.hardware import Hardware
from autotp.runtime.collectives.hosts import Host, Launch, cpu_set, local_host
from autotp.runtime.collectives.shared_memory import shared_memory_all_reduce_for

__all__ = [
    "MEANINGFUL_SLOWDOWN",
    "CalibrationConfig",
    "calibrate",
    "calibrate_launched",
    "measure_links",
    "measure_rank",
]

MEASURED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
MEANINGFUL_SLOWDOWN = 8.0
"""A reduced-precision dtype whose matmuls run more than this many times slower than float32 is
emulated, not supported; it is left out of the profile (a model in that dtype on this machine
would be planned on a figure nobody should use by accident)."""


QUICK_DRAM_BYTES = 128 * 2**20
"""The largest working set (a copy's source and destination) the quick calibration measures. It stopped at 32 MiB
before, the last-level cache of this project's VM: a copy of that working set ran at 28.6 GB/s where one of 128 MiB
runs at 17.6, and a decode step streaming 68 MB of weights was priced 35% under its time on one rank."""


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """What to measure and how long to spend; :meth:`quick` is a few seconds, for tests.

    Sizes: ``matmul_sizes`` are square matmul sizes ``n`` (float32; reduced-precision dtypes use
    the smallest one, as emulated ones are slow); ``copy_bytes`` is the tensor copied for the
    memory bandwidth; ``collective_bytes`` the full-tensor sizes of each collective.
    ``min_time_s`` is how long each timed measurement runs at least; ``repeats`` how many timed
    measurements the median is taken over. ``threads``: torch threads per rank (``None``:
    ``max(1, cores // world_size)``).
    """

    matmul_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    reduced_dtypes: tuple[str, ...] = ("bfloat16", "float16")
    copy_bytes: int = 256 * 2**20
    bandwidth_working_sets: tuple[int, ...] = DEFAULT_WORKING_SETS
    collective_bytes: tuple[int, ...] = (4 * 2**10, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
    min_time_s: float = 0.2
    repeats: int = 5
    threads: int | None = None
    progress: bool = False
    gemm_width: int = 256
    gemm_tokens: tuple[int, ...] = (1, 4, 16, 64, 256)
    transcendental_numel: int = 2**20
    graph_shapes: tuple[GraphShape, ...] = tuple(
        GraphShape(layers, tokens, hidden, collectives=collectives, family=family)
        for layers in (1, 3) for tokens in (2, 32) for hidden in (64, 256) for collectives in (True, False)
        for family in GRAPH_FAMILIES if collectives or (layers == 3 and family != "mlp")
    ) + (GraphShape(0, 2, 64), GraphShape(1, 64, 1024, collectives=False),
         GraphShape(1, 128, 768, collectives=False, family="gpt"))
    graph_runs: int = 15

    @classmethod
    def quick(cls, *, progress: bool = False, threads: int | None = None) -> CalibrationConfig:
        """Small sizes and short timings: a rough profile in a few seconds (tests, smoke runs). The copy curve
        still reaches past a server's last-level cache (:data:`QUICK_DRAM_BYTES`): a graph whose weights stream from
        DRAM is priced at DRAM's rate."""
        return cls(
            matmul_sizes=(128, 256),
            reduced_dtypes=("bfloat16",),
            copy_bytes=QUICK_DRAM_BYTES // 2,
            bandwidth_working_sets=(2**20, 8 * 2**20, 32 * 2**20, 64 * 2**20),
            collective_bytes=(4 * 2**10, 64 * 2**10, 2**20),
            min_time_s=0.02,
            repeats=3,
            threads=threads,
            progress=progress,
            gemm_tokens=(1, 8, 64, 256),
            transcendental_numel=2**18,
            graph_shapes=(GraphShape(1, 2, 64), GraphShape(3, 2, 64, family="gpt"),
                          GraphShape(3, 2, 64, collectives=False), GraphShape(2, 16, 128, collectives=False, family="gpt"),
                          GraphShape(1, 32, 256, family="gpt"), GraphShape(2, 32, 256),
                          GraphShape(3, 32, 256, family="gpt"),
                          GraphShape(3, 32, 256, collectives=False), GraphShape(0, 2, 64),
                          GraphShape(1, 32, 256, family="mlp"), GraphShape(3, 32, 256, family="mlp"),
                          GraphShape(1, 64, 1024, collectives=False)),
            graph_runs=11,
        )

    def __post_init__(self) -> None:
        if not self.matmul_sizes or any(n < 1 for n in self.matmul_sizes):
            raise ValueError(f"matmul_sizes must be sizes >= 1, got {self.matmul_sizes!r}")
        if len(set(self.collective_bytes)) < 2 or any(n < 4 for n in self.collective_bytes):
            raise ValueError(
                f"collective_bytes needs at least two different sizes >= 4 bytes to fit latency and "
                f"bandwidth, got {self.collective_bytes!r}"
            )
        if self.copy_bytes < 4 or self.min_time_s <= 0 or self.repeats < 1:
            raise ValueError(
                f"copy_bytes ({self.copy_bytes}) must be >= 4, min_time_s ({self.min_time_s}) > 0 and "
                f"repeats ({self.repeats}) >= 1"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if len(self.graph_shapes) < 3 or self.graph_runs < 1:
            raise ValueError(f"graph_shapes needs at least 3 shapes (3 host terms are fitted over them) and "
                             f"graph_runs >= 1; got {len(self.graph_shapes)} shapes and graph_runs={self.graph_runs}")

    def threads_for(self, world_size: int) -> int:
        return self.threads if self.threads is not None else max(1, (os.cpu_count() or 1) // world_size)


# ------------------------------------------------------------------------------ timing

def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[autotp calibrate] {message}", file=sys.stderr, flush=True)


def measure_matmul_flops_per_s(dtype: torch.dtype, size: int, config: CalibrationConfig) -> float:
    """FLOP/s of ``aten.linear`` in ``dtype``: input ``(2, size // 2, size)``, weight ``(size, size)``,
    bias ``(size,)`` — the op and the shape family (batch, tokens, features) of the linear layers
    of traced transformer graphs; ``2 * size^3`` FLOPs per call (the bias add is not counted, as in
    :func:`~autotp.cost_model.compute.aten_flops`)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, max(1, size // 2), size, generator=generator).to(dtype)  # (batch, tokens, features)
    weight = torch.randn(size, size, generator=generator).to(dtype)
    bias = torch.randn(size, generator=generator).to(dtype)
    linear = torch.ops.aten.linear.default
    seconds = median_work_s(lambda: linear(x, weight, bias), config.min_time_s, config.repeats)
    return 2 * (2 * max(1, size // 2)) * size * size / seconds


def measure_copy_bytes_per_s(config: CalibrationConfig) -> float:
    """Memory bandwidth from ``dst.copy_(src)``: ``2 * nbytes`` (read + write) per call."""
    numel = config.copy_bytes // 4
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_work_s(lambda: dst.copy_(src), config.min_time_s, config.repeats)
    return 2 * numel * 4 / seconds


# One-element ops chained in an FX graph, as the rewritten graph runs them: every op dispatches
# through a different path, so a chain of different ops costs what a model's graph pays per op
# (several times what one op repeated in a tight loop costs, whose path stays warm in the caches).
# Kernel ops: the common elementwise, reduction and data-movement ops of transformer graphs;
# views: the shape ops that launch no kernel. Each maps a (1, 1) tensor to a (1, 1) tensor.
_KERNEL_CHAIN: tuple[tuple[Any, tuple[Any, ...]], ...] = (
    (torch.ops.aten.add.Tensor, ("x", "x")),
    (torch.ops.aten.mul.Tensor, ("x", "x")),
    (torch.ops.aten.sub.Tensor, ("x", "x")),
    (torch.ops.aten.div.Tensor, ("x", "x")),
    (torch.ops.aten.neg.default, ("x",)),
    (torch.ops.aten.exp.default, ("x",)),
    (torch.ops.aten.rsqrt.default, ("x",)),
    (torch.ops.aten.silu.default, ("x",)),
    (torch.ops.aten.gelu.default, ("x",)),
    (torch.ops.aten.tanh.default, ("x",)),
    (torch.ops.aten.mean.dim, ("x", [-1], True)),
    (torch.ops.aten.sum.dim_IntList, ("x", [-1], True)),
    (torch.ops.aten.amax.default, ("x", [-1], True)),
    (torch.ops.aten._softmax.default, ("x", -1, False)),
    (torch.ops.aten.cat.default, (["x"], 0)),
    (torch.ops.aten.clone.default, ("x",)),
)
_VIEW_CHAIN: tuple[tuple[Any, tuple[Any, ...]], ...] = (
    (torch.ops.aten.view.default, ("x", [1, 1])),
    (torch.ops.aten.unsqueeze.default, ("x", 0)),
    (torch.ops.aten.squeeze.dim, ("x", 0)),
    (torch.ops.aten.transpose.int, ("x", 0, 1)),
    (torch.ops.aten.expand.default, ("x", [1, 1])),
    (torch.ops.aten.slice.Tensor, ("x", 0, 0, 1)),
    (torch.ops.aten.permute.default, ("x", [1, 0])),
    (torch.ops.aten.t.default, ("x",)),
    (torch.ops.aten.select.int, (("unsqueeze", "x"), 0, 0)),
    (torch.ops.aten.alias.default, ("x",)),
)
_CHAIN_REPEATS = 8


def _chain_module(chain: tuple[tuple[Any, tuple[Any, ...]], ...]) -> tuple[torch.fx.GraphModule, int]:
    """A GraphModule running ``chain`` ``_CHAIN_REPEATS`` times on its input; and its op count."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    ops = 0

    def bind(arg: Any, current: torch.fx.Node) -> Any:
        nonlocal ops
        if arg == "x":
            return current
        if isinstance(arg, tuple) and arg and arg[0] == "unsqueeze":  # select needs a leading dim to drop
            ops += 1
            return graph.call_function(torch.ops.aten.unsqueeze.default, (current, 0))
        if isinstance(arg, list):
            return [bind(a, current) for a in arg]
        return arg

    for _ in range(_CHAIN_REPEATS):
        for op, args in chain:
            value = graph.call_function(op, tuple(bind(a, value) for a in args))
            ops += 1
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph), ops


def _per_op_s(chain: tuple[tuple[Any, tuple[Any, ...]], ...], config: CalibrationConfig) -> float:
    module, ops = _chain_module(chain)
    x = torch.ones(1, 1)
    with torch.no_grad():
        return median_work_s(lambda: module(x), config.min_time_s, config.repeats) / ops


def measure_kernel_floor_s(config: CalibrationConfig) -> float:
    """Seconds per op of a graph of one-element kernel ops (add, exp, mean, softmax, cat, ...)."""
    return _per_op_s(_KERNEL_CHAIN, config)


def measure_view_op_s(config: CalibrationConfig) -> float:
    """Seconds per op of a graph of one-element views (view, transpose, expand, slice, ...)."""
    return _per_op_s(_VIEW_CHAIN, config)


def _collective_call(kind: str, nbytes: int, world_size: int, group_name: str) -> Callable[[], Any]:
    """One functional collective on a float32 tensor whose full size is ``nbytes`` (rounded to
    whole float32 elements per rank), waited on — what the rewritten graph runs."""
    c10d = torch.ops._c10d_functional
    per_rank = max(1, nbytes // 4 // world_size)
    full = torch.ones(per_rank * world_size)
    shard = torch.ones(per_rank)
    if kind == "all_reduce":
        return lambda: c10d.wait_tensor(c10d.all_reduce(full, "sum", group_name))
    if kind == "all_gather":
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world_size, group_name))
    if kind == "reduce_scatter":
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", world_size, group_name))
    raise ValueError(f"cannot measure collective kind {kind!r}; measured kinds: {', '.join(MEASURED_KINDS)}")


def measure_collectives(rank: int, world_size: int, config: CalibrationConfig, *, group: Any = None,
                        host: Host | None = None) -> tuple[CollectiveSample, ...]:
    """Time every kind and size over ``group`` (None: the default group; ``rank`` and ``world_size`` are this
    rank's place in it and its size); each timed repeat starts after a barrier and counts the slowest rank.
    ``host``: this rank's host, with which the group's ranks decide whether they share one and so measure the
    shared-memory all-reduce too (None: this machine's, for ranks spawned here)."""
    group = dist.group.WORLD if group is None else group
    if group is None:
        raise RuntimeError("measure_collectives needs an initialised process group (dist.init_process_group)")
    group_name = group.group_name
    where = "ranks" if host is None or host.node is None else "ranks (launcher's nodes)"
    samples = []
    for kind in MEASURED_KINDS:
        for nbytes in config.collective_bytes:
            call = _collective_call(kind, nbytes, world_size, group_name)
            elements = max(1, nbytes // 4 // world_size) * world_size
            sample = CollectiveSample(kind, world_size, elements * 4, _slowest_rank_s(call, config, group))
            samples.append(sample)
            _say(config.progress and rank == 0,
                 f"gloo {kind:<14} {sample.nbytes / 2**10:>9.1f} KiB over {world_size} {where}: "
                 f"{sample.seconds * 1e6:>9.1f} us")
    # the all-reduce autotp's inference graphs run instead where the ranks share a host
    shared = shared_memory_all_reduce_for(group, host=local_host() if host is None else host,
                                          timeout_s=_SHARED_MEMORY_TIMEOUT_S)
    for nbytes in config.collective_bytes if shared is not None else ():
        full = torch.ones(max(1, nbytes // 4))
        sample = CollectiveSample(SHARED_MEMORY_KIND, world_size, full.numel() * 4,
                                  _slowest_rank_s(lambda full=full: shared(full), config, group))
        samples.append(sample)
        _say(config.progress and rank == 0, f"shared-memory all_reduce {sample.nbytes / 2**10:>9.1f} KiB over "
                                            f"{world_size} ranks: {sample.seconds * 1e6:>9.1f} us")
    return tuple(samples)


NETWORK_LARGEST_BYTES = 4 * 2**20
"""The network between hosts is measured up to at least this size (:func:`network_sizes`): a link shaped by a token
bucket passes a small transfer at the bucket's burst, faster than its rate, and the quick calibration's sizes (up to
1 MiB) fitted a 200 Mbit/s link at 248 Mbit/s, where a 4 MiB send took its rate's time (docs: Layouts on a two-host
network)."""

NETWORK_MIN_REPEATS = 9
"""Repeats (at least) of each collective between hosts: with one rank per host the samples are of 1 and 2 steps,
so the per-step latency comes from small differences between them, and one slow or fast repeat of three (the quick
calibration's) moved it from 0 to 440 µs between calibrations of the same link; nine cost a second or two more."""


SEND_BYTES = (2**20, NETWORK_LARGEST_BYTES)
"""The sizes of the one-way sends timed between the first two hosts (:func:`measure_sends`): large ones, whose line
is the link a send alone gets (``Hardware.inter_node_send``: its rate, and its latency or burst)."""

SEND_IDLE_S = 0.01
"""Seconds the link idles before each timed send, as it idles between a pipeline's stage sends (a stage's compute
apart): a shaped link's token bucket fills again meanwhile, and the send gets its burst as a stage's send does."""


def measure_sends(rank: int, config: CalibrationConfig, *, group: Any,
                  sizes: tuple[int, ...] = SEND_BYTES) -> tuple[CollectiveSample, ...]:
    """One-way sends of ``sizes`` bytes from ``group``'s rank 0 to its rank 1, the other ranks of ``group`` waiting:
    the link as a pipeline's and a hand-out's sends use it, one message in one direction at a time, where the
    collectives send both ways at once. Each repeat times one message after a barrier and :data:`SEND_IDLE_S` of
    idle link (sends back to back would stream through the sockets' buffers, faster than one message goes): the
    receiver's time from the barrier less the sender's idle time; the median over repeats."""
    samples = []
    for nbytes in sizes:
        buffer = torch.ones(nbytes // 4)
        times = []
        for _ in range(config.repeats + 1):  # the first repeat opens the pair's connection: not timed
            dist.barrier(group=group)
            start = time.perf_counter()
            if rank == 0:
                time.sleep(SEND_IDLE_S)
                times.append(-(time.perf_counter() - start))  # the idle time, taken off the receiver's below
                dist.send(buffer, group=group, group_dst=1)
            elif rank == 1:
                dist.recv(buffer, group=group, group_src=0)
                times.append(time.perf_counter() - start)
            else:
                times.append(0.0)
        received = torch.tensor(times[1:], dtype=torch.float64)
        dist.all_reduce(received, group=group)  # the receiver's time less the sender's idle, per repeat
        sample = CollectiveSample(SEND_KIND, 2, buffer.numel() * 4, statistics.median(received.tolist()))
        samples.append(sample)
        _say(config.progress and rank == 0, f"gloo send {sample.nbytes / 2**10:>9.1f} KiB from host 0 to host 1: "
                                            f"{sample.seconds * 1e6:>9.1f} us")
    return tuple(samples)


def network_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The collective sizes measured between hosts: ``sizes`` and :data:`NETWORK_LARGEST_BYTES` if none reaches it."""
    return sizes if max(sizes) >= NETWORK_LARGEST_BYTES else (*sizes, NETWORK_LARGEST_BYTES)


_SHARED_MEMORY_TIMEOUT_S = 300.0  # how long a rank waits for the others in a measured all-reduce


def _slowest_rank_s(call: Callable[[], Any], config: CalibrationConfig, group: Any = None) -> float:
    """Seconds per ``call`` on the slowest rank of ``group`` (None: the default group): the median over
    repeats, each after a barrier."""
    # min_time_s is per measurement; every rank must run the same number of calls, so the
    # count comes from the group's first rank's probe.
    call()
    start = time.perf_counter()
    call()
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.broadcast(probe, group=group, group_src=0)
    calls = max(1, math.ceil(config.min_time_s / max(float(probe.item()), 1e-9)))
    times = []
    for _ in range(config.repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def measure_rank(rank: int, world_size: int, config: CalibrationConfig, *, compute: bool = True,
                 collectives: bool = True) -> RankMeasurements:
    """Everything one rank measures; call it on every rank of an initialised gloo group.

    Compute is measured on all ranks at once, every timed repeat of a single op started at one moment on
    every rank (:func:`~autotp.calibration.graphs.median_work_s`). The number
    of torch threads is set to ``config.threads_for(world_size)`` while measuring and restored
    afterwards. ``compute=False`` measures only the links; ``collectives=False`` only compute (a
    group of one has no link). What is not measured is left empty (0.0). With ``compute``, the
    rank-local graphs of :mod:`autotp.calibration.graphs` are timed last, on every rank together.
    """
    threads = config.threads_for(world_size)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    progress = config.progress and rank == 0
    flops: dict[str, float] = {}
    bandwidth = floor = view = transcendental = 0.0
    cold: tuple[tuple[int, float], ...] = ()
    curve: tuple[tuple[int, float], ...] = ()
    gemms: tuple[GemmSample, ...] = ()
    graphs: tuple[GraphSample, ...] = ()
    op_fixed: tuple[tuple[str, float], ...] = ()
    element_rates: tuple[tuple[str, float], ...] = ()
    first_call: tuple[tuple[str, float], ...] = ()
    model_call = fair_share = 0.0
    busy: tuple[tuple[int, float], ...] = ()
    gemv_curve: tuple[tuple[int, float], ...] = ()
    try:
        if dist.is_initialized():
            dist.barrier()
        if compute:
            flops = _measure_matmuls(config, threads, progress)
            bandwidth = measure_copy_bytes_per_s(config)
            _say(progress, f"copy of {config.copy_bytes / 2**20:.0f} MiB: {bandwidth / 1e9:.2f} GB/s per rank")
            measured = dict(measure_copy_curve(config.bandwidth_working_sets, config.min_time_s, config.repeats))
            curve = tuple(sorted({**measured, 2 * (config.copy_bytes // 4) * 4: bandwidth}.items()))
            _say(progress, "copy bandwidth by working set: " + ", ".join(
                f"{size / 2**20:g} MiB {rate / 1e9:.1f} GB/s" for size, rate in curve))
            gemv_curve = measure_gemv_curve([size for size, _ in curve], config.min_time_s, config.repeats)
            _say(progress, "matrix-vector product's read by working set: " + ", ".join(
                f"{size / 2**20:g} MiB {rate / 1e9:.1f} GB/s" for size, rate in gemv_curve))
            if world_size > 1 and collectives:
                cold = tuple((size, measure_cold_call_s(world_size, size, config.repeats)) for size, _ in curve)
                _say(progress, "shared-memory collective after a stream of: " + ", ".join(
                    f"{size / 2**20:g} MiB +{seconds * 1e6:.1f} us" for size, seconds in cold))
            floor = measure_kernel_floor_s(config)
            _say(progress, f"tiny kernel op in a graph (1 element): {floor * 1e6:.2f} us")
            view = measure_view_op_s(config)
            _say(progress, f"view op in a graph (no kernel): {view * 1e6:.2f} us")
            gemms = tuple(measure_gemm_samples(config.gemm_width, config.gemm_tokens, config.min_time_s, config.repeats))
            transcendental, element_rates = measure_element_rates(
                config.transcendental_numel, config.min_time_s, config.repeats)
            _say(progress, f"transcendental elementwise: {transcendental * 1e9:.2f} ns per element (median); by op "
                 "(pooling per window element): "
                 + ", ".join(f"{name} {rate * 1e9:.2f}" for name, rate in element_rates))
            kernels = kernel_profile(flops, bandwidth, floor, view, gemms, transcendental, curve, element_rates,
                                     gemv_curve)
            op_fixed = measure_op_fixed_s(kernels, config.min_time_s, config.repeats)
            _say(progress, "fixed cost per call beyond the roofline: " + ", ".join(
                f"{family} {seconds * 1e6:.1f} us" for family, seconds in op_fixed))
            first_call = measure_first_call_s(config.graph_runs)
            _say(progress, "first call of a kernel in a graph's call, beyond back to back: " + ", ".join(
                f"{kind} {seconds * 1e6:.1f} us" for kind, seconds in first_call))
            model_call = measure_model_call_s(4 * config.graph_runs)  # a small difference: more runs
            _say(progress, f"a compiled model's call beyond its graph's: {model_call * 1e6:.1f} us")
        samples = measure_collectives(rank, world_size, config) if collectives and world_size > 1 else ()
        if compute:
            # the graphs' kernels priced without a floor: the fit charges it per kernel node, scaled
            kernels_only = dataclasses.replace(kernels, kernel_floor_s=0.0, op_fixed_s=op_fixed, first_call_s=first_call)
            graphs = measure_graphs(config.graph_shapes, kernels_only, config.graph_runs)
            fair_share = fair_core_share()  # the bound of every graph's share, and the share of a long compute
            for shape, sample in zip(config.graph_shapes, graphs):
                _say(progress, f"graph of {shape.layers} block(s), {shape.tokens} tokens x {shape.hidden}: "
                               f"{sample.kernel_nodes} kernels, {len(sample.collectives)} collectives, "
                               f"{sample.seconds * 1e3:.3f} ms (kernels {sample.device_s * 1e3:.3f} ms)")
            if world_size > 1 and dist.is_initialized():
                busy = measure_busy_scale(world_size, config.repeats)
                _say(progress, "compute time with k ranks of this machine busy, over all busy: " + ", ".join(
                    f"{k} {scale:.2f}" for k, scale in busy))
    finally:
        torch.set_num_threads(previous_threads)
    return RankMeasurements(rank, threads, flops, bandwidth, floor, view, samples, gemms, transcendental, graphs,
                            curve, cold, op_fixed, element_rates, first_call, model_call, fair_share, busy,
                            gemv_curve=gemv_curve)


def _measure_matmuls(config: CalibrationConfig, threads: int, progress: bool) -> dict[str, float]:
    """Best float32 matmul rate over ``config.matmul_sizes``; reduced-precision dtypes if meaningful."""
    float32_rates: dict[int, float] = {}
    for size in config.matmul_sizes:
        float32_rates[size] = measure_matmul_flops_per_s(torch.float32, size, config)
        _say(progress, f"matmul float32 {size}x{size}: {float32_rates[size] / 1e9:.2f} GFLOP/s per rank "
                       f"({threads} threads)")
    flops = {"float32": max(float32_rates.values())}
    size = min(config.matmul_sizes)
    for name in config.reduced_dtypes:
        rate = measure_matmul_flops_per_s(getattr(torch, name), size, config)
        ratio = rate / float32_rates[size]
        meaningful = ratio * MEANINGFUL_SLOWDOWN >= 1
        _say(progress, f"matmul {name} {size}x{size}: {rate / 1e9:.2f} GFLOP/s "
                       f"({ratio:.2f}x float32{'' if meaningful else '; emulated, left out'})")
        if meaningful:
            flops[name] = rate
    return flops


# ------------------------------------------------------------------------------ processes

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawned_rank(rank: int, world_size: int, init_method: str, config: CalibrationConfig,
                  compute: bool, collectives: bool, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        measured = measure_rank(rank, world_size, config, compute=compute, collectives=collectives)
        results.put(measured)
        dist.barrier()  # keep the group up until every rank has queued its result
    finally:
        dist.destroy_process_group()


def _run_spawned(world_size: int, config: CalibrationConfig, *, compute: bool,
                 collectives: bool) -> list[RankMeasurements]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.start_processes(_spawned_rank, args=(world_size, init_method, config, compute, collectives, results),
                                 nprocs=world_size, join=False, start_method="spawn")
    collected: list[RankMeasurements] = []
    while True:
        while not results.empty():
            collected.append(results.get())
        if context.join(timeout=0.1):  # every process has ended; a failed rank raises here
            break
    while not results.empty():
        collected.append(results.get())
    if len(collected) != world_size:
        raise RuntimeError(f"calibration: {len(collected)} of {world_size} ranks reported measurements")
    return sorted(collected, key=lambda m: m.rank)


def measure_links(world_size: int, config: CalibrationConfig) -> list[CollectiveSample]:
    """Collective samples across ``world_size`` (>= 2) fresh gloo processes, nothing else measured."""
    if world_size < 2:
        raise ValueError(f"a link needs world_size >= 2, got {world_size}")
    return list(_run_spawned(world_size, config, compute=False, collectives=True)[0].collectives)


def calibrate(world_size: int, *, config: CalibrationConfig | None = None, name: str = "cpu-calibrated") -> Hardware:
    """Measure this machine with ``world_size`` gloo processes and return the profile.

    ``world_size == 1`` measures compute in one process and the links across two.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}; e.g. world_size=2")
    config = config or CalibrationConfig()
    _say(config.progress, f"spawning {world_size} gloo process(es), "
                          f"{config.threads_for(world_size)} thread(s) each")
    compute = _run_spawned(world_size, config, compute=True, collectives=world_size > 1)
    if world_size > 1:
        links = list(compute[0].collectives)
    else:
        _say(config.progress, "one rank has no link: measuring gloo collectives across 2 processes")
        links = measure_links(2, config)
    profile = build_profile(compute, links, world_size=world_size, name=name)
    _say(config.progress, f"profile {profile.name!r}: float32 {profile.peak_tflops['float32'] * 1e3:.1f} GFLOP/s, "
                          f"memory {profile.memory_bandwidth_gbps:.1f} GB/s, floor {profile.kernel_floor_s * 1e6:.1f} us, "
                          f"view {profile.view_op_s * 1e6:.1f} us, "
                          f"gloo alpha {profile.intra_node.latency_s * 1e6:.1f} us + "
                          f"{profile.intra_node.base_latency_s * 1e6:.1f} us per call, "
                          f"{profile.intra_node.bandwidth_gbps:.2f} GB/s")
    return profile


# ------------------------------------------------------------------------------ a launcher's group, across hosts

def calibrate_launched(launch: Launch, *, config: CalibrationConfig | None = None, name: str = "cpu-calibrated",
                       host_profile: Hardware | None = None) -> Hardware | None:
    """Measure both links of a group a launcher started on several hosts (torchrun: ``--nnodes N
    --nproc-per-node R``) and return the two-level profile on rank 0 (None on the other ranks); call it on
    every rank, with no process group initialised (it meets the others through torch's ``env://`` rendezvous).

    1. *Compute, per machine*: the ranks under one kernel (hostname and boot id) bound to the same cores
       (:func:`~autotp.runtime.collectives.hosts.cpu_set`): the ranks that share cores, which is each host's on
       a real cluster, and on a cluster of network namespaces on one machine every rank, or each host's where
       the hosts are given cores of their own) form a group of their own and measure as :func:`calibrate` does with that many spawned
       processes, all in step. With ``host_profile`` (a profile measured on these hosts before) compute is not
       measured again: its terms are kept.
    2. *Inside each host*: the ranks of each launcher node (``LOCAL_WORLD_SIZE``) time gloo's collectives and the
       shared-memory all-reduce among themselves, every host at once: ``intra_node``.
    3. *Across hosts*: the first rank of each node (one rank per host, the others waiting) times the same
       collectives over the network, up to at least :data:`NETWORK_LARGEST_BYTES`, each the median of at least
       :data:`NETWORK_MIN_REPEATS`: ``inter_node`` (one device's link, its host's alone).

    ``devices_per_node`` is the launcher's ``LOCAL_WORLD_SIZE``.
    """
    config = config or CalibrationConfig()
    if launch.nodes < 2:
        raise ValueError(f"the launcher started {launch.world_size} rank(s) on one node: there is no network to "
                         "measure; start ranks on 2 or more nodes (torchrun --nnodes 2), or run `autotp calibrate "
                         "--world-size N` without a launcher")
    store, _, _ = next(dist.rendezvous("env://"))
    progress = config.progress and launch.rank == 0
    dist.init_process_group("gloo", store=dist.PrefixStore("autotp-calibrate/who/", store), rank=launch.rank,
                            world_size=launch.world_size)
    try:
        places: list[Any] = [None] * launch.world_size
        dist.all_gather_object(places, (launch.host.key, (*local_host().key, cpu_set())))
    finally:
        dist.destroy_process_group()
    nodes = [[rank for rank, (node, _) in enumerate(places) if node == key] for key in dict.fromkeys(p[0] for p in places)]
    machines = [[rank for rank, (_, kernel) in enumerate(places) if kernel == key]
                for key in dict.fromkeys(p[1] for p in places)]
    if len(nodes) != launch.nodes or any(len(ranks) != launch.local_world_size for ranks in nodes):
        raise RuntimeError(f"the launcher's variables describe {launch.nodes} node(s) of {launch.local_world_size} "
                           f"rank(s), but the ranks name these nodes: {nodes}; start one torchrun agent per node "
                           "(--nnodes, --node-rank) with the same --nproc-per-node")
    # 1. compute, the ranks of each machine in step
    machine = next(ranks for ranks in machines if launch.rank in ranks)
    measured = RankMeasurements(launch.rank, config.threads_for(len(machine)), {}, 0.0, 0.0, 0.0, ())
    if host_profile is None:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"autotp-calibrate/machine{machine[0]}/", store),
                                rank=machine.index(launch.rank), world_size=len(machine))
        try:
            _say(progress, f"{launch.nodes} hosts x {launch.local_world_size} rank(s), {len(machines)} machine(s): "
                           f"measuring compute on the {len(machine)} rank(s) of each machine")
            measured = dataclasses.replace(measure_rank(machine.index(launch.rank), len(machine), config),
                                           rank=launch.rank)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    # 2. and 3. the links: inside each host, then between hosts
    dist.init_process_group("gloo", store=dist.PrefixStore("autotp-calibrate/links/", store), rank=launch.rank,
                            world_size=launch.world_size)
    try:
        host_groups = [dist.new_group(ranks) for ranks in nodes]  # every rank creates every group, in one order
        firsts = [ranks[0] for ranks in nodes]
        network_group = dist.new_group(firsts)
        inside: tuple[CollectiveSample, ...] = ()
        if launch.local_world_size > 1:
            node = next(index for index, ranks in enumerate(nodes) if launch.rank in ranks)
            _say(progress, "measuring the links inside each host")
            inside = measure_collectives(nodes[node].index(launch.rank), launch.local_world_size, config,
                                         group=host_groups[node], host=launch.host)
        dist.barrier()
        network: tuple[CollectiveSample, ...] = ()
        if launch.rank in firsts:
            _say(progress, f"measuring the network between {len(firsts)} hosts (ranks {firsts})")
            steady = dataclasses.replace(config, repeats=max(config.repeats, NETWORK_MIN_REPEATS),
                                         collective_bytes=network_sizes(config.collective_bytes))
            network = measure_collectives(firsts.index(launch.rank), len(firsts), steady, group=network_group,
                                          host=launch.host)
            network += measure_sends(firsts.index(launch.rank), steady, group=network_group)
        everything: list[Any] = [None] * launch.world_size
        dist.all_gather_object(everything, (measured, inside))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if launch.rank != 0:
        return None
    host_links = [sample for _, samples in everything for sample in samples]  # every host's: one link class
    if host_profile is not None:
        return with_measured_links(host_profile, network, devices_per_node=launch.local_world_size, inside=host_links)
    compute = [m for m, _ in everything]
    # the graphs' collectives ran on each machine's group: its samples price them
    machine_links = [sample for m in compute if m.rank == machine[0] for sample in m.collectives]
    if not machine_links:
        _say(progress, "one rank per machine: measuring gloo collectives across 2 processes on this host")
        machine_links = measure_links(2, config)
    profile = build_profile(compute, machine_links, world_size=len(machine), name=name)
    same = machines == nodes  # each host its own machine: the machine's links are the host's
    return with_measured_links(profile, network, devices_per_node=launch.local_world_size,
                               inside=() if same else host_links)
