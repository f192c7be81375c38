"""What autotp needs from inside ``torch``, in one place, with the releases it is tested on.

torch's private modules (``torch._subclasses``, ``torch._dynamo``, ``torch._inductor``, ``torch._export``...)
and its ``_underscore`` functions change between releases without notice. Every one autotp uses is read here
and nowhere else (``tests/test_torch_internals.py`` fails on a private torch name anywhere else in the
library), so an upgrade of torch touches this file only:

- fake tensors, for tracing without weights: :data:`FakeTensor`, :data:`FakeTensorMode`,
  :data:`maybe_get_fake_mode`, :data:`in_kernel_invocation_manager`; :data:`is_traceable_wrapper_subclass`
  (a tensor subclass made of plain tensors, as torchao's weights are) and
  :func:`unwrap_tensor_subclass_parameters`; :data:`TorchDispatchMode` (watching the ops a model runs);
- tracing: :data:`reparametrize_module` (a model called with other tensors), :data:`compiling_state_context`
  and :func:`shape_env` (the flags and the symbolic sizes ``torch.export`` sets up), :data:`OpOverload`
  (the type of an ATen op of a graph), :data:`LazyGraphModule` (a GraphModule that writes its code on first use);
- the program serializer of the trace cache and the shared trace (:func:`export_serde`,
  :func:`serde_unsupported`, :func:`symbolic_shapes`, :func:`int_oo`, :data:`max_operator_version`): autotp's
  own form of a program in ``torch._export.serde``'s schema (:mod:`autotp.capture.trace_cache`), which reads names
  of the serializer's classes that :data:`SERDE_NAMES` lists;
- Dynamo and Inductor: :func:`compile_fx`, :func:`mark_static_address`, :func:`dynamo_unsupported`,
  :func:`current_compile_id`, :data:`GlobalStateGuard`, :data:`current_function_mode_stack`;
- process groups: :func:`process_group_store` (c10d keeps a group's store but offers no accessor) and
  :func:`symmetric_memory`;
- the cost model's questions to torch's kernel choice: :data:`fused_sdp_choice`, :data:`select_conv_backend`.

A detail that is not found raises :class:`~autotp.base.errors.UnsupportedReleaseError` naming it and the
releases CI tests (the details torch itself imports are read when autotp is imported; the others, whose modules
take seconds to import, when first used). The few that autotp can do without (:data:`LazyGraphModule`,
:data:`GlobalStateGuard`, :data:`fused_sdp_choice`, :data:`select_conv_backend`) fall back, as each says.
A release outside :data:`RELEASES` is refused when a model is compiled (:func:`check_release`).

Not here, on purpose: ``torch.utils._pytree``, which autotp imports where it is used. Its ``tree_map``,
``tree_flatten``, ``tree_unflatten`` and ``TreeSpec`` are the de-facto public pytree API (``torch.export``'s
own documentation, ``torch.compile`` and most of the ecosystem use them; torch keeps them stable across
releases). Nor the op namespaces of ``torch.ops`` (``torch.ops._c10d_functional``, ``aten._softmax``): an
op is named by its schema, the vocabulary of the graphs autotp reads and writes, not a Python API.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.fx

from autotp.adapters.releases import ReleaseRange
from autotp.base.errors import UnsupportedReleaseError

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "GlobalStateGuard",
    "LazyGraphModule",
    "OpOverload",
    "PIP_SPEC",
    "RELEASES",
    "SERDE_NAMES",
    "ReleaseRange",
    "TorchDispatchMode",
    "check_release",
    "compile_fx",
    "compiling_state_context",
    "current_compile_id",
    "current_function_mode_stack",
    "dynamo_unsupported",
    "export_serde",
    "fused_sdp_choice",
    "in_kernel_invocation_manager",
    "installed_release",
    "int_oo",
    "is_traceable_wrapper_subclass",
    "mark_static_address",
    "max_operator_version",
    "maybe_get_fake_mode",
    "missing_details",
    "process_group_store",
    "reparametrize_module",
    "select_conv_backend",
    "serde_unsupported",
    "shape_env",
    "symbolic_shapes",
    "symmetric_memory",
    "unwrap_tensor_subclass_parameters",
]


RELEASES = ReleaseRange("2.13.0", "2.14", "torch")
"""torch releases autotp is tested on: CI's main suite runs the oldest (2.13.0, CPU build), its torch tier the
newest (2.14.1, ``.ci/torch_tier``)."""

PIP_SPEC = RELEASES.pip_spec()
""":data:`RELEASES` as pyproject.toml's dependency declares it."""


