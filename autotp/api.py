"""The front door: ``autotp.plan`` (decide) and ``autotp.compile`` (decide and apply).

Pipeline (each step a pure function of its inputs; see ARCHITECTURE.md)::

    capture      nn.Module -> CapturedGraph (ATen FX graph, FakeTensor shapes)
    strategies   -> StrategyGraph (candidate placements of every node)
    cost         -> CostedGraph (predicted seconds and bytes per strategy)
    solve        -> Solution (MILP, HiGHS)
    plan         -> Plan (data: inspect, save, edit, reload)
    rewrite      -> rank-local GraphModule (sharded weights, functional collectives)
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.progress import log_progress
from autotp.capture import (
    CapturedGraph,
    capture,
    check_model,
    inputs_on_model_device,
    random_state_fingerprint,
    trace_device,
)
from autotp.cost_model import Hardware
from autotp.passes.backward import DEFAULT_OPTIMIZER_STATES
from autotp.passes.random_streams import check_dropout
from autotp.passes.rewrite import rewrite_for_rank
from autotp.passes.state import update_state_in_place
from autotp.passes.uneven import Partitions, build_partitions
from autotp.planning.checks import check_plan_applies
from autotp.planning.constraints import Constraints, check_plan_constraints
from autotp.planning.mesh_plan import MeshShape, ParallelPlan
from autotp.planning.options import DEFAULT_HARDWARE, PlanOptions, check_activation_checkpointing, check_world_size
from autotp.planning.outputs import check_outputs
from autotp.planning.phases import DEFAULT_EXPECTED_NEW_TOKENS, check_expected_new_tokens
from autotp.planning.plan import Plan, as_plan
from autotp.planning.planner import plan_graph
from autotp.runtime.agreement import (
    DEFAULT_AGREEMENT_TIMEOUT_S,
    InputGuard,
    agreed_options,
    check_timeout,
    compile_record,
    options_record,
    plan_text,
    ranks_agree,
)
from autotp.runtime.checkpointing import checkpointed_graph
from autotp.runtime.generation_on_demand import GenerationOnDemand
from autotp.runtime.group import PlannedAhead, bind_group, plan_ahead, plan_on_first_rank
from autotp.runtime.kv_cache import check_causal_lm
from autotp.runtime.loading import agree_on_success, open_checkpoint, read_local_values
from autotp.runtime.module import TensorParallelModule, parameter_layout, shard_tensor
from autotp.runtime.shared_memory import inference_all_reduces
from autotp.runtime.shared_trace import FirstRankTrace
from autotp.trace_cache import open_trace_cache

__all__ = ["compile", "plan"]


def plan(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    hardware: str | Hardware = DEFAULT_HARDWARE,
    memory_budget: float | int | str | None = "auto",
    strict: bool = False,
    time_limit_s: float = 60.0,
    progress: bool = False,
    constraints: Constraints | None = None,
    max_cache_len: int | None = None,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
    parallelism: str | dict[str, int] = "tp",
    mesh: MeshShape | None = None,
    objective: str = "latency",
    throughput_batch: int = 64,
    training: bool = False,
    optimizer_states: int = DEFAULT_OPTIMIZER_STATES,
    outputs: str = "replicated",
    dropout: str = "replicated",
    activation_checkpointing: str | None = None,
) -> Plan | ParallelPlan:
    """Decide how to split ``model`` over ``world_size`` ranks, without running anything.

    Needs no process group and no real weights: a model built on the ``meta`` device is fine.

    ``memory_budget`` is the most parameter bytes one rank may hold:

    - ``"auto"`` (default): the weights are *distributed* — each rank holds about
      ``1/world_size`` of the parameter bytes: room for every matrix split along one of its
      dims, while 1-D tensors such as norms and biases may stay whole. Tensor parallelism is
      usually asked for because the weights do not fit one device, so the default keeps that
      promise; within it, the cost model chooses *how* to split so communication is least.
    - a number of bytes per rank: tighter or looser than the default.
    - ``None``: no limit; the cost model may keep layers whole where splitting does not pay.

    ``hardware`` names a profile of :data:`autotp.cost_model.KNOWN_HARDWARE`, or is a
    :class:`~autotp.cost_model.Hardware` or a path to a JSON profile.
    ``strict=True`` raises instead of running ops without a sharding rule replicated.
    ``constraints`` pins placements before solving: ``{fnmatch pattern over parameter FQNs and
    node names: placement}``, e.g. ``{"model.layers.*.mlp.down_proj.weight": Replicate()}``
    (see :mod:`autotp.planning.constraints`).
    ``max_cache_len`` plans a causal LM's decode step with a KV cache of that many slots per row
    (the cache placed like a parameter), as :func:`compile` does with it.

    ``dynamic`` (default True) traces the batch and sequence dims (dims 0 and 1 of every tensor
    input) as symbols, so the plan serves every size; only static dims are split. ``dynamic=False``
    pins every size to the example's; ``dynamic_shapes`` is passed to ``torch.export`` as is
    (see :mod:`autotp.capture`).

    ``training=True`` plans a training step: forward and backward are priced together (each
    collective's adjoint, the backward's compute) and memory counts gradients,
    ``optimizer_states`` fp32 values per parameter element (default 2, AdamW) and the
    activations kept for the backward (see :mod:`autotp.passes.backward`); ``print(plan)``
    shows where it differs from the inference plan. (One tensor-parallel group only: not with
    ``parallelism=`` or ``mesh=``.)

    ``outputs="local"`` plans outputs returned as computed (a split output is not gathered, and
    its gather is not priced) instead of whole on every rank (see :mod:`autotp.planning.outputs`).
    ``dropout="split"`` lets dropout run on split activations (per-rank random streams, as
    Megatron-LM's; :mod:`autotp.passes.random_streams`) instead of gathering them first.
    ``activation_checkpointing="blocks"`` (with ``training``) prices checkpointed blocks: activations
    kept are the blocks' inputs plus one block's, and each block's forward runs again.

    ``parallelism``: ``"tp"`` (default) plans one tensor-parallel group of ``world_size`` ranks and
    returns a :class:`Plan`. ``"auto"`` searches data x pipeline x tensor parallelism (every
    ``dp * pp * tp == world_size``, the stage cuts, the microbatches) on ``hardware``'s nodes and
    returns a :class:`~autotp.planning.mesh_plan.ParallelPlan`; a dict such as ``{"tp": 8}`` (or
    ``mesh=MeshShape(dp=2, pp=1, tp=8)``) fixes some dims and searches the rest.
    ``objective``: ``"latency"`` (one request of batch 1) or ``"throughput"`` (requests per second
    at ``throughput_batch`` requests). See :mod:`autotp.planning.mesh_search`.
    """
    check_model(model)
    if parallelism != "tp" or mesh is not None:
        if (max_cache_len is not None or constraints is not None or training or outputs != "replicated"
                or dropout != "replicated" or activation_checkpointing is not None):
            raise ValueError("max_cache_len=, constraints=, training=True, outputs=, dropout= and "
                             "activation_checkpointing= plan one tensor-parallel group; leave them out with "
                             "parallelism='auto' or mesh=")
        from autotp.planning.mesh_search import plan_mesh

        check_world_size(world_size)
        return plan_mesh(model, example_inputs, example_kwargs, world_size=world_size, hardware=hardware,
                         parallelism="auto" if parallelism == "tp" else parallelism, mesh=mesh, objective=objective,
                         throughput_batch=throughput_batch, time_limit_s=time_limit_s, progress=progress)
    options = PlanOptions(world_size=world_size, hardware=hardware, memory_budget=memory_budget, strict=strict,
                          time_limit_s=time_limit_s, progress=progress, constraints=constraints, training=training,
                          optimizer_states=optimizer_states, outputs=outputs, dropout=dropout,
                          activation_checkpointing=activation_checkpointing)
    if max_cache_len is not None:
        from autotp.generation import generation_inputs

        wrapper, _, _ = generation_inputs(model, example_inputs, max_cache_len)
        log_progress(progress, f"tracing {type(model).__name__}'s decode step with a KV cache of {max_cache_len} slots")
        return plan_graph(capture(wrapper, inputs_on_model_device(model, wrapper.example_inputs(1)), dynamic=False),
                          options)
    log_progress(progress, f"tracing {type(model).__name__} with torch.export")
    captured = capture(model, inputs_on_model_device(model, example_inputs),
                       inputs_on_model_device(model, example_kwargs), dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                       training=training)  # a training plan may sample (dropout in train mode)
    return plan_graph(captured, options)


def compile(  # noqa: A001 - mirrors torch.compile
    model: torch.nn.Module,
    *,
    world_size: int | None = None,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    hardware: str | Hardware = DEFAULT_HARDWARE,
    memory_budget: float | int | str | None = "auto",
    plan: Plan | None = None,
    strict: bool = False,
    group: dist.ProcessGroup | None = None,
    time_limit_s: float = 60.0,
    progress: bool = False,
    constraints: Constraints | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    max_cache_len: int | None = None,
    expected_new_tokens: int = DEFAULT_EXPECTED_NEW_TOKENS,
    check_weights: bool = True,
    agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
    training: bool = False,
    mesh: Any = None,
    activation_checkpointing: str | None = None,
    outputs: str = "replicated",
    dropout: str = "replicated",
    trace_cache: bool | str | os.PathLike[str] | None = False,
) -> Any:
    """Make ``model`` tensor-parallel over the ranks of ``group`` (default: the whole world).

    Call it on every rank with the same model weights and example inputs. Returns this rank's
    :class:`TensorParallelModule`: called like ``model``, it returns the same outputs (within
    floating-point tolerance) on every rank. Each rank keeps only its shards of the split
    parameters, sliced once here. ``world_size`` defaults to the group's size; pass ``plan=``
    to apply a saved or hand-edited :class:`Plan` (or the path of a saved one) instead of
    planning. Other options as in :func:`autotp.plan`. A Hugging Face model needs no ``example_kwargs``: it
    is traced with ``use_cache=False``, and the result takes calls with ``use_cache`` left out, False or
    True, returning the model's output without its cache part (``past_key_values`` None; :mod:`autotp.hf_calls`).

    The ranks check that they agree before a plan is used (:mod:`autotp.runtime.agreement`; rank 0 plans
    meanwhile, while the others rebuild the program it traced, and sends its plan once they agree): that
    every rank traced the model, the same graph, with the same options and the same full
    weights (a float64 sum and a sampled hash per weight; ``check_weights=False`` skips this
    for huge models loaded from one checkpoint, and it is skipped with ``checkpoint=``). Any
    difference raises the same :class:`~autotp.AgreementError` on every rank, naming the ranks
    and what differs. No rank waits for the others longer than ``agreement_timeout_s`` seconds
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
    cast to the model's dtype. See :mod:`autotp.runtime.loading`.

    ``max_cache_len``: for a HuggingFace causal LM, build it for text generation instead
    (:meth:`TensorParallelModule.generate`): a KV cache of ``max_cache_len`` slots per row, one
    row per row of ``example_inputs[0]`` (token ids, ``(batch, seq)``), placed by the planner like
    a parameter. Two graphs share the weights' shards and the cache: decode (one token per
    row) and prefill (``seq`` prompt tokens per call) share every weight's placement, chosen to
    minimise the predicted ``prefill + expected_new_tokens x decode`` (default 128 new tokens
    per prompt; see :mod:`autotp.planning.phases`). ``plan=`` then gives the decode plan, whose
    placements prefill is pinned to. See :mod:`autotp.generation`. Without ``max_cache_len`` a causal LM
    compiled for inference still generates: ``tp.generate`` builds these graphs on its first call, with a
    cache sized for the request, from ``model`` (held by a weak reference: keep it until then); see
    :mod:`autotp.runtime.generation_on_demand`.

    ``training=True``: build it for training. The result's parameters (``tp.parameters()``, named
    by the original FQNs in ``tp.named_parameters()``) are this rank's shards and require grad;
    ``loss.backward()`` gives each shard the matching block of the single-device gradient and every
    replicated parameter its whole gradient, the same on every rank (each collective carries its
    adjoint: :mod:`autotp.passes.adjoints`). Build the optimizer over ``tp.parameters()``;
    ``tp.full_state_dict()`` gathers the full tensors. See the README's "Training" section.
    ``activation_checkpointing="blocks"`` (with ``training=True``) runs each repeated block of the
    rank-local graph (``model.layers.3``...) under ``torch.utils.checkpoint``: the forward keeps only
    the blocks' inputs, the backward recomputes each block, collectives included
    (:mod:`autotp.runtime.checkpointing`).

    ``outputs="local"``: return each output as this rank computes it instead of whole on every rank
    (``tp.output_placements`` says, per flattened output, ``"R"``, ``"S(d)"`` or ``"P"``): e.g. a
    training step returning its loss (whole) and this rank's vocabulary block of the logits, which
    are then never gathered (:mod:`autotp.planning.outputs`). Not with ``max_cache_len=`` or ``mesh=``.

    ``dropout``: ``"replicated"`` (default) draws every dropout mask whole from the shared random
    stream (the same on every rank: the loss equals one process's with the same seed), gathering a
    split activation first; ``"split"`` (with ``training=True``) lets the planner keep it split, each
    rank masking its block from its own stream seeded ``torch.initial_seed() + 2718 + rank``
    (Megatron-LM's model-parallel RNG), while replicated activations keep the shared stream
    (:mod:`autotp.passes.random_streams`).

    ``mesh``: a ``torch.distributed.device_mesh.DeviceMesh`` with dims named from ``("dp", "pp",
    "tp")`` (a missing dim has size 1) runs the model data parallel x pipeline parallel x tensor
    parallel instead and returns a :class:`~autotp.runtime.mesh.MeshParallelModule` whose output on
    every rank is the whole batch's (with ``training=True``, on a mesh without ``pp``: each
    data-parallel replica's output for its slice of the batch, gradients averaged over ``dp``);
    ``plan=`` then takes a
    :class:`~autotp.planning.mesh_plan.ParallelPlan` (``None``: the layer blocks cut into equal
    stages; or the path of one saved with ``ParallelPlan.save``). Not with ``group=`` or
    ``world_size=``. With ``max_cache_len`` it is compiled for generation instead
    (:class:`~autotp.runtime.mesh_generate.MeshGenerationModule`, whose ``generate`` returns the
    whole batch on every rank); ``checkpoint=`` reads each rank's stage shards (not with
    ``max_cache_len``, as over one group). See :mod:`autotp.runtime.mesh` and
    :mod:`autotp.runtime.mesh_generate`.

    ``trace_cache``: reuse the program ``torch.export`` made of this model and these inputs' specs
    before (tracing is most of a large model's load time): ``True`` for ``$AUTOTP_CACHE_DIR``
    (default ``~/.cache/autotp``; ``$AUTOTP_CACHE=0`` turns it off), a directory, or ``False``
    (default here; :func:`autotp.from_pretrained` and :func:`autotp.load` default to ``True``).
    The plan made for the traced graph and these options is kept there too and reused (checked
    against the graph as a given ``plan=`` is). See :mod:`autotp.trace_cache`.
    """
    check_activation_checkpointing(activation_checkpointing, training)
    if training and max_cache_len is not None:
        raise ValueError("training=True and max_cache_len= do not go together: the KV cache is for generation; "
                         "compile once with training=True to train and once with max_cache_len= to generate")
    if check_dropout(dropout) != "replicated" and not training:
        raise ValueError("dropout='split' needs training=True: a model compiled for inference runs without dropout")
    if check_outputs(outputs) != "replicated" and (mesh is not None or max_cache_len is not None):
        raise ValueError("outputs='local' with mesh= or max_cache_len= is not supported: those return whole outputs "
                         "(generate() returns token ids); leave outputs= out")
    if mesh is not None:
        training_options = {"training": True, "dropout": dropout,
                            "activation_checkpointing": activation_checkpointing} if training else {}
        return _compile_on_mesh(model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                plan=plan, world_size=world_size, group=group, checkpoint=checkpoint,
                                max_cache_len=max_cache_len, dynamic_shapes=dynamic_shapes,
                                expected_new_tokens=expected_new_tokens,
                                tp_options=dict(hardware=hardware, memory_budget=memory_budget, strict=strict,
                                                time_limit_s=time_limit_s, progress=progress, constraints=constraints,
                                                check_weights=check_weights, agreement_timeout_s=agreement_timeout_s,
                                                dynamic=dynamic, **training_options))
    timeout_s = check_timeout(agreement_timeout_s)
    cache = open_trace_cache(trace_cache, checkpoint)
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
        options = PlanOptions(world_size=world_size, hardware=hardware, memory_budget=memory_budget, strict=strict,
                              time_limit_s=time_limit_s, progress=progress, constraints=constraints, training=training,
                              outputs=outputs, dropout=dropout, activation_checkpointing=activation_checkpointing)
        agreed = agreed_options(options, plan=plan_text(plan), check_weights=check_weights,
                                checkpoint=checkpoint is not None, max_cache_len=max_cache_len,
                                training=training,
                                **({"expected_new_tokens": check_expected_new_tokens(expected_new_tokens)}
                                   if max_cache_len is not None else {}))
        if max_cache_len is not None:  # the generation graphs are captured later; agree on options and weights now
            weights = dict(model.state_dict()) if check_weights and checkpoint is None else None
            agreement.record = options_record(agreed, weights=weights)
        else:
            log_progress(progress and rank == 0, f"tracing {type(model).__name__} with torch.export")
            captured = capture(model, example_inputs, example_kwargs, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                               training=training, trace_cache=cache,
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
        from autotp.generation import compile_for_generation

        generating = compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=options,
                                            plan=plan, group=group, rank=rank, expected_new_tokens=expected_new_tokens,
                                            timeout_s=timeout_s)
        generating.generation_config = getattr(model, "generation_config", None)  # generate's defaults, as HF's
        return generating
    plan = plan_or_check(captured, plan, options, group=group, rank=rank, agreement_timeout_s=timeout_s,
                         plan_cache=cache, ahead=ahead)
    local_gm, local_values, layout = apply_plan(captured, plan, group=group, rank=rank, files=files, model=model,
                                                device=trace_device(example_inputs, example_kwargs),
                                                timeout_s=timeout_s, training=training)
    if activation_checkpointing == "blocks":
        local_gm = checkpointed_graph(local_gm)
    on_demand = None
    if not training and outputs == "replicated" and _is_causal_lm(model):
        on_demand = GenerationOnDemand(model, example_inputs, group=group, timeout_s=timeout_s, build=functools.partial(
            _compile_for_generation, options=options, group=group, rank=rank, timeout_s=timeout_s,
            expected_new_tokens=check_expected_new_tokens(expected_new_tokens)))
    return TensorParallelModule(captured, local_gm, plan, local_values, rank, layout,
                                guard=InputGuard(captured, group=group, timeout_s=timeout_s),
                                training=training, original=model, group=group, generation_on_demand=on_demand)


def _is_causal_lm(model: torch.nn.Module) -> bool:
    """True for a HuggingFace causal LM, which ``generate`` can build generation graphs for."""
    try:
        check_causal_lm(model)
    except TypeError:
        return False
    return True


def _compile_for_generation(model: torch.nn.Module, example_inputs: tuple[Any, ...], max_cache_len: int, *,
                            options: PlanOptions, group: dist.ProcessGroup | None, rank: int, timeout_s: float,
                            expected_new_tokens: int) -> TensorParallelModule:
    """``compile(model, ..., max_cache_len=max_cache_len)`` after the plain compile that planned with ``options``:
    what :class:`~autotp.runtime.generation_on_demand.GenerationOnDemand` builds on the first ``generate``."""
    from autotp.generation import compile_for_generation

    return compile_for_generation(model, example_inputs, max_cache_len=max_cache_len, options=options, plan=None,
                                  group=group, rank=rank, expected_new_tokens=expected_new_tokens, timeout_s=timeout_s)


def _compile_on_mesh(model: torch.nn.Module, mesh: Any, *, example_inputs: tuple[Any, ...],
                     example_kwargs: dict[str, Any] | None, plan: Any, world_size: int | None,
                     group: dist.ProcessGroup | None, checkpoint: Any, max_cache_len: int | None,
                     dynamic_shapes: Any, expected_new_tokens: int, tp_options: dict[str, Any]) -> Any:
    """``compile(..., mesh=)``: the options a mesh run does not take raise here, the rest is
    :func:`autotp.runtime.mesh.compile_on_mesh` (:func:`autotp.runtime.mesh_generate.compile_generation_on_mesh`
    with ``max_cache_len``)."""
    from autotp.runtime.mesh import compile_on_mesh

    unsupported = {"group": group, "world_size": world_size, "dynamic_shapes": dynamic_shapes}
    if max_cache_len is not None:
        unsupported.update(checkpoint=checkpoint, example_kwargs=example_kwargs or None)
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise ValueError(f"autotp.compile(mesh=...{', max_cache_len=...' if max_cache_len is not None else ''}) "
                         f"does not take {', '.join(f'{n}=' for n in given)}: the mesh gives the groups and sizes; "
                         "drop them (checkpoint= with mesh= and max_cache_len= is not supported yet)")
    if max_cache_len is not None:
        from autotp.runtime.mesh_generate import compile_generation_on_mesh

        return compile_generation_on_mesh(model, mesh, example_inputs=example_inputs, max_cache_len=max_cache_len,
                                          plan=plan, expected_new_tokens=expected_new_tokens, **tp_options)
    return compile_on_mesh(model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs, plan=plan,
                           checkpoint=checkpoint, **tp_options)


def plan_or_check(captured: CapturedGraph, plan: Plan | None, options: PlanOptions, *,
                  group: dist.ProcessGroup | None, rank: int,
                  agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, plan_cache: Any = None,
                  ahead: PlannedAhead | None = None) -> Plan:
    """Plan ``captured`` (on the first rank, broadcast; through ``plan_cache`` when given; ``ahead``: the first
    rank's plan made already), or check that the given ``plan`` applies to it."""
    if plan is None:
        return plan_on_first_rank(captured, options, group=group, rank=rank, agreement_timeout_s=agreement_timeout_s,
                                  plan_cache=plan_cache, ahead=ahead)
    check_plan_applies(plan, captured, options.world_size)
    check_plan_constraints(plan, options.constraints)
    return plan


def apply_plan(captured: CapturedGraph, plan: Plan, *, group: dist.ProcessGroup | None, rank: int,
               files: Any = None, model: torch.nn.Module | None = None, device: torch.device | None = None,
               timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, training: bool = False,
               ) -> tuple[torch.fx.GraphModule, dict[str, torch.Tensor], dict]:
    """This rank's graph (state updates in place), its local parameter shards, buffers and cache blocks,
    and the parameter layout (global offsets of every rank's block, for ``save``).

    With ``files`` (an opened checkpoint) the shards are read from it, agreed by all ranks within
    ``timeout_s``; otherwise they are sliced from the captured model's weights. ``training``: the
    graph differentiates correctly (see :func:`autotp.passes.rewrite.rewrite_for_rank`)."""
    local_gm, parts = rank_local_graph(captured, plan, group=group, rank=rank, timeout_s=timeout_s, training=training)
    if files is None:
        local_values = _local_values(captured, plan, parts, rank)
    else:
        local_values = agree_on_success(group, lambda: read_local_values(captured, plan, parts, rank, files, model,
                                                                          device), timeout_s=timeout_s)
    return local_gm, local_values, parameter_layout(captured, plan, parts)


def rank_local_graph(captured: CapturedGraph, plan: Plan, *, group: dist.ProcessGroup | None, rank: int,
                     timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, training: bool = False,
                     ) -> tuple[torch.fx.GraphModule, Partitions]:
    """This rank's graph of :func:`apply_plan` (state updates in place) and the partitions its shards follow,
    without the shards: for a graph that takes another graph's tensors (generation's prefill graphs)."""
    decisions = plan.decisions()
    parts = build_partitions(captured.graph_module, decisions, plan.world_size)
    group_name = (group or dist.group.WORLD).group_name
    local_gm = update_state_in_place(
        rewrite_for_rank(captured.graph_module, decisions, parts, rank, group_name, routes=plan.reshard_routes(),
                         training=training),
        captured.state)
    if not training:  # gloo all-reduces through shared memory on one host, else small ones in one round
        local_gm = inference_all_reduces(local_gm, group, plan.world_size, timeout_s=timeout_s)
    return local_gm, parts


def _local_values(captured: CapturedGraph, plan: Plan, parts: Any, rank: int) -> dict[str, torch.Tensor]:
    """Slice every parameter to this rank's block; buffers and constants are taken whole."""
    exported = captured.exported
    state = exported.state_dict
    unread = {n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder" and not n.users}
    values: dict[str, torch.Tensor] = {}
    for slot in captured.inputs:
        if slot.kind == "parameter" and slot.name in unread:
            # the graph never reads it (the second name of a tied weight): hold nothing
            values[slot.name] = state[str(slot.target)].new_empty(0)
        elif slot.kind == "parameter":
            values[slot.name] = shard_tensor(state[str(slot.target)], plan.parameters[str(slot.target)], parts, slot.name, rank)
        elif slot.kind == "buffer" and slot.name in captured.state:
            # a KV cache: this rank's block, a copy of its own (the graph writes into it)
            full = state[str(slot.target)] if str(slot.target) in state else exported.constants[str(slot.target)]
            values[slot.name] = shard_tensor(full, plan.parameters[str(slot.target)], parts, slot.name, rank).clone()
        elif slot.kind == "buffer":
            values[slot.name] = state[str(slot.target)] if str(slot.target) in state else exported.constants[str(slot.target)]
        elif slot.kind == "constant":
            values[slot.name] = exported.constants[str(slot.target)]
    return values

