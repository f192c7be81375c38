"""Capture: ``nn.Module`` + example inputs -> ATen-level FX graph with shapes on every node.

``torch.export.export(strict=False)`` gives a graph in which parameters, buffers and constants
are lifted to placeholders (for a transformers decoder of 4 or more identical layers, export traces
three of them and :mod:`autotp.capture.stamping` copies the last for the others: the same program, sooner); ``node.meta["val"]`` holds a FakeTensor (shape, dtype) for every
node. We keep that lifted form: the planner sees a parameter as an input it may split, and
the runtime feeds each rank its own shard in the parameter's place.

After capture the graph is *unchanged in meaning*; only ``_assert_tensor_metadata`` checks
(which export adds and which say nothing about layout) are removed, and a graph that updates
its own intermediate tensors in place (``x /= s``, ``out[idx] = v``: export keeps such in-place
ops) is *functionalized* (``ExportedProgram.run_decompositions({})``: every in-place op becomes
its out-of-place form, no other op is decomposed). The planner may give a tensor another
placement on each edge, which makes a copy; an update through one copy would not reach the
others, so only functional graphs are planned.

A model on the ``meta`` device (no weights) is traced *as if* its tensors lived on the device of
the example inputs (the CPU when they are on ``meta`` too): its parameters and buffers are
presented to ``torch.export`` as fake tensors on that device, so kernels are chosen, and strides
come out, exactly as for the real model. (Traced on ``meta`` itself, attention returns other
strides and the graph gains ``contiguous`` nodes; a plan made on meta would then not apply to
the real weights.) Tensor-creating ops in the graph name that device.

**State.** A buffer that forward updates in place is *state*: it persists across calls, like a
parameter that the graph writes (a static KV cache, ``cache.index_copy_(2, positions, new_keys)`` or
gpt-fast's ``cache[:, :, input_pos] = k``; a convolution or SSM state; a counter ``calls += 1``). Its
update stays in the graph (the functional ``index_copy`` / ``index_put``, or, for any other new value, a
``copy(buffer, new_value)`` added after every other node); the output that export adds for the new
value is dropped, and :attr:`CapturedGraph.state` maps the buffer's placeholder to its update node.
The planner places the buffer like a parameter and its update alike, and the runtime applies the
update in place on its own (possibly split) block of the buffer (:mod:`autotp.passes.state`).
Running statistics of a normalisation layer in train mode (BatchNorm) are refused instead, with what to do.

Shapes: by default the batch and sequence dims (dims 0 and 1) of every tensor input are
exported as dynamic (``torch.export.Dim.AUTO``), so the graph's sizes there are symbols
(``s72``) and one capture serves every batch size and sequence length. Export keeps a dim
static where the model's code needs one size (e.g. image channels read by a convolution) or
where the example size is 0 or 1 (trace with sizes >= 2). ``dynamic=False`` pins every dim at
its example size; ``dynamic_shapes=`` is passed to ``torch.export`` as is. A model that cannot
be exported with dynamic dims is exported static, with a warning naming why.
:class:`InputDims` records, per user input, which dims stayed static and the range of the
dynamic ones; the runtime checks every call against it.

**Tracing fast: one stack, tried in this order.** ``torch.export`` of a large model is most of a compile's
time, so :func:`capture` asks four layers for the program, each keeping one contract: *the program it
gives is the one* ``torch.export.export(model, ...)`` *would return for these inputs* (graph, signature,
shapes; the model's own weights bound), *or nothing, and the next layer is asked*:

1. **trace cache** (:mod:`autotp.capture.trace_cache`, ``trace_cache=``): an entry under the key of the model's
   code, config, weight specs, input specs and releases; read, checked against the model and rebuilt.
2. **shared trace** (:mod:`autotp.runtime.agreement.shared_trace`, ``share=``): in a group, rank 0 alone asks
   layers 1, 3 and 4 and sends the program without weights; a rank whose trace key equals rank 0's binds
   its own weights to it, any other rank asks 1, 3 and 4 as if alone.
3. **stamping** (:mod:`autotp.capture.stamping`): a decoder of 4 or more identical layers is exported with three
   and the last is stamped out to the others, where that is provably the same graph.
4. **torch.export** of the whole model (non-strict).

Both ways a program travels, the cache entry and the message to the group, are one form (the trace
cache's: ``torch._export.serde``'s schema without weights, see :mod:`autotp.capture.trace_cache` for why not
``torch.export.save``); a stamped program travels as the three layers' program and is stamped again
where it is read. The mesh search's two-layer copy (:func:`autotp.planning.mesh_search.reduced_copy`) is
not part of this stack: it prices layers and never gives a program that runs.

Refused, with what to do: models export cannot trace (data-dependent Python control flow),
models whose forward updates BatchNorm's running statistics (train mode) or its inputs in place,
outputs that are not tensors (or tuples, lists, dicts of them), and graphs that draw random
numbers (dropout in training mode): each rank would draw different ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autotp.adapters import hf_transformers, torch_internals, torchao
from autotp.adapters.hf_transformers import takes_use_cache, traced_kwargs
from autotp.adapters.torch_internals import FakeTensorMode
from autotp.base.errors import CaptureError, UnsupportedQuantizationError
from autotp.passes.grouped_query import attend_grouped_query, pack_one_token_gqa
from autotp.passes.rules.args import arg
from autotp.passes.state import IN_PLACE_UPDATES, WRITES_IN_PLACE

__all__ = [
    "CapturedGraph", "InputDims", "InputSlot", "as_if_on", "capture", "check_model", "default_dynamic_shapes",
    "from_exported", "draws_random_numbers", "inputs_on_model_device", "shapes_only",
]

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class InputSlot:
    """One placeholder of the captured graph: where its value comes from at run time.

    ``kind`` is ``"parameter"``, ``"buffer"``, ``"constant"`` or ``"user"``; ``target`` is the
    FQN of a parameter/buffer/constant, or the index into the flattened user inputs.
    """

    name: str
    kind: str
    target: str | int


@dataclasses.dataclass(frozen=True)
class InputDims:
    """One dim of one tensor user input, as traced: static (one size) or dynamic (a range).

    ``index`` is the input's position among the flattened user inputs, ``name`` its argument
    name (``input_ids``, ``kwargs['attention_mask']``). A dynamic dim has ``symbol`` (dims with
    the same symbol must have equal sizes) and ``low``/``high`` (``high`` None: no bound);
    ``requested`` says whether capture asked for it to be dynamic (so a static dim was pinned
    by the caller, or fixed by export).
    """

    index: int
    name: str
    dim: int
    traced: int
    symbol: str | None
    low: int
    high: int | None
    requested: bool


@dataclasses.dataclass
class CapturedGraph:
    """The traced model: graph, where each placeholder's value comes from, input/output specs."""

    graph_module: fx.GraphModule
    inputs: list[InputSlot]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    exported: ExportedProgram
    state: dict[str, str] = dataclasses.field(default_factory=dict)
    """State buffers (see the module docstring): placeholder name -> name of its update node (an ``index_copy``,
    ``index_put`` or ``copy`` whose first argument is the buffer, made in place on each rank)."""
    input_dims: tuple[InputDims, ...] = ()
    """Every dim of every tensor user input, as traced (see :class:`InputDims`)."""
    shape_mode: str = "static"
    """How input sizes were traced: ``"dynamic"`` (batch and sequence dims dynamic, the default),
    ``"static"`` (``dynamic=False``), ``"custom"`` (``dynamic_shapes=``), ``"static-fallback"``
    (dynamic export failed; traced static with a warning)."""
    from_cache: bool = False
    """True when the program came from the trace cache (:mod:`autotp.capture.trace_cache`) instead of ``torch.export``."""
    hf_use_cache: bool = False
    """A HF model traced with ``use_cache=False`` whatever the example said: calls may pass ``use_cache`` or
    leave it out (:mod:`autotp.adapters.hf_transformers`)."""
    constant_outputs: tuple[tuple[int, Any], ...] = ()
    """(flat position, value) of each output that is a constant of the trace (``None``, a number, a string): not a
    graph output; :attr:`outputs` puts it back."""

    @property
    def outputs(self) -> OutputStructure:
        """How a call's return value is rebuilt from the graph's tensor outputs."""
        return OutputStructure(self.out_spec, self.constant_outputs)

    def state_fqns(self) -> dict[str, str]:
        """Placeholder name -> FQN of every state buffer (e.g. ``key_cache_0``)."""
        return {s.name: str(s.target) for s in self.inputs if s.name in self.state}

    def parameter_fqns(self) -> dict[str, str]:
        """Placeholder name -> parameter FQN (e.g. ``model.layers.0.mlp.up_proj.weight``)."""
        return {s.name: str(s.target) for s in self.inputs if s.kind == "parameter"}


