"""Compile a HuggingFace causal LM for text generation: ``autotp.compile(..., max_cache_len=N)``.

Two phases share one set of weight shards and one KV cache:

- **decode**: one new token per row at any position (the position is a tensor input); planned
  first, with the cache as state that the planner places (heads split where attention is
  head-parallel, whole where that is cheaper, e.g. fewer kv heads than ranks). Its plan decides
  every weight's placement, since decode runs once per generated token.
- **prefill**: ``seq`` prompt tokens per call (``seq`` = the example input's sequence length);
  planned with every weight and cache placement pinned to the decode plan's, so the same
  shards serve both graphs; the planner chooses only how the activations are split.

Each phase is captured once here; :meth:`~autotp.runtime.module.TensorParallelModule.generate`
then runs one graph call per prompt chunk and per new token, with no tracing or planning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.errors import PlanError
from autotp.capture import capture
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan
from autotp.runtime.kv_cache import CachedCausalLM, CacheLayout, check_causal_lm
from autotp.runtime.module import GenerationGraphs, TensorParallelModule

__all__ = ["compile_for_generation", "generation_inputs"]


def generation_inputs(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                      max_cache_len: int) -> tuple[CachedCausalLM, int, int]:
    """The cache wrapper of ``model`` and ``(batch, prefill_len)`` from ``example_inputs[0]`` (token ids)."""
    check_causal_lm(model)
    ids = example_inputs[0] if isinstance(example_inputs, tuple) and example_inputs else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
        raise ValueError(
            "with max_cache_len, example_inputs must start with token ids of shape (batch, seq): the cache "
            f"gets `batch` rows and prompts are read `seq` tokens per call; got {example_inputs!r:.120}"
        )
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be an int >= 1 (tokens per row: prompt + new), got {max_cache_len!r}")
    batch, seq = (int(s) for s in ids.shape)
    if seq > max_cache_len:
        raise ValueError(
            f"example_inputs has {seq} tokens per row but max_cache_len={max_cache_len}; "
            f"pass max_cache_len >= {seq} or a shorter example"
        )
    return CachedCausalLM(model, batch_size=batch, max_cache_len=max_cache_len), batch, seq


def compile_for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, max_cache_len: int,
                           options: PlanOptions, plan: Plan | None, group: dist.ProcessGroup | None,
                           rank: int) -> TensorParallelModule:
    """See :func:`autotp.compile` (``max_cache_len``) and the module docstring."""
    from autotp.api import apply_plan, plan_or_check
    from autotp.base.progress import log_progress

    wrapper, batch, seq = generation_inputs(model, example_inputs, max_cache_len)
    talk = options.progress and rank == 0
    log_progress(talk, f"tracing {type(model).__name__} with a {batch}x{max_cache_len} KV cache (decode: 1 token per row)")
    # static sizes: the cache fixes the batch, decode reads one token, prefill `seq` tokens per call
    decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False)
    decode_plan = plan_or_check(decode, plan, options, group=group, rank=rank)
    decode_gm, values, layout = apply_plan(decode, decode_plan, group=group, rank=rank)
    prefill_gm = prefill_plan = None
    prefill_inputs: tuple[str | int, ...] = ()
    if seq > 1:
        log_progress(talk, f"tracing the prefill graph ({seq} tokens per row), weights pinned to the decode plan")
        prefill = capture(wrapper, wrapper.example_inputs(seq), dynamic=False)
        # the same placement for every weight and cache block (so one set of shards serves both graphs);
        # with placements pinned, the memory budget has nothing left to decide
        pinned = dataclasses.replace(options, memory_budget=None, constraints=dict(decode_plan.parameters))
        prefill_plan = plan_or_check(prefill, None, pinned, group=group, rank=rank)
        prefill_gm, prefill_values, _ = apply_plan(prefill, prefill_plan, group=group, rank=rank)
        by_fqn = {str(s.target): s.name for s in decode.inputs if s.kind != "user"}
        for slot in prefill.inputs:
            if slot.kind != "user" and values[by_fqn[str(slot.target)]].shape != prefill_values[slot.name].shape:
                raise PlanError(
                    f"{slot.target}: the prefill plan's shard {tuple(prefill_values[slot.name].shape)} differs from "
                    f"the decode plan's {tuple(values[by_fqn[str(slot.target)]].shape)}; the two graphs must share it"
                )
        # the prefill graph's placeholders take the decode graph's tensors (one set of shards, one cache)
        prefill_inputs = tuple(s.target if s.kind == "user" else by_fqn[str(s.target)] for s in prefill.inputs)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    layout = CacheLayout(batch_size=batch, max_cache_len=max_cache_len, prefill_len=seq if seq > 1 else 1,
                         vocab_size=vocab)
    phases = GenerationGraphs(layout=layout, prefill=prefill_gm, prefill_inputs=prefill_inputs,
                              prefill_plan=prefill_plan)
    return TensorParallelModule(decode, decode_gm, decode_plan, values, rank, layout, generation=phases)

