"""What a compiled model's call costs right after a wait, against back to back (world size 1, this CPU).

    python benchmarks/call_after_wait.py [--models mlp bert] [--runs 60]

For each tiny model of ``tests/models.py``, compile it at world size 1 (a gloo group of one) and time, on the work
clock (this thread's CPU time), one call after an untimed call of itself and, between the two, nothing (back to
back), a ``dist.barrier()``, a 0.3 / 1 / 3 ms ``time.sleep`` or a 0.5 ms spin; the median of ``--runs``. Under each
model's row, what its call takes beyond its rank-local graph's call with the same inputs
(``compiled.graph_inputs``), timed the same way, the median of the difference per run: the work
``Hardware.model_call_s`` prices (``autotp.calibration.model_call``).

Why: every timed call of the calibration and of ``cost_model_accuracy.py`` follows a common start (a barrier and
a sleep), and a rank of a model with collectives sleeps in them; if a call after the thread gave its core away
costs more work than one back to back (caches and branch predictors refilled after other threads ran), that cost
is part of what those timings measure and of what the profile's per-call and per-kernel terms must price.
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = str(Path(__file__).resolve().parent.parent / "tests")


def _spin(seconds: float) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return spin


def _work_after_us(call: Callable[[], object], between: Callable[[], object], runs: int) -> float:
    """Median microseconds of work of ``call`` right after ``call(); between()``."""
    samples = []
    with torch.no_grad():
        for _ in range(runs):
            call()
            between()
            start = time.thread_time()
            call()
            samples.append(time.thread_time() - start)
    return statistics.median(samples) * 1e6


def _extra_after_us(call: Callable[[], object], bare: Callable[[], object], between: Callable[[], object],
                    runs: int) -> float:
    """Median microseconds of work ``call`` takes beyond ``bare`` per run, each timed right after an untimed call
    of itself and ``between()`` (the difference per run: the load moves between runs)."""
    return statistics.median(_work_after_us(call, between, 1) - _work_after_us(bare, between, 1)
                             for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "bert"])
    parser.add_argument("--runs", type=int, default=60)
    options = parser.parse_args()
    sys.path.insert(0, TESTS)
    warnings.simplefilter("ignore")
    from models import BUILDERS

    import autotp

    torch.set_num_threads(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    waits = {"back to back": lambda: None, "barrier": dist.barrier, "sleep 0.3 ms": lambda: time.sleep(3e-4),
             "sleep 1 ms": lambda: time.sleep(1e-3), "sleep 3 ms": lambda: time.sleep(3e-3),
             "spin 0.5 ms": _spin(5e-4)}
    try:
        print(f"{'model':<6} " + " ".join(f"{name:>13}" for name in waits) + "   (us of work per call)")
        for name in options.models:
            model, args, kwargs = BUILDERS[name]()
            compiled = autotp.compile(model, world_size=1, example_inputs=args, example_kwargs=kwargs)
            call = functools.partial(compiled, *args, **kwargs)
            times = [_work_after_us(call, between, options.runs) for between in waits.values()]
            print(f"{name:<6} " + " ".join(f"{seconds:>13.0f}" for seconds in times), flush=True)
            values, graph = compiled.graph_inputs(*args, **kwargs), compiled.graph_module
            extras = [_extra_after_us(call, functools.partial(graph, *values), between, options.runs)
                      for between in waits.values()]
            print(f"{'':<6} " + " ".join(f"{seconds:>+13.0f}" for seconds in extras)
                  + "   the model's call beyond its graph's", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
