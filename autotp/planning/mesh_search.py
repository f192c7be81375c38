"""Search dp x pp x tp: the mesh, the pipeline stage cuts and the microbatches, by predicted cost.

The search space (optimal within it, by the cost model's prices):

* every factorization ``dp * pp * tp == world_size`` (or those matching the dims the caller
  forces), with ``tp`` dividing the devices per node or a multiple of it (a group that straddles
  two nodes is never a whole number of nodes; see :func:`check_tp_fits_nodes`) and ``pp`` at most
  the number of layer blocks;
* contiguous stage cuts between layer blocks; the modules before the first layer (embeddings) run
  on the first stage, those after the last (final norm, head) on the last;
* for ``objective="throughput"``: every microbatch count ``m`` dividing the per-replica batch
  ``batch / dp``; for ``"latency"``: one request of batch 1, ``m = 1``;
* each stage's tensor-parallel plan: the MILP's optimum over ``tp`` ranks (``passes/solver.py``,
  identical layers tied), solved once per ``tp`` at the example's batch and re-priced at other
  batch sizes (a smaller batch might prefer other placements; the search keeps the one plan).

Prices, for one microbatch of ``b`` requests (the example's sequence length):

* a layer block's time: the roofline of each of its nodes under the chosen strategy plus its
  tensor-parallel collectives (the planner's own pricing, ``passes/pricing.py``; groups bigger
  than a node pay the inter-node link, see :mod:`autotp.cost_model.collectives`). FLOPs, bytes
  and collective bytes are affine in ``b`` at a fixed sequence length, so two captures (batch 2
  and 4) give them exactly at every ``b``; the roofline ``max`` is applied at ``b``.
* a stage's time ``s_k``: its blocks, plus the first call of each kernel it runs (``Hardware.first_call_s``,
  which the planner charges once per call of a graph; a stage is a graph of its own, so a pipeline pays it once per
  stage: :func:`first_calls_s`), plus sending the activations that cross the cut to the next
  stage (:func:`autotp.cost_model.p2p_time_s`, on the inter-node link when the two ranks are on
  different nodes). As the runtime's ``PipelineStage`` does, every tp rank sends the whole boundary
  to the same tp rank of the next stage, and the crossing sends that leave one node at once share
  its link (:func:`_send_times`).
* a stage's compute runs at the share of the cores its machine gives it: the profile's rates are
  those with every rank of a machine busy; while only some are (one request through a pipeline
  runs one stage at a time), the compute takes ``Hardware.busy_scale(busy ranks)`` of it, which
  ``autotp calibrate`` measures (1.0 at every count on hosts with a core per rank and in every
  named profile).
* a replica's time for ``m`` microbatches: ``sum(s_k) + (m - 1) * max(s_k)``
  (:func:`autotp.cost_model.pipeline_time_s`, GPipe / 1F1B forward), each ``s_k`` at the busy
  ranks of its moment (:func:`replica_time_s`), plus handing the output to every rank, as the mesh
  runtime returns the whole batch's output on each (:func:`_output_s`: the replicas' last stages
  all-gather their slices over ``dp``, then each hands the batch to the rest of its replica along a
  tree that crosses into each node once). Latency: that time at
  ``b = m = 1``, the replicas serving one request each at once (so with ``dp`` rows gathered).
  Throughput: ``batch / time`` with ``dp`` replicas each running ``batch / dp`` requests at once.
  Decode (``mesh_costs(..., decode_cache_len=N)``): the same, for the step generation runs (a token per row over
  the KV cache, captured with it), the picked tokens handed out over ``pp`` instead of the output.
* memory per device: the stage's parameter shards plus twice the largest activation one of its
  ops writes (the op's input and output live together), at the microbatch size; the KV cache and
  allocator slack are not counted. It must fit ``Hardware.memory_gib``.

Because ``sum(s_k)`` does not depend on where the cuts are, the cuts that minimise the pipeline
time are those minimising the slowest stage, subject to memory: :func:`best_cuts` finds them
exactly by dynamic programming over cut points (balanced by predicted time and memory, not by
layer count; at the rates of every rank busy, so with a busy scale the cuts are the best ones
at those rates, the time then priced at each moment's busy ranks).

Speed (planning a 126-layer model in seconds): for a HuggingFace model whose layers are all
alike (``config.num_hidden_layers`` >= 3 identical modules in one ``ModuleList``; no differing
``config.layer_types``), the search captures a copy with TWO layers (built from the config on the
meta device): the first layer's costs (with the resharding of the embeddings into it) stand for
layer 0, the second's (with the layer-to-layer resharding into it) for each of the others; a
resharding counts for the block of its first reader. Any other model is captured whole (correct,
slower). Limits of the copy: a model whose layers differ (sliding and full attention, MoE every
other layer) or that is not built from its config is captured whole; and the MILP weighs the
embeddings and head against two layers, not ``num_hidden_layers``, so in a close call its layer
plan may differ from the full model's (the plan is then priced, not re-solved, at full depth).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from autotp.base.errors import PlanError
from autotp.base.module_paths import block_of, block_path, differing_layer, layer_lists
from autotp.base.placements import placement_to_str
from autotp.base.progress import log_progress
from autotp.base.shapes import nbytes as value_nbytes
from autotp.capture.kv_cache import CachedCausalLM
from autotp.capture.tracing import CapturedGraph, capture
from autotp.cost_model import (
    Hardware,
    compute_time_s,
    get_hardware,
    link_collective_time_s,
    p2p_time_s,
    pipeline_time_s,
)
from autotp.cost_model.collectives import (
    HAND_OUT_HEADER_BYTES,
    SHAPE_ROW_BYTES,
    binomial_broadcasts_s,
    host_tree_deliveries_s,
)
from autotp.cost_model.compute import op_name
from autotp.passes.costing import (
    CostedGraph,
    cost_strategy_graph,
    kernel_call,
    node_dtype,
    node_fixed_costs,
    node_shape_terms,
    node_work,
)
from autotp.passes.pricing import price_choice
from autotp.passes.quantized import quantized_links
from autotp.passes.solver import solve
from autotp.passes.strategies import build_strategy_graph
from autotp.passes.tying import tie_identical_blocks
from autotp.passes.uneven import largest_shard_nbytes
from autotp.planning.mesh_plan import MESH_DIM_NAMES, MeshShape, ParallelPlan, StagePlan
from autotp.planning.plan import module_path
from autotp.planning.planner import auto_memory_budget

__all__ = [
    "DEFAULT_THROUGHPUT_BATCH",
    "OBJECTIVES",
    "MeshCosts",
    "best_cuts",
    "check_tp_fits_nodes",
    "factorizations",
    "forced_dims",
    "mesh_costs",
    "plan_mesh",
    "search_mesh",
]

OBJECTIVES = ("latency", "throughput")
DEFAULT_THROUGHPUT_BATCH = 64
_PROFILE_BATCHES = (2, 4)  # two dynamic batch sizes: affine quantities are exact from two points
_GIB = 2**30


# ----------------------------------------------------------------------------------- requests

def forced_dims(parallelism: str | Mapping[str, int], mesh: MeshShape | None, world_size: int) -> dict[str, int]:
    """The mesh dims the caller fixes: ``{}`` for ``"auto"``, all three for ``mesh=``.

    ValueError (saying what to pass) for an unknown dim name, a size that is not a positive int,
    a mesh of another world size, or forced sizes whose product does not divide ``world_size``.
    """
    if mesh is not None:
        if not isinstance(mesh, MeshShape):
            raise ValueError(f"mesh must be a MeshShape(dp=..., pp=..., tp=...), got {type(mesh).__name__}")
        if parallelism not in ("auto", "tp") and parallelism != mesh_dict(mesh):
            raise ValueError("pass either mesh=MeshShape(...) or parallelism={...}, not both")
        if mesh.world_size != world_size:
            raise ValueError(f"mesh {mesh} has {mesh.world_size} ranks but world_size is {world_size}; "
                             f"pass a mesh whose dp * pp * tp is {world_size}, or world_size={mesh.world_size}")
        return mesh_dict(mesh)
    if parallelism == "auto":
        return {}
    if not isinstance(parallelism, Mapping):
        raise ValueError(f"parallelism must be 'tp', 'auto' or a dict of mesh dims such as {{'tp': 8}}, "
                         f"got {parallelism!r}")
    forced: dict[str, int] = {}
    for name, size in parallelism.items():
        if name not in MESH_DIM_NAMES:
            raise ValueError(f"unknown mesh dim {name!r} in parallelism={dict(parallelism)!r}; "
                             f"the dims are {', '.join(MESH_DIM_NAMES)} (e.g. parallelism={{'tp': 8, 'pp': 2}})")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"parallelism[{name!r}] must be a positive int, got {size!r}")
        forced[name] = size
    product = math.prod(forced.values())
    if world_size % product:
        raise ValueError(f"world_size {world_size} is not a multiple of "
                         f"{' * '.join(f'{k}={v}' for k, v in forced.items())} = {product}; "
                         f"force dims whose product divides {world_size}, or change world_size")
    if len(forced) == len(MESH_DIM_NAMES) and product != world_size:
        raise ValueError(f"dp * pp * tp = {product} but world_size is {world_size}; leave one dim out to let "
                         f"the search choose it")
    return forced


def mesh_dict(mesh: MeshShape) -> dict[str, int]:
    return {name: getattr(mesh, name) for name in MESH_DIM_NAMES}


def check_tp_fits_nodes(tp: int, hardware: Hardware) -> str:
    """Why ``tp`` cannot form tensor-parallel groups on whole nodes (``""`` when it can).

    Ranks are laid out with ``tp`` fastest; ``tp`` must divide the devices per node (each group
    inside one node) or be a multiple of it (each group a whole number of nodes). Any other size
    makes some group straddle a node boundary, paying the network for part of its ranks; the search
    does not consider such meshes and a forced one is refused.
    """
    d = hardware.devices_per_node
    if d % tp == 0 or tp % d == 0:
        return ""
    fits = sorted({t for t in range(1, d + 1) if d % t == 0} | {d * 2, d * 4})
    return (f"tp={tp} neither divides nor is a multiple of the {d} devices per node of {hardware.name!r}: "
            f"some tensor-parallel groups would straddle two nodes; use tp in {fits}")


def factorizations(world_size: int, forced: Mapping[str, int] | None = None) -> list[MeshShape]:
    """Every ``MeshShape`` with ``dp * pp * tp == world_size`` agreeing with ``forced``, dp-major order."""
    forced = forced or {}
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    meshes = []
    for dp, pp in itertools.product(divisors, divisors):
        if world_size % (dp * pp):
            continue
        mesh = MeshShape(dp=dp, pp=pp, tp=world_size // (dp * pp))
        if all(getattr(mesh, name) == size for name, size in forced.items()):
            meshes.append(mesh)
    return meshes


# ----------------------------------------------------------------------------------- costs

@dataclasses.dataclass(frozen=True)
class _Affine:
    """``constant + slope * b``: a quantity of a microbatch of ``b`` requests."""

    constant: float
    slope: float

    @classmethod
    def through(cls, at: tuple[float, ...]) -> _Affine:
        (b0, b1), (v0, v1) = _PROFILE_BATCHES, at
        slope = (v1 - v0) / (b1 - b0)
        return cls(v0 - slope * b0, slope)

    def __call__(self, b: float) -> float:
        return max(0.0, self.constant + self.slope * b)


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One layer block at one ``tp``: what its nodes ask of the hardware, as functions of ``b``."""

    # per kernel: FLOPs, bytes, dtype, a GEMM's local (m, n, k) (empty otherwise), transcendental elements,
    # op name (compute.op_name), fixed costs by name (compute.fixed_costs)
    kernels: tuple[tuple[_Affine, _Affine, torch.dtype, tuple[_Affine, ...], _Affine, str,
                         tuple[tuple[str, _Affine], ...]], ...]
    fixed_s: float  # views: host dispatch only
    comm_s: _Affine  # its tensor-parallel collectives
    parameter_bytes: int  # per rank
    activation_bytes: _Affine  # largest output one op writes, per rank
    boundary_bytes: _Affine  # what its outputs send to later blocks (a stage cut after it)
    kernels_called: Mapping[str, float] = dataclasses.field(default_factory=dict)  # kernel -> its first call's s

    def time_s(self, b: int, hardware: Hardware) -> float:
        return self.compute_s(b, hardware) + self.comm_s(b)

    def compute_s(self, b: int, hardware: Hardware) -> float:
        """Its kernels and views: the part a rank's share of a core sets (``Hardware.busy_scale``)."""
        compute = sum(compute_time_s(flops(b), moved(b), dtype, hardware,
                                     gemm_min_dim=min(d(b) for d in dims) if dims else None,
                                     rated_elements=elements(b), rated_op=name,
                                     fixed=[(cost, times(b)) for cost, times in fixed])
                      for flops, moved, dtype, dims, elements, name, fixed in self.kernels)
        return compute + self.fixed_s


