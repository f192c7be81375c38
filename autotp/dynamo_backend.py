"""autotp as a ``torch.compile`` backend: ``torch.compile(model, backend=autotp.backend(...))``.

Dynamo hands a backend one FX graph per region it could trace (several when the model has
graph breaks), with the module's parameters and buffers as graph inputs. For each graph this
backend returns a :class:`CompiledSubgraph` which, at its first call with given input sizes
(outside Dynamo's own compile, whose tracing context export must not share):

1. maps every input back to where it came from: Dynamo records a *source* per input
   (``L['self']._modules['mlp']._modules['up_proj']._parameters['weight']``), from which the
   parameter's FQN (``mlp.up_proj.weight``) is read; ``nn.Parameter`` inputs are parameters;
2. lowers the graph to the planner's IR: ``torch.export.export`` (non-strict) of Dynamo's
   GraphModule at concrete input sizes, the same ATen graph ``autotp.compile`` captures from
   the model itself (:func:`autotp.capture.tracing.from_exported`);
3. plans it with autotp's planner, on the group's first rank, which sends the plan to the
   others (:func:`autotp.runtime.agreement.group.plan_on_first_rank`, as ``autotp.compile`` does); graph outputs are
   ``Replicate``, so values crossing a graph break are whole on every rank;
4. applies the plan as ``autotp.compile`` does (:func:`autotp.runtime.execution.applying.apply_plan`: the rank-local
   graph, the inference collectives chosen for the group's hosts, this rank's parameter shards, sliced once
   for every graph that splits them alike) and runs it in ``RuntimeOptions.runtime_mode``
   (:func:`autotp.runtime.execution.runtime_modes.graph_runner`: ``"compiled"`` hands it to Inductor).

At run time the compiled graph ignores the full parameters Dynamo passes it and uses the
shards; :meth:`AutoTPBackend.release_full_weights` frees the full weights of split parameters. Shapes: a *dynamic* Dynamo graph (``mark_dynamic``, ``dynamic=True``, or Dynamo's
automatic-dynamic recompile) is lowered once with its symbolic dims kept symbolic (export's
``dynamic_shapes``), as :func:`autotp.compile` captures, and that one rank-local graph serves
every size. A static graph, a graph export cannot keep symbolic, and every graph run ``"compiled"``
or as a ``"cuda_graph"`` (Inductor specialises to the sizes it compiles at) are re-lowered once per
new concrete input size instead, reusing the plan when the lowered graph has the same ops (no
new solve, no new shards), at most ``max_shapes`` sizes per graph. :attr:`AutoTPBackend.stats`
reports every count.

Every :class:`~autotp.RuntimeOptions` field is honoured or refused: ``check_weights``, ``agreement_timeout_s``,
``runtime_mode`` and ``host`` as in ``autotp.compile``; ``trace_cache`` is refused (Dynamo hands the backend
graphs, not a model for ``torch.export`` to trace, so there is no trace to keep).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from autotp.adapters.torch_internals import current_compile_id
from autotp.base.errors import AutoTPError, CaptureError
from autotp.base.placements import Replicate
from autotp.base.shapes import first_tensor, is_static
from autotp.base.strategy import Strategy
from autotp.capture.tracing import CapturedGraph, InputSlot, OutputStructure, from_exported, trace_device
from autotp.passes.rewrite import count_collectives
from autotp.planning.options import PlanOptions, moved_to_options, options_taking, plan_options
from autotp.planning.plan import Plan
from autotp.runtime.agreement.exchanges import agreed_options, compile_record, ranks_agree
from autotp.runtime.agreement.group import bind_group, plan_on_first_rank
from autotp.runtime.execution.applying import apply_plan
from autotp.runtime.execution.options import RuntimeOptions, runtime_host, runtime_options
from autotp.runtime.execution.runtime_modes import graph_runner, mode_and_pricing
from autotp.runtime.execution.shards import ShardCache

__all__ = ["AutoTPBackend", "BackendStats", "CompiledSubgraph", "autotp_backend", "backend"]

_INNER = {"eager": "eager", "inductor": "compiled"}
"""The deprecated ``autotp.backend(inner=...)`` and the ``RuntimeOptions(runtime_mode=...)`` that replaces it."""
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
# ``._modules['layers']``, ``._parameters['weight']``, ``._buffers['inv_freq']`` in a Dynamo source name
_SOURCE_PART = re.compile(r"\._(modules|parameters|buffers)\['([^']+)'\]")


def _source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None and hasattr(source, "name") else ""


def fqn_from_source(source: str) -> tuple[str, str] | None:
    """``(kind, fqn)`` of a Dynamo source naming a module attribute, ``None`` for other inputs.

    ``L['self']._modules['mlp']._parameters['weight']`` -> ``("parameter", "mlp.weight")``;
    kind is ``"parameter"`` or ``"buffer"``.
    """
    parts = _SOURCE_PART.findall(source)
    if not parts or parts[-1][0] == "modules":
        return None
    kind = "parameter" if parts[-1][0] == "parameters" else "buffer"
    return kind, ".".join(name for _, name in parts)


def _concrete(value: Any) -> Any:
    """The value Dynamo traced with: a symbolic int's hint, or the value itself."""
    if isinstance(value, _SYM_TYPES):
        hint = value.node.hint
        if hint is None:
            raise AutoTPError(f"Dynamo passed a symbolic input {value} with no concrete example value; "
                              "call the compiled model once with real inputs before it is traced")
        return hint
    return value


