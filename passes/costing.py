"""Cost pass: per-rank time and memory of every strategy, and the price of every resharding.

Input: a :class:`StrategyGraph` and a hardware profile. Output: a :class:`CostedGraph`
(plain data; nothing in the FX graph changes). All formulas live in ``autotp.cost_model``;
this pass only decides *what* each strategy asks of the hardware:

- compute: the op's FLOPs (``aten_flops``) and the bytes it reads and writes on one rank. The
  FLOPs are the largest rank's share of the work when the strategy splits a tensor (the
  output, or a contracted input whose output is a Partial sum); with only Replicate and
  Partial placements every rank does the whole op. The bytes are counted tensor by tensor at
  their local size: a split tensor is read (or written) in part, a replicated or Partial one
  whole (a row-parallel GEMM writes a full-size Partial output; a token-split GEMM still
  reads the whole weight). A GEMM's rate depends on its local shape (the smallest of its local
  m, n, k: ``cost_model.compute.gemm_efficiency``); a transcendental elementwise op (exp, silu,
  ...) is priced per local output element, a pooling op per element of its local windows, where that
  bounds it (``cost_model.compute.rated_elements``). View-like ops move no data and
  launch no kernel: they cost only the host's dispatch in eager mode
  (``cost_model.runtime.view_time_s``: ``Hardware.view_op_s``, 0 on GPU profiles).
- resharding between the producer's and the consumer's placement of one tensor: the cheapest
  route of :func:`autotp.base.reshard.reshard_routes`, each step priced by its row of
  :data:`autotp.passes.resharding.RESHARD_TABLE`: its collective by ``collective_time_s``, every local node the
  rewrite emits around it (views, layout copies, an uneven split's padding) as a node of the graph.
- the first call of each kernel in the graph (in graph order; a view never) pays ``Hardware.first_call_s`` once:
  a call of the graph finds every kernel's code and state cold.
- collectives an op's rank-local form issues itself (a vocabulary-parallel cross-entropy's two
  all-gather of two values per row, :func:`op_collectives_s`) are part of its strategy's time, and so are the
  other ops it runs besides the op (a vocabulary-split embedding's masking, :func:`local_form_kernels_s`), each
  priced as a kernel node. They pay no first call: measured node by node (tied-embedding LM, tp 4, 2-core VM),
  the masking's six small integer ops took 89 us more after a common start than back to back, where the
  profile's first call of a kernel (45-160 us each) would have priced 270-960 us.
- memory: the bytes of each parameter's local shard (the largest one, for uneven splits).
- training (``training=`` a :class:`~autotp.passes.backward.Training`): each strategy's compute
  adds its backward (:func:`~autotp.passes.backward.backward_flops_factor` times the forward, at
  the same per-rank share), a trainable parameter's bytes count its gradient and optimizer state
  too, and :meth:`CostedGraph.activation_bytes` sizes what autograd keeps; the backward's
  reshardings are priced in ``passes/pricing.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.adapters.torch_internals import OpOverload
from autotp.base.placements import Placement, share_of
from autotp.base.reshard import Route, reshard_routes
from autotp.base.shapes import concrete_shape, concrete_size, first_tensor, nbytes, numel
from autotp.base.strategy import Strategy
from autotp.cost_model import (
    Hardware,
    aten_flops,
    collective_time_s,
    compute_time_s,
    group_spans_nodes,
    launches_no_kernel,
)
from autotp.cost_model.bandwidth import graph_profile, graph_working_set_bytes
from autotp.cost_model.compute import (
    first_call_key,
    fixed_costs,
    gemm_dims,
    has_element_rate,
    is_lookup,
    makes_host_calls,
    op_family,
    op_name,
    rated_elements,
)
from autotp.cost_model.runtime import view_time_s
from autotp.passes.backward import (
    REPLICATED_INPUT_BACKWARD,
    Training,
    adjoint_steps,
    backward_flops_factor,
    trainable_bytes_factor,
)
from autotp.passes.node_keys import once_per_key
from autotp.passes.resharding import layout_node_s, tensor_route_time_s
from autotp.passes.rules import local_form_kernels_for, local_work_for, op_collectives_for, tensor_inputs
from autotp.passes.rules.args import holds_tensor
from autotp.passes.state import WRITES_IN_PLACE
from autotp.passes.strategies import StrategyGraph
from autotp.passes.uneven import largest_shard_nbytes

aten = torch.ops.aten

__all__ = ["CostedGraph", "cost_strategy_graph", "forward_compute_s", "kernel_call", "node_dtype", "node_fixed_costs",
           "node_shape_terms", "node_work", "op_collectives_s", "reshard_route", "reshard_time_s", "route_time_s",
           "tensor_nbytes"]

def tensor_nbytes(value: object) -> int:
    """Bytes of a tensor (or of all tensors in a tuple/list of them)."""
    return nbytes(value)


def _dtype(value: object) -> torch.dtype:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return leaves[0].dtype if leaves else torch.float32


def route_time_s(route: Route, value: object, world_size: int, hardware: Hardware) -> float:
    """Predicted seconds of the resharding ``route`` of ``value`` (a FakeTensor, or a tuple of them): per tensor,
    :func:`autotp.passes.resharding.tensor_route_time_s` of its shape, the price of every node the rewrite emits."""
    return sum((tensor_route_time_s(route, leaf.shape, leaf.dtype, world_size, hardware)
                for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)), 0.0)


def reshard_route(src: Placement, dst: Placement, value: object, world_size: int, hardware: Hardware) -> Route:
    """The cheapest route from ``src`` to ``dst`` for ``value`` (the default one on a tie)."""
    routes = reshard_routes(src, dst)
    if len(routes) == 1:
        return routes[0]
    return min(routes, key=lambda route: route_time_s(route, value, world_size, hardware))


def reshard_time_s(src: Placement, dst: Placement, value: object, world_size: int, hardware: Hardware) -> float:
    """Predicted seconds to reshard ``value`` (a FakeTensor) from ``src`` to ``dst`` by the cheapest route."""
    return route_time_s(reshard_route(src, dst, value, world_size, hardware), value, world_size, hardware)


@dataclasses.dataclass
class CostedGraph:
    """The strategy graph with per-strategy compute time and parameter memory.

    With ``training`` (a training step is priced), ``compute_s`` is forward plus backward and
    ``memory_bytes`` counts each trainable parameter's gradient and optimizer state too.
    """

    graph: StrategyGraph
    hardware: Hardware
    compute_s: dict[str, list[float]]  # node -> per-strategy predicted seconds per rank
    memory_bytes: dict[str, list[int]]  # parameter node -> per-strategy bytes of the largest local shard
    training: Training | None = None
    _routes: dict[tuple, tuple[Route, float]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                  compare=False)
    """(shapes and dtypes, src, dst) -> the cheapest route and its seconds: the solver and the reports price
    the same resharding of the same tensor shape once (every layer repeats them), not once per ask."""
    _value_keys: dict[str, tuple] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """producer -> the shapes and dtypes of its output, as :attr:`_routes` keys them."""

    def backward_route(self, producer: str, src: Placement, dst: Placement) -> Route:
        """The steps the gradient of ``producer``'s output takes back through its ``src -> dst`` resharding."""
        return adjoint_steps(self.reshard_route(producer, src, dst))

    def backward_s(self, producer: str, src: Placement, dst: Placement) -> float:
        """Seconds of :meth:`backward_route` (0 for an identity adjoint)."""
        node = self.graph.nodes[producer]
        route = self.backward_route(producer, src, dst)
        return route_time_s(route, node.meta.get("val"), self.graph.world_size, self.hardware) if route else 0.0

    def replicated_input_s(self, producer: str) -> float:
        """Seconds of Megatron's f on ``producer``'s value: the all-reduce of its whole gradient."""
        return route_time_s(REPLICATED_INPUT_BACKWARD, self.graph.nodes[producer].meta.get("val"), self.graph.world_size,
                            self.hardware)

    def activation_bytes(self, producer: str, placement: Placement) -> float:
        """Bytes one rank keeps of ``producer``'s output, saved for the backward in ``placement``."""
        return _local_nbytes(self.graph.nodes[producer].meta.get("val"), placement, self.graph.world_size)

    def reshard_s(self, producer: str, src: Placement, dst: Placement) -> float:
        return self._priced_route(producer, src, dst)[1]

    def reshard_route(self, producer: str, src: Placement, dst: Placement) -> Route:
        """The route :meth:`reshard_s` prices: the steps the plan records and the rewrite applies."""
        return self._priced_route(producer, src, dst)[0]

    def _priced_route(self, producer: str, src: Placement, dst: Placement) -> tuple[Route, float]:
        """:func:`reshard_route` and its :func:`route_time_s`, found once per tensor shapes (symbolic sizes as
        written, with their example values), dtypes and placements: all the price depends on besides the graph's
        world size and hardware."""
        value = self.graph.nodes[producer].meta.get("val")
        if producer not in self._value_keys:  # str: a symbolic size as its expression
            self._value_keys[producer] = tuple((str(v.shape), concrete_shape(v), v.dtype)
                                               for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))
        key = (self._value_keys[producer], src, dst)
        if key not in self._routes:
            route = reshard_route(src, dst, value, self.graph.world_size, self.hardware)
            self._routes[key] = (route, route_time_s(route, value, self.graph.world_size, self.hardware))
        return self._routes[key]


