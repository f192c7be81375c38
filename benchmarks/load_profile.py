"""Where ``autotp.from_pretrained``'s time goes: timing spans per stage, per rank, in fresh processes.

    python benchmarks/load_profile.py [--world-size 2] [--layers 16] [--dir DIR] [--cache cold|warm|off]

Writes (or reuses) the random Llama checkpoint of ``benchmarks/load.py``, then starts ``--world-size``
processes with torchrun's environment variables, each calling ``autotp.from_pretrained`` once, and
prints the seconds spent in each stage (wall clock, rank 0 and the largest rank):

config (``AutoConfig``), meta build (the model on ``meta``), capture (``torch.export`` + turning the
program into a CapturedGraph, or reading it from the trace cache; a rank that waits for rank 0's
program counts the wait here), agreement (ranks compare graphs
and options), headers (safetensors headers), strategies, cost, solve, plan data (rank 0 plans; the
other ranks wait for its plan), rewrite (the rank-local graph), reads (this rank's blocks), the rest.

The spans are measured by wrapping the stage functions where ``autotp`` calls them (this process
only; the library is unchanged). ``--cache cold`` starts from an empty ``AUTOTP_CACHE_DIR``,
``warm`` runs once to fill it and then measures, ``off`` sets ``AUTOTP_CACHE=0``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load import CONFIG, SEQ_LEN, _free_port, write_checkpoints  # noqa: E402

SPANS = [  # (label, module, attribute): the function autotp calls for that stage, where it looks it up
    ("config", "transformers", "AutoConfig.from_pretrained"),
    ("capture", "autotp.driver", "capture"),
    ("  export", "autotp.capture.tracing", "_export"),
    ("  trace cache key", "autotp.capture.trace_cache", "trace_key"),
    ("  trace cache read", "autotp.capture.trace_cache", "_read_entry"),
    ("  trace cache rebuild", "autotp.capture.trace_cache", "_rebuild"),
    ("  trace cache write", "autotp.capture.trace_cache", "_entry"),
    ("  trace cache write file", "autotp.capture.trace_cache", "_write_payload"),
    ("agreement record", "autotp.driver", "compile_record"),
    ("headers", "autotp.driver", "open_checkpoint"),
    ("plan (rank 0 plans, others wait)", "autotp.runtime.execution.applying", "plan_on_first_rank"),
    ("  cached plan read", "autotp.planning.plan_cache", "cached_plan"),
    ("  strategies", "autotp.planning.planner", "build_strategy_graph"),
    ("  cost", "autotp.planning.planner", "cost_strategy_graph"),
    ("  solve", "autotp.planning.planner", "solve"),
    ("  plan data", "autotp.planning.planner", "_build_plan"),
    ("  cached plan write (after sending)", "autotp.planning.plan_cache", "store_plan"),
    ("rewrite", "autotp.runtime.execution.applying", "rewrite_for_rank"),
    ("reads", "autotp.runtime.execution.applying", "read_local_values"),
    ("module", "autotp.driver", "TensorParallelModule"),
]


def _wrap(totals: dict[str, float], label: str, module_name: str, attribute: str) -> None:
    import importlib

    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - started

    static = isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name), (classmethod, staticmethod))
    setattr(owner, name, staticmethod(timed) if static else timed)  # a bound classmethod stays bound


def worker(path: str) -> None:
    """One rank: warm up imports, then one timed ``from_pretrained``; prints one JSON line."""
    import torch
    import torch.distributed as dist
    import transformers

    import autotp

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        warm = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **CONFIG))
    autotp.plan(warm, (ids,), {"use_cache": False}, world_size=world_size)  # imports, not counted
    totals: dict[str, float] = {}
    for label, module_name, attribute in SPANS:
        _wrap(totals, label, module_name, attribute)
    dist.barrier()
    started = time.perf_counter()
    tp = autotp.from_pretrained(path, world_size=world_size, example_inputs=(ids,))
    totals["total"] = time.perf_counter() - started
    del tp
    print(json.dumps({"rank": rank, **totals}), flush=True)
    dist.destroy_process_group()


def run(path: Path, world_size: int, env_extra: dict[str, str]) -> list[dict]:
    port = str(_free_port())
    processes = []
    for rank in range(world_size):
        env = {**os.environ, **env_extra, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        processes.append(subprocess.Popen([sys.executable, __file__, "--worker", str(path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, process in enumerate(processes):
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"rank {rank} exited with {process.returncode}:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--layout", default="single-file", choices=["single-file", "sharded"])
    parser.add_argument("--cache", default="cold", choices=["cold", "warm", "off"])
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints are (default: a temp dir)")
    parser.add_argument("--worker", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    directory = args.dir or Path(tempfile.mkdtemp(prefix="autotp-load-"))
    path = write_checkpoints(directory, args.layers)[args.layout]
    cache_dir = tempfile.mkdtemp(prefix="autotp-cache-")
    env = {"AUTOTP_CACHE_DIR": cache_dir}
    if args.cache == "off":
        env["AUTOTP_CACHE"] = "0"
    runs = [("cold", run(path, args.world_size, env))] if args.cache == "warm" else []
    runs.append((args.cache, run(path, args.world_size, env)))
    for cache, results in runs:
        _print(results, f"{args.layers} layers, {args.layout}, world size {args.world_size}, trace cache {cache}")


def _print(results: list[dict], title: str) -> None:
    labels = list(dict.fromkeys(label for label, *_ in SPANS if any(label in r for r in results)))
    total = {r["rank"]: r["total"] for r in results}
    print(f"autotp.from_pretrained, {title}: seconds per stage, by rank (share of rank 0's total)")
    for label in [*labels, "total"]:
        values = [r.get(label, 0.0) for r in results]
        print(f"  {label:<34} " + " ".join(f"{v:8.2f}" for v in values) + f"   {values[0] / total[0]:6.1%}")
    known = sum(results[0].get(label, 0.0) for label in labels if not label.startswith("  "))
    print(f"  {'rest (meta build, agreement, ...)':<34} {total[0] - known:8.2f}   {(total[0] - known) / total[0]:6.1%}",
          flush=True)


if __name__ == "__main__":
    main()