def _export_spec(placeholder: fx.Node) -> Any:
    """``dynamic_shapes`` entry of one Dynamo graph input: ``Dim.AUTO`` for each symbolic dim
    (and for a symbolic int input), ``None`` where everything is static."""
    from torch.export import Dim

    value = placeholder.meta.get("example_value")
    if isinstance(value, torch.SymInt):
        return Dim.AUTO
    if isinstance(value, torch.Tensor):
        dims = {d: Dim.AUTO for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt)}
        return dims or None
    return None


def _by_argument(gm: fx.GraphModule, specs: tuple[Any, ...] | None) -> Any:
    """``specs`` (one per flat input) in the form export matches to ``gm.forward``: Dynamo's graphs
    take either one parameter per input (a tuple, matched by position) or ``*args``."""
    if specs is None:
        return None
    params = inspect.signature(gm.forward).parameters.values()
    # not yet compiled (a lazy GraphModule): forward(*args, **kwargs)
    var_positional = [p.name for p in params if p.kind == p.VAR_POSITIONAL]
    if var_positional and not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return {var_positional[0]: tuple(specs)}
    return tuple(specs)


@dataclasses.dataclass(frozen=True)
class BackendStats:
    """What the backend did so far (every count since it was made or reset).

    ``graphs``: Dynamo graphs handed to the backend; ``regions``: distinct code regions among
    them (one per graph-break region), so ``graphs - regions`` is Dynamo's recompiles.
    ``plans``: plans solved. ``plans_reused``: graphs or input sizes whose lowered graph matched
    an existing plan (no solve). ``lowerings``: rank-local graphs built
    (one per graph and concrete input size). ``parameter_bytes``: bytes of parameters this
    rank holds for the compiled graphs (shards, and replicated parameters counted once).
    ``full_parameter_bytes``: bytes of the same parameters unsplit.
    """

    graphs: int
    regions: int
    plans: int
    plans_reused: int
    lowerings: int
    parameter_bytes: int
    full_parameter_bytes: int


@dataclasses.dataclass
class _LocalGraph:
    """The rank-local graph of one Dynamo graph at one concrete input size, ready to call."""

    run: Callable[..., Any]
    graph_module: fx.GraphModule
    template: list[Any]  # argument list of ``run`` with parameter shards in place
    feeds: list[tuple[int, int]]  # (position in template, index of Dynamo's argument)
    outputs: OutputStructure

    def __call__(self, args: Sequence[Any]) -> Any:
        values = list(self.template)
        for position, index in self.feeds:
            values[position] = args[index]
        with torch.no_grad():
            outputs = self.run(*values)
        return self.outputs.unflatten(outputs)