def _meta_args(node: fx.Node) -> tuple[tuple, dict]:
    def to_val(a: object) -> object:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    return pytree.tree_map(to_val, node.args), pytree.tree_map(to_val, node.kwargs)


def _local_fraction(value: object, placement: Placement, world_size: int) -> float:
    """Share of ``value`` the largest rank holds under ``placement`` (1.0 unless it is split)."""
    if not isinstance(value, torch.Tensor) or numel(value) == 0:
        return 1.0
    return largest_shard_nbytes(value.shape, value.element_size(), placement, world_size) / (numel(value) * value.element_size())


def _local_nbytes(value: object, placement: Placement, world_size: int) -> float:
    """Bytes of ``value`` (a tensor, or a tuple of them sharing one placement) on the largest rank."""
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return sum(_local_fraction(v, placement, world_size) * numel(v) * v.element_size() for v in leaves)


def _work_fraction(strategy: Strategy, out: object, inputs: list[object], world_size: int) -> float:
    """Share of the op's FLOPs the largest rank does under ``strategy``.

    All split tensors of one strategy are cut at the same fractions (``passes/uneven.py``),
    so the largest rank's share is at least the coarsest of their splits: e.g. 8 query heads
    with 4 kv heads over 8 ranks leave half the ranks without a kv head, and the busiest rank
    does 1/4 of the attention, not 1/8. A Partial output computed from split inputs is a split
    contraction. With only Replicate and Partial placements every rank does it all.
    """
    out_leaf = next((v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)), None)
    shares = [_local_fraction(out_leaf, strategy.output, world_size)] if share_of(strategy.output) else []
    shares += [_local_fraction(value, placement, world_size)
               for placement, value in zip(strategy.inputs, inputs) if share_of(placement) is not None]
    return max(shares, default=1.0)


