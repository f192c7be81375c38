"""The compile driver: what ``autotp.compile`` does over one tensor-parallel group, as one function that calls
the stages in order.

:func:`compile_group` is read top to bottom; each step hands its result to the next and none calls back::

    1. bind      the group's size and this rank, the device, the runtime mode, and the planning options
                 priced in that mode (Hardware.runtime_mode)
    2. capture   torch.export of the model (autotp.capture.tracing; the first rank's trace shared with the others)
    3. agree     the ranks compare their graphs, options and weights (autotp.runtime.agreement.exchanges); rank 0
                 starts planning meanwhile (autotp.runtime.agreement.group.plan_ahead)
    4. plan      rank 0's plan sent to every rank, or the given plan checked (autotp.runtime.execution.applying.plan_or_check)
    5. read      the checkpoint's headers, agreed by every rank (autotp.runtime.checkpoints.loading), with ``checkpoint=``
    6. apply     the rank-local graph and this rank's shards (autotp.runtime.execution.applying.apply_plan)
    7. module    the TensorParallelModule this rank calls

A generation compile (``max_cache_len``) agrees on the options and weights in step 3 and hands steps 2, 4 and 6
to :func:`autotp.runtime.generation.compile_for_generation.compile_for_generation`, which captures prefill and decode graphs.

The front doors (:mod:`autotp.api`, :mod:`autotp.pretrained`) call it once; ``autotp.compile_mesh`` hands it
to :func:`autotp.runtime.mesh.mesh_module.compile_on_mesh`, which calls it once per pipeline stage over the stage's tp
group; calibration compiles its small model with it. Options come in as validated frozen values
(:class:`~autotp.planning.options.PlanOptions`, :class:`~autotp.runtime.execution.options.RuntimeOptions`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.progress import log_progress
from autotp.capture.kv_cache import check_causal_lm
from autotp.capture.trace_cache import TraceCache, open_trace_cache
from autotp.capture.tracing import CapturedGraph, capture, check_model, random_state_fingerprint, trace_device
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan, as_plan
from autotp.runtime.agreement.exchanges import (
    InputGuard,
    agreed_options,
    compile_record,
    options_record,
    plan_text,
    ranks_agree,
)
from autotp.runtime.agreement.group import bind_group, plan_ahead
from autotp.runtime.agreement.shared_trace import FirstRankTrace
from autotp.runtime.checkpoints.loading import TensorSource, agree_on_success
from autotp.runtime.checkpoints.saving import open_checkpoint
from autotp.runtime.collectives.hosts import Host
from autotp.runtime.execution.applying import apply_plan, plan_or_check
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.options import RuntimeOptions, runtime_host
from autotp.runtime.execution.runtime_modes import mode_and_pricing
from autotp.runtime.generation.compile_for_generation import compile_for_generation
from autotp.runtime.generation.generation_on_demand import ForwardOnDemand, GenerationOnDemand
from autotp.runtime.training.checkpointing import checkpointed_graph

__all__ = ["compile_group"]


@dataclasses.dataclass(frozen=True)
class _Bound:
    """Step 1's result: where this compile runs and the options it plans with."""

    world_size: int
    rank: int
    device: torch.device
    mode: str  # the runtime mode that runs here (RuntimeOptions.runtime_mode resolved on ``device``)
    options: PlanOptions  # with the group's world size, priced in ``mode``
    plan: Plan | None  # the given plan, loaded


