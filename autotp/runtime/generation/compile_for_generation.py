"""Compile a HuggingFace causal LM for text generation: ``autotp.compile(..., max_cache_len=N)``.

Two phases share one set of weight shards and one KV cache:

- **decode**: one new token per row at any position (the position is a tensor input), with the
  cache as state that the planner places (heads split where attention is head-parallel, whole
  where that is cheaper, e.g. fewer kv heads than ranks);
- **prefill**: ``seq`` prompt tokens per call (``seq`` = the example input's sequence length).
  The first chunk of a prompt runs a graph that attends to the chunk's own keys only (the cache is
  empty before it; :meth:`~autotp.capture.kv_cache.CachedCausalLM.first_chunk`), as HF's prefill
  does; a prompt longer than ``seq`` runs its later chunks through a *continuation* graph that
  attends to the whole cache, planned pinned to the same placements.

Every weight and cache has one placement for both graphs, chosen for a whole request: predicted
``prefill + expected_new_tokens x decode`` (:mod:`autotp.planning.phases`). Each phase is
planned alone, the other pinned to its placements (only its activations free), and the cheaper
pair is kept; ``print(tp.generation)`` shows the candidates' predicted times. Where the first rank
would run a phase without collectives alone (CPU ranks sharing cores), a whole-model candidate priced
at a whole core is compared too. With ``plan=`` (a decode plan) its placements are kept and prefill
is pinned to them.

Each phase is captured once here; :meth:`~autotp.runtime.execution.module.TensorParallelModule.generate`
then runs one graph call per prompt chunk and per new token, with no tracing or planning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autotp.adapters import hf_transformers
from autotp.base.errors import PlanError, UnsupportedModelError
from autotp.base.progress import log_progress
from autotp.capture.kv_cache import CachedCausalLM, CacheLayout, check_causal_lm, generation_defaults
from autotp.capture.trace_cache import TraceCache
from autotp.capture.tracing import CapturedGraph, capture
from autotp.cost_model.runtime import graph_host_s
from autotp.passes.uneven import Partitions
from autotp.planning.options import PlanOptions, StrategyFilter
from autotp.planning.phases import PhaseCandidate, PhaseWeighting, first_rank_alone, keep_whole, weigh_phases
from autotp.planning.plan import Plan
from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S
from autotp.runtime.agreement.shared_trace import FirstRankTrace
from autotp.runtime.checkpoints.loading import TensorSource, match_keys, materialize_hf_buffers, tensor_aliases
from autotp.runtime.collectives.hosts import Host
from autotp.runtime.execution.applying import apply_plan, plan_or_check, rank_local_graph
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.rank_local import GenerationGraphs, PhaseGraph
from autotp.runtime.execution.shards import local_shape

__all__ = ["check_cache_is_state", "check_generation_inputs", "compile_for_generation", "generation_inputs"]

Solve = Callable[[CapturedGraph, Plan | None, PlanOptions], Plan]
"""Plan a graph under options (or check a given plan): ``plan_or_check`` bound to a group, rank and plan cache."""


def generation_inputs(model: torch.nn.Module, example_inputs: tuple[Any, ...], max_cache_len: int,
                      inputs_device: torch.device | None = None) -> tuple[CachedCausalLM, int, int]:
    """The cache wrapper of ``model`` and ``(batch, prefill_len)`` from ``example_inputs[0]`` (token ids);
    ``inputs_device``: where the wrapper's example inputs are made (default: the model's device)."""
    batch, seq = check_generation_inputs(model, example_inputs, max_cache_len)
    wrapper = CachedCausalLM(model, batch_size=batch, max_cache_len=max_cache_len, last_logits_only=True,
                             inputs_device=inputs_device)
    return wrapper, batch, seq


def check_generation_inputs(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                            max_cache_len: int) -> tuple[int, int]:
    """``(batch, prefill_len)`` from ``example_inputs[0]`` (token ids); ValueError/TypeError saying the fix."""
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
    return batch, seq


def compile_for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, max_cache_len: int,
                           options: PlanOptions, plan: Plan | None, group: dist.ProcessGroup | None,
                           rank: int, host: Host, wrapper: CachedCausalLM | None = None,
                           timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, runtime_mode: str = "eager",
                           files: TensorSource | None = None, device: torch.device | None = None,
                           trace_cache: TraceCache | None = None) -> TensorParallelModule:
    """See :func:`autotp.compile` (``max_cache_len``; ``options.expected_new_tokens``) and the module docstring.

    ``wrapper``: the cache wrapper to capture instead of ``CachedCausalLM(model)`` (a pipeline stage's:
    :class:`autotp.runtime.mesh.mesh_generate.StageCachedLM`). ``host``: where this rank runs
    (:mod:`autotp.runtime.collectives.hosts`). ``timeout_s``: how long the other ranks wait
    for rank 0's traced programs (``agreement_timeout_s``). ``files``: an opened checkpoint
    (:func:`autotp.runtime.checkpoints.saving.open_checkpoint`, agreed by every rank) to read this rank's blocks of the
    weights from, once for every graph, onto ``device`` (default: the CPU); the model may then be on meta, and
    its cache is made on ``device`` in this rank's blocks only. ``trace_cache``: where the graphs' programs and
    plans are read from and kept (:mod:`autotp.capture.trace_cache`; the first chunk's and the later chunks' graphs have
    keys of their own, the wrapper's ``reads_cache`` among its attributes; each plan the phases' weighing makes is
    keyed by its graph and options, the placements it is pinned to among them)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if files is not None:
        _derive_meta_buffers(model, files, device)
    if wrapper is None:
        wrapper, batch, seq = generation_inputs(model, example_inputs, max_cache_len,
                                                inputs_device=device if files is not None else None)
    else:
        batch, seq = check_generation_inputs(model, example_inputs, max_cache_len)
    talk = options.progress and rank == 0
    log_progress(talk, f"tracing {type(model).__name__} with a {batch}x{max_cache_len} KV cache (decode: 1 token per row)")
    # static sizes: the cache fixes the batch, decode reads one token, prefill `seq` tokens per call
    share = FirstRankTrace(group, timeout_s=timeout_s)  # rank 0 traces, the others rebuild
    decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False, share=share, trace_cache=trace_cache)
    prefill = continuation = None
    # a recurrent state starts empty at the prompt's first chunk only: that chunk has a graph of its own even at one
    # token, and later prompt tokens go one per decode call (a continuation graph would re-read a chunk's tokens)
    recurrent = wrapper.recurrent
    if seq > 1 or recurrent:
        log_progress(talk, f"tracing the prefill graph ({seq} tokens per row, the prompt's first chunk)")
        with wrapper.first_chunk():
            prefill = capture(wrapper, wrapper.example_inputs(seq), dynamic=False, share=share, trace_cache=trace_cache)
        if max_cache_len - 1 > seq and not recurrent:  # a prompt (at most max_cache_len - 1 tokens) may need more chunks
            log_progress(talk, f"tracing the continuation graph (a longer prompt's later chunks of {seq} tokens)")
            continuation = capture(wrapper, wrapper.example_inputs(seq), dynamic=False, share=share,
                                   trace_cache=trace_cache)
    for name, graph in (("decode", decode), ("prefill", prefill), ("continuation", continuation)):
        if graph is not None:
            check_cache_is_state(graph, wrapper, name)
    solve = functools.partial(plan_or_check, group=group, rank=rank, plan_cache=trace_cache)
    decode_plan, prefill_plan, weighting = _plan_phases(decode, prefill, plan, options, solve=solve, talk=talk)
    continuation_plan = None
    if continuation is not None:
        continuation_plan = solve(continuation, None, _continuation_options(decode_plan, prefill_plan, options))
    # one read of each weight (and one cache) for every graph: the prefill graphs take the decode graph's tensors
    decode_gm, values, parameter_layout = apply_plan(decode, decode_plan, group=group, rank=rank, host=host,
                                                         timeout_s=timeout_s, files=files, model=wrapper, device=device,
                                                         created=frozenset(wrapper.cache_buffer_names()))

    def sharing(graph: CapturedGraph | None, graph_plan: Plan | None, name: str) -> PhaseGraph | None:
        """``graph`` made rank-local, its weights and cache taken from the decode graph's tensors."""
        if graph is None or graph_plan is None:
            return None
        graph_module, parts = rank_local_graph(graph, graph_plan, group=group, rank=rank, host=host,
                                                 timeout_s=timeout_s)
        return PhaseGraph(graph_module, _shared_inputs(graph, graph_plan, parts, rank, decode, values, name),
                          graph_plan)

    vocab = int(model.get_output_embeddings().weight.shape[0])
    eos_ids, pad_id = generation_defaults(model)
    cache = CacheLayout(batch_size=batch, max_cache_len=max_cache_len, prefill_len=seq if seq > 1 else 1,
                         vocab_size=vocab, eos_token_ids=eos_ids, pad_token_id=pad_id, recurrent=recurrent)
    phases = GenerationGraphs(layout=cache, prefill=sharing(prefill, prefill_plan, "prefill"),
                              continuation=sharing(continuation, continuation_plan, "continuation"),
                              decode_plan=decode_plan, weighting=weighting)
    return TensorParallelModule(decode, decode_gm, decode_plan, values, rank, parameter_layout, generation=phases,
                                group=group, runtime_mode=runtime_mode, progress=options.progress)


