"""Strategy builders that several op families share.

- :func:`dim_map_rule`: ops that move dims around (transpose, permute, squeeze, slice...);
- :func:`broadcast_placement`: the placement of a broadcast input under a split output;
- :func:`fitting_blocks`: the block counts k for which ``BlockShard(d, k)`` is offered on a dim.

``R`` and ``P`` are the two placements without a dim, named once for every family.
"""

from __future__ import annotations

import torch.fx as fx

from autotp.base.placements import BlockShard, Partial, Placement, Replicate, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import is_tensor, shape, tensor_inputs

__all__ = ["P", "R", "broadcast_placement", "dim_map_rule", "fitting_blocks"]

R = Replicate()
P = Partial()


def fitting_blocks(size: int, block_counts: frozenset[int]) -> list[int]:
    """The k of ``block_counts`` (ascending) that cut a dim of ``size`` into k equal blocks of more than one element."""
    return [k for k in sorted(block_counts) if size % k == 0 and size // k > 1]


def broadcast_placement(inp: fx.Node, out_ndim: int, out_dim: int) -> Placement:
    """Placement of a broadcast input when the output is sharded on ``out_dim``."""
    if not is_tensor(inp):
        return R
    in_shape = shape(inp)
    in_dim = out_dim - (out_ndim - len(in_shape))
    if in_dim < 0 or in_shape[in_dim] == 1:
        return R
    return Shard(in_dim)


def dim_map_rule(node: fx.Node, out_to_in: dict[int, int], blocks: frozenset[int] = frozenset()) -> list[Strategy]:
    """Rule for ops that move dims around: output dim d holds input dim ``out_to_in[d]``.

    A dim carried over whole keeps its split, and its ``BlockShard(d, k)`` for each k in
    ``blocks``; a Partial sum passes through (the op only moves values).
    """
    n_inputs = len(tensor_inputs(node))
    rest = tuple(R for _ in range(n_inputs - 1))
    in_shape, out_shape = shape(tensor_inputs(node)[0]), shape(node)
    strategies = [Strategy((P, *rest), P)]
    for out_dim, in_dim in out_to_in.items():
        if out_shape[out_dim] > 1 and in_shape[in_dim] == out_shape[out_dim]:
            strategies.append(Strategy((Shard(in_dim), *rest), Shard(out_dim)))
            for k in fitting_blocks(in_shape[in_dim], blocks):
                strategies.append(Strategy((BlockShard(in_dim, k), *rest), BlockShard(out_dim, k)))
    return strategies
