"""What a rank-local model is, as the functions behind its methods read it: the generation graphs a model compiled
with ``max_cache_len`` carries (:class:`GenerationGraphs`, :class:`PhaseGraph`) and :class:`RankLocalModel`, the
attributes and methods of a :class:`~autotp.runtime.execution.module.TensorParallelModule` that ``generate``, ``tp.save`` and
the training helpers use. ``module.py`` builds the class on these and imports those functions; they name this
protocol, not the class, so the imports run one way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.fx as fx

from autotp.capture.kv_cache import CacheLayout
from autotp.planning.phases import PhaseWeighting
from autotp.planning.plan import Plan

__all__ = ["GenerationGraphs", "PhaseGraph", "RankLocalModel"]


@dataclasses.dataclass(frozen=True, eq=False)
class PhaseGraph:
    """A generation graph beside the decode graph: ``graph_module`` (rank-local), ``inputs`` (per placeholder, the
    decode graph's slot name whose tensor it takes — weights and cache are shared — or the index of the user
    input) and its ``plan``."""

    graph_module: fx.GraphModule
    inputs: tuple[str | int, ...]
    plan: Plan


@dataclasses.dataclass(frozen=True)
class GenerationGraphs:
    """What a model compiled with ``max_cache_len`` adds (see :mod:`autotp.runtime.generation.compile_for_generation`).

    ``prefill``: the graph of a prompt's first chunk (attends to the chunk only; ``None`` when prompts go
    one token per call); ``continuation``: the graph of a longer prompt's later chunks (attends to the
    cache; ``None`` when no prompt can be longer than a chunk); ``weighting``: how the shared placement
    was chosen (:mod:`autotp.planning.phases`; ``None`` without a prefill graph or with a given ``plan=``).
    """

    layout: CacheLayout
    prefill: PhaseGraph | None
    continuation: PhaseGraph | None = None
    decode_plan: Plan | None = None
    weighting: PhaseWeighting | None = None

    @property
    def prefill_plan(self) -> Plan | None:
        """The plan of a prompt's first chunk (the prefill phase the placements were weighed with)."""
        return self.prefill.plan if self.prefill is not None else None

    def __str__(self) -> str:
        """How the phases were weighed, then the phases' plans (decode first)."""
        layout = self.layout
        parts = [f"KV cache: {layout.batch_size} rows x {layout.max_cache_len} slots"]
        placed_by = self.weighting.chosen.placed_by if self.weighting is not None else "decode"
        if self.weighting is not None:
            parts.append(str(self.weighting))
        if self.decode_plan is not None:
            how = "places the weights and the cache" if placed_by == "decode" else "placements pinned to prefill's"
            parts.append(f"== decode (1 token per row; {how}) ==\n{self.decode_plan}")
        if self.prefill is not None:
            how = "places the weights and the cache" if placed_by == "prefill" else "placements pinned to decode's"
            parts.append(f"== prefill (a prompt's first {layout.prefill_len} tokens per row; {how}) ==\n"
                         f"{self.prefill.plan}")
        if self.continuation is not None:
            parts.append(f"== continuation (a longer prompt's later chunks of {layout.prefill_len} tokens; placements "
                         f"pinned) ==\n{self.continuation.plan}")
        return "\n".join(parts)


class RankLocalModel(Protocol):
    """One rank's compiled model as :func:`autotp.runtime.generation.generate.generate`, :func:`autotp.runtime.checkpoints.saving.save_sharded`
    and :mod:`autotp.runtime.training.trainable` read it (:class:`~autotp.runtime.execution.module.TensorParallelModule` is one)."""

    plan: Plan
    rank: int
    world_size: int
    runtime_mode: str
    layout: dict[str, tuple[tuple[int, ...], list[Any] | None]]
    generation: GenerationGraphs | None
    generation_config: Any
    generation_on_demand: Callable[[Any, torch.Tensor, int], Any] | None
    state_dict_aliases: dict[str, tuple[str, ...]] | None

    @property
    def group(self) -> Any: ...

    def local_state(self) -> dict[str, torch.Tensor]: ...

    def phase_runner(self, phase: str) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...