class CompiledSubgraph:
    """One Dynamo graph made tensor-parallel: what Dynamo calls in the graph's place.

    Attributes:
        index: order in which the backend received it (0 for the first graph).
        region: Dynamo's id of the traced code region (frame); a recompile of the region (new
            input sizes, failed guards) yields a new graph with the same ``region``.
        plan: the :class:`~autotp.Plan` applied (made at the first call; ``None`` before it).
        local_graphs: rank-local graphs by input-size key (one entry for a static graph).
    """

    def __init__(self, owner: AutoTPBackend, gm: fx.GraphModule, example_inputs: Sequence[Any], index: int,
                 region: int) -> None:
        self.index = index
        self.region = region
        self._owner = owner
        self._gm = gm
        self.plan: Plan | None = None
        self.local_graphs: dict[tuple, _LocalGraph] = {}
        self._last: _LocalGraph | None = None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise AutoTPError(f"Dynamo graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs")
        # Dynamo argument index -> ("parameter" | "buffer", FQN); everything else is a user input.
        self._origin: dict[int, tuple[str, str]] = {}
        self._arg_names = [node.name for node in placeholders]  # stable across Dynamo recompiles
        for index_, (node, value) in enumerate(zip(placeholders, example_inputs)):
            found = fqn_from_source(_source_name(node))
            if isinstance(value, torch.nn.Parameter):
                self._origin[index_] = ("parameter", found[1] if found else node.name)
            elif found is not None:
                self._origin[index_] = found
        self._dynamic = any(isinstance(v, _SYM_TYPES) for v in example_inputs)
        # Dynamo's symbolic dims, as torch.export dynamic_shapes: a dynamic graph is lowered once
        # with them, and that one rank-local graph serves every size (see _build_dynamic)
        self._dynamic_shapes = tuple(_export_spec(node) for node in placeholders) if self._dynamic else None
        self._key_positions = [i for i, v in enumerate(example_inputs)
                               if i not in self._origin and isinstance(v, (torch.Tensor, *_SYM_TYPES))]
        self._static: _LocalGraph | None = None  # the one local graph of a static-shape graph

    # -- run ----------------------------------------------------------------------------
    def _key(self, args: Sequence[Any]) -> tuple:
        if not self._dynamic:
            return ()
        return tuple(tuple(args[i].shape) if isinstance(args[i], torch.Tensor) else args[i] for i in self._key_positions)

    def __call__(self, *args: Any) -> Any:
        # Lowering and planning run here, at the first call with these sizes, not while Dynamo
        # compiles: torch.export (and the plan broadcast) inside Dynamo's compile would share its
        # tracing context and can leave guards Dynamo cannot build.
        local = self._static
        if local is None:
            if self._dynamic_shapes is not None and self._owner.runtime_mode == "eager":
                local = self._build_dynamic(list(args))
                if local is not None:
                    self._static = local
                    return local(args)
            key = self._key(args)
            local = self.local_graphs.get(key)
            if local is None:
                local = self._build(list(args), key)
                if not self._dynamic:
                    self._static = local
        return local(args)

    def _build_dynamic(self, args: list[Any]) -> _LocalGraph | None:
        """Lower a dynamic Dynamo graph once with its symbolic dims: one rank-local graph for every size.

        Returns ``None`` (and the graph is lowered once per size instead) when export cannot keep
        the dims symbolic. Only in ``"eager"`` runtime mode: Inductor would specialise the rank-local
        graph to the sizes it is compiled at.
        """
        try:
            local = self._build(args, ("dynamic",), dynamic_shapes=self._dynamic_shapes)
        except AutoTPError as exc:  # export could not keep the dims symbolic
            self._dynamic_shapes = None
            self._owner._log(f"graph {self.index}: lowered once per input size: {str(exc).splitlines()[0]}")
            return None
        return local

    # -- inspect ------------------------------------------------------------------------
    @property
    def graph_module(self) -> fx.GraphModule:
        """The rank-local graph built most recently."""
        if self._last is None:
            raise AutoTPError(f"torch.compile graph {self.index} has not run yet: its rank-local graph is built "
                              "at its first call; call the compiled model once")
        return self._last.graph_module

    def collective_counts(self) -> dict[str, int]:
        """Collectives in the most recently built rank-local graph, by kind."""
        return count_collectives(self.graph_module)

    # -- build ----------------------------------------------------------------------------
    def _lower(self, concrete: Sequence[Any], dynamic_shapes: Any = None) -> tuple[CapturedGraph, dict[str, int]]:
        """Dynamo's graph at these concrete inputs -> the planner's ATen IR, parameters named.

        Returns the captured graph and, for each parameter placeholder, the index of Dynamo's
        argument that carries the full weight. Export keeps Dynamo's flat argument order, so a
        user input's index in the exported program is its index in Dynamo's arguments.
        """
        # Plain aliases: a tensor the user passed through torch._dynamo.mark_dynamic carries marks
        # that export would read as a request for a symbolic size; we lower at concrete sizes.
        plain = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in concrete)
        try:
            with torch.no_grad():
                exported = torch.export.export(self._gm, plain, dynamic_shapes=_by_argument(self._gm, dynamic_shapes),
                                               strict=False)
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CaptureError(
                f"could not lower torch.compile graph {self.index} to ATen with torch.export: "
                f"{type(exc).__name__}: {first_line}\nDynamo's graph:\n{self._gm.code[:2000]}"
            ) from exc
        captured = from_exported(exported, f"torch.compile graph {self.index}")
        arg_of_param: dict[str, int] = {}
        slots = []
        for slot in captured.inputs:
            origin = self._origin.get(int(slot.target)) if slot.kind == "user" else None
            if origin is not None and origin[0] == "parameter":
                arg_of_param[slot.name] = int(slot.target)
                slot = InputSlot(slot.name, "parameter", origin[1])
            slots.append(slot)
        captured.inputs = slots
        return captured, arg_of_param

    def _canonical_names(self, captured: CapturedGraph) -> dict[str, str]:
        """Placeholder name -> a name that identifies the same input in any lowering of this region.

        Export numbers placeholders by position, and a Dynamo recompile with dynamic sizes adds
        size inputs in front, so positions move; parameters are named by FQN, other inputs by
        Dynamo's own (source-derived) placeholder name.
        """
        names = {}
        for slot in captured.inputs:
            if slot.kind == "user":
                names[slot.name] = "input:" + self._arg_names[int(slot.target)]
            else:
                names[slot.name] = f"{slot.kind}:{slot.target}"
        return names

    def _build(self, args: Sequence[Any], key: tuple, dynamic_shapes: Any = None) -> _LocalGraph:
        owner = self._owner
        # every rank lowers, then the ranks agree (graph, options, weights) before planning
        with ranks_agree(owner.group, timeout_s=owner.agreement_timeout_s,
                         what=f"torch.compile graph {self.index}") as agreement:
            if len(self.local_graphs) >= owner.max_shapes:
                raise AutoTPError(
                    f"torch.compile graph {self.index} has been called with {len(self.local_graphs) + 1} different "
                    f"input sizes (max_shapes={owner.max_shapes}); each needs its own rank-local graph. Pad inputs to "
                    "a few fixed sizes, or pass a larger max_shapes to autotp.backend(...)"
                )
            concrete = [_concrete(a) for a in args]
            captured, arg_of_param = self._lower(concrete, dynamic_shapes)
            weights = ({str(slot.target): concrete[arg_of_param[slot.name]] for slot in captured.inputs
                        if slot.name in arg_of_param} if owner.check_weights else None)
            agreement.record = compile_record(captured, weights=weights, checksums=owner._checksums,
                                              options=agreed_options(owner._options,
                                                                     runtime_mode=owner.runtime.runtime_mode,
                                                                     check_weights=owner.check_weights))
        plan, decisions = owner._plan_for(captured, self._canonical_names(captured))
        if self.plan is None:
            self.plan = plan
        # applied as autotp.compile applies a plan; the full weights are Dynamo's arguments (a module attribute
        # Dynamo left as get_attr is in the exported program), each split sliced once for every graph
        full_weights = {name: concrete[index] for name, index in arg_of_param.items()}
        local_gm, values, _ = apply_plan(captured, plan, group=owner.group, rank=owner.rank, host=owner.host,
                                         timeout_s=owner.agreement_timeout_s, decisions=decisions,
                                         weights=full_weights, shards=owner._shards)
        template: list[Any] = []
        feeds: list[tuple[int, int]] = []
        for position, slot in enumerate(captured.inputs):
            template.append(values.get(slot.name))
            if slot.kind == "user":
                feeds.append((position, int(slot.target)))
        run = graph_runner(local_gm, owner.runtime_mode, what=f"torch.compile graph {self.index}",
                           talk=owner.progress and owner.rank == 0,
                           static=tuple(t for t in template if isinstance(t, torch.Tensor)))
        local = _LocalGraph(run, local_gm, template, feeds, captured.outputs)
        self.local_graphs[key] = local
        self._last = local
        owner._lowerings += 1
        sizes = "every input size (symbolic dims)" if dynamic_shapes is not None else f"input sizes {key or 'static'}"
        owner._log(f"graph {self.index}: rank-local graph for {sizes} "
                   f"({sum(self.collective_counts().values())} collectives, runtime_mode={owner.runtime_mode})")
        return local


