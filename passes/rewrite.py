"""Rewrite: captured graph + chosen strategies -> the rank-local GraphModule of one rank.

Input: the captured ATen graph (unchanged), the chosen strategy of every node, the
partitions of split dims, and this rank's index. Output: a new ``fx.GraphModule`` that
takes this rank's *local* parameter shards in the parameters' placeholder slots and returns
replicated outputs. The input graph is not modified.

What changes, node by node:

- shape arguments of reshapes (``view``/``reshape``/``expand``/``unflatten``) get this rank's
  local size in the split dim (uneven splits give each rank its own constant); every other
  entry stays as traced, so a dynamic batch or sequence size stays a symbolic expression
  (a ``sym_size`` node) and one rank-local graph serves every input size;
- ops whose local form differs from the global one get it (:data:`_LOCAL_FORMS`): a
  vocabulary-split ``embedding`` looks up only the ids in this rank's row range (others give
  zeros: the output is a Partial sum); a grouped convolution split by groups gets this rank's
  group count;
- wherever a producer's placement differs from what a consumer's strategy needs, the
  resharding steps of :func:`autotp.passes.costing.reshard_plan` are inserted once per
  (producer, target placement) as traceable functional collectives
  (``torch.ops._c10d_functional.*`` followed by ``wait_tensor``) or local slices.

Every rank inserts the same collectives in the same (topological) order, so no rank can wait
on a collective another rank does not issue.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import BlockShard, Placement, Shard, split_of
from autotp.base.shapes import concrete_shape, first_tensor, is_static
from autotp.passes.costing import reshard_plan
from autotp.passes.rules import Strategy, holds_tensor
from autotp.passes.rules_conv import conv_groups_index
from autotp.passes.uneven import Partitions

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["COLLECTIVE_OPS", "rewrite_for_rank"]

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast.default: "broadcast",
}

_SHAPE_ARG_OPS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1}

_KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr")


class _Builder:
    """Emits nodes into the new graph for one rank."""

    def __init__(self, graph: fx.Graph, parts: Partitions, rank: int, group_name: str) -> None:
        self.graph = graph
        self.parts = parts
        self.rank = rank
        self.world_size = parts.world_size
        self.group_name = group_name

    def call(self, target: object, *args: object, meta_from: fx.Node | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        if meta_from is not None:
            for key in _KEEP_META:
                if key in meta_from.meta:
                    node.meta[key] = meta_from.meta[key]
        return node

    # -- resharding steps ------------------------------------------------------------
    def slice(self, x: fx.Node, producer: fx.Node, dim: int, blocks: int) -> fx.Node:
        offset, length = self.parts.local(producer.name, dim, self.rank, blocks)
        if blocks == 1:
            return self.call(aten.narrow.default, x, dim, offset, length, meta_from=producer)
        block = concrete_shape(producer.meta["val"])[dim] // blocks
        pieces = [self.call(aten.narrow.default, x, dim, b * block + offset, length, meta_from=producer) for b in range(blocks)]
        return self.call(aten.cat.default, pieces, dim, meta_from=producer)

    def zero_unless_rank0(self, x: fx.Node, origin: fx.Node) -> fx.Node:
        return x if self.rank == 0 else self.call(aten.zeros_like.default, x, meta_from=origin)

    def all_reduce(self, x: fx.Node, origin: fx.Node) -> fx.Node:
        reduced = self.call(c10d.all_reduce.default, x, "sum", self.group_name, meta_from=origin)
        return self.call(c10d.wait_tensor.default, reduced, meta_from=origin)

    def all_gather(self, x: fx.Node, producer: str, dim: int, blocks: int, ndim: int, origin: fx.Node) -> fx.Node:
        """Gather along ``dim``: pad each rank's part to the largest, gather on dim 0, cut out the padding.

        With ``blocks`` > 1 each rank's part holds its slice of every block; the pieces are
        put back in block order.
        """
        sizes = self.parts.sizes(producer, dim, blocks)
        chunk = blocks * max(sizes)
        if dim != 0:
            x = self.call(aten.movedim.int, x, dim, 0, meta_from=origin)
        x = self.call(aten.contiguous.default, x, meta_from=origin)
        mine = blocks * sizes[self.rank]
        if mine != chunk:
            x = self.call(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, chunk - mine], 0.0, meta_from=origin)
        gathered = self.call(c10d.all_gather_into_tensor.default, x, self.world_size, self.group_name, meta_from=origin)
        x = self.call(c10d.wait_tensor.default, gathered, meta_from=origin)
        if len(set(sizes)) > 1 or blocks > 1:
            pieces = [
                self.call(aten.narrow.default, x, 0, r * chunk + b * sizes[r], sizes[r], meta_from=origin)
                for b in range(blocks) for r in range(self.world_size)
            ]
            x = self.call(aten.cat.default, pieces, 0, meta_from=origin)
        if dim != 0:
            # back in place, and contiguous: a consumer's view() needs the layout it was traced with
            x = self.call(aten.movedim.int, x, 0, dim, meta_from=origin)
            x = self.call(aten.contiguous.default, x, meta_from=origin)
        return x

    def reduce_scatter(self, x: fx.Node, producer: str, dim: int, ndim: int, origin: fx.Node) -> fx.Node:
        sizes = self.parts.sizes(producer, dim)
        block = max(sizes)
        if dim != 0:
            x = self.call(aten.movedim.int, x, dim, 0, meta_from=origin)
        if len(set(sizes)) > 1:
            padded = []
            for r in range(self.world_size):
                piece = self.call(aten.narrow.default, x, 0, sum(sizes[:r]), sizes[r], meta_from=origin)
                if sizes[r] != block:
                    piece = self.call(aten.constant_pad_nd.default, piece, [0, 0] * (ndim - 1) + [0, block - sizes[r]], 0.0, meta_from=origin)
                padded.append(piece)
            x = self.call(aten.cat.default, padded, 0, meta_from=origin)
        x = self.call(aten.contiguous.default, x, meta_from=origin)
        scattered = self.call(c10d.reduce_scatter_tensor.default, x, "sum", self.world_size, self.group_name, meta_from=origin)
        x = self.call(c10d.wait_tensor.default, scattered, meta_from=origin)
        if sizes[self.rank] != block:
            x = self.call(aten.narrow.default, x, 0, 0, sizes[self.rank], meta_from=origin)
        if dim != 0:
            # back in place, and contiguous: a consumer's view() needs the layout it was traced with
            x = self.call(aten.movedim.int, x, 0, dim, meta_from=origin)
            x = self.call(aten.contiguous.default, x, meta_from=origin)
        return x

    def reshard(self, x: fx.Node, producer: fx.Node, src: Placement, dst: Placement) -> fx.Node:
        ndim = producer.meta["val"].dim()
        for step in reshard_plan(src, dst):
            if step == "slice":
                x = self.slice(x, producer, *split_of(dst))  # type: ignore[misc]
            elif step == "zero":
                x = self.zero_unless_rank0(x, producer)
            elif step == "all_reduce":
                x = self.all_reduce(x, producer)
            elif step == "all_gather":
                x = self.all_gather(x, producer.name, *split_of(src), ndim, producer)  # type: ignore[misc]
            elif step == "reduce_scatter":
                x = self.reduce_scatter(x, producer.name, split_of(dst)[0], ndim, producer)  # type: ignore[index]
            else:
                raise AssertionError(f"unknown resharding step {step}")
        return x


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


def _localise_args(node: fx.Node, args: tuple, strategy: Strategy, parts: Partitions, rank: int) -> tuple:
    """Replace the split dim's entry of shape arguments with this rank's local size."""
    if node.target in _SHAPE_ARG_OPS:
        split = _local_split_size(node, strategy.output, parts, rank)
        if split is None:
            return args
        index = _SHAPE_ARG_OPS[node.target]
        return (*args[:index], _with_local_size(args[index], *split), *args[index + 1:])
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default) and isinstance(strategy.inputs[0], BlockShard):
        # a block-sharded tensor split into its blocks: every piece is this rank's part of one block
        split = _local_split_size(node.args[0], strategy.inputs[0], parts, rank)
        assert split is not None, f"{node.format_node()}: block-sharded input without a split"
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
        return (args[0], args[1], _with_local_size(args[2], dim - start, local))
    return args


def _sizes_of(builder: _Builder, x: fx.Node, value: torch.Tensor) -> list:
    """The sizes of ``x`` (a node of the new graph whose traced value is ``value``): ints where
    static, a ``sym_size`` node where dynamic."""
    return [size if is_static(size) else builder.call(aten.sym_size.int, x, dim)
            for dim, size in enumerate(value.shape)]


def _local_embedding(builder: _Builder, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """Vocabulary-parallel lookup (``weight S(0) -> Partial``): ids outside this rank's rows give zeros.

    ``local = ids - offset``; ids with ``0 <= local < rows`` look up row ``local`` of this rank's
    shard, the others look up row 0 and are zeroed, so the ranks' outputs sum to the lookup.
    """
    if strategy.inputs[0] != Shard(0):
        return None
    weight = node.args[0]
    offset, rows = builder.parts.local(weight.name, 0, builder.rank)
    local_weight, global_ids = args[0], args[1]
    if rows == 0:  # more ranks than rows: this rank holds none, and contributes zeros
        ids = node.args[1]
        shape = [*_sizes_of(builder, global_ids, ids.meta["val"]), concrete_shape(weight.meta["val"])[1]]
        return builder.call(aten.new_zeros.default, local_weight, shape, meta_from=node)
    local = builder.call(aten.sub.Tensor, global_ids, offset, meta_from=node)
    inside = builder.call(aten.bitwise_and.Tensor,
                          builder.call(aten.ge.Scalar, local, 0, meta_from=node),
                          builder.call(aten.lt.Scalar, local, rows, meta_from=node), meta_from=node)
    safe = builder.call(aten.where.ScalarOther, inside, local, 0, meta_from=node)
    looked_up = builder.graph.call_function(node.target, (local_weight, safe, *args[2:]), kwargs)
    outside = builder.call(aten.logical_not.default, builder.call(aten.unsqueeze.default, inside, -1, meta_from=node),
                           meta_from=node)
    return builder.call(aten.masked_fill.Scalar, looked_up, outside, 0.0, meta_from=node)


def _local_convolution(builder: _Builder, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A grouped convolution split by whole groups runs this rank's groups: ``groups`` becomes the local count."""
    index = conv_groups_index(node.target)
    groups = args[index] if index is not None and len(args) > index else kwargs.get("groups", 1)
    if index is None or groups == 1 or split_of(strategy.output) is None or strategy.inputs[1] != Shard(0):
        return None
    weight = node.args[1]
    out_channels = concrete_shape(weight.meta["val"])[0]
    local_out = builder.parts.local(weight.name, 0, builder.rank)[1]
    local_groups = groups * local_out // out_channels
    if len(args) > index:
        args = (*args[:index], local_groups, *args[index + 1:])
    else:
        kwargs = {**kwargs, "groups": local_groups}
    new = builder.graph.call_function(node.target, args, kwargs)
    return new


