"""What one rank's work costs when the other cores work too: one process alone against two at once.

Two processes (one torch thread each) time the same op on the work clock (each thread's CPU time), in rounds:
once both at the same moment, once process 0 alone while process 1 waits, in turn, so that a slow stretch of the
machine falls on both. Ops: a float32 ``linear`` of ``(512, 1024) @ (1024, 1024)^T`` (compute-bound), a small one
``(32, 256) @ (256, 688)^T``, a chain of one-element ``add`` / ``view`` / ``transpose`` (host-bound), and
``dst.copy_(src)`` over working sets from 0.5 to 32 MiB (cache and memory), and with ``--models`` the forward of
each family named (``benchmarks/cost_model_families.py``: the accuracy benchmark's models, as
``torch.export`` captures them, so the same ATen graph a rank-local module runs). Prints per op the median
microseconds per call alone and with both busy, and their ratio: where it is above 1 the cores share something
(memory bandwidth, a cache level, a physical core behind two virtual ones), and a calibration must time that op on
every rank at once, as a plan's ranks run (``autotp.calibration.graphs.median_work_s`` does). Usage::

    python benchmarks/core_contention.py [--rounds 6] [--seconds 0.25] [--models llama gpt2 ...]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import time
from collections.abc import Callable

COPY_WORKING_SETS_MIB = (0.5, 2, 8, 32)
OPS = ("linear 512x1024x1024", "linear 32x256x688", "60 one-element ops",
       *(f"copy over {mib:g} MiB" for mib in COPY_WORKING_SETS_MIB))
"""The ops timed, in the order printed."""


def _forward(family: str) -> Callable[[], object]:
    """The family's forward as ``torch.export`` captures it (its ATen graph), called without autograd."""
    import torch
    from cost_model_families import build

    model, args, kwargs = build(family)
    module = torch.export.export(model, args, kwargs, strict=False).module()

    def call() -> object:
        with torch.no_grad():
            return module(*args, **kwargs)

    return call


def _ops(models: tuple[str, ...] = ()) -> dict[str, Callable[[], object]]:
    """The calls of :data:`OPS` and of the ``models``' forwards, by name (built in the process that times them)."""
    import torch

    torch.set_num_threads(1)
    aten = torch.ops.aten
    big_x, big_w, big_b = torch.randn(512, 1024), torch.randn(1024, 1024), torch.randn(1024)
    small_x, small_w, small_b = torch.randn(32, 256), torch.randn(688, 256), torch.randn(688)
    one = torch.ones(1, 1)

    def chain() -> object:
        value = one
        for _ in range(20):
            value = aten.transpose.int(aten.view.default(aten.add.Tensor(value, value), [1, 1]), 0, 1)
        return value

    calls: list[Callable[[], object]] = [lambda: aten.linear.default(big_x, big_w, big_b),
                                         lambda: aten.linear.default(small_x, small_w, small_b), chain]
    for mib in COPY_WORKING_SETS_MIB:
        src = torch.ones(int(mib * 2**20) // 8)  # half the working set each, float32
        calls.append(functools.partial(torch.Tensor.copy_, torch.empty_like(src), src))
    return {**dict(zip(OPS, calls, strict=True)), **{f"{family} forward": _forward(family) for family in models}}


def _worker(index: int, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue,
            rounds: int, seconds: float, models: tuple[str, ...]) -> None:
    import warnings

    warnings.simplefilter("ignore")
    ops = _ops(models)
    for call in ops.values():
        for _ in range(20):
            call()
    for _ in range(rounds):
        for name, call in ops.items():
            for both in (True, False):
                barrier.wait()
                if index == 0 or both:
                    calls, work_started, wall_started = 0, time.thread_time(), time.perf_counter()
                    while time.perf_counter() - wall_started < seconds:
                        call()
                        calls += 1
                    if index == 0:
                        results.put((name, both, (time.thread_time() - work_started) / calls))
                if not both:
                    barrier.wait()  # process 1 waits out process 0's loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every op, alone and both (default 6)")
    parser.add_argument("--seconds", type=float, default=0.25, help="seconds each timed loop runs (default 0.25)")
    parser.add_argument("--models", nargs="*", default=[],
                        help="families whose forward is timed too (names of benchmarks/cost_model_families.py)")
    args = parser.parse_args()
    names = (*OPS, *(f"{family} forward" for family in args.models))
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_worker, args=(i, barrier, results, args.rounds, args.seconds, tuple(args.models)))
               for i in range(2)]
    for worker in workers:
        worker.start()
    samples: dict[tuple[str, bool], list[float]] = {}
    expected = args.rounds * len(names) * 2
    for _ in range(expected):
        name, both, seconds = results.get()
        samples.setdefault((name, both), []).append(seconds)
    for worker in workers:
        worker.join()
    print(f"two processes, one thread each; medians of {args.rounds} rounds, work clock (process 0)")
    print(f"{'op':24s} {'alone us':>10s} {'both us':>10s} {'both/alone':>10s}")
    for name in names:
        alone, both = statistics.median(samples[name, False]), statistics.median(samples[name, True])
        print(f"{name:24s} {alone * 1e6:10.1f} {both * 1e6:10.1f} {both / alone:10.2f}")


if __name__ == "__main__":
    main()
