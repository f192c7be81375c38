"""Loading a model bigger than one rank should hold: autotp vs transformers' native TP vs one process.

    python benchmarks/load.py [--world-sizes 2 4] [--layers 16] [--repeats 3] [--dir DIR] [--modes ...]
                              [--baseline CHECKOUT] [--profile DIR]

Writes a random LlamaForCausalLM (hidden 1024, intermediate 2816, 8 heads / 4 kv heads, vocab
32000, ``--layers`` layers: 1.09 GB of float32 at 16 layers) with ``save_pretrained``, once as one
safetensors file and once sharded (200 MB files + ``model.safetensors.index.json``). Then, for
every world size, file layout and loader, it starts fresh processes with torchrun's environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and in each measures:

- growth of the peak resident set (Linux VmHWM minus VmRSS just before loading), per rank, after
  the load call and again after one forward pass (transformers maps the files and leaves weights
  it does not copy on disk until a forward touches them; autotp copies each rank's blocks);
- wall-clock time of the load call (for autotp it includes tracing and planning);
- that the weights really are split: parameter bytes held by the rank (transformers' TP holds
  DTensors: their local shards are counted). A run in which some rank holds the whole model is
  reported as "NOT SPLIT";
- for autotp, the wall-clock time of the first ``tp.generate(ids, max_new_tokens=2)``, which builds the
  generation graphs from the checkpoint (traced, or read from the trace cache when warm) and plans them.

Loaders: ``autotp-cold`` = ``autotp.from_pretrained(path, world_size)`` with an empty trace cache
(``AUTOTP_CACHE_DIR`` a fresh directory: it traces with ``torch.export`` and writes the cache);
``autotp-warm`` = the same with the cache filled by one unmeasured load before (it reads the traced
program instead of tracing); ``hf-tp`` =
``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")``; ``single`` = one process,
``from_pretrained(path)`` (world size 1). Before measuring, each process imports its loader and
(autotp) traces and plans a one-layer model of the same config, so lazily imported code is not
counted as loading. Figures are medians over ``--repeats`` runs of the largest rank (ratio: growth after the
forward pass / the rank's share of the checkpoint; "/ hf-tp": load time over transformers' TP load
time at the same world size and layout, measured just before); wall-clock on a shared machine,
so compare ratios. ``--baseline CHECKOUT`` also runs each autotp mode with that checkout's ``autotp``
(e.g. ``main``'s worktree) just before this one's, labelled "(base)": every module of it, ``autotp.passes`` and
``autotp.cost_model`` included (:func:`package_of`; each baseline process checks where they came from).
``--profile DIR`` runs each autotp loader once more with rank 0's first ``generate`` under ``cProfile`` (not in the
medians) and prints its 20 largest entries by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
          "num_key_value_heads": 4, "max_position_embeddings": 256, "tie_word_embeddings": False}
SEQ_LEN = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])



def write_checkpoints(directory: Path, layers: int) -> dict[str, Path]:
    """The random model as one file and as 200 MB shards (skipped when already there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = {"single-file": directory / f"llama-{layers}l-single", "sharded": directory / f"llama-{layers}l-sharded"}
    if all((p / "config.json").is_file() for p in paths.values()):
        return paths
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG)).eval()
    model.save_pretrained(paths["single-file"], max_shard_size="100GB")
    model.save_pretrained(paths["sharded"], max_shard_size="200MB")
    return paths


def _held_bytes(tensors: Any) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def worker(mode: str, path: str) -> None:
    """One rank of one run (started by :func:`run`); prints one JSON line."""
    import torch
    import torch.distributed as dist
    import transformers

    from autotp.cli.load_demo import peak_rss_bytes, resident_bytes

    torch.set_num_threads(1)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if mode != "single":
        dist.init_process_group("gloo")
    ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))  # (batch, seq)
    if mode.startswith("autotp"):
        import autotp
        import autotp.cost_model
        import autotp.passes

        baseline = os.environ.get("AUTOTP_BASELINE")
        stray = [f"{module.__name__} from {module.__file__}" for module in (autotp, autotp.passes, autotp.cost_model)
                 if baseline and not Path(module.__file__).is_relative_to(baseline)]
        if stray:  # a baseline row must run the baseline's code only
            raise RuntimeError(f"the baseline {baseline} imported {', '.join(stray)}")

        with torch.device("meta"):
            warm = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **CONFIG))
        autotp.plan(warm, (ids,), {"use_cache": False}, world_size=world_size)
    if mode != "single":
        dist.barrier()  # every rank starts the clock together: a rank slower to warm up is not counted as loading
    before = resident_bytes()
    started = time.perf_counter()
    if mode.startswith("autotp"):
        tp = autotp.from_pretrained(path, world_size=world_size, example_inputs=(ids,))
        held = tp.parameter_bytes()
    elif mode == "hf-tp":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        held = _held_bytes(model.parameters())
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        held = _held_bytes(model.parameters())
    seconds = time.perf_counter() - started
    grown = peak_rss_bytes() - before
    with torch.no_grad():
        (tp if mode.startswith("autotp") else model)(ids, use_cache=False)
    after_forward = peak_rss_bytes() - before
    generate_s = None
    if mode.startswith("autotp"):
        dist.barrier()
        profile_to = os.environ.get("AUTOTP_LOAD_PROFILE")
        profiler = cProfile.Profile() if profile_to and rank == 0 else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        tp.generate(ids, max_new_tokens=2)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_to)
        generate_s = time.perf_counter() - started
    print(json.dumps({"rank": rank, "grown": grown, "forward": after_forward, "held": held, "seconds": seconds,
                      "generate_s": generate_s}), flush=True)
    if mode != "single":
        dist.destroy_process_group()