def installed_release() -> str:
    """The installed torch release (``torch.__version__``, e.g. ``"2.13.0+cpu"``)."""
    return str(torch.__version__)


def check_release(release: str | None = None) -> None:
    """Raise :class:`UnsupportedReleaseError` unless ``release`` (default: the installed torch) is in
    :data:`RELEASES`: autotp never traces through a torch whose internals it was not tested with."""
    release = installed_release() if release is None else release
    if not RELEASES.admits(release):
        raise UnsupportedReleaseError(
            f"torch {release} is not a release autotp supports: supported are {RELEASES} (both tested in CI). "
            f"Install one, e.g. pip install '{PIP_SPEC}'.")


def _missing(detail: str, error: BaseException) -> UnsupportedReleaseError:
    return UnsupportedReleaseError(
        f"torch {installed_release()} lacks {detail}, which autotp uses ({type(error).__name__}: {error}); "
        f"autotp is tested on torch {RELEASES}: install one, e.g. pip install '{PIP_SPEC}'.")


_LOADED: list[tuple[str, str | None]] = []
"""Every ``(module, name)`` read here (name None: the module itself), for :func:`missing_details`."""


def _load(module: str, name: str | None = None) -> Any:
    """``module.name`` (or the module), raising :class:`UnsupportedReleaseError` naming it when it is missing."""
    try:
        found: Any = importlib.import_module(module)
        return found if name is None else getattr(found, name)
    except (ImportError, AttributeError) as error:
        raise _missing(module if name is None else f"{module}.{name}", error) from error


def _required(module: str, name: str) -> Any:
    """``module.name``, read now (a module torch imports itself, so reading it costs nothing)."""
    _LOADED.append((module, name))
    return _load(module, name)


def _optional(module: str, name: str, fallback: Any) -> Any:
    """``module.name``, read now, or ``fallback`` when this torch lacks it."""
    _LOADED.append((module, name))
    try:
        return _load(module, name)
    except UnsupportedReleaseError:
        return fallback


def _lazy(module: str, name: str | None = None) -> Callable[[], Any]:
    """A function that reads ``module.name`` when first called (a module that takes seconds to import)."""
    _LOADED.append((module, name))
    cached: list[Any] = []

    def read() -> Any:
        if not cached:
            cached.append(_load(module, name))
        return cached[0]

    return read


# -- read when autotp is imported (torch has imported these modules already) -----------------------------------

FakeTensor: type = _required("torch._subclasses.fake_tensor", "FakeTensor")
"""A tensor with a shape, dtype and device and no data (``torch._subclasses.fake_tensor``)."""
FakeTensorMode: type = _required("torch._subclasses.fake_tensor", "FakeTensorMode")
"""The mode in which tensors made are fake (``torch.export`` traces under one)."""
maybe_get_fake_mode: Callable[[Any], Any] = _required("torch._subclasses.fake_tensor", "maybe_get_fake_mode")
"""The fake mode of a tensor, or None for a real one."""
in_kernel_invocation_manager: Callable[[Any], Any] = _required("torch._subclasses.fake_tensor",
                                                               "in_kernel_invocation_manager")
"""Within the block, a fake mode's tensors are used as their meta tensors (how the mode runs a kernel)."""
is_traceable_wrapper_subclass: Callable[[Any], bool] = _required("torch.utils._python_dispatch",
                                                                 "is_traceable_wrapper_subclass")
