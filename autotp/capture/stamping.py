"""Trace three layers, stamp the rest: the program of an N-layer decoder from a 3-layer export.

``torch.export`` time grows linearly with depth, and a transformers decoder's layers are the same
module N times in one ``ModuleList``. So :func:`export_stamped` exports a *twin* of the model that
holds only the first three layers (shallow copies of the modules on the path to the list; every
module, weight and the config are the model's own), then extends the ATen graph to N layers: the
nodes of layer 2 (those whose ``nn_module_stack`` lies under ``<list>.2``) are copied for layers
3..N-1 with

- parameter and buffer placeholders renamed to ``<list>.i`` (placeholders and signature entries
  inserted where ``torch.export`` puts them: after layer i-1's, layer by layer), and so is the state a
  wrapper holds for each layer outside the list (see below);
- each value layer 2 took from layer 1 (the hidden states) taken from the copy of layer i-1;
- values shared by every layer (rotary cos/sin, the attention mask, positions, symbolic sizes)
  left shared;
- node names numbered on from the highest number of their kind so far, as export numbers the nodes
  it makes (``linear_14`` .. ``linear_20`` in layer 2, ``linear_21`` .. in layer 3), the nodes after
  the layers (final norm, head) alike; ``nn_module_stack`` and ``torch_fn`` renamed to layer i. A
  functionalized program is numbered by one retrace, the same gaps in every layer: there a stamped
  layer's names are the copied layer's moved on by the step from layer 1 to layer 2.

**State held per layer outside the list.** The KV-cache wrapper a generation compile traces
(:class:`autotp.capture.kv_cache.CachedCausalLM`) holds each layer's keys and values as its own
buffers (``key_cache_i``) and its graphs write them. It declares them with ``stamping_layer_state()``
(the decoder it wraps and, per layer, those buffers' names); its twin holds the first three layers'
only. The twin's program is functionalized before it is stamped (the writes become state updates
among its outputs, three layers' worth instead of N: functionalizing re-traces the whole program),
and the stamped layers get their buffers, their writes and their updates, in export's order.

Three layers, not two: export's numbering has gaps that depend on its internal caches (Llama's
first and third attention use up names of nodes export deletes), so the names of layers 0 and 1
do not predict the next layer's. The result is an ``ExportedProgram`` like ``torch.export``'s for
the whole model node for node (ops, arguments, shapes and symbols, placeholder names, signature,
state, module call graph; tests compare the two on several transformers families) but for the
numbers in some names (the symbolic-size nodes export adds after tracing; a few nodes after the
layers), so the trace cache, the shared trace and everything downstream take it unchanged.

Only stamped when that is provably the same graph, else the model is exported whole (the reason
logged at debug level on the ``autotp.capture.stamping`` logger): the model has ``config.num_hidden_layers``
(>= 4) and exactly one ``ModuleList`` of that length; every layer has the same module classes,
plain attributes (layer-index attributes aside), parameter and buffer specs and hooks, shares no
weight with another layer, and every per-layer list of the config (``layer_types``, ...) holds
one value; the twin exports; layers 1 and 2 are isomorphic blocks (same ops, constant arguments,
shapes, module paths) that sit back to back in the graph; layer 2 reads from layer 1 only values
that stand where layer 1 read layer 0's; nothing after the layers reads an earlier layer than the
last, and the program's outputs are user outputs, or updates of state a layer holds made by that
layer.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind, TensorArgument

from autotp.adapters import torchao
from autotp.base.errors import CaptureError
from autotp.base.module_paths import differing_layer, layer_lists, within

__all__ = ["MIN_LAYERS", "StampError", "StampedFrom", "export_stamped", "layer_stack", "restamp", "stamped_from", "twin"]

log = logging.getLogger(__name__)

_TRACED_LAYERS = 3
"""Layers the twin keeps: the last is copied; the step of each name's number is read off the last two (the
first layer may use up more numbers than the others, e.g. for checks made once)."""

MIN_LAYERS = _TRACED_LAYERS + 1
"""Fewest layers worth stamping."""

_Item = TypeVar("_Item")

_EXPORT_ADDED_NODE = "_empty_nn_module_stack_from_metadata_hook"
_NAME_NUMBER = re.compile(r"(.*)_(\d+)$")


class StampError(ValueError):
    """Why a model's program cannot be stamped from its twin's (the model is then exported whole)."""


Export = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], ExportedProgram]


def export_stamped(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
                   export: Export) -> ExportedProgram | None:
    """``model``'s program from its twin's export (``export(twin, args, kwargs, dynamic_shapes)``), or
    None when stamping does not apply or cannot be proven right (see the module docstring)."""
    try:
        path, count = layer_stack(model)
    except StampError as why:
        log.debug("autotp: %s is exported whole: %s", type(model).__name__, why)
        return None
    twin = _twin(model, path)
    try:
        small = export(twin, args, kwargs, dynamic_shapes)
    except CaptureError as exc:
        log.debug("autotp: %s is exported whole: its twin did not export (%s)", type(model).__name__,
                  str(exc).splitlines()[0])
        return None
    try:
        stamped = restamp(small, model, path, count)
    except StampError as why:
        log.debug("autotp: %s is exported whole: %s", type(model).__name__, why)
        return None
    log.debug("autotp: %s traced with %d of its %d layers, the others stamped", type(model).__name__,
              _TRACED_LAYERS, count)
    return stamped


@dataclasses.dataclass(frozen=True)
class StampedFrom:
    """How a stamped program was made: the twin's program (``torch.export``'s, unchanged) and the list
    of layers (``path``, ``count`` layers). The trace cache and the shared trace store and send ``traced``
    (a few layers: smaller, and quicker to rebuild) and stamp again where it is read (:func:`restamp`)."""

    traced: ExportedProgram
    path: str
    count: int


_STAMPED_FROM = "_autotp_stamped_from"
"""Attribute of a stamped ``ExportedProgram`` holding its :class:`StampedFrom`."""


def stamped_from(exported: ExportedProgram) -> StampedFrom | None:
    """How ``exported`` was stamped, or None when ``torch.export`` made it whole."""
    return getattr(exported, _STAMPED_FROM, None)


def twin(model: torch.nn.Module, path: str, count: int) -> torch.nn.Module | None:
    """The twin :func:`export_stamped` traces for ``model`` (its first layers of the list at ``path``), or
    None when ``model`` is not one to stamp that way (another list, another length, layers not uniform)."""
    try:
        found = layer_stack(model)
    except StampError:
        return None
    return _twin(model, path) if found == (path, count) else None


def restamp(traced: ExportedProgram, model: torch.nn.Module, path: str, count: int) -> ExportedProgram:
    """``model``'s program stamped from ``traced``, its twin's (:func:`twin`); :class:`StampError` when the
    twin's program cannot be stamped (see the module docstring)."""
    stamped = _stamp(traced, model, path, count)
    setattr(stamped, _STAMPED_FROM, StampedFrom(traced, path, count))
    return stamped