def package_of(checkout: str) -> str:
    """A directory holding ``checkout``'s ``autotp`` package as installed: its ``autotp/`` entries with ``passes/`` and
    ``cost_model/`` beside them (``pyproject.toml`` maps them to ``autotp.passes`` and ``autotp.cost_model``), as links.
    Put first on ``PYTHONPATH``, every module of autotp comes from ``checkout``; the checkout alone would take those
    two from the installed tree."""
    root = Path(tempfile.mkdtemp(prefix="autotp-baseline-"))
    package = root / "autotp"
    package.mkdir()
    source = Path(checkout).resolve()
    for entry in (source / "autotp").iterdir():
        (package / entry.name).symlink_to(entry)
    for mapped in ("passes", "cost_model"):
        (package / mapped).symlink_to(source / mapped)
    return str(root)


def run(mode: str, path: Path, world_size: int, cache_dir: str | None = None, autotp_from: str | None = None,
        profile_to: Path | None = None) -> list[dict]:
    """Start ``world_size`` fresh processes of ``mode`` on ``path``; their JSON results by rank.
    ``cache_dir``: the trace cache directory (default: a fresh, empty one); ``autotp_from``: a directory from
    :func:`package_of` whose ``autotp`` the processes import instead (put first on ``PYTHONPATH``);
    ``profile_to``: where rank 0 writes the ``cProfile`` statistics of its first ``generate``."""
    port = str(_free_port())
    processes = []
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="autotp-cache-")
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [autotp_from, os.environ.get("PYTHONPATH")])),
             "AUTOTP_BASELINE": autotp_from} if autotp_from else {}
    if profile_to is not None:
        extra["AUTOTP_LOAD_PROFILE"] = str(profile_to)
    for rank in range(world_size):
        env = {**os.environ, **extra, "AUTOTP_CACHE_DIR": cache_dir, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        processes.append(subprocess.Popen([sys.executable, __file__, "--worker", mode, str(path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, process in enumerate(processes):
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"{mode} rank {rank} exited with {process.returncode}:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=["single-file", "sharded"], choices=["single-file", "sharded"])
    parser.add_argument("--modes", nargs="+", default=["hf-tp", "autotp-cold", "autotp-warm", "single"],
                        choices=["autotp-cold", "autotp-warm", "hf-tp", "single"])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--baseline", default=None, metavar="CHECKOUT",
                        help="another autotp checkout (e.g. main's worktree): its autotp modes run just before this one's")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="also profile rank 0's first generate (cProfile) in one more run of each autotp loader, "
                             "write the statistics to DIR and print the 20 largest by cumulative time")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    baseline = package_of(args.baseline) if args.baseline else None
    directory = args.dir or Path(tempfile.mkdtemp(prefix="autotp-load-"))
    paths = write_checkpoints(directory, args.layers)
    size = sum(f.stat().st_size for f in paths["single-file"].glob("*.safetensors"))
    mib = 2**20
    print(f"checkpoint: {size / mib:.0f} MiB ({args.layers} layers), in {directory}; medians of {args.repeats} runs, "
          "largest rank", flush=True)
    print(f"{'ws':>3} {'layout':<12} {'loader':<18} {'peak growth: load':>18} {'+forward':>9} {'share (1/ws)':>13} "
          f"{'ratio':>6} {'held/rank':>10} {'load s':>7} {'/ hf-tp':>8} {'generate s':>11}", flush=True)
    for world_size in args.world_sizes:
        for layout in args.layouts:
            hf_seconds = None
            loaders = [(mode, source) for mode in args.modes
                       for source in ([baseline] if baseline and mode.startswith("autotp") else []) + [None]]
            for mode, source in loaders:
                ranks = 1 if mode == "single" else world_size
                if mode == "single" and world_size != args.world_sizes[0]:
                    continue
                warm = None
                if mode == "autotp-warm":  # one unmeasured load fills the trace cache
                    warm = tempfile.mkdtemp(prefix="autotp-cache-")
                    run(mode, paths[layout], ranks, warm, source)
                runs = [run(mode, paths[layout], ranks, warm, source) for _ in range(args.repeats)]
                grown = statistics.median(max(r["grown"] for r in rs) for rs in runs)
                forward = statistics.median(max(r["forward"] for r in rs) for rs in runs)
                seconds = statistics.median(max(r["seconds"] for r in rs) for rs in runs)
                generate = (f"{statistics.median(max(r['generate_s'] for r in rs) for rs in runs):>11.2f}"
                            if mode.startswith("autotp") else f"{'':>11}")
                held = max(r["held"] for r in runs[0])
                split = "" if mode == "single" or held < 0.75 * size else "  NOT SPLIT"
                hf_seconds = seconds if mode == "hf-tp" else hf_seconds
                versus = f"{seconds / hf_seconds:8.2f}" if hf_seconds and mode != "single" else f"{'':>8}"
                share = size / ranks
                label = f"{mode} (base)" if source else mode
                print(f"{ranks:>3} {layout:<12} {label:<18} {grown / mib:>14.0f} MiB {forward / mib:>5.0f} MiB "
                      f"{share / mib:>9.0f} MiB {forward / share:>6.2f} {held / mib:>6.0f} MiB {seconds:>7.2f} {versus}"
                      f" {generate}{split}",
                      flush=True)
                if args.profile and mode.startswith("autotp"):  # one more run, profiled, not in the medians
                    args.profile.mkdir(parents=True, exist_ok=True)
                    stats_path = args.profile / f"{mode}{'-base' if source else ''}-{layout}-{ranks}.prof"
                    run(mode, paths[layout], ranks, warm, source, profile_to=stats_path)
                    print(f"    rank 0's first generate, profiled ({stats_path}):", flush=True)
                    pstats.Stats(str(stats_path)).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