@dataclasses.dataclass
class MeshCosts:
    """Per ``tp``, the costs of the pipeline's units: ``units[tp][u]`` for layer block ``u``.

    ``pre[tp]`` / ``post[tp]``: the modules before the first layer and after the last, which run
    on the first and last stage. ``names[u]``: the module FQN of layer block ``u``, where a stage
    starting at it is cut (``model.layers.8``). Times are memoised per ``(tp, b)``.
    """

    hardware: Hardware
    names: tuple[str, ...]
    units: dict[int, tuple[_Unit, ...]]
    pre: dict[int, _Unit]
    post: dict[int, _Unit]
    tp_summaries: dict[int, str]
    profile_s: float = 0.0
    _times: dict[tuple[int, int], tuple[np.ndarray, float, float]] = dataclasses.field(default_factory=dict)
    output_bytes: _Affine = _Affine(0.0, 0.0)  # the model's output (every leaf) for b requests
    output_leaves: int = 0
    generation_step: bool = False  # priced as one decode step: tokens, not the output, handed out
    _comm: dict[tuple[int, int], tuple[np.ndarray, float, float]] = dataclasses.field(default_factory=dict)

    def comm_times(self, tp: int, b: int) -> tuple[np.ndarray, float, float]:
        """The tensor-parallel collectives' part of :meth:`times` (what a busy core does not speed up)."""
        key = (tp, b)
        if key not in self._comm:
            self._comm[key] = (np.array([unit.comm_s(b) for unit in self.units[tp]]), self.pre[tp].comm_s(b),
                               self.post[tp].comm_s(b))
        return self._comm[key]

    def times(self, tp: int, b: int) -> tuple[np.ndarray, float, float]:
        """(seconds of each layer block, of the pre modules, of the post modules) at microbatch ``b``."""
        key = (tp, b)
        if key not in self._times:
            memo: dict[int, float] = {}  # identical layers share one _Unit: price it once
            for unit in self.units[tp]:
                if id(unit) not in memo:
                    memo[id(unit)] = unit.time_s(b, self.hardware)
            per_unit = np.array([memo[id(unit)] for unit in self.units[tp]])
            self._times[key] = (per_unit, self.pre[tp].time_s(b, self.hardware), self.post[tp].time_s(b, self.hardware))
        return self._times[key]