def _derive_meta_buffers(model: torch.nn.Module, files: TensorSource, device: torch.device) -> None:
    """Give the buffers of a meta ``model`` that ``files`` lacks (rotary ``inv_freq``) their values on ``device``,
    derived from the config as a plain load does (:func:`autotp.runtime.checkpoints.loading.materialize_hf_buffers`), before
    the model is wrapped with its cache; a buffer the checkpoint holds is read with the weights."""
    found = match_keys(tensor_aliases(model), files)
    derived = [name for name, buffer in model.named_buffers() if buffer.device.type == "meta" and name not in found]
    if derived:
        materialize_hf_buffers(model, derived, device)


def check_cache_is_state(graph: CapturedGraph, wrapper: CachedCausalLM, phase: str) -> None:
    """Raise :class:`UnsupportedModelError` unless every cache buffer of ``wrapper`` is written in ``graph``.

    The model writes its keys and values into the cache through transformers' cache interface; a model that keeps
    some of its state another way (module attributes, its own cache object) would ignore the cache there, attend
    to each call's own tokens only and generate other tokens with no error. The release is one autotp tests
    (:class:`CachedCausalLM` checked it), so the model is named, not the release."""
    written = set(graph.state_fqns().values())
    missing = [fqn for fqn in wrapper.cache_buffer_names() if fqn not in written]
    if missing:
        raise UnsupportedModelError(
            f"the {phase} graph of {type(wrapper.model).__name__} does not write its KV cache ({len(missing)} of "
            f"{len(wrapper.cache_buffer_names())} cache buffers untouched, e.g. {missing[0]}): the model keeps its "
            f"state another way than transformers' cache layers (checked with transformers "
            f"{hf_transformers.installed_release()}, a release generation is tested on). autotp's generation holds "
            "keys and values per attention layer only; the forward compiles without max_cache_len."
        )


