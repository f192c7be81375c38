"""Generation speed: autotp vs transformers' native TP vs hand-written Megatron TP vs the single process.

One run, gloo on this machine's CPU, a Llama with random weights saved as a checkpoint (default:
tiny, 4 layers, hidden 512, 8 query / 4 kv heads, vocab 1000; ``--layers 12 --hidden 768 --vocab
32000`` is ~113M parameters), batch 1 by default, greedy:

- ``autotp``: ``autotp.compile(model, example_inputs=(prompt,), max_cache_len=...)`` then
  ``tp.generate`` (the KV cache split as the planner chose);
- ``hf-tp``: ``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`` (torchrun's
  environment variables set in each process) then ``model.generate(cache_implementation="static")``;
  the script checks that the weights really are split (a ``q_proj`` shard of 1/ws of the rows); it needs
  ``accelerate`` (``--no-hf-tp`` leaves it out);
- ``megatron``: the HF model with its ``nn.Linear``s sliced by hand (q/k/v/gate/up by output rows,
  o/down by input columns, an all-reduce after each of the latter) and HF's static cache;
- ``single``: the HF model in one process (alone: the other ranks wait), static cache.

Prints, per variant, the median prefill ms (``generate(max_new_tokens=1)``), the median ms per
decoded token (``(t(N) - t(1)) / (N - 1)``), tokens/s, and whether its tokens equal the single
process's, then one markdown row per (world size, batch, prompt): every variant's prefill ms / ms
per token and autotp's ratios. Usage::

    OMP_NUM_THREADS=1 python benchmarks/generate.py --world-size 2 --prompt 32 --new-tokens 32
    OMP_NUM_THREADS=1 python benchmarks/generate.py --world-size 2 4 --batch 1 8 --prompt 32 512 --new-tokens 128
    OMP_NUM_THREADS=1 python benchmarks/generate.py --layers 12 --hidden 768 --vocab 32000 --batch 8 --prompt 128
    autotp calibrate --threads 1 --output cpu.json && OMP_NUM_THREADS=1 python benchmarks/generate.py --hardware cpu.json --memory-budget none

autotp is compiled with ``expected_new_tokens=--new-tokens`` (the phase weights) and prints how it
weighed the phases and which collectives its decode plan issues.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from decode_timing import time_interleaved


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def save_checkpoint(path: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int = 1000) -> int:
    """A random Llama, saved with ``save_pretrained`` (safetensors); returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _hf_generate(model: Any, ids: torch.Tensor) -> Callable[[int], torch.Tensor]:
    def run(new_tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                  cache_implementation="static", pad_token_id=0)
    return run


def _megatron(model: Any, rank: int, world_size: int) -> Any:
    """Slice the Llama's projections Megatron-style in place: column-parallel q/k/v/gate/up, row-parallel o/down."""
    def rows(linear: torch.nn.Linear) -> None:
        block = linear.out_features // world_size
        linear.weight = torch.nn.Parameter(linear.weight.detach()[rank * block:(rank + 1) * block].clone())
        linear.out_features = block

    def columns(linear: torch.nn.Linear) -> None:
        block = linear.in_features // world_size
        linear.weight = torch.nn.Parameter(linear.weight.detach()[:, rank * block:(rank + 1) * block].clone())
        linear.in_features = block
        linear.register_forward_hook(lambda _m, _i, out: torch.distributed._functional_collectives.all_reduce(
            out, "sum", dist.group.WORLD))

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            rows(linear)
        columns(attention.o_proj)
        columns(mlp.down_proj)
    return model


