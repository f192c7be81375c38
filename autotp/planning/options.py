"""Planning options: one frozen value, validated where it is built, passed by keyword.

:class:`PlanOptions` carries everything :func:`autotp.planning.planner.plan_graph` needs besides
the captured graph: the world size, the hardware profile to cost on, the memory budget, the
solver's time limit, strictness about ops without a sharding rule, user constraints, and an
optional filter on the strategy graph (the Megatron reference plan pins GEMM weights with one).
Every entry point (``autotp.plan``, ``autotp.compile``, the ``torch.compile`` backend,
``autotp.from_pretrained``, ``autotp plan``) builds the one it plans with through
:func:`plan_options`, from a user's ``options=PlanOptions(...)`` alone (the keywords some entry points once took
for these fields still work for one release, with a DeprecationWarning: :func:`moved_to_options`), so a bad
value or a bad combination fails before any tracing, with what to pass.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotp.cost_model import Hardware, get_hardware
from autotp.passes.backward import DEFAULT_OPTIMIZER_STATES
from autotp.passes.random_streams import check_dropout
from autotp.planning.expert_load import ExpertLoad, check_expert_load
from autotp.planning.experts import check_experts_option
from autotp.planning.outputs import check_outputs
from autotp.planning.phases import DEFAULT_EXPECTED_NEW_TOKENS, check_expected_new_tokens

if TYPE_CHECKING:
    from autotp.passes.strategies import StrategyGraph
    from autotp.planning.constraints import Constraints

__all__ = ["ACTIVATION_CHECKPOINTING", "DEFAULT_HARDWARE", "PlanOptions", "check_activation_checkpointing",
           "check_world_size", "moved_to_options", "options_taking", "plan_options",
           "search_options"]

DEFAULT_HARDWARE = "h100-sxm"

ACTIVATION_CHECKPOINTING = (None, "blocks")
"""Values of ``autotp.compile(..., activation_checkpointing=)``: none, or every repeated block."""

StrategyFilter = Callable[["StrategyGraph"], "StrategyGraph"]


def check_world_size(world_size: object) -> int:
    """``world_size`` if it is an int >= 1; otherwise a ValueError that says what to pass."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); e.g. world_size=4")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}; pass the number of ranks to split over, e.g. world_size=4")
    return world_size


