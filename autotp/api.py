"""The front doors: ``autotp.plan`` / ``autotp.plan_mesh`` (decide) and ``autotp.compile`` /
``autotp.compile_mesh`` (decide and apply).

Pipeline (each step a pure function of its inputs; see ARCHITECTURE.md)::

    capture      nn.Module -> CapturedGraph (ATen FX graph, FakeTensor shapes)
    strategies   -> StrategyGraph (candidate placements of every node)
    cost         -> CostedGraph (predicted seconds and bytes per strategy)
    solve        -> Solution (MILP, HiGHS)
    plan         -> Plan (data: inspect, save, edit, reload)
    rewrite      -> rank-local GraphModule (sharded weights, functional collectives)

The keywords say what to build (the model, its example inputs, the ranks, a given plan or checkpoint, a KV
cache's length); every other option is given one way, in one of two frozen values validated where built:
:class:`~autotp.planning.options.PlanOptions` (``options=``: how to plan) and
:class:`~autotp.runtime.execution.options.RuntimeOptions` (``runtime=``: how the ranks agree and run, the trace cache).
The compile driver below (:mod:`autotp.driver`) calls the stages in order; nothing
imports this module but :mod:`autotp` and the other front doors.
"""

from __future__ import annotations

import os
from typing import Any, overload

import torch
import torch.distributed as dist

from autotp.base.progress import log_progress
from autotp.capture.tracing import capture, check_model, inputs_on_model_device
from autotp.driver import compile_group
from autotp.planning.mesh_plan import MeshShape, ParallelPlan
from autotp.planning.mesh_search import plan_mesh as search_mesh
from autotp.planning.options import PlanOptions, check_world_size, moved_to_options, plan_options, search_options
from autotp.planning.plan import Plan
from autotp.planning.planner import plan_graph
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.options import RuntimeOptions, runtime_options
from autotp.runtime.generation.compile_for_generation import generation_inputs
from autotp.runtime.mesh.mesh_generate import MeshGenerationModule, compile_generation_on_mesh
from autotp.runtime.mesh.mesh_module import MeshParallelModule, compile_on_mesh

__all__ = ["compile", "compile_mesh", "plan", "plan_mesh"]

_PLAN_MOVED = ("hardware", "memory_budget", "constraints", "training")
"""The :class:`PlanOptions` fields :func:`plan` once took as keywords (deprecated: they go in ``options=``)."""
_COMPILE_MOVED = ("hardware", "training")
"""The same for :func:`compile`, :func:`compile_mesh`, :func:`autotp.from_pretrained` and :func:`autotp.load`."""