def _config_layer_count(model: torch.nn.Module) -> int | None:
    config: Any = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if count is None and hasattr(config, "get_text_config"):
        count = getattr(config.get_text_config(), "num_hidden_layers", None)
    return count if isinstance(count, int) else None


def layer_stack(model: torch.nn.Module) -> tuple[str, int]:
    """The FQN of the model's one list of identical layers and its length; :class:`StampError` says why not."""
    decoder, held = _held_state(model)
    count = _config_layer_count(decoder)
    if count is None:
        raise StampError("it has no config.num_hidden_layers (not a transformers model)")
    if count < MIN_LAYERS:
        raise StampError(f"{count} layers: fewer than {MIN_LAYERS}, nothing to stamp")
    lists = layer_lists(model, count)
    if len(lists) != 1:
        raise StampError(f"{len(lists)} ModuleLists of {count} modules (config.num_hidden_layers); stamping needs one")
    path = lists[0]
    layers = model.get_submodule(path)
    if (index := differing_layer(layers)) is not None:
        raise StampError(f"{path}.{index} differs from {path}.0 (module classes, attributes, weights or hooks)")
    owners: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for tensor in (*layer.parameters(), *layer.buffers()):
            if owners.setdefault(id(tensor), index) != index:
                raise StampError(f"{path}.{index} shares a weight with {path}.{owners[id(tensor)]}")
    config: Any = getattr(decoder, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, value in settings.items():
        if isinstance(value, (list, tuple)) and len(value) == count and len({repr(v) for v in value}) > 1:
            raise StampError(f"config.{key} differs between layers")
    if held and len(held) != count:
        raise StampError(f"{type(model).__name__} holds state for {len(held)} of the {count} layers")
    return path, count


def _held_state(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[str, ...]]]:
    """The decoder whose config counts the layers, and per layer the names of ``model``'s own buffers that hold
    that layer's state outside the list (empty: none). A module wrapping a decoder declares both with
    ``stamping_layer_state()`` (the KV-cache wrapper: the decoder, each layer's keys and values); it may return
    None to be exported whole. Any other module is its own decoder."""
    declare = getattr(type(model), "stamping_layer_state", None)
    if declare is None:
        return model, []
    declared = declare(model)
    if declared is None:
        raise StampError(f"{type(model).__name__} is not stamped (it says so)")
    decoder, held = declared
    held = [tuple(names) for names in held]
    if len({len(names) for names in held}) > 1:
        raise StampError(f"{type(model).__name__} holds a different number of buffers for some layers")
    if any(name not in model._buffers for names in held for name in names):
        raise StampError(f"{type(model).__name__} declares layer state that is not its own buffer")
    return decoder, held


