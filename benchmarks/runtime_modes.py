"""Decode speed per runtime mode against HF, and each variant's fraction of the memory-bandwidth roofline.

One run, gloo on this machine's CPU by default (``--device cuda``: every rank on a GPU, ``cuda:rank`` modulo the
GPUs there are, with ``--backend nccl`` or ``gloo``), Llamas with random weights saved once with ``save_pretrained``
(``--models``: ``LAYERSxHIDDENxVOCAB``, 8 query / 4 kv heads, intermediate 2 x hidden) and loaded in ``--dtype``,
per tensor-parallel size (``--world-sizes``) and batch (``--batches``), greedy, prompt ``--prompt``,
``--new-tokens`` new tokens:

- ``eager`` / ``compiled`` / ``cuda_graph`` (CUDA only): ``tp.generate`` with
  ``autotp.RuntimeOptions(runtime_mode=...)`` (the compiled modes' Inductor compile happens at the first call and
  is timed apart);
- ``hf``: ``model.generate(cache_implementation="static")`` in one process (rank 0 alone: the other ranks wait
  at a barrier);
- ``hf-compiled``: the same with ``model.forward = torch.compile(model.forward, fullgraph=True)``, as HF documents
  for a static cache (with ``mode="reduce-overhead"``, CUDA graphs, on CUDA; the default mode on the CPU);
- ``hf-tp``: transformers' own tensor parallelism, ``from_pretrained(path, tp_plan="auto")`` with torchrun's
  environment variables set in every rank, then ``generate(cache_implementation="static")``.

Per variant: the median ms per decoded token (``(t(N) - t(1)) / (N - 1)`` over ``--rounds`` interleaved rounds,
so load from other jobs falls on every variant alike) and its fraction of the roofline: the bytes one rank reads
per token (its share of every weight but the embedding table, ``1/tp`` of it at tp ranks, 1 alone, plus its share
of the static KV cache, read whole by attention at every step) over the bandwidth measured in the same run (a
``sum`` over a 256 MiB buffer, 1 GiB on a GPU, on every rank at once, median of 5: one thread on the CPU), divided
by the measured time. Also how many of the new tokens equal ``hf``'s (all of them, in float32; in bfloat16 a
split sum may round differently and flip a near tie), and each autotp mode's plain forward against the model's
(``autotp.compile(model, example_inputs=(ids,))`` then ``tp(ids)``: the largest absolute difference of the logits)
and the form its all-reduces take (symmetric memory, shared memory, one-shot, the backend's, none). Prints a
markdown table at the end (``--json``: also the rows as JSON). Usage::

    OMP_NUM_THREADS=1 python benchmarks/runtime_modes.py --world-sizes 2 --batches 1,8
    python benchmarks/runtime_modes.py --device cuda --backend nccl --world-sizes 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
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

VARIANTS = ("eager", "compiled", "cuda_graph", "hf", "hf-compiled", "hf-tp")
AUTOTP_MODES = ("eager", "compiled", "cuda_graph")
DEFAULT_VARIANTS = {"cpu": "eager,compiled,hf,hf-compiled,hf-tp", "cuda": "eager,compiled,cuda_graph,hf,hf-compiled"}
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
    element = next(model.parameters()).element_size()
    cache = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * cache_len * head_dim * element
    return (weights + cache) / ranks


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bandwidth_gbs(device: torch.device) -> float:
    """This rank's read bandwidth while every rank reads at once: ``sum`` over 256 MiB (1 GiB on a GPU), median
    of 5."""
    buffer = torch.ones((256 if device.type == "cuda" else 64) * 2**20, device=device)
    buffer.sum()
    times = []
    for _ in range(5):
        _synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        buffer.sum()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


def _hf_generate(model: Any, ids: torch.Tensor) -> Callable[[int], torch.Tensor]:
    def run(new_tokens: int) -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, cache_implementation="static", pad_token_id=0)
        _synchronize(ids.device)
        return out
    return run


def _same_tokens(tokens: torch.Tensor, reference: torch.Tensor | None, prompt: int) -> str:
    """How many new tokens equal ``reference``'s, up to the first step where some row differs: "all" or
    "first N of M"."""
    if reference is None:
        return "-"
    tokens, reference = tokens.cpu(), reference.cpu()
    if tokens.shape != reference.shape:
        return f"shape {tuple(tokens.shape)} against {tuple(reference.shape)}"
    differs = (tokens[:, prompt:] != reference[:, prompt:]).any(dim=0)
    if not differs.any():
        return "all"
    return f"first {int(differs.nonzero()[0, 0])} of {reference.shape[1] - prompt}"


def _worker(rank: int, world_size: int, port: int, path: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import autotp

    hf_logging.set_verbosity_error()
    variants = args.variants.split(",")
    dtype = getattr(torch, args.dtype)

    def load(**kwargs: Any) -> Any:  # converted after loading: the keyword's name differs by transformers release
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval().to(dtype)

    model = load().to(device)
    vocab = int(model.config.vocab_size)
    cache_len = args.prompt + args.new_tokens
    hf_compiled = hf_tp = None
    if "hf-compiled" in variants and rank == 0:
        hf_compiled = load().to(device)
        hf_compiled.forward = torch.compile(hf_compiled.forward, fullgraph=True,
                                            mode="reduce-overhead" if device.type == "cuda" else None)
    if "hf-tp" in variants:
        try:
            hf_tp = load(tp_plan="auto")
        except ValueError as exc:  # e.g. accelerate not installed: the same on every rank
            if rank == 0:
                print(f"hf-tp not run: {exc}", flush=True)
    bandwidth = statistics.mean(_every_rank(float(_bandwidth_gbs(device)), world_size))
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            reference_logits = model(ids).logits
        runs: dict[str, Callable[[int], torch.Tensor]] = {}
        first_call_s: dict[str, float] = {}
        logits_error: dict[str, float] = {}
        all_reduce_form: dict[str, str] = {}
        for mode in (m for m in AUTOTP_MODES if m in variants):
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=cache_len,
                                options=autotp.PlanOptions(expected_new_tokens=args.new_tokens),
                                runtime=autotp.RuntimeOptions(runtime_mode=mode))
            started = time.perf_counter()
            tp.generate(ids, max_new_tokens=2)  # the compiled modes compile their graphs here
            _synchronize(device)
            first_call_s[mode] = time.perf_counter() - started
            plain = autotp.compile(model, example_inputs=(ids,), runtime=autotp.RuntimeOptions(runtime_mode=mode))
            logits_error[mode] = float((plain(ids).logits.float() - reference_logits.float()).abs().max())
            all_reduce_form[mode] = _all_reduce_form(plain)
            del plain

            def run(n: int, tp: Any = tp, ids: torch.Tensor = ids) -> torch.Tensor:
                out = tp.generate(ids, max_new_tokens=n)
                _synchronize(device)
                return out
            runs[mode] = run
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
                rows.append({"variant": name, "ms_per_token": ms, "of_roofline": roofline_ms / ms,
                             "tokens_equal_hf": _same_tokens(outputs[name], reference, args.prompt),
                             "first_call_s": first_call_s.get(name), "logits_error": logits_error.get(name),
                             "all_reduce_form": all_reduce_form.get(name)})
            results.put((batch, bandwidth, rows))
    dist.destroy_process_group()


def _all_reduce_form(tp: Any) -> str:
    """How the rank-local graph of ``tp`` sums its all-reduces (autotp.runtime.collectives.inference_collectives)."""
    from autotp.passes.small_collectives import one_shot_all_reduce
    from autotp.runtime.collectives.shared_memory import SharedMemoryAllReduce
    from autotp.runtime.collectives.symmetric_memory import SymmetricMemoryAllReduce

    targets = [n.target for n in tp.graph_module.graph.nodes if n.op == "call_function"]
    for form, takes in (("symmetric memory", lambda t: isinstance(t, SymmetricMemoryAllReduce)),
                        ("shared memory", lambda t: isinstance(t, SharedMemoryAllReduce)),
                        ("one-shot", lambda t: t is one_shot_all_reduce),
                        ("backend", lambda t: t is torch.ops._c10d_functional.all_reduce.default)):
        if any(takes(t) for t in targets):
            return form
    return "none"


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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: {DEFAULT_VARIANTS['cpu']} on the "
                             f"CPU, {DEFAULT_VARIANTS['cuda']} on CUDA)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    args.variants = args.variants or DEFAULT_VARIANTS[args.device]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table, records = [], []
    for spec in args.models.split(","):
        layers, hidden, vocab = (int(x) for x in spec.split("x"))
        with tempfile.TemporaryDirectory() as path:
            _save_model(path, layers, hidden, vocab)
            for world_size in (int(w) for w in args.world_sizes.split(",")):
                results = mp.get_context("spawn").SimpleQueue()
                mp.spawn(_worker, args=(world_size, _free_port(), path, args, results), nprocs=world_size)
                while not results.empty():
                    batch, bandwidth, rows = results.get()
                    print(f"Llama {spec}, tp={world_size}, batch {batch}, {args.device} {args.backend} {args.dtype}: "
                          f"bandwidth {bandwidth:.1f} GB/s per rank", flush=True)
                    eager = next((row["ms_per_token"] for row in rows if row["variant"] == "eager"), None)
                    for row in rows:
                        extra = "" if row["first_call_s"] is None else f", first call {row['first_call_s']:.1f} s"
                        if row["logits_error"] is not None:
                            extra += f", forward's logits off by {row['logits_error']:.2e}"
                        if row["all_reduce_form"] is not None:
                            extra += f", all-reduces: {row['all_reduce_form']}"
                        print(f"  {row['variant']:<12} {row['ms_per_token']:8.2f} ms/token  {row['of_roofline']:5.0%} "
                              f"of roofline  new tokens equal to hf's: {row['tokens_equal_hf']}{extra}", flush=True)
                        ratio = f"{row['ms_per_token'] / eager:.2f}" if eager else "-"
                        table.append(f"| {spec} | {world_size} | {batch} | {row['variant']} | {row['ms_per_token']:.2f} "
                                     f"| {ratio} | {row['of_roofline']:.0%} | {row['tokens_equal_hf']} |")
                        records.append({"model": spec, "tp": world_size, "batch": batch, "device": args.device,
                                        "backend": args.backend, "dtype": args.dtype,
                                        "bandwidth_gbs": bandwidth, **row})
    print("\n| model (layers x hidden x vocab) | tp | batch | variant | ms/token | / eager | of roofline | "
          "new tokens = hf |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
