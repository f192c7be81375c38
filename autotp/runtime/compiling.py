"""Compiling a model over one tensor-parallel group: what ``autotp.compile`` does without a mesh.

The front doors (:mod:`autotp.api`, :mod:`autotp.pretrained`) and the mesh runtime
(:mod:`autotp.runtime.mesh`, one compile per pipeline stage) call :func:`compile_group`; it runs
the stages of :mod:`autotp.runtime.applying` (capture, agree, plan or check, rewrite, shard) and,
for generation, :mod:`autotp.runtime.generation`. Options come in as validated frozen values
(:class:`~autotp.planning.options.PlanOptions`, :class:`~autotp.runtime.options.RuntimeOptions`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.progress import log_progress
from autotp.capture import capture, check_model, random_state_fingerprint, trace_device
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan, as_plan
from autotp.runtime.agreement import (
    InputGuard,
    agreed_options,
    compile_record,
    options_record,
    plan_text,
    ranks_agree,
)
from autotp.runtime.applying import apply_plan, plan_or_check
from autotp.runtime.checkpointing import checkpointed_graph
from autotp.runtime.generation import compile_for_generation
from autotp.runtime.generation_on_demand import ForwardOnDemand, GenerationOnDemand
from autotp.runtime.group import PlannedAhead, bind_group, plan_ahead
from autotp.runtime.hosts import Host
from autotp.runtime.kv_cache import check_causal_lm
from autotp.runtime.loading import TensorSource, agree_on_success
from autotp.runtime.module import TensorParallelModule
from autotp.runtime.options import RuntimeOptions, runtime_host
from autotp.runtime.runtime_modes import priced_in, resolve_runtime_mode
from autotp.runtime.saving import open_checkpoint
from autotp.runtime.shared_trace import FirstRankTrace
from autotp.trace_cache import TraceCache, open_trace_cache

__all__ = ["compile_group"]


def compile_group(model: torch.nn.Module, *, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
                  world_size: int | None, group: dist.ProcessGroup | None, plan: Plan | str | os.PathLike[str] | None,
                  checkpoint: str | os.PathLike[str] | None, max_cache_len: int | None, options: PlanOptions,
                  runtime: RuntimeOptions) -> TensorParallelModule:
    """This rank's :class:`TensorParallelModule` over ``group``: see :func:`autotp.compile`. ``options`` come
    from :func:`~autotp.planning.options.plan_options` (their ``world_size`` is set here, from the group)."""
    requested = options  # as asked for, before the group and the runtime mode set theirs
    training, progress = options.training, options.progress
    timeout_s = runtime.agreement_timeout_s
    check_weights = runtime.check_weights
    host = runtime_host(runtime)
    cache = open_trace_cache(runtime.trace_cache, checkpoint)
    ahead: PlannedAhead | None = None
    with ranks_agree(group, timeout_s=timeout_s, what="autotp.compile") as agreement:
        check_model(model)
        world_size, rank = bind_group(group, world_size, caller="autotp.compile")
        if checkpoint is None and any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(
                "autotp.compile needs real weights, but the model has parameters on the meta device; "
                "pass checkpoint='path/to/model.safetensors' (or its directory) to read each rank's shards from it, "
                "use autotp.plan(...) to plan a meta model, or load its weights first"
            )
        plan = as_plan(plan)
        # the plan is priced in the mode that runs (Hardware.runtime_mode)
        device = trace_device(example_inputs, example_kwargs)
        mode = resolve_runtime_mode(runtime.runtime_mode, device, training=training, talk=progress and rank == 0)
        options = priced_in(dataclasses.replace(options, world_size=world_size), mode,
                            requested=runtime.runtime_mode, device=device)
        agreed = agreed_options(options, plan=plan_text(plan), check_weights=check_weights,
                                checkpoint=checkpoint is not None, max_cache_len=max_cache_len,
                                training=training,
                                **({"expected_new_tokens": options.expected_new_tokens}
                                   if max_cache_len is not None else {}))
        if max_cache_len is not None:  # the generation graphs are captured later; agree on options and weights now
            weights = dict(model.state_dict()) if check_weights and checkpoint is None else None
            agreement.record = options_record(agreed, weights=weights)
        else:
            log_progress(progress and rank == 0, f"tracing {type(model).__name__} with torch.export")
            captured = capture(model, example_inputs, example_kwargs, dynamic=options.dynamic,
                               dynamic_shapes=options.dynamic_shapes, training=training, trace_cache=cache,
                               share=FirstRankTrace(group, timeout_s=timeout_s))
            if training and (fingerprint := random_state_fingerprint(captured.graph_module)) is not None:
                # dropout: every rank must draw the same masks (seed every rank alike before compiling)
                agreed["random number generator state (seed every rank alike, e.g. torch.manual_seed(0))"] = fingerprint
            weights = captured.exported.state_dict if check_weights and checkpoint is None else None
            agreement.record = compile_record(captured, weights=weights, options=agreed)
            if plan is None:  # rank 0 plans while the others rebuild the program it sent (used once the ranks agree)
                agreement.extra_wait_s = options.time_limit_s
                ahead = plan_ahead(captured, options, group=group, rank=rank, plan_cache=cache)
    files = None
    if checkpoint is not None:  # headers only, agreed by all ranks: a bad file fails before planning, everywhere
        files = agree_on_success(group, lambda: open_checkpoint(checkpoint), timeout_s=timeout_s)
    if max_cache_len is not None:
        generating = compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=options,
                                            plan=plan, group=group, rank=rank, host=host, timeout_s=timeout_s,
                                            runtime_mode=mode, files=files, device=device, trace_cache=cache)
        generating.generation_config = getattr(model, "generation_config", None)  # generate's defaults, as HF's
        generating.forward_on_demand = ForwardOnDemand(model, group=group, timeout_s=timeout_s, build=functools.partial(
            _compile_forward, world_size=world_size, group=group, checkpoint=checkpoint, options=requested,
            runtime=runtime))
        return generating
    plan = plan_or_check(captured, plan, options, group=group, rank=rank, agreement_timeout_s=timeout_s,
                         plan_cache=cache, ahead=ahead)
    local_gm, local_values, layout = apply_plan(captured, plan, group=group, rank=rank, host=host, files=files,
                                                model=model,
                                                device=trace_device(example_inputs, example_kwargs),
                                                timeout_s=timeout_s, training=training)
    if options.activation_checkpointing == "blocks":
        local_gm = checkpointed_graph(local_gm)
    on_demand = None
    if not training and options.outputs == "replicated" and _is_causal_lm(model):
        on_demand = GenerationOnDemand(model, example_inputs, group=group, timeout_s=timeout_s, build=functools.partial(
            _compile_for_generation, options=options, group=group, rank=rank, host=host, timeout_s=timeout_s,
            runtime_mode=mode, device=device, trace_cache=cache), files=files)
    return TensorParallelModule(captured, local_gm, plan, local_values, rank, layout,
                                guard=InputGuard(captured, group=group, timeout_s=timeout_s),
                                training=training, original=model, group=group, generation_on_demand=on_demand,
                                runtime_mode=mode, progress=progress)


def _is_causal_lm(model: torch.nn.Module) -> bool:
    """True for a HuggingFace causal LM, which ``generate`` can build generation graphs for."""
    try:
        check_causal_lm(model)
    except TypeError:
        return False
    return True


def _compile_forward(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any], *,
                     world_size: int, group: dist.ProcessGroup | None, checkpoint: str | os.PathLike[str] | None,
                     options: PlanOptions, runtime: RuntimeOptions) -> TensorParallelModule:
    """``compile(model, example_inputs, example_kwargs=...)`` after a generation compile with ``options``: what
    :class:`~autotp.runtime.generation_on_demand.ForwardOnDemand` builds at the first plain call."""
    return compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs or None,
                         world_size=world_size, group=group, plan=None, checkpoint=checkpoint, max_cache_len=None,
                         options=options, runtime=runtime)


def _compile_for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], max_cache_len: int,
                            files: TensorSource | None, *, options: PlanOptions, group: dist.ProcessGroup | None,
                            rank: int, host: Host, timeout_s: float, runtime_mode: str, device: torch.device,
                            trace_cache: TraceCache | None) -> TensorParallelModule:
    """``compile(model, ..., max_cache_len=max_cache_len)`` after the plain compile that planned with ``options``:
    what :class:`~autotp.runtime.generation_on_demand.GenerationOnDemand` builds on the first ``generate``
    (``files``: the checkpoint that compile read, seen through its module's blocks, or None; ``trace_cache``: that
    compile's)."""
    return compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=options, plan=None,
                                  group=group, rank=rank, host=host, timeout_s=timeout_s, runtime_mode=runtime_mode,
                                  files=files, device=device, trace_cache=trace_cache)
