"""Runtime: run one rank's rewritten graph with that rank's parameter shards.

:class:`TensorParallelModule` is what :func:`autotp.compile` returns. It holds the
rank-local ``torch.fx.GraphModule``, the local shards of split parameters (sliced once from
the full weights at compile time; the full tensors are not kept), the replicated parameters
and buffers, and the pytree specs that give outputs the original structure (tensors,
tuples, dicts, HuggingFace ``ModelOutput``).

Shapes: the graph was traced with dynamic batch and sequence dims (see :mod:`autotp.capture.tracing`),
so one module serves every size with no re-trace; each call's sizes are first checked against
the traced ones (:class:`~autotp.runtime.execution.input_check.InputShapeCheck`), so a static dim called
at another size raises an error naming it instead of failing inside the graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.adapters.hf_transformers import call_kwargs
from autotp.capture.tracing import CapturedGraph
from autotp.passes.rewrite import count_collectives
from autotp.planning.outputs import output_placements
from autotp.planning.plan import Plan
from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S, InputGuard
from autotp.runtime.agreement.peer_failure import failure_notes
from autotp.runtime.execution.input_check import InputShapeCheck
from autotp.runtime.execution.rank_local import GenerationGraphs, PhaseGraph
from autotp.runtime.execution.runtime_modes import graph_runner
from autotp.runtime.training.trainable import (
    OriginalParameterCheck,
    full_state_dict,
    refuse_backward,
    state_dict_aliases,
)

__all__ = ["TensorParallelModule"]


def _leaf_inputs(in_spec: pytree.TreeSpec) -> tuple[int, dict[str, None]] | None:
    """``(positional count, keyword names in traced order)`` when every traced input was one leaf (each
    argument a tensor, not a container), else None: then a call with tensors alone flattens to its
    arguments in that order."""
    positional, keywords = in_spec.child(0), in_spec.child(1)
    if keywords.context is None and keywords.num_children:
        return None
    if not all(spec.is_leaf() for spec in (*positional.children(), *keywords.children())):
        return None
    return positional.num_children, dict.fromkeys(keywords.context or ())


class TensorParallelModule(torch.nn.Module):
    """One rank's tensor-parallel model: same call signature and outputs as the original.

    Attributes:
        plan: the :class:`~autotp.Plan` that was applied.
        graph_module: the rank-local ``torch.fx.GraphModule`` that runs.
        rank, world_size: this process's place in the tensor-parallel group.
        output_placements: per flattened output, what this rank returns: ``"R"`` (whole; every
            output unless compiled with ``outputs="local"``), ``"S(d)"`` (its block along dim ``d``)
            or ``"P"`` (a partial sum); see :mod:`autotp.planning.outputs`.
        runtime_mode: how the rank-local graphs run: ``"eager"``, ``"compiled"`` or ``"cuda_graph"``
            (:mod:`autotp.runtime.execution.runtime_modes`; compiled at each graph's first call).
    """

    def __init__(self, captured: CapturedGraph, graph_module: fx.GraphModule, plan: Plan,
                 local_values: dict[str, torch.Tensor], rank: int,
                 layout: dict[str, tuple[tuple[int, ...], list[Any] | None]] | None = None,
                 generation: GenerationGraphs | None = None, *, guard: InputGuard | None = None,
                 training: bool = False, original: torch.nn.Module | None = None, group: Any = None,
                 generation_on_demand: Callable[[TensorParallelModule, torch.Tensor, int], TensorParallelModule]
                 | None = None, runtime_mode: str = "eager", progress: bool = False) -> None:
        super().__init__()
        self.runtime_mode = runtime_mode
        self._progress = progress and rank == 0
        self._runners: dict[str, Callable[..., Any]] = {}  # phase -> its graph in runtime_mode, made on first use
        self.trains = training  # built for training (autotp.compile(..., options=PlanOptions(training=True))): see autotp.runtime.training.trainable
        self._group = group
        # a call that raises on this rank tells the others, whose collectives would wait for it (peer_failure.py)
        self._notes = failure_notes(group, timeout_s=guard.timeout_s if guard is not None else DEFAULT_AGREEMENT_TIMEOUT_S)
        self.layout = layout or {}  # see parameter_layout: what save() writes with global offsets
        self.generation = generation
        # a plain compile of a causal LM: (tp, input_ids, max_new_tokens) -> a module compiled for generation with
        # room for the request, built on first use (autotp.generation_on_demand)
        self.generation_on_demand = generation_on_demand
        # a generation compile: (tp, args, kwargs) -> the plain forward's module, built at the first call that is
        # not a decode step (autotp.runtime.generation.generation_on_demand.ForwardOnDemand)
        self.forward_on_demand: Callable[[TensorParallelModule, tuple, dict], TensorParallelModule] | None = None
        # the model's HF generation defaults (max_length, eos...), read by generate() where a call names none
        self.generation_config = getattr(original, "generation_config", None)
        self._hf_use_cache = captured.hf_use_cache  # a HF model: calls may pass use_cache= or not (autotp.adapters.hf_transformers)
        self._state = set(captured.state)
        self.plan = plan
        self._guard = guard  # traced non-tensor values, input shapes agreed across ranks (autotp.runtime.agreement.exchanges)
        self.graph_module = graph_module
        self.rank = rank
        self.world_size = plan.world_size
        self._slots = captured.inputs
        self._in_spec = captured.in_spec
        self._leaf_inputs = _leaf_inputs(captured.in_spec)
        self._outputs = captured.outputs  # the model's return structure, constants of the trace included
        # per flattened output: "R" (whole), or with outputs="local" this rank's "S(d)" block / "P" part
        self.output_placements = output_placements(plan)
        self._check_shapes = InputShapeCheck(captured)  # static dims must keep their traced size
        self._fqn_of = {s.name: str(s.target) for s in captured.inputs if s.kind != "user"}
        self._param_names = {s.name for s in captured.inputs if s.kind == "parameter"}
        self._local = torch.nn.ParameterDict()
        self._buffers_local: dict[str, torch.Tensor] = {}
        for slot in captured.inputs:
            if slot.kind == "user":
                continue
            key = slot.name
            if slot.kind == "parameter":
                value = local_values[key]
                if training and self.layout.get(str(slot.target), (None, None))[1] is None:
                    value = value.clone()  # a replicated weight: the optimizer updates tp's copy, not the model's
                self._local[key] = torch.nn.Parameter(value, requires_grad=training and value.is_floating_point())
            else:
                self.register_buffer(key, local_values[key], persistent=False)
                self._buffers_local[key] = local_values[key]
        # Where forward reads each graph input: the flat user inputs (0), this rank's parameters (1) or
        # buffers (2), looked up in the live dicts on every call (so .to(), loading and KV-cache resets
        # stay visible) but without Module.__getattr__ per slot, which cost ~2 us each (~0.1 ms for BERT).
        self._slot_keys: tuple[tuple[int, Any], ...] = tuple(
            (0, int(s.target)) if s.kind == "user" else (1 if s.kind == "parameter" else 2, s.name)
            for s in captured.inputs)
        # training: the original's state_dict names, and a check that catches an optimizer over its parameters
        self.state_dict_aliases = state_dict_aliases(original) if training and original is not None else None
        if training and original is not None:
            OriginalParameterCheck(self, original)
        # inference: a scalar output (a loss) gets a backward that says to compile with PlanOptions(training=True)
        self._refuse_anchor = torch.zeros((), requires_grad=True)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters (shards of split ones) under the original model's FQNs.

        The second name of a tied weight (which the graph never reads and which holds nothing) is left
        out; :meth:`parameters` yields the same tensors, for an optimizer.
        """
        for slot in self._slots:
            if slot.kind == "parameter":
                param = self._local[slot.name]
                if param.numel() > 0 or str(slot.target) in self.layout:
                    yield prefix + ("." if prefix else "") + str(slot.target), param

    def manual_seed(self, seed: int) -> None:
        """Seed dropout on this rank (call on every rank with the same ``seed``): the shared stream
        (``torch.manual_seed``) and, with ``dropout="split"``, this rank's own stream
        (:func:`autotp.passes.random_streams.manual_seed`)."""
        from autotp.passes.random_streams import manual_seed

        manual_seed(self.graph_module, seed, self.rank)

    @property
    def group(self) -> Any:
        """The process group this model was compiled over (``None``: the default group)."""
        return self._group

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's ``state_dict``: full tensors gathered from every rank's shards (call on every rank).

        See :func:`autotp.runtime.training.trainable.full_state_dict`."""
        return full_state_dict(self, self._group)

    def local_state(self) -> dict[str, torch.Tensor]:
        """FQN -> this rank's tensor (a shard for split parameters)."""
        out = {}
        for slot in self._slots:
            if slot.kind == "parameter":
                out[str(slot.target)] = self._local[slot.name]
            elif slot.kind != "user":
                out[str(slot.target)] = getattr(self, slot.name)
        return out

    def save(self, directory: str | os.PathLike[str], group: Any = None) -> None:
        """Write this rank's shards to ``directory`` with ``torch.distributed.checkpoint`` (call on every rank).

        Each split parameter is saved with its global offsets, so :func:`autotp.load` reads it back
        at any world size; replicated tensors are written once. See :mod:`autotp.runtime.checkpoints.saving`.
        """
        from autotp.runtime.checkpoints.saving import save_sharded

        save_sharded(self, directory, group)

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (shards of split ones, whole replicated ones)."""
        return sum(p.numel() * p.element_size() for p in self._local.values())

    def cache_bytes(self) -> int:
        """Bytes of state buffers (those forward updates: a KV cache, a counter) this rank holds: its blocks of
        the split ones, whole others."""
        return sum(t.numel() * t.element_size() for name, t in self._buffers_local.items() if name in self._state)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
        """Generate text like HuggingFace ``model.generate``; see :func:`autotp.runtime.generation.generate.generate`."""
        from autotp.runtime.generation.generate import generate

        return generate(self, input_ids, attention_mask, **options)

    def share_weights(self, other: TensorParallelModule, prefix: str = "", other_prefix: str = "") -> int:
        """Hold ``other``'s tensor in place of each parameter shard that is the same block of the same weight
        (FQN ``prefix`` + a name here, ``other_prefix`` + the same name in ``other``; same global :attr:`layout`
        entry, shape, dtype and device), so the two modules keep one copy of it (a generation compile beside a
        plain one); returns how many are shared. ValueError when such a block holds other values (the weights
        changed between the compiles)."""
        if self.trains or other.trains:
            return 0  # an optimizer updates each module's own tensors
        theirs = {str(s.target): s.name for s in other._slots if s.kind == "parameter"}
        shared = 0
        for slot in self._slots:
            fqn = str(slot.target)
            if slot.kind != "parameter" or not fqn.startswith(prefix):
                continue
            other_fqn = other_prefix + fqn.removeprefix(prefix)
            source = theirs.get(other_fqn)
            if source is None or fqn not in self.layout or self.layout[fqn] != other.layout.get(other_fqn):
                continue
            mine, held = self._local[slot.name], other._local[source]
            if (mine.shape, mine.dtype, mine.device) != (held.shape, held.dtype, held.device):
                continue
            if not torch.equal(mine, held):
                raise ValueError(
                    f"{fqn}: this rank's block differs from the one the other module holds, so the weights changed "
                    "between the two compiles; compile both from the same weights (compile again after changing them)"
                )
            self._local[slot.name] = held
            shared += 1
        return shared

    def _value_of(self, slot_name: str) -> torch.Tensor:
        return self._local[slot_name] if slot_name in self._param_names else getattr(self, slot_name)

    def phase_runner(self, phase: str) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
        """A function running the ``"decode"``, ``"prefill"`` or ``"continuation"`` graph on flat user inputs,
        returning its first output. The weights and cache tensors are looked up once here, not on every call
        (the cache is updated in place, so the same tensors serve every position)."""
        other = getattr(self.generation, phase, None) if phase in ("prefill", "continuation") else None
        if phase == "decode":
            keys: list[str | int] = [int(s.target) if s.kind == "user" else s.name for s in self._slots]
            graph_module = self.graph_module
        elif isinstance(other, PhaseGraph):
            keys = list(other.inputs)
            graph_module = other.graph_module
        else:
            raise ValueError(f"no {phase!r} graph: compile with max_cache_len= and example ids of more than one token")
        template: list[Any] = [None if isinstance(key, int) else self._value_of(key) for key in keys]
        users = [(position, key) for position, key in enumerate(keys) if isinstance(key, int)]
        graph = self._runner(phase, graph_module, [value for value in template if value is not None])

        notes = self._notes

        def run(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            values = list(template)
            for position, index in users:
                values[position] = inputs[index]
            if notes is not None:
                notes.begin_call()
            try:
                with torch.no_grad():
                    return graph(*values)[0]
            except Exception as exc:
                if notes is not None:
                    notes.failed(exc)
                raise

        return run

    def _runner(self, phase: str, graph_module: fx.GraphModule, static: list[torch.Tensor]) -> Callable[..., Any]:
        """``graph_module`` (the graph of ``phase``; the decode graph serves ``forward`` too) in this module's
        runtime mode, made once; ``static``: the weights and cache every call passes again."""
        if self.runtime_mode == "eager":
            return graph_module
        key = "decode" if phase == "forward" else phase
        runner = self._runners.get(key)
        if runner is None:
            what = key if self.generation is not None else "forward"
            runner = self._runners[key] = graph_runner(graph_module, self.runtime_mode, what=what,
                                                       talk=self._progress, static=tuple(static))
        return runner

    def collective_counts(self) -> dict[str, int]:
        """Collectives in the rank-local graph, by kind (one forward pass issues each once)."""
        return count_collectives(self.graph_module)

    def _called_as_traced(self, args: tuple, kwargs: dict) -> bool:
        """Whether ``args`` and ``kwargs`` have the structure the graph was traced with (checked again, with
        errors, when the call's inputs are flattened)."""
        if self._hf_use_cache:
            kwargs = call_kwargs(kwargs)
        expected = self._traced_kwarg_names()
        if set(kwargs) != set(expected):
            return False
        return pytree.tree_flatten((args, {k: kwargs[k] for k in expected}))[1] == self._in_spec

    def _traced_kwarg_names(self) -> list[str]:
        kw_spec = self._in_spec.child(1)
        return list(kw_spec.context) if kw_spec.context is not None else []

    def _flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        if self._hf_use_cache:
            kwargs = call_kwargs(kwargs)
        leaves = self._leaf_inputs
        if leaves is not None and len(args) == leaves[0] and kwargs.keys() == leaves[1].keys():
            # traced with one leaf per argument, called with tensors and scalars only (pytree leaves): the flat
            # list is the inputs in order (pytree's flatten and spec check cost ~20 us per call, a tenth of a
            # tiny model's step); the guard checks the scalars' traced values
            flat = [*args, *(kwargs[key] for key in leaves[1])]
            if all(isinstance(value, (torch.Tensor, bool, int, float)) for value in flat):
                return flat
        expected = self._traced_kwarg_names()
        if set(kwargs) != set(expected):
            raise TypeError(
                f"this tensor-parallel model was traced with keyword arguments {sorted(expected)}, "
                f"got {sorted(kwargs)}; call it the way it was traced or compile it again with these arguments"
                + self._decode_step_hint())
        ordered = {k: kwargs[k] for k in expected}
        flat, spec = pytree.tree_flatten((args, ordered))
        if spec != self._in_spec:
            raise TypeError(
                "inputs do not have the structure the model was traced with "
                f"(expected {self._in_spec}, got {spec}); pass the same kinds of arguments as example_inputs"
                + self._decode_step_hint())
        return flat

    def _decode_step_hint(self) -> str:
        """For a module compiled for generation, what its forward is and how to get what a plain call gives."""
        if self.generation is None:
            return ""
        return (f". This module was compiled for generation (max_cache_len={self.generation.layout.max_cache_len}): "
                "its forward is one decode step on the KV cache (token ids, positions, cache positions, mask). Call "
                "tp.generate(ids, max_new_tokens=N) to generate; for a sequence's logits (tp(ids)), compile without "
                "max_cache_len: that module generates too (tp.generate builds the generation graphs at its first call)")

    def graph_inputs(self, *args: Any, **kwargs: Any) -> list[Any]:
        """What :attr:`graph_module` is called with for a call of this model with ``args`` and ``kwargs``: the
        user inputs flattened and checked against what was traced, then this rank's weights and buffers, in the
        order of the graph's placeholders."""
        flat = self._flatten_inputs(args, kwargs)
        self._check_shapes(flat)
        if self._guard is not None:
            self._guard.check(flat)
        sources = (flat, self._local._parameters, self._buffers)
        return [sources[source][key] for source, key in self._slot_keys]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.forward_on_demand is not None and not self._called_as_traced(args, kwargs):
            return self.forward_on_demand(self, args, kwargs)(*args, **kwargs)  # a plain call of a generation compile
        notes = self._notes
        if notes is not None:
            notes.begin_call()
        try:
            values = self.graph_inputs(*args, **kwargs)
            if self.trains:
                outputs = self.graph_module(*values)
            else:
                graph = self.graph_module if self.runtime_mode == "eager" else self._runner(
                    "forward", self.graph_module,
                    [cast(torch.Tensor, value) for (source, _), value in zip(self._slot_keys, values) if source != 0])
                with torch.no_grad():
                    outputs = graph(*values)
                if torch.is_grad_enabled():
                    outputs = refuse_backward(outputs, self._refuse_anchor)
        except Exception as exc:
            if notes is not None:
                notes.failed(exc)  # the other ranks learn of it (or a peer's failure that caused it is raised)
            raise
        return self._outputs.unflatten(outputs)
