"""Host syncs per decoded token of ``tp.generate``, per runtime mode.

One process (world size 1: NCCL on CUDA, gloo on the CPU), a random Llama, greedy. Each mode's model is compiled with
``max_cache_len`` and warmed up (the compiled modes compile there); then ``generate`` runs twice, for 1 and for
``--new-tokens`` new tokens, and the syncs counted in each are subtracted, so the prompt's are left out:

- on CUDA, the synchronizing CUDA calls that ``torch.cuda.set_sync_debug_mode("warn")`` reports (a tensor read to
  the host, a blocking copy);
- on the CPU, where nothing synchronizes, the reads of a tensor's value on the host (``bool()``, ``item()``,
  ``tolist()``, ``int()``), as ``tests/test_runtime_modes.py`` counts them.

The loop looks at "has every row ended" once every ``stop_check_every`` tokens (8 in the compiled modes, 1 eager,
``autotp.runtime.generation.generate.EOS_CHECK_TOKENS``), so a compiled mode should make about one sync per 8 tokens. Usage::

    python benchmarks/host_syncs.py                       # CPU: eager, compiled
    python benchmarks/host_syncs.py --device cuda         # CUDA: eager, compiled, cuda_graph
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from host_reads import HostReads  # noqa: E402  (shared with tests/test_runtime_modes.py)


def _syncs(device: torch.device, run: Any) -> int:
    """Syncs (CUDA) or host reads (CPU) while ``run()`` runs."""
    if device.type != "cuda":
        with HostReads() as reads:
            run()
        return reads.count
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--modes", default=None, help="comma-separated runtime modes (default: every one the device has)")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    modes = args.modes.split(",") if args.modes else ["eager", "compiled"] + (["cuda_graph"] if device.type == "cuda" else [])
    print(f"Llama {args.layers} layers, hidden {args.hidden}, batch 1, prompt 16, {args.new_tokens} new tokens, "
          f"{device.type}; {'synchronizing CUDA calls' if device.type == 'cuda' else 'host reads of a tensor'}")
    for mode in modes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=16 + args.new_tokens + 8,
                                runtime=autotp.RuntimeOptions(runtime_mode=mode))
            tp.generate(ids, max_new_tokens=args.new_tokens)  # compiles the compiled modes' graphs
            one = _syncs(device, lambda tp=tp: tp.generate(ids, max_new_tokens=1))
            many = _syncs(device, lambda tp=tp: tp.generate(ids, max_new_tokens=args.new_tokens))
        decoded = args.new_tokens - 1
        print(f"  {mode:<10} {many - one:4d} for {decoded} decoded tokens ({(many - one) / decoded:.2f} per token; "
              f"the prompt and first token: {one})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
