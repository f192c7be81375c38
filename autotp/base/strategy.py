"""Strategy: one way to run one node, as placements of its inputs and of its output.

A :class:`Strategy` lists one placement per *tensor input slot* of the node (its fx.Node
arguments, flattened in (args, kwargs) order) and one placement for the output (for ops that
return several tensors, e.g. ``split``, it applies to every output). Rules produce them
(``passes/rules/``), the solver picks one per node, a ``Plan`` records it and the rewrite
applies it; this base-layer value is what all of them share.
"""

from __future__ import annotations

import dataclasses

from autotp.base.placements import Placement

__all__ = ["Strategy"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run a node: a placement per tensor input slot and one for the output."""

    inputs: tuple[Placement, ...]
    output: Placement

    def __str__(self) -> str:
        ins = ", ".join(str(p) for p in self.inputs)
        return f"({ins}) -> {self.output}"