class AutoTPBackend:
    """A ``torch.compile`` backend that makes every Dynamo graph tensor-parallel (see module doc).

    Made by :func:`backend`; called by Dynamo as ``backend(gm, example_inputs)``. One instance
    may serve several models; shards of a parameter are shared by every graph that splits it
    the same way.

    Attributes:
        subgraphs: every :class:`CompiledSubgraph` made so far, in order.
    """

    def __init__(self, *, world_size: int | None, group: dist.ProcessGroup | None, max_shapes: int,
                 options: PlanOptions, runtime: RuntimeOptions) -> None:
        if runtime.trace_cache not in (None, False):
            raise ValueError(f"autotp.backend does not take RuntimeOptions(trace_cache={runtime.trace_cache!r}): "
                             "Dynamo hands the backend graphs, not a model for torch.export to trace, so there is "
                             "no trace to keep; leave trace_cache out, or use autotp.compile(model, ..., "
                             "runtime=autotp.RuntimeOptions(trace_cache=True)) to reuse a model's trace")
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes must be an int >= 1, got {max_shapes!r}")
        self._world_size = world_size
        # validated where built, so a bad option fails here rather than inside Dynamo; the world size is
        # the group's, known when Dynamo first calls the backend (see _bind_group)
        self._options = options
        self.hardware = options.hardware
        self.runtime = runtime_options(runtime)  # host from the launcher's variables, read here at the front door
        self.host = runtime_host(self.runtime)
        self.runtime_mode = "eager"  # the mode that runs, resolved on the device when Dynamo first calls us
        self.memory_budget = options.memory_budget
        self.group = group
        self.strict = options.strict
        self.time_limit_s = options.time_limit_s
        self.max_shapes = max_shapes
        self.progress = options.progress
        self.check_weights = runtime.check_weights
        self.agreement_timeout_s = runtime.agreement_timeout_s
        self.reset()

    def reset(self) -> None:
        """Forget every plan, shard and graph (``torch._dynamo.reset()`` calls this)."""
        self.subgraphs: list[CompiledSubgraph] = []
        self._plans: dict[tuple, tuple[Plan, dict[str, str]]] = {}
        self._shards = ShardCache()
        self._checksums: WeakIdKeyDictionary = WeakIdKeyDictionary()  # full weight -> WeightChecksum
        self._plans_solved = 0
        self._plans_reused = 0
        self._lowerings = 0

    # -- the process group and the device, read when Dynamo first calls us -----------------
    def _bind_group(self, example_inputs: Sequence[Any]) -> None:
        self.world_size, self.rank = bind_group(self.group, self._world_size,
                                                caller="the autotp torch.compile backend (when the model first runs)")
        self.group_name = cast(dist.ProcessGroup, self.group or dist.group.WORLD).group_name
        # the plan is priced in the mode that runs, as autotp.compile prices it (Hardware.runtime_mode)
        device = trace_device(tuple(example_inputs), None)
        requested = self.runtime.runtime_mode
        self.runtime_mode, self._options = mode_and_pricing(
            dataclasses.replace(self._options, world_size=self.world_size), requested, device,
            talk=self.progress and self.rank == 0)

    def _log(self, message: str) -> None:
        if self.progress and self.rank == 0:
            print(f"[autotp backend] {message}", file=sys.stderr, flush=True)

    def _plan_for(self, captured: CapturedGraph, canonical: dict[str, str]) -> tuple[Plan, dict[str, Strategy]]:
        """A plan and the decisions for every node of ``captured``: reused when the ops match, else solved.

        Two lowerings match when their non-placeholder nodes have the same names, ops and inputs,
        and the same inputs are used (compared by ``canonical`` name, see
        :meth:`CompiledSubgraph._canonical_names`), with the same dims symbolic; static sizes may differ. Unused inputs (Dynamo's
        size arguments) get ``Replicate``.
        """
        gm = captured.graph_module

        def ref(node: fx.Node) -> str:
            return canonical[node.name] if node.op == "placeholder" else node.name

        def symbolic_dims(node: fx.Node) -> tuple[int, ...]:
            # a plan may split a dim only where it is static: a static lowering's plan is no plan
            # for a dynamic one with the same ops
            value = first_tensor(node.meta.get("val"))
            return tuple(d for d, size in enumerate(value.shape) if not is_static(size)) if value is not None else ()

        key = tuple(
            ("placeholder", canonical[n.name], symbolic_dims(n)) if n.op == "placeholder"
            else (n.name, str(n.target), tuple(ref(i) for i in n.all_input_nodes), symbolic_dims(n))
            for n in gm.graph.nodes if n.op != "placeholder" or n.users
        )
        found = self._plans.get(key)
        if found is None:
            plan = plan_on_first_rank(captured, self._options, group=self.group, rank=self.rank,
                                      agreement_timeout_s=self.agreement_timeout_s)
            self._plans[key] = found = (plan, {canonical[n.name]: n.name for n in gm.graph.nodes if n.op == "placeholder"})
            self._plans_solved += 1
        else:
            self._plans_reused += 1
        plan, planned_name = found
        planned = plan.decisions()
        decisions = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                name = planned_name.get(canonical[node.name])
                decisions[node.name] = planned[name] if name is not None else Strategy((), Replicate())
            else:
                decisions[node.name] = planned[node.name]
        return plan, decisions

    # -- Dynamo's entry -------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self._bind_group(example_inputs)
        compile_id = current_compile_id()
        region = getattr(compile_id, "frame_id", None)
        if region is None:  # called outside Dynamo (e.g. by hand): every graph is its own region
            region = -1 - len(self.subgraphs)
        if any(g.region == region for g in self.subgraphs):
            self._log(f"Dynamo recompiled region {region} (graph {len(self.subgraphs)}); "
                      "its plan is reused if the ops match")
        subgraph = CompiledSubgraph(self, gm, example_inputs, len(self.subgraphs), region)
        self.subgraphs.append(subgraph)
        return subgraph

    # -- reports --------------------------------------------------------------------------
    @property
    def stats(self) -> BackendStats:
        held, full = self._shards.parameter_bytes()
        return BackendStats(graphs=len(self.subgraphs), regions=len({g.region for g in self.subgraphs}), plans=self._plans_solved, plans_reused=self._plans_reused,
                            lowerings=self._lowerings, parameter_bytes=held, full_parameter_bytes=full)

    def collective_counts(self) -> dict[str, int]:
        """Collectives of one forward pass, by kind: summed over the newest graph of each region."""
        latest: dict[int, CompiledSubgraph] = {}
        for subgraph in self.subgraphs:
            latest[subgraph.region] = subgraph
        counts: dict[str, int] = {}
        for subgraph in latest.values():
            for kind, n in subgraph.collective_counts().items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def release_full_weights(self) -> int:
        """Free the full weights of every split parameter; returns the bytes freed.

        The parameters stay in the model with their shapes (so Dynamo's guards still pass and
        nothing recompiles), but their storage is emptied, as FSDP does: after this the model
        runs only through the compiled graphs; calling it eagerly, or with an input size that
        needs a new split of a released weight, raises. Call it after the first forward pass,
        when every graph region has been compiled.
        """
        return self._shards.release()