def plan(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    max_cache_len: int | None = None,
    options: PlanOptions | None = None,
    **deprecated: Any,
) -> Plan:
    """Decide how to split ``model`` over one tensor-parallel group of ``world_size`` ranks, without running
    anything; returns the :class:`Plan`. (Data x pipeline x tensor parallelism: :func:`plan_mesh`.)

    Needs no process group and no real weights: a model built on the ``meta`` device is fine.

    Everything else about how to plan is a field of ``options``, an :class:`~autotp.PlanOptions`
    (e.g. ``options=autotp.PlanOptions(hardware="a100-sxm", memory_budget=None)``). ``memory_budget`` is the
    most parameter bytes one rank may hold:

    - ``"auto"`` (default): the weights are *distributed* — each rank holds about
      ``1/world_size`` of the parameter bytes: room for every matrix split along one of its
      dims, while 1-D tensors such as norms and biases may stay whole. Tensor parallelism is
      usually asked for because the weights do not fit one device, so the default keeps that
      promise; within it, the cost model chooses *how* to split so communication is least.
    - a number of bytes per rank: tighter or looser than the default.
    - ``None``: no limit; the cost model may keep layers whole where splitting does not pay.

    ``hardware`` names a profile of :data:`autotp.cost_model.KNOWN_HARDWARE`, or is a
    :class:`~autotp.cost_model.Hardware` or a path to a JSON profile.
    ``constraints`` pins placements before solving: ``{fnmatch pattern over parameter FQNs and
    node names: placement}``, e.g. ``{"model.layers.*.mlp.down_proj.weight": Replicate()}``
    (see :mod:`autotp.planning.constraints`).
    ``max_cache_len`` plans a causal LM's decode step with a KV cache of that many slots per row
    (the cache placed like a parameter), as :func:`compile` does with it.

    ``training=True`` (in ``options``) plans a training step: forward and backward are priced together (each
    collective's adjoint, the backward's compute) and memory counts gradients,
    ``optimizer_states`` fp32 values per parameter element (default 2, AdamW) and the
    activations kept for the backward (see :mod:`autotp.passes.backward`); ``print(plan)``
    shows where it differs from the inference plan.

    The other fields of ``options``:

    - ``strict=True`` raises instead of running ops without a sharding rule replicated;
      ``time_limit_s`` bounds the solver; ``progress=True`` prints what planning does.
    - ``dynamic`` (default True) traces the batch and sequence dims (dims 0 and 1 of every tensor
      input) as symbols, so the plan serves every size; only static dims are split. ``dynamic=False``
      pins every size to the example's; ``dynamic_shapes`` is passed to ``torch.export`` as is
      (see :mod:`autotp.capture.tracing`).
    - ``outputs="local"`` plans outputs returned as computed (a split output is not gathered, and
      its gather is not priced) instead of whole on every rank (see :mod:`autotp.planning.outputs`).
    - ``dropout="split"`` (with ``training``) lets dropout run on split activations (per-rank random
      streams, as Megatron-LM's; :mod:`autotp.passes.random_streams`) instead of gathering them first.
    - ``activation_checkpointing="blocks"`` (with ``training``) prices checkpointed blocks: activations
      kept are the blocks' inputs plus one block's, and each block's forward runs again.
    - ``optimizer_states`` (with ``training``), ``expected_new_tokens`` (with ``max_cache_len``).
    """
    options = moved_to_options("autotp.plan", options, deprecated, taken=_PLAN_MOVED)
    check_model(model)
    options = plan_options(options, world_size=check_world_size(world_size), max_cache_len=max_cache_len)
    if max_cache_len is not None:
        wrapper, _, _ = generation_inputs(model, example_inputs, max_cache_len)
        log_progress(options.progress,
                     f"tracing {type(model).__name__}'s decode step with a KV cache of {max_cache_len} slots")
        return plan_graph(capture(wrapper, inputs_on_model_device(model, wrapper.example_inputs(1)), dynamic=False),
                          options)
    log_progress(options.progress, f"tracing {type(model).__name__} with torch.export")
    captured = capture(model, inputs_on_model_device(model, example_inputs),
                       inputs_on_model_device(model, example_kwargs), dynamic=options.dynamic,
                       dynamic_shapes=options.dynamic_shapes,
                       training=options.training)  # a training plan may sample (dropout in train mode)
    return plan_graph(captured, options)


def plan_mesh(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    parallelism: str | dict[str, int] = "auto",
    mesh: MeshShape | None = None,
    objective: str = "latency",
    throughput_batch: int = 64,
    options: PlanOptions | None = None,
    **deprecated: Any,
) -> ParallelPlan:
    """Search data x pipeline x tensor parallelism for ``model`` over ``world_size`` ranks; returns the
    :class:`~autotp.planning.mesh_plan.ParallelPlan` (run it with :func:`compile_mesh`).

    ``parallelism="auto"`` (default) tries every ``dp * pp * tp == world_size``, the stage cuts and the
    microbatches on the nodes of ``options.hardware``; a dict such as ``{"tp": 8}`` (or ``mesh=MeshShape(dp=2, pp=1,
    tp=8)``) fixes some dims and searches the rest. ``objective``: ``"latency"`` (one request of batch 1)
    or ``"throughput"`` (requests per second at ``throughput_batch`` requests). ``options`` gives
    ``hardware``, ``time_limit_s`` and ``progress`` (each stage's own plan is made when compiling). See
    :mod:`autotp.planning.mesh_search`.
    """
    options = search_options(moved_to_options("autotp.plan_mesh", options, deprecated, taken=("hardware",)))
    check_model(model)
    return search_mesh(model, example_inputs, example_kwargs, world_size=check_world_size(world_size),
                       hardware=options.hardware, parallelism=parallelism, mesh=mesh, objective=objective,
                       throughput_batch=throughput_batch, time_limit_s=options.time_limit_s, progress=options.progress)


