"""Make a HuggingFace Llama tensor-parallel with one call, and check it against the original.

Run on 4 local CPU processes (gloo) or 4 GPUs (NCCL):

    torchrun --nproc-per-node 4 examples/torchrun_hf_llama.py

Every rank builds the same random-weight model (same seed), so no weights are downloaded. With a
real checkpoint, load it the same way on every rank before calling autotp.compile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autotp


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda" if backend == "nccl" else "cpu")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, 1000, (2, 16), device=device)

    tp_model = autotp.compile(model, example_inputs=(ids,), example_kwargs={"use_cache": False})
    out = tp_model(ids, use_cache=False)
    with torch.no_grad():
        ref = model(ids, use_cache=False)

    diff = (out.logits - ref.logits).abs().max().item()
    if rank == 0:
        print(tp_model.plan)
        print(f"max abs difference to the single-device model: {diff:.2e}")
        print(f"rank 0 holds {tp_model.parameter_bytes() / 2**20:.2f} MiB of parameters "
              f"(the full model: {sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.2f} MiB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