def backend(
    world_size: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    max_shapes: int = 8,
    options: PlanOptions | None = None,
    runtime: RuntimeOptions | None = None,
    **deprecated: Any,
) -> AutoTPBackend:
    """A ``torch.compile`` backend that makes the model tensor-parallel over ``group``'s ranks.

    ``torch.compile(model, backend=autotp.backend(world_size=4))``, on every rank, with the
    same weights. ``max_shapes`` bounds the input sizes each graph is re-lowered for. ``options``: an
    :class:`~autotp.PlanOptions` with ``hardware``, ``memory_budget``, ``strict``, ``time_limit_s``, ``progress``,
    ``constraints``, as in :func:`autotp.plan` (Dynamo decides shapes; no training or generation here).
    ``runtime``: an :class:`~autotp.RuntimeOptions`; ``runtime_mode`` runs each rank-local graph as is
    (``"eager"``), compiled by Inductor (``"compiled"``), or compiled and captured as a CUDA graph
    (``"cuda_graph"``; ``"auto"``, the default, picks as :func:`autotp.compile` does), and ``check_weights``,
    ``agreement_timeout_s`` and ``host`` are as in :func:`autotp.compile`; ``trace_cache`` is refused (there is
    no ``torch.export`` trace of a model to keep). The process group must be initialised before the compiled
    model first runs. Before each graph is planned (once per graph and input size) the ranks check that they
    agree, as in :func:`autotp.compile`.

    ``hardware=`` and ``memory_budget=`` as keywords, and ``inner=`` (``"eager"`` or ``"inductor"``), still work
    for one release, with a :class:`DeprecationWarning` saying what to write instead.
    """
    inner = deprecated.pop("inner", None)
    options = moved_to_options("autotp.backend", options, deprecated, taken=("hardware", "memory_budget"))
    if inner is not None:
        runtime = _runtime_for_inner(inner, runtime)
    options = plan_options(options_taking(options, _BACKEND_OPTIONS, caller="autotp.backend",
                                          instead="compile with autotp.compile for those"), world_size=world_size)
    return AutoTPBackend(world_size=world_size, group=group, max_shapes=max_shapes, options=options,
                         runtime=runtime if runtime is not None else RuntimeOptions())


