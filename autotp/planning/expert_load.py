"""A router's measured load: rows per expert of every mixture-of-experts block, and how planning reads it.

By default the planner prices an MoE block for a uniform router (every expert equally likely,
:mod:`autotp.cost_model.routing`). A trained router is rarely that even on a user's data: an
:class:`ExpertLoad`, measured from calibration data with :func:`autotp.measure_expert_load` (or written by
hand), gives per block the rows each expert received, and ``PlanOptions(expert_load=...)`` prices the block by
them: the busiest rank's rows when experts are placed (rank r holds contiguous experts, so a rank holding the
favourite experts carries more), and the expert weights a grouped GEMM reads in either form.

A block is keyed by the fully qualified names of its expert weights (``model.layers.0.mlp.experts.gate_up_proj``):
the names survive ``torch.export`` (the planner sees them on the graph's parameter placeholders), so a load
measured by running the model matches the block the planner finds in the graph (:mod:`autotp.planning.experts`,
never by class or module names). :func:`with_expert_load` attaches the shares to the block's grouped GEMMs
(:attr:`~autotp.passes.strategies.StrategyGraph.expert_shares`); a block the load does not name stays uniform,
and an entry that names no block of the graph is left aside (a pipeline stage plans some layers only), unless
no entry names any block: then the load is for another model, and that is an error.

The value is plain data: frozen, compared by value, JSON with a version field (:meth:`ExpertLoad.to_json`,
:meth:`ExpertLoad.save`, :meth:`ExpertLoad.load`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from autotp.base.errors import PlanError
from autotp.passes.strategies import StrategyGraph
from autotp.planning.experts import find_expert_blocks

__all__ = ["EXPERT_LOAD_FORMAT_VERSION", "BlockLoad", "ExpertLoad", "check_expert_load", "measured_blocks",
           "with_expert_load"]

EXPERT_LOAD_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BlockLoad:
    """One MoE block's measured load: the rows its router sent to each expert over the calibration data.

    Attributes:
        weights: fully qualified names of the block's expert weights, in the order its grouped GEMMs read them
            (``(...gate_up_proj, ...down_proj)``); any one of them names the block.
        rows: rows (token-expert pairs) each expert received, expert 0 first.
        top_k: experts per token, as the router picked them (None where it was not seen).
    """

    weights: tuple[str, ...]
    rows: tuple[int, ...]
    top_k: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(str(w) for w in self.weights))
        object.__setattr__(self, "rows", tuple(self.rows))
        if not self.weights:
            raise ValueError("a BlockLoad names its block by at least one expert weight's FQN, e.g. "
                             "weights=('model.layers.0.mlp.experts.gate_up_proj',)")
        if len(self.rows) < 2 or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.rows):
            raise ValueError(f"rows of {self.weights[0]} must be one count >= 0 per expert (2 or more experts), "
                             f"got {self.rows}")
        if sum(self.rows) == 0:
            raise ValueError(f"no rows were routed in {self.weights[0]}: measure on batches that reach the block")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or not 1 <= self.top_k <= len(self.rows)):
            raise ValueError(f"top_k of {self.weights[0]} must be None or an int in 1..{len(self.rows)}, "
                             f"got {self.top_k!r}")

    @property
    def shares(self) -> tuple[float, ...]:
        """The fraction of the routed rows each expert received (they sum to 1)."""
        total = sum(self.rows)
        return tuple(r / total for r in self.rows)

    @property
    def imbalance(self) -> float:
        """The busiest expert's rows over the mean (1.0: perfectly even)."""
        return max(self.rows) * len(self.rows) / sum(self.rows)