def node_work(node: fx.Node, strategies: list[Strategy], world_size: int,
              shares: tuple[float, ...] | None = None) -> list[tuple[float, float]] | None:
    """Per strategy, ``(FLOPs, bytes moved)`` of the largest rank running ``node``; None for a node
    priced without work (size arithmetic: free; a view: ``Hardware.view_op_s``). ``shares``: the measured
    fraction of the node's rows per expert, for a grouped GEMM routed by a measured router (None: uniform;
    :attr:`~autotp.passes.strategies.StrategyGraph.expert_shares`).

    What :func:`cost_strategy_graph` feeds the roofline (``compute_time_s(flops, bytes, dtype, hw)``);
    the mesh search (:mod:`autotp.planning.mesh_search`) reads it at two batch sizes to price any other.
    """
    if node.op != "call_function" or not holds_tensor(node) or launches_no_kernel(node.target):
        return None
    args, kwargs = _meta_args(node)
    out = node.meta.get("val")
    try:
        flops = aten_flops(node.target, args, kwargs, out)
    except Exception:  # noqa: BLE001 - an op the FLOP counter cannot size costs by bytes only
        flops = 0
    inputs = [producer.meta.get("val") for producer in tensor_inputs(node)]  # one per input slot
    work = []
    lookup = is_lookup(node.target)  # reads only the rows it returns from its table
    in_place = bool(node.meta.get(WRITES_IN_PLACE)) and len(inputs) >= 2  # a state update: (buffer, [indices], source)
    for strategy in strategies:
        written = _local_nbytes(out, strategy.output, world_size)
        read = [_local_nbytes(value, placement, world_size) for placement, value in zip(strategy.inputs, inputs)]
        if lookup and read:
            read[0] = min(read[0], written)
        if in_place:  # the runtime writes the source's rows into the buffer where it lies (passes/state.py)
            written, read[0] = read[-1], 0
        moved = written + sum(read)
        work.append((flops * _work_fraction(strategy, out, inputs, world_size), moved))
    busiest = local_work_for(node.target)
    if busiest is not None:  # an op whose busiest rank's load is not its split share (experts by the router)
        found = [busiest(node, strategy, world_size, generic, shares) for strategy, generic in zip(strategies, work)]
        work = [(w.flops, w.nbytes) if w is not None else generic for w, generic in zip(found, work)]
    return work


