"""The rule table: op -> rule, and op -> rank-local form.

A *rule* is a pure function ``rule(node, ctx) -> list[Strategy]`` that reads only
``node.meta["val"]`` shapes and the node's arguments; rules know ops, never models. The
decorator :func:`register_rule` fills :data:`RULES`; :func:`strategies_for` adds the
all-``Replicate`` strategy every op has, so the solver always has a correct choice.

A *local form* (:func:`register_local_form`) is how the rewrite emits an op whose rank-local
call differs from the global one under some strategy (a vocabulary-split embedding looks up
only its own rows; a grouped convolution runs its own groups). It sits in the same family
module as the op's rule, so the knowledge of one op lives in one place.

A *rule extension* (:func:`register_rule_extension`) adds strategies to an op's own rule from another
module: the strategies of one placement that several op families pass through (experts placed whole,
:mod:`.experts`), kept beside the op that makes that placement.

Keys are op overloads (``aten.mm.default``) or, for ops of libraries that may not be imported
(custom ops such as ``transformers::grouped_mm_fallback``), the overload's qualified name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch.fx as fx

from autotp.adapters.torch_internals import OpOverload
from autotp.base.placements import Replicate
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import tensor_inputs

if TYPE_CHECKING:
    from autotp.passes.uneven import Partitions

__all__ = [
    "LOCAL_FORMS", "LOCAL_FORM_KERNELS", "LOCAL_WORK", "OP_COLLECTIVES", "RULES", "RULE_EXTENSIONS", "LocalForm",
    "LocalFormKernels", "LocalGraph", "LocalWork", "LocalWorkOf", "OpCollectives", "Rule", "RuleContext", "has_rule",
    "local_form_for", "local_form_kernels_for", "local_work_for", "op_collectives_for", "register_local_form",
    "register_local_form_kernels", "register_local_work", "register_op_collectives", "register_rule",
    "register_rule_extension", "replicated", "rule_for", "strategies_for",
]


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule may know beyond the node: the mesh axis size and the graph's block counts.

    ``block_counts``: the k of every equal k-way ``split``/``chunk`` in the graph; GEMMs and
    views offer ``BlockShard(d, k)`` for these k only (fused projections split per block).
    ``split_random``: sampling ops (dropout, attention with ``dropout_p``) may run on split
    activations, each rank drawing from its own stream (:mod:`autotp.passes.random_streams`);
    otherwise they are offered replicated only, so every rank draws the same mask.
    """

    world_size: int
    block_counts: frozenset[int] = frozenset()
    split_random: bool = False
    place_experts: bool = False
    """Grouped GEMMs over 3-D expert weights may place whole experts on ranks (:mod:`.experts`): on where the graph
    has one, off in training plans, whose backward the expert-placed op does not have."""
    routed_rows: frozenset[int] = frozenset()
    """The static row counts (tokens x top-k) of the graph's expert grouped GEMMs where experts may be placed: values
    of that many rows may be computed by each rank from its own tokens (``S(local)``, :mod:`.experts`); empty where
    the token dim is dynamic (never split), so no other op is offered those placements."""


class LocalGraph(Protocol):
    """What a local form (or a resharding step) may use of the rewrite's graph builder for one rank."""

    graph: fx.Graph
    parts: Partitions
    rank: int
    world_size: int
    group_name: str  # the process group collectives are issued on

    def call(self, target: object, *args: object, meta_from: fx.Node | None = None) -> fx.Node:
        """Emit ``target(*args)`` into the rank-local graph, copying source metadata from ``meta_from``."""
        ...


Rule = Callable[[fx.Node, RuleContext], list[Strategy]]
LocalForm = Callable[[LocalGraph, fx.Node, tuple, dict, Strategy], "fx.Node | None"]
"""``emit(builder, node, local_args, local_kwargs, strategy)``: emits the op's rank-local form and
returns its node, or ``None`` when the op runs unchanged under this strategy."""

OpCollectives = Callable[[fx.Node, Strategy, int], tuple[tuple[str, int], ...]]
"""``collectives(node, strategy, world_size)``: the ``(kind, bytes of the whole tensor)`` of each
collective the op's rank-local form issues itself under ``strategy`` (e.g. a vocabulary-parallel cross-entropy's all-gather of
two values per row); the cost pass adds their time to the strategy's."""

LocalFormKernels = Callable[[fx.Node, Strategy, int], tuple[tuple[object, int], ...]]
"""``kernels(node, strategy, world_size)``: the ``(op, bytes it reads and writes)`` of each op the op's rank-local
form runs besides the op itself under ``strategy`` (a vocabulary-split embedding's masking of the ids it does not
hold), in the order it emits them; a view moves 0 bytes. The cost pass prices each as a kernel node of its own
(a view as a view)."""


@dataclasses.dataclass(frozen=True)
class LocalWork:
    """The busiest rank's work of an op whose load is not its split share (experts placed by the router's choice):
    FLOPs, bytes read and written, and the ``(m, n, k)`` of one of its GEMMs (None: not a GEMM)."""

    flops: float
    nbytes: float
    gemm_dims: tuple[int, int, int] | None = None