def _node_paths(graph: Any) -> dict[str, str]:
    return {name: graph.parameters.get(name) or module_path(graph.nodes[name]) for name in graph.order}


def _unit_keys(graph: Any) -> tuple[dict[str, Any], list[Any]]:
    """Node -> its layer block (``(container, index)``), or ``"pre"`` / ``"post"``; and the layers in order."""
    paths = _node_paths(graph)
    position = {name: index for index, name in enumerate(graph.order)}
    first_layer = None
    keys: dict[str, Any] = {}
    layers: list[Any] = []
    for name in graph.order:
        layer = block_of(paths[name])
        if layer is not None and graph.nodes[name].op == "call_function":
            if layer not in layers:
                layers.append(layer)
            if first_layer is None:
                first_layer = position[name]
    for name in graph.order:
        node = graph.nodes[name]
        layer = block_of(paths[name])
        if layer is not None and layer in layers:
            keys[name] = layer
            continue
        at = position[name] if node.op == "call_function" else min(
            (position[u.name] for u in node.users if u.name in position), default=position[name])
        keys[name] = "pre" if first_layer is not None and at < first_layer else "post"
    return keys, layers


def _profile_units(captured: tuple[CapturedGraph, CapturedGraph], tp: int, hardware: Hardware,
                   time_limit_s: float) -> tuple[dict[Any, _Unit], list[Any], str]:
    """Solve the TP plan over ``tp`` ranks and measure every block's work at both batch sizes."""
    graphs = []
    for cap in captured:
        graph = build_strategy_graph(cap.graph_module, tp, {**cap.parameter_fqns(), **cap.state_fqns()},
                                     frozenset(cap.state))
        graphs.append((graph, cost_strategy_graph(graph, hardware)))
    (g0, costed0), (g1, costed1) = graphs
    if g0.order != g1.order or any(len(g0.strategies[n]) != len(g1.strategies[n]) for n in g0.order):
        raise PlanError("the model traced into different graphs at batch 2 and 4; the mesh search prices other "
                        "batch sizes from these two, so it needs a model whose graph does not depend on the batch")
    budget = auto_memory_budget(costed0, frozenset(captured[0].state))
    choice = solve(costed0, memory_budget_bytes=budget, time_limit_s=time_limit_s, tie=tie_identical_blocks(g0),
                   links=tuple(quantized_links(g0))).choice
    keys, layers = _unit_keys(g0)
    return _units_from(keys, layers, (costed0, costed1), choice), layers, _layer_summary(g0, keys, layers, choice)


def _layer_summary(graph: Any, keys: dict[str, Any], layers: list[Any], choice: dict[str, int]) -> str:
    """The first layer's weight placements, by path inside the layer: ``mlp.up_proj.weight S(0), ...``."""
    if not layers:
        return ""
    prefix = block_path(*layers[0]) + "."
    parts = [f"{fqn.removeprefix(prefix)} {placement_to_str(graph.strategies[name][choice[name]].output)}"
             for name, fqn in graph.parameters.items() if keys.get(name) == layers[0] and fqn.startswith(prefix)]
    return ", ".join(parts)