"""True for a tensor subclass made of plain tensors (``__tensor_flatten__``)."""
TorchDispatchMode: type = _required("torch.utils._python_dispatch", "TorchDispatchMode")
"""A mode that sees every ATen (and custom) op call below autograd (the expert load's measuring counts grouped GEMMs)."""
OpOverload: type = _required("torch._ops", "OpOverload")
"""The type of one overload of an op (``torch.ops.aten.add.Tensor``), a graph node's target."""
reparametrize_module: Callable[..., Any] = _required("torch.nn.utils.stateless", "_reparametrize_module")
"""Within the block, a module's parameters and buffers are the given tensors (``functional_call``'s own)."""
compiling_state_context: Callable[[], Any] = _required("torch._export.utils", "_compiling_state_context")
"""Within the block, ``torch.compiler.is_exporting()`` and the flags ``torch.export`` sets are set."""
current_function_mode_stack: Callable[[], list[Any]] = _required("torch.overrides", "_get_current_function_mode_stack")
"""The torch function modes active now (Dynamo's guards check that there are none)."""
max_operator_version: Callable[[], int] = _required("torch._C", "_get_max_operator_version")
"""The ATen operator version a serialized program records."""
LazyGraphModule: type = _optional("torch.fx._lazy_graph_module", "_LazyGraphModule", torch.fx.GraphModule)
"""A GraphModule that writes its Python code when first called or read, not at every ``recompile()``
(falls back to ``torch.fx.GraphModule``, which writes it at once)."""
GlobalStateGuard: type | None = _optional("torch._C._dynamo.guards", "GlobalStateGuard", None)
"""Dynamo's own check of the global state its guards read (grad mode, autocast, default dtype...); None
where missing (every call of a compiled graph then keeps Dynamo's guards)."""
fused_sdp_choice: Callable[..., Any] | None = _optional("torch", "_fused_sdp_choice", None)
"""The attention kernel torch picks for given query, key and value (an ``SDPBackend`` number); None where missing."""
select_conv_backend: Callable[..., Any] | None = _optional("torch._C", "_select_conv_backend", None)
"""The convolution kernel torch picks for given shapes (``ConvBackend``); None where missing."""

# -- read when first used (their modules take seconds to import) ---------------------------------------------

_compile_fx = _lazy("torch._inductor.compile_fx", "compile_fx")
_mark_static_address = _lazy("torch._dynamo", "mark_static_address")
_dynamo_unsupported = _lazy("torch._dynamo.exc", "Unsupported")
_compile_context = _lazy("torch._guards", "CompileContext")
_shape_env = _lazy("torch.fx.experimental.symbolic_shapes", "ShapeEnv")
_symbolic_shapes = _lazy("torch.fx.experimental.symbolic_shapes")
_int_oo = _lazy("torch.utils._sympy.numbers", "int_oo")
_unwrap_subclass_parameters = _lazy("torch._functorch._aot_autograd.subclass_parametrization",
                                    "unwrap_tensor_subclass_parameters")
_symmetric_memory = _lazy("torch.distributed._symmetric_memory")
_default_group = _lazy("torch.distributed.distributed_c10d", "_get_default_group")
_group_store = _lazy("torch.distributed.distributed_c10d", "_get_process_group_store")
_serde_schema = _lazy("torch._export.serde.schema")
_serde_serialize = _lazy("torch._export.serde.serialize")


