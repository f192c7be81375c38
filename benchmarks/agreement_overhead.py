"""Per-call cost of the call-time agreement checks of a ``TensorParallelModule``.

    python benchmarks/agreement_overhead.py [--world-size 2] [--model llama] [--calls 300]

Spawns ``--world-size`` gloo processes (the shared pool of ``tests/distributed.py``). Each
compiles a tiny model of ``tests/models.py`` with ``autotp.compile`` and times, interleaved,
``--calls`` forward passes with the input guard (traced non-tensor values compared, the input
shape signature looked up among the ones already agreed) and the same number with the guard
removed, after warm-up. Printed (rank 0, medians): a forward pass with and without the guard and
their ratio; the guard's own steady-state check; and the one exchange a *new* shape signature
costs (through the process group's store). Wall-clock on a possibly shared machine: read the ratio.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import run_on_ranks, shutdown_all  # noqa: E402


def _measure(rank: int, world_size: int, model_name: str, calls: int) -> dict[str, float]:
    import torch
    from models import BUILDERS

    import autotp

    model, args, kwargs = BUILDERS[model_name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs)
    guard = tp._guard
    for _ in range(5):
        tp(*args, **kwargs)
    with_guard, without_guard, check_only = [], [], []
    flat = tp._flatten_inputs(args, kwargs)
    for _ in range(calls):
        tp._guard = guard
        started = time.perf_counter()
        tp(*args, **kwargs)
        with_guard.append(time.perf_counter() - started)
        tp._guard = None
        started = time.perf_counter()
        tp(*args, **kwargs)
        without_guard.append(time.perf_counter() - started)
        started = time.perf_counter()
        guard.check(flat)
        check_only.append(time.perf_counter() - started)
    tp._guard = guard
    new_signature = []
    for _ in range(20):  # a fresh guard has agreed on nothing: its first check exchanges the signature
        fresh_guard = copy.copy(guard)
        fresh_guard._checked = set()
        started = time.perf_counter()
        fresh_guard.check(flat)
        new_signature.append(time.perf_counter() - started)
    torch.distributed.barrier()
    return {
        "with_guard_s": statistics.median(with_guard),
        "without_guard_s": statistics.median(without_guard),
        "check_s": statistics.median(check_only),
        "new_signature_s": statistics.median(new_signature),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="llama", help="a name of tests/models.py BUILDERS (default: llama)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per variant")
    args = parser.parse_args(argv)
    try:
        results = run_on_ranks(args.world_size, _measure, args.model, args.calls, timeout_s=900)
    finally:
        shutdown_all()
    first = results[0]
    ratio = first["with_guard_s"] / first["without_guard_s"]
    print(f"model {args.model}, tp={args.world_size}, {args.calls} calls per variant (rank 0, medians)")
    print(f"  forward with the input guard     {first['with_guard_s'] * 1e3:9.3f} ms")
    print(f"  forward without it               {first['without_guard_s'] * 1e3:9.3f} ms")
    print(f"  ratio with / without             {ratio:9.3f}")
    print(f"  guard check alone (steady state) {first['check_s'] * 1e6:9.1f} us")
    print(f"  first call of a new shape (one exchange) {first['new_signature_s'] * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