def inputs_on_model_device(model: torch.nn.Module, value: Any) -> Any:
    """``value`` (example inputs, any pytree) with its tensors moved to ``meta`` when the model is on ``meta``.

    Planning a model built on the meta device needs example inputs there too; for a model with
    real weights ``value`` is returned as is.
    """
    params = list(model.parameters())
    if params and params[0].device.type == "meta":
        return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)
    return value


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch (the user's or a model library's code)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return None
    frame = frames[-1]
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}\n    {frame.line}'


def check_model(model: object) -> None:
    """TypeError, saying what to pass, unless ``model`` is an ``nn.Module``."""
    if isinstance(model, torch.nn.Module):
        return
    name = getattr(model, "__name__", type(model).__name__)
    raise TypeError(
        f"autotp needs a torch.nn.Module (its parameters are what it splits), got {type(model).__name__} {name!r}. "
        "Pass the module itself (not its output, state_dict or a bound method); to split a function that uses "
        "weights, make it an nn.Module whose forward calls it with the weights as nn.Parameter attributes."
    )


def _is_meta_model(model: torch.nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def trace_device(example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None) -> torch.device:
    """The device a model is traced for: that of the first example tensor not on ``meta``, else the CPU."""
    for leaf in pytree.tree_leaves((example_inputs, example_kwargs or {})):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            return leaf.device
    return torch.device("cpu")


@contextlib.contextmanager
def as_if_on(model: torch.nn.Module, device: torch.device, example: Any, mode: FakeTensorMode | None = None) -> Any:
    """Within the block, ``model``'s parameters and buffers are fake tensors on ``device``; yields the
    example inputs as fake tensors on ``device`` (same mode: ``mode``, default a new one), for ``torch.export``
    to trace."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if mode is None else mode

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    with torchao.parts_as_parameters(model):  # a quantized weight: its parts faked, as export names them
        held_whole = [name for name, b in model.named_buffers() if torchao.is_subclass_weight(b)]
        if held_whole:  # faked as a plain tensor it would trace as a float weight of the same shape
            raise UnsupportedQuantizationError(
                f"{held_whole[0]} is a quantized tensor held as a buffer ({len(held_whole)} such buffers); autotp reads "
                "quantized weights that are parameters, as torchao's quantize_ leaves them")
        state: dict[str, torch.Tensor] = {
            name: torch.nn.Parameter(fake(p), requires_grad=False) for name, p in model.named_parameters()
        }
        state.update({name: fake(b) for name, b in model.named_buffers()})
        fake_example = pytree.tree_map_only(torch.Tensor, lambda t: fake(t) if t.device.type == "meta" else mode.from_tensor(t),
                                            example)
        with torch_internals.reparametrize_module(model, state, tie_weights=True):
            yield fake_example


@contextlib.contextmanager
def shapes_only(model: torch.nn.Module, device: torch.device) -> Any:
    """Within the block, calls of ``model`` give shapes and compute nothing: its tensors are fake on ``device``,
    tensors made in the block are fake too, sizes that depend on data are symbols, and the model sees the
    flags ``torch.export`` sets (``torch.compiler.is_exporting()``), so it takes the code path it is traced
    through. Cheap on any model, weights on ``meta`` included."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=torch_internals.shape_env())
    with as_if_on(model, device, (), mode=mode), mode, torch_internals.compiling_state_context():
        yield


DYNAMIC_DIMS = (0, 1)
"""Dims of each tensor input made dynamic by default: batch and sequence."""


def _bound_arguments(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``model.forward``'s arguments by name, as torch.export matches ``dynamic_shapes`` to them."""
    return dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)


def default_dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export``: dims 0 and 1 of every tensor input ``Dim.AUTO``.

    ``AUTO`` lets export keep a dim static where the model needs one size, instead of failing.
    Dims of example size 0 or 1 are left static: export would specialise them anyway.
    """
    from torch.export import Dim

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        dims = {d: Dim.AUTO for d in DYNAMIC_DIMS if d < value.dim() and value.shape[d] >= 2}
        return dims or None

    return {name: pytree.tree_map(spec, value) for name, value in _bound_arguments(model, args, kwargs).items()}


def _input_names(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """A readable name for every flattened user input (``input_ids``, ``kwargs['mask']``, ``x[1]``)."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, key, rest = path[0], path[1], path[2:]
        if getattr(top, "idx", None) == 0:
            index = key.idx  # type: ignore[attr-defined]
            base = params[index] if index < len(params) else f"args[{index}]"
        else:
            base = str(key.key)  # type: ignore[attr-defined]
        names.append(base + pytree.keystr(rest))
    return names


def _requested_dims(dynamic_shapes: Any, model: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> list[set[int]]:
    """Per flattened user input, the dims ``dynamic_shapes`` asks to be dynamic (best effort)."""
    bound = _bound_arguments(model, args, kwargs)
    if isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = dict(zip(bound, dynamic_shapes))
    if not isinstance(dynamic_shapes, dict):
        return []
    requested: dict[int, set[int]] = {}
    flat_ids = {id(v): i for i, v in enumerate(pytree.tree_leaves((args, kwargs)))}
    for name, value in bound.items():
        spec = dynamic_shapes.get(name)
        leaves = pytree.tree_leaves(value)
        specs = pytree.tree_flatten(spec, is_leaf=lambda x: isinstance(x, dict) or x is None)[0] if spec is not None else []
        for leaf, dims in zip(leaves, specs):
            if isinstance(leaf, torch.Tensor) and id(leaf) in flat_ids:
                marked = dims.keys() if isinstance(dims, dict) else (i for i, d in enumerate(dims or ()) if d is not None)
                requested[flat_ids[id(leaf)]] = set(marked)
    return [requested.get(i, set()) for i in range(len(flat_ids))]


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
    training: bool = False,
    trace_cache: Any = None,
    share: TraceShare | None = None,
) -> CapturedGraph:
    """Trace ``model(*example_inputs, **example_kwargs)`` with ``torch.export`` (non-strict); a Hugging Face
    model with ``use_cache=False`` (see :mod:`autotp.adapters.hf_transformers`).

    ``trace_cache`` (a :class:`autotp.capture.trace_cache.TraceCache`, or None): reuse the program traced
    for the same model and inputs before, and store a new one (see :mod:`autotp.capture.trace_cache`);
    :attr:`CapturedGraph.from_cache` says which happened. ``share`` (see :data:`TraceShare`): how
    to obtain the program instead of tracing it here.

    ``training=True``: the graph may draw random numbers (dropout in training mode), see
    :func:`from_exported`.

    ``dynamic=True`` (default) exports dims 0 and 1 of every tensor input as dynamic (see the
    module docstring); ``dynamic=False`` pins every size; ``dynamic_shapes`` overrides both
    and goes to ``torch.export.export`` unchanged.

    Raises :class:`CaptureError` naming the cause and the line of the model's code when the
    model cannot be exported (data-dependent control flow, unsupported Python, ...);
    :class:`~autotp.base.errors.UnsupportedReleaseError` on a torch release autotp is not tested on.
    """
    torch_internals.check_release()
    check_model(model)
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}; "
            "for one input write example_inputs=(x,)"
        )
    if hf_transformers.is_transformers_model(model):
        hf_transformers.check_release("a forward", hf_transformers.FORWARD_RELEASES)
    torchao.check_quantized_weights(model)  # an unsupported scheme fails here, not inside its subclass
    hf_model = takes_use_cache(model)
    kwargs = traced_kwargs(model, dict(example_kwargs or {}))  # a HF model: use_cache=False (autotp.adapters.hf_transformers)
    explicit = dynamic_shapes is not None
    if not explicit and dynamic:
        dynamic_shapes = default_dynamic_shapes(model, example_inputs, kwargs)
    mode = "custom" if explicit else "dynamic" if dynamic else "static"

    def trace() -> Traced:
        return _trace(model, example_inputs, kwargs, dynamic_shapes, mode, training, trace_cache)

    traced = trace() if share is None else share(model, example_inputs, kwargs, dynamic_shapes, training, trace)
    if traced.store is not None:  # after sharing: the other ranks rebuild the program meanwhile
        traced.store()
    captured = from_exported(traced.exported, type(model).__name__, training=training)
    captured.shape_mode = traced.mode
    captured.from_cache = traced.from_cache
    captured.hf_use_cache = hf_model
    requested = (_requested_dims(traced.dynamic_shapes, model, example_inputs, kwargs)
                 if traced.dynamic_shapes is not None else [])
    captured.input_dims = _input_dims(captured, _input_names(model, example_inputs, kwargs), requested)
    return captured