def compile(  # noqa: A001 - mirrors torch.compile
    model: torch.nn.Module,
    *,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    max_cache_len: int | None = None,
    options: PlanOptions | None = None,
    runtime: RuntimeOptions | None = None,
    **deprecated: Any,
) -> TensorParallelModule:
    """Make ``model`` tensor-parallel over the ranks of ``group`` (default: the whole world).

    Call it on every rank with the same model weights and example inputs. Returns this rank's
    :class:`TensorParallelModule`: called like ``model``, it returns the same outputs (within
    floating-point tolerance) on every rank. Each rank keeps only its shards of the split
    parameters, sliced once here. ``world_size`` defaults to the group's size; pass ``plan=``
    to apply a saved or hand-edited :class:`Plan` (or the path of a saved one) instead of
    planning. How to plan is ``options`` (:class:`~autotp.PlanOptions`: ``hardware``, ``training``,
    ``memory_budget``, ``constraints``, ``strict``, ``dynamic``, ``outputs``, ``dropout``,
    ``activation_checkpointing``...), as in :func:`autotp.plan`; how the ranks build and run is ``runtime``
    (:class:`~autotp.RuntimeOptions`). A Hugging Face model needs no ``example_kwargs``: it is traced with
    ``use_cache=False``, and the result takes calls with ``use_cache`` left out, False or True, returning the
    model's output without its cache part (``past_key_values`` None; :mod:`autotp.adapters.hf_transformers`).
    (Over a ``DeviceMesh``, data x pipeline x tensor parallel: :func:`compile_mesh`.)

    The ranks check that they agree before a plan is used (:mod:`autotp.runtime.agreement.exchanges`; rank 0 plans
    meanwhile, while the others rebuild the program it traced, and sends its plan once they agree): that
    every rank traced the model, the same graph, with the same options and the same full
    weights (a float64 sum and a sampled hash per weight; ``runtime=RuntimeOptions(check_weights=False)``
    skips this for huge models loaded from one checkpoint, and it is skipped with ``checkpoint=``). Any
    difference raises the same :class:`~autotp.AgreementError` on every rank, naming the ranks
    and what differs. No rank waits for the others longer than ``runtime.agreement_timeout_s`` seconds
    at any exchange (:class:`~autotp.RankTimeoutError` names the ranks that did not arrive; the
    agreement and the plan from rank 0 may take ``time_limit_s`` more). Each call of the result checks that
    non-tensor arguments have their traced values and that the input shapes agree across ranks
    (once per new shape).

    Shapes: with ``dynamic=True`` (default) the returned module serves every batch size and
    sequence length from this one trace (no re-trace, no re-plan per call); a dim that stayed
    static raises :class:`~autotp.base.errors.InputShapeError` when called with another size.

    ``checkpoint`` (a ``.safetensors`` file or a directory of them, with or without
    ``model.safetensors.index.json``, or a directory written by ``tp.save``): read each rank's
    shards from it instead of slicing the model's weights, so ``model`` may live on the ``meta``
    device and no rank holds the whole model. Shards land on the device of ``example_inputs``,
    cast to the model's dtype. See :mod:`autotp.runtime.checkpoints.loading`.

    ``max_cache_len``: for a HuggingFace causal LM, build it for text generation instead
    (:meth:`TensorParallelModule.generate`): a KV cache of ``max_cache_len`` slots per row, one
    row per row of ``example_inputs[0]`` (token ids, ``(batch, seq)``), placed by the planner like
    a parameter. Two graphs share the weights' shards and the cache: decode (one token per
    row) and prefill (``seq`` prompt tokens per call) share every weight's placement, chosen to
    minimise the predicted ``prefill + expected_new_tokens x decode`` (``options.expected_new_tokens``,
    default 128 new tokens per prompt; see :mod:`autotp.planning.phases`). ``plan=`` then gives the decode
    plan, whose placements prefill is pinned to. See :mod:`autotp.runtime.generation.compile_for_generation`. Without ``max_cache_len`` a
    causal LM compiled for inference still generates: ``tp.generate`` builds these graphs on its first call,
    with a cache sized for the request, from ``model`` (held by a weak reference: keep it until then), or with
    ``checkpoint=`` from the checkpoint (each rank reads the blocks its module does not hold); see
    :mod:`autotp.runtime.generation.generation_on_demand`. With ``checkpoint=`` and ``max_cache_len`` the generation graphs
    are captured on the (meta) model and each rank reads its blocks of the weights once for all of them.

    ``options=PlanOptions(training=True)``: build it for training. The result's parameters (``tp.parameters()``, named
    by the original FQNs in ``tp.named_parameters()``) are this rank's shards and require grad;
    ``loss.backward()`` gives each shard the matching block of the single-device gradient and every
    replicated parameter its whole gradient, the same on every rank (each collective carries its
    adjoint: :mod:`autotp.passes.adjoints`). Build the optimizer over ``tp.parameters()``;
    ``tp.full_state_dict()`` gathers the full tensors. See the README's "Training" section.
    ``options=PlanOptions(training=True, activation_checkpointing="blocks")`` runs each repeated block of the
    rank-local graph (``model.layers.3``...) under ``torch.utils.checkpoint``: the forward keeps only
    the blocks' inputs, the backward recomputes each block, collectives included
    (:mod:`autotp.runtime.training.checkpointing`).

    ``options=PlanOptions(outputs="local")``: return each output as this rank computes it instead of whole
    on every rank (``tp.output_placements`` says, per flattened output, ``"R"``, ``"S(d)"`` or ``"P"``):
    e.g. a training step returning its loss (whole) and this rank's vocabulary block of the logits, which
    are then never gathered (:mod:`autotp.planning.outputs`). Not with ``max_cache_len=``.

    ``dropout`` (in ``options``): ``"replicated"`` (default) draws every dropout mask whole from the shared
    random stream (the same on every rank: the loss equals one process's with the same seed), gathering a
    split activation first; ``"split"`` (with ``training=True``) lets the planner keep it split, each
    rank masking its block from its own stream seeded ``torch.initial_seed() + 2718 + rank``
    (Megatron-LM's model-parallel RNG), while replicated activations keep the shared stream
    (:mod:`autotp.passes.random_streams`).

    ``runtime=RuntimeOptions(trace_cache=...)``: reuse the program ``torch.export`` made of this model and
    these inputs' specs before (tracing is most of a large model's load time): ``True`` for
    ``$AUTOTP_CACHE_DIR`` (default ``~/.cache/autotp``; ``$AUTOTP_CACHE=0`` turns it off), a directory, or
    ``False`` (default here; :func:`autotp.from_pretrained` and :func:`autotp.load` default to ``True``).
    The plan made for the traced graph and these options is kept there too and reused (checked
    against the graph as a given ``plan=`` is). See :mod:`autotp.capture.trace_cache`.
    """
    options = plan_options(moved_to_options("autotp.compile", options, deprecated, taken=_COMPILE_MOVED),
                           max_cache_len=max_cache_len)
    return compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs, world_size=world_size,
                         group=group, plan=plan, checkpoint=checkpoint, max_cache_len=max_cache_len, options=options,
                         runtime=runtime_options(runtime))