def compile_group(model: torch.nn.Module, *, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
                  world_size: int | None, group: dist.ProcessGroup | None, plan: Plan | str | os.PathLike[str] | None,
                  checkpoint: str | os.PathLike[str] | None, max_cache_len: int | None, options: PlanOptions,
                  runtime: RuntimeOptions) -> TensorParallelModule:
    """This rank's :class:`TensorParallelModule` over ``group``: see :func:`autotp.compile` and the module
    docstring for the steps. ``options`` come from :func:`~autotp.planning.options.plan_options` (their
    ``world_size`` is set here, from the group); ``runtime`` from :func:`~autotp.runtime.execution.options.runtime_options`."""
    timeout_s, host = runtime.agreement_timeout_s, runtime_host(runtime)
    cache = open_trace_cache(runtime.trace_cache, checkpoint)
    ahead = None
    with ranks_agree(group, timeout_s=timeout_s, what="autotp.compile") as agreement:  # 3. an error here reaches all
        bound = _bind(model, example_inputs, example_kwargs, world_size, group, plan, checkpoint, options, runtime)
        agreed = agreed_options(bound.options, plan=plan_text(bound.plan), check_weights=runtime.check_weights,
                                checkpoint=checkpoint is not None, max_cache_len=max_cache_len,
                                training=bound.options.training,
                                **({"expected_new_tokens": bound.options.expected_new_tokens}
                                   if max_cache_len is not None else {}))
        compare_weights = runtime.check_weights and checkpoint is None
        if max_cache_len is not None:  # the generation graphs are captured later; agree on options and weights now
            agreement.record = options_record(agreed, weights=dict(model.state_dict()) if compare_weights else None)
        else:
            captured = _capture(model, example_inputs, example_kwargs, bound, group=group, timeout_s=timeout_s,
                                cache=cache)  # 2.
            agreement.record = _capture_record(captured, agreed, bound, compare_weights=compare_weights)
            if bound.plan is None:  # rank 0 plans while the others rebuild the program it sent
                agreement.extra_wait_s = bound.options.time_limit_s
                ahead = plan_ahead(captured, bound.options, group=group, rank=bound.rank, plan_cache=cache)
    files = None
    if checkpoint is not None:  # 5. headers only, agreed by all ranks: a bad file fails before planning, everywhere
        files = agree_on_success(group, lambda: open_checkpoint(checkpoint), timeout_s=timeout_s)
    if max_cache_len is not None:
        return _for_generation(model, example_inputs, max_cache_len, bound, group=group, host=host, files=files,
                               cache=cache, checkpoint=checkpoint, requested=options,
                               runtime=runtime)
    chosen = plan_or_check(captured, bound.plan, bound.options, group=group, rank=bound.rank,
                           agreement_timeout_s=timeout_s, plan_cache=cache, ahead=ahead)  # 4.
    local_gm, local_values, layout = apply_plan(captured, chosen, group=group, rank=bound.rank, host=host,
                                                files=files, model=model, device=bound.device, timeout_s=timeout_s,
                                                training=bound.options.training)  # 6.
    if bound.options.activation_checkpointing == "blocks":
        local_gm = checkpointed_graph(local_gm)
    return TensorParallelModule(  # 7.
        captured, local_gm, chosen, local_values, bound.rank, layout,
        guard=InputGuard(captured, group=group, timeout_s=timeout_s), training=bound.options.training,
        original=model, group=group, runtime_mode=bound.mode, progress=bound.options.progress,
        generation_on_demand=_generation_on_demand(model, example_inputs, bound, group=group, host=host,
                                                   timeout_s=timeout_s, files=files, cache=cache))


def _bind(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
          world_size: int | None, group: dist.ProcessGroup | None, plan: Plan | str | os.PathLike[str] | None,
          checkpoint: str | os.PathLike[str] | None, options: PlanOptions, runtime: RuntimeOptions) -> _Bound:
    """Step 1: check the model, read the group, load a given plan, and price the options in the mode that runs."""
    check_model(model)
    world_size, rank = bind_group(group, world_size, caller="autotp.compile")
    if checkpoint is None and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(
            "autotp.compile needs real weights, but the model has parameters on the meta device; "
            "pass checkpoint='path/to/model.safetensors' (or its directory) to read each rank's shards from it, "
            "use autotp.plan(...) to plan a meta model, or load its weights first"
        )
    loaded = as_plan(plan)
    device = trace_device(example_inputs, example_kwargs)
    mode, priced = mode_and_pricing(dataclasses.replace(options, world_size=world_size), runtime.runtime_mode, device,
                                    training=options.training, talk=options.progress and rank == 0)
    return _Bound(world_size, rank, device, mode, priced, loaded)


def _capture(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
             bound: _Bound, *, group: dist.ProcessGroup | None, timeout_s: float,
             cache: TraceCache | None) -> CapturedGraph:
    """Step 2: the model's ATen graph (from the trace cache, or traced on the first rank and shared)."""
    log_progress(bound.options.progress and bound.rank == 0, f"tracing {type(model).__name__} with torch.export")
    return capture(model, example_inputs, example_kwargs, dynamic=bound.options.dynamic,
                   dynamic_shapes=bound.options.dynamic_shapes, training=bound.options.training, trace_cache=cache,
                   share=FirstRankTrace(group, timeout_s=timeout_s))


