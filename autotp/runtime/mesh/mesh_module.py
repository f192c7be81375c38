"""Running a model over a ``DeviceMesh``: data parallel x pipeline parallel x tensor parallel (inference).

``autotp.compile_mesh(model, mesh, example_inputs=(ids,), plan=parallel_plan)`` lands here
(:func:`compile_on_mesh`). The mesh's dims are named ``"dp"``, ``"pp"``, ``"tp"`` (any subset, any
order; a missing dim has size 1). Every rank builds its own part:

- **tp**: the ranks of one ``mesh["tp"]`` sub-group split the weights of one pipeline stage, as
  :func:`autotp.compile` does with ``group=mesh["tp"].get_group()`` (the stage's ``tp_plan``
  from the :class:`~autotp.planning.mesh_plan.ParallelPlan` is applied, or the stage is planned on
  the first rank of its tp group and sent to the others).
- **pp**: the model is traced once with ``torch.export`` and its graph cut into ``pp`` stages, each
  beginning where the forward enters a module of the plan's ``split_points`` (module FQNs)
  (:func:`split_stages`); a value a later stage reads (a model input, the attention mask, the
  rotary cos/sin) is passed on by the stages in between. This rank keeps its stage's module
  only. Stages talk over ``mesh["pp"]`` with ``torch.distributed.pipelining``'s
  ``PipelineStage`` and run the plan's schedule (``"gpipe"``:
  ``ScheduleGPipe``; ``"1f1b"``: ``Schedule1F1B`` without a loss, i.e. its forward order only)
  over ``plan.microbatches`` microbatches. Inference only: no backward, no loss.
- **dp**: each ``mesh["dp"]`` replica runs its slice of the batch (dim 0 of every tensor input
  whose dim 0 is the batch, split as ``torch.tensor_split`` does), and the slices' outputs are
  gathered back, so **every rank returns the output of the whole batch**, the same as the
  single-process model: a user checks it against one process. Only each replica's source (its last
  stage's first tp rank) gathers over ``dp``; it then hands the batch to the rest of its replica along
  a tree that crosses into each host once (:func:`hand_out`; each rank's host as the front door read it:
  the launcher's node and the kernel, docs/hosts.md). Without ``dp``, a pipeline's last stage hands its output to the stages before.

Weights: with ``checkpoint=`` the model may be on the meta device and each rank reads only its
stage's tensor-parallel shards (:mod:`autotp.runtime.checkpoints.loading`). Generation
(``max_cache_len=``) over a mesh is :mod:`autotp.runtime.mesh.mesh_generate`; a
:class:`~autotp.planning.mesh_plan.ParallelPlan` saved with ``save`` may be passed as its path.

**Training** (``autotp.compile_mesh(model, mesh, ..., training=True)``, a mesh without ``pp``: dp x tp):
each replica's tp group compiles its part with ``training=True`` (the tp shards are trainable
parameters, collectives carry their adjoints: :mod:`autotp.passes.adjoints`); a call runs the
replica's slice of the batch and returns **that slice's** output (its loss: the loss of its rows),
not the whole batch's, so ``loss.backward()`` stays local to the replica; each parameter's
gradient is then averaged over ``dp`` as it is accumulated (a hook per parameter: one all-reduce
over ``mesh["dp"]``, in the same order on every replica), as DDP does. With slices of equal token
counts the averaged gradient is the single process's on the whole batch. ``tp.parameters()`` are
this rank's shards, the same on every replica: build the optimizer over them. Not yet: ``pp > 1``
with training (a pipeline schedule with a loss), or FSDP-style sharding over ``dp`` (compose with
``fully_shard`` over ``group=`` for that: README "FSDP2").

Shapes: with ``pp == 1`` the compiled module serves any batch size (at least ``dp``) and
sequence length, as :func:`autotp.compile` does. With ``pp > 1`` the stages exchange buffers of
fixed shapes, so each call must have the batch size and sequence length of ``example_inputs``
(another shape raises :class:`~autotp.base.errors.InputShapeError` saying to compile again).

Before building, every rank of the mesh checks its input (mesh, plan, model, example batch) and
the ranks agree on the outcome (:func:`~autotp.runtime.agreement.exchanges.ranks_agree` over the whole
world: mesh, plan, example shapes, weight checksums): bad input raises the same error on every
rank, and one rank that differs raises :class:`~autotp.base.errors.AgreementError` naming it,
instead of a hang in a pipeline exchange. Each stage's tensor-parallel compile then agrees within
its tp group as :func:`autotp.compile` always does: the agreement and the plan hand-over use the
group's own store and group ranks, so they work on mesh sub-groups unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram

from autotp.base.errors import InputShapeError, TracedValueError
from autotp.base.module_paths import layer_blocks
from autotp.capture.trace_cache import TraceCache, open_trace_cache, trace_key
from autotp.capture.tracing import Traced, TraceShare, as_if_on, check_model, trace_device
from autotp.cost_model.collectives import (
    HAND_OUT_HEADER_BYTES,
    HAND_OUT_LEAVES,
    OUTPUT_SHAPE_DIMS,
    host_tree_children,
)
from autotp.planning.even_stages import SCHEDULES, even_parallel_plan
from autotp.planning.mesh_plan import MESH_DIM_NAMES, MeshShape, ParallelPlan, as_parallel_plan
from autotp.planning.options import PlanOptions
from autotp.runtime.agreement.exchanges import options_record, plan_text, ranks_agree
from autotp.runtime.agreement.shared_trace import FirstRankTrace
from autotp.runtime.collectives.hosts import Host
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.options import RuntimeOptions, runtime_host

__all__ = ["MeshParallelModule", "StageSplit", "average_gradients_over", "compile_on_mesh", "mesh_shape_of",
           "split_stages", "stage_graphs"]


def mesh_shape_of(mesh: Any) -> MeshShape:
    """The :class:`MeshShape` of a ``DeviceMesh`` whose dims are named from ``("dp", "pp", "tp")``.

    ValueError, saying the fix, when a dim has no name or an unknown one, a name repeats, the mesh
    does not hold every rank of the process group, or this rank is not in it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh= takes a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
                        "build one with init_device_mesh('cpu' or 'cuda', (dp, pp, tp), "
                        "mesh_dim_names=('dp', 'pp', 'tp'))")
    names = mesh.mesh_dim_names
    sizes = tuple(mesh.mesh.shape)
    if names is None:
        raise ValueError(f"the mesh's dims {sizes} have no names; autotp reads them by name: pass "
                         f"mesh_dim_names= to init_device_mesh, from {MESH_DIM_NAMES} (e.g. ('dp', 'tp'))")
    unknown = [name for name in names if name not in MESH_DIM_NAMES]
    if unknown or len(set(names)) != len(names):
        what = f"unknown dim name(s) {', '.join(map(repr, unknown))}" if unknown else f"repeated dim names {names}"
        raise ValueError(f"the mesh has {what}; autotp knows {MESH_DIM_NAMES} (data, pipeline and tensor parallel): "
                         "name each dim one of them, and leave out a dim of size 1")
    world_size = dist.get_world_size()
    if mesh.size() != world_size:
        raise ValueError(
            f"the mesh {dict(zip(names, sizes))} holds {mesh.size()} ranks but the process group has {world_size}; "
            f"build the mesh over every rank (sizes multiplying to {world_size}) or start {mesh.size()} processes "
            f"(torchrun --nproc-per-node {mesh.size()})")
    if mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()}; build it over every rank")
    return MeshShape(**dict(zip(names, sizes)))


