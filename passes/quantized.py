"""Quantized weights split as one: the placements of a weight's parts (data, scales, zero points) linked.

``torch.export`` turns a torchao weight into one placeholder per part
(:mod:`autotp.adapters.torchao`), so each part has its own candidate strategies. Left alone, the
solver may split the data by rows and keep its per-row scale whole, or slice a scale the data
does not follow: the rank-local graph is still right (resharding fixes it), but the weight is not
one tensor any more. :func:`quantized_links` ties each part to the data (part 0): the data's
placement decides the part's, dim by dim of the data's split ``d``:

- the part is as long as the data along ``d`` (a per-output-channel scale under a column split,
  group-wise scales of a split in whole groups): the same placement;
- the part has length 1 along ``d``, or no dim ``d`` (a per-row scale under a row split, a
  per-tensor scale): ``Replicate()``;
- the data replicated: the part replicated.

A data placement with no such part placement is not allowed (the solver's rows forbid it).
Input: a :class:`StrategyGraph`; output: a list of :class:`Link`; nothing is modified.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.tensor import Replicate

from autotp.adapters.torchao import weight_of
from autotp.base.placements import split_of
from autotp.base.shapes import concrete_shape
from autotp.passes.strategies import StrategyGraph

__all__ = ["Link", "quantized_links"]


@dataclasses.dataclass(frozen=True)
class Link:
    """``follower``'s strategy is ``mapping[i]`` when ``leader`` takes strategy ``i`` (``None``: forbidden)."""

    leader: str
    follower: str
    mapping: tuple[int | None, ...]


def _follower_index(graph: StrategyGraph, leader: str, follower: str, index: int) -> int | None:
    placement = graph.strategies[leader][index].output
    options = [s.output for s in graph.strategies[follower]]
    split = split_of(placement)
    if split is None:
        wanted = Replicate()
    else:
        dim = split[0]
        lead_shape = concrete_shape(graph.nodes[leader].meta["val"])
        part_shape = concrete_shape(graph.nodes[follower].meta["val"])
        whole = dim >= len(part_shape) or part_shape[dim] == 1 < lead_shape[dim]  # per-tensor, or per-row under a row split
        wanted = Replicate() if whole else placement
    return options.index(wanted) if wanted in options else None


def quantized_links(graph: StrategyGraph) -> list[Link]:
    """One :class:`Link` from the data part to each other part of every quantized weight in ``graph``."""
    parts: dict[str, dict[int, str]] = defaultdict(dict)
    for name, fqn in graph.parameters.items():
        found = weight_of(fqn)
        if found is not None and name in graph.strategies:
            parts[found[0]][found[1]] = name
    links = []
    for by_index in parts.values():
        leader = by_index.get(0)
        if leader is None:
            continue
        for index, follower in sorted(by_index.items()):
            if index == 0:
                continue
            mapping = tuple(_follower_index(graph, leader, follower, i) for i in range(len(graph.strategies[leader])))
            links.append(Link(leader, follower, mapping))
    return links
