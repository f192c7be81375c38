"""Plan time of a Llama-3-70B-shaped model on the meta device, by number of layers.

    python benchmarks/plan_time.py [--layers 10 20 40 80] [--world-size 8] [--hardware h100-sxm] [--untied] [--training]
    python benchmarks/plan_time.py --max-cache-len 4096 [--layers 80]

Shapes: hidden 8192, 64 heads, 8 kv heads, intermediate 28672, vocab 128256, bfloat16, one
sequence of 2048 tokens (prefill). Prints per stage: capture (torch.export), strategies, cost,
solve (MILP with identical layers tied) and the total, and the time per layer. ``--untied``
also solves without tying and prints both objectives (the optimality lost by tying, if any).
``--training`` prices a training step (forward + backward, gradients, AdamW state, activations;
``passes/backward.py``), as ``autotp.plan(..., training=True)`` does.
``--max-cache-len N``: the decode step with a KV cache of N slots, one sequence of 16 prompt tokens, planned
end to end by ``autotp.plan(..., max_cache_len=N)``, as built (three layers traced, the others stamped:
:mod:`autotp.capture.stamping`) and with stamping off (every layer exported and functionalized), in turn.
Wall-clock on a shared machine: read growth with depth and the ratios, not the last digit.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autotp.capture.tracing import capture
from autotp.cost_model import get_hardware
from autotp.passes.backward import Training
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.solver import evaluate_choice, solve
from autotp.passes.strategies import build_strategy_graph
from autotp.passes.tying import tie_identical_blocks
from autotp.planning.planner import auto_memory_budget


def llama70b_shaped(layers: int) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--untied", action="store_true", help="also solve without tying identical layers")
    parser.add_argument("--training", action="store_true", help="price a training step (forward + backward)")
    parser.add_argument("--max-cache-len", type=int, help="plan the decode step with a KV cache, stamped and whole")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    if options.max_cache_len is not None:
        _decode_with_cache(options)
        return
    hardware = get_hardware(options.hardware)
    print(f"Llama-3-70B shape, tp={options.world_size}, {hardware.name}, seq {options.seq_len}"
          + (", training step" if options.training else ""))
    print(f"{'layers':>6} {'nodes':>6} {'vars(node)':>10} {'capture s':>10} {'strategies s':>12} {'cost s':>7} "
          f"{'solve s':>8} {'total s':>8} {'total s/layer':>13}")
    for layers in options.layers:
        model = llama70b_shaped(layers)
        ids = torch.zeros(1, options.seq_len, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        captured = capture(model, (ids,), {"use_cache": False})
        t1 = time.perf_counter()
        graph = build_strategy_graph(captured.graph_module, options.world_size, captured.parameter_fqns())
        t2 = time.perf_counter()
        costed = cost_strategy_graph(graph, hardware, Training.of(graph) if options.training else None)
        t3 = time.perf_counter()
        tie = tie_identical_blocks(graph)
        budget = auto_memory_budget(costed)
        solution = solve(costed, memory_budget_bytes=budget, tie=tie, count_activations=False)
        t4 = time.perf_counter()
        print(f"{layers:>6} {len(graph.order):>6} {len(set(tie.values())):>10} {t1 - t0:>10.2f} {t2 - t1:>12.2f} "
              f"{t3 - t2:>7.2f} {t4 - t3:>8.2f} {t4 - t0:>8.2f} {(t4 - t0) / layers:>13.3f}", flush=True)
        if options.untied:
            start = time.perf_counter()
            untied = solve(costed, memory_budget_bytes=budget, count_activations=False)
            tied_cost, untied_cost = evaluate_choice(costed, solution.choice), evaluate_choice(costed, untied.choice)
            print(f"       untied solve {time.perf_counter() - start:.2f} s; objective tied {tied_cost * 1e3:.4f} ms, "
                  f"untied {untied_cost * 1e3:.4f} ms (tied/untied = {tied_cost / untied_cost:.6f})", flush=True)


def _decode_with_cache(options: argparse.Namespace) -> None:
    """``autotp.plan(..., max_cache_len=)`` end to end, stamped and whole (see the module docstring)."""
    import autotp
    import autotp.capture.stamping as stamping

    print(f"Llama-3-70B shape, tp={options.world_size}, {options.hardware}, decode step with a KV cache of "
          f"{options.max_cache_len} slots: autotp.plan, seconds")
    print(f"{'layers':>6} {'stamped':>8} {'whole':>8} {'ratio':>6}")
    stamped = stamping.export_stamped
    for layers in options.layers:
        seconds = {}
        for way in ("stamped", "whole"):
            model = llama70b_shaped(layers)
            ids = torch.zeros(1, 16, dtype=torch.long, device="meta")  # (batch, prompt tokens)
            stamping.export_stamped = stamped if way == "stamped" else (lambda *_: None)
            try:
                started = time.perf_counter()
                autotp.plan(model, (ids,), world_size=options.world_size, options=autotp.PlanOptions(hardware=options.hardware),
                            max_cache_len=options.max_cache_len)
                seconds[way] = time.perf_counter() - started
            finally:
                stamping.export_stamped = stamped
        print(f"{layers:>6} {seconds['stamped']:>8.1f} {seconds['whole']:>8.1f} "
              f"{seconds['stamped'] / seconds['whole']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
