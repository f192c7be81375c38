"""The module structure of a plan: which module each node belongs to, layer blocks, and runs of
identical layers (so an 80-layer plan reads like a 2-layer one).

Shared by the plan's text (``print(plan)``), the HTML page and the DOT drawing; reads only the plan's
records (:mod:`autotp.planning.decisions`).

- :func:`node_module`: the module FQN a node is drawn in. Ops use
  :attr:`NodeDecision.module`; a parameter or buffer placeholder goes to the module that owns
  it (``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``).
- :func:`blocks`: the plan cut into *blocks*: one per repeated layer (a module path up to its
  first integer segment, e.g. ``model.layers.3``) and one per other module at the same depth
  as the layer containers (``model.embed_tokens``, ``lm_head``...), in execution order.
- :func:`block_runs`: consecutive blocks of one container with the same *signature* (ops,
  placements, shapes, collectives, relative module paths; not node names) folded into one run.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache

import torch

from autotp.adapters.torchao import weight_of
from autotp.base.module_paths import block_name, block_of
from autotp.base.placements import placement_from_str
from autotp.passes.uneven import largest_shard_nbytes
from autotp.planning.decisions import CollectiveDecision, NodeDecision

__all__ = ["Block", "BlockRun", "block_runs", "blocks", "node_module", "parameter_bytes_per_rank"]


def node_module(node: NodeDecision) -> str:
    """The module FQN a node belongs to (placeholders: the module owning the parameter/buffer)."""
    if node.op == "placeholder":
        part = weight_of(node.target)  # a quantized weight's part belongs to the weight's module
        fqn = part[0] if part is not None else node.target
        return fqn.rsplit(".", 1)[0] if "." in fqn else ""
    return node.module


@lru_cache(maxsize=64)
def _element_size(dtype: str) -> int:
    try:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        return 4


def parameter_bytes_per_rank(node: NodeDecision, world_size: int) -> int:
    """Bytes of the largest rank's shard of a parameter placeholder (0 without a recorded shape)."""
    if not node.shape:
        return 0
    return largest_shard_nbytes(node.shape, _element_size(node.dtype), placement_from_str(node.output), world_size)


@dataclasses.dataclass
class Block:
    """One layer (or top-level module) of the plan: its nodes and the collectives inserted in it."""

    name: str  # module FQN of the block ("" for nodes outside every module)
    container: str  # for a layer: the module holding the layers (``model.layers``); else ""
    nodes: list[NodeDecision] = dataclasses.field(default_factory=list)
    collectives: list[CollectiveDecision] = dataclasses.field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return sum(n.compute_s for n in self.nodes)

    @property
    def comm_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    def weights(self, parameters: Mapping[str, str]) -> list[NodeDecision]:
        """The block's parameter placeholders (``parameters``: the plan's, FQN -> placement)."""
        return [n for n in self.nodes if n.op == "placeholder" and n.target in parameters]

    def relative(self, fqn: str) -> str:
        """``mlp.up_proj`` for ``model.layers.3.mlp.up_proj`` in block ``model.layers.3``."""
        if not self.name:
            return fqn
        if fqn == self.name:
            return ""
        return fqn[len(self.name) + 1:] if fqn.startswith(self.name + ".") else fqn

    def signature(self) -> tuple:
        """Everything that makes two layers the same plan, without node names."""
        nodes = tuple((n.op, n.inputs, n.output, self.relative(node_module(n)), n.shape, n.dtype, n.fallback,
                       self.relative(n.target)) for n in self.nodes)
        collectives = tuple((c.steps, c.src, c.dst, c.nbytes, self.relative(c.module)) for c in self.collectives)
        return nodes, collectives


@dataclasses.dataclass
class BlockRun:
    """Consecutive identical blocks (``count`` == 1 for a block that is not repeated)."""

    blocks: list[Block]

    @property
    def first(self) -> Block:
        return self.blocks[0]

    @property
    def count(self) -> int:
        return len(self.blocks)

    @property
    def label(self) -> str:
        """``model.layers.0`` or ``model.layers.1-79``."""
        if self.count == 1:
            return self.first.name or "(top level)"
        last = self.blocks[-1].name.rsplit(".", 1)[-1]
        return f"{self.first.name}-{last}"


def _block_depth(modules: list[str]) -> int:
    depths = [len(prefix.split(".")) - 1 for prefix in (block_name(m) for m in modules) if prefix]
    return min(depths) if depths else 1


def blocks(nodes: Sequence[NodeDecision], collectives: Sequence[CollectiveDecision]) -> list[Block]:
    """A plan's blocks in execution order, from its ``nodes`` and ``collectives`` (see module doc)."""
    modules = [node_module(n) for n in nodes]
    depth = _block_depth(modules)

    def group_of(module: str) -> str:
        """The layer ``module`` lies in, else its ancestor at the layer containers' depth."""
        prefix = block_name(module)
        if prefix is not None:
            return prefix
        return ".".join(module.split(".")[:depth]) if module else ""

    found: dict[str, Block] = {}
    first_op: dict[str, int] = {}
    first_any: dict[str, int] = {}
    for index, (node, module) in enumerate(zip(nodes, modules)):
        name = group_of(module)
        if name not in found:
            layer = block_of(module)
            found[name] = Block(name, layer[0] if layer is not None else "")
            first_any[name] = index
        found[name].nodes.append(node)
        # size arithmetic (sym_size of a dynamic dim: no tensor, no dtype) does not place a block
        if node.op not in ("placeholder", "output") and node.dtype and name not in first_op:
            first_op[name] = index
    for c in collectives:
        name = group_of(c.module)
        if name not in found:
            found[name] = Block(name, "")
            first_any[name] = len(nodes)
        found[name].collectives.append(c)
    order = sorted(found, key=lambda n: (first_op.get(n, len(nodes) + first_any[n]), first_any[n]))
    return [found[n] for n in order]


def block_runs(nodes: Sequence[NodeDecision], collectives: Sequence[CollectiveDecision], *,
               fold: bool = True) -> list[BlockRun]:
    """:func:`blocks` with consecutive identical layers of one container folded into runs."""
    runs: list[BlockRun] = []
    signatures: list[tuple] = []
    for block in blocks(nodes, collectives):
        signature = block.signature()
        if (fold and runs and block.container and runs[-1].first.container == block.container
                and signatures[-1] == signature):
            runs[-1].blocks.append(block)
            continue
        runs.append(BlockRun([block]))
        signatures.append(signature)
    return runs


def placement_counts(nodes: list[NodeDecision]) -> str:
    """``S(0)*5 R*2 S(1)*2`` for a list of parameter placeholders (``x`` belongs to block splits, ``S(1)x3``);
    a quantized weight counts once, by its data's placement."""
    counts = Counter(n.output for n in nodes if (weight_of(n.target) or ("", 0))[1] == 0)
    return " ".join(f"{p}*{k}" if k > 1 else p for p, k in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