def _capture_record(captured: CapturedGraph, agreed: dict[str, object], bound: _Bound, *,
                    compare_weights: bool) -> Any:
    """Step 3's record of a captured graph: what every rank must share (graph, options, weights, random state)."""
    if bound.options.training and (fingerprint := random_state_fingerprint(captured.graph_module)) is not None:
        # dropout: every rank must draw the same masks (seed every rank alike before compiling)
        agreed["random number generator state (seed every rank alike, e.g. torch.manual_seed(0))"] = fingerprint
    weights = captured.exported.state_dict if compare_weights else None
    return compile_record(captured, weights=weights, options=agreed)


def _for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], max_cache_len: int, bound: _Bound, *,
                    group: dist.ProcessGroup | None, host: Host, files: TensorSource | None, cache: TraceCache | None,
                    checkpoint: str | os.PathLike[str] | None, requested: PlanOptions,
                    runtime: RuntimeOptions) -> TensorParallelModule:
    """Steps 2, 4 and 6 of a generation compile (prefill and decode graphs), and the plain forward it builds at
    its first plain call (with the options as ``requested``, before the group and the runtime mode set theirs)."""
    generating = compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=bound.options,
                                        plan=bound.plan, group=group, rank=bound.rank, host=host,
                                        timeout_s=runtime.agreement_timeout_s, runtime_mode=bound.mode, files=files,
                                        device=bound.device, trace_cache=cache)
    generating.generation_config = getattr(model, "generation_config", None)  # generate's defaults, as HF's
    generating.forward_on_demand = ForwardOnDemand(
        model, group=group, timeout_s=runtime.agreement_timeout_s,
        build=functools.partial(_compile_forward, world_size=bound.world_size, group=group, checkpoint=checkpoint,
                                options=requested, runtime=runtime))
    return generating


def _generation_on_demand(model: torch.nn.Module, example_inputs: tuple[Any, ...], bound: _Bound, *,
                          group: dist.ProcessGroup | None, host: Host, timeout_s: float, files: TensorSource | None,
                          cache: TraceCache | None) -> GenerationOnDemand | None:
    """What ``tp.generate`` builds its graphs with on its first call: for a causal LM compiled for inference with
    whole outputs; None otherwise."""
    if bound.options.training or bound.options.outputs != "replicated" or not _is_causal_lm(model):
        return None
    return GenerationOnDemand(model, example_inputs, group=group, timeout_s=timeout_s, build=functools.partial(
        _compile_for_generation, options=bound.options, group=group, rank=bound.rank, host=host, timeout_s=timeout_s,
        runtime_mode=bound.mode, device=bound.device, trace_cache=cache), files=files)


def _is_causal_lm(model: torch.nn.Module) -> bool:
    """True for a HuggingFace causal LM, which ``generate`` can build generation graphs for."""
    try:
        check_causal_lm(model)
    except TypeError:
        return False
    return True


def _compile_forward(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any], *,
                     world_size: int | None, group: dist.ProcessGroup | None,
                     checkpoint: str | os.PathLike[str] | None, options: PlanOptions,
                     runtime: RuntimeOptions) -> TensorParallelModule:
    """``compile(model, example_inputs, example_kwargs=...)`` after a generation compile with ``options``: what
    :class:`~autotp.runtime.generation.generation_on_demand.ForwardOnDemand` builds at the first plain call."""
    return compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs or None,
                         world_size=world_size, group=group, plan=None, checkpoint=checkpoint, max_cache_len=None,
                         options=options, runtime=runtime)


def _compile_for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], max_cache_len: int,
                            files: TensorSource | None, *, options: PlanOptions, group: dist.ProcessGroup | None,
                            rank: int, host: Host, timeout_s: float, runtime_mode: str, device: torch.device,
                            trace_cache: TraceCache | None) -> TensorParallelModule:
    """``compile(model, ..., max_cache_len=max_cache_len)`` after the plain compile that planned with ``options``:
    what :class:`~autotp.runtime.generation.generation_on_demand.GenerationOnDemand` builds on the first ``generate``
    (``files``: the checkpoint that compile read, seen through its module's blocks, or None; ``trace_cache``: that
    compile's)."""
    return compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=options, plan=None,
                                  group=group, rank=rank, host=host, timeout_s=timeout_s, runtime_mode=runtime_mode,
                                  files=files, device=device, trace_cache=trace_cache)
