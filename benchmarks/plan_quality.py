"""Plan quality: predicted cost of autotp's plan / predicted cost of the Megatron-style plan.

    python benchmarks/plan_quality.py [--world-sizes 2 4 8] [--hardware h100-sxm pcie-gpu]

Models (meta device, 2 layers, shapes of real models' blocks): GPT-2 (hidden 1024, 16 heads),
Llama (hidden 2048, 16 heads / 4 kv heads, intermediate 5632), BERT (hidden 1024, 16 heads),
Mixtral (hidden 1024, 8 experts, top-2). Shapes: prefill (batch 1, seq 1024) and decode
(batch 8, seq 1). Both plans are priced by the same cost model under the same memory budget
("auto": every matrix split); the Megatron-style plan pins GEMM weights to column/row parallel
(autotp/planning/megatron.py) and lets the solver place everything else. A ratio below 1 lists the
weights autotp placed differently.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import autotp
from autotp.planning.megatron import megatron_plan


def _build(kind: str):
    from transformers import (
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    with torch.device("meta"):
        if kind == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_head=16, n_layer=2, vocab_size=50257, n_positions=2048))
        elif kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                                                 num_attention_heads=16, num_key_value_heads=4, vocab_size=32000))
        elif kind == "bert":
            model = BertModel(BertConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                                         num_hidden_layers=2, max_position_embeddings=2048))
        else:
            model = MixtralForCausalLM(MixtralConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                                     num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                                     num_local_experts=8, num_experts_per_tok=2))
    return model.to(torch.bfloat16).eval()


SHAPES = {"prefill": (1, 1024), "decode": (8, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama", "bert", "mixtral"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--hardware", nargs="+", default=["h100-sxm", "pcie-gpu"])
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"{'model':<8} {'shape':<8} {'hardware':<9} {'tp':>3} {'autotp us':>10} {'megatron us':>12} {'ratio':>7}  differences")
    worst = 0.0
    for kind in options.models:
        model = _build(kind)
        decoder = kind != "bert"
        for shape, (batch, seq) in SHAPES.items():
            ids = torch.zeros(batch, seq, dtype=torch.long)
            kwargs = {"use_cache": False} if decoder else {}
            for hardware in options.hardware:
                for world_size in options.world_sizes:
                    try:
                        ours = autotp.plan(model, (ids,), kwargs, world_size=world_size, options=autotp.PlanOptions(hardware=hardware))
                        ref = megatron_plan(model, (ids,), kwargs, world_size=world_size, hardware=hardware)
                    except autotp.AutoTPError as exc:
                        print(f"{kind:<8} {shape:<8} {hardware:<9} {world_size:>3}  failed: {str(exc).splitlines()[0]}")
                        continue
                    ratio = ours.predicted_time_s / ref.predicted_time_s
                    worst = max(worst, ratio)
                    diff = [f"{fqn.split('.', 2)[-1]}:{ref.parameters[fqn]}->{p}" for fqn, p in ours.parameters.items()
                            if p != ref.parameters[fqn] and (".0." in fqn or "." not in fqn.split(".", 1)[-1])]
                    note = "" if ratio >= 1 - 1e-9 else "; ".join(diff[:4]) + (" ..." if len(diff) > 4 else "")
                    print(f"{kind:<8} {shape:<8} {hardware:<9} {world_size:>3} {ours.predicted_time_s * 1e6:>10.1f} "
                          f"{ref.predicted_time_s * 1e6:>12.1f} {ratio:>7.3f}  {note}", flush=True)
    print(f"worst ratio: {worst:.3f} (goal <= 1.000)")


if __name__ == "__main__":
    main()