def _units_from(keys: dict[str, Any], layers: list[Any], costed: tuple[CostedGraph, CostedGraph],
                choice: dict[str, int]) -> dict[Any, _Unit]:
    graph0 = costed[0].graph
    kernels: dict[Any, list] = {}
    fixed: dict[Any, float] = {}
    comm: dict[Any, list[float]] = {}
    params: dict[Any, int] = {}
    act: dict[Any, list[float]] = {}
    boundary: dict[Any, list[float]] = {}
    called: dict[Any, dict[str, float]] = {}
    for key in [*layers, "pre", "post"]:
        kernels[key], fixed[key], comm[key], params[key] = [], 0.0, [0.0, 0.0], 0
        act[key], boundary[key], called[key] = [0.0, 0.0], [0.0, 0.0], {}
    for name in graph0.order:
        key = keys[name]
        node = graph0.nodes[name]
        call = kernel_call(node, costed[0].hardware)
        if call is not None:
            called[key][call[0]] = call[1]
        works = [node_work(c.graph.nodes[name], [c.graph.strategies[name][choice[name]]], c.graph.world_size)
                 for c in costed]
        if works[0] is None:
            if node.op == "call_function" and costed[0].compute_s[name][choice[name]] > 0:
                fixed[key] += costed[0].compute_s[name][choice[name]]
        else:
            (f0, m0), (f1, m1) = works[0][0], works[1][0]  # type: ignore[index]
            (dims0, e0), (dims1, e1) = (
                node_shape_terms(c.graph.nodes[name], [c.graph.strategies[name][choice[name]]], c.graph.world_size,
                                 work)[0] for c, work in zip(costed, works))  # type: ignore[arg-type]
            dims = tuple(_Affine.through((a, b)) for a, b in zip(dims0, dims1)) if dims0 and dims1 else ()
            costs0, costs1 = (dict(node_fixed_costs(c.graph.nodes[name], [c.graph.strategies[name][choice[name]]],
                                                    c.graph.world_size)[0]) for c in costed)
            kernels[key].append((_Affine.through((f0, f1)), _Affine.through((m0, m1)), node_dtype(node), dims,
                                 _Affine.through((e0, e1)), op_name(node.target),
                                 tuple((cost, _Affine.through((times, costs1.get(cost, 0))))
                                       for cost, times in costs0.items())))
        if name in costed[0].memory_bytes:
            params[key] += costed[0].memory_bytes[name][choice[name]]
        for i, c in enumerate(costed):
            value = c.graph.nodes[name].meta.get("val")
            placement = c.graph.strategies[name][choice[name]].output
            local = sum(largest_shard_nbytes(v.shape, v.element_size(), placement, c.graph.world_size)
                        for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))
            if node.op == "call_function":
                act[key][i] = max(act[key][i], float(local))
            crosses = any(keys.get(u.name) not in (key, None) for u in c.graph.nodes[name].users)
            if key in layers and crosses and node.op == "call_function":
                boundary[key][i] += value_nbytes(value)
    # a resharding counts for the block of its first reader: the layer->layer transition into layer i
    # belongs to layer i (on the receiving stage when a cut falls there), the last layer's into the head
    # to the post modules, so every layer after the first costs the same
    position = {name: index for index, name in enumerate(graph0.order)}
    for i, c in enumerate(costed):
        for r in price_choice(c, choice).reshardings:
            reader = min(r.consumers, key=lambda name: position.get(name, len(position)))
            comm[keys.get(reader, keys[r.producer])][i] += r.time_s
    return {key: _Unit(tuple(kernels[key]), fixed[key], _Affine.through(tuple(comm[key])), params[key],
                       _Affine.through(tuple(act[key])), _Affine.through(tuple(boundary[key])), called[key])
            for key in [*layers, "pre", "post"]}


def _at_batch(value: Any, batch: int) -> Any:
    def resize(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return t

    return pytree.tree_map(resize, value)


def _layer_list(model: torch.nn.Module, count: int) -> str | None:
    """FQN of the outermost ``ModuleList`` of ``count`` identical layers
    (:func:`autotp.base.module_paths.layer_signature`), if any."""
    for name in layer_lists(model, count) if count > 0 else ():
        if differing_layer(model.get_submodule(name)) is None:
            return name
    return None


def reduced_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, int, str] | None:
    """A meta-device copy of an HF-style ``model`` with two layers, the real layer count, and the layer
    list's FQN; None when the model is not built from a config of 3 or more identical layers (module doc)."""
    config: Any = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if config is None or not isinstance(layers, int) or layers < 3:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return None
    container = _layer_list(model, layers)
    if container is None:
        return None
    small_config = copy.deepcopy(config)
    small_config.num_hidden_layers = 2
    if layer_types is not None:
        small_config.layer_types = list(layer_types[:2])
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        with torch.device("meta"):
            small = type(model)(small_config).to(dtype).eval()
    except Exception:  # noqa: BLE001 - a model not constructible from its config: capture it whole
        return None
    if _layer_list(small, 2) != container:
        return None
    return small, layers, container


def mesh_costs(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None,
               tp_sizes: list[int], hardware: Hardware, *, time_limit_s: float = 60.0,
               progress: bool = False, decode_cache_len: int | None = None) -> MeshCosts:
    """Capture ``model`` at batch 2 and 4 (two layers of it when :func:`reduced_copy` applies) and
    price its blocks for each ``tp`` in ``tp_sizes``.

    ``decode_cache_len``: price one step of generation instead of the example's forward (the example
    is then not used): a token per row over a static KV cache of that many slots, captured as generation
    compiles it (:class:`~autotp.capture.kv_cache.CachedCausalLM`: the cache's writes, attention over
    every slot, the mask over the cache); each call hands out the picked tokens over the pipeline
    (``runtime/mesh/mesh_generate.py``), not the whole batch's output."""
    started = time.perf_counter()
    reduced = reduced_copy(model)
    target, count, container = (reduced if reduced is not None else (model, 0, ""))
    device = "meta" if reduced is not None else None
    captured = []
    for batch in _PROFILE_BATCHES:
        traced: torch.nn.Module = target
        if decode_cache_len is None:
            inputs = _at_batch(example_inputs, batch)
            kwargs = _at_batch(example_kwargs or {}, batch)
        else:
            traced = CachedCausalLM(target, batch_size=batch, max_cache_len=decode_cache_len)
            inputs, kwargs = traced.example_inputs(1), {}
        if device is not None:
            inputs, kwargs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (inputs, kwargs))
        what = "a decode step of " if decode_cache_len is not None else ""
        log_progress(progress, f"tracing {what}{type(model).__name__}{' (two layers)' if reduced else ''} at batch {batch}")
        captured.append(capture(traced, inputs, kwargs))
    units: dict[int, tuple[_Unit, ...]] = {}
    pre: dict[int, _Unit] = {}
    post: dict[int, _Unit] = {}
    summaries: dict[int, str] = {}
    names: tuple[str, ...] = ()
    for tp in tp_sizes:
        log_progress(progress, f"tensor-parallel plan over {tp} rank(s)")
        by_key, layers, summaries[tp] = _profile_units((captured[0], captured[1]), tp, hardware, time_limit_s)
        if reduced is not None:  # the first layer (reading the embeddings), then the second L - 1 times
            units[tp] = (by_key[layers[0]],) + (by_key[layers[1]],) * (count - 1)
            names = tuple(block_path(container, i) for i in range(count))
        elif layers:
            units[tp] = tuple(by_key[key] for key in layers)
            names = tuple(block_path(c, i) for c, i in layers)
        else:  # no repeated layers: the whole model is one block, on one stage
            units[tp], by_key["post"] = (by_key["post"],), by_key["pre"]
            names = ("",)
        pre[tp], post[tp] = by_key["pre"], by_key["post"]
    outputs = [_output_nbytes(cap) for cap in captured]
    return MeshCosts(hardware, names, units, pre, post, summaries, time.perf_counter() - started,
                     output_bytes=_Affine.through((outputs[0][0], outputs[1][0])), output_leaves=outputs[0][1],
                     generation_step=decode_cache_len is not None)


