"""A decode step's matmuls on the CPU: the GEMM against the multiply-and-sum the compiled decode graph uses.

The weights of one tp-sharded decode step of the 8-layer Llama of ``benchmarks/runtime_modes.py`` (hidden 512,
8 query / 4 kv heads, intermediate 1024, vocab 8000; each of ``--tp`` ranks holds ``1/tp`` of every weight in
``nn.Linear``'s ``(out, in)`` layout), multiplied by ``ROWS x in`` activations for each ``--rows``, in
``--processes`` processes at once (one thread each, as the ranks of a gloo run share the machine), each form
compiled by Inductor as one graph:

- ``gemm``: ``linear(x, weight)`` (Inductor calls the library GEMM);
- ``summed``: one row through :func:`autotp.runtime.execution.runtime_modes.one_row_linear` (the multiply-and-sum the
  compiled decode graph uses); more rows through an output-major multiply-and-sum
  (``(weight.unsqueeze(1) * x).sum(-1).t()``: each weight row read once for every row of ``x``), which is as
  fast here but which the decode graph does not use: there Inductor stores its output transposed and the
  next layer's sum reads its weight one element at a time.

Prints the median ms of one step's matmuls per form and rows (of ``--repeats`` calls), the bytes per second of
weight read, and ``summed / gemm``. Usage::

    OMP_NUM_THREADS=1 python benchmarks/decode_matmul.py --rows 1,2,4,8,16 --processes 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from autotp.runtime.execution.runtime_modes import one_row_linear

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 8, 512, 8, 4, 8000


def _weights(tp: int) -> list[torch.Tensor]:
    """One rank's ``(out, in)`` weights of a decode step: per layer q, k, v, o, gate, up, down; then the LM head."""
    head_dim, intermediate = HIDDEN // HEADS, 2 * HIDDEN
    q, kv = HIDDEN // tp, KV_HEADS * head_dim // tp
    layer = [(q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, q),
             (intermediate // tp, HIDDEN), (intermediate // tp, HIDDEN), (HIDDEN, intermediate // tp)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(out, inp, generator=generator) for out, inp in layer * LAYERS + [(VOCAB // tp, HIDDEN)]]


def _summed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 1:
        return one_row_linear(x, weight)
    return (weight.unsqueeze(1) * x).sum(-1).t()


def _step(form: str) -> Any:
    linear = torch.nn.functional.linear if form == "gemm" else _summed

    def step(activations: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
        return [linear(activations[w.shape[1]], w) for w in weights]
    return torch.compile(step, fullgraph=True)


def _worker(index: int, args: argparse.Namespace, results: Any, barrier: Any) -> None:
    torch.set_num_threads(1)
    weights = _weights(args.tp)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = {}
    for rows in args.rows:
        activations = {size: torch.randn(rows, size) for size in {w.shape[1] for w in weights}}
        for form in ("gemm", "summed"):
            step = _step(form)
            with torch.no_grad():
                for _ in range(3):
                    step(activations, weights)
                barrier.wait()  # every process compiled: the timed calls overlap
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    step(activations, weights)
                    times.append(time.perf_counter() - started)
            out[rows, form] = statistics.median(times)
    results[index] = (nbytes, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="activation rows (batch of a decode step), comma-separated")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size the weights are sharded for")
    parser.add_argument("--processes", type=int, default=2, help="processes timing at once (one thread each)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    manager = mp.Manager()
    results, barrier = manager.dict(), manager.Barrier(args.processes)
    mp.start_processes(_worker, args=(args, results, barrier), nprocs=args.processes, start_method="spawn")
    nbytes = results[0][0]
    print(f"tp {args.tp} decode step: {nbytes / 2**20:.1f} MiB of weights, {args.processes} processes at once")
    print("| rows | gemm ms | summed ms | gemm GB/s | summed GB/s | summed / gemm |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        gemm = statistics.median(results[i][1][rows, "gemm"] for i in range(args.processes))
        summed = statistics.median(results[i][1][rows, "summed"] for i in range(args.processes))
        print(f"| {rows} | {gemm * 1e3:.2f} | {summed * 1e3:.2f} | {nbytes / gemm / 1e9:.1f} | "
              f"{nbytes / summed / 1e9:.1f} | {summed / gemm:.2f} |")


if __name__ == "__main__":
    main()
