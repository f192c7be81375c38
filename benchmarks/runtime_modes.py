"""Decode speed per runtime mode against HF, and each variant's fraction of the memory-bandwidth roofline.

One run, gloo on this machine's CPU, Llamas with random weights saved once with ``save_pretrained``
(``--models``: ``LAYERSxHIDDENxVOCAB``, 8 query / 4 kv heads, intermediate 2 x hidden), per tensor-parallel size
(``--world-sizes``) and batch (``--batches``), greedy, prompt ``--prompt``, ``--new-tokens`` new tokens:

- ``eager`` / ``compiled``: ``tp.generate`` with ``autotp.RuntimeOptions(runtime_mode=...)`` (the compiled
  mode's Inductor compile happens at the first call and is timed apart);
- ``hf``: ``model.generate(cache_implementation="static")`` in one process (rank 0 alone: the other ranks wait
  at a barrier);
- ``hf-compiled``: the same with ``model.forward = torch.compile(model.forward, fullgraph=True)``, as HF documents
  for a static cache (``mode="reduce-overhead"`` is CUDA graphs, so the default mode on the CPU);
- ``hf-tp``: transformers' own tensor parallelism, ``from_pretrained(path, tp_plan="auto")`` with torchrun's
  environment variables set in every rank, then ``generate(cache_implementation="static")``.

Per variant: the median ms per decoded token (``(t(N) - t(1)) / (N - 1)`` over ``--rounds`` interleaved rounds,
so load from other jobs falls on every variant alike) and its fraction of the roofline: the bytes one rank reads
per token (its share of every weight but the embedding table, ``1/tp`` of it at tp ranks, 1 alone, plus its share
of the static KV cache, read whole by attention at every step) over the bandwidth measured in the same run (a
one-thread ``sum`` over a 256 MiB buffer on every rank at once, median of 5), divided by the measured time. Also
whether the tokens equal ``hf``'s. Prints a markdown table at the end. Usage::

    OMP_NUM_THREADS=1 python benchmarks/runtime_modes.py --world-sizes 2 --batches 1,8
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from decode_timing import time_interleaved

VARIANTS = ("eager", "compiled", "hf", "hf-compiled", "hf-tp")
HEADS, KV_HEADS = 8, 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _save_model(path: str, layers: int, hidden: int, vocab: int) -> None:
    """A random Llama (seed 0) saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)


def _bytes_per_token(model: Any, batch: int, cache_len: int, ranks: int) -> float:
    """Bytes one of ``ranks`` ranks reads per decoded token: its share of the weights but the embedding table,
    and of the static KV cache ``(batch, kv_heads, cache_len, head_dim)`` per layer, keys and values."""
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * cache_len * head_dim * 4
    return (weights + cache) / ranks


def _bandwidth_gbs() -> float:
    """This rank's one-thread read bandwidth while every rank reads at once: ``sum`` over 256 MiB, median of 5."""
    buffer = torch.ones(64 * 2**20)
    times = []
    for _ in range(5):
        dist.barrier()
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


def _hf_generate(model: Any, ids: torch.Tensor) -> Callable[[int], torch.Tensor]:
    def run(new_tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, cache_implementation="static", pad_token_id=0)
    return run


def _worker(rank: int, world_size: int, port: int, path: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    variants = args.variants.split(",")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    vocab = int(model.config.vocab_size)
    cache_len = args.prompt + args.new_tokens
    hf_compiled = hf_tp = None
    if "hf-compiled" in variants and rank == 0:
        hf_compiled = AutoModelForCausalLM.from_pretrained(path).eval()
        hf_compiled.forward = torch.compile(hf_compiled.forward, fullgraph=True)
    if "hf-tp" in variants:
        try:
            hf_tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        except ValueError as exc:  # e.g. accelerate not installed: the same on every rank
            if rank == 0:
                print(f"hf-tp not run: {exc}", flush=True)
    bandwidth = statistics.mean(_every_rank(float(_bandwidth_gbs()), world_size))
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(1))
        runs: dict[str, Callable[[int], torch.Tensor]] = {}
        first_call_s: dict[str, float] = {}
        for mode in ("eager", "compiled"):
            if mode not in variants:
                continue
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=cache_len,
                                options=autotp.PlanOptions(expected_new_tokens=args.new_tokens),
                                runtime=autotp.RuntimeOptions(runtime_mode=mode))
            started = time.perf_counter()
            tp.generate(ids, max_new_tokens=2)  # the compiled mode compiles its graphs here
            first_call_s[mode] = time.perf_counter() - started
            runs[mode] = lambda n, tp=tp, ids=ids: tp.generate(ids, max_new_tokens=n)
        alone = {"hf": model, "hf-compiled": hf_compiled}
        for name in ("hf", "hf-compiled"):
            if name in variants:
                runs[name] = _hf_generate(alone[name], ids) if rank == 0 else (lambda n: torch.empty(0))
        if hf_tp is not None:
            runs["hf-tp"] = _hf_generate(hf_tp, ids)
        timed = time_interleaved(runs, args.new_tokens, args.rounds, dist.barrier)
        per_token = {name: ms for name, (_, _, ms) in timed.items()}
        outputs = {name: tokens for name, (tokens, _, _) in timed.items()}
        if rank == 0:
            reference = outputs.get("hf")
            rows = []
            for name, ms in per_token.items():
                ranks = 1 if name in ("hf", "hf-compiled") else world_size
                roofline_ms = _bytes_per_token(model, batch, cache_len, ranks) / (bandwidth * 1e9) * 1e3
                same = None if reference is None else bool(torch.equal(outputs[name], reference))
                rows.append((name, ms, roofline_ms / ms, same, first_call_s.get(name)))
            results.put((batch, bandwidth, rows))
    dist.destroy_process_group()


def _every_rank(value: float, world_size: int) -> list[float]:
    """``value`` of every rank."""
    values: list[Any] = [None] * world_size
    dist.all_gather_object(values, value)
    return [float(v) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8x512x8000,12x768x32000", help="LAYERSxHIDDENxVOCAB, comma-separated")
    parser.add_argument("--world-sizes", default="2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table = []
    for spec in args.models.split(","):
        layers, hidden, vocab = (int(x) for x in spec.split("x"))
        with tempfile.TemporaryDirectory() as path:
            _save_model(path, layers, hidden, vocab)
            for world_size in (int(w) for w in args.world_sizes.split(",")):
                results = mp.get_context("spawn").SimpleQueue()
                mp.spawn(_worker, args=(world_size, _free_port(), path, args, results), nprocs=world_size)
                while not results.empty():
                    batch, bandwidth, rows = results.get()
                    print(f"Llama {spec}, tp={world_size}, batch {batch}: bandwidth {bandwidth:.1f} GB/s per rank",
                          flush=True)
                    eager = next((ms for name, ms, *_ in rows if name == "eager"), None)
                    for name, ms, fraction, same, first_s in rows:
                        extra = f", first call {first_s:.1f} s" if first_s is not None else ""
                        print(f"  {name:<12} {ms:8.2f} ms/token  {fraction:5.0%} of roofline  same tokens as hf: "
                              f"{same}{extra}", flush=True)
                        ratio = f"{ms / eager:.2f}" if eager else "-"
                        table.append(f"| {spec} | {world_size} | {batch} | {name} | {ms:.2f} | {ratio} | "
                                     f"{fraction:.0%} | {same} |")
    print("\n| model (layers x hidden x vocab) | tp | batch | variant | ms/token | / eager | of roofline | "
          "tokens = hf |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