def _output_nbytes(cap: CapturedGraph) -> tuple[float, int]:
    """Bytes and count of the tensors the captured model returns (the logits of a causal LM)."""
    output = next(node for node in cap.graph_module.graph.nodes if node.op == "output")
    values = [leaf.meta.get("val") for leaf in pytree.tree_leaves(output.args) if isinstance(leaf, torch.fx.Node)]
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    return float(sum(value_nbytes(value) for value in tensors)), len(tensors)


# ----------------------------------------------------------------------------------- cuts

@dataclasses.dataclass(frozen=True)
class _Evaluation:
    mesh: MeshShape
    microbatches: int
    microbatch_size: int
    cuts: tuple[int, ...]  # first layer block of each stage, then the number of blocks
    stage_s: tuple[float, ...]
    stage_memory: tuple[float, ...]
    time_s: float  # one replica, all its microbatches
    collectives_s: float = 0.0  # of one microbatch through every stage: tensor-parallel collectives
    sends_s: float = 0.0  # ... and stage-to-stage sends (the rest of sum(stage_s) is compute)
    output_s: float = 0.0  # the whole batch's output handed to every rank, once per call
    busy_s: float = 0.0  # what the machine's busy scale adds to the pipeline (< 0: fewer busy ranks, faster)


def best_cuts(unit_s: np.ndarray, unit_memory: np.ndarray, unit_activation: np.ndarray, send_s: list[float],
              capacity: float, pre_s: float = 0.0, post_s: float = 0.0, pre_memory: float = 0.0,
              post_memory: float = 0.0) -> tuple[tuple[int, ...], float] | None:
    """Contiguous cuts of the units into ``len(send_s) + 1`` stages minimising the slowest stage.

    Stage ``k`` runs units ``[c_k, c_{k+1})`` and takes their time plus ``send_s[k]`` (sending to
    stage ``k+1``; the last stage sends nothing); the first stage also runs ``pre``, the last
    ``post``. Its memory: parameters plus twice its largest activation, at most ``capacity``.
    Exact dynamic programme over cut points, O(pp * L^2). Returns ``(cuts, slowest stage s)`` with
    ``cuts = (0, c_1, ..., L)``, or None when no cut fits memory.
    """
    units = len(unit_s)
    stages = len(send_s) + 1
    if stages > units:
        return None
    time_prefix = np.concatenate([[0.0], np.cumsum(unit_s)])
    memory_prefix = np.concatenate([[0.0], np.cumsum(unit_memory)])
    span_time = time_prefix[None, :] - time_prefix[:, None]  # [i, j]: units i..j-1
    span_memory = memory_prefix[None, :] - memory_prefix[:, None]
    largest = np.full((units + 1, units + 1), 0.0)
    for i in range(units):
        largest[i, i + 1:] = np.maximum.accumulate(unit_activation[i:])
    span_memory = span_memory + 2 * largest
    span_memory[0, :] += pre_memory
    span_memory[:, units] += post_memory
    span_time = span_time.copy()
    span_time[0, :] += pre_s
    span_time[:, units] += post_s
    index = np.arange(units + 1)
    valid = (index[:, None] < index[None, :]) & (span_memory <= capacity)
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    back = []
    for k in range(stages):
        cost = span_time + (send_s[k] if k < stages - 1 else 0.0)
        candidate = np.where(valid, np.maximum(best[:, None], cost), np.inf)
        choice = np.argmin(candidate, axis=0)
        best = candidate[choice, index]
        back.append(choice)
    if not np.isfinite(best[units]):
        return None
    cuts = [units]
    for k in range(stages - 1, -1, -1):
        cuts.append(int(back[k][cuts[-1]]))
    return tuple(reversed(cuts)), float(best[units])