def _shared_inputs(graph: CapturedGraph, graph_plan: Plan, parts: Partitions, rank: int, decode: CapturedGraph,
                   values: dict[str, torch.Tensor], name: str) -> tuple[str | int, ...]:
    """Per placeholder of ``graph``: the decode graph's slot whose tensor it takes (one set of shards, one
    cache), or the index of the user input. PlanError if a weight or cache ``graph`` reads would have a shard
    of another shape under ``graph_plan`` (its ``parts``) than the decode graph's."""
    by_fqn = {str(s.target): s.name for s in decode.inputs if s.kind != "user"}
    placeholders = {n.name: n for n in graph.graph_module.graph.nodes if n.op == "placeholder"}
    for slot in graph.inputs:
        node = placeholders[slot.name]
        if slot.kind == "user" or not node.users:
            continue
        split = slot.kind == "parameter" or slot.name in graph.state  # other buffers and constants stay whole
        placement = graph_plan.parameters[str(slot.target)] if split else "R"
        expected = local_shape(node.meta["val"].shape, placement, parts, slot.name, rank)
        held = tuple(values[by_fqn[str(slot.target)]].shape)
        if held != expected:
            raise PlanError(
                f"{slot.target}: the {name} plan's shard {expected} differs from the decode plan's {held}; the "
                f"graphs must share it"
            )
    return tuple(s.target if s.kind == "user" else by_fqn[str(s.target)] for s in graph.inputs)


def _continuation_options(decode_plan: Plan, prefill_plan: Plan | None, options: PlanOptions) -> PlanOptions:
    """Options of the continuation graph: every placement pinned to the decode plan's; and where neither other
    phase has a collective (the first rank may run a request alone, :func:`first_rank_alone`), every tensor
    whole, so that a long prompt does not bring the other ranks in."""
    pinned = _pinned_to(decode_plan, options)
    if decode_plan.collectives or (prefill_plan is not None and prefill_plan.collectives):
        return pinned
    return dataclasses.replace(pinned, strategy_filter=_whole_only(options))


def _whole_only(options: PlanOptions) -> StrategyFilter:
    """``options``' strategy filter narrowed to strategies that keep every tensor whole (``keep_whole``)."""
    narrow = options.strategy_filter
    return keep_whole if narrow is None else lambda graph: keep_whole(narrow(graph))


def _pinned_to(placed: Plan, options: PlanOptions) -> PlanOptions:
    """``options`` with every weight and cache pinned to ``placed``'s placement (one set of shards for both
    graphs); with placements pinned, the memory budget has nothing left to decide."""
    return dataclasses.replace(options, memory_budget=None, constraints=dict(placed.parameters))