@dataclasses.dataclass(frozen=True)
class _Targets:
    """Which layer a state target (a parameter, buffer or constant FQN) belongs to, and its counterpart in another
    layer: the layer's own weights (under ``<path>.i``) and the state held for it outside the list."""

    path: str
    held: list[tuple[str, ...]]

    @classmethod
    def of(cls, model: torch.nn.Module, path: str) -> _Targets:
        return cls(path, _held_state(model)[1])

    def layer_of(self, target: str) -> int | None:
        block = target[len(self.path) + 1:].split(".", 1)[0] if within(target, self.path) else ""
        if block.isdigit():
            return int(block)
        return next((i for i, names in enumerate(self.held) if target in names), None)

    def moved(self, target: str, layer: int) -> str:
        """``target`` of its layer's counterpart in ``layer``."""
        if within(target, self.path):
            _, rest = target[len(self.path) + 1:].split(".", 1)
            return f"{self.path}.{layer}.{rest}"
        own = self.layer_of(target)
        if own is None:
            raise StampError(f"{target} belongs to no layer")
        return self.held[layer][self.held[own].index(target)]


def _renamed_placeholder(name: str, target: str, moved: str) -> str:
    """The placeholder name export gives ``moved`` where it gave ``target`` the name ``name`` (``p_``/``b_``/``c_``
    and the FQN with dots as underscores)."""
    old, new = target.replace(".", "_"), moved.replace(".", "_")
    if not name.endswith(old):
        raise StampError(f"placeholder {name} does not name its target {target}")
    return name[:len(name) - len(old)] + new


