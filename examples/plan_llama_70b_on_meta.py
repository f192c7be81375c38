"""Plan a Llama-3-70B-shaped model for 8 GPUs on a laptop: no weights, no GPUs, no process group.

    python examples/plan_llama_70b_on_meta.py [--layers 80] [--world-size 8] [--hardware h100-sxm]

The model is built on the meta device (shapes only); autotp traces it, costs every candidate
split on the chosen hardware profile and solves for the cheapest plan. Save it with --json and
apply it later with autotp.compile(model, plan=autotp.Plan.load(path), ...).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autotp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--json", help="write the plan here")
    args = parser.parse_args()

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=args.layers,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, torch_dtype=torch.bfloat16)
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.zeros(1, args.seq_len, dtype=torch.long)
    plan = autotp.plan(model, (ids,), {"use_cache": False}, world_size=args.world_size,
                       options=autotp.PlanOptions(progress=True, hardware=args.hardware))
    print(plan.summary(max_rows=12))
    print(f"planned {args.layers} layers in {time.perf_counter() - start:.1f} s")
    if args.json:
        plan.save(args.json)
        print(f"plan written to {args.json}")


if __name__ == "__main__":
    main()
