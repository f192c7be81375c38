"""Plan time and per-rank parameter bytes vs the original model, per model and world size.

    python benchmarks/plan_and_memory.py [--repeats 3] [--world-sizes 2 3 4 8]

Planning runs on the meta device (no weights, no process group), as a user planning a large
model would. For each model and world size it prints the median plan time over ``--repeats``
runs (capture + strategies + cost + solve), and the parameter bytes of the largest rank from the
exact uneven partition the rewrite uses, as a ratio of the whole model (ideal: 1/world size).
Timings are wall-clock medians on a shared machine: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import tiny_bert, tiny_gpt2, tiny_llama, tiny_mlp  # noqa: E402

import autotp  # noqa: E402
from autotp.capture.tracing import capture  # noqa: E402
from autotp.passes.uneven import build_partitions  # noqa: E402
from autotp.runtime.execution.shards import shard_tensor  # noqa: E402


def llama_1b(device: str = "meta"):
    """A Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32 heads, 8 kv heads), bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, (torch.zeros(1, 128, dtype=torch.long),), {"use_cache": False}


MODELS = {
    "mlp": lambda: tiny_mlp(device="meta"),
    "llama-tiny": lambda: tiny_llama(device="meta"),
    "gpt2-tiny": lambda: tiny_gpt2(device="meta"),
    "bert-tiny": lambda: tiny_bert(device="meta"),
    "llama-1b-shape": llama_1b,
}


def largest_rank_bytes(model, args, kwargs, plan: autotp.Plan) -> tuple[int, int]:
    """(bytes of the largest rank's parameter shards, bytes of all parameters), from the real partition."""
    captured = capture(model, tuple(a.to("meta") for a in args), kwargs)
    parts = build_partitions(captured.graph_module, plan.decisions(), plan.world_size)
    per_rank = []
    unread = {n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder" and not n.users}
    for rank in range(plan.world_size):
        total = 0
        for slot in captured.inputs:
            if slot.kind == "parameter" and slot.name not in unread:
                full = captured.exported.state_dict[str(slot.target)]
                local = shard_tensor(full, plan.parameters[str(slot.target)], parts, slot.name, rank)
                total += local.numel() * local.element_size()
        per_rank.append(total)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(per_rank), full_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"{'model':<16} {'tp':>3} {'plan s (median)':>16} {'largest rank MiB':>17} {'of model MiB':>13} "
          f"{'ratio':>7} {'1/tp':>6}  collectives")
    for name in options.models:
        for world_size in options.world_sizes:
            times = []
            for _ in range(options.repeats):
                model, args, kwargs = MODELS[name]()
                start = time.perf_counter()
                plan = autotp.plan(model, args, kwargs, world_size=world_size)
                times.append(time.perf_counter() - start)
            largest, full = largest_rank_bytes(model, args, kwargs, plan)
            counts = ", ".join(f"{k}={v}" for k, v in sorted(plan.collective_counts().items()))
            print(f"{name:<16} {world_size:>3} {statistics.median(times):>16.2f} {largest / 2**20:>17.2f} "
                  f"{full / 2**20:>13.2f} {largest / full:>7.3f} {1 / world_size:>6.3f}  {counts}", flush=True)


if __name__ == "__main__":
    main()