def _twin(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """``model`` with only the first ``_TRACED_LAYERS`` modules of the list at ``path`` (and the state it holds
    for those only): shallow copies of the modules on the way there (their submodule dicts copied), everything
    else the model's own."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    targets = _Targets.of(model, path)
    twin._buffers = {name: buffer for name, buffer in model._buffers.items()
                     if (layer := targets.layer_of(name)) is None or layer < _TRACED_LAYERS}
    parent = twin
    *ancestors, last = path.split(".")
    for name in ancestors:
        child = copy.copy(parent.get_submodule(name))
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    layers = parent.get_submodule(last)
    if not isinstance(layers, torch.nn.ModuleList):
        raise StampError(f"{path} is not a ModuleList of {type(model).__name__}")
    parent._modules[last] = torch.nn.ModuleList(list(layers)[:_TRACED_LAYERS])
    return twin


def _block_of(node: fx.Node, prefixes: tuple[str, ...]) -> int | None:
    """The layer that made ``node`` (by its ``nn_module_stack``: under ``prefixes[i]``), else None."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for key, (path, *_) in stack.items() if key != _EXPORT_ADDED_NODE]
    for index, prefix in enumerate(prefixes):
        if any(within(p, prefix) for p in paths):
            return index
    return None


def _split_name(name: str) -> tuple[str, int]:
    """``linear_7`` -> (``linear``, 7); ``linear`` -> (``linear``, 0): FX's numbering of names."""
    match = _NAME_NUMBER.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _numbered(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


class _Numbering:
    """Per name base, how far the number of a ``torch_fn`` name moves from one layer to the next (read
    off the last two traced layers)."""

    def __init__(self) -> None:
        self.step: dict[str, int] = {}
        self.irregular: set[str] = set()

    def learn(self, first: str, second: str) -> None:
        """Learn from a name of the layer before and the same node's in the next; a base numbered
        irregularly is left as it is."""
        (base, number), (base_1, number_1) = _split_name(first), _split_name(second)
        step = number_1 - number
        if base != base_1 or step < 0 or self.step.setdefault(base, step) != step:
            self.irregular.add(base)

    def shifted(self, name: str, layers: int) -> str:
        """``name`` moved on by ``layers`` layers (names of bases that no layer uses stay)."""
        base, number = _split_name(name)
        step = self.step.get(base)
        return name if step is None or base in self.irregular else _numbered(base, number + layers * step)


def _torch_fn_name(node: fx.Node) -> str | None:
    value = node.meta.get("torch_fn")
    return value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else None


def _value_text(value: Any) -> str:
    """Shape, stride and dtype of a node's value (symbolic sizes as their expressions), for comparing."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return repr(value)


@dataclasses.dataclass
class _Program:
    """The traced program (``_TRACED_LAYERS`` layers) taken apart: its nodes by role."""

    prefixes: tuple[str, ...]
    """FQN of each traced layer (``model.layers.0``...)."""
    placeholders: list[fx.Node]
    before: list[fx.Node]
    blocks: list[list[fx.Node]]
    """Each traced layer's nodes, in graph order."""
    after: list[fx.Node]
    output: fx.Node
    layer_inputs: dict[fx.Node, int]
    """Placeholder -> its layer, for a parameter, buffer or constant of a traced layer (or state held for it)."""
    next_input: dict[fx.Node, fx.Node]
    """A traced layer's placeholder -> the same weight's (or state's) of the next traced layer."""
    updates: dict[int, int]
    """Output position -> layer, for the outputs that update state held for a layer (a KV cache's new keys)."""

    def user_outputs(self) -> list[fx.Node]:
        """The values the program returns to its caller (its outputs but the state updates)."""
        values = self.output.args[0]
        return [v for i, v in enumerate(values) if i not in self.updates and isinstance(v, fx.Node)]


def _take_apart(small: ExportedProgram, targets: _Targets) -> _Program:
    prefixes = tuple(f"{targets.path}.{i}" for i in range(_TRACED_LAYERS))
    nodes = list(small.graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    layer_inputs: dict[fx.Node, int] = {}
    roles: dict[fx.Node, str] = {}  # a layer's placeholder -> what it is in every layer (its target in layer 0)
    for node, spec in zip(placeholders, small.graph_signature.input_specs):
        layer = targets.layer_of(str(spec.target)) if spec.target is not None else None
        if layer is not None:
            layer_inputs[node], roles[node] = layer, targets.moved(str(spec.target), 0)
    calls = [n for n in nodes if n.op not in ("placeholder", "output")]
    if any(n.op != "call_function" for n in calls):
        raise StampError("the graph has nodes other than calls (get_attr)")
    layer_of = [_block_of(n, prefixes) for n in calls]
    positions = [[i for i, b in enumerate(layer_of) if b == layer] for layer in range(_TRACED_LAYERS)]
    if not all(positions):
        raise StampError("some traced layer has no nodes (by nn_module_stack)")
    start = positions[0][0]
    if [i for p in positions for i in p] != list(range(start, positions[-1][-1] + 1)):
        raise StampError("the traced layers' nodes are not back-to-back runs in the graph")
    blocks = [[calls[i] for i in p] for p in positions]
    by_role = {(layer, roles[node]): node for node, layer in layer_inputs.items()}
    next_input = {node: by_role[layer + 1, roles[node]] for node, layer in layer_inputs.items()
                  if (layer + 1, roles[node]) in by_role}
    output = nodes[-1]
    values = output.args[0]
    if not isinstance(values, (tuple, list)) or len(values) != len(small.graph_signature.output_specs):
        raise StampError("the program's outputs do not match its signature's")
    updates = {}
    for index, (spec, value) in enumerate(zip(small.graph_signature.output_specs, values)):
        if spec.kind == OutputKind.USER_OUTPUT:
            continue
        layer = targets.layer_of(str(spec.target)) if spec.kind == OutputKind.BUFFER_MUTATION else None
        if layer is None or value not in blocks[layer]:
            raise StampError(f"the program updates {spec.target}, which is not state held for a layer by that layer")
        updates[index] = layer
    return _Program(prefixes, placeholders, calls[:start], blocks, calls[positions[-1][-1] + 1:], output,
                    layer_inputs, next_input, updates)


def _stack_renamed(stack: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    pattern = re.compile(re.escape(old) + r"(?=\.|$)")
    return {pattern.sub(new, key): (pattern.sub(new, value[0]), *value[1:]) for key, value in stack.items()}


def _check_isomorphic(program: _Program) -> dict[fx.Node, fx.Node]:
    """The next-to-last traced layer's node -> the last one's, when the two are the same graph up to names;
    else :class:`StampError`.

    Also checks what the last layer reads: its own nodes, its own weights (the layer before's,
    renamed), values shared with the layer before (the same node), or values of the layer before
    that stand where that layer read the same value of the layer before it (the hidden states
    handed on).
    """
    *_, grand, first, second = program.blocks
    last = len(program.blocks) - 1
    if len(first) != len(second):
        raise StampError(f"the last two traced layers have {len(first)} and {len(second)} nodes")
    # the first layer may make more nodes (symbolic sizes the later layers reuse, as Mixtral's): then a value
    # handed on is matched by where it is read, not by its position in the layer
    same_length = len(grand) == len(first)
    handed_on: dict[fx.Node, fx.Node] = {}
    counterpart: dict[fx.Node, fx.Node] = {}
    position_in_grand = {node: i for i, node in enumerate(grand)}
    position_in_first = {node: i for i, node in enumerate(first)}
    in_second = set(second)

    def same(a: Any, b: Any, where: fx.Node) -> None:
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):
            if a in position_in_first:  # the layer's own value: the next layer's own counterpart
                ok = counterpart.get(a) is b
            elif b in position_in_first:  # handed on from the layer before, as the layer before had it from its own
                if same_length:
                    ok = position_in_grand.get(a) == position_in_first[b]
                else:  # one value of the layer before per value handed on
                    ok = a in position_in_grand and handed_on.setdefault(b, a) is a
                    ok = ok and len(set(handed_on.values())) == len(handed_on)
            elif program.layer_inputs.get(a) == last - 1:
                ok = program.next_input.get(a) is b
            else:
                ok = a is b and a not in program.layer_inputs and a not in in_second
            if not ok:
                raise StampError(f"{where.name} of {program.prefixes[last]} reads {b.name} where the layer before reads {a.name}")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
            for x, y in zip(a, b):
                same(x, y, where)
        elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for key in a:
                same(a[key], b[key], where)
        elif isinstance(a, fx.Node) or isinstance(b, fx.Node) or type(a) is not type(b) or repr(a) != repr(b):
            raise StampError(f"{where.name} of {program.prefixes[last]} has argument {b!r} where the layer before has {a!r}")

    for a, b in zip(first, second):
        if a.op != b.op or a.target != b.target:
            raise StampError(f"{a.name} ({a.target}) and {b.name} ({b.target}) of consecutive layers differ")
        same(a.args, b.args, b)
        same(a.kwargs, b.kwargs, b)
        if _value_text(a.meta.get("val")) != _value_text(b.meta.get("val")):
            raise StampError(f"{a.name} and {b.name} of consecutive layers have different shapes")
        renamed = _stack_renamed(a.meta.get("nn_module_stack") or {}, program.prefixes[last - 1], program.prefixes[last])
        if renamed != b.meta.get("nn_module_stack"):
            raise StampError(f"{a.name} and {b.name} of consecutive layers come from different modules")
        counterpart[a] = b
    earlier = {n for block in program.blocks[:-1] for n in block}
    for node, reads in [*((n, n.all_input_nodes) for n in program.after), (program.output, program.user_outputs())]:
        for used in reads:
            if used in earlier:
                raise StampError(f"{node.name} after the layers reads {used.name} of a layer before the last")
    return counterpart


def _stamp(small: ExportedProgram, model: torch.nn.Module, path: str, count: int) -> ExportedProgram:
    """The program of ``model`` (``count`` layers at ``path``) from ``small``, its twin's with ``_TRACED_LAYERS``."""
    from autotp.adapters.torch_internals import maybe_get_fake_mode

    signature = small.graph_signature
    targets = _Targets.of(model, path)
    program = _take_apart(small, targets)
    last = _TRACED_LAYERS - 1  # the layer copied; it reads from the layer before (``last - 1``)
    counterpart = _check_isomorphic(program)
    torch_fns = _Numbering()
    for a, b in counterpart.items():
        if (fn_a := _torch_fn_name(a)) is not None and (fn_b := _torch_fn_name(b)) is not None:
            torch_fns.learn(fn_a, fn_b)
    # a functionalized program (run_decompositions': ATEN dialect) was numbered by one retrace, layers alike, gaps
    # included: a stamped layer's names are the copied layer's moved on by the step; export's own numbering is not
    # that regular (see the module docstring), so there each kind is numbered on from its highest name
    retraced = None
    if any(verifier.dialect == "ATEN" for verifier in small.verifiers):
        retraced = _Numbering()
        for a, b in counterpart.items():
            retraced.learn(a.name, b.name)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}  # node of the traced graph -> its node in the new one
    stamped: dict[int, dict[fx.Node, fx.Node]] = {layer: {} for layer in range(last - 1, count)}
    """Per layer from ``last - 1`` on: the copied layer's node (or placeholder) -> that layer's."""
    specs: list[Any] = []
    spec_of = {spec.arg.name: spec for spec in signature.input_specs}
    layer_fqn = {i: f"{path}.{i}" for i in range(count)}
    copied = program.prefixes[last]

    highest: dict[str, int] = {}  # name base -> highest number given so far

    def add(name: str | None, op: str, target: Any, args: Any, kwargs: Any, like: fx.Node, meta: dict[str, Any]) -> fx.Node:
        """A node named ``name``, or (None) numbered on from the highest name of ``like``'s kind so far, as
        export numbers the nodes it makes."""
        if name is None:
            base = _split_name(like.name)[0]
            name = _numbered(base, highest[base] + 1) if base in highest else base
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=like.type)
        if node.name != name:
            raise StampError(f"the name {name} is taken twice")
        base, number = _split_name(name)
        highest[base] = max(highest.get(base, 0), number)
        node.meta = meta
        return node

    def torch_fn_shifted(node: fx.Node, meta: dict[str, Any], layers: int) -> None:
        if (fn := _torch_fn_name(node)) is not None:
            meta["torch_fn"] = (torch_fns.shifted(fn, layers), *meta["torch_fn"][1:])

    # placeholders, with each run of the copied layer's followed by layers last+1..count-1's
    for node, layer in _with_stamped_runs(program.placeholders, lambda n: program.layer_inputs.get(n) == last, count):
        spec = spec_of[node.name]
        if layer is None:
            env[node] = add(node.name, "placeholder", node.target, (), {}, node, dict(node.meta))
            specs.append(spec)
            continue
        target = targets.moved(str(spec.target), layer)
        name = _renamed_placeholder(node.name, str(spec.target), target)
        stamped[layer][node] = add(name, "placeholder", name, (), {}, node, dict(node.meta))
        specs.append(dataclasses.replace(spec, arg=TensorArgument(name=name), target=target))

    first, second = program.blocks[-2], program.blocks[-1]
    previous = {b: a for a, b in counterpart.items()}  # copied layer's node -> the layer before's
    for node in (*program.before, *(n for block in program.blocks for n in block)):
        env[node] = add(node.name, node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                        fx.map_arg(node.kwargs, env.__getitem__), node, dict(node.meta))
    stamped[last].update({b: env[b] for b in second})
    stamped[last - 1].update({b: env[previous[b]] for b in second})
    in_first = set(first)
    for layer in range(last + 1, count):
        this, before = stamped[layer], stamped[layer - 1]

        def source(used: fx.Node, this: dict[fx.Node, fx.Node] = this, before: dict[fx.Node, fx.Node] = before) -> fx.Node:
            if used in this:  # this layer's own node, or its weight (placeholders were stamped above)
                return this[used]
            if used in in_first:  # what the copied layer reads of the layer before: this layer's layer before's
                return before[counterpart[used]]
            return env[used]

        for node in second:
            meta = dict(node.meta)
            if "nn_module_stack" in meta:
                meta["nn_module_stack"] = _stack_renamed(meta["nn_module_stack"], copied, layer_fqn[layer])
            torch_fn_shifted(node, meta, layer - last)
            name = None if retraced is None else retraced.shifted(node.name, layer - last)
            this[node] = add(name if name != node.name else None, node.op, node.target,
                             fx.map_arg(node.args, source), fx.map_arg(node.kwargs, source), node, meta)
    final = stamped[count - 1]

    def after_layers(used: fx.Node) -> fx.Node:
        return final[used] if used in final else env[used]

    layer_bases = {_split_name(node.name)[0] for node in second}
    for node in program.after:
        # numbered on after the layers' names, as export does; a kind of op the layers do not use keeps its name
        name = None if _split_name(node.name)[0] in layer_bases else node.name
        meta = dict(node.meta)
        torch_fn_shifted(node, meta, count - 1 - last)
        env[node] = add(name, node.op, node.target, fx.map_arg(node.args, after_layers),
                        fx.map_arg(node.kwargs, after_layers), node, meta)
    values, outputs = _stamped_outputs(program, signature.output_specs, targets, count,
                                       lambda value, layer: stamped[layer][value] if layer > last else env[value],
                                       after_layers)
    add("output", "output", "output", (type(program.output.args[0])(values),), {}, program.output,
        dict(program.output.meta))
    graph.lint()

    state_dict, constants = _stamped_state(small, model, specs, targets, count, maybe_get_fake_mode)
    exported = ExportedProgram(  # makes the graph module (generating its code once)
        root=small.graph_module, graph=graph, graph_signature=ExportGraphSignature(specs, outputs),
        state_dict=state_dict, range_constraints=small.range_constraints,
        module_call_graph=_stamped_call_graph(small.module_call_graph, copied, layer_fqn, count),
        example_inputs=small.example_inputs, constants=constants, verifiers=list(small.verifiers))
    exported._guards_code = small._guards_code
    exported.graph_module.meta.update(small.graph_module.meta)
    return exported


def _with_stamped_runs(items: Iterable[_Item], of_copied: Callable[[_Item], bool],
                       count: int) -> Iterator[tuple[_Item, int | None]]:
    """``items`` (the twin's, in order) as ``(item, None)``, each run of the copied layer's items
    (``of_copied``) followed by the same run again as ``(item, layer)`` for each stamped layer: the order export
    gives a whole model's placeholders, outputs, state and module calls, layer by layer."""
    run: list[_Item] = []
    for item in items:
        if run and not of_copied(item):
            yield from ((copied, layer) for layer in range(_TRACED_LAYERS, count) for copied in run)
            run.clear()
        yield item, None
        if of_copied(item):
            run.append(item)
    yield from ((copied, layer) for layer in range(_TRACED_LAYERS, count) for copied in run)


def _stamped_outputs(program: _Program, specs: list[Any], targets: _Targets, count: int,
                     layer_value: Callable[[fx.Node, int], fx.Node], after_layers: Callable[[fx.Node], fx.Node],
                     ) -> tuple[list[Any], list[Any]]:
    """The stamped program's outputs and their specs: the traced program's, with the state updates of the
    copied layer followed by the stamped layers' (as export orders them: by the state's place among the
    inputs, layer by layer). ``layer_value(value, layer)``: the copied layer's ``value`` in ``layer``;
    ``after_layers``: a user output's node in the stamped graph."""
    last = _TRACED_LAYERS - 1
    values: list[Any] = []
    outputs: list[Any] = []
    traced = list(enumerate(zip(specs, program.output.args[0])))
    for (index, (spec, value)), stamped in _with_stamped_runs(traced, lambda item: program.updates.get(item[0]) == last,
                                                               count):
        if stamped is not None:  # the copied layer's update, made by a stamped layer
            node = layer_value(value, stamped)
            spec = dataclasses.replace(spec, target=targets.moved(str(spec.target), stamped))
        elif (layer := program.updates.get(index)) is not None:
            node = layer_value(value, layer)
        else:
            node = fx.map_arg(value, after_layers)
        values.append(node)
        outputs.append(dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=node.name))
                       if isinstance(node, fx.Node) and hasattr(spec.arg, "name") else spec)
    return values, outputs