def _rank(rank: int, world_size: int, port: int, path: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    budget = None if args.memory_budget == "none" else args.memory_budget if args.memory_budget == "auto" else float(
        args.memory_budget)
    tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=args.prompt + args.new_tokens,
                        options=autotp.PlanOptions(memory_budget=budget, expected_new_tokens=args.new_tokens, hardware=args.hardware))
    if rank == 0 and tp.generation.weighting is not None:
        print(tp.generation.weighting, flush=True)
    if rank == 0:
        split = sorted({text for text in tp.plan.parameters.values()})
        prefill_plan = tp.generation.prefill_plan
        prefill_counts = prefill_plan.collective_counts() if prefill_plan is not None else "no prefill graph"
        print(f"autotp plan: {tp.plan.collective_counts()} per decode step, {prefill_counts} per prefill call; "
              f"placements used {split}", flush=True)
        if args.show_plans:
            print(tp.generation, flush=True)
    runs: dict[str, Callable[[int], torch.Tensor]] = {"autotp": lambda n: tp.generate(ids, max_new_tokens=n)}
    if not args.no_hf_tp:
        hf_tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        q_proj = hf_tp.model.layers[0].self_attn.q_proj.weight
        local_rows = int(q_proj.to_local().shape[0]) if hasattr(q_proj, "to_local") else int(q_proj.shape[0])
        if local_rows * world_size != int(model.config.hidden_size):
            raise RuntimeError(f"transformers' tp_plan='auto' did not split q_proj: {local_rows} rows on rank {rank}")
        runs["hf-tp"] = _hf_generate(hf_tp, ids)
    runs["megatron"] = _hf_generate(_megatron(AutoModelForCausalLM.from_pretrained(path).eval(), rank, world_size), ids)
    if rank == 0:
        runs["single"] = _hf_generate(model, ids)  # the other ranks wait at the barrier meanwhile
    else:
        runs["single"] = lambda n: torch.empty(0)
    rows = time_interleaved(runs, args.new_tokens, args.repeats, dist.barrier)
    if rank == 0:
        reference = rows["single"][0]
        results.put({name: (bool(torch.equal(out, reference)), prefill, ms) for name, (out, prefill, ms) in rows.items()})
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2])
    parser.add_argument("--prompt", type=int, nargs="+", default=[32], help="prompt lengths (one run each)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (one run each)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary size (32000: Llama-2's)")
    parser.add_argument("--hardware", default="h100-sxm",
                        help="autotp's cost profile: a known name or the JSON written by `autotp calibrate`")
    parser.add_argument("--show-plans", action="store_true", help="print autotp's decode and prefill plans")
    parser.add_argument("--memory-budget", default="auto", help="autotp's memory_budget: auto, none, or bytes per rank")
    parser.add_argument("--no-hf-tp", action="store_true",
                        help="leave out transformers' tp_plan='auto' (which needs accelerate)")
    args = parser.parse_args()
    summary: list[str] = []
    if not args.no_hf_tp and importlib.util.find_spec("accelerate") is None:  # before any process starts
        print("benchmarks/generate.py compares against transformers' tp_plan='auto', which needs accelerate: "
              "pip install accelerate, or pass --no-hf-tp", file=sys.stderr)
        return 2
    variants = ("autotp", "megatron", "single") if args.no_hf_tp else ("autotp", "hf-tp", "megatron", "single")
    against = [name for name in ("hf-tp", "megatron") if name in variants]
    with tempfile.TemporaryDirectory() as path:
        count = save_checkpoint(path, args.layers, args.hidden, heads=8, kv_heads=4, vocab=args.vocab)
        print(f"Llama ({count / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, 8/4 heads, vocab "
              f"{args.vocab}) at {path}; autotp hardware={args.hardware} memory_budget={args.memory_budget}; batch "
              f"{args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, gloo, {args.threads} thread(s) per "
              f"process, medians of {args.repeats}", flush=True)
        for world_size in args.world_size:
            for batch in args.batch:
                for prompt in args.prompt:
                    run_args = argparse.Namespace(**{**vars(args), "batch": batch, "prompt": prompt})
                    ctx = mp.get_context("spawn")
                    results = ctx.SimpleQueue()
                    mp.start_processes(_rank, args=(world_size, _free_port(), path, run_args, results),
                                       nprocs=world_size, start_method="spawn")
                    table = results.get()
                    print(f"\nworld size {world_size}, batch {batch}, prompt {prompt}")
                    print(f"{'variant':10}{'prefill ms':>12}{'ms/token':>10}{'tokens/s':>10}{'same tokens':>13}"
                          + "".join(f"{'vs ' + other:>13}" for other in against))
                    for name, (same, prefill, ms) in table.items():
                        print(f"{name:10}{prefill:12.2f}{ms:10.2f}{1e3 * batch / ms:10.1f}{str(same):>13}"
                              + "".join(f"{ms / table[other][2]:13.2f}" for other in against), flush=True)
                    summary.append(f"| {world_size} | {batch} | {prompt} | " + " | ".join(
                        f"{table[name][1]:.1f} / {table[name][2]:.1f}{'' if table[name][0] else ' (tokens differ)'}"
                        for name in variants)
                        + "".join(f" | {table['autotp'][2] / table[other][2]:.2f}" for other in against) + " |")
    headers = {"autotp": "autotp", "hf-tp": "transformers tp_plan=auto", "megatron": "hand-written Megatron",
               "single": "single"}
    columns = [headers[name] for name in variants] + [f"autotp/{other}" for other in against]
    print("\nprefill ms / ms per token (markdown)\n| ws | batch | prompt | " + " | ".join(columns) + " |\n|"
          + "---|" * (3 + len(columns)))
    print("\n".join(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main())