@dataclasses.dataclass
class Traced:
    """What tracing gave :func:`capture`: the program and how its input sizes were traced."""

    exported: ExportedProgram
    mode: str
    """:attr:`CapturedGraph.shape_mode`."""
    dynamic_shapes: Any
    """The ``dynamic_shapes`` the program was exported with (None: static)."""
    from_cache: bool = False
    fallback_warning: str | None = None
    """The warning given when dynamic export failed and the model was traced static (``"static-fallback"``)."""
    store: Callable[[], None] | None = None
    """Writes the new program to the trace cache: left to :func:`capture`, which does it once the program
    is shared with the group (``functools.partial(TraceCache.put, key, exported)``; the sharing rank binds
    ``payload=`` to the bytes it sent, so the program is not serialized twice)."""


TraceShare = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any, bool, Callable[[], Traced]], Traced]
"""``capture(share=...)``: called as ``share(model, args, kwargs, dynamic_shapes, training, trace)``
instead of ``trace()``, to obtain the program some other way when it is the same (one rank traces
for its group: :class:`autotp.runtime.agreement.shared_trace.FirstRankTrace`)."""


def _trace(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any, mode: str,
           training: bool, trace_cache: Any) -> Traced:
    """Export (through ``trace_cache``); a model that cannot be exported with the default dynamic dims
    is exported static, with a warning."""
    try:
        exported, from_cache, store = _export_or_reuse(model, args, kwargs, dynamic_shapes, training, trace_cache)
    except CaptureError as exc:
        if mode != "dynamic" or dynamic_shapes is None:
            raise
        try:
            exported = _export(model, args, kwargs, None)
        except CaptureError:
            raise exc from None
        message = (f"autotp: {type(model).__name__} could not be traced with dynamic batch and sequence dims, so it "
                   f"is traced at the example sizes only (other sizes raise an error naming the dim): "
                   f"{str(exc).splitlines()[0]}")
        warnings.warn(message, stacklevel=2)
        return Traced(exported, "static-fallback", None, fallback_warning=message)
    return Traced(exported, mode, dynamic_shapes, from_cache, store=store)