def compile_fx(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``graph_module`` compiled by Inductor for inputs like ``example_inputs`` (what ``torch.compile`` runs)."""
    return _compile_fx()(graph_module, example_inputs)


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell Dynamo that ``tensor`` keeps its address across calls (a CUDA graph then reads it in place)."""
    _mark_static_address()(tensor)


def dynamo_unsupported() -> type[Exception]:
    """The exception Dynamo raises for code it cannot compile (``torch._dynamo.exc.Unsupported``)."""
    return _dynamo_unsupported()


def current_compile_id() -> Any:
    """Dynamo's id of the compile in progress (its ``frame_id`` names the code region), None outside one."""
    return _compile_context().current_compile_id()


def shape_env() -> Any:
    """A new ``ShapeEnv``: the symbolic sizes of one trace."""
    return _shape_env()()


def symbolic_shapes() -> ModuleType:
    """``torch.fx.experimental.symbolic_shapes`` (``ValueRanges`` of a serialized program's symbols)."""
    return _symbolic_shapes()


def int_oo() -> Any:
    """torch's symbolic infinity of integer ranges (an unbounded size)."""
    return _int_oo()


def unwrap_tensor_subclass_parameters(model: torch.nn.Module) -> Any:
    """Hold each tensor-subclass parameter of ``model`` as its parts, the parametrization ``torch.export``
    gives it (torch's own, in ``torch._functorch``)."""
    return _unwrap_subclass_parameters()(model)


def symmetric_memory() -> ModuleType:
    """``torch.distributed._symmetric_memory``: buffers every rank of a group maps into its address space."""
    return _symmetric_memory()


def process_group_store(group: Any | None) -> Any:
    """The key-value store of ``group`` (None: the default group), prefixed with the group's name by torch."""
    return _group_store()(group if group is not None else _default_group()())


SERDE_NAMES = {
    "serialize": ("GraphModuleSerializer", "GraphModuleDeserializer", "ExportedProgramDeserializer", "SCHEMA_VERSION",
                  "serialize_tensor_meta", "serialize_range_constraints", "deserialize_device", "load_verifier",
                  "_SERIALIZE_TO_TORCH_DTYPE", "_int_to_sympy_int", "log"),
    "schema": ("ExportedProgram", "TensorArgument", "SchemaVersion"),
}
"""The names of ``torch._export.serde.<module>`` that :mod:`autotp.capture.trace_cache` uses (with the serializer's
``serialize_tensor_output`` and ``graph_state``, the deserializer's ``_parse_sym_expr``, ``shape_env`` and
``fake_tensor_mode``, and the program's ``_guards_code``)."""


def serde_unsupported() -> str | None:
    """Why the installed torch cannot carry a program in :mod:`autotp.capture.trace_cache`'s form (the trace cache and
    the shared trace are then off), or None when it can: a release outside :data:`RELEASES`, or a missing name."""
    if not RELEASES.admits(installed_release()):
        return f"torch {installed_release()} is not one it is tested on ({RELEASES})"
    try:
        modules = {"schema": _serde_schema(), "serialize": _serde_serialize()}
    except UnsupportedReleaseError as error:
        return str(error)
    missing = [f"{module}.{name}" for module, names in SERDE_NAMES.items() for name in names
               if not hasattr(modules[module], name)]
    if not hasattr(modules["serialize"].GraphModuleDeserializer, "_parse_sym_expr"):
        missing.append("serialize.GraphModuleDeserializer._parse_sym_expr")
    return f"torch._export.serde lacks {', '.join(missing)}" if missing else None


def export_serde() -> tuple[ModuleType, ModuleType]:
    """``(schema, serialize)`` of ``torch._export.serde``, the program serializer; raises
    :class:`UnsupportedReleaseError` where :func:`serde_unsupported` says why not."""
    why = serde_unsupported()
    if why is not None:
        raise UnsupportedReleaseError(f"torch's program serializer cannot be used: {why}")
    return _serde_schema(), _serde_serialize()


def missing_details() -> list[str]:
    """Every private detail this module reads that the installed torch lacks (all of them read, the slow ones
    included): empty on a release it supports. What CI checks on each release it tests."""
    missing = []
    for module, name in _LOADED:
        try:
            _load(module, name)
        except UnsupportedReleaseError:
            missing.append(module if name is None else f"{module}.{name}")
    if (why := serde_unsupported()) is not None:
        missing.append(why)
    return missing