def dim_group(mesh: Any, name: str) -> dist.ProcessGroup | None:
    """The sub-group of ``mesh`` along dim ``name`` that holds this rank (``None`` when the mesh has no such dim)."""
    return mesh[name].get_group() if name in (mesh.mesh_dim_names or ()) else None


def mesh_coordinate(mesh: Any, name: str) -> int:
    """This rank's coordinate along dim ``name`` (0 when the mesh has no such dim)."""
    names = mesh.mesh_dim_names or ()
    return mesh.get_coordinate()[names.index(name)] if name in names else 0


# --------------------------------------------------------------------------- splitting the batch

def _batch_size(args: Any, kwargs: Any) -> int | None:
    """Dim 0 of the first tensor input with at least one dim: the batch the replicas split."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def replica_sizes(batch: int, replicas: int) -> list[int]:
    """Rows of each replica's slice of a batch of ``batch`` rows (``torch.tensor_split``: earlier slices larger)."""
    size, extra = divmod(batch, replicas)
    return [size + (1 if index < extra else 0) for index in range(replicas)]


def replica_example_rows(batch: int, replicas: int, replica: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of a ``batch``-row example that replica ``replica`` traces its graph with.

    Its own slice (:func:`replica_sizes`), widened to 2 rows when the slice has 1 and the batch more:
    ``torch.export`` specialises a dim of size 1, so a one-row trace would serve one-row slices only,
    while a call of a larger batch gives the replica more rows."""
    sizes = replica_sizes(batch, replicas)
    start = sum(sizes[:replica])
    rows = max(sizes[replica], min(batch, 2))
    start = min(start, batch - rows)
    return start, start + rows


def _slice_batch(args: Any, kwargs: Any, batch: int, start: int, stop: int) -> tuple[Any, Any]:
    """``(args, kwargs)`` with rows ``[start, stop)`` of every tensor whose dim 0 is the batch."""
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch:
            return leaf[start:stop]
        return leaf

    return pytree.tree_map(cut, (args, kwargs))


def gather_batch(output: Any, sizes: Sequence[int], group: dist.ProcessGroup) -> Any:
    """Every replica's ``output`` for its slice, concatenated along dim 0 (leaves whose dim 0 is the
    slice's rows); other leaves are taken from the first replica. One ``all_gather`` of the leaves' shapes
    (:func:`_gather_shapes`), then one per batch leaf (slices padded to the largest)."""
    leaves, spec = pytree.tree_flatten(output)
    shapes = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    every = _gather_shapes(shapes, len(sizes), group, device)
    rows = max(sizes)
    gathered = []
    for position, leaf in enumerate(leaves):
        per_replica = [their[position] for their in every]
        batched = all(s is not None and len(s) >= 1 and s[0] == n for s, n in zip(per_replica, sizes))
        if not batched:
            if len(set(per_replica)) > 1:  # every replica sees the same shapes: all raise alike
                raise InputShapeError(
                    f"output {position} of the model has shapes {per_replica} on the {len(sizes)} data-parallel "
                    f"replicas (slices of {list(sizes)} rows): dim 0 is not the batch, so the slices cannot be "
                    "joined; return outputs whose dim 0 is the batch, or use a mesh without dp")
            gathered.append(_from_first(leaf, group) if isinstance(leaf, torch.Tensor) else leaf)
            continue
        padded = leaf.new_zeros((rows, *leaf.shape[1:]))
        padded[: leaf.shape[0]] = leaf
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        gathered.append(torch.cat([part[:n] for part, n in zip(parts, sizes)]))
    return pytree.tree_unflatten(gathered, spec)


def _gather_shapes(shapes: list[tuple[int, ...] | None], replicas: int, group: dist.ProcessGroup,
                   device: torch.device) -> list[list[tuple[int, ...] | None]]:
    """Every replica's ``shapes`` (one per output leaf, ``None`` for a leaf that is not a tensor): one
    ``all_gather`` of an int64 row per leaf (its number of dims, -1 for ``None``, then the dims) on ``device``
    (the outputs'), where an ``all_gather_object`` runs two collectives and pickles. Every replica runs the same
    graph, so its leaves and their numbers of dims are the same and so is the choice of form."""
    if any(shape is not None and len(shape) > OUTPUT_SHAPE_DIMS for shape in shapes):
        every: list[Any] = [None] * replicas
        dist.all_gather_object(every, shapes, group=group)
        return every
    table = [[-1] * (1 + OUTPUT_SHAPE_DIMS) for _ in shapes]
    for row, shape in zip(table, shapes):
        if shape is not None:
            row[: 1 + len(shape)] = [len(shape), *shape]
    rows = torch.tensor(table, dtype=torch.int64, device=device).reshape(len(shapes), 1 + OUTPUT_SHAPE_DIMS)
    parts = [torch.empty_like(rows) for _ in range(replicas)]
    dist.all_gather(parts, rows, group=group)
    return [[None if row[0] < 0 else tuple(row[1:1 + row[0]]) for row in part.tolist()] for part in parts]


def _from_first(leaf: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The first replica's value of a leaf that is not split by rows (all replicas hold its shape)."""
    value = leaf.contiguous().clone()
    dist.broadcast(value, group=group, group_src=0)
    return value


def replica_ranks(mesh: Any, replica: int) -> list[list[int]]:
    """The global ranks of data-parallel replica ``replica`` of ``mesh``, as ``[stage][tp rank]`` (a dim the mesh
    does not name has size 1; the mesh's dims may come in any order)."""
    names = list(mesh.mesh_dim_names or ())
    grid = mesh.mesh
    for name in MESH_DIM_NAMES:
        if name not in names:
            grid = grid.unsqueeze(-1)
            names.append(name)
    grid = grid.permute([names.index(name) for name in ("dp", "pp", "tp")])
    return grid[replica].tolist()


def rank_hosts(host: Host) -> list[Hashable]:
    """Every rank's host (:attr:`Host.key`: the launcher's node and the kernel), by global rank: one
    ``all_gather_object`` of this rank's ``host`` over the default group, called by every rank."""
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, host.key)
    return keys


def _hand_out_tree(stages: list[list[int]], replicas: bool,
                   hosts: Sequence[Hashable]) -> tuple[int, dict[int, list[int]]]:
    """A replica's hand-out, fixed for the module: its source (the last stage's first tp rank, of ``stages``:
    :func:`replica_ranks`) and the tree (:func:`~autotp.cost_model.collectives.host_tree_children` over each
    rank's host in ``hosts``) to every rank of the replica with ``replicas`` (dp > 1; the others hold only their
    slice), to the stages before the last without."""
    source = stages[-1][0]
    ranks = [rank for stage in stages for rank in stage] if replicas else \
        [source, *(rank for stage in stages[:-1] for rank in stage)]
    return source, host_tree_children(ranks, source, {rank: hosts[rank] for rank in ranks})


_HEADER_ROW = 2 + OUTPUT_SHAPE_DIMS  # a leaf's row in a hand-out's header: its dtype, its number of dims, the dims
_HEADER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)