def _mesh_groups(mesh: MeshShape, dim: str) -> list[list[int]]:
    """The ranks of each group along mesh dim ``dim``; ranks are laid out ``(dp, pp, tp)``, tp fastest."""
    stride = {"tp": 1, "pp": mesh.tp, "dp": mesh.tp * mesh.pp}[dim]
    size = getattr(mesh, dim)
    firsts = [rank for rank in range(mesh.world_size) if (rank // stride) % size == 0]
    return [[first + i * stride for i in range(size)] for first in firsts]


def _link_use(groups: list[list[int]], hardware: Hardware) -> tuple[bool, int]:
    """Whether a group spans nodes, and how many spanning groups at most have a member on one node: their
    traffic leaves that node at once, sharing its link (1 when none spans)."""
    d = hardware.devices_per_node
    spanning = [{rank // d for rank in group} for group in groups if len({rank // d for rank in group}) > 1]
    if not spanning:
        return False, 1
    return True, max(collections.Counter(node for nodes in spanning for node in nodes).values())


def _stage_sends(mesh: MeshShape, hardware: Hardware) -> list[tuple[bool, int]]:
    """For each cut between stages k and k+1: whether a send crosses nodes, and how many crossing sends at
    most leave one node at once (every tp rank of every replica sends to the same tp rank of the next stage)."""
    d = hardware.devices_per_node
    sends = []
    for k in range(mesh.pp - 1):
        pairs = [(src, src + mesh.tp) for dp in range(mesh.dp) for t in range(mesh.tp)
                 for src in [dp * mesh.pp * mesh.tp + k * mesh.tp + t]]
        crossing = collections.Counter(src // d for src, dst in pairs if src // d != dst // d)
        sends.append((bool(crossing), max(crossing.values(), default=1)))
    return sends


def _send_times(costs: MeshCosts, mesh: MeshShape, b: int) -> list[float]:
    """Seconds of each stage's send to the next at microbatch ``b``: the whole boundary from every tp rank
    (the runtime's ``PipelineStage`` sends each tp rank's full copy to its peer), the crossing sends that
    leave one node together sharing its link."""
    units = costs.units[mesh.tp]
    boundary = units[0].boundary_bytes(b) if units else 0.0
    return [p2p_time_s(boundary * sharing, costs.hardware, spans_nodes=spans)
            for spans, sharing in _stage_sends(mesh, costs.hardware)]




def _output_s(costs: MeshCosts, mesh: MeshShape, rows: int) -> float:
    """Seconds the mesh runtime takes to give every rank the whole batch's output after its replica's last
    stage has it (``MeshParallelModule._to_every_rank`` in ``runtime/mesh/mesh_module.py``): with ``dp > 1`` the
    replicas' sources (each last stage's first tp rank) all-gather the leaves' shapes (a row of int64s each) and
    each leaf, every replica's slice of ``rows`` rows (gloo: a ring), on the network where they span nodes; then
    each source hands the output (a header of int64s, then each leaf) to the rest of its replica (every rank with
    ``dp > 1``, the stages before the last without), all replicas at once, along a tree that crosses into each node
    once (:func:`~autotp.cost_model.collectives.host_tree_deliveries_s`)."""
    hardware, leaves = costs.hardware, costs.output_leaves
    if costs.generation_step:  # the last stage broadcasts each row's token; replicas gather once, at the end
        from_last_stage = [(group, group[-1]) for group in _mesh_groups(mesh, "pp")]
        return binomial_broadcasts_s(from_last_stage, 8.0 * rows, hardware) if mesh.pp > 1 else 0.0
    if not leaves:
        return 0.0
    per_leaf = costs.output_bytes(rows) / leaves
    per_replica = mesh.pp * mesh.tp
    firsts = [replica * per_replica for replica in range(mesh.dp)]  # ranks laid out (dp, pp, tp), tp fastest
    sources = [first + (mesh.pp - 1) * mesh.tp for first in firsts]
    seconds = 0.0
    if mesh.dp > 1:
        link = hardware.link(spans_nodes=_link_use([sources], hardware)[0])
        seconds += link_collective_time_s("all_gather", SHAPE_ROW_BYTES * leaves * mesh.dp, mesh.dp, link)
        seconds += leaves * link_collective_time_s("all_gather", per_leaf * mesh.dp, mesh.dp, link)
        per_leaf *= mesh.dp
    receiving = per_replica if mesh.dp > 1 else (mesh.pp - 1) * mesh.tp  # every rank, or the stages before the last
    groups = [([source, *(first + i for i in range(receiving) if first + i != source)], source)
              for first, source in zip(firsts, sources)]
    if len(groups[0][0]) > 1:
        seconds += host_tree_deliveries_s(groups, HAND_OUT_HEADER_BYTES, hardware)
        seconds += leaves * host_tree_deliveries_s(groups, per_leaf, hardware)
    return seconds


def _busy_ranks(mesh: MeshShape, hardware: Hardware, stages: range) -> int:
    """The most ranks of one machine (``Hardware.machine_ranks``) computing while ``stages`` of every replica run."""
    per_machine = hardware.machine_ranks()
    busy = collections.Counter((dp * mesh.pp * mesh.tp + k * mesh.tp + t) // per_machine
                               for dp in range(mesh.dp) for k in stages for t in range(mesh.tp))
    return max(busy.values())


def replica_time_s(compute_s: list[float], other_s: list[float], mesh: MeshShape, microbatches: int,
                   hardware: Hardware) -> float:
    """One replica's pipeline time for ``microbatches``: stage ``k`` takes ``compute_s[k]`` (at the rates of
    every rank busy) times the machine's :meth:`~autotp.cost_model.hardware.Hardware.busy_scale` for the ranks
    busy beside it, plus ``other_s[k]`` (collectives, sends). The first microbatch passes every stage while
    only the stages it has filled compute, then ``m - 1`` more leave at the pace of the slowest stage with
    ``min(m, pp)`` stages busy: ``sum_k s_k(filling) + (m - 1) * max_k s_k(full)``, which is
    :func:`~autotp.cost_model.pipeline_time_s` where the profile measured no busy scale."""
    pp, m = mesh.pp, microbatches
    width = min(m, pp)

    def stage_s(k: int, stages: range) -> float:
        return compute_s[k] * hardware.busy_scale(_busy_ranks(mesh, hardware, stages)) + other_s[k]

    filling = sum(stage_s(k, range(max(0, k - m + 1), k + 1)) for k in range(pp))
    if m == 1:
        return filling
    full = max(stage_s(k, range(start, start + width)) for k in range(pp)
               for start in [min(max(0, k - width + 1), pp - width)])
    return filling + (m - 1) * full


def _evaluate(costs: MeshCosts, mesh: MeshShape, microbatches: int, microbatch_size: int) -> _Evaluation | str:
    hardware = costs.hardware
    units = costs.units[mesh.tp]
    unit_s, pre_s, post_s = costs.times(mesh.tp, microbatch_size)
    unit_comm, pre_comm, post_comm = costs.comm_times(mesh.tp, microbatch_size)
    unit_memory = np.array([u.parameter_bytes for u in units], dtype=float)
    unit_activation = np.array([u.activation_bytes(microbatch_size) for u in units])
    send_s = _send_times(costs, mesh, microbatch_size)
    capacity = hardware.memory_gib * _GIB
    pre, post = costs.pre[mesh.tp], costs.post[mesh.tp]
    found = best_cuts(unit_s, unit_memory, unit_activation, send_s, capacity, pre_s, post_s,
                      pre.parameter_bytes + 2 * pre.activation_bytes(microbatch_size),
                      post.parameter_bytes + 2 * post.activation_bytes(microbatch_size))
    if found is None:
        return _no_fit(costs, mesh, microbatch_size, capacity)
    cuts, _ = found
    stage_s, stage_memory, stage_compute, stage_other = [], [], [], []
    for k in range(mesh.pp):
        first, stop = cuts[k], cuts[k + 1]
        send = send_s[k] if k < mesh.pp - 1 else 0.0
        ends = ([pre] if k == 0 else []) + ([post] if k == mesh.pp - 1 else [])
        seconds = float(unit_s[first:stop].sum()) + send + first_calls_s([*units[first:stop], *ends])
        comm = float(unit_comm[first:stop].sum())
        memory = float(unit_memory[first:stop].sum() + 2 * unit_activation[first:stop].max())
        if k == 0:
            seconds += pre_s
            comm += pre_comm
            memory += pre.parameter_bytes + 2 * pre.activation_bytes(microbatch_size)
        if k == mesh.pp - 1:
            seconds += post_s
            comm += post_comm
            memory += post.parameter_bytes + 2 * post.activation_bytes(microbatch_size)
        stage_s.append(seconds)
        stage_memory.append(memory)
        stage_compute.append(seconds - comm - send)
        stage_other.append(comm + send)
    collectives = (sum(u.comm_s(microbatch_size) for u in units) + pre.comm_s(microbatch_size)
                   + post.comm_s(microbatch_size))
    output = _output_s(costs, mesh, microbatches * microbatch_size)
    pipeline = replica_time_s(stage_compute, stage_other, mesh, microbatches, hardware)
    return _Evaluation(mesh, microbatches, microbatch_size, cuts, tuple(stage_s), tuple(stage_memory),
                       pipeline + output, collectives, sum(send_s), output,
                       pipeline - pipeline_time_s(stage_s, microbatches))


def first_calls_s(units: list[_Unit]) -> float:
    """Seconds a stage of ``units`` pays for the first call of each kernel it runs: a stage is a graph of its
    own, and each kernel's first call in a call of a graph costs ``Hardware.first_call_s``
    (:func:`autotp.passes.costing.kernel_call`), once per stage however many of its layers call it. Not
    part of the cut search (:func:`best_cuts`): every stage of layers alike calls the same kernels."""
    called: dict[str, float] = {}
    for unit in units:
        called.update(unit.kernels_called)
    return sum(called.values())


def _no_fit(costs: MeshCosts, mesh: MeshShape, b: int, capacity: float) -> str:
    units = costs.units[mesh.tp]
    total = (sum(u.parameter_bytes for u in units) + costs.pre[mesh.tp].parameter_bytes
             + costs.post[mesh.tp].parameter_bytes)
    return (f"does not fit: {total / mesh.pp / _GIB:.1f} GiB of parameters per device at best "
            f"(> {capacity / _GIB:.0f} GiB with activations)")


# ----------------------------------------------------------------------------------- search

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate(mesh: MeshShape, latency: _Evaluation | str, throughput: _Evaluation | str | None,
               batch: int, note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"mesh": mesh, "note": note}
    if isinstance(latency, _Evaluation):
        row.update(latency_s=latency.time_s, latency_memory_bytes=max(latency.stage_memory),
                   latency_cuts=latency.cuts, latency_stage_s=latency.stage_s, latency_parts=_parts(latency))
    elif not note:
        row["note"] = latency
    if isinstance(throughput, _Evaluation):
        row.update(throughput_per_s=batch / throughput.time_s, microbatches=throughput.microbatches,
                   microbatch_size=throughput.microbatch_size, memory_bytes_per_device=max(throughput.stage_memory),
                   throughput_cuts=throughput.cuts, throughput_stage_s=throughput.stage_s,
                   throughput_parts=_parts(throughput))
    elif isinstance(throughput, str) and not row["note"]:
        row["note"] = throughput
    return row


def search_mesh(costs: MeshCosts, world_size: int, *, objective: str = "latency",
                forced: Mapping[str, int] | None = None, batch: int = DEFAULT_THROUGHPUT_BATCH,
                schedule: str = "gpipe") -> ParallelPlan:
    """The best mesh, cuts and microbatches for ``objective`` among :func:`factorizations` (module doc)."""
    started = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}")
    hardware = costs.hardware
    layers = len(costs.names)
    forced = dict(forced or {})
    if "pp" in forced and forced["pp"] > max(layers, 1):
        raise ValueError(f"pp={forced['pp']} is more pipeline stages than the model's {layers} layer block(s); "
                         f"use pp <= {max(layers, 1)}")
    if "tp" in forced and check_tp_fits_nodes(forced["tp"], hardware) and world_size > hardware.devices_per_node:
        raise ValueError(check_tp_fits_nodes(forced["tp"], hardware))
    rows: list[dict[str, Any]] = []
    evaluated: list[tuple[dict[str, Any], _Evaluation]] = []
    for mesh in factorizations(world_size, forced):
        why = check_tp_fits_nodes(mesh.tp, hardware) if world_size > hardware.devices_per_node else ""
        if mesh.tp not in costs.units:
            why = why or f"tp={mesh.tp} was not priced"
        if not why and mesh.pp > max(layers, 1):
            why = f"pp={mesh.pp} > {layers} layer blocks"
        if why:
            rows.append(_candidate(mesh, why, None, batch, note=why))
            continue
        latency = _evaluate(costs, mesh, 1, 1)
        throughput: _Evaluation | str | None = None
        if batch % mesh.dp:
            throughput = f"batch {batch} does not split over dp={mesh.dp}"
        else:
            per_replica = batch // mesh.dp
            options = [e for m in _divisors(per_replica)
                       if isinstance(e := _evaluate(costs, mesh, m, per_replica // m), _Evaluation)]
            throughput = min(options, key=lambda e: e.time_s) if options else _evaluate(costs, mesh, 1, per_replica)
        row = _candidate(mesh, latency, throughput, batch)
        rows.append(row)
        chosen = latency if objective == "latency" else throughput
        if isinstance(chosen, _Evaluation):
            evaluated.append((row, chosen))
    if not evaluated:
        why = next((f"{r['mesh']}: {r['note']}" for r in rows if "does not fit" in r["note"]),
                   "; ".join(f"{r['mesh']}: {r['note']}" for r in rows[:3]) or "no factorization matches")
        raise PlanError(f"no mesh of {world_size} {hardware.name} devices fits the model for objective {objective!r} "
                        f"(e.g. {why}); use more devices, a profile with more memory, or a smaller model/batch")

    def rank_key(item: tuple[dict[str, Any], _Evaluation]) -> tuple:
        row, evaluation = item
        primary = row["latency_s"] if objective == "latency" else -row["throughput_per_s"]
        secondary = -row.get("throughput_per_s", 0.0) if objective == "latency" else row.get("latency_s", math.inf)
        return (round(primary, 15), round(secondary, 15), evaluation.mesh.pp, evaluation.mesh.tp)

    evaluated.sort(key=rank_key)
    best_row, best = evaluated[0]
    best_row["chosen"] = True
    if len(evaluated) > 1:
        evaluated[1][0]["runner_up"] = True
        evaluated[1][0]["why_lost"] = _why_lost(evaluated[1][0], best_row, objective)
    blockless = costs.names == ("",)  # the whole model as one block: the runtime sees no layer blocks
    stages = tuple(
        StagePlan(first_block=best.cuts[k], stop_block=0 if blockless else best.cuts[k + 1],
                  begins_at="" if k == 0 else costs.names[best.cuts[k]],
                  predicted_s=best.stage_s[k], memory_bytes_per_device=int(best.stage_memory[k]))
        for k in range(best.mesh.pp)
    )
    predicted = {
        "latency_s": best_row["latency_s"],
        "throughput_per_s": best_row.get("throughput_per_s", 0.0),
        "throughput_batch": float(batch),
        "memory_bytes_per_device": float(max(best.stage_memory)),
        "microbatch_size": float(best.microbatch_size),
        "search_s": time.perf_counter() - started + costs.profile_s,
    }
    return ParallelPlan(mesh=best.mesh, stages=stages, microbatches=best.microbatches, schedule=schedule,
                        objective=objective, hardware=hardware.name, predicted=predicted, candidates=tuple(rows),
                        layer_blocks=() if blockless else costs.names, tp_summary=costs.tp_summaries.get(best.mesh.tp, ""))


def _parts(evaluation: _Evaluation) -> dict[str, float]:
    """The replica's time split by kind: ``m / pp`` of one microbatch's compute, collectives and sends
    through all stages (the work of one device, were the stages equal; the compute at the busy ranks'
    share of the cores), the output handed to every rank, and the rest: pipeline bubble and stage
    imbalance. With ``m = 1`` and ``pp = 1``, exactly the latency's terms."""
    m, pp = evaluation.microbatches, evaluation.mesh.pp
    through = sum(evaluation.stage_s)
    compute = through - evaluation.collectives_s - evaluation.sends_s
    share = m / pp if m > 1 else 1.0  # one microbatch: every stage's time is on the request's path
    parts = {"compute": max(0.0, share * compute + evaluation.busy_s),  # at the busy ranks' share of the cores
             "tensor-parallel collectives": share * evaluation.collectives_s,
             "stage sends": share * evaluation.sends_s, "output to every rank": evaluation.output_s}
    parts["pipeline bubble and imbalance"] = max(0.0, evaluation.time_s - sum(parts.values()))
    return parts


def _why_lost(runner: dict[str, Any], best: dict[str, Any], objective: str) -> str:
    """The runner-up's figure against the winner's, and the term of the time that differs most."""
    if objective == "latency":
        a, b = runner["latency_s"], best["latency_s"]
        what = f"latency {a * 1e3:.3f} ms vs {b * 1e3:.3f} ms (+{(a / b - 1) * 100:.1f}%)"
        parts_a, parts_b = runner["latency_parts"], best["latency_parts"]
        where = "per request"
    else:
        a, b = runner["throughput_per_s"], best["throughput_per_s"]
        what = f"throughput {a:.2f}/s vs {b:.2f}/s ({(a / b - 1) * 100:.1f}%)"
        parts_a, parts_b = runner["throughput_parts"], best["throughput_parts"]
        where = f"of the time for the batch ({runner['mesh'].dp} vs {best['mesh'].dp} replica(s))"
    term = max(parts_a, key=lambda k: abs(parts_a[k] - parts_b.get(k, 0.0)))
    return (f"{what}; the term that differs most: {term} {parts_a[term] * 1e3:.3f} ms vs "
            f"{parts_b.get(term, 0.0) * 1e3:.3f} ms {where}")


def plan_mesh(model: torch.nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None, *,
              world_size: int, hardware: str | Hardware, parallelism: str | Mapping[str, int] = "auto",
              mesh: MeshShape | None = None, objective: str = "latency",
              throughput_batch: int = DEFAULT_THROUGHPUT_BATCH, time_limit_s: float = 60.0,
              progress: bool = False) -> ParallelPlan:
    """``autotp.plan(..., parallelism="auto" | {...}, mesh=...)``: validate, price each ``tp``, search.

    Every argument is checked before anything is traced (ValueError saying what to pass).
    """
    hw = get_hardware(hardware)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}")
    if isinstance(throughput_batch, bool) or not isinstance(throughput_batch, int) or throughput_batch < 1:
        raise ValueError(f"throughput_batch must be a positive int (requests per batch), got {throughput_batch!r}")
    forced = forced_dims(parallelism, mesh, world_size)
    multi_node = world_size > hw.devices_per_node
    if "tp" in forced and multi_node and check_tp_fits_nodes(forced["tp"], hw):
        raise ValueError(check_tp_fits_nodes(forced["tp"], hw))
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if "pp" in forced and isinstance(layers, int) and forced["pp"] > layers:
        raise ValueError(f"pp={forced['pp']} is more pipeline stages than the model's {layers} layers; "
                         f"use pp <= {layers}")
    meshes = factorizations(world_size, forced)
    tp_sizes = sorted({m.tp for m in meshes if not (multi_node and check_tp_fits_nodes(m.tp, hw))})
    if not tp_sizes:
        raise ValueError(f"no dp x pp x tp of {world_size} matches parallelism={dict(forced)!r} with tensor-parallel "
                         f"groups on whole nodes of {hw.devices_per_node}; force other dims")
    costs = mesh_costs(model, example_inputs, example_kwargs, tp_sizes, hw, time_limit_s=time_limit_s,
                       progress=progress)
    return search_mesh(costs, world_size, objective=objective, forced=forced, batch=throughput_batch)
