"""Planning options: one frozen value, validated where it is built, passed by keyword.

:class:`PlanOptions` carries everything :func:`autotp.planning.planner.plan_graph` needs besides
the captured graph: the world size, the hardware profile to cost on, the memory budget, the
solver's time limit, strictness about ops without a sharding rule, user constraints, and an
optional filter on the strategy graph (the Megatron reference plan pins GEMM weights with one).
``autotp.plan``, ``autotp.compile``, the ``torch.compile`` backend and ``autotp plan`` all build
one from their keyword arguments, so a bad value fails before any tracing, with what to pass.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from autotp.cost_model import Hardware, get_hardware
from autotp.passes.backward import DEFAULT_OPTIMIZER_STATES

if TYPE_CHECKING:
    from autotp.passes.strategies import StrategyGraph
    from autotp.planning.constraints import Constraints

__all__ = ["DEFAULT_HARDWARE", "PlanOptions", "check_world_size"]

DEFAULT_HARDWARE = "h100-sxm"

StrategyFilter = Callable[["StrategyGraph"], "StrategyGraph"]


def check_world_size(world_size: object) -> int:
    """``world_size`` if it is an int >= 1; otherwise a ValueError that says what to pass."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); e.g. world_size=4")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}; pass the number of ranks to split over, e.g. world_size=4")
    return world_size


def _check_memory_budget(memory_budget: object) -> float | str | None:
    if memory_budget is None or memory_budget == "auto":
        return memory_budget  # type: ignore[return-value]
    if isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool) and memory_budget > 0:
        return float(memory_budget)
    raise ValueError(
        f"memory_budget must be 'auto', None (no limit) or a positive number of bytes per rank, got {memory_budget!r}; "
        "e.g. memory_budget=20 * 2**30"
    )


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan a captured graph (see :func:`autotp.plan` for the meaning of each option).

    Attributes:
        world_size: ranks of the tensor-parallel group (int >= 1).
        hardware: the profile to cost on; a name from :data:`autotp.cost_model.KNOWN_HARDWARE`,
            a :class:`~autotp.cost_model.Hardware`, or the path of a JSON profile. Resolved to a
            :class:`~autotp.cost_model.Hardware` when the options are built.
        memory_budget: most parameter bytes one rank may hold: ``"auto"`` (every matrix split
            along some dim), ``None`` (no limit) or a positive number of bytes (kept as float).
        strict: raise :class:`~autotp.UnsupportedOpError` instead of running ops without a
            sharding rule replicated.
        time_limit_s: the MILP solver's wall-clock limit, seconds (> 0).
        progress: print what planning does to stderr.
        constraints: ``{fnmatch pattern: placement}`` pinning parameters or nodes
            (:mod:`autotp.planning.constraints`); validated here, kept as placement text.
        strategy_filter: ``StrategyGraph -> StrategyGraph`` applied before ``constraints``; it
            may only narrow each node's candidates (e.g. the Megatron reference's pinning).
        training: plan a training step: price forward *and* backward (each resharding's adjoint,
            backward compute), and count gradients, optimizer state and the activations kept
            for the backward in memory (:mod:`autotp.passes.backward`).
        outputs: ``"replicated"`` (default: every output whole on every rank) or ``"local"``
            (each output in the placement it is computed in, no gather: :mod:`autotp.planning.outputs`).
        dropout: ``"replicated"`` (default: every dropout mask drawn whole, the same on every rank)
            or ``"split"`` (dropout may run on split activations, from per-rank random streams:
            :mod:`autotp.passes.random_streams`).
        activation_checkpointing: ``None`` or ``"blocks"`` (with ``training``): the plan's activation
            bytes and time count checkpointed blocks (:func:`autotp.passes.backward.checkpointed_blocks_price`).
        optimizer_states: with ``training``, fp32 values the optimizer keeps per parameter
            element (default 2: AdamW's two moments; SGD with momentum 1, plain SGD 0).
    """

    world_size: int
    hardware: str | Hardware | os.PathLike[str] = DEFAULT_HARDWARE
    memory_budget: float | int | str | None = "auto"
    strict: bool = False
    time_limit_s: float = 60.0
    progress: bool = False
    constraints: Constraints | None = None
    strategy_filter: StrategyFilter | None = None
    training: bool = False
    optimizer_states: int = DEFAULT_OPTIMIZER_STATES
    outputs: str = "replicated"
    dropout: str = "replicated"
    activation_checkpointing: str | None = None

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        object.__setattr__(self, "memory_budget", _check_memory_budget(self.memory_budget))
        for flag in ("strict", "progress", "training"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        from autotp.passes.random_streams import check_dropout
        from autotp.planning.outputs import check_outputs
        from autotp.runtime.checkpointing import check_activation_checkpointing

        check_outputs(self.outputs)
        check_dropout(self.dropout)
        check_activation_checkpointing(self.activation_checkpointing, self.training)
        states = self.optimizer_states
        if isinstance(states, bool) or not isinstance(states, int) or states < 0:
            raise ValueError(f"optimizer_states must be an int >= 0 (fp32 values the optimizer keeps per parameter "
                             f"element), got {states!r}; e.g. optimizer_states=2 for AdamW, 1 for SGD with momentum")
        limit = self.time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"time_limit_s must be a positive number of seconds, got {limit!r}; e.g. time_limit_s=60")
        if self.constraints is not None:
            from autotp.planning.constraints import normalize_constraints

            normalized = normalize_constraints(self.constraints)
            object.__setattr__(self, "constraints", normalized or None)
        if self.strategy_filter is not None and not callable(self.strategy_filter):
            raise TypeError(f"strategy_filter must be a function StrategyGraph -> StrategyGraph, got "
                            f"{type(self.strategy_filter).__name__}")

    @property
    def hardware_profile(self) -> Hardware:
        """The resolved :class:`~autotp.cost_model.Hardware` (``hardware`` after validation)."""
        return get_hardware(self.hardware)