def node_dtype(node: fx.Node) -> torch.dtype:
    """The dtype the roofline prices ``node`` at (its output's; float32 when it has no tensor)."""
    return _dtype(node.meta.get("val"))


def _node_compute_s(node: fx.Node, strategies: list[Strategy], world_size: int, hardware: Hardware,
                    training: Training | None = None, shares: tuple[float, ...] | None = None) -> list[float]:
    """Per-strategy seconds of ``node``: its forward, and with ``training`` its backward too."""
    grads = training.requires_grad if training is not None else frozenset()
    work = node_work(node, strategies, world_size, shares)
    if work is None:
        if node.op == "call_function" and holds_tensor(node) and launches_no_kernel(node.target):
            steps = 2 if node.name in grads else 1  # the backward of a view is a view
            # no kernel, no bytes: only the host's dispatch in eager mode (0 on GPU profiles)
            return [steps * view_time_s(hardware)] * len(strategies)
        return [0.0] * len(strategies)  # size arithmetic runs on the host: free
    dtype, name = node_dtype(node), op_name(node.target)
    priced = bool(hardware.op_fixed_s) or makes_host_calls(node.target)  # else every fixed cost prices at 0
    fixed = node_fixed_costs(node, strategies, world_size) if priced else [()] * len(strategies)
    costs = []
    for index, (strategy, (flops, moved), (min_dim, elements)) in enumerate(
            zip(strategies, work, _shape_terms(node, strategies, world_size, work))):
        passes = 1.0 + (backward_flops_factor(node, grads, flops) if training is not None else 0.0)
        costs.append(passes * compute_time_s(flops, moved, dtype, hardware, gemm_min_dim=min_dim,
                                             rated_elements=elements, rated_op=name,
                                             fixed=fixed[index])
                     + op_collectives_s(node, strategy, world_size, hardware)
                     + local_form_kernels_s(node, strategy, world_size, hardware))
    return costs


