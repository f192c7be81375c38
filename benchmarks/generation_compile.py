"""Time to compile a causal LM for generation in a group of gloo ranks, against a baseline of the code before.

    python benchmarks/generation_compile.py [--world-size 2] [--layers 2 8] [--rounds 3] [--baseline per-rank|whole] [--int8]

A generation compile (``autotp.compile(model, example_inputs=(ids,), max_cache_len=N)``) traces three graphs
(prefill, continuation, decode) that write a KV cache in place, and a graph that writes in place is
functionalized (``ExportedProgram.run_decompositions``: the whole program traced again). The first rank traces for
its group (``autotp.runtime.agreement.shared_trace``); since ``autotp.capture.tracing._functional`` it functionalizes the program
before it sends it, so the other ranks receive the functional form. The baseline, run side by side in the same
processes, sends the program as exported and every rank functionalizes its copy (the code before).
``--baseline whole``: the baseline exports and functionalizes every layer instead of stamping the graphs of a
model of four or more layers from three (:mod:`autotp.capture.stamping`; the code before stamping took generation graphs).
``--int8``: the model's Linears quantized with torchao's int8 weight-only config; ``--baseline per-rank`` is then the
code before for such a model (exported whole and functionalized by every rank: its stamping needs the functional form).
Tiny Llama (hidden 256, 8 heads, 4 kv heads), batch 2, prompt 6, a 12-slot cache, one torch thread per rank. Prints,
per number of layers, the median over rounds of the group's wall time and of the CPU seconds all ranks spent, both
ways, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autotp.cli.demo_ranks import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _compile_s(layers: int, baseline: str | None, int8: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one generation compile on this rank (after a barrier); ``baseline``: None (as
    built), ``"per-rank"`` or ``"whole"`` (see the module docstring)."""
    from models import tiny_llama

    import autotp
    import autotp.capture.stamping as stamping_module
    import autotp.capture.tracing as capture_module

    model, (ids,), _ = tiny_llama(batch=2, seq_len=6, layers=layers)
    if int8:
        import torchao.quantization as tq

        tq.quantize_(model, tq.Int8WeightOnlyConfig())
    functional, stamped = capture_module._functional, stamping_module.export_stamped
    if baseline == "per-rank":
        capture_module._functional = lambda exported: exported  # every rank functionalizes in from_exported
    elif baseline == "whole":
        stamping_module.export_stamped = lambda *_: None  # every layer exported and functionalized
    try:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        autotp.compile(model, example_inputs=(ids,), max_cache_len=12)
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        capture_module._functional, stamping_module.export_stamped = functional, stamped


def _rank(rank: int, world_size: int, port: int, layers: list[int], rounds: int, baseline: str, int8: bool,
          queue: mp.Queue) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _compile_s(2, None, int8)  # warm-up: imports and the first export of the process
    for count in layers:
        for _ in range(rounds):
            for built in (True, False):
                wall, cpu = _compile_s(count, None if built else baseline, int8)
                queue.put((count, built, rank, wall, cpu))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", choices=["per-rank", "whole"], default="per-rank")
    parser.add_argument("--int8", action="store_true", help="torchao int8 weight-only Linears")
    options = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, options.world_size, port, options.layers, options.rounds,
                                                        options.baseline, options.int8, queue))
             for r in range(options.world_size)]
    for process in ranks:
        process.start()
    samples: dict[tuple[int, bool, int], list[tuple[float, float]]] = {}
    for _ in range(options.world_size * len(options.layers) * options.rounds * 2):
        count, first, rank, wall, cpu = queue.get()
        samples.setdefault((count, first, rank), []).append((wall, cpu))
    for process in ranks:
        process.join()
    print(f"tp {options.world_size}, tiny Llama, medians of {options.rounds} rounds: the group's wall time (its "
          f"slowest rank) and the CPU seconds of all ranks")
    print(f"as built against the baseline {options.baseline!r}" + (", int8 weight-only" if options.int8 else ""))
    print(f"{'layers':>6} {'wall':>10} {'wall, baseline':>15} {'ratio':>6} {'CPU':>10} "
          f"{'CPU, baseline':>14} {'ratio':>6}")
    for count in options.layers:
        figures = {}
        for built in (True, False):
            rounds = zip(*(samples[count, built, r] for r in range(options.world_size)), strict=True)
            per_round = [(max(w for w, _ in ranks), sum(c for _, c in ranks)) for ranks in rounds]
            figures[built] = (statistics.median(w for w, _ in per_round), statistics.median(c for _, c in per_round))
        (wall, cpu), (wall_base, cpu_base) = figures[True], figures[False]
        print(f"{count:>6} {wall:>9.2f}s {wall_base:>14.2f}s {wall / wall_base:>6.2f} {cpu:>9.2f}s "
              f"{cpu_base:>13.2f}s {cpu / cpu_base:>6.2f}")


if __name__ == "__main__":
    main()
