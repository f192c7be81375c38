"""Quantized decode: ms per decoded token and bytes per rank, float32 / bf16 vs int8 / int4, side by side.

One run, gloo on this machine's CPU, a Llama with random weights built from its config (default:
~113M parameters: 12 layers, hidden 768, 8 query / 4 kv heads, vocab 32000), batch 1, greedy. For
each world size, every rank builds the model in each precision:

- ``float32`` and ``bf16``: the model as built, and cast with ``.to(torch.bfloat16)``;
- ``int8``: ``quantize_(model, Int8WeightOnlyConfig())`` (per-row scales);
- ``int4``: ``quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))``
  (int4 values held in int8, one scale per group of 32);

compiles each with ``autotp.compile(model, example_inputs=(prompt,), max_cache_len=...)`` and times
``tp.generate`` against the single-process model's own ``model.generate(do_sample=False)`` (rank 0
alone, the other ranks wait), in interleaved rounds (every variant once per round, so the load from
other jobs falls on all alike): median ms per decoded token, ``(t(N) - t(1)) / (N - 1)``. Prints per
variant the ms per token of autotp and of the single process, their ratio, ``tp.parameter_bytes()``
of the largest rank, and whether autotp's tokens equal the single-process model's of the same
precision; then one markdown row per (world size, variant). Usage::

    OMP_NUM_THREADS=1 python benchmarks/quantized_decode.py
    OMP_NUM_THREADS=1 python benchmarks/quantized_decode.py --world-size 1 2 --variants float32 int8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from decode_timing import time_interleaved

VARIANTS = ("float32", "bf16", "int8", "int4")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build(variant: str, args: argparse.Namespace) -> torch.nn.Module:
    """The random Llama (same weights on every rank: seeded) in ``variant``'s precision."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: never stop early, every run decodes all tokens
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    elif variant in ("int8", "int4"):
        import torchao.quantization as tq

        tq.quantize_(model, tq.Int8WeightOnlyConfig() if variant == "int8" else tq.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=tq.PerGroup(32)))
    return model


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))  # (batch, seq)
    runs: dict[str, Callable[[int], torch.Tensor]] = {}
    held: dict[str, int] = {}
    for variant in args.variants:
        model = build(variant, args)
        for mode in args.runtime_modes:
            started = time.perf_counter()
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=args.prompt + args.new_tokens,
                                runtime=autotp.RuntimeOptions(runtime_mode=mode))
            tp.generate(ids, max_new_tokens=2)  # a compiled mode builds its graphs at their first call
            if rank == 0:
                print(f"  tp={world_size} {variant} {mode}: compiled and first run in "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
            held[variant] = tp.parameter_bytes()
            runs[f"{variant} autotp {mode}"] = lambda n, tp=tp: tp.generate(ids, max_new_tokens=n)
        if rank == 0:  # the other ranks wait at the barrier meanwhile

            def single(n: int, model: torch.nn.Module = model) -> torch.Tensor:
                with torch.no_grad():
                    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)

            runs[f"{variant} single"] = single
        else:
            runs[f"{variant} single"] = lambda n: torch.empty(0)
            del model
    timed = time_interleaved(runs, args.new_tokens, args.repeats, dist.barrier)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, held)
    if rank == 0:
        table = {}
        for variant in args.variants:
            reference, _, single_ms = timed[f"{variant} single"]
            for mode in args.runtime_modes:
                tokens, _, ms = timed[f"{variant} autotp {mode}"]
                if tokens.shape[1] != args.prompt + args.new_tokens:
                    raise RuntimeError(f"tp={world_size} {variant} {mode}: {tokens.shape[1] - args.prompt} new tokens, "
                                       f"expected {args.new_tokens}")
                table[(variant, mode)] = (ms, single_ms, max(h[variant] for h in gathered),
                                          bool(torch.equal(tokens, reference)))
        results.put(table)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (32000: Llama-2's)")
    parser.add_argument("--runtime-modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"],
                        help="autotp's runtime modes, each timed beside the others (compiled: Inductor)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    count = sum(p.numel() for p in build("float32", args).parameters())
    print(f"Llama ({count / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, 8/4 heads, vocab "
          f"{args.vocab}); batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, gloo, {args.threads} "
          f"thread(s) per process, medians of {args.repeats} interleaved rounds", flush=True)
    summary = []
    for world_size in args.world_size:
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(world_size, _free_port(), args, results), nprocs=world_size, start_method="spawn")
        table = results.get()
        print(f"\nworld size {world_size}")
        print(f"{'variant':10}{'mode':>10}{'autotp ms/token':>17}{'single ms/token':>17}{'ratio':>8}"
              f"{'MB per rank':>13}{'same tokens':>13}")
        for (variant, mode), (ms, single_ms, held, same) in table.items():
            print(f"{variant:10}{mode:>10}{ms:17.2f}{single_ms:17.2f}{ms / single_ms:8.2f}{held / 1e6:13.1f}"
                  f"{str(same):>13}", flush=True)
            summary.append(f"| {world_size} | {variant} | {mode} | {ms:.1f} | {single_ms:.1f} | {ms / single_ms:.2f} | "
                           f"{held / 1e6:.1f} | {'yes' if same else 'no'} |")
    print("\n| tp | weights | runtime mode | autotp ms/token | single process ms/token | autotp / single | MB of "
          "parameters per rank | tokens equal the single process's |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