def _stamped_state(small: ExportedProgram, model: torch.nn.Module, specs: Iterable[Any], targets: _Targets,
                   count: int, fake_mode_of: Callable[[Any], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """State dict and constants of the stamped program: the twin's, plus the stamped layers' from the model's
    own tensors, or (a model traced as fake tensors) fakes made like the copied layer's in its fake mode; each
    in the twin's order, the stamped layers' entries after the copied layer's (as export orders them)."""
    from autotp.adapters.torch_internals import FakeTensor, in_kernel_invocation_manager, is_traceable_wrapper_subclass

    parameters, buffers = torchao.as_exported(model)
    own = {**parameters, **buffers}
    values: dict[str, Any] = {}
    for spec in specs:
        fqn = str(spec.target)
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        known = small.state_dict.get(fqn, small.constants.get(fqn))
        if known is None:
            copied = targets.moved(fqn, _TRACED_LAYERS - 1)
            like = small.state_dict.get(copied, small.constants.get(copied))
            mode = fake_mode_of(like)
            if mode is None:
                known = own[fqn]
                if isinstance(like, torch.nn.Parameter) and not isinstance(known, torch.nn.Parameter):
                    known = torch.nn.Parameter(known, requires_grad=like.requires_grad)  # a quantized weight's part
            elif is_traceable_wrapper_subclass(like):
                raise StampError(f"{copied} is a tensor subclass traced as fake tensors: a fake of it is not made here")
            else:  # what the fake mode makes of empty_strided, without a dispatch per tensor
                with in_kernel_invocation_manager(mode):
                    empty = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
                known = FakeTensor(mode, empty, like.device)
                if isinstance(like, torch.nn.Parameter):
                    known = torch.nn.Parameter(known, requires_grad=like.requires_grad)
        values[fqn] = known
    state_dict = {fqn: values[fqn] for fqn in _stamped_order(small.state_dict, targets, count)}
    constants = {fqn: values.get(fqn, small.constants.get(fqn))
                 for fqn in _stamped_order(small.constants, targets, count)}
    return state_dict, constants


def _stamped_order(fqns: Iterable[str], targets: _Targets, count: int) -> list[str]:
    """``fqns`` (the twin's, in order) with each run of the copied layer's followed by the same for each stamped
    layer."""
    return [fqn if layer is None else targets.moved(fqn, layer)
            for fqn, layer in _with_stamped_runs(fqns, lambda f: targets.layer_of(f) == _TRACED_LAYERS - 1, count)]


def _stamped_call_graph(entries: list[Any], prefix: str, layer_fqn: dict[int, str], count: int) -> list[Any]:
    """The module call graph with the copied layer's entries (under ``prefix``) repeated for the stamped
    layers right after them."""
    result = []
    for entry, layer in _with_stamped_runs(entries, lambda e: within(e.fqn, prefix), count):
        if layer is None and within(entry.fqn, prefix) and entry.signature is not None:
            raise StampError(f"the call signature of {entry.fqn} is kept")
        result.append(entry if layer is None else dataclasses.replace(entry, fqn=layer_fqn[layer] + entry.fqn[len(prefix):]))
    return result