def kernel_call(node: fx.Node, hardware: Hardware) -> tuple[str, float] | None:
    """The kernel ``node`` launches, as :func:`~autotp.cost_model.compute.first_call_key` counts it, and what its
    first call in a call of a graph costs (``Hardware.first_call_s``, paid once per kernel per graph call);
    None for views and other nodes that launch no kernel."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return None
    if launches_no_kernel(node.target) or not holds_tensor(node):
        return None
    return first_call_key(node.target), hardware.first_call_cost_s(op_family(node.target))


def _first_call_of_its_kernel(node: fx.Node, hardware: Hardware, called: set[str]) -> float:
    """Seconds ``node`` (visited in graph order) pays as the first call of its kernel in the graph
    (:func:`kernel_call`), 0.0 when it is not; adds its kernel to ``called``."""
    call = kernel_call(node, hardware)
    if call is None or call[0] in called:
        return 0.0
    called.add(call[0])
    return call[1]


def forward_compute_s(node: fx.Node, strategy: Strategy, world_size: int, hardware: Hardware,
                      shares: tuple[float, ...] | None = None) -> float:
    """Seconds per rank of ``node``'s forward alone under ``strategy`` (a recomputation's price; ``shares`` as
    :func:`node_work` takes them)."""
    return _node_compute_s(node, [strategy], world_size, hardware, None, shares)[0]


def op_collectives_s(node: fx.Node, strategy: Strategy, world_size: int, hardware: Hardware) -> float:
    """Seconds of the collectives ``node``'s rank-local form issues itself under ``strategy``
    (:func:`autotp.passes.rules.op_collectives_for`: e.g. a vocabulary-parallel cross-entropy's
    all-gather of two values per row); 0 for ops whose communication is all resharding."""
    collectives = op_collectives_for(node.target)
    if collectives is None or world_size == 1:
        return 0.0
    spans = group_spans_nodes(world_size, hardware.devices_per_node)
    return sum(collective_time_s(kind, nbytes, world_size, hardware, spans_nodes=spans)
               for kind, nbytes in collectives(node, strategy, world_size))


def local_form_kernels_s(node: fx.Node, strategy: Strategy, world_size: int, hardware: Hardware) -> float:
    """Seconds of the ops ``node``'s rank-local form runs besides the op itself under ``strategy``
    (:func:`autotp.passes.rules.local_form_kernels_for`: e.g. a vocabulary-split embedding's masking), each a kernel
    node moving its bytes (a view: a view's dispatch); 0 for an op whose rank-local form is the op alone."""
    kernels = local_form_kernels_for(node.target)
    if kernels is None:
        return 0.0
    dtype = node_dtype(node)
    return sum(layout_node_s(op, nbytes, dtype, hardware) for op, nbytes in kernels(node, strategy, world_size))


def node_fixed_costs(node: fx.Node, strategies: list[Strategy], world_size: int
                     ) -> list[tuple[tuple[str, int], ...]]:
    """Per strategy, the fixed costs ``node`` pays on the largest rank (:func:`~autotp.cost_model.compute.fixed_costs`
    of its local shapes: attention per block of its local queries and once per call, a convolution only where
    PyTorch runs it through oneDNN; a Python-level loop's host calls per group of its local rows; none for any
    other op, whose local shapes are not worked out); the mesh search reads them at two batch sizes."""
    if op_family(node.target) is None and not makes_host_calls(node.target):
        return [()] * len(strategies)
    args, kwargs = _meta_args(node)
    inputs = [producer.meta.get("val") for producer in tensor_inputs(node)]
    dtype = node_dtype(node)
    return [fixed_costs(node.target, _local_args(args, strategy, inputs, world_size), kwargs, dtype)
            for strategy in strategies]


def _shape_terms(node: fx.Node, strategies: list[Strategy], world_size: int,
                 work: list[tuple[float, float]]) -> list[tuple[int | None, int]]:
    """Per strategy, the smallest local dim of a GEMM node (None for other ops) and the local
    elements its arithmetic runs over (:func:`~autotp.cost_model.compute.rated_elements`; 0 for most ops)."""
    return [(min(dims) if dims is not None else None, elements)
            for dims, elements in node_shape_terms(node, strategies, world_size, work)]


def node_shape_terms(node: fx.Node, strategies: list[Strategy], world_size: int,
                     work: list[tuple[float, float]]) -> list[tuple[tuple[int, ...] | None, int]]:
    """Per strategy, a GEMM node's local ``(m, n, k)`` (None for other ops) and the local elements its
    arithmetic runs over (a transcendental op's output, a pooling op's windows; 0 for other ops): what
    ``compute_time_s`` takes besides FLOPs and bytes (``work`` is :func:`node_work`'s). The mesh search reads
    them at two batch sizes, as it reads :func:`node_work`."""
    args, kwargs = _meta_args(node)
    gemm = any(flops > 0 for flops, _ in work) and gemm_dims(node.target, args, kwargs) is not None
    rated = has_element_rate(node.target)
    if not gemm and not rated:
        return [(None, 0)] * len(strategies)
    out = node.meta.get("val")
    inputs = [producer.meta.get("val") for producer in tensor_inputs(node)]

    def elements(strategy: Strategy) -> int:
        first_in = _local_numel(inputs[0], strategy.inputs[0], world_size) if inputs and strategy.inputs else None
        return rated_elements(node.target, args, kwargs, _local_numel(out, strategy.output, world_size), first_in)

    return [(_local_gemm_dims(node, args, kwargs, strategy, inputs, world_size) if gemm else None,
             elements(strategy) if rated else 0)
            for strategy in strategies]


def _local_shape(value: torch.Tensor, placement: Placement, world_size: int) -> tuple[int, ...]:
    """Shape of ``value`` on the largest rank under ``placement`` (a split dim: ``ceil(size / N)``)."""
    shape = [int(size) for size in concrete_shape(value)]
    split = share_of(placement)
    if split is not None and shape:
        dim, blocks = split
        shape[dim] = blocks * math.ceil(shape[dim] // blocks / world_size)
    return tuple(shape)


def _local_numel(value: object, placement: Placement, world_size: int) -> int:
    leaf = first_tensor(value)
    return math.prod(_local_shape(leaf, placement, world_size)) if leaf is not None else 0


def _local_args(args: tuple, strategy: Strategy, inputs: list[object], world_size: int) -> Any:
    """``args`` with each tensor input replaced by its shape on the largest rank under ``strategy``."""
    local = {id(value): _local_shape(value, placement, world_size)
             for placement, value in zip(strategy.inputs, inputs) if isinstance(value, torch.Tensor)}
    return pytree.tree_map(lambda a: local.get(id(a), a) if isinstance(a, torch.Tensor) else a, args)


def _local_gemm_dims(node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, inputs: list[object],
                     world_size: int) -> tuple[int, ...] | None:
    """A GEMM node's (m, n, k) on the largest rank under ``strategy``."""
    busiest = local_work_for(node.target)
    work = busiest(node, strategy, world_size, (0.0, 0.0), None) if busiest is not None else None  # dims: no load
    if work is not None and work.gemm_dims is not None:
        return work.gemm_dims
    dims = gemm_dims(node.target, _local_args(args, strategy, inputs, world_size), kwargs)
    return tuple(concrete_size(d) for d in dims) if dims is not None else None


def _compute_key(node: fx.Node, key: Hashable | None, strategies: list[Strategy],
                 training: Training | None, shares: tuple[float, ...] | None = None) -> Hashable | None:
    """What :func:`_node_compute_s` reads of ``node`` besides the graph-wide world size and hardware: its
    :func:`~autotp.passes.node_keys.node_key` ``key``, its strategies, its measured router ``shares`` and, when
    training, which of it and its inputs take gradients (None: no key, price it directly)."""
    if key is None:
        return None
    grads = training.requires_grad if training is not None else frozenset()
    return (key, tuple(strategies), node.name in grads, tuple(p.name in grads for p in tensor_inputs(node)), shares)


def cost_strategy_graph(graph: StrategyGraph, hardware: Hardware, training: Training | None = None) -> CostedGraph:
    """Attach predicted compute seconds to every strategy and bytes to every parameter strategy.

    ``training``: price a training step (forward + backward, gradients and optimizer state).
    ``hardware`` is first resolved for this graph (:func:`autotp.cost_model.bandwidth.graph_profile`:
    the memory bandwidth at the graph's working set, the all-reduce the runtime runs); the
    :class:`CostedGraph` carries the resolved profile, so every later price of it agrees.
    """
    hardware = graph_profile(hardware, graph_working_set_bytes(graph.graph_module.graph), training=training is not None)
    compute_s = {}
    memory = {}
    priced: dict[Hashable, list[float]] = {}  # _compute_key -> seconds per strategy: each layer's copy priced once
    called: set[str] = set()  # first_call_key of every kernel node so far, in graph order
    for name in graph.order:
        node = graph.nodes[name]
        shares = graph.expert_shares.get(name)
        key = _compute_key(node, graph.structural_keys[name], graph.strategies[name], training, shares)
        compute_s[name] = once_per_key(priced, key, functools.partial(
            _node_compute_s, node, graph.strategies[name], graph.world_size, hardware, training, shares))
        first = _first_call_of_its_kernel(node, hardware, called) if hardware.first_call_s else 0.0
        if first:  # a new list: priced may share the old
            compute_s[name] = [seconds + first for seconds in compute_s[name]]
        if name in graph.parameters:
            val = node.meta["val"]
            # a parameter nothing reads (e.g. the second name of a tied weight) is not kept
            unread = not node.users
            factor = (trainable_bytes_factor(val, training.optimizer_states)
                      if training is not None and name in training.requires_grad else 1.0)
            memory[name] = [0 if unread else int(factor * largest_shard_nbytes(val.shape, val.element_size(), s.output,
                                                                                graph.world_size))
                            for s in graph.strategies[name]]
    return CostedGraph(graph, hardware, compute_s, memory, training)