def _export_or_reuse(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
                     training: bool, trace_cache: Any) -> tuple[ExportedProgram, bool, Callable[[], None] | None]:
    """:func:`_export`, through ``trace_cache`` when there is one; whether the program came from the cache,
    and the write of a new one to the cache (:attr:`Traced.store`)."""
    if trace_cache is None:
        return _export(model, args, kwargs, dynamic_shapes), False, None
    from autotp.capture.trace_cache import trace_key

    device = trace_device(args, kwargs)
    key = trace_key(model, args, kwargs, dynamic_shapes, device=device, training=training)
    return trace_cache.get_or_export(key, model, device, lambda: _export(model, args, kwargs, dynamic_shapes))


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any) -> ExportedProgram:
    """:func:`_export_whole`, or for a transformers decoder, three of its layers exported and the graph stamped
    out to all of them (:mod:`autotp.capture.stamping`: the same program in a fraction of the time)."""
    from autotp.capture.stamping import export_stamped

    stamped = export_stamped(model, args, kwargs, dynamic_shapes, _export_functional)
    return stamped if stamped is not None else _export_functional(model, args, kwargs, dynamic_shapes)


def _export_functional(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       dynamic_shapes: Any) -> ExportedProgram:
    """:func:`_export_whole`, functionalized where needed (:func:`_functional`): a stamped program is stamped from
    its twin's functional program, so the other layers are never functionalized."""
    return _functional(_export_whole(model, args, kwargs, dynamic_shapes))