def _local_block_split(builder: _Builder, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A block-sharded tensor split into its k blocks: always k pieces, even when this rank's are empty.

    (``split(x, 0)`` on an empty dim returns one piece, not k; ``split_with_sizes`` returns k.)
    """
    if not isinstance(strategy.inputs[0], BlockShard):
        return None
    blocks = strategy.inputs[0].blocks
    return builder.graph.call_function(aten.split_with_sizes.default, (args[0], [args[1]] * blocks, *args[2:]), kwargs)


_LOCAL_FORMS = {
    aten.embedding.default: _local_embedding,
    aten.split.Tensor: _local_block_split,
    **{op: _local_convolution for op in (
        aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding,
        aten.conv3d.padding, aten.convolution.default)},
}
"""Op -> ``emit(builder, node, local_args, local_kwargs, strategy)``: emits the op's rank-local form
and returns its node, or ``None`` when the op runs unchanged under this strategy."""


def rewrite_for_rank(gm: fx.GraphModule, decisions: dict[str, Strategy], parts: Partitions, rank: int,
                     group_name: str) -> fx.GraphModule:
    """Build the rank-local graph of ``gm`` for ``rank`` (see module docstring)."""
    graph = fx.Graph()
    builder = _Builder(graph, parts, rank, group_name)
    env: dict[str, fx.Node] = {}
    resharded: dict[tuple[str, Placement], fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}

    def value_for(producer: fx.Node, needed: Placement) -> fx.Node:
        have = decisions[producer.name].output
        if have == needed or not isinstance(producer.meta.get("val"), torch.Tensor):
            return env[producer.name]
        key = (producer.name, needed)
        if key not in resharded:
            resharded[key] = builder.reshard(env[producer.name], producer, have, needed)
        return resharded[key]

    for node in gm.graph.nodes:
        strategy = decisions[node.name]
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            new.meta.update({k: v for k, v in node.meta.items() if k in _KEEP_META})
            env[node.name] = new
            continue
        slot = iter(strategy.inputs)

        def map_arg(a: object, slot: Iterator[Placement] = slot) -> object:
            if isinstance(a, fx.Node):
                # a symbolic size (sym_size, s0 * 4) is no input slot: it stays an expression
                return value_for(by_name[a.name], next(slot)) if holds_tensor(a) else env[a.name]
            return a

        args, kwargs = pytree.tree_map(map_arg, (node.args, node.kwargs))
        if node.op == "output":
            graph.output(args[0])
            continue
        args = _localise_args(node, tuple(args), strategy, parts, rank)
        local_form = _LOCAL_FORMS.get(node.target)
        new = local_form(builder, node, args, kwargs, strategy) if local_form is not None else None
        if new is None:
            new = graph.call_function(node.target, args, kwargs)
        new.name = node.name
        new.meta.update({k: v for k, v in node.meta.items() if k in _KEEP_META})
        new.meta["autotp_placement"] = str(strategy.output)
        env[node.name] = new
    graph.lint()
    return fx.GraphModule(gm, graph)


def is_collective(node: fx.Node) -> bool:
    """True for inserted functional collectives (not their ``wait_tensor``)."""
    return node.op == "call_function" and node.target in COLLECTIVE_OPS