def _plan_phases(decode: CapturedGraph, prefill: CapturedGraph | None, plan: Plan | None, options: PlanOptions,
                 *, solve: Solve, talk: bool) -> tuple[Plan, Plan | None, PhaseWeighting | None]:
    """The decode plan, the prefill plan (``None`` without a prefill graph) and how the phases were weighed.
    ``solve``: :func:`~autotp.runtime.execution.applying.plan_or_check` bound to the group, rank and plan cache.

    With ``plan=`` (a decode plan) its placements are kept and prefill is pinned to them. Otherwise
    each phase is planned alone and the other pinned to its placements; :func:`weigh_phases` keeps
    the pair with the least ``prefill + expected_new_tokens x decode`` (see :mod:`autotp.planning.phases`).
    Every rank receives the same plans from the first rank, so every rank keeps the same pair.
    """
    expected_new_tokens = options.expected_new_tokens
    decode_plan = solve(decode, plan, options)
    if prefill is None:
        return decode_plan, None, None
    hardware = options.hardware_profile
    call_s = graph_host_s(hardware)  # what each call pays once beyond its plan, every rank computing
    by_decode = PhaseCandidate("decode", solve(prefill, None, _pinned_to(decode_plan, options)), decode_plan,
                               call_s, call_s)
    if plan is not None:
        return decode_plan, by_decode.prefill, None
    log_progress(talk, f"planning prefill alone, then decode pinned to it (phase weights: prefill + "
                       f"{expected_new_tokens} x decode)")
    prefill_alone = solve(prefill, None, options)
    candidates = [by_decode]
    if prefill_alone.parameters == decode_plan.parameters:
        candidates.append(PhaseCandidate("prefill", prefill_alone, decode_plan, call_s, call_s))
    else:
        try:
            candidates.append(PhaseCandidate("prefill", prefill_alone,
                                             solve(decode, None, _pinned_to(prefill_alone, options)), call_s, call_s))
        except PlanError:  # decode cannot take prefill's placements (raised on every rank alike): no candidate
            log_progress(talk, "decode cannot take the placements prefill chose alone; keeping decode's")
    could_run_alone = first_rank_alone(world_size=options.world_size, ranks_share_host=hardware.host_is_device,
                                       decode_collectives=False, prefill_collectives=False).prefill
    if could_run_alone and hardware.alone() is not hardware:  # else the MILP already priced it as run alone
        log_progress(talk, f"planning both phases whole, priced at a whole core (one rank alone; the profile's "
                           f"rates are at a share of {hardware.core_share:.2f})")
        whole = _whole_candidate(decode, prefill, options, decode_plan.memory_budget_bytes, solve=solve)
        if whole is not None:
            candidates = [_priced_as_run(c, whole, options.world_size, hardware.host_is_device) for c in candidates]
            candidates.append(whole)
    weighting = weigh_phases(candidates, expected_new_tokens)
    log_progress(talk, str(weighting))
    return weighting.chosen.decode, weighting.chosen.prefill, weighting


def _whole_candidate(decode: CapturedGraph, prefill: CapturedGraph, options: PlanOptions,
                     decode_budget_bytes: float | None, *, solve: Solve) -> PhaseCandidate | None:
    """Both phases with every tensor whole, priced on ``Hardware.alone()`` (the first rank runs them while
    the others wait); None when the memory budget or the constraints do not allow every weight whole.

    ``decode_budget_bytes``: the decode plan's budget in bytes; ``memory_budget="auto"`` is resolved on the
    graph with every split on offer, so it is passed as that number (with splits filtered out, "auto"
    would find no matrix to split and allow every one whole)."""
    budget = decode_budget_bytes if options.memory_budget == "auto" else options.memory_budget
    alone = dataclasses.replace(options, hardware=options.hardware_profile.alone(), memory_budget=budget,
                                strategy_filter=_whole_only(options))
    try:
        decode_plan = solve(decode, None, alone)
        prefill_plan = solve(prefill, None, alone)
    except PlanError:  # raised on every rank alike (plan_on_first_rank shares rank 0's failure)
        return None
    call_s = graph_host_s(alone.hardware_profile)
    return PhaseCandidate("whole", prefill_plan, decode_plan, call_s, call_s)


def _priced_as_run(candidate: PhaseCandidate, whole: PhaseCandidate, world_size: int,
                   ranks_share_host: bool) -> PhaseCandidate:
    """``candidate`` with the phases the first rank would run alone (:func:`first_rank_alone`) replaced by
    ``whole``'s plans of them, which compute the same on one rank and are priced at a whole core; as is
    when it has collectives in decode or its placements are not all whole."""
    alone = first_rank_alone(world_size=world_size, ranks_share_host=ranks_share_host,
                             decode_collectives=bool(candidate.decode.collectives),
                             prefill_collectives=bool(candidate.prefill.collectives))
    if not alone.decode or candidate.decode.parameters != whole.decode.parameters:
        return candidate
    prefill = {"prefill": whole.prefill, "prefill_call_s": whole.prefill_call_s} if alone.prefill else {}
    return dataclasses.replace(candidate, decode=whole.decode, decode_call_s=whole.decode_call_s, **prefill)