LocalWorkOf = Callable[[fx.Node, Strategy, int, tuple[float, float], "tuple[float, ...] | None"], "LocalWork | None"]
"""``work(node, strategy, world_size, (flops, nbytes), shares)``: the busiest rank's :class:`LocalWork` under
``strategy``, given its split share of the op's FLOPs and of its tensors' bytes (as for any op; None: that share);
the cost pass prices it instead. ``shares``: the measured fraction of the op's rows per group (a router's load
per expert, :attr:`autotp.passes.strategies.StrategyGraph.expert_shares`), None: spread evenly."""

RULES: dict[object, Rule] = {}
LOCAL_WORK: dict[object, LocalWorkOf] = {}
RULE_EXTENSIONS: dict[object, list[Rule]] = {}
LOCAL_FORMS: dict[object, LocalForm] = {}
OP_COLLECTIVES: dict[object, OpCollectives] = {}
LOCAL_FORM_KERNELS: dict[object, LocalFormKernels] = {}


def _registering(table: dict[object, Callable], ops: tuple[object, ...]) -> Callable[[Callable], Callable]:
    """A decorator that enters what it decorates in ``table`` for each op overload (or qualified op name) in
    ``ops``, and returns it unchanged."""

    def wrap(entry: Callable) -> Callable:
        for op in ops:
            table[op] = entry
        return entry

    return wrap


def register_rule(*ops: object) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule`` for each op overload (or qualified op name, ``"ns::op"``) in ``ops``."""
    return _registering(RULES, ops)


def register_rule_extension(*ops: object) -> Callable[[Rule], Rule]:
    """Decorator: add ``rule``'s strategies to those of each op in ``ops`` (see module docstring)."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            RULE_EXTENSIONS.setdefault(op, []).append(rule)
        return rule

    return wrap


def register_local_work(*ops: object) -> Callable[[LocalWorkOf], LocalWorkOf]:
    """Decorator: register the busiest rank's work of each op in ``ops`` (see :data:`LocalWorkOf`)."""
    return _registering(LOCAL_WORK, ops)


def local_work_for(target: object) -> LocalWorkOf | None:
    """The busiest rank's work of an op (``None``: its split share, as for any op)."""
    return _lookup(LOCAL_WORK, target)


def register_local_form(*ops: object) -> Callable[[LocalForm], LocalForm]:
    """Decorator: register the rank-local form of each op in ``ops`` (see module docstring)."""
    return _registering(LOCAL_FORMS, ops)


def register_op_collectives(*ops: object) -> Callable[[OpCollectives], OpCollectives]:
    """Decorator: register the collectives the rank-local form of each op in ``ops`` issues itself."""
    return _registering(OP_COLLECTIVES, ops)


def register_local_form_kernels(*ops: object) -> Callable[[LocalFormKernels], LocalFormKernels]:
    """Decorator: register the ops the rank-local form of each op in ``ops`` runs besides the op itself."""
    return _registering(LOCAL_FORM_KERNELS, ops)


def _lookup(table: dict[object, Callable], target: object) -> Callable | None:
    """Entry of ``target`` in ``table``: by overload, else by its qualified name."""
    found = table.get(target)
    if found is None and isinstance(target, OpOverload):
        found = table.get(target.name())
    return found


def rule_for(target: object) -> Rule | None:
    """The rule of an op overload: registered by overload, else by its qualified name."""
    return _lookup(RULES, target)


def local_form_for(target: object) -> LocalForm | None:
    """The rank-local form of an op overload (``None``: the op runs as captured)."""
    return _lookup(LOCAL_FORMS, target)


def op_collectives_for(target: object) -> OpCollectives | None:
    """The collectives an op's rank-local form issues itself (``None``: none under any strategy)."""
    return _lookup(OP_COLLECTIVES, target)


def local_form_kernels_for(target: object) -> LocalFormKernels | None:
    """The ops an op's rank-local form runs besides the op itself (``None``: the op alone under any strategy)."""
    return _lookup(LOCAL_FORM_KERNELS, target)


def has_rule(node: fx.Node) -> bool:
    """True when ``node`` is covered by a sharding rule (placeholders and outputs always are)."""
    return node.op in ("placeholder", "output") or rule_for(node.target) is not None


def replicated(node: fx.Node) -> Strategy:
    """The all-``Replicate`` strategy of ``node``: always correct."""
    return Strategy(tuple(Replicate() for _ in tensor_inputs(node)), Replicate())


def strategies_for(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """All candidate strategies of ``node``; the all-replicate one is always first."""
    base = replicated(node)
    rule = rule_for(node.target) if node.op == "call_function" else None
    found = rule(node, ctx) if rule is not None else []
    if node.op == "call_function":
        extensions = RULE_EXTENSIONS.get(node.target, [])
        if not extensions and isinstance(node.target, OpOverload):
            extensions = RULE_EXTENSIONS.get(node.target.name(), [])
        for extension in extensions:
            found = [*found, *extension(node, ctx)]
    unique = [base]
    for strategy in found:
        if len(strategy.inputs) != len(base.inputs):
            raise AssertionError(f"rule for {node.target} returned {len(strategy.inputs)} input placements, expected {len(base.inputs)}")
        if strategy not in unique:
            unique.append(strategy)
    return unique