def _encode_header(leaves: list[Any], device: torch.device) -> tuple[torch.Tensor, list[Any] | None]:
    """A hand-out's header: one int64 tensor of fixed size, its first slot the number of leaves and then a row per
    leaf (its dtype's index in ``_HEADER_DTYPES``, its number of dims, the dims); -1 leaves, and the header as an
    object beside it, where a leaf is not a tensor of a listed dtype and at most ``OUTPUT_SHAPE_DIMS`` dims, or
    there are more than ``HAND_OUT_LEAVES`` leaves. One small send where an object takes two and a pickle."""
    header = torch.full((HAND_OUT_HEADER_BYTES // 8,), -1, dtype=torch.int64)
    plain = len(leaves) <= HAND_OUT_LEAVES and all(
        isinstance(leaf, torch.Tensor) and leaf.dtype in _HEADER_DTYPES and leaf.dim() <= OUTPUT_SHAPE_DIMS
        for leaf in leaves)
    if not plain:
        return header.to(device), [(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else ("value", leaf)
                                   for leaf in leaves]
    values = [len(leaves)]
    for leaf in leaves:
        row = [_HEADER_DTYPES.index(leaf.dtype), leaf.dim(), *leaf.shape]
        values += row + [-1] * (_HEADER_ROW - len(row))
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header.to(device), None


def hand_out(leaves: list[Any] | None, source: int, children: dict[int, list[int]], device: torch.device) -> list[Any]:
    """The output ``leaves`` of global rank ``source`` on every rank of the tree ``children`` (whom each rank sends
    to: :func:`~autotp.cost_model.collectives.host_tree_children` over each rank's host, so the value crosses into
    each host once, where a broadcast over a group spanning hosts sends it across a link once per rank beyond it);
    called by each of them, ``leaves`` read on ``source`` only. Point-to-point sends on the default group: each a
    header (:func:`_encode_header`: each leaf's dtype and shape), then the tensors; a rank forwards what it
    received to its children, all of its sends under way at once."""
    me = dist.get_rank()
    if me != source:
        parent = next(rank for rank, sent_to in children.items() if me in sent_to)
        header = torch.empty(HAND_OUT_HEADER_BYTES // 8, dtype=torch.int64, device=device)
        dist.recv(header, src=parent)
        count, *rows = header.tolist()
        if count >= 0:
            described: list[Any] = []
            for index in range(count):
                dtype, dims, *shape = rows[index * _HEADER_ROW: (index + 1) * _HEADER_ROW]
                described.append((tuple(shape[:dims]), _HEADER_DTYPES[dtype]))
        else:
            listed: list[Any] = [None]
            dist.recv_object_list(listed, src=parent)
            described = listed[0]
        leaves = []
        for what in described:
            if what[0] == "value":
                leaves.append(what[1])
                continue
            leaf = torch.empty(what[0], dtype=what[1], device=device)
            dist.recv(leaf, src=parent)
            leaves.append(leaf)
    assert leaves is not None
    if children[me]:
        header, as_object = _encode_header(leaves, device)
        tensors = [leaf.contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        for child in children[me]:
            dist.send(header, dst=child)
            if as_object is not None:
                dist.send_object_list([as_object], dst=child)
        sends = [dist.isend(tensor, dst=child) for child in children[me] for tensor in tensors]
        for send in sends:
            send.wait()
    return leaves


# --------------------------------------------------------------------------- pipeline stages

@dataclasses.dataclass
class StageSplit:
    """A model cut into pipeline stages (:func:`split_stages`), with one microbatch run through it.

    ``modules[i]``: stage ``i``'s module (an ``fx.GraphModule`` holding its part of the exported graph,
    with the model's parameter FQNs); ``inputs[i]`` / ``outputs[i]``: the tensors it took and gave for
    the example microbatch (stage ``i + 1`` takes stage ``i``'s outputs, in order). To plan a stage's
    tensor-parallel part the way the runtime applies it:
    ``autotp.plan(split.modules[i], split.inputs[i], world_size=tp)``. ``first_inputs``: the model
    arguments stage 0 takes, by name; ``constants``: non-tensor arguments baked into the trace
    (``use_cache=False``); ``out_spec``: the model's output structure over the last stage's outputs.
    """

    modules: tuple[nn.Module, ...]
    inputs: tuple[tuple[torch.Tensor, ...], ...]
    outputs: tuple[tuple[torch.Tensor, ...], ...]
    first_inputs: tuple[str, ...]
    constants: dict[str, Any]
    out_spec: pytree.TreeSpec | None


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def split_stages(model: nn.Module, split_points: Sequence[str], mb_args: tuple[Any, ...],
                 mb_kwargs: dict[str, Any] | None = None, *, share: TraceShare | None = None,
                 trace_cache: TraceCache | None = None) -> StageSplit:
    """Cut ``model`` before each module of ``split_points`` (FQNs): one ``torch.export`` trace of the whole
    model on the microbatch ``mb_args``/``mb_kwargs`` (non-strict), its graph cut into contiguous stages
    (:func:`stage_graphs`), then the microbatch run through the stages to record what each takes and
    gives. ``model`` is left as it was.

    ``share`` (:data:`autotp.capture.tracing.TraceShare`, e.g. a
    :class:`~autotp.runtime.agreement.shared_trace.FirstRankTrace` over the mesh's ranks): how to obtain that
    program instead of tracing it on every rank (every rank cuts the same model at the same microbatch);
    ``trace_cache`` (:mod:`autotp.capture.trace_cache`): reuse the program traced for the same model and
    microbatch before (its key's purpose ``"pipeline stages"``), and store a new one.

    A model on the meta device (weights to be read from a checkpoint) is traced and run with fake
    weights on the device of ``mb_args`` (so the stage graphs make their tensors there); its stages
    then hold the model's meta tensors again, and the recorded inputs and outputs are zeros of the
    right shapes on that device. Such a model is traced on every rank, without the cache."""
    mb_kwargs = dict(mb_kwargs or {})
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    device = trace_device(mb_args, mb_kwargs)
    with contextlib.ExitStack() as fake:
        if on_meta:
            mb_args, mb_kwargs = fake.enter_context(as_if_on(model, device, (mb_args, mb_kwargs)))
            exported = _export_for_split(model, mb_args, mb_kwargs)
        else:
            def trace() -> Traced:
                return _trace_for_split(model, mb_args, mb_kwargs, device, trace_cache)

            traced = trace() if share is None else share(model, mb_args, mb_kwargs, None, model.training, trace)
            if traced.store is not None:  # after sharing: the other ranks rebuild the program meanwhile
                traced.store()
            exported = traced.exported
        flat = exported.module(check_guards=False)
        names = tuple(str(node.target) for node in flat.graph.nodes if node.op == "placeholder")
        arguments = _arguments_by_name(model, mb_args, mb_kwargs)
        values = [arguments.get(name) for name in names]
        modules, first_inputs = stage_graphs(flat, split_points, name=type(model).__name__)
        for module in modules:
            module.train(model.training)
        inputs, outputs = [], []
        current = tuple(arguments[name] for name in first_inputs)
        with torch.no_grad():
            for module in modules:
                inputs.append(current)
                current = _as_tuple(module(*current))
                outputs.append(current)
    if on_meta:
        _restore_meta_tensors(modules, model)
        inputs, outputs = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), (inputs, outputs))
        values = [None if isinstance(value, torch.Tensor) else value for value in values]
    return StageSplit(
        modules=tuple(modules),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        first_inputs=first_inputs,
        constants={name: value for name, value in zip(names, values)
                   if name not in first_inputs and value is not None and not isinstance(value, torch.Tensor)},
        out_spec=exported.call_spec.out_spec,
    )


SPLIT_PURPOSE = "pipeline stages"
"""The trace key's ``purpose`` (:func:`autotp.capture.trace_cache.trace_key`) of the program the stages are cut from:
``torch.export``'s program as it is, which a compile's trace of the same model and inputs is not."""


def _export_for_split(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExportedProgram:
    """The static, non-strict ``torch.export`` program the stages are cut from; a ValueError saying what to do."""
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:
        raise ValueError(f"the pipeline stages are cut from one torch.export trace of {type(model).__name__}, "
                         f"which failed ({type(exc).__name__}: {exc}); make the forward pass traceable by "
                         "torch.export (non-strict), or use a mesh without 'pp'") from exc


def _trace_for_split(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
                     cache: TraceCache | None) -> Traced:
    """:func:`_export_for_split`, through ``cache`` when there is one (the write left to the caller,
    :attr:`~autotp.capture.tracing.Traced.store`)."""
    if cache is None:
        return Traced(_export_for_split(model, args, kwargs), "static", None)
    key = trace_key(model, args, kwargs, None, device=device, training=model.training, purpose=SPLIT_PURPOSE)
    exported, from_cache, store = cache.get_or_export(key, model, device,
                                                      lambda: _export_for_split(model, args, kwargs))
    return Traced(exported, "static", None, from_cache=from_cache, store=store)


def _arguments_by_name(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``model.forward``'s arguments by name (defaults applied; a ``**kwargs`` parameter's items by their own names)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, None) or {})
    return arguments


def _module_paths(node: fx.Node) -> list[str]:
    """FQNs of the modules whose forward ``node`` runs in, outermost first (export's ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [str(path).replace("L['self'].", "") for path, _ in stack.values()]


def _stage_of_nodes(graph: fx.Graph, split_points: Sequence[str], name: str) -> dict[fx.Node, int]:
    """The stage of every operation of ``graph``: stage ``k`` begins at the first operation (in graph order,
    which is the order the forward ran) inside module ``split_points[k - 1]``; an ``operator.getitem`` runs
    with the node it reads from (a tuple never crosses a cut). Placeholders and ``get_attr`` nodes have no
    stage: a stage takes the values it reads as inputs and holds its own copy of each attribute it reads."""
    begins = {fqn: index + 1 for index, fqn in enumerate(split_points)}
    stage_of: dict[fx.Node, int] = {}
    stage = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        for path in _module_paths(node):
            begun = begins.get(path, 0)
            if begun > stage + 1:
                raise ValueError(f"{name} runs {path!r} (where stage {begun} begins) before "
                                 f"{split_points[stage]!r} (where stage {stage + 1} begins); split at modules that "
                                 "run once, in order")
            stage = max(stage, begun)
        source = node.args[0] if node.target is operator.getitem and node.args else None
        stage_of[node] = stage_of[source] if isinstance(source, fx.Node) and source in stage_of else stage
    if stage != len(split_points):
        missing = [fqn for fqn, index in begins.items() if index > stage]
        raise ValueError(f"cutting {name} at {list(split_points)} gave {stage + 1} stages, not {len(split_points) + 1}: "
                         f"the trace runs no operation inside {', '.join(map(repr, missing))}; split at modules that "
                         "run once, in order, after the first op")
    return stage_of


def stage_graphs(gm: fx.GraphModule, split_points: Sequence[str], *,
                 name: str = "model") -> tuple[list[fx.GraphModule], tuple[str, ...]]:
    """``gm`` (a flat graph with ``nn_module_stack`` metadata, as ``ExportedProgram.module()`` gives) cut
    into ``len(split_points) + 1`` stage modules, and the names of the placeholders stage 0 takes.

    Stage ``k + 1`` takes exactly stage ``k``'s outputs, in order (what a pipeline schedule sends): a
    value made before stage ``k`` and read in or after stage ``k + 1`` (a model input, the attention
    mask, the rotary embedding's cos/sin) is passed on by every stage in between. Each stage holds the
    parameters, buffers and constants it reads under their FQNs in ``gm``; the last returns ``gm``'s
    flat outputs. ValueError, saying the fix, when the cut is impossible (a split module never runs,
    modules out of order, a non-tensor value crossing a cut)."""
    stage_of = _stage_of_nodes(gm.graph, split_points, name)
    last = len(split_points)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    results = list(pytree.tree_leaves(output.args[0]))

    def last_reader(node: fx.Node) -> int:
        readers = [last if user.op == "output" else stage_of[user] for user in node.users if user.op != "get_attr"]
        return max(readers, default=-1)

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder" and node.users]
    values = placeholders + [node for node in gm.graph.nodes if node in stage_of]
    crossing: list[list[fx.Node]] = [placeholders]  # crossing[k]: what stage k takes
    for cut in range(1, last + 1):
        crossing.append([node for node in values if stage_of.get(node, -1) < cut <= last_reader(node)])
    for cut, passed in enumerate(crossing):
        for node in passed:
            value = node.meta.get("val")
            if value is not None and not isinstance(value, torch.Tensor):
                where = "the model's input" if node.op == "placeholder" else "a value"
                raise ValueError(f"{where} {node.format_node()} ({type(value).__name__}) is read by pipeline stage "
                                 f"{cut} or later, but stages pass tensors only; split at other modules, or pass "
                                 "it as a tensor")
        if cut and not passed:
            raise ValueError(f"pipeline stage {cut} of {name} reads nothing from stage {cut - 1}; split at modules "
                             "that continue the computation of the previous ones")
    modules = [_stage_module(gm, [node for node in gm.graph.nodes if stage_of.get(node) == stage], crossing[stage],
                             results if stage == last else crossing[stage + 1], f"{name}Stage{stage}")
               for stage in range(last + 1)]
    return modules, tuple(str(node.target) for node in placeholders)


def _stage_module(gm: fx.GraphModule, nodes: Sequence[fx.Node], takes: Sequence[fx.Node], gives: Sequence[Any],
                  class_name: str) -> fx.GraphModule:
    """A module running ``nodes`` (of ``gm``'s graph, in order) on placeholders for ``takes``, returning
    ``gives`` (one value bare, several as a tuple); it holds its own copy of each attribute it reads."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in takes:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def read(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":
            env[node] = graph.get_attr(str(node.target))
            env[node].meta = dict(node.meta)
        return env[node]

    for node in nodes:
        env[node] = graph.node_copy(node, read)
    outs = tuple(read(node) if isinstance(node, fx.Node) else node for node in gives)
    graph.output(outs[0] if len(outs) == 1 else outs)
    return fx.GraphModule(gm, graph, class_name=class_name)


def _restore_meta_tensors(stages: Sequence[nn.Module], model: nn.Module) -> None:
    """Give the stages of a pipeline traced with fake weights the model's own (meta) parameters and
    buffers back, by FQN (a stage module keeps the model's names)."""
    for stage in stages:
        for name, _ in list(stage.named_parameters(remove_duplicate=False)):
            path, _, leaf = name.rpartition(".")
            stage.get_submodule(path)._parameters[leaf] = model.get_parameter(name)
        for name, _ in list(stage.named_buffers(remove_duplicate=False)):
            path, _, leaf = name.rpartition(".")
            if _has_buffer(model, name):  # not a constant the trace made (those are real already)
                stage.get_submodule(path)._buffers[leaf] = model.get_buffer(name)


def _has_buffer(model: nn.Module, name: str) -> bool:
    try:
        model.get_buffer(name)
    except AttributeError:
        return False
    return True


@dataclasses.dataclass
class _Stage:
    """This rank's stage: its module (tensor-parallel when tp > 1), its microbatch inputs and outputs,
    and what it needs of the :class:`StageSplit` to feed stage 0 and rebuild the model's output."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    first_inputs: tuple[str, ...]
    constants: dict[str, Any]
    out_spec: pytree.TreeSpec | None


# --------------------------------------------------------------------------- the module

class MeshParallelModule(nn.Module):
    """This rank's part of a model run over a dp x pp x tp mesh; called like the model, it returns the
    whole batch's output on every rank (see :mod:`autotp.runtime.mesh.mesh_module`).

    Attributes: ``plan`` (the :class:`ParallelPlan` applied), ``stage_module`` (this rank's stage,
    a :class:`~autotp.runtime.execution.module.TensorParallelModule` when ``tp > 1``), ``stage_index``,
    ``replica_index``.
    """

    def __init__(self, plan: ParallelPlan, mesh: Any, stage_module: nn.Module, *, signature: inspect.Signature,
                 hosts: Sequence[Hashable], stage: _Stage | None = None,
                 example_shapes: tuple[tuple[int, ...], ...] = (), training: bool = False) -> None:
        super().__init__()
        self.trains = training
        self.plan = plan
        self.stage_module = stage_module
        self.stage_index = mesh_coordinate(mesh, "pp")
        self.replica_index = mesh_coordinate(mesh, "dp")
        self._dp_group = dim_group(mesh, "dp") if plan.mesh.dp > 1 else None
        self._pp_group = dim_group(mesh, "pp") if plan.mesh.pp > 1 else None
        self._hand_out = _hand_out_tree(replica_ranks(mesh, self.replica_index), plan.mesh.dp > 1, hosts)
        self._signature = signature
        self._stage = stage
        self._example_shapes = example_shapes
        self._schedule: Any = None
        self._device = next(iter(stage.inputs)).device if stage is not None else torch.device("cpu")
        if stage is not None:
            self._schedule = _schedule(plan, stage_module, stage, self.stage_index, self._pp_group, self._device)
        if training and self._dp_group is not None:
            average_gradients_over(stage_module, self._dp_group, plan.mesh.dp)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict``, full tensors (call on every rank): the tp stage's
        :meth:`~autotp.runtime.execution.module.TensorParallelModule.full_state_dict`, or its own ``state_dict``
        when ``tp == 1``."""
        own = getattr(self.stage_module, "full_state_dict", None)
        return own() if callable(own) else {k: v.detach().clone() for k, v in self.stage_module.state_dict().items()}

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds: its stage's, split over its tp group."""
        own = getattr(self.stage_module, "parameter_bytes", None)
        if callable(own):
            return int(own())
        return sum(p.numel() * p.element_size() for p in self.stage_module.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = _batch_size(args, kwargs)
        dp = self.plan.mesh.dp
        if self._stage is not None:
            self._check_pipeline_shapes(args, kwargs)
        if dp > 1:
            if batch is None or batch < dp:
                raise InputShapeError(f"the batch ({batch} rows) must have at least dp={dp} rows, one slice per "
                                      "data-parallel replica; pass a larger batch or use a mesh with a smaller dp")
            sizes = replica_sizes(batch, dp)
            start = sum(sizes[: self.replica_index])
            args, kwargs = _slice_batch(args, kwargs, batch, start, start + sizes[self.replica_index])
        output = self._run_stages(args, kwargs) if self._stage is not None else self.stage_module(*args, **kwargs)
        if self.trains:  # the replica's own rows (its gradients are averaged over dp)
            return output
        return self._to_every_rank(output, sizes if dp > 1 else None)

    def _to_every_rank(self, output: Any, sizes: Sequence[int] | None) -> Any:
        """The whole batch's output on every rank. The replica's source (its last stage's first tp rank) holds the
        replica's output (``None`` on the stages before the last); with ``sizes`` (dp > 1) the sources all-gather
        the replicas' slices over dp, then each source hands the output to the rest of its replica
        (:func:`hand_out` along the tree :func:`_hand_out_tree` made). Without dp, the last stage's tp ranks hold it
        already."""
        source, children = self._hand_out
        me = dist.get_rank()
        failure: InputShapeError | None = None
        if sizes is not None and me == source:
            assert self._dp_group is not None
            try:
                output = gather_batch(output, sizes, self._dp_group)
            except InputShapeError as error:  # every source raises it; its replica hears of it, then raises too
                failure = error
        if me not in children or len(children) == 1:
            if failure is not None:
                raise failure
            return output
        leaves, spec = pytree.tree_flatten(output) if output is not None else (None, None)
        device = next((leaf.device for leaf in leaves or () if isinstance(leaf, torch.Tensor)), self._device)
        leaves = hand_out([failure] if failure is not None else leaves, source, children, device)
        if len(leaves) == 1 and isinstance(leaves[0], InputShapeError):
            raise leaves[0]
        if spec is not None:
            return pytree.tree_unflatten(leaves, spec)
        return self._rebuild(leaves)  # a stage before the last: the output's structure is the pipeline's

    def _check_pipeline_shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._stage is not None
        shapes = tuple(tuple(t.shape) for t in _first_inputs(self._signature, args, kwargs, self._stage.first_inputs))
        if shapes != self._example_shapes:
            raise InputShapeError(
                f"a pipeline over pp={self.plan.mesh.pp} stages runs the shapes it was compiled for: inputs "
                f"{list(self._example_shapes)}; this call passes {list(shapes)}. Compile again with example_inputs of "
                "these shapes")

    def _run_stages(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stage = self._stage
        assert stage is not None and self._pp_group is not None
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, traced in stage.constants.items():
            given = bound.arguments.get(name)
            if given is not traced and given != traced:
                raise TracedValueError(f"{name} was {traced!r} when the pipeline was traced and is part of its stages; "
                                       f"this call passes {given!r}. Call it with {traced!r} or compile again.")
        first = tuple(bound.arguments[name] for name in stage.first_inputs)
        with torch.no_grad():
            result = self._schedule.step(*first) if self.stage_index == 0 else self._schedule.step()
        return self._rebuild(list(_as_tuple(result))) if self.stage_index == self.plan.mesh.pp - 1 else None

    def _rebuild(self, leaves: list[Any]) -> Any:
        """The last stage's output ``leaves`` in the model's output structure."""
        assert self._stage is not None
        if self._stage.out_spec is not None:
            return pytree.tree_unflatten(leaves, self._stage.out_spec)
        return leaves[0] if len(leaves) == 1 else tuple(leaves)


def average_gradients_over(module: nn.Module, group: dist.ProcessGroup, replicas: int) -> None:
    """After every gradient accumulation into a parameter of ``module``, average it over ``group``
    (``replicas`` ranks: one all-reduce per parameter, summed then divided, which gloo supports).
    Every replica's autograd reaches the parameters in the same order, so the all-reduces match."""
    def average(param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(replicas)

    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _schedule(plan: ParallelPlan, module: nn.Module, stage: _Stage, stage_index: int,
              group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """The plan's pipeline schedule over this rank's stage (inference: no loss, so 1F1B runs its forwards only)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    runner = PipelineStage(module, stage_index, plan.mesh.pp, device, input_args=stage.inputs,
                           output_args=stage.outputs, group=group)
    kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return kind(runner, n_microbatches=plan.microbatches)


# --------------------------------------------------------------------------- compile

def check_plan_for_mesh(plan: ParallelPlan, shape: MeshShape, model: nn.Module) -> ParallelPlan:
    """``plan`` with every stage's ``begins_at`` filled in; ValueError, saying the fix, when it does not fit
    the mesh or the model (another mesh shape, stages that do not cover the layer blocks, an unknown
    schedule, a split point that is not a module)."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"with mesh=, plan= takes a ParallelPlan (autotp.planning.mesh_plan) or None, got "
                        f"{type(plan).__name__}; for a tensor-parallel Plan alone use group= instead of mesh=")
    if plan.mesh != shape:
        raise ValueError(f"the plan was made for a mesh {plan.mesh} but the given mesh is {shape}; build the mesh "
                         f"the plan asks for (init_device_mesh(..., ({plan.mesh.dp}, {plan.mesh.pp}, {plan.mesh.tp}), "
                         "mesh_dim_names=('dp', 'pp', 'tp'))) or plan again for this mesh (or pass plan=None)")
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"schedule {plan.schedule!r} is not one the mesh runtime runs: {', '.join(SCHEDULES)}")
    if not isinstance(plan.microbatches, int) or plan.microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {plan.microbatches!r}")
    if shape.pp == 1:
        return plan
    blocks = layer_blocks(model)
    if shape.pp > len(blocks):
        raise ValueError(f"pp={shape.pp} pipeline stages need at least {shape.pp} layer blocks, but "
                         f"{type(model).__name__} has {len(blocks)}; use a mesh with pp <= {max(len(blocks), 1)} "
                         "and give the other ranks to dp or tp")
    stops = [0]
    fixed = []
    modules = dict(model.named_modules())
    for index, stage in enumerate(plan.stages):
        if stage.first_block != stops[-1] or not stage.first_block < stage.stop_block <= len(blocks):
            ranges = [(s.first_block, s.stop_block) for s in plan.stages]
            raise ValueError(f"the plan's stages {ranges} must be non-empty, contiguous block ranges from 0 to "
                             f"{len(blocks)} (the model's layer blocks); fix the ParallelPlan's stages")
        stops.append(stage.stop_block)
        begins_at = stage.begins_at or (blocks[stage.first_block] if index else "")
        if index and begins_at not in modules:
            raise ValueError(f"stage {index} begins at {begins_at!r}, which is not a module of {type(model).__name__}; "
                             f"name a layer block such as {blocks[stage.first_block]!r}")
        fixed.append(dataclasses.replace(stage, begins_at=begins_at))
    if stops[-1] != len(blocks):
        raise ValueError(f"the plan's stages end at block {stops[-1]} but the model has {len(blocks)} layer blocks; "
                         "the last stage must stop at the last block")
    return dataclasses.replace(plan, stages=tuple(fixed))


def _check_pipeline_batch(batch: int | None, shape: MeshShape, microbatches: int) -> int:
    """Rows of one microbatch; ValueError when the example batch does not split into equal microbatches."""
    parts = shape.dp * microbatches
    if batch is None or batch % parts:
        raise ValueError(
            f"with pp={shape.pp}, the example batch ({batch} rows) must split into dp={shape.dp} replicas x "
            f"{microbatches} microbatch(es) of equal rows; pass a batch that is a multiple of {parts} "
            "(or a ParallelPlan with other microbatches)")
    return batch // parts


def default_microbatches(batch: int | None, shape: MeshShape) -> int:
    """Microbatches when no plan says: ``pp`` (each stage busy once the pipeline fills) when the replica's
    batch divides by it, else the largest divisor of the replica's batch below ``pp``, else 1."""
    if shape.pp == 1 or batch is None or batch % shape.dp:
        return 1
    rows = batch // shape.dp
    return max(m for m in range(1, shape.pp + 1) if rows % m == 0)


def compile_on_mesh(model: nn.Module, mesh: Any, *, example_inputs: tuple[Any, ...],
                    example_kwargs: dict[str, Any] | None, plan: ParallelPlan | str | os.PathLike[str] | None,
                    checkpoint: str | os.PathLike[str] | None = None, options: PlanOptions,
                    runtime: RuntimeOptions, compile_group: Callable[..., TensorParallelModule]) -> MeshParallelModule:
    """This rank's :class:`MeshParallelModule`: see :mod:`autotp.runtime.mesh.mesh_module` and :func:`autotp.compile_mesh`.
    ``options`` and ``runtime`` go to ``compile_group`` (the compile driver, :func:`autotp.driver.compile_group`,
    handed down by ``autotp.compile_mesh``) for each stage's tensor-parallel part.

    ``checkpoint``: each rank reads its stage's tensor-parallel shards from it
    (:mod:`autotp.runtime.checkpoints.loading`), so ``model`` may be on the meta device (the stages are cut
    with fake weights, :func:`split_stages`); every stage is then compiled over its tp group
    (a group of one where ``tp == 1``)."""
    timeout_s = runtime.agreement_timeout_s
    training = options.training
    example_kwargs = dict(example_kwargs or {})
    split: StageSplit | None = None
    # every rank checks the same things and agrees on the outcome: one rank's bad input fails them all
    with ranks_agree(None, timeout_s=timeout_s, what="autotp.compile_mesh") as agreement:
        check_model(model)
        shape = mesh_shape_of(mesh)
        if checkpoint is None and any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("autotp.compile_mesh needs real weights, but the model has parameters on the meta "
                             "device; pass checkpoint='path/to/model.safetensors' (or its directory) to read each "
                             "rank's stage shards from it, or load the weights first")
        batch = _batch_size(example_inputs, example_kwargs)
        plan = as_parallel_plan(plan)
        if plan is None:
            plan = even_parallel_plan(model, shape, microbatches=default_microbatches(batch, shape))
        plan = check_plan_for_mesh(plan, shape, model)
        if training and shape.pp > 1:
            raise ValueError(f"autotp.compile_mesh(..., training=True) trains over dp x tp; this mesh has pp={shape.pp} "
                             "(pipeline training, a schedule with a loss, is not supported yet): use a mesh without pp")
        if shape.dp > 1 and (batch is None or batch < shape.dp):
            raise ValueError(f"the example batch ({batch} rows) must have at least dp={shape.dp} rows, one per "
                             "replica; pass a larger example batch")
        if shape.pp > 1:
            rows = _check_pipeline_batch(batch, shape, plan.microbatches)
            if checkpoint is not None:  # buffers transformers derives from the config (rotary inv_freq): real ones
                from autotp.runtime.checkpoints.loading import materialize_hf_buffers

                derived = [name for name, b in model.named_buffers() if b.device.type == "meta"]
                materialize_hf_buffers(model, derived, trace_device(example_inputs, example_kwargs))
            mb_args, mb_kwargs = _slice_batch(example_inputs, example_kwargs, batch or 0, 0, rows)
            # one rank traces the whole model for the mesh (through the trace cache), the others rebuild its program
            split = split_stages(model, plan.split_points, mb_args, mb_kwargs,
                                 share=FirstRankTrace(None, timeout_s=timeout_s, purpose=SPLIT_PURPOSE),
                                 trace_cache=open_trace_cache(runtime.trace_cache, checkpoint))
        check_weights = runtime.check_weights and checkpoint is None
        record = {**mesh_record(plan, example_inputs, example_kwargs), "training": training}
        record["checkpoint"] = checkpoint is not None
        agreement.record = options_record(record, weights=dict(model.state_dict()) if check_weights else None)
    tp_group = dim_group(mesh, "tp")
    if checkpoint is not None and tp_group is None:
        # no tp dim: each rank reads its part alone (groups of one, made on every rank in order)
        tp_group, _ = dist.new_subgroups(group_size=1)
    compile_stage = shape.tp > 1 or checkpoint is not None
    signature = inspect.signature(model.forward)
    replica = mesh_coordinate(mesh, "dp")
    hosts = rank_hosts(runtime_host(runtime))
    if shape.pp == 1:
        if shape.dp > 1:
            example_inputs, example_kwargs = _slice_batch(example_inputs, example_kwargs, batch or 0,
                                                          *replica_example_rows(batch or 0, shape.dp, replica))
        whole: nn.Module = model
        if compile_stage:
            whole = compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                  world_size=None, group=tp_group, plan=plan.stages[0].tp_plan, checkpoint=checkpoint,
                                  max_cache_len=None, options=options, runtime=runtime)
        return MeshParallelModule(plan, mesh, whole, signature=signature, hosts=hosts, training=training)
    assert split is not None
    stage_index = mesh_coordinate(mesh, "pp")
    module = split.modules[stage_index]
    if compile_stage:
        module = compile_group(module, example_inputs=split.inputs[stage_index], example_kwargs=None,
                               world_size=None, group=tp_group, plan=plan.stages[stage_index].tp_plan,
                               checkpoint=checkpoint, max_cache_len=None, options=options, runtime=runtime)
    stage = _Stage(module, split.inputs[stage_index], split.outputs[stage_index], split.first_inputs,
                   split.constants, split.out_spec)
    del split  # the other stages' modules and activations
    first_shapes = tuple(tuple(leaf.shape) for leaf in _first_inputs(signature, example_inputs, example_kwargs,
                                                                        stage.first_inputs))
    return MeshParallelModule(plan, mesh, module, signature=signature, hosts=hosts, stage=stage,
                              example_shapes=first_shapes)


def mesh_record(plan: ParallelPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, object]:
    """What every rank of the mesh must share before building its part, printed for comparison."""
    stages = [(stage.first_block, stage.stop_block, stage.begins_at, plan_text(stage.tp_plan)) for stage in plan.stages]
    inputs = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else repr(leaf)
              for leaf in pytree.tree_leaves((args, kwargs))]
    return {"mesh": str(plan.mesh), "stages": stages, "microbatches": plan.microbatches, "schedule": plan.schedule,
            "example inputs": inputs}


def _first_inputs(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                  names: Sequence[str]) -> list[torch.Tensor]:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments[name] for name in names if isinstance(bound.arguments.get(name), torch.Tensor)]