def _runtime_for_inner(inner: object, runtime: RuntimeOptions | None) -> RuntimeOptions:
    """``runtime`` with the mode that the deprecated ``autotp.backend(inner=...)`` asked for, and the warning that
    says what to write instead."""
    if inner not in _INNER:
        raise ValueError(f"inner must be one of {tuple(_INNER)}, got {inner!r}; pass "
                         "runtime=autotp.RuntimeOptions(runtime_mode='eager' | 'compiled') instead")
    mode = _INNER[cast(str, inner)]
    warnings.warn(f"autotp.backend(..., inner={inner!r}) is deprecated: pass "
                  f"runtime=autotp.RuntimeOptions(runtime_mode={mode!r})", DeprecationWarning, stacklevel=3)
    if runtime is not None and runtime.runtime_mode != "auto":
        raise ValueError(f"inner={inner!r} and RuntimeOptions(runtime_mode={runtime.runtime_mode!r}) both say how "
                         "the rank-local graphs run; give it once, as runtime_mode")
    return dataclasses.replace(runtime or RuntimeOptions(), runtime_mode=mode)


_BACKEND_OPTIONS = ("hardware", "memory_budget", "strict", "time_limit_s", "progress", "constraints")
"""The :class:`PlanOptions` fields the backend plans with (Dynamo decides shapes; no training or generation)."""


