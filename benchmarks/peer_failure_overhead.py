"""Per-call cost of telling the ranks about a failed peer (``autotp/runtime/agreement/peer_failure.py``) on the happy path.

    python benchmarks/peer_failure_overhead.py [--world-size 2] [--calls 300]

Spawns ``--world-size`` gloo processes (the shared pool of ``tests/distributed.py``). Each compiles a tiny MLP
and times, interleaved after warm-up, ``--calls`` decode-like forward passes (batch 1, one token) with the
failure notes (a call counter, a ``try``) and with them removed; then, on 2 KiB, gloo's functional
reduce-scatter and its wait against the watched form the inference graphs use now (the same collective with
``async_op=True``, waited on with a timeout). Printed (rank 0, medians, microseconds) with their ratios.
Wall-clock on a possibly shared machine: read the ratios.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import run_on_ranks, shutdown_all  # noqa: E402


def _measure(rank: int, world_size: int, calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn

    import autotp
    from autotp.runtime.agreement.peer_failure import failure_notes
    from autotp.runtime.collectives.watched_collectives import WatchedCollective

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    x = torch.randn(1, 1, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(torch.randn(2, 4, 64),))
    notes = tp._notes
    for _ in range(10):
        tp(x)
    with_notes, without_notes = [], []
    for _ in range(calls):
        tp._notes = notes
        started = time.perf_counter()
        tp(x)
        with_notes.append(time.perf_counter() - started)
        tp._notes = None
        started = time.perf_counter()
        tp(x)
        without_notes.append(time.perf_counter() - started)
    tp._notes = notes

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD
    piece = torch.randn(512 * world_size)  # 2 KiB per rank after the scatter
    watched = WatchedCollective("reduce_scatter", ("sum", world_size, group.group_name), group,
                                failure_notes(None, timeout_s=300.0), torch.zeros(1))
    functional_s, watched_s = [], []
    for _ in range(calls):
        started = time.perf_counter()
        c10d.wait_tensor(c10d.reduce_scatter_tensor(piece, "sum", world_size, group.group_name))
        functional_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        watched(piece)
        watched_s.append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1e6 for name, values in (
        ("forward_with_notes_us", with_notes), ("forward_without_notes_us", without_notes),
        ("functional_reduce_scatter_us", functional_s), ("watched_reduce_scatter_us", watched_s))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    try:
        result = run_on_ranks(args.world_size, _measure, args.calls)[0]
    finally:
        shutdown_all()
    print(f"tp={args.world_size}, medians of {args.calls} interleaved calls (rank 0):")
    print(f"  decode-like forward: {result['forward_with_notes_us']:.1f} us with the failure notes, "
          f"{result['forward_without_notes_us']:.1f} us without "
          f"({result['forward_with_notes_us'] / result['forward_without_notes_us']:.2f}x)")
    print(f"  reduce-scatter of 2 KiB per rank: {result['watched_reduce_scatter_us']:.1f} us watched, "
          f"{result['functional_reduce_scatter_us']:.1f} us functional "
          f"({result['watched_reduce_scatter_us'] / result['functional_reduce_scatter_us']:.2f}x)")


if __name__ == "__main__":
    main()
