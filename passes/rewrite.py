"""Rewrite: captured graph + chosen strategies -> the rank-local GraphModule of one rank.

Input: the captured ATen graph (unchanged), the chosen strategy of every node, the
partitions of split dims, and this rank's index. Output: a new ``fx.GraphModule`` that
takes this rank's *local* parameter shards in the parameters' placeholder slots and returns
replicated outputs. The input graph is not modified.

What changes, node by node:

- shape arguments of reshapes (``view``/``reshape``/``expand``/``unflatten``) get this rank's
  local size in the split dim (uneven splits give each rank its own constant); every other
  entry stays as traced, so a dynamic batch or sequence size stays a symbolic expression
  (a ``sym_size`` node) and one rank-local graph serves every input size; on a rank whose part
  of the split is empty (fewer heads than ranks), a ``-1`` entry is spelled out, since a tensor of
  0 elements gives no count to infer it from;
- ops whose local form differs from the global one get it (registered beside the op's rule,
  :func:`autotp.passes.rules.local_form_for`): a vocabulary-split ``embedding`` looks up only
  the ids in this rank's row range (others give zeros: the output is a Partial sum); a grouped
  convolution split by groups gets this rank's group count;
- wherever a producer's placement differs from what a consumer's strategy needs, the
  resharding steps of :func:`autotp.base.reshard.reshard_steps` are inserted once per
  (producer, target placement), each by its row of :data:`autotp.passes.resharding.RESHARD_TABLE`:
  traceable functional collectives (``torch.ops._c10d_functional.*`` followed by
  ``wait_tensor``) or local slices.

Every rank inserts the same collectives in the same (topological) order, so no rank can wait
on a collective another rank does not issue.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.adapters.torch_internals import LazyGraphModule
from autotp.base.errors import PlanMismatchError
from autotp.base.placements import BlockShard, Placement, Replicate, split_of
from autotp.base.reshard import ReshardKind, reshard_steps, route_with_kinds
from autotp.base.shapes import concrete_shape, concrete_size, first_tensor, is_static
from autotp.base.strategy import Strategy
from autotp.passes.adjoints import REPLICATED_INPUT_ADJOINT, EagerSteps, ReshardNode, adjoint_route
from autotp.passes.random_streams import RankStreams, rank_seed, rank_stream_target
from autotp.passes.resharding import RESHARD_TABLE
from autotp.passes.rules import local_form_for
from autotp.passes.rules.args import holds_tensor
from autotp.passes.small_collectives import inference_collective_kind, one_shot_all_reduce
from autotp.passes.uneven import Partitions

# a GraphModule that generates its Python code when first called or read, not at every recompile() (a torch
# without it: every recompile() generates the code at once, as a GraphModule does)
_CodeOnFirstCall = LazyGraphModule

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["COLLECTIVE_OPS", "count_collectives", "generate_code", "is_collective", "rewrite_for_rank"]

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast.default: "broadcast",
    one_shot_all_reduce: "all_reduce",  # a small gloo all-reduce in one exchange (autotp.passes.small_collectives)
}

_SHAPE_ARG_OPS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1}

_KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr")


class _Builder:
    """Emits nodes into the new graph for one rank."""

    def __init__(self, graph: fx.Graph, parts: Partitions, rank: int, group_name: str, *, training: bool = False) -> None:
        self.graph = graph
        self.parts = parts
        self.rank = rank
        self.world_size = parts.world_size
        self.group_name = group_name
        self.eager = EagerSteps(parts, rank, group_name) if training else None

    def call(self, target: object, *args: object, meta_from: fx.Node | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        if meta_from is not None:
            for key in _KEEP_META:
                if key in meta_from.meta:
                    node.meta[key] = meta_from.meta[key]
        return node

    def reshard(self, x: fx.Node, producer: fx.Node, src: Placement, dst: Placement,
                kinds: tuple[ReshardKind, ...] | None) -> fx.Node:
        """Emit the steps that turn ``x`` (``producer``'s value on this rank) from ``src`` into ``dst``:
        the route of step ``kinds`` the plan chose, or the default route when it names none."""
        try:
            route = reshard_steps(src, dst) if kinds is None else route_with_kinds(src, dst, kinds)
        except ValueError as exc:
            raise PlanMismatchError(f"the plan's resharding of {producer.name}: {exc}") from None
        if self.eager is not None:  # training: the route and its adjoint, as one autograd-correct node
            return self.call(ReshardNode(self.eager, producer, route, adjoint_route(route)), x, meta_from=producer)
        for step in route:
            x = RESHARD_TABLE[step.kind].emit(self, x, producer, step)
        return x

    def replicated_input(self, x: fx.Node, producer: fx.Node) -> fx.Node:
        """Training: ``x`` (replicated) as read by rank-divergent work (Megatron's ``f``, see
        :mod:`autotp.passes.adjoints`): identity forward, all-reduce of the gradient backward."""
        assert self.eager is not None, "replicated_input is for training graphs"
        return self.call(ReshardNode(self.eager, producer, (), REPLICATED_INPUT_ADJOINT), x, meta_from=producer)


def _local_split_size(node: fx.Node, placement: Placement, parts: Partitions, rank: int) -> tuple[int, int] | None:
    """``(dim, local size)`` of ``node``'s output split under ``placement`` on this rank, or ``None``.

    Only static dims are ever split (:mod:`autotp.passes.strategies`), so the local size is an int.
    """
    split = split_of(placement)
    if split is None:
        return None
    dim, blocks = split
    ndim = len(concrete_shape(first_tensor(node.meta["val"])))
    return dim % ndim, blocks * parts.local(node.name, dim, rank, blocks)[1]


def _with_local_size(sizes: object, index: int, local: int) -> list:
    """``sizes`` (a shape argument: ints, ``-1`` and symbolic-size nodes) with entry ``index`` set to ``local``.

    Every other entry is kept as traced: a dynamic batch or sequence size stays the graph's
    expression for it (a ``sym_size`` node), so the rank-local graph serves every size.
    """
    out = list(sizes)  # type: ignore[call-overload]
    out[index] = local
    return out


def _product(graph: fx.Graph, factors: list, name: str) -> object:
    """The product of ``factors`` (ints and symbolic-size nodes): an int, or a node of the rank-local graph
    (named after ``name``, which no traced node's name takes later)."""
    static = math.prod(f for f in factors if not isinstance(f, fx.Node))
    result: object = static
    for factor in (f for f in factors if isinstance(f, fx.Node)):
        result = factor if result == 1 else graph.call_function(operator.mul, (result, factor), name=name)
    return result


def _resolve_inferred_size(graph: fx.Graph, node: fx.Node, sizes: list, split: tuple[int, int],
                           local_input: fx.Node, input_split: tuple[int, int] | None) -> list:
    """``sizes`` with its ``-1`` entry spelled out when this rank's shard is empty.

    A reshape infers a ``-1`` entry from the element count, and a tensor of 0 elements gives no
    count to infer from (``view(x, [-1, 0, 16, 16])`` raises), so on a rank whose part of the split
    dim is empty the entry becomes the global value it stands for: the input's global element count
    over the other entries' global sizes, from the same symbolic sizes, so every size still serves.
    """
    dim, local = split
    inferred = [i for i, size in enumerate(sizes) if isinstance(size, int) and size == -1]
    if local != 0 or not inferred:
        return sizes
    index = inferred[0]
    traced = node.meta["val"].shape[index]
    if is_static(traced):
        return _with_local_size(sizes, index, concrete_size(traced))
    traced_input = first_tensor(node.args[0].meta["val"])  # type: ignore[union-attr]
    in_global = concrete_shape(traced_input)
    # the input's global element count: its split dim at its (static) global size, its other dims as they are here
    numerator = [in_global[d] if (input_split is not None and d == input_split[0]) or is_static(size)
                 else graph.call_function(aten.sym_size.int, (local_input, d), name=f"{node.name}_inferred")
                 for d, size in enumerate(traced_input.shape)]  # type: ignore[union-attr]
    out_global = concrete_shape(node.meta["val"])
    denominator = [out_global[d] if d == dim else size for d, size in enumerate(sizes) if d != index]
    name = f"{node.name}_inferred"
    value = graph.call_function(operator.floordiv, (_product(graph, numerator, name), _product(graph, denominator, name)),
                                name=name)
    return _with_local_size(sizes, index, value)  # type: ignore[arg-type]


def _localise_args(graph: fx.Graph, node: fx.Node, args: tuple, strategy: Strategy, parts: Partitions,
                   rank: int) -> tuple:
    """Replace the split dim's entry of shape arguments with this rank's local size."""
    if node.target in _SHAPE_ARG_OPS:
        split = _local_split_size(node, strategy.output, parts, rank)
        if split is None:
            return args
        index = _SHAPE_ARG_OPS[node.target]
        sizes = _with_local_size(args[index], *split)
        if node.target is not aten.expand.default:  # expand's -1 keeps a dim; a reshape's is inferred
            input_split = _local_split_size(node.args[0], strategy.inputs[0], parts, rank)
            sizes = _resolve_inferred_size(graph, node, sizes, split, args[0], input_split)
        return (*args[:index], sizes, *args[index + 1:])
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default) and isinstance(strategy.inputs[0], BlockShard):
        # a block-sharded tensor split into its blocks: every piece is this rank's part of one block
        split = _local_split_size(node.args[0], strategy.inputs[0], parts, rank)
        if split is None:
            raise AssertionError(f"{node.format_node()}: block-sharded input without a split")
        piece = split[1] // strategy.inputs[0].blocks
        sizes = piece if node.target is aten.split.Tensor else [piece] * strategy.inputs[0].blocks
        return (args[0], sizes, *args[2:])
    if node.target is aten.unflatten.int:
        split = _local_split_size(node, strategy.output, parts, rank)
        if split is None:
            return args
        dim, local = split
        in_ndim = len(concrete_shape(node.meta["val"])) - len(args[2]) + 1
        start = args[1] % in_ndim
        if not start <= dim < start + len(args[2]):
            return args
        sizes = _with_local_size(args[2], dim - start, local)
        if local == 0:  # an empty shard gives no count to infer a -1 from: the split input dim is static, so is it
            traced = concrete_shape(node.meta["val"])
            sizes = [traced[start + i] if isinstance(size, int) and size == -1 else size for i, size in enumerate(sizes)]
        return (args[0], args[1], sizes)
    return args


def rewrite_for_rank(gm: fx.GraphModule, decisions: dict[str, Strategy], parts: Partitions, rank: int,
                     group_name: str, *,
                     routes: Mapping[tuple[str, Placement], tuple[ReshardKind, ...]] | None = None,
                     training: bool = False) -> fx.GraphModule:
    """Build the rank-local graph of ``gm`` for ``rank`` (see module docstring). Its Python code is generated when it
    is first called or read (:func:`generate_code` does it at once).

    ``training=True`` builds a graph that autograd differentiates correctly: each resharding
    route is one node carrying its adjoint, and replicated float values read by rank-divergent
    work go through Megatron's ``f`` (see :mod:`autotp.passes.adjoints`).

    ``routes``: (producer, needed placement) -> the kinds of the resharding steps the plan chose
    (:meth:`autotp.planning.plan.Plan.reshard_routes`); resharding it does not name takes the
    default route of :func:`autotp.base.reshard.reshard_steps`.
    """
    routes = routes or {}
    graph = fx.Graph()
    builder = _Builder(graph, parts, rank, group_name, training=training)
    env: dict[str, fx.Node] = {}
    resharded: dict[tuple[str, Placement], fx.Node] = {}
    shared_inputs: dict[str, fx.Node] = {}  # training: producer -> its value read through f
    # training: dropout on a split activation draws from this rank's own stream (passes/random_streams.py)
    streams = RankStreams(rank_seed(torch.initial_seed(), rank)) if training else None
    by_name = {n.name: n for n in gm.graph.nodes}

    def value_for(producer: fx.Node, needed: Placement, divergent: bool) -> fx.Node:
        have = decisions[producer.name].output
        val = producer.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return env[producer.name]
        key = (producer.name, needed)
        if have == needed:
            value = env[producer.name]
        else:
            if key not in resharded:
                resharded[key] = builder.reshard(env[producer.name], producer, have, needed, routes.get(key))
            value = resharded[key]
        if training and divergent and needed == Replicate() and val.dtype.is_floating_point:
            if producer.name not in shared_inputs:
                shared_inputs[producer.name] = builder.replicated_input(value, producer)
            return shared_inputs[producer.name]
        return value

    for node in gm.graph.nodes:
        strategy = decisions[node.name]
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            new.meta.update({k: v for k, v in node.meta.items() if k in _KEEP_META})
            env[node.name] = new
            continue
        slot = iter(strategy.inputs)
        divergent = strategy.output != Replicate()

        def map_arg(a: object, slot: Iterator[Placement] = slot, divergent: bool = divergent) -> object:
            if isinstance(a, fx.Node):
                # a symbolic size (sym_size, s0 * 4) is no input slot: it stays an expression
                return value_for(by_name[a.name], next(slot), divergent) if holds_tensor(a) else env[a.name]
            return a

        args, kwargs = pytree.tree_map(map_arg, (node.args, node.kwargs))
        if node.op == "output":
            graph.output(args[0])
            continue
        args = _localise_args(graph, node, tuple(args), strategy, parts, rank)
        local_form = local_form_for(node.target)
        new = local_form(builder, node, args, kwargs, strategy) if local_form is not None else None
        if new is None:
            new = graph.call_function(rank_stream_target(node, strategy.output, streams), args, kwargs)
        new.name = node.name
        new.meta.update({k: v for k, v in node.meta.items() if k in _KEEP_META})
        new.meta["autotp_placement"] = str(strategy.output)
        env[node.name] = new
    graph.lint()
    return _CodeOnFirstCall(gm, graph)


def generate_code(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its Python code generated now. :func:`rewrite_for_rank` returns a module that generates it when
    first called or read, so that the passes after it (each changing the graph and calling ``recompile()``) do not
    each generate the code of a whole model's graph; the last of them calls this, and the module leaves built."""
    real_recompile = getattr(gm, "real_recompile", None)
    if real_recompile is not None:
        real_recompile()
    return gm


def is_collective(node: fx.Node) -> bool:
    """True for inserted functional collectives (not their ``wait_tensor``) and the inference forms of
    an all-reduce or all-gather (:mod:`autotp.passes.small_collectives`)."""
    return node.op == "call_function" and (node.target in COLLECTIVE_OPS
                                           or inference_collective_kind(node.target) is not None)


def count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    """Collectives in a rank-local graph, by kind (``all_reduce``...): one forward pass issues each once."""
    counts: dict[str, int] = {}
    # a graph cut into submodules (activation checkpointing of blocks) holds its collectives in them
    nodes = [node for module in gm.modules() if isinstance(module, fx.GraphModule) for node in module.graph.nodes]
    for node in nodes:
        if is_collective(node):
            kind = COLLECTIVE_OPS.get(node.target) or str(inference_collective_kind(node.target))
            counts[kind] = counts.get(kind, 0) + 1
        elif node.op == "call_function" and isinstance(node.target, ReshardNode):  # a training graph's route
            for step in node.target.forward_steps:
                collective = RESHARD_TABLE[step.kind].collective
                if collective is not None:
                    counts[collective] = counts.get(collective, 0) + 1
    return counts

