"""``autotp.to_parallelize_plan(plan)``: the plan in PyTorch's own words, where it has them.

``torch.distributed.tensor.parallel.parallelize_module(model, mesh, plan)`` takes a dict from
module FQN to a ``ParallelStyle``. This module reads an autotp :class:`~autotp.planning.plan.Plan` and
writes that dict:

=====================================  ==============================================
autotp decided                          ParallelStyle
=====================================  ==============================================
linear, weight ``S(0)`` (out features)  ``ColwiseParallel`` (bias ``S(0)``)
linear, weight ``S(1)`` (in features)   ``RowwiseParallel`` (bias ``R``)
embedding, weight ``S(1)`` / ``S(0)``   ``ColwiseParallel`` / ``RowwiseParallel``
replicated weights, sequence-split in   ``SequenceParallel`` (e.g. a norm)
and out
=====================================  ==============================================

``input_layouts`` / ``output_layouts`` come from the placements the plan gives the module's
input and output and from the collectives on them: an all-gather of a sequence-split input
becomes ``input_layouts=Shard(1)``, an all-reduce after a row-parallel linear
``output_layouts=Replicate()``, a reduce-scatter ``output_layouts=Shard(1)``...

Everything else is listed in :attr:`ParallelizePlan.unexpressed`: modules split in ways no
style describes (fused projections split per block, weights split with replicated
activations...), collectives that no style would issue, and uneven splits (DTensor cuts a
dim into ``ceil(n / N)`` chunks, autotp on whole-head boundaries). Between the styled
modules, as in any ``parallelize_module`` plan, the model's own code runs on local shards.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from autotp.base.reshard import ReshardKind
from autotp.passes.resharding import route_label
from autotp.planning.decisions import CollectiveDecision, NodeDecision
from autotp.planning.plan import Plan

__all__ = ["ParallelizePlan", "to_parallelize_plan"]

_LINEAR = "aten.linear.default"
_EMBEDDING = "aten.embedding.default"


@dataclasses.dataclass(frozen=True)
class ParallelizePlan:
    """A ``parallelize_module`` plan and what of the autotp plan it leaves out.

    ``plan``: module FQN -> ``ParallelStyle``, ready for
    ``parallelize_module(model, device_mesh, export.plan)``.
    ``unexpressed``: one line per part of the autotp plan no style expresses (empty: the
    plan is complete). ``notes``: expressed, but not identically (e.g. more collectives).
    """

    plan: dict[str, Any]
    unexpressed: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """True when ``plan`` does everything the autotp plan does."""
        return not self.unexpressed

    def __str__(self) -> str:
        lines = ["{"]
        lines += [f"    {fqn!r}: {style!r}," for fqn, style in self.plan.items()]
        lines.append("}")
        if self.unexpressed:
            lines.append("not expressible as ParallelStyles:")
            lines += [f"  - {line}" for line in self.unexpressed]
        if self.notes:
            lines.append("notes:")
            lines += [f"  - {line}" for line in self.notes]
        return "\n".join(lines)


def _placement(text: str) -> Any:
    from autotp.base.placements import placement_from_str

    return placement_from_str(text)


def _split_dim(placement: str) -> int | None:
    if placement.startswith("S(") and ")" in placement:
        return int(placement[2:placement.index(")")])
    return None


def _last_dim(node: NodeDecision) -> int:
    return len(node.shape) - 1


class _Exporter:
    def __init__(self, plan: Plan, model: Any | None) -> None:
        self.plan = plan
        self.model = model
        self.nodes = {n.name: n for n in plan.nodes}
        self.readers: dict[str, list[NodeDecision]] = defaultdict(list)
        for n in plan.nodes:
            for p in n.input_nodes:
                self.readers[p].append(n)
        self.out_collectives: dict[str, list[CollectiveDecision]] = defaultdict(list)
        for c in plan.collectives:
            self.out_collectives[c.producer].append(c)
        self.covered: set[int] = set()
        self.input_readers: dict[int, set[str]] = defaultdict(set)  # collective -> styled ops it feeds
        self.styles: dict[str, Any] = {}
        self.unexpressed: list[str] = []
        self.notes: list[str] = []

    # ------------------------------------------------------------------ helpers
    def module_type_ok(self, fqn: str, kinds: tuple[str, ...]) -> bool:
        if self.model is None:
            return True
        import torch

        try:
            module = self.model.get_submodule(fqn)
        except AttributeError:
            self.unexpressed.append(f"{fqn}: not a submodule of the given model")
            return False
        wanted = {"linear": torch.nn.Linear, "embedding": torch.nn.Embedding}
        if not any(isinstance(module, wanted[k]) for k in kinds):
            self.unexpressed.append(f"{fqn}: a {type(module).__name__}; ColwiseParallel/RowwiseParallel "
                                    "apply to nn.Linear and nn.Embedding only")
            return False
        return True

    def output_layout(self, op: NodeDecision, natural: Any, fqn: str) -> Any | None:
        """The output layout the collectives after ``op`` produce (``natural`` without any)."""
        collectives = [(i, c) for i, c in enumerate(self.plan.collectives) if c.producer == op.name]
        if not collectives:
            return natural
        dsts = {c.dst for _, c in collectives}
        readers = {r.name for r in self.readers[op.name]}
        via = {x for _, c in collectives for x in c.consumers}
        if len(dsts) > 1 or via != readers:
            self.unexpressed.append(
                f"{fqn}: its output is needed as {', '.join(sorted(dsts | ({op.output} if via != readers else set())))} "
                "by different readers; a ParallelStyle gives one output layout")
            return None
        self.covered.update(i for i, _ in collectives)
        return _placement(next(iter(dsts)))

    def input_layout(self, op: NodeDecision, fqn: str, want: str) -> Any | None:
        """The input layout of a styled module whose op reads its first input as ``want``."""
        producer = self.nodes[op.input_nodes[0]]
        if producer.output == want:
            return _placement(want)
        for i, c in enumerate(self.plan.collectives):
            if c.producer == producer.name and op.name in c.consumers:
                self.covered.add(i)
                self.input_readers[i].add(op.name)
                sharing = [x for x in c.consumers if x != op.name]
                if sharing and c.steps and c.steps[0] is not ReshardKind.SLICE:
                    self.notes.append(f"{fqn}: redistributes its input {producer.name} ({c.src}->{c.dst}) itself; "
                                      f"autotp does it once for {len(c.consumers)} readers")
                return _placement(producer.output)
        return _placement(producer.output)

    # ------------------------------------------------------------------ styles
    def split_module(self, fqn: str, params: dict[str, NodeDecision]) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        weight = params.get("weight")
        bias = params.get("bias")
        if weight is None or set(params) - {"weight", "bias"}:
            self.unexpressed.append(f"{fqn}: parameters {', '.join(sorted(params))} split as "
                                    f"{', '.join(p.output for p in params.values())}; no style splits these")
            return
        readers = self.readers[weight.name]
        ops = {r.op for r in readers}
        if not readers:
            self.unexpressed.append(f"{fqn}.weight ({weight.output}) is read by no op of the graph (tied to another weight?)")
            return
        if len(readers) != 1 or ops - {_LINEAR, _EMBEDDING}:
            self.unexpressed.append(f"{fqn}.weight ({weight.output}) is read by {', '.join(r.name for r in readers) or 'nothing'} "
                                    f"({', '.join(sorted(ops))}); styles describe one linear or embedding")
            return
        op = readers[0]
        embedding = op.op == _EMBEDDING
        if not self.module_type_ok(fqn, ("embedding",) if embedding else ("linear",)):
            return
        colwise_dim, rowwise_dim = (1, 0) if embedding else (0, 1)
        last = _last_dim(op)
        if weight.output == f"S({colwise_dim})":
            if bias is not None and bias.output != "S(0)":
                self.unexpressed.append(f"{fqn}: column-parallel weight with bias {bias.output} (ColwiseParallel splits the bias)")
                return
            if op.output != f"S({last})":
                self.unexpressed.append(f"{fqn}: column-parallel weight but output {op.output} (ColwiseParallel gives Shard(-1))")
                return
            inp = Replicate() if embedding else self.input_layout(op, fqn, "R")
            out = self.output_layout(op, Shard(-1), fqn)
            if inp is None or out is None:
                return
            self.styles[fqn] = ColwiseParallel(input_layouts=inp, output_layouts=out)
        elif weight.output == f"S({rowwise_dim})":
            if bias is not None and bias.output != "R":
                self.unexpressed.append(f"{fqn}: row-parallel weight with bias {bias.output} (RowwiseParallel replicates the bias)")
                return
            if op.output != "P":
                self.unexpressed.append(f"{fqn}: row-parallel weight but output {op.output} (RowwiseParallel sums a partial output)")
                return
            inp = Replicate() if embedding else self.input_layout(op, fqn, f"S({last})")
            out = self.output_layout(op, None, fqn)
            if out is None:
                if not any(m.startswith(f"{fqn}:") for m in self.unexpressed):
                    self.unexpressed.append(f"{fqn}: its partial sums flow on unreduced into {', '.join(r.name for r in self.readers[op.name])}")
                return
            if inp is None:
                return
            if not embedding and inp == Shard(last):
                inp = Shard(-1)
            self.styles[fqn] = RowwiseParallel(input_layouts=inp, output_layouts=out)
            if bias is not None:  # the style adds the replicated bias once, after the sum
                self.covered.update(i for i, c in enumerate(self.plan.collectives)
                                    if c.producer == bias.name and set(c.steps) <= {ReshardKind.ZERO})
        else:
            self.unexpressed.append(f"{fqn}.weight is {weight.output}; only {'S(1) or S(0)' if embedding else 'S(0) or S(1)'} "
                                    f"map to ColwiseParallel/RowwiseParallel")

    def replicated_module(self, fqn: str, params: dict[str, NodeDecision]) -> None:
        from torch.distributed.tensor.parallel import SequenceParallel

        ops = [n for n in self.plan.nodes if n.module == fqn and n.op not in ("placeholder", "output")]
        placements = {p for n in ops for p in (*n.inputs, n.output)}
        if placements <= {"R"}:
            return  # whole weights, whole activations: nothing to say
        if placements == {"S(1)", "R"} and all(n.output == "S(1)" for n in ops if n.shape and len(n.shape) >= 3):
            self.styles[fqn] = SequenceParallel()
            return
        self.unexpressed.append(f"{fqn}: whole weights ({', '.join(sorted(params))}) computing on {', '.join(sorted(placements - {'R'}))} "
                                "activations; only SequenceParallel (split on dim 1) is a style for that")

    def run(self) -> ParallelizePlan:
        owners: dict[str, dict[str, NodeDecision]] = defaultdict(dict)
        for n in self.plan.nodes:
            if n.op == "placeholder" and n.target in self.plan.parameters:
                module, _, leaf = n.target.rpartition(".")
                owners[module][leaf] = n
        for fqn, params in owners.items():
            if any(p.output not in ("R",) for p in params.values()):
                self.split_module(fqn, params)
            else:
                self.replicated_module(fqn, params)
        uneven = [f"{p.target} dim {dim} ({p.shape[dim]})" for params in owners.values() for p in params.values()
                  if (dim := _split_dim(p.output)) is not None and dim < len(p.shape) and p.shape[dim] % self.plan.world_size]
        if uneven:
            self.unexpressed.append(
                f"{len(uneven)} parameter(s) split unevenly over {self.plan.world_size} ranks, where DTensor cuts "
                f"ceil(n/N) per rank but autotp cuts whole units (e.g. heads), so results would differ: "
                + ", ".join(uneven[:4]) + (" ..." if len(uneven) > 4 else ""))
        for i, readers in self.input_readers.items():
            c = self.plan.collectives[i]
            others = [x for x in c.consumers if x not in readers]
            if others:
                self.unexpressed.append(f"{route_label(c.steps)} of {c.producer} ({c.src}->{c.dst}) also feeds "
                                        f"{', '.join(others[:3])}, which no style redistributes")
        for i, c in enumerate(self.plan.collectives):
            if i not in self.covered:
                kind = route_label(c.steps)
                self.unexpressed.append(f"{kind} of {c.producer} ({c.src}->{c.dst}) for {', '.join(c.consumers[:3])}"
                                        f"{' ...' if len(c.consumers) > 3 else ''} in {c.module or 'the top level'}: "
                                        "no ParallelStyle above issues it")
        if self.plan.version < 2:
            self.unexpressed.insert(0, "format-v1 plan: no graph edges recorded; plan again to export it")
        return ParallelizePlan(dict(self.styles), tuple(dict.fromkeys(self.unexpressed)), tuple(dict.fromkeys(self.notes)))


def to_parallelize_plan(plan: Plan, model: Any | None = None) -> ParallelizePlan:
    """The ``parallelize_module`` plan equivalent to ``plan`` where one exists (see module doc).

    Pass ``model`` to check that each styled module has a type the style accepts.
    """
    return _Exporter(plan, model).run()