def _functional(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` functionalized where it writes in place (a KV cache's ``index_copy_``) or holds tensor subclass
    weights (torchao: split into their parts), as :func:`from_exported` would do it, but once where it was traced:
    before a rank sends it to its group or the trace cache keeps it, so that no other rank and no later load
    functionalizes it again (re-tracing the whole program: more than half of a generation graph's capture), and
    for a stamped program on its three traced layers only."""
    if _needs_functionalizing(exported.graph_module) or torchao.holds_subclass_weights(exported.state_dict):
        return exported.run_decompositions({})
    return exported


def _export_whole(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any) -> ExportedProgram:
    """``torch.export.export`` (non-strict); a failure becomes a :class:`CaptureError` with the user's line."""
    try:
        with torch.no_grad():
            if _is_meta_model(model):
                with as_if_on(model, trace_device(args, kwargs), (args, kwargs)) as (fake_args, fake_kwargs):
                    return torch.export.export(model, fake_args, fake_kwargs, dynamic_shapes=dynamic_shapes, strict=False)
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with the user's line
        where = _user_frame(exc)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            "autotp traces the model with torch.export (non-strict). Make the forward pass free of "
            "Python control flow that depends on tensor values (compute both branches and select with torch.where), "
            "or pass example inputs that match what forward() expects."
        )
        location = f"\n  at {where}" if where else ""
        raise CaptureError(f"could not trace {type(model).__name__}: {type(exc).__name__}: {first_line}{location}\n{hint}") from exc


def _input_dims(captured: CapturedGraph, names: list[str], requested: list[set[int]]) -> tuple[InputDims, ...]:
    """Every dim of every tensor user input: its traced size, and its symbol and range if dynamic."""
    import sympy

    from autotp.base.shapes import concrete_size, is_static

    ranges = captured.exported.range_constraints
    placeholders = {n.name: n for n in captured.graph_module.graph.nodes if n.op == "placeholder"}
    dims = []
    for slot in captured.inputs:
        if slot.kind != "user":
            continue
        val = placeholders[slot.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        index = int(slot.target)
        name = names[index] if index < len(names) else f"user input {index}"
        asked = requested[index] if index < len(requested) else set()
        for dim, size in enumerate(val.shape):
            symbol: str | None = None
            low: int = concrete_size(size)
            high: int | None = low
            if isinstance(size, torch.SymInt) and not is_static(size):
                expr = size.node.expr
                symbol = str(expr)
                bounds = ranges.get(expr)
                low = int(bounds.lower) if bounds is not None and isinstance(bounds.lower, sympy.Integer) else 0
                high = int(bounds.upper) if bounds is not None and isinstance(bounds.upper, sympy.Integer) else None
            dims.append(InputDims(index, name, dim, concrete_size(size), symbol, low, high, dim in asked))
    return tuple(dims)


def _needs_functionalizing(gm: fx.GraphModule) -> bool:
    """True when some node writes into one of its arguments (``div_``, ``index_put_``, ``copy_``, ...),
    or wraps a region in a submodule (``torch.autocast`` inside forward), which the functional form inlines.

    ``batch_norm`` in training mode updates its running statistics without saying so in its schema.
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), torch.nn.Module):
            return True
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if node.target is torch.ops.aten.batch_norm.default and node.args[5] and node.args[3] is not None:
            return True
    return False


def _draws_random_numbers(node: fx.Node) -> bool:
    """True for ops that sample (``rand``, ``bernoulli``, dropout in training mode, ...).

    Ops with a dropout probability (``dropout``, ``scaled_dot_product_attention``) sample only
    when it is non-zero and, where they have a ``train`` flag, in training mode.
    """
    tags = getattr(node.target, "tags", ())
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = node.target._schema
    bound = {a.name: arg(node, i, a.name, a.default_value) for i, a in enumerate(schema.arguments)}
    probability = bound.get("p", bound.get("dropout_p"))
    if probability is not None and not isinstance(probability, fx.Node) and probability == 0:
        return False
    return bool(bound.get("train", bound.get("training", True)))


def random_state_fingerprint(gm: fx.GraphModule) -> str | None:
    """For a graph that draws random numbers (training with dropout): a hash of this process's RNG state
    on the devices it draws on, which every rank must share (seed every rank alike); ``None`` otherwise.

    Every random op stays replicated (the dropout rules offer no split), so ranks whose generators
    agree draw the same masks, the same as one process with that seed.
    """
    import hashlib

    random_nodes = [n for n in gm.graph.nodes if _draws_random_numbers(n)]
    if not random_nodes:
        return None
    devices = {val.device for n in random_nodes for val in [n.meta.get("val")] if isinstance(val, torch.Tensor)}
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    for device in sorted(devices - {torch.device("cpu")}, key=str):
        module = torch.get_device_module(device.type)
        digest.update(module.get_rng_state(device).numpy().tobytes())
    return digest.hexdigest()[:16]


def draws_random_numbers(node: fx.Node) -> bool:
    """True for ops that sample (dropout in training mode, ``rand``...): see :func:`_draws_random_numbers`."""
    return _draws_random_numbers(node)


def _check_no_randomness(gm: fx.GraphModule, what: str) -> None:
    """Refuse graphs that sample: each rank would draw its own numbers and the ranks' outputs would differ."""
    random_nodes = [n for n in gm.graph.nodes if _draws_random_numbers(n)]
    if random_nodes:
        where = []
        for node in random_nodes:
            trace = (node.meta.get("stack_trace") or "").strip().splitlines()
            where.append(f"{node.target}" + (f" at {trace[-2].strip()}" if len(trace) >= 2 else ""))
        raise CaptureError(
            f"{what}.forward draws random numbers: {'; '.join(where)}. Each rank would draw its own and the "
            "ranks' outputs would differ from each other and from the model's; call model.eval() (dropout in "
            "training mode is the usual cause), or pass the random tensor in as an input."
        )


def _check_straight_line(gm: fx.GraphModule, what: str) -> None:
    """Refuse graphs that still call submodules (``torch.cond``, ``torch.while_loop``): autotp plans one flat graph."""
    nested = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), fx.GraphModule)]
    if nested:
        users = sorted({str(u.target) for n in nested for u in n.users})
        raise CaptureError(
            f"{what}.forward contains control-flow operators ({', '.join(users)}) whose branches are separate "
            "graphs; autotp plans one straight-line graph. Compute both branches and select with torch.where, "
            "or keep the branching outside the model."
        )


def _data_dependent(value: Any) -> bool:
    """Whether a traced tensor has a size with no example value (an unbacked size: it depends on the data)."""
    return isinstance(value, torch.Tensor) and any(
        isinstance(size, torch.SymInt) and size.node.hint is None for size in value.shape)


def _check_sizes_from_inputs(gm: fx.GraphModule, what: str) -> None:
    """Refuse graphs with a tensor whose size depends on the data (``nonzero``, a count read to the host): a plan holds
    for every call only where every size follows from the input sizes, and the planner prices example sizes."""
    found = next((n for n in gm.graph.nodes if _data_dependent(n.meta.get("val"))), None)
    if found is None:
        return
    trace = (found.meta.get("stack_trace") or "").strip().splitlines()
    at = f" at {trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else ""
    raise CaptureError(
        f"{what}.forward makes a tensor whose size depends on the data, not on the input sizes: {found.name} "
        f"({found.target}, shape {tuple(found.meta['val'].shape)}){at}. autotp plans one graph at the example sizes "
        "for every call, so every size must follow from the input sizes; a mixture of experts that loops over the "
        "experts its router hit, or counts their rows on the host, does this: run the experts as one grouped GEMM "
        "(transformers' experts_implementation='grouped_mm', where the model offers it)."
    )


_CONSTANT_OUTPUT_TYPES = (type(None), bool, int, float, complex, str, bytes)
"""Non-tensor outputs that are constants of the trace (``(logits, None)``, a flag, a name): returned as traced."""


def _constant_outputs(exported: ExportedProgram, what: str) -> tuple[tuple[int, Any], ...]:
    """(flat position, value) of each output that is a constant of the trace; refuse any other non-tensor output
    (a size of a dynamic dim, which would be this rank's size of a split dim)."""
    output = next(n for n in exported.graph_module.graph.nodes if n.op == "output")
    constants = []
    for index, value in enumerate(pytree.tree_leaves(output.args[0])):
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            continue
        if not isinstance(value, fx.Node) and isinstance(value, _CONSTANT_OUTPUT_TYPES):
            constants.append((index, value))
            continue
        shown = value.meta.get("val") if isinstance(value, fx.Node) else value
        if isinstance(shown, torch.SymInt):  # a size of a dynamic dim: show the traced one
            shown = shown.node.hint
        raise CaptureError(
            f"{what}.forward returns a value that is neither a tensor nor a constant of the trace (output {index}: "
            f"{shown!r} of type {type(shown).__name__}, computed from the inputs' sizes or values). autotp returns "
            "tensors, and None, numbers and strings that do not depend on the inputs; return the value as a tensor, "
            "or compute it outside the model."
        )
    return tuple(constants)


def _drop_constant_outputs(gm: fx.GraphModule, constants: tuple[tuple[int, Any], ...]) -> None:
    """Remove the constant outputs from ``gm``'s output node: the graph returns tensors only, and
    :meth:`OutputStructure.unflatten` puts the constants back where the model returned them."""
    if not constants:
        return
    output = next(n for n in gm.graph.nodes if n.op == "output")
    places = {index for index, _ in constants}
    output.args = (tuple(v for index, v in enumerate(output.args[0]) if index not in places),)


@dataclasses.dataclass(frozen=True)
class OutputStructure:
    """The model's return value from the graph's tensor outputs: the traced structure (``spec``) with the
    constants of the trace (None, numbers, strings) back at their flat positions."""

    spec: pytree.TreeSpec
    constants: tuple[tuple[int, Any], ...] = ()

    def unflatten(self, tensors: Sequence[Any]) -> Any:
        """``tensors`` (the graph's outputs, in order) in the structure the model returns."""
        leaves = list(tensors)
        for index, value in self.constants:  # ascending positions: each lands where the model had it
            leaves.insert(index, value)
        return pytree.tree_unflatten(leaves, self.spec)


def from_exported(exported: ExportedProgram, what: str, *, training: bool = False) -> CapturedGraph:
    """The :class:`CapturedGraph` of an ``ExportedProgram`` (``what`` names the traced callable in errors).

    Shared by :func:`capture` and the ``torch.compile`` backend, which exports Dynamo's graph.
    ``training=True`` keeps ops that draw random numbers (dropout): the planner keeps them
    replicated, so every rank draws the same numbers from the same stream (see
    :func:`random_state_fingerprint`). Refuses a torch release autotp is not tested on (``UnsupportedReleaseError``).
    """
    from torch.export.graph_signature import OutputKind

    torch_internals.check_release()

    if _needs_functionalizing(exported.graph_module) or torchao.holds_subclass_weights(exported.state_dict):
        # export's graph keeps in-place ops and does not list what they update; the functional
        # form lists every updated buffer and input in its signature (and a quantized weight's parts).
        # capture's own traces arrive functional already (_functional); the torch.compile backend's do not
        exported = exported.run_decompositions({})
    state = _state_updates(exported)
    specs_out = exported.graph_signature.output_specs
    _check_buffer_updates(exported, state, what, training)
    inputs = [str(o.target) for o in specs_out if o.kind == OutputKind.USER_INPUT_MUTATION]
    other = [f"{o.target} ({o.kind.name})" for o in specs_out
             if o.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)]
    if inputs:
        raise CaptureError(
            f"{what}.forward updates its input(s) in place: {', '.join(inputs)}. The tensor-parallel model "
            "cannot write back into the caller's tensors; compute on a copy (e.g. x = x + 1 instead of x += 1) "
            "and return the result."
        )
    if other:
        raise CaptureError(f"{what}.forward has outputs autotp cannot handle: {', '.join(other)}; return tensors only.")
    constant_outputs = _constant_outputs(exported, what)
    if not training:
        _check_no_randomness(exported.graph_module, what)
    _check_straight_line(exported.graph_module, what)
    _check_sizes_from_inputs(exported.graph_module, what)
    gm = exported.graph_module
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    state_by_placeholder = _drop_state_outputs(exported, state)
    _drop_constant_outputs(gm, constant_outputs)
    nodes = {n.name: n for n in gm.graph.nodes}
    for update in state_by_placeholder.values():
        nodes[update].meta[WRITES_IN_PLACE] = True  # priced as the rows it writes (passes/state.py)
    if not training:
        pack_one_token_gqa(gm)  # a decode step attends to the KV cache without copying it per head
        attend_grouped_query(gm)  # so does a prefill chunk (enable_gqa)
    gm.graph.lint()
    gm.recompile()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = exported.graph_signature.input_specs
    if len(specs) != len(placeholders):
        raise CaptureError(f"export produced {len(placeholders)} placeholders but {len(specs)} input specs")
    kinds = {
        InputKind.PARAMETER: "parameter",
        InputKind.BUFFER: "buffer",
        InputKind.CONSTANT_TENSOR: "constant",
        InputKind.USER_INPUT: "user",
    }
    slots: list[InputSlot] = []
    user_index = 0
    for node, spec in zip(placeholders, specs):
        kind = kinds.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported export input kind {spec.kind} for {node.name}")
        if kind == "user":
            slots.append(InputSlot(node.name, kind, user_index))
            user_index += 1
        else:
            slots.append(InputSlot(node.name, kind, str(spec.target)))
    return CapturedGraph(gm, slots, exported.call_spec.in_spec, exported.call_spec.out_spec, exported,
                         state=state_by_placeholder, constant_outputs=constant_outputs)


_TRAIN_MODE_STATISTICS = (torch.ops.aten._native_batch_norm_legit_functional.default,)
"""Ops whose outputs include running statistics that a normalisation layer updates in training mode."""


def _new_value(exported: ExportedProgram, fqn: str) -> fx.Node | None:
    """The node whose value export writes back into buffer ``fqn`` (None when ``fqn`` is not updated)."""
    from torch.export.graph_signature import OutputKind

    name = next((str(o.arg.name) for o in exported.graph_signature.output_specs
                 if o.kind == OutputKind.BUFFER_MUTATION and str(o.target) == fqn), None)
    return next((n for n in exported.graph_module.graph.nodes if n.name == name), None) if name else None


def _check_buffer_updates(exported: ExportedProgram, state: dict[str, str], what: str, training: bool) -> None:
    """Refuse buffer updates that are not state (:func:`_state_updates`), naming each buffer and why.

    Running statistics of a normalisation layer in train mode (BatchNorm's) are refused: for inference
    the model is almost surely meant to be in eval mode; for training they would be state that the
    planner keeps whole beside a split normalisation, which autotp does not build yet.
    """
    from torch.export.graph_signature import OutputKind

    mutated = [str(o.target) for o in exported.graph_signature.output_specs if o.kind == OutputKind.BUFFER_MUTATION]

    def statistic(fqn: str) -> bool:
        value = _new_value(exported, fqn)
        source = value.args[0] if value is not None and value.target is operator.getitem else value
        return isinstance(source, fx.Node) and source.target in _TRAIN_MODE_STATISTICS

    statistics = [fqn for fqn in mutated if statistic(fqn)]
    if statistics:
        fix = ("call model.eval() before compiling for inference" if not training else
               "to train, construct the normalisation with track_running_stats=False (batch statistics, which autotp "
               "splits by channel), or put it in eval mode (frozen statistics, as in fine-tuning) with "
               "module.eval() on those layers")
        raise CaptureError(
            f"{what}.forward updates buffers in place: {', '.join(mutated)}. {', '.join(statistics)} are running "
            f"statistics of a normalisation layer in train mode, which autotp does not keep as state; {fix}."
        )
    unplaced = [fqn for fqn in mutated if fqn not in state]
    if unplaced:
        raise CaptureError(
            f"{what}.forward updates buffers in place: {', '.join(unplaced)}, but the new value is not a tensor the "
            "graph computes, so autotp cannot keep it as state on each rank; write a tensor into the buffer "
            "(buffer.copy_(new), buffer[index] = new), or move the update out of forward()."
        )


def _state_updates(exported: ExportedProgram) -> dict[str, str]:
    """Buffer FQN -> name of the node computing its new value, for every buffer that forward updates.

    Each is *state*: the rank-local graph writes this rank's block of the new value into its block of the
    buffer. Where the new value is an update written in place (:data:`~autotp.passes.state.IN_PLACE_UPDATES`)
    straight into the buffer, which nothing else reads, that update writes in place; otherwise
    :func:`_drop_state_outputs` adds a copy into the buffer after every other node.
    """
    from torch.export.graph_signature import OutputKind

    signature = exported.graph_signature
    placeholder_of = {str(i.target): i.arg.name for i in signature.input_specs if i.kind == InputKind.BUFFER}
    nodes = {n.name: n for n in exported.graph_module.graph.nodes}
    state: dict[str, str] = {}
    for spec in signature.output_specs:
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        update = nodes.get(getattr(spec.arg, "name", ""))
        if (update is not None and update.name != placeholder_of.get(str(spec.target))
                and isinstance(update.meta.get("val"), torch.Tensor)):
            state[str(spec.target)] = update.name
    return state


def _writes_in_place(update: fx.Node, buffer: fx.Node) -> bool:
    """True when ``update`` overwrites slices of ``buffer`` itself (an in-place form exists) and nothing else reads it."""
    return update.op == "call_function" and update.target in IN_PLACE_UPDATES and update.args[0] is buffer \
        and len(buffer.users) == 1


def _drop_state_outputs(exported: ExportedProgram, state: dict[str, str]) -> dict[str, str]:
    """Remove the outputs export added for state buffers' new values; placeholder name -> update node name.

    The graph keeps only the user outputs; the updates stay in the graph, read by what uses the
    new value (attention reads the updated cache). A new value that is not written in place
    (:func:`_writes_in_place`: a counter's ``calls + 1``, a rolled convolution state) gets an update of its
    own, ``copy(buffer, new_value)`` just before the output, so every read of the old value comes first;
    the planner places it like the buffer (the edge is ``must_match``) and reshards the new value to it.
    """
    if not state:
        return {}
    from torch.export.graph_signature import OutputKind

    graph = exported.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    specs = exported.graph_signature.output_specs
    values = list(output.args[0])
    kept = [v for v, spec in zip(values, specs)
            if not (spec.kind == OutputKind.BUFFER_MUTATION and str(spec.target) in state)]
    output.args = (tuple(kept),)
    placeholder_of = {str(i.target): i.arg.name for i in exported.graph_signature.input_specs if i.kind == InputKind.BUFFER}
    nodes = {n.name: n for n in graph.nodes}
    updates: dict[str, str] = {}
    for fqn, name in state.items():
        buffer, update = nodes[placeholder_of[fqn]], nodes[name]
        if not _writes_in_place(update, buffer):
            with graph.inserting_before(output):
                copy = graph.call_function(torch.ops.aten.copy.default, (buffer, update))
            copy.meta.update({k: v for k, v in update.meta.items() if k in ("stack_trace", "nn_module_stack")})
            copy.meta["val"] = buffer.meta["val"]
            update = copy
        updates[buffer.name] = update.name
    exported.graph_module.recompile()
    return updates
