"""Per-call time: ``torch.compile(model, backend=autotp.backend(...))`` vs ``autotp.compile(model)``.

    python benchmarks/backend_vs_compile.py [--world-size 2] [--models llama gpt2] [--runtime-modes eager compiled]
                                            [--runs 50] [--warmup 5] [--layers 2] [--seq-len 16] [--threads T]

Spawns ``--world-size`` gloo processes on this machine. In each, for every model of
``tests/models.py`` (random weights, nothing downloaded), it makes the same model
tensor-parallel both ways, warms both up, then times them *interleaved*: run i calls the
autotp.compile module, then each backend variant, each call after a barrier. A call's time is the
slowest rank's; the figure is the median over ``--runs`` runs. The backend's figure includes
Dynamo's guard checks; the plan is the same as autotp.compile's (the collectives are checked
equal before timing). Threads per rank: ``--threads``, by default ``max(1, cores // world size)``.
Wall-clock on a possibly shared machine: compare the ratio, and run it on an idle machine.

It also prints the parameter bytes each variant holds per rank, and what the model object itself
still holds before and after the last backend's ``release_full_weights()``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = str(Path(__file__).resolve().parent.parent / "tests")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(fn: Any, args: tuple, kwargs: dict) -> float:
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        fn(*args, **kwargs)
    return time.perf_counter() - start


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind the model's parameters (a tied weight once)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def _max_error(got: Any, expected: Any) -> float:
    got = getattr(got, "logits", getattr(got, "last_hidden_state", got))
    expected = getattr(expected, "logits", getattr(expected, "last_hidden_state", expected))
    return (got - expected).abs().max().item()


def _rank(rank: int, world_size: int, init_method: str, options: argparse.Namespace, results: Any) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, TESTS)
    from models import BUILDERS

    import autotp

    torch.set_num_threads(options.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        for name in options.models:
            model, args, kwargs = BUILDERS[name](layers=options.layers, seq_len=options.seq_len)
            contenders: dict[str, Any] = {"autotp.compile": autotp.compile(model, world_size=world_size, example_inputs=args,
                                                                           example_kwargs=kwargs)}
            expected_counts = contenders["autotp.compile"].collective_counts()
            with torch.no_grad():
                expected = contenders["autotp.compile"](*args, **kwargs)
            memory = {"autotp.compile": contenders["autotp.compile"].parameter_bytes()}
            backends = {}
            for mode in options.runtime_modes:
                tp_backend = autotp.backend(world_size=world_size, runtime=autotp.RuntimeOptions(runtime_mode=mode))
                compiled = torch.compile(model, backend=tp_backend)
                with torch.no_grad():
                    compiled(*args, **kwargs)  # compile now, not inside the timed runs
                counts = tp_backend.collective_counts()
                if counts != expected_counts:
                    raise RuntimeError(f"{name}: backend collectives {counts} != autotp.compile's {expected_counts}")
                label = f"backend runtime_mode={mode}"
                contenders[label] = compiled
                backends[label] = tp_backend
                memory[label] = tp_backend.stats.parameter_bytes
            times: dict[str, list[float]] = {label: [] for label in contenders}
            for _ in range(options.warmup):
                for fn in contenders.values():
                    _timed(fn, args, kwargs)
            for _ in range(options.runs):
                for label, fn in contenders.items():
                    times[label].append(_timed(fn, args, kwargs))
            model_bytes = _storage_bytes(model)
            # Last: free the full weights of split parameters (the model is unusable eagerly after this).
            last_label, last_backend = list(backends.items())[-1]
            last_backend.release_full_weights()
            with torch.no_grad():
                error = _max_error(contenders[last_label](*args, **kwargs), expected)
            released = (_storage_bytes(model), error)
            for label, values in times.items():
                slowest = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a call takes as long as its slowest rank
                if rank == 0:
                    results.put((name, label, statistics.median(slowest.tolist()), memory[label], model_bytes,
                                 released if label == last_label else None))
            torch._dynamo.reset()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2", "bert"])
    parser.add_argument("--runtime-modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    options = parser.parse_args()
    if options.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {options.world_size}")
    if options.threads is None:
        options.threads = max(1, (os.cpu_count() or 1) // options.world_size)
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_rank, args=(options.world_size, init_method, options, results), nprocs=options.world_size,
                       start_method="spawn")
    rows = [results.get() for _ in range(len(options.models) * (1 + len(options.runtime_modes)))]
    print(f"world size {options.world_size}, {options.layers} layers, batch 2 x seq {options.seq_len}, "
          f"{options.threads} thread(s) per rank; median of {options.runs} interleaved runs, slowest rank per run")
    print(f"{'model':<8} {'variant':<24} {'per call (ms)':>14} {'vs autotp.compile':>18} {'param MiB/rank':>15} "
          f"{'of model':>9}")
    baseline = {name: t for name, label, t, *_ in rows if label == "autotp.compile"}
    for name, label, seconds, held, model_bytes, _ in rows:
        print(f"{name:<8} {label:<24} {seconds * 1e3:>14.3f} {seconds / baseline[name]:>17.2f}x "
              f"{held / 2**20:>15.2f} {held / model_bytes:>9.1%}")
    print("\nparameter MiB/rank: shards plus whole (replicated) parameters each variant holds; the model object")
    print("still owns its full weights until the backend's release_full_weights() frees the split ones:")
    for name, label, _, held, model_bytes, released in rows:
        if released is not None:
            left, error = released
            print(f"  {name}: model weights {model_bytes / 2**20:.2f} MiB -> {left / 2**20:.2f} MiB after "
                  f"release_full_weights(); rank holds {(left + held) / 2**20:.2f} MiB in all "
                  f"({(left + held) / model_bytes:.1%}); {label} still matches (max |diff| {error:.1e})")


if __name__ == "__main__":
    main()
