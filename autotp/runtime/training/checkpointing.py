"""Activation checkpointing of blocks in a rank-local training graph (``activation_checkpointing="blocks"``).

``autotp.compile(..., options=PlanOptions(training=True))`` returns one FX graph per rank: the model's layer modules
are gone, so ``torch.utils.checkpoint`` could only wrap the whole call. :func:`checkpoint_blocks`
cuts the rank-local graph back into its repeated blocks (the children of a numbered container,
``model.layers.3``: :func:`autotp.base.module_paths.block_name` of each node's module, from the
``nn_module_stack`` the rewrite keeps) and runs each block under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only each
block's inputs, and the backward runs the block's forward again before its backward.

- **Cuts**: the graph's nodes, in order, fall into runs of one block; a node without a module of
  its own (a size expression, an inserted resharding route: the rewrite gives it its producer's
  module) stays in the run it appears in. Runs outside every block (embedding, final norm, head,
  loss) are not checkpointed: they run as before. ``torch.fx.passes.split_module`` makes each run
  a submodule; a block's submodule is then called through the checkpoint.
- **Collectives** inside a block (its resharding routes, each an autograd node carrying its
  adjoint: :mod:`autotp.passes.adjoints`) run again in the recomputation, in the block's order.
  Every rank has the same blocks with the same nodes and autograd reaches them in the same
  order, so the ranks issue the recomputed collectives alike.
- **Random numbers**: the checkpoint restores the CPU (and device) generator state before the
  recomputation (``preserve_rng_state=True``), so dropout draws the same masks again; a block with
  dropout on split activations also replays this rank's own stream (``dropout="split"``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from autotp.base.module_paths import block_name
from autotp.passes.adjoints import ReshardNode
from autotp.passes.random_streams import RankStream
from autotp.planning.plan import module_path

__all__ = ["CheckpointedBlock", "block_runs_of", "checkpoint_blocks", "checkpointed_graph"]

class CheckpointedBlock(torch.nn.Module):
    """One block's submodule, called through ``torch.utils.checkpoint`` (non-reentrant) in grad mode.

    The checkpoint restores the default generators before recomputing; a block with dropout on split
    activations also replays this rank's own stream (:class:`~autotp.passes.random_streams.RankStreams`)
    from where the forward left it, so the recomputed masks are the forward's.
    """

    def __init__(self, block: fx.GraphModule, name: str) -> None:
        super().__init__()
        self.block = block
        self.name = name
        self.streams = next((node.target.streams for node in block.graph.nodes
                             if isinstance(node.target, RankStream)), None)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args)
        streams = self.streams
        if streams is None:
            return checkpoint(self.block, *args, use_reentrant=False)
        snapshot = streams.snapshot()
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.block(*inputs)
            with streams.replaying(snapshot):  # the recomputation
                return self.block(*inputs)

        return checkpoint(run, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"block={self.name!r}"


def block_runs_of(gm: fx.GraphModule) -> dict[str, int]:
    """Node name -> run index: consecutive nodes of one block (or of no block) share a run.

    A node without a module path of its own (size arithmetic) and a resharding route (the rewrite
    gives it its producer's module, which may be another block's) join the run they appear in, so a block's own nodes are never split by it. Placeholders and the output are left
    out (``split_module`` places them).
    """
    runs: dict[str, int] = {}
    index, current = -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        path = "" if isinstance(node.target, ReshardNode) else module_path(node)
        key = block_name(path) if path else current
        if key != current or index < 0:
            index += 1
            current = key
        runs[node.name] = index
    return runs


def checkpoint_blocks(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """``gm`` cut at its blocks, each block's submodule run under activation checkpointing.

    Returns the new graph module (same inputs and outputs as ``gm``; ``gm`` is not modified) and
    the names of the checkpointed blocks in order. A graph without numbered blocks comes back with
    no block checkpointed (the caller says so).
    """
    runs = block_runs_of(gm)
    block_of_run: dict[int, str | None] = {}
    for node in gm.graph.nodes:
        if node.name in runs and not isinstance(node.target, ReshardNode):
            path = module_path(node)
            if path and runs[node.name] not in block_of_run:
                block_of_run[runs[node.name]] = block_name(path)
    split = split_module(gm, gm, lambda node: runs[node.name], keep_original_order=True,
                         keep_original_node_name=True)
    names: list[str] = []
    for node in split.graph.nodes:
        if node.op != "call_module" or not node.target.startswith("submod_"):
            continue
        block = block_of_run.get(int(node.target.removeprefix("submod_")))
        if block is None:
            continue
        setattr(split, node.target, CheckpointedBlock(getattr(split, node.target), block))
        names.append(block)
    split.recompile()
    return split, names


def checkpointed_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """:func:`checkpoint_blocks` of ``gm``; raises when ``gm`` has no repeated blocks to checkpoint."""
    split, names = checkpoint_blocks(gm)
    if not names:
        raise ValueError("activation_checkpointing='blocks' found no repeated blocks (children of a numbered "
                         "container such as model.layers.N) in the traced graph; leave the option out, or wrap the "
                         "whole call: torch.utils.checkpoint.checkpoint(tp, ..., use_reentrant=False)")
    return split
