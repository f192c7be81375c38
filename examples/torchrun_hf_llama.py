"""Make a HuggingFace Llama tensor-parallel with one call, and check it against the original.

Run on 4 local CPU processes (gloo) or 4 GPUs (NCCL):

    torchrun --nproc-per-node 4 examples/torchrun_hf_llama.py
    torchrun --nproc-per-node 2 examples/torchrun_hf_llama.py --layers 4 --seq-len 64 --hardware pcie-gpu
    python examples/torchrun_hf_llama.py --help

Every rank builds the same random-weight model (same seed), so no weights are downloaded. With a
real checkpoint, load it the same way on every rank before calling autotp.compile. Each process
uses the GPU of its ``LOCAL_RANK`` (set by torchrun: the rank within this machine). The exit
status is 1 when the tensor-parallel logits differ from the single-device ones by more than
``--tolerance``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autotp

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Make a small random-weight HuggingFace Llama tensor-parallel with autotp.compile on every "
                    "rank and compare its logits with the single-device model. Launch with torchrun, e.g. "
                    "`torchrun --nproc-per-node 4 examples/torchrun_hf_llama.py`; NCCL on GPUs when CUDA is "
                    "available, gloo on the CPU otherwise.")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default: 16)")
    parser.add_argument("--hardware", default="h100-sxm",
                        help="hardware profile the plan is costed for, a name or a JSON path from `autotp calibrate` "
                             "(default: h100-sxm)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest max-abs logit difference accepted (default: 1e-4)")
    args = parser.parse_args(argv)
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        parser.error(f"{', '.join(missing)} not set: launch with torchrun, e.g. "
                     f"torchrun --nproc-per-node 4 {sys.argv[0]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])  # the rank within this machine: which GPU is ours
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    rank = dist.get_rank()

    torch.manual_seed(args.seed)  # same seed on every rank: identical weights everywhere
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=max(128, args.seq_len))
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, 1000, (2, args.seq_len), device=device)  # (batch, seq)

    tp_model = autotp.compile(model, example_inputs=(ids,), example_kwargs={"use_cache": False},
                              options=autotp.PlanOptions(hardware=args.hardware))
    with torch.no_grad():
        out = tp_model(ids, use_cache=False)
        ref = model(ids, use_cache=False)

    diff = torch.tensor([(out.logits - ref.logits).abs().max().item()], device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # the worst rank decides
    if rank == 0:
        print(tp_model.plan)
        print(f"(plan costed for the {args.hardware!r} hardware profile; this run: {dist.get_world_size()} "
              f"{backend} processes on {device.type})")
        print(f"max abs difference to the single-device model: {diff.item():.2e} (tolerance {args.tolerance:g})")
        print(f"rank 0 holds {tp_model.parameter_bytes() / 2**20:.2f} MiB of parameters "
              f"(the full model: {sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.2f} MiB)")
    dist.destroy_process_group()
    return 0 if diff.item() <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
