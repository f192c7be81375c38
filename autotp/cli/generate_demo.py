"""``autotp demo --generate N``: greedy text generation, tensor-parallel against the single process.

Runs on every rank of the demo after its logits check: compiles the same model with a KV cache
(``autotp.compile(..., max_cache_len=...)``), generates ``N`` tokens greedily, checks they equal
HuggingFace's single-process ``model.generate(do_sample=False)``, and prints the tokens, prefill
milliseconds, milliseconds per decoded token and tokens per second of both (medians of
:data:`REPEATS` runs; the single process runs alone on rank 0 while the other ranks wait).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["REPEATS", "generate_demo"]

REPEATS = 3


def _timed(run: Callable[[int], Any], new_tokens: int) -> tuple[Any, float, float]:
    """``(output, prefill_ms, ms_per_decoded_token)``: medians of ``run(1)`` and of ``run(new_tokens)``
    over :data:`REPEATS` runs; one token costs the prefill, each further token one decode step."""
    firsts, wholes = [], []
    output = None
    for _ in range(REPEATS):
        started = time.perf_counter()
        run(1)
        firsts.append(time.perf_counter() - started)
        started = time.perf_counter()
        output = run(new_tokens)
        wholes.append(time.perf_counter() - started)
    prefill, whole = statistics.median(firsts), statistics.median(wholes)
    return output, prefill * 1e3, (whole - prefill) * 1e3 / max(1, new_tokens - 1)


def generate_demo(rank: int, model: Any, ids: Any, new_tokens: int, hardware: str) -> bool:
    """Compile ``model`` for generation on this rank's group, generate, print the comparison on rank 0.

    Returns whether the tokens equal the single process's (on every rank).
    """
    import torch
    import torch.distributed as dist

    import autotp

    prompt = int(ids.shape[1])
    if rank == 0:
        print(f"\ngenerate: compiling with max_cache_len={prompt + new_tokens} (decode graph + prefill graph "
              f"of {prompt} tokens)...", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        tp_model = autotp.compile(model, example_inputs=(ids,), max_cache_len=prompt + new_tokens,
                                  options=autotp.PlanOptions(expected_new_tokens=new_tokens, hardware=hardware))
        compile_s = time.perf_counter() - started
    with torch.no_grad():
        got, tp_prefill_ms, tp_ms = _timed(lambda n: tp_model.generate(ids, max_new_tokens=n), new_tokens)
    dist.barrier()
    single = [None, float("nan"), float("nan")]
    if rank == 0:
        model.generation_config.pad_token_id = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            single = list(_timed(lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                          do_sample=False), new_tokens))
    dist.barrier()
    box = [single[0]]
    dist.broadcast_object_list(box, src=0)
    same = torch.tensor([int(torch.equal(got, box[0]))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        _, single_prefill_ms, single_ms = single
        print(f"compile: {compile_s:.2f} s; KV cache on rank 0: {tp_model.cache_bytes() / 2**10:.1f} KiB "
              f"(cache placements: {sorted({v for k, v in tp_model.plan.parameters.items() if 'cache' in k})})")
        if tp_model.generation.weighting is not None:
            print(tp_model.generation.weighting)
        print(f"new tokens (row 0): {got[0, prompt:].tolist()}")
        print(f"same tokens as single-process model.generate(do_sample=False): {'OK' if same.item() else 'FAILED'}")
        print(f"{'':18}{'prefill ms':>12}{'ms/token':>10}{'tokens/s':>10}   (medians of {REPEATS})")
        for name, prefill_ms, ms in (("autotp", tp_prefill_ms, tp_ms), ("single process", single_prefill_ms, single_ms)):
            print(f"{name:18}{prefill_ms:12.2f}{ms:10.2f}{1e3 * int(ids.shape[0]) / ms:10.1f}")
    return bool(same.item())