@dataclasses.dataclass(frozen=True)
class ExpertLoad:
    """The measured load of every MoE block of a model (see the module docstring); pass it as
    ``autotp.PlanOptions(expert_load=...)``.

    Attributes:
        blocks: one :class:`BlockLoad` per block, in the order the model ran them.
        batches: how many calibration batches were counted.
    """

    blocks: tuple[BlockLoad, ...]
    batches: int = 0
    version: int = EXPERT_LOAD_FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not all(isinstance(b, BlockLoad) for b in self.blocks):
            raise TypeError("ExpertLoad.blocks holds BlockLoad values (autotp.measure_expert_load makes them)")
        seen: dict[str, int] = {}
        for index, block in enumerate(self.blocks):
            for weight in block.weights:
                if seen.setdefault(weight, index) != index:
                    raise ValueError(f"{weight} names two blocks of this ExpertLoad; give each weight once")
        if self.version != EXPERT_LOAD_FORMAT_VERSION:
            raise ValueError(f"expert load format version {self.version} is not {EXPERT_LOAD_FORMAT_VERSION}: "
                             "measure it again with this release (autotp.measure_expert_load)")

    def block(self, weight: str) -> BlockLoad | None:
        """The block one of whose expert weights is ``weight`` (a FQN), or None."""
        return next((b for b in self.blocks if weight in b.weights), None)

    def __str__(self) -> str:
        lines = [f"expert load of {len(self.blocks)} blocks over {self.batches} batches "
                 "(busiest expert's rows / mean):"]
        lines += [f"  {b.weights[0]}: {len(b.rows)} experts, top-{b.top_k or '?'}, {sum(b.rows)} rows, "
                  f"{b.imbalance:.2f}x" for b in self.blocks]
        return "\n".join(lines)

    def to_json(self, *, indent: int | None = 1) -> str:
        """The load as JSON (read back with :meth:`from_json`)."""
        return json.dumps(dataclasses.asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ExpertLoad:
        """Read :meth:`to_json`'s text; a ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            blocks = tuple(BlockLoad(tuple(b["weights"]), tuple(b["rows"]), b.get("top_k")) for b in data["blocks"])
            return cls(blocks, int(data.get("batches", 0)), int(data.get("version", EXPERT_LOAD_FORMAT_VERSION)))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"not an expert load written by ExpertLoad.to_json: {error}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the load to ``path`` as JSON."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExpertLoad:
        """Read a load written by :meth:`save`."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"cannot read expert load {str(path)!r}: {error}") from None
        return cls.from_json(text)


def check_expert_load(value: object) -> ExpertLoad | None:
    """``PlanOptions.expert_load`` resolved: None, an :class:`ExpertLoad`, or the path of one saved as JSON."""
    if value is None or isinstance(value, ExpertLoad):
        return value
    if isinstance(value, (str, os.PathLike)):
        return ExpertLoad.load(value)
    raise TypeError(f"expert_load takes an autotp.ExpertLoad (from autotp.measure_expert_load) or the path of one "
                    f"saved with ExpertLoad.save, got {type(value).__name__}")


def with_expert_load(graph: StrategyGraph, load: ExpertLoad | None) -> StrategyGraph:
    """``graph`` with the measured shares of every MoE block that ``load`` names attached to its grouped GEMMs
    (:attr:`~autotp.passes.strategies.StrategyGraph.expert_shares`; module docstring). A PlanError when a named
    block has another number of experts, or when the graph has blocks and ``load`` names none of them."""
    if load is None:
        return graph
    blocks = find_expert_blocks(graph)
    shares: dict[str, tuple[float, ...]] = {}
    matched = 0
    for block in blocks:
        fqns = [graph.parameters.get(w, w) for w in block.weights]
        found = next((m for m in (load.block(f) for f in fqns) if m is not None), None)
        if found is None:
            continue
        if len(found.rows) != block.experts:
            raise PlanError(f"the expert load of {found.weights[0]} counts {len(found.rows)} experts, but the block "
                            f"{block.module} has {block.experts}: measure the load on this model "
                            "(autotp.measure_expert_load)")
        matched += 1
        shares.update(dict.fromkeys(block.gemms, found.shares))
    if blocks and not matched:
        named = ", ".join(graph.parameters.get(b.weights[0], b.weights[0]) for b in blocks[:3])
        raise PlanError(f"PlanOptions(expert_load=...) names none of this model's {len(blocks)} mixture-of-experts "
                        f"blocks (it names {', '.join(b.weights[0] for b in load.blocks[:3])}; the graph's blocks "
                        f"read {named}): measure the load on this model with autotp.measure_expert_load")
    return dataclasses.replace(graph, expert_shares=shares)


def measured_blocks(graph: StrategyGraph) -> tuple[tuple[str, float], ...]:
    """``(module, busiest expert's rows / mean)`` of every MoE block of ``graph`` priced for a measured load
    (``Plan.expert_load_imbalance``, which the plan's text and ``autotp.explain`` give)."""
    found = []
    for block in find_expert_blocks(graph):
        shares = graph.expert_shares.get(block.gemms[0])
        if shares is not None:
            found.append((block.module, max(shares) * len(shares)))
    return tuple(found)
