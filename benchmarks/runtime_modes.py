"""Decode speed per runtime mode: ``tp.generate`` in eager and compiled mode against the single-process HF model.

One run, gloo on this machine's CPU, a Llama with random weights (default: 4 layers, hidden 512, 8 query /
4 kv heads, vocab 1000), batch 1, greedy. Every rank compiles the model once per mode
(``autotp.RuntimeOptions(runtime_mode=...)``; the compiled mode's Inductor compile happens at the first
call and is timed apart); ``hf`` is ``model.generate(cache_implementation="static")`` in one process
(rank 0 alone: the other ranks wait at a barrier). ``cuda_graph`` needs a CUDA device and is not run here.

Prints, per variant, the median ms per decoded token (``(t(N) - t(1)) / (N - 1)`` over ``--rounds``
interleaved rounds, so load from other jobs falls on every variant alike), its ratio to ``hf``, and whether
its tokens equal HF's; then one markdown row. Usage::

    OMP_NUM_THREADS=1 python benchmarks/runtime_modes.py --world-size 2 --prompt 16 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("eager", "compiled")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model(layers: int, hidden: int, vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _generating(tp: Any, ids: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda new_tokens: tp.generate(ids, max_new_tokens=new_tokens)


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import autotp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model = _model(args.layers, args.hidden, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    runs: dict[str, Callable[[int], torch.Tensor]] = {}
    compile_s: dict[str, float] = {}
    for mode in MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=args.prompt + args.new_tokens,
                                options=autotp.PlanOptions(expected_new_tokens=args.new_tokens),
                                runtime=autotp.RuntimeOptions(runtime_mode=mode))
        started = time.perf_counter()
        tp.generate(ids, max_new_tokens=2)  # the compiled mode compiles its graphs here
        compile_s[mode] = time.perf_counter() - started
        runs[mode] = _generating(tp, ids)

    def hf(new_tokens: int) -> torch.Tensor:
        if rank != 0:
            return torch.empty(0)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, cache_implementation="static", pad_token_id=0)

    runs["hf"] = hf
    firsts: dict[str, list[float]] = {name: [] for name in runs}
    wholes: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, torch.Tensor] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, run in runs.items():
            dist.barrier()
            started = time.perf_counter()
            run(1)
            first = time.perf_counter() - started
            started = time.perf_counter()
            outputs[name] = run(args.new_tokens)
            whole = time.perf_counter() - started
            dist.barrier()
            if round_index:
                firsts[name].append(first)
                wholes[name].append(whole)
    if rank == 0:
        per_token = {name: (statistics.median(wholes[name]) - statistics.median(firsts[name])) * 1e3
                     / (args.new_tokens - 1) for name in runs}
        same = {name: torch.equal(outputs[name], outputs["hf"]) for name in runs}
        results.put((per_token, same, compile_s))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.world_size, _free_port(), args, results), nprocs=args.world_size)
    per_token, same, compile_s = results.get()
    print(f"tp={args.world_size}, Llama {args.layers} layers x hidden {args.hidden}, vocab {args.vocab}, batch 1, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, medians of {args.rounds} rounds (rank 0)")
    for name, ms in per_token.items():
        extra = f", first call (compile) {compile_s[name]:.1f} s" if name in compile_s else ""
        print(f"  {name:<9} {ms:8.2f} ms/token  x{ms / per_token['hf']:.2f} of hf  same tokens as hf: "
              f"{same[name]}{extra}")
    print("| tp | " + " | ".join(f"{name} ms/token" for name in per_token) + " | compiled / eager |")
    print(f"| {args.world_size} | " + " | ".join(f"{ms:.2f}" for ms in per_token.values())
          + f" | {per_token['compiled'] / per_token['eager']:.2f} |")


if __name__ == "__main__":
    main()