def check_activation_checkpointing(value: object, training: bool) -> None:
    """Raise a :class:`ValueError` naming the fix for a bad ``activation_checkpointing=`` option."""
    if value not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={value!r}: expected None or 'blocks' (checkpoint every "
                         "repeated block, e.g. model.layers.N)")
    if value is not None and not training:
        raise ValueError("activation_checkpointing='blocks' needs training=True: it trades memory kept for the "
                         "backward against recomputation, and a model compiled for inference has no backward")


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

    Build one for ``autotp.plan(..., options=)`` or ``autotp.compile(..., options=)`` with the knobs to
    change, e.g. ``PlanOptions(strict=True, constraints={...})``; the entry point fills in ``world_size``.

    Attributes:
        world_size: ranks of the tensor-parallel group (int >= 1); ``None`` until an entry point sets it
            (``autotp.compile`` takes the group's size). :func:`~autotp.planning.planner.plan_graph` needs it.
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
        dynamic: trace the batch and sequence dims (dims 0 and 1 of every tensor input) as symbols,
            so the plan serves every size (only static dims are split); ``False`` pins every size to
            the example's (:mod:`autotp.capture.tracing`).
        dynamic_shapes: passed to ``torch.export`` as is, instead of what ``dynamic`` asks for.
        experts: the form of every mixture-of-experts block: ``"auto"`` (default: the solver picks),
            ``"placed"`` (whole experts on ranks), ``"dispatched"`` (whole experts on ranks, the tokens split across
            the ranks and sent to their experts' ranks by all-to-all; needs ``dynamic=False``) or ``"split"``
            (every rank a slice of each expert)
            (:mod:`autotp.planning.experts`).
        expert_load: the router's measured load per MoE block (an :class:`~autotp.planning.expert_load.ExpertLoad`
            from :func:`autotp.measure_expert_load`, or the path of one saved as JSON), to price each block by
            the rows its experts get on the user's data; ``None`` (default): a uniform router
            (:mod:`autotp.planning.expert_load`).
        expected_new_tokens: with ``max_cache_len`` (generation), decode steps per prompt: the weights
            are placed for the least predicted ``prefill + expected_new_tokens x decode``
            (:mod:`autotp.planning.phases`).
    """

    world_size: int | None = None
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
    dynamic: bool = True
    dynamic_shapes: Any = None
    expected_new_tokens: int = DEFAULT_EXPECTED_NEW_TOKENS
    experts: str = "auto"
    expert_load: ExpertLoad | str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.world_size is not None:
            check_world_size(self.world_size)
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        object.__setattr__(self, "memory_budget", _check_memory_budget(self.memory_budget))
        for flag in ("strict", "progress", "training", "dynamic"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        check_outputs(self.outputs)
        check_dropout(self.dropout)
        check_activation_checkpointing(self.activation_checkpointing, self.training)
        check_expected_new_tokens(self.expected_new_tokens)
        check_experts_option(self.experts, self.training)
        object.__setattr__(self, "expert_load", check_expert_load(self.expert_load))
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

    @property
    def ranks(self) -> int:
        """``world_size``, or a ValueError saying to set it (a planner needs the number of ranks)."""
        if self.world_size is None:
            raise ValueError("these PlanOptions have no world_size; pass PlanOptions(world_size=4, ...) to "
                             "plan_graph, or world_size= to autotp.plan")
        return self.world_size


_DEFAULTS = PlanOptions()


def plan_options(options: PlanOptions | None = None, *, world_size: int | None = None,
                 max_cache_len: int | None = None, mesh: bool = False) -> PlanOptions:
    """The options an entry point plans with: ``options`` (default ``PlanOptions()``) with ``world_size`` set.

    A ValueError for the combinations the entry point cannot run: ``dropout="split"`` without ``training``,
    ``max_cache_len`` (generation) with ``training`` or ``outputs="local"``, and ``mesh`` (a DeviceMesh run)
    with ``outputs="local"`` or ``dynamic_shapes``."""
    if options is None:
        options = _DEFAULTS
    elif not isinstance(options, PlanOptions):
        raise TypeError(f"options= takes an autotp.PlanOptions, got {type(options).__name__}; e.g. "
                        "options=autotp.PlanOptions(strict=True)")
    if world_size is not None:
        options = dataclasses.replace(options, world_size=check_world_size(world_size))
    if options.dropout != "replicated" and not options.training:
        raise ValueError("dropout='split' needs training=True: a model compiled for inference runs without dropout")
    if max_cache_len is not None and options.training:
        raise ValueError("training=True and max_cache_len= do not go together: the KV cache is for generation; "
                         "compile once with training=True to train and once with max_cache_len= to generate")
    if mesh and options.dynamic_shapes is not None:
        raise ValueError("dynamic_shapes= is not taken over a mesh: each stage is traced with the mesh's own "
                         "shapes (dynamic= still applies without pp); leave it out")
    if options.outputs != "replicated" and (mesh or max_cache_len is not None):
        raise ValueError("outputs='local' with a mesh or max_cache_len= is not supported: those return whole "
                         "outputs (generate() returns token ids); leave outputs= out")
    return options


def moved_to_options(caller: str, options: PlanOptions | None, moved: dict[str, Any], *,
                     taken: tuple[str, ...]) -> PlanOptions | None:
    """``options`` with the :class:`PlanOptions` fields that ``caller`` once took as its own keywords (``moved``,
    each one of ``taken``), and a :class:`DeprecationWarning` that says what to write instead.

    These spellings keep working for one release. A keyword ``caller`` never took is a TypeError, as Python's
    own; one that ``options`` sets too is a ValueError (give it once)."""
    unknown = sorted(set(moved) - set(taken))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if not moved:
        return options
    spelled = ", ".join(f"{name}={_shown(value)}" for name, value in moved.items())
    warnings.warn(f"{caller}(..., {spelled}) is deprecated: pass options=autotp.PlanOptions({spelled})",
                  DeprecationWarning, stacklevel=3)
    base = _DEFAULTS if options is None else plan_options(options)
    twice = [name for name in moved if getattr(base, name) != getattr(_DEFAULTS, name)]
    if twice:
        raise ValueError(f"{', '.join(twice)} given both as {caller}(..., {twice[0]}=) and in options=; give it once, "
                         f"in options=autotp.PlanOptions({twice[0]}=...)")
    return dataclasses.replace(base, **moved)


def _shown(value: object) -> str:
    """``value`` as it would be written in a call (a hardware profile by its name)."""
    return repr(value.name) if isinstance(value, Hardware) else repr(value)


def search_options(options: PlanOptions | None) -> PlanOptions:
    """``options`` for a search over data x pipeline x tensor parallelism, which takes only ``time_limit_s``
    and ``progress`` from them (each stage's plan is made when compiling); see :func:`options_taking`."""
    return options_taking(options, ("hardware", "time_limit_s", "progress"), caller="autotp.plan_mesh",
                          instead="plan a stage with autotp.plan, or pass them to autotp.compile_mesh")


def options_taking(options: PlanOptions | None, taken: tuple[str, ...], *, caller: str, instead: str) -> PlanOptions:
    """``options`` (default ``PlanOptions()``) for an entry point that reads only the fields ``taken`` (and
    ``world_size``); a ValueError names every other field set, which ``caller`` would ignore, and ``instead``."""
    options = plan_options(options)
    ignored = [field.name for field in dataclasses.fields(PlanOptions)
               if field.name not in (*taken, "world_size")
               and getattr(options, field.name) != getattr(_DEFAULTS, field.name)]
    if ignored:
        raise ValueError(f"{caller} takes {', '.join(f'{name}=' for name in taken)} from its options only, not "
                         f"{', '.join(f'{name}=' for name in ignored)}; {instead}")
    return options