def _backend_from(options: dict[str, Any]) -> AutoTPBackend:
    """:func:`backend` from ``torch.compile(..., options={...})``'s flat dict: the backend's own keywords, plus
    any field of :class:`PlanOptions` or :class:`RuntimeOptions` by name."""
    own = {"world_size", "inner", "group", "max_shapes", "options", "runtime"}
    planning = {f.name for f in dataclasses.fields(PlanOptions)}
    running = {f.name for f in dataclasses.fields(RuntimeOptions)}
    unknown = sorted(set(options) - own - planning - running)
    if unknown:
        raise ValueError(f"torch.compile(..., backend='autotp', options=...) does not know {', '.join(unknown)}; "
                         f"it takes {', '.join(sorted(own - {'options', 'runtime', 'inner'}))} and the fields of "
                         "autotp.PlanOptions and autotp.RuntimeOptions")
    plan_fields = {k: v for k, v in options.items() if k in planning and k not in own}
    run_fields = {k: v for k, v in options.items() if k in running}
    kwargs = {k: v for k, v in options.items() if k in own}
    if plan_fields:
        kwargs["options"] = PlanOptions(**plan_fields)
    if run_fields:
        kwargs["runtime"] = RuntimeOptions(**run_fields)
    return backend(**kwargs)


class _EntryPoint:
    """``torch.compile(model, backend="autotp", options={...})``, registered in pyproject.toml.

    ``options`` are the keyword arguments of :func:`backend`, with the fields of :class:`PlanOptions` and
    :class:`RuntimeOptions` given flat (``{"world_size": 2, "strict": True}``). One backend per distinct set of
    options serves the process, so recompiles reuse its plans and shards; ``torch._dynamo.reset()``
    drops them.
    """

    __name__ = "autotp"

    def __init__(self) -> None:
        self._backends: dict[tuple, AutoTPBackend] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None) -> Any:
        options = dict(options or {})
        try:
            key = tuple(sorted(options.items()))
            hash(key)
        except TypeError as exc:
            raise ValueError(f"torch.compile options for backend='autotp' must be hashable values, got {options!r}; "
                             "pass backend=autotp.backend(...) for other options") from exc
        if key not in self._backends:
            self._backends[key] = _backend_from(options)
        return self._backends[key](gm, example_inputs)

    def reset(self) -> None:
        self._backends.clear()


autotp_backend = _EntryPoint()
"""The object the ``torch_dynamo_backends`` entry point ``autotp`` names."""
