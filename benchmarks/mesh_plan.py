"""dp x pp x tp choices for Llama-3-70B and Llama-3.1-405B shapes on 1, 2 and 4 nodes of 8 H100s.

Meta-device models from their published configs (no download), planned with
``autotp.planning.mesh_search`` on ``--hardware`` (default h100-multinode): for each world size, the
mesh, stage cuts and microbatches chosen for latency (one request of batch 1) and for throughput
(requests/s at ``--batch``), with the runner-up and why it lost. Also prints the planning time:
the costs of every tensor-parallel size (two one-layer captures and one MILP per size) and the search.

    python benchmarks/mesh_plan.py                    # both models, 1/2/4 nodes, prefill of 1024 tokens
    python benchmarks/mesh_plan.py --models 405b --nodes 4 --seq-len 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autotp.base.errors import PlanError
from autotp.cost_model import get_hardware
from autotp.planning.mesh_search import check_tp_fits_nodes, factorizations, mesh_costs, search_mesh

# Llama-3-70B and Llama-3.1-405B config.json (meta-llama on the Hugging Face Hub): the shapes only.
CONFIGS = {
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}


def build(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**CONFIGS[name], tie_word_embeddings=False)).to(torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["70b", "405b"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hardware", default="h100-multinode")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per request (default: 1024, a prefill)")
    parser.add_argument("--batch", type=int, default=64, help="requests per batch for throughput (default: 64)")
    parser.add_argument("--table", action="store_true", help="also print every factorization considered")
    parser.add_argument("--inter-node-latency-us", type=float, default=None,
                        help="replace the profile's network latency per message step (microseconds): what-if")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    hardware = get_hardware(options.hardware)
    if options.inter_node_latency_us is not None:
        link = dataclasses.replace(hardware.inter_node, latency_s=options.inter_node_latency_us * 1e-6)
        hardware = dataclasses.replace(hardware, name=f"{hardware.name}-net-{options.inter_node_latency_us:g}us",
                                       inter_node=link)
    print(f"{hardware.name}, {hardware.devices_per_node} GPUs per node, seq {options.seq_len}, "
          f"throughput at batch {options.batch}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in options.models:
        model = build(name)
        world_sizes = [n * hardware.devices_per_node for n in options.nodes]
        tps = sorted({m.tp for w in world_sizes for m in factorizations(w)
                      if not (w > hardware.devices_per_node and check_tp_fits_nodes(m.tp, hardware))})
        ids = torch.zeros(1, options.seq_len, dtype=torch.long, device="meta")
        started = time.perf_counter()
        costs = mesh_costs(model, (ids,), {"use_cache": False}, tps, hardware)
        profile_s = time.perf_counter() - started
        print(f"\nLlama {name}: costs of tp in {tps}: {profile_s:.1f} s")
        for world in world_sizes:
            for objective in ("latency", "throughput"):
                started = time.perf_counter()
                try:
                    plan = search_mesh(costs, world, objective=objective, batch=options.batch)
                except PlanError as error:
                    print(f"  {world:>2} GPUs {objective:<10} -> {error}")
                    continue
                search_s = time.perf_counter() - started
                p = plan.predicted
                runner = next((r for r in plan.candidates if r.get("runner_up")), None)
                print(f"  {world:>2} GPUs {objective:<10} -> {plan.mesh}, {plan.microbatches} microbatch(es): "
                      f"latency {p['latency_s'] * 1e3:.1f} ms, throughput {p['throughput_per_s']:.2f}/s, "
                      f"{p['memory_bytes_per_device'] / 2**30:.1f} GiB/device (search {search_s:.2f} s)")
                if runner is not None:
                    print(f"      runner-up {runner['mesh']}: {runner['why_lost']}")
                if options.table:
                    print("      " + plan.candidates_table().replace("\n", "\n      "))


if __name__ == "__main__":
    main()