@overload
def compile_mesh(model: torch.nn.Module, mesh: Any, *, example_inputs: tuple[Any, ...],
                 example_kwargs: dict[str, Any] | None = None,
                 plan: ParallelPlan | str | os.PathLike[str] | None = None,
                 checkpoint: str | os.PathLike[str] | None = None, max_cache_len: None = None,
                 options: PlanOptions | None = None, runtime: RuntimeOptions | None = None,
                 **deprecated: Any) -> MeshParallelModule: ...


@overload
def compile_mesh(model: torch.nn.Module, mesh: Any, *, example_inputs: tuple[Any, ...],
                 example_kwargs: dict[str, Any] | None = None,
                 plan: ParallelPlan | str | os.PathLike[str] | None = None,
                 checkpoint: str | os.PathLike[str] | None = None, max_cache_len: int,
                 options: PlanOptions | None = None, runtime: RuntimeOptions | None = None,
                 **deprecated: Any) -> MeshGenerationModule: ...


def compile_mesh(
    model: torch.nn.Module,
    mesh: Any,
    *,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | os.PathLike[str] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    max_cache_len: int | None = None,
    options: PlanOptions | None = None,
    runtime: RuntimeOptions | None = None,
    **deprecated: Any,
) -> MeshParallelModule | MeshGenerationModule:
    """Run ``model`` over ``mesh``, a ``torch.distributed.device_mesh.DeviceMesh`` with dims named from
    ``("dp", "pp", "tp")`` (a missing dim has size 1): data parallel x pipeline parallel x tensor parallel.

    Returns this rank's :class:`~autotp.runtime.mesh.mesh_module.MeshParallelModule`, whose output on every rank is the
    whole batch's (with ``options=PlanOptions(training=True)``, on a mesh without ``pp``: each data-parallel replica's output for
    its slice of the batch, gradients averaged over ``dp``). ``plan``: a
    :class:`~autotp.planning.mesh_plan.ParallelPlan` (from :func:`plan_mesh`; ``None``: the layer blocks cut
    into equal stages; or the path of one saved with ``ParallelPlan.save``). ``checkpoint=`` reads each
    rank's stage shards. With ``max_cache_len`` it is compiled for generation instead and returns a
    :class:`~autotp.runtime.mesh.mesh_generate.MeshGenerationModule`, whose ``generate`` returns the whole batch
    on every rank (not with ``checkpoint=`` or ``example_kwargs=`` yet). ``options`` and ``runtime``
    as in :func:`compile`, for each stage's tensor-parallel part. See
    :mod:`autotp.runtime.mesh.mesh_module` and :mod:`autotp.runtime.mesh.mesh_generate`.
    """
    options = plan_options(moved_to_options("autotp.compile_mesh", options, deprecated, taken=_COMPILE_MOVED),
                           max_cache_len=max_cache_len, mesh=True)
    runtime = runtime_options(runtime)
    if max_cache_len is None:
        return compile_on_mesh(model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs, plan=plan,
                               checkpoint=checkpoint, options=options, runtime=runtime, compile_group=compile_group)
    given = [name for name, value in (("checkpoint", checkpoint), ("example_kwargs", example_kwargs or None))
             if value is not None]
    if given:
        raise ValueError(f"autotp.compile_mesh(..., max_cache_len=...) does not take {', '.join(f'{n}=' for n in given)} "
                         "yet: generation over a mesh reads the model's own weights and token ids alone; drop them")
    return compile_generation_on_mesh(model, mesh, example_inputs=example_inputs, max_cache_len=max_cache_len,
                                      plan=plan, options=options, runtime=runtime)
