"""Sharding rules: for one ATen op, the placements its inputs and output may take.

One table (:data:`RULES`) maps an op overload to a rule; a rule is a pure function
``rule(node, ctx) -> list[Strategy]`` that reads only ``node.meta["val"]`` shapes and the
node's arguments. Rules know ops, never models: no module names, no model classes.

A :class:`~autotp.base.strategy.Strategy` lists one placement per *tensor input slot* of the
node (the fx.Node arguments in the order :func:`tensor_inputs` yields them) and one placement
for the output (for ops returning several tensors, e.g. ``split``, it applies to every output).

On a one-axis mesh every ``Shard`` placement in one strategy is the *same* split of the work:
the rewrite gives all of them one partition (``passes/uneven.py``), so e.g. the ``k`` dim of
both GEMM operands is cut at the same boundaries.

Every op also has the all-``Replicate`` strategy, so the solver always has a correct choice.
An op missing from the table gets only that one, and the plan reports it as a fallback.

Layout (one module per op family; each registers into the one table when imported here):

- :mod:`.registry`: the tables (rules and rank-local forms), :class:`RuleContext`, lookups;
- :mod:`.args`: reading a node's arguments, input slots and shapes (one helper each);
- :mod:`.builders`: strategy builders several families share (dim maps, broadcasting, blocks);
- families: :mod:`.elementwise` (and factories), :mod:`.views`, :mod:`.reductions`,
  :mod:`.norms`, :mod:`.matmul` (einsum-described GEMMs), :mod:`.attention`,
  :mod:`.embedding`, :mod:`.conv` (convolution, batch/group norm, pooling),
  :mod:`.grouped_mm` (mixture-of-experts GEMMs), :mod:`.experts` (experts placed whole on ranks), :mod:`.indexing` (gather/scatter/top-k/sort),
  :mod:`.symbolic` (size arithmetic of dynamic batch/sequence dims), :mod:`.losses`
  (vocabulary-parallel cross-entropy), :mod:`.quantized` (torchao's dequantization).

To add an op: write its rule in the family module it belongs to (or a new one imported below),
decorated with ``@register_rule(aten.op.overload)``; if its rank-local call differs from the
global one under some strategy, register that too with ``@register_local_form``; if that form
issues collectives itself, say which with ``@register_op_collectives`` (the cost pass prices them).
"""

from autotp.base.strategy import Strategy
from autotp.passes.rules import (  # noqa: F401 - imported to register their rules
    attention,
    conv,
    elementwise,
    embedding,
    experts,
    grouped_mm,
    indexing,
    losses,
    matmul,
    norms,
    quantized,
    reductions,
    symbolic,
    views,
)
from autotp.passes.rules.args import arg, tensor_inputs
from autotp.passes.rules.registry import (
    LOCAL_FORM_KERNELS,
    LOCAL_FORMS,
    OP_COLLECTIVES,
    RULES,
    LocalForm,
    LocalGraph,
    LocalWork,
    RuleContext,
    has_rule,
    local_form_for,
    local_form_kernels_for,
    local_work_for,
    op_collectives_for,
    register_local_form,
    register_local_form_kernels,
    register_op_collectives,
    register_rule,
    rule_for,
    strategies_for,
)
from autotp.passes.rules.views import block_counts, view_groups

__all__ = [
    "LOCAL_FORMS", "LOCAL_FORM_KERNELS", "OP_COLLECTIVES", "RULES", "LocalForm", "LocalGraph", "LocalWork", "RuleContext",
    "Strategy", "arg", "block_counts", "has_rule", "local_form_for", "local_form_kernels_for", "local_work_for",
    "op_collectives_for",
    "register_local_form", "register_local_form_kernels", "register_op_collectives", "register_rule", "rule_for",
    "strategies_for", "tensor_inputs", "view_groups",
]
